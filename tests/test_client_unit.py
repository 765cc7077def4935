"""The client's bookkeeping without Ray or a deployment (a fake intake records what it is sent): what happens to a
request whose reader leaves at an awkward moment."""
import threading
import time
import types
import weakref

import pytest

import memra_pp.client as client_mod
from memra_pp.client import Client, _Track


class _Remote:
    def __init__(self, log, name, effect=None):
        self.log, self.name, self.effect = log, name, effect

    def remote(self, *a):
        self.log.append((self.name, *a))
        if self.effect is not None:
            self.effect(*a)
        return object()


def _client(monkeypatch, on_submit=None):
    """A Client over a fake replay deployment whose supervisor has recovered; the pump finds nothing to poll."""
    log = []
    intake = types.SimpleNamespace(submit=_Remote(log, "submit", on_submit), abort=_Remote(log, "abort"),
                                   poll=_Remote(log, "poll"), forget_client=_Remote(log, "forget"),
                                   _actor_id="the-intake")
    sup = types.SimpleNamespace(ready=threading.Event(), recovered=1, generation=1, failure=None)
    sup.ready.set()
    dep = types.SimpleNamespace(actors=[intake], supervisor=sup, tokenizer=None, _clients=weakref.WeakSet(),
                                placement=types.SimpleNamespace(recover="replay",
                                                                timeouts=types.SimpleNamespace(step_s=1.0,
                                                                                               ready_s=1.0)))
    monkeypatch.setattr(client_mod.ray, "get", lambda refs, timeout=None: [] if isinstance(refs, list) else [])
    monkeypatch.setattr(client_mod.ray, "is_initialized", lambda: True)   # (the fakes stand for a live cluster's)
    return Client(dep), log


def test_a_reader_gone_during_a_replay_has_its_replayed_request_aborted(monkeypatch):
    """A held request is replayed under a new rid; if its reader lets go between the new rid and the submit, the
    abort (for the new rid) reaches the intake first and finds nothing, so the replay must be aborted after its
    submit, or it would run to its budget with nobody reading it."""
    c = None

    def reader_leaves(req):        # the reader lets go while the replay is being submitted
        c._let_go(held)
    c, log = _client(monkeypatch, on_submit=reader_leaves)
    try:
        held = _Track("old", {"prompt": [5, 17], "max_new_tokens": 8}, lambda item: None, gen=0)
        c._held.append(held)
        c._replay_if_recovered()
        new = held.rid
        assert new != "old" and ("submit",) == log[0][:1] and log[0][1]["rid"] == new, log
        aborts = [a[1] for a in log if a[0] == "abort"]
        assert aborts.count(new) == 2, ("the replayed rid must be aborted again after its submit", log)
        assert not c._tracks and not c._held
    finally:
        c.close()


def test_a_replay_nobody_left_is_not_aborted(monkeypatch):
    """The other side of the same check: a replayed request whose reader is still there must not be aborted."""
    c, log = _client(monkeypatch)
    try:
        held = _Track("old", {"prompt": [5, 17], "max_new_tokens": 8}, lambda item: None, gen=0)
        c._held.append(held)
        c._replay_if_recovered()
        assert [a[0] for a in log if a[0] != "poll"] == ["submit"], log
        assert list(c._tracks) == [held.rid]
        c._tracks.clear()           # (the fake intake never finishes it)
    finally:
        c.close()


def test_an_agenerate_cancelled_during_its_submit_lets_the_request_go(monkeypatch):
    """A task cancelled while its submit still runs in the executor cannot stop that thread: the request the
    submit then makes must be let go (aborted) when it returns, once."""
    import asyncio
    c, log = _client(monkeypatch)
    gone = []
    monkeypatch.setattr(c, "_let_go", lambda tr: gone.append(tr.rid))
    release, started = threading.Event(), threading.Event()
    tr = _Track("r1", {}, lambda item: None)

    def submit():
        started.set()
        release.wait(5)
        return tr, None, [5]

    async def go():
        task = asyncio.ensure_future(c._submit_cancellable(asyncio.get_running_loop(), submit))
        while not started.is_set():
            await asyncio.sleep(0.001)
        task.cancel()                  # the submit is still running in its thread
        try:
            await task
            return False
        except asyncio.CancelledError:
            pass
        assert gone == [], "let go before the submit returned: there is no request yet"
        release.set()                  # the submit returns now, after the cancellation
        for _ in range(500):
            if gone:
                break
            await asyncio.sleep(0.01)
        return True
    try:
        assert asyncio.run(go()), "the task was not cancelled during its submit: the test ran nothing"
        assert gone == ["r1"], gone
    finally:
        release.set()
        c.close()


def test_a_cancel_that_arrives_with_a_piece_is_not_lost():
    """agenerate's wait for its next piece must raise a cancellation that comes in the same loop turn as the piece
    (asyncio.wait_for before Python 3.12 returns the piece and drops the cancellation: the cancelled agenerate
    then ran its request to the end), time out with RequestTimeout naming the request, and return a piece."""
    import asyncio

    import pytest

    from memra_pp.errors import RequestTimeout

    async def race(turns):
        box = client_mod._Box(asyncio.get_running_loop())
        task = asyncio.ensure_future(box.get(10.0, "r1"))
        for _ in range(turns):      # the piece and the cancel after one loop turn or two of the parked get
            await asyncio.sleep(0)
        box.put("piece")                    # the piece and the cancellation in one turn
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return "cancelled"
        return "lost"

    async def timeout_and_piece():
        box = client_mod._Box(asyncio.get_running_loop())
        with pytest.raises(RequestTimeout, match="request r2 produced nothing for 0.01 s"):
            await box.get(0.01, "r2")
        assert box.waiter is None                   # the timed-out get left no waiter behind
        asyncio.get_running_loop().call_later(0.01, box.put, "later")
        got = await box.get(5.0, "r3")
        box.put("queued")                           # one already here is taken at once, also with wait 0
        return got, await box.get(0, "r4"), box.waiter
    assert [asyncio.run(race(turns)) for turns in (1, 2)] == ["cancelled"] * 2
    assert asyncio.run(timeout_and_piece()) == ("later", "queued", None)


def test_a_request_during_a_recovery_longer_than_ready_s_is_refused(monkeypatch):
    """A request made while a recovery is in progress waits for it at most timeouts.ready_s; then it must fail with
    StageFailed naming that wait, its setting and the fix, having sent nothing to the intake and tracking nothing."""
    import time

    import pytest

    from memra_pp.errors import StageFailed
    c, log = _client(monkeypatch)
    try:
        c._sup.ready.clear()        # a recovery is in progress
        t0 = time.monotonic()
        with pytest.raises(StageFailed, match=r"the deployment did not recover within 1 s \(timeouts.ready_s\); "
                                              r"retry once dep.wait_ready\(\) returns"):
            c.generate([5, 17], max_new_tokens=2)
        assert time.monotonic() - t0 >= 1.0
        assert not [e for e in log if e[0] == "submit"] and not c._tracks and not c._held, log
    finally:
        c.close()


def test_a_lost_intake_takes_only_its_own_requests(monkeypatch):
    """The pump's failed poll names the intake it polled: only requests submitted to that actor are lost (held for
    replay here); one already submitted to its replacement (a connect()ed handle looked the new actor up) goes on.
    Without the actor, a supervisor's report takes every request."""
    from memra_pp.errors import StageFailed
    c, log = _client(monkeypatch)
    try:
        # (gen 1: the pump's replay, which takes held requests of a generation below `recovered`, leaves them)
        old, new = _Track("r-old", {}, lambda item: None, intake="dead", gen=1), \
            _Track("r-new", {}, lambda item: None, intake="the-intake", gen=1)
        with c._lock:
            c._tracks.update({"r-old": old, "r-new": new})
        c.on_stage_failed(StageFailed("stage 0 failed", stage=0), intake="dead")
        assert list(c._tracks) == ["r-new"] and c._held == [old]
        assert not [a for a in log if a[0] == "abort"], "a dead intake's requests need no abort"
        c.on_stage_failed(StageFailed("stage 1 failed", stage=1))
        assert not c._tracks and c._held == [old, new]
        # the intake may have survived, with r-new's submit still to reach it: it is aborted there (its replay
        # goes under a new rid), so it does not run beside its replay with nobody reading it
        assert [a[1] for a in log if a[0] == "abort"] == ["r-new"], log
    finally:
        c.close()


def test_a_request_lost_at_every_replay_is_failed_after_max_replays(monkeypatch):
    """With recover: replay, a request in flight at MAX_REPLAYS + 1 stage losses in a row with no token between
    them is failed with a StageFailed saying so, instead of being held again: a request that broke a stage each
    time it ran (a seed past 64 bits did) restarted the deployment 41 times, every other request waiting. One that
    got a token between two losses starts its count again."""
    from memra_pp.client_replay import MAX_REPLAYS
    from memra_pp.errors import StageFailed
    c, _ = _client(monkeypatch)
    got = []
    try:
        poison = _Track("p", {"prompt": [5], "max_new_tokens": 8}, got.append, gen=1)   # (gen 1: see above)
        moving = _Track("m", {"prompt": [6], "max_new_tokens": 8}, lambda item: None, gen=1)
        with c._lock:
            c._tracks.update({"p": poison, "m": moving})
        for i in range(MAX_REPLAYS + 1):
            c.on_stage_failed(StageFailed("stage 0 failed: its actor died", stage=0))
            if i < MAX_REPLAYS:
                assert c._held == [poison, moving] and not got, (i, got)
                with c._lock:            # (as a replay puts them back)
                    c._held.clear()
                    c._tracks.update({"p": poison, "m": moving})
                moving.tokens.append(7)  # the other request makes progress between the losses
        assert c._held == [moving] and moving.losses == 1 and poison.losses == MAX_REPLAYS + 1
        [(toks, lps, finish, err)] = got
        assert finish == "error" and err[0] == "StageFailed" and err[2] == 0, got
        assert err[1].startswith("stage 0 failed: its actor died; this request was in flight at 4 stage failures in "
                                 "a row without a token between them and is not replayed again"), err
        assert "p" not in c._tracks
    finally:
        c._held.clear()
        c.close()


def test_a_client_closed_while_a_submit_waits_for_a_recovery_sends_nothing(monkeypatch):
    """A request waiting in submit for a recovery, whose client is closed meanwhile, fails with StageFailed once
    the recovery is over and is never sent: it used to be registered and sent after the close, with the client's
    pump gone, so nobody read it (and with timeout=inf its caller waited forever)."""
    import time
    import pytest
    from memra_pp.errors import StageFailed
    c, log = _client(monkeypatch)
    c.dep.placement.timeouts.ready_s = 30.0
    c.dep.supervisor.ready.clear()              # a recovery is in progress
    out = {}

    def ask():
        try:
            c.generate([5, 17], max_new_tokens=2, timeout=float("inf"))
        except Exception as e:  # noqa: BLE001 - recorded for the asserts
            out["e"] = e
    th = threading.Thread(target=ask, daemon=True)
    th.start()
    time.sleep(0.5)                             # (in submit's wait: closed before it, the message would differ)
    c.close()
    c.dep.supervisor.ready.set()                # the recovery completes
    th.join(10)
    assert not th.is_alive() and isinstance(out.get("e"), StageFailed), out
    assert "this client was closed (close(), or its deployment's shutdown) while the request waited" in str(out["e"])
    assert not [e for e in log if e[0] == "submit"] and not c._tracks, log
    with pytest.raises(StageFailed, match="this client was closed"):
        c.generate([5, 17], max_new_tokens=2)


def test_the_replay_cap_counts_losses_the_intake_reports_too(monkeypatch):
    """A later stage's loss usually reaches the client first as the intake's error events (it fails every request
    when its send fails), not through the supervisor: those losses count toward MAX_REPLAYS as well, or a request
    that breaks stage 1 each time would still restart it forever."""
    from memra_pp.client_replay import MAX_REPLAYS
    c, _ = _client(monkeypatch)
    got = []
    try:
        t = _Track("p", {"prompt": [5], "max_new_tokens": 8}, got.append, gen=1)
        err = ("StageFailed", "stage 1 is lost: it did not take a microbatch", 1)
        for i in range(MAX_REPLAYS + 1):
            with c._lock:
                c._held.clear()
                c._tracks["p"] = t
            c._take([("p", [], [], "error", err)])
            assert (c._held == [t]) is (i < MAX_REPLAYS) and ("p" in c._tracks) is False, (i, c._held)
        [(_, _, finish, e)] = got
        assert finish == "error" and e[0] == "StageFailed" and e[2] == 1, got
        assert e[1].startswith("stage 1 is lost: it did not take a microbatch; this request was in flight at 4 "
                               "stage failures in a row"), e
    finally:
        c._held.clear()
        c.close()


def test_a_request_lost_after_the_recovery_failed_is_failed_not_held(monkeypatch):
    """Once the recovery has failed (a connect()ed handle's launch is gone), nothing will replay: a request whose
    loss arrives after that ends with the recovery's failure instead of waiting in the held list for ever."""
    from memra_pp.errors import StageFailed
    c, _ = _client(monkeypatch)
    got = []
    try:
        c.dep.supervisor.failure = StageFailed("the deployment 'x' was shut down (its placement group is gone)")
        t = _Track("late", {"prompt": [5], "max_new_tokens": 8}, got.append, gen=1)
        with c._lock:
            c._tracks["late"] = t
        c.on_stage_failed(StageFailed("stage 0 failed: it did not answer a poll", stage=0))
        assert not c._held and not c._tracks
        [(_, _, finish, e)] = got
        assert finish == "error" and e[1] == "the deployment 'x' was shut down (its placement group is gone)", got
    finally:
        c.close()



def test_a_submit_that_loses_the_intake_after_the_recovery_failed_is_not_held(monkeypatch):
    """A submit whose intake is lost is held for the replay; but where the recovery has already failed, it raises
    that failure instead of waiting in the held list (which on_recovery_failed had already emptied) for ever."""
    import pytest
    from memra_pp.errors import StageFailed
    failure = StageFailed("the deployment 'x' was shut down (its placement group is gone)")

    def lost(req):
        c.dep.supervisor.failure = failure       # the recovery gives up while the send is on its way
        raise StageFailed("submit: a stage actor died")
    c, _ = _client(monkeypatch, on_submit=lost)
    try:
        with pytest.raises(StageFailed, match=r"the deployment 'x' was shut down \(its placement group is gone\)"):
            c.generate([5, 17], max_new_tokens=2, timeout=float("inf"))
        assert not c._held and not c._tracks
    finally:
        c.close()


def test_a_submit_the_intake_does_not_take_in_time_is_a_timeout_and_aborted(monkeypatch):
    """A live intake that does not answer a submit within timeouts.step_s: the caller gets RequestTimeout (not
    "stage 0 failed", and no hold for a replay that no failure will bring), and the request is aborted at the intake,
    which drops it if it takes it later (runner.abort remembers it)."""
    import pytest
    import ray
    from memra_pp.errors import RequestTimeout
    c, log = _client(monkeypatch)
    real = client_mod.ray.get
    submits = []

    def get(refs, timeout=None):
        if submits and refs is submits[-1]:
            raise ray.exceptions.GetTimeoutError("slow")
        return real(refs, timeout=timeout)
    c._intake.submit = types.SimpleNamespace(remote=lambda req: (log.append(("submit", req)),
                                                                 submits.append(object()))[1] or submits[-1])
    monkeypatch.setattr(client_mod.ray, "get", get)
    monkeypatch.setattr(client_mod.ray, "is_initialized", lambda: True)
    try:
        with pytest.raises(RequestTimeout, match=r"submit: no answer within 1 s \(timeouts.step_s\); request \w+ "
                                                 r"was aborted"):
            c.generate([5, 17], max_new_tokens=2)
        rid = log[0][1]["rid"]
        assert ("abort", rid) in log and not c._tracks and not c._held
    finally:
        c.close()


def test_an_actor_ray_cannot_reach_for_now_is_not_a_lost_stage(monkeypatch):
    """rayutil.get names the stage whose actor died (a replaying client then waits for its recovery), but not one
    Ray cannot reach for now (ActorUnavailableError, a RayActorError too): no recovery would come for a live stage,
    and the request would wait for it until its timeout (for ever with timeout=inf)."""
    import pytest
    import ray
    from memra_pp.errors import StageFailed
    from memra_pp.rayutil import get
    for exc, stage, words in ((ray.exceptions.ActorDiedError(), 1, "a stage actor died"),
                              (ray.exceptions.ActorUnavailableError("gone for now", b"\0" * 16), None,
                               "a stage actor is unreachable for now")):
        def fail(refs, timeout=None, exc=exc):
            raise exc
        monkeypatch.setattr(ray, "get", fail)
        with pytest.raises(StageFailed, match=f"^stage 1 \\(vision tower\\): {words}") as e:
            get(object(), 1.0, "stage 1 (vision tower)", stage=1)
        assert e.value.stage == stage


def test_get_fetches_the_other_failures_of_a_list(ray_cluster):
    """rayutil.get of a list raises at the first failure (Ray does not wait for the rest); the others' errors,
    never fetched, were logged as "Unhandled error" when their refs went (every stage refusing one adapter gave
    one such log a stage). get now fetches them, within DRAIN_S, before it raises the first."""
    import time
    import ray
    from memra_pp.errors import InputError
    from memra_pp.rayutil import get

    @ray.remote(num_cpus=0)
    def boom(d):
        time.sleep(d)
        raise InputError(f"boom {d}")

    refs = [boom.remote(0.0), boom.remote(0.6)]
    ray.wait(refs[:1], timeout=30)
    with pytest.raises(InputError, match="^boom 0.0$"):
        get(refs, 30, "two calls")
    ready, _ = ray.wait(refs, num_returns=2, timeout=0)
    assert len(ready) == 2          # the slower one was waited for (and fetched) before the raise


def test_an_interrupted_submit_is_aborted_at_the_intake(monkeypatch):
    """Ctrl-C while the submit was on its way dropped the request here only: the intake may hold it, and it ran to
    its budget with nobody reading. It is now aborted there too (an abort that overtakes its submit drops it)."""
    c, log = _client(monkeypatch)

    def interrupted(tr, req, step_s):
        log.append(("sent", req["rid"]))
        raise KeyboardInterrupt
    monkeypatch.setattr(c, "_send", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            c.generate([5, 17], max_new_tokens=4)
        rid = next(a[1] for a in log if a[0] == "sent")
        assert ("abort", rid) in [a[:2] for a in log], log
        assert not c._tracks
    finally:
        c.close()


def test_a_group_poll_takes_a_client_made_while_it_waits():
    """The intake's poll is for a deployment handle's group of clients ("GROUP.CLIENT" ids): a client made while a
    poll is out (its first events posted then) is answered by that poll at once; a poll naming its clients waited
    its whole long poll for such a one. Other groups' events stay where they are; a forgotten client leaves its
    group."""
    from memra_pp.sched_types import Event
    from memra_pp.stages.events import Mailboxes
    m, out = Mailboxes(), {}
    t = threading.Thread(target=lambda: out.update(m.poll("g", 30.0)))
    t.start()
    time.sleep(0.1)
    m.post([Event("other.x", "r0", [5], [-1.0]), Event("g.new", "r1", [7], [-1.0])])
    t.join(10)
    assert not t.is_alive() and out == {"g.new": [("r1", [7], [-1.0], None, None)]}
    assert m.poll("g", 0) == {} and m.poll("other", 0) == {"other.x": [("r0", [5], [-1.0], None, None)]}
    m.forget("g.new")
    assert len(m) == 1 and "g" not in m._groups and m.polls == 3


def test_a_wait_left_by_a_closed_event_loop_leaves_no_unawaited_get():
    """An agenerate whose event loop closed under it (its task never resumed) is collected: the queue read its wait
    had started as a task never ran, and Python warned "coroutine 'Queue.get' was never awaited" at some later
    collection (seen in the suite's warnings). The wait parks on a plain future now: no task to leave behind."""
    import asyncio
    import gc
    import warnings

    def run():
        loop = asyncio.new_event_loop()
        task = loop.create_task(client_mod._Box(loop).get(10, "r1"))
        loop.call_soon(loop.stop)
        loop.run_forever()          # one round: the get parks and waits; nothing resumes it
        task._log_destroy_pending = False
        loop.close()

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        run()
        gc.collect()
    assert not [x for x in w if "never awaited" in str(x.message)], [str(x.message) for x in w]


def test_a_replay_the_new_intake_cannot_take_ends_typed_and_is_not_held_again(monkeypatch):
    """A held request whose replay the new, live intake answers with a task error (its submit raised something
    not ours, or it could not unpickle the request) ends with that refusal as an InputError: it was taken for the
    new intake's loss, and the request held again for a recovery no failure would bring."""
    import ray
    c, log = _client(monkeypatch)
    got = []

    def get(refs, timeout=None):
        raise ray.exceptions.RayTaskError("submit", "Traceback (most recent call last): ...",
                                          NotImplementedError("boom"))
    try:
        t = _Track("h", {"prompt": [5], "max_new_tokens": 8}, got.append, gen=0)     # (recovered is 1)
        with c._lock:
            c._held.append(t)
        monkeypatch.setattr(client_mod.ray, "get", get)
        c._replay_if_recovered()
        # (the abort after it: a request no longer tracked is let go at the intake, which never took this one)
        assert [e[0] for e in log] == ["submit", "abort"] and log[0][1]["step0"] == 0, log
        assert not c._held and t.rid not in c._tracks
        [(toks, lps, finish, err)] = got
        assert finish == "error" and err[0] == "InputError", got
        assert err[1] == ("the request was replayed after a stage failure and the new intake refused it: replay: the "
                          "actor refused the call: NotImplementedError: boom"), err
    finally:
        c.close()


def test_a_stream_closed_while_its_reader_holds_an_event_lets_the_request_go():
    """close() from another thread while the reader is inside next() with an event in hand cannot close the pieces
    ("generator already executing"); the reader's next call must then close them (their cleanup lets the request
    go on the intake), not only end: the request ran on to max_new_tokens, its slot and KV held."""
    from memra_pp.client import Stream
    inside, go, cleaned = threading.Event(), threading.Event(), []

    def pieces():
        try:
            yield None
            inside.set()
            go.wait(10)             # the reader's thread decodes this event's text
            yield "event"
            yield "more"
        finally:
            cleaned.append(True)    # (stream()'s pieces: the request is let go)
    it = pieces()
    next(it)
    s = Stream(it, lambda: None)
    got = []
    th = threading.Thread(target=lambda: got.extend(s))
    th.start()
    assert inside.wait(10)
    s.close()
    assert cleaned == []            # the close could not reach the generator
    go.set()
    th.join(10)
    assert got == ["event"] and cleaned == [True]
