"""fla_rule's tuning guards, on CPU: a kernel tuned once keeps its first winner for every later key, and
tuned_keys() counts the keys fla's autotuners hold (tests/test_gpu_fla.py runs fla itself)."""
import functools
import sys
import types

from triton.runtime.autotuner import Autotuner

from memra_pp.model import fla_rule


class _Tuner(Autotuner):
    """An autotuner without a kernel: run() tunes a new key by taking the config the key names."""

    def __init__(self, configs):       # noqa: D107 (Autotuner's own __init__ needs a JIT function)
        self.configs, self.cache, self.runs = list(configs), {}, 0

    def run(self, key):
        self.runs += 1
        if len(self.configs) > 1 and key not in self.cache:
            self.cache[key] = self.configs[key % len(self.configs)]
        return self.cache.get(key, self.configs[0])


def every_h() -> list:
    """fla 0.6's 12 chunk_h configs (BV, warps, stages), as on a Hopper GPU."""
    import triton
    return [triton.Config({"BV": bv}, num_warps=w, num_stages=s) for w in (2, 4) for s in (2, 3, 4) for bv in (32, 64)]


def named(c) -> tuple:
    return c.kwargs["BV"], c.num_warps, c.num_stages


def fake_fla(monkeypatch, chunk_h, calls: list):
    """An fla stand-in in sys.modules with chunk_h's autotuner `chunk_h`: its chunk call records (segments, a
    variable-length call?, q heads, chunk_h's configs) in `calls`. Returns chunk_h's module."""
    def chunk(q, k, v, **kw):
        cu = kw.get("cu_seqlens")
        calls.append((v.shape[0] if cu is None else cu.shape[0] - 1, cu is not None, q.shape[-2],
                      tuple(chunk_h.configs)))
        return v, kw["initial_state"]

    def recurrent(q, k, v, **kw):
        return v, kw["initial_state"]
    mods = {n: types.ModuleType(n) for n in ("fla", "fla.ops", "fla.ops.gated_delta_rule", "fla.ops.utils",
                                             "fla.ops.utils.cumsum", "fla.ops.common", "fla.ops.common.chunk_delta_h")}
    mods["fla.ops.gated_delta_rule"].chunk_gated_delta_rule = chunk
    mods["fla.ops.gated_delta_rule"].fused_recurrent_gated_delta_rule = recurrent
    mods["fla.ops.utils"].cumsum = mods["fla.ops.utils.cumsum"]
    mods["fla.ops.utils.cumsum"].chunk_local_cumsum_scalar_kernel = _Tuner(["a"])
    mods["fla.ops.common.chunk_delta_h"].chunk_gated_delta_rule_fwd_kernel_h_blockdim64 = \
        types.SimpleNamespace(fn=chunk_h)
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name)
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    return mods["fla.ops.common.chunk_delta_h"]


def test_tune_once_keeps_the_first_winner_and_counts_keys(monkeypatch):
    tuner = _Tuner(["a", "b", "c"])
    wrapped = types.SimpleNamespace(fn=tuner)          # as a heuristics wrapper holds its autotuner
    mod = types.ModuleType("fla.fake_kernels")
    mod.kernel = wrapped
    monkeypatch.setitem(sys.modules, "fla.fake_kernels", mod)
    before = fla_rule.tuned_keys()          # fla's own tuners, where fla is installed
    fla_rule._tune_once(wrapped)
    fla_rule._tune_once(wrapped)                      # idempotent: one wrapper
    assert tuner.run(1) == "b" and tuner.configs == ["b"]
    assert tuner.run(2) == "b" and tuner.run(0) == "b"     # new keys: the first winner, nothing tuned
    assert tuner.runs == 3 and fla_rule.tuned_keys() == before + 1


def test_available_tells_absent_from_broken(monkeypatch, tmp_path, caplog):
    """fla absent: False, silently (the torch/Triton forms serve). fla installed but failing to import: False,
    with the reason in a warning and in WHY_NOT (a stage's gdn_backend then says it), never swallowed."""
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(fla_rule, "WHY_NOT", None)
    monkeypatch.setattr(fla_rule, "_probe", fla_rule._probe.__wrapped__)     # the uncached probe, each call
    monkeypatch.setattr(sys, "path", [str(tmp_path / "none")] + [p for p in sys.path if "site-packages" not in p])
    with caplog.at_level("WARNING", logger=fla_rule.__name__):
        assert fla_rule.available() is False
    assert fla_rule.WHY_NOT is None and not caplog.records, "absent fla is not an error"
    pkg = tmp_path / "broken" / "fla" / "ops"
    pkg.mkdir(parents=True)
    (pkg.parent / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "gated_delta_rule.py").write_text("raise RuntimeError('built for triton 9.9')\n")
    monkeypatch.setattr(sys, "path", [str(tmp_path / "broken")] + sys.path)
    with caplog.at_level("WARNING", logger=fla_rule.__name__):
        assert fla_rule.available() is False
    assert fla_rule.WHY_NOT == "RuntimeError: built for triton 9.9"
    assert "installed but cannot be used (RuntimeError: built for triton 9.9)" in caplog.text
    # an fla too old to have fla.ops.gated_delta_rule is installed, not absent: said too
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name)
    (pkg / "gated_delta_rule.py").unlink()
    caplog.clear()
    with caplog.at_level("WARNING", logger=fla_rule.__name__):
        assert fla_rule.available() is False
    assert fla_rule.WHY_NOT.startswith("ModuleNotFoundError: No module named 'fla.ops.gated_delta_rule'")
    assert "installed but cannot be used" in caplog.text
    # cached in a process: the warning is said once
    monkeypatch.setattr(fla_rule, "_probe", functools.cache(fla_rule._probe))
    caplog.clear()
    with caplog.at_level("WARNING", logger=fla_rule.__name__):
        assert fla_rule.available() is False and fla_rule.available() is False
    assert caplog.text.count("installed but cannot be used") == 1
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name)


def _fake_fla(grouping):
    """chunk and recurrent entry points with fla's keywords over the torch chunked form (variable-length too:
    cu_seqlens with chunk_indices); `grouping` maps q / k of H heads onto HV value heads (None: no grouped heads at
    all, the kernel indexes q / k by the value head)."""
    from memra_pp.model.gdn import chunk_gated_delta_rule, chunk_gated_delta_rule_varlen

    def rule(q, k, v, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel, cu_seqlens=None,
             chunk_indices=None):
        H, HV = q.shape[2], v.shape[2]
        if H != HV:
            if grouping is None:
                raise ValueError(f"q has {H} heads, v {HV}")
            q, k = grouping(q, HV // H), grouping(k, HV // H)
        args = q.float(), k.float(), v.float(), g, beta.float(), initial_state
        if cu_seqlens is None:
            o, s = chunk_gated_delta_rule(*args)
        else:
            assert chunk_indices is not None, "the engine passes the chunk indices it made on the host"
            o, s = chunk_gated_delta_rule_varlen(*args, cu_seqlens.diff().tolist())
        return o.to(v.dtype), s
    return rule


def test_grouped_value_heads_are_used_only_where_they_equal_repeated_ones(monkeypatch, caplog):
    """FlaRule.warm_up(k_heads=) must turn gva on only where the grouped call gives what repeated q and k give
    (value head h reads key head h // (HV / H), as repeat_interleave maps them): an fla that maps the heads another
    way (tile: head h reads h % H) or takes no grouped heads (raises) must keep the repeated heads. The finding must
    hold for a second rule of the process with the same dimensions."""
    import torch
    from memra_pp.kernels import prefill as pf
    monkeypatch.setattr(fla_rule, "_WARM", {})
    monkeypatch.setattr(pf, "VARLEN", True)     # the warm-up's variable-length call too, with the heads it found
    cases = [("interleave", lambda x, r: x.repeat_interleave(r, 2), True),
             ("tile", lambda x, r: x.repeat(1, 1, r, 1), False),
             ("none", None, False)]
    for i, (name, grouping, expect) in enumerate(cases):
        rule = fla_rule.FlaRule.__new__(fla_rule.FlaRule)
        rule._chunk = rule._rec = _fake_fla(grouping)
        dk = 8 + i          # each case its own dimensions (the cache's key)
        caplog.clear()
        with caplog.at_level("INFO", logger=fla_rule.__name__):
            rule.warm_up(4, dk, 8, torch.float32, torch.device("cpu"), k_heads=2)
        assert rule.gva is expect, name
        # an fla that refuses grouped heads is said so, with its error (the warm-up's fallback ran)
        assert ("fla takes no grouped value heads" in caplog.text) == (grouping is None), (name, caplog.text)
        again = fla_rule.FlaRule.__new__(fla_rule.FlaRule)
        again._chunk = again._rec = _fake_fla(None)     # would raise if asked: the finding comes from the cache
        again.warm_up(4, dk, 8, torch.float32, torch.device("cpu"), k_heads=2)
        assert again.gva is expect, name


def test_pin_cuts_an_autotuner_to_its_one_matching_config():
    """_pin: the autotuner keeps only its own config with BK 64 and 1 warp (fla's kkt-solve: the warm-up's one-chunk
    tuning picked 2 or 4 warps, up to 1.9x slower over a real step's grid) and forgets what it tuned; a kernel with
    no such config, or several, or no autotuner, is left as it was."""
    import triton
    configs = [triton.Config({"BK": bk}, num_warps=w) for bk in (32, 64) for w in (1, 2, 4)]
    tuner = _Tuner(configs)
    tuner.cache[(16, 32)] = configs[5]          # tuned before the pin: BK 64, 4 warps
    assert fla_rule._pin(types.SimpleNamespace(fn=tuner), fla_rule.KKT_SOLVE_CONFIG)
    assert tuner.configs == [configs[3]] and tuner.configs[0].kwargs == {"BK": 64} and \
        tuner.configs[0].num_warps == 1 and tuner.cache == {}
    assert tuner.run(7) is configs[3]           # every key now: the pinned config, nothing tuned
    other = _Tuner([triton.Config({"BK": 32}, num_warps=2)])
    assert not fla_rule._pin(other, fla_rule.KKT_SOLVE_CONFIG) and len(other.configs) == 1
    twice = _Tuner([triton.Config({"BK": 64}, num_warps=1, num_stages=s) for s in (2, 3)])
    assert not fla_rule._pin(twice, fla_rule.KKT_SOLVE_CONFIG) and len(twice.configs) == 2
    assert not fla_rule._pin(None, fla_rule.KKT_SOLVE_CONFIG)


def test_making_the_rule_pins_fla_kernels_where_they_exist(monkeypatch):
    """FlaRule() pins each of PINS where its fla has the kernel: kkt-solve to BK 64 with 1 warp, chunk_h to BV 64
    with 4 warps and 4 stages (one of its 12 configs, matched by num_stages too), recompute_w_u to 4 warps and 3
    stages (configs of no kwargs); an fla without chunk_h's module makes the rule all the same."""
    import triton
    kkt = _Tuner([triton.Config({"BK": bk}, num_warps=w) for bk in (32, 64) for w in (1, 2, 4)])
    wu = _Tuner([triton.Config({}, num_warps=w, num_stages=s) for w in (2, 4, 8) for s in (2, 3, 4)])
    chunk_h = _Tuner([triton.Config({"BV": bv}, num_warps=w, num_stages=s)
                      for w in (2, 4) for s in (2, 3, 4) for bv in (32, 64)])
    chunk_h.cache["k"] = chunk_h.configs[0]         # tuned before: forgotten
    mods = {n: types.ModuleType(n) for n in ("fla", "fla.ops", "fla.ops.gated_delta_rule", "fla.ops.utils",
                                             "fla.ops.utils.cumsum", "fla.ops.gated_delta_rule.chunk_fwd",
                                             "fla.ops.common", "fla.ops.common.chunk_delta_h",
                                             "fla.ops.gated_delta_rule.wy_fast")}
    mods["fla.ops.gated_delta_rule.wy_fast"].recompute_w_u_fwd_kernel = types.SimpleNamespace(fn=wu)
    mods["fla.ops.gated_delta_rule"].chunk_gated_delta_rule = "chunk"
    mods["fla.ops.gated_delta_rule"].fused_recurrent_gated_delta_rule = "recurrent"
    mods["fla.ops.utils"].cumsum = mods["fla.ops.utils.cumsum"]
    mods["fla.ops.utils.cumsum"].chunk_local_cumsum_scalar_kernel = _Tuner(["a"])
    mods["fla.ops.gated_delta_rule.chunk_fwd"].chunk_gated_delta_rule_fwd_kkt_solve_kernel = \
        types.SimpleNamespace(fn=kkt)
    mods["fla.ops.common.chunk_delta_h"].chunk_gated_delta_rule_fwd_kernel_h_blockdim64 = \
        types.SimpleNamespace(fn=types.SimpleNamespace(fn=chunk_h))       # (under two heuristics wrappers)
    for name in [m for m in sys.modules if m == "fla" or m.startswith("fla.")]:
        monkeypatch.delitem(sys.modules, name)
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    rule = fla_rule.FlaRule()
    assert rule._chunk == "chunk" and rule._rec == "recurrent"
    [k] = kkt.configs
    assert (k.kwargs, k.num_warps) == ({"BK": 64}, 1) and len(kkt._memra_all) == 6
    [h] = chunk_h.configs
    assert (h.kwargs, h.num_warps, h.num_stages) == ({"BV": 64}, 4, 4) and len(chunk_h._memra_all) == 12
    assert chunk_h.cache == {} and chunk_h.run(5) is h
    [w] = wu.configs
    assert (w.kwargs, w.num_warps, w.num_stages) == ({}, 4, 3) and len(wu._memra_all) == 9
    monkeypatch.delitem(sys.modules, "fla.ops.common.chunk_delta_h")
    monkeypatch.setattr(sys.modules["fla.ops.common"], "__path__", [], raising=False)
    assert fla_rule._kernel(*fla_rule.CHUNK_H) is None
    fla_rule.FlaRule()          # (no chunk_h module: nothing pinned there, no failure)


def test_chunk_h_picked_by_grid_where_switched_on(monkeypatch):
    """MEMRA_PP_CHUNK_H_GRID: chunk_h's config call by call (GridPick, matched by num_stages too): BV 32 / 4 warps /
    4 stages where segments x heads x 4 programs fit the SMs, BV 64 / 4 / 4 where x 2 do, else BV 64 / 4 / 2; the
    eight points of the forty-second session's measurement (35B-A3B 32 value heads, 27B 48; 132 SMs), each its
    fastest config. The warm-up compiles every one of the three (chunk and variable-length calls). An fla without
    one of those configs keeps the pin; the switch off, the pin."""
    import torch
    chunk_h, calls = _Tuner(every_h()), []
    h_mod = fake_fla(monkeypatch, chunk_h, calls)
    sms = []
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: sms.append(d) or types.SimpleNamespace(multi_processor_count=132))
    import memra_pp.kernels.fused_decode as fd
    from memra_pp.kernels import prefill as pf
    monkeypatch.setattr(fd, "l2norm", lambda x: x)
    monkeypatch.setattr(pf, "VARLEN", True)
    monkeypatch.setattr(fla_rule, "_WARM", {})

    monkeypatch.setattr(fla_rule, "CHUNK_H_GRID", False)
    assert fla_rule.FlaRule()._chunk_h is None
    assert [named(c) for c in chunk_h.configs] == [(64, 4, 4)]      # the pin
    monkeypatch.setattr(fla_rule, "CHUNK_H_GRID", True)
    rule = fla_rule.FlaRule()
    pick = rule._chunk_h
    assert pick.tuner is chunk_h and len(chunk_h._memra_all) == 12 and chunk_h.cache == {}
    assert [named(c) for c in chunk_h.configs] == [(64, 4, 2)]
    dev = torch.device("cuda", 0)
    got = {(heads, n): named(pick.choose(n, heads, 128, dev)) for heads in (32, 48) for n in (1, 2, 8, 16)}
    assert got == {(32, 1): (32, 4, 4), (32, 2): (64, 4, 4), (32, 8): (64, 4, 2), (32, 16): (64, 4, 2),
                   (48, 1): (64, 4, 4), (48, 2): (64, 4, 2), (48, 8): (64, 4, 2), (48, 16): (64, 4, 2)}
    assert len(sms) == 1        # (the SM count asked once a device)
    z = torch.zeros(1, 192, 32, 128)
    rule.chunk_varlen(z, z, z, z[..., 0], z[..., 0], torch.zeros(1, 32, 128, 128), torch.tensor([0, 192]),
                      torch.zeros(3, 2, dtype=torch.long))
    rule.chunk_varlen(z, z, z, z[..., 0], z[..., 0], torch.zeros(2, 32, 128, 128), torch.tensor([0, 96, 192]),
                      torch.zeros(3, 2, dtype=torch.long), normed=True)
    b = torch.zeros(8, 64, 32, 128)
    rule.chunk(b, b, b, b[..., 0], b[..., 0], torch.zeros(8, 32, 128, 128))
    assert [[named(c) for c in cs] for _, _, _, cs in calls] == [[(32, 4, 4)], [(64, 4, 4)], [(64, 4, 2)]]
    calls.clear()
    # the warm-up (grouped value heads found: q and k keep their 16 heads): each config compiled, both calls
    rule.warm_up(32, 128, 128, torch.float32, torch.device("cpu"), k_heads=16)
    assert rule.gva
    compiled = {(nb, varlen, named(cs[0])) for nb, varlen, _, cs in calls}
    assert {(c[1], c[2]) for c in compiled} >= {(v, cfg) for v in (False, True)
                                                 for cfg in ((32, 4, 4), (64, 4, 4), (64, 4, 2))}
    # an fla whose chunk_h lacks one of the picked configs: pinned as without the switch
    short = _Tuner([c for c in every_h() if named(c) != (64, 4, 2)])
    h_mod.chunk_gated_delta_rule_fwd_kernel_h_blockdim64 = types.SimpleNamespace(fn=short)
    assert fla_rule.FlaRule()._chunk_h is None and [named(c) for c in short.configs] == [(64, 4, 4)]
