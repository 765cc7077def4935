"""Engine and ContextId on CPU: a context is the process; ids never match across processes."""
import multiprocessing as mp
import os
import pickle
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from memra_pp.engine import ContextId, Engine, cpu_context, parse_device, process_counters, residency_of
from memra_pp.errors import ConfigError


def _child_context() -> ContextId:
    return Engine("cpu").ctx


@pytest.fixture(scope="module")
def child():
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as ex:
        yield ex


def test_two_cpu_engines_in_one_process_share_one_context():
    """Two engines on one device of one process must share ONE context."""
    a, b = Engine("cpu"), Engine(torch.device("cpu"))
    assert a.ctx == b.ctx == cpu_context()
    assert a.ctx.pid == os.getpid() and a.ctx.device == "cpu" and not a.is_cuda and a.stream is None
    assert a.ctx.is_local()


def test_context_id_str_is_readable():
    """A ContextId must print its device, uid, pid and node."""
    c = ContextId("host-a", 42, "cuda:1", 7)
    assert str(c) == "cuda:1 ctx#7 (pid 42 on host-a)"


def test_another_process_is_another_context(child):
    """The same device in two processes must be two contexts, never local in the other process."""
    theirs = child.submit(_child_context).result(timeout=120)
    mine = Engine("cpu").ctx
    assert theirs != mine and theirs.pid != mine.pid
    assert not theirs.is_local()
    forged = ContextId(mine.node, theirs.pid, mine.device, mine.uid)  # same uid, other process
    assert forged != mine and not forged.is_local()


def test_residency_of_cpu_tensor_is_the_process():
    """A CPU tensor must live in the process's context whatever engine is asked."""
    assert residency_of(torch.zeros(3), Engine("cpu")) == cpu_context()


@pytest.mark.parametrize("bad", ["tpu", "gpu:0", "meta"])
def test_unknown_device_is_refused(bad):
    """An unknown device string must be refused with ConfigError naming it."""
    with pytest.raises(ConfigError, match=repr(bad).replace("'", ".")):
        parse_device(bad)


def test_engine_does_not_pickle():
    """An Engine is process-local and must refuse to travel; its ContextId travels."""
    e = Engine("cpu")
    with pytest.raises(TypeError, match="cannot be pickled: send its .ctx"):
        pickle.dumps(e)
    assert pickle.loads(pickle.dumps(e.ctx)) == e.ctx


def test_counters_start_at_zero_per_engine():
    """Per-engine counters must start at zero; the process counter object must be one per process."""
    e = Engine("cpu")
    assert (e.counters.splices, e.counters.publications) == (0, 0)
    assert process_counters() is process_counters()


def test_a_cpu_engine_owns_no_tensor_and_is_never_current():
    """Engine.owns / is_current must answer False for a CPU engine (they speak for CUDA contexts only): its checks
    go the full way."""
    e = Engine("cpu")
    assert not e.owns(torch.zeros(3)) and not e.is_current()
