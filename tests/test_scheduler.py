"""The scheduler must batch continuously, spread sequences over microbatches and never lose a request."""
import random

import pytest

from memra_pp.errors import InputError
from memra_pp.model.sampling import SamplingParams
from memra_pp.scheduler import Request, Scheduler


def req(i, n=5, new=3, stop=()):
    return Request(f"r{i}", "c", list(range(1, n + 1)), new, SamplingParams(), frozenset(stop))


def run_to_end(s: Scheduler, token=7, shuffle=None):
    events, rounds = [], 0
    while not s.idle():
        mbs = []
        while True:
            mb, ev = s.next_microbatch()
            events += ev
            if mb is None:
                break
            mbs.append(mb)
        if shuffle:
            shuffle.shuffle(mbs)
        for mb in mbs:
            events += s.on_tokens(mb.mb, [token] * sum(mb.sample), [-0.5] * sum(mb.sample))
        rounds += 1
        assert rounds < 10_000
    return events


def test_every_request_finishes_once_with_its_tokens():
    """Each request must get exactly max_new_tokens tokens and one finish event, whatever the arrival order."""
    s = Scheduler(max_batch=4, microbatches=3, prefill_chunk=7, max_context=64)
    for i in range(11):
        s.add(req(i, n=1 + i * 3, new=1 + i % 4))
    ev = run_to_end(s, shuffle=random.Random(0))
    for i in range(11):
        mine = [e for e in ev if e.rid == f"r{i}"]
        assert sum(len(e.tokens) for e in mine) == 1 + i % 4
        assert [e.finish for e in mine if e.finish] == ["length"]


def test_microbatches_spread_sequences_and_respect_chunk():
    """With M microbatches, active sequences must be split over them and prefill chunks capped."""
    s = Scheduler(max_batch=6, microbatches=3, prefill_chunk=4, max_context=64)
    for i in range(6):
        s.add(req(i, n=10, new=5))
    mbs = [s.next_microbatch()[0] for _ in range(4)]
    assert mbs[3] is None, "no more than M microbatches may be in flight"
    for mb in mbs[:3]:
        assert len(mb.seqs) <= 2 and sum(mb.counts) <= 4
    assert len({s.slot for mb in mbs[:3] for s in mb.seqs}) == sum(len(mb.seqs) for mb in mbs[:3])


def test_stop_token_and_context_limit():
    """A stop id must end the request with 'stop'; a request runs to exactly its max_new_tokens ('length'), up to
    max_context positions (its last token is sampled, never fed: n + m - 1 positions); one that would need more is
    refused at submission, never cut short."""
    s = Scheduler(max_batch=2, microbatches=1, prefill_chunk=16, max_context=8)
    s.add(req(0, n=3, new=6, stop=[7]))
    s.add(req(1, n=6, new=3))                  # 6 + 3 - 1 = 8 positions: just fits
    ev = run_to_end(s, token=7)
    assert [e.finish for e in ev if e.rid == "r0"] == ["stop"]
    r1 = [e for e in ev if e.rid == "r1"]      # 7 is no stop of r1's: it runs to its max_new_tokens
    assert sum(len(e.tokens) for e in r1) == 3 and [e.finish for e in r1 if e.finish] == ["length"], r1
    with pytest.raises(InputError, match=r"the prompt's 6 tokens and max_new_tokens 4 need 9 positions, more than "
                                         r"scheduler.max_context \(8\); ask for at most 3 new tokens"):
        s.add(req(1, n=6, new=4))
    assert s.idle()


@pytest.mark.parametrize("r,msg", [
    (Request("x", "c", [], 3, SamplingParams()), "prompt is empty"),
    (Request("x", "c", list(range(100)), 3, SamplingParams()), "more than scheduler.max_context"),
    (Request("x", "c", [1], -1, SamplingParams()), "max_new_tokens must be >= 0"),
])
def test_refusals(r, msg):
    """Requests that can never run must be refused with InputError naming the problem."""
    s = Scheduler(max_batch=2, microbatches=1, prefill_chunk=16, max_context=64)
    with pytest.raises(InputError, match=msg):
        s.add(r)


def test_failed_microbatch_ends_only_its_requests():
    """fail_mb must end that microbatch's requests with the error and leave the others running."""
    s = Scheduler(max_batch=4, microbatches=2, prefill_chunk=64, max_context=64)
    for i in range(4):
        s.add(req(i, new=2))
    a, _ = s.next_microbatch()
    b, _ = s.next_microbatch()
    ev = s.fail_mb(a.mb, "StageFailed", "boom")
    assert {e.rid for e in ev} == {q.req.rid for q in a.seqs} and all(e.finish == "error" for e in ev)
    rest = s.on_tokens(b.mb, [7] * len(b.seqs), [0.0] * len(b.seqs)) + run_to_end(s)
    assert {e.rid for e in rest if e.finish == "length"} == {q.req.rid for q in b.seqs}


def test_continuations_leave_out_ending_sequences_and_drop_late_tokens():
    """Async scheduling: the continuation of a step is cut before its tokens are back. It must leave out the
    sequences that certainly end with that step (length, abort), feed the rest from the step's sampled rows, and
    a sequence that ends on a stop token meanwhile must lose its continuation's token, not gain it."""
    s = Scheduler(max_batch=4, microbatches=1, prefill_chunk=64, max_context=64)
    s.add(req(0, n=3, new=5, stop=(9,)))
    s.add(req(1, n=2, new=1))                     # ends with its first token
    s.add(req(2, n=4, new=5))
    mb, _ = s.next_microbatch()                   # the three prompts, each sampling its first token
    cont = s.continue_microbatch(mb)
    assert [q.req.rid for q in cont.seqs] == ["r0", "r2"] and cont.feed == [0, 2]
    assert cont.starts == [3, 4] and cont.ids == [] and cont.pos_3T[:, 0].tolist() == [3, 3, 3]
    assert not s.has_ready_work()
    ev = s.on_tokens(mb.mb, [5, 6, 7], [-0.1] * 3)
    assert [(e.rid, e.tokens, e.finish) for e in ev] == [("r0", [5], None), ("r1", [6], "length"),
                                                         ("r2", [7], None)]
    cont2 = s.continue_microbatch(cont)            # r0 stops on 9 in `cont`; its `cont2` token is dropped
    ev = s.on_tokens(cont.mb, [9, 8], [-0.2] * 2)
    assert [(e.rid, e.finish) for e in ev] == [("r0", "stop"), ("r2", None)]
    s.add(req(3, n=2, new=2))
    assert s.has_ready_work()
    ev = s.on_tokens(cont2.mb, [4, 4], [-0.3] * 2)
    assert [(e.rid, e.tokens) for e in ev] == [("r2", [4])] and s.dropped == 1
    assert s.active[[q for q in cont2.seqs if q.req.rid == "r2"][0].slot].fed == 6
    s.abort("r2")                                  # in no microbatch now: ends at once
    ev = run_to_end(s)
    assert [(e.rid, len(e.tokens), e.finish) for e in ev] == [("r3", 1, None), ("r3", 1, "length")]
    assert s.idle() and sorted(s.free_slots) == [0, 1, 2, 3]


def test_a_long_prompt_is_chunked_through_the_pipeline():
    """A prompt's next chunk is sent while its previous one is still in flight (each stage runs microbatches in
    order), so a long prompt fills the pipeline; other sequences take the budget first; the first token comes with
    the last chunk and decoding waits for it."""
    s = Scheduler(max_batch=2, microbatches=3, prefill_chunk=4, max_context=64)
    s.add(req(0, n=10, new=2))
    mbs = [s.next_microbatch()[0] for _ in range(3)]
    assert [(m.starts, m.counts, m.sample) for m in mbs] == [([0], [4], [False]), ([4], [4], [False]),
                                                             ([8], [2], [True])]
    assert mbs[1].ids == [5, 6, 7, 8] and mbs[2].pos_3T[0].tolist() == [8, 9] and s.pipelined == 2
    s.add(req(1, n=3, new=1))
    assert s.next_microbatch()[0] is None             # three in flight (M); r0's prompt is all sent
    assert s.on_tokens(mbs[0].mb, [], []) == [] and s.on_tokens(mbs[1].mb, [], []) == []
    nxt, _ = s.next_microbatch()                      # r1's prompt; r0 waits for its first token
    assert [q.req.rid for q in nxt.seqs] == ["r1"]
    ev = s.on_tokens(mbs[2].mb, [7], [-0.1])
    assert [(e.rid, e.tokens) for e in ev] == [("r0", [7])]
    dec, _ = s.next_microbatch()
    assert [q.req.rid for q in dec.seqs] == ["r0"] and dec.starts == [10] and dec.ids == [7]


def _prefill_pieces(s: Scheduler) -> list[list[tuple[str, int, int]]]:
    """Cut microbatches until none can go, then return all tokens in order; each microbatch as (rid, start, count)."""
    out, inflight = [], []
    while not s.idle():
        while True:
            mb, _ = s.next_microbatch()
            if mb is None:
                break
            out.append([(q.req.rid, st, c) for q, st, c in zip(mb.seqs, mb.starts, mb.counts)])
            inflight.append(mb)
        mb = inflight.pop(0)
        s.on_tokens(mb.mb, [5] * sum(mb.sample), [-0.1] * sum(mb.sample))
    return out


def test_a_lone_long_prompt_goes_down_the_pipeline_in_equal_pieces():
    """Two stages (pipeline_chunks 8), prefill_chunk 4096: an 8,192-token prompt alone would be two whole chunks,
    one stage always idle; it goes in 8 pieces of 1,024, each sent while the one before is in flight. The pieces are
    fixed when the first is cut: a request arriving later does not change them, and is itself not cut (it is not
    alone)."""
    s = Scheduler(max_batch=4, microbatches=2, prefill_chunk=4096, max_context=9000, pipeline_chunks=8)
    s.add(req(0, n=8192, new=1))
    a, _ = s.next_microbatch()
    b, _ = s.next_microbatch()
    assert (a.starts, a.counts, b.starts, b.counts) == ([0], [1024], [1024], [1024]) and s.pipelined == 1
    s.add(req(1, n=9000 - 1, new=1))               # r0 is active: whole chunks for r1
    s.on_tokens(a.mb, [], [])
    rest = _prefill_pieces(s)
    r0 = [c for mb in rest for rid, _, c in mb if rid == "r0"]
    r1 = [c for mb in rest for rid, _, c in mb if rid == "r1"]
    assert r0 == [1024] * 6 and r1 == [4096, 4096, 807] and s.cut == 1 and s.idle(), rest


def test_pipeline_pieces_are_equal_above_their_floor_and_only_for_a_prompt_alone():
    """A prompt alone of n tokens goes in k = min(pipeline_chunks, n // least) equal pieces, least = max(
    prefill_chunk / 8, a KV page); fewer than two and it stays whole; pieces are at most prefill_chunk (a prompt
    past pipeline_chunks chunks is already many). pipeline_chunks 1 cuts nothing. With another request admitted or
    waiting, whether prefilling or decoding, its microbatches keep the stages busy: whole chunks, which ride with
    the decode rows instead of one piece a round."""
    def counts(n, chunk=4096, pieces=8, M=2, others=0, decoding=False):
        s = Scheduler(max_batch=8, microbatches=M, prefill_chunk=chunk, max_context=70000, pipeline_chunks=pieces)
        if decoding:               # a request already decoding when the long prompt arrives
            s.add(req(9, n=3, new=50))
            mb, _ = s.next_microbatch()
            s.on_tokens(mb.mb, [5], [-0.1])
        s.add(req(0, n=n, new=1))
        for i in range(others):
            s.add(req(1 + i, n=n, new=1))
        return [c for mb in _prefill_pieces(s) for rid, _, c in mb if rid == "r0"], s.cut
    assert counts(700) == ([700], 0)                       # 700 // 512 = 1 piece: whole
    assert counts(1024) == ([512, 512], 1)
    assert counts(8193) == ([1025] * 7 + [1018], 1)
    assert counts(12288) == ([1536] * 8, 1)                # above M x prefill_chunk too
    assert counts(65536) == ([4096] * 16, 0)               # 8 pieces would pass prefill_chunk: whole chunks
    assert counts(2000, chunk=1024) == ([250] * 8, 1)      # least = 128
    assert counts(200, chunk=256) == ([67, 67, 66], 1)      # least = a KV page (64): 3 pieces
    assert counts(8192, pieces=1) == ([4096, 4096], 0)
    assert counts(8192, others=1) == ([4096, 4096], 0)
    assert counts(4096, decoding=True) == ([4096], 0)


def test_pipeline_chunks_auto_is_eight_per_stage_beyond_the_first():
    from placement.schema import SchedulerSpec
    from memra_pp.scheduler import auto_pipeline_chunks
    assert [auto_pipeline_chunks(n) for n in (1, 2, 3, 4)] == [1, 8, 16, 24]
    assert Scheduler.for_placement(SchedulerSpec(), 2, 2).pieces == 8
    assert Scheduler.for_placement(SchedulerSpec(), 1, 1).pieces == 1
    assert Scheduler.for_placement(SchedulerSpec(pipeline_chunks=3), 2, 2).pieces == 3
    # pieces need a second stage and a second microbatch to overlap: else none, whatever was asked
    assert Scheduler.for_placement(SchedulerSpec(pipeline_chunks=3), 1, 2).pieces == 1
    assert Scheduler.for_placement(SchedulerSpec(pipeline_chunks=3), 2, 1).pieces == 1


def test_an_aborted_prompt_sends_no_more_chunks_and_ends_when_its_chunks_are_back():
    s = Scheduler(max_batch=2, microbatches=3, prefill_chunk=4, max_context=64)
    s.add(req(0, n=12, new=3))
    a, _ = s.next_microbatch()
    b, _ = s.next_microbatch()                      # the second chunk follows the first
    assert s.abort("r0") == []                      # in flight: it ends when its chunks are back
    assert s.next_microbatch()[0] is None           # no third chunk
    assert s.on_tokens(a.mb, [], []) == []
    ev = s.on_tokens(b.mb, [], [])
    assert [(e.rid, e.finish) for e in ev] == [("r0", "abort")] and s.idle()
    assert s.abort("r0") == [] and s.aborted == 1   # gone: an abort that finds nothing counts nothing
    s.add(req(1, n=3, new=1))
    assert [(e.rid, e.finish) for e in s.abort("r1")] == [("r1", "abort")] and s.aborted == 2   # waiting


def test_a_follow_on_chunk_travels_alone():
    """Should a prompt's chunk fail on some stage, the chunk already sent after it fails there too (the stage's
    cached length disagrees): it must be alone in its microbatch, so no other request fails with it. Checked over
    a randomized run (long and short prompts, tokens back in order); the case must have occurred."""
    rng = random.Random(4)
    s = Scheduler(max_batch=4, microbatches=3, prefill_chunk=8, max_context=128)
    for i in range(8):
        s.add(req(i, n=rng.choice([2, 3, 30, 45, 60]), new=rng.randint(1, 8)))
    follow_ons, inflight = 0, []
    while not s.idle():
        while True:
            mb, _ = s.next_microbatch()
            if mb is None:
                break
            fo = [q.fed < st for q, st in zip(mb.seqs, mb.starts)]     # its previous chunk is not back
            follow_ons += any(fo)
            assert not any(fo) or len(mb.seqs) == 1, [(q.req.rid, st, q.fed) for q, st in zip(mb.seqs, mb.starts)]
            inflight.append(mb)
        mb = inflight.pop(0)
        s.on_tokens(mb.mb, [5] * sum(mb.sample), [-0.1] * sum(mb.sample))
    assert follow_ons >= 3 and s.pipelined == follow_ons


def test_kv_admission_waits_for_pages_and_refuses_what_can_never_fit():
    """With a KV budget (the least pages over the stages), a request is admitted only when its most pages fit beside
    the admitted ones': the next waits in order (slots free or not) and runs once pages come back; one that can
    never fit is refused at once with a message naming the budget; the pages reserved return to zero."""
    s = Scheduler(max_batch=4, microbatches=1, prefill_chunk=256, max_context=512)
    s.kv_pages = 4
    with pytest.raises(InputError, match=r"can reach 320 positions .* KV cache holds 256"):
        s.add(req(9, n=300, new=10))                 # 5 pages > 4: never
    s.add(req(0, n=100, new=28))                     # 2 pages
    s.add(req(1, n=10, new=100))                     # 2 pages
    s.add(req(2, n=60, new=4))                       # 1 page: must wait behind r1's admission (in order)
    mb, _ = s.next_microbatch()
    assert {q.req.rid for q in s.active.values()} == {"r0", "r1"} and s.kv_used == 4
    assert [r.rid for r in s.waiting] == ["r2"] and s.kv_waits > 0
    s.on_tokens(mb.mb, [7] * sum(mb.sample), [-0.5] * sum(mb.sample))
    assert not s.has_ready_work() or any(not q.in_flight for q in s.active.values())
    ev = run_to_end(s)
    assert sorted(e.rid for e in ev if e.finish == "length") == ["r0", "r1", "r2"]
    assert s.kv_used == 0 and s.idle()


def test_kv_admission_unlimited_without_a_budget():
    s = Scheduler(max_batch=2, microbatches=1, prefill_chunk=64, max_context=4096)
    s.add(req(0, n=4000, new=90))
    assert s.kv_pages is None and s.pages(s.waiting[0]) == 64      # 4,089 positions: 64 pages of 64
    assert [e.finish for e in run_to_end(s) if e.finish] == ["length"]


def test_prefill_chunk_decoding_holds_prompt_tokens_back_only_while_requests_decode():
    """scheduler.prefill_chunk_decoding: a microbatch takes at most that many prompt tokens while any admitted request
    decodes (its next token waits for them), and prefill_chunk while none does; every request still gets its tokens."""
    s = Scheduler(max_batch=8, microbatches=1, prefill_chunk=64, max_context=512, prefill_chunk_decoding=8)
    s.add(req(0, n=40, new=6))
    mb, _ = s.next_microbatch()
    assert mb.counts == [40] and s.held_back == 0, "nobody decodes yet: the whole prefill_chunk"
    s.on_tokens(mb.mb, [7], [-0.5])
    s.add(req(1, n=100, new=2))
    seen, ended = [], []
    while not ended:
        mb, _ = s.next_microbatch()
        seen.append([c for c, x in zip(mb.counts, mb.seqs) if x.req.rid == "r1"])
        ended = [e for e in s.on_tokens(mb.mb, [7] * sum(mb.sample), [-0.5] * sum(mb.sample)) if e.finish]
    assert seen == [[8]] * 5, "r0 decodes its 5 tokens left: r1's prompt goes in 8-token pieces"
    assert s.held_back == 5
    seen = [c for (c,) in seen]
    # r0 ended: r1's rest takes the whole prefill_chunk again
    mb, _ = s.next_microbatch()
    assert mb.counts == [100 - sum(seen)] and 100 - sum(seen) > 8
    ev = s.on_tokens(mb.mb, [7], [-0.5]) + run_to_end(s)
    assert [e.finish for e in ev if e.finish] == ["length"] and s.held_back == 5

    # off (None) and a budget as large as prefill_chunk change nothing
    for pd in (None, 64):
        s = Scheduler(max_batch=8, microbatches=1, prefill_chunk=64, max_context=512, prefill_chunk_decoding=pd)
        s.add(req(0, n=3, new=9))
        mb, _ = s.next_microbatch()
        s.on_tokens(mb.mb, [7], [-0.5])
        s.add(req(1, n=100, new=2))
        mb, _ = s.next_microbatch()
        assert sorted(mb.counts) == [1, 64] and s.held_back == 0


def test_prefill_chunk_decoding_counts_the_prompt_tokens_of_every_microbatch_in_flight():
    """A decoding request's next step runs after every microbatch ahead of it, so the budget holds for the prompt
    tokens in flight together, not per microbatch: with 3 microbatches and a budget of 8, one 8-token piece at a
    time, and a decode-only microbatch may still go beside it."""
    s = Scheduler(max_batch=8, microbatches=3, prefill_chunk=64, max_context=512, prefill_chunk_decoding=8)
    s.add(req(0, n=2, new=50))
    s.add(req(1, n=2, new=50))
    mb, _ = s.next_microbatch()
    s.on_tokens(mb.mb, [7] * sum(mb.sample), [-0.5] * sum(mb.sample))     # r0, r1 decode from here
    s.add(req(2, n=100, new=2))
    s.add(req(3, n=100, new=2))
    mbs = []
    while (mb := s.next_microbatch()[0]) is not None:
        mbs.append(mb)
    assert [m.prompt_tokens for m in mbs] == [8, 0], [(m.counts, m.prompt_tokens) for m in mbs]
    assert sum(len(m.seqs) for m in mbs) == 3, "both decoders and one 8-token piece"
    s.on_tokens(mbs[0].mb, [7] * sum(mbs[0].sample), [-0.5] * sum(mbs[0].sample))
    mb, _ = s.next_microbatch()
    assert mb.prompt_tokens == 8 and s.held_back >= 2
    ev = s.on_tokens(mbs[1].mb, [7] * sum(mbs[1].sample), [-0.5] * sum(mbs[1].sample))
    ev += s.on_tokens(mb.mb, [7] * sum(mb.sample), [-0.5] * sum(mb.sample)) + run_to_end(s)
    assert sorted(e.rid for e in ev if e.finish) == ["r0", "r1", "r2", "r3"]


def test_a_budget_equal_to_prefill_chunk_still_counts_the_microbatches_in_flight():
    """prefill_chunk_decoding = prefill_chunk (accepted) caps the prompt tokens in flight together at one chunk: it
    was taken for off, and 4 microbatches held 48 prompt tokens of a 16-token budget."""
    s = Scheduler(max_batch=8, microbatches=4, prefill_chunk=16, max_context=512, prefill_chunk_decoding=16)
    s.add(req(0, n=2, new=50))
    mb, _ = s.next_microbatch()
    s.on_tokens(mb.mb, [7], [-0.5])                 # r0 decodes from here
    for i in range(1, 4):
        s.add(req(i, n=100, new=2))
    mbs = []
    while (mb := s.next_microbatch()[0]) is not None:
        mbs.append(mb)
    assert sum(m.prompt_tokens for m in mbs) == 16, [(m.counts, m.prompt_tokens) for m in mbs]


def test_prefill_chunk_decoding_from_the_placement():
    """The YAML key reaches the intake's scheduler, round-trips through to_dict, and bad values are refused."""
    from memra_pp.errors import ConfigError
    from memra_pp.placement import load_placement
    base = {"name": "t", "model": {"path": "/x", "format": "dummy"}, "stages": [{"device": "cpu"}]}
    p = load_placement({**base, "scheduler": {"prefill_chunk": 256, "prefill_chunk_decoding": 32}})
    assert Scheduler.for_placement(p.scheduler, 2, 2).chunk_decoding == 32
    assert load_placement(p.to_dict()) == p
    off = load_placement(base)
    assert off.scheduler.prefill_chunk_decoding is None
    assert off.to_dict()["scheduler"]["prefill_chunk_decoding"] == "off"
    assert Scheduler.for_placement(off.scheduler, 1, 1).chunk_decoding is None
    import yaml                 # a bare `off` is YAML 1.1's false, as the README writes it
    assert load_placement({**base, "scheduler": yaml.safe_load("{prefill_chunk_decoding: off}")}) == off
    assert load_placement(yaml.safe_load(yaml.safe_dump(p.to_dict()))) == p
    assert load_placement(yaml.safe_load(yaml.safe_dump(off.to_dict()))) == off
    for bad in (0, 257, True, 8.0, "auto"):
        with pytest.raises(ConfigError, match=r"scheduler.prefill_chunk_decoding.*must be off or an integer from 1 to "
                                              r"scheduler.prefill_chunk \(256\)"):
            load_placement({**base, "scheduler": {"prefill_chunk": 256, "prefill_chunk_decoding": bad}})


def test_kv_admission_counts_the_positions_a_sequence_can_write():
    """A sequence writes its prompt and every generated token but the last (sampled, never fed): n + m - 1
    positions. A request that fills its pages exactly is admitted and runs (it used to be counted one position
    over, a page more at a page boundary, and refused); max_new_tokens 0 still holds its prompt."""
    s = Scheduler(max_batch=2, microbatches=1, prefill_chunk=256, max_context=512)
    s.kv_pages = 2
    r = req(0, n=100, new=29)                        # 128 positions: 2 pages of 64
    assert s.pages(r) == 2 and s.pages(req(1, n=100, new=30)) == 3 and s.pages(req(2, n=128, new=0)) == 2
    s.add(r)
    with pytest.raises(InputError, match=r"can reach 192 positions \(100 prompt \+ 30 new tokens, the last never fed"):
        s.add(req(1, n=100, new=30))
    ev = run_to_end(s)
    assert sum(len(e.tokens) for e in ev if e.rid == "r0") == 29 and ev[-1].finish == "length"
    assert s.kv_used == 0 and s.idle()


@pytest.mark.parametrize("limit,prompt,new,fix", [
    (4, 300, 10, r"raise scheduler\.kv_pages \(now 4\)"),           # the placement's own cap is what binds
    (None, 300, 10, r"shorten the prompt or split the model over more stages"),    # the prompt alone is too long
    (None, 200, 100, r"ask for at most 57 new tokens or split the model over more stages"),
    (8, 200, 100, r"ask for at most 57 new tokens"),                  # a cap the memory budget is under
])
def test_a_request_the_kv_cache_can_never_hold_is_refused_with_the_fix_that_works(limit, prompt, new, fix):
    """(Was a defect: it always said "lower max_new_tokens", also where the prompt alone overflowed or the budget
    was the placement's own scheduler.kv_pages.) 4 pages of 64 positions: 256 positions, 200 + 57 - 1 = 256."""
    s = Scheduler(max_batch=4, microbatches=1, prefill_chunk=256, max_context=512)
    s.kv_pages, s.kv_limit = 4, limit
    with pytest.raises(InputError, match=r"the KV cache holds 256 positions on the fullest stage: " + fix):
        s.add(req(0, n=prompt, new=new))
    s.add(req(1, n=200, new=57))        # what the message offers fits
