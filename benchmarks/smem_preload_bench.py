"""Can a weight that depends on nothing be read during a latency window, so that the GEMV after it costs almost no
DRAM time? The premise of a layer megakernel (issue 7, MoE target 1; docs/PERF.md, sixteenth session): the 35B-A3B's
out_proj ([2048, 4096] bf16, 16.8 MB) fits in the H200's shared memory, and the conv, GDN and gated-norm chain before
it keeps DRAM idle for several microseconds a layer.

One persistent CUDA kernel (benchmarks/smem_preload.cu, compiled with NVRTC for this GPU), 128 CTAs of 16 rows each
and a control warp, runs a window of n grid-wide barriers (each CTA reads another's value of the phase before), then
the GEMV, with the weight read (mode 0) from memory after the window; (1) into shared memory by cp.async before the
window; (2) into registers before the window; (3) no GEMV: the window alone. Beside it, today's path: n dependent
tiny kernels, then the step's Triton GEMV (kernels/gemv.py). Each figure is the median over 100 replays of a CUDA
graph of the device span of the timed kernels, from CUPTI's timestamps; each replay first empties L2 (by reading a
buffer: clean lines, as a decode step leaves L2; --flush write leaves it dirty), untimed. What the GEMV adds is
each row minus its window alone.

    python -u benchmarks/smem_preload_bench.py --out DIR [--window 0,2,4,8,16] [--cubin FILE]

--cubin loads a cubin built elsewhere (nvcc -cubin -arch=sm_90 benchmarks/smem_preload.cu) where NVRTC is missing.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os

import torch

from gpu_decode import copy_bandwidth      # benchmarks/ is on the path
from moe_kernels import captured
from step_profile import device_kernels

N, K, R = 2048, 4096, 16                    # the 35B-A3B's out_proj; R rows a CTA (smem_preload.cu's defaults)
THREADS = 288                               # smem_preload.cu: eight worker warps and the control warp
MODES = {0: "from memory after the window", 1: "shared memory, cp.async before the window",
         2: "registers, loaded before the window", 3: "the window alone"}
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


class Kernel:
    """preload_gemv loaded into torch's context; launch() enqueues it on torch's current stream (graph-capturable)."""

    def __init__(self, image: bytes):
        from memra_pp.cuda import ck, drv, init
        init()
        self.ck, self.d = ck, drv()
        self.mod = ck(self.d.cuModuleLoadData(image), "cuModuleLoadData")
        self.fn = ck(self.d.cuModuleGetFunction(self.mod, b"preload_gemv"), "cuModuleGetFunction")
        self.smem = R * K * 2
        attr = self.d.CUfunction_attribute
        ck(self.d.cuFuncSetAttribute(self.fn, attr.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, self.smem),
           "cuFuncSetAttribute")
        self.regs = ck(self.d.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_NUM_REGS, self.fn), "cuFuncGetAttribute")
        self.per_sm = ck(self.d.cuOccupancyMaxActiveBlocksPerMultiprocessor(self.fn, THREADS, self.smem),
                         "cuOccupancyMaxActiveBlocksPerMultiprocessor")

    def launch(self, W, x, y, bar, tick, window: int, mode: int) -> None:
        s = self.d.CUstream(torch.cuda.current_stream().cuda_stream)
        args = ((W.data_ptr(), x.data_ptr(), y.data_ptr(), bar.data_ptr(), tick.data_ptr(), window, mode),
                (ctypes.c_void_p,) * 5 + (ctypes.c_int, ctypes.c_int))
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


def device_span_us(fn, *name_sets, replays: int = 100):
    """For each of `name_sets`, the median over `replays` replays of a CUDA graph of fn of the span of its kernels
    so named, in us (one float for one set, else a list), from CUPTI's timestamps (torch.profiler). The flush in fn
    sets L2's state and is not timed, so nothing measured apart is subtracted (the first run's subtraction of the
    flush was uncertain by 3-4 us)."""
    from torch.profiler import ProfilerActivity, profile
    g = captured(fn)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            g.replay()
        torch.cuda.synchronize()
    ks = device_kernels(prof)
    out = []
    for names in name_sets:
        spans = split_spans(ks, names)
        if len(spans) < replays // 2:
            raise RuntimeError(f"the profile holds {len(spans)} runs of {names} for {replays} replays")
        out.append(sorted(spans)[len(spans) // 2])
    return out[0] if len(out) == 1 else out


def expected_tick(t0: torch.Tensor, window: int) -> torch.Tensor:
    """The window's values as the kernel must leave them: phase w reads buffer w % 2 and writes the other."""
    t = t0.clone().view(2, -1)
    for w in range(window):
        t[(w + 1) % 2] = t[w % 2].roll(-1) * 0.5 + 1.0
    return t.view(-1)


def plot(rows, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for label in sorted({r["label"] for r in rows if r["added_us"] is not None}):
        pts = sorted((r["window"], r["added_us"]) for r in rows if r["label"] == label and r["added_us"] is not None)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
    ax.set_xlabel("window: dependent phases before the GEMV")
    ax.set_ylabel("time the GEMV adds (us)")
    ax.set_title(f"out_proj [{N}, {K}] bf16 after a latency window (H200)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--window", default="0,2,4,8,16", help="dependent phases before the GEMV")
    ap.add_argument("--cubin", default=None, help="a prebuilt cubin instead of NVRTC")
    ap.add_argument("--flush-mb", type=int, default=192)
    ap.add_argument("--flush", default="read", choices=("read", "write"),
                    help="empty L2 by reading a buffer (clean lines, as a decode step leaves it) or writing it (dirty "
                         "lines: every load then also pays a write-back)")
    a = ap.parse_args()
    windows = [int(v) for v in a.window.split(",")]
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
    bar = torch.zeros(2, dtype=torch.int32, device=dev)
    tick = torch.rand(2 * (N // R), dtype=torch.float32, device=dev)
    ticks = torch.ones(256, dtype=torch.float32, device=dev)
    scratch = torch.ones(a.flush_mb * 2 ** 20 // 4, dtype=torch.float32, device=dev)
    flushed = torch.empty((), dtype=torch.float32, device=dev)
    ref = (W.float() @ x.float().view(-1)).view(-1)

    # the kernel is checked before it is timed: every mode's product, and the window's values after the barriers
    checked = []
    for mode in (0, 1, 2):
        for window in (0, 3):
            y.zero_()
            t0 = tick.clone()
            k.launch(W, x, y, bar, tick, window, mode)
            torch.cuda.synchronize()
            torch.testing.assert_close(y.float(), ref, rtol=2e-2, atol=2e-2)
            assert torch.equal(tick, expected_tick(t0, window)), f"mode {mode}, window {window}: barrier order"
            checked.append((mode, window))
    assert int(bar[0]) == 0, "the barrier's count is not back to zero"
    print(f"checked: {checked} (the product against torch, the window's values against the barriers' order)",
          flush=True)

    def flush():
        if a.flush == "read":
            torch.sum(scratch, 0, dtype=torch.float32, out=flushed)
        else:
            scratch.fill_(1.0)

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
    for window in windows:
        alone = device_span_us(lambda: (flush(), k.launch(W, x, y, bar, tick, window, 3)), ("preload_gemv",))
        rows.append({"label": "persistent: " + MODES[3], "mode": 3, "window": window, "us": alone,
                     "added_us": None})
        print(f"  window {window:2d}: {MODES[3]:44s} {alone:7.2f} us", flush=True)
        for mode in (0, 1, 2):
            t = device_span_us(lambda: (flush(), k.launch(W, x, y, bar, tick, window, mode)), ("preload_gemv",))
            rows.append({"label": "persistent: " + MODES[mode], "mode": mode, "window": window, "us": t,
                         "added_us": t - alone})
            print(f"  window {window:2d}: {MODES[mode]:44s} {t:7.2f} us (the GEMV adds {t - alone:6.2f})",
                  flush=True)

        def ticks_only():
            for _ in range(window):
                _tick[(1,)](ticks, BLOCK=256)
        base = device_span_us(lambda: (flush(), ticks_only()), ("_tick",)) if window else 0.0
        t, own = device_span_us(lambda: (flush(), ticks_only(), gemv.linear(x, W)), ("_tick", "_gemv_kernel"),
                                ("_gemv_kernel",))
        rows.append({"label": "today: tiny kernels, then the Triton GEMV", "mode": "triton", "window": window,
                     "us": t, "added_us": t - base, "window_us": base, "gemv_us": own})
        print(f"  window {window:2d}: {'today: ' + str(window) + ' tiny kernels, then the Triton GEMV':44s} {t:7.2f}"
              f" us (the GEMV adds {t - base:6.2f}; the kernels alone {base:.2f}; the GEMV's own span {own:.2f})",
              flush=True)
    with open(os.path.join(a.out, "smem_preload_bench.json"), "w") as f:
        json.dump({"copy_bandwidth_Bps": bw, "flush": a.flush, "N": N, "K": K, "rows_per_cta": R,
                   "registers": k.regs, "checked": checked, "rows": rows}, f, indent=1)
    plot(rows, os.path.join(a.out, "smem_preload.png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
