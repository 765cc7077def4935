"""A connect()ed handle of a detached deployment around a recovery and a relaunch, whatever `recover`: its
wait_ready and adapter loads wait for a recovery as the launching handle's do (it pinged the stage actors it had
looked up before the restart, and a load reached the new actor before its setup); its clients let go unclosed free
their intake mailboxes (its RemoteSupervisor's round kept the last list of clients alive); and a handle whose launch
was shut down never serves from a later launch of the same name."""
import asyncio
import gc
import re
import time

import ray

import memra_pp
from conftest_models import hf_reference, tiny_checkpoint
from memra_pp.errors import StageFailed

SHORT = (5, 17, 42)
NS = "memra-test"


def cfg(path, name, recover="error"):
    return {"name": name, "model": {"path": str(path)}, "recover": recover,
            "stages": [{"device": "cpu", "num_cpus": 0.1}] * 2, "timeouts": {"heartbeat_s": 0.5},
            "adapters": {"max_loras": 2, "max_rank": 8},
            "scheduler": {"max_batch": 8, "max_context": 512, "prefill_chunk": 16}}


def wait_for(pred, timeout=10.0, step=0.05):
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v or time.monotonic() >= deadline:
            return v
        time.sleep(step)


def test_a_connected_handle_waits_for_recoveries_and_frees_its_clients_mailboxes(ray_cluster):
    from test_adapters import NEW, PROMPTS, adapter, peft_reference
    _, path = tiny_checkpoint("dense", False)
    want = hf_reference("dense", False, SHORT, 4)[0]
    with memra_pp.launch(cfg(path, "hha"), detached=True) as dep:
        other = memra_pp.connect("hha", namespace=NS)
        assert other.supervisor is not None, "recover: error too: the handle follows the launcher's recoveries"
        mailboxes = lambda: dep.stats()["stages"][0]["mailboxes"]     # noqa: E731
        other.client().close()
        base = mailboxes()
        clients = [other.client() for _ in range(12)]

        async def burst(cs):
            return await asyncio.gather(*[c.agenerate(list(SHORT), max_new_tokens=4) for c in cs])
        assert all(r.token_ids == want for r in asyncio.run(burst(clients)))
        assert mailboxes() >= base + 12
        del clients
        gc.collect()
        time.sleep(0.5)           # (a round of the handle's RemoteSupervisor and of its poller)
        other.client().close()    # the next client() forgets the collected ones
        assert wait_for(lambda: mailboxes() <= base, 15), (mailboxes(), base)
        # a failure the launcher has not detected yet: the connected handle's wait_ready waits it out
        ray.kill(dep.actors[1])
        t0 = time.monotonic()
        other.wait_ready(60)
        assert dep.supervisor.log and dep.supervisor.log[-1]["recovered"], dep.supervisor.log
        print(f"connected wait_ready through an undetected failure: {time.monotonic() - t0:.2f} s")
        other.wait_ready(10)      # after the restart: it asks the new actors
        # an adapter load during a recovery waits for it, then loads on every stage
        ray.kill(dep.actors[1])
        assert wait_for(lambda: not dep.supervisor.ready.is_set(), 15, 0.005), "the launcher must be recovering"
        # (the RemoteSupervisor reads the launcher's record every 0.2 s): it has seen this failure
        assert wait_for(lambda: other.supervisor.generation >= dep.supervisor.generation, 15, 0.01), \
            (other.supervisor.generation, dep.supervisor.generation)
        assert other.load_adapter("a", adapter("dense", False, "A")[1]) == 0
        assert [e["stage"] for e in dep.supervisor.log] == [1, 1] and dep.supervisor.log[-1]["recovered"]
        r = other.client().generate(list(PROMPTS[0]), max_new_tokens=NEW, adapter="a", timeout=60)
        assert r.token_ids == peft_reference("dense", False, "A", PROMPTS[0])[0]


def test_a_handle_of_an_earlier_launch_does_not_serve_from_a_later_one(ray_cluster):
    """Launch #1 is shut down and #2 launched under its name: #1's connected handle fails (StageFailed naming
    why), its requests never going to #2's intake (another placement, a recovery record it does not follow)."""
    _, path = tiny_checkpoint("dense", False)
    d1 = memra_pp.launch(cfg(path, "hh-relaunch", recover="replay"), detached=True)
    d2 = None
    try:
        other = memra_pp.connect("hh-relaunch", namespace=NS)
        c = other.client()
        assert c.generate(list(SHORT), max_new_tokens=4).token_ids == hf_reference("dense", False, SHORT, 4)[0]
        d1.shutdown()
        d2 = memra_pp.launch(cfg(path, "hh-relaunch", recover="replay"), detached=True)
        gone = r"the deployment 'hh-relaunch' this handle connected to was shut down; a later launch has its name: " \
               r"connect\(\) to it"
        try:
            c.generate(list(SHORT), max_new_tokens=4, timeout=30)
            raise AssertionError("served after its launch was shut down")
        except StageFailed as e:
            assert re.fullmatch("submit: " + gone, str(e)), e
        assert other.actors[0]._actor_id != d2.actors[0]._actor_id
        try:
            other.stats()
            raise AssertionError("stats answered after its launch was shut down")
        except StageFailed as e:
            assert re.fullmatch("stats: " + gone, str(e)), e
        assert d2.client().generate(list(SHORT), max_new_tokens=4).token_ids == \
            hf_reference("dense", False, SHORT, 4)[0]
    finally:
        d1.shutdown()
        if d2 is not None:
            d2.shutdown()


def test_a_connected_handle_takes_the_tokenizer_and_model_config_from_the_intake(ray_cluster, tmp_path, monkeypatch):
    """(Was a defect.) A connect()ed handle read the tokenizer and the model config from its own disk at the
    launch's model.path: on a host without the checkpoint a text prompt was refused, r.text came back None, and an
    image request ran to its end and then raised ConfigError (its tokens lost). Here this process's reads of the
    model directory raise, as on such a host: text, r.text, a raw (PIL) image and its prompt count all come from
    the intake, equal to the launching handle's."""
    from PIL import Image

    from memra_pp.model import tokenizer as tk
    from memra_pp.model import weights
    from memra_pp.model.tiny import make_tiny
    path = make_tiny(tmp_path / "tiny-vision", vision=True)
    cfg = {"name": "hh-remote", "model": {"path": str(path)}, "stages": [{"device": "cpu", "num_cpus": 0.1}],
           "scheduler": {"max_batch": 4, "max_context": 2048, "prefill_chunk": 512}}
    import numpy as np
    img = Image.fromarray(np.random.default_rng(0).integers(0, 255, (40, 56, 3), dtype="uint8"))
    with memra_pp.launch(cfg, detached=True) as dep:
        mc = dep.model_config
        prompt = "<|vision_start|><|image_pad|><|vision_end|>Describe it."
        here = dep.client()
        want_text = here.generate("Hello there", max_new_tokens=5, ignore_eos=True)
        want_img = here.generate(prompt, max_new_tokens=5, ignore_eos=True, images=[img])
        assert want_text.text and want_img.prompt_tokens > len(dep.tokenizer.encode(prompt, True))

        def no_disk(*a, **k):
            raise AssertionError("a connected handle read the model directory on its own host")
        monkeypatch.setattr(tk.Tokenizer, "for_model", classmethod(no_disk))
        monkeypatch.setattr(weights, "open_weights", no_disk)
        other = memra_pp.connect("hh-remote", namespace=NS)
        try:
            c = other.client()
            r = c.generate("Hello there", max_new_tokens=5, ignore_eos=True)
            assert (r.token_ids, r.text) == (want_text.token_ids, want_text.text)
            ri = c.generate(prompt, max_new_tokens=5, ignore_eos=True, images=[img])
            assert (ri.token_ids, ri.prompt_tokens) == (want_img.token_ids, want_img.prompt_tokens)
            assert other.model_config == mc
        finally:
            other.supervisor.stop()
