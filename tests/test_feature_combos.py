"""Scheduler features in combination, through memra_pp.launch on CPU stages, against transformers: an image prompt
alone on three stages in pipeline pieces that cut through its image span, then a prefill_chunk_decoding budget of
one token while a request decodes."""
import asyncio
import threading

import torch
from conftest_models import hf_reference, tiny_checkpoint
from test_runtime_vision import IMG, VE, VS, image

import memra_pp
from gaps import worst_gap

TOL = 5e-4


def cfg(path, n, **sched):
    return {"name": "combo", "model": {"path": str(path), "dtype": "float32"},
            "stages": [{"device": "cpu", "num_cpus": 0.1}] * n,
            "scheduler": {"max_batch": 8, "max_context": 512, "prefill_chunk": 256, **sched}}


def image_prompt(imgs, pre=(5, 17), post=(42, 7)):
    p = list(pre)
    for ii in imgs:
        t, h, w = ii.grid_thw
        p += [VS] + [IMG] * (t * h * w // 4) + [VE]
    return p + list(post)


def hf_image(model, p, imgs, new):
    ids = torch.tensor([p])
    kw = {}
    if imgs:
        kw = {"pixel_values": torch.cat([i.pixel_values for i in imgs]),
                  "image_grid_thw": torch.tensor([i.grid_thw for i in imgs]), "mm_token_type_ids": (ids == IMG).long()}
    with torch.no_grad():
        g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                           output_logits=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=0,
                           **kw)
    toks = g.sequences[0, len(p):].tolist()
    return toks, [float(torch.log_softmax(l[0].float(), -1)[t]) for l, t in zip(g.logits, toks, strict=True)]


def same(r, ref, what=""):
    assert r.token_ids == ref[0], (what, r.token_ids, ref[0])
    d = worst_gap(zip(r.logprobs, ref[1], strict=True))
    assert d < TOL, (what, d)


class Streamer:
    """A request streamed on a thread; `first` is set at its first token."""

    def __init__(self, c, prompt, new, **kw):
        self.toks, self.lps, self.finish, self.error = [], [], None, None
        self.first = threading.Event()
        self.th = threading.Thread(target=self._run, args=(c, prompt, new, kw), daemon=True)
        self.th.start()

    def _run(self, c, prompt, new, kw):
        try:
            for e in c.stream(prompt, max_new_tokens=new, logprobs=True, **kw):
                self.toks += e.token_ids
                self.lps += e.logprobs
                self.first.set()
                if e.finish_reason:
                    self.finish = e.finish_reason
        except Exception as e:   # noqa: BLE001
            self.error = e
            self.first.set()

    def join(self, t=120):
        self.th.join(t)
        assert not self.th.is_alive() and self.error is None, self.error
        return self


def same_stream(s, ref, what=""):
    assert s.toks == ref[0], (what, s.toks, ref[0])
    d = worst_gap(zip(s.lps, ref[1], strict=True))
    assert d < TOL, (what, d)


def test_lone_image_prompt_in_pieces_on_three_stages_then_a_budget_of_one(ray_cluster):
    """A 300-token image prompt alone on 3 stages (pipeline_chunks auto = 16, prefill_chunk 256) goes in pieces of
    at least a KV page that cut through its 144-row image span; must equal transformers. Then, with a request
    decoding, a second image prompt goes one prompt token per step (prefill_chunk_decoding 1), and both equal
    transformers; a third text request arrives mid-decode with the budget of 1 too."""
    model, path = tiny_checkpoint("dense", False)
    big = [image(11, (1, 24, 24))]                       # 576 patches: 144 placeholder rows
    p1 = image_prompt(big, pre=tuple(range(1, 80)), post=tuple(range(100, 175)))
    assert len(p1) > 290
    new = 6
    with memra_pp.launch(cfg(path, 3, prefill_chunk_decoding=1)) as dep:
        c = dep.client()
        r = c.generate(p1, max_new_tokens=new, images=big, logprobs=True, timeout=120)
        same(r, hf_image(model, p1, big, new), "lone image in pieces")
        st = dep.stats()["stages"][0]
        assert st["prompts_cut"] == 1 and st["pipelined_chunks"] >= 2, st
        assert st["mid_span_splices"] > 0, st
        # a decoding request, then an image prompt and a text prompt under a budget of one token per step
        long_text = (5, 17, 42)
        dec = Streamer(c, list(long_text), 120)
        assert dec.first.wait(60)
        small = [image(12, (1, 4, 8))]
        p2 = image_prompt(small)
        h0 = dep.stats()["stages"][0]["prefill_held_back"]

        async def go():
            return await asyncio.gather(c.agenerate(p2, max_new_tokens=new, images=small, logprobs=True),
                                        c.agenerate(list(range(30, 70)), max_new_tokens=new, logprobs=True))
        r2, r3 = asyncio.run(go())
        dec.join()
        same(r2, hf_image(model, p2, small, new), "image under budget 1")
        same(r3, hf_reference("dense", False, tuple(range(30, 70)), new), "text under budget 1")
        same_stream(dec, hf_reference("dense", False, long_text, 120), "decoding request")
        assert dep.stats()["stages"][0]["prefill_held_back"] > h0
