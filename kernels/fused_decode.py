"""Fused kernels of the decode step a CUDA graph captures: each replaces a chain of small torch kernels (a decode
step of 64 layers was ~4,300 kernels, two thirds of them a few microseconds of elementwise work each).

- add_rms_norm: residual add + zero-centred RMSNorm, one pass (and the per-head q/k norms, strided rows).
- gated_rms_norm: the linear-attention output norm gated by silu(z), z read in place from the projection.
- silu_mul: silu(gate) * up from the merged gate/up projection.
- decode_attention, kv_write (kernels/paged_attention.py): one query per sequence against its slot of the KV
  pools, read in place (no gather), gated; the new key and value written into their pages.
- conv_step, gdn_decode_fused (kernels/gdn_decode.py): the Gated DeltaNet's conv and recurrent steps in place at
  the slots, the gates computed in the kernel from the raw b / a projections.
- l2norm (prefill): the q/k normalisation before flash-linear-attention's chunk kernels, with fla's arithmetic but
  one fixed tile (fla's own kernel autotunes per bucket of the token count, compiling 25 configs mid-request).

Every kernel has a torch reference with the same contract and the same rounding points (the torch ops the eager
step runs), which the CPU path uses; tests run the Triton kernels against them on CPU through Triton's interpreter
and compiled on the GPU. Runs in stage processes.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch references serve
    triton = None
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without grid dependency control: every kernel launches as usual
    gdc_wait = gdc_launch_dependents = None


USE_TRITON = True    # False: the torch references everywhere (tests compare the two on one device)
# Programmatic dependent launch (Hopper and later) for the decode step's kernels: a kernel is launched while the one
# before it still runs; it loads what cannot have changed (weights) first, waits at `pdl_enter` for the kernel before
# to finish (its writes visible), and only then reads activations, writes anything, and lets the next kernel
# launch. A step of few rows is hundreds of kernels of a few microseconds each, whose ramp and tail this overlaps
PDL = gdc_wait is not None
_PDL_DEVICES: dict = {}


def pdl(t: torch.Tensor) -> dict:
    """A step kernel's launch options on t's device: its PDL constexpr, and launch_pdl where PDL runs there."""
    if not (PDL and t.is_cuda and os.environ.get("TRITON_INTERPRET") != "1"):
        return {"PDL": False}
    on = _PDL_DEVICES.get(t.device.index)
    if on is None:
        on = _PDL_DEVICES[t.device.index] = (torch.version.hip is None       # griddepcontrol: NVIDIA only
                                             and torch.cuda.get_device_capability(t.device)[0] >= 9)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


_SMS: dict = {}


def _sms(device) -> int:
    """The device's multiprocessors (4 off CUDA: the interpreter's grids stay small)."""
    if device.type != "cuda":
        return 4
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]


def device_counters(store: dict, dev, n: int = 1) -> torch.Tensor:
    """Zeroed int32 counters [>= n] on dev for a kernel whose last program resets what it counted (the router's,
    the greedy sampler's), kept in `store` per device and replaced by a larger one when n outgrows them. Made during
    a CUDA graph capture, they belong to the graph's pool (their zeroing captured too) and are not kept."""
    key = str(dev)
    c = store.get(key)
    if c is None or c.numel() < n:
        c = torch.zeros(n, dtype=torch.int32, device=dev)
        if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return c        # decode graphs warm up eagerly first, so they find one kept
        store[key] = c
    return c


def _triton(t: torch.Tensor) -> bool:
    """The Triton kernel for CUDA tensors (and for CPU ones under Triton's interpreter, which the tests use)."""
    return USE_TRITON and triton is not None and (t.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")


def _rows3(x: torch.Tensor) -> torch.Tensor:
    """A [.., D] tensor with unit last stride as [R0, R1, D] (strided rows allowed)."""
    if x.dim() == 2:
        return x[:, None]
    assert x.dim() == 3, x.shape
    return x


# -- RMSNorm (+ residual) -------------------------------------------------------------------------------------------
def add_rms_norm_ref(x, res, w, eps: float, plus_one: bool = True, rope=None):
    """(s, norm(s)) with s = x + res (or x when res is None); the torch ops of layers.rms_norm (then
    attention.apply_rope with rope = (cos, sin) [R0, r])."""
    s = x if res is None else x + res
    sf = s.float()
    y = sf * torch.rsqrt(sf.pow(2).mean(-1, keepdim=True) + eps)
    wf = (1.0 + w.float()) if plus_one else w.float()
    y = (y * wf).to(s.dtype)
    if rope is not None:
        from memra_pp.model.attention import apply_rope
        y = apply_rope(y, *rope)
    return s, y


def add_rms_norm(x, res, w, eps: float, plus_one: bool = True, rope=None):
    """x [R, D] or [R0, R1, D] (rows may be strided, as a view into a projection); res like x or None. Returns
    (x + res, or x itself when res is None) and the normed rows, both [R0 * R1, D]-shaped like x but contiguous.
    rope = (cos, sin) [R0, r]: the normed rows (the per-head q / k norms) are also rotated, partial rotary on
    their first r dims, as attention.apply_rope rounds."""
    if not _triton(x):
        return add_rms_norm_ref(x, res, w, eps, plus_one, rope)
    x3 = _rows3(x)
    R0, R1, D = x3.shape
    assert x3.stride(2) == 1 and w.is_contiguous()
    out = torch.empty(x3.shape, dtype=x.dtype, device=x.device)
    s = out if res is None else torch.empty_like(out)
    r3 = x3 if res is None else _rows3(res)
    cos, sin = rope if rope is not None else (w, w)
    assert cos.is_contiguous() and sin.is_contiguous()
    _add_rms_norm_kernel[(R0 * R1,)](x3, r3, w, s, out, cos, sin, eps, R1, x3.stride(0), x3.stride(1),
                                     r3.stride(0), r3.stride(1), D=D, BLOCK=triton.next_power_of_2(D),
                                     HAS_RES=res is not None, PLUS_ONE=plus_one,
                                     ROPE=0 if rope is None else cos.shape[-1], num_warps=8 if D >= 2048 else 1,
                                     **pdl(x3))
    return (x if res is None else s.view(x.shape)), out.view(x.shape)


# -- gated RMSNorm ------------------------------------------------------------------------------------------------
def gated_rms_norm_ref(o_RD, z_RD, w, eps: float):
    """The eager model's gated norm itself (layers.gated_rms_norm)."""
    from memra_pp.model.layers import gated_rms_norm as eager
    return eager(o_RD, z_RD, w, eps)


def gated_rms_norm(o_BVD, z_BVD, w, eps: float):
    """o [B, HV, D] contiguous, z [B, HV, D] with unit last stride (a view into the projection) -> [B, HV * D]."""
    B, HV, D = o_BVD.shape
    if not _triton(o_BVD):
        return gated_rms_norm_ref(o_BVD, z_BVD, w, eps).reshape(B, HV * D)
    assert o_BVD.is_contiguous() and z_BVD.stride(2) == 1
    out = torch.empty(B, HV * D, dtype=o_BVD.dtype, device=o_BVD.device)
    R = B * HV
    # few heads (a decode step below GATED_MANY: up to 85 sequences of the 27B, 127 of the 35B-A3B): one head a
    # program, one warp; more (a prefill's thousands, a large decode batch): GATED_ROWS heads a program, the same
    # arithmetic per head (one head a program at 4,096 tokens of the 27B was 237 us a layer on an H200)
    BT, warps = (GATED_ROWS, 4) if R >= GATED_MANY else (1, 1)
    _gated_rms_norm_kernel[(triton.cdiv(R, BT),)](o_BVD, z_BVD, w, out, eps, R, HV, z_BVD.stride(0),
                                                  z_BVD.stride(1), D=D, BLOCK=triton.next_power_of_2(D), BT=BT,
                                                  num_warps=warps, **pdl(o_BVD))
    return out


GATED_ROWS, GATED_MANY = 16, 4096     # heads a program, from this many heads (a 64-token prefill of the 27B: 3,072)


# -- l2norm (prefill q / k) -----------------------------------------------------------------------------------------
def l2norm_ref(x, eps: float = 1e-6):
    """flash-linear-attention's l2norm_fwd arithmetic: float32, x / sqrt(sum x^2 + eps), rounded once."""
    xf = x.float()
    return (xf * (1.0 / torch.sqrt((xf * xf).sum(-1, keepdim=True) + eps))).to(x.dtype)


L2_ROWS = 16     # rows a program (4 warps): one tile for every token count, so nothing tunes or compiles per step


def l2norm(x, eps: float = 1e-6, out=None):
    """x [..., D] (contiguous) -> each row over its L2 norm, as l2norm_ref rounds; written into `out` (contiguous,
    x's shape) where given."""
    if not _triton(x) or not x.is_contiguous() or x.numel() == 0 or (out is not None and not out.is_contiguous()):
        return l2norm_ref(x, eps) if out is None else out.copy_(l2norm_ref(x, eps))
    D = x.shape[-1]
    R = x.numel() // D
    out = torch.empty_like(x) if out is None else out
    _l2norm_kernel[(triton.cdiv(R, L2_ROWS),)](x, out, eps, R, D=D, BD=triton.next_power_of_2(D), BT=L2_ROWS,
                                                num_warps=4)
    return out


# -- silu(gate) * up --------------------------------------------------------------------------------------------
def silu_mul_ref(gu_BI2):
    i = gu_BI2.shape[1] // 2
    return F.silu(gu_BI2[:, :i]) * gu_BI2[:, i:]


def silu_mul(gu_BI2):
    """[B, 2I] (gate | up) -> silu(gate) * up [B, I], rounded as the two torch ops round."""
    if not _triton(gu_BI2):
        return silu_mul_ref(gu_BI2)
    B, I2 = gu_BI2.shape
    i = I2 // 2
    assert gu_BI2.stride(1) == 1
    out = torch.empty(B, i, dtype=gu_BI2.dtype, device=gu_BI2.device)
    BLOCK = 1024
    _silu_mul_kernel[(B, triton.cdiv(i, BLOCK))](gu_BI2, out, gu_BI2.stride(0), i, BLOCK=BLOCK, num_warps=4,
                                                 **pdl(gu_BI2))
    return out


if triton is not None:
    @triton.jit
    def pdl_enter(PDL: tl.constexpr):
        """With PDL: wait for the kernel before (its writes visible), then let the next one launch. Every kernel
        launched with launch_pdl calls it before it reads an activation or writes anything, and no program returns
        before calling it. Waiting first means that when a kernel starts, every kernel two or more back has
        finished: what only those wrote may be read before the wait (gdn_decode.STATE_BEFORE_WAIT relies on it)."""
        if PDL:
            gdc_wait()
            gdc_launch_dependents()

    @triton.jit
    def _partner(o, ROPE: tl.constexpr):
        """The rotate_half partner of each dim j < ROPE (j + ROPE/2, or j - ROPE/2), and which dims rotate."""
        half: tl.constexpr = ROPE // 2
        return tl.where(o < half, o + half, o - half), o < ROPE

    @triton.jit
    def _rotate(y, xp, inv, w, cos, sin, o, pj, rm, ROPE: tl.constexpr, PLUS_ONE: tl.constexpr):
        """The normed row y (its dtype) with its first ROPE dims rotated as attention.apply_rope rounds: xp [BLOCK]
        the partner dims' input (float32 of the dtype-rounded value), normed by the row's inv and weights w; cos,
        sin the row's [ROPE] angles."""
        wp = tl.load(w + pj, mask=rm, other=0).to(tl.float32)
        if PLUS_ONE:
            wp = 1.0 + wp
        yp = (xp * inv * wp).to(y.dtype).to(tl.float32)
        yp = tl.where(o < ROPE // 2, -yp, yp)
        c = tl.load(cos + o, mask=rm, other=0).to(tl.float32)
        sn = tl.load(sin + o, mask=rm, other=0).to(tl.float32)
        a = (y.to(tl.float32) * c).to(y.dtype).to(tl.float32)
        bb = (yp * sn).to(y.dtype).to(tl.float32)
        return tl.where(rm, (a + bb).to(y.dtype), y)

    @triton.jit
    def _norm_rope_head(x, w, cos, sin, o, m, eps, D: tl.constexpr, ROPE: tl.constexpr):
        """One head of D at x normed with weights (1 + w) and its first ROPE dims rotated (cos, sin: its [ROPE]
        angles), rounded as add_rms_norm with rope rounds (the q / k norms)."""
        xv = tl.load(x + o, mask=m, other=0)
        xf = xv.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / D + eps)
        y = (xf * inv * (1.0 + tl.load(w + o, mask=m, other=0).to(tl.float32))).to(xv.dtype)
        if ROPE > 0:
            pj, rm = _partner(o, ROPE)
            y = _rotate(y, tl.load(x + pj, mask=rm, other=0).to(tl.float32), inv, w, cos, sin, o, pj, rm, ROPE,
                        True)
        return y

    @triton.jit
    def _add_rms_norm_kernel(x, r, w, s, out, cos, sin, eps, R1, sx0, sx1, sr0, sr1, D: tl.constexpr,
                             BLOCK: tl.constexpr, HAS_RES: tl.constexpr, PLUS_ONE: tl.constexpr, ROPE: tl.constexpr,
                             PDL: tl.constexpr):
        pdl_enter(PDL)
        row = tl.program_id(0).to(tl.int64)
        i0, i1 = row // R1, row % R1
        o = tl.arange(0, BLOCK)
        m = o < D
        xv = tl.load(x + i0 * sx0 + i1 * sx1 + o, mask=m, other=0)
        if HAS_RES:
            rv = tl.load(r + i0 * sr0 + i1 * sr1 + o, mask=m, other=0)
            xv = (xv.to(tl.float32) + rv.to(tl.float32)).to(xv.dtype)
            tl.store(s + row * D + o, xv, mask=m)
        xf = xv.to(tl.float32)
        var = tl.sum(xf * xf, 0) / D
        inv = 1.0 / tl.sqrt(var + eps)
        wf = tl.load(w + o, mask=m, other=0).to(tl.float32)
        if PLUS_ONE:
            wf = 1.0 + wf
        y = (xf * inv * wf).to(xv.dtype)
        if ROPE > 0:   # rotate_half partner of dim j < ROPE: j + ROPE/2 (negated) or j - ROPE/2, normed the same way
            pj, rm = _partner(o, ROPE)
            xp = tl.load(x + i0 * sx0 + i1 * sx1 + pj, mask=rm, other=0).to(tl.float32)
            if HAS_RES:
                xp = (xp + tl.load(r + i0 * sr0 + i1 * sr1 + pj, mask=rm, other=0).to(tl.float32)).to(xv.dtype)
                xp = xp.to(tl.float32)
            y = _rotate(y, xp, inv, w, cos + i0 * ROPE, sin + i0 * ROPE, o, pj, rm, ROPE, PLUS_ONE)
        tl.store(out + row * D + o, y, mask=m)

    @triton.jit(do_not_specialize=["R"])    # one binary for every row count
    def _gated_rms_norm_kernel(o_ptr, z, w, out, eps, R, HV, sz0, sz1, D: tl.constexpr, BLOCK: tl.constexpr,
                               BT: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)
        row = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)            # [BT] (sequence, head) rows
        n, hv = row // HV, row % HV
        o = tl.arange(0, BLOCK)
        m = (row < R)[:, None] & (o < D)[None, :]
        ov = tl.load(o_ptr + row[:, None] * D + o[None, :], mask=m, other=0)
        of = ov.to(tl.float32)
        var = tl.sum(of * of, 1) / D
        nrm = (of * (1.0 / tl.sqrt(var + eps))[:, None]).to(ov.dtype).to(tl.float32)
        wv = tl.load(w + o, mask=o < D, other=0)
        y = (wv.to(tl.float32)[None, :] * nrm).to(ov.dtype).to(tl.float32)
        zf = tl.load(z + (n * sz0 + hv * sz1)[:, None] + o[None, :], mask=m, other=0).to(tl.float32)
        tl.store(out + row[:, None] * D + o[None, :], (y * (zf / (1.0 + tl.exp(-zf)))).to(ov.dtype), mask=m)

    @triton.jit(do_not_specialize=["R"])    # one binary for every row count
    def _l2norm_kernel(x, y, eps, R, D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr):
        rows = tl.program_id(0).to(tl.int64) * BT + tl.arange(0, BT)
        o = tl.arange(0, BD)
        m = (rows < R)[:, None] & (o < D)[None, :]
        xf = tl.load(x + rows[:, None] * D + o[None, :], mask=m, other=0.0).to(tl.float32)
        inv = 1 / tl.sqrt(tl.sum(xf * xf, 1) + eps)
        tl.store(y + rows[:, None] * D + o[None, :], (xf * inv[:, None]).to(y.dtype.element_ty), mask=m)

    @triton.jit
    def _silu_mul_kernel(gu, out, sg, I, BLOCK: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)
        n = tl.program_id(0).to(tl.int64)
        o = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        m = o < I
        gv = tl.load(gu + n * sg + o, mask=m, other=0)
        uv = tl.load(gu + n * sg + I + o, mask=m, other=0)
        gf = gv.to(tl.float32)
        sv = (gf / (1.0 + tl.exp(-gf))).to(gv.dtype)
        tl.store(out + n * I + o, (sv.to(tl.float32) * uv.to(tl.float32)).to(gv.dtype), mask=m)
