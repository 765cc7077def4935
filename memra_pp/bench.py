"""`memra-pp bench CONFIG`: throughput, request latency, per-stage busy fraction and slot handoff latency under
concurrent load, next to a Ray actor call round trip measured in the same run (driver side)."""
from __future__ import annotations

import json
import math
import os
import sys
import random
import threading
import time

from .errors import InputError, MemraError


def _pct(xs, q):
    """The q-quantile of xs by nearest rank (the ceil(q * n)-th smallest; stages/slots.nearest_rank, which gives the
    report's handoff figures), 0.0 where xs is empty. (xs[int(q * n)] took the larger of two samples for their p50,
    and the largest of 100 for their p99.)"""
    xs = sorted(xs)
    return xs[max(0, math.ceil(q * len(xs)) - 1)] if xs else 0.0


def actor_call_us(actor, n: int = 200) -> tuple[float, float]:
    """p50/p99 of a no-op Ray actor call round trip (what a per-microbatch control call would cost)."""
    import ray
    ray.get(actor.ping.remote(), timeout=30)
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        ray.get(actor.ping.remote(), timeout=30)
        ts.append((time.perf_counter() - t) * 1e6)
    return _pct(ts, 0.5), _pct(ts, 0.99)


def _decode_window(runs: list[tuple[float, list[tuple[float, int]]]]) -> tuple[float, float]:
    """Steady-state decode rate from per-request token arrival times: the tokens that arrived while every request
    was decoding (after the last first token, up to the first finish) over that window. Falls back to all tokens
    after each request's first over the whole decode span when that window is empty. Returns (tokens/s, window s)."""
    firsts = [ev[0][0] for _, ev in runs if ev]
    lasts = [ev[-1][0] for _, ev in runs if ev]
    if not firsts:
        return 0.0, 0.0
    t1, t2 = max(firsts), min(lasts)
    n = sum(k for _, ev in runs for t, k in ev if t1 < t <= t2)
    if t2 > t1 and n > 0:
        return n / (t2 - t1), t2 - t1
    n = sum(k for _, ev in runs for _, k in ev[1:])
    span = max(lasts) - min(firsts)
    return (n / span if span > 0 else 0.0), span


def token_latencies(runs: list[tuple[float, list[tuple[float, int]]]]) -> dict:
    """What a decoding request waits for each next token, from per-request (start, [(arrival, tokens)]) runs:
    time per output token (a request's span after its first event over the tokens that came after it), and the
    inter-token latency: each event's gap from the one before it, shared evenly by the tokens it carried (a stream
    event may carry several). A running request waits for every step the deployment takes, prefill steps included,
    so these are what a larger prefill_chunk costs the requests already decoding. itl_max_s is the longest gap."""
    tpot, itl, gaps = [], [], []
    for _, ev in runs:
        after = sum(k for _, k in ev[1:])
        if after:
            tpot.append((ev[-1][0] - ev[0][0]) / after)
        for (a, _), (b, k) in zip(ev, ev[1:]):
            gaps.append(b - a)
            itl.extend([(b - a) / k] * k)
    return {"tpot_p50_s": _pct(tpot, 0.5), "tpot_p99_s": _pct(tpot, 0.99),
            "itl_p50_s": _pct(itl, 0.5), "itl_p99_s": _pct(itl, 0.99), "itl_max_s": max(gaps, default=0.0)}


def warm_tokens(concurrency: int, prompt_len: int, max_new_tokens: int, prefill_chunk: int,
                chunk_decoding: int | None = None) -> int:
    """Tokens each warm-up request generates: 3, plus one for each prefill step the prompts take, so the first
    request still decodes when the last one starts (with 3 tokens alone, 256 prompts of 128 tokens in steps of
    4,096 never made one decode-only step of more than 64 rows, and the timed run captured 5 graphs). With
    scheduler.prefill_chunk_decoding, the steps after the first take that many prompt tokens."""
    total, chunk = concurrency * prompt_len, max(1, prefill_chunk)
    steps = -(-total // chunk)
    if chunk_decoding is not None and total > chunk:
        steps = 1 + -(-(total - chunk) // max(1, min(chunk, chunk_decoding)))
    return min(max_new_tokens, 3 + steps)


def prompt_range(prompt_len: int, spread: float) -> tuple[int, int]:
    """The shortest and longest prompt bench_prompts draws: prompt_len x [1 - spread, 1 + spread], at least one
    token (a deployment's max_context must hold the longest)."""
    return max(1, round(prompt_len * (1 - spread))), max(1, round(prompt_len * (1 + spread)))


def bench_prompts(rng: random.Random, n: int, prompt_len: int, spread: float, vocab: int,
                  avoid: frozenset[int] = frozenset()) -> list[list[int]]:
    """n prompts of random ids in [4, vocab) but not in `avoid`, their lengths drawn evenly over prompt_range."""
    lo, hi = prompt_range(prompt_len, spread)

    def tok() -> int:
        while (t := rng.randrange(4, vocab)) in avoid:
            pass
        return t
    return [[tok() for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def placeholder_ids(dep) -> frozenset[int]:
    """The ids a text prompt must not hold: a vision model's image and video placeholders (the intake refuses a
    placeholder without its image; a 512-token random prompt over Qwen3.5's 248k ids holds one 1 time in 240)."""
    mc = dep.model_config
    if mc.vision is None:
        return frozenset()
    return frozenset(t for t in (mc.image_token_id, mc.video_token_id) if t is not None)


# the intake's ring figures in a pipeline (stages/intake_loop.py): the tokens' way back from the primary to the next
# launch, what the first stage waits for between a microbatch's step and its next one
RING_KEYS = tuple(f"ring_{k}_p{q}_us" for k in ("transit", "queue", "launch") for q in (50, 99))


def ring_line(s: dict) -> str:
    """'ring back p50 / p99: transit a / b us, queue ..., launch ...' from a stage's stats, or '' (no ring)."""
    if s.get("ring_transit_p50_us") is None:
        return ""
    return "ring back p50 / p99: " + ", ".join(
        f"{k} {s[f'ring_{k}_p50_us']:.0f} / {s[f'ring_{k}_p99_us']:.0f} us" for k in ("transit", "queue", "launch")
        if s.get(f"ring_{k}_p50_us") is not None)


def run_bench(dep, concurrency: int, prompt_len: int, max_new_tokens: int, seed: int = 0,
              warm: bool = True, timeline: bool = False, prompt_spread: float = 0.0, progress=None,
              every_s: float = 5.0) -> dict:
    """`concurrency` requests at once, each streamed on its own thread (the public `stream` API), every event's
    arrival time recorded: throughput end to end, time to first token, and the steady-state decode rate. `warm`
    first runs the same requests, untimed, long enough that every one is still decoding when the last prompt's
    prefill ends (`warm_tokens`): the decode batches then pass through the sizes the timed run meets, so their lazy
    graph captures stay out of the figures (`graph_captures_in_run` counts those that did not).
    `timeline`: also every stage's microbatch spans of the timed run (seconds from its start; plot_timelines), and
    the p50 first token on that axis. `prompt_spread` s: prompt lengths drawn evenly from prompt_len x [1 - s,
    1 + s] (as traffic has them: every mix of lengths is a new prefill shape) instead of all prompt_len.
    `progress`: called with a line every `every_s` seconds (the warm-up's and the timed run's requests done and
    tokens so far)."""
    from concurrent.futures import ThreadPoolExecutor
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1:
        # (0 was the thread pool's ValueError, after the actor calls had been timed)
        raise InputError(f"run_bench: concurrency is the number of requests at once, an integer >= 1, got "
                         f"{concurrency!r}")
    c = dep.client()
    rng = random.Random(seed)
    V = dep.vocab_size
    prompts = bench_prompts(rng, concurrency, prompt_len, prompt_spread, V, placeholder_ids(dep))
    p50, p99 = actor_call_us(dep.stage_actor(0))

    # the steady-state window (every request decoding, none finished yet) gets its own stats: the stages' busy
    # fractions there, apart from the prefill's
    lock, firsts, steady, ramp = threading.Lock(), [0], {}, {}
    all_decoding, first_done, failed = threading.Event(), threading.Event(), threading.Event()

    counts = {"phase": "warm-up", "done": 0, "tokens": 0, "of": 0}

    def ticker(stop: threading.Event):
        t0 = time.monotonic()
        while not stop.wait(every_s):
            progress(f"  {counts['phase']}: {counts['done']}/{concurrency} requests done, {counts['tokens']} of "
                     f"{counts['of']} tokens ({time.monotonic() - t0:.0f} s)")

    def one(p, new=max_new_tokens, timed=True):
        t = time.perf_counter()
        ev = []
        for e in c.stream(p, max_new_tokens=new, ignore_eos=True):
            if e.token_ids:
                counts["tokens"] += len(e.token_ids)          # (a progress figure: the GIL's += is enough)
                ev.append((time.perf_counter(), len(e.token_ids)))
                if timed and len(ev) == 1:
                    with lock:
                        firsts[0] += 1
                        if firsts[0] == concurrency:
                            all_decoding.set()
        if timed:
            first_done.set()
        counts["done"] += 1
        return t, ev

    def snapshot():     # a stage still recovering (replay) answers without its loop's figures: zeros for them
        return [{"busy_s": x.get("busy_s", 0.0), "wall_s": x.get("wall_s", 0.0), "phase_s": x.get("phase_s") or {},
                 "microbatches": x.get("microbatches", 0)} for x in dep.stats()["stages"]]

    def watch():    # two snapshots, no reset: the run's own figures still cover all of it
        all_decoding.wait()
        if failed.is_set():
            return
        try:
            a, t = snapshot(), time.perf_counter()
        except MemraError:      # the run is failing (a lost stage): run_bench raises the requests' own error
            return
        # the prefill ramp: from the timed run's start (its stats reset) until every request has its first token
        ramp.update(busy=[x["busy_s"] / max(x["wall_s"], 1e-9) for x in a],
                    microbatches=[x["microbatches"] for x in a],
                    phase_us=[{k: v / max(1, x["microbatches"]) * 1e6 for k, v in x["phase_s"].items()} for x in a])
        if first_done.is_set():
            return
        first_done.wait()
        if failed.is_set():
            return
        try:
            b = snapshot()
        except MemraError:
            return
        steady.update(window_s=time.perf_counter() - t,
                      busy=[(y["busy_s"] - x["busy_s"]) / max(y["wall_s"] - x["wall_s"], 1e-9)
                            for x, y in zip(a, b)],
                      phase_us=[{k: (v - x["phase_s"].get(k, 0.0)) / max(1, y["microbatches"] - x["microbatches"])
                                 * 1e6 for k, v in y["phase_s"].items()} for x, y in zip(a, b)])

    stop_ticking = threading.Event()
    if progress is not None:
        threading.Thread(target=ticker, args=(stop_ticking,), daemon=True).start()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        if warm:   # the same load, untimed: decode graphs of these batch sizes are captured, KV pools grown
            sc = dep.placement.scheduler
            n = warm_tokens(concurrency, prompt_len, max_new_tokens, sc.prefill_chunk, sc.prefill_chunk_decoding)
            counts["of"] = n * concurrency
            try:
                list(pool.map(lambda p: one(p, n, False), prompts))
            except BaseException:
                stop_ticking.set()
                c.close()       # the requests still streaming end now (the pool waits for them), and the client goes
                raise
        counts.update(phase="timed run", done=0, tokens=0, of=max_new_tokens * concurrency)
        st0 = dep.stats(reset=True)["stages"]
        captures0 = _graph_captures(st0)     # graph counts are never reset
        tunings0 = _tunings(st0)
        growths0 = _kv_growths(st0)
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        t0, tm0 = time.perf_counter(), time.monotonic()     # monotonic: the stages' timeline clock
        try:
            out = list(pool.map(one, prompts))
            # the run ends with its last request, not once the watcher's stats calls below are answered (a stage
            # that answers late put its delay into the wall time and the end-to-end rate)
            wall = time.perf_counter() - t0
        except BaseException:
            failed.set()
            c.close()
            raise
        finally:        # also when a request failed: the watcher must not wait for ever
            stop_ticking.set()
            all_decoding.set()
            first_done.set()
            watcher.join(timeout=30)
    st = dep.stats(timeline=timeline)["stages"]
    toks = sum(k for _, ev in out for _, k in ev)
    lat = [ev[-1][0] - t for t, ev in out if ev]
    ttft = [ev[0][0] - t for t, ev in out if ev]
    dec, window = _decode_window(out)
    c.close()
    return {"concurrency": concurrency, "prompt_len": prompt_len, "prompt_spread": prompt_spread,
            "prompt_tokens": sum(map(len, prompts)), "max_new_tokens": max_new_tokens,
            "generated_tokens": toks, "wall_s": wall, "tokens_per_s": toks / wall,
            "decode_tokens_per_s": dec, "decode_window_s": window,
            "ttft_p50_s": _pct(ttft, 0.5), "ttft_p99_s": _pct(ttft, 0.99),
            "request_latency_p50_s": _pct(lat, 0.5), "request_latency_p99_s": _pct(lat, 0.99),
            **token_latencies(out),
            "ray_actor_call_p50_us": p50, "ray_actor_call_p99_us": p99,
            "stages": [{k: s.get(k) for k in ("index", "device", "layers", "busy", "microbatches", "handoffs",
                                              "handoff_p50_us", "handoff_p99_us", "phase_us_per_microbatch",
                                              "async_steps", "host_busy", "send_write_us", "send_header_us",
                                              *RING_KEYS)}
                       for s in st],
            "steady_busy": steady.get("busy", []),
            # each stage's host time per microbatch in that window (no prefill in it): where a decode step's goes
            "steady_phase_us": steady.get("phase_us", []),
            # the same for the prefill ramp (every microbatch until each request has its first token): where a
            # prefill or mixed step's host time goes, end to end
            "ramp_busy": ramp.get("busy", []), "ramp_microbatches": ramp.get("microbatches", []),
            "ramp_phase_us": ramp.get("phase_us", []),
            # decode graphs captured inside the timed run (a bucket the warm-up did not reach): each one stalls its
            # stage for the capture, so time to first token and the end-to-end rate carry it
            "graph_captures_in_run": _graph_captures(st) - captures0,
            # kernel keys autotuned inside the timed run (flash-linear-attention's; a request waits for each)
            "kernel_tunings_in_run": _tunings(st) - tunings0,
            # KV pool growths inside the timed run, and how the stages' pools grow ("in place" keeps the graphs)
            "kv_growths_in_run": _kv_growths(st) - growths0,
            "kv_growth": sorted({s.get("kv_growth", "") for s in st}),
            "steady_window_s": steady.get("window_s", 0.0),
            **({"timeline": timeline_since(st, tm0, _pct([ev[0][0] - t0 for _, ev in out if ev], 0.5), wall)}
               if timeline else {})}


def _graph_captures(stages: list[dict]) -> int:
    return sum((s.get("decode_graphs") or {}).get("captures", 0) for s in stages)


def _tunings(stages: list[dict]) -> int:
    """Kernel keys autotuned so far, summed over the stages (fla_rule.tuned_keys in each; never reset)."""
    return sum(s.get("kernel_tunings") or 0 for s in stages)


def _kv_growths(stages: list[dict]) -> int:
    """KV pool growths so far, summed over the stages (each stage's count survives its halts)."""
    return sum(s.get("kv_growths", 0) for s in stages)


def timeline_since(stages: list[dict], tm0: float, ttft_s: float, wall_s: float) -> dict:
    """The spans of `dep.stats(timeline=True)["stages"]` that ended after time.monotonic() tm0, in seconds from
    tm0, with the run's time to first token and wall time (what plot_timelines draws)."""
    return {"ttft_s": ttft_s, "wall_s": wall_s,
            "complete": all(s.get("timeline_complete", True) for s in stages),
            "stages": [[[k, n, a - tm0, b - tm0] for k, n, a, b in s.get("timeline", []) if b >= tm0]
                       for s in stages]}


def plot_timelines(runs: list[tuple[str, dict]], path: str, title: str = "") -> None:
    """One panel per run (label, run_bench's "timeline"): a lane per stage, each microbatch a bar from its start
    to its end (prefill chunks in alternating colours, decode steps grey), the first token a dashed line. Shows
    whether a long prompt's chunks were pipelined: stage i+1 on chunk k while stage i is on chunk k+1."""
    if not runs:
        return
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(runs), 1, figsize=(11, 1.0 + 0.9 * sum(len(t["stages"]) for _, t in runs)),
                             squeeze=False)
    for ax, (label, tl) in zip(axes[:, 0], runs):
        for i, spans in enumerate(tl["stages"]):
            bars: dict[str, list] = {"tab:blue": [], "tab:orange": [], "lightgrey": []}   # one artist per colour
            k = 0
            for kind, n, a, b in spans:
                bars[("tab:blue", "tab:orange")[k % 2] if kind == "prefill" else "lightgrey"].append(
                    (a * 1e3, (b - a) * 1e3))
                k += kind == "prefill"
            for color, xs in bars.items():
                if xs:
                    ax.broken_barh(xs, (i - 0.4, 0.8), facecolors=color, edgecolor="black", linewidth=0.3)
        ax.axvline(tl["ttft_s"] * 1e3, ls="--", c="red", lw=1, label=f"first token (p50) {tl['ttft_s'] * 1e3:.0f} ms")
        ax.set_yticks(range(len(tl["stages"])), [f"stage {i}" for i in range(len(tl["stages"]))])
        ax.invert_yaxis()
        ax.set_xlim(0, max([tl["ttft_s"]] + [b for sp in tl["stages"] for *_, b in sp[:1] + sp[-1:]]) * 1e3 * 1.03)
        ax.set_title(label, fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
        ax.grid(axis="x", alpha=0.3)
    axes[-1, 0].set_xlabel("ms from the request's submission (prefill chunks alternate colours; grey: decode)")
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_report(r: dict) -> str:
    spread = f" +-{r['prompt_spread']:.0%}" if r.get("prompt_spread") else ""     # (prompt lengths drawn over a range)
    lines = [f"{r['concurrency']} concurrent x ({r['prompt_len']}{spread} in, {r['max_new_tokens']} out): "
             f"{r['generated_tokens']} tokens in {r['wall_s']:.2f} s = {r['tokens_per_s']:.1f} tokens/s; "
             f"steady decode {r['decode_tokens_per_s']:.1f} tokens/s; time to first token p50 "
             f"{r['ttft_p50_s'] * 1e3:.0f} ms; request latency p50 {r['request_latency_p50_s']:.2f} s, "
             f"p99 {r['request_latency_p99_s']:.2f} s",
             f"time per output token p50 {r['tpot_p50_s'] * 1e3:.1f} ms, p99 {r['tpot_p99_s'] * 1e3:.1f} ms; "
             f"inter-token latency p50 {r['itl_p50_s'] * 1e3:.1f} ms, p99 {r['itl_p99_s'] * 1e3:.1f} ms, "
             f"longest gap {r['itl_max_s'] * 1e3:.0f} ms",
             f"Ray actor call round trip (same run): p50 {r['ray_actor_call_p50_us']:.0f} us, "
             f"p99 {r['ray_actor_call_p99_us']:.0f} us",
             "busy in the steady decode window: " + (", ".join(f"{b:.1%}" for b in r.get("steady_busy") or [])
                                                     or "(no window)"),
             f"{'stage':>5} {'device':>8} {'layers':>9} {'busy':>6} {'microbatches':>12} {'handoffs':>9} "
             f"{'handoff p50 us':>15} {'p99 us':>8}"]
    for s in r["stages"]:
        lines.append(f"{s['index']:>5} {s['device']:>8} {str(tuple(s['layers'])):>9} {s['busy']:>6.1%} "
                     f"{s['microbatches']:>12} {s['handoffs']:>9} {s['handoff_p50_us'] or 0:>15.1f} "
                     f"{s['handoff_p99_us'] or 0:>8.1f}")
    if r["stages"] and ring_line(r["stages"][0]):
        lines.append(f"stage 0 {ring_line(r['stages'][0])} (the primary's send to the intake's receipt, to its loop, "
                     f"to the next launch)")
    for s in r["stages"]:
        ph = s.get("phase_us_per_microbatch") or {}
        if ph:
            lines.append(f"stage {s['index']} host time per microbatch: " + ", ".join(f"{k} {v:.0f} us"
                                                                                   for k, v in ph.items()))
    for what, key in (("the steady decode window", "steady_phase_us"), ("the prefill ramp", "ramp_phase_us")):
        for i, ph in enumerate(r.get(key) or []):
            lines.append(f"stage {i} host time per microbatch in {what}: "
                         + ", ".join(f"{k} {v:.0f} us" for k, v in ph.items()))
    return "\n".join(lines)


MAX_CONCURRENCY = 4096


def check_output_path(flag: str, path: str | None) -> None:
    """A report's path, refused before anything is launched (not after the run): empty, a directory (or a name
    ending in a separator), one whose directory does not exist, or one this process cannot open for writing (the
    check opens it for appending, as root too, and removes the file again if it made it). An existing device or
    FIFO is taken as given (/dev/stdout)."""
    if path is None:
        return
    if not path.strip():
        raise InputError(f"{flag} {path!r}: an empty path; give a file's path or leave {flag} out")
    if os.path.isdir(path) or path.endswith(os.sep):
        raise InputError(f"{flag} {path}: is a directory; give a file's path")
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise InputError(f"{flag} {path}: its directory does not exist or is not writable")
    if os.path.exists(path) and not os.path.isfile(path):
        return
    made = not os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise InputError(f"{flag} {path}: its directory does not exist or is not writable "
                         f"({e.strerror or e})") from None
    if made:
        os.unlink(path)


def check_timeline_path(path: str | None) -> None:
    """--timeline: a writable path whose extension names an image format matplotlib writes (savefig refused
    `t.txt` after the whole run, and wrote `t` to `t.png`)."""
    if path is None:
        return
    check_output_path("--timeline", path)
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise InputError(f"--timeline {path}: plotting needs matplotlib (pip install matplotlib)") from None
    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    ext = os.path.splitext(path)[1][1:].lower()
    if ext not in formats:
        raise InputError(f"--timeline {path}: " + (f"'.{ext}' is not an image format matplotlib writes" if ext else
                                                   "no extension to name the image format") +
                         f"; end the name with one of {', '.join('.' + f for f in formats)} (e.g. timeline.png)")


def write_report(flag: str, path: str, report: dict) -> None:
    """The JSON report written where `flag` said; a write that fails even so (a full disk) is one line, not a
    traceback after the run."""
    try:
        with open(path, "w") as f:
            json.dump(report, f, indent=1, default=str)
    except OSError as e:
        raise InputError(f"{flag} {path}: the report could not be written ({e.strerror or e})") from None


def main(args) -> int:
    import memra_pp
    for name in ("concurrency", "prompt_len", "max_new_tokens"):     # refused before anything is launched
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.concurrency > MAX_CONCURRENCY:      # each request streams on a thread of its own
        raise InputError(f"--concurrency {args.concurrency}: the bench streams each request on a thread of its own, "
                         f"at most {MAX_CONCURRENCY}")
    spread = getattr(args, "prompt_spread", 0.0)
    if not 0 <= spread <= 1:       # (a NaN fails this too)
        raise InputError(f"--prompt-spread is a fraction from 0 to 1 of --prompt-len, got {spread}")
    from .placement.schema import load_placement
    ctx = load_placement(args.config).scheduler.max_context     # a request past it is refused: before the launch
    longest = prompt_range(args.prompt_len, spread)[1]
    if longest + args.max_new_tokens - 1 > ctx:
        raise InputError(f"--prompt-len {args.prompt_len} (prompts up to {longest} tokens with --prompt-spread "
                         f"{spread:g}) and --max-new-tokens {args.max_new_tokens} need "
                         f"{longest + args.max_new_tokens - 1} positions, more than the placement's "
                         f"scheduler.max_context ({ctx}): lower them or raise max_context")
    check_output_path("--out", args.out)
    check_timeline_path(getattr(args, "timeline", None))
    say = lambda m: print(m, file=sys.stderr, flush=True)   # noqa: E731 - progress off stdout (--json is JSON)
    say(f"launching {args.config} ...")
    dep = memra_pp.launch(args.config)
    try:
        say(f"running {args.concurrency} concurrent requests ...")
        r = run_bench(dep, args.concurrency, args.prompt_len, args.max_new_tokens,
                      timeline=bool(getattr(args, "timeline", None)), prompt_spread=spread, progress=say)
    finally:
        dep.shutdown()
    r["config"] = str(args.config)
    # the figures first: a plot or a file that fails after the run must not lose them
    print(json.dumps(r, indent=1) if args.json else format_report(r), file=getattr(args, "stdout", None), flush=True)
    if args.out:
        write_report("--out", args.out, r)
    if r.get("timeline"):
        plot_timelines([(f"{args.config}: {args.concurrency} concurrent x ({args.prompt_len} in, "
                         f"{args.max_new_tokens} out)", r["timeline"])], args.timeline)
        say(f"timeline plot: {args.timeline}")
    return 0
