"""The one fan-in for cross-actor calls: wait for every ref at once, with a timeout, unwrapping our own errors; and
the one way to attach to a running Ray cluster."""
from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import socket
import threading
import time

import ray

from .errors import ConfigError, MemraError, StageFailed
from .shm import proc_stat


class Limit(float):
    """A timeout that names the placement key it comes from: get's "no answer" says which one to raise (a large
    model's load past timeouts.ready_s was refused as "stage setup: no answer within 300 s", naming no key)."""

    def __new__(cls, value: float, key: str):
        self = super().__new__(cls, value)
        self.key = key
        return self

    @classmethod
    def of(cls, timeouts, name: str) -> "Limit":
        """The placement's `timeouts.<name>`, naming itself."""
        return cls(getattr(timeouts, name), f"timeouts.{name}")

    def __reduce__(self):       # sent to a stage (a wiring's timeout): a plain float there
        return float, (float(self),)


def get(refs, timeout: float, what: str, stage: int | None = None, timeout_error: type = StageFailed,
        refused: type = StageFailed):
    """ray.get of `refs` within `timeout`: our own errors as they were raised, anything else StageFailed naming
    `what` (and `stage`, the index of the stage whose actor answers, where its death is that stage's loss; an actor
    Ray cannot reach for now is not lost); no answer in time raises `timeout_error`. `refused`: what a live actor's
    other task errors become (its call raised, or it could not read the call's arguments): a call's own input
    (a request's submit) is refused there, and no stage was lost."""
    end = time.monotonic() + timeout
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        key = f" ({timeout.key})" if isinstance(timeout, Limit) else ""
        raise timeout_error(f"{what}: no answer within {timeout:g} s{key}") from None
    except (ray.exceptions.RayTaskError, ray.exceptions.RayActorError) as e:
        _drain(refs, end)
        raise _ours(e, what, stage, refused) from None


def _ours(e: Exception, what: str, stage: int | None, refused: type = StageFailed) -> Exception:
    if isinstance(e, ray.exceptions.RayTaskError):
        cause = getattr(e, "cause", None)
        if isinstance(cause, MemraError):
            return cause
        if refused is StageFailed:
            return StageFailed(f"{what}: {e}")
        if isinstance(cause, ray.exceptions.RaySystemError):    # the actor could not unpickle the arguments
            inner = cause.args[0] if cause.args and isinstance(cause.args[0], BaseException) else cause
            return refused(f"{what}: the actor could not read the call's arguments: {first_line(inner)}")
        return refused(f"{what}: the actor refused the call: {first_line(cause if cause is not None else e)}")
    if isinstance(e, getattr(ray.exceptions, "ActorUnavailableError", ())):
        return StageFailed(f"{what}: a stage actor is unreachable for now ({e})")
    return StageFailed(f"{what}: a stage actor died ({e})", stage=stage)


def first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"


def proc_identity() -> dict:
    """This process as kill_actor finds it again: its Ray node, host name, pid namespace, pid and start time (a pid
    reused by another process has another start time; the host name, where Ray is gone and cannot name the node: a
    host's root pid namespace has the same inode on every Linux host)."""
    return {"node": ray.get_runtime_context().get_node_id(), "host": socket.gethostname(), "pidns": _pidns(),
            "pid": os.getpid(), "start": _start_time(os.getpid())}


def _pidns() -> int | None:
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def _start_time(pid: int) -> int | None:
    """Process `pid`'s start time (clock ticks since boot) where it runs on this host (shm.proc_stat); else None."""
    fields = proc_stat(pid)
    try:
        return None if fields is None else int(fields[19])
    except (IndexError, ValueError):
        return None


def _sigkill(pid: int, start: int) -> bool:
    """SIGKILL `pid` if it is still the process that started at `start`, through a pidfd where Linux has them (the
    pid then cannot be reused between the check and the signal). Returns whether it was sent."""
    fd = None
    with contextlib.suppress(OSError, AttributeError):
        fd = os.pidfd_open(pid)
    try:
        if _start_time(pid) != start:
            return False
        if fd is not None:
            signal.pidfd_send_signal(fd, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
        return True
    except (ProcessLookupError, PermissionError):
        return False
    finally:
        if fd is not None:
            os.close(fd)


def kill_actor(actor, proc: dict | None) -> bool:
    """ray.kill(actor), after a SIGKILL to its process where `proc` (its proc_identity) is a live process of this
    node and pid namespace. Ray gives a worker that does not answer (SIGSTOPped, hung in a driver call) about 5 s
    before it kills it, and a restart's new actor waits that long for the old one's bundle. Returns whether the
    SIGKILL was sent."""
    sent = False
    if proc and proc.get("start") is not None:
        try:
            here = ray.get_runtime_context().get_node_id()
        except Exception:  # noqa: BLE001 - no Ray here: Ray's kill alone
            here = None
        if here is not None and here == proc.get("node") and _pidns() == proc.get("pidns"):
            sent = _sigkill(proc["pid"], proc["start"])
    ray.kill(actor)
    return sent


DRAIN_S = 2.0   # the longest a failed list's other refs are waited for (a stage still loading is not waited out)


def _drain(refs, end: float) -> None:
    """Fetch what the other refs of a failed list give, for up to DRAIN_S within the call's time: an error Ray
    holds that no one fetched is logged as "Unhandled error" when its ref goes, a second copy of the one raised
    (every stage refusing one adapter, say)."""
    if isinstance(refs, list) and len(refs) > 1:
        wait = max(0.0, min(DRAIN_S, end - time.monotonic()))
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=wait)
        for r in ready:
            try:
                ray.get(r, timeout=0)
            except Exception:  # noqa: BLE001 - fetched to be handled; the first failure is the one raised
                pass


class SignalsHeld:
    """`with SignalsHeld() as held: ray.init(...)`: SIGINT and SIGTERM held back while Ray starts or attaches.

    Ctrl-C there raised KeyboardInterrupt inside Ray's start, among its threads (a `memra-pp launch` interrupted
    3.2 s in ended with SIGSEGV, exit 139), and SIGTERM met the handler ray.init installs first, sys.exit (exit 15,
    no message); either way Ray's agent processes stayed up to two minutes. Held, a signal is delivered by
    `deliver()` once ray.init has returned, to the handlers in place then: the one Ray's start would have left
    (Ray's own SIGTERM handler is installed on the way out, as ray.init would have, and a launching command's hook
    replaces it after). Main thread only: Python runs handlers there alone. A signal ignored on entry stays so."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.pending: list[int] = []
        self._old: dict = {}
        self._ray_term = None
        self._on = False

    def __enter__(self) -> "SignalsHeld":
        if threading.current_thread() is not threading.main_thread():
            return self
        import ray._private.utils as ray_utils
        self._utils, self._set, self._on = ray_utils, ray_utils.set_sigterm_handler, True

        def hold(signum, frame):
            self.pending.append(signum)

        def keep(handler):      # (ray.init's SIGTERM handlers: the last one is installed on the way out)
            self._ray_term = handler
        for s in self.SIGNALS:
            if signal.getsignal(s) is not signal.SIG_IGN:
                self._old[s] = signal.signal(s, hold)
        ray_utils.set_sigterm_handler = keep
        return self

    def __exit__(self, *exc) -> bool:
        if not self._on:
            return False
        self._utils.set_sigterm_handler = self._set
        for s, old in self._old.items():
            signal.signal(s, signal.SIG_DFL if old is None else old)
        if self._ray_term is not None:
            self._set(self._ray_term)
        return False

    def deliver(self) -> None:
        """Each held signal once, in order, to its handler now (which may raise: KeyboardInterrupt, SystemExit)."""
        for s in dict.fromkeys(self.pending):
            signal.raise_signal(s)


def attach(address: str, namespace: str) -> None:
    """ray.init onto a running cluster, refusing with ConfigError (naming the address) where that fails.

    Ray 2.60 starts a local cluster with token authentication on (the token in ~/.ray/auth_token) but sends the
    token only when it finds the cluster itself (`auto`): an address given as `memra-pp launch` prints it was
    refused as unauthenticated. So where RAY_AUTH_MODE is unset, the address is this host's own (loopback or one
    of its interfaces: where `auto` would look) and a token is at hand, token mode is turned on as Ray does for
    `auto`. A cluster without authentication accepts such a client. Another host never gets this host's token:
    set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN for it, as Ray asks."""
    try:        # Ray's private module: a Ray without it has no token authentication to turn on
        from ray._private.authentication import authentication_token_setup as auth
    except ImportError:
        auth = None
    # its "Token authentication is enabled for this Ray cluster" on every connect, `auto`'s too: stderr noise on
    # every generate / status / stop
    quiet = logging.getLogger(auth.__name__ if auth is not None else "ray")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        if address not in (None, "auto"):
            host = _require_listening(address)
            if auth is not None and "RAY_AUTH_MODE" not in os.environ and host is not None and _this_host(host):
                auth.maybe_enable_token_auth_if_token_available(warn_if_disabled=False)
        ray.init(address=address, namespace=namespace, logging_level=logging.WARNING)
    except ConfigError:         # _require_listening's own refusal, already saying what to give (a ValueError too)
        raise
    except (ConnectionError, RuntimeError, ValueError,      # ValueError: an address Ray cannot parse
            getattr(ray.exceptions, "AuthenticationError", ConnectionError)) as e:
        raise ConfigError(f"ray.address {address!r}: cannot attach to a Ray cluster there ({type(e).__name__}: "
                          f"{str(e).splitlines()[0]}); give the address `memra-pp launch` printed, or `auto` on "
                          f"the launcher's host; a cluster with token authentication needs its token "
                          f"(~/.ray/auth_token or RAY_AUTH_TOKEN)") from None
    finally:
        quiet.setLevel(level)


def _require_listening(address: str, timeout: float = 5.0) -> str | None:
    """A host:port where nothing accepts a connection is refused at once: ray.init retries such an address for
    minutes (13 measured here) before it gives up. Returns the host (None for ray://, a file path...: Ray's own
    rules)."""
    m = re.fullmatch(_HOST_PORT, address)
    if m is None:
        return None
    host = m.group(1).strip("[]")
    try:
        conn = socket.create_connection((host, int(m.group(2))), timeout=timeout)
    except OSError as e:
        raise ConfigError(f"ray.address {address!r}: nothing accepts a connection there ({e}); give the address "
                          f"`memra-pp launch` printed, or `auto` on the launcher's host") from None
    with conn:
        if os.environ.get("RAY_USE_TLS", "0").lower() not in ("1", "true") and not _answers_http2(conn, timeout):
            # (an HTTP server, the dashboard's port, a listener that never answers: ray.init waited there for
            # minutes, printing its retries)
            raise ConfigError(f"ray.address {address!r}: something accepts connections there but does not answer "
                              f"as a Ray cluster's GCS (gRPC) does; give the address `memra-pp launch` printed (the "
                              f"GCS port, 6379 by default, not the dashboard's), or `auto` on the launcher's host")
    return host


# HTTP/2's client connection preface and an empty SETTINGS frame: a gRPC server (Ray's GCS) answers with a SETTINGS
# frame of its own (RFC 9113 3.4)
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])


def _answers_http2(conn: socket.socket, timeout: float) -> bool:
    """Does the peer answer HTTP/2's preface with a SETTINGS frame (type 4) within `timeout`?"""
    try:
        conn.settimeout(timeout)
        conn.sendall(_H2_PREFACE)
        head = b""
        while len(head) < 9:
            got = conn.recv(9 - len(head))
            if not got:
                return False
            head += got
    except OSError:
        return False
    return head[3] == 4


_HOST_PORT = r"([A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\]):(\d+)"


def same_cluster(address: str, gcs: str) -> bool:
    """Whether a host:port `address` names the Ray cluster whose GCS is at `gcs` (host:port): the same port on the
    same host (equal names, both this machine, or names resolving to a common address). Addresses of other forms
    (ray://, auto) are not compared: True."""
    m, g = re.fullmatch(_HOST_PORT, address), re.fullmatch(_HOST_PORT, gcs or "")
    if m is None or g is None:
        return True
    if int(m.group(2)) != int(g.group(2)):
        return False
    a, b = m.group(1).strip("[]"), g.group(1).strip("[]")
    if a == b or (_this_host(a) and _this_host(b)):
        return True
    try:
        ips = [{i[4][0] for i in socket.getaddrinfo(h, None, proto=socket.IPPROTO_TCP)} for h in (a, b)]
    except OSError:
        return False
    return bool(ips[0] & ips[1])


def _this_host(host: str) -> bool:
    """Does every address `host` resolves to belong to this machine (loopback, or an interface a socket can bind)?"""
    try:
        ips = {a[4][0] for a in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)}
    except OSError:
        return False
    for ip in ips:
        fam = socket.AF_INET6 if ":" in ip else socket.AF_INET
        try:
            with socket.socket(fam, socket.SOCK_STREAM) as s:
                s.bind((ip, 0))              # only an address of this machine's own can be bound
        except OSError:
            return False
    return bool(ips)
