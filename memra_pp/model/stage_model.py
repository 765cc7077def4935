"""A stage slice of the Qwen3.5 text model: layers [start, end), the embedding on the intake slice and the
final norm + lm_head on the primary slice. Knows nothing of actors, contexts or Ray.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import GatedAttention, Rope, attend_batch, attend_varlen
from .batch import StepBatch, h2d
from .cache import StageCache
from .config import ModelConfig
from .layers import DenseMLP, MoE, rms_norm
from .linear_attention import GatedDeltaNet


class Layer(nn.Module):
    def __init__(self, mc: ModelConfig, i: int):
        super().__init__()
        c = mc.text
        self.i, self.full = i, c.is_full(i)
        self.mixer = GatedAttention(c) if self.full else GatedDeltaNet(c, i)
        self.ffn = MoE(c.num_experts_per_tok) if c.moe else DenseMLP()
        self.eps = c.rms_norm_eps

    def load(self, src, dtype, device):
        p = f"layers.{self.i}."
        self.ln1 = src.get(p + "input_layernorm.weight", dtype, device)
        self.ln2 = src.get(p + "post_attention_layernorm.weight", dtype, device)
        self.mixer.load(p + ("self_attn." if self.full else "linear_attn."), src, dtype, device)
        self.ffn.load(p + "mlp.", src, dtype, device)

    def forward(self, h_TH, b: StepBatch, cache: StageCache, cos, sin, lora=None):
        if b.decode_only():
            slots, pos = b.index_tensors(h_TH.device)
            return self.decode(h_TH, slots, pos, max(b.starts) + 1, cache, cos, sin, lora)
        from memra_pp.kernels.fused_decode import add_rms_norm     # one kernel a norm on CUDA; the torch ops elsewhere
        pre = self.mix_pre(add_rms_norm(h_TH, None, self.ln1, self.eps)[1], cos, sin, lora)
        return self.rest(h_TH, self.mix_core(pre, b, cache, lora), pre, lora)

    # A prompt step's layer in three parts, so that a prefill graph (model/prefill_graphs.py) captures the row-wise
    # ones and runs only the mixer's core eagerly: mix_pre (the input norm is the caller's), mix_core, rest.
    def mix_pre(self, x_TH, cos, sin, lora=None, out=None) -> tuple:
        """The mixer's input projections (the attention's q and k normed and rotated, the Gated DeltaNet's gates);
        `out`: where the merged projection goes."""
        return self.mixer.project(x_TH, cos, sin, lora, out) if self.full else self.mixer.pre(x_TH, lora, out)

    def mix_core(self, pre: tuple, b: StepBatch, cache: StageCache, lora=None, rules=None) -> torch.Tensor:
        """What crosses rows and reads or writes the cache: the attention (gated) or the conv and chunked rule
        (`rules`: the prefill graphs' RuleGraphs, for the rule's variable-length call)."""
        return self._attention(pre, b, cache, lora) if self.full else self.mixer.core(pre, b, cache, lora, rules)

    def rest(self, h_TH, o, pre: tuple, lora=None) -> torch.Tensor:
        """From the mixer core's output o: its output projection (the Gated DeltaNet's gated norm first), the
        residual add with the FFN's norm, the FFN and its residual add -> the layer's output."""
        from memra_pp.kernels.fused_decode import add_rms_norm
        m = self.mixer.lin(o, "o_proj", lora) if self.full else self.mixer.post(o, pre, lora)
        h_TH, x = add_rms_norm(h_TH, m, self.ln2, self.eps)         # h + m, and its norm
        return h_TH + self.ffn(x, lora)

    def decode(self, h_BH, slots_B, pos_B, S: int, cache: StageCache, cos, sin, lora=None):
        """One new token per sequence at positions pos_B of slots slots_B, attending over the first S cached
        positions (S > every pos). The eager decode; the graphs run decode_fused."""
        x = rms_norm(h_BH, self.ln1, self.eps)
        if self.full:
            m = self._attend_decode(*self.mixer.project(x, cos, sin, lora), slots_B, pos_B, S, cache, lora)
        else:
            m = self.mixer.decode(x, slots_B, cache, lora)
        h_BH = h_BH + m
        return h_BH + self.ffn(rms_norm(h_BH, self.ln2, self.eps), lora)

    def decode_fused(self, h_BH, pending, slots_B, pos_B, S: int, cache: StageCache, cos, sin, live=None):
        """Layer.decode for the decode graphs through fused kernels: the previous layer's last residual add
        (`pending`, None for the first layer) fused with this layer's input norm and its merged input projection
        (one GEMV kernel at few rows, kernels/gemv.py), this layer's mixer output added and normed inside the
        FFN's first kernel. Returns (h, this layer's pending FFN output); the caller adds the last one. `live`: a
        flag a row, 0 for padding rows, or None: where given, the Gated DeltaNet's step skips the padding rows (at
        the scratch slot) and the MoE routes them to no expert; their outputs are not defined."""
        from memra_pp.kernels.gemv import norm_linear
        h_BH, P = norm_linear(h_BH, pending, self.ln1, self.eps, self.mixer.w_in)
        if self.full:
            m = self.mixer.decode_fused(P, cos, sin, cache.k[self.i], cache.v[self.i], cache.table, slots_B, pos_B, S)
        else:
            m = self.mixer.decode_fused(P, slots_B, cache, live is not None)
        return self.ffn.decode_fused(h_BH, m, self.ln2, self.eps, live)

    def _attend_decode(self, q, gate, k, v, slots_B, pos_B, S: int, cache: StageCache, lora=None):
        """Write one new key/value per sequence at its slot and position, attend over the first S positions (on a
        GPU one kernel reads the slots' pages in place and applies the output gate)."""
        from memra_pp.kernels.gemv import linear
        from memra_pp.kernels.paged_attention import decode_attention, kv_write
        kp, vp = cache.k[self.i], cache.v[self.i]
        lens = kv_write(k, v, kp, vp, cache.table, slots_B, pos_B)
        o = decode_attention(q, gate, kp, vp, cache.table, slots_B, lens, S)
        return linear(o, self.mixer.o_proj_weight) if lora is None else self.mixer.lin(o, "o_proj", lora)

    def _attention(self, pre: tuple, b: StepBatch, cache: StageCache, lora=None):
        """A step with prompt segments, from its projections (q, gate, k, v): every new key and value into its
        page, then each group of segments with the same (start, length) in one batched attention over their pages,
        gathered; the step's one-token continuing segments (a mixed step's decode rows) in one paged decode
        attention call, gated there; then the output gate (o_proj is the caller's)."""
        from memra_pp.kernels import prefill as pf
        from memra_pp.kernels.paged_attention import decode_attention, kv_write
        q, gate, k, v = pre
        kp, vp = cache.k[self.i], cache.v[self.i]
        kv_write(k, v, kp, vp, cache.table, *b.token_index(q.device))     # every new token into its page
        T, merged = q.shape[0], pf.merged(q, lora, count=True)
        groups, (single, srows, sslots, slens) = pf.row_groups(b, "start", q.device)
        fresh = pf.fresh_segments(b, q.device, q.dtype) if merged else None      # (VARLEN: one call for all)
        if fresh is not None:   # the fresh segments leave the groups: one group of their own, as far as o goes
            groups = [g for g in groups if b.starts[g[0][0]] != 0]
        whole = pf.whole(([(None, fresh.rows, None, fresh.span)] if fresh is not None else []) + groups, T, merged)
        o = None if whole else torch.empty(T, q.shape[1] * q.shape[2], dtype=q.dtype, device=q.device)
        if fresh is not None:   # every fresh segment in one variable-length call, keys its own rows
            sel = pf.group_rows(fresh.rows, fresh.span, merged)
            of = attend_varlen(q[sel], k[sel], v[sel], fresh.cu32, fresh.lens)
            pf.CALLS["attn_varlen"] += 1
            if whole:
                o = of
            else:               # beside continuing segments or decode rows
                o[sel] = of
                pf.CALLS["attn_varlen_part"] += 1
        for idx, rows, slots, span in groups:
            G, start, n = len(idx), b.starts[idx[0]], b.counts[idx[0]]
            sel = pf.group_rows(rows, span, merged)     # consecutive rows: a slice (a view, no gather)
            if start == 0:      # a fresh group's keys are its own rows of this step, as just written to its pages:
                #                 [G, kv_heads, n, D] views of them, no gather of the pages (and none of the table)
                kg, vg = (t[sel].view(G, n, *t.shape[1:]).transpose(1, 2) for t in (k, v))
                CALLS["fresh_kv"] += 1
            else:
                kg, vg = cache.gather(kp, slots, start + n), cache.gather(vp, slots, start + n)
            og = attend_batch(q[sel].view(G, n, *q.shape[1:]), kg, vg, start).reshape(G * n, -1)
            if whole:
                o = og
            else:
                o[sel] = og
        y = o * torch.sigmoid(gate)                 # at.output's gate (the single rows' o is overwritten below)
        if single:
            CALLS["single_rows"] += len(single)
            y[srows] = decode_attention(q[srows], gate[srows], kp, vp, cache.table, sslots, slens,  # (one kernel
                                        max(b.starts[i] for i in single) + 1, max_splits=1)  # binary: warmed up)
        return y


# one-token segments of steps with prompts, attended in one decode call; fresh groups attended over their own rows
CALLS = {"single_rows": 0, "fresh_kv": 0}      # (no gather of their pages): law 3's counters


class StageModel(nn.Module):
    """Layers [layer_start, layer_end) of the text model; `intake` embeds ids, `primary` returns logits."""

    def __init__(self, mc: ModelConfig, layer_start: int, layer_end: int, intake: bool, primary: bool):
        super().__init__()
        n = mc.text.num_hidden_layers
        assert 0 <= layer_start < layer_end <= n, f"bad slice [{layer_start}, {layer_end}) of {n} layers"
        self.mc, self.start, self.end = mc, layer_start, layer_end
        self.intake, self.primary = intake, primary
        self.layers = nn.ModuleList(Layer(mc, i) for i in range(layer_start, layer_end))
        self.embed = self.norm = self.lm_head = None
        self.dtype, self.device, self.rope = None, None, None
        self.graphs = None          # DecodeGraphs once enabled (CUDA)
        self.graphs_failed = None   # why capture failed, if it did (the stage then decodes eagerly)
        self.pgraphs = None         # PrefillGraphs once enabled (CUDA)
        self.pgraphs_failed = None  # why their capture failed, if it did (prompt steps then run eagerly)

    def load(self, src, dtype=torch.float32, device="cpu", progress=None) -> "StageModel":
        """Read exactly the tensors this slice owns from a WeightSource."""
        self.dtype, self.device = dtype, torch.device(device)
        if self.intake:
            self.embed = src.get("embed_tokens.weight", dtype, device)
        for j, layer in enumerate(self.layers):
            layer.load(src, dtype, device)
            if progress:
                progress(j + 1, len(self.layers))
        if self.primary:
            self.norm = src.get("norm.weight", dtype, device)
            if self.mc.tied:
                self.lm_head = self.embed if self.embed is not None else src.get("embed_tokens.weight", dtype,
                                                                                 device)
            else:
                self.lm_head = src.get("lm_head.weight", dtype, device)
        self.rope = Rope(self.mc.text, device)
        self.gdn_backend = "torch"
        if self.device.type == "cuda":
            moe = next((layer.ffn for layer in self.layers if isinstance(layer.ffn, MoE)), None)
            if moe is not None:         # the MoE kernels compile now (they are shared by every layer)
                moe.warm_up()
            from . import fla_rule
            use_fla = fla_rule.available()
            if fla_rule.WHY_NOT:        # installed but broken: said in gdn_backend (stage stats) too
                self.gdn_backend = f"torch (fla unusable: {fla_rule.WHY_NOT})"
            if use_fla:
                rule = fla_rule.FlaRule()
                gdn = [layer for layer in self.layers if not layer.full]
                for layer in gdn:
                    layer.mixer.rule = rule
                self.gdn_backend = "fla"
                t = self.mc.text
                if gdn:     # fla tunes now, not in the first prefill
                    rule.warm_up(t.linear_num_value_heads, t.linear_key_head_dim, t.linear_value_head_dim,
                                 self.dtype, self.device, k_heads=t.linear_num_key_heads)
            from memra_pp.kernels.prefill import prefill_warm_up    # the prefill's kernels compile now too
            prefill_warm_up(self.mc.text, any(not layer.full for layer in self.layers),
                            any(layer.full for layer in self.layers), self.dtype, self.device)
        return self

    def new_cache(self, max_seqs: int, max_context: int) -> StageCache:
        cache = StageCache(self.mc.text, range(self.start, self.end), max_seqs, max_context, self.dtype, self.device)
        # a mixed step's decode rows' kernels compile now, not in a first request (Triton kernels only)
        from memra_pp.kernels.prefill import warm_single_rows
        warm_single_rows(self.mc.text, cache, self.layers)
        return cache

    def tensors(self) -> list[torch.Tensor]:
        """Every weight tensor this slice holds, each once (a tied lm_head is the embedding)."""
        ts = [self.embed, self.norm, self.lm_head]
        ts += [t for layer in self.layers for t in (layer.ln1, layer.ln2, *layer.buffers())]
        return list({t.data_ptr(): t for t in ts if t is not None}.values())

    def set_decode_graphs(self, on: bool, cache: StageCache, max_batch: int | None = None,
                          capture: bool = True) -> None:
        """Decode steps through CUDA graphs (one per batch-size bucket with decode_graphs.ANY_KV, else one per
        batch-size and KV-length bucket; captured on first use, or all at once by capture_decode_graphs) or
        eagerly. Steps with adapters, prefill or more sequences than the largest bucket always run eagerly.
        `capture=False`: the same static step, uncaptured (CPU tests)."""
        if not on:
            self.graphs = None
            return
        from .decode_graphs import DecodeGraphs
        self.graphs = DecodeGraphs(self, cache, max_batch or cache.max_seqs, capture=capture)

    def capture_decode_graphs(self) -> int:
        """Capture every batch bucket's decode graph now (DecodeGraphs.capture_all); how many. A capture that fails
        leaves the stage decoding eagerly, as one that fails on first use does."""
        return self._capture_all("graphs")

    def set_prefill_graphs(self, on: bool, max_tokens: int, capture: bool = True) -> None:
        """Prompt steps of up to max_tokens rows (at most prefill_graphs.MAX_ROWS) without adapters through
        piecewise CUDA graphs (prefill_graphs.py: the row-wise parts of every layer captured per token bucket, the
        mixers' cores eager between them), or eagerly. They read no cache, so they outlive a cache's replacement.
        `capture=False`: the same pieces on the same static buffers, uncaptured (CPU tests)."""
        from .prefill_graphs import PrefillGraphs
        self.pgraphs = PrefillGraphs(self, max_tokens, capture=capture) if on else None

    def capture_prefill_graphs(self) -> int:
        """Capture every token bucket's pieces now; how many buckets. A failure leaves prompt steps eager."""
        return self._capture_all("pgraphs")

    def _capture_all(self, attr: str) -> int:
        from .decode_graphs import CaptureFailed
        g = getattr(self, attr)
        if g is None:
            return 0
        try:
            return g.capture_all()
        except CaptureFailed as e:
            self._eagerly(attr, e)
            return 0

    def _eagerly(self, attr: str, e: Exception) -> None:
        """Graphs whose capture failed (attr "graphs": the decode graphs, "pgraphs": the prefill graphs) are
        dropped, and why kept in attr + "_failed"; those steps run eagerly from then on."""
        import warnings
        warnings.warn(f"layers [{self.start}, {self.end}): {e}; "
                      + ("decoding eagerly" if attr == "graphs" else "prompt steps run eagerly"))
        setattr(self, attr + "_failed", str(e))
        setattr(self, attr, None)

    def decode_static(self, h_BH, slots_B, pos_B, pos_3B, S: int, cache: StageCache, out=None,
                      live=None) -> torch.Tensor:
        """The decode step a CUDA graph captures: hidden in, hidden (or float32 logits on the primary) out, written
        into `out` when given (the graphs' one output buffer; the same kernels either way). `live`: a flag a row on
        the device, 0 for the graph's padding rows (Layer.decode_fused), or None."""
        cos, sin = self.rope.cos_sin(pos_3B, self.dtype)
        pending = None
        for layer in self.layers:
            h_BH, pending = layer.decode_fused(h_BH, pending, slots_B, pos_B, S, cache, cos, sin, live)
        if not self.primary:
            return h_BH + pending if out is None else torch.add(h_BH, pending, out=out)
        from memra_pp.kernels.fused_decode import add_rms_norm
        logits = F.linear(add_rms_norm(h_BH, pending, self.norm, self.mc.text.rms_norm_eps)[1], self.lm_head)
        return logits.float() if out is None else out.copy_(logits)

    def embed_ids(self, ids_T: torch.Tensor, b: StepBatch | None = None, token_overlay=None) -> torch.Tensor:
        """ids [T] -> embeddings [T, H]; with a TokenOverlaySet and b.adapter_slots, each token's adapter slot
        overrides the rows of its trainable ids (before any image splice)."""
        e = F.embedding(h2d(ids_T, self.device), self.embed)
        if token_overlay is None or b is None or not b.uses_adapters() or not token_overlay.any_active():
            return e
        from memra_pp.kernels.adapter_ops import apply_token_embedding
        return apply_token_embedding(token_overlay, ids_T.to(self.device), b.adapter_slot_per_token(self.device), e)

    @torch.inference_mode()
    def forward(self, b: StepBatch, h_TH: torch.Tensor, cache: StageCache, lora=None,
                token_overlay=None) -> torch.Tensor:
        """hidden [T, H] in -> hidden [T, H] out, or float32 logits [n_sample, V] on the primary slice.
        `lora`: this stage's LoraPool (used when b.adapter_slots names a slot); `token_overlay`: the primary's
        TokenOverlaySet, which recomputes the logits of each sampled row's adapter-overridden ids."""
        cache.release(b.release)       # first: a released slot may hold a new sequence in this very step
        for slot, start in zip(b.slots, b.starts):
            if start and cache.lens[slot] != start:
                raise RuntimeError(f"stage layers [{self.start},{self.end}): slot {slot} holds "
                                   f"{cache.lens[slot]} tokens but the step says {start}")
        cache.reset([slot for slot, start in zip(b.slots, b.starts) if start == 0])     # new sequences' slots
        cache.reserve(b.slots, [s + c for s, c in zip(b.starts, b.counts)])
        out = self._step(b, h_TH.to(self.device, self.dtype), cache, lora, token_overlay)
        for slot, start, n in zip(b.slots, b.starts, b.counts):
            cache.lens[slot] = start + n
        return out

    def _layers(self, b: StepBatch, h: torch.Tensor, cache: StageCache, cos, sin, step) -> torch.Tensor:
        """The layers of a step the decode graphs do not take: a prompt step through the prefill graphs where they
        take it, else eagerly."""
        if step is None and self.pgraphs is not None and self.pgraphs.takes(b, h.shape[0]):
            from .decode_graphs import CaptureFailed
            try:
                return self.pgraphs.run(b, h, cache, cos, sin)
            except CaptureFailed as e:      # (before any core ran: the cache is as it was)
                self._eagerly("pgraphs", e)
        for layer in self.layers:
            h = layer(h, b, cache, cos, sin, None if step is None else step.layer(layer.i))
        return h

    def _step(self, b: StepBatch, h: torch.Tensor, cache: StageCache, lora, token_overlay) -> torch.Tensor:
        """The step's compute: a decode graph when one takes the batch, else the layers (_layers: the prefill
        graphs' pieces where they take it)."""
        if self.graphs is not None and self.graphs.takes(b):
            from .decode_graphs import CaptureFailed
            try:
                return self.graphs.run(b, h)
            except CaptureFailed as e:
                self._eagerly("graphs", e)
        cos, sin = self.rope.cos_sin(b.pos_3T, self.dtype)
        step = None if lora is None else lora.step(b)
        h = self._layers(b, h, cache, cos, sin, step)
        if not self.primary:
            return h
        rows = b.sample_rows()
        hs = rms_norm(h[rows], self.norm, self.mc.text.rms_norm_eps)
        logits = F.linear(hs, self.lm_head).float()
        if token_overlay is None or not b.uses_adapters() or not token_overlay.any_active():
            return logits
        from memra_pp.kernels.adapter_ops import apply_token_lm_head
        return apply_token_lm_head(token_overlay, hs, b.adapter_slot_per_sample(self.device), logits)
