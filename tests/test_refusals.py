"""Refusals no other test executed: each runs the real path that refuses and asserts the typed error and its message
(images for a model without a vision tower, published rows of an unknown dtype, the residency of a tensor that has
none, a stage restart that keeps failing)."""
import dataclasses
import re
import shutil
import threading
import time

import pytest
import ray
import torch

import memra_pp
from memra_pp.engine import Engine, residency_of
from memra_pp.errors import ConfigError, InputError, OverlayError, StageFailed
from memra_pp.model.config import parse_config
from memra_pp.model.image import DEFAULT_MAX_PATCHES, ImageInput
from memra_pp.model.tiny import TOKEN_IDS, make_tiny, tiny_config
from memra_pp.multimodal import plan_images
from memra_pp.overlay import publish_out

IMG = TOKEN_IDS["<|image_pad|>"]


def test_images_for_a_model_without_a_vision_tower_are_refused():
    """Images given for a text-only model (no vision_config) must be refused with InputError naming the missing
    tower before any pixel work; the same prompt and image must plan on the model with a tower (the refusal is the
    tower's absence, not the image)."""
    image = ImageInput(torch.randn(1 * 4 * 6, 3 * 2 * 4 * 4), (1, 4, 6))   # the tiny tower's patch width
    prompt = [5, TOKEN_IDS["<|vision_start|>"], IMG, TOKEN_IDS["<|vision_end|>"], 7]
    text_only = parse_config(tiny_config(vision=False))
    assert text_only.vision is None
    with pytest.raises(InputError, match=r"this model has no vision tower \(no vision_config\): images cannot be "
                                         r"given"):
        plan_images(prompt, [image], text_only, DEFAULT_MAX_PATCHES)
    plan = plan_images(prompt, [image], parse_config(tiny_config(vision=True)), DEFAULT_MAX_PATCHES)
    assert plan.prompt.count(IMG) == 1 * 4 * 6 // 2 ** 2 and plan.spans == [(2, 0, 6)]


def test_published_rows_of_an_unknown_dtype_are_refused():
    """Published rows whose dtype name is no torch dtype of this process must be refused with OverlayError naming
    that dtype, both when sized and when landed, and nothing must be landed; the same rows with their own dtype
    land bit-exact."""
    rows = torch.randn(6, 16)
    pub = publish_out(Engine("cpu"), rows, [(0, 0, 6)])
    intake = Engine("cpu")
    bad = dataclasses.replace(pub, dtype="float7")
    msg = r"published rows carry unknown dtype 'float7': not a dtype of this process's torch .*same torch"
    with pytest.raises(OverlayError, match=msg):
        bad.nbytes
    with pytest.raises(OverlayError, match=msg):
        bad.land(intake)
    assert intake.counters.publications == 0
    assert torch.equal(pub.land(intake).rows, rows) and intake.counters.publications == 1


def test_residency_of_a_meta_tensor_is_refused():
    """A tensor of a device whose memory is not tracked (meta) must be refused with ConfigError naming that device
    and what is tracked."""
    with pytest.raises(ConfigError, match=r"residency of a meta tensor is not tracked: use cpu or cuda tensors"):
        residency_of(torch.empty(2, 3, device="meta"), Engine("cpu"))


@pytest.mark.gpu
def test_residency_of_an_empty_cuda_tensor_is_refused():
    """An empty CUDA tensor has no allocation to read its context from: residency_of must refuse it with
    ConfigError saying so (a one-element tensor of the same device is resident in the engine's context). Needs a
    CUDA GPU: fails (never skips) without one."""
    assert torch.cuda.is_available(), "this test needs a CUDA GPU (run it on the GPU machine: pytest -m gpu)"
    eng = Engine("cuda:0")
    empty = torch.empty(0, device="cuda:0")
    assert empty.data_ptr() == 0
    with pytest.raises(ConfigError, match=r"residency of an empty CUDA tensor cannot be read \(it has no "
                                          r"allocation\); pass a tensor of at least one element"):
        residency_of(empty, eng)
    assert residency_of(torch.zeros(1, device="cuda:0"), eng) == eng.ctx


def test_a_restart_that_keeps_failing_ends_the_deployment_with_its_cause(ray_cluster, tmp_path):
    """A stage whose restart fails every attempt (its checkpoint is gone) must end the recovery: wait_ready, a new
    request and a request held for replay must each end with StageFailed naming the stage, the failure, the
    restart's own cause and the fix, the supervisor's log must record the recovery as failed, and the shutdown must
    still complete."""
    ckpt = make_tiny(tmp_path / "ckpt")
    msg = (rf"stage 1 failed \(its actor died \(\w+\)\) and could not be restarted in 3 attempts: ConfigError: "
           rf"model.path {re.escape(repr(str(ckpt)))} does not exist; shut the deployment down and launch it again "
           r"once that is fixed")
    dep = memra_pp.launch({"name": "norestart", "model": {"path": str(ckpt)}, "recover": "replay",
                           "stages": [{"device": "cpu", "num_cpus": 0.1}] * 2, "timeouts": {"heartbeat_s": 0.5},
                           "scheduler": {"max_batch": 4, "max_context": 512}})
    try:
        c = dep.client()
        held, got = {}, []

        def run():
            try:
                for ev in c.stream([5, 17, 42], max_new_tokens=400, timeout=60):
                    got.extend(ev.token_ids)
            except Exception as e:  # noqa: BLE001 - recorded for the test to assert on
                held["error"] = e
        th = threading.Thread(target=run, daemon=True)
        th.start()
        deadline = time.monotonic() + 30
        while len(got) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert 3 <= len(got) < 400 and th.is_alive(), "the request must still be generating when the stage dies"
        shutil.rmtree(ckpt)
        ray.kill(dep.actors[1])
        deadline = time.monotonic() + 30     # (ray.kill is asynchronous: a wait_ready before the supervisor has
        while dep.supervisor.generation == 0 and time.monotonic() < deadline:   # noticed may find every stage up)
            time.sleep(0.02)
        assert dep.supervisor.generation == 1, "the supervisor did not notice the kill"
        with pytest.raises(StageFailed, match=msg) as ei:
            dep.wait_ready(60)
        assert ei.value.stage == 1
        th.join(30)
        assert isinstance(held.get("error"), StageFailed) and held["error"].stage == 1, held
        assert re.search(msg, str(held["error"])), str(held["error"])
        with pytest.raises(StageFailed, match=msg):
            c.generate([5, 17, 42], max_new_tokens=4, timeout=60)
        assert [(e["stage"], e["recovered"]) for e in dep.supervisor.log] == [(1, False)], dep.supervisor.log
    finally:
        dep.shutdown()
    assert not dep.supervisor.thread.is_alive()
