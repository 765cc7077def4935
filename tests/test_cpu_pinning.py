"""memra_pp.cpu_pinning: physical cores from the topology, disjoint shares of them, every thread of a process pinned;
and the probe's pinnings (gpu_checks.pin_sets)."""
import os
import threading

import pytest

from memra_pp import cpu_pinning


def test_parse_list_reads_ranges_and_singles():
    """A kernel CPU list must read as the set of its ranges and single CPUs."""
    assert cpu_pinning._parse_list("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert cpu_pinning._parse_list("5") == {5}


def test_core_groups_cover_the_allowed_cpus_once():
    """The physical cores must cover this process's CPUs, each once; a CPU alone must be a core of its own."""
    allowed = set(os.sched_getaffinity(0))
    groups = cpu_pinning.core_groups()
    flat = [c for g in groups for c in g]
    assert sorted(flat) == sorted(allowed) and len(flat) == len(set(flat))
    assert cpu_pinning.core_groups({min(allowed)}) == [(min(allowed),)]


def test_share_splits_whole_cores_disjointly():
    """Shares must be whole cores, disjoint and as even as the cores allow, round robin where processes outnumber
    cores; an index out of range or no cores must be refused, naming both."""
    groups = [(0, 8), (1, 9), (2, 10)]
    assert cpu_pinning.share(0, 2, groups) == {0, 8, 1, 9}
    assert cpu_pinning.share(1, 2, groups) == {2, 10}
    assert [cpu_pinning.share(i, 3, groups) for i in range(3)] == [{0, 8}, {1, 9}, {2, 10}]
    # more processes than cores: round robin over whole cores
    assert [cpu_pinning.share(i, 4, groups[:2]) for i in range(4)] == [{0, 8}, {1, 9}, {0, 8}, {1, 9}]
    with pytest.raises(ValueError, match="process 2 of 2 over 3 physical cores"):
        cpu_pinning.share(2, 2, groups)
    with pytest.raises(ValueError, match="over 0 physical cores"):
        cpu_pinning.share(0, 1, [])


def test_pin_process_moves_every_thread_and_later_ones_inherit():
    """Pinning must move a thread already running as well as the caller, threads started after must inherit the mask,
    and an empty set must change nothing."""
    before = os.sched_getaffinity(0)
    one = {min(before)}
    started, stop = threading.Event(), threading.Event()
    seen = {}

    def worker():
        started.set()
        stop.wait(10)
        seen["old"] = os.sched_getaffinity(0)

    t = threading.Thread(target=worker)
    t.start()
    started.wait(10)
    try:
        assert cpu_pinning.pin_process(one) >= 2            # this thread and the worker at least
        later = {}
        t2 = threading.Thread(target=lambda: later.setdefault("cpus", os.sched_getaffinity(0)))
        t2.start()
        t2.join()
        stop.set()
        t.join()
        assert seen["old"] == one and later["cpus"] == one and os.sched_getaffinity(0) == one
    finally:
        stop.set()
        cpu_pinning.pin_process(before)
    assert os.sched_getaffinity(0) == before
    assert cpu_pinning.pin_process(set()) == 0 and os.sched_getaffinity(0) == before


def test_probe_pinnings_are_disjoint_or_refused(monkeypatch):
    """The probe's pinnings must give the two processes disjoint cores (apart) or one core's two hyperthreads
    (siblings), or be refused naming what the machine lacks; an unknown pinning must be refused naming the three."""
    assert cpu_pinning.probe_pair("none") == (None, None)
    groups = cpu_pinning.core_groups()
    if len(groups) >= 2:
        r, s = cpu_pinning.probe_pair("apart")
        assert r and s and not r & s and r | s == {c for g in groups for c in g}
    else:
        with pytest.raises(ValueError, match="two physical cores"):
            cpu_pinning.probe_pair("apart")
    if any(len(g) >= 2 for g in groups):
        r, s = cpu_pinning.probe_pair("siblings")
        assert len(r) == len(s) == 1 and r != s
    else:
        with pytest.raises(ValueError, match="two hyperthreads"):
            cpu_pinning.probe_pair("siblings")
    with pytest.raises(ValueError, match="none, apart or siblings"):
        cpu_pinning.probe_pair("near")
    # both branches on a machine with hyperthreads (this one may have none)
    monkeypatch.setattr(cpu_pinning, "core_groups", lambda allowed=None: [(0, 8), (1, 9)])
    assert cpu_pinning.probe_pair("siblings") == ({0}, {8})
    assert cpu_pinning.probe_pair("apart") == ({0, 8}, {1, 9})
