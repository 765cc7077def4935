"""On a GPU: prompt steps through captured prefill graphs (model/prefill_graphs.py) equal the same pieces run
uncaptured bit for bit, and the eager layers within float32 rounding; whole generations agree."""
import pytest
import torch

from conftest_models import tiny_checkpoint
from memra_pp.model.batch import StepBatch
from memra_pp.model.local import LocalPipeline
from memra_pp.model.weights import SafetensorsSource

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cuda():
    assert torch.cuda.is_available(), "this test needs a CUDA GPU (it is selected with -m gpu, never skipped)"
    return torch.device("cuda:0")


def pipe(src, splits, dtype, cuda, graphs=None, max_seqs=6):
    p = LocalPipeline(src, splits, dtype=dtype, device=cuda, max_seqs=max_seqs)
    if graphs is not None:
        for s in p.stages:
            s.set_prefill_graphs(True, 300, capture=graphs)
    return p


STEPS = [  # fresh prompts (bucket 128); continuing chunks, a decode row and a new prompt (256); a last chunk + decode
    ([0, 1], [0, 0], [40, 57], [False, True]),
    ([0, 1, 2], [40, 57, 0], [33, 1, 150], [True, True, False]),
    ([2, 0, 1], [150, 73, 58], [20, 1, 1], [True, True, True]),
]


def run_steps(p, cuda, steps=STEPS):
    outs = []
    for slots, starts, counts, sample in steps:
        b = StepBatch(slots, starts, counts, StepBatch.text_positions(starts, counts), sample)
        ids = torch.tensor([5 + (7 * i) % 90 for i in range(sum(counts))])
        outs.append(p.step(b, ids))
    torch.cuda.synchronize()
    return outs


@pytest.mark.parametrize("kind,splits", [("dense", [(0, 3), (3, 8)]), ("moe", [(0, 2), (2, 5), (5, 8)])])
def test_captured_pieces(cuda, kind, splits):
    """bf16 only (a fresh machine tunes fla's kernels for each dtype, minutes of this test's time)."""
    _, path = tiny_checkpoint(kind, False)
    src = SafetensorsSource(path)
    print(f"{kind} {splits}: loading", flush=True)
    g = pipe(src, splits, torch.bfloat16, cuda, graphs=True)
    cap = run_steps(g, cuda)
    unc = run_steps(pipe(src, splits, torch.bfloat16, cuda, graphs=False), cuda)
    eag = run_steps(pipe(src, splits, torch.bfloat16, cuda), cuda)
    # captured and uncaptured pieces run the same kernels on the same shapes: bit-equal
    for a, b in zip(cap, unc, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()
    worst = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(cap, eag, strict=True))
    agree = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in zip(cap, eag, strict=True))
    rows = sum(a.shape[0] for a in cap)
    print(f"{kind} {splits}: captured vs eager bf16 logits, worst {worst:.2e} of the largest; argmax {agree}/{rows}")
    if kind == "dense":     # padding rows change no GEMM's result here (measured on an H100: bit-equal)
        assert worst == 0.0
    # the MoE's fused kernels pick their path and blocks by the number of (row, expert) pairs, which padding
    # changes: bf16 rounding, which top-k routing turns into a flipped expert (H100: 0.22 of the largest logit,
    # argmax 5 of 6). test_moe_exact_buckets and test_moe_padded_float32 check the MoE against the eager layers
    for s in g.stages:
        st = s.pgraphs.stats()
        assert st["replays"] == 3 and st["buckets"] == [128, 256] and st["captures"] == 2, st
        assert st["rule"] is None, st       # (the rule graphs are off by default: MEMRA_PP_RULE_GRAPHS)


EXACT = [  # the steps above with rows that fill their buckets (no padding): 128, 256, 128 rows
    ([0, 1], [0, 0], [60, 68], [False, True]),
    ([0, 1, 2], [60, 68, 0], [30, 1, 225], [True, True, False]),
    ([2, 0, 1], [225, 90, 69], [126, 1, 1], [True, True, True]),
]


def test_moe_exact_buckets(cuda):
    """Steps that fill their buckets run the eager layers' kernels on the same shapes: bit-equal in bf16."""
    _, path = tiny_checkpoint("moe", False)
    src = SafetensorsSource(path)
    g = pipe(src, [(0, 3), (3, 8)], torch.bfloat16, cuda, graphs=True)
    cap, eag = run_steps(g, cuda, EXACT), run_steps(pipe(src, [(0, 3), (3, 8)], torch.bfloat16, cuda), cuda, EXACT)
    for a, b in zip(cap, eag, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()
    assert all(s.pgraphs.stats()["buckets"] == [128, 256] for s in g.stages)


def test_moe_padded_float32(cuda, monkeypatch):
    """Padded steps of the MoE against the eager layers in float32 (no near tie flips an expert there). The Gated
    DeltaNet through the torch rule on both sides: fla would tune its float32 kernels first, minutes on a fresh
    machine, for no part of what this checks (the MoE's fused kernels with padding rows)."""
    from memra_pp.model import fla_rule
    monkeypatch.setattr(fla_rule, "available", lambda: False)
    _, path = tiny_checkpoint("moe", False)
    src = SafetensorsSource(path)
    g = pipe(src, [(0, 3), (3, 8)], torch.float32, cuda, graphs=True)
    cap, eag = run_steps(g, cuda), run_steps(pipe(src, [(0, 3), (3, 8)], torch.float32, cuda), cuda)
    worst = max((a - b).abs().max().item() for a, b in zip(cap, eag, strict=True))
    print(f"moe float32: captured vs eager logits, worst {worst:.2e}")
    assert worst < 1e-3 and g.stages[0].gdn_backend == "torch"


RULE_STEPS = [  # 2 segments (2 + 1 empty -> bucket 4); 9 (-> 16); 16 (more than the buckets hold: fla eagerly); then
    # continuing chunks beside decode rows and a new prompt of 250 rows (283 rows of segments: row bucket 512)
    ([0, 1], [0, 0], [40, 57], [False, True]),
    (list(range(2, 11)), [0] * 9, [10 + 2 * i for i in range(9)], [True] * 9),
    (list(range(11, 27)), [0] * 16, [5 + i for i in range(16)], [True] * 16),
    ([0, 1, *range(2, 11), 27], [40, 57, *(10 + 2 * i for i in range(9)), 0], [33, 1, *[1] * 9, 250], [True] * 12),
]


@pytest.mark.parametrize("kind,splits", [("dense", [(0, 3), (3, 8)]), ("moe", [(0, 5), (5, 8)])])
def test_rule_graphs_bit_equal(cuda, kind, splits, monkeypatch):
    """fla's rule replayed from the rule graphs (padded rows, empty segments, padding chunks) against fla called
    eagerly on the same steps, both inside captured prefill graphs: logits and every recurrent and conv state bit
    for bit, bf16. Then the counters: which calls replayed and which the buckets declined."""
    from memra_pp.model import prefill_graphs as pg
    _, path = tiny_checkpoint(kind, False)
    src = SafetensorsSource(path)
    monkeypatch.setattr(pg, "RULE_GRAPHS", True)
    on = pipe(src, splits, torch.bfloat16, cuda, graphs=True, max_seqs=32)
    monkeypatch.setattr(pg, "RULE_GRAPHS", False)
    off = pipe(src, splits, torch.bfloat16, cuda, graphs=True, max_seqs=32)
    assert all(s.pgraphs.rules is None for s in off.stages)
    a, b = run_steps(on, cuda, RULE_STEPS), run_steps(off, cuda, RULE_STEPS)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y), (x - y).abs().max()
    for c_on, c_off in zip(on.caches, off.caches, strict=True):
        for i in c_on.rec:
            assert torch.equal(c_on.rec[i], c_off.rec[i]) and torch.equal(c_on.conv[i], c_off.conv[i]), i
    for s in on.stages:
        st, gdn = s.pgraphs.stats(), sum(not L.full for L in s.layers)
        n = len(s.pgraphs.rules.rows) * len(pg.SEGMENT_BUCKETS)     # every row and segment bucket, at capture
        assert st["rule"]["captures"] == n and st["rule_failed"] is None, st
        assert st["rule"]["replays"] == 3 * gdn and st["rule"]["declined"] == gdn, st
