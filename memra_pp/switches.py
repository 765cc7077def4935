"""The runtime's environment switches (MEMRA_PP_*): one table, one reader. A switch is 0 or 1; any other value,
or a MEMRA_PP_ name that is not a switch, is a ConfigError naming it (a typo such as MEMRA_PP_KV_IN_PLACE=false
must not silently leave the default on). `launch` resolves every switch from the driver's environment before any
stage starts, and passes the values to each stage's setup, which sets them where they are read (apply): a stage
never takes a mode from its own environment (DESIGN law 2). A process without stages (one-process use: the tests,
the benchmarks' engine steps) starts from its environment's values, read leniently when each module is imported
(`initial`: an import never raises, since a stage's worker may carry a malformed variable its setup overrides), and
checks them strictly at its start (`check_environment`: tests/conftest.py, gpu_engine_step.main)."""
from __future__ import annotations

import importlib
import os

from .errors import ConfigError

SWITCHES = {
    "MEMRA_PP_ANY_KV_GRAPHS": (True, "one decode graph per batch bucket serves every KV length (captured at load)"),
    "MEMRA_PP_KV_IN_PLACE": (True, "KV pools grow in place by mapping memory (0: grow by copying)"),
    "MEMRA_PP_MOE_BLOCK": (False, "the single-kernel MoE block at batch 1 (measured slower in the step; GPU only)"),
    "MEMRA_PP_SDPA_CUDNN": (False, "torch's own SDPA choice for the prefill's and the vision tower's attention, "
                                   "cuDNN included (it plans each new shape: model/attention.sdpa; GPU only)"),
    "MEMRA_PP_PREFILL_MERGED": (True, "the prefill's merged projections, contiguous conv parts and row slices, "
                                      "and eager decode's merged projections (kernels/prefill.py; GPU only)"),
    "MEMRA_PP_PREFILL_VARLEN": (True, "on the merged path, a prefill step's Gated DeltaNet segments, and its fresh "
                                      "segments' attention, as one variable-length call each (kernels/prefill.py; "
                                      "GPU only; 0: one call per group of equal lengths)"),
    "MEMRA_PP_PREFILL_GRAPHS": (True, "prompt steps through piecewise CUDA graphs per token bucket (the mixers' "
                                      "cores eager between them: model/prefill_graphs.py; GPU only)"),
    "MEMRA_PP_RULE_GRAPHS": (False, "inside the prefill graphs, fla's chunked Gated DeltaNet rule through CUDA graphs "
                                    "per row and segment bucket (model/prefill_graphs.RuleGraphs; GPU only): a "
                                    "quarter of its host time for a fifth more device time, off where the host keeps "
                                    "up (docs/PERF.md, thirty-ninth session)"),
    "MEMRA_PP_CHUNK_H_GRID": (False, "fla's chunk_h kernel gets its config call by call from the call's grid against "
                                     "the SMs (model/fla_rule.GridPick; GPU only; 0: one pinned config): the "
                                     "fastest of three measured at each layout, not yet measured in a step (docs/"
                                     "PERF.md, forty-second session)"),
    "MEMRA_PP_SKIP_PADDING": (True, "a decode graph's padding rows skip the Gated DeltaNet's state and the MoE's "
                                    "experts (model/decode_graphs.SKIP_PADDING; GPU only; 0: they run as real rows, "
                                    "reading a state and their experts' weights)"),
    "MEMRA_PP_GC_FREEZE": (True, "each stage collects its heap once and freezes it when it starts serving (as vLLM "
                                 "does), so no full collection walks the libraries' objects mid-run (a ~160 ms "
                                 "stall of the whole pipeline on the CPU stages measured)"),
}
_VALUES = {"0": False, "1": True}
# where each switch's value is read in a process: module, attribute (set at import from the environment, then by
# apply in a stage process)
TARGETS = {
    "MEMRA_PP_ANY_KV_GRAPHS": ("memra_pp.model.decode_graphs", "ANY_KV"),
    "MEMRA_PP_KV_IN_PLACE": ("memra_pp.model.cache", "IN_PLACE"),
    "MEMRA_PP_MOE_BLOCK": ("memra_pp.kernels.moe_block", "ENABLED"),
    "MEMRA_PP_SDPA_CUDNN": ("memra_pp.model.attention", "SDPA_CUDNN"),
    "MEMRA_PP_PREFILL_MERGED": ("memra_pp.kernels.prefill", "MERGED"),
    "MEMRA_PP_PREFILL_VARLEN": ("memra_pp.kernels.prefill", "VARLEN"),
    "MEMRA_PP_PREFILL_GRAPHS": ("memra_pp.model.prefill_graphs", "ENABLED"),
    "MEMRA_PP_RULE_GRAPHS": ("memra_pp.model.prefill_graphs", "RULE_GRAPHS"),
    "MEMRA_PP_CHUNK_H_GRID": ("memra_pp.model.fla_rule", "CHUNK_H_GRID"),
    "MEMRA_PP_SKIP_PADDING": ("memra_pp.model.decode_graphs", "SKIP_PADDING"),
    "MEMRA_PP_GC_FREEZE": ("memra_pp.stages.runner", "GC_FREEZE"),
}


def flag(name: str, environ=None) -> bool:
    """The switch's value: the environment's 0/1, else its default."""
    default, _ = SWITCHES[name]
    raw = (os.environ if environ is None else environ).get(name)
    if raw is None:
        return default
    if raw.strip() not in _VALUES:
        raise ConfigError(f"environment variable {name}={raw!r}: a switch is 0 or 1 (default "
                          f"{int(default)}: {SWITCHES[name][1]})")
    return _VALUES[raw.strip()]


def initial(name: str) -> bool:
    """A module's value at import: the environment's 0/1, else the default; never raises (check_environment, at
    launch or a one-process entry point's start, is the strict reader, and a stage's setup overrides it: apply)."""
    try:
        return flag(name)
    except ConfigError:
        return SWITCHES[name][0]


def check_environment(environ=None) -> dict[str, bool]:
    """Every MEMRA_PP_* variable set is a known switch with a 0/1 value; returns every switch's value."""
    env = os.environ if environ is None else environ
    unknown = sorted(k for k in env if k.startswith("MEMRA_PP_") and k not in SWITCHES)
    if unknown:
        raise ConfigError(f"environment variable {unknown[0]} is not a memra_pp switch (known: "
                          f"{', '.join(SWITCHES)})")
    return {name: flag(name, env) for name in SWITCHES}


def apply(values: dict[str, bool]) -> None:
    """A stage's setup: the driver's resolved switches (check_environment's answer) set where this process reads
    them, before anything is built with them. Every switch must be given: a missing one would leave this process's
    own environment deciding."""
    if set(values) != set(SWITCHES):
        raise ConfigError(f"a stage was given the switches {sorted(values)}; it needs exactly {sorted(SWITCHES)}")
    for name, value in values.items():
        module, attr = TARGETS[name]
        setattr(importlib.import_module(module), attr, bool(value))


def current() -> dict[str, bool]:
    """Every switch as this process has it now (where apply set it)."""
    return {name: bool(getattr(importlib.import_module(m), a)) for name, (m, a) in TARGETS.items()}

