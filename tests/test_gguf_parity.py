"""GGUF-loaded slices must generate what transformers generates from the same (dequantized) weights."""
import pytest
import torch

from conftest_models import tiny_checkpoint
from gguf_writer import gguf_from_hf_dir
from test_gguf import _fixtures
from tiny_hf import hf_greedy
from memra_pp.model.gguf_source import GGUFSource
from memra_pp.model.local import LocalPipeline
from gaps import worst_gap

PROMPTS = [[5, 17, 42], list(range(3, 90)), [9]]


def hf_dequantized(model, gguf_path, hf_dir):
    """transformers' `model` with every weight the GGUF holds quantized (F16, Q8_0) replaced by gguf-py's own
    dequantization of it (gguf.quants.dequantize), put back in transformers' order by running the converter's
    permutation (gguf_writer.gguf_tensors, written from llama.cpp's converter) over tensors of element indices.
    memra_pp's loader plays no part in it: a loader that changed the weights would not match this model."""
    import gguf
    import numpy as np
    from gguf_writer import canonical_state_dict, gguf_tensors
    from memra_pp.model.config import load_config
    reader = gguf.GGUFReader(str(gguf_path))
    names = {t.name for t in reader.tensors}
    tied = "output.weight" not in names
    sd, seen = {}, set()
    for k, v in model.state_dict().items():     # a tied lm_head shares the embedding's storage: once
        if v.is_floating_point() and v.data_ptr() not in seen:
            seen.add(v.data_ptr())
            sd[k] = v
    offs = np.cumsum([0] + [v.numel() for v in sd.values()])
    assert offs[-1] < 2 ** 24, "float32 indices are exact below 2**24"
    idx = {k: torch.arange(o, o + v.numel(), dtype=torch.float32).reshape(v.shape)
           for (k, v), o in zip(sd.items(), offs, strict=False)}
    where = gguf_tensors(canonical_state_dict(idx, tied), load_config(hf_dir),
                         fuse_gate_up=any("ffn_gate_up_exps" in n for n in names))
    flat = torch.cat([v.detach().reshape(-1).double() for v in sd.values()])
    n = 0
    for t in reader.tensors:
        if t.tensor_type in (gguf.GGMLQuantizationType.F16, gguf.GGMLQuantizationType.Q8_0):
            at = torch.from_numpy(where[t.name][0].astype(np.int64)).reshape(-1)
            flat[at] = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)).reshape(-1)
            n += 1
    assert n > 0, f"{gguf_path}: no quantized tensor"
    with torch.no_grad():
        for (k, v), o in zip(sd.items(), offs, strict=False):
            v.copy_(flat[o:o + v.numel()].reshape(v.shape))
    return model


def assert_parity(model, src, splits, prompts=PROMPTS, new=6):
    toks, lps = LocalPipeline(src, splits).greedy(prompts, new)
    for p, t, l in zip(prompts, toks, lps, strict=True):
        ht, hl = hf_greedy(model, p, new)
        assert t == ht
        assert worst_gap(zip(l, hl, strict=True)) < 5e-4


@pytest.mark.parametrize("kind", ["dense_text-s404", "moe_text-s414"])
@pytest.mark.parametrize("q", ["f32", "q8_0"])
def test_llama_cpp_fixtures(kind, q):
    """llama.cpp's own GGUFs must match transformers: f32 against the hf/ checkpoint itself, q8_0 against
    transformers holding gguf-py's dequantization of the same file (quantization changes the model; the loader must
    not)."""
    from transformers import AutoModelForCausalLM
    d = _fixtures() / kind
    src = GGUFSource(d / f"{kind.split('-')[0]}-{q}.gguf")
    model = AutoModelForCausalLM.from_pretrained(d / "hf", dtype=torch.float32).eval()
    if q != "f32":
        hf_dequantized(model, d / f"{kind.split('-')[0]}-{q}.gguf", d / "hf")
    n = src.config.text.num_hidden_layers
    assert_parity(model, src, [(0, 2), (2, n)])


@pytest.mark.parametrize("kind,tied", [("dense", False), ("moe", True)])
@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0"])
def test_written_gguf(tmp_path, kind, tied, qtype):
    """GGUFs written from tiny transformers models (F32, F16, Q8_0) must match through 1 and 3 stages."""
    import copy
    model, path = tiny_checkpoint(kind, tied)
    src = GGUFSource(gguf_from_hf_dir(path, tmp_path / "m.gguf", qtype))
    ref = model if qtype == "F32" else hf_dequantized(copy.deepcopy(model), tmp_path / "m.gguf", path)
    assert_parity(ref, src, [(0, 8)])
    assert_parity(ref, src, [(0, 2), (2, 5), (5, 8)], prompts=PROMPTS[:1])
