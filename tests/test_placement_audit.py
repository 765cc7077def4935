"""Placement audit: YAML merge keys, bounded refusal messages, numbers YAML reads as text, Ray's smallest CPU
fraction, the transport warning on boundaries that all touch a cpu stage, a model file given as the placement, and
model.path as a Path."""
import time

import pytest

from memra_pp.errors import ConfigError
from memra_pp.model.config import parse_config
from memra_pp.placement import load_placement, make_plan

TINY = dict(model_type="qwen3_5_text", vocab_size=512, hidden_size=64, num_hidden_layers=6, intermediate_size=128,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
            layer_types=["linear_attention"] * 3 + ["full_attention", "linear_attention", "full_attention"],
            rope_parameters={"mrope_section": [2, 1, 1]})


def _file(tmp_path, text):
    f = tmp_path / "p.yaml"
    f.write_text(text)
    return f


def test_yaml_merge_keys_load_as_safe_load_reads_them(tmp_path):
    """A stage written as '<<: *anchor' plus overrides must load as yaml.safe_load reads it (the duplicate-key
    loader refused every merge key: 'could not determine a constructor for the tag ...merge'); a key given twice
    beside a merge must still be refused."""
    f = _file(tmp_path, "stages:\n  - &gpu {device: 'cuda:0', num_cpus: 2, threads: 4}\n"
                        "  - {<<: *gpu, device: 'cuda:1'}\n  - {<<: [*gpu], threads: 1}\n")
    p = load_placement(f)
    assert [(s.device, s.num_cpus, s.threads) for s in p.stages] == [
        ("cuda:0", 2.0, 4), ("cuda:1", 2.0, 4), ("cuda:0", 2.0, 1)]
    f = _file(tmp_path, "stages:\n  - &c {device: cpu}\n  - {<<: *c, threads: 2, threads: 3}\n")
    with pytest.raises(ConfigError, match=r"not valid YAML: duplicate key 'threads'"):
        load_placement(f)


def test_a_refused_value_built_from_aliases_is_shown_bounded(tmp_path):
    """A few hundred bytes of YAML whose aliases nest lists ten wide must be refused at once with a short message:
    the value's full repr (10**7 items here, 10**9 at two more levels) made a message of tens of megabytes, and
    gigabytes (minutes, then out of memory) at two more levels."""
    items = ["&l0 [x, x, x, x, x, x, x, x, x, x]"] + [
        f"&l{i} [" + ", ".join([f"*l{i - 1}"] * 10) + "]" for i in range(1, 7)]
    for key in ("name", "transport", "vision: {engine", "stages: [{device: cpu, layers"):
        close = "}" * key.count("{") + "]" * key.count("[")
        head = "" if key.startswith("stages") else "stages: [{device: cpu}]\n"
        f = _file(tmp_path, f"{head}{key}: [{', '.join(items)}]{close}\n")
        t = time.monotonic()
        with pytest.raises(ConfigError) as e:
            load_placement(f)
        assert len(str(e.value)) < 2000 and time.monotonic() - t < 5, (key, len(str(e.value)))
        assert "[['x', 'x'," in str(e.value) and "[...], ...]" in str(e.value), str(e.value)[:300]


@pytest.mark.parametrize("text,msg", [
    ("timeouts: {step_s: 1e3}", "timeouts.step_s: must be a positive finite number, got '1e3', a string (YAML reads "
                                "1e3 and 1.0e3 as text: write 1000 or 1.0e+3)"),
    ("scheduler: {max_context: 1.0e4}", "scheduler.max_context: must be an integer >= 1, got '1.0e4', a string "
                                        "(YAML reads 1e3 and 1.0e3 as text: write 1000 or 1.0e+3)"),
    ("scheduler: {max_batch: '32'}", "scheduler.max_batch: must be an integer >= 1, got '32', a string (write the "
                                     "number unquoted)"),
    ("transport_poll_us: 5e2", "transport_poll_us: must be auto or microseconds in [0, 1000000] (0: no mailbox), "
                               "got '5e2', a string (YAML reads 1e3"),
])
def test_a_number_yaml_read_as_text_is_named_as_text(tmp_path, text, msg):
    """A number that YAML 1.1 reads as a string (1e3, 1.0e3, a quoted '32') must be refused saying it is text and how
    to write it: "must be a positive finite number, got '1e3'" read as a contradiction."""
    f = _file(tmp_path, f"stages: [{{device: cpu}}]\n{text}\n")
    with pytest.raises(ConfigError) as e:
        load_placement(f)
    assert str(e.value) == f"{f}: {msg}" or str(e.value).startswith(f"{f}: {msg}"), str(e.value)


def test_a_cpu_reservation_below_rays_resource_unit_is_refused():
    """stages[].num_cpus under Ray's unit (0.0001) must be refused at load with the key: Ray's actor options raise a
    raw ValueError for it only at launch, after the cluster and placement group are up. Ray's own check must agree
    on both sides of the bound."""
    from ray._common.ray_option_utils import _validate_resource_quantity
    with pytest.raises(ConfigError, match=r"^placement: stages\[1\]\.num_cpus: must be at least 0\.0001 \(Ray's "
                                          r"smallest CPU fraction\), got 1e-05$"):
        load_placement({"stages": [{"device": "cpu"}, {"device": "cpu", "num_cpus": 0.00001}]})
    assert _validate_resource_quantity("num_cpus", 0.00001) is not None
    assert load_placement({"stages": [{"device": "cpu", "num_cpus": 0.0001}]}).stages[0].num_cpus == 0.0001
    assert _validate_resource_quantity("num_cpus", 0.0001) is None


@pytest.mark.parametrize("stages,warns", [
    (["cuda:0", "cpu"], True),
    (["cuda:0", "cpu", "cuda:1"], True),
    (["cpu", "cuda:0", "cpu", "cuda:1"], True),
    (["cuda:0", "cuda:1", "cpu"], False),       # boundary 0 is cuda to cuda: the transport applies there
])
def test_transport_warns_when_no_boundary_is_cuda_to_cuda(stages, warns):
    """transport: host | peer must warn when every boundary has a cpu stage on one side (Deployment._transports
    gives those shared-memory slots whatever is asked), not only when every stage is on cpu."""
    p = load_placement({"model": {"path": "/m", "format": "dummy"}, "transport": "host",
                        "stages": [{"device": d} for d in stages]})
    w = make_plan(p, parse_config(TINY)).warnings
    want = ("transport: host has no effect: every stage boundary has a cpu stage on one side, so boundaries use CPU "
            "shared-memory slots")
    assert w == ((want,) if warns else ()), w


def test_a_model_file_given_as_the_placement_is_refused_before_it_is_read(tmp_path):
    """A file far larger than any placement YAML (a checkpoint passed by mistake: `memra-pp plan model.safetensors`)
    must be refused from its size, naming model.path, not read whole into memory and then parsed or decoded; a large
    but plausible YAML still loads."""
    f = tmp_path / "model.safetensors"
    with open(f, "wb") as fh:
        fh.write(b"stages: [{device: cpu}]\n# " + b"x" * (2 ** 20) + b"\n")
    with pytest.raises(ConfigError, match=rf"^{f}: cannot read the placement file \({2 ** 20 + 27} bytes; a placement "
                                          r"YAML is at most 1048576 bytes\): is it a model file\? That goes in "
                                          r"model.path$"):
        load_placement(f)
    f.write_bytes(b"stages: [{device: cpu}]\n# " + b"x" * 100_000 + b"\n")
    assert load_placement(f).stages[0].device == "cpu"


def test_a_model_path_given_as_a_path_object_loads():
    """A placement dict built in Python with model.path a pathlib.Path (what ModelSpec.path itself holds, and what
    load_placement accepts for the file) must load like the same path as a string; it was refused as "must be a
    non-empty string, got PosixPath(...)"."""
    from pathlib import Path
    for given in (Path("~/ckpt"), Path("/m/ckpt")):
        p = load_placement({"stages": [{"device": "cpu"}], "model": {"path": given}})
        assert p == load_placement({"stages": [{"device": "cpu"}], "model": {"path": str(given)}})
        assert p.model.path == given.expanduser() and load_placement(p.to_dict()) == p
    with pytest.raises(ConfigError, match=r"^placement: model\.path: must be a non-empty string, got b'/m'$"):
        load_placement({"stages": [{"device": "cpu"}], "model": {"path": b"/m"}})


def test_a_relative_model_path_is_made_absolute_where_the_placement_is_loaded(tmp_path, monkeypatch):
    """A relative model.path was kept relative and read from each process's own working directory: a stage on an
    existing cluster, or a client connecting from elsewhere (its tokenizer), read another path. It is made absolute
    where the placement is loaded, and survives to_dict; presets and absolute paths stay as given."""
    monkeypatch.chdir(tmp_path)
    p = load_placement({"model": {"path": "ckpt/m", "format": "dummy"}, "stages": [{"device": "cpu"}]})
    assert p.model.path == tmp_path / "ckpt" / "m"
    monkeypatch.chdir("/")
    assert load_placement(p.to_dict()) == p
    cpu = [{"device": "cpu"}]
    assert str(load_placement({"model": {"path": "preset:qwen3.5-27b"}, "stages": cpu}).model.path) == \
        "preset:qwen3.5-27b"
    assert load_placement({"model": {"path": "/abs/m"}, "stages": cpu}).model.path.as_posix() == "/abs/m"


def test_scheduler_auto_spellings_and_bounded_messages():
    """microbatches: ~ is auto as kv_pages: ~ and pipeline_chunks: ~ are (it was refused); the scheduler's own
    refusals show a value built from aliases bounded, and a number YAML read as text as text."""
    cpu = [{"device": "cpu"}]
    assert load_placement({"scheduler": {"microbatches": None}, "stages": cpu}).scheduler.microbatches is None
    nested = [[1] * 100] * 100
    for key in ("microbatches", "pipeline_chunks", "prefill_chunk_decoding"):
        with pytest.raises(ConfigError, match=f"scheduler.{key}") as e:
            load_placement({"scheduler": {key: nested}, "stages": cpu})
        assert len(str(e.value)) < 600, str(e.value)[:200]
        with pytest.raises(ConfigError, match=r"got '1e3', a string \(YAML reads 1e3"):
            load_placement({"scheduler": {key: "1e3"}, "stages": cpu})
