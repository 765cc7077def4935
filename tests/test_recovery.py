"""A stage's halt (the supervisor's recovery) makes a fresh cache: a stage that decodes through graphs must decode
through graphs over the new cache after it, never over the old one. Driven on a StageRunner without Ray."""
import types

import torch

from conftest_models import tiny_checkpoint
from memra_pp.model.batch import StepBatch
from memra_pp.model.decode_graphs import DecodeGraphs
from memra_pp.model.stage_model import StageModel
from memra_pp.model.weights import SafetensorsSource
from memra_pp.stages.runner import StageRunner


def model():
    _, path = tiny_checkpoint("dense", False)
    src = SafetensorsSource(path)
    return StageModel(src.config, 0, 8, intake=True, primary=True).load(src)


def steps(m, cache, ids=(5, 6, 7, 9, 11)):
    """A 3-token prefill, then two decode steps: the last logits of each."""
    out = []
    for start, toks in ((0, ids[:3]), (3, ids[3:4]), (4, ids[4:])):
        b = StepBatch([0], [start], [len(toks)], StepBatch.text_positions([start], [len(toks)]), [True])
        out.append(m(b, m.embed_ids(torch.tensor(list(toks))), cache))
    return out


def test_halt_rebuilds_the_decode_graphs_over_the_new_cache(monkeypatch):
    import weakref
    r = StageRunner()
    r.model = model()
    r.placement = types.SimpleNamespace(scheduler=types.SimpleNamespace(max_batch=2, max_context=512))
    r.spec = types.SimpleNamespace(intake=False)
    r.cache = r.model.new_cache(2, 512)
    r.model.graphs = DecodeGraphs(r.model, r.cache, 2, capture=False)
    steps(r.model, r.cache, (1, 2, 3, 4, 8))          # the old cache holds another sequence in slot 0
    old, old_graphs = weakref.ref(r.cache), weakref.ref(r.model.graphs)
    alive = []
    make = r.model.new_cache
    monkeypatch.setattr(r.model, "new_cache", lambda *a: (alive.append((old(), old_graphs())), make(*a))[1])
    r.cache.grown = 3                   # as if its pools had grown three times
    r.halt(1, "stage 1 is lost")
    assert alive == [(None, None)]      # the old graphs and the old cache were released before the new cache
    assert r.cache.grown == 0 and r.kv_growths() == 3     # the stage's count survives the fresh cache
    g = r.model.graphs
    assert g is not None and g.cache is r.cache and not g.capture and g.captures == 0
    eager = model()
    want = steps(eager, eager.new_cache(2, 512))
    got = steps(r.model, r.cache)
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(got, want))
    assert g.replays == 2 and g.captures == 1          # the decode steps ran through a graph, captured on first use


def stuck_loop(name: str, gate=None, wait_s: float = 30.0):
    """A stage loop as halt() finds it: its thread (named `name`, started) still inside a step until `gate` is set
    or `wait_s` has passed."""
    import threading
    gate = gate if gate is not None else threading.Event()
    loop = types.SimpleNamespace(stopping=threading.Event(), ring_thread=None,
                                 thread=threading.Thread(target=gate.wait, args=(wait_s,), name=name))
    loop.thread.start()
    return loop


def test_a_halt_whose_loop_is_still_inside_a_step_fails_and_keeps_the_old_state():
    """An intake whose loop is still inside a step when halt() stops waiting for it (HALT_JOIN_S, or half of
    timeouts.step_s) must not carry on: that step would end in the fresh cache and scheduler (it once failed the
    recovered deployment's requests with "stage 1 is lost"). The halt ends this stage's requests as ever, then
    raises StageFailed naming the stage and the thread, and makes nothing fresh: the supervisor restarts it."""
    import threading

    import pytest

    from memra_pp.errors import StageFailed
    from memra_pp.model.sampling import SamplingParams
    from memra_pp.scheduler import Request, Scheduler
    r = StageRunner()
    r.index = 0
    r.spec = types.SimpleNamespace(intake=True)
    r.placement = types.SimpleNamespace(scheduler=types.SimpleNamespace(max_batch=2, max_context=64),
                                        timeouts=types.SimpleNamespace(step_s=60.0))
    r.scheduler = sched = Scheduler(2, 1, 16, 64)
    sched.add(Request("held", "g.c", [1, 2, 3], 4, SamplingParams()))
    r.cache = cache = object()
    gate = threading.Event()
    r.loop = stuck_loop("memra-intake-0", gate)
    r.HALT_JOIN_S = 0.2
    try:
        with pytest.raises(StageFailed) as e:
            r.halt(1, "stage 1 is lost")
    finally:
        gate.set()
    assert e.value.stage == 0 and "memra-intake-0 was still inside a step 0.2 s into the halt" in str(e.value)
    assert "this stage is restarted too" in str(e.value)
    evs = r.mail._boxes.get("g.c", [])
    assert [(x[0], x[3], x[4][0]) for x in evs] == [("held", "error", "StageFailed")], evs    # its request ended
    assert r.scheduler is sched and r.cache is cache and r.loop is None     # nothing fresh for the old step
    r.placement.timeouts.step_s = 0.2       # half of step_s where that is less: the supervisor waits step_s
    r.loop = stuck_loop("t", wait_s=2)
    r.HALT_JOIN_S = 10.0
    with pytest.raises(StageFailed, match="t was still inside a step 0.1 s into the halt"):
        r.halt(1, "stage 1 is lost")
