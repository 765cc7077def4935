"""PEFT LoRA + trainable-token adapters: loading, refusals, and mixed-adapter batches through 1-3 stage slices
matching PEFT run alone (float32, CPU)."""
import copy
import functools
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest_models import hf_reference, record_pieces, tiny_checkpoint
import threads
from memra_pp.adapters import load_peft_adapter, token_overlay_set
from memra_pp.engine import Engine
from memra_pp.errors import ConfigError, InputError
from memra_pp.model.batch import StepBatch
from memra_pp.model.local import LocalPipeline
from memra_pp.model.lora import LoraPool
from memra_pp.model.weights import SafetensorsSource
from tiny_hf import hf_greedy
from gaps import worst_gap

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",
       "gate_proj", "up_proj", "down_proj"]
SPLITS = {1: [(0, 8)], 2: [(0, 3), (3, 8)], 3: [(0, 2), (2, 5), (5, 8)]}
PROMPTS = [(5, 17, 42, 7, 23), tuple(range(1, 40)), (99, 60), (60, 61, 62, 11, 7)]
SLOTS = [0, 2, -1, 2]          # adapter A in slot 0, adapter B in slot 2, one request without adapter
NEW, MAX_LORAS, MAX_RANK = 6, 3, 8
_PEFT_KEY = "base_model.model.model.language_model."


def _adapter(kind, tied, which):
    """(peft model, saved dir) for adapter 'A' (r=8, all projections, embed + untied lm_head rows) or 'B' (r=4,
    rslora, a subset, embed rows only); LoRA B and token rows randomised (PEFT inits B to zero)."""
    from peft import LoraConfig, get_peft_model
    base, path = tiny_checkpoint(kind, tied)
    tti = {"embed_tokens": [5, 17, 42, 99]} if which == "A" else {"embed_tokens": [7, 23, 60]}
    if which == "A" and not tied:
        tti["lm_head"] = [11, 42, 250]
    cfg = LoraConfig(r=8 if which == "A" else 4, lora_alpha=16 if which == "A" else 8, use_rslora=which == "B",
                     target_modules=ALL if which == "A" else ["q_proj", "v_proj", "in_proj_qkv", "out_proj",
                                                               "down_proj"], trainable_token_indices=tti)
    return perturbed_and_saved(get_peft_model(copy.deepcopy(base), cfg), ord(which) + 10 * tied,
                               path.parent / f"adapter-{kind}-{tied}-{which}")


def perturbed_and_saved(pm, seed: int, out):
    """(peft model, saved dir): its LoRA B and token rows randomised (PEFT inits B to zero and the rows to the
    base's), saved to `out`."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif "trainable_tokens_delta" in n:
                p.copy_(torch.randn(p.shape, generator=g) * (3.0 if "lm_head" in n else 1.0))
    pm.save_pretrained(out)
    return pm.eval(), out


adapter = functools.lru_cache(maxsize=None)(_adapter)


@functools.lru_cache(maxsize=None)
def peft_reference(kind, tied, which, prompt):
    return hf_greedy(adapter(kind, tied, which)[0], list(prompt), NEW)


def pipeline(kind, tied, splits, slots=((0, "A"), (2, "B"))):
    """A LocalPipeline with a LoraPool per stage (each holding its own layers) and token overlays loaded."""
    _, path = tiny_checkpoint(kind, tied)
    src = SafetensorsSource(path)
    lp = LocalPipeline(src, splits)
    weights = {s: load_peft_adapter(adapter(kind, tied, w)[1], src.config, MAX_RANK) for s, w in slots}
    for j, st in enumerate(lp.stages):
        pool = LoraPool(src.config, range(st.start, st.end), MAX_LORAS, MAX_RANK)
        for s, aw in weights.items():
            pool.load(s, aw.for_layers(st.start, st.end))
        lp.loras[j] = pool
        lp.token_overlays[j] = token_overlay_set(Engine("cpu"), weights, MAX_LORAS, src.config.tied)
    return lp


def check_mixed(kind, tied, n_stages, chunk=None):
    lp = pipeline(kind, tied, SPLITS[n_stages])
    pieces = record_pieces(lp)
    toks, lps = lp.greedy([list(p) for p in PROMPTS], NEW, chunk=chunk, adapter_slots=SLOTS)
    pieces(PROMPTS, chunk)
    changed = 0
    for p, s, t, l in zip(PROMPTS, SLOTS, toks, lps, strict=True):
        ht, hl = peft_reference(kind, tied, "A" if s == 0 else "B", p) if s >= 0 else hf_reference(kind, tied, p, NEW)
        assert t == ht, f"slot {s}, prompt of {len(p)} tokens: {t} != reference {ht}"
        assert worst_gap(zip(l, hl, strict=True)) < 5e-4
        changed += s >= 0 and t != hf_reference(kind, tied, p, NEW)[0]
    assert changed >= 2, "the adapters must change some greedy tokens, or the test is vacuous"


@pytest.mark.parametrize("n_stages", [1, 2, 3])
@pytest.mark.parametrize("tied", [False, True])
def test_mixed_adapter_batch_matches_peft(tied, n_stages):
    """A batch mixing adapter A, adapter B and no adapter must give each request PEFT's (or the base model's)
    greedy tokens and logprobs, through 1, 2 and 3 stage slices."""
    check_mixed("dense", tied, n_stages)


@pytest.mark.parametrize("chunk", [7, 4])
def test_mixed_adapter_batch_chunked_prefill(chunk):
    """Chunked prefill with adapters (state carried across chunks) must match PEFT too; in chunks of 4 a prompt's
    one-token last chunk beside other prompts' chunks takes the one-token rows' decode kernels (counted)."""
    from memra_pp.model import linear_attention as la
    before = la.CALLS["single_rows"]
    check_mixed("dense", False, 2, chunk=chunk)
    assert la.CALLS["single_rows"] > before or chunk == 7


def test_moe_shared_expert_lora_matches_peft():
    """On the MoE model, LoRA on the shared expert's gate/up/down (what PEFT's *_proj targets hit) must match."""
    check_mixed("moe", False, 2)


def _batch(prompts, slots, lens=None):
    counts = [1] * len(prompts) if lens else [len(p) for p in prompts]
    starts = lens or [0] * len(prompts)
    ids = [p[-1] for p in prompts] if lens else [t for p in prompts for t in p]
    return StepBatch(list(range(len(prompts))), starts, counts, StepBatch.text_positions(starts, counts),
                     [True] * len(prompts), slots), torch.tensor(ids)


@pytest.mark.parametrize("tied", [False, True])
def test_no_adapter_batch_is_byte_identical(tied):
    """With pools and overlays loaded but no active slot (None or all -1), prefill and decode logits must be
    bit-identical to a pipeline without any pool."""
    _, path = tiny_checkpoint("dense", tied)
    plain = LocalPipeline(SafetensorsSource(path), SPLITS[2])
    for slots in (None, [-1] * len(PROMPTS)):
        lp = pipeline("dense", tied, SPLITS[2])
        plain.caches = [s.new_cache(8, 1024) for s in plain.stages]
        for step in (0, 1):
            lens = [len(p) for p in PROMPTS] if step else None
            b, ids = _batch(PROMPTS, slots, lens)
            assert torch.equal(lp.step(b, ids), plain.step(b, ids))


def test_an_adapter_overflowing_in_its_products_leaves_other_requests_untouched():
    """An adapter whose lora_A and lora_B x scale are finite (the load's check passes) but whose x A overflows: a
    step computes every slot's x A for every row and keeps each row's own slot's columns. Multiplied by a 0/1
    mask, another slot's inf became 0 * inf = NaN in the rows of every other request of the batch (with no
    adapter, or another one), silently. Selected instead, those rows must be bit for bit what they are with a
    normal adapter in that slot, in prefill and decode; the adapter's own row is not finite (the path ran)."""
    import dataclasses
    cfg = SafetensorsSource(tiny_checkpoint("dense", False)[1]).config
    aw = load_peft_adapter(adapter("dense", False, "B")[1], cfg, MAX_RANK)
    huge = dataclasses.replace(aw, lora={m: dataclasses.replace(lw, a_RI=torch.full_like(lw.a_RI, 3e38),
                                                                b_OR=torch.full_like(lw.b_OR, 1e-30))
                                         for m, lw in aw.lora.items()})
    lp, ref = pipeline("dense", False, SPLITS[2]), pipeline("dense", False, SPLITS[2])
    for st, pool in zip(lp.stages, lp.loras):
        pool.load(2, huge.for_layers(st.start, st.end))
    prompts = PROMPTS[:3]
    for step in (0, 1):
        lens = [len(p) for p in prompts] if step else None
        b, ids = _batch(prompts, [2, -1, 0], lens)
        got, want = lp.step(b, ids), ref.step(b, ids)
        assert not bool(torch.isfinite(got[0]).all()), "the huge adapter's own row must overflow (else vacuous)"
        assert bool(torch.isfinite(got[1:]).all()) and torch.equal(got[1:], want[1:])


def test_lm_head_rows_are_not_vacuous():
    """Untied adapter A's lm_head rows must change the logits of their ids, and only those, on the primary."""
    lp = pipeline("dense", False, SPLITS[2])
    b, ids = _batch(PROMPTS[:1], [0])
    with_rows = lp.step(b, ids)
    tos, lp.token_overlays[-1] = lp.token_overlays[-1], None
    lp.caches = [s.new_cache(8, 1024) for s in lp.stages]
    without = lp.step(b, ids)
    diff = (with_rows != without)[0].nonzero().squeeze(1).tolist()
    assert diff == sorted(tos.lm_ids_R.tolist())


def test_for_layers_keeps_own_layers():
    """for_layers must keep exactly the LoRA modules of [start, end) and every token row."""
    aw = load_peft_adapter(adapter("dense", False, "A")[1], SafetensorsSource(tiny_checkpoint()[1]).config, 8)
    part = aw.for_layers(2, 5)
    assert {int(m.split(".")[1]) for m in part.lora} == {2, 3, 4}
    assert len(part.lora) == 8 + 7 + 8 and part.embed_ids is aw.embed_ids and part.lm_head_ids is aw.lm_head_ids
    assert aw.rank == 8 and abs(aw.lora["layers.3.self_attn.q_proj"].scale - 2.0) < 1e-9
    bw = load_peft_adapter(adapter("dense", False, "B")[1], SafetensorsSource(tiny_checkpoint()[1]).config, 8)
    assert abs(bw.lora["layers.3.self_attn.q_proj"].scale - 8 / 2) < 1e-9   # rslora: alpha / sqrt(r)


def test_an_adapters_digest_names_what_was_read(tmp_path):
    """content_digest: the same files give the same digest (another copy, another stage's read), every stage's part
    (for_layers) keeps it, and a changed tensor or config value gives another one."""
    import json
    from safetensors.torch import load_file, save_file
    cfg = SafetensorsSource(tiny_checkpoint()[1]).config
    src = adapter("dense", False, "A")[1]
    aw = load_peft_adapter(src, cfg, 8)
    copy_ = tmp_path / "copy"
    shutil.copytree(src, copy_)
    assert len(aw.digest) == 64 and load_peft_adapter(copy_, cfg, 8).digest == aw.digest
    assert aw.for_layers(0, 3).digest == aw.digest
    t = load_file(str(copy_ / "adapter_model.safetensors"))
    k = next(k for k in sorted(t) if "lora_B" in k)
    t[k] = t[k].clone()
    t[k].view(-1)[0] += 1e-3
    save_file(t, str(copy_ / "adapter_model.safetensors"))
    changed = load_peft_adapter(copy_, cfg, 8).digest
    assert changed != aw.digest
    c = json.loads((copy_ / "adapter_config.json").read_text())
    c["lora_alpha"] = c["lora_alpha"] * 2
    (copy_ / "adapter_config.json").write_text(json.dumps(c))
    assert load_peft_adapter(copy_, cfg, 8).digest not in (aw.digest, changed)


def _edit(tmp_path, cfg=None, add=None, drop=None, rm=None, raw_cfg=None):
    d = tmp_path / "edited"
    shutil.copytree(adapter("dense", False, "A")[1], d)
    if raw_cfg is not None:
        (d / "adapter_config.json").write_text(raw_cfg)
    if cfg:
        c = json.loads((d / "adapter_config.json").read_text())
        c.update(cfg)
        (d / "adapter_config.json").write_text(json.dumps(c))
    if add or drop:
        t = load_file(str(d / "adapter_model.safetensors"))
        t = {k: v for k, v in t.items() if not (drop and drop in k)}
        save_file({**t, **(add or {})}, str(d / "adapter_model.safetensors"))
    if rm:
        (d / rm).unlink()
    return d


REFUSALS = {
    "rank above max_rank": (dict(), 4, r"rank 8 above adapters.max_rank=4"),
    "token id beyond vocab": (dict(cfg={"trainable_token_indices": {"embed_tokens": [5, 17, 42, 400],
                                                                    "lm_head": [11, 42, 250]}}),
                              8, r"trainable token ids \[400\] of embed_tokens are outside .*\[0, 320\)"),
    "vocab size mismatch": (dict(add={_PEFT_KEY + "embed_tokens.weight": torch.zeros(330, 64)}), 8,
                            r"330 rows but the model's vocabulary is 320.*vocab size mismatch"),
    "lora on lm_head": (dict(add={"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)}), 8,
                        r"unknown adapter tensor 'base_model.model.lm_head.lora_A.weight'"),
    "router target": (dict(add={_PEFT_KEY + "layers.0.mlp.gate.lora_A.weight": torch.zeros(8, 64)}), 8,
                      r"unknown LoRA target .*layers.0.mlp.gate.lora_A.weight"),
    "mixer of the wrong kind": (dict(add={_PEFT_KEY + "layers.3.linear_attn.in_proj_z.lora_A.weight":
                                          torch.zeros(8, 64)}), 8, r"unknown LoRA target .*layer 3 .*q_proj"),
    "missing lora_B": (dict(drop="layers.0.mlp.up_proj.lora_B"), 8, r"layers.0.mlp.up_proj has lora_A but no lora_B"),
    "missing config": (dict(rm="adapter_config.json"), 8, r"adapter_config.json is missing"),
    "missing weights": (dict(rm="adapter_model.safetensors"), 8, r"adapter_model.safetensors is missing"),
    "dora": (dict(cfg={"use_dora": True}), 8, r"use_dora=True: DoRA"),
    "moe experts": (dict(cfg={"target_parameters": ["mlp.experts.gate_up_proj"]}), 8, r"MoE routed experts"),
    "not lora": (dict(cfg={"peft_type": "IA3"}), 8, r"peft_type 'IA3' is not supported"),
    "trained biases": (dict(cfg={"bias": "lora_only"}), 8,
                       r"bias='lora_only': trained biases are not supported \(bias must be 'none'\)"),
    "lora_A of the wrong width": (dict(add={_PEFT_KEY + "layers.0.mlp.up_proj.lora_A.weight": torch.zeros(8, 63)}), 8,
                                  r"layers.0.mlp.up_proj has lora_A \(8, 63\), lora_B \(128, 8\); the model needs "
                                  r"\(r, 64\) and \(128, r\)"),
    # one adapter's NaN reached every other adapter's requests in a batch (a step computes every slot, then masks)
    "NaN in lora_B": (dict(add={_PEFT_KEY + "layers.0.mlp.up_proj.lora_B.weight": torch.full((128, 8), float("nan"))}),
                      8, r"adapter_model.safetensors' '.*layers.0.mlp.up_proj.lora_B.weight' holds NaN or inf"),
    "inf token rows": (dict(add={_PEFT_KEY + "embed_tokens.token_adapter.trainable_tokens_delta":
                                 torch.full((4, 64), float("inf"))}), 8, r"trainable_tokens_delta' holds NaN or inf"),
    "NaN lora_alpha": (dict(cfg={"lora_alpha": float("nan")}), 8,
                       r"lora_alpha must be a positive finite number, got nan"),
    "rank 0": (dict(add={_PEFT_KEY + "layers.0.mlp.up_proj.lora_A.weight": torch.zeros(0, 64),
                         _PEFT_KEY + "layers.0.mlp.up_proj.lora_B.weight": torch.zeros(128, 0)}), 8,
               r"layers.0.mlp.up_proj has lora_A \(0, 64\), lora_B \(128, 0\); the model needs \(r, 64\) and "
               r"\(128, r\), r >= 1"),
    "0-d lora_A": (dict(add={_PEFT_KEY + "layers.0.mlp.up_proj.lora_A.weight": torch.tensor(1.0)}), 8,
                   r"layers.0.mlp.up_proj has lora_A \(\), lora_B \(128, 8\)"),
    "config a list": (dict(raw_cfg="[1, 2]"), 8, r"adapter_config.json: must hold a JSON object .*got list"),
    "config null": (dict(raw_cfg="null"), 8, r"adapter_config.json: must hold a JSON object .*got NoneType"),
    "token rows of the wrong width": (dict(add={_PEFT_KEY + "embed_tokens.token_adapter.trainable_tokens_delta":
                                                torch.zeros(4, 63)}), 8,
                                      r"embed_tokens token rows have shape \(4, 63\), the model needs \(K, 64\)"),
}


@pytest.mark.parametrize("name", REFUSALS)
def test_loader_refusals(tmp_path, name):
    """Every malformed or unsupported adapter must be refused with a ConfigError naming the problem."""
    edits, max_rank, msg = REFUSALS[name]
    cfg = SafetensorsSource(tiny_checkpoint()[1]).config
    with pytest.raises(ConfigError, match=msg):
        load_peft_adapter(_edit(tmp_path, **edits), cfg, max_rank)


def test_loader_refusals_paths_and_tying(tmp_path):
    """A missing directory and untied lm_head rows on a tied model must be refused with their messages."""
    cfg = SafetensorsSource(tiny_checkpoint()[1]).config
    with pytest.raises(ConfigError, match=r"is not a directory"):
        load_peft_adapter(tmp_path / "nope", cfg, 8)
    tied = SafetensorsSource(tiny_checkpoint("dense", True)[1]).config
    with pytest.raises(ConfigError, match=r"lm_head token rows on a tied model"):
        load_peft_adapter(adapter("dense", False, "A")[1], tied, 8)


def test_pool_refusals():
    """The pool must refuse foreign layers, bad slots, and a batch naming an empty slot, each with its message."""
    cfg = SafetensorsSource(tiny_checkpoint()[1]).config
    aw = load_peft_adapter(adapter("dense", False, "A")[1], cfg, 8)
    pool = LoraPool(cfg, range(0, 3), MAX_LORAS, MAX_RANK)
    with pytest.raises(ConfigError, match=r"not in this stage's layers \[0, 3\); load weights.for_layers"):
        pool.load(0, aw)
    with pytest.raises(InputError, match=r"adapter slot 3 is outside \[0, max_loras=3\)"):
        pool.load(3, aw.for_layers(0, 3))
    with pytest.raises(ConfigError, match=r"rank 8 above adapters.max_rank=4"):
        LoraPool(cfg, range(0, 3), MAX_LORAS, 4).load(0, aw.for_layers(0, 3))
    with pytest.raises(ConfigError, match=r"adapters.max_loras must be a positive integer"):
        LoraPool(cfg, range(0, 3), 0, MAX_RANK)
    pool.load(1, aw.for_layers(0, 3))
    with pytest.raises(InputError, match=r"adapter slot 0 is empty on stage layers \[0, 3\)"):
        pool.step(_batch(PROMPTS[:2], [1, 0])[0])
    assert pool.step(_batch(PROMPTS[:2], [1, -1])[0]) is not None
    pool.unload(1)
    assert all(not t for t in pool.targets.values()) and all(float(a.abs().sum()) == 0 for a in pool.a.values())
    # a finite lora_alpha whose scale overflows B (0 * inf is NaN in every row of a shared step): refused before
    # the slot is touched, naming the module
    import dataclasses
    huge = dataclasses.replace(aw, lora={m: dataclasses.replace(lw, scale=1e300) for m, lw in aw.lora.items()})
    pool.load(2, aw.for_layers(0, 3))
    before = {k: v.clone() for k, v in pool.b.items()}
    with pytest.raises(ConfigError, match=r"adapter 'adapter-dense-False-A': module 'layers.0.* is not finite in "
                                          r"the pool's float32 \(lora_A, or lora_B x scale 1e\+300\): lower "
                                          r"lora_alpha"):
        pool.load(2, huge.for_layers(0, 3))
    assert all(torch.equal(before[k], v) for k, v in pool.b.items()), "the refused load changed the pool"


def test_lora_pools_the_device_cannot_hold_are_refused_before_any_is_allocated(monkeypatch):
    """adapters.max_loras 10^9 passed the schema, and the first load_adapter took the node's memory until Ray's OOM
    killer ended both stages (a helper's run: 100 s, then Ray's OutOfMemoryError). The pools are sized first: the
    refusal names both keys, the bytes, what the device has and how many slots fit; nothing is allocated."""
    from memra_pp.model import kv_memory, lora as lora_mod
    cfg = SafetensorsSource(tiny_checkpoint()[1]).config
    small = LoraPool(cfg, range(0, 3), 2, 8)
    per_slot = sum(t.numel() * t.element_size() for t in [*small.a.values(), *small.b.values()]) // 2
    made = []
    monkeypatch.setattr(lora_mod.torch, "zeros", lambda *a, **kw: made.append(a) or torch.empty(0))
    with pytest.raises(ConfigError, match=r"^adapters.max_loras 1000000000 x adapters.max_rank 8: the LoRA pools of "
                                          r"layers \[0, 3\) need [0-9.]+ GiB on cpu, which has [0-9.]+ GiB available; "
                                          r"lower adapters.max_loras \(at most \d+ fit at this max_rank\) or "
                                          r"adapters.max_rank$"):
        LoraPool(cfg, range(0, 3), 10 ** 9, 8)
    assert made == []
    have = 200 * per_slot + (64 << 20)       # room for about 190 slots, after fits' slack
    monkeypatch.setattr(kv_memory, "host_available", lambda: have)
    with pytest.raises(ConfigError, match=r"at most 190 fit at this max_rank"):
        LoraPool(cfg, range(0, 3), 191, 8)
    monkeypatch.undo()
    assert LoraPool(cfg, range(0, 3), 190, 8).S == 190       # (the bytes counted are the bytes allocated)


def test_an_unload_waits_for_the_replays_a_recovery_brings_and_is_refused_before_it():
    """begin_unload: while a stage loss has ended requests at the intake (clients hold them for a replay) it refuses
    with StageFailed naming the stage, the name left loaded; after a recovery with recover: replay it waits until
    REPLAY_GRACE_S past the loop's restart (the replays' submits count the adapter's users), and refuses if a stage
    is lost meanwhile; adapter_users refuses for a loss after it; with recover: error, nothing is replayed: it
    neither waits nor refuses."""
    import threading
    import time
    import types
    from memra_pp.errors import StageFailed
    from memra_pp.scheduler import Scheduler
    from memra_pp.stages.runner import Inbox, StageRunner
    r = StageRunner.__new__(StageRunner)
    r.placement = types.SimpleNamespace(adapters=types.SimpleNamespace(max_loras=2), recover="replay")
    r.adapter_registry, r._registry_lock, r._registry_kv, r._registry_seq = {}, threading.Condition(), None, 0
    r.reserve_adapter("a", "/a")
    r.commit_adapter("a", 0)
    r.lost = (1, "stage 1 is lost: the ring from it broke")
    with pytest.raises(StageFailed, match=r"^adapter 'a' cannot be unloaded now: stage 1 is lost: the ring from it "
                                          r"broke, and the deployment has not recovered yet \(requests held for a "
                                          r"replay may still use it\); retry once dep.wait_ready\(\) returns$") as e:
        r.begin_unload("a")
    assert e.value.stage == 1 and r.adapter_names == {"a": 0}
    r.lost, r.resumed_at = None, time.monotonic()       # what start(recovered=True) sets
    t0 = time.monotonic()
    assert r.begin_unload("a") == 0
    assert time.monotonic() - t0 >= StageRunner.REPLAY_GRACE_S - 0.05 and r.adapter_names == {}
    r.abort_unload("a")
    # a stage lost during the wait (a replay breaks a stage again): refused after it, as before it
    r.resumed_at = time.monotonic()
    th, out = threads.start(r.begin_unload, "a")
    time.sleep(0.3)
    r.lost = (2, "stage 2 is lost: it did not answer")
    th.join(5)
    assert isinstance(out["r"], StageFailed) and out["r"].stage == 2 and r.adapter_names == {"a": 0}, out
    # ... and a loss after begin_unload: adapter_users (the deployment's next ask) refuses
    r.scheduler = Scheduler(max_batch=2, microbatches=1, prefill_chunk=16, max_context=64)
    r._submitting, r._pending, r._pending_lock, r.inbox = {}, {}, threading.Lock(), Inbox()
    with pytest.raises(StageFailed, match=r"^adapter in slot 0 cannot be unloaded now: stage 2 is lost"):
        r.adapter_users(0)
    r.lost = None
    assert r.adapter_users(0) == 0
    # recover: error holds nothing for a replay: no wait, and no refusal while a loss is unrecovered
    r.placement.recover, r.resumed_at, r.lost = "error", time.monotonic(), (1, "stage 1 is lost")
    t0 = time.monotonic()
    assert r.begin_unload("a") == 0 and time.monotonic() - t0 < 0.5 and r.adapter_users(0) == 0


def test_the_intakes_adapter_registry_moves_each_name_through_its_states():
    """stages/runner's registry (the table every Deployment handle loads and unloads through): reserve gives the
    lowest free slot (loading), commit publishes the name (loaded), begin_unload withdraws it (unloading), abort_unload
    publishes it again, release frees the slot. A name in any state is refused a second reserve, a loading or
    unloading one an unload, a commit whose reservation is gone is refused, and so is a slot outside max_loras."""
    import threading
    import types
    from memra_pp.errors import InputError
    from memra_pp.stages.runner import StageRunner
    r = StageRunner.__new__(StageRunner)
    r.placement = types.SimpleNamespace(adapters=types.SimpleNamespace(max_loras=2))
    r.adapter_registry, r._registry_lock, r._registry_kv, r._registry_seq = {}, threading.Condition(), None, 0
    assert r.reserve_adapter("a", "/a") == 0 and r.adapters() == {"a": (0, "/a", "loading")}
    with pytest.raises(InputError, match=r"adapter 'a' is being loaded by another handle \(slot 0\)"):
        r.reserve_adapter("a", "/a2")
    with pytest.raises(InputError, match=r"adapter 'a' is being loaded by another handle; try again"):
        r.begin_unload("a")
    assert "a" not in r.adapter_names                  # not published before every stage holds it
    r.commit_adapter("a", 0)
    assert r.adapter_names == {"a": 0} and r.adapters(loaded_only=True) == {"a": (0, "/a")}
    with pytest.raises(InputError, match=r"adapter 'a' is already loaded \(slot 0\); unload it first"):
        r.reserve_adapter("a", "/a")
    assert r.reserve_adapter("b", "/b") == 1
    with pytest.raises(InputError, match=r"the adapter pool is full \(2 slots: \['a', 'b'\]\)"):
        r.reserve_adapter("c", "/c")
    r.release_adapter("b")                             # a load that failed
    with pytest.raises(InputError, match=r"adapter 'b' is not being loaded into slot 1"):
        r.commit_adapter("b", 1)
    assert r.begin_unload("a") == 0 and r.adapter_names == {}
    with pytest.raises(InputError, match=r"adapter 'a' is being unloaded by another handle"):
        r.begin_unload("a")
    r.abort_unload("a")                                # still in use: published again
    assert r.adapter_names == {"a": 0} and r.adapters()["a"][2] == "loaded"
    with pytest.raises(InputError, match=r"unknown adapter 'zz'; loaded: \['a'\]"):
        r.begin_unload("zz")
    with pytest.raises(InputError, match=r"adapter slot 5 is outside adapters.max_loras \(2\)"):
        r.reserve_adapter("d", "/d", slot=5)
    assert r.reserve_adapter("d", "/d", slot=1) == 1   # a restart's reload names its slot
    r.begin_unload("a")
    r.release_adapter("a")
    assert r.adapters() == {"d": (1, "/d", "loading")} and r.adapter_names == {}
    # an unload counts the slot's requests still in the intake's inbox too (submitted, not yet scheduled)
    from memra_pp.stages.runner import Inbox
    r.inbox, r.scheduler = Inbox(), types.SimpleNamespace(waiting=[types.SimpleNamespace(adapter=1)], active={},
                                                          mu=threading.Lock())
    r._submitting, r._pending, r._pending_lock = {}, {}, threading.Lock()
    r.inbox.put(("req", types.SimpleNamespace(adapter=1)))
    r.inbox.put(("abort", "x"))
    r.inbox.put(("req", types.SimpleNamespace(adapter=0)))
    assert r.adapter_users(1) == 2 and r.adapter_users(0) == 1


def test_a_request_during_a_refused_unload_takes_the_adapter_it_finds_still_loaded(monkeypatch):
    """An unload withdraws the adapter's name, counts its users, and publishes the name again if there are any.
    A request arriving in between was refused "unknown adapter" for an adapter that stayed loaded (a helper saw 75
    of 121 such requests refused while a retry loop's unloads were refused). It now waits for the decision: the
    adapter when the unload is refused, "unknown adapter" when it goes on, and after UNLOAD_DECIDED_S (an unload
    whose caller died midway) it is refused."""
    import threading
    import time
    import types
    from memra_pp.errors import InputError
    from memra_pp.stages.runner import StageRunner
    r = StageRunner.__new__(StageRunner)
    r.placement = types.SimpleNamespace(adapters=types.SimpleNamespace(max_loras=2), recover="error")
    r.adapter_registry, r._registry_lock, r._registry_kv, r._registry_seq = {}, threading.Condition(), None, 0
    r._submitting, r.lost, r.resumed_at = {}, None, None
    r.reserve_adapter("a", "/a")
    r.commit_adapter("a", 0)

    def take_while(decide):
        got = []
        th = threading.Thread(target=lambda: got.append(_outcome(r._take_adapter, "a")))
        assert r.begin_unload("a") == 0
        th.start()
        time.sleep(0.2)
        assert th.is_alive() and not got, "the request did not wait for the unload's decision"
        decide()
        th.join(5)
        return got[0]
    assert take_while(lambda: r.abort_unload("a")) == 0 and r._submitting == {0: 1}      # refused unload: served
    out = take_while(lambda: r.release_adapter("a"))                                     # the unload went on
    assert isinstance(out, InputError) and "unknown adapter 'a'" in str(out)
    r.reserve_adapter("a", "/a")
    r.commit_adapter("a", 0)
    r.begin_unload("a")
    monkeypatch.setattr(StageRunner, "UNLOAD_DECIDED_S", 0.3)
    t0 = time.monotonic()
    with pytest.raises(InputError, match="unknown adapter 'a'"):
        r._take_adapter("a")
    assert 0.25 < time.monotonic() - t0 < 3


def _outcome(fn, *a):
    try:
        return fn(*a)
    except Exception as e:  # noqa: BLE001
        return e


def test_a_request_queued_past_its_adapters_drop_fails_alone_and_never_takes_the_next_adapter():
    """A request the intake queued while a recovery ran (its loop stopped) keeps the slot submit found its adapter in.
    The restart's reload of that adapter failed, and the supervisor dropped it (its name and slot released, no users
    counted); the next adapter loaded took the same slot. The loop then ran the request with that other adapter's
    LoRA and token rows (or, with the slot empty, failed its whole microbatch). As the loop takes a request, its
    adapter must still be in its slot: here it ends alone with InputError naming the adapter, and nothing is
    scheduled."""
    import types

    from memra_pp.scheduler import Scheduler
    from memra_pp.stages.intake_loop import IntakeLoop
    from memra_pp.stages.runner import StageRunner
    r = StageRunner()
    r.index, r.engine = 0, types.SimpleNamespace(is_cuda=False)
    r.spec = types.SimpleNamespace(intake=True, primary=False)
    r.mc = types.SimpleNamespace(text=types.SimpleNamespace(vocab_size=512), eos_token_ids=(), vision=None,
                                 image_token_id=None, video_token_id=None)
    r.scheduler = Scheduler(max_batch=4, microbatches=1, prefill_chunk=16, max_context=64)
    r.placement = types.SimpleNamespace(adapters=types.SimpleNamespace(max_loras=2), recover="error")
    r.adapter_registry = {"x": [0, "/adapters/x", "loaded"]}
    r._reaper_stop.set()            # (no Ray here: no reaper)
    for rid, adapter in (("q1", "x"), ("q2", None)):
        r.submit({"rid": rid, "client": "c", "prompt": [5, 6, 7], "max_new_tokens": 4, "adapter": adapter})
    r.release_adapter("x")                          # the dropped reload (then unloaded on every stage)
    assert r.reserve_adapter("y", "/adapters/y") == 0
    r.commit_adapter("y", 0)                        # the next adapter takes slot 0
    loop = IntakeLoop(r)
    assert loop._drain(block=False)
    evs = {e[0]: e for e in r.mail._boxes["c"]}
    assert set(evs) == {"q1"} and evs["q1"][3] == "error" and evs["q1"][4][0] == "InputError", evs
    assert "adapter 'x' is no longer loaded in slot 0" in evs["q1"][4][1], evs
    assert [q.rid for q in r.scheduler.waiting] == ["q2"]       # the request without an adapter goes on
