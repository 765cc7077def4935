"""transformers' generate on the same GPUs, the baseline of benchmarks/gpu_decode.py: the Qwen3.5 text model with
random weights built on meta and materialised on its device(s) (one GPU, or spread with device_map as
`from_pretrained(device_map="auto")` would), timed per step like memra_pp's steady window. Runs in the driver process.
"""
from __future__ import annotations

import gc
import time

import torch


def hf_device_map(model, devices: list, max_memory: dict | None = None) -> dict:
    """What device_map="auto" gives from_pretrained: whole decoder layers (the model's _no_split_modules) balanced
    over the GPUs by transformers' get_balanced_memory (about model size / GPUs each, over each card's free memory
    unless max_memory says), the embedding on the first, lm_head on the last. One device: the whole model there."""
    if len(devices) == 1:
        return {"": devices[0]}
    from transformers.integrations.accelerate import get_balanced_memory, infer_auto_device_map
    if max_memory is None:
        max_memory = {d: torch.cuda.mem_get_info(d)[0] for d in devices}
    no_split = model._no_split_modules
    mem = get_balanced_memory(model, max_memory=max_memory, no_split_module_classes=no_split)
    return dict(infer_auto_device_map(model, max_memory=mem, no_split_module_classes=no_split))


def hf_on_meta(text_config: dict):
    """transformers' Qwen3_5ForCausalLM (Qwen3_5MoeForCausalLM for a MoE text_config) for a text_config dict (a
    preset's), bf16, on the meta device: no storage."""
    import transformers
    kind = "Qwen3_5Moe" if "moe" in text_config.get("model_type", "") else "Qwen3_5"
    cfg = getattr(transformers, kind + "TextConfig")(**{k: v for k, v in text_config.items() if k != "model_type"})
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):
            return getattr(transformers, kind + "ForCausalLM")(cfg).eval()
    finally:
        torch.set_default_dtype(torch.float32)


def build_hf(text_config: dict, devices: list, device_map: dict | None = None):
    """hf_on_meta's model with transformers' own random init (dummy weights) over `devices`: each device_map entry
    materialised on its device and initialised there, so the weights never pass through the host; on several
    devices accelerate's hooks move activations between them (dispatch_model, as from_pretrained does)."""
    model = hf_on_meta(text_config)
    device_map = device_map or hf_device_map(model, devices)
    for name, dev in device_map.items():    # entries are whole modules: a decoder layer is never split
        model.get_submodule(name).to_empty(device=dev)
    model.init_weights()     # normal(0, initializer_range) linears, norms, A_log, rotary buffers; ties if tied
    if len(set(device_map.values())) > 1:
        from accelerate import dispatch_model
        dispatch_model(model, device_map=device_map)
        model.hf_device_map = device_map     # as from_pretrained sets it: generate reads it
    return model


def run_hf(concurrencies, prompt_len: int, new: int, devices=("cuda",), text_config: dict | None = None,
           system: str = "transformers", out: list | None = None, save=None) -> list[dict]:
    """transformers' generate at each concurrency on the model spread over `devices` (one: the plain baseline;
    several: the naive device_map pipeline). Rows are named `system`, so plot() draws each as its own line; they
    go to the caller's `out` as they are measured, save() after each."""
    from transformers import LogitsProcessor, LogitsProcessorList
    from memra_pp.model import presets
    tc = text_config or presets.get("qwen3.5-27b")["text_config"]
    model = build_hf(tc, list(devices))
    layers = {}     # decoder layers per device, as the device map placed them
    for name, d in getattr(model, "hf_device_map", {}).items():
        if ".layers." in name:
            layers[str(d)] = layers.get(str(d), 0) + 1
    cuda = [d for d in (torch.device("cuda", x) if isinstance(x, int) else torch.device(x) for x in devices)
            if d.type == "cuda"]

    def sync():     # every card: a step's last kernels run on the last one
        for d in cuda:
            torch.cuda.synchronize(d)

    class Stamp(LogitsProcessor):
        """Called once per generated token (after its forward): a timestamp per step, so the decode rate is
        measured over the steps themselves, like memra_pp's steady-state window (generate syncs every step)."""
        def __init__(self):
            self.t = []

        def __call__(self, input_ids, scores):
            sync()
            self.t.append(time.perf_counter())
            return scores

    out = [] if out is None else out
    for c in concurrencies:
        ids = torch.randint(4, tc["vocab_size"], (c, prompt_len), device=model.device)
        with torch.no_grad():
            model.generate(ids[:, :8], max_new_tokens=2, do_sample=False)
            stamp = Stamp()
            sync()
            t = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, logits_processor=LogitsProcessorList([stamp]))
            sync()
            dt = time.perf_counter() - t
        st = stamp.t
        dec = c * (len(st) - 1) / max(1e-9, st[-1] - st[0])
        out.append({"system": system, "devices": list(devices), "layers_per_device": layers, "concurrency": c,
                    "tokens_per_s": c * new / dt, "wall_s": dt, "decode_tokens_per_s": dec, "ttft_s": st[0] - t})
        print(f"  {system}, {c} concurrent: {c * new / dt:.1f} tokens/s end to end, decode {dec:.1f}, "
              f"first token {st[0] - t:.2f} s", flush=True)
        if save:
            save()
    del model
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    return out
