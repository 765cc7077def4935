"""A deployment launched from a GGUF file (llama.cpp's own q8_0 qwen35 fixture, `format: gguf`), two CPU stages
through real Ray actors and slots, must generate what transformers generates holding gguf-py's dequantization of
the file: identical greedy tokens, logprobs within 5e-4. (That each stage reads only its own layers' tensors:
tests/test_gguf.py::test_stage_reads_only_its_layers.)"""
import torch

import memra_pp
from test_gguf import _fixtures
from test_gguf_parity import hf_dequantized
from tiny_hf import hf_greedy
from memra_pp.model.gguf_source import GGUFSource
from gaps import worst_gap

PROMPTS = [[5, 17, 42], list(range(3, 60))]


def test_gguf_deployment_matches_transformers(ray_cluster):
    from transformers import AutoModelForCausalLM
    d = _fixtures() / "dense_text-s404"
    path = d / "dense_text-q8_0.gguf"
    src = GGUFSource(path)
    ref = hf_dequantized(AutoModelForCausalLM.from_pretrained(d / "hf", dtype=torch.float32).eval(), path, d / "hf")
    cfg = {"name": "gguf", "model": {"path": str(path), "format": "gguf", "dtype": "float32"},
           "stages": [{"device": "cpu", "num_cpus": 0.1}] * 2}
    with memra_pp.launch(cfg) as dep:
        assert [(s.layer_start, s.layer_end) for s in dep.plan.stages][-1][1] == src.config.text.num_hidden_layers
        c = dep.client()
        for p in PROMPTS:
            r = c.generate(p, max_new_tokens=6, ignore_eos=True)
            want, want_lp = hf_greedy(ref, p, 6)
            assert r.token_ids == want, (p[:4], r.token_ids, want)
            assert len(r.logprobs) == len(want_lp)
            assert worst_gap(zip(r.logprobs, want_lp, strict=True)) < 5e-4
        # text through the GGUF's own tokenizer (tokenizer.ggml.*): the HF tokenizer's ids, decoded back
        from tokenizers import Tokenizer as HFTokenizer
        hf_tok = HFTokenizer.from_file(str(d / "hf" / "tokenizer.json"))
        text = "<|im_start|>user\nHello, world! 123<|im_end|>\n"
        r = c.generate(text, max_new_tokens=6, ignore_eos=True)
        assert r.token_ids == c.generate(hf_tok.encode(text).ids, max_new_tokens=6, ignore_eos=True).token_ids
        assert r.text == hf_tok.decode(r.token_ids), (r.text, r.token_ids)
        st = dep.stats()["stages"]
    assert st[1]["handoffs"] > 0, "the activations crossed the boundary"
