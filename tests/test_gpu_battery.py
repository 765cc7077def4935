"""The residency battery on GPUs, the way a user runs it: two stages (two processes, two CUDA contexts) on one
card, or on two cards where the machine has them, tower on the primary. Every check but never_within_context (the
tower-on-intake case, SKIP here) applies on CUDA and must pass with its evidence: the secondary context refused at
construction, splice and publication source; the image rows published by host bounce; `never` refused; peer and
host transports bit-identical to each other and giving the one-stage tokens."""
import json

import pytest
import torch

from memra_pp.battery import Battery
from memra_pp.model.tiny import make_tiny

pytestmark = pytest.mark.gpu


def test_gpu_battery_all_checks_pass(ray_cluster, tmp_path):
    assert torch.cuda.is_available(), "this test needs a CUDA GPU (it is selected with -m gpu, never skipped)"
    devices = ["cuda:0", "cuda:1"] if torch.cuda.device_count() > 1 else ["cuda:0", "cuda:0"]
    path = make_tiny(tmp_path / "tiny-vision", vision=True)
    cfg = {"name": "gpu-bat", "model": {"path": str(path), "dtype": "bfloat16"}, "vision": {"engine": "primary"},
           "stages": [{"device": d} for d in devices]}
    lines = []
    report = Battery(cfg, progress=lines.append, out=str(tmp_path / "report.json")).run()
    print("\n".join(lines))
    rows = {r["check"]: r for r in report["rows"]}
    assert report["passed"], [r for r in report["rows"] if r["outcome"] != "PASS"]
    # on CUDA every check applies but never_within_context, whose case (the tower on the intake) this is not
    assert {c for c, r in rows.items() if r["outcome"] != "PASS"} == {"never_within_context"}, rows
    assert rows["never_within_context"]["outcome"] == "SKIP"
    assert set(rows) == {"contexts", "foreign_handle", "secondary_context", "same_context_publication",
                         "image_publication", "never_refuses", "never_within_context", "force_publishes",
                         "pipeline_equals_one_stage", "transport_peer", "transport_host", "transports_bit_identical"}
    sec = rows["secondary_context"]["evidence"]
    doors = ("construct", "splice", "publish_source", "token_overlay", "splice_target")
    assert sec["applicable"] and len({sec[k] for k in doors}) == 5 and sec["messages_name_context_and_fix"]
    assert rows["image_publication"]["evidence"]["publications_moved"] == 1
    assert "overlay_publish: never" in rows["never_refuses"]["evidence"]["message"]
    assert rows["transport_peer"]["evidence"]["transport"] == "peer"
    assert rows["transport_host"]["evidence"]["transport"] == "host"
    assert rows["transports_bit_identical"]["evidence"]["hashes"] > 0
    assert "NOT REFUSED" not in json.dumps(report["rows"])
