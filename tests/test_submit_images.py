"""An image request's submit returns once checked; its tower work runs on the intake's images thread (runner_images).
These tests drive a StageRunner's submit, abort and adapter_users in-process (no Ray), with the tower work held on
an event: what waits there is counted, can be aborted, and fails its request alone."""
import threading
import types

import pytest

from memra_pp.errors import InputError, StageFailed
from memra_pp.scheduler import Scheduler
from memra_pp.stages.runner import StageRunner
from memra_pp.supervisor import is_stage_lost

IMG, VIDEO = 300, 301


@pytest.fixture
def runner(monkeypatch):
    r = StageRunner()
    r.index = 0
    r.mc = types.SimpleNamespace(text=types.SimpleNamespace(vocab_size=512), eos_token_ids=(), vision=object(),
                                 image_token_id=IMG, video_token_id=VIDEO)
    r.scheduler = Scheduler(max_batch=4, microbatches=1, prefill_chunk=16, max_context=64)
    r.adapter_registry = {"a": [0, "/a", "loaded"]}
    gate, seen, fail = threading.Event(), [], {}

    def attach(req, ip):                     # the tower's work: held until the test lets it go
        seen.append(req.rid)
        assert gate.wait(10)
        if req.rid in fail:
            raise fail[req.rid]
        req.images = "rows"
    monkeypatch.setattr(r, "_plan_images", lambda req, images: "plan")
    monkeypatch.setattr(r, "_attach_images", attach)
    yield r, gate, seen, fail
    gate.set()
    r._stop_images()


def req(rid, images=True, adapter=None, prompt=(5, IMG, 7)):
    return {"rid": rid, "client": "c", "prompt": list(prompt), "max_new_tokens": 4, "adapter": adapter,
            "images": ["img"] if images else None}


def inbox(r, n, timeout=10):
    out = [r.inbox.get(timeout=timeout) for _ in range(n)]
    assert r.inbox.empty()
    return out


def test_an_image_request_waits_off_the_submit_counted_for_its_adapter(runner):
    r, gate, seen, _ = runner
    r.submit(req("x", adapter="a"))                  # returns with the tower's work still held
    assert r.inbox.empty() and list(r._pending) == ["x"]
    assert r.adapter_users(0) == 1 and r.adapter_users(1) == 0      # an unload of "a" now is refused
    assert r._submitting == {0: 0}
    gate.set()
    [(kind, got)] = inbox(r, 1)
    assert kind == "req" and got.rid == "x" and got.images == "rows" and got.adapter == 0
    with r._pending_lock:                            # (the thread queues it and forgets it under the lock)
        assert not r._pending and seen == ["x"]


def test_an_abort_reaches_a_request_waiting_for_its_images(runner):
    r, gate, seen, _ = runner
    r.submit(req("x"))
    r.submit(req("y"))
    r.abort("y")                                     # still waiting behind x: dropped, never queued
    r.abort("y")
    assert r._pending_aborted == {"y"} and r.aborted_early == 1         # counted once (the intake's "aborted")
    gate.set()
    assert [(k, g.rid) for k, g in inbox(r, 1)] == [("req", "x")]
    for _ in range(1000):                            # y leaves the images thread with nothing queued
        with r._pending_lock:
            if not r._pending:
                break
        threading.Event().wait(0.01)
    assert seen == ["x"] and not r._pending and not r._pending_aborted and r.inbox.empty()   # y's never ran


def test_an_abort_that_overtakes_its_submit_drops_it(runner):
    r, *_ = runner
    r.abort("z")                                     # Ray ran the abort first (another thread, another group)
    assert inbox(r, 1) == [("abort", "z")]
    r.submit(req("z", images=False, prompt=(5, 6)))
    r.submit(req("w", images=False, prompt=(5, 6)))
    assert [(k, g.rid) for k, g in inbox(r, 1)] == [("req", "w")]


def test_a_failed_tower_fails_its_request_alone(runner):
    r, gate, _, fail = runner
    fail["x"] = StageFailed("stage 1 (vision tower): a stage actor died (gone)", stage=1)
    fail["y"] = RuntimeError("boom")                 # anything else: typed, and the thread lives on
    fail["v"] = InputError("the images' 24 embedding rows are not all finite")
    for rid in "xyvw":
        r.submit(req(rid))
    gate.set()
    got = inbox(r, 4)
    assert [k for k, _ in got] == ["post", "post", "post", "req"] and got[3][1].rid == "w"
    (ex,), (ey,), (ev,) = (g for _, g in got[:3])
    assert (ex.rid, ex.finish, ex.error) == ("x", "error", ("StageFailed", "stage 1 (vision tower): a stage actor "
                                                            "died (gone)", 1))
    assert is_stage_lost(ex.error)                   # the tower's stage is lost: a replaying client holds it
    assert ey.error == ("StageFailed", "stage 0: images: RuntimeError: boom", None) and not is_stage_lost(ey.error)
    assert ev.error[0] == "InputError" and "not all finite" in ev.error[1]


def test_placeholders_without_images_are_refused_video_ones_too(runner):
    r, *_ = runner
    for p, n in (((5, IMG, 7), 1), ((5, VIDEO, VIDEO, 7), 2)):
        with pytest.raises(InputError, match=f"the prompt holds {n} image or video placeholder token"):
            r.submit(req("p", images=False, prompt=p))
    assert r.inbox.empty()


def test_an_unknown_adapter_leaves_no_count(runner):
    r, *_ = runner
    with pytest.raises(InputError, match=r"unknown adapter 'b'; loaded: \['a'\]"):
        r.submit(req("x", adapter="b"))
    with pytest.raises(InputError, match="outside the vocabulary"):
        r.submit(req("x", adapter="a", prompt=(5, 999)))
    r.scheduler.max_context = 2
    with pytest.raises(InputError, match="more than scheduler.max_context"):
        r.submit(req("x", adapter="a"))               # refused after its adapter was counted: counted back
    assert r._submitting == {0: 0} and r.adapter_users(0) == 0 and r.inbox.empty() and not r._pending


def test_a_halt_fails_the_requests_waiting_for_their_images(runner):
    """A stage failure halts the intake: requests waiting for their images end with the stage's failure like the
    scheduler's (their clients hold them for a replay or fail them), and their tower work, running or queued, lands
    nowhere. They used to reach the new loop after the restart and run a second time under their old rid."""
    r, gate, seen, _ = runner
    r.submit(req("x", adapter="a"))
    r.submit(req("y"))
    for _ in range(1000):                            # x's tower work is running, y's queued behind it
        if seen:
            break
        threading.Event().wait(0.01)
    evs = r._fail_pending("stage 1 is lost", 1)
    assert sorted((e.rid, e.error) for e in evs) == [("x", ("StageFailed", "stage 1 is lost", 1)),
                                                      ("y", ("StageFailed", "stage 1 is lost", 1))]
    assert r.adapter_users(0) == 0 and not r._pending
    gate.set()
    r.submit(req("z"))                               # the restarted intake's own requests still go through
    [(kind, got)] = inbox(r, 1)
    assert (kind, got.rid) == ("req", "z") and seen == ["x", "z"]       # y's tower work never ran


def test_a_request_between_the_inbox_and_the_scheduler_is_its_adapters_user():
    """The loop takes a request from the inbox, then adds it to the scheduler: adapter_users, read from another
    thread, missed it in between, so an unload could swap another adapter into its slot under it. The inbox keeps
    what it gave out as `taken` until the loop has handed it on, and the scheduler moves a request into waiting and
    on to active under its lock, which adapter_users holds to read both."""
    from memra_pp.model.sampling import SamplingParams
    from memra_pp.sched_types import Request
    r = StageRunner()
    r.scheduler = Scheduler(max_batch=4, microbatches=1, prefill_chunk=16, max_context=64)
    q = Request("x", "c", [5, 6, 7], 4, SamplingParams(), adapter=1)
    r.inbox.put(("req", q))
    assert r.adapter_users(1) == 1                  # in the inbox
    kind, got = r.inbox.get_nowait()                # the loop has it, not yet the scheduler
    assert got is q and r.adapter_users(1) == 1 and r.adapter_users(0) == 0
    r.scheduler.add(got)
    assert r.adapter_users(1) >= 1                  # (taken and waiting at once: counted twice is safe)
    r.inbox.taken = None                            # handed on (intake_loop._drain)
    assert r.adapter_users(1) == 1
    r.scheduler.next_microbatch()                   # admitted: active
    assert not r.scheduler.waiting and r.adapter_users(1) == 1
    # the reader holds the scheduler's lock: a move between waiting and active cannot fall between its two reads
    got = []
    with r.scheduler.mu:
        t = threading.Thread(target=lambda: got.append(r.adapter_users(1)))
        t.start()
        t.join(0.3)
        assert t.is_alive() and not got
    t.join(5)
    assert got == [1]


def test_an_abort_that_overtakes_its_submit_is_counted_once(runner):
    """Ray runs a client's abort and submit on different threads: an abort may reach the intake first. The
    submit then queues nothing, and stats' "aborted" counts the request once (the scheduler never had it)."""
    r, *_ = runner
    r.abort("z")
    r.abort("z")                                     # (close() and a cancel both ask)
    r.submit(req("z", images=False, prompt=(5, 6, 7)))
    assert r.aborted_early == 1
    assert inbox(r, 2) == [("abort", "z"), ("abort", "z")]     # the scheduler's abort finds nothing: counts 0
    assert r.scheduler.abort("z") == [] and r.scheduler.aborted == 0


def test_an_image_request_for_0_new_tokens_is_checked_but_runs_no_tower(runner):
    """max_new_tokens 0 ends at admission, never prefilled: its images are checked (planned) at submit, and it goes
    to the scheduler at once, without the tower's work."""
    r, gate, seen, _ = runner
    q = req("z")
    q["max_new_tokens"] = 0
    r.submit(q)
    [(kind, got)] = inbox(r, 1)
    assert kind == "req" and got.rid == "z" and got.max_new_tokens == 0
    assert seen == [] and not r._pending
