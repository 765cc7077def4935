"""Session-cached tiny checkpoints written by transformers (one build per kind), shared by the parity tests."""
from __future__ import annotations

import contextlib
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
    """launched(key, **launch_kw): the deployment of make(key), launched at its first use and then shared (a module
    fixture's: a stage process costs the suite seconds to start), serving when returned (a recovery an earlier test
    started is waited for). One an earlier test shut down (ended with `with`) is launched again, and so is one a
    failed test left failing (shut down first): each test also passes alone. launch_kw (detached=True) go to the
    launch. shutdown() stops every one launched."""

    def __init__(self, make):
        self.make, self.deps = make, {}

    def __call__(self, key, **launch_kw):
        import memra_pp
        from memra_pp.errors import StageFailed
        d = self.deps.get(key)
        if d is not None and not d._down:
            try:
                d.wait_ready(90)
            except StageFailed:     # left failed by a test that failed: not the next test's to inherit
                d.shutdown()
        if d is None or d._down:
            d = self.deps[key] = memra_pp.launch(self.make(key), **launch_kw)
        return d

    def shutdown(self):
        for dep in self.deps.values():
            dep.shutdown()


@contextlib.contextmanager
def connected(name: str, namespace: str = "memra-test"):
    """with connected(name) as h: a connect()ed handle of the detached deployment `name` (the ray_cluster fixture's
    namespace), let go at the end: its clients closed, its remote supervisor stopped; never its shutdown(), which
    would stop the deployment."""
    import memra_pp
    h = memra_pp.connect(name, namespace=namespace)
    try:
        yield h
    finally:
        for c in list(h._clients):
            c.close()
        if h.supervisor is not None:
            h.supervisor.stop()


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
