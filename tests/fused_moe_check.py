"""The fused MoE kernels (kernels/fused_moe.py) against their torch references, on one device: run as
`python fused_moe_check.py DTYPE DEVICE [PART]` (CPU under TRITON_INTERPRET=1, or cuda compiled; PART 1 (routing,
alignment, the experts at several row counts) or 2 (the router with the norm, the per-pair kernels' variants,
warm-up) runs one half, about equal in the interpreter, so two processes can share the work; all by default).
Prints "moe ok" and the paths that ran."""
import sys

import torch

from memra_pp.kernels import fused_moe as fm
from memra_pp.kernels import moe_align
from memra_pp.kernels import moe_route as mr
from memra_pp.kernels.fused_decode import device_counters
from memra_pp.kernels.moe_align import ALIGN_KERNEL_PAIRS

torch.manual_seed(0)
dt = getattr(torch, sys.argv[1])
dev = sys.argv[2]
cpu = dev == "cpu"      # Triton's interpreter: fewer programs where the compiled check runs them all
part = sys.argv[3] if len(sys.argv) > 3 else "all"     # 1 / 2: about equal halves in Triton's interpreter
assert part in ("all", "1", "2"), part
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


if part in ("all", "1"):
    # routing: one row, a few, many; the experts a decode batch of the released size routes over
    for T, E, k in [(1, 16, 4), (5, 16, 4), (70, 16, 2), (3, 256, 8)]:
        routing(T, E, k)

    # the router GEMV and the routing in one kernel (up to ROUTER_ROWS rows; beyond, F.linear and route): the experts
    # route() picks from F.linear's logits, and the counter left at zero for the next call; the kernel at up to 8 rows
    def routed(T, E_, H_, k):
        x, g = torch.randn(T, H_, dtype=dt), torch.randn(E_, H_, dtype=dt) / H_ ** 0.5
        before = fm.CALLS["router"]
        w, idx = fm.router_route(x, g, k, dt)
        assert (fm.CALLS["router"] - before == 1) == (T <= mr.ROUTER_ROWS), fm.CALLS
        logits = torch.nn.functional.linear(x, g)
        rw, ridx = fm.route_ref(logits, k, dt)
        p = logits.float().softmax(-1)
        assert torch.equal(p.gather(1, idx), p.gather(1, ridx)), (idx, ridx)
        close(w, rw)
        assert int(device_counters(mr._COUNTERS, x.device)) == 0
        ran.add("router")


    router_rows = mr.ROUTER_ROWS
    for rows in sorted({router_rows, 8}):
        mr.ROUTER_ROWS = rows
        for T, E_, H_, k in [(1, 256, 2048, 8), (3, 16, 80, 4), (8, 60, 100, 4), (5, 7, 33, 2), (9, 16, 80, 4)]:
            routed(T, E_, H_, k)
    mr.ROUTER_ROWS = router_rows
    # a NaN router row makes that logit NaN: the row's weights NaN as route_ref's, its ids k distinct real experts
    x, g = torch.randn(1, 64, dtype=dt), torch.randn(16, 64, dtype=dt) / 8
    g[5] = float("nan")
    w, idx = fm.router_route(x, g, 4, dt)
    assert bool(fm.route_ref(torch.nn.functional.linear(x, g), 4, dt)[0].isnan().all()) and bool(w.isnan().all()), w
    assert bool(((idx >= 0) & (idx < 16)).all()) and len(set(idx[0].tolist())) == 4, idx
    # tied logits (equal router rows): the lowest experts first, as the argmax rounds take them
    g = torch.randn(16, 64, dtype=dt) / 8
    g[[2, 7, 9, 12]] = 3 * x[0] / x[0].norm()
    w, idx = fm.router_route(x, g, 4, dt)
    assert idx[0].tolist() == [2, 7, 9, 12], idx
    ran.add("router nan and ties")


    # align: the kernel equals the torch ops (up to ALIGN_KERNEL_PAIRS; beyond, the torch ops), at both block sizes:
    # one row, 512 and 2,048 pairs, 256 experts and a few (not a power of two), distinct experts a row, experts with
    # no pair, every pair on one expert; both ways of counting (tl.histogram's mask, or bin 0 and a correction on
    # older Tritons)
    def aligned(idx, E_, BM):
        assert idx.numel() <= ALIGN_KERNEL_PAIRS        # the kernel, not the torch ops it is compared with
        a, b = fm.align(idx, E_, BM), fm.align_ref(idx, E_, BM)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (tuple(idx.shape), E_, BM)
        ran.add("align")


    # (the interpreter runs the kernel's E + 1 programs one by one, about 0.03 s each: there, 256 experts at one
    # shape, the 1,024-id steps at 60 and 8, and the other Tritons' way at a few shapes; all of them compiled)
    hist_mask = moe_align._HIST_MASK
    for hm in sorted({hist_mask, False}):
        moe_align._HIST_MASK = hm
        shapes = [(1, 8, 256, 16), (37, 4, 16, 16), (64, 8, 256, 16), (64, 8, 256, 64), (256, 8, 256, 16),
                  (150, 4, 16, 64), (90, 8, 40, 64), (256, 8, 60, 64), (200, 8, 8, 16)]
        if cpu:
            shapes = shapes[:2] + shapes[5:7] + (shapes[7:] if hm == hist_mask else [])
        for T, k, E_, BM in shapes:
            aligned(torch.stack([torch.randperm(E_)[:k] for _ in range(T)]), E_, BM)
        for E_, BM in [(40 if cpu else 256, 16), (60, 64)]:
            aligned(torch.randint(0, 5, (64, 8)), E_, BM)               # most experts without a pair
            aligned(torch.full((256, 8), E_ - 1), E_, BM)               # all on the last expert
            aligned(torch.zeros(1, 8, dtype=torch.long), E_, BM)       # one row, all on the first
    moe_align._HIST_MASK = hist_mask
    # the kernel past its first bound (16,384 pairs until the twenty-sixth session): a mixed prefill step's 36,800
    # pairs and the bound itself, 65,536 (the interpreter: 16,800 pairs over 8 experts, 9 programs)
    for T, k, E_ in ([(2100, 8, 8)] if cpu else [(4600, 8, 256), (ALIGN_KERNEL_PAIRS // 8, 8, 256)]):
        aligned(torch.rand(T, E_).argsort(1)[:, :k].contiguous(), E_, 64)
        aligned(torch.randint(0, 5, (T, k)), E_, 64)                  # skewed: five experts take every pair
    # ids outside [0, E) (route makes none): skipped, nothing written outside the rows, the rest where align_ref puts
    # them without those pairs, then padding
    for E_, BM in [(60, 16), (40 if cpu else 256, 64)]:
        idx = torch.randint(0, E_, (40, 8))
        idx[0, 0], idx[3, 2], idx[5, 1], idx[7, 7] = E_, -1, 2 ** 32 + 1, E_ + 100
        sp, be = fm.align(idx, E_, BM)
        flat, N = idx.reshape(-1), idx.numel()
        good = torch.nonzero((flat >= 0) & (flat < E_)).reshape(-1)
        rsp, rbe = fm.align_ref(flat[good], E_, BM)
        n = rsp.numel()
        assert sp.numel() == moe_align._padded_rows(N, E_, BM) and be.numel() == sp.numel() // BM
        assert torch.equal(sp[:n], torch.where(rsp < good.numel(), good[rsp.clamp(max=good.numel() - 1)], N).int())
        assert bool((sp[n:] == N).all()) and torch.equal(be[:n // BM], rbe) and bool((be[n // BM:] == E_).all())
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

# the experts: per-pair kernels (few pairs), grouped GEMM (many; every block-size config), odd sizes (masks). The
# per-pair kernels run a program for every 4 columns of a pair's gate|up, so in the interpreter, which runs them one
# by one (about 0.04 s each), the experts are half as wide
E, H, I = 16, 80, 24 if cpu else 48
w_gu = torch.randn(E, 2 * I, H, dtype=dt) / H ** 0.5
w_d = torch.randn(E, H, I, dtype=dt) / I ** 0.5
def shared_expert(Is):
    return (torch.randn(2 * Is, H, dtype=dt) / H ** 0.5, torch.randn(H, Is, dtype=dt) / Is ** 0.5,
            torch.randn(1, H, dtype=dt) / H ** 0.5)


# the shared expert, narrower and wider than the routed ones (the per-pair kernels mask both; h rows are the wider)
shared, wide = (shared_expert(20), shared_expert(28)) if cpu else (shared_expert(40), shared_expert(56))
if part in ("all", "1"):
    for T, k in [(1, 4), (5, 4), (16, 4), (17, 4), (40, 4), (520, 4), (4100, 4)]:
        if cpu and T > 600:
            continue            # the interpreter is slow: the 64-row blocks are checked compiled
        x = torch.randn(T, H, dtype=dt)
        # (the interpreter: the routing kernel's program a row checked up to 40 rows; beyond, the reference routes)
        w, idx = routing(T, E, k) if not cpu or T <= 40 else fm.route_ref(torch.randn(T, E, dtype=dt), k, dt)
        out = fm.moe_experts(x, w_gu, w_d, w, idx)
        close(out, fm.moe_experts_ref(x, w_gu, w_d, w, idx))
        ran.add("small" if T * k <= fm.SMALL_PAIRS else "grouped{}x{}".format(*fm.grouped_config(T * k)))
        if T <= 40:     # (the interpreter: the wider shared expert at the per-pair kernels' most rows only)
            for sh in (shared, wide) if not cpu or T == 16 else (shared,):
                close(fm.moe_experts(x, w_gu, w_d, w, idx, sh), fm.moe_ref(x, w_gu, w_d, w, idx, sh))
            ran.add("shared")


if part in ("all", "2"):
    # the MoE's input norm inside the router kernel (one row whose hidden fits one step of it; else add_rms_norm, then
    # router_route): the new residual and the normed row as add_rms_norm gives them, the routing of that row
    def norm_routed(T, E_, H_, k, taken):
        from memra_pp.kernels.fused_decode import add_rms_norm_ref
        h, r = torch.randn(T, H_, dtype=dt), torch.randn(T, H_, dtype=dt)
        lw, g = torch.randn(H_, dtype=dt) * 0.1, torch.randn(E_, H_, dtype=dt) / H_ ** 0.5
        before = fm.CALLS["norm_router"]
        s_, x_, w, idx = fm.norm_router_route(h, r, lw, 1e-6, g, k, dt)
        assert (fm.CALLS["norm_router"] - before == 1) == taken, fm.CALLS
        s0, x0 = add_rms_norm_ref(h, r, lw, 1e-6)
        # the new residual bit for bit (the interpreter rounds to bfloat16 its own way); the normed row within rounding
        assert torch.equal(s_, s0) if dt == torch.float32 or dev == "cuda" else close(s_, s0) is None
        close(x_, x0)
        logits = torch.nn.functional.linear(x_, g)
        p = logits.float().softmax(-1)
        assert torch.equal(p.gather(1, idx), p.gather(1, fm.route_ref(logits, k, dt)[1])), idx
        close(w, fm.route_ref(logits, k, dt)[0])
        assert int(device_counters(mr._COUNTERS, h.device)) == 0
        ran.add("norm router")


    for T, E_, H_, k, taken in [(1, 256, 2048, 8, True), (1, 60, 100, 4, True), (2, 16, 80, 4, False),
                                (1, 16, 4100, 4, False)]:
        norm_routed(T, E_, H_, k, taken)


    def check_small(shapes, experts, **kw):
        """_moe_small against moe_ref for rows (T, k) routed at random, with each shared expert of `experts` (or
        None). Returns the calls made."""
        for T, k in shapes:
            x = torch.randn(T, H, dtype=dt)
            w, idx = fm.route_ref(torch.randn(T, E, dtype=dt), k, dt)
            for sh in experts:
                close(fm._moe_small(x, w_gu, w_d, w, idx, sh, **kw), fm.moe_ref(x, w_gu, w_d, w, idx, sh))
        return len(shapes) * len(experts)


    # The interpreter runs each program one by one (the per-pair kernels' about 0.02-0.05 s each, the loop down
    # kernel's 0.1), so there each variant runs at the fewest (shapes, shared experts) that reach it; compiled, all.
    # the per-pair down kernel both ways ("loop": a row's pairs one after another; "tile": every pair's slice in one
    # tile), k not a power of two (the tile's masked pair rows), without the shared expert and with both widths; the
    # shared gate computed by the gate|up kernel (SHARED_GATE_EARLY) and by every down program (late: only rows with
    # a shared expert have a gate to compute)
    for early in (True, False):
        fm.SHARED_GATE_EARLY = early
        for down in ("loop", "tile"):
            before, gates = fm.CALLS["down_tile"], fm.CALLS["shared_gate"]
            # (16 rows of 4, the per-pair kernels' most, run in the interpreter through moe_experts above)
            shapes = [(1, 4), (5, 4), (3, 3)] + ([(16, 4)] if not cpu else []) if early else [(1, 4), (3, 3)]
            experts = (None, shared, wide) if early else (shared, wide)
            if cpu and (down == "loop" or not early):
                shapes, experts = shapes[-1:], experts[-2:] if down == "tile" else experts[:1] + experts[-1:]
            calls = check_small(shapes, experts, down=down)
            assert fm.CALLS["down_tile"] - before == (calls if down == "tile" else 0), fm.CALLS
            assert fm.CALLS["shared_gate"] - gates == (len(shapes) * sum(e is not None for e in experts)
                                                       if early else 0), fm.CALLS
            ran.add(f"down {down}")
        ran.add("shared gate early" if early else "shared gate late")
    fm.SHARED_GATE_EARLY = True
    # the shared pair's first gate|up K step loaded before PDL's wait (SHARED_BEFORE_WAIT) and used in the loop's first
    # step only: the gate|up K in several steps with a ragged last one (BK 32, H 80), with the early gate and without
    for early in (True, False):
        fm.SHARED_GATE_EARLY, fm.SHARED_BEFORE_WAIT = early, True
        check_small([(1, 4), (3, 3)] if early or not cpu else [(3, 3)], (shared, wide) if early or not cpu
                    else (wide,), tiles=(4, 32, 2, 4, 64, 4))
    fm.SHARED_GATE_EARLY, fm.SHARED_BEFORE_WAIT = True, False
    ran.add("shared before wait")
    # the tile down kernel's routed ids and weights loaded after PDL's wait (DOWN_IDS_BEFORE_WAIT off; on above)
    assert fm.DOWN_IDS_BEFORE_WAIT
    fm.DOWN_IDS_BEFORE_WAIT = False
    before = fm.CALLS["down_tile"]
    calls = check_small([(3, 3)] if cpu else [(1, 4), (3, 3)], (None, shared), down="tile")
    assert fm.CALLS["down_tile"] - before == calls, fm.CALLS
    fm.DOWN_IDS_BEFORE_WAIT = True
    ran.add("down ids after wait")

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

    # a decode graph's padding rows (route's `live` 0): routed to no expert (ids E, weights 0), the real rows' routing
    # unchanged. The per-pair kernels (3 rows) load nothing for a padding row's pairs: its routed sum is 0, plus the
    # shared expert's term where one rides along (an unmasked id E would read past the experts). The grouped GEMM (20
    # rows) gets from the alignment the real rows' pairs alone. Either way the real rows' outputs are as without them.
    # The experts here lie in front of an expert of NaN, what an unmasked id E would read
    gu_nan = torch.cat([w_gu, torch.full_like(w_gu[:1], float("nan"))])[:E]
    d_nan = torch.cat([w_d, torch.full_like(w_d[:1], float("nan"))])[:E]
    for T, sh in ((3, None), (3, shared), (20, None)):
        logits, x = torch.randn(T, E, dtype=dt), torch.randn(T, H, dtype=dt)
        live = torch.tensor([1, 0, 1] + [0, 1] * ((T - 3) // 2) + [1] * ((T - 3) % 2))
        dead = live == 0
        x_nan = x.clone()
        x_nan[dead] = float("nan")
        before = fm.CALLS["route_live"]
        w, idx = fm.route(logits, 4, dt, live)
        assert fm.CALLS["route_live"] == before + 1, fm.CALLS
        w0, i0 = fm.route(logits, 4, dt)
        assert bool((idx[dead] == E).all()) and bool((w[dead] == 0).all()), (idx, w)
        assert torch.equal(idx[~dead], i0[~dead]) and torch.equal(w[~dead], w0[~dead])
        ref = fm.moe_ref(x[~dead], w_gu, w_d, w0[~dead], i0[~dead], sh)
        if T * 4 <= fm.SMALL_PAIRS:
            for down in ("tile", "loop") if sh is None else ("tile",):
                out = fm._moe_small(x, gu_nan, d_nan, w, idx, sh, down=down)
                close(out[~dead], ref)
                if sh is None:
                    assert bool((out[dead] == 0).all()), (down, out[dead])
                else:
                    close(out[dead], fm.shared_ref(x[dead], sh))
                # a padding row's input NaN (the Gated DeltaNet's skipped rows leave theirs unwritten): the real
                # rows bit for bit as before
                assert torch.equal(fm._moe_small(x_nan, gu_nan, d_nan, w, idx, sh, down=down)[~dead], out[~dead])
        else:
            out = fm.moe_experts(x, gu_nan, d_nan, w, idx, sh)
            close(out[~dead], ref)
            assert torch.equal(fm.moe_experts(x_nan, gu_nan, d_nan, w, idx, sh)[~dead], out[~dead])
            placed = lambda ids: int((moe_align.align(ids, E, 16)[0] < ids.numel()).sum())  # noqa: E731
            assert placed(idx) == 4 * int(live.sum()) and placed(i0) == 4 * T, (placed(idx), placed(i0))
            # the torch alignment (past the kernel's bound) skips the padding pairs as the kernel does
            a, b = moe_align.align(idx, E, 16), moe_align.align_ref(idx, E, 16)
            assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), (a, b)
        ran.add(f"padding rows {'small' if T * 4 <= fm.SMALL_PAIRS else 'grouped'}")

    if not cpu:             # captured in a CUDA graph (static shapes, no host sync), replayed on new inputs
        T, k = 64, 4
        x = torch.randn(T, H, dtype=dt)
        logits = torch.randn(T, E, dtype=dt)
        x1, l1 = x[:2], logits[:2]      # and two rows (the per-pair kernels, with the shared expert)
        gate = torch.randn(E, H, dtype=dt) / H ** 0.5       # and the router kernel, twice a graph (its counter resets)
        x2 = x[:mr.ROUTER_ROWS]
        for _ in range(2):
            fm.moe_experts(x, w_gu, w_d, *fm.route(logits, k, dt))
            fm.moe_experts(x1, w_gu, w_d, *fm.route(l1, k, dt), shared)
            fm.router_route(x2, gate, k, dt)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = fm.moe_experts(x, w_gu, w_d, *fm.route(logits, k, dt))
            out1 = fm.moe_experts(x1, w_gu, w_d, *fm.route(l1, k, dt), shared)
            r1 = fm.router_route(x2, gate, k, dt)
            r2 = fm.router_route(x2 * 2, gate, k, dt)
        for _ in range(3):
            x.copy_(torch.randn(T, H, dtype=dt))
            logits.copy_(torch.randn(T, E, dtype=dt))
            g.replay()
            torch.cuda.synchronize()
            close(out, fm.moe_experts_ref(x, w_gu, w_d, *fm.route_ref(logits, k, dt)))
            close(out1, fm.moe_ref(x1, w_gu, w_d, *fm.route_ref(l1, k, dt), shared))
            for (rw, ri), xx in ((r1, x2), (r2, x2 * 2)):
                lg = torch.nn.functional.linear(xx, gate)
                p = lg.float().softmax(-1)
                assert torch.equal(p.gather(1, ri), p.gather(1, fm.route_ref(lg, k, dt)[1])), ri
            assert int(device_counters(mr._COUNTERS, x.device)) == 0
        ran.add("graph")

    # MoE.warm_up (at load on a GPU): every path a step can pick ran once, so Triton compiles them then, not mid-step
    from memra_pp.model.layers import MoE  # noqa: E402
    moe = MoE(4)
    moe.gate_weight = torch.randn(E, H, dtype=dt) / H ** 0.5
    moe.experts_gate_up_proj, moe.experts_down_proj = w_gu, w_d
    moe.shared_gate_up, moe.shared_expert_down_proj_weight, moe.shared_expert_gate_weight = shared
    before = dict(fm.CALLS)
    if cpu:
        moe.WARM_ROWS = (1, 3, 40)      # the interpreter is slow; compiled, every size the GPU warms
    moe.warm_up()
    assert all(fm.CALLS[p] > before[p] for p in ("router", "norm_router", "small", "down_tile", "grouped",
                                                 "route_live")), \
        (before, fm.CALLS)
    ran.add("warm up")

print("moe ok", sorted(ran))
