"""Recovery paths driven without Ray (fake actors, Ray's calls patched): a retried restart, a replay a live intake
does not take in time, a connected handle whose lookup of the new stages fails once. Each was found by a review and
failed before its fix."""
import itertools
import threading
import time
import types
import weakref

import ray

import memra_pp.client as client_mod
import memra_pp.deployment as deployment
import memra_pp.supervisor as S
from memra_pp.client import Client, _Track
from memra_pp.errors import StageFailed


class _Ref:
    def __init__(self, v=None, exc=None):
        self.v, self.exc = v, exc


def _res(r):
    if r.exc is not None:
        raise r.exc
    return r.v


def test_a_stage_a_failed_attempt_replaced_gets_the_adapters_on_the_retry(monkeypatch):
    """Attempt 0 of a restart replaces stage 1 (lost) and stage 2 (its halt failed), then fails at the wiring.
    Attempt 1 took the new stage 2 for a survivor (its halt works): relinked only, it never loaded the adapter the
    intake still publishes, and served its requests without the adapter's LoRA, with no error. Every stage that
    is not the actor the last completed restart left is restarted as a failed one, adapters included."""
    calls, ids = [], itertools.count()
    monkeypatch.setattr(ray, "get", lambda refs, timeout=None: [_res(r) for r in refs] if isinstance(refs, list)
                        else _res(refs))
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns=1, timeout=None: (list(refs), []))
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(S, "kill_actor", lambda a, p: (calls.append(("kill", a.name)), False)[1])
    monkeypatch.setattr(S, "shm_names", lambda info: [])

    class Actor:
        def __init__(self, name, halt_ok=True):
            self.name, self.halt_ok, self._actor_id = name, halt_ok, name

        def __getattr__(self, m):
            def remote(*a, **kw):
                calls.append((m, self.name))
                if m == "halt" and not self.halt_ok:
                    return _Ref(exc=ray.exceptions.RayActorError())
                return _Ref({"proc": None} if m in ("setup", "relink") else {"A": (0, "/a")} if m == "adapters"
                            else {"pid": self.name} if m == "proc" else None)
            return types.SimpleNamespace(remote=remote)

    wires = []

    def wire(actors, infos, t):
        wires.append(1)
        if len(wires) == 1:
            raise StageFailed("stage wiring: no answer within 300 s")
    dep = types.SimpleNamespace(
        actors=[Actor("intake"), Actor("s1-dead", False), Actor("s2-old", False)], procs={}, slot_names=[[]] * 3,
        run_dir=str(__import__("tempfile").mkdtemp()), transports=["shm"] * 3, switches={}, detached=False,
        placement=types.SimpleNamespace(timeouts=types.SimpleNamespace(ready_s=1.0, step_s=1.0), to_dict=dict),
        plan=types.SimpleNamespace(to_dict=dict), wire=wire, _rebudget=lambda t: None, _adapter_paths={},
        _actors_lock=threading.Lock(), kv_key=lambda k: None)
    dep.new_actor = lambda i: Actor(f"s{i}-new{next(ids)}")
    sup = S.Supervisor(dep)
    err = StageFailed("stage 1 failed: its actor died", stage=1)
    try:
        sup._restart(1, err, 0)
        raise AssertionError("attempt 0 must fail at the wiring")
    except StageFailed:
        pass
    calls.clear()
    sup._restart(1, err, 1)
    names = [a.name for a in dep.actors]
    assert names[0] == "intake" and names[1] != "s1-dead" and names[2] != "s2-old", names
    assert sorted(n for m, n in calls if m == "load_adapter") == sorted(names[1:]), calls   # both new stages
    assert ("kill", "s2-new1") in calls, calls      # attempt 0's stage 2, halted fine but never given adapters
    assert sup.actor_ids == names
    # each new process named before its setup (a shutdown without Ray kills it by its pid), the killed ones forgotten
    assert dep.procs == {1: {"pid": names[1]}, 2: {"pid": names[2]}}, dep.procs


def _replay_client(monkeypatch, intake_id="the-intake"):
    log, slow = [], set()

    def remote(name):
        def call(*a):
            ref = object()
            log.append((name, *a))
            if name == "submit":
                slow.add(ref)
            return ref
        return types.SimpleNamespace(remote=call)
    intake = types.SimpleNamespace(**{k: remote(k) for k in ("submit", "abort", "poll", "forget_client")},
                                   _actor_id=intake_id)
    sup = types.SimpleNamespace(ready=threading.Event(), recovered=1, generation=1, failure=None)
    sup.ready.set()
    dep = types.SimpleNamespace(actors=[intake], supervisor=sup, tokenizer=None, _clients=weakref.WeakSet(),
                                placement=types.SimpleNamespace(recover="replay", timeouts=types.SimpleNamespace(
                                    step_s=0.2, ready_s=1.0)))

    def get(refs, timeout=None):
        rs = refs if isinstance(refs, list) else [refs]
        if any(r in slow for r in rs):
            raise ray.exceptions.GetTimeoutError("slow")
        return [None] * len(rs) if isinstance(refs, list) else None
    monkeypatch.setattr(client_mod.ray, "get", get)
    monkeypatch.setattr(client_mod.ray, "is_initialized", lambda: True)
    return Client(dep), log


def test_a_replay_a_live_intake_does_not_take_in_time_ends_alone(monkeypatch):
    """A held request replayed to a live intake that does not take it within step_s: it was taken for a lost intake,
    and every request of the client on that intake was held, the healthy ones too, for a recovery that never came
    (their readers got nothing). It ends alone now, RequestTimeout, aborted at the intake, as a submit does; the
    healthy request's tokens still reach its reader."""
    c, log = _replay_client(monkeypatch)
    got = {"live": [], "held": []}
    live = _Track("live-rid", {"prompt": [1], "max_new_tokens": 8}, got["live"].append, gen=1, intake="the-intake")
    c._tracks["live-rid"] = live
    c._held.append(_Track("old", {"prompt": [5, 17], "max_new_tokens": 8}, got["held"].append, gen=0))
    try:
        for _ in range(3):
            c._replay_if_recovered()
        assert not c._held and list(c._tracks) == ["live-rid"], (c._held, c._tracks)
        (err,) = got["held"]
        assert err[2] == "error" and err[3][0] == "RequestTimeout", err
        assert "the intake did not take it within 0.2 s (timeouts.step_s)" in err[3][1], err
        rid = next(e[1]["rid"] for e in log if e[0] == "submit")
        assert [e[1] for e in log if e[0] == "abort"] == [rid], log      # once
        c._take([("live-rid", [9, 10], [-0.1, -0.2], "length", None)])
        assert got["live"] == [([9, 10], [-0.1, -0.2], "length", None)]
    finally:
        c.close()


def test_a_connected_handle_replays_only_once_it_has_the_new_stages(monkeypatch):
    """A connect()ed handle's RemoteSupervisor saw the launcher's recovery and replayed its held requests even where
    its lookup of the new stages failed (a slow GCS): they went to the dead intake and stayed held for good. It
    waits for a lookup that succeeds, then replays to the new intake."""
    log, dead = [], set()

    def intake(name):
        def remote(kind):
            def call(*a):
                ref = object()
                log.append((kind, name))
                if name == "old":
                    dead.add(ref)
                return ref
            return types.SimpleNamespace(remote=call)
        return types.SimpleNamespace(**{k: remote(k) for k in ("submit", "abort", "poll", "forget_client")},
                                     _actor_id=name)

    def get(refs, timeout=None):
        rs = refs if isinstance(refs, list) else [refs]
        if any(r in dead for r in rs):
            raise ray.exceptions.RayActorError()
        return [None] * len(rs) if isinstance(refs, list) else None
    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(deployment, "_named_pg_id", lambda name: "pg")
    rec = {"generation": 1, "recovered": 0, "ready": False, "stage": 0, "reason": "stage 0 failed: x", "failure": None}
    monkeypatch.setattr(S.RemoteSupervisor, "_read", lambda self: dict(rec))
    found = {"ok": False}

    class Dep:
        _pg_id, _gone, connected, _down = "pg", None, True, False
        placement = types.SimpleNamespace(name="n", recover="replay", timeouts=types.SimpleNamespace(
            heartbeat_s=0.5, step_s=0.2, ready_s=1.0))
        tokenizer = None

        def refresh_actors(self):
            if found["ok"]:
                self.actors = [intake("new")]
            return found["ok"]
    dep = Dep()
    dep.actors, dep._clients = [intake("old")], weakref.WeakSet()
    sup = dep.supervisor = S.RemoteSupervisor(dep)      # (not started: its rounds driven here)
    c = Client(dep)
    dep._clients.add(c)
    got = []
    c._held.append(_Track("r0", {"prompt": [5, 17], "max_new_tokens": 8}, got.append, gen=0, tokens=[3],
                          intake="old"))
    try:
        rec.update(recovered=1, ready=True)
        sup._round(time.monotonic())        # the lookup fails this round: nothing replayed yet
        assert sup.recovered == 0 and len(c._held) == 1 and not [e for e in log if e[0] == "submit"], log
        found["ok"] = True
        for _ in range(3):
            sup._round(time.monotonic())
            c._replay_if_recovered()
        assert sup.recovered == 1 and not c._held and got == [], (c._held, got)
        assert [e for e in log if e[0] == "submit"] == [("submit", "new")], log
    finally:
        c.close()


def test_a_heartbeat_read_before_a_load_does_not_undo_the_loads_own_read():
    """The supervisor's heartbeat reads the intake's loaded adapters (what a restart of the intake reloads); one read
    before a load's commit but answered after the load's own read overwrote it, and a restart then reloaded the
    adapters without the new one. Every change of the registry has a number, kept in Ray's KV or not, and a handle
    keeps the newest list it has seen."""
    from memra_pp.deployment import Deployment
    from memra_pp.stages.runner import StageRunner
    r = StageRunner()
    r.index = 0
    r.placement = types.SimpleNamespace(adapters=types.SimpleNamespace(max_loras=2))
    before = r.adapters_seen()                           # the heartbeat's read, before the load
    assert r.reserve_adapter("a", "/a") == 0
    r.commit_adapter("a", 0)                             # (not detached: no KV key, still numbered)
    after = r.adapters_seen()                            # the load's own read, after its commit
    assert after[0] > before[0] and after[1] == {"a": (0, "/a")} and before[1] == {}
    dep = Deployment.__new__(Deployment)
    dep._adapter_paths, dep._adapter_seq = {}, -1
    dep.saw_adapters(*after)
    dep.saw_adapters(*before)                            # the heartbeat's answer, arriving last
    assert dep._adapter_paths == {"a": (0, "/a")}
    r.release_adapter("a")
    dep.saw_adapters(*r.adapters_seen())                 # a later change is taken
    assert dep._adapter_paths == {}


def test_a_shutdown_during_a_restarts_last_attempt_ends_it_as_stopped(monkeypatch):
    """A restart's last attempt that a shutdown cut short (its next step found the deployment stopping) was reported
    as a recovery that failed ATTEMPTS times ("shut the deployment down and launch it again"), logged as not
    recovered, and published after ray.shutdown() on a detached deployment. It ends as a stop now: the failure
    says the deployment was shut down during a recovery, and nothing is logged as a failed restart."""
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    dep = types.SimpleNamespace(actors=[types.SimpleNamespace(_actor_id="a0")], detached=False, _clients=set())
    sup = S.Supervisor(dep)
    attempts = []

    def restart(stage, err, attempt):
        attempts.append(attempt)
        if attempt == S.ATTEMPTS - 1:       # the shutdown lands during the last attempt
            sup.stopping.set()
            sup._live()
        raise StageFailed("stage wiring: no answer within 300 s")
    monkeypatch.setattr(sup, "_restart", restart)
    sup.recover(1, "its actor died")
    assert attempts == list(range(S.ATTEMPTS)) and sup.ready.is_set()
    assert "shut down during a recovery" in str(sup.failure) and sup.log == [], (sup.failure, sup.log)


def test_a_stage_process_is_killed_without_ray_only_on_its_own_host(monkeypatch):
    """dep.shutdown() after ray.shutdown() SIGKILLs the stage processes by pid: only those of this host (its name,
    and the pid namespace, whose inode alone is no host's mark), and only processes that started when the stage
    did (_sigkill checks the start time)."""
    import socket

    import memra_pp.rayutil as rayutil
    from memra_pp.deployment import Deployment
    killed = []
    monkeypatch.setattr(rayutil, "_sigkill", lambda pid, start: killed.append(pid) or True)
    unlinked = []
    monkeypatch.setattr(deployment, "unlink_shm_of", lambda pids: unlinked.extend(pids))
    monkeypatch.setattr(deployment, "unlink_shm", lambda names: 0)
    dep = Deployment.__new__(Deployment)
    ns = rayutil._pidns()
    dep.procs = {0: {"host": socket.gethostname(), "pidns": ns, "pid": 11, "start": 5},
                 1: {"host": "another-host", "pidns": ns, "pid": 12, "start": 5},
                 2: {"host": socket.gethostname(), "pidns": ns, "pid": 13, "start": None}}
    dep.slot_names, dep.run_dir = [], None
    dep._teardown_without_ray()
    assert killed == [11] and unlinked == [11]      # (and its segments, by the pid's tag)


def test_a_call_past_ready_s_names_the_key_to_raise(monkeypatch):
    """A launch's and a restart's calls wait timeouts.ready_s; one that ran out said "stage setup: no answer within
    300 s" and named no key (a large model's load outlives the default). The timeout names its key now."""
    import memra_pp.rayutil as rayutil

    def slow(refs, timeout=None):
        raise ray.exceptions.GetTimeoutError("slow")
    monkeypatch.setattr(ray, "get", slow)
    try:
        rayutil.get([], rayutil.Limit(0.01, "timeouts.ready_s"), "stage setup")
        raise AssertionError("must time out")
    except StageFailed as e:
        assert str(e) == "stage setup: no answer within 0.01 s (timeouts.ready_s)", e
    try:
        rayutil.get([], 0.01, "stats")
        raise AssertionError("must time out")
    except StageFailed as e:
        assert str(e) == "stats: no answer within 0.01 s", e
    import pickle       # (a stage is sent the timeout as an argument: a plain float)
    t = pickle.loads(pickle.dumps(rayutil.Limit(2.5, "timeouts.ready_s")))
    assert type(t) is float and t == 2.5
    t = rayutil.Limit.of(types.SimpleNamespace(ready_s=300.0), "ready_s")    # (as the launch and a restart make it)
    assert t == 300.0 and t.key == "timeouts.ready_s"


class _DigestActor:
    """A stage that answers load_adapter and adapter_digest with the digest it holds."""

    def __init__(self, digest, calls):
        self.digest, self.calls = digest, calls

    def __getattr__(self, m):
        def remote(*a, **kw):
            self.calls.append((m, id(self)))
            return _Ref(self.digest if m in ("load_adapter", "adapter_digest") else 0 if m == "reserve_adapter"
                        else None)
        return types.SimpleNamespace(remote=remote)


def _fake_ray(monkeypatch):
    monkeypatch.setattr(ray, "get", lambda refs, timeout=None: [_res(r) for r in refs] if isinstance(refs, list)
                        else _res(refs))
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns=1, timeout=None: (list(refs), []))
    monkeypatch.setattr(ray, "is_initialized", lambda: True)


def test_a_restarted_stage_must_read_the_adapter_the_survivors_hold(monkeypatch):
    """Supervisor._same_adapter: a restarted stage's reload of an adapter whose files were rewritten since the load
    is a ConfigError naming the stages and both digests (the caller drops the adapter); the same digest passes;
    with no survivor, the restarted stages need only agree among themselves."""
    import pytest
    from memra_pp.errors import ConfigError
    _fake_ray(monkeypatch)
    calls = []
    sup = S.Supervisor.__new__(S.Supervisor)
    sup.dep = types.SimpleNamespace(actors=[_DigestActor("a" * 64, calls), _DigestActor("b" * 64, calls)])
    sup._same_adapter("/x", 0, {1}, ["a" * 64], 1.0)
    with pytest.raises(ConfigError, match=r"^its files at /x changed since it was loaded: the restarted stage\(s\) "
                                          r"\[1\] read other weights \(sha256 bbbbbbbbbbbb\) than stage 0 holds "
                                          r"\(aaaaaaaaaaaa\); load it again to serve the new files$"):
        sup._same_adapter("/x", 0, {1}, ["b" * 64], 1.0)
    assert ("adapter_digest", id(sup.dep.actors[0])) in calls
    calls.clear()
    sup._same_adapter("/x", 0, {0, 1}, ["c" * 64, "c" * 64], 1.0)
    assert calls == []
    with pytest.raises(ConfigError, match=r"^its files at /x changed while the restarted stages read them$"):
        sup._same_adapter("/x", 0, {0, 1}, ["c" * 64, "d" * 64], 1.0)


def test_a_load_whose_stages_read_different_files_is_refused_and_undone(monkeypatch, tmp_path):
    """Deployment.load_adapter: every stage reads the adapter's files itself; if they read different contents (the
    files rewritten during the load) the load is refused with ConfigError, unloaded on every stage and its slot
    released, not published to run as two adapters."""
    import pytest
    from memra_pp.deployment import Deployment
    from memra_pp.errors import ConfigError
    _fake_ray(monkeypatch)
    calls = []
    dep = Deployment.__new__(Deployment)
    dep._down, dep._gone, dep.supervisor, dep.connected = False, None, None, False
    dep.placement = types.SimpleNamespace(name="x", timeouts=types.SimpleNamespace(ready_s=1.0))
    dep.actors = [_DigestActor("a" * 64, calls), _DigestActor("b" * 64, calls)]
    dep.refresh_actors, dep._rebudget = (lambda: False), (lambda t: None)
    with pytest.raises(ConfigError, match=r"^adapter 'x': its files at .*changed while the stages read them \(the "
                                          r"stages read 2 different adapters\); load it again once they are "
                                          r"written$"):
        dep.load_adapter("x", str(tmp_path))
    done = [m for m, _ in calls]
    assert done.count("unload_adapter") == 2 and "release_adapter" in done and "commit_adapter" not in done, done
