"""On GPUs, a deployment of two stages (one card or two, peer or host slots) must generate exactly what one GPU
stage generates, in bf16, with the fla kernels, through the real actors and slots."""
import pytest
import torch

import memra_pp
from conftest_models import tiny_checkpoint

pytestmark = pytest.mark.gpu
PROMPTS = [[5, 17, 42], list(range(1, 131)), [7], list(range(200, 265))]


@pytest.fixture(scope="module")
def gpus():
    assert torch.cuda.is_available(), "this test needs a CUDA GPU (it is selected with -m gpu, never skipped)"
    return torch.cuda.device_count()


def run(path, devices, transport="auto"):
    cfg = {"name": "g", "model": {"path": str(path), "dtype": "bfloat16"}, "transport": transport,
           "stages": [{"device": d} for d in devices], "scheduler": {"max_batch": 8, "prefill_chunk": 48}}
    with memra_pp.launch(cfg) as dep:
        c = dep.client()
        toks = [c.generate(p, max_new_tokens=12, ignore_eos=True).token_ids for p in PROMPTS]
        st = dep.stats(timeline=True)["stages"]
    # the timeline's device spans (timing events placed on the host clock): both kinds on every stage, each
    # stage's spans in order and never overlapping (one stream), stage 1's first chunk after stage 0's began
    for s in st:
        tl = s["timeline"]
        assert {k for k, *_ in tl} == {"prefill", "decode"}, tl[:4]
        assert all(a <= b for _, _, a, b in tl) and all(x[3] <= y[2] + 1e-4 for x, y in zip(tl, tl[1:])), tl[:8]
    if len(st) > 1:
        assert st[1]["timeline"][0][2] >= st[0]["timeline"][0][2]
    assert all(s["kv_growth"] == "in place" for s in st), [s["kv_growth"] for s in st]    # KV pools map memory
    assert sum(s["kv_mapped_bytes"] for s in st) > 0, [s["kv_mapped_bytes"] for s in st]
    from memra_pp.model import decode_graphs
    if decode_graphs.ANY_KV:    # the stages take the driver's setting: every batch bucket (1, 2, 4, 8) captured at
        for s in st:            # load, none while decoding (these prompts never grow the KV pools)
            g = s["decode_graphs"]
            assert g["captures"] == len(g["graphs"]) == 4 and len({kv for _, kv in g["graphs"]}) == 1, g
    from memra_pp.model import prefill_graphs
    if prefill_graphs.ENABLED:  # the prompt steps (48 prompt rows + 8 decode rows at most: the 128-row bucket,
        for s in st:            # captured at load) through the prefill graphs
            g = s["prefill_graphs"]
            assert g["buckets"] == [128] and g["captures"] == 1 and g["replays"] > 0, g
    return toks, st


@pytest.mark.parametrize("transport", ["peer", "host"])
def test_two_gpu_stages_equal_one(ray_cluster, gpus, transport):
    _, path = tiny_checkpoint("dense", False)
    ref, st1 = run(path, ["cuda:0"])
    assert st1[0]["gdn_backend"] == "fla"
    assert st1[0]["decode_graphs"]["replays"] > 0, st1[0]["decode_graphs"]     # decode ran through CUDA graphs
    # two cards where the machine has them (a one-card machine runs the same-card layout once, not twice, and
    # says so: the cross-card path is then not exercised here)
    layouts = [["cuda:0", "cuda:0"]] + ([["cuda:0", "cuda:1"]] if gpus > 1 else [])
    print(f"layouts run ({transport}): {layouts}")
    for devs in layouts:
        toks, st = run(path, devs, transport)
        assert st[1]["transport"] == transport and st[1]["handoffs"] > 0
        assert all(s["decode_graphs"]["replays"] > 0 for s in st), [s["decode_graphs"] for s in st]
        assert all(0 < s["busy"] <= 1 for s in st), [s["busy"] for s in st]      # device time (timing events)
        assert toks == ref, f"{devs} {transport}: {toks} != {ref}"
