"""Around a recovery, in-process (no Ray): a connected handle's RemoteSupervisor (held by a weak reference, it follows
the launcher while a client lives; its launch check while a recovery runs), wait_ready's health ask and deadline,
the supervisor's loss report aborting the lost requests' rids, the unload refusals around a loss and a recovery,
and the halt's counters."""
import gc
import threading
import time
import types
import weakref

import pytest

import memra_pp.client as client_mod
from memra_pp.client import Client, _Track
from memra_pp.errors import StageFailed


# -- helpers ------------------------------------------------------------------------------------------------------
class _Remote:
    def __init__(self, log, name, actor):
        self.log, self.name, self.actor = log, name, actor

    def remote(self, *a):
        self.log.append((self.name, self.actor, *a))
        return object()


def _intake(log, name):
    return types.SimpleNamespace(submit=_Remote(log, "submit", name), abort=_Remote(log, "abort", name),
                                 poll=_Remote(log, "poll", name), forget_client=_Remote(log, "forget", name),
                                 _actor_id=name)


def _fake_dep(log, recover="replay"):
    sup = types.SimpleNamespace(ready=threading.Event(), recovered=1, generation=1, failure=None)
    sup.ready.set()
    return types.SimpleNamespace(actors=[_intake(log, "old-intake")], supervisor=sup, tokenizer=None,
                                 _clients=weakref.WeakSet(),
                                 placement=types.SimpleNamespace(recover=recover,
                                                                 timeouts=types.SimpleNamespace(step_s=1.0,
                                                                                                ready_s=1.0)))


def _patch_ray(monkeypatch):
    monkeypatch.setattr(client_mod.ray, "get", lambda refs, timeout=None: [] if isinstance(refs, list) else [])
    monkeypatch.setattr(client_mod.ray, "is_initialized", lambda: True)


# -- RemoteSupervisor: weak reference, idle launch check, wait_ready -------------------------------------------------
def test_a_connected_handle_let_go_while_its_client_lives_keeps_following_the_launcher(monkeypatch):
    """The thread holds its RemoteSupervisor by a weak reference. A caller that keeps only a client (`c =
    memra_pp.connect(name).client()`) must still have the launcher's recoveries followed: the client holds its
    handle, which holds the supervisor. Only once the client goes too does the thread end."""
    import ray
    import memra_pp.deployment as deployment
    from memra_pp.supervisor import RemoteSupervisor
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    _patch_ray(monkeypatch)
    monkeypatch.setattr(deployment, "_named_pg_id", lambda name: "pg")
    rec = {"v": None}
    monkeypatch.setattr(RemoteSupervisor, "_read", lambda self: rec["v"])
    log = []

    class Dep:
        _pg_id, _gone, connected = "pg", None, True
        placement = types.SimpleNamespace(name="n", recover="replay",
                                          timeouts=types.SimpleNamespace(heartbeat_s=0.5, step_s=1.0, ready_s=1.0))

        def refresh_actors(self):
            return True

    dep = Dep()
    dep.actors, dep._clients, dep.tokenizer = [_intake(log, "i")], weakref.WeakSet(), None
    dep.supervisor = RemoteSupervisor(dep)
    dep.supervisor.start()
    th = dep.supervisor.thread
    c = Client(dep)
    dep._clients.add(c)
    seen = []
    c.on_stage_failed = lambda e, intake=None: seen.append(("failed", e.stage))
    c.on_recovered = lambda: seen.append(("recovered",))
    dref = weakref.ref(dep)
    try:
        del dep
        gc.collect()
        time.sleep(0.5)
        assert th.is_alive() and dref() is not None, "the thread ended while a client of the handle lives"
        rec["v"] = {"generation": 1, "recovered": 1, "ready": True, "stage": 1, "reason": "stage 1 failed: x",
                    "failure": None}
        deadline = time.monotonic() + 3
        while len(seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert seen == [("failed", 1), ("recovered",)], seen
        del c
        gc.collect()
        th.join(2.0)
        assert not th.is_alive() and dref() is None, "the handle and its thread outlived its last client"
    finally:
        if dref() is not None:
            dref().supervisor.stop()


def _remote_sup(monkeypatch, read, pg):
    import ray
    import memra_pp.deployment as deployment
    from memra_pp.supervisor import RemoteSupervisor
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(deployment, "_named_pg_id", pg)
    monkeypatch.setattr(RemoteSupervisor, "_read", lambda self: read())
    refreshed = []
    dep = types.SimpleNamespace(_clients=weakref.WeakSet(), _pg_id="pg", _gone=None, _down=False,
                                refresh_actors=lambda: refreshed.append(1) or True,
                                placement=types.SimpleNamespace(name="n", recover="replay",
                                                                timeouts=types.SimpleNamespace(heartbeat_s=0.5)))
    return dep, RemoteSupervisor(dep), refreshed


def test_an_idle_connected_handle_waits_through_a_long_recovery_while_its_launch_lives(monkeypatch):
    """The idle launch check during a recovery must not take a live launch for gone: a recovery that runs for
    several seconds (its placement group still there) ends with `ready` set and no failure."""
    t0 = time.monotonic()
    busy = {"generation": 1, "recovered": 0, "ready": False, "stage": 1, "reason": "stage 1 failed: x",
            "failure": None}
    done = dict(busy, recovered=1, ready=True)
    dep, sup, refreshed = _remote_sup(monkeypatch, lambda: busy if time.monotonic() - t0 < 2.5 else done,
                                      lambda name: "pg")
    assert not sup.ready.is_set()
    sup.start()
    try:
        time.sleep(1.5)
        assert sup.failure is None and not sup.ready.is_set()
        assert sup.ready.wait(3.0) and sup.failure is None and sup.recovered == 1 and refreshed
    finally:
        sup.stop()


def test_an_idle_connected_handle_rides_out_a_passing_gcs_error_during_a_recovery(monkeypatch):
    """A placement-group lookup that raises for a moment (less than UNREACHABLE_S) is asked again, not a failure."""
    t0 = time.monotonic()
    busy = {"generation": 1, "recovered": 0, "ready": False, "stage": 1, "reason": "stage 1 failed: x",
            "failure": None}
    done = dict(busy, recovered=1, ready=True)

    def pg(name):
        if time.monotonic() - t0 < 2.0:
            raise ConnectionError("GCS busy")
        return "pg"
    dep, sup, _ = _remote_sup(monkeypatch, lambda: busy if time.monotonic() - t0 < 3.0 else done, pg)
    sup.start()
    try:
        assert sup.ready.wait(5.0) and sup.failure is None, sup.failure
    finally:
        sup.stop()


def test_the_launchers_wait_ready_waits_out_a_dead_loop_until_the_recovery(monkeypatch):
    """await_ready (Supervisor.wait_ready's loop): a stage whose loop ended answers health with alive False; the
    heartbeat then clears `ready`, the restart sets it, and the ask says True: wait_ready returns in time (the
    new deadline raise must only come at the deadline)."""
    from memra_pp.supervisor import await_ready
    sup = types.SimpleNamespace(ready=threading.Event(), failure=None, stopping=threading.Event())
    sup.ready.set()
    state = {"alive": False, "asks": 0}

    def recovery():
        time.sleep(0.3)
        sup.ready.clear()
        time.sleep(0.5)
        state["alive"] = True
        sup.ready.set()
    threading.Thread(target=recovery, daemon=True).start()

    def ask(left):
        state["asks"] += 1
        return state["alive"]
    t0 = time.monotonic()
    await_ready(sup, 3.0, lambda: None, ask, 0.05)
    assert 0.7 < time.monotonic() - t0 < 2.0 and state["asks"] >= 2


def test_await_ready_with_no_time_left_still_returns_for_a_serving_deployment():
    """wait_ready(0) on a deployment that serves returns (the ask gets its 0.1 s floor)."""
    from memra_pp.supervisor import await_ready
    sup = types.SimpleNamespace(ready=threading.Event(), failure=None, stopping=threading.Event())
    sup.ready.set()
    await_ready(sup, 0.0, lambda: None, lambda left: True, 0.05)
    with pytest.raises(StageFailed, match="a stage's loop is not running"):
        await_ready(sup, 0.0, lambda: None, lambda left: False, 0.05)


# -- the supervisor's loss report aborts the lost requests' old rids -----------------------------------------------
def test_a_loss_report_during_a_replays_submit_aborts_no_live_request(monkeypatch):
    """A supervisor's report (intake=None) that comes while a replay is being submitted (its new rid tracked, its
    submit on its way): the replayed request is held again and its new rid aborted; the rid of the next replay is
    never aborted, and no tracked request's rid is ever among the aborts."""
    _patch_ray(monkeypatch)
    log = []
    dep = _fake_dep(log)
    c = Client(dep)
    fired = []

    def submit_effect(*a):
        if not fired:           # the second loss arrives while the first replay's submit is on its way
            fired.append(1)
            c.on_stage_failed(StageFailed("stage 1 failed: again", stage=1))
    dep.actors[0].submit = types.SimpleNamespace(remote=lambda req: (log.append(("submit", "old-intake", req)),
                                                                     submit_effect(req), object())[-1])
    try:
        t = _Track("r0", {"prompt": [5, 17], "max_new_tokens": 8}, lambda item: None, gen=0)
        c._held.append(t)
        c._replay_if_recovered()
        first = [e[2]["rid"] for e in log if e[0] == "submit"][0]
        aborts = [e[2] for e in log if e[0] == "abort"]
        # (aborted twice: by the report, and by the replay's own "reader gone" check, which finds it untracked; the
        # intake counts an abort once)
        assert set(aborts) == {first} and c._held == [t] and not c._tracks, (log, c._held, c._tracks)
        dep.actors[0] = _intake(log, "new-intake")
        c.on_recovered()
        second = t.rid
        assert second not in (first, "r0") and list(c._tracks) == [second]
        assert second not in [e[2] for e in log if e[0] == "abort"], log
        c._tracks.clear()
    finally:
        c.close()


def test_a_late_loss_report_on_a_connected_handle_aborts_old_rids_at_the_new_intake_only(monkeypatch):
    """A connect()ed handle reads the launcher's record late: the new intake is already looked up when the report
    comes. The old rids are aborted there (unknown to it, or a submit to it that the report holds for a replay);
    the replays that follow go under new rids, never aborted; with recover: error the requests fail, and are
    aborted."""
    _patch_ray(monkeypatch)
    for recover in ("replay", "error"):
        log = []
        dep = _fake_dep(log, recover)
        c = Client(dep)
        got = []
        try:
            tracks = [_Track(f"r{i}", {"prompt": [5, 17], "max_new_tokens": 8}, got.append, gen=1,
                             intake="old-intake") for i in range(3)]
            c._tracks.update({t.rid: t for t in tracks})
            dep.actors[0] = _intake(log, "new-intake")
            c.on_stage_failed(StageFailed("stage 0 failed: x", stage=0))
            assert sorted(e[2] for e in log if e[0] == "abort") == ["r0", "r1", "r2"]
            assert {e[1] for e in log if e[0] == "abort"} == {"new-intake"}
            if recover == "replay":
                assert len(c._held) == 3 and not got
                dep.supervisor.recovered = 2
                c.on_recovered()
                new = set(c._tracks)
                assert len(new) == 3 and not new & {"r0", "r1", "r2"}
                assert not new & {e[2] for e in log if e[0] == "abort"}
                c._tracks.clear()
            else:
                assert not c._held and not c._tracks and len(got) == 3
        finally:
            c.close()


def test_a_loss_report_after_ray_shutdown_sends_no_abort(monkeypatch):
    """The poller's report after ray.shutdown() (intake=None) must not call Ray (a call starts a new cluster)."""
    _patch_ray(monkeypatch)
    log = []
    dep = _fake_dep(log)
    c = Client(dep)
    try:
        c._tracks["r0"] = _Track("r0", {"prompt": [5], "max_new_tokens": 2}, lambda item: None, gen=1)
        monkeypatch.setattr(client_mod.ray, "is_initialized", lambda: False)
        c.on_stage_failed(StageFailed("this process is no longer connected"))
        assert not [e for e in log if e[0] == "abort"], log
    finally:
        c._held.clear()
        c.close()


# -- unload refusals -------------------------------------------------------------------------------------------
def _runner(recover="replay"):
    from memra_pp.scheduler import Scheduler
    from memra_pp.stages.runner import Inbox, StageRunner
    r = StageRunner.__new__(StageRunner)
    r.placement = types.SimpleNamespace(adapters=types.SimpleNamespace(max_loras=2), recover=recover)
    r.adapter_registry, r._registry_lock, r._registry_kv, r._registry_seq = {}, threading.Condition(), None, 0
    r.scheduler = Scheduler(max_batch=2, microbatches=1, prefill_chunk=16, max_context=64)
    r._submitting, r._pending, r._pending_lock, r.inbox = {}, {}, threading.Lock(), Inbox()
    r.reserve_adapter("a", "/a")
    r.commit_adapter("a", 0)
    return r


def test_an_unload_with_no_loss_and_no_recent_recovery_is_not_refused_or_delayed():
    """The paths that must succeed: no loss, no recovery yet (resumed_at None), and a recovery long ago."""
    r = _runner()
    t0 = time.monotonic()
    assert r.begin_unload("a") == 0 and r.adapter_users(0) == 0 and time.monotonic() - t0 < 0.2
    r.abort_unload("a")
    r.resumed_at = time.monotonic() - 10.0
    t0 = time.monotonic()
    assert r.begin_unload("a") == 0 and r.adapter_users(0) == 0 and time.monotonic() - t0 < 0.2


def test_an_unload_is_refused_for_a_stage_lost_and_recovered_between_withdrawing_the_name_and_counting(monkeypatch):
    """RELIABILITY.md: "A stage lost ... after the name was withdrawn and before the users are counted, refuses the
    unload the same way". A connect()ed handle holds no supervisor lock: the launcher's whole recovery (halt:
    fail_lost, then start(recovered=True), which clears `lost`) can fall between its begin_unload and its
    adapter_users. The requests that recovery cut are held by their clients, to be replayed within
    REPLAY_GRACE_S; adapter_users, finding `lost` cleared, counts 0 users and the unload goes on: the replays are
    then refused ("unknown adapter"). (Narrow: the recovery must fit between two Ray calls of that handle.)"""
    from memra_pp.stages.runner import StageRunner
    r = _runner()
    slot = r.begin_unload("a")
    # the launcher's recovery, all of it, now: the halt marks the loss, the restart's start clears it
    r.lost = (1, "stage 1 is lost: the ring from it broke")
    r.lost, r.resumed_at = None, time.monotonic()
    with pytest.raises(StageFailed, match=r"^adapter in slot 0 cannot be unloaded now: the deployment recovered "
                                          r"from a stage loss while it was being unloaded"):
        r.adapter_users(slot)
    r.resumed_at -= StageRunner.REPLAY_GRACE_S     # the grace over: the replays are in, and counted
    assert r.adapter_users(slot) == 0


# -- the halt's fresh scheduler keeps the counters -------------------------------------------------------------
def test_counters_carried_over_two_halts_are_not_doubled():
    """A restart that is retried halts the survivors again: each halt carries the counters once (no doubling)."""
    from memra_pp.scheduler import Scheduler

    def mk():
        return Scheduler(max_batch=2, microbatches=1, prefill_chunk=16, max_context=64)
    s = mk()
    for i, k in enumerate(Scheduler.COUNTS):
        setattr(s, k, i + 1)
    s2 = mk().carry_counts(s)
    s3 = mk().carry_counts(s2)
    assert {k: getattr(s3, k) for k in Scheduler.COUNTS} == {k: i + 1 for i, k in enumerate(Scheduler.COUNTS)}
