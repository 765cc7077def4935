"""The residency battery on a live CPU placement must run every applicable check, pass them, and carry evidence
that each path ran (publication counters, refusal messages, equal tokens)."""
import json

from memra_pp.battery import Battery
from memra_pp.model.tiny import make_tiny


def test_cpu_battery_passes_with_evidence(ray_cluster, tmp_path):
    path = make_tiny(tmp_path / "tiny-vision", vision=True)
    cfg = {"name": "bat", "model": {"path": str(path)}, "vision": {"engine": "primary"},
           "stages": [{"device": "cpu", "num_cpus": 0.1}] * 2}
    out = tmp_path / "report.json"
    report = Battery(cfg, progress=lambda m: None, out=str(out)).run()
    rows = {r["check"]: r for r in report["rows"]}
    assert report["passed"], [r for r in report["rows"] if r["outcome"] != "PASS"]
    assert {"contexts", "foreign_handle", "same_context_publication", "image_publication", "never_refuses",
            "force_publishes", "pipeline_equals_one_stage"} <= set(rows)
    assert rows["image_publication"]["evidence"]["publications_moved"] == 1
    assert rows["same_context_publication"]["evidence"]["force_published"] == 1
    assert "overlay_publish: never" in rows["never_refuses"]["evidence"]["message"]
    assert "NOT REFUSED" not in json.dumps(rows["foreign_handle"]["evidence"])
    assert json.loads(out.read_text())["rows"], "the report must be written as rows complete"
