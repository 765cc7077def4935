"""Per-sequence caches of one stage (in its stage process): KV for full layers in paged pools, conv + fp32 state for
linear layers in slot-indexed pools.

A sequence owns one slot for its life on every stage; `lens[slot]` is its cached length on this stage. One more
slot, `scratch`, is never given to a sequence: the padding rows of a decode CUDA graph use it.

KV is paged: each full layer's keys (and values) live in a pool of fixed-size blocks [n_blocks, kv_heads,
kv_block, head_dim]; `table[slot, j]` names the block holding positions [j * kv_block, (j + 1) * kv_block) of the
slot's sequence. A sequence takes blocks as it grows and returns them when its slot is released or reset, so memory
follows the tokens actually cached (a long prompt no longer sizes every slot to its length). Block 0 (NULL) is
where every unused table entry points; nothing writes it, so it stays zeros (a reference attention multiplies a
masked position's value by 0, and 0 * NaN is NaN). Block 1 (SINK) is the scratch slot's whole table row: a padding
row's write, garbage or NaN, lands where only padding rows read. The pools grow only when no block is free (by the
blocks needed, further towards doubling while the device keeps headroom free). On a GPU each pool grows in place:
its address range is reserved for every slot at max_context and memory is mapped onto it as it grows
(memra_pp.vmm.GrowableBuffer), so the decode graphs captured over it stay valid. Elsewhere (the CPU, or
MEMRA_PP_KV_IN_PLACE=0, or a driver without the virtual memory API) a growth replaces the pool tensors, bumping
`generation`, so decode graphs captured over the old ones are dropped.
"""
from __future__ import annotations

import torch

from ..errors import ConfigError
from .batch import h2d
from .config import TextConfig
from ..switches import initial
from .kv_memory import (FIRST_FREE, cuda_free_total, fits, growth_size, headroom, host_available, kv_budget,
                        reachable_blocks, size_text, upfront, upfront_bytes)

KV_BLOCK = 64           # positions a KV page holds, unless a cache is made with another
NULL, SINK = 0, 1      # the null block, the scratch slot's sink block (FIRST_FREE: the first block given out)
# CUDA pools grow in place (GrowableBuffer). Off, a growth copies every pool into a larger one and drops the decode
# graphs: H200, 35B-A3B, 64 concurrent of 128 in, 256 out, two graphs were captured again mid-run (twelfth session)
IN_PLACE = initial("MEMRA_PP_KV_IN_PLACE")


class StageCache:
    def __init__(self, cfg: TextConfig, layers: range, max_seqs: int, max_context: int, dtype, device,
                 kv_block: int | None = None, initial_blocks_per_slot: int = 4):
        kv_block = KV_BLOCK if kv_block is None else kv_block
        # the decode attention kernel's tiles (powers of two, at most 64) must divide a page
        assert kv_block > 0 and kv_block & (kv_block - 1) == 0, f"kv_block {kv_block} is not a power of two"
        self.cfg, self.max_seqs, self.max_context = cfg, max_seqs, max_context
        self.scratch = max_seqs
        rows = max_seqs + 1
        self.dtype, self.device, self.kv_block = dtype, torch.device(device), kv_block
        self.max_blocks = -(-max_context // kv_block)             # table columns: one sequence's most blocks
        self.conv: dict[int, torch.Tensor] = {}
        self.rec: dict[int, torch.Tensor] = {}
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self._bufs: dict[tuple[str, int], object] = {}      # GrowableBuffer of each pool growing in place
        self.layers, self._initial = layers, initial_blocks_per_slot
        parts = upfront(cfg, layers, max_seqs, max_context, dtype, kv_block, initial_blocks_per_slot)
        self._refuse_upfront(parts)
        n_blocks = parts["kv"][1][0]
        try:    # what the check could not see (several stages on one host, say) still ends in the error it gives
            self.copy_growth = self._make_kv_pools([i for i in layers if cfg.is_full(i)], parts["kv"][1])
            for i in layers:
                if not cfg.is_full(i):
                    self.conv[i] = torch.zeros(parts["conv"][1], dtype=dtype, device=device)
                    self.rec[i] = torch.zeros(parts["rec"][1], dtype=torch.float32, device=device)
            self.table = torch.zeros(parts["table"][1], dtype=torch.long, device=device)    # unused entries: NULL
        except RuntimeError as e:      # torch.OutOfMemoryError, or the CPU allocator's (unmappable pools copy)
            if not isinstance(e, torch.OutOfMemoryError) and "allocate" not in str(e):
                raise
            for d in (self.conv, self.rec, self.k, self.v, self._bufs):
                d.clear()
            raise ConfigError(self._too_big(parts, "ran out of memory with", self._available())) from e
        self.n_blocks = n_blocks if self.k else 0
        self.table[self.scratch] = SINK
        self.owned: list[list[int]] = [[] for _ in range(rows)]
        self.free_blocks = list(range(self.n_blocks - 1, FIRST_FREE - 1, -1))   # NULL and SINK never given out
        self.lens = [0] * rows
        self.grown = 0                                            # growths (stats, tests)
        self.generation = 0     # bumped whenever a pool moves (a copying growth; decode graphs bake in the addresses)

    def _refuse_upfront(self, parts: dict) -> None:
        """Refuse settings whose up-front tensors the device cannot hold, before any is allocated. The figure is this
        cache's alone against what the device has now: in a stage, after its weights are loaded (stages/runner.py);
        what comes after (graph captures, activations) has only `fits`' slack left."""
        have = self._available()
        if have is not None and not fits(upfront_bytes(parts), have):
            raise ConfigError(self._too_big(parts, "has", have))

    def _available(self) -> int | None:
        """Bytes the device has now (None: unknown): a GPU's free memory, in this process's (primary) context, or
        the host's MemAvailable."""
        return self._free_bytes()[0] if self.device.type == "cuda" else host_available()

    def _too_big(self, parts: dict, verb: str, have: int | None) -> str:
        """One line for settings whose up-front cache does not fit in `have` bytes: the keys, the bytes by part, how
        many fit."""
        names = {"table": "block table", "conv": "conv states", "rec": "recurrent states", "kv": "first KV blocks"}
        by = ", ".join(f"{names[p]} {size_text(upfront_bytes(parts, p))}" for p in names if parts[p][0])
        free = "?" if have is None else size_text(have)
        free += " free" if self.device.type == "cuda" else " available (MemAvailable)"
        n = 0 if have is None else reachable_blocks(0, self.max_seqs, lambda m: fits(upfront_bytes(upfront(
            self.cfg, self.layers, m, self.max_context, self.dtype, self.kv_block, self._initial)), have))
        most = f" (at most {n} fit at this max_context)" if 0 < n < self.max_seqs else ""
        return (f"scheduler.max_batch {self.max_seqs} x scheduler.max_context {self.max_context}: the cache of "
                f"layers [{self.layers.start}, {self.layers.stop}) needs {size_text(upfront_bytes(parts))} up front "
                f"({by}) on {self.device}, which {verb} {free}; lower scheduler.max_batch{most} or "
                f"scheduler.max_context")

    def _make_kv_pools(self, full: list[int], shape: tuple) -> str | None:
        """The zeroed KV pools of the full layers `full`, mapped to grow in place where the device can; returns why
        they grow by copying instead (None: in place), and warns where a GPU's pools copy without being told to."""
        why = self._copy_growth_reason(bool(full))
        if not why:
            from memra_pp.cuda import CudaError
            try:
                for i in full:
                    for d, name in ((self.k, "k"), (self.v, "v")):
                        d[i] = self._mapped_pool((name, i), shape)
            except CudaError as e:      # e.g. no address space for every slot at max_context: copy, and say why
                for d in (self.k, self.v, self._bufs):
                    d.clear()
                why = f"the KV pools could not be mapped ({e})"
        if why:
            for i in full:
                self.k[i] = torch.zeros(shape, dtype=self.dtype, device=self.device)
                self.v[i] = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if why and self.device.type == "cuda" and why != "MEMRA_PP_KV_IN_PLACE=0":
            import warnings
            warnings.warn(f"KV pools on {self.device} grow by copying: {why}; every growth drops the decode graphs "
                          f"(captured again on first use)", stacklevel=3)
        return why

    def _copy_growth_reason(self, has_kv: bool) -> str | None:
        """Why this cache's pools grow by copying (None: they grow in place, on a GPU)."""
        if not has_kv or self.device.type != "cuda":
            return "not on a GPU" if has_kv else "no KV pools"
        if not IN_PLACE:
            return "MEMRA_PP_KV_IN_PLACE=0"
        from memra_pp.cuda import CudaError
        try:
            from memra_pp.vmm import vmm_supported
            if not vmm_supported(self._index()):
                return "the driver has no virtual memory management on this device"
        except CudaError as e:      # no cuda-bindings, no driver: copy, and say why
            return f"no virtual memory API ({e})"
        return None

    def _index(self) -> int:
        return self.device.index if self.device.index is not None else torch.cuda.current_device()

    def _mapped_pool(self, key: tuple[str, int], shape: tuple) -> torch.Tensor:
        """A zeroed pool of shape[0] blocks over a GrowableBuffer reserved for this cache's most blocks."""
        from memra_pp.vmm import GrowableBuffer
        page = self._page_bytes(shape)
        buf = self._bufs[key] = GrowableBuffer(self._index(), self.most_blocks * page)
        buf.grow(shape[0] * page)
        return self._view(buf, shape).zero_()

    def _page_bytes(self, shape: tuple) -> int:
        """Bytes of one block of a pool of `shape` (every KV pool's blocks are alike)."""
        return shape[1] * shape[2] * shape[3] * self.dtype.itemsize

    def _view(self, buf, shape: tuple) -> torch.Tensor:
        return buf.tensor(shape[0] * self._page_bytes(shape)).view(self.dtype).view(shape)

    @property
    def max_positions(self) -> int:
        """The most positions one sequence can cache (table columns x block size)."""
        return self.max_blocks * self.kv_block

    @property
    def most_blocks(self) -> int:
        """The blocks a pool holds at most: every slot at max_context, plus the null and sink blocks."""
        return FIRST_FREE + self.max_seqs * self.max_blocks

    def reserve(self, slots: list[int], ends: list[int]) -> None:
        """Give each slot enough blocks for positions < its end (a sequence keeps the blocks it has)."""
        if not self.k:
            return
        B = self.kv_block
        if max(ends) > self.max_context:
            raise ValueError(f"sequence length {max(ends)} exceeds max_context {self.max_context}")
        need = {s: -(-e // B) - len(self.owned[s]) for s, e in zip(slots, ends)}
        need = {s: n for s, n in need.items() if n > 0}
        if not need:
            return
        short = sum(need.values()) - len(self.free_blocks)
        if short > 0:
            self._grow(short)
        for s, n in need.items():
            self.owned[s] += [self.free_blocks.pop() for _ in range(n)]
        self._write_rows(list(need))

    def _write_rows(self, slots: list[int]) -> None:
        rows = torch.zeros(len(slots), self.max_blocks, dtype=torch.long)
        for r, s in enumerate(slots):
            rows[r, :len(self.owned[s])] = torch.tensor(self.owned[s])
        idx = torch.tensor(slots)
        if self.device.type == "cuda":    # pinned: the copies never wait for the step still on the device
            rows = rows.pin_memory().to(self.device, non_blocking=True)
            idx = idx.pin_memory().to(self.device, non_blocking=True)
        self.table.index_copy_(0, idx, rows)

    def _grow(self, short: int) -> None:
        """Grow every KV pool (in place, or by copying: `copy_growth`) to more blocks: the `short` ones needed
        (refused with a typed error when even those do not fit), and beyond them up to doubling while the device
        keeps its headroom free."""
        n = self.n_blocks
        cap = self.most_blocks
        self._check_room(n + short)
        room = None
        if self.device.type == "cuda":
            free, total = self._free_bytes()
            room = (free, headroom(total))

        def roomy(m: int) -> bool:
            return room is None or fits(self._peak_bytes(m), *room)
        new = growth_size(n, short, cap, roomy)
        from memra_pp.vmm import DeviceOutOfMemory
        try:    # pool by pool; one that already grew (an earlier, interrupted growth) is left as it is
            for name, d in (("k", self.k), ("v", self.v)):
                for i, t in d.items():
                    if t.shape[0] >= new:
                        continue
                    shape = (new, *t.shape[1:])
                    if self.copy_growth:
                        p = t.new_zeros(shape)
                        p[:t.shape[0]] = t
                        self.generation += 1
                    else:       # mapped onto the same addresses: the graphs over them stay valid
                        buf = self._bufs[(name, i)]
                        buf.grow(new * self._page_bytes(shape))
                        p = self._view(buf, shape)
                        p[t.shape[0]:].zero_()
                    d[i] = p
        except (torch.OutOfMemoryError, DeviceOutOfMemory) as e:
            from memra_pp.errors import InputError
            raise InputError(f"the KV cache could not grow to {new} blocks of {self.kv_block} positions on "
                             f"{self.device} (out of memory); lower scheduler.max_batch or scheduler.max_context, "
                             f"or split the model over more stages") from e
        finally:   # the pages every pool has are usable, whatever happened
            got = min(t.shape[0] for d in (self.k, self.v) for t in d.values())
            if got > n:
                self.free_blocks = list(range(got - 1, n - 1, -1)) + self.free_blocks
                self.n_blocks = got
                self.grown += 1

    def kv_report(self) -> dict:
        """What `kv_budget` needs from this stage: its device, the pages its table can name, and (on a GPU, with
        full layers here) the bytes of one page over all its pools, of one page of its largest pool, the blocks it
        has, and the device's free and total memory, measured now."""
        rep = {"device": str(self.device), "table_pages": self.max_seqs * self.max_blocks, "kv_block": self.kv_block}
        if self.k and self.device.type == "cuda":
            blks = [self._page_bytes(t.shape) for d in (self.k, self.v) for t in d.values()]
            free, total = self._free_bytes()
            # pool_page_bytes: what the one old pool a copying growth holds costs a page (none in place);
            # map_slack_bytes: in place, what mapping whole granules may take beyond the pages
            rep.update(page_bytes=sum(blks), pool_page_bytes=max(blks) if self.copy_growth else 0,
                       map_slack_bytes=sum(b.granularity for b in self._bufs.values()),
                       n_blocks=self.n_blocks, free=free, total=total)
        return rep

    def page_capacity(self, limit: int | None = None) -> int:
        """How many pages this stage's sequences may hold at once, were it alone on its device."""
        return kv_budget([self.kv_report()], limit)

    def _peak_bytes(self, n_blocks: int) -> int:
        """Bytes growing the pools to n_blocks needs at its peak. Only pools smaller than n_blocks grow (after an
        interrupted growth some already have), one by one: the peak is their growth, plus, where a growth copies,
        the largest one old pool, held while its copy is made, or in place, up to a granule each beyond it."""
        grow = [(t.shape[0], self._page_bytes(t.shape)) for d in (self.k, self.v) for t in d.values()
                if t.shape[0] < n_blocks]
        if self.copy_growth:
            extra = max((n * blk for n, blk in grow), default=0)
        else:
            extra = len(grow) * max((b.granularity for b in self._bufs.values()), default=0)
        return sum((n_blocks - n) * blk for n, blk in grow) + extra

    def _free_bytes(self) -> tuple[int, int]:
        """(bytes the device has for a growth: its free memory and what the caching allocator holds unused, its total
        memory)."""
        return cuda_free_total(self.device)

    def _fits(self, n_blocks: int) -> bool:
        return self.device.type != "cuda" or fits(self._peak_bytes(n_blocks), self._free_bytes()[0])

    def _check_room(self, n_blocks: int) -> None:
        """Refuse a growth the device cannot hold with a message that says so, before the allocator's
        out-of-memory error would."""
        if self._fits(n_blocks):
            return
        need, free = self._peak_bytes(n_blocks), self._free_bytes()[0]
        from memra_pp.errors import InputError
        raise InputError(
            f"the KV cache cannot grow to {n_blocks} blocks of {self.kv_block} positions: {need / 2**30:.1f} GiB "
            f"more on {self.device} where {free / 2**30:.1f} GiB are free (the sequences in flight hold "
            f"{sum(map(len, self.owned)) * self.kv_block} positions); lower scheduler.max_batch or "
            f"scheduler.max_context, or split the model over more stages")

    def locate(self, slots: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return locate(self.table, slots, pos, self.kv_block)

    def gather(self, pool: torch.Tensor, slots: torch.Tensor, S: int) -> torch.Tensor:
        return gather_pages(pool, self.table, slots, S)

    def release(self, slots: list[int]) -> None:
        """Give finished sequences' blocks back (work on the device that still reads them runs before any later
        write, in stream order). Their linear states are zeroed when a new sequence starts in the slot."""
        for slot in slots:
            self.free_blocks += reversed(self.owned[slot])
            self.owned[slot] = []
            self.lens[slot] = 0

    def reset(self, slots: list[int]) -> None:
        """Forget sequences: zero their linear states (a fresh prefill must start from S0 = 0), give their blocks
        back. One fill a state pool for all of them: slot by slot, a step of 8 new prompts cost each Gated DeltaNet
        layer 16 launches (768 a step on the 27B, 480 on the 35B-A3B: the memsets and fills of the twenty-sixth
        session's profiles, results/profile-mixed-*-2026-12-03-s26.txt)."""
        if not slots:
            return
        idx = h2d(torch.tensor(slots), self.device) if len(slots) > 1 else None
        for t in (*self.conv.values(), *self.rec.values()):
            if idx is None:
                t[slots[0]].zero_()
            else:
                t.index_fill_(0, idx, 0)
        self.release(slots)

    def mapped_bytes(self) -> int:
        """Device memory the pools growing in place have mapped (whole granules; 0 where they copy)."""
        return sum(b.mapped for b in self._bufs.values())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.conv, self.rec, self.k, self.v) for t in d.values())


def locate(table: torch.Tensor, slots: torch.Tensor, pos: torch.Tensor, kv_block: int):
    """(block, offset) of position pos[i] of slot slots[i] (device tensors; one gather)."""
    return table[slots, pos // kv_block], pos % kv_block


def gather_pages(pool: torch.Tensor, table: torch.Tensor, slots: torch.Tensor, S: int) -> torch.Tensor:
    """The first S positions of each slot's sequence from a paged pool [n_blocks, kv_heads, block, head_dim]:
    [len(slots), kv_heads, S, head_dim], one copy (the gather reads the pool as [n_blocks, block, kv_heads,
    head_dim], so its result's pages join into positions as a view; head_dim stays contiguous for attention)."""
    Bk = pool.shape[2]
    nb = -(-S // Bk)
    idx = table[slots, :nb]
    G, H, D = idx.shape[0], pool.shape[1], pool.shape[3]
    g = pool.transpose(1, 2).index_select(0, idx.reshape(-1))     # [G * nb, block, kv_heads, head_dim], contiguous
    return g.view(G, nb * Bk, H, D)[:, :S].transpose(1, 2)
