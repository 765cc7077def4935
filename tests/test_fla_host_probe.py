"""benchmarks/fla_host.py's kkt probe and autotune report on the CPU, fla replaced by recording stand-ins (the probe
runs only on a GPU, where device time is scarce: its plumbing is checked here): every input set and layout it
names, the layouts as it says (exact, the rule graphs' padding, chunks past the end), inputs of R rows equal in
content across the sets, the static set the rule graphs' buffers."""
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))

import fla_host  # noqa: E402
from memra_pp.model import prefill_graphs as pg  # noqa: E402
from test_rule_graphs import CFG  # noqa: E402

KKT = "chunk_gated_delta_rule_fwd_kkt_solve_kernel"


def _stand_in_profiler(monkeypatch, totals) -> None:
    """torch.profiler.profile replaced: its key_averages give each kernel of totals() (us over the profiled calls)."""
    class Profile:
        def __init__(self, activities):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def key_averages(self):
            return [types.SimpleNamespace(key=k, self_device_time_total=us) for k, us in totals().items()]
    monkeypatch.setattr(torch.profiler, "profile", Profile)


def _stand_in_fla(monkeypatch) -> list:
    """fla's intra call and cumsum, the profiler and CUDA's synchronize replaced: the calls' arguments, recorded."""
    calls = []

    def intra(k, v, g, beta, cu_seqlens=None, chunk_size=64, chunk_indices=None):
        calls.append((k, v, g, beta, cu_seqlens.tolist(), chunk_indices.tolist()))

    def cumsum(g, chunk_size, cu_seqlens=None, chunk_indices=None):
        return g.cumsum(1)
    chunk_fwd = types.ModuleType("fla.ops.gated_delta_rule.chunk_fwd")
    chunk_fwd.chunk_gated_delta_rule_fwd_intra = intra
    utils = types.ModuleType("fla.ops.utils")
    utils.chunk_local_cumsum = cumsum
    for name, mod in (("fla", types.ModuleType("fla")), ("fla.ops", types.ModuleType("fla.ops")),
                      ("fla.ops.gated_delta_rule", types.ModuleType("fla.ops.gated_delta_rule")),
                      ("fla.ops.gated_delta_rule.chunk_fwd", chunk_fwd), ("fla.ops.utils", utils)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)

    # (no CUDA activity to profile on the CPU): one kernel's total over the profiled calls
    _stand_in_profiler(monkeypatch, lambda: {KKT: 40.0, "idle": 0.0})
    return calls


def test_kkt_probe_inputs_and_layouts(monkeypatch):
    calls = _stand_in_fla(monkeypatch)
    rg = pg.RuleGraphs(None, CFG, 512, torch.float32, "cpu", capture=False)
    R, qh, HV, D = 256, 4, 4, 8
    rows = fla_host.kkt_probe(rg, qh, HV, D, "cpu", torch.Generator().manual_seed(0), R=R, iters=2)
    assert [(r["inputs"], r["layout"]) for r in rows] == [(i, lay) for i in ("fresh", "static", "sliced")
                                                          for lay in ("exact", "padded", "overrun")]
    assert len(calls) == 9 * (3 + 2)        # warm-up and profiled calls of each
    assert all(r["kernels_us"] == {KKT: 20.0} for r in rows)   # 40 us / 2 calls
    per = [calls[i * 5] for i in range(9)]
    chunks = [[0, j] for j in range(R // 64)]
    assert [c[4:] for c in per[:3]] == [([0, R], chunks), ([0, R, R], chunks + [[1, 0]] * 2),
                                        ([0, R], chunks + [[0, R // 64], [0, R // 64 + 1]])]
    fresh, static, sliced = per[0], per[3], per[6]
    for c in (fresh, static, sliced):
        assert c[0].shape == (1, R, qh, D) and c[1].shape == (1, R, HV, D) and c[3].shape == (1, R, HV)
    for j in range(4):
        assert torch.equal(fresh[j].float(), static[j].float()) and torch.equal(fresh[j].float(), sliced[j].float())
    assert static[0].data_ptr() == rg.k.data_ptr() and static[1].data_ptr() == rg.v.data_ptr()
    assert sliced[0].untyped_storage().nbytes() == 2 * fresh[0].untyped_storage().nbytes()


def test_autotuned_reports_tuned_kernels_under_wrappers(monkeypatch):
    """autotuned() finds an fla module's Autotuner under a heuristics-like wrapper and skips untuned ones."""
    from triton.runtime.autotuner import Autotuner

    class Tuned(Autotuner):
        def __init__(self, cache):
            self.cache = cache
    mod = types.ModuleType("fla.ops.fake")
    mod.kernel = types.SimpleNamespace(fn=Tuned({(16, "torch.bfloat16"): "BK: 64, num_warps: 2"}))
    mod.untuned = Tuned({})
    monkeypatch.setitem(sys.modules, "fla.ops.fake", mod)
    assert fla_host.autotuned() == {"kernel": {"(16, 'torch.bfloat16')": "BK: 64, num_warps: 2"}}


def test_kkt_grid_layouts(monkeypatch):
    """--kkt-grid: one segment's chunk programs exact, with programs past its end or in front (which return at
    once), the real ones twice, and longer real segments whose grids match those sizes."""
    calls = _stand_in_fla(monkeypatch)
    rows = fla_host.kkt_grid(4, 4, 8, "cpu", torch.Generator().manual_seed(0), n1=4, iters=2)
    real = [[0, j] for j in range(4)]
    want = [("exact", 256, real), ("1 past the end", 256, real + [[0, 4]]),
            ("2 past the end", 256, real + [[0, 4], [0, 5]]), ("2 in front", 256, [[0, 4], [0, 5]] + real),
            ("4 past the end", 256, real + [[0, j] for j in range(4, 8)]), ("the real chunks twice", 256, real * 2),
            ("exact, 5 chunks", 320, [[0, j] for j in range(5)]), ("exact, 6 chunks", 384, [[0, j] for j in range(6)]),
            ("exact, 8 chunks", 512, [[0, j] for j in range(8)])]
    assert [(r["layout"], r["rows"], r["programs"]) for r in rows] == [(w[0], w[1], len(w[2])) for w in want]
    per = [calls[i * 5] for i in range(len(want))]      # (3 warm-up and 2 profiled calls each)
    assert len(calls) == 5 * len(want)
    for (label, R, ch), c in zip(want, per):
        assert c[0].shape == (1, R, 4, 8) and c[4] == [0, R] and c[5] == ch, label
    assert all(r["kernels_us"] == {KKT: 20.0} for r in rows) and fla_host.KKT_KERNEL == KKT


def test_kkt_configs_pins_each_config_then_restores_the_tuner(monkeypatch, tmp_path):
    """--kkt-configs: every config of the kkt-solve kernel's autotuner (all of fla's, where fla_rule pinned one)
    pinned in turn over four layouts, the tuner as it was after; the plot drawn from the rows."""
    import triton
    from triton.runtime.autotuner import Autotuner

    class Tuner(Autotuner):
        def __init__(self, configs):
            self.configs, self.cache = configs, {}
    calls = _stand_in_fla(monkeypatch)
    every = [triton.Config({"BK": bk}, num_warps=w) for bk in (32, 64) for w in (1, 2, 4)]
    tuner = Tuner([every[3]])
    tuner._memra_all, tuner.cache = every, {"k": every[3]}
    seen = []
    kernel = types.SimpleNamespace(fn=tuner)
    monkeypatch.setattr(sys.modules["fla.ops.gated_delta_rule.chunk_fwd"],
                        "chunk_gated_delta_rule_fwd_kkt_solve_kernel", kernel, raising=False)
    real = fla_host.kkt_grid

    def grid(*a, **kw):
        seen.append(list(tuner.configs))
        return real(*a, **kw)
    monkeypatch.setattr(fla_host, "kkt_grid", grid)
    rows = fla_host.kkt_configs(4, 4, 8, "cpu", torch.Generator().manual_seed(0), n1=4, iters=2)
    assert seen == [[c] for c in every]
    assert [r["layout"] for r in rows[:4]] == ["exact", "2 past the end", "exact, 6 chunks", "exact, 8 chunks"]
    assert len(rows) == 24 and len(calls) == 24 * 5 and rows[0]["config"] == "BK: 32, num_warps: 1"
    assert tuner.configs == [every[3]] and tuner.cache == {"k": every[3]}
    assert Path(fla_host.plot_kkt_configs(rows, str(tmp_path / "k.png"))).stat().st_size > 10_000


def test_chunk_configs_pins_each_kernels_configs_in_turn(monkeypatch, tmp_path):
    """--chunk-configs: each tuned kernel of the chunked rule, each of its autotuner's configs pinned in turn (the
    other kernels left as tuned), timed in the variable-length call over every layout's segments; the config the
    process runs marked; a config that fails recorded, not fatal; every tuner as it was after; the summary's in-use
    and fastest sums; the plot."""
    import triton
    from triton.runtime.autotuner import Autotuner

    class Tuner(Autotuner):
        def __init__(self, configs):
            self.configs, self.cache = configs, {}
    names = [name for _, name in fla_host.CHUNK_KERNELS]
    tuners = {}
    for mod, name in fla_host.CHUNK_KERNELS:
        every = [triton.Config({"BV": bv}, num_warps=w, num_stages=3) for bv in (32, 64) for w in (2, 4)]
        t = tuners[name] = Tuner(list(every))
        t.cache = {"key": every[1]}         # the warm-up's pick: BV 32, 4 warps
        m = types.ModuleType(mod)
        setattr(m, name, types.SimpleNamespace(fn=t))
        monkeypatch.setitem(sys.modules, mod, m)
    for parent in ("fla", "fla.ops", "fla.ops.gated_delta_rule", "fla.ops.common"):
        monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    calls = []

    class Pick:     # the rule's chunk_h grid pick: BV 32, 2 warps for one segment, BV 64, 2 warps for more
        tuner = tuners[names[2]]
        every = list(tuner.configs)

        def choose(self, segments, heads, dv, device):
            assert (heads, dv, device) == (4, 8, "cpu")
            return self.every[0 if segments == 1 else 2]

    class Rule:
        _chunk_h = Pick()

        def chunk_varlen(self, q, k, v, g, beta, state, cu, chunks):
            for t in tuners.values():     # (Triton's: the config a call ran)
                t.best_config = t.configs[0] if len(t.configs) == 1 else t.cache["key"]
            if all(len(t.configs) > 1 for n, t in tuners.items() if n != names[3]):
                return      # (the call before the sweep)
            assert self._chunk_h is None        # (the grid pick off while the probe pins configs)
            # one kernel pinned at a time, the others as tuned (the last as fla_rule pinned it)
            swept = [n for n, t in tuners.items() if len(t.configs) == 1 and n != names[3]] or [names[3]]
            [name] = swept
            [cfg] = tuners[name].configs
            if name == names[2] and cfg.kwargs["BV"] == 64 and cfg.num_warps == 4:
                raise RuntimeError("out of resources: shared memory")
            calls.append((name, cfg.kwargs["BV"], cfg.num_warps, tuple(q.shape), cu.tolist(), chunks.tolist(),
                          tuple(state.shape)))

    def totals():       # the pinned kernel takes BV + 10 x warps us a call (the others 1)
        got = {}
        for n, t in tuners.items():
            c = t.configs[0] if len(t.configs) == 1 else None
            got[n] = (c.kwargs["BV"] + 10 * c.num_warps if c is not None else 1) * 2.0
        return got
    _stand_in_profiler(monkeypatch, totals)
    layouts = fla_host.chunk_layouts("1x128,2x64")
    assert layouts == [("1x128", [128]), ("2x64", [64, 64])]
    last = tuners[names[3]]         # pinned as fla_rule pins: cut to one config, run but not cached
    last._memra_all, last.configs, last.cache = list(last.configs), [last.configs[2]], {}
    rule = Rule()
    rows = fla_host.chunk_configs(rule, 4, 4, 8, "cpu", torch.Generator().manual_seed(0), layouts, iters=2)
    assert len(rows) == 4 * 4 * 2 and isinstance(rule._chunk_h, Pick)
    h = [(r["config"], r["layout"]) for r in rows if r["kernel"] == names[2] and r["in_use"]]
    assert h == [("BV 32, 2 warps, 3 stages", "1x128"), ("BV 64, 2 warps, 3 stages", "2x64")]
    assert [r["config"] for r in rows if r["kernel"] == names[3] and r["in_use"]] == ["BV 64, 2 warps, 3 stages"] * 2
    assert [r["kernel"] for r in rows[::8]] == names
    assert rows[0]["config"] == "BV 32, 2 warps, 3 stages" and rows[0]["us"] == 52.0
    assert [r["in_use"] for r in rows[:8]] == [False, False, True, True, False, False, False, False]
    failed = [r for r in rows if r["us"] is None]
    assert [(r["kernel"], r["config"]) for r in failed] == [(names[2], "BV 64, 4 warps, 3 stages")] * 2
    assert "shared memory" in failed[0]["error"]
    first = [c for c in calls if c[0] == names[0] and c[1] == 32 and c[2] == 2]
    assert len(first) == 2 * 5         # 3 warm-up and 2 profiled calls a layout
    assert {(c[3], tuple(map(tuple, c[5])), tuple(c[4])) for c in first} == {
        ((1, 128, 4, 8), ((0, 0), (0, 1)), (0, 128)), ((1, 128, 4, 8), ((0, 0), (1, 0)), (0, 64, 128))}
    assert all(len(t.configs) == 4 and list(t.cache) == ["key"] for t in list(tuners.values())[:3])
    assert len(tuners[names[3]].configs) == 1 and tuners[names[3]].cache == {}
    lines = fla_host.chunk_config_summary(rows)
    assert lines[0].startswith(names[0]) and "in use    72.00 us (BV 32, 4 warps, 3 stages)" in lines[0]
    assert "fastest    52.00 us (BV 32, 2 warps, 3 stages)" in lines[0]
    assert lines[-1].endswith("in use   312.00 us a layer, each at its fastest   208.00 us (1.50x)")
    assert Path(fla_host.plot_chunk_configs(rows, str(tmp_path / "c.png"), "test")).stat().st_size > 10_000
