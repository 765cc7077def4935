"""What KV memory a stage's pools may take: the slack and headroom a growth must leave, how far a growth goes, and
the pages every stage may hold at once (`kv_budget`, from the stages' `StageCache.kv_report`s; the intake admits
requests against it), and what a cache allocates before its first request (`upfront`, checked against the device's
memory). Pure functions but `host_available`, run in the driver and in stage processes."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:       # (the driver imports this module without torch: a CPU placement's driver never loads it)
    import torch

    from .config import TextConfig

FIRST_FREE = 2          # the null and sink blocks come first in every pool (model/cache.py)
SLACK_BYTES = 64 << 20


def fits(need: int, free: int, keep: int = 0) -> bool:
    """Can `need` bytes be taken from `free` and leave `keep` free? With slack (5% + 64 MiB): memory the caching
    allocator holds free may be fragmented."""
    return need * 1.05 + SLACK_BYTES + keep <= free


def headroom(total: int) -> int:
    """What a growth beyond the blocks needed must leave free on a device of `total` bytes: activations and CUDA graph
    captures allocate after it (8% of the device, at least 2 GiB)."""
    return max(2 << 30, int(0.08 * total))


def growth_size(n: int, short: int, cap: int, roomy) -> int:
    """The blocks pools of n blocks grow to when `short` more are needed: at least n + short (the caller checks that
    those fit); beyond, towards doubling (at most `cap`), only as far as `roomy(blocks)` allows."""
    lo, new = n + short, min(cap, max(2 * n, n + short))
    while new > lo and not roomy(new):
        new = max(lo, (new + lo) // 2)
    return new


def reachable_blocks(n: int, cap: int, ok) -> int:
    """The most blocks (n <= it <= cap) pools of n blocks can grow to, where ok(blocks) says a growth fits (monotone:
    a larger growth never fits where a smaller one does not)."""
    if ok(cap):
        return cap
    lo, hi = n, cap
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo


def kv_budget(reports: list[dict], limit: int | None = None) -> int:
    """The pages every stage's sequences may hold at once (the intake admits requests against it, so no stage's
    pool growth is ever refused under a running microbatch): at most each stage's table, `limit`
    (scheduler.kv_pages), and per device the most pages m for which the pools of all its stages (several stages may
    share one GPU) grow to m pages plus the null and sink blocks, at the peak of the last growth step (where pools
    grow by copying, one old pool of m blocks held while its copy is made; where they grow in place, up to one
    mapping granule each beyond their pages), leaving the device's headroom free. Measured after every stage is
    loaded."""
    cap = min(r["table_pages"] for r in reports)
    cap = cap if limit is None else min(cap, limit)
    by_dev: dict[str, list[dict]] = {}
    for r in reports:
        if "page_bytes" in r:
            by_dev.setdefault(r["device"], []).append(r)
    for group in by_dev.values():
        free, keep = min(r["free"] for r in group), headroom(group[0]["total"])

        def ok(m: int, group=group, free=free, keep=keep) -> bool:
            blocks = m + FIRST_FREE
            short = [r for r in group if blocks > r["n_blocks"]]
            if not short:
                return True            # the pools hold it already
            grow = sum((blocks - r["n_blocks"]) * r["page_bytes"] + r.get("map_slack_bytes", 0) for r in short)
            return fits(grow + max(r["pool_page_bytes"] for r in short) * (blocks - 1), free, keep)
        cap = reachable_blocks(0, cap, ok)
    return cap


def upfront(cfg: TextConfig, layers: range, max_seqs: int, max_context: int, dtype, kv_block: int,
            initial_blocks_per_slot: int = 4) -> dict[str, tuple[int, tuple, torch.dtype]]:
    """The tensors a StageCache allocates up front, by part: (how many, shape, dtype). The one source of their shapes:
    the constructor allocates these. table: a row of max_blocks int64 per slot and scratch; conv, rec: a linear
    layer's states, a row per slot and scratch; kv: a full layer's K and V pools, the null and sink blocks and the
    first blocks of each slot."""
    import torch
    rows, max_blocks = max_seqs + 1, -(-max_context // kv_block)
    n_full = sum(1 for i in layers if cfg.is_full(i))
    n_lin = len(layers) - n_full
    n_blocks = FIRST_FREE + max_seqs * min(initial_blocks_per_slot, max_blocks)
    return {"table": (1, (rows, max_blocks), torch.long),
            "conv": (n_lin, (rows, cfg.conv_dim, cfg.linear_conv_kernel_dim - 1), dtype),
            "rec": (n_lin, (rows, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
                    torch.float32),
            "kv": (2 * n_full, (n_blocks, cfg.num_key_value_heads, kv_block, cfg.head_dim), dtype)}


def upfront_bytes(parts: dict, part: str | None = None) -> int:
    """Bytes of `upfront`'s tensors (of one part, or all). On a GPU a pool growing in place maps whole granules: up
    to 2 MiB more a pool, within `fits`' slack."""
    return sum(n * math.prod(shape) * dt.itemsize for p, (n, shape, dt) in parts.items() if part in (None, p))


def host_available() -> int | None:
    """The host's MemAvailable in bytes (None where /proc/meminfo does not say)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def cuda_free_total(device) -> tuple[int, int]:
    """(bytes a GPU has for a new allocation: its free memory plus what the caching allocator holds unused, in this
    process's context; its total memory)."""
    import torch
    free, total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device), total


def device_available(device) -> int | None:
    """Bytes a torch device has for a new allocation now (`cuda_free_total`), or the host's MemAvailable (None:
    unknown)."""
    import torch
    device = torch.device(device)
    return cuda_free_total(device)[0] if device.type == "cuda" else host_available()


def size_text(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n} bytes"
