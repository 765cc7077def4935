"""Time to first token of one long prompt with 1 and 2 stages, side by side in one run (issue 7, target 4: two
stages at most 0.6x one, chunked prefill pipelined across stages). Each stage is one process with one torch thread
(on CPU: one core per stage, the analogue of one GPU per stage); random weights (`format: dummy`) of a mid-sized
Qwen3.5 written as a config only. Prints the ratio and how many chunks followed their predecessor down the pipeline.

    .venv/bin/python benchmarks/prefill_pipeline.py [--prompt 2048] [--chunk 256] [--device cpu] [--json OUT]
        [--model DIR | preset:NAME] [--plot PNG] [--pipeline-chunks 1,auto]

Two stages run once per --pipeline-chunks value (scheduler.pipeline_chunks: 1 sends the prompt in whole
prefill_chunk chunks; auto cuts a lone prompt in 8 equal pieces), one deployment each.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time

MID = dict(vocab_size=4096, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
           num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
           linear_key_head_dim=64, linear_value_head_dim=64,
           rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                mrope_section=[4, 2, 2], mrope_interleaved=True))


def mid_model(d: str) -> str:
    from memra_pp.model.tiny import tiny_config
    cfg = tiny_config()
    cfg["text_config"].update(MID)
    cfg["text_config"]["layer_types"] = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                         for i in range(MID["num_hidden_layers"])]
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


def _matmuls(q=None) -> float:
    import torch
    torch.set_num_threads(1)
    a, w = torch.randn(256, 512), torch.randn(1536, 512)
    for _ in range(20):
        a @ w.T
    t = time.perf_counter()
    for _ in range(300):
        a @ w.T
    dt = time.perf_counter() - t
    if q is not None:
        q.put(dt)
    return dt


def parallel_scaling() -> float:
    """How much faster two single-threaded processes compute than one, on this machine (2.0: two real cores; a
    two-stage pipeline can at best gain what the hardware gives)."""
    import multiprocessing as mp
    alone = _matmuls()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    ps = [ctx.Process(target=_matmuls, args=(q,)) for _ in range(2)]
    for p in ps:
        p.start()
    both = [q.get() for _ in ps]
    for p in ps:
        p.join()
    return 2 * alone / max(both)


def ttft(dep, prompt: list[int], n: int) -> tuple[list[float], dict]:
    """n times the time to first token of `prompt`; and the stages' timeline of the last one (bench.timeline_since)."""
    from memra_pp.bench import timeline_since
    c = dep.client()
    c.generate(prompt[:16], max_new_tokens=2)          # warm
    out = []
    for _ in range(n):
        t, tm0 = time.perf_counter(), time.monotonic()
        next(iter(c.stream(prompt, max_new_tokens=1, ignore_eos=True)))
        out.append(time.perf_counter() - t)
    wall = time.monotonic() - tm0
    time.sleep(0.05)            # the primary's last span is summed once its stream is done
    c.close()
    return out, timeline_since(dep.stats(timeline=True)["stages"], tm0, out[-1], wall)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (stage i on cuda:i)")
    ap.add_argument("--model", default=None, help="a model directory or preset:NAME (dummy weights); default MID")
    ap.add_argument("--n", type=int, default=3)
    ap.add_argument("--json")
    ap.add_argument("--plot", help="a PNG of every run's last prompt: each stage's chunks against time")
    ap.add_argument("--pipeline-chunks", default="auto",
                    help="scheduler.pipeline_chunks for the two-stage runs, comma-separated (1,auto: side by side)")
    a = ap.parse_args()
    from memra_pp import switches
    switches.check_environment()   # strict: a typo in a MEMRA_PP_* switch must not run the default
    import ray
    import memra_pp
    ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False)
    tmp = tempfile.mkdtemp()
    path = a.model or mid_model(tmp)
    rng = random.Random(0)
    res = {"prompt": a.prompt, "chunk": a.chunk, "device": a.device, "model": a.model or MID, "runs": {}}
    pcs = [x if x == "auto" else int(x) for x in a.pipeline_chunks.split(",")]
    for n, pc in [(1, "auto")] + [(2, pc) for pc in pcs]:
        key = "1" if n == 1 else f"2, pipeline_chunks {pc}"
        dev = (lambda i: "cpu") if a.device == "cpu" else (lambda i: f"cuda:{i}")
        cfg = {"name": f"prefill{n}", "model": {"path": path, "format": "dummy",
                                                "dtype": "float32" if a.device == "cpu" else "bfloat16"},
               "stages": [{"device": dev(i), "num_cpus": 0.5, "threads": 1} for i in range(n)],
               "scheduler": {"max_batch": 2, "max_context": a.prompt + 64, "prefill_chunk": a.chunk,
                             "pipeline_chunks": pc}}
        with memra_pp.launch(cfg) as dep:
            from memra_pp.bench import bench_prompts, placeholder_ids
            prompt = bench_prompts(rng, 1, a.prompt, 0.0, dep.vocab_size, placeholder_ids(dep))[0]
            ts, tl = ttft(dep, prompt, a.n)
            st = dep.stats()["stages"]
        pre = [s[1] for s in tl["stages"][0] if s[0] == "prefill"]
        res["runs"][key] = {"ttft_s": ts, "median_s": statistics.median(ts), "pipeline_chunks": pc,
                            "pipelined_chunks": st[0].get("pipelined_chunks"), "prompts_cut": st[0].get("prompts_cut"),
                            "prefill_steps": pre, "busy": [s["busy"] for s in st], "timeline": tl}
        print(f"{n} stage(s){'' if n == 1 else f', pipeline_chunks {pc}'}: time to first token of a {a.prompt}-token "
              f"prompt, prefill_chunk {a.chunk}: median {statistics.median(ts) * 1e3:.0f} ms "
              f"({', '.join(f'{t * 1e3:.0f}' for t in ts)}); its {len(pre)} prefill steps {pre}; chunks pipelined "
              f"{st[0].get('pipelined_chunks')}", flush=True)
    if a.device == "cpu":
        res["cpu_parallel_scaling"] = parallel_scaling()
        print(f"this machine: two single-threaded processes compute {res['cpu_parallel_scaling']:.2f}x one "
              f"(2.00 = two real cores)", flush=True)
    one = res["runs"]["1"]["median_s"]
    for key, run in res["runs"].items():
        if key == "1":
            continue
        k = len(run["prefill_steps"]) or 1
        run["ratio_2_over_1"], run["ideal_pipelined"] = run["median_s"] / one, (k + 1) / (2 * k)
        print(f"two stages ({key.partition(', ')[2]}) / one stage: {run['ratio_2_over_1']:.2f} (a perfect two-stage "
              f"pipeline of its {k} steps: {run['ideal_pipelined']:.2f}; one step: >= 1.0)", flush=True)
    if a.json:
        json.dump(res, open(a.json, "w"), indent=1)
    if a.plot:
        from memra_pp.bench import plot_timelines
        plot_timelines([(("1 stage" if key == "1" else f"2 stages ({key.partition(', ')[2]})")
                         + f", {a.prompt}-token prompt, prefill_chunk {a.chunk}, on {a.device}"
                         + (f": {run['ratio_2_over_1']:.2f}x one stage" if key != "1" else ""), run["timeline"])
                        for key, run in res["runs"].items()], a.plot,
                       "time to first token, one long prompt alone: each stage's prefill steps")
    ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
