"""Bad input through memra_pp.launch: each must end with a typed error naming what was wrong, and the deployment
must serve the next valid request. One 2-stage deployment is shared by the request-level checks; the launch-level
checks (YAML, checkpoints) must leave no actor and, when launch started it, no Ray cluster behind."""
import os
import shutil
import stat
import struct
import subprocess
import sys
import textwrap
import time

import pytest
import ray
import torch

import memra_pp
from conftest_models import hf_reference, tiny_checkpoint
from memra_pp.errors import ConfigError, InputError, StageFailed

FIXTURES = "/work/shared/fixtures/qwen35-tiny/dense_text-s404"
IMG, VS, VE, V, CTX = 300, 302, 303, 320, 64


def image(grid=(1, 4, 6), fill=None, width=96):
    t, h, w = grid
    pv = torch.randn(t * h * w, width, generator=torch.Generator().manual_seed(0))
    if fill is not None:
        pv[3, 5] = fill
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
    "not a prompt": (dict(prompt=3.5), InputError, "a prompt is a string or a list of token ids"),
    "negative max_new_tokens": (dict(max_new_tokens=-2), InputError, "max_new_tokens must be >= 0"),
    "fractional max_new_tokens": (dict(max_new_tokens=2.5), InputError, "max_new_tokens must be an integer"),
    "negative temperature": (dict(temperature=-0.5), InputError, "temperature must be >= 0"),
    "temperature of a wrong type": (dict(temperature="hot"), InputError, "bad sampling parameters"),
    "top_p above 1": (dict(top_p=1.5), InputError, "top_p must be in (0, 1]"),
    "negative top_k": (dict(top_k=-3), InputError, "top_k must be an integer >= 0"),
    "min_p of 1": (dict(min_p=1.0), InputError, "min_p must be in [0, 1)"),
    "unknown adapter": (dict(adapter="nope"), InputError, "unknown adapter 'nope'"),
    "adapter path": (dict(adapter="/tmp/peft_adapter"), InputError, "unknown adapter '/tmp/peft_adapter'"),
    "adapter relative path": (dict(adapter="../adapters/a1"), InputError, "unknown adapter '../adapters/a1'"),
    "placeholder count": (dict(prompt=[5, VS, IMG, IMG, IMG, VE, 7], images=[image()]), InputError,
                          "Attempted to assign"),
    "pixel shape": (dict(prompt=[5, VS, IMG, VE], images=[image(width=95)]), InputError,
                    "pixel_values has shape (24, 95)"),
    "grid": (dict(prompt=[5, VS, IMG, VE], images=[image(grid=(1, 3, 6))]), InputError,
             "multiples of spatial_merge_size"),
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

def broken_copy(tmp_path, how):
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
        sd["model.language_model.layers.0.input_layernorm.weight"] = torch.ones(7)
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
    with pytest.raises(ConfigError, match=f"{f}: not valid YAML"):
        memra_pp.launch(str(f))


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
    monkeypatch.setattr(Deployment, "_make_actor", staticmethod(no_ray))
    cfg = {"name": "nodev", "model": {"path": "preset:qwen3.5-27b", "format": "dummy"},
           "stages": [{"device": "cpu"}, {"device": f"cuda:{missing}"}]}
    with pytest.raises(ConfigError, match=rf"stages\[1\].device: device 'cuda:{missing}': this process sees "
                                          rf"{missing} CUDA device\(s\)"):
        memra_pp.launch(cfg)
    with pytest.raises(ConfigError, match=rf"device 'cuda:{missing}': this process sees {missing} CUDA"):
        Engine(f"cuda:{missing}")


def test_bad_tensor_inside_a_stage_leaves_no_actor(ray_cluster, tmp_path):
    """A checkpoint that fails in a stage actor's load must raise ConfigError from launch and leave no actor of
    the deployment alive (Ray was already up, so it stays up)."""
    d, _ = broken_copy(tmp_path, "shape")
    with pytest.raises(ConfigError, match="input_layernorm.weight' has shape"):
        memra_pp.launch({"name": "badshape", "model": {"path": str(d)}, "stages": [{"device": "cpu"}] * 2},
                        detached=True)
    assert ray.is_initialized()
    for i in range(2):
        with pytest.raises(ValueError):
            ray.get_actor(f"badshape.stage{i}")


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
    it = c.stream([5, 17, 42], max_new_tokens=CTX - 3, stop_token_ids=[])
    got = list(next(it).token_ids)
    c.close()
    with pytest.raises(StageFailed, match="the client was closed") as ei:
        for ev in it:
            got += ev.token_ids
    assert isinstance(ei.value, memra_pp.MemraError) and len(got) < CTX - 3, (ei.value, len(got))
    serves(dep)
    assert pages() == free, "the dropped request's KV pages did not come back"


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
        next(iter(c.stream([5, 17], max_new_tokens=2, temprature=0.5)))
    with pytest.raises(InputError, match=r"unknown keyword arguments \['temprature'\]"):
        asyncio.run(c.agenerate([5, 17], max_new_tokens=2, temprature=0.5))
    serves(dep)
