"""Which CPUs a process runs on: the physical cores it may use, and pinning every thread of it to a set of them.

Two processes that hand a boundary off spin on shared memory (stages/mailbox.py's receiver polls for up to its
spin time). Where the scheduler puts the spinner on the hyperthread sibling of the sender's core, every instruction
of the sender's send path runs at about half speed. Pinning neighbouring processes to different physical cores is
the remedy measured by `memra_pp.gpu_checks --pin` (docs/PERF.md). Linux only; elsewhere nothing is pinned.
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
    sched_setaffinity(0) moves only the calling thread, so each task of /proc/self/task is moved by its id."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        return 0
    tids = [int(t) for t in os.listdir("/proc/self/task")] if os.path.isdir("/proc/self/task") else [0]
    done = 0
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
            done += 1
        except (ProcessLookupError, PermissionError):    # a thread that ended meanwhile
            pass
    return done
