"""A Ctrl-C or SIGTERM while a launch starts Ray (Deployment._ray_up; rayutil.SignalsHeld), driven without a cluster:
ray.init is a fake that receives the signal in the middle of its work. Before, Ctrl-C raised inside Ray's start
(`memra-pp launch` ended with SIGSEGV) and SIGTERM met ray.init's sys.exit (exit 15, no message), and Ray's agent
processes stayed up to two minutes. Now the signal waits until ray.init has returned, then the cluster goes and the
signal takes its course."""
import os
import signal
import types

import pytest
import ray
import ray._private.utils as ray_utils

import memra_pp.cli as cli
import memra_pp.deployment as deployment
from memra_pp.deployment import Deployment


def _placement():
    return types.SimpleNamespace(name="sig", stages=[types.SimpleNamespace(num_cpus=0.1)] * 2,
                                 ray=types.SimpleNamespace(address="local", namespace="memra-test", listen=None))


def ray_term_a(signum, frame):     # the SIGTERM handlers ray.init installs (its own first, then its head node's)
    raise AssertionError("ray.init's first SIGTERM handler is replaced by its node's")


def ray_term_b(signum, frame):
    raise SystemExit(1)


@pytest.fixture
def fake_ray(monkeypatch):
    events = []

    def init(*a, **kw):
        ray_utils.set_sigterm_handler(ray_term_a)
        if fake_ray_signal:
            os.kill(os.getpid(), fake_ray_signal[0])     # delivered at once to a handler in place, if any
            events.append("signalled")
        ray_utils.set_sigterm_handler(ray_term_b)
        events.append("init returned")
    fake_ray_signal = []
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "shutdown", lambda: events.append("shutdown"))
    term, intr = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    # as a terminal's foreground process has them: a suite started in the background (`pytest &` in a script)
    # inherits SIGINT ignored, which SignalsHeld leaves ignored (test_a_signal_ignored_on_entry_stays_ignored)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    yield events, fake_ray_signal
    signal.signal(signal.SIGTERM, term)
    signal.signal(signal.SIGINT, intr)
    assert ray_utils.set_sigterm_handler.__module__ == "ray._private.utils"       # Ray's own again


def test_ctrl_c_while_ray_starts_is_raised_after_it_and_the_cluster_goes(fake_ray):
    events, sig = fake_ray
    sig.append(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt):
        Deployment._ray_up(_placement())
    assert events == ["signalled", "init returned", "shutdown"], events
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    assert signal.getsignal(signal.SIGTERM) is ray_term_b      # as ray.init leaves it


def test_sigterm_while_a_command_starts_ray_is_its_ctrl_c(fake_ray, monkeypatch):
    """A launching command's hook makes SIGTERM Ctrl-C once Ray is up (cli._sigterm_is_ctrl_c): a SIGTERM held
    through the start reaches that hook's handler, not ray.init's sys.exit."""
    events, sig = fake_ray
    sig.append(signal.SIGTERM)
    monkeypatch.setattr(deployment, "AFTER_RAY_INIT", [cli._sigterm_is_ctrl_c])
    monkeypatch.setattr(cli, "_TERM_SEEN", False)
    with pytest.raises(KeyboardInterrupt):
        Deployment._ray_up(_placement())
    assert events == ["signalled", "init returned", "shutdown"] and cli._TERM_SEEN, events


def test_a_start_without_signals_leaves_rays_handler(fake_ray):
    events, _ = fake_ray
    assert Deployment._ray_up(_placement()) is True
    assert events == ["init returned"] and signal.getsignal(signal.SIGTERM) is ray_term_b, events


def test_a_signal_ignored_on_entry_stays_ignored(fake_ray):
    """A launch started with SIGINT ignored (a background job of a script) is not made interruptible by it."""
    events, sig = fake_ray
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sig.append(signal.SIGINT)
    assert Deployment._ray_up(_placement()) is True
    assert events == ["signalled", "init returned"], events
    assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_a_launch_that_would_start_ray_in_another_thread_is_refused(fake_ray):
    """(Was a defect.) Ray started from a thread served until that thread ended; the deployment's shutdown then
    waited 60 s for Ray's GCS and Ray ended the process with exit 1. Such a launch is refused before Ray starts."""
    import threading
    from memra_pp.errors import ConfigError
    events, _ = fake_ray
    out = []

    def run():
        try:
            out.append(Deployment._ray_up(_placement()))
        except ConfigError as e:
            out.append(e)
    t = threading.Thread(target=run, name="worker-7")
    t.start()
    t.join(10)
    assert isinstance(out[0], ConfigError) and events == [], (out, events)
    assert str(out[0]) == ("memra_pp.launch('sig') from thread 'worker-7' would start Ray there: launch from the main "
                           "thread (or call ray.init() in the main thread first; a launch onto Ray already up may run "
                           "in any thread)")


def test_a_launch_attaching_from_another_thread_is_left_alone(fake_ray, monkeypatch):
    """Attaching to a running cluster starts no Ray process (whose parent-death signal would follow the thread):
    allowed from any thread."""
    import threading
    events, _ = fake_ray
    monkeypatch.setattr(deployment, "attach", lambda address, namespace: events.append(("attach", address)))
    p = _placement()
    p.ray.address = "10.0.0.1:6379"
    out = []
    t = threading.Thread(target=lambda: out.append(Deployment._ray_up(p)))
    t.start()
    t.join(10)
    assert out == [True] and events == [("attach", "10.0.0.1:6379")], (out, events)
