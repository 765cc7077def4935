"""A review of the forty-second session's change: fla's chunk_h pin and GridPick (the warm-up compiles every
binary a request can meet, in every combination of the switches), launch's refusals in a process attached to Ray
(what names this cluster passes), the GGUF type checks against what gguf's reader really returns. CPU stand-ins
only, no Ray, no GPU."""
import itertools
import types

import pytest

from memra_pp.errors import ConfigError
from memra_pp.model import fla_rule
from test_fla_rule import _Tuner, every_h as _every_h, fake_fla, named as _named


@pytest.mark.parametrize("varlen,grid,kh,gva_ok", [
    (v, g, kh, ok) for v, g, kh, ok in itertools.product((False, True), (False, True), (16, 32), (True, False))
    if not (kh == 32 and not ok)])
def test_warm_up_compiles_every_chunk_h_binary_a_request_can_meet(monkeypatch, varlen, grid, kh, gva_ok):
    """Every combination of pf.VARLEN, gva (found / not / no grouped heads) and MEMRA_PP_CHUNK_H_GRID: each (config,
    varlen?, q heads) a later call can take (its q heads: k_heads under gva, else the value heads; its config: the
    pin, or any GridPick config) was run at warm-up, so no request compiles chunk_h."""
    import torch
    import memra_pp.kernels.fused_decode as fd
    from memra_pp.kernels import prefill as pf
    chunk_h, calls = _Tuner(_every_h()), []
    fake_fla(monkeypatch, chunk_h, calls)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda d: types.SimpleNamespace(multi_processor_count=132))
    monkeypatch.setattr(fd, "l2norm", lambda x: x)
    monkeypatch.setattr(pf, "VARLEN", varlen)
    monkeypatch.setattr(fla_rule, "_WARM", {})
    monkeypatch.setattr(fla_rule, "CHUNK_H_GRID", grid)
    rule = fla_rule.FlaRule()
    monkeypatch.setattr(rule, "_grouped_equals_repeated",
                        lambda kh_, heads, *a: (fla_rule.FlaRule._grouped_equals_repeated(rule, kh_, heads, *a)
                                                and gva_ok))
    rule.warm_up(32, 128, 128, torch.float32, torch.device("cpu"), k_heads=kh)
    compiled = {(v, qh, _named(cs[0])) for _, v, qh, cs in calls}
    qh = kh if rule.gva else 32
    configs = [_named(c) for c in rule._chunk_h.every()] if grid else [(64, 4, 4)]
    need = {(v, qh, c) for v in ((False, True) if varlen else (False,)) for c in configs}
    assert need <= compiled, need - compiled


def test_a_second_rule_without_the_switch_restores_the_pin_and_keeps_every_config(monkeypatch):
    """GridPick made, then a rule made with the switch off (or _pin called again): the pin is back, _memra_all still
    the 12 configs (benchmarks iterate it)."""
    chunk_h, calls = _Tuner(_every_h()), []
    fake_fla(monkeypatch, chunk_h, calls)
    monkeypatch.setattr(fla_rule, "CHUNK_H_GRID", True)
    assert fla_rule.FlaRule()._chunk_h is not None
    monkeypatch.setattr(fla_rule, "CHUNK_H_GRID", False)
    assert fla_rule.FlaRule()._chunk_h is None
    assert [_named(c) for c in chunk_h.configs] == [(64, 4, 4)] and len(chunk_h._memra_all) == 12


def _attached(monkeypatch, namespace: str, gcs: str):
    from memra_pp import deployment
    ctx = types.SimpleNamespace(namespace=namespace, gcs_address=gcs)
    monkeypatch.setattr(deployment.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(deployment.ray, "get_runtime_context", lambda: ctx)
    return deployment


def _placement(ray_section: dict):
    from placement.schema import parse_placement
    return parse_placement({"stages": [{"device": "cpu"}], "ray": ray_section})


def test_attached_launch_takes_addresses_that_name_this_cluster(monkeypatch):
    """Loopback, 'localhost', this host's own name and the GCS's own spelling of this cluster all pass; 'auto' and
    ray:// are not compared; another port is refused."""
    import socket
    dep = _attached(monkeypatch, "memra", "127.0.0.1:6379")
    for addr in ("127.0.0.1:6379", "localhost:6379", f"{socket.gethostname()}:6379", "auto", "ray://127.0.0.1:10001",
                 "local"):
        assert dep.Deployment._ray_up(_placement({"address": addr})) is False, addr
    with pytest.raises(ConfigError, match="another Ray cluster"):
        dep.Deployment._ray_up(_placement({"address": "127.0.0.1:6380"}))


def test_a_second_launch_with_the_listen_its_cluster_was_started_with_is_not_refused(monkeypatch):
    """(Was a defect: a false refusal.) A process launches deployment A from a YAML with `ray.listen: X` (launch
    starts the local cluster advertising X), then, A still up, deployment B from a YAML with the same `ray` section
    (two models from one program; Deployment.shutdown hands cluster ownership to the other live handle, so several
    live launches in one process are a supported flow). B's launch was refused ("only a Ray cluster that launch
    starts takes it"), though launch had started the cluster it would run in with exactly that listen address.
    Modelled here without Ray: the attached cluster's node advertises X; another listen address is still refused."""
    from memra_pp import deployment
    dep = _attached(monkeypatch, "memra", "10.1.2.3:6379")
    import ray
    monkeypatch.setattr(ray.util, "get_node_ip_address", lambda *a, **k: "10.1.2.3", raising=False)
    monkeypatch.setattr(deployment, "log", deployment.log)
    assert dep.Deployment._ray_up(_placement({"listen": "10.1.2.3"})) is False
    with pytest.raises(ConfigError, match=r"ray\.listen '10\.1\.2\.4': only a Ray cluster .*node at 10\.1\.2\.3"):
        dep.Deployment._ray_up(_placement({"listen": "10.1.2.4"}))


@pytest.mark.parametrize("key,value,kind", [
    ("tokenizer.ggml.bos_token_id", 7, "uint32"), ("tokenizer.ggml.add_bos_token", True, "bool")])
def test_gguf_scalars_read_back_as_python_types(tmp_path, key, value, kind):
    """gguf's reader gives plain int / bool (ndarray.tolist) for a UINT32 bos id and a BOOL add_bos_token, and a
    list of int for an INT32 token_type array: from_gguf's isinstance checks take real converters' files."""
    import gguf
    p = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(str(p), "qwen35")
    {"uint32": w.add_uint32, "bool": w.add_bool}[kind](key, value)
    w.add_array("tokenizer.ggml.token_type", [1, 1, 3])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = gguf.GGUFReader(str(p))
    got = r.fields[key].contents()
    assert type(got) is type(value) and got == value
    types_ = r.fields["tokenizer.ggml.token_type"].contents()
    assert all(type(x) is int for x in types_)
