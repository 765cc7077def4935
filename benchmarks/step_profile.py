"""A profiled decode step read two ways (benchmarks/gpu_engine_step.py --profile): device time by kernel name, and
the step's critical path when kernels overlap under PDL (each kernel's exposed time), with a plot of the latter."""
from __future__ import annotations


def kernel_summary(prof, top: int = 30) -> str:
    """Device time of one profiled step by kernel name: how many kernels, and where the time goes."""
    by: dict[str, list] = {}
    for start, end, name in device_kernels(prof):
        d = by.setdefault(name[:90], [0, 0.0])
        d[0] += 1
        d[1] += end - start
    total = sum(v[1] for v in by.values())
    n = sum(v[0] for v in by.values())
    lines = [f"{n} kernels, {total / 1e3:.2f} ms device time"]
    for name, (k, us) in sorted(by.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"{us / 1e3:8.3f} ms {us / max(total, 1e-9):6.1%} {k:6d}x {us / k:8.1f} us  {name}")
    return "\n".join(lines)


def device_kernels(prof) -> list:
    """The profile's device kernels as (start us, end us, name), in order of their start."""
    from torch.autograd import DeviceType
    return sorted(((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == DeviceType.CUDA), key=lambda k: k[0])


def critical_path(prof) -> dict:
    """Where one profiled step's wall time goes when kernels overlap (PDL): the kernels in order of their start, each
    charged with the part of its span past the latest end before it (its exposed time), and an idle gap before it
    charged to it apart. By kernel name: {name: [count, device us, exposed us, idle us]}; the exposed and idle times
    together sum to the step's span."""
    ks = [(start, end, name[:90]) for start, end, name in device_kernels(prof)]
    by: dict[str, list] = {}
    latest = ks[0][0] if ks else 0.0
    for start, end, name in ks:
        d = by.setdefault(name, [0, 0.0, 0.0, 0.0])
        d[0] += 1
        d[1] += end - start
        if start > latest:
            d[3] += start - latest
        if end > latest:
            d[2] += end - max(latest, start)
            latest = end
    return by


def critical_text(by: dict, top: int = 30) -> str:
    if not by:
        return "no kernels profiled"
    exposed, idle, device = (sum(v[i] for v in by.values()) for i in (2, 3, 1))
    lines = [f"{sum(v[0] for v in by.values())} kernels over {(exposed + idle) / 1e3:.3f} ms: exposed "
             f"{exposed / 1e3:.3f} ms, idle {idle / 1e3:.3f} ms, device time {device / 1e3:.3f} ms",
             "   exposed     idle   device  count  exposed/kernel  name"]
    for name, (k, dev, exp, gap) in sorted(by.items(), key=lambda kv: -(kv[1][2] + kv[1][3]))[:top]:
        lines.append(f"{exp / 1e3:7.3f} ms {gap / 1e3:6.3f} {dev / 1e3:8.3f} {k:6d} {exp / k:10.2f} us  {name}")
    return "\n".join(lines)


def plot_critical(rows: list, png: str, top: int = 10) -> bool:
    """A panel per profiled (mode, batch): each kernel name's exposed time (its share of the step's critical path)
    beside its device time, per step; the idle gaps (host time between the profiled step's launches, outside its
    graph) in the title. False where nothing was profiled."""
    rows = [r for r in rows if r.get("critical")]
    if not rows:
        return False
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(len(rows), 1, figsize=(10, 2.2 + 0.42 * top * len(rows)), squeeze=False)
    for ax, r in zip(axes[:, 0], rows):
        items = sorted(r["critical"].items(), key=lambda kv: -kv[1][2])[:top][::-1]
        idle = sum(v[3] for v in r["critical"].values())
        names = [f"{n[:40]} ({v[0]}x)" for n, v in items]
        y = range(len(items))
        ax.barh([i + 0.2 for i in y], [v[1] / 1e3 for _, v in items], 0.4, label="device time", color="#bbbbbb")
        ax.barh([i - 0.2 for i in y], [v[2] / 1e3 for _, v in items], 0.4, label="exposed (critical path)",
                color="#1f77b4")
        ax.set_yticks(list(y), names, fontsize=8)
        ax.set_xlabel("ms per step")
        ax.set_title(f"{r['mode']}, batch {r['batch']}: step {r['step_ms']:.2f} ms, floor {r['floor_ms']:.2f} ms "
                     f"(profiled: exposed {sum(v[2] for v in r['critical'].values()) / 1e3:.2f} ms, host gaps "
                     f"{idle / 1e3:.2f} ms)", fontsize=9)
        ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return True
