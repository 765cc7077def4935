"""The project's shared-memory segments that killed stage processes leave behind (a killed process unlinks nothing):
the names a stage's setup answer gives, and unlinking them, or every segment of a process by its pid, on this host.
Driver side (launch, teardown, the supervisor) and stage side (a replacement unlinks its predecessor's)."""
from __future__ import annotations

import fnmatch
import os
import time

import ray


def shm_names(info: dict | None) -> list[str]:
    """The shared-memory segments a stage's setup / relink answer names (its receiving slots), and the name
    prefixes of segments it makes later (the intake's publication slots): what to unlink if it is killed."""
    ep = (info or {}).get("endpoint") or {}
    return list(ep.get("shm") or []) + ([ep["mailbox"]] if ep.get("mailbox") else []) \
        + [p + "*" for p in (info or {}).get("shm_prefixes") or []]


def unlink_shm(names) -> int:
    """Unlink this project's shared-memory segments (names starting "mpp"; a name with "*" is a pattern, e.g.
    "PREFIX*" for every segment with that prefix) where they exist on this host: a stage that was killed could not
    unlink its own. Returns how many."""
    import _posixshmem
    todo = []
    for name in names:
        name = str(name)
        if not name.startswith("mpp"):
            continue
        if "*" in name:
            try:
                todo += [e for e in os.listdir("/dev/shm") if fnmatch.fnmatchcase(e, name)]
            except OSError:
                pass
        else:
            todo.append(name)
    n = 0
    for name in todo:
        try:
            _posixshmem.shm_unlink("/" + name)
            n += 1
        except OSError:
            pass
    return n


def stage_pids(actors, timeout: float = 5.0) -> list[int]:
    """The stage processes' pids, asked of each actor (best effort: one that does not answer in time is left)."""
    refs = [a.pid.remote() for a in actors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    out = []
    for r in ready:
        try:
            out.append(int(ray.get(r, timeout=0)))
        except Exception:  # noqa: BLE001 - a stage that failed to start has no pid to give
            pass
    return out


def _alive(pid: int) -> bool:
    """Whether process `pid` runs on this host (a zombie, killed and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def unlink_shm_of(pids, wait: float = 5.0) -> int:
    """Unlink this host's segments made by killed stage processes: "mpp" names carrying "_PID_" (every segment a
    stage makes has its pid in its name). A launch that fails kills stages that may be inside their setup, whose
    answer (the names, shm_names) never came. Waits up to `wait` seconds for each process to exit (one still
    running could make a segment after); one that has not is left alone. Returns how many were unlinked."""
    live, end = set(pids), time.monotonic() + wait
    while live and time.monotonic() < end:
        live = {p for p in live if _alive(p)}
        if live:
            time.sleep(0.05)
    return unlink_shm([f"mpp*_{p}_*" for p in set(pids) - live])
