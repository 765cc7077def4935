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


def record_pieces(lp):
    """check(prompts, chunk) for LocalPipeline `lp` from now: every prompt went in ceil(len / chunk) pieces (one
    where chunk is None), each starting where the last one ended, as the steps lp ran really cut them."""
    rows, step = [], lp.step           # every step's (slot, start, count)
    lp.step = lambda b, ids: rows.extend(zip(b.slots, b.starts, b.counts)) or step(b, ids)

    def check(prompts, chunk):
        for i, p in enumerate(prompts):
            size = chunk or len(p)
            pieces = [(s0, c) for slot, s0, c in rows if slot == i and s0 < len(p)]
            assert pieces == [(k, min(size, len(p) - k)) for k in range(0, len(p), size)], (len(p), chunk, pieces)
    return check


def grown(dep, before):
    """Each stage's counters now minus `before` (a stats()["stages"] taken earlier): what happened in between (the
    tests of a deployment LaunchedOnce shares read its counters so)."""
    def num(v):
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    return [{k: v - b[k] for k, v in s.items() if num(v) and num(b.get(k))}
            for s, b in zip(dep.stats()["stages"], before, strict=True)]
