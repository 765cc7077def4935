"""GGUF-loaded slices must generate what transformers generates from the same (dequantized) weights."""
import pytest
import torch

from conftest_models import tiny_checkpoint
from gguf_writer import gguf_from_hf_dir
from test_gguf import _fixtures
from tiny_hf import hf_greedy
from memra_pp.model.gguf_source import GGUFSource
from memra_pp.model.local import LocalPipeline

PROMPTS = [[5, 17, 42], list(range(3, 90)), [9]]


def hf_from_source(model, src):
    """Overwrite every text weight of a transformers model with the source's (dequantized) tensors."""
    sd = model.state_dict()
    with torch.no_grad():
        for k, v in sd.items():
            name = k.removeprefix("model.language_model.").removeprefix("model.")
            if k.startswith("model.visual") or not src.has(name):
                continue
            v.copy_(src.get(name, torch.float32, "cpu"))
    return model


def assert_parity(model, src, splits, prompts=PROMPTS, new=6):
    toks, lps = LocalPipeline(src, splits).greedy(prompts, new)
    for p, t, l in zip(prompts, toks, lps, strict=True):
        ht, hl = hf_greedy(model, p, new)
        assert t == ht
        assert max(abs(a - b) for a, b in zip(l, hl, strict=True)) < 5e-4


@pytest.mark.parametrize("kind", ["dense_text-s404", "moe_text-s414"])
@pytest.mark.parametrize("q", ["f32", "q8_0"])
def test_llama_cpp_fixtures(kind, q):
    """llama.cpp's own GGUFs must match transformers: f32 against the hf/ checkpoint itself, q8_0 against
    transformers holding the dequantized weights (quantization changes the model; the loader must not)."""
    from transformers import AutoModelForCausalLM
    d = _fixtures() / kind
    src = GGUFSource(d / f"{kind.split('-')[0]}-{q}.gguf")
    model = AutoModelForCausalLM.from_pretrained(d / "hf", dtype=torch.float32).eval()
    if q != "f32":
        hf_from_source(model, src)
    n = src.config.text.num_hidden_layers
    assert_parity(model, src, [(0, 2), (2, n)])


@pytest.mark.parametrize("kind,tied", [("dense", False), ("moe", True)])
@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0"])
def test_written_gguf(tmp_path, kind, tied, qtype):
    """GGUFs written from tiny transformers models (F32, F16, Q8_0) must match through 1 and 3 stages."""
    import copy
    model, path = tiny_checkpoint(kind, tied)
    src = GGUFSource(gguf_from_hf_dir(path, tmp_path / "m.gguf", qtype))
    ref = model if qtype == "F32" else hf_from_source(copy.deepcopy(model), src)
    assert_parity(ref, src, [(0, 8)])
    assert_parity(ref, src, [(0, 2), (2, 5), (5, 8)], prompts=PROMPTS[:1])
