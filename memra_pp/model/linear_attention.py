"""Gated DeltaNet mixer (reference/qwen35.md 2.4) over a StepBatch, with per-slot conv and recurrent state."""
from __future__ import annotations

import torch

from .batch import StepBatch
from .cache import StageCache
from .config import TextConfig
from .gdn import (causal_conv_step, chunk_gated_delta_rule, chunk_gated_delta_rule_varlen, gdn_gates,
                  recurrent_gated_delta_rule, recurrent_step)
from .layers import Param, gated_rms_norm, project


CALLS = {"single_rows": 0}     # one-token segments of steps with prompts, through the decode kernels (law 3)


class GatedDeltaNet(Param):
    def __init__(self, cfg: TextConfig, layer: int):
        super().__init__(["in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight",
                          "conv1d.weight", "A_log", "dt_bias", "norm.weight", "out_proj.weight"])
        self.cfg, self.layer = cfg, layer
        self.rule = None   # optional fast kernels (GPU): object with chunk(...) and recurrent(...), same contract

    def load(self, prefix: str, src, dtype, device):
        super().load(prefix, src, dtype, device)
        self.in_proj = self.fuse(["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"])
        self.w_in = self.in_proj       # the decode graphs' merged input projection (Layer.decode_fused)

    def decode_fused(self, P: torch.Tensor, slots_B: torch.Tensor, cache: StageCache,
                     skip_padding: bool = False) -> torch.Tensor:
        """The decode graphs' step from the merged projection P = x @ in_proj^T (qkv|z|b|a; the layer computes it
        with its input norm): the conv step in place, the recurrent step with its gates computed in the kernel, the
        gated norm reading z in place, out_proj (kernels/gdn_decode.py, kernels/fused_decode.py, kernels/gemv.py).
        skip_padding: the recurrent step skips the rows at the scratch slot (the graph's padding rows: their output
        is not defined)."""
        from memra_pp.kernels import fused_decode as fd
        from memra_pp.kernels.gdn_decode import conv_step, gdn_decode_fused
        from memra_pp.kernels.gemv import linear
        c = self.cfg
        nk, nv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, \
            c.linear_value_head_dim
        B = P.shape[0]
        C, Z = c.conv_dim, nv * dv
        y = conv_step(P[:, :C], cache.conv[self.layer], self.conv1d_weight[:, 0, :], slots_B)
        o = gdn_decode_fused(y, P[:, C + Z:C + Z + nv], P[:, C + Z + nv:], self.A_log, self.dt_bias,
                             cache.rec[self.layer], slots_B, nk, dk ** -0.5,
                             skip_slot=cache.scratch if skip_padding else -1)
        o = fd.gated_rms_norm(o, P[:, C:C + Z].view(B, nv, dv), self.norm_weight, c.rms_norm_eps)
        return linear(o, self.out_proj_weight)

    def forward(self, x_TH: torch.Tensor, b: StepBatch, cache: StageCache, lora=None) -> torch.Tensor:
        """A step with prompt segments: each group of equal-length segments through one conv kernel and one call of
        the chunked rule, then the gated norm (kernels/prefill.py's conv_prefill, kernels/fused_decode.py's
        gated_rms_norm on CUDA, their torch references elsewhere). On CUDA without a LoRA hook, the merged path
        (kernels/prefill.MERGED): one GEMM for q|k|v|z|b|a, the conv's q, k, v written contiguous, a group's rows a
        slice where consecutive, and the one group's output the layer's where it holds every row. The one-token
        continuing segments (a mixed step's decode rows) take the decode step's kernels, states in place."""
        if b.decode_only():
            return self.decode(x_TH, b.index_tensors(x_TH.device)[0], cache, lora)
        pre = self.pre(x_TH, lora)
        return self.post(self.core(pre, b, cache, lora), pre, lora)

    def pre(self, x_TH: torch.Tensor, lora=None, out=None) -> tuple:
        """A prompt step's row-wise start (a prefill graph's piece captures it, model/prefill_graphs.py): the input
        projections (u [T, C], z [T, nv, dv], the raw b and a) and the gates g, beta. `out`: where the merged
        projection goes (a prefill graph's buffer, shared by its layers)."""
        from memra_pp.kernels import prefill as pf
        c = self.cfg
        nv, dv = c.linear_num_value_heads, c.linear_value_head_dim
        T, C, Z = x_TH.shape[0], c.conv_dim, nv * dv
        if pf.merged(x_TH, lora):       # one GEMM for q|k|v, z, b, a (their views), as the decode graphs' projection
            P = project(x_TH, self.in_proj, out)
            u, z, b_, a_ = P[:, :C], P[:, C:C + Z], P[:, C + Z:C + Z + nv], P[:, C + Z + nv:]
        else:
            u, z, b_, a_ = (self.lin(x_TH, f"in_proj_{p}", lora) for p in ("qkv", "z", "b", "a"))   # u: [T, C]
        return (u, z.view(T, nv, dv), b_, a_, *gdn_gates(b_, a_, self.A_log, self.dt_bias))

    def post(self, out: torch.Tensor, pre: tuple, lora=None) -> torch.Tensor:
        """The row-wise end: the gated norm of core()'s output by z, then out_proj."""
        from memra_pp.kernels import fused_decode as fd
        return self.lin(fd.gated_rms_norm(out.contiguous(), pre[1], self.norm_weight, self.cfg.rms_norm_eps),
                        "out_proj", lora)

    def core(self, pre: tuple, b: StepBatch, cache: StageCache, lora=None, rules=None) -> torch.Tensor:
        """What crosses rows and reads the cache (run eagerly between a prefill graph's pieces): the conv and the
        chunked rule over the step's segments, states read and written at their slots -> out [T, nv, dv].
        `rules`: the prefill graphs' RuleGraphs, which replay the rule's variable-length call where they take it."""
        from memra_pp.kernels import prefill as pf
        from memra_pp.kernels.gdn_decode import conv_step, gdn_decode_fused
        c = self.cfg
        nk, nv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, \
            c.linear_value_head_dim
        u, z, b_, a_, g, beta = pre
        T = u.shape[0]
        merged = pf.merged(u, lora, count=True)
        w = self.conv1d_weight[:, 0, :]
        conv, rec = cache.conv[self.layer], cache.rec[self.layer]
        seg = None
        if self.varlen(merged, u.device):    # every prompt segment in one call: one group, as far as the output
            single, srows, sslots, _ = b.single_rows(u.device)          # goes (no groups made)
            seg = pf.segments(b, u.device, w.shape[1]) if len(single) < len(b.slots) else None
            groups = [(seg.idx, seg.rows, seg.slots, seg.span)] if seg is not None else []
        else:
            groups, (single, srows, sslots, _) = pf.row_groups(b, "length", u.device)
        out = None if pf.whole(groups, T, merged) else \
            torch.empty(T, nv, dv, dtype=z.dtype, device=u.device)        # None: the one group's o is out
        if single:      # the decode step's kernels: conv and recurrent states read and written in place at their
            # slots (a group would gather and scatter each sequence's 2-3 MB recurrent state a layer: three times
            # the state traffic of the kernel alone); gates from the raw b and a rows, in the kernel. gdn_decode
            # reads its state rows before PDL's wait (gdn_decode.STATE_BEFORE_WAIT): nothing that writes `rec` may
            # be issued between the conv step and it (the groups below write their own slots, after it)
            CALLS["single_rows"] += len(single)
            y = conv_step(u[srows], conv, w, sslots)
            out[srows] = gdn_decode_fused(y, b_[srows], a_[srows], self.A_log, self.dt_bias, rec, sslots, nk,
                                          dk ** -0.5)
        r, parts = nv // nk, (nk * dk, nk * dk, nv * dv)
        if seg is not None:
            slots, sel, R = seg.slots, pf.group_rows(seg.rows, seg.span, merged), seg.rows.numel()
            (q, k, v), conv[slots] = pf.conv_varlen(u, seg, w, None if seg.fresh else conv[slots], parts)
            q, k = q.view(1, R, nk, dk), k.view(1, R, nk, dk)
            if not getattr(self.rule, "gva", False):
                q, k = q.repeat_interleave(r, 2), k.repeat_interleave(r, 2)
            v, gs, bs = v.view(1, R, nv, dv), g[sel].view(1, R, nv), beta[sel].view(1, R, nv)
            if rules is not None and rules.takes(R, len(seg.lens)):     # (o: a view of the graphs' buffer)
                o, rec[slots] = rules.run(q, k, v, gs, bs, rec, None if seg.fresh else slots, seg)
            else:
                if rules is not None:
                    rules.declined += 1
                s0 = rec.new_zeros(len(seg.lens), *rec.shape[1:]) if seg.fresh else rec[slots]  # (fresh: none read)
                o, rec[slots] = self._chunk_varlen(q, k, v, gs, bs, s0, seg)
            if out is None:
                out = o.view(T, nv, dv).to(z.dtype)
            else:
                out[sel] = o.view(R, nv, dv).to(out.dtype)
            groups = []
        # sequences with the same segment length (and both fresh, or both continuing) run as one batched call
        for idx, rows, slots, span in groups:
            G, n, fresh = len(idx), b.counts[idx[0]], b.starts[idx[0]] == 0
            sel = pf.group_rows(rows, span, merged)     # consecutive rows: a slice (a view, no gather)
            y, conv[slots] = pf.conv_prefill(u, rows, w, None if fresh else conv[slots], G, n,
                                             parts if pf.MERGED else None)
            q, k, v = y if pf.MERGED else torch.split(y, parts, -1)
            q, k = q.reshape(G, n, nk, dk), k.reshape(G, n, nk, dk)
            if not getattr(self.rule, "gva", False):    # the value heads' own copies of q and k (fla's gva: none)
                q, k = q.repeat_interleave(r, 2), k.repeat_interleave(r, 2)
            s0 = rec.new_zeros(G, *rec.shape[1:]) if fresh else rec[slots]
            # transformers runs the chunked form for every prefill, even of one token, and the recurrent
            # one only to continue a cached state: the same kernels keep bf16 rounding identical
            fn = self._recurrent if n == 1 and not fresh else self._chunk
            o, rec[slots] = fn(q, k, v.reshape(G, n, nv, dv), g[sel].reshape(G, n, nv),
                           beta[sel].reshape(G, n, nv), s0)
            if out is None:
                out = o.reshape(T, nv, dv).to(z.dtype)
            else:
                out[sel] = o.reshape(G * n, nv, dv).to(out.dtype)
        return out

    def decode(self, x_BH: torch.Tensor, slots_B: torch.Tensor, cache: StageCache, lora=None) -> torch.Tensor:
        """One new token per sequence, states read and written at their cache slots; free of host syncs and of
        data-dependent shapes (the torch path: decode_fused is what the decode graphs capture). Padding rows may
        share one scratch slot."""
        c = self.cfg
        nk, nv, dk, dv = c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim, \
            c.linear_value_head_dim
        B = x_BH.shape[0]
        u = self.lin(x_BH, "in_proj_qkv", lora)
        z = self.lin(x_BH, "in_proj_z", lora).view(B, nv, dv)
        g, beta = gdn_gates(self.lin(x_BH, "in_proj_b", lora), self.lin(x_BH, "in_proj_a", lora), self.A_log,
                            self.dt_bias)
        conv, rec = cache.conv[self.layer], cache.rec[self.layer]
        y, conv[slots_B] = causal_conv_step(u, self.conv1d_weight[:, 0, :], conv[slots_B])
        q, k, v = torch.split(y, [nk * dk, nk * dk, nv * dv], -1)
        q, k, v = q.reshape(B, nk, dk), k.reshape(B, nk, dk), v.reshape(B, nv, dv)
        if self.rule is not None and hasattr(self.rule, "decode"):
            o = self.rule.decode(q, k, v, g, beta, rec, slots_B)
        else:   # the torch recurrence (CPU): gather, step, scatter
            r = nv // nk
            o, rec[slots_B] = recurrent_step(q.repeat_interleave(r, 1), k.repeat_interleave(r, 1), v, g, beta,
                                             rec[slots_B])
        o = gated_rms_norm(o.to(x_BH.dtype), z, self.norm_weight, c.rms_norm_eps).reshape(B, nv * dv)
        return self.lin(o, "out_proj", lora)

    def _recurrent(self, q, k, v, g, beta, s):
        if self.rule is not None:
            return self.rule.recurrent(q, k, v, g, beta, s)
        return recurrent_gated_delta_rule(q, k, v, g, beta, s)

    def varlen(self, merged: bool, device) -> bool:
        """Whether a prompt step's segments take one variable-length call (kernels/prefill.VARLEN): on the merged
        path, with a rule that has one (fla), or off CUDA the torch rule segment by segment (Triton's interpreter
        checks; on CUDA without fla the groups' batched calls are faster)."""
        from memra_pp.kernels import prefill as pf
        return merged and pf.VARLEN and (hasattr(self.rule, "chunk_varlen") if self.rule is not None
                                         else torch.device(device).type != "cuda")

    def _chunk_varlen(self, q, k, v, g, beta, s, seg):
        """The chunked rule over seg's segments of q, k, v, g, beta [1, R, ...] (states s [N, ...]): the rule's
        variable-length call, or the torch rule segment by segment."""
        if self.rule is not None:
            return self.rule.chunk_varlen(q, k, v, g, beta, s, seg.cu, seg.chunks)
        return chunk_gated_delta_rule_varlen(q, k, v, g, beta, s, seg.lens)

    def _chunk(self, q, k, v, g, beta, s):
        if self.rule is not None:
            return self.rule.chunk(q, k, v, g, beta, s)
        return chunk_gated_delta_rule(q, k, v, g, beta, s)
