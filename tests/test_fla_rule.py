"""fla_rule's tuning guards, on CPU: a kernel tuned once keeps its first winner for every later key, and
tuned_keys() counts the keys fla's autotuners hold (tests/test_gpu_fla.py runs fla itself)."""
import sys
import types

from triton.runtime.autotuner import Autotuner

from memra_pp.model import fla_rule


class _Tuner(Autotuner):
    """An autotuner without a kernel: run() tunes a new key by taking the config the key names."""

    def __init__(self, configs):       # noqa: D107 (Autotuner's own __init__ needs a JIT function)
        self.configs, self.cache, self.runs = list(configs), {}, 0

    def run(self, key):
        self.runs += 1
        if len(self.configs) > 1 and key not in self.cache:
            self.cache[key] = self.configs[key % len(self.configs)]
        return self.cache.get(key, self.configs[0])


def test_tune_once_keeps_the_first_winner_and_counts_keys(monkeypatch):
    tuner = _Tuner(["a", "b", "c"])
    wrapped = types.SimpleNamespace(fn=tuner)          # as a heuristics wrapper holds its autotuner
    mod = types.ModuleType("fla.fake_kernels")
    mod.kernel = wrapped
    monkeypatch.setitem(sys.modules, "fla.fake_kernels", mod)
    before = fla_rule.tuned_keys()          # fla's own tuners, where fla is installed
    fla_rule._tune_once(wrapped)
    fla_rule._tune_once(wrapped)                      # idempotent: one wrapper
    assert tuner.run(1) == "b" and tuner.configs == ["b"]
    assert tuner.run(2) == "b" and tuner.run(0) == "b"     # new keys: the first winner, nothing tuned
    assert tuner.runs == 3 and fla_rule.tuned_keys() == before + 1
