"""rayutil.kill_actor: a stage that stops answering is SIGKILLed by its process where that process is the one its
setup named (same Ray node, same pid and start time), then ray.kill'ed; Ray alone gave such a worker about 5 s, and a
restart's new actor waited that long for its bundle. A pid now another process's, or another node's, is never sent a
signal."""
import signal
import subprocess
import sys
import types

import pytest

from memra_pp import rayutil


@pytest.fixture
def child(monkeypatch):
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    killed = []
    monkeypatch.setattr(rayutil.ray, "get_runtime_context", lambda: types.SimpleNamespace(get_node_id=lambda: "n1"))
    monkeypatch.setattr(rayutil.ray, "kill", lambda a: killed.append(a))
    yield p, killed
    p.kill()
    p.wait()


def ident(p, **kw):
    return {"node": "n1", "pidns": rayutil._pidns(), "pid": p.pid, "start": rayutil._start_time(p.pid)} | kw


def test_a_stopped_stage_on_this_node_is_sigkilled_then_ray_killed(child):
    p, killed = child
    p.send_signal(signal.SIGSTOP)
    assert rayutil.kill_actor("actor", ident(p)) is True
    assert p.wait(10) == -signal.SIGKILL and killed == ["actor"]
    assert rayutil._start_time(p.pid) is None          # reaped: gone; a zombie reads as gone too


@pytest.mark.parametrize("why", ["another start time (the pid reused)", "another node", "another pid namespace",
                                 "no start time", "none", "no Ray context"])
def test_a_process_that_is_not_the_stage_is_never_signalled(child, monkeypatch, why):
    p, killed = child
    proc = {"another start time (the pid reused)": ident(p, start=(rayutil._start_time(p.pid) or 0) + 1),
            "another node": ident(p, node="n2"), "another pid namespace": ident(p, pidns=-1),
            "no start time": ident(p, start=None), "none": None, "no Ray context": ident(p)}[why]
    if why == "no Ray context":
        monkeypatch.setattr(rayutil.ray, "get_runtime_context", lambda: 1 / 0)
    assert rayutil.kill_actor("actor", proc) is False
    assert p.poll() is None and killed == ["actor"]      # alive, and Ray's kill still asked
