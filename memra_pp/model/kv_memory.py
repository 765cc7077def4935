"""What KV memory a stage's pools may take: the slack and headroom a growth must leave, how far a growth goes, and
the pages every stage may hold at once (`kv_budget`, from the stages' `StageCache.kv_report`s; the intake admits
requests against it). Pure functions, run in the driver and in stage processes."""
from __future__ import annotations

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
