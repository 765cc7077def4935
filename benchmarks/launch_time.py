"""How long a CPU deployment takes to launch, answer its first request and shut down (1, 2 and 3 stages of the
embedded tiny checkpoint, real Ray), and how long CLI processes take: `memra-pp launch` to its ready line, and
`status`, `plan` and `generate` processes against that launch's detached tiny-cpu deployment, and `stop` (its
process, and until the launcher has exited). Run from the repository root, with no other Ray cluster up.

    .venv/bin/python benchmarks/launch_time.py [--repeats 5] [--vision] [--no-cli] [--out DIR]

Prints the median of each and writes launch_time.json under --out. --vision: a tiny checkpoint with a vision tower
(written to a temporary directory), whose tower the last stage holds. Each launch also reports every stage process's
CPU seconds at ready (its start: Ray's worker, the imports, the slice's load). Run it on a quiet machine: every
figure is a process start, so other work on the cores moves it."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("OMP_NUM_THREADS", "1")


CLI_COMMANDS = {"status": ["status", "tiny-cpu"], "plan": ["plan", "cluster_configs/tiny-cpu.yaml"],
                "generate": ["generate", "tiny-cpu", "5,17,42", "--ids", "--max-new-tokens", "4"]}


def cli_figures(repeats: int) -> dict:
    """Median wall times of CLI processes against the CLI's detached tiny-cpu deployment, started here with
    `memra-pp launch` (its own Ray cluster: run this where no other cluster is up): the launcher's time to its ready
    line (one launch), then `status`, `plan` and `generate` processes, each `repeats` times."""
    cli = [sys.executable, "-m", "memra_pp.cli"]
    log = tempfile.TemporaryFile("w+")      # the launcher's output, read for its "ray address" line
    t0 = time.perf_counter()
    launcher = subprocess.Popen(cli + ["launch", "cluster_configs/tiny-cpu.yaml"], stdout=log, stderr=subprocess.STDOUT,
                                env=dict(os.environ, PYTHONUNBUFFERED="1"))
    out = {}
    try:
        for _ in range(4800):
            log.seek(0)
            if "ray address" in log.read():
                break
            if launcher.poll() is not None:
                raise SystemExit(f"the launcher exited: {log.read()[-2000:]}")
            time.sleep(0.025)
        out["cli_launch_ready_s"] = round(time.perf_counter() - t0, 2)
        print(f"  memra-pp launch, ready after {out['cli_launch_ready_s']:.2f} s", flush=True)
        for what, argv in CLI_COMMANDS.items():
            times = []
            for r in range(repeats):
                t0 = time.perf_counter()
                p = subprocess.run(cli + argv, capture_output=True, text=True, timeout=120)
                times.append(time.perf_counter() - t0)
                assert p.returncode == 0, p.stderr[-2000:]
                print(f"  memra-pp {what}, run {r + 1}/{repeats}: {times[-1]:.2f} s", flush=True)
            out[f"cli_{what}_s"] = round(statistics.median(times), 3)
        t0 = time.perf_counter()
        p = subprocess.run(cli + ["stop", "tiny-cpu"], capture_output=True, text=True, timeout=120)
        out["cli_stop_s"] = round(time.perf_counter() - t0, 2)
        assert p.returncode == 0, p.stderr[-2000:]
        launcher.wait(timeout=60)
        out["cli_stop_launcher_exit_s"] = round(time.perf_counter() - t0, 2)
        print(f"  memra-pp stop: {out['cli_stop_s']:.2f} s; the launcher exited "
              f"{out['cli_stop_launcher_exit_s']:.2f} s after the stop began", flush=True)
    finally:
        if launcher.poll() is None:
            launcher.send_signal(2)
            launcher.wait(timeout=60)
    return out


def stage_cpu_s(dep) -> list[float]:
    """Each stage process's CPU seconds so far (utime + stime from /proc: the stages run on this host)."""
    import ray
    from memra_pp.shm import proc_stat
    pids = ray.get([a.pid.remote() for a in dep.actors], timeout=30)
    return [(int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK") for f in map(proc_stat, pids)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--vision", action="store_true", help="a tiny checkpoint with a vision tower")
    ap.add_argument("--no-cli", action="store_true", help="skip the CLI figures")
    args = ap.parse_args()
    import ray
    import memra_pp
    from memra_pp.defaults import ensure_tiny
    if args.vision:
        from memra_pp.model.tiny import make_tiny
        path = str(make_tiny(os.path.join(tempfile.mkdtemp(prefix="launch-time-"), "tiny-vision"), vision=True))
    else:
        path = str(ensure_tiny())
    res = {} if args.no_cli else cli_figures(args.repeats)
    ray.init(num_cpus=2, include_dashboard=False, namespace="launch-time", logging_level="WARNING")
    try:
        for n in (1, 2, 3):
            rows = []
            for r in range(args.repeats):
                cfg = {"name": f"lt{n}", "model": {"path": path}, "stages": [{"device": "cpu", "num_cpus": 0.1}] * n}
                t0 = time.perf_counter()
                dep = memra_pp.launch(cfg)
                t1 = time.perf_counter()
                cpu = stage_cpu_s(dep)
                dep.client().generate([1, 2, 3], max_new_tokens=4)
                t2 = time.perf_counter()
                dep.shutdown()
                rows.append((t1 - t0, t2 - t1, time.perf_counter() - t2, sum(cpu), cpu[-1]))
                print(f"  {n} stage(s), run {r + 1}/{args.repeats}: launch {rows[-1][0]:.2f} s, stage CPU "
                      f"{' '.join(f'{c:.2f}' for c in cpu)} s", flush=True)
            res[f"{n}_stages"] = {k: statistics.median(x[i] for x in rows)
                                  for i, k in enumerate(("launch_s", "first_generate_s", "shutdown_s",
                                                         "stages_cpu_s", "last_stage_cpu_s"))}
    finally:
        ray.shutdown()
    for k, v in res.items():
        print(f"{k}: {json.dumps(v) if isinstance(v, dict) else f'{v:.2f} s'}")
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "launch_time.json"), "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
