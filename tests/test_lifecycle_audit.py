"""Deployment lifecycle around a stage's recovery, on one detached 3-stage CPU deployment with `recover: replay`:
a handle connected while a stage is being replaced, an adapter loaded during a recovery, a second stage lost
while the first is being restarted, and wait_ready's argument. Every request must end with its reference tokens,
and the deployment must serve after each recovery."""
import re
import threading
import time

import pytest
import ray

import memra_pp
from conftest_models import hf_reference, tiny_checkpoint
from memra_pp.deployment import Deployment
from memra_pp.errors import InputError
from test_adapters import NEW, PROMPTS, adapter, peft_reference

SHORT = (5, 17, 42)
NAME = "lcaudit"


@pytest.fixture(scope="module")
def dep(ray_cluster):
    _, path = tiny_checkpoint("dense", False)
    cfg = {"name": NAME, "model": {"path": str(path)}, "recover": "replay",
           "stages": [{"device": "cpu", "num_cpus": 0.1}] * 3, "timeouts": {"heartbeat_s": 0.5},
           "adapters": {"max_loras": 2, "max_rank": 8},
           "scheduler": {"max_batch": 8, "max_context": 256, "prefill_chunk": 16}}
    d = memra_pp.launch(cfg, detached=True)
    yield d
    d.shutdown()


def recovering(d, timeout=30):
    """Wait until the supervisor has detected the failure and its recovery runs."""
    deadline = time.monotonic() + timeout
    while d.supervisor.ready.is_set():
        assert time.monotonic() < deadline, "the supervisor did not detect the killed stage"
        time.sleep(0.01)


def test_wait_ready_refuses_a_timeout_that_is_not_seconds():
    """wait_ready(timeout) must refuse NaN, a negative or a non-number with InputError naming the value (None raised
    a TypeError and NaN a ValueError from inside the supervisor), before touching Ray."""
    d = Deployment.__new__(Deployment)
    for bad in (float("nan"), -1, "5", True):
        with pytest.raises(InputError, match=r"wait_ready: timeout is seconds >= 0 or None"):
            d.wait_ready(bad)


def test_two_concurrent_shutdowns_tear_down_once(monkeypatch):
    """shutdown() from two threads at once (a signal handler and the main thread; a stop request's and the
    caller's) must tear the deployment down once, and neither call may return before that teardown ended: both
    tore down side by side, and where launch owned Ray the first's ray.shutdown() made the second's ray.kill raise
    Ray's own error."""
    from types import SimpleNamespace
    d = Deployment(SimpleNamespace(name="x"), None, [], [{"vocab_size": 8, "eos": None}], None, False, False)
    calls, ended = [], []

    def teardown():
        calls.append(time.monotonic())
        time.sleep(0.3)
    monkeypatch.setattr(d, "_teardown", teardown)

    def stop():
        d.shutdown()
        ended.append(time.monotonic())
    ts = [threading.Thread(target=stop) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(10)
    assert len(calls) == 1 and len(ended) == 2 and min(ended) >= calls[0] + 0.3, (calls, ended)


def test_wait_ready_ends_when_the_deployment_is_shut_down(monkeypatch):
    """A wait_ready(None) in one thread (a health probe) while another shuts the deployment down must end at once
    with StageFailed: its stages no longer answered, and it asked them again without a pause until its deadline
    (with None, for ever)."""
    from types import SimpleNamespace
    from memra_pp import supervisor as sv
    from memra_pp.errors import StageFailed
    d = SimpleNamespace(placement=SimpleNamespace(timeouts=SimpleNamespace(heartbeat_s=0.5)), actors=[],
                        detached=False, _clients=[])
    sup, asked, out = sv.Supervisor(d), [], []

    def gone(*a, **k):
        asked.append(1)
        raise StageFailed("wait_ready: a stage actor died")
    monkeypatch.setattr(sv, "_get", gone)

    def wait():
        try:
            sup.wait_ready(30)
        except StageFailed as e:
            out.append(e)
    t = threading.Thread(target=wait, daemon=True)
    t.start()
    time.sleep(0.3)
    sup.stop()
    t.join(5)
    assert not t.is_alive() and "shut down" in str(out[0]) and len(asked) < 50, (out, len(asked))


def test_a_recovery_stopped_by_a_shutdown_leaves_no_caller_waiting():
    """A shutdown whose stop() came between a recovery's start and its clearing `ready` (stop() then saw the
    deployment ready and set nothing) must still leave `ready` set with a typed failure: the recovery returned with
    `ready` cleared, and a submit already waiting for it waited timeouts.ready_s (300 s by default)."""
    from types import SimpleNamespace
    from memra_pp import supervisor as sv

    class Client:
        def on_stage_failed(self, e):       # (the clients are told once `ready` is cleared): stop() lands here
            sup.stopping.set()
    d = SimpleNamespace(actors=[], detached=False, _clients=[Client()])
    sup = sv.Supervisor(d)
    sup.recover(1, "its actor died")
    assert sup.ready.is_set() and "shut down during a recovery" in str(sup.failure), sup.failure


def test_connect_while_a_stage_is_replaced_waits_for_the_recovery(dep):
    """connect(name) while the launcher replaces the intake (its name free for a moment) must return a handle once
    the deployment serves again, whose client gets the reference tokens; it raised "no deployment named" (stage 0)
    or Ray's raw ValueError (another stage). wait_ready(None) waits as long as it takes."""
    want = hf_reference("dense", False, SHORT, 4)[0]
    old = dep.actors[0]
    ray.kill(old)
    deadline = time.monotonic() + 10
    while True:         # the dead actor's name is released: the moment connect used to refuse
        try:
            if ray.get_actor(f"{NAME}.stage0")._actor_id == old._actor_id:
                time.sleep(0.01)
                assert time.monotonic() < deadline
                continue
        except ValueError:
            pass
        break
    other = memra_pp.connect(NAME, namespace="memra-test")
    try:
        dep.wait_ready(None)
        assert other.actors[0]._actor_id == dep.actors[0]._actor_id != old._actor_id
        assert other.client().generate(list(SHORT), max_new_tokens=4, timeout=60).token_ids == want
        assert dep.supervisor.log[-1]["stage"] == 0 and dep.supervisor.log[-1]["recovered"]
    finally:
        other.supervisor.stop()


def test_load_adapter_during_a_recovery_waits_for_it(dep):
    """load_adapter while the supervisor replaces the middle stage must wait for the recovery and then load on
    every stage (it reached the new actor before its setup: a StageFailed wrapping an AttributeError traceback,
    and the adapter was lost); the adapter then gives PEFT's tokens."""
    ray.kill(dep.actors[1])
    recovering(dep)
    dep.load_adapter("a", adapter("dense", False, "A")[1])
    assert dep.supervisor.log[-1]["stage"] == 1 and dep.supervisor.log[-1]["recovered"]
    assert "a" in ray.get(dep.actors[0].adapters.remote(True), timeout=30)     # the intake's registry
    r = dep.client().generate(list(PROMPTS[0]), max_new_tokens=NEW, adapter="a", timeout=60)
    assert r.token_ids == peft_reference("dense", False, "A", PROMPTS[0])[0]


def test_a_stage_lost_during_a_restart_is_recovered_and_the_stream_replayed(dep):
    """The intake lost while the supervisor restarts the primary (during the rewiring) must be restarted too, by
    the next attempt: a streamed greedy request completes with the reference tokens and the adapter serves again.
    Every retry reused the failed attempt's run dir and was refused ("channel socket ... exists"): the deployment
    was left failed after one stage loss inside a recovery."""
    c = dep.client()
    got, errs = [], []

    def stream():
        try:
            for ev in c.stream(list(SHORT), max_new_tokens=48, timeout=60):
                got.extend(ev.token_ids)
        except Exception as e:  # noqa: BLE001 - asserted below
            errs.append(e)
    th = threading.Thread(target=stream, daemon=True)
    th.start()
    deadline = time.monotonic() + 30
    while len(got) < 3 and not errs and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(got) < 48 and not errs, (got, errs)
    real = dep.wire

    def wire(actors, infos, timeout):     # the supervisor's rewiring, once: the intake dies right then
        del dep.wire
        ray.kill(actors[0])
        return real(actors, infos, timeout)
    dep.wire = wire
    n = len(dep.supervisor.log)
    ray.kill(dep.actors[2])
    want = hf_reference("dense", False, SHORT, 48)[0]       # (computed here while the stages recover)
    th.join(90)
    assert not errs and got == want, (errs, got)
    rec = dep.supervisor.log[n:]
    assert [(e["stage"], e["recovered"], e["attempts"]) for e in rec] == [(2, True, 2)], rec
    assert dep.supervisor.failure is None
    r = c.generate(list(PROMPTS[0]), max_new_tokens=NEW, adapter="a", timeout=60)
    assert r.token_ids == peft_reference("dense", False, "A", PROMPTS[0])[0]


def test_a_replay_the_new_intake_refuses_ends_that_request_alone(dep, tmp_path):
    """A request cut by the intake's loss whose adapter cannot be reloaded on the new intake (its files deleted
    meanwhile: the restart drops it) must end with the intake's InputError, saying it was replayed, while the
    client's other cut request completes with its reference tokens. The refusal held both again, for a recovery
    that never came: they hung to their timeout."""
    import shutil
    from test_reliability import Stream
    b = tmp_path / "b"
    shutil.copytree(adapter("dense", False, "B")[1], b)
    dep.load_adapter("b", str(b))
    c = dep.client()
    plain, with_b = Stream(c, SHORT, 48), Stream(c, PROMPTS[0], 48, adapter="b")
    plain.wait_tokens(3)
    with_b.wait_tokens(3)
    shutil.rmtree(b)
    ray.kill(dep.actors[0])
    plain.join(40)
    with_b.join(40)
    assert plain.error is None and plain.tokens == hf_reference("dense", False, SHORT, 48)[0], plain.error
    assert isinstance(with_b.error, InputError), with_b.error
    assert "replayed after a stage failure" in str(with_b.error) and "unknown adapter 'b'" in str(with_b.error)
    assert dep.supervisor.log[-1]["stage"] == 0 and dep.supervisor.log[-1]["recovered"]


def test_a_malformed_tokenizer_is_refused_at_launch(tmp_path):
    """A tokenizer.json that does not load was read lazily, at a request's end: every request, token ids included,
    ran and then lost its tokens to the ConfigError its text raised. launch refuses it, naming the file, before
    anything starts."""
    import shutil
    import memra_pp
    from memra_pp.defaults import ensure_tiny
    d = tmp_path / "m"
    shutil.copytree(ensure_tiny(), d)
    (d / "tokenizer.json").write_text("{not json")
    with pytest.raises(memra_pp.errors.ConfigError, match=r"tokenizer.json: not a loadable tokenizer.json"):
        memra_pp.launch({"name": "bt", "model": {"path": str(d)}, "stages": [{"device": "cpu", "num_cpus": 0.1}]})


AFTER_RAY_SHUTDOWN = r"""
import os, sys, time, ray, memra_pp
from memra_pp.defaults import ensure_tiny      # (the project's own writer: transformers' import and build cost 2 s)
path = ensure_tiny()
dep = memra_pp.launch({"name": "gone", "model": {"path": str(path)}, "recover": "replay",
                       "timeouts": {"heartbeat_s": 0.2}, "stages": [{"device": "cpu", "num_cpus": 0.1}]},
                      detached=True)
other = memra_pp.connect("gone")
c = dep.client()
assert other.client().generate([5, 6, 7], max_new_tokens=2).token_ids and c.generate([5], max_new_tokens=1).token_ids
mine = lambda: sorted(n for n in os.listdir("/dev/shm") if n.startswith(tuple(f"mpp-{p}." for p in pids)))
pids = [x["pid"] for x in dep.procs.values()]
assert mine() and os.path.isdir(dep.run_dir)
ray.shutdown()                  # not dep.shutdown(): the supervisors' threads and the poller are still running
time.sleep(2)
t0 = time.monotonic()
try:                            # a client made before: refused at once, no new cluster to find the intake in
    c.generate([5, 6, 7], max_new_tokens=2)
except memra_pp.StageFailed as e:
    print("generate refused:", e, round(time.monotonic() - t0, 2), flush=True)
try:                            # nothing it can ask or kill from here: it says so
    other.shutdown()
except memra_pp.StageFailed as e:
    print("connected shutdown:", e, flush=True)
dep.shutdown()                  # returns, and frees what the cluster's end left: the segments, the run dir
print("segments left", mine(), "run dir left", os.path.isdir(dep.run_dir), flush=True)
print("initialized after", ray.is_initialized(), flush=True)
"""


SLOW_RESTART = r"""
import os, signal, threading, time, ray, memra_pp
from memra_pp.defaults import ensure_tiny
from memra_pp.deployment import Deployment
from memra_pp.supervisor import Supervisor
Supervisor.STOP_JOIN_S = 0.5        # (stop()'s wait, 10 s: a restart outlives it here without a 10 s test)
dep = memra_pp.launch({"name": "slowre", "model": {"path": str(ensure_tiny())}, "timeouts": {"heartbeat_s": 0.2},
                       "stages": [{"device": "cpu", "num_cpus": 0.1}] * 2})
c = dep.client()
assert c.generate([5, 6, 7], max_new_tokens=2).token_ids
entered, gate, wire = threading.Event(), threading.Event(), Deployment.wire
def slow_wire(self, *a, **k):       # a restart's wiring that takes long (as a big model's reload would)
    entered.set()
    gate.wait(60)
    return wire(self, *a, **k)
Deployment.wire = slow_wire
os.kill(dep.procs[1]["pid"], signal.SIGKILL)
assert entered.wait(30)
t0 = time.monotonic()
try:
    c.generate([5, 6, 7], max_new_tokens=2, timeout=1)
except memra_pp.RequestTimeout as e:
    print("timed out:", e, round(time.monotonic() - t0, 2), flush=True)
threading.Timer(1.5, gate.set).start()      # the restart goes on once shutdown() has begun
t0 = time.monotonic()
dep.shutdown()
print("shutdown", round(time.monotonic() - t0, 2), "supervisor alive", dep.supervisor.thread.is_alive(), flush=True)
time.sleep(1)
print("initialized after", ray.is_initialized(), flush=True)
"""


def test_a_restart_outliving_shutdowns_wait_ends_before_ray_and_a_timeout_bounds_the_wait_for_it(tmp_path):
    """A restart that takes long (its wiring held here) while the caller asks for a request with timeout=1, then shuts
    the deployment down. The request waited for the whole recovery (up to timeouts.ready_s, 300 s) whatever its
    timeout: it ends in RequestTimeout after its timeout. shutdown() waited 10 s for the restart, then stopped Ray,
    and the restart's next Ray call started a new local cluster, left running: the restart now ends before Ray does
    (its calls fail on the killed stages), and no cluster starts."""
    import subprocess
    import sys
    script = tmp_path / "s.py"
    script.write_text(SLOW_RESTART)
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                       cwd=str(__import__("pathlib").Path(__file__).parent.parent))
    out = p.stdout
    timed = re.search(r"timed out: (.*) ([0-9.]+)\n", out)
    assert timed and "recovering from a stage failure and was not ready within 1 s" in timed[1], (out, p.stderr[-3000:])
    assert float(timed[2]) < 3.0, out
    assert "supervisor alive False" in out and "initialized after False" in out, (out, p.stderr[-3000:])
    assert "Started a local Ray instance" not in p.stderr, p.stderr[-3000:]


def test_ray_shutdown_without_dep_shutdown_starts_no_new_cluster(tmp_path):
    """ray.shutdown() in a process holding a launched and a connect()ed handle: the connected handle's supervisor
    thread asked Ray's KV for the recovery state every 0.2 s, and that call (get_runtime_context) made Ray start a
    new local cluster ("Started a local Ray instance"), left running. No background thread calls Ray once the
    process has left the cluster."""
    import subprocess
    import sys
    script = tmp_path / "s.py"
    script.write_text(AFTER_RAY_SHUTDOWN)
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240,
                       cwd=str(__import__("pathlib").Path(__file__).parent.parent))
    assert "initialized after False" in p.stdout, (p.stdout[-2000:], p.stderr[-4000:])
    assert "Started a local Ray instance" not in p.stderr.split("initialized after")[-1], p.stderr[-4000:]
    # a client made before ray.shutdown() is refused at once (it started a cluster to look for the intake and said
    # InputError), and dep.shutdown() then frees what Ray's end left (it started a cluster too, raised a bare
    # Exception and left the stages' segments and the run dir)
    refused = re.search(r"generate refused: (.*) ([0-9.]+)\n", p.stdout)
    assert refused and "ray.shutdown() was called" in refused[1] and float(refused[2]) < 1.0, p.stdout[-2000:]
    assert "segments left [] run dir left False" in p.stdout, p.stdout[-2000:]
    assert "connected shutdown: shutdown: this process is no longer connected" in p.stdout, p.stdout[-2000:]
