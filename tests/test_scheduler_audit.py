"""The scheduler must keep its books under any interleaving: a randomized model-based run (fixed seeds) checks slots,
KV pages, in-flight counts, starts, fed ids and every request's events after each step; and the defects the audit
found stay fixed."""
import collections
import random

import pytest

from memra_pp.model.sampling import SamplingParams
from memra_pp.scheduler import Request, Scheduler

VOCAB = 12


def req(i, n=5, new=3, stop=()):
    return Request(f"r{i}", "c", list(range(1, n + 1)), new, SamplingParams(), frozenset(stop))


class Harness:
    """Drives a Scheduler against a model of the device: stage A (the intake) runs each microbatch when it is cut,
    stage B (the rest of the pipeline) runs them in cut order when they are reported (`ordered`), or the reports
    come back in any order (`ordered` False: B is not modelled). Both keep each slot's cached length and check the
    starts the way StageModel.forward does."""

    def __init__(self, rng: random.Random, ordered: bool, **cfg):
        self.rng, self.ordered = rng, ordered
        kv = cfg.pop("kv_pages", None)
        self.s = Scheduler(**cfg)
        self.s.kv_block = 8
        self.s.kv_pages = kv
        self.n_slots = cfg["max_batch"]
        self.lens_a = [0] * self.n_slots
        self.lens_b = [0] * self.n_slots
        self.poisoned_b: set[int] = set()       # slots whose length B lost to a failed microbatch
        self.queue: list = []                   # microbatches in flight, in cut order
        self.continued: set[int] = set()
        self.want: dict[str, int] = {}
        self.req: dict[str, Request] = {}
        self.events: dict[str, list] = collections.defaultdict(list)
        self.finish: dict[str, str] = {}
        self.aborted: set[str] = set()
        self.failed: set[str] = set()
        self.dev: dict[str, dict[int, int]] = collections.defaultdict(dict)   # rid -> {position fed: token drawn}
        self.next_rid = 0
        self.n_cont = 0

    # -- operations -------------------------------------------------------------------------------------------
    def add(self, lone=False):
        rng, ctx, chunk = self.rng, self.s.max_context, self.s.chunk
        n = rng.choice([1, 2, chunk, chunk + 1, rng.randint(1, ctx // 2), rng.randint(1, ctx)])
        if lone:        # a long prompt alone in the deployment (pipeline pieces)
            if not self.s.idle():
                return
            least = max(chunk // 8, self.s.kv_block)
            n = min(ctx, rng.randint(2 * least, max(2 * least, self.s.pieces * chunk - 1)))
        n = min(n, ctx)
        new = rng.choice([0, 1, 1, 2, rng.randint(1, 8), rng.randint(1, 20)])
        new = max(0, min(new, ctx + 1 - n))
        stop = frozenset(rng.sample(range(VOCAB), rng.choice([0, 0, 1, 2])))
        r = Request(f"q{self.next_rid}", "c", [rng.randrange(VOCAB) for _ in range(n)], new, SamplingParams(), stop)
        self.next_rid += 1
        try:
            self.s.add(r)
        except Exception as e:      # only a request that can never fit the KV budget is refused here
            assert self.s.kv_pages is not None and self.s.pages(r) > self.s.kv_pages, e
            return
        self.want[r.rid], self.req[r.rid] = new, r

    def cut(self, launch_fails=False):
        s = self.s
        decoding = any(q.sent >= len(q.req.prompt) for q in s.active.values())
        before = sum(m.prompt_tokens for m in s.inflight.values())
        mb, evs = s.next_microbatch()
        self.take(evs)
        if mb is None:
            return
        assert len(mb.seqs) <= s.max_batch and len({q.slot for q in mb.seqs}) == len(mb.seqs)
        assert mb.prompt_tokens <= s.chunk
        assert mb.prompt_tokens == sum(c for q, st, c in zip(mb.seqs, mb.starts, mb.counts) if st < len(q.req.prompt))
        if decoding and mb.prompt_tokens and s.chunk_decoding is not None:
            assert before + mb.prompt_tokens <= s.chunk_decoding, (before, mb.prompt_tokens)
        follow = [q.fed < st for q, st in zip(mb.seqs, mb.starts)]
        assert not any(follow) or len(mb.seqs) == 1, "a follow-on chunk travels alone"
        ids = iter(mb.ids)
        for q, st, c, smp in zip(mb.seqs, mb.starts, mb.counts, mb.sample):
            n = len(q.req.prompt)
            if st < n:
                assert st + c <= n and [next(ids) for _ in range(c)] == q.req.prompt[st:st + c]
                assert smp == (st + c == n)
            else:
                assert c == 1 and smp and next(ids) == self.dev[q.req.rid][st - 1], "a decode row feeds its last token"
            assert st + c <= n + self.want[q.req.rid] - 1, "never past prompt + max_new_tokens - 1 positions"
        if launch_fails:                # stage 0 could not run it (intake_loop._fail): no stage saw it
            self.take(s.fail_mb(mb.mb, "StageFailed", "stage 0 failed"), failed=True)
            return
        self.run_a(mb)
        self.queue.append(mb)

    def cont(self):
        # (the intake continues a step only while that step is its sequences' one microbatch in flight)
        cands = [m for m in self.queue if m.mb not in self.continued and any(m.sample) and all(
            q.in_flight == 1 for q, smp in zip(m.seqs, m.sample) if smp)]
        if not cands:
            return
        mb = self.rng.choice(cands)
        self.continued.add(mb.mb)
        nxt = self.s.continue_microbatch(mb)
        if nxt is None:
            return
        self.n_cont += 1
        rows = [q for q, smp in zip(mb.seqs, mb.sample) if smp]
        assert [rows[i] for i in nxt.feed] == nxt.seqs and nxt.ids == []
        for q, st in zip(nxt.seqs, nxt.starts):
            assert len(q.out) + 1 < q.req.max_new_tokens and st + 1 <= len(q.req.prompt) + self.want[q.req.rid] - 1
        self.run_a(nxt)
        self.queue.append(nxt)

    def report(self):
        if not self.queue:
            return
        if self.ordered:
            mb = self.queue.pop(0)
        else:   # any order, but a sequence's sampled tokens in order (one stage: a step's before its continuation's)
            ok = [i for i, m in enumerate(self.queue) if not any(
                x is q for e in self.queue[:i] for x in e.seqs for q, smp in zip(m.seqs, m.sample) if smp)]
            mb = self.queue.pop(self.rng.choice(ok))
        if self.ordered:
            fails = not self.run_b(mb) or self.rng.random() < 0.04
        else:
            fails = self.rng.random() < 0.04
        if fails:
            if self.ordered:
                self.poisoned_b.update(q.slot for q in mb.seqs)
            self.take(self.s.fail_mb(mb.mb, "StageFailed", "stage 1 failed"), failed=True)
            return
        toks, lps = [], []
        for q, st, c, smp in zip(mb.seqs, mb.starts, mb.counts, mb.sample):
            if smp:
                t = self.rng.randrange(VOCAB)
                self.dev[q.req.rid][st + c - 1] = t
                toks.append(t)
                lps.append(-0.5)
        self.take(self.s.on_tokens(mb.mb, toks, lps))

    def abort(self):
        live = [rid for rid in self.want if rid not in self.finish]
        if live:
            rid = self.rng.choice(live)
            self.aborted.add(rid)
            self.take(self.s.abort(rid))

    def fail_all(self):
        self.take(self.s.fail_all("StageFailed", "lost", 1), failed=True)
        assert self.s.idle() and not self.s.inflight and self.s.kv_used == 0
        # the intake's halt resets every stage's cache
        self.queue.clear()
        self.lens_a, self.lens_b, self.poisoned_b = [0] * self.n_slots, [0] * self.n_slots, set()

    # -- the device model -------------------------------------------------------------------------------------
    def run_a(self, mb):
        for x in mb.release:
            self.lens_a[x] = 0
        for q, st, c in zip(mb.seqs, mb.starts, mb.counts):
            assert st == 0 or self.lens_a[q.slot] == st, (q.req.rid, st, self.lens_a[q.slot])
            self.lens_a[q.slot] = st + c

    def run_b(self, mb) -> bool:
        for x in mb.release:
            self.lens_b[x] = 0
            self.poisoned_b.discard(x)
        for q, st in zip(mb.seqs, mb.starts):
            if st == 0:
                self.poisoned_b.discard(q.slot)
            elif self.lens_b[q.slot] != st:
                assert q.slot in self.poisoned_b, (q.req.rid, st, self.lens_b[q.slot])
                return False
        for q, st, c in zip(mb.seqs, mb.starts, mb.counts):
            self.lens_b[q.slot] = st + c
        return True

    # -- checks -----------------------------------------------------------------------------------------------
    def take(self, evs, failed=False):
        for e in evs:
            assert e.rid not in self.finish, f"an event after {e.rid}'s finish: {e}"
            self.events[e.rid].append(e)
            if e.finish:
                self.finish[e.rid] = e.finish
                toks = [t for x in self.events[e.rid] for t in x.tokens]
                r, want = self.req[e.rid], self.want[e.rid]
                assert len(toks) <= want
                if e.finish == "length":
                    assert len(toks) == want and not (set(toks[:-1]) & r.stop_ids)
                elif e.finish == "stop":
                    assert toks and toks[-1] in r.stop_ids and not (set(toks[:-1]) & r.stop_ids)
                elif e.finish == "abort":
                    assert e.rid in self.aborted
                else:
                    assert e.finish == "error" and failed, e
                    self.failed.add(e.rid)
                n = len(r.prompt)
                assert toks == [self.dev[e.rid][n - 1 + i] for i in range(len(toks))], "tokens in position order"

    def invariants(self):
        s = self.s
        slots = sorted(s.free_slots + list(s.active))
        assert slots == list(range(self.n_slots)), slots
        assert all(q.slot == k for k, q in s.active.items())
        assert s.kv_used == sum(q.pages for q in s.active.values())
        if s.kv_pages is not None:
            assert s.kv_used <= s.kv_pages
        assert set(s.inflight) == {m.mb for m in self.queue}
        for q in s.active.values():
            mine = [(st, c) for m in self.queue for x, st, c in zip(m.seqs, m.starts, m.counts) if x is q]
            assert q.in_flight == len(mine), (q.req.rid, q.in_flight, mine)
            assert q.sent - q.fed == sum(c for _, c in mine) and 0 <= q.fed <= q.sent
            assert not q.done and q.req.rid not in self.finish
        for r in s.waiting:
            assert r.rid not in self.finish
        if self.ordered and not self.queue:        # nothing in flight: a free slot holds nothing on any stage
            for x in set(s.free_slots) - set(s.pending_release):
                assert self.lens_a[x] == self.lens_b[x] == 0, \
                    f"slot {x} is free but the stages still hold {self.lens_a[x]} / {self.lens_b[x]} positions"

    def drain(self):
        for _ in range(20_000):
            if self.s.idle() and not self.queue:
                break
            self.cut()
            if self.rng.random() < 0.3:
                self.cont()
            self.report()
            self.invariants()
        assert self.s.idle() and not self.queue, "every request must end"
        assert sorted(self.s.free_slots) == list(range(self.n_slots)) and self.s.kv_used == 0
        for rid, want in self.want.items():
            assert rid in self.finish, f"{rid} never finished"
            if self.finish[rid] == "length":
                assert sum(len(e.tokens) for e in self.events[rid]) == want

    def run(self, ops: int):
        weights = [("add", 18), ("lone", 3), ("cut", 30), ("report", 30), ("cont", 6), ("abort", 6), ("launch_fail", 2),
                   ("fail_all", 0.3)]
        names, w = zip(*weights)
        for _ in range(ops):
            op = self.rng.choices(names, w)[0]
            if op in ("add", "lone"):
                self.add(op == "lone")
            elif op == "cut":
                self.cut()
            elif op == "launch_fail":
                self.cut(launch_fails=True)
            elif op == "report":
                self.report()
            elif op == "cont":
                self.cont()
            elif op == "abort":
                self.abort()
            else:
                self.fail_all()
            self.invariants()
        self.drain()


CONFIGS = [
    dict(max_batch=1, microbatches=1, prefill_chunk=4, max_context=32),
    dict(max_batch=4, microbatches=1, prefill_chunk=8, max_context=48),
    dict(max_batch=4, microbatches=3, prefill_chunk=16, max_context=64, pipeline_chunks=4),
    dict(max_batch=3, microbatches=5, prefill_chunk=1, max_context=24),
    dict(max_batch=6, microbatches=2, prefill_chunk=16, max_context=64, prefill_chunk_decoding=5),
    dict(max_batch=8, microbatches=3, prefill_chunk=8, max_context=64, prefill_chunk_decoding=3, kv_pages=12),
    dict(max_batch=5, microbatches=2, prefill_chunk=16, max_context=40, pipeline_chunks=3, kv_pages=6),
]


@pytest.mark.parametrize("ordered", [True, False], ids=["in_order", "any_order"])
@pytest.mark.parametrize("ci", range(len(CONFIGS)))
def test_random_operations_keep_the_books(ci, ordered):
    """Under random adds, cuts, continuations, reports (in pipeline order or any order), aborts and failures,
    the scheduler's slots, KV pages and in-flight counts must match the microbatches in flight after every step;
    every start must meet the cached length; each request must get its tokens in order, never past
    max_new_tokens, exactly that many when it ends by length, nothing after its finish, and must end."""
    cfg = CONFIGS[ci]
    seen = collections.Counter()
    for seed in range(3):
        h = Harness(random.Random(1000 * ci + 10 * seed + ordered), ordered, **dict(cfg))
        h.run(700)
        seen.update(h.finish.values())
        seen.update(continued=h.n_cont, aborted=h.s.aborted, pipelined=h.s.pipelined, kv_waits=h.s.kv_waits,
                    held_back=h.s.held_back, cut=h.s.cut, dropped=h.s.dropped)
    # non-vacuity: the paths the configuration can take were taken
    need = ["length", "stop", "abort", "error", "continued", "aborted"]
    need += ["pipelined"] * (cfg["microbatches"] > 1 and cfg["max_batch"] < 5)
    need += ["kv_waits"] * ("kv_pages" in cfg) + ["held_back"] * ("prefill_chunk_decoding" in cfg)
    need += ["cut"] * (cfg.get("pipeline_chunks", 1) > 1)
    assert all(seen[k] for k in need), seen

def test_a_failed_microbatch_releases_its_slots_again():
    """A microbatch carries the slots of the sequences finished before it (`release`). Should it fail at stage 0
    (no stage ran it) or on a stage that passes an mb_error on instead of the step, those slots keep their KV pages
    on some stage while the scheduler counts them free: the next microbatch must release them again, where they
    are still free, and never a slot that a new sequence has taken since."""
    s = Scheduler(max_batch=3, microbatches=2, prefill_chunk=16, max_context=64)
    s.add(req(0, n=4, new=1))
    s.add(req(1, n=4, new=5))
    mb, _ = s.next_microbatch()
    ev = s.on_tokens(mb.mb, [7, 7], [-0.5, -0.5])        # r0 ends: its slot goes out with the next microbatch
    gone = next(e for e in ev if e.finish).rid
    assert gone == "r0" and len(s.pending_release) == 1
    freed = s.pending_release[0]
    a, _ = s.next_microbatch()
    assert a.release == [freed]
    assert [e.rid for e in s.fail_mb(a.mb, "StageFailed", "stage 0 failed")] == ["r1"]
    assert freed in s.pending_release, "the failed microbatch's releases must go out again"
    s.add(req(2, n=3, new=2))                             # takes a free slot: released first, then reset
    b, _ = s.next_microbatch()
    assert freed in b.release

    # a slot given to a new sequence since is not released again (it would drop that sequence's cache)
    s = Scheduler(max_batch=2, microbatches=3, prefill_chunk=16, max_context=64)
    s.add(req(0, n=4, new=1))
    s.add(req(1, n=4, new=5))
    mb, _ = s.next_microbatch()
    s.on_tokens(mb.mb, [7, 7], [-0.5, -0.5])
    x = s.pending_release[0]
    a, _ = s.next_microbatch()                            # r1's decode step carries x's release
    assert a.release == [x] and [q.req.rid for q in a.seqs] == ["r1"]
    s.add(req(2, n=4, new=3))
    b, _ = s.next_microbatch()                            # r2 starts in x while `a` is in flight
    assert b.seqs[0].slot == x and b.starts == [0]
    s.fail_mb(a.mb, "StageFailed", "stage 1 failed")
    assert x not in s.pending_release and s.active[x].req.rid == "r2"

def test_a_request_that_no_longer_fits_a_shrunk_kv_budget_is_refused_not_left_waiting():
    """The KV budget is measured again after an adapter load (its LoRA pools take memory) and may shrink under a
    request already waiting, checked against the old one. It can then never be admitted: it must end with an
    InputError naming the budget, and the requests behind it must run, not wait behind it for ever."""
    s = Scheduler(max_batch=4, microbatches=1, prefill_chunk=64, max_context=512)
    s.kv_pages = 8
    s.add(req(0, n=100, new=300))                         # 7 pages: r1 must wait
    s.add(req(1, n=300, new=10))
    s.add(req(2, n=10, new=2))
    mb, _ = s.next_microbatch()
    s.on_tokens(mb.mb, [7], [-0.5])
    d, _ = s.next_microbatch()                            # r0's decode step
    assert [r.rid for r in s.waiting] == ["r1", "r2"] and not s.has_ready_work()
    s.kv_pages = 4                                        # an adapter load's new budget
    # work now: a one-stage intake must stop cutting continuations and come to refuse it
    assert s.has_ready_work()
    s.on_tokens(d.mb, [7], [-0.5])
    s.abort("r0")
    ev = []
    for _ in range(50):
        if s.idle():
            break
        nxt, evs = s.next_microbatch()
        ev += evs
        if nxt is not None:
            ev += s.on_tokens(nxt.mb, [7] * sum(nxt.sample), [-0.5] * sum(nxt.sample))
    assert s.idle() and s.kv_used == 0, [r.rid for r in s.waiting]
    err = [e for e in ev if e.rid == "r1"]
    assert [e.finish for e in err] == ["error"] and err[0].error[0] == "InputError"
    assert "KV cache holds 256 positions" in err[0].error[1]
    assert [e.finish for e in ev if e.rid == "r2" and e.finish] == ["length"]


@pytest.mark.parametrize("decoding_budget", [None, 16])
def test_a_long_prompt_progresses_while_short_requests_keep_arriving(decoding_budget):
    """Requests admitted after a long prompt's first chunk must not take its prompt budget step after step: ready
    prompts go least recently run first, a new one counting from its admission, so each of the (at most max_batch)
    prompts gets its turn. Before, a new request went before every other (last_run 0), and short prompts admitted
    every step (slots freed by short decodes) held a 512-token prompt at its first chunk for good."""
    budget = decoding_budget or 64
    s = Scheduler(max_batch=32, microbatches=1, prefill_chunk=64, max_context=4096,
                  prefill_chunk_decoding=decoding_budget)
    for j in range(4):                                    # requests already decoding
        s.add(Request(f"d{j}", "c", [1] * 16, 400, SamplingParams()))
    mb, _ = s.next_microbatch()
    s.on_tokens(mb.mb, [3] * sum(mb.sample), [0.0] * sum(mb.sample))
    s.add(Request("long", "c", [1] * 512, 2, SamplingParams()))
    k, steps, got = 0, 300, []
    for _ in range(steps):
        while len(s.waiting) < 8:                         # short requests keep arriving
            s.add(Request(f"s{k}", "c", [1] * 16, 2, SamplingParams()))
            k += 1
        mb, _ = s.next_microbatch()
        got += [c for q, c in zip(mb.seqs, mb.counts) if q.req.rid == "long"]
        s.on_tokens(mb.mb, [3] * sum(mb.sample), [0.0] * sum(mb.sample))
    fair = steps * budget // s.max_batch                  # a round robin over max_batch prompts, at least
    assert sum(got) >= min(512, fair // 2), f"{k} short requests served; the long prompt sent {sum(got)} of 512"
    assert k > 100, "the short requests were served meanwhile too"


def test_a_request_whose_logits_are_not_finite_ends_alone_naming_the_cause():
    """The primary's logprob of a row is NaN when its logits were not finite (an adapter that overflows on the
    activations, or a model in too narrow a dtype): its token means nothing. That request must end with an
    InputError naming the token and the likely cause (its adapter's slot where it has one), its slot freed; the
    others of the same microbatch go on; nothing is counted twice."""
    import dataclasses
    s = Scheduler(max_batch=3, microbatches=1, prefill_chunk=16, max_context=64)
    s.add(dataclasses.replace(req(0, n=4, new=4), adapter=1, adapter_name="ad"))
    s.add(req(1, n=4, new=4))
    s.add(req(2, n=4, new=4))
    mb, _ = s.next_microbatch()
    ev = s.on_tokens(mb.mb, [7, 8, 9], [-0.5, float("nan"), -0.25])
    assert [(e.rid, e.tokens, e.finish) for e in ev] == [("r0", [7], None), ("r1", [], "error"), ("r2", [9], None)]
    assert ev[1].error == ("InputError", "the model's logits for output token 1 of this request are not finite "
                           "(NaN): the model overflows on this prompt in its dtype: load it in a wider one "
                           "(model.dtype)")
    assert s.not_finite == 1 and sorted(s.active) != [] and len(s.active) == 2
    mb, _ = s.next_microbatch()
    assert [q.req.rid for q in mb.seqs] == ["r0", "r2"] and len(mb.release) == 1
    ev = s.on_tokens(mb.mb, [5, 6], [float("nan"), -0.1])
    assert [(e.rid, e.finish) for e in ev] == [("r0", "error"), ("r2", None)]
    assert ev[0].error[1].startswith("the model's logits for output token 2 of this request are not finite (NaN): "
                                     "its adapter 'ad' overflows on these activations: lower its lora_alpha")
    assert s.not_finite == 2 and [q.req.rid for q in s.active.values()] == ["r2"]
    assert Scheduler(max_batch=1, microbatches=1, prefill_chunk=16, max_context=64).carry_counts(s).not_finite == 2
