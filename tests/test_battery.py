"""The residency battery on a live CPU placement must run every applicable check, pass them, and carry evidence
that each path ran (publication counters, refusal messages, equal tokens); a check that does not apply to the
placement writes a SKIP row saying why, never a missing row and never a PASS."""
import json
import os
import types

import yaml

from memra_pp.battery import Battery, verdict
from memra_pp.cli import main as cli_main
from memra_pp.model.tiny import make_tiny
from conftest_models import tiny_checkpoint

ALL = {"contexts", "foreign_handle", "secondary_context", "same_context_publication", "image_publication",
       "never_refuses", "never_within_context", "force_publishes", "pipeline_equals_one_stage", "transport_peer",
       "transport_host", "transports_bit_identical"}


def test_cpu_battery_passes_with_evidence(ray_cluster, tmp_path):
    path = make_tiny(tmp_path / "tiny-vision", vision=True)
    cfg = {"name": "bat", "model": {"path": str(path)}, "vision": {"engine": "primary"},
           "stages": [{"device": "cpu", "num_cpus": 0.1}] * 2}
    out = tmp_path / "report.json"
    report = Battery(cfg, progress=lambda m: None, out=str(out)).run()
    rows = {r["check"]: r for r in report["rows"]}
    assert report["passed"], [r for r in report["rows"] if r["outcome"] != "PASS"]
    assert set(rows) == ALL, "every check writes a row, applicable or not"
    skipped = {c for c, r in rows.items() if r["outcome"] == "SKIP"}
    assert skipped == {"secondary_context", "never_within_context", "transport_peer", "transport_host",
                       "transports_bit_identical"}
    assert all(rows[c]["exercised"].startswith("not applicable: ") for c in skipped)
    assert "not a CUDA device" in rows["secondary_context"]["exercised"]
    assert rows["transport_peer"]["evidence"] == {"cuda_stages": 0}
    assert rows["pipeline_equals_one_stage"]["evidence"]["boundary_microbatches"] > 0   # the boundary was crossed
    assert rows["image_publication"]["evidence"]["publications_moved"] == 1
    for c in ("image_publication", "force_publishes"):     # the rows spliced are the rows published, bit-exact
        ev = rows[c]["evidence"]
        assert ev["mismatch"] is None and len(ev["published_sha256"]) == 1, ev
        assert ev["spliced_sha256"] == ev["published_sha256"], ev
    assert rows["pipeline_equals_one_stage"]["evidence"]["image_mismatch"] is None
    assert "image request" in rows["pipeline_equals_one_stage"]["exercised"]
    assert rows["same_context_publication"]["evidence"]["force_published"] == 1
    assert "overlay_publish: never" in rows["never_refuses"]["evidence"]["message"]
    assert "NOT REFUSED" not in json.dumps(rows["foreign_handle"]["evidence"])
    assert json.loads(out.read_text())["rows"], "the report must be written as rows complete"


# Loaded at the start of each stage process (sitecustomize): the rows a publication lands from the intake's
# publication slot (the tower in another process wrote them there) are zeroed after they land.
CORRUPT_SLOT = """
import memra_pp.overlay as _ov
_land = _ov.PublishedRows.land


def _corrupted(self, intake, host=None):
    ov = _land(self, intake, host)
    if host is not None:
        ov.rows.zero_()
    return ov


_ov.PublishedRows.land = _corrupted
"""


def test_battery_fails_when_published_rows_arrive_wrong(ray_cluster, tmp_path, monkeypatch):
    """Stage processes whose publications land wrong rows (zeroed after the htod, counters moved as usual) must
    fail every row that claims a cross-context publication, each naming the mismatch: image_publication and
    force_publishes (the rows the intake spliced differ from those the tower published, by sha256) and
    pipeline_equals_one_stage (the image request's tokens differ from one stage's, whose tower aliases its rows).
    The checks that publish nothing across processes still pass."""
    import memra_pp.stages.actor as actor_mod
    patch = tmp_path / "patch"
    patch.mkdir()
    (patch / "sitecustomize.py").write_text(CORRUPT_SLOT)
    real = actor_mod.StageActor
    pythonpath = os.pathsep.join(p for p in (str(patch), os.environ.get("PYTHONPATH")) if p)

    class Corrupting:
        @staticmethod
        def options(**opts):
            rt = opts.get("runtime_env", {})       # (a CPU stage has none of its own)
            env = dict(rt.get("env_vars", {}), PYTHONPATH=pythonpath)
            return real.options(**dict(opts, runtime_env=dict(rt, env_vars=env)))
    monkeypatch.setattr(actor_mod, "StageActor", Corrupting)

    path = make_tiny(tmp_path / "tiny-vision", vision=True)
    cfg = {"name": "bat-corrupt", "model": {"path": str(path)}, "vision": {"engine": "primary"},
           "stages": [{"device": "cpu", "num_cpus": 0.1}] * 2}
    report = Battery(cfg, progress=lambda m: None).run()
    rows = {r["check"]: r for r in report["rows"]}
    assert not report["passed"]
    failed = {c for c, r in rows.items() if r["outcome"] == "FAIL"}
    assert failed == {"image_publication", "force_publishes", "pipeline_equals_one_stage"}, rows
    for c in ("image_publication", "force_publishes"):
        ev = rows[c]["evidence"]
        assert ev["publications" if c == "force_publishes" else "publications_moved"] == 1, ev   # it published
        assert "the rows the intake spliced (sha256" in ev["mismatch"], ev
        assert "differ from the rows the tower published" in ev["mismatch"], ev
        assert ev["spliced_sha256"] != ev["published_sha256"], ev
    one = rows["pipeline_equals_one_stage"]["evidence"]
    assert one["tokens_equal"] and "differ from the reference's" in one["image_mismatch"], one
    assert rows["never_refuses"]["outcome"] == "PASS" and rows["same_context_publication"]["outcome"] == "PASS"


def test_cli_battery_tower_on_intake(ray_cluster, tmp_path, capsys):
    """`memra-pp battery CONFIG --json` with the tower on the intake engine of two stages: the image never crosses
    a context, so `never` has nothing to refuse (SKIP) and must serve instead (never_within_context: same tokens,
    no publication); `force` still publishes. stdout is the JSON report alone; the exit code is 0 (passed).
    A placement that cannot launch exits 2 with the typed error on stderr."""
    path = make_tiny(tmp_path / "tiny-vision", vision=True)
    cfg = {"name": "bat-intake", "model": {"path": str(path)}, "vision": {"engine": "intake"},
           "stages": [{"device": "cpu", "num_cpus": 0.1}] * 2}
    yml = tmp_path / "intake.yaml"
    yml.write_text(yaml.safe_dump(cfg))
    capsys.readouterr()
    assert cli_main(["battery", str(yml), "--json", "--out", str(tmp_path / "r.json")]) == 0
    cap = capsys.readouterr()
    report = json.loads(cap.out)
    assert "PASS  never_within_context" in cap.err, "progress goes to stderr under --json"
    rows = {r["check"]: r for r in report["rows"]}
    assert report["passed"] and set(rows) == ALL
    assert rows["never_refuses"]["outcome"] == "SKIP" and "intake engine" in rows["never_refuses"]["exercised"]
    assert rows["never_within_context"]["outcome"] == "PASS"
    ev = rows["never_within_context"]["evidence"]
    assert ev["publications"] == 0 and ev["splices"] > 0 and ev["tokens_equal"] and ev["refused"] is None, ev
    assert rows["image_publication"]["evidence"]["publications_moved"] == 0
    assert rows["image_publication"]["evidence"]["published_sha256"] == []     # aliased: nothing published
    assert rows["force_publishes"]["outcome"] == "PASS" and rows["force_publishes"]["evidence"]["publications"] == 1
    ev = rows["force_publishes"]["evidence"]
    assert ev["mismatch"] is None and ev["spliced_sha256"] == ev["published_sha256"] != [], ev
    assert json.loads((tmp_path / "r.json").read_text())["rows"] == report["rows"]

    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(dict(cfg, model={"path": str(tmp_path / "no-such-model")})))
    assert cli_main(["battery", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and err.startswith("memra-pp battery: ConfigError: "), err   # as every command


def test_battery_without_tower_on_one_stage_skips_what_cannot_apply(ray_cluster, tmp_path, monkeypatch, capsys):
    """No vision tower and one stage: every image, never/force, foreign-handle and boundary check is a SKIP row
    saying why; the contexts and same-context publication checks still run and pass. The CLI exits 1 on a FAIL
    row and on a report of SKIP rows alone (nothing was shown), 0 when a PASS stands beside SKIPs."""
    path = make_tiny(tmp_path / "tiny", vision=False)
    cfg = {"name": "bat-one", "model": {"path": str(path)}, "stages": [{"device": "cpu", "num_cpus": 0.1}]}
    report = Battery(cfg, progress=lambda m: None).run()
    rows = {r["check"]: r for r in report["rows"]}
    assert set(rows) == ALL and report["passed"]
    assert {c for c, r in rows.items() if r["outcome"] == "PASS"} == {"contexts", "same_context_publication"}, \
        {c: r["outcome"] for c, r in rows.items()}
    for c, r in rows.items():
        if c not in ("contexts", "same_context_publication"):
            assert r["outcome"] == "SKIP" and r["exercised"].startswith("not applicable: "), r
    assert "vision tower" in rows["force_publishes"]["exercised"] and "one stage" in rows["transport_peer"]["exercised"]
    assert "one stage" in rows["foreign_handle"]["exercised"]

    yml = tmp_path / "one.yaml"
    yml.write_text(yaml.safe_dump(cfg))
    row = {"check": "contexts", "exercised": "x", "evidence": {}}
    for outcomes, code in ((("PASS", "FAIL"), 1), (("SKIP", "SKIP"), 1), (("PASS", "SKIP"), 0)):
        rs = [dict(row, outcome=o) for o in outcomes]
        fake = {"passed": verdict(rs), "seconds": 0.0, "rows": rs}
        monkeypatch.setattr(Battery, "run", lambda self, fake=fake: fake)
        assert cli_main(["battery", str(yml)]) == code, outcomes
    assert "1/2 checks passed (1 not applicable)" in capsys.readouterr().out


def test_the_base_run_is_autos_whatever_mode_the_yaml_names(tmp_path):
    """The base run's rows say AUTO, and the later checks compare with its tokens as auto's: a YAML naming
    overlay_publish force made image_publication FAIL on one stage ("1 publication(s) recorded where the rows are
    aliased") and PASS across contexts without auto running; never aborted the battery with a ResidencyError. The
    base is auto's now (the YAML's mode is said, and never / force run as variants of their own), and a refusal
    in the image run is that row's FAIL, naming it, not an abort."""
    import types
    from memra_pp.errors import ResidencyError
    path = make_tiny(tmp_path / "tiny-vision", vision=True)
    said = []
    for mode in ("force", "never", "auto"):
        b = Battery({"name": "bat", "model": {"path": str(path)}, "overlay_publish": mode,
                     "stages": [{"device": "cpu", "num_cpus": 0.1}]}, progress=said.append)
        assert b.base["overlay_publish"] == "auto" and b.given_publish == mode
        assert b.variant(overlay_publish="force")["overlay_publish"] == "force"

    def refused(dep):
        raise ResidencyError("overlay rows live in ctx A but engine cpu is ctx B")
    b.image_run = refused
    from memra_pp.model.config import load_config
    dep = types.SimpleNamespace(model_config=load_config(path),
                                stats=lambda: {"stages": [{"overlay_publications": 0, "splices": 0}]})
    b.images(dep)
    assert [(r["check"], r["outcome"]) for r in b.rows] == [("image_publication", "FAIL")]
    assert b.rows[0]["evidence"] == {"refused": "overlay rows live in ctx A but engine cpu is ctx B",
                                     "overlay_publish_in_yaml": "auto"}
    assert not verdict(b.rows) and not hasattr(b, "image_result")


def test_transport_rows_check_the_boundary_between_two_cuda_stages(monkeypatch):
    """The transport rows read stage 1's boundary, which is shared memory wherever stage 0 or 1 is a CPU: on
    [cpu, cuda:0, cuda:1] peer and host FAILed on a healthy deployment and transports_bit_identical PASSed by
    comparing shared-memory runs. They now record the first boundary between two CUDA stages (skip where there is
    none), and bit-identity passes only where peer and host both ran there. Launches are faked (no GPU here): each
    boundary's transport is Deployment._transports' own rule, every received activation hashes alike."""
    import contextlib

    import memra_pp
    import memra_pp.battery as B
    from memra_pp.deployment import Deployment
    from memra_pp.model.weights import open_weights
    from memra_pp.placement import make_plan, parse_placement
    mc = open_weights(str(tiny_checkpoint("dense", False)[1]), "auto").config
    forced = {}

    class Dep:
        def __init__(self, raw):
            p = parse_placement(raw)
            self.plan = make_plan(p, mc)
            self.tr = forced.get("tr") or Deployment._transports(p, self.plan, None, 1)[0]
            self.rx, self.actors = None, list(self.plan.stages)

        def stage_actor(self, i):
            dep = self

            def record(name, on):
                out, dep.rx = list(dep.rx or []), ([] if on else None)
                return out
            return types.SimpleNamespace(run_check=types.SimpleNamespace(remote=record))

        def client(self):
            def generate(p, **kw):
                if self.rx is not None:
                    self.rx.append("sha")
                return types.SimpleNamespace(token_ids=[1, 2, 3])
            return types.SimpleNamespace(generate=generate)

        def stats(self):
            return {"stages": [{"transport": t} for t in self.tr]}

    monkeypatch.setattr(memra_pp, "launch", contextlib.contextmanager(lambda raw: (yield Dep(raw))))
    monkeypatch.setattr(B, "get", lambda x, *a: x)

    def run(devices):
        bat = B.Battery.__new__(B.Battery)
        bat.base = parse_placement({"stages": [{"device": d} for d in devices], "transport": "peer"}).to_dict()
        bat.rows, bat.say, bat.out, bat.tol = [], lambda m: None, None, 1e-4
        with memra_pp.launch(bat.base) as dep:
            ref, bat.base_run = bat.recorded_tokens(dep)
        bat.transports(ref)
        return {r["check"]: r for r in bat.rows}

    rows = run(["cpu", "cuda:0", "cuda:1"])
    for c in ("transport_peer", "transport_host", "transports_bit_identical"):
        assert rows[c]["outcome"] == "PASS" and rows[c]["evidence"]["boundary"] == 2, rows[c]
    assert rows["transport_host"]["evidence"]["transport"] == "host"
    rows = run(["cuda:0", "cpu", "cuda:1"])
    assert all(rows[c]["outcome"] == "SKIP" and "no boundary between two CUDA stages" in rows[c]["exercised"]
               for c in ("transport_peer", "transport_host", "transports_bit_identical")), rows
    forced["tr"] = ["shm"] * 3      # neither transport took effect: nothing may pass, bit-identity least of all
    rows = run(["cuda:0", "cuda:1", "cuda:2"])
    assert all(rows[c]["outcome"] == "FAIL" for c in ("transport_peer", "transport_host",
                                                      "transports_bit_identical")), rows
