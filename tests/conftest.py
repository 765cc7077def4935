import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
# One intra-op thread for torch in this process (and the checks it starts), read when torch loads: the tests' tensors
# are tiny, so a second OpenMP thread only spins (measured: the same wall time, a third less CPU), and that CPU is
# what the interpreter checks in the background (tests/interp.py) run on. The stages set their own (deployment.py).
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest


def pytest_configure(config):
    """The MEMRA_PP_* switches this process runs with, checked strictly once (the modules read them leniently at
    import: switches.initial): a typo in one stops the session with its ConfigError instead of testing the default."""
    from memra_pp import switches
    switches.check_environment()


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster for the session (2 logical CPUs as in CI; stages ask for fractions)."""
    import ray
    ray.init(num_cpus=2, include_dashboard=False, namespace="memra-test", logging_level="WARNING",
             log_to_driver=True)
    yield
    ray.shutdown()


@pytest.fixture
def oom_on_new_zeros(monkeypatch):
    """arm() makes torch.Tensor.new_zeros (how the KV pools grow) raise OutOfMemoryError on its state["fail"]-th
    call from then on, counted in state["n"] (set both to re-arm); returns that state."""
    import torch
    real = torch.Tensor.new_zeros

    def arm(fail: int = 2) -> dict:
        state = {"n": 0, "fail": fail}

        def flaky(t, *a, **k):
            state["n"] += 1
            if state["n"] == state["fail"]:
                raise torch.OutOfMemoryError("injected")
            return real(t, *a, **k)
        monkeypatch.setattr(torch.Tensor, "new_zeros", flaky)
        return state
    return arm


@pytest.fixture
def graphs_per_kv_bucket(monkeypatch):
    """decode_graphs.ANY_KV off, whatever MEMRA_PP_ANY_KV_GRAPHS says: one graph per (batch, KV-length) bucket, as
    the tests that count graphs by key expect (those of ANY_KV turn it on themselves, after this)."""
    import memra_pp.model.decode_graphs as dg
    monkeypatch.setattr(dg, "ANY_KV", False)


# -- the Triton-interpreter checks in the background (tests/interp.py) -------------------------------------------
@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    """The tests that read an interpreter check run last, so that their checks have the session to run in."""
    marked = [i for i in items if i.get_closest_marker("interpreter")]
    if marked:
        items[:] = [i for i in items if not i.get_closest_marker("interpreter")] + marked


def pytest_collection_finish(session):
    """Starts the selected tests' checks in the background (none for --collect-only)."""
    if session.config.option.collectonly:
        return
    import interp
    names = []
    for item in session.items:
        m = item.get_closest_marker("interpreter")
        if m is not None and m.args[0] not in names:
            assert m.args[0] in interp.CHECKS, f"{item.nodeid}: no interpreter check named {m.args[0]!r}"
            names.append(m.args[0])
    # beside other tests under SCHED_IDLE; where only these tests were selected, at normal priority
    interp.start(names, idle=not all(i.get_closest_marker("interpreter") for i in session.items))


def pytest_sessionfinish(session):
    import interp
    if interp.BACKGROUND is not None:
        interp.BACKGROUND.close()


def pytest_terminal_summary(terminalreporter):
    import interp
    if interp.BACKGROUND is not None:
        terminalreporter.write_line(interp.BACKGROUND.summary())
