"""Gated full attention with q/k norms and partial interleaved M-RoPE (reference/qwen35.md 2.3)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..switches import initial
from .batch import h2d
from .config import TextConfig
from .layers import Param, project


class Rope:
    """Partial rotary embedding; frequency j takes its angle from row T, H or W (interleaved M-RoPE)."""

    def __init__(self, cfg: TextConfig, device):
        r = cfg.rotary_dim
        self.r = r
        self.inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, r, 2, dtype=torch.float32, device=device) / r))
        row = torch.zeros(r // 2, dtype=torch.long)
        sec = cfg.mrope_section
        # interleaved always: transformers' Qwen3.5 never reads mrope_interleaved (config.py warns on false and
        # sets it true); a TextConfig built by hand with false would be read otherwise than it says
        assert cfg.mrope_interleaved, "Qwen3.5's M-RoPE is interleaved (mrope_interleaved false is not supported)"
        for j in range(r // 2):
            if j % 3 == 1 and j < 3 * sec[1]:
                row[j] = 1
            elif j % 3 == 2 and j < 3 * sec[2]:
                row[j] = 2
        self.row = row.to(device)

    def cos_sin(self, pos_3T: torch.Tensor, dtype):
        """pos [3, T] -> cos, sin [T, r] in the model dtype."""
        p = h2d(pos_3T, self.inv_freq.device).float()                         # [3, T]
        f = p[self.row, :].transpose(0, 1) * self.inv_freq                      # [T, r/2]
        emb = torch.cat([f, f], -1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x_THD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    r = cos.shape[-1]
    xr, xp = x_THD[..., :r], x_THD[..., r:]
    x1, x2 = xr[..., : r // 2], xr[..., r // 2:]
    rot = torch.cat([-x2, x1], -1)
    out = xr * cos[:, None, :] + rot * sin[:, None, :]
    return torch.cat([out, xp], -1)


class GatedAttention(Param):
    def __init__(self, cfg: TextConfig):
        super().__init__(["q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "q_norm.weight",
                          "k_norm.weight"])
        self.cfg = cfg

    def load(self, prefix: str, src, dtype, device):
        super().load(prefix, src, dtype, device)
        self.qkv = self.fuse(["q_proj", "k_proj", "v_proj"])
        self.w_in = self.qkv           # the decode graphs' merged input projection (Layer.decode_fused)

    def decode_fused(self, P, cos, sin, kp, vp, table, slots_B, pos_B, S: int):
        """The decode graphs' attention from the merged projection P = x @ qkv^T (q|gate|k|v; the layer computes it
        with its input norm): the q and k norms with their rotary embedding and the new key and value written into
        their pages (kp, vp of this layer) in one kernel, attention over the slots' first S positions read in place
        and gated, then o_proj (kernels/paged_attention.py, kernels/gemv.py)."""
        from memra_pp.kernels.gemv import linear
        from memra_pp.kernels.paged_attention import decode_attention, qk_norm_kv_write
        c = self.cfg
        B, D = P.shape[0], c.head_dim
        nq, nkv = c.num_attention_heads * 2 * D, c.num_key_value_heads * D
        qg = P[:, :nq].view(B, c.num_attention_heads, 2 * D)
        k = P[:, nq:nq + nkv].view(B, c.num_key_value_heads, D)
        v = P[:, nq + nkv:].view(B, c.num_key_value_heads, D)
        q, lens = qk_norm_kv_write(qg[..., :D], k, v, self.q_norm_weight, self.k_norm_weight, c.rms_norm_eps, cos,
                                   sin, kp, vp, table, slots_B, pos_B)
        from .decode_graphs import ANY_KV
        o = decode_attention(q, qg[..., D:], kp, vp, table, slots_B, lens, S,     # the gate: a view, read in place
                             len_chunks=ANY_KV)
        return linear(o, self.o_proj_weight)

    def project(self, x_TH, cos, sin, lora=None, out=None):
        """q [T, nh, D], gate [T, nh*D], k, v [T, nkv, D] (k normed and rotated, as cached). The q / k norms with
        their rotary embedding are one kernel each on CUDA (kernels/fused_decode.add_rms_norm, reading q's heads in
        place in the projection), the torch ops of rms_norm and apply_rope elsewhere."""
        from memra_pp.kernels import prefill as pf
        from memra_pp.kernels.fused_decode import add_rms_norm
        c = self.cfg
        T, D = x_TH.shape[0], c.head_dim
        if pf.merged(x_TH, lora):   # one GEMM for q|gate, k, v (views of it), as the decode graphs' projection
            P = project(x_TH, self.qkv, out)       # (out: a prefill graph's buffer)
            nq, nkv = c.num_attention_heads * 2 * D, c.num_key_value_heads * D
            qg, k, v = P[:, :nq], P[:, nq:nq + nkv], P[:, nq + nkv:]
        else:
            qg, k, v = (self.lin(x_TH, f"{p}_proj", lora) for p in "qkv")
        qg = qg.view(T, c.num_attention_heads, 2 * D)
        q, gate = qg[..., :D], qg[..., D:].reshape(T, -1)
        k, v = k.view(T, c.num_key_value_heads, D), v.view(T, c.num_key_value_heads, D)
        q = add_rms_norm(q, None, self.q_norm_weight, c.rms_norm_eps, rope=(cos, sin))[1]
        k = add_rms_norm(k, None, self.k_norm_weight, c.rms_norm_eps, rope=(cos, sin))[1]
        return q, gate, k, v


# MEMRA_PP_SDPA_CUDNN=1: SDPA's own choice of backend, cuDNN included (benchmarks compare: gpu_decode --sdpa-cudnn)
SDPA_CUDNN = initial("MEMRA_PP_SDPA_CUDNN")


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw) -> torch.Tensor:
    """F.scaled_dot_product_attention with cuDNN's backend left out on CUDA. cuDNN builds an execution plan for each
    new shape (batch, lengths), and a prefill step's shapes change with every mix of prompts and chunks (the vision
    tower's with every image size): on an H200 with torch 2.11, a new mixed step's first run spent 104 ms of host
    time in `_cudnn_attention_forward` over the 35B-A3B's 10 attention layers and 76 ms over the 27B's 16, where a
    step of planned shapes spends 1.5-2.3 ms, still 110-165 us a call (results/profile-mixed-*-2026-12-03-s26.txt,
    under the profiler). Flash attention, which SDPA picks next, runs any shape without a plan. Torch's backend
    switch is one flag for the process: a stage process turns it off for good at setup (stages/runner.py; its tower
    runs on other threads than its prefill), so this is a no-op there; elsewhere (benchmarks, tests: one thread) it
    is turned off around the call and back on (about 1 us), and code outside keeps its choice."""
    if SDPA_CUDNN or not (q.is_cuda and torch.backends.cuda.cudnn_sdp_enabled()):
        return F.scaled_dot_product_attention(q, k, v, **kw)
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        return F.scaled_dot_product_attention(q, k, v, **kw)
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)


def attend_batch(q_GTHD: torch.Tensor, k_GHSD: torch.Tensor, v_GHSD: torch.Tensor, start: int) -> torch.Tensor:
    """attend() for G sequences with the same start and T at once (keys: the start + T positions) -> [G, T, nh*D].
    A continuing segment's mask is causal aligned to the lower right (query t sees keys <= start + t). In flash
    attention's dtypes on CUDA it is given as torch's CausalBias, which flash takes (grouped heads too): a mask
    tensor leaves flash out, and SDPA falls to a backend that takes masks. Elsewhere (float32, the CPU) the mask
    tensor, as the bias would materialise it. Both through sdpa(): never cuDNN's backend."""
    G, T = q_GTHD.shape[:2]
    q = q_GTHD.transpose(1, 2)                                                # [G, nh, T, D]
    S = k_GHSD.shape[2]
    assert S == start + T, (k_GHSD.shape, start, T)
    if start == 0:
        o = sdpa(q, k_GHSD, v_GHSD, is_causal=T > 1, enable_gqa=True)
    else:
        if q.is_cuda and q.dtype in (torch.bfloat16, torch.float16):
            # (imported here: torch.nn.attention.bias imports torch._dynamo, 1.2 s of every stage's start)
            from torch.nn.attention.bias import causal_lower_right
            mask = causal_lower_right(T, S)
        else:
            mask = torch.arange(S, device=q.device)[None, :] <= (start + torch.arange(T, device=q.device))[:, None]
        o = sdpa(q, k_GHSD, v_GHSD, attn_mask=mask, enable_gqa=True)
    return o.transpose(1, 2).reshape(G, T, -1)


def attend_decode(q_BHD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor, lens: torch.Tensor):
    """One query per sequence over padded caches; key s of sequence b is visible iff s < lens[b]."""
    S = k_BHSD.shape[2]
    mask = (torch.arange(S, device=q_BHD.device)[None, :] < lens[:, None])[:, None, None, :]
    o = sdpa(q_BHD[:, :, None], k_BHSD, v_BHSD, attn_mask=mask, enable_gqa=True)
    return o[:, :, 0].reshape(q_BHD.shape[0], -1)


def attend_varlen(q_RHD: torch.Tensor, k_RHD: torch.Tensor, v_RHD: torch.Tensor, cu32: torch.Tensor,
                  lens: list[int]) -> torch.Tensor:
    """Causal attention of fresh segments packed one after another (segment s: rows cu32[s]:cu32[s + 1], its keys
    its own rows) -> [R, nh*D]: one call of flash attention's variable-length kernel on CUDA in half precision
    (grouped heads taken as they are; cu32: int32 on the device, lens: the same lengths on the host), instead of one
    call a group of equal lengths. Elsewhere attend_batch segment by segment (the reference)."""
    R = q_RHD.shape[0]
    if q_RHD.is_cuda and q_RHD.dtype in (torch.bfloat16, torch.float16):
        n = max(lens)
        o = torch.ops.aten._flash_attention_forward(q_RHD, k_RHD, v_RHD, cu32, cu32, n, n, 0.0, True, False)[0]
        return o.reshape(R, -1)
    outs, at = [], 0
    for n in lens:
        k, v = (t[at:at + n][None].transpose(1, 2) for t in (k_RHD, v_RHD))
        outs.append(attend_batch(q_RHD[at:at + n][None], k, v, 0)[0])
        at += n
    return torch.cat(outs)
