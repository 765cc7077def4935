"""Overlay publication by host bounce, timed: a 256 x 5120 float32 image's rows (issue 7, target 6: under 1 ms)
go from a tower engine to an intake engine, in one process (publish_out + land) and between two Ray actors (the
tower actor's publish_out, the object store, the intake actor's land: the path a deployment's image takes), the
latter also with the rows as a Python bytes object (the transit form before 2026-12-01), side by side. Through the
intake's publication slot the bytes' own path (the tower's dtoh into the slot + the intake's htod out of it, both
DMA from page-locked memory on a GPU) is also timed apart from the Ray call that asks the tower for the rows.

    .venv/bin/python benchmarks/overlay_publish.py [--rows 256] [--hidden 5120] [--n 50] [--tower cpu]
        [--intake cpu] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def in_process(rows: int, hidden: int, n: int, tower_dev: str, intake_dev: str) -> list[float]:
    from memra_pp.engine import Engine
    from memra_pp.overlay import publish_out
    tower, intake = Engine(tower_dev), Engine(intake_dev)
    x = torch.randn(rows, hidden, device=tower.device)
    spans = [(0, 0, rows)]
    ts = []
    for _ in range(n + 3):
        t = time.perf_counter()
        ov = publish_out(tower, x, spans).land(intake)
        if intake.is_cuda:
            torch.cuda.synchronize(intake.device)
        ts.append((time.perf_counter() - t) * 1e3)
        assert torch.equal(ov.rows.cpu(), x.cpu())          # bit-exact
    return ts[3:]


def across_actors(rows: int, hidden: int, n: int, tower_dev: str, intake_dev: str, as_bytes=False,
                  via_slot=False) -> list[float]:
    import ray

    @ray.remote(num_cpus=0.1)
    class Tower:
        def __init__(self):
            from memra_pp.engine import Engine
            self.eng = Engine(tower_dev)
            self.x = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(0)).to(self.eng.device)

        def publish(self, as_bytes: bool = False, inbox=None):
            import dataclasses
            from memra_pp.overlay import publish_out
            from memra_pp.stages.pub_inbox import InboxWriter
            if inbox is not None:        # the rows' bytes into the intake's slot, the answer a description only
                self.w = getattr(self, "w", None) or InboxWriter(self.eng)
                t = time.perf_counter()
                with self.w.lease(*inbox) as into:
                    pub = publish_out(self.eng, self.x, [(0, 0, rows)], into=into)
                return pub, (time.perf_counter() - t) * 1e3      # and the tower's dtoh time
            pub = publish_out(self.eng, self.x, [(0, 0, rows)])
            # as_bytes: the rows as a Python bytes object (how publications travelled before 2026-12-01)
            return dataclasses.replace(pub, data=pub.data.tobytes()) if as_bytes else pub

    @ray.remote(num_cpus=0.1)
    class Intake:
        def __init__(self, tower):
            from memra_pp.engine import Engine
            self.eng, self.tower = Engine(intake_dev), tower

        def run(self, n, as_bytes, via_slot):
            from memra_pp.stages.pub_inbox import PublicationInbox
            inbox = PublicationInbox("bench", engine=self.eng)
            ts, data = [], []
            for _ in range(n + 3):
                t = time.perf_counter()
                if via_slot:
                    with inbox.slot(rows * hidden * 4, 30) as (name, size, buf):
                        pub, dtoh_ms = ray.get(self.tower.publish.remote(inbox=(name, size)))
                        t1 = time.perf_counter()
                        ov = pub.land(self.eng, host=buf)
                        if self.eng.is_cuda:
                            torch.cuda.synchronize(self.eng.device)
                        data.append(dtoh_ms + (time.perf_counter() - t1) * 1e3)   # the bytes' path alone
                else:
                    ov = ray.get(self.tower.publish.remote(as_bytes)).land(self.eng)
                if self.eng.is_cuda:
                    torch.cuda.synchronize(self.eng.device)
                ts.append((time.perf_counter() - t) * 1e3)
            inbox.close()
            ref = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(0))
            assert torch.equal(ov.rows.cpu(), ref), "published rows differ from the tower's"
            return (ts[3:], data[3:]) if via_slot else ts[3:]

    share = 0.5 if tower_dev == intake_dev else 1       # both actors on one GPU: each asks for half of it
    gpus = lambda d: share if d.startswith("cuda") else 0   # noqa: E731
    tower = Tower.options(num_gpus=gpus(tower_dev)).remote()
    intake = Intake.options(num_gpus=gpus(intake_dev)).remote(tower)
    return ray.get(intake.run.remote(n, as_bytes, via_slot), timeout=300)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--tower", default="cpu")
    ap.add_argument("--intake", default="cpu")
    ap.add_argument("--json")
    a = ap.parse_args()
    import ray
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    mb = a.rows * a.hidden * 4 / 2**20
    out = {"rows": a.rows, "hidden": a.hidden, "MiB": mb, "tower": a.tower, "intake": a.intake}
    runs = (("in_process", in_process),
            ("across_actors_via_slot", lambda *x: across_actors(*x, via_slot=True)),
            ("across_actors", across_actors),
            ("across_actors_as_bytes", lambda *x: across_actors(*x, as_bytes=True)))
    for name, fn in runs:
        ts = fn(a.rows, a.hidden, a.n, a.tower, a.intake)
        if isinstance(ts, tuple):    # via the slot: also the data path alone (tower dtoh + intake htod), no call
            ts, data = ts
            out["slot_data_path"] = {"p50_ms": _pct(data, 0.5), "p90_ms": _pct(data, 0.9), "min_ms": min(data)}
            print(f"slot data path (the tower's dtoh into the slot + the intake's htod, no Ray call): p50 "
                  f"{out['slot_data_path']['p50_ms']:.3f} ms, p90 {out['slot_data_path']['p90_ms']:.3f} ms",
                  flush=True)
        out[name] = {"p50_ms": _pct(ts, 0.5), "p90_ms": _pct(ts, 0.9), "min_ms": min(ts)}
        print(f"{name:22s} {a.rows} x {a.hidden} float32 ({mb:.1f} MiB) {a.tower} -> {a.intake}: p50 "
              f"{out[name]['p50_ms']:.2f} ms, p90 {out[name]['p90_ms']:.2f} ms, min {out[name]['min_ms']:.2f} ms",
              flush=True)
    ray.shutdown()
    if a.json:
        json.dump(out, open(a.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
