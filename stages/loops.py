"""The per-stage loop threads' common part (launch bookkeeping, device-time busy, stats) and the downstream stage
loop; the intake's loop is intake_loop.py. Run in the stage processes.

Microbatches flow stage 0 -> ... -> last through boundary slots; the last stage samples and sends the tokens
back to stage 0 over the ring channel, so the next step is scheduled without the driver.
"""
from __future__ import annotations

import collections
import os
import queue
import threading
import time
import traceback

import torch

from ..errors import ProtocolError
from ..model.batch import StepBatch
from ..model.fla_rule import tuned_keys
from ..model.sampling import PendingTokens, SamplingParams, sample_async
from ..battery_stage import hash_rx
from .channel import ChannelClosed
from .timeline import Timeline, kind_of


class Sampler:
    """Primary-stage sampling state per cache slot: the request's params and how many tokens it has drawn."""

    def __init__(self):
        self.params: dict[int, SamplingParams] = {}
        self.steps: dict[int, int] = {}
        self.rngs: dict[torch.device, torch.Generator] = {}

    def rng(self, device: torch.device) -> torch.Generator:
        """The unseeded requests' generator on the logits' device, seeded from the OS at its first use. (A CPU
        one was passed for CUDA logits, which `sample` then dropped for torch's default CUDA generator: that
        starts at the same fixed seed in every process, so every fresh GPU deployment drew the same "random"
        tokens for the same unseeded request.)"""
        g = self.rngs.get(device)
        if g is None:
            g = self.rngs[device] = torch.Generator(device=device).manual_seed(
                int.from_bytes(os.urandom(8), "little"))
        return g

    def admit(self, rows, release) -> None:
        for s in release:
            self.params.pop(s, None)
        for slot, t, k, p, mp, seed, _adapter, step0 in rows:
            self.params[slot] = SamplingParams(t, k, p, mp, seed)
            self.steps[slot] = step0     # a replayed request continues its seeded (seed, step) draws

    def __call__(self, logits, b: StepBatch) -> PendingTokens:
        """Sample the step's rows; an all-greedy step is only enqueued (the device keeps its tokens)."""
        slots = [s for s, smp in zip(b.slots, b.sample) if smp]
        out = sample_async(logits, [self.params[s] for s in slots], [self.steps[s] for s in slots],
                           self.rng(logits.device))
        for s in slots:
            self.steps[s] += 1
        return out


def mb_error(mb: int, stage: int, e: BaseException, release=()) -> dict:
    """A failed microbatch's header, passed down the stages in its place. `release`: the slots it released (the
    sequences finished before it), which every stage after the failing one releases as the error passes: the
    scheduler counted their pages free when it cut the microbatch, and a microbatch cut since may be admitted into
    them, reaching those stages right after this error."""
    return {"kind": "mb_error", "mb": mb, "stage": stage, "etype": type(e).__name__, "message": str(e),
            "release": list(release)}


def batch_of(h: dict) -> StepBatch:
    return StepBatch(h["slots"], h["starts"], h["counts"], h["pos"].long(), h["sample"], h.get("adapters"),
                     h.get("release") or [])


class _Loop:
    name = "stage"

    def __init__(self, runner):
        self.r = runner
        self.stopping = threading.Event()
        self.busy_s, self.microbatches, self.t0 = 0.0, 0, time.monotonic()
        self._busy_mark = 0.0
        # on a GPU, busy is device time: a timing event pair around each microbatch's work on the stream, summed
        # once both have completed (the host's launch-to-done spans say nothing about the device once launches
        # are asynchronous); on a CPU the compute is synchronous and the host spans are the device time
        self._events = getattr(runner.engine, "is_cuda", False)
        self._ev: collections.deque = collections.deque()    # (start, end, span meta) not yet summed
        self.timeline = Timeline()          # where each microbatch's work lay in time (stats(timeline=True))
        self._ev_lock = threading.Lock()
        self.device_busy_s = 0.0
        self.continued = 0                  # decode steps cut before the previous step's tokens were back
        self.phase_s: dict[str, float] = {}  # host time per phase of the loop (where a step's time goes)
        self.error: str | None = None
        self.computing_since: float | None = None   # launch time of the oldest microbatch not yet done here
        self._launches: collections.deque = collections.deque()    # [launch time] of each, oldest first
        self._launch_lock = threading.Lock()        # the loop and the primary's ring thread both end launches
        self.lost_link = False              # the loop ended because a neighbour's link closed under it
        self.sampler = Sampler() if runner.spec.primary else None
        self.thread = threading.Thread(target=self._guarded, name=f"memra-{self.name}-{runner.index}",
                                       daemon=True)
        self.ring_thread: threading.Thread | None = None   # the ring's reader (intake) or writer (primary)
        # the links this loop serves, fixed at its start: a loop still computing after halt() gave up waiting for it
        # (10 s) must not free a slot on, or send its stale microbatch through, the links relink() made since
        self.receiver, self.sender, self.ring = runner.receiver, runner.sender, runner.ring

    def start(self):
        if self.ring_thread is not None:
            self.ring_thread.start()
        self.thread.start()

    def stop(self):
        self.stopping.set()
        self.thread.join(timeout=5)
        if self.ring_thread is not None:
            self.ring_thread.join(timeout=5)

    def _mark(self):
        """A timing event recorded on the stage's stream now (None on a CPU stage)."""
        if not self._events:
            return None
        self.timeline.anchor()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def _span(self, start, end, meta: tuple[str, int]) -> None:
        """A microbatch's device work lies between these two events; sum what has completed."""
        with self._ev_lock:
            self._ev.append((start, end, meta))
            self._sum_events()

    def _sum_events(self) -> None:
        while self._ev and self._ev[0][1].query():
            a, b, meta = self._ev.popleft()
            dt = a.elapsed_time(b) / 1e3
            self.device_busy_s += dt
            self.timeline.device(*meta, a, b, dt)

    def stats(self, reset: bool = False, timeline: bool = False) -> dict:
        wall = max(time.monotonic() - self.t0, 1e-9)
        if self._events:    # stats() arrives on a Ray pool thread: query the events on the stage's own device
            with self._ev_lock, torch.cuda.device(self.r.engine.device):
                self._sum_events()
                busy_s = self.device_busy_s
                if reset:
                    self.device_busy_s = 0.0
                    self._ev.clear()     # their spans began before the new window
        else:
            busy_s = self.busy_s
        # busy_s / wall_s and phase_s: raw, so a caller can difference two snapshots (run_bench's steady window)
        phase_s = dict(self.phase_s)    # a copy: the loop adds keys
        out = {"busy": busy_s / wall, "busy_s": busy_s, "wall_s": wall, "host_busy": self.busy_s / wall,
               "microbatches": self.microbatches, "phase_s": phase_s,
               "loop_error": self.error, "async_steps": self.continued, "kernel_tunings": tuned_keys(),
               "phase_us_per_microbatch": {k: v / max(1, self.microbatches) * 1e6 for k, v in phase_s.items()}}
        if timeline:     # (a reset drops the spans of microbatches still in flight from the timeline too)
            tl = self.timeline.since()
            out["timeline"], out["timeline_complete"] = tl["spans"], tl["complete"]
        if reset:
            self.busy_s, self.t0, self.microbatches, self.continued = 0.0, time.monotonic(), 0, 0
            self.phase_s = {}
        return out

    def _guarded(self):
        try:
            self.r.engine.make_current()      # a fresh thread has no CUDA context current
            self.run()
        except Exception as e:  # the loop must never die silently: record it for stats() and the driver's monitor
            self.error = traceback.format_exc()
            # a neighbour that closed its link, or would not take a microbatch in time, is the lost one, not us
            self.lost_link = isinstance(e, (ChannelClosed, TimeoutError))
            ch = getattr(self.receiver, "_ch", None)
            if isinstance(e, ProtocolError) and ch is not None:
                ch.close()   # fail the link loudly: the sender sees it closed, never waits on it

    def health(self) -> dict:
        """For the driver's supervisor: is the loop (and the ring reader) still running, and why not."""
        threads = [self.thread] + [t for t in [self.ring_thread] if t is not None]
        alive = all(t.is_alive() for t in threads)
        since = self.computing_since
        return {"alive": alive, "error": self.error, "lost_link": not alive and (self.error is None or
                                                                                self.lost_link),
                "computing_s": 0.0 if since is None else time.monotonic() - since}

    def _phase(self, name: str, t: float) -> float:
        now = time.monotonic()
        self.phase_s[name] = self.phase_s.get(name, 0.0) + now - t
        return now

    def _begin(self) -> list:
        """A microbatch starts here: its launch time joins the outstanding ones (the supervisor reads how long the
        oldest has been running, `computing_since`). Returns the token `_end` takes."""
        tok = [time.monotonic()]
        with self._launch_lock:
            self._launches.append(tok)
            self.computing_since = self._launches[0][0]
        return tok

    def _end(self, tok: list) -> None:
        with self._launch_lock:
            try:
                self._launches.remove(tok)       # equal launch times are interchangeable
            except ValueError:
                pass
            self.computing_since = self._launches[0][0] if self._launches else None

    def compute(self, b: StepBatch, h, wait: bool = True):
        """Run the stage's layers on microbatch `b` (and sample, on the primary: then the tokens are returned, or
        with wait=False (PendingTokens, launch token): the caller ends the launch with `_resolved` once the
        tokens are back)."""
        tok = self._begin()
        t = tok[0]
        r = self.r
        try:
            if r.stall_s:                              # fault injection (StageRunner.inject_stall)
                stall, r.stall_s = r.stall_s, 0.0
                time.sleep(stall)
            if r.fault is not None:                    # fault injection (StageRunner.inject_fault)
                fault, r.fault = r.fault, None
                raise RuntimeError(fault)
            ev, t_work, meta = self._mark(), time.monotonic(), (kind_of(b.counts, b.starts), b.total)
            out = r.model(b, h, r.cache, lora=r.lora, token_overlay=r.token_overlay if r.spec.primary else None)
            t1 = self._phase("model", t)    # on a GPU: launching (a graph replay is one launch)
            if self.sampler is not None:
                out = self.sampler(out, b)
                t1 = self._phase("sample", t1)
            if ev is not None:
                self._span(ev, self._mark(), meta)
            else:                           # a CPU stage computes synchronously: the host span is the work
                self.timeline.host(*meta, t_work, t1)
            if self.sampler is not None:
                if not wait:
                    self.microbatches += 1
                    return out, tok
                out = out.result()
                self._phase("wait", t1)     # waits for the device: the step's device time shows here
        except BaseException:
            self._end(tok)                  # a failed microbatch is not a stuck one
            raise
        self.microbatches += 1
        self._resolved(tok)
        return out

    def _await(self, pend: PendingTokens, tok: list) -> tuple[list[int], list[float]]:
        """Wait for an asynchronously launched microbatch's tokens; the launch ends here even if it failed."""
        t = time.monotonic()
        try:
            return pend.result()
        finally:
            self._phase("wait", t)
            self._resolved(tok)

    def release(self, slots) -> None:
        """Give a failed microbatch's released slots back on this stage (idempotent: the model's step releases
        them first too, and a slot released again holds either nothing or a sequence of the same failed
        microbatch, which ends with it). The primary also forgets their sampling params."""
        if not slots:
            return
        self.r.cache.release(list(slots))
        if self.sampler is not None:
            self.sampler.admit((), slots)

    def _resolved(self, tok: list) -> None:
        """A launched microbatch is done here (its tokens are back, or its layers ran): the device was busy from
        its launch (or the previous completion, whichever is later) until now."""
        now = time.monotonic()
        self.busy_s += now - max(tok[0], self._busy_mark)
        self._busy_mark = now
        self._end(tok)


class StageLoop(_Loop):
    """Stage i > 0: receive a microbatch, run the layers, free the slot, pass it on (or sample and ring it).
    The primary does not wait for its tokens: a ring thread waits for each step's tokens, in order, and sends
    them back to the intake, while this loop already receives and launches the next microbatch."""

    def __init__(self, runner):
        super().__init__(runner)
        if self.sampler is not None:
            self.ringq: queue.Queue = queue.Queue()
            self.ring_thread = threading.Thread(target=self._send_ring, name="memra-ring-out", daemon=True)

    def _send_ring(self):
        """The primary's ring writer: tokens (once the device has them) and failures, in microbatch order."""
        try:
            self.r.engine.make_current()    # the events it waits on belong to the stage's context
            self._ring_out()
        except Exception as e:  # the ring is lost: say why (health() sees the thread gone)
            self.error = traceback.format_exc()
            self.lost_link = isinstance(e, (ChannelClosed, TimeoutError))

    def _ring_out(self):
        r = self.r
        while not self.stopping.is_set():
            try:
                hdr, launched = self.ringq.get(timeout=0.2)
            except queue.Empty:
                continue
            if launched is not None:
                try:
                    toks, lps = self._await(*launched)
                    # t: when the tokens were on the host (CLOCK_MONOTONIC, shared by the node's processes)
                    hdr = {"kind": "tokens", "mb": hdr["mb"], "tokens": toks, "logprobs": lps, "t": time.monotonic()}
                except Exception as e:  # pragma: no cover - a device fault surfaces here; the microbatch fails
                    hdr = mb_error(hdr["mb"], r.index, e)
            self.ring.send(hdr)

    def run(self):
        r = self.r
        step = r.placement.timeouts.step_s
        while not self.stopping.is_set():
            try:
                hdr, view = self.receiver.recv(timeout=0.2)
            except TimeoutError:
                continue
            except ChannelClosed:
                return
            out, slot = None, hdr.get("slot")
            if hdr["kind"] == "mb_error":
                self.release(hdr.get("release") or ())
            elif hdr["kind"] == "step":
                try:
                    if self.sampler is not None:
                        self.sampler.admit(hdr.get("admit", ()), hdr.get("release", ()))
                    if r.rx_hashes is not None:
                        hash_rx(r, view)
                    out = self.compute(batch_of(hdr), view, wait=self.sampler is None)
                except Exception as e:  # this microbatch fails; the stage keeps serving the others
                    rel = hdr.get("release") or ()
                    self.release(rel)       # (it may have failed before the model's own release)
                    hdr = mb_error(hdr["mb"], r.index, e, rel)
                finally:
                    if slot is not None:
                        self.receiver.free(slot)
            if self.stopping.is_set():      # halted under it: the stage's requests already ended (stage lost)
                return
            self._forward(hdr, out, step)

    def _forward(self, hdr, out, step):
        if self.sampler is not None:      # the ring thread waits for the tokens and sends them (or the error)
            self.ringq.put((hdr, out if hdr["kind"] == "step" else None))
        else:
            self.sender.send(hdr, out if hdr["kind"] == "step" else None, timeout=step)
