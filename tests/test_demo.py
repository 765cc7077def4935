"""The embedded default must run end to end: tiny checkpoint, two CPU stages, tokens equal to one stage."""
import json

from memra_pp.cli import main


def test_demo_runs_and_matches_one_stage(ray_cluster, capsys):
    """`memra-pp demo --json` must exit 0 and report tokens equal to a one-stage run, with both stages busy; its
    text prompts went through the client, whose r.text (the model dir has a tokenizer) must be the tokenizer's
    decode of exactly the generated token ids, special tokens skipped (as vLLM)."""
    from memra_pp.defaults import ensure_tiny
    from memra_pp.model.tokenizer import Tokenizer
    assert main(["demo", "--prompts", "4", "--max-new-tokens", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["equal_to_one_stage"] is True
    assert len(out["stages"]) == 2 and all(s["microbatches"] > 0 for s in out["stages"])
    assert out["tokens"] > 0 and len(out["generations"]) == 4
    tok = Tokenizer.from_model_dir(ensure_tiny())
    for g in out["generations"]:
        assert g["token_ids"] and g["text"] == tok.decode(g["token_ids"], skip_special_tokens=True), g
