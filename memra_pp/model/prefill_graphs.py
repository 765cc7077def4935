"""Piecewise CUDA graphs of a stage's prompt steps (as vLLM's piecewise graphs: everything but the attention).

A prompt step launches about 1,700 kernels on the 35B-A3B; from Python on a GPU host they cost more time than the
device needs (one H100, docs/PERF.md thirty-seventh session: 134 ms a step at 1,024 tokens as at 4,096, 38 ms of
device time at 1,024). Most of them are row-wise: the norms, projections, gates, the MoE or MLP and the residual
adds see each row alone. What is not, the mixer's core (the attention over its pages, the Gated DeltaNet's conv and
chunked rule over each sequence's segments, every cache read and write), depends on the step's segments and stays
eager. So a step of T rows runs the graphs of the smallest token bucket n >= T: its rows are copied into a static
buffer, the first piece (layer 0's input norm and projections) replays, then for each layer its core runs eagerly
on the first T rows and writes its output into a static buffer, and the next piece (that layer's output projection,
residual, FFN and the next layer's input norm and projections) replays. Rows T..n are padding: row-wise pieces
never mix them into real rows, and no core reads them.

Every piece's outputs that a later piece or a core reads live in static buffers shared by the layers (the merged
projection is written there by the GEMM itself; the rest is copied in), so the memory the graphs hold does not grow
with the layer count. All buckets' graphs share one memory pool, captured largest first, as the decode graphs'.
With `capture=False` the same pieces run uncaptured on the static buffers (the CPU tests check the padding and
the buffers that way)."""
from __future__ import annotations

import torch

from ..switches import initial
from .batch import StepBatch
from .decode_graphs import CaptureFailed, bucket, capture

# Token buckets: a step of T rows pads to the smallest >= T. Padding rows cost device time in the row-wise pieces
# (one H100, 35B-A3B: a mixed step of 4,152 rows padded to 5,120 took 108 ms against 97 eager, where at 1,024 rows
# the graphs took 50 ms against 94), so the steps are fine: 128 rows up to 4,096, then 256 and 512, at most 1/16
# more rows past 2,048. A capture costs about 0.25 s a bucket at load (the 35B-A3B's 40 layers), and all share one
# memory pool, sized by the largest.
TOKEN_BUCKETS = (tuple(range(128, 4096, 128)) + tuple(range(4096, 8192, 256)) + tuple(range(8192, 16384, 512))
                 + (16384,))
# Steps of more rows run eagerly: there the device time hides the host's (one H100, 35B-A3B at 4,096 rows: 95.0 ms
# through the graphs against 95.9 eager; H200, 27B: 348.4 against 347.9), and padding only adds to it (a mixed step of
# the 27B, 4,152 rows in a bucket of 4,224: 376.0 against 348.6 ms). Fewer buckets also hold less memory, which the
# KV cache would otherwise have (the pool is sized by the largest bucket: 1.4 GiB at 4,152 rows of the 35B-A3B)
MAX_ROWS = 2048
# MEMRA_PP_PREFILL_GRAPHS=0: prompt steps run eagerly, layer by layer (switches.py)
ENABLED = initial("MEMRA_PP_PREFILL_GRAPHS")


class PrefillGraphs:
    def __init__(self, model, max_tokens: int, capture: bool = True):
        self.model, self.capture = model, capture
        max_tokens = min(max_tokens, MAX_ROWS)
        top = bucket(max_tokens, TOKEN_BUCKETS) or max_tokens
        self.buckets = tuple(b for b in TOKEN_BUCKETS if b < top) + (top,)
        n, dev, dt = top, model.device, model.dtype
        H = model.mc.text.hidden_size
        self.h = torch.zeros(n, H, dtype=dt, device=dev)
        cos, _ = model.rope.cos_sin(torch.zeros(3, 1, dtype=torch.long), dt)
        self.cos = torch.zeros(n, cos.shape[1], dtype=dt, device=dev)
        self.sin = torch.zeros_like(self.cos)
        # per mixer kind (full attention or not): the merged projection's buffer, the other pre outputs' buffers
        # (shapes from one row through that kind's first layer), the core's output buffer
        self.P, self.pre, self.o = {}, {}, {}
        x1 = torch.zeros(1, H, dtype=dt, device=dev)
        for layer in model.layers:
            kind = layer.full
            if kind in self.P:
                continue
            self.P[kind] = torch.zeros(n, layer.mixer.w_in.shape[0], dtype=dt, device=dev)
            pre = layer.mix_pre(x1, cos, cos, out=self.P[kind][:1])
            self.pre[kind] = [None if self._in_P(kind, t) else
                              torch.zeros(n, *t.shape[1:], dtype=t.dtype, device=dev) for t in pre]
            c = model.mc.text
            self.o[kind] = (torch.zeros(n, c.num_attention_heads * c.head_dim, dtype=dt, device=dev) if kind
                            else torch.zeros(n, c.linear_num_value_heads, c.linear_value_head_dim, dtype=dt,
                                             device=dev))
        self.graphs: dict[int, list] = {}       # bucket -> its pieces' graphs (None each when uncaptured)
        self.pres: dict[int, list] = {}         # bucket -> each layer's pre outputs (static buffers' views)
        self.out: dict[int, torch.Tensor] = {}  # bucket -> the last piece's output
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = self.captures = 0

    def _in_P(self, kind, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() == self.P[kind].untyped_storage().data_ptr()

    def stats(self) -> dict:
        return {"captures": self.captures, "replays": self.replays, "buckets": sorted(self.graphs)}

    def takes(self, b: StepBatch, T: int) -> bool:
        return not b.decode_only() and not b.uses_adapters() and T <= self.buckets[-1]

    def capture_all(self) -> int:
        """Every bucket's pieces now (a stage's load), largest first; how many buckets. Raises CaptureFailed."""
        n = 0
        for nb in reversed(self.buckets):
            if nb not in self.graphs:
                self._build(nb)
                n += 1
        return n

    def run(self, b: StepBatch, h_TH: torch.Tensor, cache, cos, sin) -> torch.Tensor:
        """The step's layers: h [T, H] in, h out (a new tensor)."""
        T = h_TH.shape[0]
        nb = bucket(T, self.buckets)
        if nb not in self.graphs:
            self._build(nb)             # raises CaptureFailed: the stage goes on eagerly
        graphs, pres = self.graphs[nb], self.pres[nb]
        self.h[:T].copy_(h_TH)
        self.cos[:T].copy_(cos)
        self.sin[:T].copy_(sin)
        h = self.h[:nb]
        for j in range(len(self.model.layers) + 1):
            if j:       # layer j - 1's core, eagerly on the real rows, into its static output buffer
                L = self.model.layers[j - 1]
                o = L.mix_core(tuple(t[:T] for t in pres[j - 1]), b, cache)
                self.o[L.full][:T].copy_(o.view(self.o[L.full][:T].shape))
            if graphs[j] is not None:
                graphs[j].replay()
            else:
                h = self._piece(nb, j, h)
        self.replays += 1
        return (self.out[nb] if graphs[0] is not None else h)[:T].clone()

    def _piece(self, nb: int, j: int, h: torch.Tensor) -> torch.Tensor:
        """Piece j of bucket nb on h [nb, H]: layer j - 1's rest (for j > 0), then layer j's input norm and pre
        outputs into the static buffers (for j < the layer count; recorded in self.pres[nb][j]). Returns h after
        layer j - 1 (piece 0: h itself)."""
        from memra_pp.kernels.fused_decode import add_rms_norm
        layers, pres = self.model.layers, self.pres[nb]
        if j:
            L = layers[j - 1]
            h = L.rest(h, self.o[L.full][:nb], pres[j - 1])
        if j < len(layers):
            N = layers[j]
            pre = N.mix_pre(add_rms_norm(h, None, N.ln1, self.model.mc.text.rms_norm_eps)[1], self.cos[:nb],
                            self.sin[:nb], out=self.P[N.full][:nb])
            # (the projection's views are in its buffer already; the rest is copied into theirs)
            pres[j] = tuple(t if buf is None else buf[:nb].copy_(t) for t, buf in zip(pre, self.pre[N.full]))
        return h

    def _build(self, nb: int) -> None:
        """The bucket's pieces, each captured after a warm-up run (kernels compile, cuBLAS picks its algorithms)
        and replayed once (its outputs then hold numbers, not the pool's old bytes, for the next piece's warm-up).
        Uncaptured (capture=False), a run once to record the pre outputs' views. Capture errors are thread-local:
        the stage's transport threads keep using CUDA meanwhile."""
        self.pres[nb] = [None] * len(self.model.layers)
        graphs, h = [], self.h[:nb]
        self.captures += 1
        try:
            for j in range(len(self.model.layers) + 1):
                if self.capture:
                    g, h = self._capture_cuda(nb, j, h)
                    graphs.append(g)
                else:
                    h = self._piece(nb, j, h)
                    graphs.append(None)
        except Exception as e:
            del self.pres[nb]
            if self.capture:
                torch.cuda.synchronize()
            raise CaptureFailed(f"prefill graph capture ({nb} rows) failed: {type(e).__name__}: {e}") from e
        self.graphs[nb], self.out[nb] = graphs, h

    def _capture_cuda(self, nb: int, j: int, h: torch.Tensor):
        g, out = capture(lambda: self._piece(nb, j, h), self.pool)
        g.replay()          # (its outputs hold numbers for the next piece's warm-up)
        torch.cuda.synchronize()
        return g, out
