"""On a GPU, adapters through a deployment: two GPU stages serving a batch that mixes two LoRA adapters (with
embedding and lm_head token rows) and no adapter must give what the same deployment on CPU stages gives (the CPU
path is PEFT's to the token and within 5e-4 in tests/test_adapters.py and test_runtime_adapters.py), in float32; and
LoRA pools the GPU cannot hold are refused before any is allocated. The adapters are written here (PEFT's file
layout), since the GPU machines have no PEFT."""
import json
import threading

import pytest
import torch

import memra_pp
from conftest_models import tiny_checkpoint
from gaps import worst_gap
from memra_pp.errors import ConfigError

pytestmark = pytest.mark.gpu
PROMPTS = [[5, 17, 42, 7, 23], list(range(1, 40)), [99, 60], [60, 61, 62, 11, 7]]
ADAPTERS = ["a", "b", None, "b"]
NEW = 8


def write_adapter(d, mc, seed: int, rank: int, modules: tuple[str, ...], embed_ids, lm_head_ids=None):
    """A PEFT LoRA directory (adapter_config.json + adapter_model.safetensors, PEFT's key names) with random A and
    B for `modules` of every layer that has them, and trainable-token rows for `embed_ids` / `lm_head_ids`."""
    from safetensors.torch import save_file
    from memra_pp.model.lora import layer_modules
    from memra_pp.model.weights import expected_shape
    g = torch.Generator().manual_seed(seed)
    tc, tensors = mc.text, {}
    for i in range(tc.num_hidden_layers):
        for m in layer_modules(tc, i):
            if m.rsplit(".", 1)[-1] not in modules:
                continue
            out, inp = expected_shape(f"layers.{i}.{m}.weight", tc)
            key = f"base_model.model.model.layers.{i}.{m}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=g) / inp ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.1
    tti = {"embed_tokens": list(embed_ids)}
    tensors["base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"] = \
        torch.randn(len(embed_ids), tc.hidden_size, generator=g)
    if lm_head_ids:
        tti["lm_head"] = list(lm_head_ids)
        tensors["base_model.model.lm_head.token_adapter.trainable_tokens_delta"] = \
            torch.randn(len(lm_head_ids), tc.hidden_size, generator=g) * 3
    d.mkdir(parents=True)
    save_file(tensors, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(modules),
        "trainable_token_indices": tti, "bias": "none"}))
    return str(d)


def serve(path, device: str, adapters: dict) -> list:
    cfg = {"name": "gad", "model": {"path": str(path), "dtype": "float32"},
           "stages": [{"device": device, "num_cpus": 0.1}] * 2, "adapters": {"max_loras": 2, "max_rank": 8},
           "scheduler": {"max_batch": 8, "prefill_chunk": 16}}
    with memra_pp.launch(cfg) as dep:
        for name, d in adapters.items():
            dep.load_adapter(name, d)
        c, out = dep.client(), [None] * len(PROMPTS)

        def one(k):
            r = c.generate(PROMPTS[k], max_new_tokens=NEW, adapter=ADAPTERS[k], ignore_eos=True, timeout=120)
            out[k] = (r.token_ids, r.logprobs)
        ts = [threading.Thread(target=one, args=(k,)) for k in range(len(PROMPTS))]     # one batch, mixed
        for t in ts:
            t.start()
        for t in ts:
            t.join(300)
        st = dep.stats()["stages"]
    assert all(o is not None for o in out), out
    return out, st


def test_adapters_on_gpu_stages_match_the_cpu_stages(ray_cluster, tmp_path):
    assert torch.cuda.is_available(), "this test needs a CUDA GPU (it is selected with -m gpu, never skipped)"
    from memra_pp.model.weights import SafetensorsSource
    _, path = tiny_checkpoint("dense", False)
    mc = SafetensorsSource(path).config
    ads = {"a": write_adapter(tmp_path / "a", mc, 1, 8, ("q_proj", "v_proj", "o_proj", "in_proj_qkv", "out_proj",
                                                          "gate_proj", "up_proj", "down_proj"), [5, 17, 42, 99],
                              [11, 42, 250]),
           "b": write_adapter(tmp_path / "b", mc, 2, 4, ("k_proj", "in_proj_z", "down_proj"), [7, 23, 60])}
    ref, _ = serve(path, "cpu", ads)
    got, st = serve(path, "cuda:0", ads)
    for k, ((t, lp), (rt, rlp)) in enumerate(zip(got, ref)):
        assert t == rt, (k, ADAPTERS[k], t, rt)
        assert worst_gap(zip(lp, rlp, strict=True)) < 5e-4, (k, ADAPTERS[k])
    base = [r[0] for r, a in zip(ref, ADAPTERS) if a is None]
    assert any(r[0] != b for r, a in zip(ref, ADAPTERS) if a for b in base)     # the adapters change the tokens
    assert all(s["device"].startswith("cuda") for s in st)


def test_lora_pools_the_gpu_cannot_hold_are_refused_before_allocation():
    assert torch.cuda.is_available(), "this test needs a CUDA GPU (it is selected with -m gpu, never skipped)"
    from memra_pp.model.lora import LoraPool
    from memra_pp.model.weights import SafetensorsSource
    mc = SafetensorsSource(tiny_checkpoint("dense", False)[1]).config
    before = torch.cuda.memory_allocated(0)
    with pytest.raises(ConfigError, match=r"^adapters.max_loras 1000000000 x adapters.max_rank 8: the LoRA pools of "
                                          r"layers \[0, 3\) need [0-9.]+ GiB on cuda:0, which has [0-9.]+ GiB free; "
                                          r"lower adapters.max_loras \(at most \d+ fit at this max_rank\)"):
        LoraPool(mc, range(0, 3), 10 ** 9, 8, device="cuda:0")
    assert torch.cuda.memory_allocated(0) == before
    assert LoraPool(mc, range(0, 3), 4, 8, device="cuda:0").a       # a pool that fits is made
