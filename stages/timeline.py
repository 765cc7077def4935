"""Where each microbatch's work lay in time on one stage: (kind, tokens, start, end) spans on the host's
CLOCK_MONOTONIC (time.monotonic), which every process of a node shares, so the stages of a deployment line up on one
axis (benchmarks plot them: is a long prompt's chunked prefill pipelined across the stages?). On a GPU the span is
the device's, from the timing events around the microbatch, placed on the host clock through an anchor event: one
recorded and waited for once, then the end event of each placed span (event offsets are float32 milliseconds, so
offsets from one old anchor would lose precision as the deployment ages; offsets from the previous span stay
small). Runs in stage processes.
"""
from __future__ import annotations

import collections
import time

import torch

SPANS = 4096        # the most recent spans kept per stage


def kind_of(counts: list[int], starts: list[int]) -> str:
    """A microbatch that carries more than one token of a sequence, or a sequence's first token, is prefill work
    (a one-token last chunk of a longer prompt reads as decode)."""
    return "prefill" if any(c > 1 or s == 0 for c, s in zip(counts, starts)) else "decode"


class Timeline:
    def __init__(self, maxlen: int = SPANS):
        self.spans: collections.deque = collections.deque(maxlen=maxlen)
        self.dropped = 0                    # spans pushed out of the deque by newer ones
        self._anchor: tuple[torch.cuda.Event, float] | None = None

    def _add(self, span: tuple) -> None:
        self.dropped += len(self.spans) == self.spans.maxlen
        self.spans.append(span)

    def host(self, kind: str, tokens: int, start: float, end: float) -> None:
        """A span timed on the host (a CPU stage computes synchronously)."""
        self._add((kind, tokens, start, end))

    def anchor(self) -> None:
        """GPU, once: the stream drained, then an event recorded and waited for, placed at the midpoint of the host
        times around the wait (the stream is empty, so the event runs at once)."""
        if self._anchor is None:
            torch.cuda.current_stream().synchronize()
            a = torch.cuda.Event(enable_timing=True)
            t0 = time.monotonic()
            a.record()
            a.synchronize()
            self._anchor = (a, (t0 + time.monotonic()) / 2)

    def device(self, kind: str, tokens: int, start: torch.cuda.Event, end: torch.cuda.Event, seconds: float) -> None:
        """A span between two completed timing events (`seconds` apart, recorded after anchor(), summed in stream
        order); its end event anchors the next span."""
        if self._anchor is not None:
            a, t = self._anchor
            s = t + a.elapsed_time(start) / 1e3
            self._add((kind, tokens, s, s + seconds))
            self._anchor = (end, s + seconds)

    def since(self, t0: float = 0.0) -> dict:
        """The spans that ended after t0, oldest first, as lists (they travel through Ray and JSON); `complete` is
        False when older spans were dropped and the oldest kept one ends after t0 (the window lost its start)."""
        spans = [list(s) for s in self.spans.copy() if s[3] >= t0]   # copy: one C call, atomic under the GIL
        return {"spans": spans, "complete": not (self.dropped and self.spans and self.spans[0][3] >= t0)}
