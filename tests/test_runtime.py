"""Through memra_pp.launch (real Ray, one process per stage, shared-memory slots), generations must equal
transformers' for 1, 2 and 3 CPU stages, one request at a time and with 16 requests in flight."""
import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor

import pytest

import memra_pp
from conftest_models import LaunchedOnce, grown, hf_reference, tiny_checkpoint
from gaps import worst_gap

PROMPTS = [(5, 17, 42), tuple(range(1, 131)), (7,), tuple(range(200, 265))]
NEW = 8


def config(path, n_stages, **sched):
    return {"name": f"t{n_stages}", "model": {"path": str(path), "dtype": "float32"},
            "stages": [{"device": "cpu", "num_cpus": 0.1}] * n_stages,
            "scheduler": {"max_batch": 16, "max_context": 512, "prefill_chunk": 48, **sched}}


@pytest.fixture(scope="module")
def dense(ray_cluster):
    """dense(n): the dense model's n-stage deployment of config(), launched at its first use and shared by the
    tests below that only generate with it (a stage process costs seconds of CPU to start); they read its counters
    as differences from their own start. Shut down when the module ends."""
    get = LaunchedOnce(lambda n_stages: config(tiny_checkpoint("dense", False)[1], n_stages))
    yield get
    get.shutdown()


def sixteen_at_once_match(c, kind="dense", tied=False):
    """16 concurrent agenerate calls over PROMPTS (chunked prefill interleaved with decode) equal transformers."""
    many = [PROMPTS[i % 4] for i in range(16)]

    async def go():
        return await asyncio.gather(*[c.agenerate(list(p), max_new_tokens=NEW) for p in many])
    for p, r in zip(many, asyncio.run(go()), strict=True):
        assert_same(kind, tied, p, r)


def assert_same(kind, tied, prompt, r):
    ht, hl = hf_reference(kind, tied, tuple(prompt), NEW)
    assert r.token_ids == ht and r.finish_reason == "length"
    assert worst_gap(zip(r.logprobs, hl, strict=True)) < 5e-4


@pytest.mark.parametrize("n_stages", [1, 2, 3])
@pytest.mark.parametrize("kind,tied", [("dense", False), ("moe", True)])
def test_launch_parity(dense, kind, tied, n_stages):
    """One request at a time, then 16 concurrent (chunked prefill interleaved with decode), must match."""
    _, path = tiny_checkpoint(kind, tied)
    with ThreadPoolExecutor(1) as pool:     # transformers' references (cached) computed while the stages start
        refs = pool.submit(lambda: [hf_reference(kind, tied, p, NEW) for p in PROMPTS])
        dep = dense(n_stages) if kind == "dense" else memra_pp.launch(config(path, n_stages))
    with (contextlib.nullcontext(dep) if kind == "dense" else dep):    # shared (dense launches at its first call)
        refs.result()
        assert [s.index for s in dep.plan.stages] == list(range(n_stages))
        before = dep.stats()["stages"]
        c = dep.client()
        for p in PROMPTS:
            assert_same(kind, tied, p, c.generate(list(p), max_new_tokens=NEW, logprobs=True))
        sixteen_at_once_match(c, kind, tied)
        st = grown(dep, before)
        assert all(s["microbatches"] > 0 for s in st), st
        if n_stages > 1:
            assert all(s["handoffs"] > 0 for s in st), "boundary slots must have carried the microbatches"
            # the 130-token prompt's chunks (48 each) followed one another down the pipeline
            assert st[0]["pipelined_chunks"] > 0, st[0]
        else:   # one stage schedules asynchronously: decode steps were cut before the previous tokens were read
            assert st[0]["async_steps"] > 0, st


def test_async_steps_drop_tokens_after_a_stop(dense):
    """One stage cuts step n+1 before step n's tokens are read, so a sequence that ends on a stop token at step n
    already has step n+1 on the device: that token must be dropped, and the slot it wrote into must serve the
    next request correctly. Requests with and without stops run together; the stop lands at different steps."""
    kind, tied = "dense", False
    dep = dense(1)
    before = dep.stats()["stages"]
    c = dep.client()
    refs = {p: hf_reference(kind, tied, p, NEW)[0] for p in PROMPTS}

    async def go():
        return await asyncio.gather(*[c.agenerate(list(p), max_new_tokens=NEW, stop_token_ids=[refs[p][k]],
                                                 ignore_eos=True)
                                      for k, p in zip((2, 4, 0, 6), PROMPTS)])
    for k, p, r in zip((2, 4, 0, 6), PROMPTS, asyncio.run(go()), strict=True):
        first = refs[p].index(refs[p][k])      # the stop id may occur earlier in the reference
        assert r.token_ids == refs[p][:first + 1] and r.finish_reason == "stop", (p, r)
    for p in PROMPTS:                          # the slots the dropped steps wrote into serve new requests
        assert_same(kind, tied, p, c.generate(list(p), max_new_tokens=NEW, logprobs=True))
    st = grown(dep, before)[0]
    assert st["async_steps"] > 0 and st["async_dropped"] > 0, st


@pytest.mark.parametrize("n_stages", [1, 2])
def test_a_request_joins_a_running_batch(dense, n_stages):
    """Continuous batching: a request submitted while another decodes joins the next step, never waits for the
    running one to finish (with one stage the tokens come back synchronously, so the intake must still drain its
    inbox between microbatches)."""
    import threading
    import time
    dep = dense(n_stages)
    c = dep.client()
    c.generate([5, 6], max_new_tokens=2)                         # warm
    times, started = [], threading.Event()

    def consume():
        for e in c.stream([5, 17, 42], max_new_tokens=400, ignore_eos=True):
            times.append((time.monotonic(), len(e.token_ids)))
            started.set()

    th = threading.Thread(target=consume)
    th.start()
    assert started.wait(60)
    short = c.generate([7, 8, 9], max_new_tokens=3, ignore_eos=True)
    t_short = time.monotonic()
    th.join(120)
    assert len(short.token_ids) == 3 and sum(k for _, k in times) == 400
    after = sum(k for t, k in times if t > t_short)
    assert after > 100, f"the short request waited for the long one: only {after} of its 400 tokens came after"


def test_header_mailbox_in_a_three_stage_deployment(ray_cluster):
    """With the boundary receivers polling the header mailbox (transport_poll_us; GPU boundaries do by default), a
    3-stage deployment must still equal transformers, and its receivers must have taken headers from the mailbox.
    Each CPU stage runs torch with its own `threads` (its setup sets them: a CPU stage's actor has no environment of
    its own, and this process's OMP_NUM_THREADS is 1)."""
    import ray
    _, path = tiny_checkpoint("dense", False)
    cfg = dict(config(path, 3), transport_poll_us=20000)   # long enough to cover a busy 2-core machine's waits
    cfg["stages"] = [cfg["stages"][0], dict(cfg["stages"][1], threads=2), cfg["stages"][2]]
    with memra_pp.launch(cfg) as dep:
        threads = ray.get([a.__ray_call__.remote(lambda self: __import__("torch").get_num_threads())
                           for a in dep.actors], timeout=30)
        assert threads == [1, 2, 1], threads
        c = dep.client()
        for p in PROMPTS:
            assert_same("dense", False, p, c.generate(list(p), max_new_tokens=NEW, logprobs=True))
        st = dep.stats()["stages"]
    assert all(s["mailbox_headers"] > 0 for s in st[1:]), [s["mailbox_headers"] for s in st]
    # and the senders wrote the socket only while a receiver slept there (between prompts), not every header
    sent = [(s["send_mailbox_headers"], s["send_socket_headers"]) for s in st[:2]]
    assert all(0 <= sock < mbox for mbox, sock in sent), sent


def test_kv_admission_and_a_prompt_budget_in_a_two_stage_deployment(ray_cluster):
    """With a KV budget of 4 pages (scheduler.kv_pages; auto on a GPU is what the memory holds), 16 concurrent
    requests must queue for pages instead of failing a microbatch, and all equal transformers; a request that can never
    fit must be refused alone with a typed error, and the deployment must go on. With scheduler.prefill_chunk_decoding
    8 (prefill_chunk 48) as well, the long prompts go in 8-token pieces while the short ones decode, and the counter
    shows the held steps ran (one deployment for both: a launch costs the suite seconds)."""
    _, path = tiny_checkpoint("dense", False)
    with memra_pp.launch(config(path, 2, kv_pages=4, prefill_chunk_decoding=8)) as dep:
        c = dep.client()
        sixteen_at_once_match(c)
        with pytest.raises(memra_pp.errors.InputError, match="KV cache holds 256 positions"):
            c.generate(list(range(1, 301)), max_new_tokens=NEW)
        assert_same("dense", False, PROMPTS[0], c.generate(list(PROMPTS[0]), max_new_tokens=NEW, logprobs=True))
        st = dep.stats()["stages"]
    assert st[0]["kv_pages"] == 4 and st[0]["kv_admission_waits"] > 0 and st[0]["kv_pages_reserved"] == 0, st[0]
    assert st[0]["prefill_held_back"] > 0, st[0]


def test_a_lone_prompt_goes_down_two_stages_in_pieces(ray_cluster):
    """scheduler.pipeline_chunks auto (8 on two stages), prefill_chunk 256: a 200-token prompt alone would be one
    chunk, the second stage idle while the first runs it; it goes in 3 equal pieces (none below a KV page: 200 //
    64), each on stage 1 after stage 0 finished it, sent before the one before it is back, stage 0 on the next
    piece while stage 1 runs one, and it equals transformers. With pipeline_chunks 1 it is one chunk."""
    import time
    from memra_pp.bench import timeline_since
    _, path = tiny_checkpoint("dense", False)
    prompt = tuple(range(1, 201))
    for pc, steps in (("auto", [67, 67, 66]), (1, [200])):
        with memra_pp.launch(config(path, 2, prefill_chunk=256, pipeline_chunks=pc)) as dep:
            c = dep.client()
            tm0 = time.monotonic()
            assert_same("dense", False, prompt, c.generate(list(prompt), max_new_tokens=NEW, logprobs=True))
            st = dep.stats(timeline=True)["stages"]
        pre = [[sp for sp in lane if sp[0] == "prefill"] for lane in timeline_since(st, tm0, 0, 0)["stages"]]
        assert [[sp[1] for sp in lane] for lane in pre] == [steps, steps], pre
        for a, b in zip(pre[0], pre[1]):                     # [kind, tokens, start, end]
            assert a[3] <= b[2], (a, b)
        if pc == "auto":                                     # the stages overlapped: k + 1 began before k ended
            assert any(pre[0][k + 1][2] < pre[1][k][3] for k in range(len(steps) - 1)), pre
        # the three pieces go at once (microbatches auto: 3 on two CPU stages)
        assert st[0]["prompts_cut"] == (pc == "auto")
        assert st[0]["pipelined_chunks"] >= 2 if pc == "auto" else st[0]["pipelined_chunks"] == 0, st[0]


@pytest.mark.parametrize("n_stages", [1, 2])
def test_sampled_logprobs_are_the_raw_distributions(dense, n_stages):
    """A sampled request's logprobs[i] must be log_softmax (temperature 1) of the model's logits at the position
    that produced token_ids[i], whatever the temperature and filters (DESIGN.md's contract; the reference is one
    transformers forward over prompt + generated tokens), and a seeded request must reproduce its draws."""
    import torch
    model, _ = tiny_checkpoint("dense", False)
    c = dense(n_stages).client()
    p = list(PROMPTS[0])
    kw = dict(max_new_tokens=NEW, temperature=0.7, top_k=40, seed=1234, logprobs=True)
    r, again = c.generate(p, **kw), c.generate(p, **kw)
    assert (again.token_ids, again.logprobs) == (r.token_ids, r.logprobs), "a seeded request must reproduce"
    assert r.token_ids != hf_reference("dense", False, tuple(p), NEW)[0], "sampled like greedy: the test is vacuous"
    ids = torch.tensor([p + r.token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0].float()
    at = torch.arange(len(p) - 1, len(p) - 1 + NEW)
    want = torch.log_softmax(logits[at], -1)[torch.arange(NEW), torch.tensor(r.token_ids)].tolist()
    assert len(r.token_ids) == len(r.logprobs) == NEW and r.finish_reason == "length"
    assert worst_gap(zip(r.logprobs, want, strict=True)) < 5e-4, (r.logprobs, want)


def test_logprobs_off_zero_tokens_and_no_tokenizer(dense):
    """logprobs=False must give None logprobs from generate, agenerate and every stream event; max_new_tokens=0
    must end at once with no tokens, finish_reason 'length' (the scheduler's documented budget; a model without
    eos generates exactly max_new_tokens); a model dir without tokenizer.json gives r.text None and refuses a text
    prompt with InputError. The deployment must serve a normal request after all of these."""
    c = dense(2).client()
    p = list(PROMPTS[0])
    ref = hf_reference("dense", False, tuple(p), NEW)[0]
    r = c.generate(p, max_new_tokens=NEW, logprobs=False)
    assert (r.token_ids, r.logprobs, r.text, r.prompt_tokens) == (ref, None, None, len(p)), r
    ar = asyncio.run(c.agenerate(p, max_new_tokens=NEW, logprobs=False))
    assert (ar.token_ids, ar.logprobs) == (ref, None), ar
    evs = list(c.stream(p, max_new_tokens=NEW, logprobs=False))
    assert [t for e in evs for t in e.token_ids] == ref and all(e.logprobs is None for e in evs), evs
    for r in (c.generate(p, max_new_tokens=0), asyncio.run(c.agenerate(p, max_new_tokens=0))):
        assert (r.token_ids, r.logprobs, r.finish_reason, r.prompt_tokens) == ([], [], "length", len(p)), r
    evs = list(c.stream(p, max_new_tokens=0))
    assert [t for e in evs for t in e.token_ids] == [] and evs[-1].finish_reason == "length", evs
    with pytest.raises(memra_pp.errors.InputError, match="a text prompt needs a tokenizer.json"):
        c.generate("hello", max_new_tokens=2)
    assert_same("dense", False, p, c.generate(p, max_new_tokens=NEW, logprobs=True))


def test_stream_text_pieces_with_a_tokenizer(ray_cluster):
    """With a tokenizer.json in the model dir, each stream event's text must be the new text its token ids complete:
    the pieces so far must equal the decode of the ids so far, short only of text held back while that decode ends
    in an incomplete UTF-8 character; the last event's flush must make the pieces' concatenation the decode of every
    generated id, which must also be generate's r.text for the same (greedy) ids (special tokens skipped in both,
    as vLLM). The embedded default's tiny checkpoint is the only model with a tokenizer here (no shared deployment
    has one): one stage of it."""
    from memra_pp.defaults import ensure_tiny
    from memra_pp.demo import PROMPTS as TEXTS
    from memra_pp.model.tokenizer import REPLACEMENT
    cfg = {"name": "tok", "model": {"path": str(ensure_tiny()), "dtype": "float32"},
           "stages": [{"device": "cpu", "num_cpus": 0.1}], "scheduler": {"max_batch": 4, "max_context": 256}}
    with memra_pp.launch(cfg) as dep:
        c, tok = dep.client(), dep.tokenizer
        assert tok is not None

        def one(text):
            """This text's checks; how many of its stream events held text back."""
            held = 0
            evs = list(c.stream(text, max_new_tokens=24))
            assert [e.finish_reason for e in evs[:-1]] == [None] * (len(evs) - 1) and evs[-1].finish_reason, evs
            ids, pieces = [], []
            for e in evs:
                assert isinstance(e.text, str), e
                ids += e.token_ids
                pieces.append(e.text)
                full, got = tok.decode(ids, skip_special_tokens=True), "".join(pieces)
                assert full.startswith(got) and (got == full or (full.endswith(REPLACEMENT) and e is not evs[-1])), \
                    (text, ids, pieces, full)
                held += got != full
            r = c.generate(text, max_new_tokens=24)
            assert ids and r.token_ids == ids, (text, ids, r.token_ids)
            assert "".join(pieces) == r.text == tok.decode(ids, skip_special_tokens=True), (text, pieces, r.text)
            # a (non-special) stop token ends the ids but not the text, as in vLLM: streamed and whole alike
            stop = next(i for i in ids[2:] if tok.decode([i]).strip() and ids.index(i) >= 2)
            k = ids.index(stop) + 1
            r = c.generate(text, max_new_tokens=24, stop_token_ids=[stop])
            evs = list(c.stream(text, max_new_tokens=24, stop_token_ids=[stop]))
            assert r.finish_reason == evs[-1].finish_reason == "stop" and r.token_ids == ids[:k], (r, ids, stop)
            assert "".join(e.text for e in evs) == r.text == tok.decode(ids[:k - 1], skip_special_tokens=True)
            assert r.text != tok.decode(ids[:k], skip_special_tokens=True), "the stop token shows no text"
            return held
        with ThreadPoolExecutor(3) as pool:     # the texts are independent requests: side by side (max_batch 4)
            held = sum(pool.map(one, TEXTS[:3]))
    # non-vacuity: the random tiny model emits lone UTF-8 bytes, so some event's text was held back (an empty piece)
    assert held > 0, "no stream event held text back: the partial-character path never ran"


def test_stats_has_the_documented_keys(dense):
    """dep.stats() must return {"stages": [...]} with one entry per stage, in order, holding at least the keys
    DESIGN.md's public API lists, with the plan's device and layers."""
    dep = dense(2)
    st = dep.stats()
    assert list(st) == ["stages"] and len(st["stages"]) == 2
    documented = {"index", "device", "layers", "busy", "microbatches", "handoffs", "handoff_p50_us", "handoff_p99_us",
                  "overlay_publications", "splices"}
    for s, ps in zip(st["stages"], dep.plan.stages, strict=True):
        assert documented <= set(s), sorted(documented - set(s))
        assert s["index"] == ps.index and str(s["device"]) == str(ps.device), (s, ps)
        assert list(s["layers"]) == [ps.layer_start, ps.layer_end], (s["layers"], ps)
        assert 0 <= s["busy"] <= 1 and s["handoff_p99_us"] >= s["handoff_p50_us"] >= 0, s
        assert s["gc_frozen"] > 10_000, "MEMRA_PP_GC_FREEZE (default on): the stage froze its heap at its start"


def test_the_ring_back_is_timed_in_a_pipeline(dense):
    """A pipeline's intake times the tokens' way back from the primary: its send to the intake's receipt (transit), to
    the loop taking them (queue), to the next launch (launch), p50 <= p99, each under a second here; the counters
    are the timed window's (stats(reset=True) empties them). Only the intake has them."""
    dep = dense(2)
    c = dep.client()
    dep.stats(reset=True)
    assert dep.stats()["stages"][0]["ring_transit_p50_us"] is None
    c.generate(list(PROMPTS[0]), max_new_tokens=NEW)
    st = dep.stats()["stages"]
    for k in ("transit", "queue", "launch"):
        p50, p99 = st[0][f"ring_{k}_p50_us"], st[0][f"ring_{k}_p99_us"]
        assert p50 is not None and 0 <= p50 <= p99 < 1e6, (k, st[0])
        assert f"ring_{k}_p50_us" not in st[1]
    from memra_pp.bench import ring_line
    assert ring_line(st[0]).startswith("ring back p50 / p99: transit ") and ring_line(st[1]) == ""
