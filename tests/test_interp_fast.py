"""tests/interp_fast.py (what the interpreter checks run under) changes what Triton's interpreter costs, not what it
computes: a kernel calling a @triton.jit helper and the standard library's reductions gives the same bits with it
and without it, the language modules are left as the unpatched interpreter leaves them, and the skipped patches
happened (its counters)."""
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))

SCRIPT = r'''
import sys, inspect
fast = sys.argv[1] == "fast"
sys.path.insert(0, HERE)
if fast:
    import interp_fast
    assert interp_fast.install()
import numpy as np
import torch
import triton
import triton.language as tl


@triton.jit
def _scale(x, s):
    return x * s + tl.sum(x, axis=0)


@triton.jit
def _kernel(X, Y, N: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, N)
    x = tl.load(X + pid * N + offs)
    y = _scale(x, 0.5) + tl.max(x, axis=0)
    tl.store(Y + pid * N + offs, tl.exp(y))


def state():
    """Which members of the language modules are the interpreter's wrappers (and so patched), by name."""
    out = []
    for mod in (tl, tl.core, tl.math, tl.tensor):
        for name, m in inspect.getmembers(mod):
            if getattr(m, "__name__", "") == "<lambda>":
                out.append(f"{getattr(mod, '__name__', mod)}.{name}")
    return sorted(out)


torch.manual_seed(0)
x = torch.randn(5, 16)
outs, states = [], []
for _ in range(2):
    y = torch.empty_like(x)
    _kernel[(5,)](x, y, N=16)
    outs.append(y.numpy().tobytes().hex())
    states.append(state())
print("OUT", outs[0] == outs[1], outs[0][:64], len(outs[0]))
print("STATE", states[0] == states[1], len(states[0]), ",".join(states[0])[:4000])
if fast:
    print("STATS", interp_fast.STATS["launches"], interp_fast.STATS["nested_skipped"])
'''.replace("HERE", repr(HERE))


def run(mode):
    p = subprocess.run([sys.executable, "-c", SCRIPT, mode], env={**os.environ, "TRITON_INTERPRET": "1"},
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    return {ln.split(" ", 1)[0]: ln.split(" ", 1)[1] for ln in p.stdout.splitlines() if " " in ln}


def test_the_fast_interpreter_computes_and_leaves_what_the_interpreter_does():
    plain, fast = run("plain"), run("fast")
    assert plain["OUT"].startswith("True") and fast["OUT"] == plain["OUT"], (plain["OUT"], fast["OUT"])
    # the same members left patched after the launches (tl.core's, by the standard library's functions: Triton's
    # own leak, kept as it is) and nothing else
    assert fast["STATE"] == plain["STATE"], (plain["STATE"][:300], fast["STATE"][:300])
    launches, skipped = map(int, fast["STATS"].split())
    # two launches of 5 programs, each calling _scale, tl.sum and tl.max: the first standard-library call of a
    # launch patches tl.core, the other nested calls are skipped
    assert launches == 2 and skipped == 2 * 5 * 3 - 2, fast["STATS"]


def test_install_does_nothing_without_the_interpreter(monkeypatch):
    import interp_fast
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert interp_fast.install() is False
