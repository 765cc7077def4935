"""The intake aborts the requests of a driver that ended without closing its clients (stages/drivers.py): in
process against a StageRunner, and end to end with a SIGKILLed driver process of a detached deployment."""
import os
import subprocess
import sys
import time
import types

from memra_pp.model.sampling import SamplingParams
from memra_pp.scheduler import Event, Request, Scheduler
from memra_pp.stages import drivers
from memra_pp.stages.runner import StageRunner


def _runner():
    r = StageRunner()
    r.index, r.spec = 0, types.SimpleNamespace(intake=True)
    r.scheduler = Scheduler(4, 1, 16, 64)
    r._reaper = "not started"       # (the test calls reap() itself)
    return r


def test_only_a_stale_group_whose_job_has_ended_is_reaped(monkeypatch):
    """Groups "a" and "b" hold requests; "c" is "a"'s job too but holds none. Only a group that has not polled for
    STALE_S is looked up, and only one whose job Ray says has ended loses its requests (aborted through the
    intake's inbox, as a client's abort) and its clients' mailboxes; a stale group with a live job keeps both."""
    r = _runner()
    asked = []
    monkeypatch.setattr(drivers, "dead_jobs", lambda jobs: (asked.append(sorted(jobs)), {"job-a"} & jobs)[1])
    for rid, client, job in (("a1", "a.1", "job-a"), ("a2", "a.2", "job-a"), ("b1", "b.1", "job-b")):
        r.scheduler.add(Request(rid, client, [1, 2, 3], 4, SamplingParams()))
        r._driver_seen(client.split(".")[0], job)
    r._driver_seen("c", "job-a")
    r.mail.post([Event("a.1", "a1", [7], [0.0], None, None), Event("b.1", "b1", [7], [0.0], None, None)])
    assert r.reap() == 0 and asked == []            # every group polled or submitted just now: nobody asked

    def last_seen(group, ago):                      # (backdated, not slept: a slow machine cannot move a window)
        r._seen[group] = time.monotonic() - ago
    for g in ("a", "c"):
        last_seen(g, 2 * r.STALE_S)                 # b polled just now: not stale
    assert r.reap() == 2 and asked == [["job-a"]]   # (c holds no request and no mailbox: not looked up)
    assert [r.inbox.get_nowait() for _ in range(2)] == [("abort", "a1"), ("abort", "a2")] and r.inbox.empty()
    assert len(r.mail) == 1 and r.mail.poll("b", 0) and r.reaped == 2
    last_seen("b", 2 * r.STALE_S)
    assert r.reap() == 0 and asked[-1] == ["job-b"]  # b stale now, its job alive: it keeps its request
    assert r.inbox.empty() and time.monotonic() - r._seen["b"] < r.STALE_S    # and is looked up again STALE_S on


DRIVER = r"""
import os, signal, sys, ray, memra_pp
ray.init(address=sys.argv[1], namespace="memra-test", logging_level="ERROR")
dep = memra_pp.connect(sys.argv[2], namespace="memra-test", address=sys.argv[1])
s = dep.client().stream([5, 17, 42], max_new_tokens=4000, ignore_eos=True)
next(s)
print("streaming", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_sigkilled_drivers_requests_are_aborted_at_the_intake(ray_cluster, tmp_path):
    """A driver that connected to a detached deployment and was SIGKILLed mid-stream: its request ran on to its
    4,000 tokens and its mailbox stayed. The intake aborts it within a few seconds (stats: reaped, aborted), and the
    deployment serves the others as before."""
    import ray

    import memra_pp
    from conftest_models import hf_reference, tiny_checkpoint
    _, path = tiny_checkpoint("dense", False)
    cfg = {"name": "reap", "model": {"path": str(path)}, "stages": [{"device": "cpu", "num_cpus": 0.1}] * 2,
           "timeouts": {"heartbeat_s": 0.5}}
    with memra_pp.launch(cfg, detached=True) as dep:
        intake = dep.actors[0]
        script = tmp_path / "driver.py"
        script.write_text(DRIVER)
        p = subprocess.run([sys.executable, str(script), ray.get_runtime_context().gcs_address, "reap"],
                           capture_output=True, text=True, timeout=120,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        assert "streaming" in p.stdout and p.returncode == -9, (p.stdout, p.stderr[-3000:])
        t0 = time.monotonic()
        while ray.get(intake.stats.remote(), timeout=30)["reaped"] < 1:
            assert time.monotonic() - t0 < 30, "the dead driver's request was not aborted"
            time.sleep(0.1)
        st = ray.get(intake.stats.remote(), timeout=30)
        assert st["reaped"] == 1 and st["aborted"] >= 1 and st["mailboxes"] == 0, st
        ref = hf_reference("dense", False, (5, 17, 42), 4)[0]
        assert dep.client().generate([5, 17, 42], max_new_tokens=4).token_ids == ref
