"""The parity tests' measure of two logprob lists' distance, which a NaN cannot slip through: Python's
max(abs(a - b) for ...) keeps its current value when a later difference is NaN (nan > x is False), so a comparison
`< 5e-4` passed with every logprob after the first NaN (shown by making them so: 19 parity tests passed)."""
from __future__ import annotations

import math


def worst_gap(pairs) -> float:
    """The largest |a - b| over the (a, b) pairs (0.0 for none); NaN if any difference is NaN, so that
    `worst_gap(...) < tol` fails."""
    worst = 0.0
    for a, b in pairs:
        d = abs(a - b)
        if math.isnan(d):
            return math.nan
        worst = max(worst, d)
    return worst
