"""The intake's loop thread (stage 0): it owns the scheduler, embeds and runs stage 0's layers, sends each
microbatch on (or, alone, samples and schedules one step ahead); tokens come back over the ring. Runs in the
stage 0 process.
"""
from __future__ import annotations

import collections
import queue
import threading
import time

import torch

from ..errors import MemraError
from ..model.batch import StepBatch, h2d
from .channel import ChannelClosed
from .loops import _Loop
from .slots import nearest_rank


class IntakeLoop(_Loop):
    """Stage 0: owns the scheduler; embeds, runs its layers and sends each microbatch on (or samples, alone)."""
    name = "intake"

    def __init__(self, runner):
        super().__init__(runner)
        self.sched = runner.scheduler
        self.pending = None     # one stage: (microbatch, PendingTokens, launch token) on the device, tokens unread
        # the ring's way back, in a pipeline (seconds; stats as us): the primary's send to this process's receipt
        # (transit), the receipt to the loop taking the tokens (queue), the tokens taken to the next launch (launch):
        # what the first stage waits for between a microbatch's step and its next one
        self.ring_s = {k: collections.deque(maxlen=4096) for k in ("transit", "queue", "launch")}
        self._tokens_at: float | None = None
        if runner.ring is not None:
            self.ring_thread = threading.Thread(target=self._read_ring, name="memra-ring", daemon=True)

    def stats(self, reset: bool = False, timeline: bool = False) -> dict:
        out = super().stats(reset, timeline)
        out["async_dropped"] = self.sched.dropped
        out["pipelined_chunks"] = self.sched.pipelined
        out["prompts_cut"] = self.sched.cut       # prompts sent in pipeline pieces (scheduler.pipeline_chunks)
        # microbatches whose prompt tokens were held to scheduler.prefill_chunk_decoding while requests decoded
        out["prefill_held_back"] = self.sched.held_back
        # requests an abort reached (a cancelled agenerate, a dropped stream), in the scheduler or waiting for images
        out["aborted"] = self.sched.aborted + self.r.aborted_early
        out["not_finite"] = self.sched.not_finite  # requests ended because their logits were not finite (NaN)
        out["mailboxes"] = len(self.r.mail)       # clients not closed that have polled (a closed one's box goes)
        out["reaped"] = self.r.reaped             # requests aborted because their driver had ended (drivers.py)
        out["polls"] = self.r.mail.polls          # poll calls: one a round per deployment handle, whatever its clients
        for k, d in self.ring_s.items():
            xs = list(d)        # (a copy first: the loop appends meanwhile)
            for q in (0.5, 0.99):
                out[f"ring_{k}_p{round(q * 100)}_us"] = nearest_rank(xs, q, 1e-6)
            if reset:
                d.clear()
        return out

    def _read_ring(self):
        """Tokens coming back from the primary go into the same inbox as new requests."""
        while not self.stopping.is_set():
            try:
                msg = self.ring.recv(timeout=0.2)
            except TimeoutError:
                continue
            except (ChannelClosed, MemraError) as e:
                if not self.stopping.is_set():
                    last = len(self.r.plan.stages) - 1
                    self.r.inbox.put(("dead", (last, f"stage {last} is lost: the ring from it broke: {e}")))
                return
            msg["_rx"] = time.monotonic()
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
                if self._tokens_at is not None:
                    self.ring_s["launch"].append(time.monotonic() - self._tokens_at)
                    self._tokens_at = None
                self._run_mb(mb)
            elif not worked:
                if not sched.inflight:      # idle: the next launch waits for a request, not for the ring
                    self._tokens_at = None
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
                    r.check_adapter(item)
                    sched.add(item)
                except MemraError as e:
                    r.mail.post(sched.fail_one(item, e))
            elif kind == "abort":
                r.mail.post(sched.abort(item))
            elif kind == "post":                # events made off this thread (an image request's failure)
                r.mail.post(item)
            elif kind == "ring" and item["kind"] == "tokens":
                t = time.monotonic()
                if "t" in item and "_rx" in item:    # (from the ring thread; a test may hand tokens in directly)
                    self.ring_s["transit"].append(item["_rx"] - item["t"])
                    self.ring_s["queue"].append(t - item["_rx"])
                if self._tokens_at is None:
                    self._tokens_at = t
                r.mail.post(sched.on_tokens(item["mb"], item["tokens"], item["logprobs"]))
                self._phase("tokens", t)
            elif kind == "ring":   # mb_error: that microbatch's requests fail, the others go on
                msg = f"stage {item['stage']} failed a microbatch: {item['etype']}: {item['message']}"
                r.mail.post(sched.fail_mb(item["mb"], "StageFailed", msg))
            elif kind == "dead":
                r.mail.post(r.fail_lost(item[0], item[1]))
            r.inbox.taken = None        # handed on (a request: in the scheduler now, or failed)

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
        self.release(mb.release)        # (the next microbatch releases them again on the later stages)
        self.r.mail.post(self.sched.fail_mb(mb.mb, "StageFailed", f"stage 0 failed a microbatch: "
                                            f"{type(e).__name__}: {e}"))

    def _ids(self, mb, fed_from):
        """The microbatch's token ids: from the host, or (a continuation) rows of the previous step's tokens."""
        if mb.feed is None:
            return torch.tensor(mb.ids)
        if mb.feed == list(range(fed_from.shape[0])):
            return fed_from
        return fed_from[h2d(torch.tensor(mb.feed), fed_from.device)]   # the copy does not wait for the step

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
            self.sender.send(hdr, out, timeout=r.placement.timeouts.step_s)
        except (ChannelClosed, TimeoutError, MemraError) as e:
            if self.stopping.is_set():      # halted under it: the halt ended the requests (stage lost), not stage 1
                return
            r.mail.post(r.fail_lost(1, f"stage 1 is lost: it did not take a microbatch: {e}"))
            raise   # the loop ends loudly: the supervisor sees a lost link and recovers the pipeline
