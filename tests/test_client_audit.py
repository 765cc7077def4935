"""The client's concurrency contract as an AsyncLLMEngine / OpenAI-server user expects it: readers that go away
(an event loop closed under a pending agenerate) abort their request, clients made per request leave no thread,
and a poll queued behind other clients' polls at a live intake is not taken for a lost stage."""
import asyncio
import threading
import time
import types
import weakref

import pytest
import ray

import memra_pp
import memra_pp.client as client_mod
from conftest_models import hf_reference, tiny_checkpoint
from memra_pp.errors import StageFailed


@pytest.fixture(scope="module")
def dep(ray_cluster):
    _, path = tiny_checkpoint("dense", False)
    d = memra_pp.launch({"name": "client-audit", "model": {"path": str(path)}, "timeouts": {"heartbeat_s": 0.5},
                         "stages": [{"device": "cpu", "num_cpus": 0.1}] * 2,
                         "scheduler": {"max_batch": 4, "max_context": 64, "prefill_chunk": 16}})
    yield d
    d.shutdown()


def aborted(dep, above: int, wait: float = 5.0) -> int:
    end = time.monotonic() + wait
    while (n := dep.stats()["stages"][0]["aborted"]) <= above and time.monotonic() < end:
        time.sleep(0.02)
    return n


IDLE_WAIT = getattr(client_mod, "PUMP_IDLE_S", 1.0) + 3     # (the old client had no idle end)


def pumps() -> int:
    return sum(t.name == "memra-client-pump" for t in threading.enumerate())


def pumps_back_to(n: int, wait: float) -> int:
    end = time.monotonic() + wait
    while pumps() > n and time.monotonic() < end:
        time.sleep(0.05)
    return pumps()


def test_clients_made_per_request_and_shared_by_threads_and_loops_leave_no_thread(dep):
    """A client made per request (dep.client().generate) must not keep a pump thread once idle (each kept one,
    waking 50 times a second, until shutdown); a client whose pump ended must serve again; one client shared by 50
    threads and by two event loops in two threads at once must serve every request, and end with no pump."""
    ref = hf_reference("dense", False, (5, 17, 42), 4)[0]
    base = pumps()
    for _ in range(6):
        assert dep.client().generate([5, 17, 42], max_new_tokens=4, timeout=60).token_ids == ref
    assert pumps_back_to(base, IDLE_WAIT) == base, "idle clients kept their pump threads"
    c = dep.client()
    out, errors = [], []

    def one():
        try:
            out.append(c.generate([5, 17, 42], max_new_tokens=4, timeout=60).token_ids)
        except Exception as e:  # noqa: BLE001 - the test reports it
            errors.append(e)

    def loop_thread():
        async def go():
            return await asyncio.gather(*[c.agenerate([5, 17, 42], max_new_tokens=4, timeout=60) for _ in range(5)])
        try:
            out.extend(r.token_ids for r in asyncio.run(go()))
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    ts = [threading.Thread(target=one) for _ in range(50)] + [threading.Thread(target=loop_thread) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors and out == [ref] * 60, (errors, len(out))
    assert pumps() <= base + 1, "one client ran more than one pump"
    assert pumps_back_to(base, IDLE_WAIT) == base
    # served again after its pump ended: a stream and an agenerate start a new one
    assert [x for e in c.stream([5, 17, 42], max_new_tokens=4) for x in e.token_ids] == ref
    assert asyncio.run(c.agenerate([5, 17, 42], max_new_tokens=4)).token_ids == ref


def test_an_agenerate_whose_event_loop_closed_is_aborted(dep):
    """An agenerate task left pending when its event loop is closed (loop.stop() then close(), a test framework's
    loop torn down) never runs its cleanup: its request must be aborted at the intake once a piece finds nobody to
    take it (it ran to its budget, holding its batch row), and the client must go on serving."""
    c = dep.client()
    before = dep.stats()["stages"][0]["aborted"]
    loop = asyncio.new_event_loop()
    task = loop.create_task(c.agenerate([5, 17, 42], max_new_tokens=60, ignore_eos=True))

    async def first_tokens():
        while not task.done() and not any(t.tokens for t in list(c._tracks.values())):
            await asyncio.sleep(0.001)
    loop.run_until_complete(first_tokens())
    assert not task.done(), "the request ended before the loop closed: the test ran nothing"
    loop.close()
    assert aborted(dep, above=before) == before + 1, "the closed loop's request was not aborted at the intake"
    assert c.abandoned == 1 and not c._tracks
    assert c.generate([5, 17, 42], max_new_tokens=4).token_ids == hf_reference("dense", False, (5, 17, 42), 4)[0]
    task = None


@ray.remote(concurrency_groups={"control": 2, "polls": 2})
class _SlowIntake:
    """An intake whose polls answer late (queued behind other clients' long polls) or never (silent)."""

    def __init__(self):
        self.rids, self.poll_s, self.silent = [], 0.0, False

    def set(self, poll_s: float, silent: bool) -> None:
        self.poll_s, self.silent = poll_s, silent

    def submit(self, req: dict) -> None:
        self.rids.append((req["client"], req["rid"]))

    @ray.method(concurrency_group="polls")
    def poll(self, group: str, timeout: float) -> dict:
        time.sleep(self.poll_s if self.rids else timeout)
        rids, self.rids = self.rids, []
        out = {}
        for c, r in rids:
            out.setdefault(c, []).append((r, [7], [-1.0], "length", None))
        return out

    @ray.method(concurrency_group="control")
    def ping(self) -> int:
        if self.silent:
            time.sleep(30)
        return 0

    @ray.method(concurrency_group="control")
    def abort(self, rid: str) -> None:
        pass

    @ray.method(concurrency_group="control")
    def forget_client(self, client: str) -> None:
        pass


def test_a_poll_queued_past_step_s_at_a_live_intake_is_not_a_lost_stage(ray_cluster):
    """A poll answered after step_s by an intake that still answers a ping must be waited for, not taken for a lost
    stage 0 (200 clients waiting on a healthy 2-stage deployment with step_s 1 lost 28 requests to StageFailed: the
    intake serves a bounded number of long polls at once); an intake that misses the ping too still fails its
    requests with StageFailed(stage=0)."""
    intake = _SlowIntake.remote()
    dep = types.SimpleNamespace(actors=[intake], supervisor=None, tokenizer=None, _clients=weakref.WeakSet(),
                                refresh_actors=lambda: False,
                                placement=types.SimpleNamespace(recover="error", timeouts=types.SimpleNamespace(
                                    step_s=0.5, ready_s=1.0)))
    c = client_mod.Client(dep)
    try:
        ray.get(intake.set.remote(1.2, False))
        r = c.generate([5, 17], max_new_tokens=1, timeout=10)
        assert r.token_ids == [7] and c.slow_polls >= 1, (r, c.slow_polls)
        ray.get(intake.set.remote(1.2, True))
        with pytest.raises(StageFailed, match="stage 0 failed: it did not answer a poll: GetTimeoutError") as ei:
            c.generate([5, 17], max_new_tokens=1, timeout=10)
        assert ei.value.stage == 0
    finally:
        c.close()
        ray.kill(intake)


def test_a_client_let_go_without_close_is_collected_and_its_mailbox_forgotten(dep):
    """dep.client().generate(...) and nothing else: the deployment held every client until shutdown, and the
    intake kept each one's mailbox (a dict entry and a deque per client, for ever on a server that makes one per
    request). The deployment holds its clients weakly; a collected client's mailbox is forgotten at the next
    client()."""
    import gc
    import weakref
    boxes = lambda: dep.stats()["stages"][0]["mailboxes"]      # noqa: E731

    def settled() -> int:                       # (forget_client calls are sent and not waited for)
        n, end = boxes(), time.monotonic() + 5
        while time.monotonic() < end:
            time.sleep(0.2)
            if (m := boxes()) == n:
                return n
            n = m
        return n
    gc.collect()
    c = dep.client()                            # (forgets the earlier tests' collected clients)
    n0 = settled()
    assert len(c.generate([5, 6, 7], max_new_tokens=2, ignore_eos=True).token_ids) == 2
    assert boxes() == n0 + 1 and c in dep._clients
    gone = weakref.ref(c)
    del c
    end = time.monotonic() + IDLE_WAIT         # its pump (which holds it) ends once idle
    while gone() is not None and time.monotonic() < end:
        gc.collect()
        time.sleep(0.05)
    assert gone() is None, "the deployment (or something) still holds the client"
    dep.client().close()                       # the next client() forgets it (close() forgets its own)
    end = time.monotonic() + 5
    while boxes() > n0 and time.monotonic() < end:
        time.sleep(0.05)
    assert boxes() == n0


def test_one_poll_a_round_for_every_client_of_a_process(dep):
    """A client per request, 24 streaming at once: the intake answered a poll per client per round (its poll
    threads and GIL taken from its scheduler); one poller per deployment handle now polls once a round for all of
    them, and every request gets its tokens."""
    ref = hf_reference("dense", False, (5, 17, 42), 6)[0]
    before = dep.stats()["stages"][0]
    out, go = [], threading.Barrier(24)

    def one():
        c = dep.client()
        go.wait()
        out.append([t for e in c.stream([5, 17, 42], max_new_tokens=6, ignore_eos=True) for t in e.token_ids])
        c.close()
    ts = [threading.Thread(target=one) for _ in range(24)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    after = dep.stats()["stages"][0]
    polls, mbs = after["polls"] - before["polls"], after["microbatches"] - before["microbatches"]
    assert out == [ref] * 24, out
    # a round ends when tokens are posted (once per microbatch back) or after 0.2 s: at most one poll for each,
    # where a poll per client made up to 24 for each
    assert 0 < polls <= mbs + 10, f"{polls} polls for 24 clients over {mbs} microbatches"
