"""Image prompts through memra_pp.launch must generate what transformers generates (pixel_values, grids,
mm_token_type_ids), for each vision.engine choice; publication happens exactly when tower and intake differ."""
import asyncio
import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

import memra_pp
from conftest_models import LaunchedOnce, grown, hf_reference, tiny_checkpoint
from memra_pp.errors import InputError, ResidencyError
from gaps import worst_gap

IMG, VS, VE = 300, 302, 303
NEW = 6


def image(seed, grid=(1, 4, 6)):
    t, h, w = grid
    pv = torch.randn(t * h * w, 3 * 2 * 4 * 4, generator=torch.Generator().manual_seed(seed))
    return memra_pp.ImageInput(pv, grid)


def prompt_for(imgs, expand=True):
    p = [5, 17]
    for ii in imgs:
        t, h, w = ii.grid_thw
        p += [VS] + [IMG] * (t * h * w // 4 if expand else 1) + [VE, 42]
    return p + [7]


_REFS: dict = {}


def cached(fn):
    """fn(model, p, imgs, *a) computed once per (model, prompt, images' grids and pixels, *a): several tests and
    parameters ask transformers for the same generation."""
    def get(model, p, imgs, *a):
        key = (fn.__name__, id(model), tuple(p), a,
               tuple((tuple(i.grid_thw), i.pixel_values.numpy().tobytes()) for i in imgs))
        if key not in _REFS:
            _REFS[key] = fn(model, p, imgs, *a)
        return _REFS[key]
    return get


@cached
def hf_image_greedy(model, p, imgs):
    ids = torch.tensor([p])
    with torch.no_grad():
        g = model.generate(ids, attention_mask=torch.ones_like(ids), pixel_values=torch.cat(
            [i.pixel_values for i in imgs]), image_grid_thw=torch.tensor([i.grid_thw for i in imgs]),
            mm_token_type_ids=(ids == IMG).long(), max_new_tokens=NEW, do_sample=False, output_logits=True,
            return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    toks = g.sequences[0, len(p):].tolist()
    return toks, [float(torch.log_softmax(l[0].float(), -1)[t]) for l, t in zip(g.logits, toks, strict=True)]


def cfg(path, n, engine="primary", publish="auto", chunk=8):
    return {"name": "v", "model": {"path": str(path)}, "stages": [{"device": "cpu", "num_cpus": 0.1}] * n,
            "vision": {"engine": engine}, "overlay_publish": publish,
            "scheduler": {"max_batch": 8, "max_context": 256, "prefill_chunk": chunk}}


@pytest.fixture(scope="module")
def shared(ray_cluster):
    """shared(n): cfg(path, n)'s deployment (tower on the primary), launched at its first use and shared by the tests
    below that only generate with it (a launch costs the suite seconds); they read its counters as differences
    (`grown`). Shut down when the module ends."""
    get = LaunchedOnce(lambda n: cfg(tiny_checkpoint("dense", False)[1], n))
    yield get
    get.shutdown()


@pytest.mark.parametrize("n,engine", [(1, "primary"), (2, "primary"), (2, "intake"), (3, "stage:1"),
                                      (3, "primary")])
def test_image_prompts_match_transformers(ray_cluster, shared, n, engine):
    """Image prompts (chunks cutting through image spans, batched with text-only requests) must match."""
    model, path = tiny_checkpoint("dense", False)
    imgs1, imgs2 = [image(1)], [image(2, (1, 2, 4)), image(3)]
    with (contextlib.nullcontext(shared(n)) if engine == "primary" and n < 3     # shared (launched at first use)
          else memra_pp.launch(cfg(path, n, engine))) as dep:
        before = dep.stats()["stages"]
        c = dep.client()

        async def go():
            return await asyncio.gather(
                c.agenerate(prompt_for(imgs1, expand=False), max_new_tokens=NEW, images=imgs1),
                c.agenerate(prompt_for(imgs2), max_new_tokens=NEW, images=imgs2),
                c.agenerate([5, 17, 42], max_new_tokens=NEW))
        r1, r2, r3 = asyncio.run(go())
        for r, imgs in ((r1, imgs1), (r2, imgs2)):
            ht, hl = hf_image_greedy(model, prompt_for(imgs), imgs)
            assert r.token_ids == ht
            assert worst_gap(zip(r.logprobs, hl, strict=True)) < 5e-4
        assert r3.token_ids == hf_reference("dense", False, (5, 17, 42), NEW)[0]
        # the prompt as the model read it: image 1's lone placeholder counts its 6 rows (as written out in full)
        assert [r.prompt_tokens for r in (r1, r2, r3)] == [len(prompt_for(imgs1)), len(prompt_for(imgs2)), 3]
        assert len(prompt_for(imgs1)) == len(prompt_for(imgs1, expand=False)) + 5
        st = grown(dep, before)[0]
        cross = dep.plan.tower_index != dep.plan.intake_index
        assert st["overlay_publications"] == (2 if cross else 0), "AUTO publishes exactly across contexts"
        # across actors the rows' bytes come through the intake's publication slots, not Ray's object store
        assert st["publications_via_slot"] == (2 if cross else 0)
        assert st["splices"] > 0
        # non-vacuity: image 1's span is prompt positions [3, 9) of 12, and its first chunk ends at 5..8 (a budget of
        # 8 tokens, of which the 3-token text request may take its share first), so its second begins inside the span
        assert st["mid_span_splices"] > 0, "no prefill chunk cut through an image span"


def test_force_publishes_and_never_refuses(ray_cluster):
    """FORCE must publish even within one context; NEVER across contexts must refuse that request with
    ResidencyError while the deployment keeps serving; a placeholder mismatch must say both numbers."""
    model, path = tiny_checkpoint("dense", False)
    imgs = [image(4)]
    with ThreadPoolExecutor(1) as pool:     # the NEVER deployment launches while the FORCE one runs (independent)
        never = pool.submit(memra_pp.launch, cfg(path, 2, "primary", "never"))
        try:
            with memra_pp.launch(cfg(path, 1, "intake", "force")) as dep:
                r = dep.client().generate(prompt_for(imgs), max_new_tokens=NEW, images=imgs)
                assert r.token_ids == hf_image_greedy(model, prompt_for(imgs), imgs)[0]
                assert dep.stats()["stages"][0]["overlay_publications"] == 1
        except BaseException:
            with contextlib.suppress(Exception):
                never.result().shutdown()
            raise
    with never.result() as dep:
        c = dep.client()
        with pytest.raises(ResidencyError, match="overlay_publish: never"):
            c.generate(prompt_for(imgs), max_new_tokens=NEW, images=imgs)
        with pytest.raises(InputError, match="Attempted to assign"):
            c.generate(prompt_for(imgs)[:-5] + [7], max_new_tokens=NEW, images=imgs)
        assert c.generate([5, 17, 42], max_new_tokens=NEW).token_ids == hf_reference(
            "dense", False, (5, 17, 42), NEW)[0]
        assert dep.stats()["stages"][0]["overlay_publications"] == 0


def test_the_towers_work_never_holds_the_heartbeat_or_a_requests_answer(ray_cluster, shared):
    """An image request's submit returns once it is checked, and its tower work runs on the intake's images thread;
    the actor's heartbeats, aborts and stats have threads of their own. A burst of encodes filling the call threads
    once kept the supervisor's heartbeat unanswered past its deadline, and the intake was restarted under its
    requests. Here 20 encodes are asked of the tower at once and the heartbeat asked after them is answered first;
    image requests from 8 threads at once (tower on another stage: each published) all get transformers' tokens."""
    import ray
    model, path = tiny_checkpoint("dense", False)
    dep = shared(1)
    a = dep.actors[0]
    big = image(9, (1, 32, 32))                       # 1,024 patches, 256 rows
    encs = [a.encode_images.remote([big.pixel_values], [big.grid_thw], [(3, 0, 256)]) for _ in range(20)]
    h, st = a.health.remote(), a.stats.remote()
    ready, _ = ray.wait([h, st] + encs, num_returns=2, timeout=120)
    assert ready == [h, st], "a heartbeat or stats waited behind the tower's encodes"
    ray.get(encs, timeout=120)
    dep = shared(2)
    before = dep.stats()["stages"]
    c = dep.client()
    imgs = [[image(20 + i, (1, 2, 4 if i % 2 else 6))] for i in range(8)]
    out = [None] * 8

    def one(i):
        out[i] = c.generate(prompt_for(imgs[i]), max_new_tokens=NEW, images=imgs[i], timeout=120)
    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    for i in range(8):
        ht, hl = hf_image_greedy(model, prompt_for(imgs[i]), imgs[i])
        assert out[i] is not None and out[i].token_ids == ht
        assert worst_gap(zip(out[i].logprobs, hl, strict=True)) < 5e-4
    st = grown(dep, before)[0]
    assert st["overlay_publications"] == 8 and st["publications_via_slot"] == 8
    assert dep.supervisor is None or dep.supervisor.generation == 0      # no stage was found lost


def test_a_dead_tower_is_named_not_the_intake(ray_cluster):
    """Pixels that overflow the tower are refused for their request alone. Then the tower on stage 1 dies: an image
    request fails with StageFailed naming stage 1, the tower, and carrying its index (a replaying client would wait
    for that stage's recovery). It was reported as the intake's own loss, "stage 0 failed", because the tower's
    error came back through the intake's submit (the supervisor, 30 s a heartbeat here, has not acted yet)."""
    import ray
    from memra_pp.errors import StageFailed
    _, path = tiny_checkpoint("dense", False)
    imgs = [image(5)]
    with memra_pp.launch({**cfg(path, 2), "timeouts": {"heartbeat_s": 30}}) as dep:
        c = dep.client()
        assert c.generate(prompt_for(imgs), max_new_tokens=1, images=imgs, timeout=60).token_ids
        # finite pixels that overflow the tower: this request is refused, not decoded from NaN rows (it was, with
        # NaN logprobs and finish "length")
        huge = [memra_pp.ImageInput(torch.full_like(imgs[0].pixel_values, 3e38), imgs[0].grid_thw)]
        with pytest.raises(InputError, match=r"the images' 6 embedding rows are not all finite \(torch.float32 "
                                             r"tower\): pixel values of magnitude up to 3e\+38 overflow it"):
            c.generate(prompt_for(huge), max_new_tokens=NEW, images=huge, timeout=60)
        ray.kill(dep.actors[1], no_restart=True)
        with pytest.raises(StageFailed) as e:
            c.generate(prompt_for(imgs), max_new_tokens=NEW, images=imgs, timeout=60)
        assert e.value.stage == 1 and str(e.value).startswith("stage 1 (vision tower): a stage actor died"), e.value


@cached
def hf_image_greedy_n(model, p, imgs, new):
    ids = torch.tensor([p])
    with torch.no_grad():
        g = model.generate(ids, attention_mask=torch.ones_like(ids), pixel_values=torch.cat(
            [i.pixel_values for i in imgs]), image_grid_thw=torch.tensor([i.grid_thw for i in imgs]),
            mm_token_type_ids=(ids == IMG).long(), max_new_tokens=new, do_sample=False, eos_token_id=None,
            pad_token_id=0)
    return g[0, len(p):].tolist()


@pytest.fixture(scope="module")
def replaying(ray_cluster):
    """replaying("replay"): the replay tests' deployment (recover: replay, a heartbeat every 0.5 s, 4-token prefill
    chunks), launched at the first one's use and taken over, recovered, by the next (its restarted stage is a fresh
    process; a launch costs the suite seconds); each reads the supervisor's log and the intake's counters from its
    own start. One a failed test left failing is shut down and launched again (LaunchedOnce)."""
    path = tiny_checkpoint("dense", False)[1]
    get = LaunchedOnce(lambda _: {**cfg(path, 2), "recover": "replay", "timeouts": {"heartbeat_s": 0.5},
                                  "scheduler": {"max_batch": 8, "max_context": 256, "prefill_chunk": 4}})
    yield get
    get.shutdown()


@pytest.mark.parametrize("stage", [1, 0])
def test_an_image_request_is_replayed_through_a_restart(replaying, stage):
    """recover: replay with an image request cut mid-decode, by the loss of the tower (stage 1, primary) or of the
    intake: the replay re-runs the tower and the request ends with transformers' tokens. This prompt's first
    generated token is the image placeholder itself (300): in the replayed prompt it is a generated token, plain
    text, not a second image's span (the replay was refused, "1 placeholder rows but 0 images", or spliced)."""
    from test_reliability import Stream, kill
    model, path = tiny_checkpoint("dense", False)
    imgs = [image(2)]
    p = [5, 17, VS] + [IMG] * 6 + [VE, 42, 14, 7]
    new = 160
    want = hf_image_greedy_n(model, p, imgs, new)
    assert want[0] == IMG, "the premise: the model's first token is the placeholder"
    dep = replaying("replay")
    n0, before = len(dep.supervisor.log), dep.stats()["stages"][0]["overlay_publications"]
    c = dep.client()
    s = Stream(c, p, new, images=imgs)
    s.wait_tokens(3)
    assert s.t_end is None, "the request must still be decoding when the stage dies"
    kill(dep, stage, "ray.kill")
    s.join(120)
    assert s.error is None, s.error
    assert len(dep.supervisor.log) == n0 + 1 and dep.supervisor.log[n0]["stage"] == stage
    assert s.tokens == want and s.finish == "length"
    st = dep.stats()["stages"]
    # the replay ran the tower again: a new intake counts the replay's publication alone, the old one both
    assert st[0]["overlay_publications"] == (1 if stage == 0 else before + 2), st[0]
    r = c.generate(p, max_new_tokens=NEW, images=imgs, timeout=60)
    assert r.token_ids == want[:NEW]
