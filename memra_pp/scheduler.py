"""Continuous batching on the intake stage: admits requests into cache slots, cuts microbatches (decode plus
chunked prefill), and turns sampled tokens into per-request events. Pure: no threads, no transport, no torch math.
"""
from __future__ import annotations

import itertools
import math
import threading
from collections import deque

from .errors import InputError, StageFailed
from .model.batch import positions_3T
from .sched_types import Event, Microbatch, Request, Seq


def _not_finite(r: Request, n: int) -> str:
    """The error of a request whose logits came back not finite (NaN) at its output token n + 1."""
    if r.adapter >= 0:
        name = repr(r.adapter_name) if r.adapter_name is not None else f"in slot {r.adapter}"
        why = f"its adapter {name} overflows on these activations: lower its lora_alpha or check its weights"
    else:
        why = "the model overflows on this prompt in its dtype: load it in a wider one (model.dtype)"
    return f"the model's logits for output token {n + 1} of this request are not finite (NaN): {why}"


def auto_pipeline_chunks(stages: int) -> int:
    """`scheduler.pipeline_chunks: auto`: how many pieces a prompt alone in the deployment is cut into. n stages
    finish its k pieces in k + n - 1 piece times, against k n on one stage: (k + n - 1) / (k n) of one stage's time
    (plus a step's fixed cost per piece). k = 8 (n - 1) puts that within 1/8 of the ideal 1/n, where the prompt is
    long enough for k pieces above the floor (Scheduler.piece). One stage: no pieces (1)."""
    return 1 if stages <= 1 else 8 * (stages - 1)


class Scheduler:
    def __init__(self, max_batch: int, microbatches: int, prefill_chunk: int, max_context: int,
                 pipeline_chunks: int = 1, prefill_chunk_decoding: int | None = None, kv_limit: int | None = None):
        self.max_batch, self.M, self.chunk, self.max_context = max_batch, microbatches, prefill_chunk, max_context
        # the prompt tokens the microbatches in flight may hold together while any admitted request decodes
        # (scheduler.prefill_chunk_decoding; None: prefill_chunk per microbatch throughout). A decoding request's
        # next step runs after every microbatch ahead of it on each stage, so what its token waits for is the prompt
        # tokens of all of them, not of its own microbatch alone
        self.chunk_decoding = None if prefill_chunk_decoding is None else min(prefill_chunk, prefill_chunk_decoding)
        self.held_back = 0                        # microbatches whose prompt tokens that budget cut (stats, tests)
        # a prompt alone in the deployment when its first chunk is cut goes down the pipeline in up to
        # `pipeline_chunks` equal pieces (Scheduler.piece), so stage i+1 runs piece k while stage i runs k + 1;
        # with other requests about, their microbatches keep the stages busy and its chunks stay whole
        self.pieces = pipeline_chunks
        self.cut = 0                              # prompts cut into pieces for the pipeline (stats, tests)
        self.waiting: deque[Request] = deque()
        self.active: dict[int, Seq] = {}          # slot -> Seq
        self.free_slots = list(range(max_batch))[::-1]
        self.inflight: dict[int, Microbatch] = {}
        # add and admission move a request into waiting and on to active under it: a reader on another thread (the
        # intake's adapter_users) that holds it sees each request in one of the two, never between them
        self.mu = threading.Lock()
        self.pending_release: list[int] = []
        self._mb = itertools.count()
        self.dropped = 0                          # sampled tokens nobody gets: their sequence had ended or was aborted
        self.pipelined = 0                        # prompt chunks sent while the same prompt's previous one ran
        self.aborted = 0                          # requests an abort found, waiting or admitted (stats, tests)
        # a new sequence counts as run when admitted: had it gone before all (last_run 0), short prompts arriving
        # every step would take a long prompt's budget for ever once its first chunk had run
        self._tick = itertools.count(1)
        # KV admission: the pages (of kv_block positions) every stage can hold for sequences at once (the least
        # over the stages, set when the pipeline is wired; None: no limit). A request is admitted only when its
        # most pages (prompt + max_new_tokens - 1 positions) fit beside those of the admitted ones, so
        # no stage's cache growth is ever refused under a running microbatch; the others wait in order.
        self.kv_pages: int | None = None
        self.kv_limit = kv_limit                  # scheduler.kv_pages, the placement's cap on kv_pages (None: none)
        self.kv_block = 64
        self.kv_used = 0
        self.kv_waits = 0                         # requests that waited for pages at the head (stats, tests)
        self.not_finite = 0                       # requests ended because their logits were not finite (_not_finite)
        self._kv_blocked: Request | None = None

    COUNTS = ("held_back", "cut", "dropped", "pipelined", "aborted", "kv_waits", "not_finite")     # the stats counters

    def carry_counts(self, old: "Scheduler") -> "Scheduler":
        """This scheduler (a halt's fresh one) goes on counting from where `old` stopped: the intake's stats
        counters, like the stage's KV growths, count over the process, not since its last recovery."""
        for k in self.COUNTS:
            setattr(self, k, getattr(old, k))
        return self

    def add(self, r: Request) -> None:
        self.validate(r)
        with self.mu:
            self.waiting.append(r)

    def validate(self, r: Request) -> None:
        """Refuse a request that can never run (pure: safe to call from any thread)."""
        if not r.prompt:
            raise InputError("the prompt is empty: give at least one token")
        if len(r.prompt) > self.max_context:
            raise InputError(f"the prompt has {len(r.prompt)} tokens, more than scheduler.max_context "
                             f"({self.max_context}); shorten it or raise max_context")
        if r.max_new_tokens < 0:
            raise InputError(f"max_new_tokens must be >= 0, got {r.max_new_tokens}")
        # a request runs to its max_new_tokens unless a stop token ends it (the last token is sampled, never fed:
        # n + m - 1 positions), never cut short at max_context
        if len(r.prompt) + r.max_new_tokens - 1 > self.max_context:
            raise InputError(f"the prompt's {len(r.prompt)} tokens and max_new_tokens {r.max_new_tokens} need "
                             f"{len(r.prompt) + r.max_new_tokens - 1} positions, more than scheduler.max_context "
                             f"({self.max_context}); ask for at most {self.max_context + 1 - len(r.prompt)} new "
                             f"tokens or raise max_context")
        if self.kv_pages is not None and r.max_new_tokens > 0 and self.pages(r) > self.kv_pages:
            held = self.kv_pages * self.kv_block
            if self.kv_limit is not None and self.kv_pages >= self.kv_limit:    # the placement's own cap
                fix = f"raise scheduler.kv_pages (now {self.kv_limit})"
            elif len(r.prompt) > held:
                fix = "shorten the prompt or split the model over more stages"
            else:
                fix = f"ask for at most {held + 1 - len(r.prompt)} new tokens or split the model over more stages"
            raise InputError(f"the request can reach {self.pages(r) * self.kv_block} positions "
                             f"({len(r.prompt)} prompt + {r.max_new_tokens} new tokens, the last never fed, in pages "
                             f"of {self.kv_block}); the KV cache holds {held} positions on the fullest stage: {fix}")

    def pages(self, r: Request) -> int:
        """The most KV pages request r's sequence can hold: its prompt and every generated token but the last (which
        is sampled, never fed); validate refuses a request whose positions pass max_context."""
        return -(-(len(r.prompt) + max(r.max_new_tokens - 1, 0)) // self.kv_block)

    def _pages_fit(self, r: Request) -> bool:
        return self.kv_pages is None or self.kv_used + self.pages(r) <= self.kv_pages

    @classmethod
    def for_placement(cls, sc, stages: int, microbatches: int) -> "Scheduler":
        """The intake's scheduler for a placement's SchedulerSpec `sc` over `stages` stages. Pieces need another
        stage to run on and a second microbatch to travel in: on one stage or with one microbatch, none."""
        pieces = auto_pipeline_chunks(stages) if sc.pipeline_chunks is None else sc.pipeline_chunks
        if stages < 2 or microbatches < 2:
            pieces = 1
        return cls(sc.max_batch, microbatches, sc.prefill_chunk, sc.max_context, pieces, sc.prefill_chunk_decoding,
                   sc.kv_pages)

    def piece(self, s: Seq) -> int:
        """The most prompt tokens of `s` one microbatch takes, fixed when its first chunk is cut: prefill_chunk,
        unless `s` is then alone in the deployment (no other request admitted or waiting). Alone, its prompt of n
        tokens goes in k = min(pipeline_chunks, n // least) equal pieces of ceil(n / k) (at most prefill_chunk),
        none below `least` = max(prefill_chunk / 8, a KV page): fewer than two, and it stays whole."""
        if not s.piece:
            s.piece = self.chunk
            n = len(s.req.prompt)
            if self.pieces > 1 and len(self.active) == 1 and not self.waiting:
                k = min(self.pieces, n // max(self.chunk // 8, self.kv_block))
                p = min(self.chunk, -(-n // max(k, 1)))
                if k >= 2 and p < min(n, self.chunk):
                    s.piece = p
                    self.cut += 1
        return s.piece

    def idle(self) -> bool:
        return not self.waiting and not self.active

    def has_ready_work(self) -> bool:
        """Is there anything next_microbatch could take besides what is in flight (new requests, idle seqs)?"""
        h = self.waiting[0] if self.waiting else None      # (one that can never fit is work too: _admit refuses it)
        return bool(h and (h.max_new_tokens == 0 or self.free_slots and (self._pages_fit(h) or
                                                                          self.pages(h) > self.kv_pages))) or \
            any(not s.in_flight for s in self.active.values())

    def continue_microbatch(self, mb: Microbatch) -> Microbatch | None:
        """The next decode step of `mb`'s sampling sequences, cut before `mb`'s tokens are back (async
        scheduling: the device runs it while the host reads `mb`'s tokens). Sequences that certainly end with
        `mb`'s token (length, abort) are left out; one that ends on a stop token is found only when
        the tokens arrive, and its continuation's token is dropped. The ids are `mb`'s sampled tokens (`feed`
        names the rows), so only the device knows them."""
        take, feed = [], []
        row = 0
        for s, st, c, smp in zip(mb.seqs, mb.starts, mb.counts, mb.sample):
            if not smp:
                continue
            if not s.done and len(s.out) + 1 < s.req.max_new_tokens:     # (validate: within max_context)
                take.append((s, st + c))
                feed.append(row)
            row += 1
        if not take:
            return None
        tick = next(self._tick)
        pos = []
        for s, _ in take:
            pos.append(self._positions(s, 1))       # s.sent is the continuation's start
            s.in_flight += 1
            s.sent += 1
            s.last_run = tick
        starts = [st for _, st in take]
        nxt = Microbatch(next(self._mb), [s for s, _ in take], [], starts, [1] * len(take), [True] * len(take),
                         positions_3T(pos), [], [], feed)
        self.inflight[nxt.mb] = nxt
        return nxt

    def abort(self, rid: str) -> list[Event]:
        for i, r in enumerate(self.waiting):
            if r.rid == rid:
                del self.waiting[i]
                self.aborted += 1
                return [Event(r.client, rid, [], [], "abort")]
        for s in list(self.active.values()):
            if s.req.rid == rid:
                if s.in_flight and s.req.max_new_tokens == 0:   # aborted already (a second abort: close() and the
                    return []                                   # submit it overtook both ask): counted once
                self.aborted += 1
                if not s.in_flight:
                    self._finish(s)
                    return [Event(s.req.client, rid, [], [], "abort")]
                s.req.max_new_tokens = 0          # ends when its microbatch returns
                break
        return []

    def _admit(self) -> list[Event]:
        done = []
        while self.waiting and (self.free_slots or self.waiting[0].max_new_tokens == 0):
            r = self.waiting[0]
            if r.max_new_tokens == 0:       # ends at once, in its turn: it takes no slot and no page
                self.waiting.popleft()
                done.append(Event(r.client, r.rid, [], [], "length"))
                continue
            if not self._pages_fit(r):      # waits, in order, for finished sequences' pages
                if self.pages(r) > self.kv_pages:   # the budget shrank since add (an adapter's LoRA pools): it can
                    with self.mu:                   # never fit, and would hold every request behind it for ever
                        self.waiting.popleft()
                    try:
                        self.validate(r)
                    except InputError as e:
                        done += self.fail_one(r, e)
                    continue
                if r is not self._kv_blocked:
                    self._kv_blocked = r
                    self.kv_waits += 1
                break
            with self.mu:
                self.waiting.popleft()
                s = Seq(r, self.free_slots.pop(), last_run=next(self._tick))
                self.active[s.slot] = s
            s.pages = self.pages(r)
            self.kv_used += s.pages
        return done

    def next_microbatch(self) -> tuple[Microbatch | None, list[Event]]:
        events = self._admit()
        if len(self.inflight) >= self.M:
            return None, events
        # a prompt's next chunk may follow its previous one before that one is back: every stage runs microbatches
        # in order, so chunk k+1 meets chunk k's cache on each stage (chunked prefill pipelined across stages)
        # (after every sequence that is not in flight: they take the budget first, prompts least recently run first,
        # then the decode rows, which need no budget, least recently run first)
        ready = sorted((s for s in self.active.values() if not s.in_flight or (
            not s.prefilled and s.req.max_new_tokens > 0)),      # (no more chunks of an aborted one)
                       key=lambda s: (s.in_flight > 0, s.prefilled, s.last_run))
        if not ready:
            return None, events
        cap = max(1, math.ceil(len(self.active) / self.M))
        budget = self.chunk
        if self.chunk_decoding is not None and any(s.prefilled for s in self.active.values()):
            # someone decodes: its next token waits for these prompt tokens and those already in flight
            budget = max(0, self.chunk_decoding - sum(m.prompt_tokens for m in self.inflight.values()))
        capped, short = budget < self.chunk, False
        take, counts = [], []
        for s in ready:
            if len(take) >= cap:
                break
            if s.in_flight and take:          # a follow-on chunk travels alone: should its predecessor fail on
                break                         # some stage, the failure (a lens mismatch there) stays its own
            if s.prefilled:                   # decoding (not in flight: its last token is known)
                take.append(s)
                counts.append(1)
            elif budget > 0:
                want = min(len(s.req.prompt) - s.sent, self.piece(s))
                c = min(want, budget)
                short |= c < want
                budget -= c
                take.append(s)
                counts.append(c)
                if s.in_flight:
                    break
            else:
                short = True
        if not take:
            return None, events
        self.held_back += capped and short
        ids, starts, sample, pos, admit = [], [], [], [], []
        tick, prompt_tokens = next(self._tick), 0
        for s, c in zip(take, counts):
            if s.prefilled:
                ids.append(s.out[-1])
            else:
                ids.extend(s.req.prompt[s.sent:s.sent + c])
                prompt_tokens += c
            self.pipelined += s.in_flight > 0
            starts.append(s.sent)
            sample.append(s.sent + c >= len(s.req.prompt))
            pos.append(self._positions(s, c))
            s.sent += c
            if not s.admitted:
                p = s.req.params
                admit.append([s.slot, p.temperature, p.top_k, p.top_p, p.min_p, p.seed, s.req.adapter, s.req.step0])
                s.admitted = True
            s.in_flight, s.last_run = s.in_flight + 1, tick
        mb = Microbatch(next(self._mb), take, ids, starts, counts, sample, positions_3T(pos), admit,
                        self.pending_release, prompt_tokens=prompt_tokens)
        self.pending_release = []
        self.inflight[mb.mb] = mb
        return mb, events

    @staticmethod
    def _positions(s: Seq, c: int):
        """The M-RoPE rows of an image prompt's segment, else the text positions as a range (all three rows)."""
        r = s.req
        if r.positions_3L is not None and s.sent < len(r.prompt):
            return r.positions_3L[:, s.sent:s.sent + c]
        return range(s.sent + r.rope_delta, s.sent + r.rope_delta + c)

    def on_tokens(self, mb_id: int, tokens: list[int], logprobs: list[float]) -> list[Event]:
        """The primary's sampled tokens for microbatch `mb_id` (one per sampled sequence, in order)."""
        mb = self.inflight.pop(mb_id, None)
        if mb is None:      # its requests were already failed (fail_all / fail_mb): late tokens are dropped
            return []
        it = iter(zip(tokens, logprobs))
        events = []
        for s, c, smp in zip(mb.seqs, mb.counts, mb.sample):
            s.in_flight -= 1
            t, lp = next(it) if smp else (None, None)
            if s.done:          # ended while this (continuation) microbatch ran: its token is dropped
                self.dropped += smp
                continue
            s.fed += c
            if not smp:
                if s.req.max_new_tokens == 0 and not s.in_flight:   # aborted mid-prompt: ends once its chunks are
                    events.append(Event(s.req.client, s.req.rid, [], [], "abort"))   # back (none run after)
                    self._finish(s)
                continue
            r = s.req
            if r.max_new_tokens == 0:     # aborted while this microbatch ran (abort): it ends as "abort" with no
                self.dropped += 1         # token, as a waiting or idle one does (it ended as "length" with one)
                events.append(Event(r.client, r.rid, [], [], "abort"))
                self._finish(s)
                continue
            if lp != lp:        # NaN: this row's logits were not finite; its token means nothing. It ends alone
                events.append(Event(r.client, r.rid, [], [], "error", ("InputError", _not_finite(r, len(s.out)))))
                self.not_finite += 1
                self._finish(s)
                continue
            s.out.append(t)
            s.lps.append(lp)
            finish = None
            if t in r.stop_ids:
                finish = "stop"
            elif len(s.out) >= r.max_new_tokens:      # (validate: the last one fits max_context)
                finish = "length"
            events.append(Event(r.client, r.rid, [t], [lp], finish))
            if finish:
                self._finish(s)
        return events

    def _finish(self, s: Seq) -> None:
        s.done = True
        self.kv_used -= s.pages
        del self.active[s.slot]
        self.free_slots.append(s.slot)
        self.pending_release.append(s.slot)

    def fail_one(self, r: Request, e: Exception) -> list[Event]:
        """r's end with `e` (pure: any thread may call it); a StageFailed naming a lost stage names it here too."""
        lost = e.stage if isinstance(e, StageFailed) else None
        return [Event(r.client, r.rid, [], [], "error", (type(e).__name__, str(e), lost))]

    def fail_mb(self, mb_id: int, etype: str, message: str) -> list[Event]:
        """A microbatch failed on some stage: its requests end with the error, every other request goes on."""
        mb = self.inflight.pop(mb_id, None)
        if mb is None:
            return []
        # the slots it released may never have been released on some stage (it failed at stage 0 before any ran
        # it; a later stage passes an mb_error on, not the step): the next microbatch releases them again, where
        # they are still free (release is idempotent; a slot taken since is reset by its new sequence's start 0)
        self.pending_release += [x for x in mb.release if x in self.free_slots and x not in self.pending_release]
        evs = []
        for s in mb.seqs:
            s.in_flight -= 1
            if not s.done:
                evs.append(Event(s.req.client, s.req.rid, [], [], "error", (etype, message)))
                self._finish(s)
        return evs

    def fail_all(self, etype: str, message: str, stage: int | None = None) -> list[Event]:
        """End every request (waiting, active, in flight) with an error event; the scheduler is empty after.
        `stage` names a lost stage: clients of a `recover: replay` deployment replay such requests."""
        err = (etype, message) if stage is None else (etype, message, stage)
        evs = [Event(r.client, r.rid, [], [], "error", err) for r in self.waiting]
        evs += [Event(s.req.client, s.req.rid, [], [], "error", err) for s in self.active.values()]
        self.waiting.clear()
        for s in list(self.active.values()):
            self._finish(s)
        self.inflight.clear()
        self.pending_release = []
        return evs
