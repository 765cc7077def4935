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
the buffers that way).

Between the pieces, the Gated DeltaNet cores can replay fla's chunked rule from graphs of their own (RuleGraphs,
below; MEMRA_PP_RULE_GRAPHS, off by default)."""
from __future__ import annotations

import itertools

import torch

from ..switches import initial
from .batch import StepBatch, aligned_parts
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
        # fla's chunked rule through graphs of its own (RuleGraphs), where the cores call it (the Gated DeltaNet's
        # variable-length path) and the switch is on
        from memra_pp.kernels import prefill as pf
        gdn = next((L.mixer for L in model.layers if not L.full), None)
        self.rules = RuleGraphs(gdn.rule, model.mc.text, max_tokens, dt, dev, capture, out=self.o[False]) \
            if RULE_GRAPHS and pf.MERGED and gdn is not None and gdn.rule is not None and gdn.varlen(True, dev) \
            else None
        self.rules_failed = None    # why the rule graphs' capture failed, if it did (the cores then call it eagerly)

    def _in_P(self, kind, t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() == self.P[kind].untyped_storage().data_ptr()

    def stats(self) -> dict:
        return {"captures": self.captures, "replays": self.replays, "buckets": sorted(self.graphs),
                "rule": None if self.rules is None else self.rules.stats(), "rule_failed": self.rules_failed}

    def takes(self, b: StepBatch, T: int) -> bool:
        return not b.decode_only() and not b.uses_adapters() and T <= self.buckets[-1]

    def capture_all(self) -> int:
        """Every bucket's pieces now (a stage's load), largest first; how many buckets. Raises CaptureFailed."""
        n = 0
        for nb in reversed(self.buckets):
            if nb not in self.graphs:
                self._build(nb)
                n += 1
        self._capture_rules()
        return n

    def _capture_rules(self) -> None:
        """The rule graphs' every bucket, before any core runs; a failed capture leaves the cores calling the rule
        eagerly (said once in a warning and in rules_failed), the pieces' graphs as they are."""
        if self.rules is None or self.rules.ready():
            return
        try:
            self.rules.capture_all()
        except CaptureFailed as e:
            import warnings
            warnings.warn(f"{e}; fla's rule runs eagerly in prompt steps")
            self.rules, self.rules_failed = None, str(e)

    def run(self, b: StepBatch, h_TH: torch.Tensor, cache, cos, sin) -> torch.Tensor:
        """The step's layers: h [T, H] in, h out (a new tensor)."""
        T = h_TH.shape[0]
        nb = bucket(T, self.buckets)
        if nb not in self.graphs:
            self._build(nb)             # raises CaptureFailed: the stage goes on eagerly
        self._capture_rules()           # (captured at load: here only where capture_all was not called)
        graphs, pres = self.graphs[nb], self.pres[nb]
        self.h[:T].copy_(h_TH)
        self.cos[:T].copy_(cos)
        self.sin[:T].copy_(sin)
        h = self.h[:nb]
        for j in range(len(self.model.layers) + 1):
            if j:       # layer j - 1's core, eagerly on the real rows, into its static output buffer
                L = self.model.layers[j - 1]
                o = L.mix_core(tuple(t[:T] for t in pres[j - 1]), b, cache, rules=self.rules)
                dst = self.o[L.full][:T]
                if o.data_ptr() != dst.data_ptr():      # (the rule graphs write a whole step's output in place)
                    dst.copy_(o.view(dst.shape))
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


# The rule graphs' buckets: a step's R rows of prompt segments pad to the smallest row bucket >= R, its N segments
# plus one trailing empty segment (the owner of the padding chunks) to the smallest segment bucket >= N + 1. Larger
# steps (more rows than the prefill graphs take, or 16 segments or more) call the rule eagerly.
# Fine buckets: every padding row costs the graph's output copy, and every empty segment its state passed through and
# copied (2-3 MB each at 35B-A3B / 27B dimensions). A capture is ~3 ms (144 graphs in 0.5 s at load).
RULE_ROW_BUCKETS = tuple(range(128, 2048 + 1, 128))
SEGMENT_BUCKETS = (2, 3, 4, 5, 6, 8, 10, 12, 16)
# MEMRA_PP_RULE_GRAPHS=1: the prefill graphs' Gated DeltaNet cores replay fla's rule from the rule graphs; off by
# default (switches.py): on one H100 a replay took 210-330 us of host time a layer against 710-960 eagerly, but
# 20-28% more device time (the copies into and out of the static buffers, the padding), and end to end (35B-A3B,
# 64 concurrent) the two were within 1% of each other: the host kept up. Where it does not (the thirty-seventh session
# measured 1.9 ms of host time a call on another H100), the switch takes three quarters of it off each layer
RULE_GRAPHS = initial("MEMRA_PP_RULE_GRAPHS")


class RuleGraphs:
    """fla's chunked gated delta rule over a prompt step's segments through CUDA graphs: the rule's variable-length
    call costs about 1 ms of host time a layer (8 Triton launches, autotuner lookups; docs/PERF.md, thirty-seventh
    session), most of a host-bound prompt step's time once the prefill graphs replay the rest. The rule holds no
    weights, so one graph per (row bucket nb, segment bucket S) serves every Gated DeltaNet layer of a stage.

    A step of R rows in N segments: the real rows' q and k are l2-normalised into static buffers (the rule then
    normalises none), v, g and beta copied in, the segments' states gathered into the first N of S; the graph
    replays over nb rows and S segments, and writes its output and final states into static buffers. Padding:
    - segments N..S-1 are empty (fla's cu_seqlens repeats R): fla passes an empty segment's state through, and no
      state of theirs is read back;
    - the chunk indices hold the real (segment, chunk) pairs, then (S - 1, 0), a chunk of the last, empty segment:
      its programs return at once (the segment has no rows), and its index into fla's per-chunk states stays below
      the padded chunk count nb / 64 + S;
    - rows R..nb belong to no segment: no kernel reads or writes them but the row-wise l2norm of stale rows.
    fla derives chunk offsets from cu_seqlens and caches them by the tensor's identity: each graph's cu_seqlens and
    chunk indices are tensors made for its capture (its warm-up runs on copies), so the capture records those
    kernels (a warm-up tensor's cached offsets would replay stale).

    Outputs (the core's output rows, the states) live in static buffers: the graphs' pool then holds one graph's
    temporaries, not every graph's outputs. The output is a view valid until the next replay. `out` (the prefill
    graphs' Gated DeltaNet output buffer [>= nb rows, nv, dv]) holds it there: a step whose rows are all prompt
    rows then needs no copy of it (a step with decode rows copies it into its own output at once).
    `capture=False`: the same padded calls uncaptured (CPU tests)."""

    def __init__(self, rule, cfg, max_rows: int, dtype, device, capture: bool = True, out=None):
        self.rule, self.capture = rule, capture
        nk, nv, dk, dv = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, \
            cfg.linear_value_head_dim
        qh = nk if getattr(rule, "gva", False) else nv
        top = bucket(max_rows, RULE_ROW_BUCKETS) or max_rows
        self.rows = tuple(b for b in RULE_ROW_BUCKETS if b < top) + (top,)
        n, S = top, SEGMENT_BUCKETS[-1]

        def z(*shape, dt=dtype):
            return torch.zeros(*shape, dtype=dt, device=device)
        self.q, self.k, self.v = z(1, n, qh, dk), z(1, n, qh, dk), z(1, n, nv, dv)
        self.g, self.beta = z(1, n, nv, dt=torch.float32), z(1, n, nv)
        self.s0, self.s = z(S, nv, dk, dv, dt=torch.float32), z(S, nv, dk, dv, dt=torch.float32)
        self.o = z(1, n, nv, dv) if out is None else out[:n][None]
        assert self.o.shape == (1, n, nv, dv), (tuple(out.shape), n)
        self.device = torch.device(device)
        self.meta: dict[tuple, tuple] = {}      # (nb, S) -> the (cu_seqlens, chunk indices) its graph reads
        self.holds: dict[tuple, object] = {}    # (nb, S) -> the Segments whose layout meta holds now
        self.graphs: dict[tuple, object] = {}   # (nb, S) -> its graph (None uncaptured)
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.replays = self.captures = 0
        self.declined = 0       # calls the cores made eagerly instead (more rows or segments than the buckets)

    def keys(self) -> list[tuple]:
        return [(nb, S) for nb in self.rows for S in SEGMENT_BUCKETS]

    def ready(self) -> bool:
        """Every bucket's graph is built (run builds none: a capture inside a step would come after its first
        cores had written the cache)."""
        return len(self.graphs) == len(self.rows) * len(SEGMENT_BUCKETS)

    def stats(self) -> dict:
        return {"captures": self.captures, "replays": self.replays, "declined": self.declined}

    def takes(self, R: int, N: int) -> bool:
        return R <= self.rows[-1] and N < SEGMENT_BUCKETS[-1]

    def capture_all(self) -> int:
        """Every (row, segment) bucket's graph now, largest first; how many. Raises CaptureFailed."""
        todo = [key for key in reversed(self.keys()) if key not in self.graphs]
        for key in todo:
            self._build(key)
        return len(todo)

    def run(self, q, k, v, g, beta, rec, slots, seg) -> tuple[torch.Tensor, torch.Tensor]:
        """The rule over seg's segments of q, k, v, g, beta [1, R, ...] (raw q and k), initial states rec[slots]
        (slots None: all zero, fresh prompts) -> (o [1, R, nv, dv], final states [N, ...]), both views of static
        buffers valid until the next replay."""
        from memra_pp.kernels.fused_decode import l2norm
        R, N = q.shape[1], len(seg.lens)
        assert slots is None or slots.numel() == N, (slots.shape, N)    # (index_select would resize a short out)
        key = (bucket(R, self.rows), bucket(N + 1, SEGMENT_BUCKETS))
        if self.holds.get(key) is not seg:
            cu, chunks = self._layout(seg, *key)
            self.meta[key][0].copy_(cu)
            self.meta[key][1].copy_(chunks)
            self.holds[key] = seg
        l2norm(q.contiguous(), out=self.q[:, :R])
        l2norm(k.contiguous(), out=self.k[:, :R])
        self.v[:, :R].copy_(v)
        self.g[:, :R].copy_(g)
        self.beta[:, :R].copy_(beta)
        if slots is None:
            self.s0[:N].zero_()
        else:
            torch.index_select(rec, 0, slots, out=self.s0[:N])
        graph = self.graphs[key]
        if graph is not None:
            graph.replay()
        else:
            self._call(*key, *self.meta[key])
        self.replays += 1
        return self.o[:, :R], self.s[:N]

    def _layout(self, seg, nb: int, S: int) -> tuple[torch.Tensor, torch.Tensor]:
        """seg's cu_seqlens [S + 1] and chunk indices [nb / 64 + S, 2], padded as the class says (one host-to-device
        copy a step and bucket, kept on the Segments)."""
        got = seg.__dict__.setdefault("_rule_layout", {})
        if (nb, S) not in got:
            cu_t, ch_t = aligned_parts(self.padded(seg.lens, nb, S), self.device)
            got[(nb, S)] = (cu_t, ch_t.view(-1, 2))
        return got[(nb, S)]

    def padded(self, lens: list[int], nb: int, S: int) -> tuple[list[int], list[int]]:
        """cu_seqlens [S + 1] and flat chunk indices [2 (nb / 64 + S)] of segments of `lens` (at most nb rows, fewer
        than S segments) padded as the class says."""
        from memra_pp.kernels.prefill import FLA_CHUNK, chunk_pairs
        NT = self._chunk_count(nb, S)
        cu = [0, *itertools.accumulate(lens)]
        cu += [cu[-1]] * (S + 1 - len(cu))
        ch = chunk_pairs(lens, FLA_CHUNK)
        assert len(ch) // 2 <= NT, (lens, nb, S)
        return cu, ch + [S - 1, 0] * (NT - len(ch) // 2)

    @staticmethod
    def _chunk_count(nb: int, S: int) -> int:
        """Chunk indices a graph holds: R <= nb rows in N <= S - 1 segments have at most nb / 64 + N chunks."""
        from memra_pp.kernels.prefill import FLA_CHUNK
        return -(-nb // FLA_CHUNK) + S

    def _call(self, nb: int, S: int, cu, chunks) -> None:
        """The padded call over the static buffers (what a graph captures); outputs into the static ones."""
        o, s = self.rule.chunk_varlen(self.q[:, :nb], self.k[:, :nb], self.v[:, :nb], self.g[:, :nb],
                                      self.beta[:, :nb], self.s0[:S], cu, chunks, normed=True)
        self.o[:, :nb].copy_(o)
        self.s[:S].copy_(s)

    def _build(self, key: tuple) -> None:
        """The key's graph, captured over fresh cu_seqlens / chunk index tensors after a warm-up on copies of them
        (a layout of one segment holding every row); replayed once. Uncaptured: the tensors only."""
        nb, S = key
        cu, ch = self.padded([nb], nb, S)
        warm = (torch.tensor(cu, device=self.device), torch.tensor(ch, device=self.device).view(-1, 2))
        self.captures += 1
        if not self.capture:
            self.meta[key], self.graphs[key] = warm, None
            return
        meta = tuple(t.clone() for t in warm)
        try:
            g, _ = capture(lambda: self._call(nb, S, *meta), self.pool, warm=lambda: self._call(nb, S, *warm))
            g.replay()
            torch.cuda.synchronize()
        except Exception as e:
            torch.cuda.synchronize()
            raise CaptureFailed(f"rule graph capture ({nb} rows, {S} segments) failed: {type(e).__name__}: {e}") \
                from e
        self.meta[key], self.graphs[key] = meta, g
