"""The KV pools hold every slot at the longest length: a growth the device cannot hold must be refused with a
typed error that names the knobs, before the allocator's out-of-memory error (measured on the H200: an 8k prompt
in a max_batch 256 deployment asked for 138 GiB of KV)."""
import pytest
import torch

from memra_pp.errors import InputError
from memra_pp.model.cache import StageCache
from memra_pp.model.config import parse_config
from memra_pp.model import presets


def test_kv_growth_the_device_cannot_hold_is_refused(monkeypatch):
    t = parse_config(presets.get("qwen3.5-27b")).text
    c = StageCache(t, range(0, 8), max_seqs=64, max_context=8448, dtype=torch.bfloat16, device="cpu")
    c.reserve(300)                                   # CPU: no check, grows to 512
    assert c.kv_capacity == 512
    c.device = torch.device("cuda", 0)               # the check's arithmetic, with the device's numbers faked
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (2 * 2**30, 141 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 2 * 2**30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 1 * 2**30)
    with pytest.raises(InputError, match=r"does not fit this stage's KV cache: its pools hold every one of 64 "
                                         r"slots \(scheduler.max_batch\).* where 3.0 GiB are free; lower "
                                         r"scheduler.max_batch or scheduler.max_context"):
        c.reserve(8192)
    assert c.kv_capacity == 512                      # nothing was allocated
    c.reserve(1024)                                  # a growth that fits goes on (2 full layers x 65 slots)
    assert c.kv_capacity == 1024
    # doubling (to 2048) would not fit in 400 MB, growing only as far as asked (1152) does
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (400 * 2**20, 141 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 0)
    c.reserve(1100)
    assert c.kv_capacity == 1280                     # 1100 rounded up to the 256-position block
