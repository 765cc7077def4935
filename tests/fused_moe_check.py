"""The fused MoE kernels (kernels/fused_moe.py) against their torch references, on one device: run as
`python fused_moe_check.py DTYPE DEVICE` (CPU under TRITON_INTERPRET=1, or cuda compiled). Prints "moe ok" and
the paths that ran."""
import sys

import torch

from memra_pp.kernels import fused_moe as fm
from memra_pp.kernels.moe_align import ALIGN_KERNEL_PAIRS

torch.manual_seed(0)
dt = getattr(torch, sys.argv[1])
dev = sys.argv[2]
torch.set_default_device(dev)
tol = 1e-5 if dt == torch.float32 else 2e-2
ran = set()


def close(a, b):
    err = ((a.float() - b.float()).abs() - tol * b.float().abs()).max().item()
    assert err <= tol * max(1.0, b.float().abs().max().item()), err


def routing(T, E, k):
    logits = torch.randn(T, E, dtype=dt) * 2
    w, idx = fm.route(logits, k, dt)
    rw, ridx = fm.route_ref(logits, k, dt)
    p = logits.float().softmax(-1)      # the same probabilities in every place (tied ones may swap experts)
    assert torch.equal(p.gather(1, idx), p.gather(1, ridx)), (idx, ridx)
    assert all(len(set(r)) == k for r in idx.tolist())
    close(w, rw)
    ran.add("route")
    return w, idx


# routing: one row, a few, many; the experts a decode batch of the released size routes over
for T, E, k in [(1, 16, 4), (5, 16, 4), (70, 16, 2), (3, 256, 8)]:
    routing(T, E, k)

# align: the kernel equals the torch ops (few pairs; many go to the torch ops), at every block size
for T, k, E_, BM in [(1, 8, 256, 16), (37, 4, 16, 16), (64, 8, 256, 16), (150, 4, 16, 64), (90, 8, 40, 64)]:
    assert T * k <= ALIGN_KERNEL_PAIRS        # the kernel, not the torch ops it is compared with
    idx = torch.stack([torch.randperm(E_)[:k] for _ in range(T)])
    a, b = fm.align(idx, E_, BM), fm.align_ref(idx, E_, BM)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (T, k, E_, BM)
    ran.add("align")
# each pair exactly once, each block one expert, padding only at a run's end
idx = torch.randint(0, 16, (37, 4))
sp, be = fm.align(idx, 16, 16)
N = idx.numel()
real = sp[sp < N].long()
assert sorted(real.tolist()) == list(range(N))
flat = idx.reshape(-1)
for b in range(be.numel()):
    rows = sp[b * 16:(b + 1) * 16].long()
    e = int(be[b])
    if e >= 16:
        assert bool((rows == N).all())
        continue
    assert bool((flat[rows[rows < N]] == e).all()) and bool((rows < N).any())

# the experts: per-pair kernels (few pairs), grouped GEMM (many; every block-size config), odd sizes (masks)
E, H, I = 16, 80, 48
w_gu = torch.randn(E, 2 * I, H, dtype=dt) / H ** 0.5
w_d = torch.randn(E, H, I, dtype=dt) / I ** 0.5
def shared_expert(Is):
    return (torch.randn(2 * Is, H, dtype=dt) / H ** 0.5, torch.randn(H, Is, dtype=dt) / Is ** 0.5,
            torch.randn(1, H, dtype=dt) / H ** 0.5)


# the shared expert, narrower and wider than the routed ones (the per-pair kernels mask both; h rows are the wider)
shared, wide = shared_expert(40), shared_expert(56)
for T, k in [(1, 4), (5, 4), (16, 4), (17, 4), (40, 4), (520, 4), (4100, 4)]:
    if dev == "cpu" and T > 600:
        continue            # the interpreter is slow: the 64-row blocks are checked compiled
    x = torch.randn(T, H, dtype=dt)
    w, idx = routing(T, E, k)
    out = fm.moe_experts(x, w_gu, w_d, w, idx)
    close(out, fm.moe_experts_ref(x, w_gu, w_d, w, idx))
    ran.add("small" if T * k <= fm.SMALL_PAIRS else "grouped{}x{}".format(*fm.grouped_config(T * k)))
    if T <= 40:
        for sh in (shared, wide):
            close(fm.moe_experts(x, w_gu, w_d, w, idx, sh), fm.moe_ref(x, w_gu, w_d, w, idx, sh))
        ran.add("shared")

# a NaN or inf logit: that row's ids stay k distinct real experts, and every other row's output is unchanged
for T in (3, 20):           # the per-pair kernels, and the grouped GEMM through the alignment kernel
    logits = torch.randn(T, E, dtype=dt)
    logits[0, 3], logits[1, 5] = float("nan"), float("inf")
    w, idx = fm.route(logits, 4, dt)
    assert bool(((idx >= 0) & (idx < E)).all()) and all(len(set(r)) == 4 for r in idx.tolist()), idx
    x = torch.randn(T, H, dtype=dt)
    out = fm.moe_experts(x, w_gu, w_d, w, idx)
    close(out[2:], fm.moe_experts_ref(x[2:], w_gu, w_d, w[2:], idx[2:]))
    ran.add("nan row")

if dev == "cuda":       # captured in a CUDA graph (static shapes, no host sync), replayed on new inputs
    T, k = 64, 4
    x = torch.randn(T, H, dtype=dt)
    logits = torch.randn(T, E, dtype=dt)
    x1, l1 = x[:2], logits[:2]      # and two rows (the per-pair kernels, with the shared expert)
    for _ in range(2):
        fm.moe_experts(x, w_gu, w_d, *fm.route(logits, k, dt))
        fm.moe_experts(x1, w_gu, w_d, *fm.route(l1, k, dt), shared)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fm.moe_experts(x, w_gu, w_d, *fm.route(logits, k, dt))
        out1 = fm.moe_experts(x1, w_gu, w_d, *fm.route(l1, k, dt), shared)
    x.copy_(torch.randn(T, H, dtype=dt))
    logits.copy_(torch.randn(T, E, dtype=dt))
    g.replay()
    torch.cuda.synchronize()
    close(out, fm.moe_experts_ref(x, w_gu, w_d, *fm.route_ref(logits, k, dt)))
    close(out1, fm.moe_ref(x1, w_gu, w_d, *fm.route_ref(l1, k, dt), shared))
    ran.add("graph")

print("moe ok", sorted(ran))
