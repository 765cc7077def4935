"""The deployment-level control API under misuse (an adversarial review, forty-first session): load_adapter /
unload_adapter / stats / connect misuse on a live 2-stage CPU deployment with requests in flight. Each bad call must
raise a memra_pp.errors class naming the problem (never a bare Python or Ray error, never a hang: every control call
runs on a thread with a timeout), the requests in flight must end with their reference tokens, and the deployment
must keep serving (a good adapter still loads afterwards)."""
import copy
import enum
import functools
import os
import re
import threading
import time
import warnings

import pytest
import ray

import memra_pp
from conftest_models import hf_reference, tiny_checkpoint
from memra_pp.adapters import load_peft_adapter
from memra_pp.errors import ConfigError, InputError, MemraError
from memra_pp.model.weights import SafetensorsSource
from test_adapters import NEW, PROMPTS, _edit, adapter, peft_reference
from tiny_hf import hf_greedy

NAME, NS = "s41ctl", "memra-test"     # the ray_cluster fixture's namespace
CALL_S = 90                           # no control call may take longer (a hang fails the test, not the suite)
LONG = 300                            # tokens of the requests that stream while the bad calls happen (at most)
CHECKED = 40                          # of which the first CHECKED are compared with transformers
# (each test streams as many as its bad calls need, asserted still streaming after them: these took under a tenth
# of those tokens' time, measured; every token streamed is compared with the same request run alone afterwards)


def call(fn, *args, timeout: float = CALL_S, **kw):
    """fn(*args, **kw) on a thread of its own: its result, or the exception it raised; a call still running after
    `timeout` fails the test (a hang)."""
    out = {}

    def run():
        try:
            out["r"] = fn(*args, **kw)
        except BaseException as e:  # noqa: BLE001 - the outcome is the test's to judge
            out["e"] = e
    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(timeout)
    assert not th.is_alive(), f"{getattr(fn, '__name__', fn)}{args} did not return within {timeout} s (a hang)"
    if "e" in out:
        raise out["e"]
    return out["r"]


def refused(kind, match, fn, *args, **kw):
    """fn(...) must raise `kind` (a memra_pp.errors class) whose message matches `match`; returns the error."""
    with pytest.raises(MemraError) as ei:
        call(fn, *args, **kw)
    assert isinstance(ei.value, kind), f"{type(ei.value).__name__} (wanted {kind.__name__}): {ei.value}"
    assert ei.value.args and re.search(match, str(ei.value)), f"message {str(ei.value)!r} !~ {match!r}"
    return ei.value


def call_all(*thunks, timeout: float = CALL_S):
    """Each thunk() on a thread of its own, all at once: their results in order, or the first exception one raised;
    one still running after `timeout` fails the test (a hang)."""
    outs = [{} for _ in thunks]

    def run(f, o):
        try:
            o["r"] = f()
        except BaseException as e:  # noqa: BLE001 - the outcome is the test's to judge
            o["e"] = e
    ths = [threading.Thread(target=run, args=(f, o), daemon=True) for f, o in zip(thunks, outs)]
    for th in ths:
        th.start()
    end = time.monotonic() + timeout
    for th in ths:
        th.join(max(end - time.monotonic(), 0.0))
    assert not any(th.is_alive() for th in ths), f"a call did not return within {timeout} s (a hang)"
    for o in outs:
        if "e" in o:
            raise o["e"]
    return [o["r"] for o in outs]


@functools.lru_cache(maxsize=None)
def checked_reference(w, p) -> list[int]:
    """transformers' (PEFT's for adapter "a") first CHECKED greedy tokens of prompt `p` (computed once a module)."""
    return hf_greedy(models()[w], list(p), CHECKED)[0]


class Streams:
    """Requests streaming in the background (ignore_eos, `new` tokens each), with when each ended."""

    def __init__(self, c, specs, new=LONG):
        assert CHECKED <= new <= LONG
        self.new, self.specs, self.out, self.threads = new, specs, [{} for _ in specs], []
        self.first = [threading.Event() for _ in specs]
        for i, (p, w) in enumerate(specs):
            th = threading.Thread(target=self._run, args=(c, i, p, w), daemon=True)
            th.start()
            self.threads.append(th)
        for ev in self.first:
            assert ev.wait(CALL_S), "a stream produced nothing"

    def _run(self, c, i, p, w):
        toks = []
        try:
            for ev in c.stream(list(p), max_new_tokens=self.new, adapter=w, ignore_eos=True, timeout=CALL_S):
                toks += ev.token_ids
                self.first[i].set()
        except BaseException as e:  # noqa: BLE001
            self.out[i]["e"] = e
            self.first[i].set()
        self.out[i]["toks"], self.out[i]["end"] = toks, time.monotonic()

    def running(self) -> bool:
        return any(th.is_alive() for th in self.threads)

    def check(self, c):
        """Each stream ended whole, its first CHECKED tokens transformers' (PEFT's) greedy ones, and all of them the
        same request's run alone afterwards (the streams' requests again, together as they streamed: with nothing
        else in flight)."""
        refs = [checked_reference(w, tuple(p)) for p, w in self.specs]    # (while the streams end)
        for th in self.threads:
            th.join(CALL_S * 2)
            assert not th.is_alive(), "a stream in flight hung"
        for (p, w), o, ref in zip(self.specs, self.out, refs, strict=True):
            assert "e" not in o, f"a request in flight (adapter {w!r}) failed: {o['e']!r}"
            assert len(o["toks"]) == self.new
            assert o["toks"][:CHECKED] == ref, f"adapter {w!r}: not the reference"
        alone = call_all(*[functools.partial(c.generate, list(p), max_new_tokens=self.new, adapter=w, ignore_eos=True,
                                             timeout=CALL_S) for p, w in self.specs], timeout=CALL_S * 2)
        for (p, w), o, a in zip(self.specs, self.out, alone, strict=True):
            assert o["toks"] == a.token_ids, f"adapter {w!r}: differs from the same request run alone"


def models():
    return {None: tiny_checkpoint("dense", False)[0], "a": adapter("dense", False, "A")[0]}


@pytest.fixture(scope="module")
def dep(ray_cluster):
    _, path = tiny_checkpoint("dense", False)
    adapter("dense", False, "A"), adapter("dense", False, "B")        # (made before the deployment: PEFT, on disk)
    d = memra_pp.launch({"name": NAME, "model": {"path": str(path)}, "stages": [{"device": "cpu", "num_cpus": 0.1}] * 2,
                         "adapters": {"max_loras": 3, "max_rank": 8},
                         "scheduler": {"max_batch": 8, "max_context": 1024, "prefill_chunk": 16}}, detached=True)
    try:
        assert d.load_adapter("a", adapter("dense", False, "A")[1]) == 0
        yield d
    finally:
        d.shutdown()


def registry(d) -> dict:
    return ray.get(d.actors[0].adapters.remote(), timeout=30)


def serves(d, c=None):
    """The deployment still serves: a base request and one with adapter "a" give their references."""
    c = c or d.client()
    p = PROMPTS[0]
    assert call(c.generate, list(p), max_new_tokens=NEW, timeout=CALL_S).token_ids == \
        hf_reference("dense", False, p, NEW)[0]
    assert call(c.generate, list(p), max_new_tokens=NEW, adapter="a", timeout=CALL_S).token_ids == \
        peft_reference("dense", False, "A", p)[0]


def good_b_loads(d, c):
    """A good adapter still loads after the refusals (no slot leaked, no stage left half-loaded), serves PEFT's
    tokens, and unloads."""
    call(d.load_adapter, "b", adapter("dense", False, "B")[1])
    p = PROMPTS[3]
    assert call(c.generate, list(p), max_new_tokens=NEW, adapter="b", timeout=CALL_S).token_ids == \
        peft_reference("dense", False, "B", p)[0]
    call(d.unload_adapter, "b")
    assert registry(d) == {"a": (0, str(adapter("dense", False, "A")[1]), "loaded")}


# -- load_adapter: bad directories and files, with requests in flight ---------------------------------------------
def test_bad_adapter_directories_are_refused_while_requests_stream(dep, tmp_path):
    c = dep.client()
    A = adapter("dense", False, "A")[1]
    st = Streams(c, [(PROMPTS[1], "a"), (PROMPTS[2], None)], new=200)
    # a file, not a directory
    refused(ConfigError, r"is not a directory", dep.load_adapter, "f", str(A / "adapter_config.json"))
    # a directory without adapter_config.json (empty)
    (tmp_path / "empty").mkdir()
    refused(ConfigError, r"adapter_config.json is missing", dep.load_adapter, "e", tmp_path / "empty")
    # adapter_config.json that is a directory
    d = _edit(tmp_path / "cfgdir", rm="adapter_config.json")
    (d / "adapter_config.json").mkdir()
    refused(ConfigError, r"adapter_config.json is missing", dep.load_adapter, "cd", d)
    # adapter_config.json that is not JSON / empty
    refused(ConfigError, r"adapter_config.json.*(JSON|json)", dep.load_adapter, "cj",
            _edit(tmp_path / "cj", raw_cfg="{r: 8"))
    refused(ConfigError, r"adapter_config.json", dep.load_adapter, "ce", _edit(tmp_path / "ce", raw_cfg=""))
    # truncated, zero-length and garbage safetensors
    for i, how in enumerate(("half", "zero", "garbage", "header-only")):
        d = _edit(tmp_path / f"st{i}")
        f = d / "adapter_model.safetensors"
        raw = f.read_bytes()
        f.write_bytes({"half": raw[: len(raw) // 2], "zero": b"", "garbage": os.urandom(4096),
                       "header-only": raw[: 8 + int.from_bytes(raw[:8], "little")]}[how])
        refused(ConfigError, r"adapter_model.safetensors.*cannot read safetensors", dep.load_adapter, f"t{i}", d)
    # adapter_model.safetensors that is a directory
    d = _edit(tmp_path / "stdir", rm="adapter_model.safetensors")
    (d / "adapter_model.safetensors").mkdir()
    refused(ConfigError, r"adapter_model.safetensors is missing", dep.load_adapter, "sd", d)
    # NaN-filled adapter (every tensor), through the deployment
    import torch
    from safetensors.torch import load_file, save_file
    d = _edit(tmp_path / "nan")
    t = load_file(str(d / "adapter_model.safetensors"))
    save_file({k: torch.full_like(v, float("nan")) for k, v in t.items()}, str(d / "adapter_model.safetensors"))
    refused(ConfigError, r"holds NaN or inf", dep.load_adapter, "nan", d)
    # a finite lora_alpha whose scale overflows the pool's float32 (refused inside the stages' pools: rollback)
    refused(ConfigError, r"not finite", dep.load_adapter, "huge", _edit(tmp_path / "huge", cfg={"lora_alpha": 1e300}))
    # config rank disagreeing with the weights; a rank above max_rank via the config too
    refused(ConfigError, r"disagree", dep.load_adapter, "r4", _edit(tmp_path / "r4", cfg={"r": 4}))
    # a path with a NUL byte; a path that does not exist
    refused(ConfigError, r"is not a directory", dep.load_adapter, "nul", str(tmp_path) + "/x\x00y")
    refused(ConfigError, r"is not a directory", dep.load_adapter, "gone", tmp_path / "nowhere")
    # the name already loaded (and in use by a stream)
    refused(InputError, r"adapter 'a' is already loaded \(slot 0\)", dep.load_adapter, "a", A)
    assert st.running(), "the streams ended before the bad loads did (the test is vacuous): stream more tokens"
    st.check(c)
    # no refused name is known; nothing leaked
    assert registry(dep) == {"a": (0, str(A), "loaded")}
    for n in ("f", "e", "t0", "nan", "huge", "r4"):
        refused(InputError, rf"unknown adapter '{n}'", c.generate, [5, 17], max_new_tokens=2, adapter=n)
    serves(dep, c)
    good_b_loads(dep, c)


def test_a_pathlike_returning_bytes_is_refused_typed(dep):
    """os.PathLike is accepted as a path; one whose __fspath__ gives bytes must be refused with InputError like a
    bytes path is, not pathlib's bare TypeError."""
    class BytesPath(os.PathLike):
        def __fspath__(self):
            return os.fsencode(str(adapter("dense", False, "B")[1]))

    refused(InputError, r"adapter 'bp'.*path", dep.load_adapter, "bp", os.fsencode("/tmp"))
    refused(InputError, r"adapter 'bp'.*path", dep.load_adapter, "bp", BytesPath())
    serves(dep)
    assert "bp" not in registry(dep)


# -- load_adapter: a config whose target modules disagree with the weights -----------------------------------------
def test_target_modules_that_disagree_with_the_weights_are_refused(tmp_path):
    """adapter_config.json's target_modules say which modules PEFT wraps; PEFT ignores (silently, in peft 0.21)
    LoRA weights for any other module. A file whose weights name modules its config does not target must be
    refused, not served with all its weights (different tokens from PEFT's)."""
    from peft import PeftModel
    base, path = tiny_checkpoint("dense", False)
    d = _edit(tmp_path, cfg={"target_modules": ["q_proj"]})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pm = PeftModel.from_pretrained(copy.deepcopy(base), str(d)).eval()
    wrapped = sum(1 for n, _ in pm.named_modules() if n.endswith("lora_A"))
    p = list(PROMPTS[0])
    # (non-vacuity: PEFT serves this directory differently from adapter A's own)
    assert hf_greedy(pm, p, NEW)[0] != peft_reference("dense", False, "A", tuple(p))[0]
    cfg = SafetensorsSource(path).config
    try:
        aw = load_peft_adapter(d, cfg, 8)
    except ConfigError as e:
        assert "target_modules" in str(e)
        return
    pytest.fail(f"loaded {len(aw.lora)} LoRA modules where PEFT wraps {wrapped} (target_modules ['q_proj']): "
                f"the deployment would serve other tokens than PEFT")


# -- unload_adapter misuse ---------------------------------------------------------------------------------------
def test_unload_misuse_is_refused_and_the_stream_keeps_its_adapter(dep):
    c = dep.client()
    st = Streams(c, [(PROMPTS[1], "a")], new=100)
    call(dep.load_adapter, "u", adapter("dense", False, "B")[1])
    call(dep.unload_adapter, "u")
    refused(InputError, r"unknown adapter 'u'", dep.unload_adapter, "u")          # twice
    refused(InputError, r"unknown adapter 'nope'; loaded: \['a'\]", dep.unload_adapter, "nope")
    for bad in (None, 5, ["a"], b"a"):
        refused(InputError, r"unknown adapter .*a string", dep.unload_adapter, bad)
    refused(InputError, r"unknown adapter ''", dep.unload_adapter, "")
    refused(InputError, r"still used by 1 request", dep.unload_adapter, "a")       # used by the stream
    refused(InputError, r"still used by 1 request", dep.unload_adapter, "a")       # (and again: abort_unload ran)
    assert st.running(), "the stream ended before the unloads (vacuous)"
    st.check(c)
    assert registry(dep)["a"][2] == "loaded"
    serves(dep, c)
    good_b_loads(dep, c)


# -- stats / client / connect --------------------------------------------------------------------------------------
def test_stats_refuses_arguments_of_the_wrong_type(dep):
    """stats(reset, timeline) are booleans: a string "no" must not reset the counters silently, and a value Ray
    cannot send must not surface as pickle's TypeError or a StageFailed (no stage failed)."""
    c = dep.client()
    call(c.generate, [5, 17, 42], max_new_tokens=4, timeout=CALL_S)
    errs = []
    for kw in ({"reset": "no"}, {"timeline": "yes"}, {"reset": threading.Lock()}, {"timeline": [1]}):
        try:
            call(dep.stats, **kw)
            errs.append(f"stats(**{kw!r}) was accepted")
        except InputError as e:
            assert "reset" in str(e) or "timeline" in str(e), e
        except BaseException as e:  # noqa: BLE001
            errs.append(f"stats(**{kw!r}) raised {type(e).__name__}: {str(e).splitlines()[0][:150]}")
    assert call(dep.stats)["stages"][0]["index"] == 0
    serves(dep, c)
    assert not errs, "; ".join(errs)


def test_client_takes_no_arguments_and_a_bad_one_leaves_serving(dep):
    for args in (("x",), (None,), (1, 2)):
        with pytest.raises(TypeError):      # Python's own signature error: the method takes no arguments
            dep.client(*args)
    serves(dep)


def test_connect_refuses_an_unknown_name(dep):
    for bad in ("s41-nope", "", NAME + ".stage0", None, 5):
        refused(ConfigError, rf"no deployment named {bad!r} in namespace", memra_pp.connect, bad, namespace=NS)
    serves(dep)


def test_connect_refuses_the_wrong_namespace(dep):
    """The deployment lives in namespace NS; connect(NAME, namespace="elsewhere") must be refused (ConfigError naming
    the namespace), not hand back a handle of the deployment in NS: the namespace argument is not to be ignored
    (the message even says it looked in 'elsewhere')."""
    other = None
    try:
        try:
            other = call(memra_pp.connect, NAME, namespace="s41-elsewhere")
        except ConfigError as e:
            assert "s41-elsewhere" in str(e)
        else:
            pytest.fail(f"connect({NAME!r}, namespace='s41-elsewhere') returned a handle of the deployment in "
                        f"namespace {ray.get_runtime_context().namespace!r}")
    finally:
        if other is not None and other.supervisor is not None:
            other.supervisor.stop()         # (never shutdown(): that would stop the fixture's deployment)
    serves(dep)


# -- many threads at once ------------------------------------------------------------------------------------------
def test_concurrent_loads_unloads_generates_and_stats(dep):
    """Three threads load and unload ("x" twice over, "y") against a 3-slot pool holding "a", one generates with
    "a", none and "x", one reads stats: every failure is an InputError naming the adapter state, every request that
    runs gives its reference, and afterwards the registry is clean and a good adapter loads."""
    B = adapter("dense", False, "B")[1]
    p = PROMPTS[3]
    ref = {None: hf_reference("dense", False, p, NEW)[0], "a": peft_reference("dense", False, "A", p)[0],
           "x": peft_reference("dense", False, "B", p)[0]}
    c = dep.client()
    st = Streams(c, [(PROMPTS[1], "a")], new=200)
    bad, outcomes, stop = [], {"loaded": 0, "refused": 0, "generated_x": 0}, threading.Event()
    lock = threading.Lock()

    def note(e, where, ok):
        if isinstance(e, InputError) and re.search(ok, str(e)):
            with lock:
                outcomes["refused"] += 1
        else:
            bad.append(f"{where}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")

    def cycle(name, n):
        for _ in range(n):
            try:
                dep.load_adapter(name, B)
                with lock:
                    outcomes["loaded"] += 1
            except BaseException as e:  # noqa: BLE001
                note(e, f"load {name}", r"already loaded|being (load|unload)ed|pool is full")
                continue
            for _ in range(50):
                try:
                    dep.unload_adapter(name)
                    break
                except BaseException as e:  # noqa: BLE001
                    note(e, f"unload {name}", r"still used|being (load|unload)ed")
                    time.sleep(0.02)

    def gen():
        while not stop.is_set():
            for w in (None, "a", "x"):
                try:
                    r = c.generate(list(p), max_new_tokens=NEW, adapter=w, timeout=CALL_S)
                    if r.token_ids != ref[w]:
                        bad.append(f"adapter {w!r}: {r.token_ids} != {ref[w]}")
                    elif w == "x":
                        outcomes["generated_x"] += 1
                except BaseException as e:  # noqa: BLE001
                    if w == "x":
                        note(e, "generate x", r"unknown adapter 'x'")
                    else:
                        bad.append(f"generate {w!r}: {type(e).__name__}: {e}")

    def stats():
        while not stop.is_set():
            try:
                dep.stats()
            except BaseException as e:  # noqa: BLE001
                bad.append(f"stats: {type(e).__name__}: {e}")
            time.sleep(0.05)

    workers = [threading.Thread(target=cycle, args=a, daemon=True) for a in (("x", 5), ("x", 5), ("y", 5))]
    side = [threading.Thread(target=f, daemon=True) for f in (gen, stats)]
    for th in workers + side:
        th.start()
    for th in workers:
        th.join(CALL_S * 2)
    in_flight = st.running()
    stop.set()
    for th in side:
        th.join(CALL_S)
    assert not any(th.is_alive() for th in workers + side), "a control call or a request hung"
    assert not bad, bad
    print("concurrency outcomes:", outcomes)
    assert outcomes["loaded"] >= 3 and outcomes["refused"] >= 1, outcomes     # (the threads did contend)
    assert in_flight, "the stream ended before the loads and unloads did (vacuous): stream more tokens"
    st.check(c)
    # nothing left loading / unloading; whatever stayed loaded unloads
    for n, (_, _, state) in registry(dep).items():
        assert state == "loaded", (n, state)
        if n != "a":
            call(dep.unload_adapter, n)
    serves(dep, c)
    good_b_loads(dep, c)


class CallerName(str):
    """A str subclass the stage processes cannot import (this test module is not on their path)."""


class CallerFlag:
    def __bool__(self):
        return True


def test_a_path_too_long_for_the_os_is_refused_with_config_error(dep, tmp_path):
    """A path whose component or whole length the OS refuses (ENAMETOOLONG) is a bad path like a missing one:
    ConfigError naming it, not a StageFailed wrapping the stage's OSError."""
    errs = []
    for p in (str(tmp_path / ("a" * 300)), "/" + "/".join(["b" * 200] * 30)):
        try:
            refused(ConfigError, r"adapter path .* is not a directory|too long", dep.load_adapter, "long", p)
        except AssertionError as e:
            errs.append(str(e).splitlines()[0][:200])
    # whatever it raised, nothing was lost: the slot came back and the deployment serves
    assert "long" not in registry(dep)
    serves(dep)
    good_b_loads(dep, dep.client())
    assert not errs, errs


class Names(enum.StrEnum):
    """Adapter names as an application may keep them: a StrEnum of the caller's module (the stage processes cannot
    import it: this test module is not on their path)."""
    SUB = "sub"
    A = "a"


class MixedNames(str, enum.Enum):
    """The older spelling of a string enum: str() of its member is "MixedNames.SUB", its string "sub"."""
    SUB = "sub"


def test_a_name_of_a_str_subclass_is_taken_as_its_string(dep):
    """An adapter name that is a str subclass only the caller can import (a StrEnum member, a (str, Enum) member,
    CallerName) is loaded and unloaded as its plain string: the stages could not unpickle it (a StageFailed for a
    stage that did not fail)."""
    B = adapter("dense", False, "B")[1]
    for name in (Names.SUB, MixedNames.SUB, CallerName("sub")):
        call(dep.load_adapter, name, B)
        assert registry(dep)["sub"][2] == "loaded", type(name)
        call(dep.unload_adapter, name)
        assert "sub" not in registry(dep)
    serves(dep)


def test_a_request_naming_its_adapter_by_a_str_subclass_is_served(dep):
    """generate(adapter=Names.A) (a str, so accepted by the client's check) must be served with adapter "a"."""
    p = PROMPTS[0]
    r = call(dep.client().generate, list(p), max_new_tokens=NEW, adapter=Names.A, timeout=CALL_S)
    assert r.token_ids == peft_reference("dense", False, "A", p)[0]


def test_stats_with_a_value_the_stages_cannot_read(dep):
    refused(InputError, r"reset", dep.stats, reset=CallerFlag())
    serves(dep)


def test_generates_racing_the_unload_of_their_adapter(dep):
    """Requests naming "x" submitted again and again while "x" is unloaded: each either runs with x's weights
    (PEFT's tokens; the unload is refused while it runs) or is refused as an unknown adapter once the name is
    withdrawn; never other tokens, never another error."""
    B, p = adapter("dense", False, "B")[1], PROMPTS[3]
    ref = peft_reference("dense", False, "B", p)[0]
    call(dep.load_adapter, "x", B)
    c, stop, seen, bad = dep.client(), threading.Event(), {"ok": 0, "unknown": 0, "still_used": 0}, []

    def gen():
        while not stop.is_set():
            try:
                r = c.generate(list(p), max_new_tokens=NEW, adapter="x", timeout=CALL_S)
                if r.token_ids != ref:
                    bad.append(f"tokens {r.token_ids} != {ref}")
                seen["ok"] += 1
            except InputError as e:
                if "unknown adapter 'x'" not in str(e):
                    bad.append(repr(e))
                seen["unknown"] += 1
            except BaseException as e:  # noqa: BLE001
                bad.append(repr(e))
    ths = [threading.Thread(target=gen, daemon=True) for _ in range(2)]
    for th in ths:
        th.start()
    end = time.monotonic() + 30
    while seen["ok"] < 2 and not bad and time.monotonic() < end:     # (the generates run: it was a fixed 0.5 s)
        time.sleep(0.01)
    end = time.monotonic() + 30
    while True:
        try:
            call(dep.unload_adapter, "x")
            break
        except InputError as e:
            assert "still used" in str(e), e
            seen["still_used"] += 1
            assert time.monotonic() < end, "the unload never found a moment without users"
    end = time.monotonic() + 30
    while seen["unknown"] < 1 and not bad and time.monotonic() < end:  # (refused since: it was a fixed 0.3 s)
        time.sleep(0.01)
    stop.set()
    for th in ths:
        th.join(CALL_S)
        assert not th.is_alive()
    assert not bad, bad
    assert seen["ok"] > 0 and seen["unknown"] > 0, seen
    assert "x" not in registry(dep)
    serves(dep, c)

def test_shutdown_during_loads_and_a_stream_ends_them_typed(dep):
    """Last (it shuts the module's deployment down): a shutdown from another thread while loads and unloads run and
    a request streams ends each with a memra_pp error (StageFailed), no call hangs, and later calls are refused."""
    c = dep.client()
    st = Streams(c, [(PROMPTS[1], "a")])
    B, errs, stop, rounds = adapter("dense", False, "B")[1], [], threading.Event(), [0]

    def cycle():
        while not stop.is_set():
            for f, a in ((dep.load_adapter, ("z", B)), (dep.unload_adapter, ("z",))):
                try:
                    f(*a)
                except MemraError:
                    pass
                except BaseException as e:  # noqa: BLE001
                    errs.append(f"{f.__name__}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            rounds[0] += 1
    th = threading.Thread(target=cycle, daemon=True)
    th.start()
    end = time.monotonic() + 30
    while rounds[0] < 3 and time.monotonic() < end:       # (loads and unloads run: it was a fixed 0.3 s)
        time.sleep(0.01)
    call(dep.shutdown, stop_ray=False)
    stop.set()
    th.join(CALL_S)
    assert not th.is_alive(), "a load or unload hung across the shutdown"
    for t in st.threads:
        t.join(CALL_S)
        assert not t.is_alive(), "the stream hung across the shutdown"
    o = st.out[0]
    assert "e" in o and isinstance(o["e"], MemraError), f"the stream ended with {o.get('e')!r} after {len(o['toks'])}"
    assert not errs, errs
    refused(MemraError, r"shut down", dep.load_adapter, "z", B)
    refused(MemraError, r"shut down", dep.stats)
