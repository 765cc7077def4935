"""Boundary transport audit (CPU): zero timeouts, an idle receiver's CPU, segments of a failed setup or a killed
receiver, fd counts over many links, and malformed credits / header numbers from a broken peer."""

import multiprocessing as mp
import os
import select
import socket
import threading
import time

import pytest
import torch

from memra_pp.errors import InputError, ProtocolError
from memra_pp.shm import sweep_dead
from memra_pp.stages import mailbox, shm_slots
from memra_pp.stages.channel import Channel, ChannelClosed, connect
from memra_pp.stages.shm_slots import SlotReceiver, SlotSender
from test_slots import _local_pair

SPAWN = mp.get_context("spawn")


def _readable(fd, timeout=5.0):
    assert select.select([fd], [], [], timeout)[0], "the frame never arrived"


def test_a_zero_timeout_takes_what_has_arrived():
    """recv(timeout=0) must return a header already in the socket, and send(timeout=0) must take a credit already
    there: a spent timeout means no more waiting, not ignoring what has arrived (it raised TimeoutError, and the
    sender's message claimed the receiver still held slots it had freed)."""
    r, s = _local_pair("zero", 256)
    try:
        s.send({"kind": "step", "mb": 0}, torch.ones(2, 2))
        _readable(r._ch.fileno())
        h, v = r.recv(0)
        assert h["mb"] == 0 and bool((v == 1).all())
        s.send({"kind": "step", "mb": 1}, torch.ones(2, 2))
        h1, v1 = r.recv(1.0)
        del v, v1
        r.free(h["slot"]), r.free(h1["slot"])
        _readable(s._ch.fileno())
        assert s.send({"kind": "step", "mb": 2}, torch.ones(2, 2), timeout=0) in (0, 1)
        a, b = socket.socketpair()          # and the channel alone
        ca, cb = Channel(a, "a"), Channel(b, "b")
        ca.send({"kind": "k", "mb": 3})
        _readable(b.fileno())
        assert cb.recv(0) == {"kind": "k", "mb": 3}
        with pytest.raises(TimeoutError):
            cb.recv(0)
        ca.close(), cb.close()
    finally:
        s.close(), r.close()


def test_an_idle_receiver_polling_its_mailbox_does_not_burn_a_core():
    """A stage loop calls recv(0.2) over and over while nothing comes; with a mailbox poll as long as the timeout
    (transport_poll_us is allowed up to 1 s) every call polled for its whole timeout: a core at 100% on an idle
    deployment. Once a wait has timed out the next ones must sleep in the socket, and a header must still arrive
    (and the poll resume after it)."""
    r, s = _local_pair("idle", 256, spin_us=300_000.0)
    try:
        cpu0, t_end = time.thread_time(), time.monotonic() + 1.5
        while time.monotonic() < t_end:
            with pytest.raises(TimeoutError):
                r.recv(0.05)
        cpu = time.thread_time() - cpu0
        assert cpu < 0.3, f"an idle receiver used {cpu:.2f} s of CPU in 1.5 s"
        t = threading.Timer(0.1, lambda: s.send({"kind": "step", "mb": 0}, torch.full((2, 2), 7.0)))
        t.start()
        h, v = r.recv(5.0)
        t.join()
        assert h["mb"] == 0 and bool((v == 7).all()) and not r._headers.idle
        del v
        r.free(h["slot"])
    finally:
        s.close(), r.close()


def test_a_slot_segment_that_cannot_be_made_leaves_none_behind(monkeypatch):
    """If the second slot's segment cannot be made (/dev/shm full, a slot size the host cannot map), the receiver's
    setup must fail with the first segment unlinked: the stage lives on, so no sweep would ever take it."""
    made, real = [], shm_slots.SharedMemory

    def second_fails(name, create, size):
        if made:
            raise OSError(28, "No space left on device")
        shm = real(name=name, create=create, size=size)
        made.append(shm.name)
        return shm

    monkeypatch.setattr(shm_slots, "SharedMemory", second_fails)
    with pytest.raises(OSError, match="No space"):
        SlotReceiver("full2", 256)
    assert made and not any(os.path.exists("/dev/shm/" + n) for n in made), made


def test_malformed_credits_and_header_numbers_give_protocol_error():
    """A credit naming a slot that is not an int (a list: TypeError before; True: taken as slot 1, so the next
    header named slot True) and a socket header whose number _q is not an int (TypeError) must be ProtocolError;
    free() of a non-int must be InputError and leave the slot held (free(0.0) freed slot 0 and sent a float credit
    the sender accepted)."""
    for bad in ([0], True):
        r, s = _local_pair("credit", 64)
        try:
            s.send({"kind": "step", "mb": 0}, torch.ones(2)), s.send({"kind": "step", "mb": 1}, torch.ones(2))
            r._ch.send({"kind": "_credit", "mb": 0, "slot": bad})
            with pytest.raises(ProtocolError, match="expected a credit"):
                s.send({"kind": "step", "mb": 2}, torch.ones(2), timeout=2.0)
        finally:
            s.close(), r.close()
    r, s = _local_pair("free", 64)
    try:
        s.send({"kind": "step", "mb": 0}, torch.ones(2))
        h, v = r.recv(1.0)
        del v
        for bad in (0.0, [0], False):
            with pytest.raises(InputError, match="not held"):
                r.free(bad)
        assert r.held() == [h["slot"]] == [0]
        r.free(0)
    finally:
        s.close(), r.close()
    a, b = socket.socketpair()
    box = mailbox.Mailbox.create("q")
    reader = mailbox.HeaderReader(Channel(b, "r"), box, 0.0, "r")
    w = Channel(a, "w")
    try:
        w.send({"kind": "t", "mb": 0, "_q": "x"})
        box.set_socketed(1)       # as the sender says when it writes the socket
        with pytest.raises(ProtocolError, match="_q 'x'"):
            reader.next(2.0)
    finally:
        w.close(), reader.ch.close(), box.close()


def test_many_links_leak_no_fds_and_no_segments():
    """Opening and closing boundaries (with and without a mailbox, each passing a payload) must leave the process's
    fd count and /dev/shm as they were."""
    def nfd():
        return len(os.listdir("/proc/self/fd"))

    for x in reversed(_local_pair("warm", 64)):      # (first use: owner_tag's lock file, imports)
        x.close()
    fd0, names = nfd(), []
    for k in range(40):
        r, s = _local_pair("cycle", 4096, spin_us=1000.0 if k % 2 else 0.0)
        ep = r.endpoint()
        names += ep["shm"] + ([ep["mailbox"]] if ep.get("mailbox") else [])
        s.send({"kind": "step", "mb": k}, torch.randn(4, 8).t())      # non-contiguous
        h, v = r.recv(2.0)
        del v
        r.free(h["slot"])
        s.drain(2.0)
        s.close(), r.close()
    assert nfd() == fd0 and len(names) == 100
    assert not [n for n in names if os.path.exists("/dev/shm/" + n)]


def _receive_and_hold(q, spin_us):
    r = SlotReceiver("held", 4096, spin_us=spin_us)
    q.put(r.endpoint())
    r.accept(30.0)
    h, v = r.recv(30.0)                 # holds its slot, never frees it
    q.put(h["slot"])
    time.sleep(120)


@pytest.mark.parametrize("spin_us", [0.0, 1000.0])
def test_a_receiver_killed_holding_slots(spin_us):
    """A receiver process killed while it holds a slot: a sender waiting for a credit must get ChannelClosed, not
    wait out its timeout; its slot segments (and mailbox) stay until sweep_dead, which must unlink every one."""
    q = SPAWN.Queue()
    p = SPAWN.Process(target=_receive_and_hold, args=(q, spin_us))
    p.start()
    try:
        ep = q.get(timeout=60)
        names = ep["shm"] + ([ep["mailbox"]] if ep.get("mailbox") else [])
        assert len(names) == 2 + bool(spin_us)
        s = SlotSender(ep)
        s.connect(10.0)
        s.send({"kind": "step", "mb": 0}, torch.ones(4, 4)), s.send({"kind": "step", "mb": 1}, torch.ones(4, 4))
        assert q.get(timeout=30) == 0
        threading.Timer(0.3, p.kill).start()
        with pytest.raises(ChannelClosed):
            s.send({"kind": "step", "mb": 2}, torch.ones(4, 4), timeout=60.0)
        s.close()
        p.join(10)
        assert all(os.path.exists("/dev/shm/" + n) for n in names)
        sweep_dead()
        assert not [n for n in names if os.path.exists("/dev/shm/" + n)]
    finally:
        p.kill()
        p.join(10)


@pytest.mark.parametrize("spin_us", [0.0, 1000.0])
def test_a_peer_closing_mid_frame_is_channel_closed(spin_us):
    """A sender that dies halfway through a header larger than the channel's buffer (and a mailbox entry) must end
    the receiver's recv with ChannelClosed naming the bytes pending, whether it polls a mailbox or not: no hang,
    no decode of half a frame."""
    import struct

    from memra_pp.stages.header import encode_header
    r = SlotReceiver("midframe", 256, spin_us=spin_us)
    try:
        ch = connect(r.endpoint()["address"], 5.0)
        ch.send({"kind": "_hello", "mb": -1, "endpoint": r.endpoint()})
        r.accept(5.0)
        raw = encode_header({"kind": "tokens", "mb": 0, "_q": 0, "toks": torch.arange(50_000, dtype=torch.int64)})
        frame = struct.pack("<I", len(raw)) + raw
        ch._sock.sendall(frame[:len(frame) // 2])
        if r._mbox is not None:
            r._mbox.put(0, raw)                  # too big for an entry: the reader must take it from the socket
            r._mbox.set_socketed(1)
        threading.Timer(0.2, ch.close).start()
        with pytest.raises(ChannelClosed, match="bytes of a frame pending"):
            r.recv(10.0)
    finally:
        r.close()


def test_a_sweep_between_the_lock_files_open_and_flock_still_leaves_a_locked_tag(monkeypatch):
    """Another stage's sweep_dead can find this process's new .mpp-TAG.tmp in the instant between its open and its
    flock, take it as a dead maker's and unlink it; the rename then failed and the process went on with a tag that
    has no lock file, so a kill of it later left segments no sweep would ever take. It must end with a lock."""
    import fcntl

    from memra_pp import shm
    real, swept = fcntl.flock, []

    def flock(fd, op):
        if op == fcntl.LOCK_EX and not swept:       # owner_tag's blocking flock: a sweep gets there first
            swept.append(shm.sweep_dead())
        return real(fd, op)

    monkeypatch.setattr(shm, "_owner", None)
    monkeypatch.setattr(fcntl, "flock", flock)
    tag = shm.owner_tag()
    monkeypatch.setattr(fcntl, "flock", real)
    lock = os.path.join(shm.SHM_DIR, shm.lock_name(tag))
    try:
        assert swept and os.path.exists(lock), (tag, swept)
        fd = os.open(lock, os.O_RDONLY)         # and it is held: a sweep cannot take it
        try:
            with pytest.raises(OSError):
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        finally:
            os.close(fd)
    finally:
        if shm._owner and shm._owner[1] >= 0:
            os.close(shm._owner[1])
        shm._drop_lock(tag, os.getpid())
