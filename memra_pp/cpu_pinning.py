"""Which CPUs a process runs on: the physical cores it may use, disjoint shares of them, every thread of a process
pinned to one. Used by the boundary probe (`memra_pp.gpu_checks --pin`) to ask whether a receiver polling its
mailbox slows the sender beside it; the runtime does not pin (docs/PERF.md, fifteenth session). Linux only.
"""
from __future__ import annotations

import os


def core_groups(allowed: set[int] | None = None) -> list[tuple[int, ...]]:
    """The physical cores among `allowed` (default: this process's affinity), each as the sorted tuple of its
    logical CPUs (hyperthread siblings), in order of their first CPU. A CPU whose topology cannot be read is a core
    of its own."""
    if allowed is None:
        allowed = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))
    groups: dict[tuple[int, ...], None] = {}
    for cpu in sorted(allowed):
        try:
            with open(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list") as f:
                sib = _parse_list(f.read())
        except OSError:
            sib = {cpu}
        groups.setdefault(tuple(sorted((sib & allowed) | {cpu})), None)
    return list(groups)


def _parse_list(text: str) -> set[int]:
    """A kernel CPU list ("0-3,8,10-11") as a set."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def share(index: int, count: int, groups: list[tuple[int, ...]] | None = None) -> set[int]:
    """The CPUs of process `index` of `count` that split the physical cores between them: whole cores, disjoint,
    as even as the cores allow (with fewer cores than processes, processes share cores round robin)."""
    groups = core_groups() if groups is None else groups
    if not 0 <= index < count or not groups:
        raise ValueError(f"process {index} of {count} over {len(groups)} physical cores")
    if len(groups) < count:
        return set(groups[index % len(groups)])
    per, extra = divmod(len(groups), count)
    start = index * per + min(index, extra)
    return {c for g in groups[start:start + per + (index < extra)] for c in g}


def pin_process(cpus: set[int]) -> int:
    """Every thread of this process on `cpus` (threads started later inherit it); the number of threads pinned.
    sched_setaffinity(0) moves only the calling thread, so each task of /proc/self/task is moved by its id. A thread
    started by a not yet pinned thread between the listing and the loop keeps the old mask: call this before
    starting threads of one's own."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return 0
    tids = [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]
    done = 0
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
            done += 1
        except ProcessLookupError:      # the thread ended after the listing
            pass
    return done


def probe_pair(pin: str) -> tuple[set | None, set | None]:
    """(receiver's CPUs, sender's CPUs) for a two-process probe: none (the scheduler's choice), apart (disjoint
    physical cores, half each), siblings (the two hyperthreads of one core: the case pinning would avoid)."""
    if pin == "none":
        return None, None
    groups = core_groups()
    if pin == "apart":
        if len(groups) < 2:
            raise ValueError(f"pin apart needs two physical cores; this process may use {groups}")
        return share(0, 2, groups), share(1, 2, groups)
    if pin == "siblings":
        core = next((g for g in groups if len(g) >= 2), None)
        if core is None:
            raise ValueError(f"pin siblings needs a core with two hyperthreads; this process may use {groups}")
        return {core[0]}, {core[1]}
    raise ValueError(f"pin {pin!r}: none, apart or siblings")
