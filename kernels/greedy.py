"""Greedy sampling of a step's float32 logits in one kernel: each row's argmax (the first of equal maxima, as
torch.argmax; a NaN counts above every number) and its logprob (the logit minus the row's logsumexp), written as the
float64 [2, N] pair (tokens, logprobs) that sampling.sample_async copies to the host, and the tokens as int64 [N]
that the next decode step is fed from on the device.

The torch ops it replaces (argmax, gather, logsumexp's four kernels, a subtraction, two casts and a stack) were ten
launches after each decode step, a few microseconds of device time each. Here a row's vocabulary is split over
programs of BLOCK logits; each writes its block's maximum, the first index holding it and its sum of exponentials,
and the row's last program to finish (a counter a row, reset by that program) combines them. Runs in stage
processes."""
from __future__ import annotations

import torch

from memra_pp.kernels.fused_decode import _triton, device_counters, triton

if triton is not None:
    import triton.language as tl

FUSED = True     # False: the torch ops (greedy_ref) on every device (benchmarks compare the two)
BLOCK = 4096     # logits a program: a [1, 248320] row is 61 programs
CALLS = {"greedy": 0}
# device -> int32 [rows]: each row's programs done, reset by the row's last. Sampling runs on the stage's one stream,
# so two greedy kernels never share a counter at once
_COUNTERS: dict = {}


def greedy_ref(logits_NV: torch.Tensor):
    """(tokens int64 [N], float64 [2, N] of tokens and logprobs): the torch ops of sampling.sample_async."""
    tok = logits_NV.argmax(-1)
    lp = logits_NV.gather(1, tok[:, None])[:, 0] - torch.logsumexp(logits_NV, -1)
    return tok, torch.stack([tok.double(), lp.double()])


def greedy(logits_NV: torch.Tensor):
    """greedy_ref's contract; float32 logits with unit last stride go through the kernel."""
    N, V = logits_NV.shape
    if not (FUSED and _triton(logits_NV) and logits_NV.dtype == torch.float32 and logits_NV.stride(1) == 1
            and N > 0 and V > 0):
        return greedy_ref(logits_NV)
    CALLS["greedy"] += 1
    dev = logits_NV.device
    P = triton.cdiv(V, BLOCK)
    part = torch.empty(2, N, P, dtype=torch.float32, device=dev)      # block maxima, their sums of exponentials
    first = torch.empty(N, P, dtype=torch.int32, device=dev)          # the first index of each block's maximum
    tok = torch.empty(N, dtype=torch.int64, device=dev)
    both = torch.empty(2, N, dtype=torch.float64, device=dev)
    cnt = device_counters(_COUNTERS, dev, max(N, 64))
    _greedy_kernel[(N, P)](logits_NV, part, first, tok, both, cnt, logits_NV.stride(0), N, V, P, BLOCK=BLOCK,
                           BP=triton.next_power_of_2(P), num_warps=4)
    return tok, both


if triton is not None:
    @triton.jit
    def _greedy_kernel(l_ptr, part_ptr, first_ptr, tok_ptr, both_ptr, cnt_ptr, stride_l, N, V, P,
                       BLOCK: tl.constexpr, BP: tl.constexpr):
        n = tl.program_id(0).to(tl.int64)       # n * stride_l passes 2**31 from about 8,600 rows of 248,320
        p = tl.program_id(1)
        offs = p * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(l_ptr + n * stride_l + offs, mask=offs < V, other=float("-inf"))
        key = tl.where(x == x, x, float("inf"))       # a NaN above every number, +inf included
        nan = tl.max((x != x).to(tl.int32), 0)
        m = tl.max(key, 0)
        # the first index of the maximum; a NaN's index where the block has one
        hit = tl.where(nan + offs * 0 > 0, x != x, key == m)
        idx = tl.min(tl.where(hit, offs, V), 0)
        # exponentials shifted by the block's maximum (by 0 where it is infinite, as torch.logsumexp shifts)
        c = tl.where(tl.abs(m) == float("inf"), 0.0, m)
        s = tl.sum(tl.where(offs < V, tl.exp(x - c), 0.0), 0)
        tl.store(part_ptr + n * P + p, tl.where(nan > 0, float("nan"), m))
        tl.store(part_ptr + (N + n) * P + p, s)
        tl.store(first_ptr + n * P + p, idx)
        # the row's last program combines its blocks (router_route's semaphore: stores, a barrier, one release)
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr + n, 1, sem="acq_rel")
        if done == P - 1:
            ps = tl.arange(0, BP)
            pm = ps < P
            bm = tl.load(part_ptr + n * P + ps, mask=pm, other=float("-inf"), volatile=True)
            bs = tl.load(part_ptr + (N + n) * P + ps, mask=pm, other=0.0, volatile=True)
            bi = tl.load(first_ptr + n * P + ps, mask=pm, other=V, volatile=True)
            bnan = bm != bm
            bkey = tl.where(bnan, float("inf"), bm)
            anynan = tl.max(bnan.to(tl.int32), 0)
            M = tl.max(bkey, 0)
            t = tl.min(tl.where(tl.where(anynan + ps * 0 > 0, bnan, bkey == M), bi, V), 0)
            bc = tl.where(tl.abs(bkey) == float("inf"), 0.0, bkey)
            C = tl.where(tl.abs(M) == float("inf"), 0.0, M)
            # a block of -inf only adds nothing (its shifted exp could overflow when C is far below 0)
            S = tl.sum(tl.where(bs > 0, bs * tl.exp(bc - C), 0.0), 0)
            lse = tl.log(S) + C
            lp = tl.load(l_ptr + n * stride_l + t) - lse      # the token's logit (its row's maximum, or a NaN)
            tl.store(tok_ptr + n, t.to(tl.int64))
            tl.store(both_ptr + n, t.to(tl.float64))
            tl.store(both_ptr + N + n, lp.to(tl.float64))
            tl.atomic_xchg(cnt_ptr + n, 0)
