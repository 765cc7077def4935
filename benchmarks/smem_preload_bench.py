"""Can a weight that depends on nothing be read during a latency window, so that the GEMV after it costs almost no
DRAM time? The premise of a layer megakernel (issue 7, MoE target 1; docs/PERF.md, sixteenth session): the 35B-A3B's
out_proj ([2048, 4096] bf16, 16.8 MB) fits in the H200's shared memory, and the conv, GDN and gated-norm chain before
it keeps DRAM idle for several microseconds a layer.

One persistent CUDA kernel (benchmarks/smem_preload.cu, compiled with NVRTC for this GPU), 128 CTAs of 16 rows each
and a control warp, runs a window of n grid-wide barriers (each CTA reads another's value of the phase before), then
the GEMV, with the weight read (mode 0) from memory after the window; (1) into shared memory by cp.async before the
window; (2) into registers before the window; (4) into shared memory by TMA bulk copies before the window; (5) the
same copies paced across the window, a few each phase; (3) no GEMV: the window alone. Each at every barrier kind
(KINDS: with and without the memory model's fences and acquire loads). Beside it, today's path: n dependent tiny
kernels, then the step's Triton GEMV (kernels/gemv.py). Each figure is the median over 100 replays of a CUDA graph of
the device span of the timed kernels, from CUPTI's timestamps; each replay first empties L2 (by reading a buffer:
clean lines, as a decode step leaves L2; --flush write leaves it dirty), untimed, then brings the window's few bytes
back into L2 (--window-cold does not), then runs the same mode once on another weight of the same size, so the timed
launch finds its code on chip (--code-cold does not). What the GEMV adds is each row minus its window alone. Last, one
launch of each mode at the longest window leaves its CTAs' stamps (STAMPS): when the preload was issued and landed,
when the window ended.

    python -u benchmarks/smem_preload_bench.py --out DIR [--window 0,4,16] [--kinds 0,1,2,3,4] [--modes 0,1,2,4,5]
        [--cubin FILE]

--cubin loads a cubin built elsewhere (nvcc -cubin -arch=sm_90 benchmarks/smem_preload.cu) where NVRTC is missing.
"""
from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os

import torch

from gpu_decode import copy_bandwidth      # benchmarks/ is on the path
from moe_kernels import captured
from step_profile import device_kernels

N, K, R = 2048, 4096, 16                    # the 35B-A3B's out_proj; R rows a CTA (smem_preload.cu's defaults)
THREADS = 288                               # smem_preload.cu: eight worker warps and the control warp
KINDS = {0: "fences (__threadfence), acquire spin", 1: "no fences, acquire spin", 2: "fences, relaxed spin",
         3: "no fences, relaxed spin", 4: "fence.acq_rel, acquire spin"}       # smem_preload.cu's barrier kinds
MODES = {0: "from memory after the window", 1: "shared memory, cp.async before the window",
         2: "registers, loaded before the window", 3: "the window alone",
         4: "shared memory, TMA bulk copies before the window", 5: "shared memory, TMA copies paced in the window"}
GEMVS = (0, 1, 2, 4, 5)                     # the modes with a GEMV
SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "smem_preload.cu")


def cubin_for(arch: str, cubin: str | None) -> bytes:
    """smem_preload.cu compiled by NVRTC for `arch` (sm_90), or the bytes of a prebuilt cubin."""
    if cubin:
        with open(cubin, "rb") as f:
            return f.read()
    from cuda.bindings import nvrtc

    def ok(res):
        err, *rest = res
        if int(err) != 0:
            raise RuntimeError(f"NVRTC: {err}")
        return rest[0] if rest else None
    with open(SRC, "rb") as f:
        prog = ok(nvrtc.nvrtcCreateProgram(f.read(), b"smem_preload.cu", 0, [], []))
    opts = [f"--gpu-architecture={arch}".encode(), b"-DK=%d" % K, b"-DR=%d" % R]
    err, = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    if int(err) != 0:
        size = ok(nvrtc.nvrtcGetProgramLogSize(prog))
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        raise RuntimeError(f"NVRTC could not compile smem_preload.cu:\n{log.decode(errors='replace')}")
    out = b" " * ok(nvrtc.nvrtcGetCUBINSize(prog))
    ok(nvrtc.nvrtcGetCUBIN(prog, out))
    return out


STAMPS = ("entry", "preload issued", "preload landed", "window's end", "row stored")     # smem_preload.cu's


class Kernel:
    """preload_gemv loaded into torch's context; launch() enqueues it on torch's current stream (graph-capturable).
    Each launch leaves its CTAs' stamps (STAMPS, globaltimer ns) in self.stamps."""

    def __init__(self, image: bytes):
        from memra_pp.cuda import ck, drv, init
        init()
        self.ck, self.d = ck, drv()
        self.mod = ck(self.d.cuModuleLoadData(image), "cuModuleLoadData")
        self.fn = ck(self.d.cuModuleGetFunction(self.mod, b"preload_gemv"), "cuModuleGetFunction")
        self.smem = R * K * 2
        self.stamps = torch.zeros(N // R, len(STAMPS), dtype=torch.int64, device="cuda")
        attr = self.d.CUfunction_attribute
        ck(self.d.cuFuncSetAttribute(self.fn, attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, self.smem),
           "cuFuncSetAttribute")
        self.regs = ck(self.d.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_NUM_REGS, self.fn), "cuFuncGetAttribute")
        self.per_sm = ck(self.d.cuOccupancyMaxActiveBlocksPerMultiprocessor(self.fn, THREADS, self.smem),
                         "cuOccupancyMaxActiveBlocksPerMultiprocessor")

    def launch(self, W, x, y, bar, tick, window: int, mode: int, kind: int = 0) -> None:
        s = self.d.CUstream(torch.cuda.current_stream().cuda_stream)
        args = ((W.data_ptr(), x.data_ptr(), y.data_ptr(), bar.data_ptr(), tick.data_ptr(), window, mode, kind,
                 self.stamps.data_ptr()), (ctypes.c_void_p,) * 5 + (ctypes.c_int,) * 3 + (ctypes.c_void_p,))
        self.ck(self.d.cuLaunchKernel(self.fn, N // R, 1, 1, THREADS, 1, 1, self.smem, s, args, 0), "cuLaunchKernel")


def split_spans(kernels, names) -> list[float]:
    """Per run of consecutive kernels whose names contain one of `names` (kernels: (start, end, name) in start
    order; any other kernel, such as the flush, ends a run): the span from its first start to its last end."""
    spans, cur = [], None
    for start, end, name in kernels:
        if any(n in name for n in names):
            cur = [start, end] if cur is None else [cur[0], max(cur[1], end)]
        elif cur is not None:
            spans.append(cur[1] - cur[0])
            cur = None
    if cur is not None:
        spans.append(cur[1] - cur[0])
    return spans


def lead_us(kernels, before: str, after: str) -> list[float]:
    """For each kernel named `after`: its start minus the end of the last kernel named `before` ahead of it (in the
    kernels' order), in the kernels' units; negative where it started before that kernel ended (PDL)."""
    out, end = [], None
    for start, stop, name in kernels:
        if before in name:
            end = stop
        elif after in name and end is not None:
            out.append(start - end)
            end = None
    return out


@functools.cache
def _mark() -> torch.Tensor:
    return torch.zeros(1, device="cuda")


def cut() -> None:
    """A one-element fill: in a profile it ends a run of the named kernels (split_spans), so runs side by side are
    not merged into one."""
    _mark().zero_()


def device_span_us(fn, *name_sets, replays: int = 100, runs: int = 1, lead: tuple[str, str] | None = None):
    """For each of `name_sets`, the median over `replays` replays of a CUDA graph of fn of the span of its kernels
    so named, in us (one float for one set, else a list), from CUPTI's timestamps (torch.profiler). The flush in fn
    sets L2's state and is not timed, so nothing measured apart is subtracted (the first run's subtraction of the
    flush was uncertain by 3-4 us). runs > 1: fn makes that many runs of the named kernels (cut by other kernels),
    exactly, and the last of each replay's is timed (the ones before it warm the code). lead=(before, after): also
    the median of lead_us, last in the list."""
    from torch.profiler import ProfilerActivity, profile
    g = captured(lambda: (cut(), fn()))     # back-to-back replays would merge into one run
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.replay()
        torch.cuda.synchronize()
    ks = device_kernels(prof)
    out = []
    for names in name_sets:
        spans = split_spans(ks, names)
        if runs > 1:
            if len(spans) != replays * runs:
                raise RuntimeError(f"the profile holds {len(spans)} runs of {names}, not {runs} a replay")
            spans = spans[runs - 1::runs]
        elif len(spans) < replays // 2:
            raise RuntimeError(f"the profile holds {len(spans)} runs of {names} for {replays} replays")
        out.append(sorted(spans)[len(spans) // 2])
    if lead is not None:
        leads = lead_us(ks, *lead)
        if len(leads) < replays // 2:
            raise RuntimeError(f"the profile holds {len(leads)} kernels {lead[1]} after a {lead[0]}")
        out.append(sorted(leads)[len(leads) // 2])
    return out[0] if len(out) == 1 else out


def stamp_table(stamps: torch.Tensor) -> dict:
    """A launch's stamps (CTAs x STAMPS, ns) as {stamp: (median, latest) over the CTAs, us from the first entry};
    a stamp no CTA wrote (zero) is left out."""
    t = stamps.double()
    t0 = t[:, 0].min()
    out = {}
    for i, name in enumerate(STAMPS):
        col = t[:, i]
        if bool((col > 0).all()):
            rel = (col - t0) / 1e3
            out[name] = (round(float(rel.median()), 2), round(float(rel.max()), 2))
    return out


def expected_tick(t0: torch.Tensor, window: int) -> torch.Tensor:
    """The window's values as the kernel must leave them: phase w reads buffer w % 2 and writes the other."""
    t = t0.clone().view(2, -1)
    for w in range(window):
        t[(w + 1) % 2] = t[w % 2].roll(-1) * 0.5 + 1.0
    return t.view(-1)


def plot(rows, path: str) -> None:
    """What the GEMV adds against the window, a panel for each barrier kind, today's Triton path in each."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    kinds = sorted({r["kind"] for r in rows if r.get("kind") is not None})
    fig, axes = plt.subplots(1, len(kinds), figsize=(4.2 * len(kinds), 4), sharey=True, squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        for label in sorted({r["label"] for r in rows if r["added_us"] is not None}):
            pts = sorted((r["window"], r["added_us"]) for r in rows if r["label"] == label
                         and r["added_us"] is not None and r.get("kind") in (kind, None))
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        ax.set_title(f"barrier: {KINDS[kind]}", fontsize=8)
        ax.set_xlabel("window: dependent phases before the GEMV")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"time the GEMV [{N}, {K}] bf16 adds (us)")
    axes[0][0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--window", default="0,4,16", help="dependent phases before the GEMV")
    ap.add_argument("--kinds", default="0,1,2,3,4", help="the grid barrier's kinds (KINDS, smem_preload.cu)")
    ap.add_argument("--modes", default=",".join(map(str, GEMVS)),
                    help="the GEMV modes to check and time (MODES; the window alone, 3, always runs)")
    ap.add_argument("--cubin", default=None, help="a prebuilt cubin instead of NVRTC")
    ap.add_argument("--flush-mb", type=int, default=192)
    ap.add_argument("--flush", default="read", choices=("read", "write"),
                    help="empty L2 by reading a buffer (clean lines, as a decode step leaves it) or writing it (dirty "
                         "lines: every load then also pays a write-back)")
    ap.add_argument("--window-cold", dest="window_in_l2", action="store_false",
                    help="leave the window's ticks and barrier words out of L2 after the flush (the second run's way)")
    ap.add_argument("--code-cold", dest="warm_code", action="store_false",
                    help="no warming launch before the timed one: its code is fetched from DRAM after the flush")
    a = ap.parse_args()
    windows = [int(v) for v in a.window.split(",")]
    kinds = [int(v) for v in a.kinds.split(",")]
    gemvs = [int(v) for v in a.modes.split(",") if v.strip()]      # none: the window alone
    if not set(gemvs) <= set(GEMVS):
        raise SystemExit(f"smem_preload_bench: --modes takes GEMV modes from {GEMVS}, not {a.modes}")
    if not torch.cuda.is_available():
        print("smem_preload_bench needs a CUDA GPU", flush=True)
        return 2
    os.makedirs(a.out, exist_ok=True)
    from memra_pp.kernels import gemv
    from l2_prefetch_bench import _tick
    torch.manual_seed(0)
    dev = torch.device("cuda")
    W = torch.randn(N, K, dtype=torch.bfloat16, device=dev) / K ** 0.5      # torch's context is current from here
    major, minor = torch.cuda.get_device_capability(dev)
    k = Kernel(cubin_for(f"sm_{major}{minor}", a.cubin))
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    if k.per_sm * sms < N // R:     # the grid barrier would spin forever on CTAs that never start
        raise SystemExit(f"smem_preload_bench: {N // R} CTAs must be resident at once; this GPU holds "
                         f"{k.per_sm} a multiprocessor on {sms}")
    x = torch.randn(1, K, dtype=torch.bfloat16, device=dev)
    y = torch.empty(N, dtype=torch.bfloat16, device=dev)
    W2, y2 = torch.randn_like(W), torch.empty_like(y)     # the code-warming launch's own weight and output
    bar = torch.zeros(2, dtype=torch.int32, device=dev)
    tick = torch.rand(2 * (N // R), dtype=torch.float32, device=dev)
    tick2 = torch.zeros_like(tick)
    ticks = torch.ones(256, dtype=torch.float32, device=dev)
    scratch = torch.ones(a.flush_mb * 2 ** 20 // 4, dtype=torch.float32, device=dev)
    flushed = torch.empty((), dtype=torch.float32, device=dev)
    ref = (W.float() @ x.float().view(-1)).view(-1)

    # the kernel is checked before it is timed: every mode's product, and the window's values after the barriers
    checked, disordered = [], {}
    for kind in kinds:
        for mode in gemvs:
            for window in (0, 3, 16):
                y.zero_()
                t0 = tick.clone()
                k.launch(W, x, y, bar, tick, window, mode, kind)
                torch.cuda.synchronize()
                torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)
                if not torch.equal(tick, expected_tick(t0, window)):
                    assert kind in (1, 2, 3), f"kind {kind}, mode {mode}, window {window}: barrier order"
                    disordered.setdefault(kind, []).append((mode, window))
                checked.append((kind, mode, window))
    assert int(bar[0]) == 0, "the barrier's count is not back to zero"
    print(f"checked {len(checked)} (kind, mode, window): the product against torch, the window's values against "
          f"the barriers' order; out of order (kinds without the memory model's ordering): {disordered or 'none'}",
          flush=True)

    def flush():
        """Empties L2 of the weight, then brings the window's few bytes back (the ticks and the barrier's words), as
        a decode step's latency chain finds the activations the kernel before it wrote: in the second run the flush
        left them in memory too, and the first phase's tick load and barrier atomic, misses queued behind the
        preload's 16.8 MB, charged the preload's whole read time to the window."""
        if a.flush == "read":
            torch.sum(scratch, 0, dtype=torch.float32, out=flushed)
        else:
            scratch.fill_(1.0)
        if a.window_in_l2:
            tick.add_(0.0)
            bar.add_(0)
            ticks.add_(0.0)
            x.add_(0.0)         # the GEMV's input, as the phase before it left it (adding 0 keeps every product)

    def persistent(window, mode, kind):
        """The timed launch after the flush; first, with --warm-code, the same mode without a window on a weight of
        the same size that is not W (W stays out of L2) and a marker kernel between: a megakernel runs the same code
        every layer, so its instructions are on chip, where one launch after a flush fetches them from DRAM."""
        def run():
            flush()
            if a.warm_code:
                k.launch(W2, x, y2, bar, tick2, 0, mode, kind)
                cut()
            k.launch(W, x, y, bar, tick, window, mode, kind)
        return run

    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name(dev)}: copy {bw / 1e12:.2f} TB/s; W {W.numel() * 2 / 1e6:.1f} MB "
          f"({W.numel() * 2 / bw * 1e6:.2f} us at the copy bandwidth); kernel {k.regs} registers, {k.smem // 1024} KB "
          f"shared; L2 emptied by a {a.flush} of {a.flush_mb} MB before each replay (not timed)", flush=True)
    rows = []
    hot = device_span_us(lambda: gemv.linear(x, W), ("_gemv_kernel",))
    cold = device_span_us(lambda: (flush(), gemv.linear(x, W)), ("_gemv_kernel",))
    rows.append({"label": "the Triton GEMV, weight in L2", "mode": "l2", "window": 0, "us": hot, "added_us": None})
    rows.append({"label": "the Triton GEMV, L2 emptied", "mode": "cold", "window": 0, "us": cold, "added_us": None})
    print(f"  the Triton GEMV's own span: weight in L2 {hot:.2f} us, after L2 was emptied {cold:.2f} us (the L2 "
          "question, without a subtraction)", flush=True)
    runs = 2 if a.warm_code else 1
    for window in windows:
        for kind in kinds:
            alone = device_span_us(persistent(window, 3, kind), ("preload_gemv",), runs=runs)
            rows.append({"label": "persistent: " + MODES[3], "mode": 3, "kind": kind, "window": window,
                         "us": alone, "added_us": None})
            print(f"  window {window:2d}, barrier {kind}: {MODES[3]:42s} {alone:7.2f} us", flush=True)
            for mode in gemvs:
                t = device_span_us(persistent(window, mode, kind), ("preload_gemv",), runs=runs)
                rows.append({"label": "persistent: " + MODES[mode], "mode": mode, "kind": kind, "window": window,
                             "us": t, "added_us": t - alone})
                print(f"  window {window:2d}, barrier {kind}: {MODES[mode]:42s} {t:7.2f} us (the GEMV adds "
                      f"{t - alone:6.2f})", flush=True)

        def ticks_only():
            for _ in range(window):
                _tick[(1,)](ticks, BLOCK=256)
        base = device_span_us(lambda: (flush(), ticks_only()), ("_tick",)) if window else 0.0
        t, own, *lead = device_span_us(lambda: (flush(), ticks_only(), gemv.linear(x, W)), ("_tick", "_gemv_kernel"),
                                       ("_gemv_kernel",), lead=("_tick", "_gemv_kernel") if window else None)
        lead = lead[0] if lead else float("nan")
        rows.append({"label": "today: tiny kernels, then the Triton GEMV", "mode": "triton", "window": window,
                     "us": t, "added_us": t - base, "window_us": base, "gemv_us": own, "gemv_lead_us": lead})
        print(f"  window {window:2d}: {'today: ' + str(window) + ' tiny kernels, then the Triton GEMV':52s} {t:7.2f}"
              f" us (the GEMV adds {t - base:6.2f}; the kernels alone {base:.2f}; the GEMV's own span {own:.2f}, "
              f"starting {lead:.2f} us after the last tiny kernel ends)", flush=True)
    # where the time after the window goes: one launch of each mode at the longest window, its CTAs' stamps
    stamps = {}
    print(f"  stamps, window {windows[-1]}, barrier 0 (us from the first CTA's entry: median / latest CTA):",
          flush=True)
    for mode in [3] + gemvs:
        k.stamps.zero_()
        persistent(windows[-1], mode, 0)()
        torch.cuda.synchronize()
        stamps[mode] = stamp_table(k.stamps)
        print(f"    {MODES[mode]:42s} "
              + "; ".join(f"{n} {med:.2f} / {late:.2f}" for n, (med, late) in stamps[mode].items()), flush=True)
    with open(os.path.join(a.out, "smem_preload_bench.json"), "w") as f:
        json.dump({"copy_bandwidth_Bps": bw, "flush": a.flush, "window_in_l2": a.window_in_l2,
                   "warm_code": a.warm_code, "N": N, "K": K, "rows_per_cta": R, "registers": k.regs,
                   "checked": checked, "disordered": disordered, "rows": rows,
                   "stamps": stamps}, f, indent=1)
    plot(rows, os.path.join(a.out, "smem_preload.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
