"""What `scheduler.prefill_chunk_decoding` buys and costs: one deployment per budget, in turn in one run, the same
requests each (all arriving at once, prompt lengths spread), and per budget the end-to-end rate, time to first token
and what a decoding request waits between tokens (inter-token p50, p99, the longest gap). Writes JSON and a PNG.

    .venv/bin/python benchmarks/decode_budget.py --out docs/results          # the tiny model on two CPU stages

On a GPU, benchmarks/gpu_decode.py --prefill-chunk-decoding off,1024 measures the same at the real dimensions.
"""
import argparse
import json
import os
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--model", default="", help="a checkpoint directory (default: the embedded tiny checkpoint)")
    ap.add_argument("--stages", default="cpu,cpu", help="one stage per entry: cpu or cuda:N")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--prompt-spread", type=float, default=0.5)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--prefill-chunk", type=int, default=512)
    ap.add_argument("--decoding", default="off,128,32", help="prefill_chunk_decoding values, comma-separated: one "
                    "deployment each")
    ap.add_argument("--gc-freeze", default="on", choices=("on", "off", "both"),
                    help="MEMRA_PP_GC_FREEZE in the stages (each freezes its heap at its start; the default on); "
                         "both: every budget without, then with")
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    try:
        budgets = [x if x == "off" else int(x) for x in a.decoding.split(",")]
    except ValueError:
        ap.error(f"--decoding {a.decoding!r}: give off or integers, comma-separated")
    # refused here, not by the placement's check at a later budget's launch: that lost the budgets run before it
    if any(pd != "off" and not 1 <= pd <= a.prefill_chunk for pd in budgets):
        ap.error(f"--decoding {a.decoding!r}: each value is off or an integer from 1 to --prefill-chunk "
                 f"({a.prefill_chunk})")
    import memra_pp
    from memra_pp.bench import run_bench
    from memra_pp.defaults import TINY_PATH, ensure_tiny
    if not a.model:
        ensure_tiny()
    stages = a.stages.split(",")
    runs = []
    for gc_freeze, pd in [(g, pd) for g in {"on": [True], "off": [False], "both": [False, True]}[a.gc_freeze]
                          for pd in budgets]:
        os.environ["MEMRA_PP_GC_FREEZE"] = "1" if gc_freeze else "0"    # (launch gives the stages the driver's)
        cfg = {"name": "budget", "model": {"path": a.model or str(TINY_PATH)},
               "stages": [{"device": d, "num_cpus": 0.5} for d in stages],
               "scheduler": {"max_batch": a.concurrency, "prefill_chunk": a.prefill_chunk,
                             "max_context": int(a.prompt_len * (1 + a.prompt_spread)) + a.new + 8,
                             "prefill_chunk_decoding": pd}}
        with memra_pp.launch(cfg) as dep:
            r = run_bench(dep, a.concurrency, a.prompt_len, a.new, prompt_spread=a.prompt_spread)
            held = dep.stats()["stages"][0]["prefill_held_back"]
        r.update(prefill_chunk_decoding=pd, prefill_chunk=a.prefill_chunk, n_stages=len(stages), held_back=held,
                 gc_freeze=gc_freeze)
        runs.append(r)
        print(f"gc freeze {'on' if gc_freeze else 'off'}, prefill_chunk {a.prefill_chunk}, while decoding {pd}: "
              f"{r['tokens_per_s']:.1f} tokens/s end to end, "
              f"ttft p50 {r['ttft_p50_s'] * 1e3:.0f} ms (p99 {r['ttft_p99_s'] * 1e3:.0f}), inter-token p50 "
              f"{r['itl_p50_s'] * 1e3:.1f} ms, p99 {r['itl_p99_s'] * 1e3:.1f} ms, longest {r['itl_max_s'] * 1e3:.0f} "
              f"ms; microbatches held back {held}", flush=True)
    os.makedirs(a.out, exist_ok=True)
    stem = os.path.join(a.out, "decode_budget" + (f"-{a.tag}" if a.tag else ""))
    with open(stem + ".json", "w") as f:
        json.dump({"argv": vars(a), "date": time.strftime("%Y-%m-%d %H:%M"), "runs": runs}, f, indent=1)
    plot(runs, stem + ".png", f"{a.concurrency} requests at once, prompts {a.prompt_len} x [1 -+ {a.prompt_spread}], "
                              f"{a.new} new, stages {a.stages}, prefill_chunk {a.prefill_chunk}")
    print(f"wrote {stem}.json and .png", flush=True)
    return 0


def plot(runs: list[dict], path: str, title: str) -> None:
    """Per budget (x), one line per heap mode: time to first token p50, inter-token p99 and the longest gap (left,
    ms, log), end-to-end tokens/s (right)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    budgets = list(dict.fromkeys(str(r["prefill_chunk_decoding"]) for r in runs))
    modes = list(dict.fromkeys(r.get("gc_freeze", True) for r in runs))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for gcf, ls in zip(modes, ("-", "--")):
        rs = {str(r["prefill_chunk_decoding"]): r for r in runs if r.get("gc_freeze", True) == gcf}
        xs = [b for b in budgets if b in rs]
        heap = "" if len(modes) == 1 else (", heap frozen" if gcf else ", heap not frozen")
        for key, label, c in (("ttft_p50_s", "time to first token p50", "C0"), ("itl_p99_s", "inter-token p99", "C1"),
                              ("itl_max_s", "longest gap", "C2")):
            axes[0].plot(xs, [rs[b][key] * 1e3 for b in xs], ls=ls, c=c, marker="o", label=label + heap)
        axes[1].plot(xs, [rs[b]["tokens_per_s"] for b in xs], ls=ls, c="C3", marker="o", label="end to end" + heap)
    axes[0].set_ylabel("ms")
    axes[0].set_yscale("log")
    axes[1].set_ylabel("tokens/s")
    axes[1].set_ylim(bottom=0)
    for ax in axes:
        ax.set_xlabel("prompt tokens in flight while requests decode (scheduler.prefill_chunk_decoding)")
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
