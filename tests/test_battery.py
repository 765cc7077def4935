"""The residency battery on a live CPU placement must run every applicable check, pass them, and carry evidence
that each path ran (publication counters, refusal messages, equal tokens); a check that does not apply to the
placement writes a SKIP row saying why, never a missing row and never a PASS."""
import json

import yaml

from memra_pp.battery import Battery
from memra_pp.cli import main as cli_main
from memra_pp.model.tiny import make_tiny

ALL = {"contexts", "foreign_handle", "secondary_context", "same_context_publication", "image_publication",
       "never_refuses", "force_publishes", "pipeline_equals_one_stage", "transport_peer", "transport_host",
       "transports_bit_identical"}


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
    assert skipped == {"secondary_context", "transport_peer", "transport_host", "transports_bit_identical"}
    assert all(rows[c]["exercised"].startswith("not applicable: ") for c in skipped)
    assert "not a CUDA device" in rows["secondary_context"]["exercised"]
    assert rows["transport_peer"]["evidence"] == {"cuda_stages": 0}
    assert rows["image_publication"]["evidence"]["publications_moved"] == 1
    assert rows["same_context_publication"]["evidence"]["force_published"] == 1
    assert "overlay_publish: never" in rows["never_refuses"]["evidence"]["message"]
    assert "NOT REFUSED" not in json.dumps(rows["foreign_handle"]["evidence"])
    assert json.loads(out.read_text())["rows"], "the report must be written as rows complete"


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
    assert report["passed"] and set(rows) == ALL | {"never_within_context"}
    assert rows["never_refuses"]["outcome"] == "SKIP" and "intake engine" in rows["never_refuses"]["exercised"]
    assert rows["never_within_context"]["outcome"] == "PASS"
    assert rows["never_within_context"]["evidence"] == {"publications": 0, "tokens_equal": True}
    assert rows["image_publication"]["evidence"]["publications_moved"] == 0
    assert rows["force_publishes"]["outcome"] == "PASS" and rows["force_publishes"]["evidence"]["publications"] == 1
    assert json.loads((tmp_path / "r.json").read_text())["rows"] == report["rows"]

    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(dict(cfg, model={"path": str(tmp_path / "no-such-model")})))
    assert cli_main(["battery", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and "Error:" in err
