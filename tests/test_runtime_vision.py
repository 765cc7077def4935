"""Image prompts through memra_pp.launch must generate what transformers generates (pixel_values, grids,
mm_token_type_ids), for each vision.engine choice; publication happens exactly when tower and intake differ."""
import asyncio

import pytest
import torch

import memra_pp
from conftest_models import hf_reference, tiny_checkpoint
from memra_pp.errors import InputError, ResidencyError

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


@pytest.mark.parametrize("n,engine", [(1, "primary"), (2, "primary"), (2, "intake"), (3, "stage:1"),
                                      (3, "primary")])
def test_image_prompts_match_transformers(ray_cluster, n, engine):
    """Image prompts (chunks cutting through image spans, batched with text-only requests) must match."""
    model, path = tiny_checkpoint("dense", False)
    imgs1, imgs2 = [image(1)], [image(2, (1, 2, 4)), image(3)]
    with memra_pp.launch(cfg(path, n, engine)) as dep:
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
            assert max(abs(a - b) for a, b in zip(r.logprobs, hl, strict=True)) < 5e-4
        assert r3.token_ids == hf_reference("dense", False, (5, 17, 42), NEW)[0]
        st = dep.stats()["stages"]
        cross = dep.plan.tower_index != dep.plan.intake_index
        assert st[0]["overlay_publications"] == (2 if cross else 0), "AUTO publishes exactly across contexts"
        # across actors the rows' bytes come through the intake's publication slots, not Ray's object store
        assert st[0]["publications_via_slot"] == (2 if cross else 0)
        assert st[0]["splices"] > 0
        # non-vacuity: image 1's span is prompt positions [3, 9) of 12, and its first chunk ends at 5..8 (a budget of
        # 8 tokens, of which the 3-token text request may take its share first), so its second begins inside the span
        assert st[0]["mid_span_splices"] > 0, "no prefill chunk cut through an image span"


def test_force_publishes_and_never_refuses(ray_cluster):
    """FORCE must publish even within one context; NEVER across contexts must refuse that request with
    ResidencyError while the deployment keeps serving; a placeholder mismatch must say both numbers."""
    model, path = tiny_checkpoint("dense", False)
    imgs = [image(4)]
    with memra_pp.launch(cfg(path, 1, "intake", "force")) as dep:
        r = dep.client().generate(prompt_for(imgs), max_new_tokens=NEW, images=imgs)
        assert r.token_ids == hf_image_greedy(model, prompt_for(imgs), imgs)[0]
        assert dep.stats()["stages"][0]["overlay_publications"] == 1
    with memra_pp.launch(cfg(path, 2, "primary", "never")) as dep:
        c = dep.client()
        with pytest.raises(ResidencyError, match="overlay_publish: never"):
            c.generate(prompt_for(imgs), max_new_tokens=NEW, images=imgs)
        with pytest.raises(InputError, match="Attempted to assign"):
            c.generate(prompt_for(imgs)[:-5] + [7], max_new_tokens=NEW, images=imgs)
        assert c.generate([5, 17, 42], max_new_tokens=NEW).token_ids == hf_reference(
            "dense", False, (5, 17, 42), NEW)[0]
        assert dep.stats()["stages"][0]["overlay_publications"] == 0
