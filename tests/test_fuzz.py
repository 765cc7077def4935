"""Fuzzing the readers of untrusted bytes with hypothesis: the placement loader must give a Placement or ConfigError,
the checkpoint readers (safetensors header, GGUF) a source or ConfigError, the slot header decoder a dict or
ProtocolError; never another exception."""
import json
import shutil
import struct

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings, strategies as st

from memra_pp.errors import ConfigError, ProtocolError
from memra_pp.model.config import load_config
from memra_pp.model.gguf_source import GGUFSource
from memra_pp.model.weights import SafetensorsSource
from memra_pp.placement.schema import load_placement
from memra_pp.stages.header import decode_header, encode_header

FIX = "/work/shared/fixtures/qwen35-tiny/dense_text-s404"
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
KEYS = ["name", "model", "stages", "vision", "scheduler", "adapters", "recover", "ray", "timeouts", "path",
        "format", "dtype", "device", "layers", "num_cpus", "threads", "engine", "max_batch", "microbatches",
        "max_context", "prefill_chunk", "max_loras", "max_rank", "address", "namespace", "listen", "ready_s",
        "step_s", "heartbeat_s", "overlay_publish", "transport", "transport_poll_us", "kv_pages", "bogus"]
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-5, 1 << 40), st.floats(allow_nan=True),
                    st.sampled_from(["cpu", "cuda:0", "cuda:-1", "auto", "replay", "stage:9", "primary", "gguf",
                                     "127.0.0.1", "", "float32", "local"]), st.text(max_size=8))
TREES = st.recursive(SCALARS, lambda kids: st.one_of(
    st.lists(kids, max_size=4), st.dictionaries(st.one_of(st.sampled_from(KEYS), st.integers(0, 3)), kids,
                                                 max_size=5)), max_leaves=20)


def only(errors, fn, *a):
    try:
        return fn(*a)
    except errors:
        return None


@FUZZ
@given(st.dictionaries(st.sampled_from(KEYS), TREES, max_size=6))
def test_placement_dicts(raw):
    """Any dict must load or raise ConfigError."""
    only(ConfigError, load_placement, raw)


@FUZZ
@given(st.one_of(st.text(max_size=200), TREES.map(lambda t: yaml.safe_dump(t, default_flow_style=True))))
def test_placement_text(tmp_path_factory, text):
    """Any YAML text (or non-YAML) in a file must load or raise ConfigError naming the file."""
    f = tmp_path_factory.mktemp("y") / "p.yaml"
    f.write_text(text)
    try:
        load_placement(str(f))
    except ConfigError as e:
        assert str(f) in str(e)


@pytest.fixture(scope="module")
def st_file():
    cfg = load_config(f"{FIX}/hf")
    from safetensors.torch import save
    blob = save({"model.language_model.norm.weight": torch.ones(64),
                 "model.language_model.embed_tokens.weight": torch.zeros(512, 64)})
    return cfg, blob


@FUZZ
@given(st.data())
def test_safetensors_header_mutations(tmp_path_factory, st_file, data):
    """A safetensors file with its length prefix or JSON header mutated, or cut, must give ConfigError or read as
    the file it now is (a mutation can leave a valid file: a byte of the JSON's whitespace, a dtype of the same
    size), never another exception."""
    cfg, blob = st_file
    n = struct.unpack("<Q", blob[:8])[0]
    b = bytearray(blob)
    for _ in range(data.draw(st.integers(1, 4))):
        b[data.draw(st.integers(0, 8 + n - 1))] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        b = b[:data.draw(st.integers(0, len(b)))]
    d = tmp_path_factory.mktemp("st")
    (d / "model.safetensors").write_bytes(bytes(b))
    src = only(ConfigError, SafetensorsSource, d, cfg)
    if src is not None:
        for name in ("norm.weight", "embed_tokens.weight"):
            only(ConfigError, src.get, name, torch.float32, "cpu")


@pytest.fixture(scope="module")
def gguf_bytes():
    return open(f"{FIX}/dense_text-q8_0.gguf", "rb").read()


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_gguf_mutations(tmp_path_factory, gguf_bytes, data):
    """A GGUF file cut anywhere or with bytes of its header / metadata mutated must give ConfigError or read as the
    file it now is (some mutations leave a valid file, and some draws mutate nothing), never another exception."""
    b = bytearray(gguf_bytes)
    for _ in range(data.draw(st.integers(0, 4))):
        b[data.draw(st.integers(0, 8191))] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):
        b = b[:data.draw(st.integers(0, len(b)))]
    f = tmp_path_factory.mktemp("gg") / "m.gguf"
    f.write_bytes(bytes(b))
    src = only(ConfigError, GGUFSource, f)
    if src is not None:
        only(ConfigError, src.get, "embed_tokens.weight", torch.float32, "cpu")


@FUZZ
@given(st.one_of(st.binary(max_size=64), st.builds(
    lambda h, i, v: bytes(h[:i]) + bytes([v]) + bytes(h[i + 1:]),
    st.just(encode_header({"kind": "step", "mb": 3, "slots": [0, 1], "pos": torch.arange(6).view(3, 2)})),
    st.integers(0, 40), st.integers(0, 255))))
def test_slot_header_decoder(b):
    """Any bytes must decode to a dict with the required keys or raise ProtocolError."""
    h = only(ProtocolError, decode_header, b)
    assert h is None or (isinstance(h["kind"], str) and isinstance(h["mb"], int))


def test_fixtures_present():
    """The fuzzers must have their seed files (a missing fixture must fail, not skip)."""
    assert shutil.os.path.exists(f"{FIX}/dense_text-q8_0.gguf") and json.loads(open(f"{FIX}/hf/config.json").read())
