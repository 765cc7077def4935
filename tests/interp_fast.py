"""Triton's interpreter without two costs that change nothing it computes: what tests/interp.py's check runs load
before their script (install(), under TRITON_INTERPRET=1 only).

Measured in the checks (py-spy): much of their time was `inspect.getmembers` over triton.language, twice over
(the eleven check runs of interp.CHECKS, each with and without this side by side: 566 to 414 CPU-seconds, 0.66-0.87
of each run's):
- a launch patches the language's builtins for the interpreter and restores them after (`_patch_lang`), listing
  every member of `tl`, `tl.tensor` and `tl.math` to find them: the list is the same at every launch, so it is
  made once (at the first launch, from the unpatched modules) and kept;
- every call of a @triton.jit helper from inside a kernel (`InterpretedFunction.__call__`: once per program and
  call, `tl.sum` and `tl.max` included) patches again, and never restores. Inside a launch, once the language
  modules the helper's module sees are patched (by the launch, or by an earlier helper call in it: the standard
  library's functions see `tl.core` as well), that finds no builtin left to patch and only sets the same
  attributes again, so it is skipped there.
Nothing else changes: the same builtins are patched with the same wrappers, and the checks' kernels run as they
did (their results are compared with the torch references as before)."""
from __future__ import annotations

import inspect
import os
import threading

STATS = {"launches": 0, "nested_skipped": 0}


def install() -> bool:
    """Patches triton.runtime.interpreter (once); False where TRITON_INTERPRET is not 1 (nothing to speed up)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    import triton.language as tl
    from triton.runtime import interpreter as ti
    if getattr(ti, "_memra_fast", False):
        return True
    builtins: dict = {}                 # pkg -> [(name, member)] of its builtins, listed unpatched
    state = threading.local()

    def patch_builtin(pkg, builder, scope):
        members = builtins.get(pkg)
        if members is None:
            members = builtins[pkg] = [(n, m) for n, m in inspect.getmembers(pkg) if tl.core.is_builtin(m)]
        for name, member in members:
            ti._patch_attr(pkg, name, member, builder, scope)

    patch_lang = ti._patch_lang

    seen: dict = {}                     # fn -> the language modules its module sees (as _patch_lang finds them)

    def langs_of(fn) -> frozenset:
        langs = seen.get(fn)
        if langs is None:
            langs = seen[fn] = frozenset(id(v) for v in fn.__globals__.values()
                                         if inspect.ismodule(v) and v in (tl, tl.core))
        return langs

    def fast_patch_lang(fn):
        if getattr(state, "launching", False):      # the launch's own patch, from the unpatched language
            state.launching = False
            state.langs = langs_of(fn)
            return patch_lang(fn)
        active = getattr(state, "langs", None)
        if active is None:
            return patch_lang(fn)
        langs = langs_of(fn)
        if langs <= active:
            STATS["nested_skipped"] += 1
            return ti._LangPatchScope()             # patched in the launch around this call already
        state.langs = active | langs                # (triton.language.standard's sees tl.core too: patched now)
        return patch_lang(fn)

    grid_call = ti.GridExecutor.__call__

    def call(self, *args, **kwargs):
        prev = getattr(state, "langs", None)
        state.launching = True
        STATS["launches"] += 1
        try:
            return grid_call(self, *args, **kwargs)
        finally:
            state.launching = False
            state.langs = prev

    ti._patch_builtin = patch_builtin
    ti._patch_lang = fast_patch_lang
    ti.GridExecutor.__call__ = call
    ti._memra_fast = True
    return True
