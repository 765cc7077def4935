"""Prompt steps through the prefill graphs' pieces (model/prefill_graphs.py: the row-wise parts of every layer on
static buffers padded to a token bucket, the mixers' cores eager on the real rows) must compute what the eager
layers compute: fresh prompts, continuing chunks, a mixed step's decode rows, every split. On the CPU the pieces run
uncaptured (capture=False); tests/test_gpu_prefill_graphs.py captures them."""
import pytest
import torch

from conftest_models import tiny_checkpoint
from memra_pp.model import prefill_graphs as pg
from memra_pp.model.batch import StepBatch
from memra_pp.model.local import LocalPipeline
from memra_pp.model.weights import SafetensorsSource
from gaps import worst_gap


def pipelines(kind, splits, max_tokens=300, max_seqs=6):
    _, path = tiny_checkpoint(kind, False)
    src = SafetensorsSource(path)
    eager = LocalPipeline(src, splits, max_seqs=max_seqs)
    pieces = LocalPipeline(src, splits, max_seqs=max_seqs)
    for s in pieces.stages:
        s.set_prefill_graphs(True, max_tokens, capture=False)
    return eager, pieces


def step(slots, starts, counts, sample, ids):
    b = StepBatch(slots, starts, counts, StepBatch.text_positions(starts, counts), sample)
    return b, torch.tensor(ids)


def run_both(eager, pieces, b, ids):
    le, lp = eager.step(b, ids), pieces.step(b, ids)
    assert le.shape == lp.shape
    return (le - lp).abs().max().item()


@pytest.mark.parametrize("kind,splits", [("dense", [(0, 8)]), ("moe", [(0, 3), (3, 8)]),
                                         ("dense", [(0, 2), (2, 5), (5, 8)]), ("moe", [(0, 8)])])
def test_pieces_equal_eager(kind, splits):
    """Fresh prompts (bucket 128), then continuing chunks beside a new prompt (bucket 256), then a mixed step:
    decode rows of two sequences with a third's last chunk; then greedy decode of the filled caches agrees too."""
    eager, pieces = pipelines(kind, splits)
    # step 1: two fresh prompts, 40 + 57 rows -> bucket 128, 31 padding rows
    b, ids = step([0, 1], [0, 0], [40, 57], [False, True], [5 + i % 90 for i in range(97)])
    assert run_both(eager, pieces, b, ids) < 1e-4
    # step 2: both continue (slot 0 its last chunk, slot 1 a one-token chunk: a mixed step's decode row) and a new
    # prompt in slot 2: 33 + 1 + 150 = 184 rows -> bucket 256
    b, ids = step([0, 1, 2], [40, 57, 0], [33, 1, 150], [True, True, False], [7 + i % 80 for i in range(184)])
    assert run_both(eager, pieces, b, ids) < 1e-4
    # step 3: slot 2's last chunk beside decode rows of slots 0 and 1
    b, ids = step([2, 0, 1], [150, 73, 58], [20, 1, 1], [True, True, True], [11 + i % 70 for i in range(22)])
    assert run_both(eager, pieces, b, ids) < 1e-4
    for s in pieces.stages:
        st = s.pgraphs.stats()
        assert st["replays"] == 3 and st["buckets"] == [128, 256], st
    for c_e, c_p in zip(eager.caches, pieces.caches, strict=True):     # the caches the cores wrote agree
        for i in c_e.rec:
            assert (c_e.rec[i] - c_p.rec[i]).abs().max() < 1e-4
        for i in c_e.k:
            assert (c_e.k[i] - c_p.k[i]).abs().max() < 1e-4


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_greedy_through_pieces_equals_eager(kind):
    """Whole generations: chunked prefill (chunks of 48) of three prompts, then decode (eager, no decode graphs)."""
    eager, pieces = pipelines(kind, [(0, 4), (4, 8)])
    prompts = [list(range(3, 120)), [9, 8, 7], list(range(40, 90))]
    te, le = eager.greedy(prompts, 8, chunk=48)
    tp, lp = pieces.greedy(prompts, 8, chunk=48)
    assert tp == te
    assert worst_gap(p for x, y in zip(le, lp, strict=True) for p in zip(x, y, strict=True)) < 5e-4
    assert all(s.pgraphs.replays == 3 for s in pieces.stages)   # three prompt steps (chunks), every stage


def test_steps_the_pieces_do_not_take():
    """Decode-only steps, steps with more rows than the largest bucket, and adapter steps run eagerly."""
    eager, pieces = pipelines("dense", [(0, 8)], max_tokens=100)
    s = pieces.stages[0]
    assert s.pgraphs.buckets == (128,)
    b, ids = step([0], [0], [200], [True], [5 + i % 90 for i in range(200)])     # 200 rows > 128
    assert run_both(eager, pieces, b, ids) < 1e-4
    b, ids = step([0], [200], [1], [True], [6])                                     # decode only
    assert run_both(eager, pieces, b, ids) < 1e-4
    assert s.pgraphs.replays == 0
    b = StepBatch([1], [0], [10], StepBatch.text_positions([0], [10]), [True], [0])   # adapter slot 0
    assert not s.pgraphs.takes(b, 10)
    b, ids = step([1], [0], [10], [True], list(range(10)))
    assert s.pgraphs.takes(b, 10)


def test_buckets_and_buffers_do_not_grow_with_layers():
    """Buckets up to the stage's largest step; the static buffers are one set per mixer kind, not per layer."""
    _, pieces = pipelines("moe", [(0, 8)], max_tokens=1000)
    g = pieces.stages[0].pgraphs
    assert g.buckets == tuple(b for b in pg.TOKEN_BUCKETS if b <= 1024)
    assert sorted(g.P) == [False, True] and sorted(g.o) == [False, True]
    assert all(t is None or t.shape[0] == 1024 for bufs in g.pre.values() for t in bufs)


def test_steps_past_the_row_cap_run_eagerly(monkeypatch):
    """Buckets stop at MAX_ROWS whatever the stage's largest step: larger steps are device-bound (PERF)."""
    monkeypatch.setattr(pg, "MAX_ROWS", 256)
    eager, pieces = pipelines("dense", [(0, 8)], max_tokens=5000)
    g = pieces.stages[0].pgraphs
    assert g.buckets == (128, 256)
    b, ids = step([0], [0], [300], [True], [5 + i % 90 for i in range(300)])
    assert not g.takes(b, 300)
    assert run_both(eager, pieces, b, ids) < 1e-4 and g.replays == 0


def test_a_failed_capture_leaves_prompt_steps_eager(monkeypatch):
    """A bucket whose capture fails (raised before any core ran) drops the prefill graphs with a warning naming
    why; that step and the later ones run eagerly and compute what the eager layers compute; at load, the same."""
    from memra_pp.model.decode_graphs import CaptureFailed

    def no_room(self, nb):
        raise CaptureFailed(f"prefill graph capture ({nb} rows) failed: RuntimeError: no room")
    eager, pieces = pipelines("moe", [(0, 4), (4, 8)])
    monkeypatch.setattr(pg.PrefillGraphs, "_build", no_room)
    b, ids = step([0, 1], [0, 0], [40, 57], [False, True], [5 + i % 90 for i in range(97)])
    with pytest.warns(UserWarning, match="no room; prompt steps run eagerly"):
        assert run_both(eager, pieces, b, ids) < 1e-4
    for s in pieces.stages:
        assert s.pgraphs is None and "(128 rows)" in s.pgraphs_failed and "no room" in s.pgraphs_failed
    b, ids = step([0, 1], [40, 57], [1, 1], [True, True], [7, 8])
    assert run_both(eager, pieces, b, ids) < 1e-4
    s = pieces.stages[0]
    s.set_prefill_graphs(True, 300, capture=False)
    with pytest.warns(UserWarning, match="no room"):
        assert s.capture_prefill_graphs() == 0
    assert s.pgraphs is None and "no room" in s.pgraphs_failed
