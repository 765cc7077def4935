"""Per-sequence caches of one stage, in slot-indexed pools: KV for full layers, conv + fp32 state for linear.

A sequence owns one slot for its life on every stage; `lens[slot]` is its cached length on this stage. One more
slot, `scratch`, is never given to a sequence: the padding rows of a decode CUDA graph write there.
"""
from __future__ import annotations

import torch

from .config import TextConfig


class StageCache:
    def __init__(self, cfg: TextConfig, layers: range, max_seqs: int, max_context: int, dtype, device,
                 kv_block: int = 256):
        self.cfg, self.max_seqs, self.max_context = cfg, max_seqs, max_context
        self.scratch = max_seqs
        rows = max_seqs + 1
        self.dtype, self.device, self.kv_block = dtype, torch.device(device), kv_block
        K = cfg.linear_conv_kernel_dim
        nv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.conv: dict[int, torch.Tensor] = {}
        self.rec: dict[int, torch.Tensor] = {}
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        for i in layers:
            if cfg.is_full(i):
                shape = (rows, cfg.num_key_value_heads, 0, cfg.head_dim)
                self.k[i] = torch.zeros(shape, dtype=dtype, device=device)
                self.v[i] = torch.zeros(shape, dtype=dtype, device=device)
            else:
                self.conv[i] = torch.zeros(rows, cfg.conv_dim, K - 1, dtype=dtype, device=device)
                self.rec[i] = torch.zeros(rows, nv, dk, dv, dtype=torch.float32, device=device)
        self.lens = [0] * rows

    @property
    def kv_capacity(self) -> int:
        return next(iter(self.k.values())).shape[2] if self.k else self.max_context

    def reserve(self, length: int) -> None:
        """Grow every KV pool so positions < length fit: by whole blocks, at least doubling (few reallocations, each
        of which drops the decode graphs captured over the old pools), up to max_context; only as far as needed
        when doubling would not fit on the device."""
        if not self.k or length <= self.kv_capacity:
            return
        if length > self.max_context:
            raise ValueError(f"sequence length {length} exceeds max_context {self.max_context}")
        blocks = lambda n: -(-n // self.kv_block) * self.kv_block   # noqa: E731
        cap = min(self.max_context, blocks(max(length, 2 * self.kv_capacity)))
        if not self._fits(cap):
            cap = min(self.max_context, blocks(length))
            self._check_room(cap)
        for d in (self.k, self.v):
            for i, t in d.items():
                n = t.new_zeros(t.shape[0], t.shape[1], cap, t.shape[3])
                n[:, :, : t.shape[2]] = t
                d[i] = n

    def _need_free(self, cap: int) -> tuple[int, int]:
        """(bytes a growth to cap needs at its peak, bytes the device has for it). The pools are replaced one by
        one, so the peak is the growth plus one old pool."""
        t = next(iter(self.k.values()))
        row = t.shape[0] * t.shape[1] * t.shape[3] * t.element_size()
        need = 2 * len(self.k) * row * (cap - t.shape[2]) + row * t.shape[2]
        free = torch.cuda.mem_get_info(self.device)[0] + torch.cuda.memory_reserved(self.device) \
            - torch.cuda.memory_allocated(self.device)
        return need, free

    def _fits(self, cap: int) -> bool:
        if self.device.type != "cuda":
            return True
        need, free = self._need_free(cap)
        return need <= free

    def _check_room(self, cap: int) -> None:
        """The pools hold every slot at the longest length (one per slot, contiguous): refuse a growth the device
        cannot hold with a message that says so, before the allocator's out-of-memory error would."""
        if self._fits(cap):
            return
        need, free = self._need_free(cap)
        from memra_pp.errors import InputError
        raise InputError(
            f"a sequence of {cap} positions does not fit this stage's KV cache: its pools hold every one of "
            f"{next(iter(self.k.values())).shape[0] - 1} slots (scheduler.max_batch) at the longest length, "
            f"{need / 2**30:.1f} GiB more on {self.device} where {free / 2**30:.1f} GiB are free; lower "
            f"scheduler.max_batch or scheduler.max_context, or split the model over more stages")

    def reset(self, slot: int) -> None:
        """Forget a sequence: zero its linear states (a fresh prefill must start from S0 = 0)."""
        for t in self.conv.values():
            t[slot].zero_()
        for t in self.rec.values():
            t[slot].zero_()
        self.lens[slot] = 0

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for d in (self.conv, self.rec, self.k, self.v) for t in d.values())
