"""The one fan-in for cross-actor calls: wait for every ref at once, with a timeout, unwrapping our own errors."""
from __future__ import annotations

import ray

from .errors import MemraError, StageFailed


def get(refs, timeout: float, what: str):
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise StageFailed(f"{what}: no answer within {timeout:.0f} s") from None
    except ray.exceptions.RayTaskError as e:
        cause = getattr(e, "cause", None)
        if isinstance(cause, MemraError):
            raise cause from None
        raise StageFailed(f"{what}: {e}") from None
    except ray.exceptions.RayActorError as e:
        raise StageFailed(f"{what}: a stage actor died ({e})") from None
