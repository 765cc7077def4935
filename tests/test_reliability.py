"""Stage failure through memra_pp.launch: every stage of 2- and 3-stage CPU deployments is killed (ray.kill,
os._exit inside it, SIGKILL, SIGSTOP) mid-generation and mid-prefill. Callers must get StageFailed naming the
stage within 15 s, the deployment must recover by itself, and with recover: replay the interrupted requests
must complete with the tokens of an uninterrupted run."""
import os
import re
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray

import memra_pp
from conftest_models import LaunchedOnce, hf_reference, tiny_checkpoint
from memra_pp.errors import StageFailed

SHORT, LONG = (5, 17, 42), tuple((i * 7) % 250 + 1 for i in range(440))
DECODE_NEW, PREFILL_NEW = 64, 6      # 64: the decode is still running when the kill lands (3 tokens + 0.15 s)
DETACHED = "reldet"                  # the detached 2-stage deployment two tests share (kept)


def config(path, n, recover="error"):
    return {"name": f"rel{n}", "model": {"path": str(path)}, "recover": recover,
            "stages": [{"device": "cpu", "num_cpus": 0.1}] * n, "timeouts": {"heartbeat_s": 0.5},
            "scheduler": {"max_batch": 8, "max_context": 512, "prefill_chunk": 4}}


@pytest.fixture(scope="module")
def kept(ray_cluster):
    """kept(n) / kept(DETACHED, detached=True): the n-stage deployment of config(), or the detached 2-stage one named
    DETACHED, that an earlier test of this module left up (LaunchedOnce), else a fresh launch. For the tests whose
    scenario needs no fresh deployment: a test that shuts its deployment down (ends it with `with`) leaves nothing
    to take, and the next one launches again."""
    path = tiny_checkpoint("dense", False)[1]
    get = LaunchedOnce(lambda key: dict(config(path, 2), name=DETACHED) if key == DETACHED else config(path, key))
    yield get
    get.shutdown()


def until(pred, what, timeout=30.0):
    """Poll `pred` (every 10 ms) until it holds; fail naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def pid_of(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)


def kill(dep, i, how):
    a = dep.actors[i]
    if how == "ray.kill":
        ray.kill(a)
    elif how == "os._exit":     # a crash inside the stage process itself
        a.__ray_call__.remote(lambda self: os._exit(3))
    else:
        pid = pid_of(a)
        os.kill(pid, signal.SIGKILL if how == "SIGKILL" else signal.SIGSTOP)


class Stream(threading.Thread):
    """One streamed request on its own thread: the tokens it got and how it ended (and when)."""

    def __init__(self, c, prompt, new, **kw):
        super().__init__(daemon=True)
        self.c, self.prompt, self.new, self.kw = c, list(prompt), new, kw
        self.tokens, self.error, self.t_end, self.finish = [], None, None, None
        self.start()

    def run(self):
        try:
            for ev in self.c.stream(self.prompt, max_new_tokens=self.new, timeout=60, **self.kw):
                self.tokens += ev.token_ids
                self.finish = ev.finish_reason or self.finish
        except Exception as e:  # noqa: BLE001 - recorded for the test to assert on
            self.error = e
        self.t_end = time.monotonic()

    def wait_tokens(self, n, timeout=30):
        deadline = time.monotonic() + timeout
        while len(self.tokens) < n and self.t_end is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(self.tokens) >= n, (self.tokens, self.error)


def interrupt(dep, c, i, how, running=(), **kw):
    """Kill stage i while one request decodes and one is mid-prefill (and the streams `running` are still going);
    returns (decode, prefill, kill time)."""
    dec = Stream(c, SHORT, DECODE_NEW, **kw)
    dec.wait_tokens(3)
    pre = Stream(c, LONG, PREFILL_NEW)
    time.sleep(0.15)
    assert not pre.tokens, "the long prompt must still be in prefill when the stage is killed"
    for s in (dec, *running):
        assert s.t_end is None and len(s.tokens) < DECODE_NEW, "a decode must still be running when the stage dies"
    t_kill = time.monotonic()
    kill(dep, i, how)
    dec.join(60)
    pre.join(60)
    return dec, pre, t_kill


def check_serves(dep, c):
    dep.wait_ready(90)
    checks = ((SHORT, 8), (LONG, PREFILL_NEW))      # side by side (independent requests): one batch, not two runs
    with ThreadPoolExecutor(len(checks)) as pool:
        got = list(pool.map(lambda pn: c.generate(list(pn[0]), max_new_tokens=pn[1], timeout=60).token_ids, checks))
    for (p, new), tokens in zip(checks, got):
        assert tokens == hf_reference("dense", False, p, new)[0], \
            "after the recovery requests must match their reference"


def test_a_microbatch_failing_mid_pipeline_ends_its_requests_alone_and_frees_every_stages_pages(kept):
    """A microbatch that fails on stage 1 of 3 (inject_fault) ends its own requests with StageFailed naming the
    stage and the error; no stage is lost, nothing recovers, the next request gets transformers' tokens. The
    failed microbatch carried the release of the request finished before it: stages 1 and 2 must give those
    pages back as the error passes, not when some later microbatch happens to carry the release again (the
    intake counted them free when it cut the failed microbatch, and admits against them). (Defined before the
    stage-death test, which takes this 3-stage deployment afterwards and shuts it down.)"""
    dep = kept(3)
    n0 = len(dep.supervisor.log)
    c = dep.client()
    ref = hf_reference("dense", False, SHORT, 4)[0]
    assert c.generate(list(SHORT), max_new_tokens=4, timeout=60).token_ids == ref
    held = [s["kv_pages_held"] for s in dep.stats()["stages"]]
    assert held[1] > 0 and held[2] > 0, held     # its release waits for the next microbatch (no test otherwise)
    ray.get(dep.actors[1].inject_fault.remote("injected fault"), timeout=30)
    with pytest.raises(StageFailed, match="stage 1 failed a microbatch: RuntimeError: injected fault") as e:
        c.generate([9, 10, 11], max_new_tokens=4, timeout=30)
    assert e.value.stage is None                  # no stage was lost
    held = [s["kv_pages_held"] for s in dep.stats()["stages"]]
    assert held[1:] == [0, 0], held
    assert c.generate(list(SHORT), max_new_tokens=4, timeout=60).token_ids == ref
    assert dep.supervisor.log[n0:] == [], dep.supervisor.log


@pytest.mark.parametrize("n,kills", [(2, ["ray.kill", "os._exit"]), (3, ["SIGKILL", "SIGSTOP", "ray.kill"])])
def test_stage_death_fails_requests_then_recovers(kept, n, kills):
    """Killing each stage mid-decode and mid-prefill must end both requests with StageFailed naming that stage
    within 15 s (no caller hangs); the deployment must then recover and serve reference tokens. (The 3-stage
    deployment is the one the microbatch test leaves, where that ran first: a fault, no stage lost.)"""
    import os
    seen = set()
    with kept(n) as dep:
        n0 = len(dep.supervisor.log)
        c = dep.client()
        for i, how in enumerate(kills):
            dead = list(dep.slot_names[i])          # the killed stage's receiving segments; the intake's prefix;
            # every segment of its process (its tag's pattern) and its lock file
            assert sum(x.endswith("*") for x in dead) == (2 if i == 0 else 1), dead
            assert sum(x.endswith(".lock") for x in dead) == 1, dead
            dec, pre, t_kill = interrupt(dep, c, i, how)
            for s in (dec, pre):
                assert isinstance(s.error, StageFailed), (how, i, s.error, len(s.tokens))
                assert s.error.stage == i and f"stage {i}" in str(s.error), (how, i, s.error)
                assert s.t_end - t_kill < 15, f"{how} of stage {i}: StageFailed took {s.t_end - t_kill:.1f} s"
            assert len(dec.tokens) < DECODE_NEW
            check_serves(dep, c)
            if how == "SIGSTOP":    # the restart SIGKILLed the stopped process itself (Ray alone waited ~5 s)
                assert dep.supervisor.log[-1]["sigkilled"] >= 1, dep.supervisor.log[-1]
            left = [x for x in dead if os.path.exists(f"/dev/shm/{x}")] + \
                [e for x in dead if x.endswith("*") for e in os.listdir("/dev/shm") if e.startswith(x[:-1])]
            assert not left, f"{how} of stage {i} left its slot segments behind: {left}"
            seen.update(x for names in dep.slot_names for x in names)
        log = dep.supervisor.log[n0:]
        assert [e["stage"] for e in log] == list(range(n)) and all(e["recovered"] for e in log), log
    assert seen and not [x for x in seen if os.path.exists(f"/dev/shm/{x}")], "shutdown left slot segments"
    assert not [e for x in seen if x.endswith("*") for e in os.listdir("/dev/shm") if e.startswith(x[:-1])]


def test_replay_completes_interrupted_requests(ray_cluster):
    """With recover: replay, requests cut by the loss of the intake (their history lives in the client) or of
    the last stage must complete: greedy ones with the reference tokens, a seeded sampled one with the tokens of
    its uninterrupted run; the prefill one too; nothing is duplicated."""
    _, path = tiny_checkpoint("dense", False)
    with memra_pp.launch(config(path, 3, recover="replay")) as dep:
        c = dep.client()
        seeded = dict(temperature=0.9, top_k=40, seed=1234)
        with ThreadPoolExecutor(1) as pool:     # its uninterrupted run, while transformers computes the references
            uninterrupted = pool.submit(c.generate, list(SHORT), max_new_tokens=DECODE_NEW, **seeded)
            want = hf_reference("dense", False, SHORT, DECODE_NEW)[0]
            want_long = hf_reference("dense", False, LONG, PREFILL_NEW)[0]
            want_seeded = uninterrupted.result().token_ids
        for i, how in ((0, "ray.kill"), (2, "SIGKILL")):
            sampled = Stream(c, SHORT, DECODE_NEW, **seeded)
            dec, pre, _ = interrupt(dep, c, i, how, running=(sampled,))
            sampled.join(60)
            assert dec.error is None and pre.error is None and sampled.error is None, \
                (dec.error, pre.error, sampled.error)
            assert dec.tokens == want and dec.finish == "length"
            assert pre.tokens == want_long
            assert sampled.tokens == want_seeded, "seeded sampling must continue at (seed, step) after a replay"
        assert [e["stage"] for e in dep.supervisor.log] == [0, 2]
        check_serves(dep, c)


def test_stages_run_with_the_drivers_switches_after_a_restart_too(ray_cluster, monkeypatch):
    """The MEMRA_PP_* switches are resolved once in the driver at launch and given to each stage's setup (law 2: a
    stage never takes a mode from its own environment). Set here after Ray started, the switch is not in the stage
    processes' environment, yet every stage runs with it, and so does a restarted one."""
    from memra_pp import switches
    want = not switches.SWITCHES["MEMRA_PP_PREFILL_VARLEN"][0]          # the default's opposite
    monkeypatch.setenv("MEMRA_PP_PREFILL_VARLEN", "1" if want else "0")
    monkeypatch.setenv("MEMRA_PP_GC_FREEZE", "0")     # (on by default: test_runtime's stats test sees it frozen)
    _, path = tiny_checkpoint("dense", False)

    def seen(dep):
        return [ray.get(a.__ray_call__.remote(
            lambda self: (os.environ.get("MEMRA_PP_PREFILL_VARLEN"), __import__("memra_pp.kernels.prefill",
                                                                                fromlist=["VARLEN"]).VARLEN)),
            timeout=30) for a in dep.actors]
    with memra_pp.launch(dict(config(path, 2), name="relsw")) as dep:
        assert seen(dep) == [(None, want)] * 2
        assert [s["switches"]["MEMRA_PP_PREFILL_VARLEN"] for s in dep.stats()["stages"]] == [want] * 2
        g0 = dep.supervisor.generation
        kill(dep, 1, "ray.kill")
        until(lambda: dep.supervisor.generation > g0, "the supervisor did not detect the killed stage")
        dep.wait_ready(90)
        assert dep.supervisor.log[-1]["recovered"] and seen(dep) == [(None, want)] * 2
        # the new stage's process is named (a shutdown without Ray kills it by its pid)
        pids = [ray.get(a.__ray_call__.remote(lambda self: os.getpid()), timeout=30) for a in dep.actors]
        assert [dep.procs[i]["pid"] for i in range(2)] == pids, (dep.procs, pids)
        check_serves(dep, dep.client())
        assert [s["gc_frozen"] for s in dep.stats()["stages"]] == [0, 0]


def test_a_connected_handle_follows_a_restarted_intake(kept):
    """A connect()ed handle holds the stage actors it looked up; when the launching process's supervisor replaces
    a failed stage 0 with a new actor of the same name, the connected handle follows: a request it was streaming
    fails with StageFailed, its next request is served by the new intake (a submit to the dead actor is sent again,
    since that took nothing), and another connected handle, idle, asks the new stages at once (its RemoteSupervisor
    follows the launcher's recoveries whatever `recover`; its stats were refused once before). Before, every call
    through a connected handle failed after a restart of stage 0 until it connected again. (Its deployment is left
    up for the shutdown race test, defined after this one.)"""
    dep = kept(DETACHED, detached=True)
    other = memra_pp.connect(DETACHED, namespace="memra-test")
    third = memra_pp.connect(DETACHED, namespace="memra-test")
    c = other.client()
    want = hf_reference("dense", False, SHORT, 4)[0]
    assert c.generate(list(SHORT), max_new_tokens=4).token_ids == want
    it = c.stream(list(SHORT), max_new_tokens=400, ignore_eos=True)
    next(it)
    g0 = dep.supervisor.generation
    ray.kill(dep.actors[0])
    with pytest.raises(StageFailed, match="stage 0"):
        for _ in it:
            pass
    until(lambda: dep.supervisor.generation > g0, "the launcher's supervisor did not detect the killed intake")
    dep.wait_ready(90)
    assert dep.supervisor.log and dep.supervisor.log[-1]["stage"] == 0 and dep.supervisor.log[-1]["recovered"]
    new = dep.actors[0]._actor_id
    assert c.generate(list(SHORT), max_new_tokens=4, timeout=60).token_ids == want
    assert other.actors[0]._actor_id == new
    # another connected handle, idle meanwhile: its RemoteSupervisor saw the recovery in the launcher's record
    # and looked the new stages up (recover: error too), so its first call asks them
    deadline = time.monotonic() + 5
    while third.actors[0]._actor_id != new and time.monotonic() < deadline:
        time.sleep(0.05)
    assert third.actors[0]._actor_id == new and [s["index"] for s in third.stats()["stages"]] == [0, 1]


def test_supervisor_does_not_race_shutdown(kept):
    """A shutdown right after a kill must return promptly and leave no actor of the deployment alive, even with
    the recovery in progress. (The detached deployment the connected-handle test left, if it ran first.)"""
    dep = kept(DETACHED, detached=True)
    old = dep.actors[1]._actor_id
    ray.kill(dep.actors[1])
    # the heartbeat finds it and the restart begins: it has made the new actor (its setup is under way)
    until(lambda: not dep.supervisor.ready.is_set() and dep.actors[1]._actor_id != old,
          "the supervisor did not begin the restart")
    t0 = time.monotonic()
    dep.shutdown()
    assert time.monotonic() - t0 < 40

    def gone(i):
        try:
            ray.get_actor(f"{DETACHED}.stage{i}")
        except ValueError:
            return True
        return False
    deadline = time.monotonic() + 0.5       # (as long as this waited before)
    while not all(gone(i) for i in range(2)) and time.monotonic() < deadline:
        time.sleep(0.02)
    for i in range(2):
        with pytest.raises(ValueError):
            ray.get_actor(f"{DETACHED}.stage{i}")


def test_stuck_stage_is_detected_and_replaced(ray_cluster):
    """A stage whose actor still answers heartbeats but whose loop hangs inside one microbatch for longer than
    timeouts.step_s must be declared failed (StageFailed naming it), replaced, and the deployment must serve."""
    _, path = tiny_checkpoint("dense", False)
    cfg = dict(config(path, 2), timeouts={"heartbeat_s": 0.5, "step_s": 3})
    with memra_pp.launch(cfg) as dep:
        c = dep.client()
        ray.get(dep.actors[1].inject_stall.remote(60), timeout=30)
        t0 = time.monotonic()
        with pytest.raises(StageFailed) as e:
            c.generate(list(SHORT), max_new_tokens=4, timeout=30)
        assert e.value.stage == 1 and "computing for" in str(e.value), e.value
        assert time.monotonic() - t0 < 15
        dep.wait_ready(timeout=60)
        assert dep.supervisor.log[-1]["sigkilled"] >= 1, dep.supervisor.log      # its live process, by its pid
        ref = hf_reference("dense", False, SHORT, 4)[0]
        assert c.generate(list(SHORT), max_new_tokens=4).token_ids == ref


def test_a_survivor_still_inside_a_step_is_restarted_too(ray_cluster):
    """Stage 0 is inside a long step (a stall shorter than timeouts.step_s: not stuck) when stage 1 dies. Its halt
    waits half of step_s for the loop, then fails (that step would end in the fresh cache and scheduler), and the
    supervisor restarts stage 0 too, naming why in its log. Before, the halt returned after 10 s whatever the loop
    did, and the old step, ending in the recovered deployment, failed its requests with "stage 1 is lost"."""
    _, path = tiny_checkpoint("dense", False)
    cfg = dict(config(path, 2), timeouts={"heartbeat_s": 0.5, "step_s": 7.5})
    with memra_pp.launch(cfg) as dep, ThreadPoolExecutor(1) as ex:
        c = dep.client()
        pid0 = pid_of(dep.actors[0])
        ray.get(dep.actors[0].inject_stall.remote(6), timeout=30)
        fut = ex.submit(c.generate, list(SHORT), max_new_tokens=4, timeout=30)
        until(lambda: ray.get(dep.actors[0].health.remote(), timeout=30)["computing_s"] > 0,
              "stage 0 inside its stalled step")
        ray.kill(dep.actors[1])
        with pytest.raises(StageFailed):
            fut.result(timeout=60)
        dep.wait_ready(timeout=60)
        entry = dep.supervisor.log[-1]
        assert entry["stage"] == 1 and entry["recovered"] and set(entry["halt_failed"]) == {0}, entry
        assert "was still inside a step 3.75 s into the halt" in entry["halt_failed"][0], entry
        assert entry["sigkilled"] >= 1 and pid_of(dep.actors[0]) != pid0, entry   # its live process, by its pid
        ref = hf_reference("dense", False, SHORT, 4)[0]
        assert [c.generate(list(SHORT), max_new_tokens=4).token_ids for _ in range(2)] == [ref, ref]


DRIVER = r"""
import os, signal, sys, ray, memra_pp
ray.init(address=sys.argv[1], namespace="memra-test", logging_level="ERROR")
dep = memra_pp.connect(sys.argv[2], namespace="memra-test", address=sys.argv[1])
s = dep.client().stream([5, 17, 42], max_new_tokens=500, ignore_eos=True)
next(s)
print("streaming", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_sigkilled_drivers_requests_are_aborted_at_the_intake(kept, tmp_path):
    """A driver that connected to a detached deployment and was SIGKILLed mid-stream: its request ran on to its
    500 tokens and its mailbox stayed. The intake aborts it within a few seconds (stats: reaped, aborted), and the
    deployment serves the others as before. (Stage 1 stalls 4 s once the driver is dead, so that the request is
    still running when the intake looks, however fast this machine decodes.)"""
    import subprocess
    import sys
    dep = kept(DETACHED, detached=True)
    intake = dep.actors[0]
    before = ray.get(intake.stats.remote(), timeout=30)
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    p = subprocess.run([sys.executable, str(script), ray.get_runtime_context().gcs_address, DETACHED],
                       capture_output=True, text=True, timeout=120,
                       cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert "streaming" in p.stdout and p.returncode == -9, (p.stdout, p.stderr[-3000:])
    ray.get(dep.actors[1].inject_stall.remote(4.0), timeout=30)
    until(lambda: ray.get(intake.stats.remote(), timeout=30)["reaped"] > before["reaped"],
          "the dead driver's request was not aborted")
    st = ray.get(intake.stats.remote(), timeout=30)
    assert st["reaped"] == before["reaped"] + 1 and st["aborted"] > before["aborted"], st
    assert st["mailboxes"] == before["mailboxes"], st       # its mailbox forgotten
    assert dep.client().generate(list(SHORT), max_new_tokens=4).token_ids == hf_reference("dense", False, SHORT, 4)[0]


def _pg_state(pg_id: str) -> str | None:
    return ray.util.placement_group_table().get(pg_id, {}).get("state")


def test_a_connected_handle_stops_a_detached_deployment(ray_cluster):
    """shutdown() on a connect()ed handle must stop the deployment for good: the launching process's supervisor
    shuts it down (its restarts stop first: it once restarted the stages a connected handle killed, and the
    detached placement group stayed), the actors and the named placement group go, the launching handle refuses
    further use. Where no launcher answers, the connected handle kills the stages and removes the group itself.
    A handle of an earlier launch of the name stops nothing of a later one ("gone"). The launcher looks for the
    request between its heartbeats (supervisor.STOP_POLL_S): with a heartbeat every 30 s, it answers within
    seconds."""
    from memra_pp.deployment import Deployment
    _, path = tiny_checkpoint("dense", False)
    dep = None
    try:
        cfg = dict(config(path, 2), name="stopme")
        dep = memra_pp.launch(dict(cfg, timeouts={"heartbeat_s": 30.0}), detached=True)
        first = dep._pg.id.hex()
        other = memra_pp.connect("stopme", namespace="memra-test")
        assert other._pg_id == first and other.kv_key("stop") == dep.kv_key("stop")
        want = hf_reference("dense", False, SHORT, 4)[0]
        assert other.client().generate(list(SHORT), max_new_tokens=4).token_ids == want
        t0 = time.monotonic()
        other.shutdown()
        assert other.stopped_by == "launcher" and dep._torn_down and dep.stop_done.is_set()
        assert time.monotonic() - t0 < 15, "the stop request waited for a heartbeat (30 s)"
        with pytest.raises(StageFailed, match="the deployment 'stopme' was shut down"):
            dep.client()
        for i in range(2):
            with pytest.raises(ValueError):
                ray.get_actor(f"stopme.stage{i}")
        assert _pg_state(first) == "REMOVED"
        # again, with a launcher that does not answer (its supervisor stopped): killed from the connected side
        dep = memra_pp.launch(cfg, detached=True)
        second = dep._pg.id.hex()
        assert second != first and not dep._down
        assert other._stop_remote() == "gone"           # the first launch's handle: this one is not its to stop
        assert dep.client().generate(list(SHORT), max_new_tokens=4).token_ids == want
        dep.supervisor.stop()
        other = Deployment.connect("stopme", namespace="memra-test")
        assert other._stop_remote(wait_s=1.0) == "killed"
        for i in range(2):
            with pytest.raises(ValueError):
                ray.get_actor(f"stopme.stage{i}")
        assert _pg_state(second) == "REMOVED"
    finally:
        if dep is not None:
            dep.shutdown()


def test_a_connected_handle_replays_through_a_restart(ray_cluster):
    """With recover: replay, a connect()ed handle's requests survive a stage's loss as launch's own do: its
    RemoteSupervisor reads the launcher's recoveries from the Ray KV, holds what was in flight, looks the new stages
    up and replays it. A stream cut by the loss of the last stage, then of the intake, ends with the reference
    tokens. Before, a connected handle had no supervisor and its requests failed."""
    from memra_pp.supervisor import RemoteSupervisor
    _, path = tiny_checkpoint("dense", False)
    with memra_pp.launch(dict(config(path, 2, recover="replay"), name="replayc"), detached=True) as dep:
        other = memra_pp.connect("replayc", namespace="memra-test")
        assert isinstance(other.supervisor, RemoteSupervisor)
        c = other.client()
        want = hf_reference("dense", False, SHORT, DECODE_NEW)[0]
        for i, how in ((1, "SIGKILL"), (0, "ray.kill")):
            dec = Stream(c, SHORT, DECODE_NEW)
            dec.wait_tokens(3)
            assert dec.t_end is None and len(dec.tokens) < DECODE_NEW, "the stream must still run at the kill"
            kill(dep, i, how)
            dec.join(90)
            assert dec.error is None and dec.tokens == want and dec.finish == "length", (i, dec.error, dec.tokens)
        assert other.supervisor.recovered == dep.supervisor.recovered == 2 and other.supervisor.failure is None
        assert c.generate(list(SHORT), max_new_tokens=4, timeout=60).token_ids == want[:4]
        # the launching process shuts the deployment down under a stream of the connected handle: the stream is
        # held for a replay, and no recovery will come. It ends with StageFailed within seconds, and so does a
        # later request (both waited out their timeout before, and with timeout=inf forever)
        dec = Stream(c, SHORT, 400, ignore_eos=True)
        dec.wait_tokens(3)
        t0 = time.monotonic()
        dep.shutdown()
        dec.join(60)
        assert isinstance(dec.error, StageFailed) and dec.t_end - t0 < 15, (dec.error, dec.t_end and dec.t_end - t0)
        gone = "the deployment 'replayc' was shut down (its placement group is gone): no recovery will replay"
        assert gone in str(dec.error), dec.error
        with pytest.raises(StageFailed, match=re.escape(gone)):
            c.generate(list(SHORT), max_new_tokens=4, timeout=float("inf"))


SHARED_RAY = r"""
import ray
import memra_pp
from memra_pp.defaults import ensure_tiny
from memra_pp.errors import StageFailed

def cfg(name):
    return {"name": name, "model": {"path": str(ensure_tiny())}, "stages": [{"device": "cpu", "num_cpus": 0.1}],
            "scheduler": {"max_batch": 2, "max_context": 64}}
d1, d2 = memra_pp.launch(cfg("one")), memra_pp.launch(cfg("two"))
assert d1.owns_ray and not d2.owns_ray
want = d2.client().generate([5, 17], max_new_tokens=3, timeout=60).token_ids
address = ray.get_runtime_context().gcs_address
d1.shutdown()
assert ray.is_initialized() and ray.get_runtime_context().gcs_address == address
assert d2.client().generate([5, 17], max_new_tokens=3, timeout=60).token_ids == want
d2.shutdown()
assert not ray.is_initialized()
d3 = memra_pp.launch(cfg("three"))
ray.shutdown()                       # the caller's own: the handle refuses, and no cluster starts on its own
try:
    d3.client()
except StageFailed as e:
    print("refused:", e)
assert not ray.is_initialized()
print("OK")
"""


def test_a_handle_shut_down_leaves_ray_to_the_others_of_its_process(tmp_path):
    """Two deployments launched by one process share its Ray: the first owned it, and its shutdown stopped Ray
    under the second, whose next call started a new local cluster and failed with a raw "different cluster"
    error. Ray now stays up while any handle of the process is up, and stops with the last. A handle whose
    process left Ray (ray.shutdown()) refuses with StageFailed instead of starting a cluster. In a process of its
    own: the test session's cluster is not launch's to stop."""
    import subprocess
    import sys
    script = tmp_path / "shared_ray.py"
    script.write_text(SHARED_RAY)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "RAY_ADDRESS": ""})
    assert out.returncode == 0 and out.stdout.splitlines()[-1] == "OK", (out.stdout[-2000:], out.stderr[-3000:])
    assert ("refused: client: this process is no longer connected to the Ray cluster of the deployment 'three' "
            "(ray.shutdown() was called); connect() again") in out.stdout


def test_a_connected_handle_stops_looking_for_an_unreachable_cluster(monkeypatch):
    """refresh_actors (a connected handle's lookup of replaced stages) waits REFRESH_S at most: with the launching
    process killed, ray.get_actor waits for the cluster until Ray ends the process (60 s), and every submit and the
    client's pump hung in it, untyped, until then."""
    import types
    from memra_pp.deployment import Deployment
    d = Deployment.__new__(Deployment)
    d.connected, d._down, d._actors_lock, d.actors = True, False, threading.Lock(), ["old"]
    d.placement, d.plan = types.SimpleNamespace(name="x"), types.SimpleNamespace(stages=[0, 1])
    d.REFRESH_S = 0.3
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_actor", lambda name: time.sleep(30))
    t0 = time.monotonic()
    assert d.refresh_actors() is False and d.actors == ["old"]
    assert time.monotonic() - t0 < 5
    monkeypatch.setattr(ray, "get_actor", lambda name: f"actor {name}")
    assert d.refresh_actors() is True and d.actors == ["actor x.stage0", "actor x.stage1"]
