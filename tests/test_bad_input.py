"""Bad input through memra_pp.launch: each must end with a typed error naming what was wrong, and the deployment
must serve the next valid request. One 2-stage deployment is shared by the request-level checks; the launch-level
checks (YAML, checkpoints) must leave no actor and, when launch started it, no Ray cluster behind."""
import array
import gc
import os
import re
import shutil
import stat
import struct
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import ray
import torch

import memra_pp
from conftest_models import hf_reference, tiny_checkpoint
from memra_pp.errors import ConfigError, InputError, StageFailed

FIXTURES = "/work/shared/fixtures/qwen35-tiny/dense_text-s404"
IMG, VS, VE, V, CTX = 300, 302, 303, 320, 64


class NotImportableThere:
    """Pickled by reference to this test module, which a stage process cannot import."""


class PicklingFails:
    def __reduce__(self):
        raise RuntimeError("this object refuses to be pickled")


class MyInt(int):
    pass


def image(grid=(1, 4, 6), fill=None, width=96, device=None, sparse=False, dtype=torch.float32):
    t, h, w = grid
    pv = torch.randn(t * h * w, width, generator=torch.Generator().manual_seed(0)).to(dtype)
    if fill is not None:
        pv[3, 5] = fill
    if device is not None:
        pv = pv.to(device)
    if sparse:
        pv = pv.to_sparse()
    return memra_pp.ImageInput(pv, grid)


@pytest.fixture(scope="module")
def dep(ray_cluster):
    _, path = tiny_checkpoint("dense", False)
    d = memra_pp.launch({"name": "bad", "model": {"path": str(path)}, "timeouts": {"heartbeat_s": 0.5},
                         "stages": [{"device": "cpu", "num_cpus": 0.1}] * 2,
                         "scheduler": {"max_batch": 4, "max_context": CTX, "prefill_chunk": 16}})
    yield d
    d.shutdown()


def serves(d):
    r = d.client().generate([5, 17, 42], max_new_tokens=4, timeout=60)
    assert r.token_ids == hf_reference("dense", False, (5, 17, 42), 4)[0], "a valid request must be served"


CASES = {   # name: (generate keywords, error type, message fragment)
    "id above vocab": (dict(prompt=[5, V]), InputError, f"outside the vocabulary [0, {V})"),
    "negative id": (dict(prompt=[-1, 5]), InputError, "outside the vocabulary"),
    "empty prompt": (dict(prompt=[]), InputError, "the prompt is empty"),
    "too long": (dict(prompt=[5] * (CTX + 1)), InputError, f"more than scheduler.max_context ({CTX})"),
    # a request is never cut short at max_context: it is refused (10 + CTX - 8 - 1 positions)
    "past max_context": (dict(prompt=[5] * 10, max_new_tokens=CTX - 8), InputError,
                         f"need {CTX + 1} positions, more than scheduler.max_context ({CTX}); ask for at most "
                         f"{CTX - 9} new tokens"),
    "not a prompt": (dict(prompt=3.5), InputError, "a prompt is a string or a list of token ids"),
    "negative max_new_tokens": (dict(max_new_tokens=-2), InputError, "max_new_tokens must be >= 0"),
    "fractional max_new_tokens": (dict(max_new_tokens=2.5), InputError, "max_new_tokens must be an integer"),
    "negative temperature": (dict(temperature=-0.5), InputError, "temperature must be >= 0"),
    "temperature of a wrong type": (dict(temperature="hot"), InputError, "temperature must be a finite number"),
    "infinite temperature": (dict(temperature=float("inf")), InputError, "temperature must be a finite number"),
    # a seed only the sampler (the last stage) used to read: it failed there, with every request of its batch
    "seed of a wrong type": (dict(seed="7", temperature=1.0), InputError, "seed must be an integer or None, got '7'"),
    "fractional seed": (dict(seed=1.5, temperature=1.0), InputError, "seed must be an integer or None, got 1.5"),
    "float token ids": (dict(prompt=[5.7, 17]), InputError, "a prompt's token ids are integers, got 5.7"),
    "bool token ids": (dict(prompt=[True, 5]), InputError, "a prompt's token ids are integers, got True"),
    "bytes prompt": (dict(prompt=b"hi"), InputError, "a prompt is a string or a list of token ids, got bytes"),
    "bytes behind a memoryview": (dict(prompt=memoryview(b"hi")), InputError,
                                  "a prompt is a string or a list of token ids, got memoryview"),
    "an array of bytes": (dict(prompt=array.array("B", b"hi")), InputError,
                          "a prompt is a string or a list of token ids, got array"),
    "stop ids as bytes": (dict(stop_token_ids=memoryview(b"\x07")), InputError, "stop_token_ids is a list of token "
                                                                               "ids, got <memory"),
    "stop id above vocab": (dict(stop_token_ids=[V]), InputError, f"stop_token_ids must be token ids in [0, {V})"),
    "stop id of a wrong type": (dict(stop_token_ids=["5"]), InputError,
                                "stop_token_ids is a list of token ids, got ['5']"),
    "ignore_eos not a bool": (dict(ignore_eos="yes"), InputError, "ignore_eos must be True or False, got 'yes'"),
    "ignore_eos a tensor": (dict(ignore_eos=torch.tensor([1, 0])), InputError, "ignore_eos must be True or False"),
    "adapter not a name": (dict(adapter=["a"]), InputError, "adapter must be a loaded adapter's name"),
    "adapter number": (dict(adapter=5), InputError, "adapter must be a loaded adapter's name (a string) or None, "
                                                    "got 5"),
    "top_p above 1": (dict(top_p=1.5), InputError, "top_p must be in (0, 1]"),
    "negative top_k": (dict(top_k=-3), InputError, "top_k must be an integer >= 0"),
    "min_p above 1": (dict(min_p=1.5), InputError, "min_p must be in [0, 1]"),
    "unknown adapter": (dict(adapter="nope"), InputError, "unknown adapter 'nope'"),
    "adapter path": (dict(adapter="/tmp/peft_adapter"), InputError, "unknown adapter '/tmp/peft_adapter'"),
    "adapter relative path": (dict(adapter="../adapters/a1"), InputError, "unknown adapter '../adapters/a1'"),
    "placeholder count": (dict(prompt=[5, VS, IMG, IMG, IMG, VE, 7], images=[image()]), InputError,
                          "Attempted to assign"),
    "placeholders without images": (dict(prompt=[5, VS, IMG, IMG, VE, 7]), InputError,
                                     f"the prompt holds 2 image or video placeholder token(s) (ids {IMG}, "
                                     f"{IMG + 1}) but no images"),
    "video placeholders without images": (dict(prompt=[5, VS, IMG + 1, VE, 7]), InputError,
                                           "the prompt holds 1 image or video placeholder token(s)"),
    "images not a list": (dict(prompt=[5, VS, IMG, VE], images=image()), InputError,
                          "images is a list of memra_pp.ImageInput, got ImageInput"),
    "pixel shape": (dict(prompt=[5, VS, IMG, VE], images=[image(width=95)]), InputError,
                    "pixel_values has shape (24, 95)"),
    "grid": (dict(prompt=[5, VS, IMG, VE], images=[image(grid=(1, 3, 6))]), InputError,
             "multiples of spatial_merge_size"),
    # values the boundary header cannot carry: the intake's loop died encoding them, taking every request with it
    "seed past 64 bits": (dict(seed=2 ** 64), InputError, "seed must fit in a signed 64-bit integer"),
    "seed below -2**63": (dict(seed=-2 ** 63 - 1), InputError, "seed must fit in a signed 64-bit integer"),
    "int too large for a float": (dict(temperature=10 ** 400), InputError, "temperature must be a finite number"),
    "top_p too large for a float": (dict(top_p=10 ** 400), InputError, "top_p must be a finite number"),
    # unordered, or not a flag: refused, not read in some order or guessed
    "set prompt": (dict(prompt={5, 17, 42}), InputError, "a prompt is a string or a list of token ids, got set"),
    "set stop ids": (dict(stop_token_ids={5, 7}), InputError, "stop_token_ids is a list of token ids"),
    "dict stop ids": (dict(stop_token_ids={5: 1}), InputError, "stop_token_ids is a list of token ids"),
    "ignore_eos 1": (dict(ignore_eos=1), InputError, "ignore_eos must be True or False, got 1 (int)"),
    "ignore_eos 0.0": (dict(ignore_eos=0.0), InputError, "ignore_eos must be True or False, got 0.0 (float)"),
    "logprobs 5": (dict(logprobs=5), InputError, "logprobs must be True or False, got 5 (int)"),
    "logprobs 'no'": (dict(logprobs="no"), InputError, "logprobs must be True or False, got 'no' (str)"),
    "adapter a lock": (dict(adapter=threading.Lock()), InputError,
                       "adapter must be a loaded adapter's name (a string) or None, got <unlocked _thread.lock"),
    "a value Ray cannot send": (dict(images=[memra_pp.ImageInput(threading.Lock(), (1, 4, 6))]), InputError,
                                "the request holds a value that cannot be sent to the intake: TypeError"),
    # values a stage process cannot unpickle or read: refused in the client by name (they failed in the intake
    # as a lost stage 0 with recover: error, and made a replay deployment's client hold the request until its
    # timeout: a RayTaskError of a live intake read as the intake's loss)
    "image not an ImageInput": (dict(prompt=[5, VS, IMG, VE], images=[threading.Lock()]), InputError,
                                "an image must be a memra_pp.ImageInput (pixel_values, grid_thw), a PIL image or an "
                                "(H, W, 3) array of pixels, got lock"),
    "image of a class the stages cannot import": (dict(prompt=[5, VS, IMG, VE], images=[NotImportableThere()]),
                                                  InputError, "an image must be a memra_pp.ImageInput"),
    "float8 pixels": (dict(prompt=[5, VS, IMG, VE], images=[image(dtype=torch.float8_e4m3fn)]), InputError,
                      "pixel_values must be float16, bfloat16, float32 or float64, got torch.float8_e4m3fn"),
    "dict image, meta grid": (dict(prompt=[5, VS, IMG, VE], images=[dict(
        pixel_values=torch.zeros(24, 96), grid_thw=torch.tensor([1, 4, 6], device="meta"))]), InputError,
        "ImageInput.grid_thw must be 3 positive ints (t, h, w), got tensor(..., device='meta'"),
    "dict image, sparse grid": (dict(prompt=[5, VS, IMG, VE], images=[dict(
        pixel_values=torch.zeros(24, 96), grid_thw=torch.tensor([1, 4, 6]).to_sparse())]), InputError,
        "ImageInput.grid_thw must be 3 positive ints"),
    "image whose pickling raises": (dict(prompt=[5, VS, IMG, VE], images=[memra_pp.ImageInput(PicklingFails(),
                                                                                                (1, 4, 6))]),
                                    InputError, "cannot be sent to the intake: RuntimeError: this object refuses"),
    "temperature of a class the stages cannot import": (dict(temperature=NotImportableThere()), InputError,
                                                         "temperature must be a finite number, got <"),
    "meta prompt": (dict(prompt=torch.tensor([5, 17], device="meta")), InputError,
                    "a prompt is a string or a list of token ids, got Tensor"),
    "sparse stop ids": (dict(stop_token_ids=torch.tensor([5]).to_sparse()), InputError,
                        "stop_token_ids is a list of token ids"),
    "meta ignore_eos": (dict(ignore_eos=torch.tensor(True, device="meta")), InputError,
                        "ignore_eos must be True or False"),
    "lone surrogate text": (dict(prompt="\ud800abc"), InputError,
                            "a text prompt must be valid Unicode: surrogates not allowed at character 0"),
    "meta pixels": (dict(prompt=[5, VS, IMG, VE], images=[image(device="meta")]), InputError,
                    "pixel_values must be a dense tensor with its values (layout strided, not meta), got layout "
                    "torch.strided on meta"),
    "sparse pixels": (dict(prompt=[5, VS, IMG, VE], images=[image(sparse=True)]), InputError,
                      "got layout torch.sparse_coo"),
    "NaN pixels": (dict(prompt=[5, VS, IMG, VE], images=[image(fill=float("nan"))]), InputError, "NaN or inf"),
    "inf pixels": (dict(prompt=[5, VS, IMG, VE], images=[image(fill=float("inf"))]), InputError, "NaN or inf"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_request(dep, case):
    """The request must fail with the typed error naming the bad value; the next valid one must be served."""
    kw, etype, msg = CASES[case]
    kw = dict(kw)
    prompt = kw.pop("prompt", [5, 17, 42])
    with pytest.raises(etype) as ei:
        dep.client().generate(prompt, **{"max_new_tokens": 4, **kw})
    assert msg in str(ei.value), str(ei.value)
    serves(dep)


def test_values_only_this_process_can_unpickle_are_sent_as_plain_ones(dep):
    """Token ids and grid sizes of an int subclass (this test module's, which no stage can import) travel as plain
    ints, and a flipped numpy image (negative strides) is taken as a copy: all served as their plain forms are."""
    import numpy as np
    c = dep.client()
    assert c.generate([MyInt(5), 17, 42], max_new_tokens=4, stop_token_ids=[MyInt(7)]).token_ids == \
        hf_reference("dense", False, (5, 17, 42), 4)[0]
    pv = np.random.default_rng(0).standard_normal((24, 96), dtype=np.float32)
    flipped = memra_pp.ImageInput(np.flip(pv, 0), (1, 4, 6))
    assert flipped.pixel_values.is_contiguous() and torch.equal(flipped.pixel_values, torch.from_numpy(pv[::-1].copy()))
    prompt = [5, VS] + [IMG] * 6 + [VE, 7]
    got = c.generate(prompt, max_new_tokens=3, images=[flipped]).token_ids
    want = c.generate(prompt, max_new_tokens=3, images=[memra_pp.ImageInput(pv[::-1].copy(), (MyInt(1), 4, 6))])
    assert got == want.token_ids


def test_a_live_actors_task_error_is_refused_not_a_lost_stage(ray_cluster):
    """rayutil.get's `refused`: a live actor whose call raised (not one of ours), or which could not unpickle the
    call's arguments, refused the call: the submit path's InputError; by default still StageFailed (no stage)."""
    from memra_pp.rayutil import get

    class Refuser:      # (local: pickled by value, so the actor's process needs no import of this module)
        def fail(self, x):
            raise NotImplementedError("boom\nsecond line")

        def take(self, x):
            return 1
    a = ray.remote(num_cpus=0.05)(Refuser).remote()
    try:
        with pytest.raises(InputError, match=r"^submit: the actor refused the call: NotImplementedError: boom$"):
            get(a.fail.remote(1), 30, "submit", refused=InputError)
        f8 = torch.zeros(2, dtype=torch.float8_e4m3fn)      # (torch cannot unpickle this in another process)
        with pytest.raises(InputError, match=r"^submit: the actor could not read the call's arguments: "):
            get(a.take.remote(f8), 30, "submit", refused=InputError)
        with pytest.raises(StageFailed) as ei:
            get(a.fail.remote(1), 30, "call")
        assert type(ei.value) is StageFailed and ei.value.stage is None and "boom" in str(ei.value)
        assert get(a.take.remote(1), 30, "submit", refused=InputError) == 1
    finally:
        ray.kill(a)


@pytest.mark.parametrize("recover", ["error", "replay"])
def test_a_request_the_intake_cannot_read_is_refused_at_once(ray_cluster, monkeypatch, recover, request):
    """A request that passes the client's checks and still cannot be read in the intake (here: a value slipped in
    after them) is refused with InputError at once. It used to be taken for the intake's loss: StageFailed with
    recover: error, and with replay the client held it for a recovery that never came, until its timeout.
    (recover: error is the shared 2-stage deployment's own: that one serves it; replay is launched here.)"""
    import contextlib
    import memra_pp.client as client_mod
    _, path = tiny_checkpoint("dense", False)
    real = client_mod.request_dict

    def slipped(kw, **fixed):
        req = real(kw, **fixed)
        if req["prompt"] == [9, 9, 9]:
            req["temperature"] = NotImportableThere()
        return req
    if recover == "error":
        shared = request.getfixturevalue("dep")
        assert shared.placement.recover == "error" and len(shared.actors) == 2
        shared.wait_ready(60)       # (no recovery of another test's under way: its counters stay put)
        launched = contextlib.nullcontext(shared)
    else:
        launched = memra_pp.launch({"name": f"unread-{recover}", "model": {"path": str(path)}, "recover": recover,
                                    "timeouts": {"heartbeat_s": 0.5},
                                    "stages": [{"device": "cpu", "num_cpus": 0.1}] * 2,
                                    "scheduler": {"max_batch": 4, "max_context": CTX}})
    with launched as d:
        g0, n0 = d.supervisor.generation, len(d.supervisor.log)
        monkeypatch.setattr(client_mod, "request_dict", slipped)
        c = d.client()
        t0 = time.monotonic()
        with pytest.raises(InputError, match="submit: the actor could not read the call's arguments: "
                                             "ModuleNotFoundError: No module named 'test_bad_input'"):
            c.generate([9, 9, 9], max_new_tokens=2, timeout=60)
        assert time.monotonic() - t0 < 10, "refused at once, not held until the timeout"
        assert d.supervisor.generation == g0 and not d.supervisor.log[n0:], "no stage was taken for lost"
        assert c.generate([5, 17, 42], max_new_tokens=4).token_ids == hf_reference("dense", False, (5, 17, 42), 4)[0]


def test_run_dir_is_private(dep):
    """The deployment's sockets must live in a 0700 temp dir owned by this user."""
    st = os.stat(dep.run_dir)
    assert stat.S_IMODE(st.st_mode) == 0o700 and st.st_uid == os.getuid()
    assert all(s.startswith("unix:" + dep.run_dir) for s in [dep.infos[0]["ring"], dep.infos[1]["endpoint"]["address"]])


def test_undecodable_slot_header_fails_the_link(dep):
    """A slot header that does not decode must end the receiving stage's link with ProtocolError (named by the
    supervisor), never hang it; the deployment must recover and serve."""
    frame = struct.pack("<I", 4) + b"\xc1\xc1\xc1\xc1"     # 0xc1 is never valid msgpack
    ray.get(dep.actors[0].__ray_call__.remote(lambda self: self.runner.sender._ch._sock.sendall(frame)), timeout=30)
    t0 = time.monotonic()
    while not dep.supervisor.log and time.monotonic() - t0 < 15:
        time.sleep(0.05)
    dep.wait_ready(60)
    log = dep.supervisor.log
    assert log and log[-1]["stage"] == 1 and "ProtocolError" in log[-1]["reason"], log
    assert time.monotonic() - t0 < 30
    serves(dep)


# -- launch-level: files ------------------------------------------------------------------------------------------

def broken_copy(tmp_path, how, layer=0):
    _, path = tiny_checkpoint("dense", False)
    d = tmp_path / how
    shutil.copytree(path, d)
    f = d / "model.safetensors"
    data = f.read_bytes()
    if how == "truncated":
        f.write_bytes(data[:len(data) // 2])
    elif how == "header":
        f.write_bytes(data[:8] + b"{not json" + data[17:])
    elif how == "shape":          # a valid file whose tensor has the wrong shape: found inside the stage actor
        from safetensors.torch import load_file, save_file
        sd = load_file(f)
        sd[f"model.language_model.layers.{layer}.input_layernorm.weight"] = torch.ones(7)
        save_file(sd, f)
    return d, f


@pytest.mark.parametrize("how", ["truncated", "header"])
def test_corrupt_safetensors(ray_cluster, tmp_path, how):
    """A truncated or corrupt safetensors file must give ConfigError naming the file (launch reads the header
    itself, before it makes any stage actor)."""
    d, f = broken_copy(tmp_path, how)
    with pytest.raises(ConfigError, match=str(f)):
        memra_pp.launch({"name": "badst", "model": {"path": str(d)}, "stages": [{"device": "cpu"}]})


@pytest.mark.parametrize("cut", [0.5, 0.02])
def test_corrupt_gguf(tmp_path, cut):
    """A truncated GGUF file, or one with its tensor data cut, must give ConfigError naming the file."""
    src = os.path.join(FIXTURES, "dense_text-f32.gguf")
    f = tmp_path / "cut.gguf"
    data = open(src, "rb").read()
    f.write_bytes(data[:int(len(data) * cut)])
    with pytest.raises(ConfigError, match=str(f)):
        memra_pp.launch({"name": "badgg", "model": {"path": str(f)}, "stages": [{"device": "cpu"}]})


def test_malformed_yaml(tmp_path):
    """Malformed YAML must give ConfigError naming the file, before Ray is touched."""
    f = tmp_path / "bad.yaml"
    f.write_text("name: x\nstages: [ {device: cpu\n")
    with pytest.raises(ConfigError, match=re.escape(str(f)) + r":3:1: not valid YAML: ") as e:
        memra_pp.launch(str(f))
    # one line, naming the file's line and column (PyYAML's own text ran to four lines, at "<unicode string>")
    f.write_text("name: x\nstages:\n\t- {device: cpu}\n")
    with pytest.raises(ConfigError) as e:
        memra_pp.launch(str(f))
    assert "\n" not in str(e.value) and "<unicode string>" not in str(e.value), str(e.value)
    assert str(e.value).startswith(f"{f}:3:1: not valid YAML: ") and "'\\t'" in str(e.value), str(e.value)


def test_a_device_this_host_lacks_is_refused_before_ray(monkeypatch):
    """A placement naming a CUDA device this host does not have (here: none; on a GPU host one past the last) must
    give ConfigError naming the stage and the device before Ray starts: the stage's Engine used to fail inside
    torch (AttributeError on a CPU build) after Ray and the actors were up. Engine refuses it the same way."""
    import torch
    from memra_pp.deployment import Deployment
    from memra_pp.engine import Engine
    missing = torch.cuda.device_count() if torch.cuda.is_available() else 0

    def no_ray(*a, **k):
        raise AssertionError("Ray work began before the devices were checked")
    monkeypatch.setattr(ray, "init", no_ray)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)    # as in a fresh process: launch would start Ray
    monkeypatch.setattr(Deployment, "_make_actor", staticmethod(no_ray))
    cfg = {"name": "nodev", "model": {"path": "preset:qwen3.5-27b", "format": "dummy"},
           "stages": [{"device": "cpu"}, {"device": f"cuda:{missing}"}]}
    with pytest.raises(ConfigError, match=rf"stages\[1\].device: device 'cuda:{missing}': this process sees "
                                          rf"{missing} CUDA device\(s\)"):
        memra_pp.launch(cfg)
    with pytest.raises(ConfigError, match=rf"device 'cuda:{missing}': this process sees {missing} CUDA"):
        Engine(f"cuda:{missing}")


def test_stages_no_node_can_hold_are_refused_at_once(ray_cluster):
    """Stages whose CPUs no node of the cluster has (one placement group packed on one node: this cluster has 2)
    are refused at once with a ConfigError naming num_cpus and both sizes; pg.ready() waited timeouts.ready_s (300 s
    by default) and said only "placement group: no answer". No placement group, no actor is left."""
    from ray.util import placement_group_table
    _, path = tiny_checkpoint("dense", False)
    before = {k for k, v in placement_group_table().items() if v.get("state") != "REMOVED"}
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=r"stages\[\*\]\.num_cpus: the stages need 8.5 CPUs on one node "
                                          r"\(stages\[0\] 8, stages\[1\] 0.5\), and the largest node of this Ray "
                                          r"cluster has 2; lower"):
        memra_pp.launch({"name": "toobig", "model": {"path": str(path)}, "timeouts": {"ready_s": 60},
                         "stages": [{"device": "cpu", "num_cpus": 8}, {"device": "cpu"}]})
    assert time.monotonic() - t0 < 10
    assert {k for k, v in placement_group_table().items() if v.get("state") != "REMOVED"} == before
    for i in range(2):
        with pytest.raises(ValueError):
            ray.get_actor(f"toobig.stage{i}")


def test_bad_tensor_inside_a_stage_leaves_no_actor(ray_cluster, tmp_path):
    """A checkpoint that fails in a stage actor's load must raise ConfigError from launch and leave no actor of
    the deployment alive (Ray was already up, so it stays up), and no shared-memory segment. The last of three
    stages holds the bad tensor, so the middle one (whose setup launch waits for first) has made its receiving
    slots before the failure: they must be gone too (memra_pp/shm.unlink_shm_of; test_shm_cleanup)."""
    import glob
    from memra_pp.model.weights import open_weights
    before = set(glob.glob("/dev/shm/mpp*"))
    _, good = tiny_checkpoint("dense", False)
    last = open_weights(str(good), "safetensors").config.text.num_hidden_layers - 1
    d, _ = broken_copy(tmp_path, "shape", layer=last)
    made, stop = set(), threading.Event()

    def watch():                    # the segments that exist at some moment of the launch
        while not stop.is_set():
            made.update(set(glob.glob("/dev/shm/mpp*")) - before)
            time.sleep(0.002)
    for _ in range(4):  # the stages load side by side: the middle one is usually, not always, past its setup
        stop.clear()
        w = threading.Thread(target=watch, daemon=True)
        w.start()
        try:
            with pytest.raises(ConfigError, match=f"layers.{last}.input_layernorm.weight' has shape"):
                memra_pp.launch({"name": "badshape", "model": {"path": str(d)},
                                 "stages": [{"device": "cpu", "num_cpus": 0.1}] * 3}, detached=True)
        finally:
            stop.set()
            w.join(5)
        assert ray.is_initialized()
        for i in range(3):
            with pytest.raises(ValueError):
                ray.get_actor(f"badshape.stage{i}")
        assert set(glob.glob("/dev/shm/mpp*")) - before == set(), made
        if made:
            break
    assert made, "no stage made its slots before the failure in 4 launches: the check above passed vacuously"


def test_failed_launch_stops_the_ray_it_started(tmp_path):
    """When launch itself started Ray and a stage fails to load, Ray must be shut down again."""
    d, _ = broken_copy(tmp_path, "shape")
    code = textwrap.dedent(f"""
        import ray, memra_pp
        try:
            memra_pp.launch({{"name": "x", "model": {{"path": {str(d)!r}}}, "stages": [{{"device": "cpu"}}]}})
        except memra_pp.ConfigError as e:
            print("CONFIGERROR", "has shape" in str(e), ray.is_initialized())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "RAY_ADDRESS": ""})
    assert "CONFIGERROR True False" in out.stdout, out.stdout + out.stderr[-2000:]


def test_a_closed_client_ends_its_requests_with_stage_failed(dep):
    """A request in flight when its client is closed (shutdown closes every client) must end with StageFailed, a
    MemraError (callers catch one base), before its budget is spent; the intake must drop it and the deployment
    must serve. (StageFailed naming a lost stage's index is provoked by test_reliability.py's stage kills.)"""
    def pages():
        return [s["kv_pages_free"] for s in dep.stats()["stages"]]
    # a finished request's pages come back with the next step's release (stage_model: cache.release(b.release)),
    # so between requests the last one's pages are still out: count after a served one, compare after another
    serves(dep)
    free = pages()
    c = dep.client()
    it = c.stream([5, 17, 42], max_new_tokens=CTX - 3, ignore_eos=True)
    got = list(next(it).token_ids)
    c.close()
    with pytest.raises(StageFailed, match="the client was closed") as ei:
        for ev in it:
            got += ev.token_ids
    assert isinstance(ei.value, memra_pp.MemraError) and len(got) < CTX - 3, (ei.value, len(got))
    serves(dep)
    assert pages() == free, "the dropped request's KV pages did not come back"


def test_a_cancelled_agenerate_is_aborted(dep):
    """An agenerate whose task is cancelled (asyncio.wait_for's timeout, a cancelled gather) must abort its request,
    also when the cancellation comes while its submit still runs in the executor: untracked by the client, its KV
    pages back at the intake, the deployment serving."""
    import asyncio

    def pages():
        return [s["kv_pages_free"] for s in dep.stats()["stages"]]
    serves(dep)
    free = pages()
    c = dep.client()

    async def go(decoding: bool):
        task = asyncio.ensure_future(c.agenerate([5, 17, 42], max_new_tokens=CTX - 3, ignore_eos=True))
        while not c._tracks and not task.done():     # tracked: its submit is running or done
            await asyncio.sleep(0.001)
        while decoding and not task.done() and not any(t.tokens for t in list(c._tracks.values())):
            await asyncio.sleep(0.001)      # its first tokens reached the client: it is decoding now
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            return True
        return False
    for decoding in (False, True):          # at once (the submit likely still running), then while it decodes
        before = aborted(dep)
        # a fast machine may decode all CTX - 3 tokens between two polls of the client: then try again
        ran = any(asyncio.run(go(decoding)) for _ in range(3))
        assert ran, "the agenerate finished before it was cancelled, three times: the test ran nothing"
        assert untracked(c), f"a cancelled agenerate's request is still tracked (decoding: {decoding})"
        # the intake's scheduler found the request and dropped it (not merely the client forgetting it)
        assert aborted(dep, above=before) > before, f"no abort reached the intake (decoding: {decoding})"
        serves(dep)
        assert pages() == free, f"the cancelled request's KV pages did not come back (decoding: {decoding})"


def test_unknown_keyword_refused_before_submit(dep):
    """generate, stream and agenerate must refuse an unknown keyword (a typo such as `temprature`) with InputError
    before anything reaches the deployment, and the deployment must keep serving."""
    import asyncio
    c = dep.client()
    with pytest.raises(InputError, match=r"unknown keyword arguments \['temprature'\]"):
        c.generate([5, 17], max_new_tokens=2, temprature=0.5)
    with pytest.raises(InputError, match=r"\['max_new_token'\]; known: .*'max_new_tokens'") as ei:
        c.generate([5, 17], max_new_token=2)
    assert all(f"'{k}'" in str(ei.value) for k in ("logprobs", "timeout", "temperature", "images")), ei.value
    with pytest.raises(InputError, match=r"unknown keyword arguments \['temprature'\]"):
        c.stream([5, 17], max_new_tokens=2, temprature=0.5)      # at the call, not at the first next()
    with pytest.raises(InputError, match=r"unknown keyword arguments \['temprature'\]"):
        asyncio.run(c.agenerate([5, 17], max_new_tokens=2, temprature=0.5))
    serves(dep)


def test_a_bad_request_does_not_fail_the_requests_beside_it(dep):
    """A request refused at submit must leave the requests already running untouched: a seed of a wrong type used
    to pass the intake and fail in the last stage's sampler, taking every request of its batch with it; a seed or
    top_k past 64 bits passed too and killed the intake's loop (the boundary header cannot carry it)."""
    import asyncio
    c = dep.client()
    ref = hf_reference("dense", False, (5, 17, 42), 40)[0]

    async def go():
        goods = [asyncio.ensure_future(c.agenerate([5, 17, 42], max_new_tokens=40, ignore_eos=True))
                 for _ in range(3)]
        await asyncio.sleep(0.3)
        bad = await asyncio.gather(*[c.agenerate([1, 2, 3], max_new_tokens=8, temperature=1.0, seed=s)
                                     for s in ("7", 1.5, 2 ** 64)], return_exceptions=True)
        huge_k = await c.agenerate([5, 17, 42], max_new_tokens=8, temperature=1.0, top_k=2 ** 64, seed=3)
        return await asyncio.gather(*goods), bad, huge_k
    goods, bad, huge_k = asyncio.run(go())
    assert [type(e) for e in bad] == [InputError] * 3, bad
    assert "seed must be an integer" in str(bad[0]) and "seed must be an integer" in str(bad[1])
    assert "seed must fit in a signed 64-bit integer" in str(bad[2])
    assert [r.token_ids for r in goods] == [ref] * 3
    # a top_k past any vocabulary keeps every token: the same draw as no top_k (it too killed the intake's loop)
    assert huge_k.token_ids == c.generate([5, 17, 42], max_new_tokens=8, temperature=1.0, seed=3).token_ids


def test_after_shutdown_every_call_is_refused_and_shutdown_repeats(ray_cluster):
    """Once shut down, a deployment and its clients refuse every call with StageFailed (before, a call made Ray
    start a new local cluster to look for the killed actors, then raised a bare Exception), and a second shutdown
    does nothing."""
    import asyncio
    _, path = tiny_checkpoint("dense", False)
    d = memra_pp.launch({"name": "down", "model": {"path": str(path)}, "stages": [{"device": "cpu", "num_cpus": 0.1}],
                         "scheduler": {"max_batch": 2, "max_context": CTX}})
    c = d.client()
    assert c.generate([5, 17], max_new_tokens=2).token_ids
    d.shutdown()
    for call in (lambda: c.generate([5, 17], max_new_tokens=2), lambda: c.stream([5, 17]),
                 lambda: asyncio.run(c.agenerate([5, 17]))):
        with pytest.raises(StageFailed, match="this client was closed"):
            call()
    for name, call in (("client", d.client), ("stats", d.stats), ("wait_ready", d.wait_ready),
                       ("load_adapter", lambda: d.load_adapter("a", "/nowhere"))):
        with pytest.raises(StageFailed, match=f"{name}: the deployment 'down' was shut down"):
            call()
    d.shutdown()
    assert ray.is_initialized()      # the session's cluster: the deployment did not start it, nor stop it


def test_a_second_detached_deployment_of_one_name_is_refused(ray_cluster):
    """Launching detached under a name a running deployment holds is a ConfigError naming it (Ray's own refusal
    was a raw ActorAlreadyExistsError saying namespace=None); the first keeps serving."""
    _, path = tiny_checkpoint("dense", False)
    cfg = {"name": "twice", "model": {"path": str(path)}, "stages": [{"device": "cpu", "num_cpus": 0.1}],
           "scheduler": {"max_batch": 2, "max_context": CTX}}
    d = memra_pp.launch(cfg, detached=True)
    try:
        with pytest.raises(ConfigError, match="name: a deployment named 'twice' is already running in namespace "
                                              f"'{ray.get_runtime_context().namespace}'; stop it"):
            memra_pp.launch(cfg, detached=True)
        assert d.client().generate([5, 17, 42], max_new_tokens=4).token_ids == \
            hf_reference("dense", False, (5, 17, 42), 4)[0]
    finally:
        d.shutdown()


def test_launch_refuses_what_is_not_a_placement():
    """A placement is a path or a dict; anything else is a ConfigError, not a TypeError from pathlib."""
    with pytest.raises(ConfigError, match="a placement is a YAML file's path or a dict of placement keys, got list"):
        memra_pp.launch(["x"])


def test_adapter_names_are_non_empty_strings(dep):
    """load_adapter refuses a name that is not a non-empty string before any stage work (None used to be loaded
    into a slot and then broke the unknown-adapter message for every later request)."""
    for name in (None, 5, ""):
        with pytest.raises(InputError, match="an adapter's name is 1 to 128 printable characters"):
            dep.load_adapter(name, "/nowhere")
    with pytest.raises(InputError, match="unknown adapter 'typo'; loaded: \\[\\]"):
        dep.client().generate([5, 17], max_new_tokens=2, adapter="typo")
    serves(dep)


def test_timeouts_and_keyword_only_arguments(dep):
    """timeout=0 means no wait (it used to mean the default); stream and agenerate take generate's keywords by
    name only past max_new_tokens, so a positional temperature is never read as logprobs."""
    import asyncio
    c = dep.client()
    with pytest.raises(memra_pp.RequestTimeout, match="produced nothing for 0 s") as ei:
        c.generate([5, 17, 42], max_new_tokens=30, timeout=0)
    # one except clause catches every memra_pp error, and the built-in TimeoutError still catches this one
    assert isinstance(ei.value, memra_pp.MemraError) and isinstance(ei.value, TimeoutError), type(ei.value).__mro__
    with pytest.raises(memra_pp.RequestTimeout, match="produced nothing for 0 s"):
        asyncio.run(c.agenerate([5, 17, 42], max_new_tokens=30, timeout=0))
    with pytest.raises(memra_pp.RequestTimeout, match="produced nothing for 0 s"):
        list(c.stream([5, 17, 42], max_new_tokens=30, timeout=0))
    with pytest.raises(TypeError):
        c.stream([5, 17], 4, 0.7)
    assert untracked(c), "a timed-out request is still tracked"
    # no limit: inf (or past Python's longest wait) waits as long as it can, where it raised OverflowError
    ref = hf_reference("dense", False, (5, 17, 42), 4)[0]
    for t in (float("inf"), 1e12):
        assert c.generate([5, 17, 42], max_new_tokens=4, timeout=t).token_ids == ref
        assert [x for e in c.stream([5, 17, 42], max_new_tokens=4, timeout=t) for x in e.token_ids] == ref
    serves(dep)


def aborted(dep, above: int | None = None, wait: float = 5.0) -> int:
    """The intake's count of requests an abort reached; with `above`, waited for (up to `wait` s) to pass it:
    a client sends its abort after it untracks the request."""
    end = time.monotonic() + wait
    while True:
        n = dep.stats()["stages"][0]["aborted"]
        if above is None or n > above or time.monotonic() > end:
            return n
        time.sleep(0.02)


def untracked(c, wait: float = 5.0) -> bool:
    """Whether the client tracks no request, within `wait` seconds: a reader's cleanup runs at once when the
    client's lock is free, else the pump finishes it (Client._let_go)."""
    end = time.monotonic() + wait
    while c._tracks or c._held:
        if time.monotonic() > end:
            return False
        time.sleep(0.01)
    return True


def test_a_stream_is_checked_at_the_call_and_freed_when_dropped(dep):
    """c.stream() must check and submit at the call (bad input raises there, as generate's does, not at the first
    next()); an iterator dropped, closed unread or closed part-way must abort its request, so that the intake frees
    its KV pages, without ever waiting for the client's lock."""

    def pages():
        return [s["kv_pages_free"] for s in dep.stats()["stages"]]
    serves(dep)
    free = pages()
    before = aborted(dep)
    c = dep.client()
    with pytest.raises(InputError, match=f"outside the vocabulary \\[0, {V}\\)"):
        c.stream([5, V])
    assert not c._tracks
    it = c.stream([5, 17, 42], max_new_tokens=CTX - 3, ignore_eos=True)
    assert len(c._tracks) == 1, "stream() must submit at the call"
    del it
    assert untracked(c), "a dropped stream's request is still tracked"
    it = c.stream([5, 17, 42], max_new_tokens=CTX - 3, ignore_eos=True)
    it.close()                  # before any next(): Python 3.12+ does not run an unstarted generator's cleanup
    assert untracked(c), "a stream closed unread is still tracked"
    it = c.stream([5, 17, 42], max_new_tokens=CTX - 3, ignore_eos=True)
    assert len(next(it).token_ids) >= 1
    it.close()
    assert untracked(c), "a closed stream's request is still tracked"
    # a stream in a reference cycle is finalised by the cyclic collector in whatever thread allocates, perhaps
    # one holding the client's lock: its cleanup must not wait for that lock (it did: a deadlock)
    it = c.stream([5, 17, 42], max_new_tokens=CTX - 3, ignore_eos=True)
    cycle = [it]
    cycle.append(cycle)
    del it, cycle

    def collect_under_the_lock():
        with c._lock:
            gc.collect()
    t = threading.Thread(target=collect_under_the_lock, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "a collected stream's cleanup deadlocked on the client's lock"
    assert untracked(c), "the pump did not finish the collected stream's request"
    # all four reached the intake's scheduler as aborts (not merely forgotten by the client)
    assert aborted(dep, above=before + 3) == before + 4, (before, aborted(dep))
    serves(dep)
    assert pages() == free, "the dropped streams' KV pages did not come back"


def test_a_stream_closes_from_another_thread_while_one_reads_it(dep):
    """DESIGN: client calls from any thread. A stream closed by one thread while another waits in next() must end
    that reader's loop (a generator refused: "ValueError: generator already executing", and the request ran to
    its end) and abort the request at the intake."""
    c = dep.client()
    before = aborted(dep)
    it = c.stream([5, 17, 42], max_new_tokens=CTX - 3, ignore_eos=True)
    got, errors, first = [], [], threading.Event()

    def read():
        try:
            for ev in it:
                got.append(ev)
                first.set()
        except BaseException as e:  # noqa: BLE001 - the test reports it
            errors.append(e)
    t = threading.Thread(target=read, daemon=True)
    t.start()
    assert first.wait(30)
    it.close()
    t.join(30)
    assert not t.is_alive() and not errors, errors
    assert sum(len(e.token_ids) for e in got) < CTX - 3 and not any(e.finish_reason for e in got)
    assert untracked(c), "the closed stream's request is still tracked"
    assert aborted(dep, above=before) == before + 1
    assert next(it, None) is None                      # ended for good
    serves(dep)


def test_two_threads_reading_one_stream_share_its_events(dep):
    """DESIGN: client calls from any thread. Two threads iterating one stream must each get some of its events,
    every event once, with no error (the second reader got Python's "ValueError: generator already executing")."""
    c = dep.client()
    n = 40
    it = c.stream([5, 17, 42], max_new_tokens=n, ignore_eos=True)
    got, errors, lock = [], [], threading.Lock()

    def read(who):
        try:
            for ev in it:
                with lock:
                    got.append((who, ev.token_ids, ev.finish_reason))
                time.sleep(0.002)           # (lets the other reader take a turn)
        except BaseException as e:  # noqa: BLE001 - the test reports it
            errors.append(e)
    ts = [threading.Thread(target=read, args=(w,), daemon=True) for w in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors and not any(t.is_alive() for t in ts), errors
    ref = c.generate([5, 17, 42], max_new_tokens=n, ignore_eos=True).token_ids
    assert sorted(t for _, toks, _ in got for t in toks) == sorted(ref)
    assert sum(len(toks) for _, toks, _ in got) == n and [f for _, _, f in got if f] == ["length"]
    assert {w for w, _, _ in got} == {0, 1}, "one reader took every event (the test is vacuous)"
    assert untracked(c)
    serves(dep)


def test_a_closed_client_is_forgotten_by_the_deployment_and_the_intake(dep):
    """Clients closed with requests streaming leave nothing behind: the deployment drops them from its list, and the
    intake drops their mailbox and the events still posted to it (their aborted requests' last events). Before, both
    kept every client ever made: 25 clients closed mid-stream left 26 mailboxes holding 84 events."""
    def mailboxes(want, wait=5.0):
        end = time.monotonic() + wait
        while (n := dep.stats()["stages"][0]["mailboxes"]) != want and time.monotonic() < end:
            time.sleep(0.05)
        return n
    import gc
    serves(dep)
    time.sleep(0.5)                 # the poller lets serves()'s client go once it has nothing: collected, it is
    gc.collect()                    # forgotten at the next client() (and that one at its close)
    dep.client().close()
    time.sleep(0.5)
    base_boxes = dep.stats()["stages"][0]["mailboxes"]
    for _ in range(4):
        c = dep.client()
        it = c.stream([5, 17, 42], max_new_tokens=CTX - 3, ignore_eos=True)
        try:
            assert len(next(it).token_ids) >= 1
            assert c in dep._clients and mailboxes(base_boxes + 1) == base_boxes + 1
        finally:
            c.close()
        with pytest.raises(StageFailed, match="the client was closed"):
            list(it)
        # (a count of dep._clients would race with the collection of earlier clients, which it holds weakly)
        assert c not in dep._clients
    time.sleep(0.5)                 # the aborted requests' last events reach the intake's mailboxes meanwhile
    assert mailboxes(base_boxes) == base_boxes
    serves(dep)


def test_stats_reset_starts_a_new_handoff_window(dep):
    """stats(reset=True) restarts the handoff counters and latencies with the loop's window (busy, microbatches),
    so a benchmark's window does not carry its warm-up's handoffs."""
    serves(dep)
    before = dep.stats(reset=True)["stages"][1]
    assert before["handoffs"] > 0
    after = dep.stats()["stages"][1]
    assert after["handoffs"] == 0 and after["microbatches"] == 0 and after["handoff_p50_us"] == 0.0, after
    serves(dep)
    st = dep.stats()["stages"][1]
    assert st["handoffs"] == st["microbatches"] > 0 and st["handoff_p50_us"] > 0, st   # one handoff a microbatch


def test_stop_ids_add_to_eos_unless_ignore_eos():
    """stop_token_ids end a request in addition to the model's eos (as in vLLM; they used to replace it, so a
    request with a stop id ran on past eos); ignore_eos leaves the stop ids alone."""
    from memra_pp.stages.runner import stop_ids
    assert stop_ids(None, False, (2,), V) == {2}
    assert stop_ids([7, 9], False, (2, 3), V) == {2, 3, 7, 9}
    assert stop_ids([7], True, (2,), V) == {7} and stop_ids(None, True, (2,), V) == frozenset()
    with pytest.raises(InputError, match="stop_token_ids is a list of token ids, got 5"):
        stop_ids(5, False, (2,), V)


def test_numpy_and_torch_values_are_taken_as_python_ones(dep):
    """Token ids, stop ids, max_new_tokens and ignore_eos given as numpy or torch values (arrays, 0-d items,
    numpy ints and bools) are what they say: the same tokens as the Python values."""
    import numpy as np
    c = dep.client()
    ref = c.generate([5, 17, 42], max_new_tokens=6, ignore_eos=True).token_ids
    for prompt in (np.array([5, 17, 42]), torch.tensor([5, 17, 42]), list(torch.tensor([5, 17, 42])),
                   [np.int64(5), np.int32(17), 42], (5, 17, 42)):
        assert c.generate(prompt, max_new_tokens=np.int64(6), ignore_eos=np.True_).token_ids == ref, prompt
    for stops in (np.array([ref[2]]), torch.tensor([ref[2]]), [np.int64(ref[2])], list(torch.tensor([ref[2]]))):
        r = c.generate([5, 17, 42], max_new_tokens=6, stop_token_ids=stops, ignore_eos=True)
        assert r.token_ids == ref[:ref.index(ref[2]) + 1] and r.finish_reason == "stop", (stops, r)
    for bad in ("x", -1.0, True):
        with pytest.raises(InputError, match="timeout is seconds >= 0 or None"):
            c.generate([5, 17], max_new_tokens=2, timeout=bad)


def test_a_replay_may_hold_the_image_placeholder_id(dep):
    """A replayed request's prompt holds the tokens generated before a restart (step0 > 0), which the model may
    have made the image placeholder: only a new request's placeholders need images."""
    from memra_pp.client import REQUEST_DEFAULTS
    req = dict(REQUEST_DEFAULTS, rid="replayed", client="nobody", prompt=[5, VS, IMG, VE, 7], max_new_tokens=1,
               step0=2, images=None)
    ray.get(dep.actors[0].submit.remote(req), timeout=30)          # accepted
    dep.actors[0].abort.remote("replayed")
    with pytest.raises(InputError, match="image or video placeholder"):
        ray.get(dep.actors[0].submit.remote(dict(req, rid="new", step0=0)), timeout=30)
    serves(dep)


def test_a_stop_id_does_not_turn_eos_off(ray_cluster):
    """Seeded sampling at a high temperature until a request draws eos: the same seed with an unrelated stop id
    must end at that eos ('stop'), and with ignore_eos run past it (stop ids used to replace eos). The embedded
    tiny checkpoint has an eos (the shared deployment's model has none), one stage of it."""
    import asyncio
    from memra_pp.defaults import ensure_tiny
    with memra_pp.launch({"name": "eos", "model": {"path": str(ensure_tiny())},
                          "stages": [{"device": "cpu", "num_cpus": 0.1}],
                          "scheduler": {"max_batch": 8, "max_context": 128}}) as d:
        c, eos, n = d.client(), set(d.eos), 100
        assert eos

        async def draws(seeds):
            return await asyncio.gather(*[c.agenerate([5, 17, 42], max_new_tokens=n, temperature=5.0, seed=s,
                                                      ignore_eos=True) for s in seeds])
        # seeds 0..15, a batch (max_batch) at a time: the first seed that reaches eos, as from all 16 at once (a
        # seeded draw is the same whatever runs beside it), without drawing the second batch when the first hit
        hit = None
        for seeds in (range(0, 8), range(8, 16)):
            hit = next(((s, r.token_ids) for s, r in zip(seeds, asyncio.run(draws(seeds)))
                        if eos & set(r.token_ids[:-1])), None)
            if hit is not None:
                break
        assert hit is not None, "no draw reached eos: raise the seeds or the temperature"
        seed, toks = hit
        at = min(i for i, t in enumerate(toks) if t in eos)
        other = next(t for t in range(d.vocab_size) if t not in eos and t not in toks)

        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(2) as pool:     # (independent requests: side by side)
            r, r_ign = pool.map(lambda ie: c.generate([5, 17, 42], max_new_tokens=n, temperature=5.0, seed=seed,
                                                      stop_token_ids=[other], ignore_eos=ie), (False, True))
        assert r.token_ids == toks[:at + 1] and r.finish_reason == "stop", (r, toks, at)
        assert r_ign.token_ids == toks and r_ign.finish_reason == "length"


def test_a_ray_section_an_attached_process_cannot_honour_is_refused(ray_cluster, caplog):
    """DESIGN law 2 (a conformance review found it): in a process already attached to Ray, launch dropped the
    placement's `ray` section silently: a detached deployment's stages were named in the process's namespace, not
    the YAML's (so connect and the CLI with that namespace could not find them), and another cluster's address was
    ignored. Now another namespace, another cluster's address and a listen address are each a ConfigError naming
    the key, before anything starts; this cluster's own GCS address (spelled with loopback) serves, and the default
    namespace of a detached launch serves in the process's with a warning that says where."""
    _, path = tiny_checkpoint("dense", False)
    rc = ray.get_runtime_context()
    here, port = rc.namespace, rc.gcs_address.rsplit(":", 1)[1]
    base = {"model": {"path": str(path)}, "stages": [{"device": "cpu", "num_cpus": 0.1}],
            "scheduler": {"max_batch": 2, "max_context": 64, "prefill_chunk": 16}}
    for section, msg in (
            ({"namespace": "elsewhere"}, f"ray.namespace 'elsewhere': this process is attached to Ray in namespace "
                                         f"{here!r}"),
            ({"address": "127.0.0.1:1"}, "ray.address '127.0.0.1:1': this process is attached to another Ray cluster"),
            ({"listen": "10.1.2.3"}, "ray.listen '10.1.2.3': only a Ray cluster that launch starts takes it")):
        with pytest.raises(ConfigError, match=re.escape(msg)):
            memra_pp.launch({**base, "name": "rayrefused", "ray": section}, detached=True)
        with pytest.raises(ValueError):
            ray.get_actor("rayrefused.stage0")
    assert ray.is_initialized() and ray.get_runtime_context().namespace == here
    with caplog.at_level("WARNING", logger="memra_pp.deployment"):
        d = memra_pp.launch({**base, "name": "rayhere", "ray": {"address": f"127.0.0.1:{port}"}}, detached=True)
    try:
        assert f"attached to Ray in namespace {here!r}, not the default 'memra'" in caplog.text
        ray.get_actor("rayhere.stage0")     # (named where this process is)
        assert len(d.client().generate([5, 17, 42], max_new_tokens=3, ignore_eos=True).token_ids) == 3
    finally:
        d.shutdown()
