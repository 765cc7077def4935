"""Sampling on the primary slice: greedy, temperature, top-k, top-p, min-p; seeded and reproducible.

A seeded request draws step n's noise from a generator seeded by (seed, n), so its tokens do not depend on
which other requests share the batch, nor on replays after a stage restart.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from typing import TYPE_CHECKING

from ..errors import InputError

if TYPE_CHECKING:   # torch where tokens are sampled: a client checks SamplingParams without it
    import torch


GREEDY_BELOW = 1e-5        # a temperature under this samples greedily (vLLM's _SAMPLING_EPS)
TOP_K_MAX = 2 ** 31 - 1    # a larger top_k keeps every token, as this one does (no vocabulary is larger)


def _finite(v) -> bool:
    try:
        return math.isfinite(v)
    except OverflowError:       # an int too large for a float
        return False


def _short(v) -> str:
    r = repr(v)
    return r if len(r) <= 40 else f"{r[:20]}...{r[-8:]} ({len(r)} characters)"


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0          # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None

    def validate(self) -> "SamplingParams":
        """These parameters checked, and normalised: a temperature under GREEDY_BELOW is greedy (as vLLM: dividing
        by it sends logits to +-inf), integral top_k and seed (numpy's too) Python ints, top_k -1 (vLLM's off) 0. Every
        stage samples with the normalised copy, so nothing a stage cannot use gets past the intake's submit."""
        for name in ("temperature", "top_p", "min_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real) or not _finite(v):
                raise InputError(f"{name} must be a finite number, got {_short(v)}")
        if not (self.temperature >= 0):
            raise InputError(f"temperature must be >= 0, got {self.temperature!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, numbers.Integral) or self.top_k < -1:
            raise InputError(f"top_k must be an integer >= 0 (0 = off; -1 is off too, as in vLLM), got "
                             f"{self.top_k!r}")
        if not (0 < self.top_p <= 1):
            raise InputError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not (0 <= self.min_p <= 1):     # (1: the most probable tokens only, as vLLM takes it)
            raise InputError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral)):
            raise InputError(f"seed must be an integer or None, got {self.seed!r}")
        if self.seed is not None and not -2 ** 63 <= self.seed < 2 ** 63:    # it travels in the boundary header
            raise InputError(f"seed must fit in a signed 64-bit integer [-2**63, 2**63), got {_short(self.seed)}")
        return dataclasses.replace(
            self, temperature=0.0 if self.temperature < GREEDY_BELOW else float(self.temperature),
            top_k=min(max(int(self.top_k), 0), TOP_K_MAX), top_p=float(self.top_p), min_p=float(self.min_p),
            seed=None if self.seed is None else int(self.seed))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


_M64 = 2 ** 64 - 1


def _mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection of 64-bit integers that spreads every input bit over the output."""
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & _M64
    x = (x ^ (x >> 27)) * 0x94D049BB133111EB & _M64
    return x ^ (x >> 31)


def step_seed(seed: int, step: int) -> int:
    """The generator seed of a seeded request's draw `step`: seed * 1000003 + step, with the seed's high 32 bits
    mixed into every bit. torch's CPU generator (mt19937) reads only the low 32 bits of its seed, so without the mix
    seeds that agree there (5 and 5 + 2**32, 0 and -2**63) drew one stream on a CPU stage. A seed in [0, 2**32)
    mixes in nothing (_mix64(0) == 0): it keeps the stream it always had."""
    s = seed & _M64
    return ((s * 1000003 + step) ^ _mix64(s >> 32)) & _M64      # in [0, 2**64): what manual_seed takes


def _filtered(logits_V: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    import torch
    x = logits_V / p.temperature
    if p.top_k and p.top_k < x.numel():
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if p.min_p > 0:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    if p.top_p < 1:
        sx, si = x.sort(descending=True)
        cum = sx.softmax(-1).cumsum(-1)
        drop = cum - sx.softmax(-1) >= p.top_p          # keep the smallest prefix whose mass reaches top_p
        drop[0] = False             # and always the top token (a top_p under float32's least value rounds to 0)
        x = x.scatter(0, si, sx.masked_fill(drop, float("-inf")))
    return x


class PendingTokens:
    """A step's sampled tokens on their way to the host. For an all-greedy batch the argmax and its logprob are
    enqueued on the device and copied to pinned host memory without waiting (`result()` waits); `device` keeps
    the tokens on the device, so the next decode step can be fed from them before the host has read them."""

    def __init__(self, device: torch.Tensor | None = None, host: torch.Tensor | None = None, event=None,
                 done: tuple[list[int], list[float]] | None = None):
        self.device, self._host, self._event, self._done = device, host, event, done

    def result(self) -> tuple[list[int], list[float]]:
        if self._done is None:
            if self._event is not None:
                self._event.synchronize()
            self._done = (self._host[0].long().tolist(), self._host[1].tolist())
        return self._done


def sample_async(logits_NV: torch.Tensor, params: list[SamplingParams], steps: list[int],
                 rng: torch.Generator | None = None) -> PendingTokens:
    """`sample` without waiting for the device when every row is greedy (the tokens stay on the device too)."""
    import torch
    if not all(p.greedy for p in params):
        return PendingTokens(done=sample(logits_NV, params, steps, rng))
    from memra_pp.kernels.greedy import greedy as greedy_tokens
    # argmax and logprob in one kernel on a GPU (kernels/greedy.py); token ids < 2**53: exact in float64
    greedy, both = greedy_tokens(logits_NV.float())
    if logits_NV.device.type != "cuda":
        return PendingTokens(greedy, both)
    host = torch.empty(both.shape, dtype=both.dtype, pin_memory=True)
    with torch.cuda.device(logits_NV.device):
        host.copy_(both, non_blocking=True)
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(logits_NV.device))
    return PendingTokens(greedy, host, ev)


def sample(logits_NV: torch.Tensor, params: list[SamplingParams], steps: list[int],
           rng: torch.Generator | None = None) -> tuple[list[int], list[float]]:
    """One token per row; returns (tokens, logprobs under the raw temperature-1 distribution)."""
    import torch
    if all(p.greedy for p in params):      # one device->host transfer for the whole batch
        return sample_async(logits_NV, params, steps, rng).result()
    logits_NV = logits_NV.float()
    logp = torch.log_softmax(logits_NV, -1)
    greedy = logits_NV.argmax(-1)
    if rng is not None and rng.device != logits_NV.device:
        rng = None
    toks = []
    for i, p in enumerate(params):
        if p.greedy:
            toks.append(int(greedy[i]))
            continue
        x = _filtered(logits_NV[i], p)
        g = rng
        if p.seed is not None:
            g = torch.Generator(device=logits_NV.device).manual_seed(step_seed(p.seed, steps[i]))
        u = torch.rand(x.shape, generator=g, device=x.device).clamp_(1e-20, 1.0)
        toks.append(int((x - (-u.log()).log()).argmax()))      # Gumbel-max
    lps = logp.gather(1, torch.tensor(toks, device=logp.device)[:, None])[:, 0].tolist()
    return toks, lps
