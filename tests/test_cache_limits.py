"""Scheduler settings whose stage cache cannot fit are refused up front: StageCache sizes its up-front tensors
(`upfront`) before allocating any, refuses with a one-line ConfigError naming scheduler.max_batch and
scheduler.max_context, the bytes and what the device has, and turns an allocation failure into the same error."""
import math

import pytest
import torch

from memra_pp.errors import ConfigError
from memra_pp.model import cache as cache_mod
from memra_pp.model import presets
from memra_pp.model.cache import StageCache, upfront, upfront_bytes
from memra_pp.model.config import parse_config
from memra_pp.model.kv_memory import fits

TEXT = parse_config(presets.get("qwen3.5-27b")).text
LAYERS = range(2, 5)        # linear, full, linear
HUGE = dict(max_seqs=65536, max_context=2 ** 24)
GiB = 2 ** 30


def make(max_seqs=3, max_context=1000, **kw):
    return StageCache(TEXT, LAYERS, max_seqs=max_seqs, max_context=max_context, dtype=torch.bfloat16, device="cpu",
                      kv_block=64, **kw)


def parts_of(max_seqs=3, max_context=1000, initial_blocks_per_slot=4):
    return upfront(TEXT, LAYERS, max_seqs, max_context, torch.bfloat16, 64, initial_blocks_per_slot)


@pytest.mark.parametrize("max_seqs, max_context, initial", [(3, 1000, 4), (1, 64, 4), (5, 100, 1), (0, 4096, 2)])
def test_upfront_bytes_must_equal_what_a_cache_allocates(max_seqs, max_context, initial):
    c = make(max_seqs, max_context, initial_blocks_per_slot=initial)
    parts = parts_of(max_seqs, max_context, initial)
    got = {"table": [c.table], "conv": list(c.conv.values()), "rec": list(c.rec.values()),
           "kv": [*c.k.values(), *c.v.values()]}
    for p, ts in got.items():
        n, shape, dtype = parts[p]
        assert len(ts) == n and all(t.shape == shape and t.dtype == dtype for t in ts), p
        assert upfront_bytes(parts, p) == sum(t.numel() * t.element_size() for t in ts), p
    assert upfront_bytes(parts) == c.nbytes() + c.table.numel() * c.table.element_size()
    assert len(got["conv"]) == 2 and len(got["kv"]) == 2


def test_huge_settings_must_be_refused_in_one_line_before_anything_is_allocated(monkeypatch):
    monkeypatch.setattr(cache_mod, "host_available", lambda: 4 * GiB)

    def no_alloc(*a, **k):
        raise AssertionError("the cache allocated before refusing")
    monkeypatch.setattr(torch, "zeros", no_alloc)
    with pytest.raises(ConfigError) as ei:
        make(**HUGE)
    msg = str(ei.value)
    parts = parts_of(**HUGE)
    need = upfront_bytes(parts)
    assert "\n" not in msg and isinstance(ei.value, ValueError)
    assert msg.startswith("scheduler.max_batch 65536 x scheduler.max_context 16777216: the cache of layers [2, 5) "
                          f"needs {need / GiB:.1f} GiB up front (block table 128.0 GiB, "), msg
    assert "on cpu, which has 4.0 GiB available (MemAvailable); lower scheduler.max_batch (at most " in msg
    assert msg.endswith(" fit at this max_context) or scheduler.max_context"), msg
    most = int(msg.split("(at most ")[1].split()[0])

    def need_for(m):
        return upfront_bytes(parts_of(m, HUGE["max_context"]))
    assert fits(need_for(most), 4 * GiB) and not fits(need_for(most + 1), 4 * GiB)


def test_settings_that_fit_must_still_be_built(monkeypatch):
    enough = math.ceil(upfront_bytes(parts_of()) * 1.05) + (64 << 20)      # kv_memory.fits' slack
    monkeypatch.setattr(cache_mod, "host_available", lambda: enough)
    assert make().table.shape == (4, 16)
    monkeypatch.setattr(cache_mod, "host_available", lambda: None)     # unknown: no check, built
    assert make().table.shape == (4, 16)
    monkeypatch.setattr(cache_mod, "host_available", lambda: enough - 1)
    with pytest.raises(ConfigError, match=r"\(block table 512 bytes, conv states .* which has 93\.\d MiB available "
                                          r"\(MemAvailable\); lower scheduler.max_batch \(at most 2 fit at this "
                                          r"max_context\) or scheduler.max_context$"):
        make()


@pytest.mark.parametrize("error", [
    RuntimeError("[enforce fail at alloc_cpu.cpp:127] data. DefaultCPUAllocator: not enough memory: you tried to "
                 "allocate 137441050624 bytes."),
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 128.00 GiB."),
])
def test_an_allocation_failure_must_become_the_same_config_error(monkeypatch, error):
    monkeypatch.setattr(cache_mod, "host_available", lambda: 1 << 50)     # the check passes
    real = torch.zeros

    def fail_on_table(*a, dtype=None, **k):
        if dtype == torch.long:
            raise error
        return real(*a, dtype=dtype, **k)
    monkeypatch.setattr(torch, "zeros", fail_on_table)
    with pytest.raises(ConfigError) as ei:
        make(max_seqs=8, max_context=2 ** 20)
    msg = str(ei.value)
    assert ei.value.__cause__ is error and "\n" not in msg
    assert msg.startswith("scheduler.max_batch 8 x scheduler.max_context 1048576: the cache of layers [2, 5) needs ")
    assert ("on cpu, which ran out of memory with 1048576.0 GiB available (MemAvailable); lower scheduler.max_batch "
            "or scheduler.max_context") in msg


def test_other_runtime_errors_must_pass_through(monkeypatch):
    def broken(*a, **k):
        raise RuntimeError("some other failure")
    monkeypatch.setattr(torch, "zeros", broken)
    with pytest.raises(RuntimeError, match="^some other failure$"):
        make()
