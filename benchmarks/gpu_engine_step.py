"""One stage's decode step on one GPU, with no runtime around it: the engine's share of a decode step against the
memory floor, eager against CUDA graphs, side by side in one run (and a profile of one step).

    python -u benchmarks/gpu_engine_step.py --out DIR [--model preset:qwen3.5-27b] [--batches 1,64]
        [--modes eager,graph,graph-nopdl,graph-nofuse,graph-noqk,graph-opre-spre,graph-p264,graph-dn4x512x4,...]
        [--ctx 192] [--profile] [--prefill 64x128,32x128,8x512+248]

The cache is filled to `--ctx` tokens per sequence without running a prefill (its contents do not change the
work of a step). With --profile, each mode's profiled step is also split into its critical path: each kernel's
exposed time, the part of its span past every kernel before it (PDL overlaps neighbours), written to
profile-MODE-BATCH.txt and drawn in critical_path.png. The floor of a step: every weight once + each sequence's
fp32 recurrent state read and written + its KV read, over the device-to-device copy bandwidth measured in this run.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import torch
# the deployment benchmark's floor (benchmarks/ is on the path)
from gpu_decode import copy_bandwidth, step_bytes, weight_bytes_per_token
from step_profile import critical_path, critical_text, kernel_summary, plot_critical


def matmul_only_ms(model, B: int, iters: int = 10) -> float:
    """Every 2-D weight of the stage (lm_head included) as one F.linear on a [B, in] input, all in one CUDA graph:
    what plain cuBLAS needs for the step's matmuls alone."""
    import torch.nn.functional as F
    ws = [t for layer in model.layers for t in layer.buffers() if t.dim() == 2 and min(t.shape) > 64]
    if model.primary:
        ws.append(model.lm_head)
    xs = {w.shape[1]: torch.randn(B, w.shape[1], dtype=w.dtype, device=w.device) for w in ws}
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for w in ws:
            F.linear(xs[w.shape[1]], w)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for w in ws:
            F.linear(xs[w.shape[1]], w)
    g.replay()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(iters):
        g.replay()
    torch.cuda.synchronize()
    del g
    return (time.perf_counter() - t) / iters * 1e3


FLAGS = {"nodnids", "block", "noblock", "nopdl", "cublas", "torchmoe", "nofuse", "noqk", "nopref",
         "nosgate", "opre", "spre", "nogdnpre", "sample", "torchsample", "anykv", "kvbuckets", "norouter", "nohop",
         "nopadskip"}


def switch_defaults() -> tuple:
    """The switches set_mode reads its defaults from, as the modules hold them before any mode has moved them:
    (GEMV rows, GEMV programs, plain K step, per-pair MoE tiles, block tiles, block on, block registers)."""
    from memra_pp.kernels import fused_moe, gemv, moe_block
    return (gemv.GEMV_ROWS, gemv.PROGRAMS, gemv.PLAIN_BK, fused_moe.SMALL_TILES, moe_block.TILES, moe_block.ENABLED,
            moe_block.MAXNREG)


def set_mode(mode: str, defaults, text) -> None:
    """Set the kernels' switches for one mode: "eager" or "graph", then "-"-separated tokens. A token not known
    here raises (a typo would otherwise time the default step under its label).
    - nopdl: every kernel launched after the one before finished (a Triton without gdc_wait: always);
    - cublas: cuBLAS for every projection and the norms as their own kernels (the sixth session's step);
    - torchmoe: layers.MoE's torch paths instead of the fused MoE kernels;
    - noqk: the q / k norms and the KV write as three kernels; nopref: the persistent GEMV one row block at a time;
      nosgate: the shared gate in every down program (the ninth session's changes, each off);
    - nofuse: all three off, and the eighth session's down tile (2, 512, 4): the eighth session's step;
    - opre: gemv.PRELOAD (out_proj / o_proj's first K step before PDL's wait; nothing where obkN >= their K, which
      runs them in one step); spre: fused_moe.SHARED_BEFORE_WAIT (the shared pair's first K step before the wait);
      nodnids: fused_moe.DOWN_IDS_BEFORE_WAIT off (the tile down kernel's routed ids after PDL's wait, as before
      the fifteenth session; nothing changes where that kernel does not run: with -block, -torchmoe, or at the
      batches that take the grouped GEMM); nogdnpre: gdn_decode.STATE_BEFORE_WAIT off (the GDN step's state tile
      after the wait, as before the tenth session); obkN: the plain GEMV's K step (gemv.PLAIN_BK);
    - sample: each step followed by the deployment's greedy sampling (sampling.sample_async: kernels/greedy.py),
      the next step fed from its tokens on the device; torchsample: the same with the torch ops (greedy.FUSED off);
    - kvbuckets: decode_graphs.ANY_KV off (a graph per batch and KV-length bucket, the attention over the bucket,
      not the cache's whole capacity: give --max-context a deployment's, e.g. 8192, to compare at --ctx); anykv: on
      (the default since the eleventh session; the tenth's commands name it);
    - block / noblock: one row's MoE block as one persistent kernel (kernels/moe_block.py) / as its three kernels
      (neither: moe_block.ENABLED's default); blkAxBxCxDxE: its tiles (gate|up rows, down rows, warps: powers of
      two; programs a multiprocessor; prefetch 1 / 0: moe_block.TILES); regN: its registers a thread at most
      (moe_block.MAXNREG);
    - norouter / nohop: premises only, the MoE's outputs wrong (fused_moe.PREMISE_ROUTE): the router kernel
      replaced by the add and norm alone with a fixed routing / by nothing at all (the three-kernel path only; at
      batch 1 only, where the fixed routing reads as many experts as a real one);
    - nopadskip: a decode graph's padding rows run as real rows: the Gated DeltaNet's state, the MoE's experts
      (decode_graphs.SKIP_PADDING off, as before the forty-fourth session; a batch of 5 runs the graph of 8);
    - pN: the persistent GEMV's programs; guAxBxC / dnAxBxC: the per-pair MoE gate|up / down tiles (BN, BK, warps).
    """
    from memra_pp.kernels import fused_decode, fused_moe, gdn_decode, gemv, greedy, moe_block, moe_route, \
        paged_attention
    from memra_pp.model import decode_graphs
    rows0, programs0, plain_bk0, small0, block0, block_on0, maxnreg0 = defaults
    kind, *tokens = mode.split("-")
    if kind not in ("eager", "graph"):
        raise SystemExit(f"mode {mode!r}: eager or graph first")
    on = set(tokens) & FLAGS
    tiles, programs, plain_bk, block, maxnreg = list(small0), programs0, plain_bk0, block0, maxnreg0
    if "nofuse" in on:
        tiles[3:6] = (2, 512, 4)

    def pow2(v: int) -> bool:
        return v >= 16 and not v & (v - 1)

    seen = set()
    for t in tokens:
        if t in FLAGS:
            continue
        if t[:1] == "p" and t[1:].isdigit() and int(t[1:]) > 0:
            setting, programs = "p", int(t[1:])
        elif t[:3] == "obk" and t[3:].isdigit() and pow2(int(t[3:])):
            setting, plain_bk = "obk", int(t[3:])
        elif t[:3] == "blk" and (parsed := moe_block.parse_tiles(t[3:])) is not None:
            setting, block = "blk", parsed
        elif t[:3] == "reg" and t[3:].isdigit() and 24 <= int(t[3:]) <= 255:
            setting, maxnreg = "reg", int(t[3:])
        elif (t[:2] in ("gu", "dn") and len(t[2:].split("x")) == 3 and t[2:].replace("x", "").isdigit()
              and pow2(int(t[2:].split("x")[1]))):
            setting, i = t[:2], 0 if t[:2] == "gu" else 3
            tiles[i:i + 3] = [int(v) for v in t[2:].split("x")]
        else:
            raise SystemExit(f"mode {mode!r}: unknown token {t!r} (pN > 0; obkN, a tile's BK: powers of two >= 16; "
                             "blkAxBxCxDxE: powers of two, programs > 0, prefetch 0 / 1; regN: 24 to 255)")
        if setting in seen:
            raise SystemExit(f"mode {mode!r}: a setting given twice ({setting})")
        seen.add(setting)
    widest = max(getattr(text, "moe_intermediate_size", 0), getattr(text, "shared_expert_intermediate_size", 0))
    if widest and tiles[4] < widest:
        raise SystemExit(f"mode {mode!r}: a down K step of {tiles[4]} sends the experts to the loop kernel")
    fused_moe.ENABLED = "torchmoe" not in on
    fused_decode.PDL = fused_decode.gdc_wait is not None and "nopdl" not in on
    gemv.GEMV_ROWS = 0 if "cublas" in on else rows0
    moe_route.NORM_ROUTER = "cublas" not in on
    nofuse = "nofuse" in on
    paged_attention.FUSE_QK = not (nofuse or "noqk" in on)
    gemv.PREFETCH = not (nofuse or "nopref" in on)
    fused_moe.SHARED_GATE_EARLY = not (nofuse or "nosgate" in on)
    gemv.PRELOAD = "opre" in on
    fused_moe.SHARED_BEFORE_WAIT = "spre" in on
    gdn_decode.STATE_BEFORE_WAIT = "nogdnpre" not in on
    fused_moe.DOWN_IDS_BEFORE_WAIT = "nodnids" not in on
    decode_graphs.SKIP_PADDING = "nopadskip" not in on
    greedy.FUSED = "torchsample" not in on
    if {"anykv", "kvbuckets"} <= on:
        raise SystemExit(f"mode {mode!r}: anykv and kvbuckets contradict each other")
    decode_graphs.ANY_KV = "kvbuckets" not in on
    gemv.PROGRAMS, gemv.PLAIN_BK, fused_moe.SMALL_TILES = programs, plain_bk, tuple(tiles)
    if {"block", "noblock"} <= on:
        raise SystemExit(f"mode {mode!r}: block and noblock contradict each other")
    moe_block.ENABLED = "block" in on or (block_on0 and "noblock" not in on)
    if seen & {"blk", "reg"} and not moe_block.ENABLED:
        raise SystemExit(f"mode {mode!r}: block tiles or registers without the block kernel (add -block)")
    if block[2] * block[3] > 8:
        raise SystemExit(f"mode {mode!r}: {block[3]} block programs of {block[2]} warps a multiprocessor cannot all "
                         "be resident (at most 8 warps)")
    moe_block.TILES, moe_block.MAXNREG = block, maxnreg
    if {"norouter", "nohop"} <= on:
        raise SystemExit(f"mode {mode!r}: norouter and nohop contradict each other")
    if {"norouter", "nohop"} & on and (moe_block.ENABLED or not fused_moe.ENABLED):
        raise SystemExit(f"mode {mode!r}: norouter / nohop replace the router kernel of the three-kernel MoE path "
                         "(the block kernel off: -noblock where MEMRA_PP_MOE_BLOCK turns it on; not with -torchmoe)")
    fused_moe.PREMISE_ROUTE = "fixed" if "norouter" in on else "skip" if "nohop" in on else None


def main() -> int:
    global PGRAPHS, CHUNKH
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="preset:qwen3.5-27b")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--modes", default="eager,graph")
    ap.add_argument("--ctx", type=int, default=192)
    ap.add_argument("--max-context", type=int, default=0, help="the cache's capacity a sequence (0: ctx + 64)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warm-s", type=float, default=0.3, help="seconds of steps before each (mode, batch) is timed")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--prefill", default="", help="also time prefill steps: comma-separated SEQSxTOKENS (e.g. "
                    "64x128: 64 prompts of 128 tokens in one step), each step timed alone (its spread shown); "
                    "SEQSxTOKENS+DECODE adds DECODE one-token rows of sequences at --ctx (a mixed step, as the "
                    "scheduler makes them while earlier requests decode); SEQSxTOKENS~S spreads the prompts' lengths "
                    "evenly over TOKENS x [1-S, 1+S] (traffic's prompts differ: 8x512~0.5+56)")
    ap.add_argument("--prefill-varlen", action="store_true", help="time each prefill step with the Gated "
                    "DeltaNet's segments by groups of equal lengths (groups) and as one variable-length call "
                    "(varlen: MEMRA_PP_PREFILL_VARLEN), interleaved")
    ap.add_argument("--profile-first", action="store_true", help="profile each prefill shape's first step (host "
                    "and device, sorted by host time: where a new shape's one-time cost goes) before timing it")
    ap.add_argument("--prefill-graphs", action="store_true", help="time each prefill step eagerly (kernels) and "
                    "through the prefill graphs (graphs: model/prefill_graphs.py, captured once for every token "
                    "bucket up to the largest step; graphs-norule: the same with fla's rule called eagerly, where "
                    "the rule graphs are on), interleaved")
    ap.add_argument("--chunk-h-grid", action="store_true", help="also time each prefill step (through the prefill "
                    "graphs where --prefill-graphs) with fla's chunk_h config chosen call by call from its grid "
                    "(model/fla_rule.GridPick, MEMRA_PP_CHUNK_H_GRID) instead of its pin, interleaved")
    ap.add_argument("--prefill-torch", action="store_true", help="also time each prefill step as the "
                    "twenty-third session left it (s23: without the merged projections, contiguous conv parts and "
                    "row slices) and with its norms and conv as the torch ops (torch), interleaved")
    a = ap.parse_args()
    from memra_pp import switches
    switches.apply(switches.check_environment())   # strict: a typo in a MEMRA_PP_* switch must not time a default
    os.makedirs(a.out, exist_ok=True)
    from memra_pp.model import decode_graphs
    from memra_pp.model.batch import StepBatch
    from memra_pp.model.fla_rule import tuned_keys
    from memra_pp.model.sampling import SamplingParams, sample_async
    from memra_pp.model.stage_model import StageModel
    from memra_pp.model.weights import open_weights
    batches = [int(x) for x in a.batches.split(",")]
    bw = copy_bandwidth()
    src = open_weights(a.model, "dummy")
    mc = src.config
    from memra_pp.kernels import fused_moe
    defaults = switch_defaults()
    for mode in a.modes.split(","):     # every mode parsed before the model loads: a typo costs no device time
        set_mode(mode, defaults, mc.text)
    t0 = time.time()
    model = StageModel(mc, 0, mc.text.num_hidden_layers, True, True).load(src, torch.bfloat16, "cuda")
    print(f"{a.model}: {mc.text.num_hidden_layers} layers loaded in {time.time() - t0:.0f} s, copy "
          f"{bw / 1e12:.2f} TB/s, gdn backend {model.gdn_backend}", flush=True)
    shapes = [prefill_shape(p) for p in a.prefill.split(",") if p]
    cache = model.new_cache(max(batches + [b + d for b, _, d, _ in shapes]),
                            max([a.max_context or a.ctx + 64] + [max(spread_lengths(b, n, s)) + 8
                                                                 for b, n, _, s in shapes]))
    rep = {"model": a.model, "copy_bandwidth_Bps": bw, "gpu": torch.cuda.get_device_name(0), "ctx": a.ctx,
           "rows": []}
    for mode in a.modes.split(","):
        set_mode(mode, defaults, mc.text)
        graph = mode.startswith("graph")
        model.set_decode_graphs(False, cache)      # drop graphs captured under the previous mode
        model.set_decode_graphs(graph, cache)
        for B in batches:
            b = StepBatch(list(range(B)), [a.ctx] * B, [1] * B, StepBatch.text_positions([a.ctx] * B, [1] * B),
                          [True] * B)
            fed = [torch.randint(4, mc.text.vocab_size, (B,), device="cuda")]
            sampled = bool({"sample", "torchsample"} & set(mode.split("-")))

            def step():
                for s in range(B):
                    cache.lens[s] = a.ctx
                out = model(b, model.embed_ids(fed[0]), cache)
                if sampled:      # as the one-stage deployment: the next step fed from the tokens on the device
                    fed[0] = sample_async(out, [SamplingParams()] * B, [0] * B).device
                return out

            fused_moe.LAST_DOWN = None      # set again only if this batch's step runs the tile down kernel
            # three steps at least, and --warm-s of them: after three alone, the fifteenth session's runs timed a
            # run's first mode 0.02-0.05 ms slower than the same mode later
            warm_end, i = time.perf_counter() + a.warm_s, 0
            while i < 3 or time.perf_counter() < warm_end:
                step()
                i += 1
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(a.iters):
                step()
            torch.cuda.synchronize()
            ms = (time.perf_counter() - t) / a.iters * 1e3
            by = step_bytes(mc, B, a.ctx)
            floor_ms = by["total"] / bw * 1e3
            row = {"mode": mode, "batch": B, "step_ms": ms, "tokens_per_s": B / ms * 1e3, "floor_ms": floor_ms,
                   "of_floor": floor_ms / ms, "bytes": by, "any_kv": decode_graphs.ANY_KV}
            if mode == "graph":
                row["matmul_only_ms"] = matmul_only_ms(model, B)
            kern = fused_moe.LAST_DOWN      # the tile down kernel the step ran last (registers: its occupancy)
            if kern is not None and getattr(kern, "n_regs", None) is not None:
                row["down_tile_regs"], row["down_tile_spills"] = kern.n_regs, kern.n_spills
            rep["rows"].append(row)
            print(f"  {mode:5s} batch {B:4d}: {ms:7.2f} ms/step, {B / ms * 1e3:8.1f} tokens/s, floor "
                  f"{floor_ms:.2f} ms -> {floor_ms / ms:.0%} of floor"
                  + (f", matmuls alone {row['matmul_only_ms']:.2f} ms" if "matmul_only_ms" in row else "")
                  + (f", down tile kernel {row['down_tile_regs']} registers, {row['down_tile_spills']} spilled"
                     if "down_tile_regs" in row else ""),
                  flush=True)
            if a.profile:
                from torch.profiler import ProfilerActivity, profile
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    step()
                    torch.cuda.synchronize()
                table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=40)
                ks = kernel_summary(prof)
                row["critical"] = critical_path(prof)
                crit = critical_text(row["critical"])
                open(os.path.join(a.out, f"profile-{mode}-{B}.txt"), "w").write(ks + "\n\n" + crit + "\n\n" + table)
                print(ks + "\n" + crit, flush=True)
            json.dump(rep, open(os.path.join(a.out, "gpu_engine_step.json"), "w"), indent=1)
        try:
            plot_critical(rep["rows"], os.path.join(a.out, "critical_path.png"))
        except ImportError as e:       # matplotlib is the test extra's: the JSON has every figure
            print(f"no critical_path.png: {e}", flush=True)
        model.set_prefill_graphs(False, 0)
        if a.prefill_graphs and shapes:     # every bucket up to the largest step, captured once, before any is timed
            most = max(sum(spread_lengths(B, n, spread)) + D for B, n, D, spread in shapes)
            torch.cuda.synchronize()
            t, m0 = time.perf_counter(), torch.cuda.memory_allocated()
            from memra_pp.model import prefill_graphs
            prefill_graphs.MAX_ROWS = max(prefill_graphs.MAX_ROWS, most)    # every shape asked for, past the cap
            model.set_prefill_graphs(True, most)
            nb = model.capture_prefill_graphs()
            PGRAPHS, model.pgraphs = model.pgraphs, None
            cap = {"buckets": nb, "s": time.perf_counter() - t, "bytes": torch.cuda.memory_allocated() - m0,
                   "failed": model.pgraphs_failed,
                   "rule": PGRAPHS.stats()["rule"] if PGRAPHS is not None else None,
                   "rule_failed": PGRAPHS.rules_failed if PGRAPHS is not None else None}
            rep.setdefault("prefill_graphs_capture", {})[mode] = cap
            print(f"  prefill graphs: {nb} buckets up to {most} rows captured in {cap['s']:.1f} s, "
                  f"{cap['bytes'] / 2**30:.2f} GiB allocated{'; FAILED ' + cap['failed'] if cap['failed'] else ''}"
                  f"; rule graphs {cap['rule']}{'; FAILED ' + cap['rule_failed'] if cap['rule_failed'] else ''}",
                  flush=True)
        if a.chunk_h_grid and shapes and CHUNKH is None:
            CHUNKH = chunk_h_pick()
            print(f"  chunk_h by its grid: {'GridPick ready' if CHUNKH else 'NOT AVAILABLE (no fla, or its configs)'}"
                  + (" (its configs compile in the first interleaved step)" if CHUNKH else ""), flush=True)
        for B, n, D, spread in shapes:  # prefill: B fresh prompts of about n tokens as one step, D decode rows
            b = prefill_batch(B, n, D, a.ctx, spread)       # after them (slots B ..)
            lens = b.counts[:B]
            ids = torch.randint(4, mc.text.vocab_size, (sum(lens) + D,), device="cuda")
            sp = f"~{spread:g}" if spread else ""
            name = f"{B} x {n}{sp} ({sum(lens)} tokens)" + (f" + {D} decode rows at {a.ctx}" if D else "")
            tag = f"{mode}-{B}x{n}{sp}" + (f"+{D}" if D else "")           # the shape's profile files
            ways = (("groups", "varlen") if a.prefill_varlen else ("kernels",)) + \
                (("graphs",) if a.prefill_graphs and PGRAPHS is not None else ()) + \
                (("graphs-norule",) if a.prefill_graphs and PGRAPHS is not None and PGRAPHS.rules else ()) + \
                ((("graphs" if a.prefill_graphs and PGRAPHS is not None else "kernels") + "-chunkh",)
                 if CHUNKH is not None else ()) + \
                (("s23", "torch") if a.prefill_torch else ())
            times, tuned = {w: [] for w in ways}, {w: [] for w in ways}
            # the profiled ways: the first, or both of --prefill-varlen's (their files named by way)
            profiled = [(w, f"{tag}-{w}" if a.prefill_varlen else tag) for w in ways[:2 if a.prefill_varlen else 1]]
            for way, wtag in profiled if a.profile_first else ():   # the shape's first step (what a new prompt
                from torch.profiler import ProfilerActivity, profile  # length costs once), host side too
                with torch_prefill(way, model), profile(activities=[ProfilerActivity.CPU,
                                                                    ProfilerActivity.CUDA]) as prof:
                    k0, t = tuned_keys(), time.perf_counter()
                    prefill_step(model, cache, b, ids)
                    torch.cuda.synchronize()
                times[way].append((time.perf_counter() - t) * 1e3)
                tuned[way].append(tuned_keys() - k0)
                open(os.path.join(a.out, f"profile-first-{wtag}.txt"), "w").write(
                    f"first step {times[way][0]:.1f} ms (profiled)\n\n"
                    + prof.key_averages().table(sort_by="cpu_time_total", row_limit=40) + "\n\n"
                    + prof.key_averages().table(sort_by="cuda_time_total", row_limit=25))
            from memra_pp.kernels import prefill as pf
            calls = {way: dict.fromkeys(pf.CALLS, 0) for way in ways}    # which paths each way's steps took
            for _ in range(6):
                for way in ways:        # interleaved, so drift falls on both
                    with torch_prefill(way, model):
                        torch.cuda.synchronize()
                        c0 = dict(pf.CALLS)
                        k0, t = tuned_keys(), time.perf_counter()
                        prefill_step(model, cache, b, ids)
                        torch.cuda.synchronize()
                    times[way].append((time.perf_counter() - t) * 1e3)
                    tuned[way].append(tuned_keys() - k0)
                    for k, v in pf.CALLS.items():
                        calls[way][k] += v - c0.get(k, 0)
            for way in ways:
                tf = sum(prefill_flops(mc, 1, m) for m in lens) / min(times[way]) * 1e3 / 1e12
                rep["rows"].append({"mode": mode, "prefill": [B, n], "spread": spread, "prompt_lens": lens,
                                    "decode_rows": D, "ctx": a.ctx,
                                    "prefill_ops": way, "step_ms": times[way],
                                    "kernel_keys_tuned": tuned[way], "tflops_at_fastest": tf,
                                    "prefill_calls": {k: v // 6 for k, v in calls[way].items() if v}})
                tps = (sum(lens) + D) / min(times[way]) * 1e3
                print(f"  {mode:5s} prefill {name} ({way}): " + ", ".join(f"{x:.1f}" for x in times[way])
                      + f" ms/step ({tps:,.0f} tokens/s at the fastest: {tf:.0f} TFLOP/s "
                      f"of matmul and attention), fla keys tuned per step {tuned[way]}; per step "
                      + ", ".join(f"{k} {v // 6}" for k, v in calls[way].items() if v), flush=True)
                if way == "varlen" and not calls[way]["conv_varlen"]:
                    print("  WARNING: the varlen way took no variable-length conv: it measured groups", flush=True)
            for way, wtag in profiled if a.profile else ():     # where a prefill step's time goes, by kernel
                from torch.profiler import ProfilerActivity, profile
                with torch_prefill(way, model), profile(activities=[ProfilerActivity.CPU,
                                                                    ProfilerActivity.CUDA]) as prof:
                    prefill_step(model, cache, b, ids)
                    torch.cuda.synchronize()
                ks = kernel_summary(prof, top=40)
                open(os.path.join(a.out, f"profile-prefill-{wtag}.txt"), "w").write(
                    ks + "\n\n" + prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))
                print(f"  {way}:\n" + ks, flush=True)
            json.dump(rep, open(os.path.join(a.out, "gpu_engine_step.json"), "w"), indent=1)
    return 0


PGRAPHS = None      # --prefill-graphs: the mode's captured PrefillGraphs, lent to the model for the "graphs" way
CHUNKH = None       # --chunk-h-grid: (fla_rule.GridPick of chunk_h, its pinned configs), lent to the rules


def chunk_h_pick():
    """(GridPick, the pinned configs) for the "-chunkh" ways; None where this fla has no such configs. The autotuner
    keeps its pin outside those ways. (The pick's other configs compile in its way's first step: the timings take
    each way's fastest step.)"""
    from memra_pp.model import fla_rule
    tuner = fla_rule._autotuner(fla_rule._kernel(*fla_rule.CHUNK_H))
    if tuner is None:
        return None
    pinned = list(tuner.configs)
    pick = fla_rule.GridPick.make(tuner, fla_rule.CHUNK_H_BY_GRID, fla_rule.CHUNK_H_MANY)
    tuner.configs = pinned
    return None if pick is None else (pick, pinned)


def gdn_rules(model) -> dict:
    """{id: rule} of the model's Gated DeltaNet rules (layers may share one)."""
    return {id(r): r for r in (getattr(layer.mixer, "rule", None) for layer in model.layers) if r is not None}


@contextlib.contextmanager
def torch_prefill(way: str, model):
    """The prefill as it was: "s23" as the twenty-third session left it (kernels/prefill.MERGED off: a GEMM per
    projection, silu and mul as two ops, the conv's output split by views, every group's rows gathered and
    scattered; the gated norm one head a program), "torch" as before it too (its norms and Gated DeltaNet conv as the
    torch ops: kernels/prefill's conv and kernels/fused_decode's norms replaced by their references for the step; q
    / k repeated to the value heads for fla, its grouped value heads off); "kernels" as it is. Captured decode
    graphs are not affected (they replay what was captured). "groups" and "varlen": as it is, with the Gated
    DeltaNet's segments by groups of equal lengths, or as one variable-length call (kernels/prefill.VARLEN)."""
    from memra_pp.kernels import fused_decode as fd, prefill as pf
    if way.endswith("-chunkh"):         # as the way before it, fla's chunk_h config chosen by its grid
        pick, pinned = CHUNKH
        rules = gdn_rules(model)
        own = {k: r._chunk_h for k, r in rules.items()}     # (a pick of their own: MEMRA_PP_CHUNK_H_GRID=1)
        for r in rules.values():
            r._chunk_h = pick
        try:
            with torch_prefill(way.removesuffix("-chunkh"), model):
                yield
        finally:
            for k, r in rules.items():
                r._chunk_h = own[k]
            pick.tuner.configs = pinned
        return
    if way in ("graphs", "graphs-norule"):   # as "kernels", through the prefill graphs; "graphs-norule": with fla's
        model.pgraphs, rules = PGRAPHS, PGRAPHS.rules   # rule called eagerly between them (no RuleGraphs)
        if way == "graphs-norule":
            PGRAPHS.rules = None
        try:
            yield
        finally:
            model.pgraphs, PGRAPHS.rules = None, rules
        return
    if way in ("kernels", "groups", "varlen"):
        varlen = pf.VARLEN
        pf.VARLEN = {"kernels": varlen, "groups": False, "varlen": True}[way]
        try:
            yield
        finally:
            pf.VARLEN = varlen
        return
    flags, saved = (pf.MERGED, fd.GATED_MANY), (pf.conv_prefill, fd.add_rms_norm, fd.gated_rms_norm)
    rules = gdn_rules(model)
    gva = {k: r.gva for k, r in rules.items()}
    pf.MERGED, fd.GATED_MANY = False, 1 << 62
    if way == "torch":
        for r in rules.values():
            r.gva = False
        pf.conv_prefill, fd.add_rms_norm = pf.conv_prefill_ref, fd.add_rms_norm_ref
        fd.gated_rms_norm = lambda o, z, w, eps: fd.gated_rms_norm_ref(o, z, w, eps).reshape(o.shape[0], -1)
    try:
        yield
    finally:        # everything back (for "s23" only the flags changed)
        pf.MERGED, fd.GATED_MANY = flags
        pf.conv_prefill, fd.add_rms_norm, fd.gated_rms_norm = saved
        for k, r in rules.items():
            r.gva = gva[k]


def prefill_shape(text: str) -> tuple[int, int, int, float]:
    """--prefill's SEQSxTOKENS[~SPREAD][+DECODE] as (prompts, tokens each, decode rows, spread)."""
    head, _, dec = text.partition("+")
    head, _, spread = head.partition("~")
    B, n = (int(v) for v in head.split("x"))
    s = float(spread or 0)
    if not 0 <= s < 1:
        raise SystemExit(f"--prefill {text}: a spread is in [0, 1)")
    return B, n, int(dec or 0), s


def spread_lengths(B: int, n: int, spread: float) -> list[int]:
    """B prompt lengths evenly over bench.prompt_range(n, spread), the span `memra-pp bench --prompt-spread` draws
    from (all n without a spread, or for one prompt)."""
    from memra_pp.bench import prompt_range
    if B == 1 or not spread:
        return [n] * B
    lo, hi = prompt_range(n, spread)
    return [round(lo + (hi - lo) * i / (B - 1)) for i in range(B)]


def prefill_batch(B: int, n: int, D: int, ctx: int, spread: float = 0.0):
    """A prefill step of B fresh prompts of n tokens (spread_lengths: spread over n x [1-s, 1+s]; slots 0 .. B-1),
    then D one-token decode rows of sequences holding ctx tokens (slots B .. B+D-1): a mixed step as the scheduler
    cuts them."""
    from memra_pp.model.batch import StepBatch
    starts, counts = [0] * B + [ctx] * D, spread_lengths(B, n, spread) + [1] * D
    return StepBatch(list(range(B + D)), starts, counts, StepBatch.text_positions(starts, counts), [True] * (B + D))


def prefill_step(model, cache, b, ids):
    """Run a step of prefill_batch's again: each continuing sequence put back at its start (the fresh prompts start
    over by themselves). Returns the logits."""
    for s, st in zip(b.slots, b.starts):
        if st:
            cache.lens[s] = st
    return model(b, model.embed_ids(ids), cache)


def prefill_flops(mc, B: int, n: int) -> float:
    """The FLOPs a prefill step of B prompts of n tokens must do: every weight matmul (2 x active parameters x
    tokens; MoE: the k routed experts and the shared one, as weight_bytes_per_token(1) counts them; the lm_head on
    the B last rows) and the full-attention layers' causal QK^T and PV. The Gated DeltaNet's chunked rule is left
    out (a few percent at these sizes), so the figure is a floor on the work done."""
    t = mc.text
    head = t.vocab_size * t.hidden_size
    params = (weight_bytes_per_token(mc, 1) - 2 * head) / 2
    n_full = sum(t.is_full(i) for i in range(t.num_hidden_layers))
    attn = n_full * 2 * 2 * t.num_attention_heads * t.head_dim * (n * (n + 1) / 2)
    return 2 * params * B * n + 2 * head * B + B * attn


if __name__ == "__main__":
    raise SystemExit(main())
