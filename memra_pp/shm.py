"""The project's shared-memory segments that killed stage processes leave behind (a killed process unlinks nothing):
the names a stage's setup answer gives, and unlinking them, or every segment of a process by its pid, on this host.
Driver side (launch, teardown, the supervisor) and stage side (a replacement unlinks its predecessor's).

Every segment's name starts "mpp-TAG-" (segment_name), TAG being its maker's pid and a random part, and the maker
holds an flock on /dev/shm/mpp-TAG.lock until it ends, however it ends (the kernel drops the lock of a killed
process). sweep_dead takes the locks it can: their makers are gone, so their segments go. That cleans what no
driver was left to clean: a SIGKILLed launcher's stages, say (every stage's setup sweeps its host)."""
from __future__ import annotations

import atexit
import fcntl
import fnmatch
import os
import re
import secrets
import threading
import time

SHM_DIR = "/dev/shm"
_owner: tuple[str, int, int] | None = None      # (tag, lock fd, pid that made it): a forked child makes its own
_owner_mu = threading.Lock()


def owner_tag() -> str:
    """This process's tag, "PID.HEX", in every segment name it makes, with its lock file mpp-TAG.lock made and
    held on first use. The lock is taken under a temporary name and then renamed, so a sweep never finds it
    unlocked while its maker lives. Where no lock file can be made (no /dev/shm), the tag comes without one: its
    segments are then never swept, only unlinked by name."""
    global _owner
    with _owner_mu:
        if _owner is None or _owner[2] != os.getpid():
            for _ in range(3):
                tag = f"{os.getpid()}.{secrets.token_hex(4)}"
                fd = -1
                try:
                    tmp = os.path.join(SHM_DIR, f".mpp-{tag}.tmp")
                    fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
                    fcntl.flock(fd, fcntl.LOCK_EX)
                    os.rename(tmp, os.path.join(SHM_DIR, lock_name(tag)))
                    atexit.register(_drop_lock, tag, os.getpid())
                    break
                except OSError as e:
                    opened = fd >= 0
                    if opened:
                        os.close(fd)
                    fd = -1
                    # a sweep took the .tmp between our open and our flock (it looked like a maker killed there):
                    # a new tag, or our segments would have no lock and never be swept
                    if not (opened and isinstance(e, FileNotFoundError)):
                        break
            _owner = (tag, fd, os.getpid())
        return _owner[0]


def lock_name(tag: str) -> str:
    return f"mpp-{tag}.lock"


def _drop_lock(tag: str, pid: int) -> None:
    """At a normal exit the lock file goes too (the process's own segments are unlinked by their owners); not at a
    forked child's, which inherits the atexit list but not the lock's ownership."""
    if os.getpid() != pid:
        return
    try:
        os.unlink(os.path.join(SHM_DIR, lock_name(tag)))
    except OSError:
        pass


def segment_name(kind: str, label: str = "") -> str:
    """A new segment name (or name prefix) of this process: mpp-TAG-KIND[_LABEL]_HEX, the label reduced to
    [A-Za-z0-9_] and 40 characters."""
    label = re.sub(r"[^A-Za-z0-9_]", "_", label)[:40]
    return f"mpp-{owner_tag()}-{kind}{'_' + label if label else ''}_{secrets.token_hex(3)}"


def owner_names(tag: str | None) -> list[str]:
    """Everything a process of that tag made here: its segments (a pattern) and its lock file."""
    return [f"mpp-{tag}-*", lock_name(tag)] if tag else []


def sweep_dead() -> int:
    """Unlink the segments and lock files of makers that are gone from this host: each mpp-TAG.lock whose flock
    can be taken (a live maker holds it; one of another user cannot be opened and is left). Returns how many
    segments were unlinked."""
    try:
        entries = os.listdir(SHM_DIR)
    except OSError:
        return 0
    n = 0
    for e in entries:
        lock = e.startswith("mpp-") and e.endswith(".lock")
        if not (lock or e.startswith(".mpp-") and e.endswith(".tmp")):   # (.tmp: a maker killed inside owner_tag)
            continue
        path = os.path.join(SHM_DIR, e)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue            # held: its maker runs (this process's own lock included)
            if lock:
                n += unlink_shm([f"mpp-{e[4:-5]}-*"])
            try:
                os.unlink(path)
            except OSError:
                pass
        finally:
            os.close(fd)
    return n


def shm_names(info: dict | None) -> list[str]:
    """The shared-memory segments a stage's setup / relink answer names (its receiving slots), and the name
    prefixes of segments it makes later (the intake's publication slots): what to unlink if it is killed."""
    ep = (info or {}).get("endpoint") or {}
    return list(ep.get("shm") or []) + ([ep["mailbox"]] if ep.get("mailbox") else []) \
        + [p + "*" for p in (info or {}).get("shm_prefixes") or []] + owner_names((info or {}).get("shm_owner"))


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
    import ray
    refs = [a.pid.remote() for a in actors]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout)
    out = []
    for r in ready:
        try:
            out.append(int(ray.get(r, timeout=0)))
        except Exception:  # noqa: BLE001 - a stage that failed to start has no pid to give
            pass
    return out


def proc_stat(pid: int) -> list[str] | None:
    """Process `pid`'s /proc stat fields after its name (state first: stat's field 3, starttime at index 19) where
    it runs on this host; None if it does not (a zombie, killed and not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields if fields and fields[0] not in ("Z", "X") else None


def _alive(pid: int) -> bool:
    """Whether process `pid` runs on this host (a zombie, killed and not yet reaped, does not)."""
    return proc_stat(pid) is not None


def unlink_shm_of(pids, wait: float = 5.0) -> int:
    """Unlink this host's segments made by killed stage processes: names "mpp-PID.*" (every segment a process makes
    starts with its tag, segment_name; its lock file too). A launch that fails kills stages that may be inside
    their setup, whose answer (the names, shm_names) never came. Waits up to `wait` seconds for each process to exit
    (one still running could make a segment after); one that has not is left alone. Returns how many were
    unlinked, lock files included."""
    live, end = set(pids), time.monotonic() + wait
    while live and time.monotonic() < end:
        live = {p for p in live if _alive(p)}
        if live:
            time.sleep(0.05)
    return unlink_shm([f"mpp-{p}.*" for p in set(pids) - live])
