"""CUDA graphs of one stage's decode step. A decode step of 64 layers is a few thousand small kernels; launched
from Python they cost more host time than the GPU needs to run them (measured: 69 ms eager for a 12 ms floor at
batch 1). A graph per (batch-size bucket, KV-length bucket) replays the step in one launch.

Static buffers hold the step's inputs and its output (one buffer of the largest bucket's rows, written by every
graph's last kernel); a batch of n sequences runs the graph of the smallest bucket >= n, its padding rows pointing at
the cache's scratch slot. With ANY_KV a deployment's stage captures every batch bucket's graph when it loads
(capture_all), as vLLM captures its sizes at startup; else graphs are captured on first use. They share one memory
pool. On a GPU the KV pools grow in place (model/cache.py), so the graphs live as long as the cache; where a growth
copies the pools instead (the CPU, MEMRA_PP_KV_IN_PLACE=0) they are dropped (their addresses are baked into the
graphs; the cache's `generation` counts the replacements), then captured again on first use, as they are after any
growth where the step's KV kernels are the torch references (their indexing bakes the pools' size in).
"""
from __future__ import annotations


import torch

from .batch import StepBatch
from ..switches import initial

BATCH_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 80, 96, 128, 160, 192, 256, 320, 384, 512, 640, 768, 1024)
MIN_KV = 256
# True: one graph per batch bucket, its attention over the cache's whole capacity, each sequence's chunks from its
# own length (paged_attention.decode_attention's len_chunks). False: a graph per (batch, KV-length) bucket, so the
# first step whose positions cross 256, 512, ... captures one more graph in the middle of serving (about 0.6 s on
# the H200 for the 35B-A3B, every request waiting). H200, 35B-A3B, cache of 8,192 positions a sequence, at 192: the
# step 2.43 / 2.42 ms against 2.43 / 2.38 at one row, 19.26 / 19.22 against 19.24 / 19.23 at 64; a deployment's
# batch-1 decode (128 in, 256 out) 412.9 tokens/s against 173.2, which captured mid-run (docs/PERF.md, eleventh
# session). MEMRA_PP_ANY_KV_GRAPHS=0 in the launching process turns it off (switches.py)
ANY_KV = initial("MEMRA_PP_ANY_KV_GRAPHS")
# A batch of 5 runs the graph of 8: its 3 padding rows, at the scratch slot, skip the Gated DeltaNet's recurrent step
# (no state read or written: 2-3 MB a layer a row) and the MoE routes them to no expert (at the 35B-A3B's top-8 they
# could add 24 experts a layer to the 5 real rows' 40). The step passes the index block's flag a row (`live`) down to
# the layers. Their outputs are then not defined; nothing reads them. MEMRA_PP_SKIP_PADDING=0 in the launching
# process: padding rows run as real rows (switches.py)
SKIP_PADDING = initial("MEMRA_PP_SKIP_PADDING")


class CaptureFailed(RuntimeError):
    pass


def bucket(n: int, buckets) -> int | None:
    return next((b for b in buckets if b >= n), None)


class DecodeGraphs:
    def __init__(self, model, cache, max_batch: int, capture: bool = True):
        """`capture=False` runs the same static step eagerly (the CPU tests check padding and buckets that way)."""
        self.model, self.cache, self.capture = model, cache, capture
        self.buckets = tuple(b for b in BATCH_BUCKETS if b < max_batch) + (bucket(max_batch, BATCH_BUCKETS)
                                                                           or max_batch,)
        n, dev = self.buckets[-1], model.device
        self.h = torch.zeros(n, model.mc.text.hidden_size, dtype=model.dtype, device=dev)
        # one index block per step, copied in with one host-to-device copy: slots, positions, 3 M-RoPE rows, and a
        # flag a row, 0 for padding rows (SKIP_PADDING: the MoE routes them to no expert, the Gated DeltaNet's step
        # skips them)
        self.idx = torch.zeros(6, n, dtype=torch.long, device=dev)
        self.slots, self.pos, self.pos3, self.live = self.idx[0], self.idx[1], self.idx[2:5], self.idx[5]
        self.slots.fill_(cache.scratch)
        # every graph's output, written in place by its last kernel (one buffer, not one per graph: float32 logits
        # for the buckets up to 1,024 rows held 4.7 GB on the primary); a replay's rows are cloned before the next
        self.out = (torch.empty(n, model.lm_head.shape[0], dtype=torch.float32, device=dev) if model.primary
                    else torch.empty_like(self.h))
        self._pin = dev.type == "cuda"
        self.graphs: dict[tuple[int, int], object] = {}       # (batch bucket, KV length) -> its CUDA graph
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.kv_key = self._kv_key()
        self.replays = self.captures = 0

    def stats(self) -> dict:
        return {"captures": self.captures, "replays": self.replays, "graphs": sorted(self.graphs)}

    def _kv_key(self) -> tuple[int, int]:
        """Changes whenever a pool moves (the cache's generation: an interrupted growth may replace some pools and
        not the first one, so neither the block count nor the first pool's address would show it), and whenever the
        pools grow in place where the step's KV kernels are the torch references, whose indexing bakes the pools'
        size into a graph."""
        from memra_pp.kernels.paged_attention import reads_pools_by_address
        kp = next(iter(self.cache.k.values()), None)
        sized = kp is not None and not reads_pools_by_address(kp)
        return self.cache.generation, self.cache.n_blocks if sized else 0

    def capture_all(self) -> int:
        """With ANY_KV, capture every batch bucket's graph now (a stage's load): no request waits for a capture
        (about 0.6 s each for the 35B-A3B; on a GPU the KV pools grow in place and keep them, and where a growth
        copies the pools it drops them all, each captured again on first use), and the memory the graphs hold is
        taken before the KV budget is measured. The largest first, so the smaller ones reuse its freed
        intermediates in the shared pool. Returns how many it captured (0 without ANY_KV: a graph per KV bucket
        stays on first use). Raises CaptureFailed."""
        if not ANY_KV:
            return 0
        S, n = self.cache.max_positions, 0
        for nb in reversed(self.buckets):
            if (nb, S) not in self.graphs:
                self.graphs[(nb, S)] = self._capture(nb, S)
                n += 1
        return n

    def takes(self, b: StepBatch) -> bool:
        return (b.decode_only() and not b.uses_adapters() and len(b.slots) <= self.buckets[-1]
                and (not self.model.primary or all(b.sample)))

    def run(self, b: StepBatch, h_BH: torch.Tensor) -> torch.Tensor:
        n = len(b.slots)
        nb = bucket(n, self.buckets)
        cap = self.cache.max_positions
        # > every position written this step
        S = cap if ANY_KV else min(cap, max(MIN_KV, 1 << max(b.starts).bit_length()))
        kv_key = self._kv_key()
        if kv_key != self.kv_key:      # the pools moved: every captured address is stale
            self.graphs.clear()
            self.kv_key = kv_key
            if self.capture:   # a fresh memory pool: capturing into the pool of freed graphs trips the allocator
                self.pool = torch.cuda.graph_pool_handle()
        key = (nb, S)
        if key not in self.graphs:
            self.graphs[key] = self._capture(nb, S)   # raises CaptureFailed: the stage goes on eagerly
        graph = self.graphs[key]
        # padding rows write into the scratch slot at position 0; pinned, so the copy never waits for the device
        idx = torch.zeros(6, nb, dtype=torch.long, pin_memory=self._pin)
        idx[0, :n] = torch.tensor(b.slots)
        idx[0, n:] = self.cache.scratch
        idx[1, :n] = torch.tensor(b.starts)
        idx[2:5, :n] = b.pos_3T
        idx[5, :n] = 1
        self.idx[:, :nb].copy_(idx, non_blocking=True)
        self.h[:n].copy_(h_BH)
        if self.capture:
            graph.replay()
        else:
            self._step(nb, S)
        self.replays += 1
        return self.out[:n].clone()

    def _step(self, nb: int, S: int) -> torch.Tensor:
        return self.model.decode_static(self.h[:nb], self.slots[:nb], self.pos[:nb], self.pos3[:, :nb], S,
                                        self.cache, out=self.out[:nb], live=self.live[:nb] if SKIP_PADDING else None)

    def _capture(self, nb: int, S: int):
        """Warm up on a side stream (kernels compile, cuBLAS picks its algorithms), then capture. Every row points
        at the scratch slot meanwhile, so no sequence's cache is touched. Capture errors are thread-local: the stage's
        transport threads keep using CUDA while it captures."""
        self.slots[:nb].fill_(self.cache.scratch)
        self.pos[:nb].zero_()
        self.pos3[:, :nb].zero_()
        self.live[:nb].zero_()
        self.captures += 1
        if not self.capture:
            return None
        try:
            return self._capture_cuda(nb, S)
        except Exception as e:  # a kernel that cannot be captured: say so once, decode eagerly from here on
            torch.cuda.synchronize()
            raise CaptureFailed(f"decode graph capture (batch {nb}, kv {S}) failed: {type(e).__name__}: {e}") from e

    def _capture_cuda(self, nb: int, S: int):
        return capture(lambda: self._step(nb, S), self.pool)[0]      # (the step writes self.out[:nb])


def capture(fn, pool, warm=None):
    """fn() run once on a side stream (kernels compile, cuBLAS picks its algorithms), then captured into a CUDA
    graph in `pool` -> (the graph, what the captured run returned). Capture errors are thread-local: a stage's
    transport threads keep using CUDA meanwhile. Shared with the prefill graphs (prefill_graphs.py). `warm`: what
    runs on the side stream instead of fn (a call on other tensors, where fn's must reach the capture unseen)."""
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), torch.inference_mode():
        (warm or fn)()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.inference_mode(), torch.cuda.graph(g, pool=pool, capture_error_mode="thread_local"):
        out = fn()
    torch.cuda.synchronize()
    return g, out
