"""The fused decode kernels (kernels/fused_decode.py, kernels/paged_attention.py) against their torch references,
on one device: run as `python fused_decode_check.py DTYPE DEVICE` (CPU under TRITON_INTERPRET=1, or cuda
compiled). Prints "fused ok"."""
import sys

import torch

from memra_pp.kernels import fused_decode as fd
from memra_pp.kernels import gdn_decode as gdk
from memra_pp.kernels import paged_attention as pgd
from memra_pp.kernels import prefill as pf

torch.manual_seed(0)
dt = getattr(torch, sys.argv[1])
torch.set_default_device(sys.argv[2])


def ref(fn, *a):
    fd.USE_TRITON = False
    try:
        return fn(*a)
    finally:
        fd.USE_TRITON = True


def close(a, b, tol):
    a, b = (a if isinstance(a, tuple) else (a,)), (b if isinstance(b, tuple) else (b,))
    for x, y in zip(a, b, strict=True):
        d = ((x.float() - y.float()).abs() - tol * y.float().abs()).max().item()   # within tol, relative
        assert d <= tol, d
    return True


tol = 1e-5 if dt == torch.float32 else 2e-2
# l2norm (prefill q / k): rows spanning several programs and a partial one, a head dim below its power of two; on the
# GPU also against flash-linear-attention's own kernel (the one transformers runs; fla's tuned tile may sum a row in
# another order, so within a rounding step, not bit for bit)
for shape in [(2, 37, 3, 128), (5, 24)]:
    xq = torch.randn(*shape, dtype=dt) * 3
    got, l2tol = fd.l2norm(xq), 1e-6 if dt == torch.float32 else 1e-2
    close(got, ref(fd.l2norm, xq), l2tol)
    assert got.shape == xq.shape and got.dtype == dt
    if xq.is_cuda:      # the GPU suite runs with fla (test_gpu_parity requires it): compare, never skip quietly
        from fla.modules.norm.l2norm import l2norm_fwd
        close(got, l2norm_fwd(xq)[0], l2tol)
# add_rms_norm: residual rows, strided 3-D rows (q heads inside a projection), no residual
x, r, w = torch.randn(3, 40, dtype=dt), torch.randn(3, 40, dtype=dt), torch.randn(40, dtype=dt)
close(fd.add_rms_norm(x, r, w, 1e-6), ref(fd.add_rms_norm, x, r, w, 1e-6), tol)
P = torch.randn(2, 3 * 2 * 16 + 8, dtype=dt)
q = P[:, :96].view(2, 3, 32)[..., :16]
wq = torch.randn(16, dtype=dt)
a, b = fd.add_rms_norm(q, None, wq, 1e-6)[1], ref(fd.add_rms_norm, q, None, wq, 1e-6)[1]
assert a.shape == (2, 3, 16) and a.is_contiguous(); close(a, b, tol)
close(fd.add_rms_norm(x, None, w, 1e-6, False)[1], ref(fd.add_rms_norm, x, None, w, 1e-6, False)[1], tol)
# the q norm with its partial rotary embedding (8 of 16 dims), on the strided q heads
cs = (torch.randn(2, 8, dtype=dt), torch.randn(2, 8, dtype=dt))
close(fd.add_rms_norm(q, None, wq, 1e-6, rope=cs)[1], ref(fd.add_rms_norm, q, None, wq, 1e-6, True, cs)[1], tol)
cs = (torch.randn(2, 16, dtype=dt), torch.randn(2, 16, dtype=dt))          # every dim rotated
close(fd.add_rms_norm(q, None, wq, 1e-6, rope=cs)[1], ref(fd.add_rms_norm, q, None, wq, 1e-6, True, cs)[1], tol)
# gated norm with z a strided view
o = torch.randn(2, 4, 16, dtype=dt)
Pz = torch.randn(2, 100, dtype=dt)
z = Pz[:, 10:74].view(2, 4, 16)
wn = torch.randn(16, dtype=dt)
close(fd.gated_rms_norm(o, z, wn, 1e-6), ref(fd.gated_rms_norm, o, z, wn, 1e-6), tol)
# and a prefill's many heads (fd.GATED_ROWS a program, the last tile partial)
R5 = -(-fd.GATED_MANY // 5) + 3
o = torch.randn(R5, 5, 16, dtype=dt)
z = torch.randn(R5, 100, dtype=dt)[:, 10:90].view(R5, 5, 16)
assert (R5 * 5) % fd.GATED_ROWS and R5 * 5 >= fd.GATED_MANY
# the interpreter rounds each of the norm's three bf16 roundings down (truncation): over 22k outputs some drift past
# 2% (1.6% typical); compiled, every rounding is to nearest and the usual tolerance holds
close(fd.gated_rms_norm(o, z, wn, 1e-6), ref(fd.gated_rms_norm, o, z, wn, 1e-6),
      tol if dt == torch.float32 or sys.argv[2] != "cpu" else 4e-2)
# silu_mul over more than one block
gu = torch.randn(2, 2 * 1500, dtype=dt)
close(fd.silu_mul(gu), ref(fd.silu_mul, gu), tol)
# conv step: state shifted in place at the slots, other slots untouched; u a view
N, C, K = 5, 300, 4
st = torch.randn(N, C, K - 1, dtype=dt)
Pu = torch.randn(3, C + 7, dtype=dt)
cw = torch.randn(C, K, dtype=dt)
slots = torch.tensor([3, 0, 4])
assert fd._triton(slots), "the Triton kernels must run here"
sa, sb = st.clone(), st.clone()
ya = gdk.conv_step(Pu[:, :C], sa, cw, slots)
yb = ref(gdk.conv_step, Pu[:, :C], sb, cw, slots)
close(ya, yb, tol); assert torch.equal(sa, sb), (sa - sb).abs().max()
assert torch.equal(sa[[1, 2]], st[[1, 2]])
# the prefill conv: segments of 37 tokens (two token tiles, the second partial), 2 and 1 (shorter than the K-1
# state: the new state mixes the old one and the inputs), fresh and continuing, rows scattered in u (a strided
# view into a projection) and channels over two tiles
T, C = 120, 200
Pu = torch.randn(T, C + 9, dtype=dt)
cw = torch.randn(C, K, dtype=dt)
for G, n in [(3, 37), (2, 2), (4, 1)]:
    rows = torch.randperm(T)[:G * n]
    for state in (None, torch.randn(G, C, K - 1, dtype=dt)):
        ya, sa = pf.conv_prefill(Pu[:, :C], rows, cw, state, G, n)
        yb, sb = ref(pf.conv_prefill, Pu[:, :C], rows, cw, state, G, n)
        assert ya.shape == yb.shape == (G, n, C) and sa.shape == sb.shape == (G, C, K - 1)
        close(ya, yb, tol); assert torch.equal(sa, sb.to(sa.dtype)), (G, n, state is None)
        # written as contiguous parts (the Gated DeltaNet's q, k, v; boundaries inside a channel tile), or two
        for parts in [(48, 48, 104), (130, 70)]:
            pa, sa = pf.conv_prefill(Pu[:, :C], rows, cw, state, G, n, parts)
            pb, _ = ref(pf.conv_prefill, Pu[:, :C], rows, cw, state, G, n, parts)
            assert [p.shape[-1] for p in pa] == list(parts) and all(p.is_contiguous() for p in pa)
            for x, y in zip(pa, pb):
                close(x, y, tol)
            assert torch.equal(torch.cat(pa, -1), ya), (parts, G, n)      # the same values as whole
# a stage's load compiles the prefill's kernels at the model's dimensions (every call above ran them too)
from memra_pp.model.config import parse_config  # noqa: E402
from memra_pp.model.tiny import tiny_config  # noqa: E402
n0 = pf.CALLS["conv_prefill"]
many = fd.GATED_MANY
if sys.argv[2] == "cpu":    # the interpreter: the gated norm's two tiles at 63 and 64 heads, not ~4,100 programs
    fd.GATED_MANY = 64
try:
    pf.prefill_warm_up(parse_config(tiny_config(num_layers=4)).text, True, True, dt, sys.argv[2])
finally:
    fd.GATED_MANY = many
assert pf.CALLS["conv_prefill"] == n0 + 4, pf.CALLS      # fresh and continuing, u of either row stride
# the Gated DeltaNet step from raw projections
B, H, HV, Kd, V = 3, 2, 4, 16, 16
y = torch.randn(B, 2 * H * Kd + HV * V, dtype=dt)
Pg = torch.randn(B, 2 * HV + 3, dtype=dt)
bb, aa = Pg[:, :HV], Pg[:, HV:2 * HV]
A_log, dtb = torch.randn(HV, dtype=dt), torch.randn(HV, dtype=dt)
pool = torch.randn(6, HV, Kd, V)
pa, pb = pool.clone(), pool.clone()
oa = gdk.gdn_decode_fused(y, bb, aa, A_log, dtb, pa, slots, H, Kd ** -0.5)
ob = ref(gdk.gdn_decode_fused, y, bb, aa, A_log, dtb, pb, slots, H, Kd ** -0.5)
close(oa, ob, tol); close(pa, pb, tol)
assert torch.equal(pa[[1, 2, 5]], pool[[1, 2, 5]])
# several value tiles per head (the tile the sweep did not pick)
pc, pd = pool.clone(), pool.clone()
oc = gdk.gdn_decode_fused(y, bb, aa, A_log, dtb, pc, slots, H, Kd ** -0.5, tile=(8, 1))
od = ref(gdk.gdn_decode_fused, y, bb, aa, A_log, dtb, pd, slots, H, Kd ** -0.5)
close(oc, od, tol); close(pc, pd, tol)
# the state tile loaded before PDL's wait (STATE_BEFORE_WAIT, on by default: the step above ran with it) against
# the same step loading it after the wait: bit for bit
# (with PDL off, as in the interpreter, the order of the loads is all it changes: the counter shows it ran)
assert gdk.STATE_BEFORE_WAIT
gdk.STATE_BEFORE_WAIT, pe_, early = False, pool.clone(), gdk.CALLS["state_before_wait"]
assert torch.equal(gdk.gdn_decode_fused(y, bb, aa, A_log, dtb, pe_, slots, H, Kd ** -0.5), oa) and torch.equal(pe_, pa)
gdk.STATE_BEFORE_WAIT = True
assert gdk.CALLS["state_before_wait"] == early
# the in-place step of kernels/gdn_decode.py (fla's tile, the eager GPU decode) against its reference
from memra_pp.kernels.gdn_decode import gdn_decode_ref, gdn_decode_triton  # noqa: E402
q, k, v = torch.randn(B, H, Kd, dtype=dt), torch.randn(B, H, Kd, dtype=dt), torch.randn(B, HV, V, dtype=dt)
g, beta = -torch.rand(B, HV), torch.rand(B, HV).to(dt)
pe, pf = pool.clone(), pool.clone()
close(gdn_decode_triton(q, k, v, g, beta, pe, slots, Kd ** -0.5), gdn_decode_ref(q, k, v, g, beta, pf, slots,
                                                                                  Kd ** -0.5), tol)
close(pe, pf, tol)
assert torch.equal(pe[[1, 2, 5]], pool[[1, 2, 5]])
# decode attention over paged KV pools: GQA (3 query heads per kv head), the gate a strided view into the
# projection, slots out of order with their pages scattered (one slot the scratch one, all on the null page), lens
# up to S; one program per head, and split over S
Bq, nkv, G3, Dh, N, S = 3, 2, 3, 32, 6, 160
Pq = torch.randn(Bq, nkv * G3 * 2 * Dh, dtype=dt)
qa = torch.randn(Bq, nkv * G3, Dh, dtype=dt)
gv = Pq.view(Bq, nkv * G3, 2 * Dh)[..., Dh:]
pgd.POISON = True        # the split partials start as NaN: one the combine reads and nothing wrote would show
for kvb, blk in ((32, 32), (64, 64), (64, 32)):            # page size, tile (a tile never straddles a page)
    npg = -(-192 // kvb)
    kp, vp = torch.randn(N * npg + 1, nkv, kvb, Dh, dtype=dt), torch.randn(N * npg + 1, nkv, kvb, Dh, dtype=dt)
    table = torch.zeros(N + 1, npg, dtype=torch.long)
    table[:N] = (torch.randperm(N * npg) + 1).view(N, npg)   # page 0: the null page, the scratch slot's
    sl, ln = torch.tensor([4, N, 5]), torch.tensor([160, 1, 97])
    # (Triton 3.9's interpreter computes tl.dot of bfloat16 operands wrongly: bf16 runs compiled on the GPU only)
    if dt == torch.float32 or sys.argv[2] == "cuda":
        # on the CPU (4 "SMs"): the 160 keys split over programs and combined; at S=kvb one tile, no split
        for s_ in (S, kvb):
            lns = ln.clamp(max=s_)
            close(pgd.decode_attention(qa, gv, kp, vp, table, sl, lns, s_, block=blk),
                  ref(pgd.decode_attention, qa, gv, kp, vp, table, sl, lns, s_), tol)
        # one split however long (a mixed step's decode rows: max_splits=1), the 160 keys walked by one program
        close(pgd.decode_attention(qa, gv, kp, vp, table, sl, ln, S, block=blk, max_splits=1),
              ref(pgd.decode_attention, qa, gv, kp, vp, table, sl, ln, S), tol)
        # each sequence's chunks from its own length (decode_graphs.ANY_KV): S the whole capacity, splits past a
        # short sequence neither written nor read by the combine; one row alone gets more splits (3 here) than three.
        # The combine sums 2 splits at a time here, so its loop runs twice, the second time ragged: the 160 keys
        # alone fill all three splits, 97 two, 1 one
        cap = npg * kvb
        pgd.COMBINE_CH = 2
        for rows in (slice(None), slice(0, 1), slice(2, 3), slice(1, 2)):
            got = pgd.decode_attention(qa[rows], gv[rows], kp, vp, table, sl[rows], ln[rows], cap, block=blk,
                                       len_chunks=True)
            close(got, ref(pgd.decode_attention, qa[rows], gv[rows], kp, vp, table, sl[rows], ln[rows], cap), tol)
        # one row at lengths around every tile, page and chunk boundary up to the capacity (a combine that took the
        # page for the tile, or miscounted the live splits, differs at some of them)
        for L in (31, 32, 33, 63, 64, 65, 96, 128, 129, 191, cap):
            l1 = torch.tensor([L])
            got = pgd.decode_attention(qa[:1], gv[:1], kp, vp, table, sl[:1], l1, cap, block=blk, len_chunks=True)
            close(got, ref(pgd.decode_attention, qa[:1], gv[:1], kp, vp, table, sl[:1], l1, cap), tol)
pgd.POISON, pgd.COMBINE_CH = False, 16
# the new key and value into their pages: slots out of order, one the scratch slot (the null page), positions at a
# page's first and last offset and inside; k a contiguous [B, nkv, D], v a strided view into a projection;
# lens = pos + 1


def write_case(kvb):
    """Two K / V pool pairs (the second a copy, for the reference), a page table with the pages scattered (page 0:
    the null page, the scratch slot's) and 4 rows' slots and positions."""
    npg = -(-192 // kvb)
    pools = [torch.randn(N * npg + 1, nkv, kvb, Dh, dtype=dt) for _ in range(2)]
    pools += [p.clone() for p in pools]
    table = torch.zeros(N + 1, npg, dtype=torch.long)
    table[:N] = (torch.randperm(N * npg) + 1).view(N, npg)
    return pools, table, torch.tensor([4, N, 5, 0]), torch.tensor([kvb, 3, kvb - 1, 191])


for kvb in (32, 64):
    pools, table, sl, pos = write_case(kvb)
    kn = torch.randn(4, nkv, Dh, dtype=dt)
    vn = torch.randn(4, nkv * 3 * Dh, dtype=dt).view(4, nkv, 3 * Dh)[..., Dh:2 * Dh]
    lens = pgd.kv_write(kn, vn, pools[0], pools[1], table, sl, pos)
    want = ref(pgd.kv_write, kn, vn, pools[2], pools[3], table, sl, pos)
    assert torch.equal(lens, want) and torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])
    assert torch.equal(pools[0][table[4, 1], :, 0], kn[0]) and torch.equal(pools[1][table[0, 191 // kvb], :,
                                                                                     191 % kvb], vn[3])
# the q / k norms with their rotary embedding and the new key and value into their pages, one kernel
# (qk_norm_kv_write), against add_rms_norm's and kv_write's references: q, k, v strided views into a projection
# (q beside its gate), GQA, partial rotary, slots out of order (one the scratch slot), positions at page edges
for kvb in (32, 64):
    pools, table, sl, pos = write_case(kvb)
    Pa = torch.randn(4, nkv * G3 * 2 * Dh + 2 * nkv * Dh, dtype=dt)
    qv = Pa[:, :nkv * G3 * 2 * Dh].view(4, nkv * G3, 2 * Dh)[..., :Dh]
    kv_ = Pa[:, nkv * G3 * 2 * Dh:].view(4, 2 * nkv, Dh)
    wq_, wk_ = torch.randn(Dh, dtype=dt) * 0.1, torch.randn(Dh, dtype=dt) * 0.1
    cs = (torch.randn(4, 8, dtype=dt), torch.randn(4, 8, dtype=dt))
    before = pgd.CALLS["qk_kv_write"]
    qa_, la_ = pgd.qk_norm_kv_write(qv, kv_[:, :nkv], kv_[:, nkv:], wq_, wk_, 1e-6, *cs, pools[0], pools[1], table,
                                    sl, pos)
    qb_, lb_ = ref(pgd.qk_norm_kv_write, qv, kv_[:, :nkv], kv_[:, nkv:], wq_, wk_, 1e-6, *cs, pools[2], pools[3],
                   table, sl, pos)
    assert pgd.CALLS["qk_kv_write"] == before + 1 and qa_.shape == (4, nkv * G3, Dh) and qa_.is_contiguous()
    close(qa_, qb_, tol); assert torch.equal(la_, lb_)
    close(pools[0], pools[2], tol); assert torch.equal(pools[1], pools[3])
    pgd.FUSE_QK = False         # switched off: the three kernels, bit for bit what the fused one wrote
    pools[2], pools[3] = pools[0].clone().normal_(), pools[1].clone().normal_()
    qc_, _ = pgd.qk_norm_kv_write(qv, kv_[:, :nkv], kv_[:, nkv:], wq_, wk_, 1e-6, *cs, pools[2], pools[3], table,
                                  sl, pos)
    pgd.FUSE_QK = True
    assert pgd.CALLS["qk_kv_write"] == before + 1
    at = (table[sl, pos // kvb], slice(None), pos % kvb)
    assert torch.equal(qc_, qa_) and torch.equal(pools[2][at], pools[0][at]) and torch.equal(pools[3][at], pools[1][at])
# kernels/gemv.py (forced onto every shape): the products of few rows (1 to 3: padded to 4 inside), plain and with
# the residual add + norm in their prologue (with and without a residual), against add_rms_norm's reference then
# F.linear; K over several steps and a ragged last one, N not a multiple of the tile; the new residual bit for bit
from memra_pp.kernels import gemv  # noqa: E402
gemv.GEMV_ROWS, gemv.FORCE, calls = 4, True, dict(gemv.CALLS)
# the persistent programs with the next row block's weights in flight (PREFETCH) and one block at a time; the K-in-
# steps products with their first step's weights loaded before PDL's wait (PRELOAD) and not
for pref, pre in ((True, False), (False, True)):
    gemv.PREFETCH, gemv.PRELOAD = pref, pre
    for T in (1, 3):
        Kg, Ng = 200, 37
        hg, rg = torch.randn(T, Kg, dtype=dt), torch.randn(T + 2, Kg + 16, dtype=dt)[1:T + 1, 5:5 + Kg]   # own stride
        lwg, Wg = torch.randn(Kg, dtype=dt) * 0.1, torch.randn(Ng, Kg, dtype=dt) * 0.1
        # tiles: the default (the whole row in one step), K in steps, persistent programs over several row blocks
        for t in (None, (8, 64, 4, 0), (4, 256, 2, 3), (8, 64, 4, 2)):
            close(gemv.linear(hg, Wg, t), ref(gemv.linear, hg, Wg), tol)
            sa_, ya_ = gemv.norm_linear(hg, rg, lwg, 1e-6, Wg, t)
            sb_, yb_ = ref(gemv.norm_linear, hg, rg, lwg, 1e-6, Wg)
            # (the interpreter rounds float32 to bfloat16 its own way: the new residual is bit-equal compiled only)
            assert torch.equal(sa_, sb_) if dt == torch.float32 or sys.argv[2] == "cuda" else close(sa_, sb_, tol)
            close(ya_, yb_, tol)
            s0, y0 = gemv.norm_linear(hg, None, lwg, 1e-6, Wg, t)
            assert s0 is hg; close(y0, ref(gemv.norm_linear, hg, None, lwg, 1e-6, Wg)[1], tol)
gemv.PREFETCH, gemv.PRELOAD = True, False
assert gemv.CALLS["gemv"] - calls["gemv"] == 16 and gemv.CALLS["norm_gemv"] - calls["norm_gemv"] == 32, gemv.CALLS
gemv.GEMV_ROWS, gemv.FORCE = 1, False
# the committed choice: one row only; plain for narrow, deep matrices, normed where the row fits one step (K <= 2,048)
x1, x2 = torch.randn(1, 4096, dtype=dt), torch.randn(2, 4096, dtype=dt)
assert gemv.takes(x1, torch.empty(2048, 4096, dtype=dt)) and not gemv.takes(x2, torch.empty(2048, 4096, dtype=dt))
assert not gemv.takes(x1, torch.empty(8192, 4096, dtype=dt))
assert gemv.takes(x1[:, :2048], torch.empty(12352, 2048, dtype=dt), True)
assert not gemv.takes(x1, torch.empty(12352, 4096, dtype=dt), True)
print("fused ok", dt, sys.argv[2])
