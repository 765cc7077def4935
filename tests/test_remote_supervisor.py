"""RemoteSupervisor, a connect()ed handle's view of the launcher's supervisor, in-process (no Ray): an idle
handle learns its launch was shut down mid-recovery, wait_ready asks health as the launcher's does, and a handle let go
does not keep its thread."""
import time
import types

import pytest

import threads

from memra_pp.errors import StageFailed


def _remote_sup(monkeypatch, states):
    """A RemoteSupervisor over a fake connected handle: `states` are what successive reads of the launcher's record
    give (the last repeats); the launch's placement group is gone (_named_pg_id: None)."""
    import ray
    import memra_pp.deployment as deployment
    from memra_pp.supervisor import RemoteSupervisor
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(deployment, "_named_pg_id", lambda name: None)
    dep = types.SimpleNamespace(_clients=set(), _pg_id="pg-of-this-launch", _gone=None, _down=False,
                                placement=types.SimpleNamespace(name="gone", recover="replay",
                                                                timeouts=types.SimpleNamespace(heartbeat_s=0.5)))

    def require_up(what):
        if dep._gone:
            raise StageFailed(f"{what}: {dep._gone}")

    def refresh():
        dep._gone = "the deployment 'gone' this handle connected to was shut down"
        return False
    dep._require_up, dep.refresh_actors = require_up, refresh
    seq = list(states)
    monkeypatch.setattr(RemoteSupervisor, "_read", lambda self: seq.pop(0) if len(seq) > 1 else seq[0])
    sup = RemoteSupervisor(dep)
    return dep, sup


def test_an_idle_connected_handle_learns_its_launch_was_shut_down_during_a_recovery(monkeypatch):
    """The launcher starts a recovery (the record says not ready) and is then shut down: its supervisor's stop
    (_end_stopped) publishes nothing and the teardown deletes the record. A connected handle holding no request
    never checks for its launch (_launch_gone runs only with requests held), so `ready` stays cleared for ever:
    wait_ready(t) waits all of t and says "did not recover", a submit waits timeouts.ready_s. RELIABILITY.md: such a
    handle's later calls fail with StageFailed ("... was shut down") within about a second."""
    rec = {"generation": 1, "recovered": 0, "ready": False, "stage": 1, "reason": "stage 1 failed: x",
           "failure": None}
    dep, sup = _remote_sup(monkeypatch, [rec, rec, None])
    assert not sup.ready.is_set()
    sup.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(StageFailed) as e:
            sup.wait_ready(4.0)
        took = time.monotonic() - t0
        assert "shut down" in str(e.value) and took < 2.5, (took, str(e.value))
    finally:
        sup.stop()


class _FakeActor:
    def __init__(self, i, alive=True):
        self.i, self.alive, self._actor_id = i, alive, f"a{i}"
        self.ping = types.SimpleNamespace(remote=lambda: ("ping", self))
        self.health = types.SimpleNamespace(remote=lambda: ("health", self))


def _answer(refs, timeout, what, *a, **k):
    out = []
    for kind, act in refs:
        out.append(act.i if kind == "ping" else {"index": act.i, "alive": act.alive, "error": "ProtocolError: x",
                                                 "lost_link": False})
    return out


def test_a_connected_wait_ready_waits_while_a_stage_loop_is_dead_as_the_launchers_does(monkeypatch):
    """Deployment.wait_ready: "Return once every stage serves". A stage whose loop ended (a ProtocolError, a link
    closed under it) answers pings but serves nothing until the launcher's next heartbeat restarts it. The launching
    handle's Supervisor.wait_ready asks health() and waits while a loop is dead; a connected handle's
    RemoteSupervisor asks ping() only, and returns at once (its docstring: "as Supervisor.wait_ready does")."""
    import ray
    import memra_pp.deployment as deployment
    import memra_pp.supervisor as supmod
    from memra_pp.supervisor import RemoteSupervisor
    monkeypatch.setattr(supmod, "_get", _answer)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(deployment, "_named_pg_id", lambda name: "pg")
    monkeypatch.setattr(RemoteSupervisor, "_read", lambda self: None)     # the launcher has not seen it yet
    actors = [_FakeActor(0), _FakeActor(1, alive=False)]
    cdep = types.SimpleNamespace(actors=actors, _clients=set(), _pg_id="pg", _gone=None,
                                 placement=types.SimpleNamespace(name="n", recover="error",
                                                                 timeouts=types.SimpleNamespace(heartbeat_s=0.2)),
                                 _require_up=lambda what: None, refresh_actors=lambda: True)
    rs = RemoteSupervisor(cdep)
    th, out = threads.start(rs.wait_ready, 0.6)
    th.join(5)
    assert isinstance(out.get("r"), StageFailed), out
    assert str(out["r"]) == "the deployment did not recover within 0.6 s: a stage's loop is not running"


def test_a_connected_handle_let_go_does_not_keep_its_remote_supervisor_thread(monkeypatch):
    """Every connect()ed handle of a detached deployment now starts a RemoteSupervisor (whatever `recover`), a
    thread that reads Ray's KV every 0.2 s and holds the handle. A connected handle has no way to be let go but
    shutdown(), which stops the whole deployment: a process that connects per job (a web worker, a script run in a
    loop) kept one more thread and handle for each, for ever. (The client poller ends when idle for the same
    reason: client.PUMP_IDLE_S.)"""
    import gc
    import weakref
    import ray
    import memra_pp.deployment as deployment
    from memra_pp.supervisor import RemoteSupervisor
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(deployment, "_named_pg_id", lambda name: "pg")
    monkeypatch.setattr(RemoteSupervisor, "_read", lambda self: None)

    class Dep:
        _clients = ()
        _pg_id, _gone = "pg", None
        placement = types.SimpleNamespace(name="n", recover="error",
                                          timeouts=types.SimpleNamespace(heartbeat_s=0.5))

    dep = Dep()
    dep.supervisor = RemoteSupervisor(dep)          # what Deployment.connect does
    dep.supervisor.start()
    th, ref = dep.supervisor.thread, weakref.ref(dep)
    try:
        del dep
        gc.collect()
        th.join(2.0)
        assert ref() is None and not th.is_alive(), "the let-go handle and its supervisor thread live on"
    finally:
        if ref() is not None:
            ref().supervisor.stop()
