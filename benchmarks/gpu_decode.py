"""Decode throughput on H200s with the Qwen3.5-27B (dense) dimensions and random bf16 weights, side by side in
one run: memra_pp with 1, 2 (and 4) stages at several concurrencies, transformers' generate on one GPU, and the
copy bandwidth that sets the memory floor. Writes JSON (and a PNG plot) to --out.

    python -u benchmarks/gpu_decode.py --out DIR [--stages 1,2,4] [--concurrency 1,64] [--hf]
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch


def copy_bandwidth(gb: float = 4.0) -> float:
    """Device-to-device copy, bytes read + written per second (the floor's denominator)."""
    n = int(gb * 2**30) // 2
    a = torch.empty(n, dtype=torch.bfloat16, device="cuda").normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    t = time.perf_counter()
    reps = 10
    for _ in range(reps):
        b.copy_(a)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t) / reps
    del a, b
    torch.cuda.empty_cache()
    return 2 * n * 2 / dt


def weight_bytes_per_token(mc) -> float:
    """Every weight a decode step reads (all layers + lm_head; the embedding reads one row)."""
    from memra_pp.model.weights import expected_shape
    t = mc.text
    total = 0
    for i in range(t.num_hidden_layers):
        for name in _layer_names(t, i):
            shp = expected_shape(name, t)
            if shp is not None:
                total += 2 * torch.Size(shp).numel()
    return total + 2 * t.vocab_size * t.hidden_size


def _layer_names(t, i):
    p = f"layers.{i}."
    mix = ["self_attn." + n for n in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")] \
        if t.is_full(i) else ["linear_attn." + n for n in ("in_proj_qkv.weight", "in_proj_z.weight",
                                                             "in_proj_b.weight", "in_proj_a.weight", "out_proj.weight")]
    return [p + m for m in mix] + [p + "mlp." + n for n in ("gate_proj.weight", "up_proj.weight", "down_proj.weight")]


def run_memra(n_stages: int, concurrencies, prompt_len: int, new: int) -> list[dict]:
    import memra_pp
    stages = [{"device": f"cuda:{i}"} for i in range(n_stages)]
    cfg = {"name": f"bench{n_stages}", "model": {"path": "preset:qwen3.5-27b", "format": "dummy",
                                                 "dtype": "bfloat16"},
           "stages": stages, "scheduler": {"max_batch": max(concurrencies), "max_context": prompt_len + new + 8,
                                           "prefill_chunk": 2048}}
    out = []
    t0 = time.time()
    with memra_pp.launch(cfg) as dep:
        print(f"  {n_stages} stage(s) up in {time.time() - t0:.0f} s", flush=True)
        from memra_pp.bench import run_bench
        run_bench(dep, 2, 16, 4)   # warm up (kernels compile)
        for c in concurrencies:
            r = run_bench(dep, c, prompt_len, new)
            # decode-only rate: tokens after the first, over the time after the slowest first token
            r["n_stages"] = n_stages
            out.append(r)
            print(f"  {n_stages} stage(s), {c} concurrent: {r['tokens_per_s']:.1f} tokens/s, busy "
                  + ", ".join(f"{s['busy']:.0%}" for s in r["stages"]), flush=True)
    return out


def run_hf(concurrencies, prompt_len: int, new: int) -> list[dict]:
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    from memra_pp.model import presets
    tc = dict(presets.get("qwen3.5-27b")["text_config"])
    tc.pop("model_type")
    cfg = Qwen3_5TextConfig(**tc)
    with torch.device("cuda"):
        torch.set_default_dtype(torch.bfloat16)
        model = Qwen3_5ForCausalLM(cfg).eval()
        torch.set_default_dtype(torch.float32)
    out = []
    for c in concurrencies:
        ids = torch.randint(4, cfg.vocab_size, (c, prompt_len), device="cuda")
        with torch.no_grad():
            model.generate(ids[:, :8], max_new_tokens=2, do_sample=False)
            torch.cuda.synchronize()
            t = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                           do_sample=False)
            torch.cuda.synchronize()
            dt = time.perf_counter() - t
        out.append({"system": "transformers", "concurrency": c, "tokens_per_s": c * new / dt, "wall_s": dt})
        print(f"  transformers, {c} concurrent: {c * new / dt:.1f} tokens/s", flush=True)
    del model
    torch.cuda.empty_cache()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--stages", default="1,2")
    ap.add_argument("--concurrency", default="1,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--hf", action="store_true")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    conc = [int(x) for x in a.concurrency.split(",")]
    from memra_pp.model.config import parse_config
    from memra_pp.model import presets
    mc = parse_config(presets.get("qwen3.5-27b"))
    bw = copy_bandwidth()
    wb = weight_bytes_per_token(mc)
    rep = {"copy_bandwidth_Bps": bw, "weight_bytes_per_token": wb, "floor_batch1_tokens_per_s": bw / wb,
           "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "runs": []}
    print(f"copy {bw / 1e12:.2f} TB/s, weights {wb / 1e9:.1f} GB/token, batch-1 floor {bw / wb:.1f} tokens/s",
          flush=True)
    for n in [int(x) for x in a.stages.split(",")]:
        if n <= torch.cuda.device_count():
            rep["runs"] += run_memra(n, conc, a.prompt_len, a.new)
            json.dump(rep, open(os.path.join(a.out, "gpu_decode.json"), "w"), indent=1)
    if a.hf:
        rep["runs"] += run_hf(conc, a.prompt_len, a.new)
    json.dump(rep, open(os.path.join(a.out, "gpu_decode.json"), "w"), indent=1)
    plot(rep, os.path.join(a.out, "gpu_decode.png"))
    return 0


def plot(rep: dict, path: str) -> None:
    """Throughput against concurrency, one line per system measured, the batch-1 floor as a marker."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6.5, 4))
    systems = {}
    for r in rep["runs"]:
        name = r.get("system") or f"memra_pp, {r['n_stages']} stage(s)"
        systems.setdefault(name, []).append((r["concurrency"], r["tokens_per_s"]))
    for name, pts in systems.items():
        ax.plot(*zip(*sorted(pts)), marker="o", label=name)
    ax.axhline(rep["floor_batch1_tokens_per_s"], ls=":", c="grey", label="batch-1 memory floor")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"Qwen3.5-27B dims, bf16, {rep['gpu']}")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
