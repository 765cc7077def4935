"""The per-stage loop threads: the intake loop (scheduler + stage 0 layers) and the downstream stage loop.

Microbatches flow stage 0 -> ... -> last through boundary slots; the last stage samples and sends the tokens
back to stage 0 over the ring channel, so the next step is scheduled without the driver.
"""
from __future__ import annotations

import collections
import queue
import threading
import time
import traceback

import torch

from ..errors import MemraError, ProtocolError
from ..model.batch import StepBatch
from ..model.sampling import PendingTokens, SamplingParams, sample_async
from ..battery_stage import hash_rx
from .channel import ChannelClosed


class Sampler:
    """Primary-stage sampling state per cache slot: the request's params and how many tokens it has drawn."""

    def __init__(self):
        self.params: dict[int, SamplingParams] = {}
        self.steps: dict[int, int] = {}
        self.rng = torch.Generator().manual_seed(int(time.time_ns() & 0xFFFFFFFF))

    def admit(self, rows, release) -> None:
        for s in release:
            self.params.pop(s, None)
        for slot, t, k, p, mp, seed, _adapter, step0 in rows:
            self.params[slot] = SamplingParams(t, k, p, mp, seed)
            self.steps[slot] = step0     # a replayed request continues its seeded (seed, step) draws

    def __call__(self, logits, b: StepBatch) -> PendingTokens:
        """Sample the step's rows; an all-greedy step is only enqueued (the device keeps its tokens)."""
        slots = [s for s, smp in zip(b.slots, b.sample) if smp]
        out = sample_async(logits, [self.params[s] for s in slots], [self.steps[s] for s in slots], self.rng)
        for s in slots:
            self.steps[s] += 1
        return out


def mb_error(mb: int, stage: int, e: BaseException) -> dict:
    return {"kind": "mb_error", "mb": mb, "stage": stage, "etype": type(e).__name__, "message": str(e)}


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
        self._ev: collections.deque = collections.deque()    # (start, end) pairs not yet summed
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
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def _span(self, start, end) -> None:
        """A microbatch's device work lies between these two events; sum what has completed."""
        if start is None:
            return
        with self._ev_lock:
            self._ev.append((start, end))
            self._sum_events()

    def _sum_events(self) -> None:
        while self._ev and self._ev[0][1].query():
            a, b = self._ev.popleft()
            self.device_busy_s += a.elapsed_time(b) / 1e3

    def stats(self, reset: bool = False) -> dict:
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
        # busy_s / wall_s: raw, so a caller can difference two snapshots (run_bench's steady window)
        out = {"busy": busy_s / wall, "busy_s": busy_s, "wall_s": wall, "host_busy": self.busy_s / wall,
               "microbatches": self.microbatches,
               "loop_error": self.error, "async_steps": self.continued,
               "phase_us_per_microbatch": {k: v / max(1, self.microbatches) * 1e6
                                           for k, v in dict(self.phase_s).items()}}   # a copy: the loop adds keys
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
            ch = getattr(self.r.receiver, "_ch", None)
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
            ev = self._mark()
            out = r.model(b, h, r.cache, lora=r.lora, token_overlay=r.token_overlay if r.spec.primary else None)
            t1 = self._phase("model", t)    # on a GPU: launching (a graph replay is one launch)
            if self.sampler is not None:
                out = self.sampler(out, b)
                t1 = self._phase("sample", t1)
            if ev is not None:
                self._span(ev, self._mark())
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
                    hdr = {"kind": "tokens", "mb": hdr["mb"], "tokens": toks, "logprobs": lps}
                except Exception as e:  # pragma: no cover - a device fault surfaces here; the microbatch fails
                    hdr = mb_error(hdr["mb"], r.index, e)
            r.ring.send(hdr)

    def run(self):
        r = self.r
        step = r.placement.timeouts.step_s
        while not self.stopping.is_set():
            try:
                hdr, view = r.receiver.recv(timeout=0.2)
            except TimeoutError:
                continue
            except ChannelClosed:
                return
            out, slot = None, hdr.get("slot")
            if hdr["kind"] == "step":
                try:
                    if self.sampler is not None:
                        self.sampler.admit(hdr.get("admit", ()), hdr.get("release", ()))
                    if r.rx_hashes is not None:
                        hash_rx(r, view)
                    out = self.compute(batch_of(hdr), view, wait=self.sampler is None)
                except Exception as e:  # this microbatch fails; the stage keeps serving the others
                    hdr = mb_error(hdr["mb"], r.index, e)
                finally:
                    if slot is not None:
                        r.receiver.free(slot)
            self._forward(hdr, out, step)

    def _forward(self, hdr, out, step):
        r = self.r
        if self.sampler is not None:      # the ring thread waits for the tokens and sends them (or the error)
            self.ringq.put((hdr, out if hdr["kind"] == "step" else None))
        else:
            r.sender.send(hdr, out if hdr["kind"] == "step" else None, timeout=step)


class IntakeLoop(_Loop):
    """Stage 0: owns the scheduler; embeds, runs its layers and sends each microbatch on (or samples, alone)."""
    name = "intake"

    def __init__(self, runner):
        super().__init__(runner)
        self.sched = runner.scheduler
        self.pending = None     # one stage: (microbatch, PendingTokens, launch token) on the device, tokens unread
        if runner.ring is not None:
            self.ring_thread = threading.Thread(target=self._read_ring, name="memra-ring", daemon=True)

    def stats(self, reset: bool = False) -> dict:
        out = super().stats(reset)
        out["async_dropped"] = self.sched.dropped
        out["pipelined_chunks"] = self.sched.pipelined
        return out

    def _read_ring(self):
        """Tokens coming back from the primary go into the same inbox as new requests."""
        while not self.stopping.is_set():
            try:
                msg = self.r.ring.recv(timeout=0.2)
            except TimeoutError:
                continue
            except (ChannelClosed, MemraError) as e:
                if not self.stopping.is_set():
                    last = len(self.r.plan.stages) - 1
                    self.r.inbox.put(("dead", (last, f"stage {last} is lost: the ring from it broke: {e}")))
                return
            self.r.inbox.put(("ring", msg))

    def run(self):
        """Before every microbatch the inbox is drained, so requests that arrived meanwhile join the next step
        (continuous batching: with one stage the tokens come back synchronously and there is always a next
        microbatch while anything runs; admissions must not wait for the running batch to finish)."""
        r, sched = self.r, self.sched
        while not self.stopping.is_set():
            t, tok = time.monotonic(), self.phase_s.get("tokens", 0.0)
            worked = self._drain(block=False)
            if self.pending is not None:
                self._advance()
                continue
            mb, evs = sched.next_microbatch()
            r.mail.post(evs)
            if mb is not None:   # schedule: inbox, admissions, next microbatch; ring tokens count as "tokens"
                self._phase("schedule", t + self.phase_s.get("tokens", 0.0) - tok)
                self._run_mb(mb)
            elif not worked:
                self._drain(block=True)

    def _drain(self, block: bool) -> bool:
        r, sched = self.r, self.sched
        got = False
        while True:
            try:
                kind, item = r.inbox.get(timeout=0.1) if block and not got else r.inbox.get_nowait()
            except queue.Empty:
                return got
            got = True
            if kind == "req":
                try:
                    sched.add(item)
                except MemraError as e:
                    r.mail.post(sched.fail_one(item, e))
            elif kind == "abort":
                r.mail.post(sched.abort(item))
            elif kind == "ring" and item["kind"] == "tokens":
                t = time.monotonic()
                r.mail.post(sched.on_tokens(item["mb"], item["tokens"], item["logprobs"]))
                self._phase("tokens", t)
            elif kind == "ring":   # mb_error: that microbatch's requests fail, the others go on
                msg = f"stage {item['stage']} failed a microbatch: {item['etype']}: {item['message']}"
                r.mail.post(sched.fail_mb(item["mb"], "StageFailed", msg))
            elif kind == "dead":
                r.mail.post(sched.fail_all("StageFailed", item[1], item[0]))

    def _advance(self):
        """One stage: a step is on the device. While nothing else waits to be scheduled and its tokens are on the
        device, cut and launch the next decode step of its sequences first (fed from those tokens), then read
        its tokens: the host's scheduling and bookkeeping overlap the device's step instead of following it."""
        mb, pend, tok = self.pending
        self.pending = nxt = failed = None
        if pend.device is not None and not self.sched.has_ready_work():
            t = time.monotonic()
            cont = self.sched.continue_microbatch(mb)
            self._phase("schedule", t)
            if cont is not None:
                self.continued += 1
                try:
                    nxt = self._launch(cont, pend.device)
                except Exception as e:  # reported after mb's tokens: mb itself succeeded
                    failed = (cont, e)
        try:
            toks, lps = self._await(pend, tok)
        except Exception as e:  # pragma: no cover - a device fault surfaces here; the microbatch fails
            self._fail(mb, e)
            toks = None
        if toks is not None:
            t = time.monotonic()
            self.r.mail.post(self.sched.on_tokens(mb.mb, toks, lps))
            self._phase("tokens", t)
        if failed is not None:
            self._fail(*failed)
        self.pending = nxt

    def _fail(self, mb, e: BaseException) -> None:
        self.r.mail.post(self.sched.fail_mb(mb.mb, "StageFailed", f"stage 0 failed a microbatch: "
                                            f"{type(e).__name__}: {e}"))

    def _ids(self, mb, fed_from):
        """The microbatch's token ids: from the host, or (a continuation) rows of the previous step's tokens."""
        if mb.feed is None:
            return torch.tensor(mb.ids)
        if mb.feed == list(range(fed_from.shape[0])):
            return fed_from
        idx = torch.tensor(mb.feed)          # pinned, so the copy does not wait for the step on the device
        return fed_from[idx.pin_memory().to(fed_from.device, non_blocking=True) if fed_from.is_cuda else idx]

    def _launch(self, mb, fed_from=None):
        """Embed and run one microbatch (raises if it fails). One stage: returns (mb, PendingTokens, launch
        token); else the stage's output for stage 1."""
        r = self.r
        t = time.monotonic()
        ad = [s.req.adapter for s in mb.seqs]
        b = StepBatch([s.slot for s in mb.seqs], mb.starts, mb.counts, mb.pos_3T, mb.sample,
                      ad if any(a >= 0 for a in ad) else None, mb.release)
        h = r.model.embed_ids(self._ids(mb, fed_from), b, token_overlay=r.token_overlay)
        for s, off, start, c in zip(mb.seqs, b.offsets, mb.starts, mb.counts):
            if s.req.images is not None and start < len(s.req.prompt):
                s.req.images.splice_into(r.engine, h[off:off + c], start)
        if self.sampler is not None:
            self.sampler.admit(mb.admit, mb.release)
        self._phase("embed", t)
        if self.sampler is None:
            return b, self.compute(b, h)
        return (mb, *self.compute(b, h, wait=False))

    def _run_mb(self, mb):
        """One stage: launch the microbatch and make `self.pending` of it; else run it and send it to stage 1."""
        r = self.r
        try:
            launched = self._launch(mb)
        except Exception as e:  # this microbatch fails; the loop keeps serving
            self._fail(mb, e)
            return
        if self.sampler is not None:
            self.pending = launched
            return
        b, out = launched
        hdr = {"kind": "step", "mb": mb.mb, "slots": b.slots, "starts": mb.starts, "counts": mb.counts,
               "sample": mb.sample, "pos": mb.pos_3T.to(torch.int32), "admit": mb.admit, "release": mb.release,
               "adapters": b.adapter_slots}
        try:
            r.sender.send(hdr, out, timeout=r.placement.timeouts.step_s)
        except (ChannelClosed, TimeoutError, MemraError) as e:
            r.mail.post(self.sched.fail_all("StageFailed", f"stage 1 is lost: it did not take a microbatch: {e}", 1))
            raise   # the loop ends loudly: the supervisor sees a lost link and recovers the pipeline
