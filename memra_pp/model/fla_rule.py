"""flash-linear-attention kernels for the gated delta rule on CUDA (same contract as gdn.py's torch forms:
raw q/k, l2-normalised before the chunk kernels and inside the recurrent one, scale dk^-1/2, fp32 state in and
out).

fla autotunes its Triton kernels on first use of each key. Two keys move with the prefill step, so a deployment
met new ones whenever arrivals packed a step differently, and the request waited for the tuning (measured on an
H200: 42 s for the first 64 x 128-token step after warm-up, 10 s for 32 x 128, then 160-300 ms):
- l2norm_fwd keys on a bucket of the token count, and the bucket is a compile-time constant: 25 configs compiled
  and timed per bucket. The chunk path normalises q and k itself (kernels/fused_decode.l2norm: fla's arithmetic,
  one tile).
- chunk_local_cumsum keys on the number of equal-length sequences a call takes: its first tuning serves every
  later key (`_tune_once`). That number is also a compile-time constant of the kernel, so a new one still compiles
  one config (the ~0.2 s that remained in a new shape's first step on an H200), but times none.
Every other key fla tunes on is fixed by the model's dimensions. `tuned_keys()` counts the keys tuned so far in this
process (stage stats report it: a timed run that tunes nothing has the same count before and after)."""
from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import sys

import torch

from memra_pp.switches import initial

log = logging.getLogger(__name__)


WHY_NOT: str | None = None      # why an installed fla could not be used (None: absent, or usable); set by _probe


def available() -> bool:
    """fla is installed, imports, and CUDA is here. fla is optional: absent (no message), the torch/Triton forms
    serve. Installed but broken (built for another triton, or too old to have the gated delta rule) is said once in
    a warning and kept in WHY_NOT: the stage then runs the slower forms, and whoever reads the log or gdn_backend
    should know why. The import is tried once a process (_probe is cached)."""
    return _probe() and torch.cuda.is_available()


@functools.cache
def _probe() -> bool:
    global WHY_NOT
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
        return True
    except ModuleNotFoundError as e:
        if e.name == "fla":             # no fla at all; a missing fla.ops... is an fla without the kernels
            return False
        WHY_NOT = f"{type(e).__name__}: {e}"
    except Exception as e:
        WHY_NOT = f"{type(e).__name__}: {e}"
    log.warning("flash-linear-attention is installed but cannot be used (%s); the gated delta rule runs on "
                "memra_pp's own kernels", WHY_NOT)
    return False


class FlaRule:
    """gva: q and k may keep their own (fewer) heads, each serving HV / H consecutive value heads, as
    repeat_interleave maps them (fla's grouped value attention, `i_h // (HV // H)`); set by a warm-up whose grouped
    calls gave what the repeated ones give, so an fla without it (or mapping heads otherwise) gets the repeated
    heads."""
    name = "fla"
    gva = False
    _chunk_h = None     # GridPick of fla's chunk_h (MEMRA_PP_CHUNK_H_GRID), where this fla has its configs

    def __init__(self):
        # fla 0.6 dispatches chunk_gated_delta_rule to other backends where installed (flash_qla, priority 3, on by
        # default: TileLang kernels that take no chunk indices and were never tuned at load); memra_pp's calls,
        # warm-ups and no-sync contract are fla's Triton kernels', so that backend stays off unless asked for (fla
        # reads the variable at every call; this sets it for the whole process and its children)
        os.environ.setdefault("FLA_FLASH_QLA", "0")
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
        from fla.ops.utils import cumsum
        self._chunk, self._rec = chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
        _tune_once(cumsum.chunk_local_cumsum_scalar_kernel)
        for mod, kernel, want in PINS:
            _pin(_kernel(mod, kernel), want)
        if CHUNK_H_GRID:        # (MEMRA_PP_CHUNK_H_GRID) chunk_h's config call by call instead of its pin
            self._chunk_h = GridPick.make(_kernel(*CHUNK_H), CHUNK_H_BY_GRID, CHUNK_H_MANY)

    def warm_up(self, heads: int, dk: int, dv: int, dtype, device, k_heads: int | None = None) -> None:
        """Tune and compile fla's kernels for these dimensions now (a stage load), not in the first request's
        prefill (2.8 s for the 35B-A3B on an H200): one chunk of 64 tokens and one recurrent token (of zeros, or the
        grouped check's random inputs). Once a process for each set of dimensions; Triton's disk cache keeps the
        tunings for later processes. k_heads
        (fewer than the value heads `heads`): q and k with their own heads (gva) where this fla takes them; the 27B
        then normalises and reads a third of the q / k rows a prefill would repeat."""
        from memra_pp.kernels import prefill as pf
        kh = k_heads or heads
        key = (heads, kh, dk, dv, dtype, str(device), pf.VARLEN)
        if key in _WARM:                 # another stage model of this process warmed these: its finding holds here
            self.gva = _WARM[key]
            return

        def z(*shape, dt=dtype):
            return torch.zeros(*shape, dtype=dt, device=device)

        def run(qh):
            for n, fn in ((64, self.chunk), (1, self.recurrent)):
                fn(z(1, n, qh, dk), z(1, n, qh, dk), z(1, n, heads, dv), z(1, n, heads, dt=torch.float32),
                   z(1, n, heads), z(1, heads, dk, dv, dt=torch.float32))
        if kh < heads:
            try:
                self.gva = self._grouped_equals_repeated(kh, heads, dk, dv, dtype, device)
            except Exception as e:  # noqa: BLE001 - an fla without grouped value heads: repeat q and k instead
                log.info("fla takes no grouped value heads (%s: %s); q and k are repeated", type(e).__name__, e)
                self.gva = False
        qh = kh if self.gva else heads
        # (with chunk_h picked call by call, each of its configs compiled now: a request meeting a new one would
        # wait for Triton)
        for cfg in self._chunk_h.every() if self._chunk_h is not None else [None]:
            with self._chunk_h.forced(cfg) if cfg is not None else contextlib.nullcontext():
                if not self.gva or cfg is not None:     # (the grouped check ran gva's calls with one config)
                    run(qh)
                if pf.VARLEN:       # the variable-length call's binaries (IS_VARLEN), one tuning of each
                    self.chunk_varlen(z(1, 64, qh, dk), z(1, 64, qh, dk), z(1, 64, heads, dv),
                                      z(1, 64, heads, dt=torch.float32), z(1, 64, heads),
                                      z(2, heads, dk, dv, dt=torch.float32), torch.tensor([0, 40, 64], device=device),
                                      torch.tensor([[0, 0], [1, 0]], device=device))
        _WARM[key] = self.gva

    def _grouped_equals_repeated(self, kh: int, heads: int, dk: int, dv: int, dtype, device) -> bool:
        """Whether this fla's chunked and recurrent rules give, for q and k with kh heads, what they give for q and
        k repeated to the value heads, on random inputs (an fla that indexes q and k by the value head raises here
        or differs; not raising alone proves nothing). Runs, so compiles and tunes, both shapes."""
        gen = torch.Generator(device=device).manual_seed(0)

        def r(*s):
            return torch.randn(*s, device=device, generator=gen)
        n, rep = 64, heads // kh
        q, k, v = r(1, n, kh, dk).to(dtype), r(1, n, kh, dk).to(dtype), r(1, n, heads, dv).to(dtype)
        g = -torch.rand(1, n, heads, device=device, generator=gen)
        beta = torch.rand(1, n, heads, device=device, generator=gen).to(dtype)
        s0 = r(1, heads, dk, dv) * 0.1
        for fn, m in ((self.chunk, n), (self.recurrent, 1)):
            a = fn(q[:, :m], k[:, :m], v[:, :m], g[:, :m], beta[:, :m], s0)
            b = fn(q[:, :m].repeat_interleave(rep, 2), k[:, :m].repeat_interleave(rep, 2), v[:, :m], g[:, :m],
                   beta[:, :m], s0)
            for x, y in zip(a, b, strict=True):
                if x.shape != y.shape or not torch.allclose(x.float(), y.float(), rtol=2e-2, atol=2e-2):
                    return False
        return True

    def chunk(self, q, k, v, g, beta, state):
        from memra_pp.kernels.fused_decode import l2norm
        # the one-tile l2norm kernel takes contiguous rows: on the merged prefill path the conv wrote q and k so
        # (contiguous() is then free); without it, grouped heads (gva) are views into the conv's output, copied here
        # (a third of the rows the repeat copied)
        if self._chunk_h is not None:
            self._chunk_h.set(v.shape[0], v.shape[-2], v.shape[-1], v.device)
        o, s = self._chunk(l2norm(q.contiguous()), l2norm(k.contiguous()), v, g=g.float(), beta=beta,
                           initial_state=state.float().contiguous(), output_final_state=True,
                           use_qk_l2norm_in_kernel=False)
        return o, s.float()

    def chunk_varlen(self, q, k, v, g, beta, state, cu, chunks, normed: bool = False):
        """chunk over packed segments: q, k, v, g, beta [1, R, ...] hold segment s at rows cu[s]:cu[s + 1], states
        [N, ...] (fla's cu_seqlens; chunks: its chunk_indices, (segment, chunk) of every 64-token chunk, made on the
        host with the step's other indices, so that fla computes none from cu on the device: that waits for it).
        `normed`: q and k are l2-normalised already (the rule graphs normalise the real rows into their buffers)."""
        from memra_pp.kernels.fused_decode import l2norm
        if not normed:
            q, k = l2norm(q.contiguous()), l2norm(k.contiguous())
        if self._chunk_h is not None:
            self._chunk_h.set(cu.shape[0] - 1, v.shape[-2], v.shape[-1], v.device)
        o, s = self._chunk(q, k, v, g=g.float(), beta=beta,
                           initial_state=state.float().contiguous(), output_final_state=True,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=cu, chunk_indices=chunks)
        return o, s.float()

    def recurrent(self, q, k, v, g, beta, state):
        # keywords, as transformers calls it: the recurrent kernel's positional order differs from chunk's
        o, s = self._rec(q, k, v, g=g.float(), beta=beta, initial_state=state.float().contiguous(),
                         output_final_state=True, use_qk_l2norm_in_kernel=True)
        return o, s.float()

    def decode(self, q, k, v, g, beta, state_pool, slots):
        """One token per sequence, in place at the state pool's slots (kernels/gdn_decode.py: fla's arithmetic)."""
        from memra_pp.kernels.gdn_decode import gdn_decode
        return gdn_decode(q, k, v, g, beta, state_pool, slots, q.shape[-1] ** -0.5)


_WARM: dict = {}     # (heads, k_heads, dk, dv, dtype, device) warmed up in this process -> gva


def _autotuner(kernel):
    """The Triton Autotuner inside a kernel object (under its heuristics wrappers), or None."""
    from triton.runtime.autotuner import Autotuner
    while kernel is not None and not isinstance(kernel, Autotuner):
        kernel = getattr(kernel, "fn", None)
    return kernel


# fla's fused kkt-solve kernel, pinned to one of its own autotuner's configs. The warm-up tunes it on one chunk (a
# grid of one program a head), where its choice is a toss-up; over a real step's grid the choices differ by up to 2x
# (`benchmarks/fla_host.py --kkt-configs`, 35B-A3B dimensions, one H100, forty-first session, us for 16 / 16 + 2 idle
# / 18 / 32 chunk programs a head): BK 64 with 1 warp 19.4 / 21.5 / 21.9 / 24.6, with 2 warps 20.7 / 33.2 / 34.7 /
# 40.8, with 4 warps 37.7 / 37.9 / 52.6 / 77.1. Processes had tuned 2 warps (the rule graphs' padded calls then paid
# 13 us a layer for two idle programs a head) and 4 (every call 1.9x the pinned one's time).
KKT_SOLVE_CONFIG = {"BK": 64, "num_warps": 1}
# fla's chunk_h carries the state across a segment's chunks: one program per BV value columns of a head and segment,
# each looping over its segment's chunks. The warm-up tunes it on one chunk too, and no one config of its 12 is fastest
# at every layout of a step (`fla_host.py --chunk-configs 1x1024,1x4096,8x256,16x128`, one H100, forty-second
# session, us a call, 35B-A3B with 32 value heads / 27B with 48):
#   BV 64, 4 warps, 4 stages (pinned): 29.7 / 104.2 / 54.1 / 72.5 and 31.4 / 107.4 / 79.5 / 106.1
#   BV 32, 4 warps, 4 stages:          23.4 / 80.4 / 71.7 / 97.6 and 45.9 / 158.0 / 106.3 / 144.0
#   BV 64, 4 warps, 2 stages:          35.6 / 155.0 / 47.0 / 60.0 and 44.1 / 173.8 / 69.2 / 87.2
#   BV 32, 2 warps, 2 stages (the 27B's processes had tuned it): 41.0 / 159.7 / 74.4 / 90.8 for the 27B
# The pin is within 1.22-1.30x of the fastest at each point and has the least sum for both models; the worst configs
# take 3-4x the fastest. (One config a call by its grid against the SMs would take the fastest at all eight points;
# each of its configs would then need compiling at load: docs/PERF.md, forty-second session.)
CHUNK_H_CONFIG = {"BV": 64, "num_warps": 4, "num_stages": 4}
# MEMRA_PP_CHUNK_H_GRID (off): GridPick gives chunk_h the first of CHUNK_H_BY_GRID whose grid fits one wave of the
# SMs, else CHUNK_H_MANY: at each of the eight points above, the fastest of its configs measured. Not yet measured in a
# step; each of the three configs is compiled at load.
CHUNK_H_BY_GRID = ({"BV": 32, "num_warps": 4, "num_stages": 4}, {"BV": 64, "num_warps": 4, "num_stages": 4})
CHUNK_H_MANY = {"BV": 64, "num_warps": 4, "num_stages": 2}
CHUNK_H_GRID = initial("MEMRA_PP_CHUNK_H_GRID")
# fla's recompute_w_u: its 9 configs are within 14% of each other over the same eight points; 4 warps / 3 stages
# has the least sum for both models and is the fastest or within 0.05 us at each (35B-A3B 11.9 / 49.3 / 24.0 / 24.3
# us, 27B 17.7 / 73.4 / 36.7 / 37.0); processes had tuned 4 warps / 4 stages for the 35B-A3B (13.1 / 52.6 / 26.1 /
# 26.2) and 8 warps / 3 stages for the 27B (18.1 / 74.6 / 37.5 / 37.3).
RECOMPUTE_W_U_CONFIG = {"num_warps": 4, "num_stages": 3}
CHUNK_H = ("fla.ops.common.chunk_delta_h", "chunk_gated_delta_rule_fwd_kernel_h_blockdim64")
# (module, kernel, config) pinned when FlaRule is made
PINS = (("fla.ops.gated_delta_rule.chunk_fwd", "chunk_gated_delta_rule_fwd_kkt_solve_kernel", KKT_SOLVE_CONFIG),
        (*CHUNK_H, CHUNK_H_CONFIG),
        ("fla.ops.gated_delta_rule.wy_fast", "recompute_w_u_fwd_kernel", RECOMPUTE_W_U_CONFIG))


def _kernel(module: str, name: str):
    """fla's kernel object `name` in `module`, or None where this fla has no such module or kernel."""
    try:
        return getattr(importlib.import_module(module), name, None)
    except ImportError:
        return None


class GridPick:
    """A kernel's autotuner set, call by call, to one of its own configs by the call's grid: the first of
    `by_grid` whose programs (segments x heads x value columns / BV) fit one wave of the device's SMs, else `many`.
    `make` gives None (the autotuner left as it was) where the kernel, its autotuner or any of these configs is
    missing."""

    def __init__(self, tuner, by_grid: list, many):
        self.tuner, self.by_grid, self.many, self._sms, self._forced = tuner, by_grid, many, {}, None

    @classmethod
    def make(cls, kernel, by_grid, many) -> GridPick | None:
        tuner = _autotuner(kernel)
        if tuner is None:
            return None
        every = list(getattr(tuner, "_memra_all", None) or tuner.configs)
        found = [_matching(every, want) for want in (*by_grid, many)]
        if any(len(f) != 1 for f in found):
            return None
        tuner._memra_all = every        # (benchmarks try each)
        tuner.cache.clear()
        pick = cls(tuner, [f[0] for f in found[:-1]], found[-1][0])
        tuner.configs = [pick.many]
        return pick

    def every(self) -> list:
        return [*self.by_grid, self.many]

    def choose(self, segments: int, heads: int, dv: int, device):
        """The config for a call over `segments` segments of `heads` heads with `dv` value columns."""
        key = getattr(device, "index", None)
        sms = self._sms.get(key)
        if sms is None:
            sms = self._sms[key] = torch.cuda.get_device_properties(device).multi_processor_count
        for cfg in self.by_grid:
            if segments * heads * -(-dv // cfg.kwargs["BV"]) <= sms:
                return cfg
        return self.many

    def set(self, segments: int, heads: int, dv: int, device) -> None:
        self.tuner.configs = [self._forced or self.choose(segments, heads, dv, device)]

    @contextlib.contextmanager
    def forced(self, cfg):
        """Every call inside takes `cfg` (the warm-up compiles each config so)."""
        self._forced = cfg
        try:
            yield
        finally:
            self._forced = None


def _pin(kernel, want: dict) -> bool:
    """Cut the kernel's autotuner to its own config matching `want` (kwargs, num_warps, num_stages), if it has
    exactly one: then no tuning picks another. False (nothing changed) where it has none, or several, or no
    autotuner."""
    tuner = _autotuner(kernel)
    if tuner is None:
        return False
    every = getattr(tuner, "_memra_all", None) or list(tuner.configs)    # (a kernel pinned or picked before)
    hits = _matching(every, want)
    if len(hits) != 1:
        return False
    tuner._memra_all = every    # (benchmarks try each)
    tuner.configs = hits
    tuner.cache.clear()     # (a key tuned before the pin would keep its old choice)
    return True


def _matching(configs: list, want: dict) -> list:
    """The configs matching `want` (kwargs, num_warps, num_stages)."""
    return [c for c in configs if all((getattr(c, k) if k in ("num_warps", "num_stages") else c.kwargs.get(k)) == v
                                      for k, v in want.items())]


def _tune_once(kernel) -> None:
    """After its first tuning, the kernel keeps the winning config for every later key (idempotent)."""
    tuner = _autotuner(kernel)
    if tuner is None or getattr(tuner, "_memra_once", False):
        return
    first = tuner.run

    def run(*args, **kwargs):
        out = first(*args, **kwargs)
        if len(tuner.configs) > 1 and tuner.cache:
            tuner.configs = [next(iter(tuner.cache.values()))]
        return out

    tuner.run, tuner._memra_once = run, True


def tuned_keys() -> int:
    """Keys fla's autotuners have tuned (or read from Triton's disk cache) in this process; 0 without fla."""
    seen, n = set(), 0
    for name, mod in list(sys.modules.items()):
        if not name.startswith("fla.") or mod is None:
            continue
        for obj in list(vars(mod).values()):
            tuner = _autotuner(obj) if hasattr(obj, "fn") else None
            if tuner is not None and id(tuner) not in seen:
                seen.add(id(tuner))
                n += len(tuner.cache)
    return n
