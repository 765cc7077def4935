"""Placement YAML schema: frozen dataclasses, read once (driver process) from a file or dict and validated with key
paths. Nothing past ``load_placement`` sees a dict; the constructors themselves do not validate.
"""
from __future__ import annotations

import dataclasses
import difflib
import ipaddress
import math
import os
import re
import reprlib
import stat
from pathlib import Path
from typing import Any, Mapping

import yaml

from memra_pp.errors import ConfigError

FORMATS = ("auto", "safetensors", "gguf", "dummy")
DTYPES = ("float32", "bfloat16", "float16")
OVERLAY_PUBLISH = ("auto", "force", "never")
TRANSPORTS = ("auto", "peer", "host")
RECOVER = ("error", "replay")
DEFAULT_MODEL_PATH = "~/.cache/memra_pp/tiny-qwen3_5"
_DEVICE = re.compile(r"cpu|cuda:(0|[1-9][0-9]*)")
_STAGE_REF = re.compile(r"stage:(0|[1-9][0-9]*)")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# Upper bounds, far past any real deployment: a larger value is a typo, and past them float() overflows in the
# planner, torch's thread pool crashes, or a wait is longer than Python's waits accept (threading.TIMEOUT_MAX)
MAX_COUNT = 2 ** 31 - 1        # every other count: microbatches, kv_pages, pipeline_chunks, adapters.*
MAX_BATCH = 65536              # scheduler.max_batch: sequences with a cache slot on every stage
MAX_CONTEXT = 2 ** 24          # scheduler.max_context: positions per sequence (Qwen3.5 trains 262144)
MAX_THREADS = 1024             # stages[].threads: torch intra-op threads of one stage
MAX_CPUS = 1024.0              # stages[].num_cpus: Ray CPUs reserved for one stage
MIN_CPUS = 1e-4                # stages[].num_cpus: Ray's resource unit; a smaller reservation is Ray's ValueError
MAX_YAML_BYTES = 2 ** 20       # a placement file: a few hundred bytes written by hand
MAX_TIMEOUT_S = 1e9            # timeouts.*: the longest wait the runtime makes (memra_pp.client.WAIT_MAX_S)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    path: Path = Path(DEFAULT_MODEL_PATH)   # '~' expanded by the loader; existence is the weight loader's check
    format: str = "auto"     # auto picks by the files present; dummy builds random weights from config.json alone
    dtype: str = "float32"   # compute and weight dtype of every stage; one dtype so boundary payloads never convert


@dataclasses.dataclass(frozen=True)
class StageSpec:
    device: str                              # "cpu" or "cuda:N": the stage actor owns this device and one context
    # [start, end), or None = auto: auto stages split, by cost, the layers between their explicit neighbours
    layers: tuple[int, int] | None = None
    num_cpus: float = 0.5    # Ray CPU reservation; 0.5 lets two cpu stages share a core on a small box
    threads: int = 1         # torch intra-op threads; 1 keeps co-located stages from oversubscribing cores

    @property
    def is_cuda(self) -> bool:
        return self.device.startswith("cuda")


@dataclasses.dataclass(frozen=True)
class VisionSpec:
    engine: str = "primary"   # "primary" | "intake" | "stage:N": where the tower runs; primary saves intake memory

    @property
    def stage(self) -> int | None:
        """N of "stage:N", else None."""
        m = _STAGE_REF.fullmatch(self.engine)
        return int(m.group(1)) if m else None


@dataclasses.dataclass(frozen=True)
class SchedulerSpec:
    max_batch: int = 32            # sequences decoded together; bounds the cache slot pools on every stage
    microbatches: int | None = None   # None = auto (the planner resolves it); in flight at once around the ring
    max_context: int = 4096        # prompt + generated tokens per sequence; sizes the KV caches
    prefill_chunk: int = 512       # prompt tokens per prefill step; bounds activation memory, any positive size
    # KV pages (64 positions each) the sequences may hold at once on every stage; None = auto: what the fullest
    # stage's memory holds (beside its headroom). Requests wait for pages at admission instead of failing mid-step
    kv_pages: int | None = None
    # the most pieces a prompt alone in the deployment is cut into, so that they pipeline across the stages (time to
    # first token); None = auto: 8 per stage beyond the first (memra_pp.scheduler.auto_pipeline_chunks); 1 = off.
    # No piece is below prefill_chunk / 8; one stage or one microbatch: no pieces (Scheduler.piece)
    pipeline_chunks: int | None = None
    # prompt tokens per microbatch while any admitted request is decoding (None = off: prefill_chunk throughout).
    # A step's prompt tokens are what a decoding request's next token waits for: a smaller budget while some decode
    # bounds their inter-token latency, and prompts that arrive with nobody decoding still take prefill_chunk
    # (Sarathi-Serve's stall-free batching; vLLM's max_num_batched_tokens is one budget for both)
    prefill_chunk_decoding: int | None = None


@dataclasses.dataclass(frozen=True)
class AdapterSpec:
    max_loras: int = 4     # adapter slots resident at once; sizes the TokenOverlaySet and LoRA buffers
    max_rank: int = 64     # largest LoRA rank a slot accepts; buffers are preallocated at this rank


@dataclasses.dataclass(frozen=True)
class RaySpec:
    address: str = "local"        # "local" starts a private Ray; anything else is passed to ray.init(address=)
    namespace: str = "memra"      # Ray namespace, so connect(name) finds detached deployments
    # the node IP a local cluster advertises (ray.init's node IP). Not a network boundary: Ray 2.60 maps loopback to
    # this host's reachable address and binds its own servers on every interface whatever is given (its token
    # authentication guards them); the stages' own sockets are Unix sockets in a private directory or loopback TCP
    listen: str = "127.0.0.1"


@dataclasses.dataclass(frozen=True)
class TimeoutSpec:
    ready_s: float = 300.0     # every stage must report ready within this (weights load, kernels compile)
    step_s: float = 60.0       # one cross-actor wait; a stage silent longer is declared failed (StageFailed)
    heartbeat_s: float = 2.0   # heartbeat period; a stage missing several is declared failed


@dataclasses.dataclass(frozen=True)
class Placement:
    """A validated placement: build it with ``load_placement``; ship it to actors as ``to_dict()``."""
    stages: tuple[StageSpec, ...]
    name: str = "memra"
    model: ModelSpec = ModelSpec()
    vision: VisionSpec = VisionSpec()
    overlay_publish: str = "auto"   # auto | force | never; resolved to OverlayPublish by memra_pp.overlay
    transport: str = "auto"         # auto | peer (CUDA IPC) | host (pinned host bounce) for GPU boundary slots
    # how long a boundary receiver polls its shared-memory header mailbox before it sleeps in the socket (a kernel
    # wake-up costs 20-30 us); None = auto: 2000 us on GPU boundaries, 0 (no mailbox) on CPU ones
    transport_poll_us: float | None = None
    scheduler: SchedulerSpec = SchedulerSpec()
    adapters: AdapterSpec = AdapterSpec()
    recover: str = "error"          # error: a failed stage fails its requests; replay: re-prefill them after restart
    ray: RaySpec = RaySpec()
    timeouts: TimeoutSpec = TimeoutSpec()

    def to_dict(self) -> dict[str, Any]:
        """Plain YAML-able dict; ``load_placement(p.to_dict()) == p``."""
        d = dataclasses.asdict(self)
        d["model"]["path"] = str(self.model.path)
        d["stages"] = [dict(s, layers=list(s["layers"]) if s["layers"] else "auto") for s in d["stages"]]
        d["scheduler"]["microbatches"] = self.scheduler.microbatches or "auto"
        d["scheduler"]["kv_pages"] = "auto" if self.scheduler.kv_pages is None else self.scheduler.kv_pages
        pc = self.scheduler.pipeline_chunks
        d["scheduler"]["pipeline_chunks"] = "auto" if pc is None else pc
        pd = self.scheduler.prefill_chunk_decoding
        d["scheduler"]["prefill_chunk_decoding"] = "off" if pd is None else pd
        d["transport_poll_us"] = "auto" if self.transport_poll_us is None else self.transport_poll_us
        return d


# --- readers: each refuses with the key path and what would be accepted ----------------------------------------

def _bad(path: str, msg: str) -> ConfigError:
    return ConfigError(f"{path}: {msg}")


# a refused value's repr, bounded: a YAML of a few hundred bytes whose aliases nest lists in lists expands to a repr
# of gigabytes (ten levels of ten aliases); numbers and short strings print whole
_SHOW = reprlib.Repr()
_SHOW.maxlevel, _SHOW.maxstring, _SHOW.maxother, _SHOW.maxlong = 2, 200, 200, 5000
_SHOW.maxlist = _SHOW.maxtuple = _SHOW.maxdict = _SHOW.maxset = _SHOW.maxfrozenset = 8


def _got(v: Any, number: bool = False) -> str:
    """The refused value for a message. Where a number was wanted, a number that reached us as text says so: YAML 1.1
    (PyYAML) reads an exponent without a dot and sign (1e3, 1.0e3) as a string, and "must be a number, got '1e3'"
    misleads."""
    shown = _SHOW.repr(v)
    if number and isinstance(v, str):
        try:
            if not math.isfinite(float(v)):
                return shown
        except ValueError:
            return shown
        if "e" in v.lower():
            return f"{shown}, a string (YAML reads 1e3 and 1.0e3 as text: write 1000 or 1.0e+3)"
        return f"{shown}, a string (write the number unquoted)"
    return shown


def _mapping(raw: Any, path: str, cls) -> dict:
    """The section as a dict; refuses a non-mapping and unknown keys (with a close match when there is one)."""
    if raw is None:
        return {}
    if not isinstance(raw, Mapping):
        raise _bad(path or "placement", f"must be a mapping, got {_got(raw)}")
    names = [f.name for f in dataclasses.fields(cls)]
    for k in raw:
        if k not in names:
            near = difflib.get_close_matches(str(k), names, n=1)
            hint = f"did you mean {near[0]!r}? " if near else ""
            where = f"{path}.{k}" if path else str(k)
            raise _bad(where, f"unknown key {_got(k)}; {hint}accepted keys: {', '.join(names)}")
    return dict(raw)


def _choice(v: Any, path: str, allowed: tuple[str, ...]) -> str:
    if v not in allowed:
        raise _bad(path, f"{_got(v)} is not one of {' | '.join(allowed)}")
    return v


def _int(v: Any, path: str, lo: int = 1, hi: int = MAX_COUNT) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        raise _bad(path, f"must be an integer >= {lo}, got {_got(v, number=True)}")
    if v > hi:
        raise _bad(path, f"must be at most {hi}, got {v!r}")
    return v


def _pos(v: Any, path: str, hi: float) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0 or v == float("inf"):
        raise _bad(path, f"must be a positive finite number, got {_got(v, number=True)}")
    if v > hi:      # (compared before float(): an integer past float range overflows there)
        raise _bad(path, f"must be at most {hi:g}, got {v!r}")
    return float(v)


def _str(v: Any, path: str) -> str:
    if not isinstance(v, str) or not v.strip():
        raise _bad(path, f"must be a non-empty string, got {_got(v)}")
    return v


def _expand(p: str | Path, path: str) -> Path:
    try:
        return Path(p).expanduser()
    except RuntimeError:        # '~user' of no such user, or no home directory to expand '~' to
        raise _bad(path, f"{str(p)!r}: cannot expand '~' (no such user or no home directory); give the path "
                         "without it") from None


def _model(raw: Any) -> ModelSpec:
    d = _mapping(raw, "model", ModelSpec)
    path = d.get("path", DEFAULT_MODEL_PATH)
    if isinstance(path, os.PathLike):   # a dict built in Python may hold a Path, as ModelSpec itself does
        path = os.fspath(path)
    path = _expand(_str(path, "model.path"), "model.path")
    if not path.is_absolute() and not str(path).startswith("preset:"):
        # from where the placement is loaded: every stage, and a client that connects later from elsewhere, reads
        # the same checkpoint (a relative path was each process's own working directory's)
        path = Path(os.path.abspath(path))
    return ModelSpec(path=path, format=_choice(d.get("format", "auto"), "model.format", FORMATS),
                     dtype=_choice(d.get("dtype", "float32"), "model.dtype", DTYPES))


def _stage(raw: Any, i: int) -> StageSpec:
    p = f"stages[{i}]"
    d = _mapping(raw, p, StageSpec)
    if "device" not in d:
        raise _bad(f"{p}.device", "is required: cpu or cuda:N (N >= 0)")
    dev = d["device"]
    if not isinstance(dev, str) or not _DEVICE.fullmatch(dev):
        raise _bad(f"{p}.device", f"{_got(dev)} is not a device; use cpu or cuda:N with N >= 0 (e.g. cuda:0)")
    layers = d.get("layers", "auto")
    if layers == "auto":
        rng = None
    elif (isinstance(layers, (list, tuple)) and len(layers) == 2
          and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in layers)
          and layers[0] < layers[1]):
        rng = (layers[0], layers[1])
    else:
        raise _bad(f"{p}.layers", f"{_got(layers)} must be auto or [start, end) with 0 <= start < end")
    spec = StageSpec(device=dev, layers=rng)
    cpus = _pos(d["num_cpus"], f"{p}.num_cpus", MAX_CPUS) if "num_cpus" in d else (1.0 if spec.is_cuda else 0.5)
    if cpus < MIN_CPUS:     # (at actor creation, after the cluster started; a fraction >= it is rounded to it)
        raise _bad(f"{p}.num_cpus", f"must be at least {MIN_CPUS:g} (Ray's smallest CPU fraction), got {cpus!r}")
    return dataclasses.replace(spec, num_cpus=cpus, threads=_int(d.get("threads", 1), f"{p}.threads",
                                                                 hi=MAX_THREADS))


def _stages(raw: Any) -> tuple[StageSpec, ...]:
    if not isinstance(raw, (list, tuple)) or not raw:
        raise _bad("stages", f"must be a list of at least one stage ({{device: cpu, layers: auto}}), got {_got(raw)}")
    return tuple(_stage(s, i) for i, s in enumerate(raw))


def _vision(raw: Any, n_stages: int) -> VisionSpec:
    d = _mapping(raw, "vision", VisionSpec)
    eng = d.get("engine", "primary")
    v = VisionSpec(engine=eng)
    if eng not in ("primary", "intake") and (not isinstance(eng, str) or v.stage is None):
        raise _bad("vision.engine", f"{_got(eng)} is not one of primary | intake | stage:N")
    if v.stage is not None and v.stage >= n_stages:
        raise _bad("vision.engine", f"{eng!r} names no stage; this placement has stages 0..{n_stages - 1}")
    return v


def _scheduler(raw: Any) -> SchedulerSpec:
    d = _mapping(raw, "scheduler", SchedulerSpec)
    mb = d.get("microbatches", "auto")
    his = {"max_batch": MAX_BATCH, "max_context": MAX_CONTEXT, "prefill_chunk": MAX_CONTEXT}
    kw = {k: _int(d[k], f"scheduler.{k}", hi=hi) for k, hi in his.items() if k in d}
    if mb not in ("auto", None):      # (~ is auto, as for kv_pages and pipeline_chunks)
        if isinstance(mb, bool) or not isinstance(mb, int) or mb < 1:
            raise _bad("scheduler.microbatches", f"must be auto or an integer >= 1, got {_got(mb, True)}")
        kw["microbatches"] = _int(mb, "scheduler.microbatches")
    kv = d.get("kv_pages", "auto")
    if kv not in ("auto", None):
        kw["kv_pages"] = _int(kv, "scheduler.kv_pages")
    pc = d.get("pipeline_chunks", "auto")
    if pc not in ("auto", None):
        if isinstance(pc, bool) or not isinstance(pc, int) or pc < 1:
            raise _bad("scheduler.pipeline_chunks", f"must be auto or an integer >= 1 (1: prompts keep whole "
                                                    f"chunks), got {_got(pc, True)}")
        kw["pipeline_chunks"] = _int(pc, "scheduler.pipeline_chunks")
    pd = d.get("prefill_chunk_decoding", "off")
    if pd is not False and pd not in ("off", None):      # (YAML 1.1 reads a bare off as false)
        chunk = kw.get("prefill_chunk", SchedulerSpec.prefill_chunk)
        if isinstance(pd, bool) or not isinstance(pd, int) or not 1 <= pd <= chunk:
            raise _bad("scheduler.prefill_chunk_decoding", f"must be off or an integer from 1 to "
                                                           f"scheduler.prefill_chunk ({chunk}), got "
                                                           f"{_got(pd, True)}")
        kw["prefill_chunk_decoding"] = pd
    return SchedulerSpec(**kw)


def _poll_us(v: Any) -> float | None:
    if v in ("auto", None):
        return None
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1e6:
        raise _bad("transport_poll_us", f"must be auto or microseconds in [0, 1000000] (0: no mailbox), "
                                        f"got {_got(v, number=True)}")
    return float(v)


def _ray(raw: Any) -> RaySpec:
    d = _mapping(raw, "ray", RaySpec)
    kw = {k: _str(d[k], f"ray.{k}") for k in ("address", "namespace", "listen") if k in d}
    if "listen" in kw:
        try:
            ip = ipaddress.ip_address(kw["listen"])
        except ValueError:
            raise _bad("ray.listen", f"{kw['listen']!r} is not an IP address; use 127.0.0.1 (Ray's own choice of "
                       "this host's address) or one of this host's interface addresses") from None
        if ip.is_unspecified:
            raise _bad("ray.listen", f"{kw['listen']!r} is no address Ray can advertise to other nodes (Ray binds "
                       "every interface already); use 127.0.0.1 or one of this host's interface addresses")
    return RaySpec(**kw)


def parse_placement(raw: Any) -> Placement:
    """Validate a placement given as a dict (the YAML's top level). Errors name the key path, not the file."""
    d = _mapping(raw, "", Placement)
    if "stages" not in d:
        raise _bad("stages", "is required: a list of at least one stage, e.g. [{device: cpu, layers: auto}]")
    stages = _stages(d["stages"])
    name = _str(d.get("name", "memra"), "name")
    if not _NAME.fullmatch(name):
        raise _bad("name", f"{name!r} must be letters, digits, '.', '_' or '-' (it names Ray actors)")
    ad = _mapping(d.get("adapters"), "adapters", AdapterSpec)
    to = _mapping(d.get("timeouts"), "timeouts", TimeoutSpec)
    return Placement(
        stages=stages, name=name, model=_model(d.get("model")), vision=_vision(d.get("vision"), len(stages)),
        overlay_publish=_choice(d.get("overlay_publish", "auto"), "overlay_publish", OVERLAY_PUBLISH),
        transport=_choice(d.get("transport", "auto"), "transport", TRANSPORTS),
        transport_poll_us=_poll_us(d.get("transport_poll_us", "auto")),
        scheduler=_scheduler(d.get("scheduler")),
        adapters=AdapterSpec(**{k: _int(v, f"adapters.{k}") for k, v in ad.items()}),
        recover=_choice(d.get("recover", "error"), "recover", RECOVER), ray=_ray(d.get("ray")),
        timeouts=_timeouts(to))


MIN_STEP_S = 0.05
MIN_HEARTBEAT_S = 0.05      # the supervisor waits 3 beats for each health answer: 150 ms against an actor call's ~1


def _timeouts(to: dict) -> TimeoutSpec:
    t = TimeoutSpec(**{k: _pos(v, f"timeouts.{k}", MAX_TIMEOUT_S) for k, v in to.items()})
    if t.heartbeat_s < MIN_HEARTBEAT_S:     # (0.001: 3 ms for a health answer; healthy stages killed in a loop)
        raise _bad("timeouts.heartbeat_s", f"must be at least {MIN_HEARTBEAT_S:g} s (the supervisor gives a stage 3 "
                   f"heartbeats to answer, and an actor call takes about a millisecond), got {t.heartbeat_s:g}")
    if t.step_s < MIN_STEP_S:       # (0.001: every submit, stats and poll call ran out before its answer came)
        raise _bad("timeouts.step_s", f"must be at least {MIN_STEP_S:g} s (it bounds each call to a stage, which "
                   f"takes about a millisecond, and a step's wait), got {t.step_s:g}")
    return t


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (plain YAML keeps the last one silently)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":   # '<<: *base' (its keys may be overridden here): it has
                continue                                    # no constructor of its own; super() flattens it in
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (list, dict)):       # a complex key ({a: 1}: ..., [a, b]: ...) is no placement key
                kind = "mapping" if isinstance(key, dict) else "sequence"
                raise yaml.constructor.ConstructorError(None, None, f"a mapping key must be a scalar, got a {kind}",
                                                        key_node.start_mark)
            if key in seen:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep)

    def construct_yaml_int(self, node):
        """YAML 1.1's integers, but the two forms a reader takes for decimal: PyYAML reads a leading 0 as octal
        (064 is 52) and colons as base 60 (1:30 is 90)."""
        return _decimal_only(self.construct_scalar(node), super().construct_yaml_int(node), node)

    def construct_yaml_float(self, node):
        return _decimal_only(self.construct_scalar(node), super().construct_yaml_float(node), node)


def _decimal_only(text: str, value, node):
    """`value` (YAML 1.1's reading of `text`), refused where that reading is octal or base 60."""
    t = text.replace("_", "").lstrip("+-")
    if ":" in t or (len(t) > 1 and t[0] == "0" and t.isdigit()):
        raise yaml.constructor.ConstructorError(
            None, None, f"{text} is read as {value} (YAML 1.1 reads " + (
                "colons as base 60" if ":" in t else "a leading 0 as octal") + "): write the number in decimal "
            "without them", node.start_mark)
    return value


_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:int", _UniqueKeyLoader.construct_yaml_int)
_UniqueKeyLoader.add_constructor("tag:yaml.org,2002:float", _UniqueKeyLoader.construct_yaml_float)


def _read_yaml(path: Path, where: str) -> Any:
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):    # a FIFO or device would block the read; a directory fails it
            raise ConfigError(f"{where}: cannot read the placement file (not a regular file)")
        if st.st_size > MAX_YAML_BYTES:     # a checkpoint given in its place would be read whole into memory
            raise ConfigError(f"{where}: cannot read the placement file ({st.st_size} bytes; a placement YAML is "
                              f"at most {MAX_YAML_BYTES} bytes): is it a model file? That goes in model.path")
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"{where}: cannot read the placement file ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: cannot read the placement file (not UTF-8 text: {e})") from None
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:     # one line: the file's line and column, then what PyYAML found there
        mark = getattr(e, "problem_mark", None)
        at = f":{mark.line + 1}:{mark.column + 1}" if mark is not None else ""
        what = " ".join(str(x) for x in (getattr(e, "context", None), getattr(e, "problem", None)) if x) or \
            " ".join(str(e).split())
        raise ConfigError(f"{where}{at}: not valid YAML: {what}") from None
    except RecursionError:
        raise ConfigError(f"{where}: not valid YAML: nested too deeply") from None
    except ValueError as e:     # an integer of more digits than Python converts
        raise ConfigError(f"{where}: not valid YAML: {e}") from None


def load_placement(src: str | Path | Mapping) -> Placement:
    """Read a placement YAML file (or an already-parsed dict) once and validate it; ConfigError names the file."""
    if isinstance(src, Mapping):
        where, raw = "placement", src
    elif not isinstance(src, (str, os.PathLike)):
        raise ConfigError(f"a placement is a YAML file's path or a dict of placement keys, got {type(src).__name__}")
    else:
        where = str(src)
        if not os.fspath(src):      # ("" is the working directory to a path, then "not a regular file")
            raise ConfigError("a placement file's path is empty: give the YAML's path (cluster_configs/*.yaml)")
        raw = _read_yaml(_expand(src, where), where)
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where}: the top level must be a mapping of placement keys (name, model, stages, "
                              f"...), got {type(raw).__name__}")
    try:
        return parse_placement(raw)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None
