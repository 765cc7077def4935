"""Randomized differential test of the stage slices (LocalPipeline over 1, 2 and 3 stages) against transformers'
greedy generation, float32, on perturbed tiny dense and MoE checkpoints, tied and untied: steps that mix sequences
at every phase (a prompt's first, middle and last chunk, a whole prompt, decode rows), chunks of random sizes
including 1, prompts of one token, more sequences than slots (a finished sequence's slot released and taken by the
next one, in the same step or later), sequences whose KV crosses pages (64 positions) and grows the pools, and image
prompts' M-RoPE positions (rope_delta). Fixed seeds; every sequence must get transformers' tokens, logprobs within
5e-4."""
import random

import pytest
import torch

from conftest_models import hf_reference, tiny_checkpoint
from memra_pp.model.batch import StepBatch, positions_3T
from memra_pp.model.local import LocalPipeline
from memra_pp.model.weights import SafetensorsSource
from gaps import worst_gap

SPLITS = {1: [(0, 8)], 2: [(0, 3), (3, 8)], 3: [(0, 2), (2, 5), (5, 8)]}
CHUNKS = [1, 1, 2, 3, 5, 8, 17, 63, 64, 65, 200]
TOL = 5e-4


class Seq:
    def __init__(self, prompt, new, arrive, embeds=None, pos_3L=None, delta=0):
        self.prompt, self.new, self.arrive = prompt, new, arrive
        self.embeds, self.pos_3L, self.delta = embeds, pos_3L, delta     # image prompts: their rows and positions
        self.sent, self.slot, self.toks, self.lps = 0, None, [], []

    @property
    def done(self):
        return len(self.toks) >= self.new


def drive(lp, seqs, max_seqs: int, rng: random.Random, embed=None) -> set:
    """Runs `seqs` through lp as a scheduler might, at random: each step admits arrived sequences into free slots
    (or into a finished sequence's slot, released in that very step), carries a random subset of the live ones (a
    prompt chunk of random size, or one decode token each) and releases some finished slots. Returns what the steps
    covered (phases met in one step, slot reuse, pages crossed, a chunk starting inside an image)."""
    free, finished, seen, step = list(range(max_seqs)), [], set(), 0
    rng.shuffle(free)
    while not all(s.done for s in seqs):
        release = [x for x in finished if rng.random() < 0.5]
        for s in seqs:
            if s.slot is None and not s.done and s.arrive <= step and rng.random() < 0.8:
                if free:
                    s.slot = free.pop(rng.randrange(len(free)))
                elif finished:       # a finished sequence's slot, released in this step
                    s.slot = finished.pop(rng.randrange(len(finished)))
                    if s.slot not in release:
                        release.append(s.slot)
                    seen.add("reuse")
        finished = [x for x in finished if x not in release]
        step += 1
        live = [s for s in seqs if s.slot is not None and not s.done and rng.random() < 0.9]
        rng.shuffle(live)
        if not live:
            finished += [x for x in release if x not in [s.slot for s in seqs]]
            continue
        free += [x for x in release if x not in [s.slot for s in seqs]]
        counts, starts, ids, parts, rows, sample, phases = [], [], [], [], [], [], set()
        for s in live:
            n = len(s.prompt)
            if s.sent < n:
                c, st = min(rng.choice(CHUNKS), n - s.sent), s.sent
                phases.add("whole" if c == n else "first" if st == 0 else "last" if st + c == n else "middle")
                if 0 < st and s.prompt[st - 1] == s.prompt[st] == IMG:
                    seen.add("image_cut")       # this chunk starts inside an image's rows
                ids += s.prompt[st:st + c]
                parts.append(s.pos_3L[:, st:st + c] if s.pos_3L is not None else range(st, st + c))
                rows.append(s.embeds[st:st + c] if s.embeds is not None else None)
            else:
                c, st = 1, n + len(s.toks) - 1
                phases.add("decode")
                ids.append(s.toks[-1])
                parts.append(range(st + s.delta, st + s.delta + 1))
                rows.append(None)
            if st + c > 64:
                seen.add("pages")
            counts.append(c)
            starts.append(st)
            sample.append(st + c >= n)
        if "decode" in phases and len(phases) > 1:
            seen.add("mixed")           # prompt chunks and decode rows in one step
        if len(phases) >= 3:
            seen.add("mixed3")
        seen |= {"phase:" + p for p in phases}
        seen |= {"reuse_same_step" for s in live if s.sent == 0 and s.slot in release}
        b = StepBatch([s.slot for s in live], starts, counts, positions_3T(parts), sample, release=release)
        ids_T = torch.tensor(ids)
        if embed is None:
            logits = lp.step(b, ids_T)
        else:       # image rows replace their placeholders' embeddings (transformers' masked_scatter)
            e = embed(ids_T)
            at = 0
            for r, c in zip(rows, counts):
                if r is not None:
                    e[at:at + c] = r
                at += c
            logits = lp.step(b, ids_T, e)
        r = 0
        for s, c, smp in zip(live, counts, sample):
            s.sent = min(len(s.prompt), s.sent + c)
            if smp:
                LocalPipeline._take(logits[r], s.toks, s.lps)
                r += 1
            if s.done:
                finished.append(s.slot)
                s.slot = None
    return seen


def random_seqs(rng: random.Random, n: int, lengths) -> list[Seq]:
    return [Seq([rng.randrange(1, 300) for _ in range(rng.choice(lengths))], rng.randint(1, 5), rng.randint(0, 3))
            for _ in range(n)]


def assert_matches(seqs, reference):
    for i, s in enumerate(seqs):
        ht, hl = reference(s)
        assert s.toks == ht, f"sequence {i} (prompt of {len(s.prompt)}): {s.toks} != transformers {ht}"
        d = worst_gap(zip(s.lps, hl, strict=True))
        assert d < TOL, f"sequence {i} (prompt of {len(s.prompt)}): logprobs differ by {d}"


# (kind, tied, stages, slots, sequences, merged, seed): every model, every split; fewer slots than sequences
CASES = [("dense", False, 1, 2, 6, False, 11), ("dense", True, 2, 3, 7, False, 12), ("moe", False, 3, 2, 5, False, 13),
         ("moe", True, 2, 4, 8, True, 14), ("dense", False, 3, 4, 9, True, 15), ("moe", False, 1, 3, 6, True, 16),
         ("dense", True, 3, 2, 6, True, 17)]
LENGTHS = [1, 1, 2, 3, 4, 7, 20, 63, 64, 65, 130]


def gpu_prefill_path(monkeypatch):
    """The GPU's prefill path (kernels/prefill.merged: merged projections, the Gated DeltaNet's prompt segments and
    the fresh prompts' attention in one variable-length call each, a mixed step's conv states read for every
    segment, fresh ones included) with its torch references, as on a GPU but on this CPU."""
    from memra_pp.kernels import prefill as pf
    monkeypatch.setattr(pf, "merged", lambda x, lora=None, count=False: pf.MERGED and lora is None)
    monkeypatch.setattr(pf, "MERGED", True)
    monkeypatch.setattr(pf, "VARLEN", True)


@pytest.mark.parametrize("kind,tied,n_stages,slots,n,merged,seed", CASES)
def test_random_mixed_schedules_match_transformers(kind, tied, n_stages, slots, n, merged, seed, monkeypatch):
    """Random steps mixing every phase of several sequences, slots reused after release, must give every sequence
    transformers' greedy tokens and logprobs (on the GPU's prefill path too, where a released slot's states are read
    by the next sequence's first chunk unless they were reset); the schedule must have met what it claims to test."""
    if merged:
        gpu_prefill_path(monkeypatch)
    rng = random.Random(seed)
    _, path = tiny_checkpoint(kind, tied)
    from memra_pp.kernels import prefill as pf
    lp = LocalPipeline(SafetensorsSource(path), SPLITS[n_stages], max_seqs=slots, max_context=512)
    seqs = random_seqs(rng, n, LENGTHS)
    paths = ("attn_varlen", "rows_whole", "rows_slice", "rows_gather", "conv_varlen")
    before = {k: pf.CALLS[k] for k in paths}
    seen = drive(lp, seqs, slots, rng)
    assert {"mixed", "reuse", "phase:decode", "phase:first"} <= seen, seen
    ran = {k: pf.CALLS[k] - before[k] for k in paths}
    # the merged path's row copies ran (its variable-length calls too, where the schedule gave fresh prompts of
    # several lengths in one step), and none of it ran where not asked
    assert (ran["rows_whole"] and ran["rows_slice"]) if merged else not any(ran.values()), (merged, ran)
    assert_matches(seqs, lambda s: hf_reference(kind, tied, tuple(s.prompt), s.new))


def test_many_sequences_long_prompts_grow_the_pools():
    """Sixteen sequences through three slots, the first three prompts of 200-300 tokens (4-5 pages each, more than
    the pools' first 4 a slot: they grow mid-run, replaced by larger copies), must match transformers."""
    rng = random.Random(23)
    _, path = tiny_checkpoint("dense", False)
    lp = LocalPipeline(SafetensorsSource(path), SPLITS[2], max_seqs=3, max_context=512)
    seqs = [Seq([rng.randrange(1, 300) for _ in range(n)], rng.randint(1, 5), 0) for n in (300, 260, 200)]
    seqs += random_seqs(rng, 13, [1, 2, 5, 64, 129])
    seen = drive(lp, seqs, 3, rng)
    assert {"pages", "reuse", "reuse_same_step", "mixed"} <= seen and all(c.grown for c in lp.caches if c.k), seen
    assert_matches(seqs, lambda s: hf_reference("dense", False, tuple(s.prompt), s.new))


def test_decode_graph_static_step_in_random_schedules():
    """The decode graphs' static step (captured on a GPU; run uncaptured here) in random schedules whose decode-only
    steps it takes, beside eager mixed steps, must match transformers for the MoE model over three stages."""
    rng = random.Random(31)
    _, path = tiny_checkpoint("moe", True)
    lp = LocalPipeline(SafetensorsSource(path), SPLITS[3], max_seqs=3, max_context=512)
    for s, c in zip(lp.stages, lp.caches):
        s.set_decode_graphs(True, c, capture=False)
    seqs = random_seqs(rng, 6, LENGTHS)
    drive(lp, seqs, 3, rng)
    assert all(s.graphs.replays > 0 for s in lp.stages)
    assert_matches(seqs, lambda s: hf_reference("moe", True, tuple(s.prompt), s.new))


IMG, VID = 300, 301


@pytest.mark.parametrize("kind,n_stages", [("dense", 2), ("moe", 3)])
def test_image_prompts_mrope_positions(kind, n_stages):
    """Image prompts (M-RoPE positions over their grids, decode at cache length + rope_delta) prefilled in random
    chunks that cut through their images, beside a text prompt and decode rows, must match transformers' generate
    with the pixels (the tower's rows taken from transformers, so only the text model's positions are compared)."""
    from memra_pp.model.mrope import rope_positions
    m, path = tiny_checkpoint(kind, False)
    rng = random.Random(41)
    seqs = []
    for grids in ([(1, 4, 6)], [(1, 8, 8), (1, 2, 4)], []):
        ids = [rng.randrange(1, 290) for _ in range(2)]
        for t, h, w in grids:
            ids += [302] + [IMG] * (t * h * w // 4) + [303] + [rng.randrange(1, 290) for _ in range(3)]
        pix = torch.randn(sum(t * h * w for t, h, w in grids), 96, generator=torch.Generator().manual_seed(len(ids)))
        with torch.no_grad():
            e = m.model.get_input_embeddings()(torch.tensor(ids))
            if grids:
                e[torch.tensor(ids) == IMG] = torch.cat(m.model.get_image_features(pix, torch.tensor(grids))
                                                        .pooler_output)
        pos, delta = rope_positions(ids, grids, IMG, VID, 2)
        s = Seq(ids, 4, len(seqs), e, pos, delta)
        s.grids, s.pix = grids, pix
        seqs.append(s)
    assert seqs[1].delta < 0                                      # the positions are not the text ones
    lp = LocalPipeline(SafetensorsSource(path), SPLITS[n_stages], max_seqs=3, max_context=512)
    with torch.no_grad():
        seen = drive(lp, seqs, 3, rng, embed=lambda ids: m.model.get_input_embeddings()(ids))
    assert {"image_cut", "mixed"} <= seen, seen       # a chunk began inside an image, beside decode rows

    def reference(s):
        x = torch.tensor([s.prompt])
        kw = dict(pixel_values=s.pix, image_grid_thw=torch.tensor(s.grids)) if s.grids else {}
        with torch.no_grad():
            g = m.generate(x, attention_mask=torch.ones_like(x), mm_token_type_ids=(x == IMG).int(), **kw,
                           max_new_tokens=s.new, do_sample=False, output_logits=True, return_dict_in_generate=True,
                           eos_token_id=None, pad_token_id=0)
        toks = g.sequences[0, len(s.prompt):].tolist()
        return toks, [float(torch.log_softmax(lg[0].float(), -1)[t]) for lg, t in zip(g.logits, toks)]
    assert_matches(seqs, reference)
