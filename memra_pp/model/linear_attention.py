"""Gated DeltaNet mixer (reference/qwen35.md 2.4) over a StepBatch, with per-slot conv and recurrent state."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .batch import StepBatch
from .cache import StageCache
from .config import TextConfig
from .gdn import causal_conv, causal_conv_step, chunk_gated_delta_rule, recurrent_gated_delta_rule
from .layers import Param, gated_rms_norm


class GatedDeltaNet(Param):
    def __init__(self, cfg: TextConfig, layer: int):
        super().__init__(["in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight",
                          "conv1d.weight", "A_log", "dt_bias", "norm.weight", "out_proj.weight"])
        self.cfg, self.layer = cfg, layer
        self.rule = None   # optional fast kernels (GPU): object with chunk(...) and recurrent(...), same contract

    def forward(self, x_TH: torch.Tensor, b: StepBatch, cache: StageCache, lora=None) -> torch.Tensor:
        c = self.cfg
        nk, nv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, \
            c.linear_value_head_dim
        T = x_TH.shape[0]
        u = self.lin(x_TH, "in_proj_qkv", lora)                                  # [T, C]
        z = self.lin(x_TH, "in_proj_z", lora).view(T, nv, dv)
        beta = torch.sigmoid(self.lin(x_TH, "in_proj_b", lora))                    # model dtype, as HF
        a = self.lin(x_TH, "in_proj_a", lora)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())
        w = self.conv1d_weight[:, 0, :]
        conv, rec = cache.conv[self.layer], cache.rec[self.layer]
        out = torch.empty(T, nv, dv, dtype=x_TH.dtype, device=x_TH.device)
        r = nv // nk

        def split(y):
            n = y.shape[0]
            q, k, v = torch.split(y, [nk * dk, nk * dk, nv * dv], -1)
            q = q.reshape(n, nk, dk).repeat_interleave(r, 1)
            k = k.reshape(n, nk, dk).repeat_interleave(r, 1)
            return q, k, v.reshape(n, nv, dv)

        if b.decode_only():
            slots, _ = b.index_tensors(x_TH.device)
            y, conv[slots] = causal_conv_step(u, w, conv[slots])
            q, k, v = split(y)
            o, rec[slots] = self._recurrent(q[:, None], k[:, None], v[:, None], g[:, None], beta[:, None],
                                            rec[slots])
            out[:] = o[:, 0].to(out.dtype)
        else:
            for slot, start, off, n in zip(b.slots, b.starts, b.offsets, b.counts):
                y, conv[slot] = causal_conv(u[off:off + n], w, conv[slot] if start else None)
                q, k, v = split(y)
                s0 = rec[slot:slot + 1] if start else torch.zeros_like(rec[slot:slot + 1])
                # transformers runs the chunked form for every prefill, even of one token, and the recurrent
                # one only to continue a cached state: the same kernels keep bf16 rounding identical
                fn = self._recurrent if n == 1 and start else self._chunk
                o, rec[slot:slot + 1] = fn(q[None], k[None], v[None], g[None, off:off + n],
                                           beta[None, off:off + n], s0)
                out[off:off + n] = o[0].to(out.dtype)
        o = gated_rms_norm(out, z, self.norm_weight, c.rms_norm_eps).reshape(T, nv * dv)
        return self.lin(o, "out_proj", lora)

    def _recurrent(self, q, k, v, g, beta, s):
        if self.rule is not None:
            return self.rule.recurrent(q, k, v, g, beta, s)
        return recurrent_gated_delta_rule(q, k, v, g, beta, s)

    def _chunk(self, q, k, v, g, beta, s):
        if self.rule is not None:
            return self.rule.chunk(q, k, v, g, beta, s)
        return chunk_gated_delta_rule(q, k, v, g, beta, s)
