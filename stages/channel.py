"""Control channel between neighbouring stage processes: length-prefixed msgpack frames over a Unix or TCP socket.

One sender thread and one receiver thread may use a Channel at the same time; lives in the stage processes.
"""

from __future__ import annotations

import ipaddress
import math
import os
import select
import shutil
import socket
import struct
import tempfile
import threading
import time

from memra_pp.errors import ConfigError, ProtocolError, StageFailed
from memra_pp.stages.header import decode_header, encode_header

_PREFIX = struct.Struct("<I")  # payload length, little-endian u32
MAX_FRAME = 64 << 20  # a length above this is a corrupt stream, not a header worth allocating for
_UNIX_PATH_MAX = 107  # sun_path is 108 bytes including the NUL


class ChannelClosed(StageFailed):
    """The peer closed the channel or died (EOF, reset, broken pipe), or this end was closed."""


def parse_address(address: str) -> tuple[int, object]:
    """(family, sockaddr) of 'unix:/abs/path' (or a bare '/abs/path') or 'tcp:HOST:PORT' with a loopback HOST."""
    if address.startswith("tcp:"):
        host, _, port = address[4:].rpartition(":")
        host = "127.0.0.1" if host == "localhost" else host.strip("[]")
        try:
            ip, port = ipaddress.ip_address(host), int(port)
        except ValueError as e:
            raise ConfigError(f"channel address {address!r} is not tcp:HOST:PORT with a numeric HOST: {e}") from None
        if not ip.is_loopback:
            # the channel has no authentication: until multi-node adds it, nothing off this host may connect
            raise ConfigError(f"channel address {address!r}: only loopback hosts are bound; use tcp:127.0.0.1:PORT")
        return (socket.AF_INET6 if ip.version == 6 else socket.AF_INET), (str(ip), port)
    path = address[5:] if address.startswith("unix:") else address
    if not path.startswith("/"):
        raise ConfigError(f"channel address {address!r} must be unix:/ABSOLUTE/PATH or tcp:127.0.0.1:PORT")
    if len(path.encode()) > _UNIX_PATH_MAX:
        raise ConfigError(f"channel socket path {path!r} is {len(path.encode())} bytes, AF_UNIX allows "
                          f"{_UNIX_PATH_MAX}; use a shorter deployment temp dir")
    return socket.AF_UNIX, path


def _format_address(sock: socket.socket) -> str:
    if sock.family == socket.AF_UNIX:
        return "unix:" + sock.getsockname()
    host, port = sock.getsockname()[:2]
    return f"tcp:[{host}]:{port}" if sock.family == socket.AF_INET6 else f"tcp:{host}:{port}"


def _wait_readable(poller: select.poll, deadline: float | None, what: str) -> None:
    """Block until readable or raise TimeoutError at `deadline` (monotonic seconds; None waits forever)."""
    while True:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            if poller.poll(0):   # one look first: a timeout of 0 (or one spent) still takes what has arrived
                return
            raise TimeoutError(f"{what}: nothing arrived before the timeout")
        if poller.poll(None if remaining is None else math.ceil(remaining * 1000)):
            return


class Channel:
    """Length-prefixed msgpack frames over a connected stream socket; `label` names the link in errors."""

    def __init__(self, sock: socket.socket, label: str = "channel", max_frame: int = MAX_FRAME):
        # blocking for good: a per-call socket timeout would also apply to a concurrent sendall on another thread
        sock.setblocking(True)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock, self.label, self.max_frame = sock, label, max_frame
        self._send_lock = threading.Lock()
        self._poller = select.poll()
        self._poller.register(sock.fileno(), select.POLLIN)
        # frames are parsed out of one reusable buffer; bytes of a partial frame survive a recv timeout
        self._buf = bytearray(1 << 16)
        self._mv = memoryview(self._buf)
        self._start = self._end = 0
        self._closed = False

    def fileno(self) -> int:
        return self._sock.fileno()

    def send(self, obj: dict) -> None:
        """Encode and write one frame (one sendall of prefix + payload); thread-safe against other senders."""
        self.send_payload(encode_header(obj))

    def check_frame(self, payload: bytes) -> None:
        """Refuse (ValueError) a frame larger than max_frame; send_payload asks it, and a caller that must know
        before it commits to sending (the header mailbox numbers frames) asks it first."""
        if len(payload) > self.max_frame:
            raise ValueError(f"{self.label}: frame of {len(payload)} bytes exceeds max_frame {self.max_frame}")

    def send_payload(self, payload: bytes, timeout: float | None = None) -> None:
        """Write one frame already encoded with encode_header. `timeout`: seconds a live peer that reads nothing
        may keep the frame waiting (TimeoutError, nothing of it sent; a frame cut short by it leaves nothing after
        it readable: the channel is closed, ChannelClosed). None: wait as long as the peer lives."""
        self.check_frame(payload)
        frame = _PREFIX.pack(len(payload)) + payload
        with self._send_lock:
            if self._closed:
                raise ChannelClosed(f"{self.label}: send on a closed channel")
            try:
                if timeout is None:
                    self._sock.sendall(frame)
                else:
                    self._send_within(frame, timeout)
            except (TimeoutError, ChannelClosed):
                raise
            except OSError as e:  # EPIPE / ECONNRESET: the peer is gone
                raise ChannelClosed(f"{self.label}: peer is gone ({type(e).__name__}: {e})") from e

    def _send_within(self, frame: bytes, timeout: float) -> None:
        end, view, sent, out = time.monotonic() + timeout, memoryview(frame), 0, None
        while sent < len(view):
            try:
                sent += self._sock.send(view[sent:], socket.MSG_DONTWAIT)
                continue
            except BlockingIOError:     # the peer's buffer is full: wait for room, within the deadline
                pass
            if out is None:
                out = select.poll()
                out.register(self._sock.fileno(), select.POLLOUT)
            left = end - time.monotonic()
            if left > 0 and out.poll(math.ceil(left * 1000)):
                continue
            if sent:
                self.close()
                raise ChannelClosed(f"{self.label}: the peer took {sent} of a frame's {len(view)} bytes in "
                                    f"{timeout:g} s; the link is closed (nothing after a cut frame can be read)")
            raise TimeoutError(f"{self.label}: the peer took no frame within {timeout:g} s (it reads nothing)")

    def recv(self, timeout: float | None = None) -> dict:
        """Next frame as a dict. TimeoutError after `timeout` s (None waits); ChannelClosed on EOF or reset."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            h = self._next_buffered()
            if h is not None:
                return h
            self._fill(deadline)

    def poll(self) -> dict | None:
        """The next frame if it is here now (buffered, or readable without waiting), else None. Bytes of a frame
        that has only partly arrived stay buffered for the next call."""
        while True:
            h = self._next_buffered()
            if h is not None:
                return h
            if self._closed:
                raise ChannelClosed(f"{self.label}: recv on a closed channel")
            if not self._poller.poll(0):
                return None
            self._fill(None)

    def _next_buffered(self) -> dict | None:
        """The next whole frame already in the buffer, decoded, else None."""
        frame = self._take_frame()
        if frame is None:
            return None
        try:
            return decode_header(frame)
        finally:
            frame.release()

    def _take_frame(self) -> memoryview | None:
        pending = self._end - self._start
        if pending < _PREFIX.size:
            return None
        (n,) = _PREFIX.unpack_from(self._buf, self._start)
        if n > self.max_frame:
            raise ProtocolError(f"{self.label}: frame length {n} exceeds max_frame {self.max_frame}: "
                                f"the stream is corrupt or the peer is not a memra_pp channel")
        if pending < _PREFIX.size + n:
            return None
        a = self._start + _PREFIX.size
        self._start = a + n
        return self._mv[a:a + n]

    def _fill(self, deadline: float | None) -> None:
        if self._closed:
            raise ChannelClosed(f"{self.label}: recv on a closed channel")
        pending = self._end - self._start
        need = _PREFIX.size
        if pending >= _PREFIX.size:
            need += _PREFIX.unpack_from(self._buf, self._start)[0]
        if need > len(self._buf):  # a new buffer, never a resize: a decoded frame's view may still be exported
            buf = bytearray(max(need, 2 * len(self._buf)))
            buf[:pending] = self._mv[self._start:self._end]
            self._buf, self._mv = buf, memoryview(buf)
            self._start, self._end = 0, pending
        elif self._start + need > len(self._buf) or pending == 0:
            self._buf[:pending] = bytes(self._mv[self._start:self._end])  # bytes(): source and target overlap
            self._start, self._end = 0, pending
        if deadline is not None:
            _wait_readable(self._poller, deadline, self.label)
        try:
            got = self._sock.recv_into(self._mv[self._end:])
        except OSError as e:
            raise ChannelClosed(f"{self.label}: peer is gone ({type(e).__name__}: {e})") from e
        if got == 0:
            partial = f" with {pending} bytes of a frame pending" if pending else ""
            raise ChannelClosed(f"{self.label}: peer closed the channel{partial}")
        self._end += got

    def close(self) -> None:
        """Close both directions; a thread blocked in recv wakes with ChannelClosed."""
        if self._closed:
            return
        self._closed = True  # no send lock: a sendall blocked on a stalled peer must not block close
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # already disconnected
        self._sock.close()


class ChannelListener:
    """Listening end; `address=None` makes a Unix socket in a fresh temp dir that `close` removes."""

    def __init__(self, address: str | None = None, label: str = "channel"):
        self.label = label
        self._tmpdir = tempfile.mkdtemp(prefix="memra_pp-") if address is None else None
        if address is None:
            address = "unix:" + os.path.join(self._tmpdir, "ch.sock")
        family, sockaddr = parse_address(address)
        if family == socket.AF_UNIX and os.path.exists(sockaddr):
            raise ConfigError(f"channel socket {sockaddr!r} exists: another receiver owns it or a run crashed; "
                              f"remove it or use a fresh deployment temp dir")
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            if family != socket.AF_UNIX:
                self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind(sockaddr)
            self._sock.listen(4)
        except OSError:
            self.close()
            raise
        self.address = _format_address(self._sock)
        self._path = sockaddr if family == socket.AF_UNIX else None
        self._poller = select.poll()
        self._poller.register(self._sock.fileno(), select.POLLIN)

    def accept(self, timeout: float | None) -> Channel:
        """The next connection as a Channel; TimeoutError if none arrives within `timeout` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        _wait_readable(self._poller, deadline, f"{self.label}: accept on {self.address}")
        conn, _ = self._sock.accept()
        return Channel(conn, self.label)

    def close(self) -> None:
        self._sock.close()
        if getattr(self, "_path", None) and os.path.exists(self._path):
            os.unlink(self._path)
        if self._tmpdir is not None:
            shutil.rmtree(self._tmpdir, ignore_errors=True)


def connect(address: str, timeout: float, label: str = "channel") -> Channel:
    """Connect to a ChannelListener, retrying while it is not up yet; TimeoutError after `timeout` s."""
    family, sockaddr = parse_address(address)
    deadline = time.monotonic() + timeout
    delay = 0.001
    while True:
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.settimeout(max(deadline - time.monotonic(), 0.001))
        try:
            sock.connect(sockaddr)
            return Channel(sock, label)
        except (FileNotFoundError, ConnectionRefusedError, TimeoutError) as e:
            sock.close()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"{label}: could not connect to {address} within {timeout}s ({e})") from None
            time.sleep(min(delay, remaining))
            delay = min(2 * delay, 0.05)
