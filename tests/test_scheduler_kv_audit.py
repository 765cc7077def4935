"""KV admission and the request lifecycle in the intake's Scheduler (memra_pp/scheduler.py): a seeded random driver
of the Scheduler API that checks, after every operation, the books a request's life leaves (pages reserved and
returned once, slots, one final event each, waiting order kept, the stats counters against what happened); aborts
in every state; and the end-to-end checks through memra_pp.launch on small CPU deployments."""
import collections
import random

import pytest

from memra_pp.model.sampling import SamplingParams
from memra_pp.errors import InputError
from memra_pp.scheduler import Request, Scheduler

VOCAB = 10


def req(i, n=5, new=3, stop=()):
    return Request(f"r{i}", "c", list(range(1, n + 1)), new, SamplingParams(), frozenset(stop))


class Driver:
    """A model of the intake around a Scheduler: microbatches in flight (reported in cut order, as a pipeline does,
    or failed), continuations (one-stage async scheduling), aborts of any request (live, ended, unknown, twice),
    and a KV budget that may shrink or grow (adapter loads). Checks the books after every operation."""

    def __init__(self, rng: random.Random, kv_block=8, **cfg):
        self.rng = rng
        kv = cfg.pop("kv_pages", None)
        self.s = Scheduler(**cfg)
        self.s.kv_block = kv_block
        self.s.kv_pages = kv
        self.queue: list = []
        self.continued: set[int] = set()
        self.req: dict[str, Request] = {}
        self.want: dict[str, int] = {}
        self.order: list[str] = []                 # add order (accepted requests)
        self.state: dict[str, str] = {}            # rid -> waiting | active | ended
        self.finals: dict[str, list] = collections.defaultdict(list)
        self.tokens: dict[str, list] = collections.defaultdict(list)
        self.admitted_order: list[str] = []
        self.abort_reached: set[str] = set()       # requests an abort found live (waiting or admitted, not ended)
        self.abort_calls = 0
        self.kv_blocked_seen: set[str] = set()     # heads that waited for pages with a slot free
        self.pages_reserved: dict[str, int] = {}   # rid -> pages while admitted
        self.pages_returned = collections.Counter()
        self.n = 0
        self.ops = collections.Counter()

    # -- operations ---------------------------------------------------------------------------------------------
    def add(self):
        rng, ctx = self.rng, self.s.max_context
        n = rng.choice([1, 2, 7, 8, 9, ctx, ctx - 1, rng.randint(1, ctx)])
        new = rng.choice([0, 1, 2, 3, rng.randint(1, 12), ctx + 1 - n])
        new = max(0, min(new, ctx + 1 - n))            # up to exactly max_context positions
        stop = frozenset(rng.sample(range(VOCAB), rng.choice([0, 0, 1, 2])))
        r = Request(f"q{self.n}", "c", [rng.randrange(VOCAB) for _ in range(n)], new, SamplingParams(), stop)
        self.n += 1
        try:
            self.s.add(r)
        except Exception as e:
            assert self.s.kv_pages is not None and self.s.pages(r) > self.s.kv_pages, e
            return
        self.req[r.rid], self.want[r.rid] = r, new
        self.order.append(r.rid)
        self.state[r.rid] = "waiting"

    def _observe_admission(self):
        """What _admit is about to do with the head, seen from outside: a head that waits for pages with a slot free
        (and could fit some day) is a KV wait."""
        s = self.s
        w = list(s.waiting)
        free = len(s.free_slots)
        used = s.kv_used
        for r in w:
            if not free:
                return
            if r.max_new_tokens == 0:
                continue
            if s.kv_pages is not None and used + s.pages(r) > s.kv_pages:
                if s.pages(r) <= s.kv_pages:
                    self.kv_blocked_seen.add(r.rid)
                    return
                continue            # refused: never fits
            free -= 1
            used += s.pages(r)

    def cut(self, fail_now=False):
        s = self.s
        self._observe_admission()
        ready_before = s.has_ready_work()
        n_inflight = len(s.inflight)
        waiting_before = [r.rid for r in s.waiting]
        mb, evs = s.next_microbatch()
        now = {q.req.rid for q in s.active.values()}
        admitted = [rid for rid in waiting_before if rid in now]
        still = {r.rid for r in s.waiting}
        if admitted:        # in order: nothing that waits now was added before one admitted now
            last = waiting_before.index(admitted[-1])
            assert not still & set(waiting_before[:last]), ("admitted past a waiting request", admitted, still)
        for rid in admitted:
            self.admitted_order.append(rid)
            self.state[rid] = "active"
            q = next(q for q in s.active.values() if q.req.rid == rid)
            self.pages_reserved[rid] = q.pages
            assert q.pages == -(-(len(q.req.prompt) + max(self.want[rid] - 1, 0)) // s.kv_block)
        # the one-stage intake cuts a continuation instead of calling next_microbatch while has_ready_work() is
        # False: it must then have nothing to do (no admission, no event, no microbatch)
        if not ready_before and n_inflight == 0:
            assert mb is None and not evs and not admitted, ("has_ready_work() said no, but next_microbatch did",
                                                             mb, evs, admitted)
        self.take(evs)
        if mb is None:
            return
        self.ops["cut"] += 1
        if fail_now:
            self.take(s.fail_mb(mb.mb, "StageFailed", "stage 0 failed"), failed=True)
            return
        self.queue.append(mb)

    def cont(self):
        cands = [m for m in self.queue if m.mb not in self.continued and any(m.sample) and all(
            q.in_flight == 1 for q, smp in zip(m.seqs, m.sample) if smp)]
        if not cands:
            return
        mb = self.rng.choice(cands)
        self.continued.add(mb.mb)
        nxt = self.s.continue_microbatch(mb)
        if nxt is not None:
            self.ops["cont"] += 1
            self.queue.append(nxt)

    def report(self, fail=False):
        if not self.queue:
            return
        mb = self.queue.pop(0)
        if fail:
            self.take(self.s.fail_mb(mb.mb, "StageFailed", "stage 1 failed"), failed=True)
            return
        toks = [self.rng.randrange(VOCAB) for smp in mb.sample if smp]
        self.take(self.s.on_tokens(mb.mb, toks, [-0.5] * len(toks)))

    def abort(self):
        rng = self.rng
        pool = list(self.req)
        if not pool:
            return
        rid = rng.choice(pool + ["nobody"])
        self.abort_calls += 1
        live = rid in self.state and self.state[rid] != "ended"
        was_waiting = live and self.state[rid] == "waiting"
        evs = self.s.abort(rid)
        if live:
            self.abort_reached.add(rid)
        if was_waiting:
            assert [(e.rid, e.finish) for e in evs] == [(rid, "abort")]
        self.take(evs)

    def rebudget(self):
        if self.s.kv_pages is None:
            return
        self.s.kv_pages = max(1, self.s.kv_pages + self.rng.choice([-2, -1, 1, 2]))

    # -- checks -------------------------------------------------------------------------------------------------
    def take(self, evs, failed=False):
        for e in evs:
            assert not self.finals[e.rid], f"an event after {e.rid}'s end: {e}"
            self.tokens[e.rid] += e.tokens
            assert len(self.tokens[e.rid]) <= self.want[e.rid], e
            if e.finish:
                self.finals[e.rid].append(e.finish)
                if e.finish == "abort":
                    assert e.rid in self.abort_reached, e
                if e.finish == "error":
                    assert failed or e.error[0] == "InputError", e
                if e.finish == "length":
                    assert len(self.tokens[e.rid]) == self.want[e.rid]
                if self.state[e.rid] == "active":
                    self.pages_returned[e.rid] += 1
                self.state[e.rid] = "ended"

    def invariants(self):
        s = self.s
        assert sorted(s.free_slots + list(s.active)) == list(range(s.max_batch))
        assert s.kv_used == sum(q.pages for q in s.active.values()), (s.kv_used, [q.pages for q in s.active.values()])
        assert s.kv_used >= 0
        live = {q.req.rid for q in s.active.values()}
        assert live == {rid for rid, st in self.state.items() if st == "active"}
        assert [r.rid for r in s.waiting] == [rid for rid in self.order if self.state[rid] == "waiting"], \
            "the waiting requests keep their order"
        # in order: no request is admitted while one added before it still waits
        pos = {rid: i for i, rid in enumerate(self.order)}
        assert self.admitted_order == sorted(self.admitted_order, key=pos.get), "admitted out of order"
        assert len(set(self.admitted_order)) == len(self.admitted_order), "a request admitted twice"
        assert s.aborted == len(self.abort_reached), ("stats aborted", s.aborted, len(self.abort_reached))
        assert s.kv_waits == len(self.kv_blocked_seen), ("stats kv_waits", s.kv_waits, sorted(self.kv_blocked_seen))

    def drain(self):
        for _ in range(50_000):
            if self.s.idle() and not self.queue:
                break
            self.cut()
            if self.rng.random() < 0.3:
                self.cont()
            self.report()
            self.invariants()
        assert self.s.idle() and not self.queue and not self.s.inflight
        assert sorted(self.s.free_slots) == list(range(self.s.max_batch)) and self.s.kv_used == 0
        for rid in self.order:
            assert len(self.finals[rid]) == 1, (rid, self.finals[rid])
        for rid, n in self.pages_returned.items():
            assert n == 1

    def run(self, ops: int, weights):
        names, w = zip(*weights)
        for _ in range(ops):
            op = self.rng.choices(names, w)[0]
            self.ops[op] += 1
            if op == "add":
                self.add()
            elif op == "cut":
                self.cut()
            elif op == "cut_fail":
                self.cut(fail_now=True)
            elif op == "report":
                self.report()
            elif op == "report_fail":
                self.report(fail=True)
            elif op == "cont":
                self.cont()
            elif op == "abort":
                self.abort()
            elif op == "rebudget":
                self.rebudget()
            self.invariants()
        self.drain()


WEIGHTS = [("add", 20), ("cut", 30), ("report", 30), ("cont", 8), ("abort", 10), ("cut_fail", 1),
           ("report_fail", 2), ("rebudget", 1)]

CONFIGS = [
    dict(max_batch=1, microbatches=1, prefill_chunk=4, max_context=24, kv_pages=3),
    dict(max_batch=4, microbatches=1, prefill_chunk=8, max_context=40, kv_pages=5),
    dict(max_batch=4, microbatches=3, prefill_chunk=16, max_context=64, pipeline_chunks=4, kv_pages=9),
    dict(max_batch=6, microbatches=2, prefill_chunk=16, max_context=48, prefill_chunk_decoding=5, kv_pages=7),
    dict(max_batch=3, microbatches=2, prefill_chunk=6, max_context=32),
]


class SingleAbortDriver(Driver):
    """Aborts only requests not aborted before (the counters' books aside from a repeated abort)."""

    def abort(self):
        pool = [rid for rid in self.req if rid not in self.abort_reached]
        if not pool:
            return
        rid = self.rng.choice(pool)
        live = self.state[rid] != "ended"
        evs = self.s.abort(rid)
        if live:
            self.abort_reached.add(rid)
        self.take(evs)


@pytest.mark.parametrize("ci", range(len(CONFIGS)))
def test_random_lifecycle_keeps_pages_slots_order_and_counters(ci):
    """Random adds (max_new_tokens 0, prompts and sequences at exactly max_context), cuts, continuations, reports,
    failures, aborts (each request at most once) and KV rebudgets: pages reserved = the ceil formula, returned once
    when a request ends however it ends, slots back to max_batch, admission in add order, one final event each,
    stats aborted and kv_waits equal to what happened."""
    seen = collections.Counter()
    for seed in range(4):
        d = SingleAbortDriver(random.Random(7919 * ci + seed), **dict(CONFIGS[ci]))
        d.run(800, WEIGHTS)
        seen.update(f for v in d.finals.values() for f in v)
        seen.update(kv_waits=d.s.kv_waits, cont=d.ops["cont"], aborted=d.s.aborted, dropped=d.s.dropped)
    waits = "kv_pages" in CONFIGS[ci] and CONFIGS[ci]["max_batch"] > 1
    need = ["length", "stop", "abort", "error", "cont", "aborted"] + ["kv_waits"] * waits
    assert all(seen[k] for k in need), seen


@pytest.mark.parametrize("ci", range(len(CONFIGS)))
def test_random_lifecycle_with_repeated_aborts_counts_each_request_once(ci):
    """As above, but an abort may reach the same request twice (a second abort of a request already aborted in
    flight) or one that ended, or an unknown id: stats `aborted` counts "requests an abort found", each once."""
    for seed in range(4):
        d = Driver(random.Random(104729 * ci + seed), **dict(CONFIGS[ci]))
        d.run(800, WEIGHTS)


# -- aborts in every state, one by one ------------------------------------------------------------------------------
def _books(s: Scheduler):
    assert s.kv_used == sum(q.pages for q in s.active.values())
    assert sorted(s.free_slots + list(s.active)) == list(range(s.max_batch))


def _tokens(s, mb, t=7):
    return s.on_tokens(mb.mb, [t] * sum(mb.sample), [-0.5] * sum(mb.sample))


def test_abort_in_every_state_returns_pages_and_slot_once_and_lets_the_head_in():
    """An abort of a request waiting for pages (the head), admitted but never sent, with a pipeline piece in flight,
    with a prompt chunk held to the prefill budget in flight, decoding in flight with its continuation in flight:
    each ends with one "abort" (no tokens after), its pages and slot come back once, the request waiting for pages
    behind it is admitted next, and stats `aborted` counts each once."""
    # waiting for pages at the head
    s = Scheduler(max_batch=4, microbatches=2, prefill_chunk=16, max_context=128)
    s.kv_block, s.kv_pages = 8, 4
    s.add(req(0, n=20, new=13))                      # 32 positions: 4 pages
    s.add(req(1, n=8, new=1))                        # 1 page: waits for r0's
    s.add(req(2, n=8, new=1))
    a, _ = s.next_microbatch()
    assert s.kv_used == 4 and [r.rid for r in s.waiting] == ["r1", "r2"] and s.kv_waits == 1
    assert [(e.rid, e.finish) for e in s.abort("r1")] == [("r1", "abort")]
    assert [r.rid for r in s.waiting] == ["r2"] and s.aborted == 1
    b, _ = s.next_microbatch()                      # r0's last chunk follows its first (pipelined)
    assert s.kv_waits == 2, "r2 now waits at the head"
    assert (a.counts, b.counts, b.sample) == ([16], [4], [True])
    # r0 in flight mid-prompt (two chunks): aborted, it ends when its chunks are back, then r2 is admitted
    assert s.abort("r0") == [] and s.aborted == 2
    assert s.next_microbatch()[0] is None
    assert _tokens(s, a) == [] and s.kv_used == 4
    ev = _tokens(s, b)
    assert [(e.rid, e.finish) for e in ev] == [("r0", "abort")] and s.kv_used == 0
    _books(s)
    mb, _ = s.next_microbatch()
    assert [q.req.rid for q in mb.seqs] == ["r2"] and s.kv_used == 1
    ev = _tokens(s, mb)
    assert [(e.rid, e.finish) for e in ev] == [("r2", "length")] and s.idle() and s.kv_used == 0

    # admitted but not yet sent (M microbatches in flight): ends at once, nothing of it is ever sent
    s = Scheduler(max_batch=4, microbatches=1, prefill_chunk=16, max_context=128)
    s.kv_block, s.kv_pages = 8, 8
    s.add(req(0, n=4, new=30))
    a, _ = s.next_microbatch()
    s.add(req(1, n=8, new=8))                        # 2 pages
    assert s.next_microbatch()[0] is None            # admitted, not sent: one microbatch in flight
    assert {q.req.rid for q in s.active.values()} == {"r0", "r1"} and s.kv_used == 7
    assert [(e.rid, e.finish) for e in s.abort("r1")] == [("r1", "abort")] and s.kv_used == 5
    _books(s)
    _tokens(s, a)
    b, _ = s.next_microbatch()
    assert [q.req.rid for q in b.seqs] == ["r0"] and b.release and not b.admit, "its slot is released, never admitted"

    # a pipeline piece in flight (a prompt alone, cut in pieces, two in flight)
    s = Scheduler(max_batch=2, microbatches=3, prefill_chunk=64, max_context=256, pipeline_chunks=4)
    s.kv_block, s.kv_pages = 8, 32
    s.add(req(0, n=64, new=4))
    p1, _ = s.next_microbatch()
    p2, _ = s.next_microbatch()
    assert p1.counts == p2.counts == [16] and s.cut == 1
    assert s.abort("r0") == [] and s.next_microbatch()[0] is None
    assert _tokens(s, p1) == [] and s.kv_used == 9
    assert [(e.rid, e.finish) for e in _tokens(s, p2)] == [("r0", "abort")] and s.idle() and s.kv_used == 0

    # a chunk held to the prefill budget while another decodes, in flight
    s = Scheduler(max_batch=4, microbatches=2, prefill_chunk=64, max_context=256, prefill_chunk_decoding=4)
    s.kv_block, s.kv_pages = 8, 32
    s.add(req(0, n=2, new=20))
    _tokens(s, s.next_microbatch()[0])               # r0 decodes
    s.add(req(1, n=40, new=3))
    mb, _ = s.next_microbatch()
    assert mb.counts == [4] and mb.seqs[0].req.rid == "r1" and s.held_back == 1
    assert s.abort("r1") == []
    ev = _tokens(s, mb)
    assert [(e.rid, e.finish) for e in ev if e.finish] == [("r1", "abort")] and s.kv_used == 3
    _books(s)

    # decoding: its step and the step's continuation in flight (one stage's async scheduling)
    s = Scheduler(max_batch=2, microbatches=1, prefill_chunk=64, max_context=256)
    s.kv_block, s.kv_pages = 8, 4
    s.add(req(0, n=3, new=20))                       # 22 positions: 3 pages
    s.add(req(1, n=8, new=3))                        # 2 pages: waits
    mb, _ = s.next_microbatch()
    cont = s.continue_microbatch(mb)
    assert s.abort("r0") == [] and s.continue_microbatch(cont) is None
    ev = _tokens(s, mb)
    assert [(e.rid, e.tokens, e.finish) for e in ev] == [("r0", [], "abort")] and s.kv_used == 0
    assert _tokens(s, cont) == [] and s.dropped == 2
    ev = []
    while not s.idle():
        nxt, evs = s.next_microbatch()
        ev += evs + _tokens(s, nxt)
    assert [(e.rid, e.finish) for e in ev if e.finish] == [("r1", "length")] and s.aborted == 1
    assert sorted(s.free_slots) == [0, 1] and s.kv_used == 0


def test_a_second_abort_of_a_request_in_flight_is_not_counted_again():
    """stats `aborted` is "requests an abort found, waiting or admitted" (an abort that finds nothing counts
    nothing; the runner counts an image request's aborts once, `_pending_aborted`). A request aborted while in
    flight stays active until its microbatch is back; a second abort meanwhile (the client's let-go and its close,
    two handles) finds it again and counts it again: one request, `aborted` 2."""
    s = Scheduler(max_batch=2, microbatches=1, prefill_chunk=64, max_context=256)
    s.add(req(0, n=3, new=20))
    mb, _ = s.next_microbatch()
    assert s.abort("r0") == [] and s.aborted == 1
    assert s.abort("r0") == []
    ev = _tokens(s, mb)
    assert [(e.rid, e.finish) for e in ev] == [("r0", "abort")] and s.idle()
    assert s.aborted == 1, f"one request aborted, counted {s.aborted} times"


def test_a_stop_token_during_a_continuation_returns_the_pages_once_and_admits_the_head():
    """One stage: a sequence stops on a token while its continuation is in flight. Its pages and slot come back when
    the stopping token is read (once: the continuation's token is dropped, no second release), the request waiting
    for pages is admitted next, into the slot released first."""
    s = Scheduler(max_batch=2, microbatches=1, prefill_chunk=64, max_context=256)
    s.kv_block, s.kv_pages = 8, 4
    s.add(req(0, n=3, new=20, stop=(9,)))            # 3 pages
    s.add(req(1, n=3, new=20))                       # 3 pages: waits
    mb, _ = s.next_microbatch()
    assert s.kv_waits == 1 and not s.has_ready_work()
    cont = s.continue_microbatch(mb)
    ev = _tokens(s, mb, t=9)
    assert [(e.rid, e.tokens, e.finish) for e in ev] == [("r0", [9], "stop")] and s.kv_used == 0
    assert s.has_ready_work(), "the head fits now: the one-stage intake stops continuing and admits it"
    assert _tokens(s, cont) == [] and s.dropped == 1 and s.kv_used == 0
    _books(s)
    nxt, _ = s.next_microbatch()
    assert [q.req.rid for q in nxt.seqs] == ["r1"] and s.kv_used == 3 and nxt.release == [mb.seqs[0].slot]
    assert s.kv_waits == 1


def test_max_new_tokens_zero_and_requests_at_exactly_max_context():
    """max_new_tokens 0 ends "length" with no token, holding no slot nor page (in order: after the head). A prompt of
    max_context tokens with one new token, and a prompt and max_new_tokens reaching exactly max_context positions
    whose pages are the whole budget, run to their length."""
    s = Scheduler(max_batch=2, microbatches=1, prefill_chunk=16, max_context=32)
    s.kv_block, s.kv_pages = 8, 4
    s.add(req(0, n=32, new=1))                       # 32 positions: every page
    s.add(req(1, n=5, new=0))
    s.add(req(2, n=20, new=13))                      # 32 positions
    mb, ev = s.next_microbatch()
    assert [(e.rid, e.tokens, e.finish) for e in ev] == [("r1", [], "length")], "r1 ends at once: a slot is free"
    assert [r.rid for r in s.waiting] == ["r2"] and s.kv_waits == 1
    while not s.idle():
        nxt, evs = s.next_microbatch()
        ev += evs
        if nxt is not None:
            ev += _tokens(s, nxt)
        elif mb is not None:
            ev += _tokens(s, mb)
            mb = None
    ends = {e.rid: (e.finish, sum(len(x.tokens) for x in ev if x.rid == e.rid)) for e in ev if e.finish}
    assert ends == {"r0": ("length", 1), "r1": ("length", 0), "r2": ("length", 13)}
    assert s.kv_used == 0 and sorted(s.free_slots) == [0, 1]


def test_a_halts_fresh_scheduler_keeps_the_stats_counters():
    """A halt replaces the intake's scheduler (recovery.halt): its stats counters go on from the old one's, as the
    runner's aborted_early does (the helper's review: stats "aborted" had dropped back to the early aborts alone)."""
    old = Scheduler(max_batch=2, microbatches=1, prefill_chunk=16, max_context=64)
    old.add(req(0))
    old.next_microbatch()
    old.abort("r0")
    for i, k in enumerate(Scheduler.COUNTS):
        setattr(old, k, getattr(old, k) + i)
    new = Scheduler(max_batch=2, microbatches=1, prefill_chunk=16, max_context=64).carry_counts(old)
    assert {k: getattr(new, k) for k in Scheduler.COUNTS} == {k: getattr(old, k) for k in Scheduler.COUNTS}
    assert new.aborted >= 1 and not new.active and not new.inflight and new.kv_used == 0


def test_max_new_tokens_zero_needs_no_slot_and_no_page():
    """A request for 0 new tokens is never prefilled: a prompt beyond the KV budget (within max_context) is
    accepted, and it ends while every slot is taken; a head that waits for pages still holds it back (in order)."""
    s = Scheduler(max_batch=1, microbatches=1, prefill_chunk=16, max_context=64)
    s.kv_block, s.kv_pages = 8, 2
    with pytest.raises(InputError, match="the KV cache holds 16 positions"):
        s.validate(req(9, n=40, new=1))
    s.add(req(0, n=5, new=4))
    mb, ev = s.next_microbatch()
    assert ev == [] and not s.free_slots
    s.add(req(1, n=40, new=0))                       # 5 pages of prompt: more than the budget, and no slot is free
    assert s.has_ready_work()
    nxt, ev = s.next_microbatch()
    assert nxt is None and [(e.rid, e.tokens, e.finish) for e in ev] == [("r1", [], "length")]
    ev = _tokens(s, mb)                               # r0 runs on, its slot and pages untouched
    s.add(req(2, n=9, new=8))                        # 16 positions: waits for r0's pages
    s.add(req(3, n=3, new=0))                        # behind it: held until r2 is admitted
    while not s.idle():
        nxt, evs = s.next_microbatch()
        ev += evs
        if nxt is not None:
            ev += _tokens(s, nxt)
    assert [e.rid for e in ev if e.finish] == ["r0", "r3", "r2"], "r3 ends once r2, ahead of it, is admitted"
    assert s.kv_used == 0 and s.free_slots == [0]


# -- end to end: memra_pp.launch on CPU stages with a small scheduler.kv_pages ---------------------------------------
def _cfg(path, n_stages, **sched):
    return {"name": f"kv{n_stages}", "model": {"path": str(path), "dtype": "float32"},
            "stages": [{"device": "cpu", "num_cpus": 0.1}] * n_stages,
            "scheduler": {"max_batch": 4, "max_context": 256, "prefill_chunk": 48, **sched}}


def _wait_for(pred, timeout=30.0):
    import time
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.02)
    return pred()


def _intake(dep):
    return dep.stats()["stages"][0]


def test_e2e_a_request_aborted_twice_counts_once(ray_cluster):
    """Two aborts reaching one request in flight (the intake's abort called twice, as a close() racing a submit's
    own abort does: client._submit aborts when it finds the client closed, close() aborts every tracked request):
    stats `aborted` must grow by 1."""
    import memra_pp
    import ray
    from conftest_models import tiny_checkpoint
    _, path = tiny_checkpoint("dense", False)
    with memra_pp.launch(_cfg(path, 1, kv_pages=4)) as dep:
        c = dep.client()
        before = _intake(dep)["aborted"]
        it = c.stream([5, 17, 42], max_new_tokens=200)
        next(it)
        rid = next(iter(c._tracks))
        ray.get([dep.actors[0].abort.remote(rid), dep.actors[0].abort.remote(rid)])
        assert _wait_for(lambda: _intake(dep)["kv_pages_reserved"] == 0)
        it.close()
        assert _intake(dep)["aborted"] - before == 1, _intake(dep)["aborted"] - before
