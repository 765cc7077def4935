"""Adapters through memra_pp.launch: a batch mixing two adapters and none must give each request PEFT's (or the
base model's) greedy tokens on 1, 2 and 3 CPU stages; every refusal keeps the deployment serving."""
import asyncio
import time

import pytest

import memra_pp
from conftest_models import connected, hf_reference, tiny_checkpoint
from memra_pp.errors import ConfigError, InputError
from test_adapters import NEW, PROMPTS, REFUSALS, _edit, adapter, peft_reference
from test_runtime_vision import hf_image_greedy, image, prompt_for
from gaps import worst_gap


def cfg(path, n, max_loras=2, max_rank=8):
    return {"name": "ad", "model": {"path": str(path)}, "stages": [{"device": "cpu", "num_cpus": 0.1}] * n,
            "adapters": {"max_loras": max_loras, "max_rank": max_rank},
            "scheduler": {"max_batch": 8, "max_context": 256, "prefill_chunk": 16}}


SHARED = "adshared"


@pytest.fixture(scope="module")
def shared(ray_cluster):
    """One detached 2-stage deployment of cfg(path, 2) (heartbeat 0.5 s) for the tests that need no fresh one (a
    stage process costs the suite seconds to start): connect()able by SHARED, stages killed and restarted by some of
    them. Each test takes it through emptied() and reads its counters as deltas."""
    _, path = tiny_checkpoint("dense", False)
    adapter("dense", False, "A"), adapter("dense", False, "B")        # (made before the deployment: PEFT, on disk)
    d = memra_pp.launch(dict(cfg(path, 2), name=SHARED, timeouts={"heartbeat_s": 0.5}), detached=True)
    try:
        yield d
    finally:
        d.shutdown()


def emptied(dep):
    """`dep` serving, with no adapter loaded: what a test before this one on the shared deployment left loaded (a
    failed one) is unloaded, so each test starts from an empty registry (slot 0 free first) as on a fresh launch."""
    import ray
    dep.wait_ready(90)
    for name in ray.get(dep.actors[0].adapters.remote(), timeout=30):
        dep.unload_adapter(name)
    assert ray.get(dep.actors[0].adapters.remote(), timeout=30) == {}
    return dep


def kill_and_recover(dep, stage):
    """ray.kill the actor of `stage`, wait until the supervisor has noticed (polled; it was a fixed 1 s pause, so
    that wait_ready did not find the killed actor still answering), then until the recovery is over."""
    import ray
    g = dep.supervisor.generation
    ray.kill(dep.actors[stage])
    end = time.monotonic() + 30
    while dep.supervisor.generation == g and time.monotonic() < end:
        time.sleep(0.01)
    assert dep.supervisor.generation > g, "the supervisor did not notice the killed stage"
    dep.wait_ready(90)


@pytest.mark.parametrize("n,tied", [(1, False), (2, True), (3, False)])
def test_mixed_adapters_match_peft(ray_cluster, n, tied):
    """Requests naming adapter A, adapter B or none, in flight together, must each match their reference; so must
    one naming adapter A with an image (PEFT's model given the pixel_values), which the adapter must change."""
    _, path = tiny_checkpoint("dense", tied)
    with memra_pp.launch(cfg(path, n)) as dep:
        kv0 = dep.stats()["stages"][0]["kv_pages"]
        dep.load_adapter("a", adapter("dense", tied, "A")[1])
        dep.load_adapter("b", adapter("dense", tied, "B")[1])
        # the KV budget was measured again after each load (on a CPU stage it is the table: unchanged)
        st0 = dep.stats()["stages"][0]
        assert st0["kv_pages"] == kv0 > 0 and st0["kv_rebudgets"] == 2
        c = dep.client()
        which = ["a", "b", None, "b"]

        imgs = [image(5)]

        async def go():
            return await asyncio.gather(*[c.agenerate(list(p), max_new_tokens=NEW, adapter=w)
                                          for p, w in zip(PROMPTS, which)],
                                        c.agenerate(prompt_for(imgs), max_new_tokens=NEW, adapter="a", images=imgs))
        *rs, ri = asyncio.run(go())
        for p, w, r in zip(PROMPTS, which, rs, strict=True):
            ref = peft_reference("dense", tied, w.upper(), p) if w else hf_reference("dense", tied, p, NEW)
            assert r.token_ids == ref[0]
            assert worst_gap(zip(r.logprobs, ref[1], strict=True)) < 5e-4
        ref = hf_image_greedy(adapter("dense", tied, "A")[0], prompt_for(imgs), imgs)
        assert ri.token_ids == ref[0] != hf_image_greedy(tiny_checkpoint("dense", tied)[0], prompt_for(imgs), imgs)[0]
        assert worst_gap(zip(ri.logprobs, ref[1], strict=True)) < 5e-4


def test_adapter_refusals_keep_serving(ray_cluster, monkeypatch):
    """Unknown adapter, pool full, rank above max_rank, duplicate name and unknown unload must be refused with
    typed errors; the deployment must then still serve a valid request."""
    import os
    _, path = tiny_checkpoint("dense", False)
    with memra_pp.launch(cfg(path, 2, max_loras=1, max_rank=4)) as dep:
        c = dep.client()
        with pytest.raises(InputError, match="unknown adapter 'nope'"):
            c.generate([5, 17], max_new_tokens=2, adapter="nope")
        with pytest.raises(ConfigError, match="rank"):
            dep.load_adapter("a", adapter("dense", False, "A")[1])        # r=8 > max_rank 4
        # names shown in logs and errors: printable, bounded, no edge spaces; a path that is not one (None became
        # the directory 'None')
        for bad in ("a\nb", "x" * 129, " a", "", 7):
            with pytest.raises(InputError, match="an adapter's name is 1 to 128 printable characters"):
                dep.load_adapter(bad, adapter("dense", False, "B")[1])
        with pytest.raises(InputError, match="adapter 'b': its path is a str or os.PathLike of a str, got None"):
            dep.load_adapter("b", None)
        # a relative path is the caller's (each stage would have read it from its own working directory)
        d = adapter("dense", False, "B")[1]
        monkeypatch.chdir(os.path.dirname(d))
        dep.load_adapter("b", os.path.basename(d))                        # r=4 fits
        with pytest.raises(InputError, match="already loaded"):
            dep.load_adapter("b", adapter("dense", False, "B")[1])
        with pytest.raises(InputError, match="pool is full"):
            dep.load_adapter("c", adapter("dense", False, "B")[1])
        with pytest.raises(InputError, match="unknown adapter 'zz'"):
            dep.unload_adapter("zz")
        p = PROMPTS[0]
        assert c.generate(list(p), max_new_tokens=NEW, adapter="b").token_ids == \
            peft_reference("dense", False, "B", p)[0]
        dep.unload_adapter("b")
        with pytest.raises(InputError, match="unknown adapter 'b'"):
            c.generate(list(p), max_new_tokens=NEW, adapter="b")
        assert c.generate(list(p), max_new_tokens=NEW).token_ids == hf_reference("dense", False, p, NEW)[0]


def test_bad_adapter_files_refused_then_serving(ray_cluster, tmp_path):
    """Adapters with token ids beyond the vocabulary or a vocabulary of another size must be refused with a
    ConfigError on load (no stage keeps them), and the deployment must then serve with a good adapter."""
    _, path = tiny_checkpoint("dense", False)
    with memra_pp.launch(cfg(path, 2, max_loras=1, max_rank=8)) as dep:
        for i, case in enumerate(("token id beyond vocab", "vocab size mismatch")):
            edits, _, msg = REFUSALS[case]
            with pytest.raises(ConfigError, match=msg):
                dep.load_adapter(f"bad{i}", _edit(tmp_path / str(i), **edits))
        dep.load_adapter("a", adapter("dense", False, "A")[1])          # the slot was left free
        p = PROMPTS[0]
        assert dep.client().generate(list(p), max_new_tokens=NEW, adapter="a").token_ids == \
            peft_reference("dense", False, "A", p)[0]


def test_unload_in_use_is_refused(shared):
    """Unloading an adapter while a request generates with it must be refused (its weights would change under
    the request); once the request is done the unload must succeed."""
    import threading
    new = 80        # (the refused unload comes right after the first token and takes milliseconds)
    dep = emptied(shared)
    dep.load_adapter("a", adapter("dense", False, "A")[1])
    c = dep.client()
    got = {}
    first = threading.Event()

    def run():
        toks = []
        for ev in c.stream(list(PROMPTS[0]), max_new_tokens=new, adapter="a", ignore_eos=True):
            toks += ev.token_ids
            first.set()
        got["n"] = len(toks)
    t = threading.Thread(target=run)
    t.start()
    assert first.wait(60)
    with pytest.raises(InputError, match="still used by 1 request"):
        dep.unload_adapter("a")
    t.join(120)
    assert got["n"] == new
    dep.unload_adapter("a")
    with pytest.raises(InputError, match="unknown adapter 'a'"):
        c.generate(list(PROMPTS[0]), max_new_tokens=2, adapter="a")


def test_a_recovered_stage_reloads_its_adapter_and_the_kv_budget_is_measured_again(shared):
    """A killed stage is replaced with its adapters reloaded: requests naming the adapter must match PEFT after the
    recovery, and the intake must have been given a KV budget measured after the reload (the LoRA pools take
    memory the wiring did not see)."""
    dep = emptied(shared)
    rb0 = dep.stats()["stages"][0]["kv_rebudgets"]      # (the shared deployment's, from the tests before)
    dep.load_adapter("a", adapter("dense", False, "A")[1])
    assert dep.stats()["stages"][0]["kv_rebudgets"] == rb0 + 1
    kill_and_recover(dep, 1)
    assert dep.supervisor.log[-1]["recovered"] and dep.supervisor.log[-1]["stage"] == 1, dep.supervisor.log
    r = dep.client().generate(list(PROMPTS[0]), max_new_tokens=NEW, adapter="a", logprobs=True, timeout=60)
    ref = peft_reference("dense", False, "A", PROMPTS[0])
    assert r.token_ids == ref[0] and worst_gap(zip(r.logprobs, ref[1], strict=True)) < 5e-4
    assert dep.stats()["stages"][0]["kv_rebudgets"] == rb0 + 2


def test_a_restarted_stage_reading_rewritten_adapter_files_drops_the_adapter(shared, tmp_path, caplog):
    """The adapter's directory re-saved in place after the load (a trainer writing its next checkpoint to the same
    output_dir), then stage 1 dies. Its replacement read the new files while the intake kept the old weights, and
    "a" ran as half of each: tokens neither PEFT A's nor B's. Now the reload is checked against a survivor's digest:
    "a" is dropped and logged, requests naming it are refused, the others served, and loading it again serves the
    new files."""
    import shutil
    import ray
    live = tmp_path / "live"
    shutil.copytree(adapter("dense", False, "A")[1], live)
    dep = emptied(shared)
    dep.load_adapter("a", str(live))
    p, cl = PROMPTS[0], dep.client()
    assert cl.generate(list(p), max_new_tokens=NEW, adapter="a").token_ids == peft_reference("dense", False, "A", p)[0]
    shutil.rmtree(live)
    shutil.copytree(adapter("dense", False, "B")[1], live)
    with caplog.at_level("WARNING", logger="memra_pp"):
        kill_and_recover(dep, 1)
    assert dep.supervisor.log[-1]["recovered"] and dep.supervisor.log[-1]["stage"] == 1, dep.supervisor.log
    assert "adapter 'a' (slot 0" in caplog.text and "could not be reloaded and is dropped: its files at" in caplog.text
    assert "changed since it was loaded: the restarted stage(s) [1] read other weights" in caplog.text
    with pytest.raises(InputError, match="unknown adapter 'a'"):
        cl.generate(list(p), max_new_tokens=NEW, adapter="a")
    assert ray.get(dep.actors[0].adapters.remote(), timeout=30) == {}
    assert cl.generate(list(p), max_new_tokens=NEW).token_ids == hf_reference("dense", False, p, NEW)[0]
    dep.load_adapter("a", str(live))
    assert cl.generate(list(p), max_new_tokens=NEW, adapter="a").token_ids == peft_reference("dense", False, "B", p)[0]


def serves_b_not_a(dep):
    """After an intake restart: adapter "b" serves PEFT's tokens and "a" is unknown; the client used."""
    p, cl = PROMPTS[1], dep.client()
    assert cl.generate(list(p), max_new_tokens=NEW, adapter="b").token_ids == peft_reference("dense", False, "B", p)[0]
    with pytest.raises(InputError, match="unknown adapter 'a'"):
        cl.generate(list(p), max_new_tokens=NEW, adapter="a")
    return cl


def test_handles_of_one_deployment_share_its_adapter_slots(shared):
    """launch's handle and a connect()ed one load adapters through the intake's registry: the second handle's load
    takes another slot (it once took slot 0 again, overwriting the first adapter under its requests), a name loaded
    by one is refused to the other, and either may unload the other's; each adapter keeps serving PEFT's tokens."""
    dep = emptied(shared)
    with connected(SHARED) as other:
        assert dep.load_adapter("a", adapter("dense", False, "A")[1]) == 0
        assert other.load_adapter("b", adapter("dense", False, "B")[1]) == 1
        with pytest.raises(InputError, match=r"adapter 'a' is already loaded \(slot 0\); unload it first"):
            other.load_adapter("a", adapter("dense", False, "B")[1])
        with pytest.raises(InputError, match=r"the adapter pool is full \(2 slots: \['a', 'b'\]\)"):
            dep.load_adapter("c", adapter("dense", False, "B")[1])
        p = PROMPTS[1]
        for h, w in ((dep, "a"), (other, "b"), (other, "a")):
            assert h.client().generate(list(p), max_new_tokens=NEW, adapter=w).token_ids == \
                peft_reference("dense", False, w.upper(), p)[0], (h is dep, w)
        other.unload_adapter("a")                       # loaded by launch's handle
        with pytest.raises(InputError, match="unknown adapter 'a'"):
            dep.client().generate(list(p), max_new_tokens=NEW, adapter="a")
        assert dep.load_adapter("c", adapter("dense", False, "A")[1]) == 0     # the freed slot
        import ray
        reg = ray.get(dep.actors[0].adapters.remote(), timeout=30)
        assert {n: (slot, state) for n, (slot, _, state) in reg.items()} == {"b": (1, "loaded"), "c": (0, "loaded")}
        # the supervisor's heartbeat reads the loaded ones (what a restart of the intake would reload)
        assert ray.get(dep.actors[0].health.remote(), timeout=30)["adapters"].keys() == {"b", "c"}


def test_an_intake_restart_reloads_every_handles_adapters_and_drops_one_whose_files_are_gone(shared, tmp_path,
                                                                                              caplog):
    """The intake holds the registry; if it is restarted, the supervisor reloads what its heartbeats last read there:
    an adapter a connect()ed handle loaded too (the launching handle's own list once lost it), and one whose files
    were deleted meanwhile is dropped and logged instead of failing the restart. The deployment serves both ways."""
    import shutil
    import ray
    gone = tmp_path / "gone"
    shutil.copytree(adapter("dense", False, "A")[1], gone)
    dep = emptied(shared)                                # (detached, heartbeat 0.5 s)
    with connected(SHARED) as other:
        dep.load_adapter("a", str(gone))
        other.load_adapter("b", adapter("dense", False, "B")[1])
        end = time.monotonic() + 10
        while set(dep._adapter_paths) != {"a", "b"} and time.monotonic() < end:
            time.sleep(0.1)                              # a heartbeat reads the registry
        assert set(dep._adapter_paths) == {"a", "b"}
        shutil.rmtree(gone)
        with caplog.at_level("WARNING", logger="memra_pp"):
            kill_and_recover(dep, 0)
        assert dep.supervisor.log[-1]["recovered"] and dep.supervisor.log[-1]["stage"] == 0, dep.supervisor.log
        assert "adapter 'a' (slot 0" in caplog.text and "could not be reloaded and is dropped" in caplog.text
        cl, p = serves_b_not_a(dep), PROMPTS[1]
        assert {n: e[0] for n, e in ray.get(dep.actors[0].adapters.remote(), timeout=30).items()} == {"b": 1}
        assert cl.generate(list(p), max_new_tokens=NEW).token_ids == hf_reference("dense", False, p, NEW)[0]


def test_an_adapter_changed_just_before_the_intake_dies_is_restored_as_it_was(ray_cluster):
    """A detached deployment's intake keeps its loaded adapters in Ray's KV at every change, and a restart of it
    reloads from there: an adapter a connect()ed handle loaded just before the intake died is served after the
    restart, and one it unloaded just before is not back. The heartbeat alone missed both (its last read came
    before them: they are made just after a heartbeat's read, a second before the next, and where a read fell
    between them all the same, they are undone and made again after the next read)."""
    import ray
    _, path = tiny_checkpoint("dense", False)
    c = dict(cfg(path, 2), name="adkept", timeouts={"heartbeat_s": 1.0})
    with memra_pp.launch(c, detached=True) as dep:
        other = memra_pp.connect("adkept", namespace="memra-test")
        dep.load_adapter("a", adapter("dense", False, "A")[1])
        for _ in range(5):
            dep._adapter_paths, dep._adapter_seq = {}, -1   # refilled by the next heartbeat: 1 s after the last
            end = time.monotonic() + 30
            while not dep._adapter_paths and time.monotonic() < end:
                time.sleep(0.01)
            other.unload_adapter("a")
            other.load_adapter("b", adapter("dense", False, "B")[1])
            if set(dep._adapter_paths) == {"a"}:
                break
            # a heartbeat read the registry between the changes (a loaded machine): undo them, try again
            other.unload_adapter("b")
            assert dep.load_adapter("a", adapter("dense", False, "A")[1]) == 0
        assert set(dep._adapter_paths) == {"a"}          # what the heartbeat saw: a restart from it would be wrong
        kill_and_recover(dep, 0)
        assert dep.supervisor.log[-1]["recovered"] and dep.supervisor.log[-1]["stage"] == 0, dep.supervisor.log
        assert dep.supervisor.reload_from == "kv"
        reg = ray.get(dep.actors[0].adapters.remote(), timeout=30)
        assert {n: (e[0], e[2]) for n, e in reg.items()} == {"b": (0, "loaded")}     # a's slot, freed for it
        serves_b_not_a(dep)
        key = dep.kv_key("adapters")
        import json
        from ray.experimental import internal_kv
        # the new intake keeps the reloaded list (written once the reload is over, not adapter by adapter)
        assert json.loads(internal_kv._internal_kv_get(key)) == {"b": [0, str(adapter("dense", False, "B")[1])]}
    assert internal_kv._internal_kv_get(key) is None     # the launch's keys go with it



def test_adapters_refused_in_the_pools_or_overflowing_leave_the_others_served(ray_cluster, tmp_path):
    """Two bad adapters on one deployment, and a good one after them:
    - A first load refused inside the pools (lora_B x scale not finite in float32) has already made every stage's
      LoRA pools (max_loras x max_rank for each target): the KV budget must be measured again then too, as after a
      load that succeeds, or the intake admits against memory the pools took.
    - An adapter whose lora_A (3e38) and lora_B x scale are finite loads, but x A overflows. Its requests must end
      with an InputError naming it (their logits are NaN: no token of theirs means anything), counted; requests
      without it, in flight beside them, must get transformers' tokens and logprobs (another slot's inf once
      became NaN in every row of the step).
    - Then a good adapter serves PEFT's tokens."""
    import torch
    from safetensors.torch import load_file, save_file
    d = _edit(tmp_path / "overflow")
    f = d / "adapter_model.safetensors"
    t = load_file(str(f))
    save_file({k: torch.full_like(v, 3e38) if "lora_A" in k else torch.full_like(v, 1e-30) if "lora_B" in k else v
               for k, v in t.items()}, str(f))
    _, path = tiny_checkpoint("dense", False)
    with memra_pp.launch(cfg(path, 2)) as dep:
        assert dep.stats()["stages"][0]["kv_rebudgets"] == 0
        with pytest.raises(ConfigError, match=r"is not finite in the pool's float32"):
            dep.load_adapter("alpha", _edit(tmp_path / "alpha", cfg={"lora_alpha": 1e300}))
        assert dep.stats()["stages"][0]["kv_rebudgets"] == 1
        dep.load_adapter("huge", d)
        c = dep.client()
        which = ["huge", None, None, "huge"]

        async def go():
            return await asyncio.gather(*[c.agenerate(list(p), max_new_tokens=NEW, adapter=w, logprobs=True)
                                          for p, w in zip(PROMPTS, which)], return_exceptions=True)
        for p, w, r in zip(PROMPTS, which, asyncio.run(go()), strict=True):
            if w is not None:
                assert isinstance(r, InputError), r
                assert str(r) == ("the model's logits for output token 1 of this request are not finite (NaN): its "
                                  "adapter 'huge' overflows on these activations: lower its lora_alpha or check its "
                                  "weights"), r
                continue
            ref = hf_reference("dense", False, p, NEW)
            assert r.token_ids == ref[0] and worst_gap(zip(r.logprobs, ref[1], strict=True)) < 5e-4
        assert dep.stats()["stages"][0]["not_finite"] == 2
        dep.unload_adapter("huge")
        dep.load_adapter("a", adapter("dense", False, "A")[1])
        p = PROMPTS[1]
        assert c.generate(list(p), max_new_tokens=NEW, adapter="a").token_ids == \
            peft_reference("dense", False, "A", p)[0]
        assert c.generate(list(PROMPTS[2]), max_new_tokens=NEW).token_ids == hf_reference("dense", False, PROMPTS[2],
                                                                                            NEW)[0]
