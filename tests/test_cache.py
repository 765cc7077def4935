"""The paged KV cache: sequences take pages as they grow and give them back when their slot is reset, so memory
follows the tokens cached, not max_batch x the longest sequence (measured on the H200 before paging: an 8k prompt
in a max_batch 256 deployment asked for 138 GiB of KV); the pools grow only when no page is free, and a growth the
device cannot hold is refused with a typed error that names the knobs, before the allocator's out-of-memory error."""
import pytest
import torch

from memra_pp.errors import InputError
from memra_pp.model import presets
from memra_pp.model.cache import StageCache
from memra_pp.model.kv_memory import fits, growth_size, headroom
from memra_pp.model.config import parse_config


def cache(max_seqs=4, max_context=8448):
    t = parse_config(presets.get("qwen3.5-27b")).text
    return StageCache(t, range(0, 8), max_seqs=max_seqs, max_context=max_context, dtype=torch.bfloat16,
                      device="cpu", kv_block=64, initial_blocks_per_slot=2)


def test_pages_follow_the_tokens_and_come_back():
    c = cache()
    assert c.n_blocks == 10 and len(c.free_blocks) == 8 and c.table.shape == (5, 132)   # null, sink, 2 per slot
    assert c.table[c.scratch].eq(1).all() and c.table[:4].eq(0).all() and min(c.free_blocks) == 2
    c.reserve([0, 1], [100, 64])                     # 2 pages, 1 page
    assert [len(o) for o in c.owned] == [2, 1, 0, 0, 0]
    assert c.table[0, :2].tolist() == c.owned[0] and c.table[0, 2:].eq(0).all() and min(c.owned[0]) >= 2
    c.reserve([0], [128])                            # still within its 2 pages: nothing taken
    assert len(c.owned[0]) == 2 and len(c.free_blocks) == 5
    c.reserve([2], [8192])                           # one long sequence: 128 pages, the pools grow once
    assert c.grown == 1 and len(c.owned[2]) == 128 and c.n_blocks == 10 + 128 - 5
    blocks = set(c.owned[2])
    c.reset([2])                                       # its pages come back for the others
    assert not c.owned[2] and blocks <= set(c.free_blocks)
    c.reserve([3], [8192])
    assert c.grown == 1 and set(c.owned[3]) <= blocks   # served from the returned pages, no reallocation
    # a page holds positions [64 j, 64 j + 64) of its sequence
    blk, off = c.locate(torch.tensor([3, 3]), torch.tensor([0, 130]))
    assert blk.tolist() == [c.owned[3][0], c.owned[3][2]] and off.tolist() == [0, 2]
    with pytest.raises(ValueError, match="exceeds max_context"):
        c.reserve([0], [9000])


def test_a_reset_zeroes_the_new_sequences_linear_states_in_one_fill_a_pool():
    """reset: the new sequences' conv and recurrent states are zero (a fresh prefill starts from S0 = 0), the other
    slots' untouched; several slots take one fill a state pool (slot by slot, a step of 8 new prompts was 16
    launches in every Gated DeltaNet layer), one slot a plain zero_."""
    from collections import Counter

    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))
    c = cache()
    pools = [*c.conv.values(), *c.rec.values()]
    assert len(pools) == 12                            # layers 0-7 of the 27B: 6 Gated DeltaNet layers
    for t in pools:
        t.fill_(1)
    with Ops() as ops:
        c.reset([0, 2])
    assert ops.n["index_fill_"] == len(pools) and ops.n["zero_"] == 0, ops.n
    for t in pools:
        assert t[[0, 2]].eq(0).all() and t[[1, 3]].eq(1).all() and t[c.scratch].eq(1).all()
    with Ops() as ops:
        c.reset([3])
        c.reset([])
    assert ops.n["zero_"] == len(pools) and ops.n["index_fill_"] == 0, ops.n
    for t in pools:
        assert t[3].eq(0).all() and t[1].eq(1).all()


def test_pages_are_a_power_of_two():
    """The decode attention kernel's tiles (powers of two) must divide a page."""
    t = parse_config(presets.get("qwen3.5-27b")).text
    with pytest.raises(AssertionError, match="kv_block 48 is not a power of two"):
        StageCache(t, range(0, 4), max_seqs=2, max_context=512, dtype=torch.bfloat16, device="cpu", kv_block=48)


def test_a_growth_the_device_cannot_hold_is_refused(monkeypatch):
    c = cache()                                      # 2 full layers: 4 pools of 128 KiB pages
    c.device = torch.device("cuda", 0)               # the check's arithmetic, with the device's numbers faked
    monkeypatch.setattr(c, "_write_rows", lambda slots: None)   # (the table copy itself: the test above)
    free = {"b": 96 * 2**20}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda d: (free["b"], 141 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda d: 0)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d: 0)
    with pytest.raises(InputError, match=r"the KV cache cannot grow to 130 blocks of 64 positions: 0.1 GiB more "
                                         r"on cuda:0 where 0.1 GiB are free .* lower scheduler.max_batch or "
                                         r"scheduler.max_context"):
        c.reserve([0], [8192])                        # 120 more pages x 4 pools x 128 KiB = 60 MiB (+ slack)
    assert c.n_blocks == 10 and not c.owned[0]       # nothing was taken
    c.reserve([0], [64 * 20])                        # 12 more pages: 7 MiB (+ 5% + 64 MiB slack), fits
    assert c.n_blocks == 22
    free["b"] = 80 * 2**20
    c.reserve([1], [64 * 4])                         # none free: the 4 needed fit; doubling to 44 would too (13.8
    assert c.n_blocks == 26 and c.grown == 2         # MiB + slack) but leave less than the headroom: only 4
    free["b"] = headroom(141 * 2**30) + 96 * 2**20
    c.reserve([2], [64])                             # with the headroom left free: doubling (16.3 MiB + slack)
    assert c.n_blocks == 52 and c.grown == 3


def test_growth_sizing():
    """The blocks needed are the floor; beyond them a growth reaches for doubling (at most every slot at
    max_context) only as far as leaves room; the room rule keeps 5% + 64 MiB of slack and, for growth beyond what
    is needed, 8% of the device (at least 2 GiB) for activations and graph captures."""
    assert growth_size(21, 4, 1000, lambda m: True) == 42
    assert growth_size(21, 4, 30, lambda m: True) == 30               # capped
    assert growth_size(21, 30, 1000, lambda m: True) == 51            # more than doubling needed
    assert growth_size(21, 4, 1000, lambda m: m <= 30) == 29          # halving the distance to the floor: 42, 33, 29
    assert growth_size(21, 4, 1000, lambda m: False) == 25            # the floor (the caller checks that it fits)
    GiB = 2**30
    assert headroom(141 * GiB) == int(0.08 * 141 * GiB) and headroom(16 * GiB) == 2 * GiB
    assert fits(GiB, GiB * 105 // 100 + 1 + (64 << 20)) and not fits(GiB, GiB * 105 // 100 + (63 << 20))
    assert fits(GiB, 4 * GiB, keep=2 * GiB) and not fits(GiB, 3 * GiB, keep=2 * GiB)


def test_an_interrupted_growth_leaves_every_pool_usable(oom_on_new_zeros):
    """Pools are replaced one by one: if the device runs out midway, the pools that grew keep their pages, the
    cache counts only the pages every pool has, and the next growth completes the others (never re-copies)."""
    c = cache()
    oom_on_new_zeros()
    with pytest.raises(InputError, match=r"could not grow to 20 blocks of 64 positions on cpu \(out of memory\)"):
        c.reserve([0], [64 * 10])
    sizes = sorted(t.shape[0] for d in (c.k, c.v) for t in d.values())
    assert sizes == [10, 10, 10, 20] and c.n_blocks == 10 and not c.owned[0]
    c.reserve([0], [64 * 10])                        # completes the growth
    assert all(t.shape[0] == 20 for d in (c.k, c.v) for t in d.values()) and c.n_blocks == 20
    assert len(c.owned[0]) == 10 and len(set(c.owned[0])) == 10 and min(c.owned[0]) >= 2



def test_growth_counts_only_the_pools_that_grow(oom_on_new_zeros):
    """After an interrupted growth the pools differ in size: the next growth's peak must count each pool smaller than
    the target (its growth) plus the largest old one held while it is copied, not the first pool's size for all."""
    c = cache()
    oom_on_new_zeros()
    with pytest.raises(InputError, match=r"could not grow to 20 blocks of 64 positions on cpu \(out of memory\)"):
        c.reserve([0], [64 * 10])
    big = c.n_blocks * 2
    blk = 4 * 64 * 256 * 2                           # one page of one pool: 4 kv heads x 64 x 256 x bf16
    sizes = [t.shape[0] for d in (c.k, c.v) for t in d.values()]
    assert sorted(sizes) == [c.n_blocks] * 3 + [big] and sizes[0] == big    # the first pool grew, the rest did not
    assert c._peak_bytes(big) == 3 * (big - c.n_blocks) * blk + c.n_blocks * blk
    assert c._peak_bytes(c.n_blocks) == 0


def test_a_release_frees_before_the_step_reuses_the_slot():
    """A step's `release` must give the finished sequences' pages back before its own resets and reservations: a
    released slot admitted again at start 0 in the same step (a new sequence) must compute exactly what it would in
    a fresh cache, a released slot that is not in the step must hold nothing after it."""
    from conftest_models import tiny_checkpoint
    from memra_pp.model.local import LocalPipeline
    from memra_pp.model.batch import StepBatch
    from memra_pp.model.weights import SafetensorsSource
    _, path = tiny_checkpoint("dense", False)
    src = SafetensorsSource(path)
    used, fresh = (LocalPipeline(src, [(0, 4), (4, 8)], max_seqs=2, max_context=512) for _ in range(2))

    def prefill(p, slot, ids, release=()):
        b = StepBatch([slot], [0], [len(ids)], StepBatch.text_positions([0], [len(ids)]), [True],
                      release=list(release))
        return p.step(b, torch.tensor(ids))
    prefill(used, 0, list(range(1, 131)))            # 3 pages
    prefill(used, 1, [4, 5])                         # 1 page
    assert [len(o) for o in used.caches[0].owned] == [3, 1, 0]
    out = prefill(used, 0, [7, 8, 9], release=[0, 1])
    assert torch.allclose(out, prefill(fresh, 0, [7, 8, 9]), atol=1e-5)
    for c in used.caches:
        assert [len(o) for o in c.owned] == [1, 0, 0] and c.lens[:2] == [3, 0]
        assert len(c.free_blocks) == c.n_blocks - 2 - 1


def test_reachable_blocks_is_the_largest_growth_that_fits():
    from memra_pp.model.kv_memory import reachable_blocks
    assert reachable_blocks(10, 100, lambda m: True) == 100
    assert reachable_blocks(10, 100, lambda m: m <= 37) == 37
    assert reachable_blocks(10, 100, lambda m: m <= 10) == 10     # nothing beyond what exists


def test_page_capacity_on_cpu_is_the_table_unless_lowered():
    c = cache(max_seqs=3, max_context=256)
    assert c.page_capacity() == 3 * 4 and c.page_capacity(5) == 5 and c.page_capacity(100) == 12


def test_gather_pages_reads_each_position_from_its_page():
    """gather_pages must return, for every slot and position s < S, the row table[slot, s // block] holds at offset
    s % block (head_dim contiguous, one copy), for S inside a page, on a page boundary and across pages."""
    from memra_pp.model.cache import gather_pages
    g = torch.Generator().manual_seed(0)
    pool = torch.randn(20, 4, 8, 16, generator=g)            # [n_blocks, kv_heads, block, head_dim]
    table = torch.randint(0, 20, (5, 6), generator=g)
    slots = torch.tensor([3, 0, 4])
    for S in (1, 8, 13, 48):
        out = gather_pages(pool, table, slots, S)
        want = torch.stack([torch.stack([pool[table[sl, s // 8], :, s % 8] for s in range(S)], 1) for sl in slots])
        assert out.shape == (3, 4, S, 16) and out.stride(-1) == 1 and torch.equal(out, want), S


@pytest.mark.parametrize("in_place", [False, True], ids=["copy", "in-place"])
@pytest.mark.parametrize("n_full", [1, 4, 16])
def test_kv_budget_pages_are_never_refused_by_a_growth(n_full, in_place):
    """Every page kv_budget admits must be obtainable by the real growth path (doubling steps; a copying one holds
    one old pool while it is copied, one in place maps only the new pages) on a simulated GPU (meta tensors, free
    memory falling as the pools grow), whatever the number of full layers on the stage; and two stages sharing the
    device get no more between them than it holds. In place must admit more pages than copying."""
    import types
    from memra_pp.model.kv_memory import kv_budget
    t = parse_config(presets.get("qwen3.5-27b")).text
    full = [i for i in range(t.num_hidden_layers) if t.is_full(i)]
    GiB, total, free0 = 1 << 30, 20 << 30, 7 << 30

    def sim():
        c = StageCache(t, range(0, full[n_full - 1] + 1), max_seqs=64, max_context=32768, dtype=torch.bfloat16,
                       device="meta", kv_block=64, initial_blocks_per_slot=1)
        c.device = types.SimpleNamespace(type="cuda")
        c._write_rows = lambda slots: None
        if in_place:    # GrowableBuffer's mapping simulated: the pool keeps its pages, a larger view over them,
            c.copy_growth = None        # and maps whole granules of 2 MiB (the H200's)
            c._bufs = {(n, i): types.SimpleNamespace(grow=lambda nbytes: None, granularity=2 << 20)
                       for n in "kv" for i in c.k}
            c._view = lambda buf, shape: torch.zeros(shape, dtype=torch.bfloat16, device="meta")
            base = c.nbytes()
            c._free_bytes = lambda: (free0 - (c.nbytes() - base) - len(c._bufs) * (2 << 20), total)
            return c
        base = c.nbytes()
        c._free_bytes = lambda: (free0 - (c.nbytes() - base), total)
        return c
    c = sim()
    pages = c.page_capacity()
    assert 0 < pages < 64 * 512
    for used in range(pages):            # decode-like: one page at a time, slots in turn
        s = used % 64
        c.reserve([s], [(len(c.owned[s]) + 1) * 64])
    assert c.grown > 0
    a, b = sim().kv_report(), sim().kv_report()
    shared = kv_budget([a, b])
    assert shared < pages and 2 * (shared + 2 - a["n_blocks"]) * a["page_bytes"] <= free0 - 2 * GiB
    assert kv_budget([dict(a, device="cuda:1"), b]) == pages          # on two devices each has its own
    assert (a["pool_page_bytes"] == 0) == in_place
    assert a["map_slack_bytes"] == (2 * n_full * (2 << 20) if in_place else 0)
    if in_place:        # a copying growth's old pool would cost more than the granules
        assert pages > kv_budget([dict(a, pool_page_bytes=a["page_bytes"] // (2 * n_full), map_slack_bytes=0)])


def test_pools_that_cannot_be_mapped_grow_by_copying(monkeypatch):
    """Where mapping a pool fails (the driver refuses the address range: every slot at max_context is reserved), the
    cache drops the pools it mapped and makes every pool a plain tensor that grows by copying, saying why."""
    from memra_pp.cuda import CudaError
    calls = []

    def mapped(self, key, shape):
        calls.append(key)
        if len(calls) == 3:
            raise CudaError("cuMemAddressReserve(68719476736) failed: CUDA_ERROR_OUT_OF_MEMORY")
        self._bufs[key] = object()
        return torch.zeros(shape, dtype=self.dtype, device=self.device)
    monkeypatch.setattr(StageCache, "_copy_growth_reason", lambda self, has_kv: None)
    monkeypatch.setattr(StageCache, "_mapped_pool", mapped)
    c = cache(max_seqs=2, max_context=512)
    assert len(calls) == 3 and not c._bufs
    assert c.copy_growth == ("the KV pools could not be mapped (cuMemAddressReserve(68719476736) failed: "
                             "CUDA_ERROR_OUT_OF_MEMORY)")
    assert sorted(c.k) == sorted(c.v) and len(c.k) == 2 and all(t.shape[0] == c.n_blocks for t in c.k.values())
    c.reserve([0], [512])                               # grows, by copying
    assert c.grown == 1 and c.generation > 0
