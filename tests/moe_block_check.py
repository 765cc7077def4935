"""The one-row MoE block kernel (kernels/moe_block.py) against the torch references and the three-kernel path, on
one device: run as `python moe_block_check.py DTYPE DEVICE` (CPU under TRITON_INTERPRET=1: the three phases as
three launches; cuda compiled: one kernel with its grid barriers, checked bit for bit against the three launches,
and replayed in a CUDA graph). Prints "block ok" and the paths that ran."""
import sys

import torch
import torch.nn.functional as F

from memra_pp.kernels import fused_moe as fm
from memra_pp.kernels import moe_block as mb
from memra_pp.kernels.fused_decode import add_rms_norm_ref

torch.manual_seed(0)
dt = getattr(torch, sys.argv[1])
dev = sys.argv[2]
torch.set_default_device(dev)
tol = 1e-5 if dt == torch.float32 else 2e-2
eps = 1e-6
ran = set()


def close(a, b):
    err = ((a.float() - b.float()).abs() - tol * b.float().abs()).max().item()
    assert err <= tol * max(1.0, b.float().abs().max().item()), err


def layer(E, H, I, Is):
    """Random weights of one MoE layer: (input norm, router, gate|up, down, shared expert)."""
    return (torch.randn(H, dtype=dt) * 0.1, torch.randn(E, H, dtype=dt) / H ** 0.5,
            torch.randn(E, 2 * I, H, dtype=dt) / H ** 0.5, torch.randn(E, H, I, dtype=dt) / I ** 0.5,
            (torch.randn(2 * Is, H, dtype=dt) / H ** 0.5, torch.randn(H, Is, dtype=dt) / Is ** 0.5,
             torch.randn(1, H, dtype=dt) / H ** 0.5))


def check(res, h, m, weights, k):
    """The block's (s, out, w, idx) against add_rms_norm_ref, route_ref and moe_ref (on the block's own routing:
    tied probabilities may swap experts)."""
    lw, g, w_gu, w_d, shared = weights
    s, out, w, idx = res
    s0, x0 = add_rms_norm_ref(h, m, lw, eps)
    assert torch.equal(s, s0) if dt == torch.float32 or dev == "cuda" else close(s, s0) is None
    logits = F.linear(x0, g)
    p = logits.float().softmax(-1)
    rw, ridx = fm.route_ref(logits, k, dt)
    assert torch.equal(p.gather(1, idx), p.gather(1, ridx)), (idx, ridx)
    assert len(set(idx[0].tolist())) == k
    close(w, rw)
    close(out, fm.moe_ref(x0, w_gu, w_d, w, idx, shared))


# shapes (experts, hidden, routed width, shared width, k, programs): the shared expert narrower and wider than the
# routed ones, experts not a power of two, programs fewer than the router's rows and than the tiles (each program
# loops), more programs than tiles (some idle in every phase), and on a GPU the 35B-A3B's (the default grid: TILES'
# programs a multiprocessor)
shapes = [(16, 80, 48, 40, 4, 3), (16, 80, 48, 56, 4, 5), (60, 100, 32, 32, 4, 4), (16, 64, 16, 16, 2, 7),
          (16, 64, 16, 16, 2, 40)]
if dev == "cuda":
    shapes += [(256, 2048, 512, 512, 8, None), (64, 256, 64, 128, 8, 20)]
# each at the default tiles, then a few shapes at others (prefetch on, wider and narrower tiles, other warps): every
# pairing compiled; in the interpreter, which runs a program in about 0.1-0.2 s, each other tile at one of the shapes
other_tiles = ((2, 2, 4, 2, True), (4, 8, 4, 1, True), (8, 4, 2, 4, True))
pairs = [(i, t) for i in (0, 1, 4) for t in other_tiles] if dev == "cuda" else list(zip((0, 1, 4), other_tiles))
runs = [(shape, None) for shape in shapes] + [(shapes[i], t) for i, t in pairs]
for (E, H, I, Is, k, P), tiles in runs:
    weights = layer(E, H, I, Is)
    lw, g, w_gu, w_d, shared = weights
    bar = torch.zeros(1, dtype=torch.int32)
    for _ in range(2 if dev == "cuda" else 1):      # twice on a GPU: the second launch finds the barrier's word reused
        h, m = torch.randn(1, H, dtype=dt), torch.randn(1, H, dtype=dt)
        before = dict(mb.CALLS)
        res = mb.moe_block(h, m, lw, eps, g, k, w_gu, w_d, shared, bar, programs=P, tiles=tiles)
        fused = dev == "cuda"
        assert mb.CALLS["block" if fused else "block_split"] - before["block" if fused else "block_split"] == 1
        check(res, h, m, weights, k)
        ran.add("block" if fused else "block split")
        if fused:       # the barriers: the one kernel equals its three phases launched apart, bit for bit
            split = mb.moe_block(h, m, lw, eps, g, k, w_gu, w_d, shared, bar, split=True, programs=P, tiles=tiles)
            assert all(torch.equal(a, b) for a, b in zip(res, split, strict=True)), (E, H, I, Is, k, P)
            # and the three-kernel path (its gate|up sums the row in other steps: within rounding)
            s3, x3, w3, i3 = fm.norm_router_route(h, m, lw, eps, g, k, dt)
            p3 = F.linear(x3, g).float().softmax(-1)         # (the same probabilities: near ties may swap experts)
            assert torch.equal(s3, res[0]) and torch.equal(p3.gather(1, i3), p3.gather(1, res[3])), (i3, res[3])
            close(res[1], fm.moe_experts(x3, w_gu, w_d, w3, i3, shared))
            ran.add("block = split = three kernels")
    # the barrier's word back where it started (on a GPU two barriers a launch each flip its top bit; the split
    # launches never touch it). That the barriers order the phases shows in the bit-for-bit match with the split
    assert int(bar[0]) == 0, bar.tolist()

if dev == "cuda":       # captured in a CUDA graph and replayed on new inputs: the barrier needs no reset
    E, H, I, Is, k = 256, 2048, 512, 512, 8
    weights = layer(E, H, I, Is)
    lw, g, w_gu, w_d, shared = weights
    bar = torch.zeros(1, dtype=torch.int32)
    h, m = torch.randn(1, H, dtype=dt), torch.randn(1, H, dtype=dt)
    for _ in range(2):
        mb.moe_block(h, m, lw, eps, g, k, w_gu, w_d, shared, bar)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        res = mb.moe_block(h, m, lw, eps, g, k, w_gu, w_d, shared, bar)
        res2 = mb.moe_block(res[0], res[1], lw, eps, g, k, w_gu, w_d, shared, bar)      # two layers' worth
    for i in range(50):
        h.copy_(torch.randn(1, H, dtype=dt))
        m.copy_(torch.randn(1, H, dtype=dt))
        graph.replay()
        if i % 10 == 0:
            torch.cuda.synchronize()
            check(res, h, m, weights, k)
            check(res2, res[0], res[1], weights, k)
    torch.cuda.synchronize()
    assert int(bar[0]) == 0, bar.tolist()
    ran.add("graph")

# ties and NaN: equal logits go to the lowest expert first, as the router kernel takes them; a NaN row routes to k
# distinct real experts, and its output is NaN
E, H, I, Is, k = 16, 80, 48, 40, 4
lw, g, w_gu, w_d, shared = layer(E, H, I, Is)
h, m = torch.randn(1, H, dtype=dt), torch.randn(1, H, dtype=dt)
x0 = add_rms_norm_ref(h, m, lw, eps)[1]
g[2] = x0[0] / x0[0].float().norm().to(dt)           # the largest logit by far, then two rows that equal it
g[9], g[5] = g[2], g[2]
bar = torch.zeros(1, dtype=torch.int32)
res = mb.moe_block(h, m, lw, eps, g, k, w_gu, w_d, shared, bar, programs=3)
assert res[3][0, :3].tolist() == [2, 5, 9], res[3]
assert torch.equal(res[3], fm.norm_router_route(h, m, lw, eps, g, k, dt)[3]), res[3]
for nan in (float("nan"), -float("nan")):      # one NaN logit, either sign: taken first, the row NaN
    g_nan = g.clone()
    g_nan[11] = nan
    res = mb.moe_block(h, m, lw, eps, g_nan, k, w_gu, w_d, shared, bar, programs=3)
    ids = res[3][0].tolist()
    assert ids[0] == 11 and len(set(ids)) == k and all(0 <= e < E for e in ids), ids
    assert bool(res[1].isnan().all()), res[1]
h[0, 7] = float("nan")      # a NaN input: every logit NaN
res = mb.moe_block(h, m, lw, eps, g, k, w_gu, w_d, shared, bar, programs=3)
ids = res[3][0].tolist()
assert len(set(ids)) == k and all(0 <= e < E for e in ids) and bool(res[1].isnan().all()), (ids, res[1])
ran.add("ties and nan")

# layers.MoE.decode_fused takes the block kernel where takes() holds (ENABLED, one row), else the three kernels
from memra_pp.model.layers import MoE  # noqa: E402
E, H, I, Is, k = 16, 80, 48, 40, 4
lw, g, w_gu, w_d, shared = layer(E, H, I, Is)
moe = MoE(k)
moe.gate_weight, moe.experts_gate_up_proj, moe.experts_down_proj = g, w_gu, w_d
moe.shared_gate_up, moe.shared_expert_down_proj_weight, moe.shared_expert_gate_weight = shared
moe.route_counter = torch.zeros(1, dtype=torch.int32)
moe.block_bar = torch.zeros(1, dtype=torch.int32)
h, m = torch.randn(1, H, dtype=dt), torch.randn(1, H, dtype=dt)
enabled = mb.ENABLED
outs = {}
for on in (True, False):
    mb.ENABLED = on
    before = sum(mb.CALLS.values()), fm.CALLS["norm_router"]
    outs[on] = moe.decode_fused(h, m, lw, eps)
    assert (sum(mb.CALLS.values()) - before[0], fm.CALLS["norm_router"] - before[1]) == ((1, 0) if on else (0, 1))
mb.ENABLED = enabled
assert torch.equal(outs[True][0], outs[False][0])
close(outs[True][1], outs[False][1])
ran.add("decode_fused")
print("block ok", sorted(ran))
