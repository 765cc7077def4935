"""Audit of overlays and the residency battery: splices refuse what would not arrive bit-exact or cannot be placed,
publications are bit-exact for every dtype and view, and the battery judges the evidence it claims (driver side,
against fake deployments: no Ray)."""
import types

import numpy as np
import pytest
import torch

import memra_pp
import memra_pp.battery as battery_mod
from memra_pp.battery import NEW, Battery
from memra_pp.battery_stage import CHECKS
from memra_pp.engine import Engine
from memra_pp.errors import OverlayError, ResidencyError
from memra_pp.overlay import EmbedOverlay, publish_out
from memra_pp.placement.schema import load_placement

H = 4


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _odd_rows(dtype: torch.dtype, n: int = 6) -> torch.Tensor:
    """Rows holding -0.0, a subnormal, a NaN with a payload and random bit patterns: compared as bytes."""
    bits_dt = torch.int32 if dtype == torch.float32 else torch.int16
    info = torch.iinfo(bits_dt)
    bits = torch.randint(info.min, info.max, (n, H), dtype=bits_dt, generator=torch.Generator().manual_seed(3))
    bits[0, 0] = {torch.float32: -2**31, torch.bfloat16: -2**15, torch.float16: -2**15}[dtype]   # -0.0
    bits[0, 1] = 1                                                                                  # subnormal
    bits[0, 2] = {torch.float32: 0x7FC00001, torch.bfloat16: 0x7F81, torch.float16: 0x7C01}[dtype]  # NaN payload
    return bits.view(dtype)


# -- publication is bit-exact and publishes only the view's rows ----------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("via_slot", [False, True])
def test_publication_of_views_is_bit_exact(dtype, via_slot):
    """Rows published from an offset row-slice or a column-strided view of a larger tensor must land as exactly
    that view's bytes (NaN payloads, -0.0, subnormals included), carried or through a publication slot."""
    e, rows = Engine("cpu"), _odd_rows(dtype)
    big = torch.zeros(20, H, dtype=dtype)
    big[7:13] = rows
    wide = torch.zeros(6, 3 * H, dtype=dtype)
    wide[:, 1::3] = rows
    for view in (big[7:13], wide[:, 1::3], rows.T.contiguous().T):
        slot = torch.full((4096,), 0xAB, dtype=torch.uint8) if via_slot else None
        pub = publish_out(e, view, [(0, 0, 6)], into=slot)
        assert pub.shape == (6, H) and (pub.data is None) == via_slot
        landed = pub.land(e, host=slot).rows
        assert landed.dtype == dtype and _bytes(landed) == _bytes(rows)
        emb = torch.zeros(8, H, dtype=dtype)
        assert EmbedOverlay(e, landed, [(2, 0, 6)]).splice_into(e, emb, 0) == 6     # a span at the prompt's end
        assert _bytes(emb[2:]) == _bytes(rows) and not emb[:2].view(torch.uint8).any()


# -- splice and window refusals -------------------------------------------------------------------------------------
def test_splice_refuses_rows_of_another_dtype():
    """Rows whose dtype differs from the embedding they replace must be refused naming both dtypes: copy_ would cast
    them, and the rows would not arrive bit-exact (nor would the battery's digest of the rows notice)."""
    e = Engine("cpu")
    ov = EmbedOverlay(e, torch.randn(3, H), [(0, 0, 3)])
    emb = torch.zeros(3, H, dtype=torch.bfloat16)
    with pytest.raises(OverlayError, match=r"splice target is torch.bfloat16 but the overlay rows are torch.float32; "
                                           r"produce the rows in the embedding's dtype"):
        ov.splice_into(e, emb, 0)
    assert not emb.view(torch.uint8).any() and e.counters.splices == 0


@pytest.mark.parametrize("target,chunk_off,msg", [
    ([[0.0] * H], 0, r"splice target must be a \(T, 4\) torch.Tensor, got a list"),
    (torch.zeros(()), 0, r"splice target \(\) is not \(T, 4\)"),
    (torch.zeros(3, H), 1.5, r"splice chunk_off 1.5 must be the chunk's first prompt position, an int >= 0"),
    (torch.zeros(3, H), -1, r"splice chunk_off -1 must be"),
    (torch.zeros(3, H), True, r"splice chunk_off True must be"),
])
def test_splice_refuses_a_bad_target_or_offset(target, chunk_off, msg):
    """A splice target that is no (T, H) tensor, or a chunk offset that is no prompt position, must be refused typed
    and before any write (not AttributeError / IndexError / TypeError, and not rows written at a negative offset)."""
    e = Engine("cpu")
    ov = EmbedOverlay(e, torch.ones(3, H), [(0, 0, 3)])
    with pytest.raises(OverlayError, match=msg):
        ov.splice_into(e, target, chunk_off)
    if isinstance(target, torch.Tensor):
        assert not target.any()
    assert e.counters.splices == 0


@pytest.mark.parametrize("off,length", [(0.5, 2), (0, 2.5), (True, 1), ("0", 1)])
def test_window_refuses_non_int_bounds(off, length):
    """A window's bounds must be ints: a float made float spans that later broke a splice with a TypeError."""
    ov = EmbedOverlay(Engine("cpu"), torch.ones(3, H), [(0, 0, 3)])
    with pytest.raises(OverlayError, match=r"window\(off=.*, length=.*\) must be ints with off >= 0"):
        ov.window(off, length)


def test_rows_of_zero_width_are_refused():
    """(N, 0) rows are empty rows: they must be refused as the message says (non-empty (N, H)), at construction and
    at the publication source."""
    with pytest.raises(OverlayError, match=r"non-empty \(N, H\) tensor, got shape \(3, 0\)"):
        EmbedOverlay(Engine("cpu"), torch.zeros(3, 0), [(0, 0, 3)])
    with pytest.raises(OverlayError, match=r"got shape \(3, 0\)"):
        publish_out(Engine("cpu"), torch.zeros(3, 0), [(0, 0, 3)])


def test_numpy_integer_spans_are_accepted_as_ints():
    """Spans computed with numpy (a processor's arrays) must be accepted and stored as Python ints; numpy bools and
    floats are still refused naming the span."""
    ov = EmbedOverlay(Engine("cpu"), torch.ones(4, H), [(np.int64(1), np.int32(0), np.int64(4))])
    assert ov.spans == ((1, 0, 4),) and all(type(v) is int for v in ov.spans[0])
    with pytest.raises(OverlayError, match=r"span 0 .* must be three ints"):
        EmbedOverlay(Engine("cpu"), torch.ones(4, H), [(np.bool_(True), 0, 1)])
    with pytest.raises(OverlayError, match=r"span 0 \(0, 3, 2\) is outside rows \[0, 4\)"):
        EmbedOverlay(Engine("cpu"), torch.ones(4, H), [(np.int64(0), np.int64(3), np.int64(2))])


# -- the battery, against fake deployments --------------------------------------------------------------------------
class _Actor:
    """A stage actor whose run_check runs the real stage-side check against a CPU runner in this process."""

    def __init__(self, runner, override=None):
        self.runner, self.override = runner, override or {}
        self.run_check = types.SimpleNamespace(remote=self._check)

    def _check(self, name, *args):
        return self.override[name] if name in self.override else CHECKS[name](self.runner, *args)


class _Dep:
    def __init__(self, cfg, n_stages, vision=None, generate=None, publications=0, override=None):
        self.cfg = cfg
        runner = types.SimpleNamespace(engine=Engine("cpu"), mc=types.SimpleNamespace(
            text=types.SimpleNamespace(hidden_size=8)), dtype=torch.float32)
        self.actors = [_Actor(runner, override) for _ in range(n_stages)]
        self.plan = types.SimpleNamespace(stages=[types.SimpleNamespace(device="cpu")] * n_stages,
                                          tower_index=n_stages - 1, intake_index=0)
        self.model_config = types.SimpleNamespace(vision=vision, vision_start_token_id=1, image_token_id=2,
                                                  vision_end_token_id=3)
        self._generate = generate or (lambda prompt, **kw: types.SimpleNamespace(token_ids=[4] * NEW,
                                                                                  logprobs=[-1.0] * NEW))
        self.publications = publications

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def stage_actor(self, i):
        return self.actors[i]

    def client(self):
        return types.SimpleNamespace(generate=self._generate)

    def stats(self):
        return {"stages": [{"overlay_publications": self.publications, "splices": 0, "transport": "shm"}]
                * len(self.actors)}


_VISION = types.SimpleNamespace(spatial_merge_size=2, in_channels=1, temporal_patch_size=1, patch_size=1)


def _battery(tmp_path, monkeypatch, make_dep, vision="primary", n_stages=2, say=lambda m: None):
    """A Battery over a CPU placement whose launches are fake deployments (`make_dep(cfg)`), each config first
    validated as a real launch would (load_placement); returns (battery, the configs launched)."""
    cfg = {"name": "audit", "model": {"path": str(tmp_path / "m"), "format": "dummy"}, "vision": {"engine": vision},
           "stages": [{"device": "cpu"}] * n_stages}
    launched = []

    def launch(c):
        load_placement(c)
        launched.append(c)
        return make_dep(c)
    monkeypatch.setattr(memra_pp, "launch", launch)
    monkeypatch.setattr(battery_mod, "get", lambda refs, timeout, what: refs)
    return Battery(cfg, progress=say), launched


def test_battery_one_stage_variant_launches_with_the_tower_on_a_later_stage(tmp_path, monkeypatch):
    """With vision.engine stage:1 the pipeline_equals_one_stage check must launch a valid one-stage placement (its
    tower on its only stage), not crash the battery with `vision.engine: 'stage:1' names no stage`."""
    b, launched = _battery(tmp_path, monkeypatch, lambda c: _Dep(c, len(c["stages"])), vision="stage:1")
    toks = [[4] * NEW] * 3
    b.base_run = ("shm", toks, ["h0", "h1"])
    b.transports(toks)
    rows = {r["check"]: r for r in b.rows}
    assert rows["pipeline_equals_one_stage"]["outcome"] == "PASS", rows
    assert len(launched) == 1 and len(launched[0]["stages"]) == 1
    assert launched[0]["vision"]["engine"] == "primary"


def test_battery_same_context_publication_must_land_resident_rows(tmp_path, monkeypatch):
    """same_context_publication gathers whether FORCE's landed rows are resident in the engine; rows that are not
    must FAIL the check and the battery (the evidence was recorded but not judged)."""
    pub = CHECKS["same_context_publication"](types.SimpleNamespace(
        engine=Engine("cpu"), mc=types.SimpleNamespace(text=types.SimpleNamespace(hidden_size=8)), dtype=torch.float32))
    assert pub["force_resident"] and pub["force_published"] == 1 and pub["auto_aliases"]   # the real check, here
    bad = dict(pub, force_resident=False)
    said = []
    b, _ = _battery(tmp_path, monkeypatch, lambda c: _Dep(c, 1, override={"same_context_publication": bad}),
                    n_stages=1, say=said.append)
    report = b.run()
    rows = {r["check"]: r for r in report["rows"]}
    assert rows["same_context_publication"]["outcome"] == "FAIL", rows["same_context_publication"]
    assert not report["passed"]
    # the progress says why it failed (the evidence), not only that it did
    at = said.index(next(m for m in said if m.startswith("  FAIL  same_context_publication: ")))
    assert said[at + 1].startswith("        evidence: {") and '"force_resident": false' in said[at + 1], said


@pytest.mark.parametrize("outcomes,code,tail", [
    (("PASS", "FAIL", "FAIL"), 1, "; FAILED: c1, c2"),
    (("SKIP", "SKIP"), 1, "; FAILED: no check applies to this placement (nothing was shown)"),
    (("PASS", "SKIP"), 0, ""),
])
def test_battery_cli_summary_names_what_failed(tmp_path, monkeypatch, capsys, outcomes, code, tail):
    """The text summary must say that the battery failed and which checks did (exit 1), or that nothing applied;
    a passing battery's summary stays as it was (exit 0)."""
    rows = [{"check": f"c{i}", "exercised": "x", "outcome": o, "evidence": {}} for i, o in enumerate(outcomes)]
    fake = {"passed": battery_mod.verdict(rows), "seconds": 0.5, "rows": rows}
    monkeypatch.setattr(Battery, "run", lambda self: fake)
    cfg = {"name": "audit", "model": {"path": str(tmp_path / "m"), "format": "dummy"}, "stages": [{"device": "cpu"}]}
    args = types.SimpleNamespace(config=cfg, json=False, out=None)
    assert battery_mod.main(args) == code
    n_pass, n_skip = outcomes.count("PASS"), outcomes.count("SKIP")
    assert capsys.readouterr().out == f"{n_pass}/{len(rows)} checks passed ({n_skip} not applicable) in 0.5 s{tail}\n"


@pytest.mark.parametrize("message,publications,outcome", [
    ("overlay_publish: never, but the vision tower runs in A and the intake in B; set overlay_publish to auto", 0,
     "PASS"),
    ("overlay rows live in A but engine cpu is B; they must not be read there", 0, "FAIL"),   # another refusal
    ("overlay_publish: never, but the vision tower runs in A and the intake in B", 1, "FAIL"),  # after publishing
])
def test_battery_never_refuses_only_on_nevers_own_refusal(tmp_path, monkeypatch, message, publications, outcome):
    """never_refuses must PASS only on overlay_publish: never's own refusal with no row published; any other
    ResidencyError on the way (a foreign-context refusal at the splice, say) is not the path the check claims."""
    def make_dep(c):
        def generate(prompt, images=None, **kw):
            if images is not None and c["overlay_publish"] == "never":
                raise ResidencyError(message)
            return types.SimpleNamespace(token_ids=[4] * NEW, logprobs=[-1.0] * NEW)
        return _Dep(c, 2, _VISION, generate, publications)
    b, launched = _battery(tmp_path, monkeypatch, make_dep)
    b.image_result = types.SimpleNamespace(token_ids=[4] * NEW, logprobs=[-1.0] * NEW)
    b.image_crosses = True
    b.never_and_force()
    rows = {r["check"]: r for r in b.rows}
    assert launched[0]["overlay_publish"] == "never"
    assert rows["never_refuses"]["outcome"] == outcome, rows["never_refuses"]
    assert rows["never_refuses"]["evidence"]["message"] == message
    assert rows["never_refuses"]["evidence"]["publications"] == publications
