"""Where each microbatch's work lay in time on one stage: (kind, tokens, start, end) spans on the host's
CLOCK_MONOTONIC (time.monotonic), which every process of a node shares, so the stages of a deployment line up on one
axis (benchmarks plot them: is a long prompt's chunked prefill pipelined across the stages?). On a GPU the span is
the device's, from the timing events around the microbatch, placed on the host clock through one anchor event.
Runs in stage processes.
"""
from __future__ import annotations

import collections
import time

import torch

SPANS = 4096        # the most recent spans kept per stage


def kind_of(counts: list[int]) -> str:
    """A microbatch that carries more than one token of any sequence is (chunked) prefill work."""
    return "prefill" if any(c > 1 for c in counts) else "decode"


class Timeline:
    def __init__(self, maxlen: int = SPANS):
        self.spans: collections.deque = collections.deque(maxlen=maxlen)
        self._anchor: tuple[torch.cuda.Event, float] | None = None

    def host(self, kind: str, tokens: int, start: float, end: float) -> None:
        """A span timed on the host (a CPU stage computes synchronously)."""
        self.spans.append((kind, tokens, start, end))

    def anchor(self) -> None:
        """GPU: once, an event recorded and waited for, with the host time it completed (within the wait's few
        microseconds): every later event's offset from it places that event on the host clock."""
        if self._anchor is None:
            a = torch.cuda.Event(enable_timing=True)
            a.record()
            a.synchronize()
            self._anchor = (a, time.monotonic())

    def device(self, kind: str, tokens: int, start: torch.cuda.Event, seconds: float) -> None:
        """A span between two completed timing events (`seconds` apart), the first recorded after anchor()."""
        if self._anchor is not None:
            a, t = self._anchor
            s = t + a.elapsed_time(start) / 1e3
            self.spans.append((kind, tokens, s, s + seconds))

    def since(self, t0: float = 0.0) -> list[list]:
        """The spans that ended after t0, oldest first, as lists (they travel through Ray and JSON)."""
        return [list(s) for s in self.spans.copy() if s[3] >= t0]     # copy: one C call, atomic under the GIL
