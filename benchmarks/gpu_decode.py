"""Decode throughput on H200s with the Qwen3.5-27B (dense) dimensions and random bf16 weights, side by side in
one run: memra_pp with 1, 2 (and 4) stages at several concurrencies, transformers' generate on one GPU and with
device_map over several, and the copy bandwidth that sets the memory floor. Writes JSON (and a PNG plot) to --out.

    python -u benchmarks/gpu_decode.py --out DIR [--layouts "0;0,1;0,0,1,1"] [--concurrency 1,64] [--hf]
        [--hf-device-map 0,1] [--model preset:qwen3.5-27b] [--microbatches auto]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time

import torch

from hf_baseline import run_hf


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


def weight_bytes_per_token(mc, c: int = 1) -> float:
    """Every weight a decode step of c sequences reads (all layers + lm_head; the embedding reads one row per
    sequence, left out). MoE: the non-expert weights once, and per layer the experts the step routes to: with k of E
    experts per token routed uniformly, E * (1 - (1 - k/E)^c) distinct experts (all k at c = 1)."""
    from memra_pp.model.weights import expected_shape
    t = mc.text
    total = 0.0
    for i in range(t.num_hidden_layers):
        for name in _layer_names(t, i):
            shp = expected_shape(name, t)
            if shp is not None:
                n = 2 * torch.Size(shp).numel()
                total += n * expert_fraction(t, c) if ".experts." in name else n
    return total + 2 * t.vocab_size * t.hidden_size


def expert_fraction(t, c: int) -> float:
    """The share of a layer's experts a step of c sequences reads (uniform routing, k of E per token)."""
    E, k = t.num_experts, t.num_experts_per_tok
    return 1 - (1 - k / E) ** c


def _layer_names(t, i):
    p = f"layers.{i}."
    mix = ["self_attn." + n for n in ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")] \
        if t.is_full(i) else ["linear_attn." + n for n in ("in_proj_qkv.weight", "in_proj_z.weight",
                                                             "in_proj_b.weight", "in_proj_a.weight", "out_proj.weight")]
    mlp = ["gate.weight", "shared_expert_gate.weight", "shared_expert.gate_proj.weight", "shared_expert.up_proj.weight",
           "shared_expert.down_proj.weight", "experts.gate_up_proj", "experts.down_proj"] if t.moe else \
        ["gate_proj.weight", "up_proj.weight", "down_proj.weight"]
    return [p + m for m in mix] + [p + "mlp." + n for n in mlp]


def step_bytes(mc, c: int, ctx: int) -> dict:
    """Bytes one decode step of c sequences at context ctx must move: every weight once, each sequence's fp32
    recurrent state read and written, its KV read. The one floor both GPU benchmarks use."""
    t = mc.text
    n_lin = sum(not t.is_full(i) for i in range(t.num_hidden_layers))
    n_full = t.num_hidden_layers - n_lin
    state = n_lin * t.linear_num_value_heads * t.linear_key_head_dim * t.linear_value_head_dim * 4 * 2
    kv = n_full * 2 * t.num_key_value_heads * t.head_dim * 2 * ctx
    w = weight_bytes_per_token(mc, c)
    return {"weights": w, "state_rw": c * state, "kv_read": c * kv, "total": w + c * (state + kv)}


def step_floor_tokens_per_s(mc, bw: float, c: int, ctx: int) -> float:
    return c / (step_bytes(mc, c, ctx)["total"] / bw)


# The MEMRA_PP_* switches a run sets in the stage processes (the stages take them from the driver's environment,
# Deployment._make_actor): each an off|on|both argument (its default the runtime's, switches.SWITCHES), its switch,
# what a "both" run prints, what on means (its help), in the runs' order. A run's JSON row records each by the
# argument's name
SWITCH_ARGS = (
    ("prefill_graphs", "MEMRA_PP_PREFILL_GRAPHS", "prompt steps through prefill graphs",
     "prompt steps through piecewise CUDA graphs (model/prefill_graphs.py; off: eager layers)"),
    ("rule_graphs", "MEMRA_PP_RULE_GRAPHS", "fla's rule through the rule graphs",
     "inside the prefill graphs fla's chunked rule replays from CUDA graphs of its own (prefill_graphs.RuleGraphs; "
     "off: called eagerly)"),
    ("skip_padding", "MEMRA_PP_SKIP_PADDING", "decode graphs' padding rows skipped",
     "a decode graph's padding rows skip the Gated DeltaNet's state and the MoE's experts (decode_graphs."
     "SKIP_PADDING; off: they run as real rows)"),
    ("gc_freeze", "MEMRA_PP_GC_FREEZE", "stages freeze their heaps at start",
     "each stage freezes its heap at its start, so no full collection stalls the pipeline mid-run"),
    ("any_kv", "MEMRA_PP_ANY_KV_GRAPHS", "one decode graph per batch bucket (any KV length)",
     "one decode graph per batch bucket over every KV length (decode_graphs.ANY_KV; off: a graph per KV-length "
     "bucket)"),
    ("kv_in_place", "MEMRA_PP_KV_IN_PLACE", "KV pools grow in place",
     "KV pools grow in place (model/cache.py IN_PLACE; off: a growth copies the pools and drops the decode graphs)"),
    ("prefill_merged", "MEMRA_PP_PREFILL_MERGED", "prefill merged path",
     "the prefill's merged path (kernels/prefill.MERGED)"),
    ("sdpa_cudnn", "MEMRA_PP_SDPA_CUDNN", "SDPA's own backend choice, cuDNN included",
     "SDPA picks its backend itself, cuDNN included (it plans each new shape)"),
    ("prefill_varlen", "MEMRA_PP_PREFILL_VARLEN", "prefill's Gated DeltaNet segments as one variable-length call",
     "a prefill step's Gated DeltaNet segments as one variable-length call (kernels/prefill.VARLEN; off: by groups "
     "of equal lengths)"),
)


def switch_sides(a) -> list[dict]:
    """Every combination the switch arguments ask for ({argument: on}), off before on, the first argument outermost."""
    sides = {"off": [False], "on": [True], "both": [False, True]}
    names = [n for n, *_ in SWITCH_ARGS]
    return [dict(zip(names, on)) for on in itertools.product(*(sides[getattr(a, n)] for n in names))]


def set_switches(a, sw: dict) -> None:
    """One combination into the driver's environment (the stages read it there), each "both" switch's side said."""
    for name, env, label, _ in SWITCH_ARGS:
        os.environ[env] = "1" if sw[name] else "0"
        if getattr(a, name) == "both":
            print(f"  {label}: {sw[name]}", flush=True)


def run_memra(model: str, devices: list, concurrencies, prompt_len: int, new: int, microbatches,
              fmt: str = "dummy", ttft: int = 0, out: list | None = None, chunk: int = 4096,
              spread: float = 0.0, pipeline_chunks="auto", chunk_decoding="off") -> list[dict]:
    """One deployment over `devices` (one stage per entry; a GPU may hold several). Each concurrency is warmed up
    by run_bench (its decode graphs are captured), then measured: the steady-state decode rate is the tokens that
    arrived while every request was decoding, over that window (memra_pp.bench)."""
    import memra_pp
    from memra_pp.bench import prompt_range, ring_line, run_bench
    n = len(devices)
    cfg = {"name": f"bench{n}", "model": {"path": model, "format": fmt, "dtype": "bfloat16"},
           "stages": [{"device": f"cuda:{d}" if isinstance(d, int) else d, "num_cpus": 0.5} for d in devices],
           "scheduler": {"max_batch": max(concurrencies),
                         "max_context": max(prompt_range(prompt_len, spread)[1] + new, ttft + 2) + 8,
                         "prefill_chunk": chunk, "microbatches": microbatches,
                         "pipeline_chunks": pipeline_chunks, "prefill_chunk_decoding": chunk_decoding}}
    out = [] if out is None else out      # the caller's list: runs measured before a failure are kept
    t0 = time.time()
    with memra_pp.launch(cfg) as dep:
        print(f"  {n} stage(s) on cuda {devices} up in {time.time() - t0:.0f} s", flush=True)
        for c in concurrencies:
            r = run_bench(dep, c, prompt_len, new, prompt_spread=spread)   # warms up first: its graphs captured
            st = dep.stats()["stages"]
            r.update(n_stages=n, devices=devices, model=model, microbatches=microbatches,
                     memory=[{k: s.get(k) for k in ("weights_bytes", "cache_bytes", "device_allocated_bytes",
                                                         "kv_mapped_bytes")}
                             for s in st], decode_graphs=[s.get("decode_graphs") for s in st],
                     prefill_graphs=[s.get("prefill_graphs") for s in st])
            out.append(r)
            print(f"  {n} stage(s) (microbatches {microbatches}), {c} concurrent: {r['tokens_per_s']:.1f} tokens/s "
                  f"end to end, steady decode {r['decode_tokens_per_s']:.1f} tokens/s, "
                  f"ttft p50 {r['ttft_p50_s'] * 1e3:.0f} ms, time per output token p50 {r['tpot_p50_s'] * 1e3:.1f} ms "
                  f"(p99 {r['tpot_p99_s'] * 1e3:.1f}), inter-token p50 {r['itl_p50_s'] * 1e3:.1f} ms (p99 "
                  f"{r['itl_p99_s'] * 1e3:.1f}, longest {r['itl_max_s'] * 1e3:.0f}), busy "
                  + ", ".join(f"{s['busy']:.0%}" for s in r["stages"])
                  + " (steady decode " + ", ".join(f"{b:.0%}" for b in r.get("steady_busy") or []) + ")"
                  + (", handoff p50 " + ", ".join(f"{s['handoff_p50_us']:.0f}" for s in r["stages"][1:]) + " us, "
                     + ring_line(r["stages"][0]) if n > 1 else "")       # one stage has no boundary nor ring
                  + f", decode graphs captured in the timed run {r['graph_captures_in_run']}"
                  + f", KV growths in it {r['kv_growths_in_run']} ({', '.join(r['kv_growth'])})"
                  + f", kernel keys tuned in it {r['kernel_tunings_in_run']}"
                  + f", microbatches held to prefill_chunk_decoding {st[0].get('prefill_held_back', 0)}",
                  flush=True)
            for what, key in (("steady decode", "steady_phase_us"), ("prefill ramp", "ramp_phase_us")):
                for i, ph in enumerate(r.get(key) or []):
                    print(f"    stage {i} host us per microbatch, {what}: "
                          + ", ".join(f"{k} {v:.0f}" for k, v in ph.items())
                          + (f" ({r['ramp_microbatches'][i]} microbatches, busy {r['ramp_busy'][i]:.0%})"
                             if key == "ramp_phase_us" else ""), flush=True)
        if ttft:      # one long prompt alone: time to first token (chunked prefill through every stage)
            r = run_bench(dep, 1, ttft, 2, seed=1, timeline=True)   # each stage's chunks against time
            pre = [s[1] for s in (r.get("timeline") or {}).get("stages", [[]])[0] if s[0] == "prefill"]
            r.update(n_stages=n, devices=devices, model=model, kind="ttft", pipeline_chunks=pipeline_chunks,
                     prompt_cut=len(pre) > -(-ttft // chunk), prefill_steps=pre)
            out.append(r)
            print(f"  {n} stage(s), one {ttft}-token prompt (pipeline_chunks {pipeline_chunks}): time to first token "
                  f"{r['ttft_p50_s'] * 1e3:.0f} ms, prefill steps on stage 0 {len(pre)} "
                  f"({'cut in pieces' if r['prompt_cut'] else 'whole chunks'}: {pre[:3]}...)", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="preset:qwen3.5-27b")
    ap.add_argument("--layouts", default="0;0,1", help="deployments to run: ';'-separated GPU lists, one stage "
                    "per entry (0,0,1,1 = four stages, two per card); a layout may end in @M: its "
                    "scheduler.microbatches; \"\": no memra_pp deployment")
    ap.add_argument("--microbatches", default="auto")
    ap.add_argument("--concurrency", default="1,64")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--ttft", type=int, default=0, help="also time the first token of one prompt this long")
    ap.add_argument("--deploy-each", action="store_true", help="one deployment per concurrency (saturation)")
    ap.add_argument("--prefill-chunk", default="4096",
                    help="scheduler.prefill_chunk (a long prompt's chunks pipeline across stages); a comma list: one "
                         "deployment each, in turn")
    ap.add_argument("--prefill-chunk-decoding", default="off",
                    help="scheduler.prefill_chunk_decoding: the prompt tokens a step takes while requests decode (off: "
                         "prefill_chunk throughout); a comma list (off,1024): one deployment each, for every "
                         "--prefill-chunk")
    ap.add_argument("--pipeline-chunks", default="auto",
                    help="scheduler.pipeline_chunks, or a comma-separated list (1,auto): one deployment each for "
                         "layouts of several stages (a lone long prompt's pieces; 1 = whole chunks)")
    ap.add_argument("--hf", action="store_true", help="transformers' generate on GPU 0")
    ap.add_argument("--hf-concurrency", default="", help="transformers' concurrencies (default: --concurrency); "
                    "its generate takes about 150 ms a step at 27B, so a sweep usually gives it fewer")
    ap.add_argument("--hf-device-map", default="", help="also transformers' generate with the model spread over "
                    "these GPUs (e.g. 0,1) as device_map=\"auto\" places it: the naive pipeline")
    ap.add_argument("--hf-first", action="store_true", help="run transformers before memra_pp")
    ap.add_argument("--prompt-spread", type=float, default=0.0,
                    help="prompt lengths drawn evenly from prompt-len x [1 - s, 1 + s] (memra_pp only): as traffic "
                         "has them, every mix of lengths a new prefill shape")
    from memra_pp import switches
    for name, env, _, on in SWITCH_ARGS:
        default = "on" if switches.SWITCHES[env][0] else "off"
        ap.add_argument(f"--{name.replace('_', '-')}", choices=("off", "on", "both"), default=default,
                        help=f"{env} in the stage processes: on, {on}; both: one deployment without, then one "
                             f"with (default {default}, as the runtime)")
    a = ap.parse_args()
    if a.hf_concurrency and not (a.hf or a.hf_device_map):
        ap.error("--hf-concurrency names transformers' concurrencies: give --hf or --hf-device-map too")
    try:
        hf_map = [int(x) for x in a.hf_device_map.split(",")] if a.hf_device_map else []
    except ValueError:
        ap.error(f"--hf-device-map {a.hf_device_map!r}: give comma-separated GPU indices, e.g. 0,1")
    if hf_map and max(hf_map) >= torch.cuda.device_count():
        ap.error(f"--hf-device-map {a.hf_device_map!r}: this machine has {torch.cuda.device_count()} GPU(s); "
                 f"name indices below that")
    os.makedirs(a.out, exist_ok=True)
    try:
        conc = [int(x) for x in a.concurrency.split(",")]
        hf_conc = [int(x) for x in a.hf_concurrency.split(",")] if a.hf_concurrency else conc
    except ValueError:
        ap.error(f"--concurrency {a.concurrency!r} / --hf-concurrency {a.hf_concurrency!r}: give comma-separated "
                 f"integers, e.g. 1,8,64")
    from memra_pp.model.config import parse_config
    from memra_pp.model import presets
    preset = presets.get(a.model.removeprefix("preset:"))
    text_config, mc = preset["text_config"], parse_config(preset)
    bw = copy_bandwidth()
    wb = weight_bytes_per_token(mc)
    ctx = a.prompt_len + a.new // 2
    rep = {"model": a.model, "copy_bandwidth_Bps": bw, "weight_bytes_per_token": wb,
           "floor_batch1_tokens_per_s": bw / wb, "gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "step_floor_tokens_per_s": {c: step_floor_tokens_per_s(mc, bw, c, ctx) for c in sorted({*conc, *hf_conc})},
           "argv": sys.argv, "date": time.strftime("%Y-%m-%d %H:%M"), "runs": []}
    print(f"copy {bw / 1e12:.2f} TB/s, weights {wb / 1e9:.1f} GB/token, batch-1 floor {bw / wb:.1f} tokens/s",
          flush=True)
    mb = a.microbatches if a.microbatches == "auto" else int(a.microbatches)
    try:
        pipeline_chunks = [x if x == "auto" else int(x) for x in a.pipeline_chunks.split(",")]
    except ValueError:
        ap.error(f"--pipeline-chunks {a.pipeline_chunks!r}: give auto or integers >= 1, comma-separated")
    try:
        chunks = [int(x) for x in a.prefill_chunk.split(",")]
    except ValueError:
        ap.error(f"--prefill-chunk {a.prefill_chunk!r}: give integers, comma-separated")
    try:
        decodings = [x if x == "off" else int(x) for x in a.prefill_chunk_decoding.split(",")]
    except ValueError:
        ap.error(f"--prefill-chunk-decoding {a.prefill_chunk_decoding!r}: give off or integers, comma-separated")

    def save():
        with open(os.path.join(a.out, "gpu_decode.json"), "w") as f:
            json.dump(rep, f, indent=1)

    def hf():
        runs = ([(["cuda"], "transformers")] if a.hf else []) \
            + ([(hf_map, f"transformers, device_map over {len(hf_map)} GPUs")] if hf_map else [])
        for devices, system in runs:
            try:
                run_hf(hf_conc, a.prompt_len, a.new, devices, text_config=text_config, system=system, out=rep["runs"],
                       save=save)
            except Exception as e:  # noqa: BLE001 - record it and go on: the rows measured so far are kept
                print(f"  {system} failed: {type(e).__name__}: {e}", flush=True)
                rep.setdefault("failed", []).append({"system": system, "error": f"{type(e).__name__}: {e}"})
            save()

    if a.hf_first:
        hf()
    for layout in filter(None, a.layouts.split(";")):
        layout, _, m = layout.partition("@")
        devices = [int(x) for x in layout.split(",")]
        mb_l = int(m) if m else mb
        if max(devices) < torch.cuda.device_count():
            # --deploy-each: one deployment per concurrency (max_batch = it), so a level that does not fit (its
            # recurrent state alone is 151 MB per sequence at 27B) fails alone: saturation = the highest that ran
            pcs = pipeline_chunks if len(devices) > 1 else pipeline_chunks[:1]   # one stage: never cut
            for sw, pc, chunk, pd, cs in [
                    (sw, pc, ch, pd, cs) for sw in switch_sides(a)
                    for pc in pcs for ch in chunks for pd in decodings if pd == "off" or pd <= ch
                    for cs in ([[c] for c in conc] if a.deploy_each else [conc])]:
                set_switches(a, sw)
                if len(chunks) > 1 or len(decodings) > 1:
                    print(f"  prefill_chunk {chunk}, prefill_chunk_decoding {pd}", flush=True)
                n0 = len(rep["runs"])
                try:
                    run_memra(a.model, devices, cs, a.prompt_len, a.new, mb_l, ttft=a.ttft, out=rep["runs"],
                              chunk=chunk, spread=a.prompt_spread, pipeline_chunks=pc, chunk_decoding=pd)
                except Exception as e:  # noqa: BLE001 - record it and go on
                    print(f"  layout {devices}, concurrency {cs} failed: {type(e).__name__}: {e}", flush=True)
                    rep.setdefault("failed", []).append({"devices": devices, "concurrency": cs, **sw,
                                                         "error": f"{type(e).__name__}: {e}"})
                for r in rep["runs"][n0:]:
                    r.update(sw)
                    r["pipeline_chunks"], r["prefill_chunk"], r["prefill_chunk_decoding"] = pc, chunk, pd
                save()
    if not a.hf_first:
        hf()
    save()
    plot(rep, os.path.join(a.out, "gpu_decode.png"))
    if len(decodings) > 1:  # a budget sweep: per budget, what a request waits and the rate (decode_budget's plot)
        plot_budget(rep, os.path.join(a.out, "budget.png"))
    ttfts = [r for r in rep["runs"] if r.get("kind") == "ttft" and r.get("timeline")]
    if ttfts:   # each layout's long prompt: every stage's chunks against time (is the prefill pipelined?)
        from memra_pp.bench import plot_timelines
        plot_timelines([(f"{r['n_stages']} stage(s) on cuda {r['devices']}: one {a.ttft}-token prompt, "
                         f"prefill_chunk {r.get('prefill_chunk')}, pipeline_chunks {r.get('pipeline_chunks')}",
                         r["timeline"]) for r in ttfts],
                       os.path.join(a.out, "ttft_timeline.png"), f"{a.model}, {rep['gpu']}")
    return 0


def plot_budget(rep: dict, path: str) -> None:
    """decode_budget.py's plot of this run's decode rows (one line per heap mode where both ran): one plot per
    layout, concurrency, prefill_chunk and pipeline_chunks (budget.png, or budget-1.png, budget-2.png, ...)."""
    from decode_budget import plot as plot_decode_budget
    groups: dict = {}
    for r in rep["runs"]:
        if r.get("kind") != "ttft" and "prefill_chunk_decoding" in r and not r.get("system"):
            key = (tuple(r["devices"]), r["concurrency"], r["prefill_chunk"], str(r.get("pipeline_chunks")))
            groups.setdefault(key, []).append(r)
    stem, ext = os.path.splitext(path)
    for k, runs in enumerate(groups.values(), 1):
        r = runs[0]
        plot_decode_budget(runs, path if len(groups) == 1 else f"{stem}-{k}{ext}",
                           f"{r['model']}, {rep['gpu']}: {r['concurrency']} requests at once, prompts "
                           f"{r['prompt_len']} x [1 -+ {r['prompt_spread']}], {r['max_new_tokens']} new, "
                           f"{r['n_stages']} stage(s) on cuda {r['devices']}, prefill_chunk {r['prefill_chunk']}")


def plot(rep: dict, path: str) -> None:
    """Three panels, one line per system measured: end-to-end tokens/s (prefill included), the decode rate
    (memra_pp: the steady window; transformers: over its per-step timestamps), the memory floor dotted; and what a
    request waits (memra_pp): time to first token p50 (solid) and inter-token latency p99 (dashed)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    floor = {int(c): v for c, v in rep["step_floor_tokens_per_s"].items()}
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    chunks = {r.get("prefill_chunk") for r in rep["runs"] if r.get("kind") != "ttft" and not r.get("system")}
    pds = {r.get("prefill_chunk_decoding") for r in rep["runs"] if r.get("kind") != "ttft" and not r.get("system")}
    lat = {}
    for panel, ax in zip(("end to end", "decode"), axes):
        systems = {}
        for r in rep["runs"]:
            if r.get("kind") == "ttft":
                continue
            name = r.get("system") or (f"memra_pp, {r['n_stages']} stage(s) on {len(set(r['devices']))} GPU(s)"
                                       + (f", {r['microbatches']} microbatches" if r.get("microbatches") not in
                                          (None, "auto") else "")
                                       + (", a graph per KV bucket" if r.get("any_kv") is False else "")
                                       + (", prefill not merged" if r.get("prefill_merged") is False else "")
                                       + (", cuDNN SDPA" if r.get("sdpa_cudnn") else "")
                                       + (", varlen prefill" if r.get("prefill_varlen") else "")
                                       + (", heap not frozen" if r.get("gc_freeze") is False else "")
                                       + (", eager prefill" if r.get("prefill_graphs") is False else "")
                                       + (", fla's rule eager" if r.get("prefill_graphs") and r.get("rule_graphs")
                                          is False else "")
                                       + (f", prefill_chunk {r['prefill_chunk']}" if len(chunks) > 1 else "")
                                       + (f" ({r.get('prefill_chunk_decoding')} while decoding)" if len(pds) > 1
                                          else "")
                                       + (", KV pools copied to grow" if "in place" not in r.get("kv_growth", [
                                           "in place"]) else ""))
            v = r["tokens_per_s"] if panel == "end to end" else r.get("decode_tokens_per_s")
            if panel == "decode":
                lat.setdefault(name, []).append((r["concurrency"], r.get("ttft_p50_s"), r.get("itl_p99_s")))
            if v is None:
                continue
            systems.setdefault(name, []).append((r["concurrency"], v))
        for name, pts in sorted(systems.items()):
            ax.plot(*zip(*sorted(pts)), marker="o", label=name)
        ax.plot(*zip(*sorted(floor.items())), ls=":", c="grey", label="decode memory floor (1 GPU)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(f"{panel} tokens / s")
        ax.set_title(f"{panel}: {rep['model']} dims, bf16 dummy weights, {rep['gpu']}", fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax = axes[2]
    for i, (name, pts) in enumerate(sorted(lat.items())):
        pts = sorted(p for p in pts if p[1] is not None and p[2] is not None)   # (transformers: none)
        if pts:
            c = f"C{i}"
            ax.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], marker="o", c=c, label=f"{name}: TTFT p50")
            ax.plot([p[0] for p in pts], [p[2] * 1e3 for p in pts], marker="x", ls="--", c=c,
                    label=f"{name}: inter-token p99")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("ms")
    ax.set_title("what a request waits", fontsize=8)
    ax.grid(alpha=0.3)
    if lat:     # below the panel: the points sit anywhere in it
        ax.legend(fontsize=6, loc="upper center", bbox_to_anchor=(0.5, -0.22))
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")


if __name__ == "__main__":
    raise SystemExit(main())
