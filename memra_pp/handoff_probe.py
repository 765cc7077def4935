"""The boundary handoff's host path, measured: each call of a send timed inside a probe's sender process, the same
calls in one idle process, and a plot of the split (gpu_checks --handoff-checks). Runs in the probe's processes."""
from __future__ import annotations

import time

import torch

from memra_pp import cuda
from memra_pp.engine import Engine, residency_of
from memra_pp.stages import gpu_slots


def split_sender_calls() -> dict:
    """Time each call of the sender's send path in this (spawned, probe-only) process: every wrapped function adds
    its wall time to {name: [ns, calls]}. The wrappers cost about a microsecond each; compare the split with itself."""
    from memra_pp.stages import mailbox
    acc: dict = {}

    def timed(owner, name, label):
        fn = getattr(owner, name)

        def wrapper(*a, **k):
            t = time.perf_counter_ns()
            try:
                return fn(*a, **k)
            finally:
                slot = acc.setdefault(label, [0, 0])
                slot[0] += time.perf_counter_ns() - t
                slot[1] += 1
        setattr(owner, name, wrapper)

    for owner, name, label in ((gpu_slots, "_require_current", "require_current"),
                               (gpu_slots._GpuSender, "_check_source", "check_source"),
                               (gpu_slots._GpuSender, "_stream", "stream_handle"),
                               (cuda, "stream_wait_event", "stream_wait_event"),
                               (cuda, "memcpy_dtod_async", "memcpy_dtod_async"),
                               (cuda, "memcpy_dtoh_async", "memcpy_dtoh_async"),
                               (cuda, "event_record", "event_record"),
                               (cuda, "event_synchronize", "event_synchronize"),
                               (mailbox.HeaderWriter, "send", "header")):
        timed(owner, name, label)
    return acc


def host_calls(dev: int = 0, n: int = 2000) -> dict:
    """Mean host microseconds of each call a boundary send makes, one process, nothing else running: what the
    handoff's host path is made of on this machine (the fast checks and the long way side by side)."""
    from memra_pp.stages.header import encode_header
    eng = Engine(f"cuda:{dev}")
    a = torch.zeros(64, 5120, dtype=torch.bfloat16, device=eng.device)
    b = torch.empty_like(a)
    ev = cuda.event_create(interprocess=True)
    s = cuda.current_stream_handle(dev)
    hdr = {"kind": "decode", "mb": 3, "slot": 1, "dtype": "bfloat16", "shape": [64, 5120], "t_ns": time.time_ns(),
           "slots": list(range(64)), "starts": list(range(64))}
    calls = {"noop": lambda: None,
             "stream_handle_torch": lambda: cuda.stream_handle(torch.cuda.current_stream(eng.device)),
             "stream_handle_cached": lambda: cuda.current_stream_handle(dev),
             "residency_full": lambda: residency_of(a, eng) == eng.ctx,
             "residency_owns": lambda: eng.owns(a),
             "current_full": lambda: cuda.context_uid(cuda.current_context()) == eng.ctx.uid,
             "current_fast": eng.is_current,
             "event_record": lambda: cuda.event_record(ev, s),
             "stream_wait_event": lambda: cuda.stream_wait_event(s, ev),
             # 1 KB: the enqueue's cost, without 2,000 queued 20-us copies filling the stream's queue
             "memcpy_dtod_async": lambda: cuda.memcpy_dtod_async(b.data_ptr(), a.data_ptr(), 1024, s),
             "encode_header": lambda: encode_header(hdr)}
    out = {}
    for name, fn in calls.items():
        for _ in range(50):
            fn()
        t = time.perf_counter_ns()
        for _ in range(n):
            fn()
        out[name] = round((time.perf_counter_ns() - t) / n / 1e3, 2)
        torch.cuda.synchronize()
    cuda.event_destroy(ev)
    out["ok"] = bool(eng.owns(a) and eng.is_current())
    return out


def plot_split(results: dict, path: str) -> bool:
    """A bar per call of the send path, full checks beside fast (the checks_split_* scenarios' split_us), each
    labelled with its sender p50 from the runs without timing wrappers (checks_*_0) where the results have them;
    False where there is no split to draw."""
    split = {m: results.get(f"checks_split_{m}", {}).get("sender", {}).get("split_us") for m in ("full", "fast")}
    if not all(split.values()):
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = sorted(set(split["full"]) | set(split["fast"]), key=lambda k: -split["full"].get(k, 0.0))
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, (mode, color) in enumerate((("full", "tab:gray"), ("fast", "tab:blue"))):
        plain = results.get(f"checks_{mode}_0", {}).get("sender", {}).get("stats")
        p50 = (plain or results[f"checks_split_{mode}"]["sender"]["stats"])["handoff_p50_us"]
        ax.barh([y + 0.38 * i for y in range(len(names))], [split[mode].get(n, 0.0) for n in names], 0.38,
                color=color, label=f"{mode} checks (sender p50 {p50:.1f} us{'' if plain else ', timed run'})")
    ax.set_yticks([y + 0.19 for y in range(len(names))], names)
    ax.invert_yaxis()
    ax.set_xlabel("mean us per call, timed in the sender process (about 1 us of it the timing's)")
    ax.set_title("Boundary send, [64, 5120] bf16, peer slots: where the host time goes")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
