"""The runtime's environment switches (MEMRA_PP_*): one table, one reader. A switch is 0 or 1; any other value,
or a MEMRA_PP_ name that is not a switch, is a ConfigError naming it (a typo such as MEMRA_PP_KV_IN_PLACE=false
must not silently leave the default on). `launch` checks the driver's environment before any stage starts; the
stages receive the same variables (deployment._make_actor)."""
from __future__ import annotations

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
}
_VALUES = {"0": False, "1": True}


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


def check_environment(environ=None) -> dict[str, bool]:
    """Every MEMRA_PP_* variable set is a known switch with a 0/1 value; returns every switch's value."""
    env = os.environ if environ is None else environ
    unknown = sorted(k for k in env if k.startswith("MEMRA_PP_") and k not in SWITCHES)
    if unknown:
        raise ConfigError(f"environment variable {unknown[0]} is not a memra_pp switch (known: "
                          f"{', '.join(SWITCHES)})")
    return {name: flag(name, env) for name in SWITCHES}
