"""Boundary slots across real processes: ordering, no reuse before free, no loss under random schedules, failures."""

import concurrent.futures as cf
import multiprocessing as mp
import os
import random
import threading
import time
import zlib
from multiprocessing import resource_tracker

import pytest
import torch

from memra_pp.errors import InputError, ProtocolError
from memra_pp.stages.channel import ChannelClosed, connect
from memra_pp.stages.shm_slots import SlotReceiver, SlotSender

# the receivers' mailbox poll in the mailbox cases: 0.2 s, so a receiver that catches up with its sender is still
# polling when the next header lands, even on a loaded 2-core machine (at 2 ms it once took all 60 by the socket)
SPIN_US = 200_000.0

SPAWN = mp.get_context("spawn")


@pytest.fixture(scope="module")
def peer():
    """One spawned process reused by the scenarios: each spawn pays a torch import (~2 s on this machine)."""
    with cf.ProcessPoolExecutor(1, mp_context=SPAWN) as ex:
        yield ex


def _crc(t: torch.Tensor) -> int:
    return zlib.crc32(t.contiguous().view(torch.uint8).numpy().tobytes())


def _connected_sender(endpoint) -> SlotSender:
    s = SlotSender(endpoint)
    s.connect(10.0)
    return s


def _send_ordered(endpoint, n):
    with_tensor = 0
    s = _connected_sender(endpoint)
    for mb in range(n):
        if mb % 5 == 4:
            s.send({"kind": "tokens", "mb": mb}, None)
        else:
            s.send({"kind": "step", "mb": mb, "pos": torch.arange(mb % 9, dtype=torch.int32)},
                   torch.full((mb % 9, 16), float(mb)), timeout=10.0)
            with_tensor += 1
    s.drain(10.0)
    s.close()
    return with_tensor, s.stats()


def _send_three(endpoint):
    s = _connected_sender(endpoint)
    slots = [s.send({"kind": "step", "mb": mb}, torch.full((8, 32), float(mb + 1)), timeout=10.0) for mb in range(3)]
    s.drain(10.0)
    s.close()
    return slots, s.stats()


def _send_random(endpoint, n, seed):
    rng = random.Random(seed)
    s = _connected_sender(endpoint)
    big = 0
    for mb in range(n):
        if rng.random() < 0.25:
            k = rng.choice([rng.randrange(4), 3000])     # 3000 ints: larger than a mailbox entry
            big += k == 3000
            s.send({"kind": "tokens", "mb": mb, "toks": [rng.randrange(1000) for _ in range(k)]})
        else:
            dt = rng.choice([torch.float32, torch.bfloat16])
            x = torch.randn(rng.randrange(0, 40), rng.choice([8, 64]), generator=torch.Generator().manual_seed(mb))
            x = x.to(dt)
            s.send({"kind": "step", "mb": mb, "crc": _crc(x)}, x, timeout=10.0)
        if rng.random() < 0.3:
            time.sleep(rng.random() * 0.002)
    s.drain(10.0)
    s.close()
    return s.stats(), big


def _send_then_sleep(endpoint):
    s = _connected_sender(endpoint)
    s.send({"kind": "step", "mb": 0}, torch.ones(2, 2))
    time.sleep(60)


@pytest.mark.parametrize("spin_us", [0.0, SPIN_US])
def test_order_and_header_only_messages(peer, spin_us):
    """Microbatches must arrive in send order with their bytes; header-only messages must pass without a slot.
    With spin_us > 0 the headers are taken from the shared-memory mailbox (counted), in the same order."""
    with SlotReceiverCtx("order", 64 * 1024, spin_us=spin_us) as r:
        fut = peer.submit(_send_ordered, r.endpoint(), 60)
        r.accept(30.0)
        for mb in range(60):
            h, v = r.recv(10.0)
            assert h["mb"] == mb
            if mb % 5 == 4:
                assert v is None and "slot" not in h
                continue
            assert v.shape == (mb % 9, 16) and bool((v == mb).all()) and h["pos"].tolist() == list(range(mb % 9))
            r.free(h["slot"])
        n_tensor, sstats = fut.result(30)
        rstats = r.stats()
    assert sstats["handoffs"] == rstats["handoffs"] == n_tensor == 48
    assert sstats["headers"] == rstats["headers"] == 12
    assert sstats["bytes"] == rstats["bytes"] > 0 and rstats["handoff_p99_us"] >= rstats["handoff_p50_us"] > 0
    # the sender splits its handoff time: the data path (the copy into the slot) and the header's path
    assert sstats["write_us_mean"] > 0 and sstats["header_us_mean"] > 0 and "write_us_mean" not in rstats
    if spin_us:   # every header went into the mailbox; the receiver took most of them there (the rest: socket)
        assert sstats["mailbox_headers"] == 60 and 0 < rstats["mailbox_headers"] <= 60, (sstats, rstats)
        # and the sender wrote the socket only while the receiver slept in it: not for every header
        assert sstats["socket_headers"] < 60 and sstats["late_headers"] == 0, sstats
    else:
        assert sstats["mailbox_headers"] == rstats["mailbox_headers"] == 0 and "mailbox" not in r.endpoint()
        assert sstats["socket_headers"] == 60


def test_no_reuse_before_free(peer):
    """With both slots held the sender must block, and the held slots' bytes must not change until freed."""
    with SlotReceiverCtx("reuse", 8 * 32 * 4) as r:
        fut = peer.submit(_send_three, r.endpoint())
        r.accept(30.0)
        h0, v0 = r.recv(10.0)
        h1, v1 = r.recv(10.0)
        before = (v0.clone(), v1.clone())
        with pytest.raises(TimeoutError):
            r.recv(0.4)  # mb 2 cannot be announced: it has no slot to go to
        assert torch.equal(v0, before[0]) and torch.equal(v1, before[1]) and bool((v0 == 1).all())
        assert r.held() == sorted([h0["slot"], h1["slot"]])
        r.free(h0["slot"])
        del v0
        h2, v2 = r.recv(10.0)
        assert h2["mb"] == 2 and h2["slot"] == h0["slot"] and bool((v2 == 3).all())
        assert torch.equal(v1, before[1])
        r.free(h1["slot"]), r.free(h2["slot"])
        del v1, v2
        slots, sstats = fut.result(30)
    assert slots == [h0["slot"], h1["slot"], h0["slot"]] and sstats["wait_s"] >= 0.35 and sstats["handoffs"] == 3


@pytest.mark.parametrize("spin_us", [0.0, 50.0, SPIN_US])    # 50 us: the receiver often sleeps in the socket
def test_randomized_schedule_loses_and_duplicates_nothing(peer, spin_us):
    """Under random delays, sizes, dtypes and free order, every microbatch must arrive exactly once, intact (with
    the header mailbox too: headers larger than an entry, and the receiver falling behind, go by the socket)."""
    n, rng = 320, random.Random(7)
    with SlotReceiverCtx("random", 40 * 64 * 4, spin_us=spin_us) as r:
        fut = peer.submit(_send_random, r.endpoint(), n, 11)
        r.accept(30.0)
        held, seen, checked = [], [], 0
        while len(seen) < n:
            if len(held) == r.n_slots or (held and rng.random() < 0.5):
                r.free(held.pop(rng.randrange(len(held))))  # frees out of order, sometimes late
            h, v = r.recv(10.0)
            seen.append(h["mb"])
            if v is not None:
                assert _crc(v) == h["crc"], f"mb {h['mb']} arrived corrupted"
                checked += 1
                held.append(h["slot"])
                del v
            if rng.random() < 0.2:
                time.sleep(rng.random() * 0.002)
        for slot in held:
            r.free(slot)
        sstats, big = fut.result(30)
    assert seen == list(range(n))
    assert sstats["handoffs"] == r.stats()["handoffs"] == checked > 150 and sstats["headers"] == n - checked
    assert (r.stats()["mailbox_headers"] > 0) == bool(spin_us)
    assert big > 0 and sstats["socket_headers"] >= big, sstats     # a header larger than an entry: the socket


def test_killed_sender_gives_channel_closed_within_a_second():
    """A killed sender process must wake the receiver with ChannelClosed within a second, never a hang."""
    with SlotReceiverCtx("kill", 1024) as r:
        p = SPAWN.Process(target=_send_then_sleep, args=(r.endpoint(),))
        p.start()
        try:
            r.accept(30.0)
            h, v = r.recv(10.0)
            del v
            r.free(h["slot"])
            p.kill()
            t0 = time.monotonic()
            with pytest.raises(ChannelClosed):
                r.recv(10.0)
            assert time.monotonic() - t0 < 1.0
        finally:
            p.join(5)


def _local_pair(name, max_bytes, spin_us=0.0):
    """A receiver and a sender connected in this process (the sender's connect on a thread)."""
    r = SlotReceiver(name, max_bytes, spin_us=spin_us)
    s = SlotSender(r.endpoint())
    t = threading.Thread(target=s.connect, args=(5.0,))
    t.start()
    r.accept(5.0)
    t.join()
    return r, s


def test_refusals_timeouts_and_closed_receiver():
    """Oversized tensors, reserved kinds and bad frees must be refused by name; a full sender must time out; a
    closed receiver must give the waiting sender ChannelClosed."""
    r, s = _local_pair("refuse", 64)
    try:
        with pytest.raises(InputError, match=r"\[4, 5\] float32 is 80 bytes, a slot holds 64 bytes"):
            s.send({"kind": "step", "mb": 0}, torch.zeros(4, 5))
        with pytest.raises(InputError, match="reserved"):
            s.send({"kind": "_credit", "mb": 0})
        s.send({"kind": "step", "mb": 1}, torch.zeros(4, 4))
        s.send({"kind": "step", "mb": 2}, torch.zeros(4, 4))
        with pytest.raises(TimeoutError, match=r"no slot freed within 0.2s; the receiver still holds slots \[0, 1\]"):
            s.send({"kind": "step", "mb": 3}, torch.zeros(4, 4), timeout=0.2)
        r.recv(1.0), r.recv(1.0)
        with pytest.raises(InputError, match="not held"):
            r.free(5)
        r.close()
        with pytest.raises(ChannelClosed):
            s.send({"kind": "step", "mb": 3}, torch.zeros(4, 4), timeout=2.0)
    finally:
        s.close(), r.close()


def test_a_connection_that_sends_no_hello_is_closed_by_the_receiver():
    """A connection whose hello does not come in time: accept() raises TimeoutError and closes that connection at
    once (the peer reads its end), not whenever the collector finds it."""
    import socket
    r = SlotReceiver("nohello", 64, spin_us=0)
    peer = socket.socket(socket.AF_UNIX)
    try:
        peer.connect(r.endpoint()["address"].removeprefix("unix:"))
        with pytest.raises(TimeoutError):
            r.accept(0.3)
        peer.settimeout(2.0)
        assert peer.recv(1) == b""      # closed by the receiver (a timeout here: the connection was left open)
    finally:
        peer.close()
        r.close()


def test_malformed_slot_headers_give_protocol_error():
    """A header naming a bad slot, dtype, shape or a held slot, or a wrong hello, must raise ProtocolError."""
    r = SlotReceiver("proto", 64)
    ch = connect(r.endpoint()["address"], 5.0)
    ch.send({"kind": "_hello", "mb": -1, "endpoint": dict(r.endpoint(), shm=["other"])})
    with pytest.raises(ProtocolError, match="this receiver is"):
        r.accept(5.0)
    r.close()
    r = SlotReceiver("proto", 64)
    ch = connect(r.endpoint()["address"], 5.0)
    ch.send({"kind": "_hello", "mb": -1, "endpoint": r.endpoint()})
    r.accept(5.0)
    try:
        for extra, msg in [({"slot": 2, "dtype": "float32", "shape": [1]}, r"slot 2 is not in \[0, 2\)"),
                           ({"slot": 0, "dtype": "complex64", "shape": [1]}, "dtype 'complex64'"),
                           ({"slot": 0, "dtype": "float32", "shape": [-1]}, "non-negative"),
                           ({"slot": 0, "dtype": "float32", "shape": [17]}, "needs 68 bytes, slots hold 64")]:
            ch.send({"kind": "step", "mb": 9, **extra})
            with pytest.raises(ProtocolError, match=msg):
                r.recv(1.0)
        ch.send({"kind": "step", "mb": 1, "slot": 0, "dtype": "float32", "shape": [2]})
        ch.send({"kind": "step", "mb": 2, "slot": 0, "dtype": "float32", "shape": [2]})
        assert r.recv(1.0)[0]["mb"] == 1
        with pytest.raises(ProtocolError, match="while mb 1 still holds it"):
            r.recv(1.0)
    finally:
        ch.close(), r.close()


def test_attach_does_not_register_and_close_unlinks(monkeypatch):
    """The sender must not register the receiver's segments with its resource tracker; receiver close must unlink
    them, and refuse loudly while a recv view is alive."""
    calls = []
    monkeypatch.setattr(resource_tracker, "register", lambda *a: calls.append(a))
    monkeypatch.setattr(resource_tracker, "unregister", lambda *a: None)
    r, s = _local_pair("track", 256)
    assert len(calls) == 2  # the receiver's own two segments, registered by SharedMemory(create=True)
    s.send({"kind": "step", "mb": 0}, torch.ones(8))
    h, v = r.recv(1.0)
    s.close()
    with pytest.raises(BufferError, match="still alive"):
        r.close()
    del v
    r.close()
    assert not any(os.path.exists("/dev/shm/" + name) for name in r.endpoint()["shm"])

class SlotReceiverCtx(SlotReceiver):
    """SlotReceiver closed on leaving a with-block, so a failing test does not leak segments."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _send_burst(endpoint, n):
    s = _connected_sender(endpoint)
    for mb in range(n):
        s.send({"kind": "tokens", "mb": mb, "toks": [mb] * (mb % 3)})
    st = s.stats()
    time.sleep(1.5)       # the channel stays open while the receiver reads (closing it is ChannelClosed there)
    s.close()
    return st


def test_a_receiver_behind_the_mailbox_reads_the_socket(peer):
    """Header-only frames are not credit-limited: a receiver more than a mailbox's entries behind finds its next
    header overwritten and takes it (and those after) from the socket, in order, none twice."""
    from memra_pp.stages import mailbox
    n = 4 * mailbox.ENTRIES
    with SlotReceiverCtx("behind", 1024, spin_us=2000.0) as r:
        fut = peer.submit(_send_burst, r.endpoint(), n)
        r.accept(30.0)
        deadline = time.monotonic() + 30.0
        while r._mbox.get(n - 1) is None and time.monotonic() < deadline:   # all sent before the first is read
            time.sleep(0.01)
        got = [r.recv(5.0)[0] for _ in range(n)]
        assert [h["mb"] for h in got] == list(range(n)) and all(h["toks"] == [h["mb"]] * (h["mb"] % 3) for h in got)
        assert all("_q" not in h for h in got)
        with pytest.raises(TimeoutError):
            r.recv(0.2)                  # no copy is delivered again
        rs = r.stats()
        sstats = fut.result(30)
    assert sstats["mailbox_headers"] == n and rs["headers"] == n
    # the receiver never slept in the socket: each header went by the ring alone until its entry was reused, and
    # then (unread) by the socket, late; the last ENTRIES were read from the ring
    assert sstats["late_headers"] == sstats["socket_headers"] == n - mailbox.ENTRIES, sstats
    assert rs["mailbox_headers"] == mailbox.ENTRIES


def test_mailbox_entries_refuse_torn_and_stale_reads():
    """The seqlock: a frame not yet written is None, a frame too large or overwritten is FALLBACK, a read whose
    entry was rewritten under it is FALLBACK; the creator unlinks the segment."""
    from memra_pp.stages.mailbox import ENTRIES, ENTRY_BYTES, FALLBACK, Mailbox
    w = Mailbox.create("t")
    r = Mailbox.attach(w.name, "t")
    try:
        assert r.get(0) is None
        w.put(0, b"abc")
        assert r.get(0) == b"abc" and r.get(1) is None
        w.put(1, b"x" * (ENTRY_BYTES + 1))
        assert r.get(1) is FALLBACK
        for q in range(2, 2 + ENTRIES + 1):
            w.put(q, str(q).encode())
        assert r.get(2) is FALLBACK and r.get(2 + ENTRIES) == str(2 + ENTRIES).encode()
        q = 2 + 2 * ENTRIES                      # a write that began (seq_begin) but has not ended
        w._words[q % ENTRIES][0][0] = q + 1
        assert r.get(q - ENTRIES) is FALLBACK and r.get(q) is None
    finally:
        r.close()
        w.close()
    assert not os.path.exists("/dev/shm/" + w.name)


def test_a_receiver_closed_while_polling_the_mailbox_raises_channel_closed():
    """close() on another thread while recv polls the mailbox must end recv with ChannelClosed (as a blocked
    socket recv does), not with an error from the unmapped ring."""
    r = SlotReceiver("spinclose", 256, spin_us=5e6)
    s = SlotSender(r.endpoint())
    t = threading.Thread(target=s.connect, args=(5.0,))
    t.start()
    r.accept(5.0)
    t.join()
    box = []
    th = threading.Thread(target=lambda: box.append(pytest.raises(ChannelClosed, r.recv, 10.0)))
    th.start()
    time.sleep(0.2)
    r.close()
    th.join(5.0)
    s.close()
    assert not th.is_alive() and box and "closed" in str(box[0].value)


def test_a_mailbox_that_cannot_be_made_leaves_no_slots_behind(monkeypatch):
    """If the header mailbox cannot be created (/dev/shm full), the receiver's setup fails with nothing left."""
    from memra_pp.stages import mailbox

    def full(label):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(mailbox.Mailbox, "create", staticmethod(full))
    before = set(os.listdir("/dev/shm"))
    with pytest.raises(OSError, match="No space"):
        SlotReceiver("full", 256, spin_us=100.0)
    assert set(os.listdir("/dev/shm")) == before



def _header_pair(spin_s=0.0, every=False):
    """A HeaderWriter and a HeaderReader over one socket pair and one mailbox, in this process."""
    import socket

    from memra_pp.stages import mailbox
    from memra_pp.stages.channel import Channel
    a, b = socket.socketpair()
    box = mailbox.Mailbox.create("hdr")
    w = mailbox.HeaderWriter(Channel(a, "w"), mailbox.Mailbox.attach(box.name, "hdr"), every_frame_on_socket=every)
    r = mailbox.HeaderReader(Channel(b, "r"), box, spin_s, "r")
    return w, r


def _reader_asleep(r, timeout):
    """A thread calling r.next(timeout), once the reader says it sleeps in the socket; its header lands in box."""
    box = []
    th = threading.Thread(target=lambda: box.append(r.next(timeout)))
    th.start()
    deadline = time.monotonic() + 5.0
    while not r.mbox.sleeping() and time.monotonic() < deadline:
        time.sleep(0.001)
    assert r.mbox.sleeping(), "the reader never said it sleeps in the socket"
    return th, box


def _close_pair(w, r):
    for x in (w.ch, r.ch, w.mbox, r.mbox):
        x.close()


def test_headers_skip_the_socket_while_the_receiver_polls_and_late_ones_overtake_nothing():
    """The mailbox's control words (mailbox.py): while the receiver is not asleep in the socket the writer puts
    headers in the ring alone; a header still unread when its entry is reused goes by the socket first (late); while
    the receiver sleeps every header goes by the socket too. Late headers arrive after later ones on the socket, and
    the reader still gives every header once, in order."""
    from memra_pp.stages.mailbox import ENTRIES
    w, r = _header_pair()
    try:
        for mb in range(ENTRIES):                       # the receiver has read nothing: the ring alone
            w.send({"kind": "t", "mb": mb})
        assert (w.mailboxed, w.socketed, w.late) == (ENTRIES, 0, 0)
        r.mbox.set_sleeping(True)                       # as a reader asleep in the socket says
        for mb in range(ENTRIES, ENTRIES + 3):          # each reuses an unread entry: that header goes first, late
            w.send({"kind": "t", "mb": mb})
        r.mbox.set_sleeping(False)
        assert (w.socketed, w.late) == (6, 3)           # socket order: 0, 8, 1, 9, 2, 10
        got = [r.next(5.0)["mb"] for _ in range(ENTRIES + 3)]
        assert got == list(range(ENTRIES + 3))
        assert r.mailboxed == ENTRIES - 3 and r.seen == 6 and not r.ahead   # 3..7 from the ring
        with pytest.raises(TimeoutError):
            r.next(0.05)                                # nothing twice: the copies of 8, 9, 10 were dropped
        assert r.mbox.read_q() == ENTRIES + 3
    finally:
        _close_pair(w, r)


def test_every_frame_on_socket_is_the_old_protocol():
    w, r = _header_pair(every=True)
    try:
        for mb in range(20):
            w.send({"kind": "t", "mb": mb})
        assert (w.mailboxed, w.socketed, w.late) == (20, 20, 0)
        assert [r.next(5.0)["mb"] for _ in range(20)] == list(range(20))
        assert r.seen == 20 and r.mailboxed == 0      # all by the socket (read ahead of the ring), none twice
        with pytest.raises(TimeoutError):
            r.next(0.05)
    finally:
        _close_pair(w, r)


def test_a_sleeping_reader_gets_the_socket_and_a_missed_flag_costs_one_short_wait(monkeypatch):
    """A reader blocked in the socket says so: the writer then sends by the socket too. If the writer misses the
    flag (the store/load race mailbox.py describes), the reader still finds the header in the ring after WAKE_S."""
    from memra_pp.stages import mailbox
    for missed in (False, True):
        w, r = _header_pair()
        try:
            if missed:
                monkeypatch.setattr(w.mbox, "sleeping", lambda: False)
            th, box = _reader_asleep(r, 5.0)
            t0 = time.monotonic()
            w.send({"kind": "t", "mb": 7})
            th.join(5.0)
            assert box and box[0]["mb"] == 7 and not r.mbox.sleeping()
            assert w.socketed == (0 if missed else 1)
            if missed:          # taken from the ring at a wake-up (1, 2, 4 ... ms), not at the caller's 5 s
                assert r.mailboxed == 1 and time.monotonic() - t0 < 10 * mailbox.WAKE_MAX_S
        finally:
            _close_pair(w, r)


def test_a_missed_flag_then_the_senders_close_still_delivers_the_last_header(monkeypatch):
    """The sender writes its last header into the ring alone (it missed the sleeping flag) and closes: the reader,
    woken by the close (no timed wake-up here), takes that header from the ring before it reports ChannelClosed."""
    from memra_pp.stages import mailbox
    monkeypatch.setattr(mailbox, "WAKE_S", 30.0)
    w, r = _header_pair()
    try:
        monkeypatch.setattr(w.mbox, "sleeping", lambda: False)
        th, box = _reader_asleep(r, 10.0)
        w.send({"kind": "t", "mb": 3})
        w.ch.close()
        th.join(5.0)
        assert box and box[0]["mb"] == 3 and w.socketed == 0
        with pytest.raises(ChannelClosed):
            r.next(1.0)
    finally:
        _close_pair(w, r)


def test_a_header_too_large_for_the_channel_takes_no_number():
    """A frame over the channel's max_frame is refused before it enters the ring: no gap in the numbering, so the
    next header still arrives."""
    import socket

    from memra_pp.stages import mailbox
    from memra_pp.stages.channel import Channel
    a, b = socket.socketpair()
    box = mailbox.Mailbox.create("big")
    w = mailbox.HeaderWriter(Channel(a, "w", max_frame=5000), mailbox.Mailbox.attach(box.name, "big"))
    r = mailbox.HeaderReader(Channel(b, "r"), box, 0.0, "r")
    try:
        with pytest.raises(ValueError, match="exceeds max_frame 5000"):
            w.send({"kind": "t", "mb": 0, "toks": list(range(3000))})
        assert (w.q, w.mailboxed, w.socketed) == (0, 0, 0)
        w.send({"kind": "t", "mb": 1})
        assert r.next(5.0)["mb"] == 1
    finally:
        _close_pair(w, r)


def test_a_reader_behind_a_fast_sender_holds_few_headers_ahead():
    """Header-only frames take no credit: a sender far ahead of a slow reader sends its unread headers late by the
    socket, and the reader must leave them there (the socket buffer then holds the sender back) rather than pull
    them all into memory. Every header arrives once, in order."""
    from memra_pp.stages import mailbox
    w, r = _header_pair()
    n, peak = 20000, 0
    try:
        th = threading.Thread(target=lambda: [w.send({"kind": "t", "mb": mb}) for mb in range(n)])
        th.start()
        time.sleep(0.2)
        for mb in range(n):
            assert r.next(10.0)["mb"] == mb
            peak = max(peak, len(r.ahead))
        th.join(10.0)
        assert not th.is_alive() and w.late > 0
        assert peak <= mailbox.AHEAD_MAX + mailbox.ENTRIES, peak
    finally:
        _close_pair(w, r)


@pytest.mark.parametrize("with_tensor", [False, True])
def test_a_sender_closed_under_its_sending_thread_ends_it_with_channel_closed(with_tensor):
    """halt() gives up joining a loop after 10 s and closes its links under it: the loop's next send must end with
    ChannelClosed (what the loops take for a lost link), and close() must not raise. The mailbox's put and the CPU
    sender's slot write raised IndexError / TypeError there, and the slot maps' close a BufferError while a copy
    held a view. 12 trials, each closing 20 ms into a stream of sends that a draining receiver keeps up with."""
    import collections
    from memra_pp.stages.channel import ChannelClosed
    from memra_pp.stages.shm_slots import SlotReceiver, SlotSender
    seen = collections.Counter()
    for _ in range(12):
        r = SlotReceiver("race", 1 << 12)
        s = SlotSender(r.endpoint())
        t = threading.Thread(target=s.connect, args=(5.0,))
        t.start()
        r.accept(5.0)
        t.join()
        stop, err = threading.Event(), []

        def drain():
            while not stop.is_set():
                try:
                    h, v = r.recv(0.05)
                except Exception:  # noqa: BLE001 - the sender went: nothing more to drain
                    continue
                if v is not None:
                    del v
                    try:
                        r.free(h["slot"])
                    except Exception:  # noqa: BLE001
                        return

        def spam():
            try:
                for i in range(10**6):
                    s.send({"kind": "h", "mb": i}, torch.ones(4, 8) if with_tensor else None, timeout=2)
            except BaseException as e:  # noqa: BLE001 - the test asserts its type
                err.append(e)
        threads = [threading.Thread(target=drain, daemon=True), threading.Thread(target=spam, daemon=True)]
        for th in threads:
            th.start()
        time.sleep(0.02)
        s.close()                       # (raised BufferError)
        threads[1].join(5)
        assert not threads[1].is_alive() and len(err) == 1
        seen[type(err[0]).__name__ if isinstance(err[0], ChannelClosed) else repr(err[0])] += 1
        stop.set()
        threads[0].join(2)
        r.close()
    assert seen == {"ChannelClosed": 12}, seen


@pytest.mark.parametrize("mailbox_on", [True, False])
def test_a_header_only_send_to_a_receiver_that_reads_nothing_ends_within_its_timeout(mailbox_on):
    """Header-only frames (an mb_error passed on) take no slot credit, so only the socket bounds them: with the
    receiver alive but reading nothing (a stage hung in its compute), the socket's buffer fills and the send
    blocked in sendall past its timeout, for ever (law 6: nothing hangs a caller). It must end with TimeoutError
    within the timeout, naming the boundary; the frames before it went through."""
    import threading
    import time
    from memra_pp.stages.shm_slots import SlotReceiver, SlotSender
    r = SlotReceiver("stuck", 1 << 12, spin_us=50.0 if mailbox_on else 0.0)     # (a mailbox where spin_us > 0)
    s = SlotSender(r.endpoint())
    t = threading.Thread(target=s.connect, args=(5.0,))
    t.start()
    r.accept(5.0)
    t.join()
    hdr = {"kind": "mb_error", "mb": 0, "stage": 1, "etype": "RuntimeError", "message": "x" * 300}
    got = {"sent": 0}

    def spam():                 # on a thread: a send that hangs must fail this test, not hang the suite
        for i in range(100_000):
            t0 = time.monotonic()
            try:
                s.send(dict(hdr, mb=i), None, timeout=0.5)
            except BaseException as e:  # noqa: BLE001 - asserted below
                got.update(err=e, took=time.monotonic() - t0)
                return
            got["sent"] += 1
    th = threading.Thread(target=spam, daemon=True)
    th.start()
    th.join(15)
    try:
        assert not th.is_alive(), f"a header-only send hangs past its timeout (after {got['sent']} frames)"
    finally:
        s.close()               # (wakes a hung sendall)
        r.close()
    assert isinstance(got.get("err"), TimeoutError), got
    assert "boundary stuck: the peer took no frame within 0.5 s" in str(got["err"])
    assert got["sent"] > 10 and 0.45 < got["took"] < 3.0, got
    assert ("mailbox" in r.endpoint()) == mailbox_on
