"""Session-cached tiny checkpoints written by transformers (one build per kind), shared by the parity tests."""
from __future__ import annotations

import functools
import tempfile
from pathlib import Path

from tiny_hf import build

_ROOT = Path(tempfile.mkdtemp(prefix="memra-tiny-"))


@functools.lru_cache(maxsize=None)
def tiny_checkpoint(kind: str = "dense", tied: bool = False, seed: int = 0):
    """(hf model, checkpoint dir) for a perturbed tiny model; built and saved once per session."""
    m = build(kind, tied=tied, seed=seed)
    path = _ROOT / f"{kind}-{'tied' if tied else 'untied'}-{seed}"
    m.save_pretrained(path)
    return m, path


@functools.lru_cache(maxsize=None)
def hf_reference(kind: str, tied: bool, prompt: tuple[int, ...], max_new_tokens: int):
    from tiny_hf import hf_greedy
    m, _ = tiny_checkpoint(kind, tied)
    return hf_greedy(m, list(prompt), max_new_tokens)


class LaunchedOnce:
    """launched(key): the deployment of make(key), launched at its first use and then shared (a module fixture's:
    a stage process costs the suite seconds to start); shutdown() stops every one launched."""

    def __init__(self, make):
        self.make, self.deps = make, {}

    def __call__(self, key):
        if key not in self.deps:
            import memra_pp
            self.deps[key] = memra_pp.launch(self.make(key))
        return self.deps[key]

    def shutdown(self):
        for dep in self.deps.values():
            dep.shutdown()


def grown(dep, before):
    """Each stage's counters now minus `before` (a stats()["stages"] taken earlier): what happened in between (the
    tests of a deployment LaunchedOnce shares read its counters so)."""
    def num(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    return [{k: v - b[k] for k, v in s.items() if num(v) and num(b.get(k))}
            for s, b in zip(dep.stats()["stages"], before, strict=True)]
