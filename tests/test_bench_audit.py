"""`memra-pp bench`'s figures computed by hand: the percentile, the run's wall time, a failing run, and the inputs
the benchmark scripts refuse, on synthetic event streams and a fake deployment (no Ray)."""
import contextlib
import random
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from memra_pp import bench
from memra_pp.bench import _pct, format_report, run_bench, token_latencies
from memra_pp.errors import InputError, StageFailed
from memra_pp.stages.slots import nearest_rank


def test_pct_is_the_nearest_rank_percentile():
    """_pct must be the nearest-rank percentile (the ceil(q * n)-th smallest), as the report's handoff figures
    are: the median of two samples is the smaller, and the p99 of 1..100 is 99, not the maximum."""
    assert _pct([2.0, 1.0], 0.5) == 1.0
    assert _pct([4, 1, 3, 2], 0.5) == 2
    assert _pct(range(1, 101), 0.99) == 99 and _pct(range(1, 201), 0.99) == 198
    assert _pct([7.0], 0.5) == _pct([7.0], 0.99) == 7.0 and _pct([], 0.5) == 0.0
    rng = random.Random(0)
    for n in (1, 2, 3, 4, 10, 99, 100, 101, 1000):
        xs = [rng.random() for _ in range(n)]
        assert _pct(xs, 0.5) == nearest_rank(xs, 0.5) and _pct(xs, 0.99) == nearest_rank(xs, 0.99), n


def test_two_requests_report_their_median_not_their_maximum():
    """Inter-token samples 0.1, 0.2, 0.2, 0.1 (a 0.4 s gap carried two tokens): p50 0.1 (two of four at or below
    it), p99 0.2; two requests' times per output token 0.1 and 0.3: p50 0.1, p99 0.3."""
    a = (0.0, [(1.0, 1), (1.1, 1), (1.5, 2), (1.6, 1)])
    r = token_latencies([a])
    assert r["itl_p50_s"] == pytest.approx(0.1) and r["itl_p99_s"] == pytest.approx(0.2)
    r = token_latencies([(0.0, [(1.0, 1), (1.1, 1)]), (0.0, [(1.0, 1), (1.3, 1)])])
    assert r["tpot_p50_s"] == pytest.approx(0.1) and r["tpot_p99_s"] == pytest.approx(0.3)


class _Client:
    def __init__(self, dep):
        self.dep, self.closed = dep, threading.Event()

    def stream(self, prompt, max_new_tokens, ignore_eos):
        for i in range(max_new_tokens):
            if self.closed.is_set():
                raise StageFailed("the client was closed")
            if self.dep.fail_after is not None and i == self.dep.fail_after and prompt == self.dep.prompts[0]:
                raise StageFailed("stage 1 failed: lost")
            time.sleep(self.dep.step_s)
            yield types.SimpleNamespace(token_ids=[7])

    def close(self):
        self.closed.set()


class _Dep:
    """What run_bench touches of a deployment: one stage, requests streamed at step_s a token."""
    vocab_size = 64
    model_config = types.SimpleNamespace(vision=None)
    placement = types.SimpleNamespace(scheduler=types.SimpleNamespace(prefill_chunk=512, prefill_chunk_decoding=None))

    def __init__(self, step_s=0.01, stats_s=0.0, fail_after=None, stage=None):
        self.step_s, self.stats_s, self.fail_after, self.prompts = step_s, stats_s, fail_after, []
        self.stage = stage or {"index": 0, "device": "cpu", "layers": [0, 4], "busy": 0.5, "busy_s": 0.1,
                               "wall_s": 0.2, "microbatches": 3, "phase_s": {"model": 0.1}, "handoffs": 0,
                               "handoff_p50_us": 0.0, "handoff_p99_us": 0.0}
        self.clients = []

    def client(self):
        self.clients.append(_Client(self))
        return self.clients[-1]

    def stage_actor(self, i):
        return None

    def stats(self, reset=False, timeline=False):
        if threading.current_thread() is not threading.main_thread():     # run_bench's watcher
            if self.fail_after is not None:
                raise StageFailed("stage 1 failed: lost")
            time.sleep(self.stats_s)
        return {"stages": [dict(self.stage)]}


@contextlib.contextmanager
def thread_errors():
    """The exceptions raised in threads inside the block (pytest puts its own hook back after each phase)."""
    errors, old = [], threading.excepthook
    threading.excepthook = errors.append
    try:
        yield errors
    finally:
        threading.excepthook = old


@pytest.fixture
def fake(monkeypatch):
    """A maker of fake deployments whose `prompts` are the ones run_bench drew."""
    monkeypatch.setattr(bench, "actor_call_us", lambda actor: (1.0, 2.0))
    made, real = [], bench.bench_prompts

    def prompts(*a, **k):
        made[-1].prompts = real(*a, **k)
        return made[-1].prompts
    monkeypatch.setattr(bench, "bench_prompts", prompts)

    def make(**kw):
        made.append(_Dep(**kw))
        return made[-1]
    return make


def test_wall_time_ends_with_the_last_request(fake):
    """tokens/s end to end must be the tokens over the time until the last request ended: the watcher's stats
    calls (0.4 s each here, a stage answering late) must not count in it (they made a 0.1 s run 0.5 s)."""
    dep = fake(step_s=0.02, stats_s=0.4)
    r = run_bench(dep, 1, 8, 5, warm=False)
    assert r["generated_tokens"] == 5 and r["wall_s"] < 0.3, r["wall_s"]
    assert r["tokens_per_s"] == pytest.approx(5 / r["wall_s"])
    assert r["request_latency_p50_s"] <= r["wall_s"]


def test_a_failing_run_raises_its_error_alone_and_closes_its_client(fake):
    """A request that fails mid-run (a lost stage) must end run_bench with that typed error, without a traceback
    from the watcher thread (its stats call fails too), and with the client closed: the other requests end now."""
    dep = fake(step_s=0.01, fail_after=3)
    t = time.perf_counter()
    with thread_errors() as errors, pytest.raises(StageFailed, match="stage 1 failed"):
        run_bench(dep, 3, 8, 400, warm=False)
    assert time.perf_counter() - t < 2.0, "the other requests streamed on to their 400 tokens"
    assert errors == [] and dep.clients[-1].closed.is_set()


def test_a_recovering_stage_leaves_no_traceback(fake):
    """A stage still recovering (replay) answers stats without its loop's figures: the watcher must not raise a
    KeyError in its thread; the run's figures come back."""
    dep = fake(stage={"index": 0, "device": "cpu", "layers": [0, 4], "busy": 0.0, "microbatches": 0,
                      "handoffs": 0, "handoff_p50_us": 0.0, "handoff_p99_us": 0.0})
    with thread_errors() as errors:
        r = run_bench(dep, 2, 8, 6, warm=False)
    assert r["generated_tokens"] == 12 and errors == [], errors
    assert r["ramp_busy"] == [0.0]


def test_run_bench_refuses_no_requests(fake):
    """concurrency 0 must be an InputError naming it (it was the thread pool's ValueError)."""
    for bad in (0, -1, 2.5):
        with pytest.raises(InputError, match="concurrency"):
            run_bench(fake(), bad, 8, 4, warm=False)


def test_report_names_the_prompt_spread(fake):
    """The printed report must say the prompt lengths were spread (it read "(16 in" for prompts of 8 to 24)."""
    r = run_bench(fake(), 2, 16, 3, warm=False, prompt_spread=0.5)
    assert "(16 +-50% in, 3 out)" in format_report(r)
    r = run_bench(fake(), 2, 16, 3, warm=False)
    assert "(16 in, 3 out)" in format_report(r)


def test_decode_budget_refuses_a_budget_past_the_chunk_before_any_launch(monkeypatch, capsys):
    """benchmarks/decode_budget.py --decoding off,1024 --prefill-chunk 512: the placement refuses 1024, but only
    at that budget's launch, after the first budget's run, whose figures were then lost. It must refuse at once."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    import decode_budget
    import memra_pp

    def launch(cfg):
        raise AssertionError("launched before the arguments were checked")
    monkeypatch.setattr(memra_pp, "launch", launch)
    for bad in ("off,1024", "0", "-4,32"):
        monkeypatch.setattr(sys, "argv", ["decode_budget.py", "--prefill-chunk", "512", f"--decoding={bad}"])
        with pytest.raises(SystemExit) as e:
            decode_budget.main()
        assert e.value.code == 2 and "from 1 to --prefill-chunk (512)" in capsys.readouterr().err
