"""The Gated DeltaNet prefill's chunked rule alone (memra_pp/model/fla_rule.py over flash-linear-attention), host
and device time per layer for one prefill step's worth of segments, the ways the engine can call it:

- equal: B prompts of n tokens as one batched call (the groups path's best case: every length the same);
- groups: prompts of spread lengths (n x [1-S, 1+S], gpu_engine_step.spread_lengths) one batched call per group of
  equal lengths, as GatedDeltaNet.forward does without MEMRA_PP_PREFILL_VARLEN (every length differs: B calls);
- varlen: the same prompts as one variable-length call (FlaRule.chunk_varlen, the chunk indices made on the host);
- varlen-equal: the equal prompts as one variable-length call;
- graphs: the same prompts through the rule graphs (model/prefill_graphs.RuleGraphs: the call replayed from a CUDA
  graph per row and segment bucket, inputs copied into its static buffers), where the step fits their buckets; the
  report gives their capture time and memory;
- padded: the rule graphs' same padded call over their static buffers, eagerly (no replay): where graphs' kernels
  take longer than varlen's, whether the padding or the replay costs it. The report ends with the configs fla's
  autotuned kernels chose, per key (`autotune`), since a kernel tuned at another shape first keeps that config.

With the conv (kernels/prefill.conv_prefill per group against conv_varlen) in each way too; a group's rows a slice
where consecutive, as the engine takes them. Host time is the enqueue time of `--iters` calls without a sync (the
device queue does not fill at these counts); device time from CUDA events around the same calls queued behind a
sleep kernel, so that it is the kernels' time and not the host's, and the kernels' durations summed by the profiler
(kernels_us: the same where the launch queue held every call). fla's own backend dispatch is off for memra_pp's
calls (FLA_FLASH_QLA=0, fla_rule); the report says whether flash_qla was installed. --cprofile prints where one
way's host time goes in Python (the twenty-sixth session's profile had fla's chunk at about 1 ms of host time a layer
in the MoE's prefill step, ~30 ms a step).

    python -u benchmarks/fla_host.py --out DIR [--model preset:qwen3.5-35b-a3b] [--prompts 8x512~0.5] [--cprofile]

--chunk-configs 1x1024,1x4096,8x256,16x128 (with --checks-only to skip the rest): each tuned kernel of the chunked
rule with each config of its autotuner pinned in turn, over those segment layouts; a summary of the config in use
against the fastest, and DIR/chunk_configs.png (docs/PERF.md, forty-second session).
"""
from __future__ import annotations

import argparse
import json
import os
import time
import types

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="preset:qwen3.5-35b-a3b")
    ap.add_argument("--prompts", default="8x512~0.5,16x256~0.75", help="comma-separated BxN~S (gpu_engine_step's "
                    "--prefill spelling, no decode rows)")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--cprofile", action="store_true", help="cProfile each way's calls (host side)")
    ap.add_argument("--checks-only", action="store_true", help="only the empty-segment and graph-replay checks")
    ap.add_argument("--kkt-probe", action="store_true", help="fla's fused kkt-solve kernel alone, eagerly, on fresh "
                    "inputs and on the rule graphs' static buffers, with the exact layout, the rule graphs' padded one "
                    "and one with chunks past the segment's end")
    ap.add_argument("--kkt-grid", action="store_true", help="fla's fused kkt-solve kernel alone over one segment "
                    "with chunk programs added past its end, in front, or as real chunks of longer segments: does "
                    "the rule graphs' 65%% come from the grid's size or from programs that do nothing?")
    ap.add_argument("--kkt-configs", action="store_true", help="--kkt-grid's layouts (a subset) once per config "
                    "of the kkt-solve kernel's autotuner, each pinned: what the autotuner's choice costs")
    ap.add_argument("--kkt-plot-from", metavar="JSON", help="only draw DIR/kkt_configs.png from a report's "
                    "kkt_configs (no GPU needed)")
    ap.add_argument("--chunk-configs", metavar="LAYOUTS", help="every tuned kernel of fla's chunked rule, each "
                    "config of its autotuner pinned in turn (the others as this process tuned them), timed in the "
                    "variable-length call over segment layouts BxN (comma-separated, e.g. 1x1024,1x4096,8x256): "
                    "what each autotuner's choice, made on the warm-up's one chunk, costs at a step's sizes")
    a = ap.parse_args()
    if a.kkt_plot_from:
        os.makedirs(a.out, exist_ok=True)
        print(plot_kkt_configs(json.load(open(a.kkt_plot_from))["kkt_configs"], os.path.join(a.out,
                                                                                          "kkt_configs.png")))
        return 0
    from memra_pp import switches
    switches.check_environment()   # strict: a typo in a MEMRA_PP_* switch must not run the default
    assert torch.cuda.is_available(), "fla_host.py times the GPU path: it needs a CUDA GPU"
    os.makedirs(a.out, exist_ok=True)
    from gpu_engine_step import prefill_shape, spread_lengths
    from memra_pp.kernels import prefill as pf
    from memra_pp.model import fla_rule, presets
    from memra_pp.model.batch import StepBatch
    t = presets.get(a.model.removeprefix("preset:"))["text_config"]
    H, HV, D, K = t["linear_num_key_heads"], t["linear_num_value_heads"], t["linear_key_head_dim"], \
        t["linear_conv_kernel_dim"]
    C = 2 * H * D + HV * D
    dev = torch.device("cuda")
    pf.VARLEN = True                 # the warm-up tunes the variable-length call too
    rule = fla_rule.FlaRule()
    rule.warm_up(HV, D, D, torch.bfloat16, dev, k_heads=H)
    qh = H if rule.gva else HV
    gen = torch.Generator(device=dev).manual_seed(0)
    import importlib.util
    rep = {"model": a.model, "gpu": torch.cuda.get_device_name(), "gva": rule.gva, "rows": [],
           "flash_qla_installed": importlib.util.find_spec("flash_qla") is not None,
           "FLA_FLASH_QLA": os.environ.get("FLA_FLASH_QLA")}
    print(f"{a.model}: q/k heads {H}, v heads {HV}, dim {D}, gva {rule.gva}; {torch.cuda.get_device_name()}; "
          f"flash_qla installed {rep['flash_qla_installed']}, FLA_FLASH_QLA={rep['FLA_FLASH_QLA']}", flush=True)

    def r(*s, dt=torch.bfloat16):
        return torch.randn(*s, device=dev, generator=gen).to(dt)

    rg = None
    if not a.checks_only:       # the rule graphs for every bucket up to the prefill graphs' row cap
        from memra_pp.model import prefill_graphs
        torch.cuda.synchronize()
        m0, r0, t0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved(), time.perf_counter()
        dims = types.SimpleNamespace(**{k: t[k] for k in ("linear_num_key_heads", "linear_num_value_heads",
                                                          "linear_key_head_dim", "linear_value_head_dim")})
        rg = prefill_graphs.RuleGraphs(rule, dims, prefill_graphs.MAX_ROWS, torch.bfloat16, dev)
        n = rg.capture_all()
        torch.cuda.synchronize()
        rep["rule_graphs"] = {"graphs": n, "capture_s": time.perf_counter() - t0,
                              "allocated_bytes": torch.cuda.memory_allocated() - m0,
                              "reserved_bytes": torch.cuda.memory_reserved() - r0}
        print(f"  rule graphs: {rep['rule_graphs']}", flush=True)

    if a.kkt_grid:
        rep["kkt_grid"] = kkt_grid(qh, HV, D, dev, gen)
        for row in rep["kkt_grid"]:
            print(f"  kkt grid: {row['layout']:<28} {row['programs']:3d} chunk programs: kkt-solve "
                  f"{row['kernels_us'].get(KKT_KERNEL, float('nan')):6.2f} us", flush=True)
    if a.kkt_configs:
        rep["kkt_configs"] = kkt_configs(qh, HV, D, dev, gen)
        plot_kkt_configs(rep["kkt_configs"], os.path.join(a.out, "kkt_configs.png"))
        for row in rep["kkt_configs"]:
            print(f"  kkt config {row['config']:<28} {row['layout']:<22} {row['programs']:3d} programs: "
                  f"kkt-solve {row['kernels_us'].get(KKT_KERNEL, float('nan')):6.2f} us", flush=True)
    if a.chunk_configs:
        rep["chunk_configs"] = chunk_configs(rule, qh, HV, D, dev, gen, chunk_layouts(a.chunk_configs), a.iters)
        plot_chunk_configs(rep["chunk_configs"], os.path.join(a.out, "chunk_configs.png"), a.model)
        for line in chunk_config_summary(rep["chunk_configs"]):
            print("  " + line, flush=True)
    if a.kkt_probe and rg is not None:
        rep["kkt_probe"] = kkt_probe(rg, qh, HV, D, dev, gen)
        for row in rep["kkt_probe"]:
            print(f"  kkt probe: {row}", flush=True)
    for spec in ([] if a.checks_only else a.prompts.split(",")):
        B, n, _, spread = prefill_shape(spec)
        for label, lens in ((("spread", spread_lengths(B, n, spread)),) if spread else ()) + (("equal", [n] * B),):
            R = sum(lens)
            step = StepBatch(list(range(B)), [0] * B, lens, StepBatch.text_positions([0] * B, lens), [True] * B)
            seg = pf.segments(step, dev, K)
            q, k, v = r(1, R, qh, D), r(1, R, qh, D), r(1, R, HV, D)
            g, beta = -torch.rand(1, R, HV, device=dev, generator=gen), r(1, R, HV).sigmoid()
            u, w = r(R, C), r(C, K)
            s0, c0 = torch.zeros(B, HV, D, D, device=dev), torch.zeros(B, C, K - 1, device=dev, dtype=torch.bfloat16)
            groups = step.groups("length", dev)     # as GatedDeltaNet.forward groups them without VARLEN

            def by_groups():     # a group's rows a slice where consecutive, as the engine takes them (pf.whole)
                for idx, rows, _, span in groups:
                    G, m = len(idx), lens[idx[0]]
                    pf.conv_prefill(u, rows, w, c0[:G], G, m, (qh * D, qh * D, HV * D))
                    rule.chunk(*((x[0, span] if span is not None else x[0, rows]).view(G, m, *x.shape[2:])
                                 for x in (q, k, v, g, beta)), s0[:G])

            def one_call():
                pf.conv_varlen(u, seg, w, c0, (qh * D, qh * D, HV * D))
                rule.chunk_varlen(q, k, v, g, beta, s0, seg.cu, seg.chunks)

            def graphs():       # as one_call, the rule replayed (fresh prompts: zero states, none read)
                pf.conv_varlen(u, seg, w, c0, (qh * D, qh * D, HV * D))
                rg.run(q, k, v, g, beta, s0, None, seg)

            def padded():       # as graphs, the same padded call eagerly (RuleGraphs.run calls it where no graph)
                key = (prefill_graphs.bucket(R, rg.rows), prefill_graphs.bucket(B + 1, prefill_graphs.SEGMENT_BUCKETS))
                held, rg.graphs[key] = rg.graphs[key], None
                try:
                    graphs()
                finally:
                    rg.graphs[key] = held
            ways = {"groups" if label == "spread" else "equal": by_groups,
                    "varlen" if label == "spread" else "varlen-equal": one_call}
            if rg is not None and rg.takes(R, B):
                ways["graphs" if label == "spread" else "graphs-equal"] = graphs
                ways["padded" if label == "spread" else "padded-equal"] = padded
            for way, fn in ways.items():
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
                h0 = time.perf_counter()
                for _ in range(a.iters):
                    fn()
                host = (time.perf_counter() - h0) / a.iters * 1e6      # enqueue time, no sync inside
                torch.cuda.synchronize()
                # the device's own time: the stream held back by a sleep kernel (about twice the enqueue time, at
                # 2 GHz) while the host queues every call, so the events time the kernels back to back and not the
                # host's pace (where the host is the slower, timing events around its loop give its time)
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(int(host * a.iters * 4e3))
                e0.record()
                for _ in range(a.iters):
                    fn()
                e1.record()
                torch.cuda.synchronize()
                device = e0.elapsed_time(e1) / a.iters * 1e3
                # and the kernels' own durations summed (CUPTI): what the device spends whatever the host's pace (a
                # way of more launches than the queue holds, ~1,024, meets the host again behind the sleep kernel)
                from torch.profiler import ProfilerActivity, profile
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    for _ in range(a.iters):
                        fn()
                    torch.cuda.synchronize()
                kernels = sum(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
                              for e in prof.key_averages()) / a.iters
                open(os.path.join(a.out, f"kernels-{spec.replace('~', 's')}-{way}.txt"), "w").write(  # by kernel
                    f"{a.iters} calls\n" + prof.key_averages().table(sort_by="cuda_time_total", row_limit=30))
                row = {"prompts": spec, "lens": lens, "way": way, "calls": len(groups) if "groups" in way or
                       way == "equal" else 1, "host_us": host, "device_us": device, "kernels_us": kernels}
                rep["rows"].append(row)
                print(f"  {spec} {way:12s} ({len(set(lens))} lengths, {R} tokens): host {host:8.1f} us, device "
                      f"{device:8.1f} us, kernels {kernels:8.1f} us a layer", flush=True)
                if a.cprofile:
                    import cProfile
                    import io
                    import pstats
                    pr = cProfile.Profile()
                    pr.enable()
                    for _ in range(a.iters):
                        fn()
                    pr.disable()
                    torch.cuda.synchronize()
                    s = io.StringIO()
                    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(25)
                    open(os.path.join(a.out, f"cprofile-{spec.replace('~', 's')}-{way}.txt"), "w").write(s.getvalue())
    rep["empty_segments"] = empty_segments(rule, qh, HV, D, dev, gen)
    print(f"  empty segments: {rep['empty_segments']}", flush=True)
    for fresh in (False, True):
        key = "graph_replay" + ("_fresh_cu" if fresh else "")
        rep[key] = graph_replay(rule, qh, HV, D, dev, gen, fresh)
        print(f"  {key}: {rep[key]}", flush=True)
    rep["autotune"] = autotuned()
    for name, got in rep["autotune"].items():
        print(f"  autotuned {name}: {got}", flush=True)
    json.dump(rep, open(os.path.join(a.out, "fla_host.json"), "w"), indent=1)
    return 0


def kkt_inputs(R: int, qh: int, HV: int, D: int, dev, gen) -> tuple:
    """Random inputs of fla's intra call over R rows: k [1, R, qh, D] l2-normalised, v [1, R, HV, D] (bf16), g
    [1, R, HV] (float32, negative), beta [1, R, HV] (bf16, in (0, 1))."""
    def r(*shape, dt=torch.bfloat16):
        return torch.randn(*shape, device=dev, generator=gen).to(dt)
    k = torch.nn.functional.normalize(r(1, R, qh, D).float(), dim=-1).to(torch.bfloat16)
    v, beta = r(1, R, HV, D), r(1, R, HV).sigmoid()
    return k, v, -torch.rand(1, R, HV, device=dev, generator=gen), beta


def kkt_probe(rg, qh: int, HV: int, D: int, dev, gen, R: int = 1024, iters: int = 20) -> list[dict]:
    """fla's fused kkt-solve (chunk_gated_delta_rule_fwd_intra, whose first kernel it is) on R rows of one segment,
    eagerly, its kernels' mean times (profiler): inputs fresh tensors or the rule graphs' static buffers (or fresh
    tensors sliced from buffers of twice the rows), the layout exact, padded as the rule graphs pad it (one
    trailing empty segment, two filler chunks of it) or with two chunks past the segment's end instead. The
    thirty-ninth session saw the kernel 65% slower in the rule graphs; the fortieth the same in their padded call
    run eagerly."""
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.utils import chunk_local_cumsum
    k, v, g, beta = kkt_inputs(R, qh, HV, D, dev, gen)
    n1 = R // 64
    exact = segments([R], dev)
    cu, ch = rg.padded([R], R, 2)       # the rule graphs' own padding for R rows in their smallest segment bucket
    padded = (torch.tensor(cu, device=dev), torch.tensor(ch, device=dev).view(-1, 2))
    # the same two programs more, as chunks past the one segment's end (no empty segment)
    overrun = (exact[0], torch.tensor([[0, j] for j in range(n1 + 2)], device=dev))
    rg.k[:, :R].copy_(k)
    rg.v[:, :R].copy_(v)
    rg.g[:, :R].copy_(g)
    rg.beta[:, :R].copy_(beta)
    static = (rg.k[:, :R], rg.v[:, :R], rg.g[:, :R], rg.beta[:, :R])

    def big(x):
        b = torch.empty(x.shape[0], 2 * R, *x.shape[2:], dtype=x.dtype, device=dev)
        b[:, :R] = x
        return b[:, :R]
    inputs = {"fresh": (k, v, g, beta), "static": static, "sliced": tuple(big(x) for x in (k, v, g, beta))}
    rows = []
    for name, (k_, v_, g_, b_) in inputs.items():
        for lay, (cu, ch) in (("exact", exact), ("padded", padded), ("overrun", overrun)):
            gc = chunk_local_cumsum(g_, chunk_size=64, cu_seqlens=cu, chunk_indices=ch)

            rows.append({"inputs": name, "layout": lay, "kernels_us": kernel_times(
                lambda: chunk_gated_delta_rule_fwd_intra(k_, v_, gc, b_, cu_seqlens=cu, chunk_size=64,
                                                         chunk_indices=ch), iters)})
    return rows


KKT_KERNEL = "chunk_gated_delta_rule_fwd_kkt_solve_kernel"


def kernel_times(call, iters: int) -> dict:
    """{kernel: mean device us a call} of call() (profiler), after three warm-up calls."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            call()
        torch.cuda.synchronize()
    t = {}
    for e in prof.key_averages():
        us = (getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)) / iters
        if us:
            t[e.key] = round(us, 2)
    return t


def kkt_grid_layouts(n1: int = 16) -> list[tuple[str, int, list[int], list[list[int]]]]:
    """(label, rows, cu_seqlens, chunk indices) of one segment: n1 real chunks exactly; then 1, 2 and n1 chunk
    programs past its end (they return at once), 2 of them in front; the real chunks twice (2 n1 programs that
    all work); and real segments of n1 + 1, n1 + 2 and 2 n1 chunks (the same grids, every program working)."""
    def real(n):
        return [[0, j] for j in range(n)]

    def past(lo, n):
        return [[0, j] for j in range(lo, lo + n)]
    R = 64 * n1
    return [("exact", R, [0, R], real(n1)),
            ("1 past the end", R, [0, R], real(n1) + past(n1, 1)),
            ("2 past the end", R, [0, R], real(n1) + past(n1, 2)),
            ("2 in front", R, [0, R], past(n1, 2) + real(n1)),
            (f"{n1} past the end", R, [0, R], real(n1) + past(n1, n1)),
            ("the real chunks twice", R, [0, R], real(n1) * 2),
            (f"exact, {n1 + 1} chunks", R + 64, [0, R + 64], real(n1 + 1)),
            (f"exact, {n1 + 2} chunks", R + 128, [0, R + 128], real(n1 + 2)),
            (f"exact, {2 * n1} chunks", 2 * R, [0, 2 * R], real(2 * n1))]


def kkt_configs(qh: int, HV: int, D: int, dev, gen, n1: int = 16, iters: int = 20) -> list[dict]:
    """kkt_grid over a few layouts (exact, 2 past the end, 2 and n1 more real chunks) once per config of the
    kkt-solve kernel's autotuner, pinned (its configs cut to that one, its cache emptied); the autotuner left as it
    was after."""
    from fla.ops.gated_delta_rule import chunk_fwd
    from memra_pp.model.fla_rule import _autotuner
    tuner = _autotuner(chunk_fwd.chunk_gated_delta_rule_fwd_kkt_solve_kernel)
    configs, cache = list(tuner.configs), dict(tuner.cache)     # (all of fla's, where fla_rule pinned one)
    keep = ("exact", "2 past the end", f"exact, {n1 + 2} chunks", f"exact, {2 * n1} chunks")
    rows = []
    try:
        for cfg in getattr(tuner, "_memra_all", None) or configs:
            tuner.configs, tuner.cache = [cfg], {}
            for row in kkt_grid(qh, HV, D, dev, gen, n1, iters, only=keep):
                rows.append({"config": str(cfg).split(", num_ctas")[0], **row})
    finally:
        tuner.configs, tuner.cache = configs, cache
    return rows


def plot_kkt_configs(rows: list[dict], path: str) -> str:
    """kkt-solve's time against its layout, one line per pinned config (kkt_configs' rows); the path written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    fig, ax = plt.subplots(figsize=(7.5, 4))
    for cfg in dict.fromkeys(r["config"] for r in rows):
        got = {r["layout"]: r["kernels_us"].get(KKT_KERNEL) for r in rows if r["config"] == cfg}
        ax.plot(range(len(layouts)), [got.get(lay) for lay in layouts], marker="o", label=cfg)
    ax.set_xticks(range(len(layouts)))
    ax.set_xticklabels([f"{lay}\n({next(r['programs'] for r in rows if r['layout'] == lay)} programs a head)"
                        for lay in layouts], fontsize=8)
    ax.set_ylabel("kkt-solve kernel, us")
    ax.set_ylim(bottom=0)
    ax.set_title("fla's fused kkt-solve, one segment of 1,024 rows, each autotuner config pinned", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


CHUNK_KERNELS = (("fla.ops.gated_delta_rule.chunk_fwd", KKT_KERNEL),
                 ("fla.ops.gated_delta_rule.wy_fast", "recompute_w_u_fwd_kernel"),
                 ("fla.ops.common.chunk_delta_h", "chunk_gated_delta_rule_fwd_kernel_h_blockdim64"),
                 ("fla.ops.common.chunk_o", "chunk_fwd_kernel_o"))


def chunk_layouts(spec: str) -> list[tuple[str, list[int]]]:
    """'1x1024,8x256' -> [('1x1024', [1024]), ('8x256', [256] * 8)]: B segments of N rows each."""
    out = []
    for part in spec.split(","):
        b, n = part.strip().split("x")
        out.append((part.strip(), [int(n)] * int(b)))
    return out


def config_label(cfg) -> str:
    """A Triton config as 'BV 64, 4 warps, 3 stages'."""
    kw = "".join(f"{k} {v}, " for k, v in cfg.kwargs.items())
    return f"{kw}{cfg.num_warps} warps, {cfg.num_stages} stages"


def chunk_configs(rule, qh: int, HV: int, D: int, dev, gen, layouts, iters: int = 20) -> list[dict]:
    """For each autotuned kernel of fla's chunked rule (CHUNK_KERNELS), each config of its autotuner pinned in turn
    (cut to that one, its cache emptied; every other kernel as this process tuned or pinned it): that kernel's device
    time in rule.chunk_varlen over each layout's segments (fresh random inputs, zero-free states). Rows: kernel,
    config, layout, us (None where the config failed: error), in_use (the config this process's variable-length
    call runs there: its autotuner's pick from the warm-up, fla_rule's pin, or the rule's grid pick for the layout,
    MEMRA_PP_CHUNK_H_GRID). Each autotuner, and the rule's grid pick, are left as they were."""
    inputs, nseg = {}, dict(layouts)
    for label, lens in layouts:
        q, k, v, g, beta, s0 = rule_inputs(sum(lens), len(lens), qh, HV, D, dev, gen)
        inputs[label] = (q, k, v, g, beta, s0, *segments(lens, dev))
    rows = []
    rule.chunk_varlen(*next(iter(inputs.values())))     # (each autotuner's best_config: what this call runs)
    pick = getattr(rule, "_chunk_h", None)     # (fla_rule.GridPick, MEMRA_PP_CHUNK_H_GRID: off while pinning here)
    rule._chunk_h = None
    try:
        _chunk_configs(rule, inputs, nseg, pick, HV, D, dev, iters, rows)
    finally:
        rule._chunk_h = pick
    return rows


def _chunk_configs(rule, inputs: dict, nseg: dict, pick, HV: int, D: int, dev, iters: int, rows: list) -> None:
    import importlib

    from memra_pp.model.fla_rule import _autotuner
    for mod, name in CHUNK_KERNELS:
        try:
            tuner = _autotuner(getattr(importlib.import_module(mod), name, None))
        except ImportError:
            tuner = None
        if tuner is None:
            continue
        configs, cache = list(tuner.configs), dict(tuner.cache)
        used = config_label(tuner.best_config) if getattr(tuner, "best_config", None) is not None else None
        try:
            for cfg in getattr(tuner, "_memra_all", None) or configs:
                tuner.configs, tuner.cache = [cfg], {}
                for label, args in inputs.items():
                    in_use = config_label(cfg) == used if pick is None or tuner is not pick.tuner else \
                        pick.choose(len(nseg[label]), HV, D, dev) is cfg        # (picked call by call)
                    row = {"kernel": name, "config": config_label(cfg), "layout": label, "in_use": in_use}
                    try:
                        row["us"] = kernel_times(lambda args=args: rule.chunk_varlen(*args), iters).get(name)
                    except Exception as e:  # noqa: BLE001 - a config this GPU cannot run (shared memory)
                        row["us"], row["error"] = None, f"{type(e).__name__}: {e}"[:200]
                    rows.append(row)
        finally:
            tuner.configs, tuner.cache = configs, cache


def chunk_config_summary(rows: list[dict]) -> list[str]:
    """Per kernel and layout: the config in use and its time, the fastest config and its time; then per layout the
    kernels' sum in use against the sum of the fastest (what pinning each to its fastest there would save)."""
    lines, tot = [], {}
    for kernel in dict.fromkeys(r["kernel"] for r in rows):
        for layout in dict.fromkeys(r["layout"] for r in rows):
            got = [r for r in rows if r["kernel"] == kernel and r["layout"] == layout and r["us"] is not None]
            if not got:
                continue
            best = min(got, key=lambda r: r["us"])
            use = next((r for r in got if r["in_use"]), None)
            t = tot.setdefault(layout, [0.0, 0.0])
            t[0] += use["us"] if use else float("nan")
            t[1] += best["us"]
            lines.append(f"{kernel:<48} {layout:<8} in use {use['us'] if use else float('nan'):8.2f} us "
                         f"({use['config'] if use else 'none tuned'}); fastest {best['us']:8.2f} us ({best['config']})")
    for layout, (u, b) in tot.items():
        lines.append(f"chunk kernels {layout:<8} in use {u:8.2f} us a layer, each at its fastest {b:8.2f} us "
                     f"({u / b:.2f}x)")
    return lines


def plot_chunk_configs(rows: list[dict], path: str, title: str = "") -> str:
    """One panel per kernel: its time at each layout, one line per config, the one in use drawn thick; the path."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    kernels = list(dict.fromkeys(r["kernel"] for r in rows))
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    fig, axes = plt.subplots(1, max(len(kernels), 1), figsize=(4.2 * max(len(kernels), 1), 4.2), squeeze=False)
    for ax, kernel in zip(axes[0], kernels):
        for cfg in dict.fromkeys(r["config"] for r in rows if r["kernel"] == kernel):
            got = {r["layout"]: r for r in rows if r["kernel"] == kernel and r["config"] == cfg}
            use = any(r["in_use"] for r in got.values())
            ax.plot(range(len(layouts)), [got[lay]["us"] if lay in got else None for lay in layouts], marker="o",
                    lw=3 if use else 1, label=cfg + (" (in use)" if use else ""))
        ax.set_xticks(range(len(layouts)))
        ax.set_xticklabels(layouts, fontsize=8)
        ax.set_yscale("log")
        ax.set_title(kernel.replace("chunk_gated_delta_rule_", ""), fontsize=8)
        ax.set_ylabel("kernel, us a call")
        ax.legend(fontsize=5)
    fig.suptitle(f"fla's chunked rule, each autotuner config pinned: {title}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def kkt_grid(qh: int, HV: int, D: int, dev, gen, n1: int = 16, iters: int = 20, only=None) -> list[dict]:
    """fla's fused kkt-solve (chunk_gated_delta_rule_fwd_intra) over kkt_grid_layouts, on fresh inputs: whether
    chunk programs that return at once cost what working ones do (the grid's size: waves) or more."""
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.utils import chunk_local_cumsum
    rows = []
    for label, R, cu, ch in kkt_grid_layouts(n1):
        if only is not None and label not in only:
            continue
        k, v, g, beta = kkt_inputs(R, qh, HV, D, dev, gen)
        cu_t, ch_t = torch.tensor(cu, device=dev), torch.tensor(ch, device=dev).view(-1, 2)
        gc = chunk_local_cumsum(g, chunk_size=64, cu_seqlens=cu_t, chunk_indices=ch_t)
        rows.append({"layout": label, "rows": R, "programs": len(ch), "kernels_us": kernel_times(
            lambda: chunk_gated_delta_rule_fwd_intra(k, v, gc, beta, cu_seqlens=cu_t, chunk_size=64,
                                                     chunk_indices=ch_t), iters)})
    return rows


def autotuned() -> dict:
    """{kernel: {key: config}} of every fla autotuner that has tuned something in this process."""
    import sys

    from triton.runtime.autotuner import Autotuner
    out = {}
    for mod in [m for name, m in list(sys.modules.items()) if name.startswith("fla.") and m is not None]:
        for name, obj in list(vars(mod).items()):
            while obj is not None and not isinstance(obj, Autotuner) and hasattr(obj, "fn"):
                obj = obj.fn        # under heuristics
            if isinstance(obj, Autotuner) and obj.cache:
                out[name] = {str(k): str(v) for k, v in obj.cache.items()}
    return out


def rule_inputs(R: int, N: int, qh: int, HV: int, D: int, dev, gen) -> tuple:
    """Random q, k, v [1, R, heads, D], g, beta [1, R, HV] and states [N, HV, D, D] (float32) for the rule."""
    def r(*shape, dt=torch.bfloat16):
        return torch.randn(*shape, device=dev, generator=gen).to(dt)
    q, k, v = r(1, R, qh, D), r(1, R, qh, D), r(1, R, HV, D)
    g, beta = -torch.rand(1, R, HV, device=dev, generator=gen), r(1, R, HV).sigmoid()
    return q, k, v, g, beta, (r(N, HV, D, D, dt=torch.float32) * 0.1).contiguous()


def segments(lens: list[int], dev, pad_chunks: int = 0) -> tuple:
    """fla's cu_seqlens and chunk indices (segment, chunk) of 64-token chunks for segments of `lens`; up to
    `pad_chunks` chunks, with indices past the last segment's end (every row masked) as padding."""
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    ch = [[i, j] for i, n in enumerate(lens) for j in range(-(-n // 64))]
    ch += [[len(lens) - 1, 1000]] * max(pad_chunks - len(ch), 0)
    return torch.tensor(cu, device=dev), torch.tensor(ch, device=dev).view(-1, 2)


def empty_segments(rule, qh: int, HV: int, D: int, dev, gen) -> dict:
    """Whether fla's variable-length call takes empty segments (cu_seqlens repeating an offset; no chunk of theirs
    in the chunk indices), as padding to a graph's segment bucket would need (docs/PERF.md, the twenty-eighth
    session): the other segments' outputs and states as without them, and an empty segment's final state its
    initial one (passed through) or something else (reported, not asserted: what the next design must know)."""
    lens = [70, 0, 33, 0]
    q, k, v, g, beta, s0 = rule_inputs(sum(lens), len(lens), qh, HV, D, dev, gen)

    def call(ls, states):
        return rule.chunk_varlen(q, k, v, g, beta, states, *segments(ls, dev))
    try:
        o, st = call(lens, s0)
        o2, st2 = call([70, 33], s0[[0, 2]])
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - the answer is that it does not
        return {"taken": False, "error": f"{type(e).__name__}: {e}"[:300]}
    return {"taken": True, "others_output_max_diff": (o.float() - o2.float()).abs().max().item(),
            "others_state_max_diff": (st[[0, 2]] - st2).abs().max().item(),
            "empty_state_passed_through": bool(torch.equal(st[[1, 3]], s0[[1, 3]])),
            "empty_state_max_diff_from_initial": (st[[1, 3]] - s0[[1, 3]]).abs().max().item()}


def graph_replay(rule, qh: int, HV: int, D: int, dev, gen, fresh: bool = False) -> dict:
    """Whether fla's variable-length call, captured once in a CUDA graph over static buffers (rows, states,
    cu_seqlens, chunk indices), replays right for other segment lengths of the same rows, segment count and chunk
    count (a chunk index past its segment's end pads the count): each replay against an eager call on fresh
    tensors. A stale replay means fla derived something from cu_seqlens at capture and kept it by the tensor's
    identity (fla's tensor_cache), so the graph holds no kernel for it: the second prerequisite for prefill graphs
    (docs/PERF.md, the twenty-eighth and thirty-seventh sessions). Reported, not asserted. `fresh`: the capture
    takes cu_seqlens and the chunk indices in tensors the warm-up did not see (so such a cache misses in the
    capture, which then records the kernels that derive from them)."""
    R, N, NT = 192, 3, 4
    layouts = {"A (capture)": [100, 60, 32], "B": [64, 0, 128], "C": [192, 0, 0], "D": [1, 127, 64]}
    q, k, v, g, beta, s0 = rule_inputs(R, N, qh, HV, D, dev, gen)

    def lay(lens, pad):
        return segments(lens, dev, NT if pad else 0)
    cu, chunks = lay(layouts["A (capture)"], True)
    out: dict = {}
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                rule.chunk_varlen(q, k, v, g, beta, s0, cu, chunks)
        torch.cuda.current_stream().wait_stream(side)
        if fresh:
            cu, chunks = cu.clone(), chunks.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o_g, s_g = rule.chunk_varlen(q, k, v, g, beta, s0, cu, chunks)
    except Exception as e:  # noqa: BLE001 - the answer is that it cannot be captured
        return {"captured": False, "error": f"{type(e).__name__}: {e}"[:300]}
    out["captured"] = True
    for name, lens in layouts.items():
        c2, ch2 = lay(lens, True)
        cu.copy_(c2)
        chunks.copy_(ch2)
        graph.replay()
        ce, che = lay(lens, False)
        o_e, s_e = rule.chunk_varlen(q.clone(), k.clone(), v.clone(), g.clone(), beta.clone(), s0.clone(), ce, che)
        torch.cuda.synchronize()
        out[name] = {"lens": lens, "output_max_diff": (o_g.float() - o_e.float()).abs().max().item(),
                     "state_max_diff": (s_g - s_e).abs().max().item()}
    return out


if __name__ == "__main__":
    raise SystemExit(main())
