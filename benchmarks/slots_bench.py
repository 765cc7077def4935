"""Boundary handoff latency between two processes (CPU shm slots + socket channel), next to an OS pipe round trip.

Run: .venv/bin/python benchmarks/slots_bench.py [--n 2000] [--json]. The parent is the receiver, a spawned child
the sender.
"""

import argparse
import json
import multiprocessing as mp
import os
import time

import torch

from memra_pp.stages.channel import ChannelListener, connect
from memra_pp.stages.shm_slots import SlotReceiver, SlotSender

PAYLOADS = [("[64, 64] float32", (64, 64), torch.float32), ("[64, 5120] bfloat16", (64, 5120), torch.bfloat16),
            ("[64, 64] float32, mailbox + every header on the socket", (64, 64), torch.float32),
            ("[64, 64] float32, header mailbox", (64, 64), torch.float32),
            ("[64, 5120] bfloat16, header mailbox", (64, 5120), torch.bfloat16),
            ("[64, 5120] bfloat16, mailbox + every header on the socket", (64, 5120), torch.bfloat16)]
SPIN_US = [0.0, 0.0, 2000.0, 2000.0, 2000.0, 2000.0]  # these receivers poll a header mailbox (stages/mailbox.py)
# the protocol before the mailbox's control words, side by side; each payload's pair in turned order (run order)
EVERY = [False, False, True, False, False, True]
WARMUP = 100


def _pct(samples_ns, q):
    s = sorted(samples_ns)
    return s[min(len(s) - 1, int(q * len(s)))] / 1e3


def _row(name, samples_ns):
    return {"path": name, "p50_us": round(_pct(samples_ns, 0.5), 1), "p99_us": round(_pct(samples_ns, 0.99), 1),
            "n": len(samples_ns)}


def _child(n, threads, ping_r, pong_w, chan_addr, endpoints, results):
    torch.set_num_threads(threads)
    rows, fin, fout = [], ping_r.fileno(), pong_w.fileno()
    rtt = []
    for i in range(WARMUP + n):  # OS pipe round trip: 1 byte there, 1 byte back
        t0 = time.perf_counter_ns()
        os.write(fout, b"x")
        os.read(fin, 1)
        if i >= WARMUP:
            rtt.append(time.perf_counter_ns() - t0)
    rows.append(_row("os pipe round trip", rtt))
    ch, rtt = connect(chan_addr, 10.0), []
    for i in range(WARMUP + n):  # Channel round trip: a small header there and back
        t0 = time.perf_counter_ns()
        ch.send({"kind": "ping", "mb": i})
        ch.recv(10.0)
        if i >= WARMUP:
            rtt.append(time.perf_counter_ns() - t0)
    rows.append(_row("channel round trip (header only)", rtt))
    ch.close()
    for (name, shape, dtype), ep, every in zip(PAYLOADS, endpoints, EVERY, strict=True):
        x = torch.randn(shape).to(dtype)
        s = SlotSender(ep, every_frame_on_socket=every)
        s.connect(10.0)
        enq, cycle = [], []
        for i in range(WARMUP + n):  # streaming: the receiver frees as it goes, so slots are usually free
            t0 = time.perf_counter_ns()
            s.send({"kind": "step", "mb": i}, x)
            if i >= WARMUP:
                enq.append(time.perf_counter_ns() - t0)
        s.drain(10.0)
        for i in range(WARMUP + n):  # one at a time: copy, header, receiver view + free, credit back
            t0 = time.perf_counter_ns()
            s.send({"kind": "step", "mb": i}, x)
            s.drain(10.0)
            if i >= WARMUP:
                cycle.append(time.perf_counter_ns() - t0)
        s.send({"kind": "done", "mb": -1})
        st = s.stats()
        rows.append({**_row(f"{name} sender enqueue", enq), "write_us_mean": round(st["write_us_mean"], 1),
                     "header_us_mean": round(st["header_us_mean"], 1), "socket_headers": st["socket_headers"],
                     "mailbox_headers": st["mailbox_headers"]})
        rows.append(_row(f"{name} full cycle (send -> credit back)", cycle))
        s.close()
    results.send(rows)


def run(n: int, threads: int) -> list[dict]:
    torch.set_num_threads(threads)
    ctx = mp.get_context("spawn")
    ping_r, ping_w = ctx.Pipe(duplex=False)
    pong_r, pong_w = ctx.Pipe(duplex=False)
    res_r, res_w = ctx.Pipe(duplex=False)
    lis = ChannelListener()
    receivers = [SlotReceiver(f"bench{i}", torch.Size(shape).numel() * dtype.itemsize, spin_us=spin)
                 for i, ((_, shape, dtype), spin) in enumerate(zip(PAYLOADS, SPIN_US))]
    p = ctx.Process(target=_child, args=(n, threads, ping_r, pong_w, lis.address,
                                         [r.endpoint() for r in receivers], res_w))
    p.start()
    try:
        fin, fout = pong_r.fileno(), ping_w.fileno()
        for _ in range(WARMUP + n):
            os.read(fin, 1)
            os.write(fout, b"y")
        ch = lis.accept(30.0)
        for _ in range(WARMUP + n):
            ch.send(ch.recv(10.0))
        view_rows = []
        for (name, _, _), r in zip(PAYLOADS, receivers):
            r.accept(30.0)
            while True:
                h, v = r.recv(10.0)
                if v is None:
                    break
                del v
                r.free(h["slot"])
            st = r.stats()
            view_rows.append({"path": f"{name} receiver header -> view ready", "p50_us": round(st["handoff_p50_us"], 1),
                              "p99_us": round(st["handoff_p99_us"], 1), "n": st["samples"],
                              "mailbox_headers": st["mailbox_headers"]})
        rows = res_r.recv()
    finally:
        p.join(30)
        lis.close()
        for r in receivers:
            r.close()
    return rows[:2] + [row for i in range(len(PAYLOADS)) for row in rows[2 + 2 * i:4 + 2 * i] + [view_rows[i]]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--n", type=int, default=2000, help="measured iterations per path (after 100 warm-up)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads in each process (copy parallelism)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = run(args.n, args.threads)
    if args.json:
        print(json.dumps({"n": args.n, "threads": args.threads, "rows": rows}, indent=2))
        return
    print(f"{'path':<72}{'p50 us':>10}{'p99 us':>10}")
    for r in rows:
        split = (f"   (mean: data path {r['write_us_mean']:.1f} us, header {r['header_us_mean']:.1f} us; "
                 f"{r['socket_headers']} headers on the socket)" if "write_us_mean" in r else "")
        print(f"{r['path']:<72}{r['p50_us']:>10.1f}{r['p99_us']:>10.1f}{split}")


if __name__ == "__main__":
    main()
