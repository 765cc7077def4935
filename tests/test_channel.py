"""Control channel and header codec: framing, timeouts, peer death, corrupt frames, fuzzed decode."""

import multiprocessing as mp
import os
import socket
import struct
import threading
import time

import msgpack
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memra_pp.errors import ConfigError, ProtocolError, StageFailed
from memra_pp.stages.channel import ChannelClosed, ChannelListener, connect, parse_address
from memra_pp.stages.header import decode_header, encode_header

SPAWN = mp.get_context("spawn")


def _pair(address=None):
    lis = ChannelListener(address)
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("c", connect(lis.address, 5.0)))
    t.start()
    server = lis.accept(5.0)
    t.join()
    return lis, server, out["c"]


def _child_echo(address, n):
    ch = connect(address, 10.0)
    for _ in range(n):
        ch.send(ch.recv(10.0))
    ch.close()


def _child_connect_and_sleep(address):
    ch = connect(address, 10.0)
    ch.send({"kind": "ready", "mb": 0})
    time.sleep(60)


@pytest.mark.parametrize("address", [None, "tcp:127.0.0.1:0"])
def test_roundtrip_in_order_with_tensors(address):
    """Frames must arrive whole, in order, with int arrays back as equal torch tensors, on Unix and TCP sockets."""
    lis, a, b = _pair(address)
    try:
        if address:
            assert b._sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        pos = torch.arange(24, dtype=torch.int32).view(3, 8)
        frames = ({"kind": "step", "mb": i, "pos": pos + i, "ids": [i] * (i % 7), "big": b"x" * (i * 997)}
                  for i in range(200))
        t = threading.Thread(target=lambda: [a.send(f) for f in frames])  # ~20 MB: more than the socket buffers
        t.start()
        for i in range(200):
            m = b.recv(5.0)
            assert m["mb"] == i and torch.equal(m["pos"], pos + i) and m["pos"].dtype == torch.int32
            assert m["ids"] == [i] * (i % 7) and len(m["big"]) == i * 997
        t.join(5)
    finally:
        a.close(), b.close(), lis.close()


def test_cross_process_echo_with_concurrent_sender_and_receiver_threads():
    """Through a real second process, one sender thread and one receiver thread on one Channel must see every frame
    once, in order."""
    lis = ChannelListener()
    p = SPAWN.Process(target=_child_echo, args=(lis.address, 300))
    p.start()
    try:
        ch = lis.accept(30.0)
        got = []
        t = threading.Thread(target=lambda: got.extend(ch.recv(10.0)["mb"] for _ in range(300)))
        t.start()
        for i in range(300):
            ch.send({"kind": "echo", "mb": i, "pad": "y" * (i % 50)})
        t.join(20)
        assert got == list(range(300))
    finally:
        p.join(10), lis.close()
    assert p.exitcode == 0


def test_timeouts_keep_partial_frames():
    """recv, accept and connect must raise TimeoutError on time; bytes of a partial frame must survive a recv
    timeout."""
    lis, a, b = _pair()
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            b.recv(0.1)
        assert 0.09 < time.monotonic() - t0 < 1.0
        frame = msgpack.packb({"kind": "k", "mb": 7})
        raw = struct.pack("<I", len(frame)) + frame
        a._sock.sendall(raw[:3])
        with pytest.raises(TimeoutError):
            b.recv(0.05)
        a._sock.sendall(raw[3:])
        assert b.recv(1.0) == {"kind": "k", "mb": 7}
        with pytest.raises(TimeoutError):
            lis.accept(0.05)
    finally:
        a.close(), b.close(), lis.close()
    with pytest.raises(TimeoutError, match="could not connect"):
        connect(lis.address, 0.1)


def test_killed_peer_gives_channel_closed_within_a_second():
    """A peer process killed mid-wait must wake recv with ChannelClosed (a StageFailed) within a second, not hang."""
    lis = ChannelListener()
    p = SPAWN.Process(target=_child_connect_and_sleep, args=(lis.address,))
    p.start()
    try:
        ch = lis.accept(30.0)
        assert ch.recv(30.0)["kind"] == "ready"
        p.kill()
        t0 = time.monotonic()
        with pytest.raises(ChannelClosed, match="peer closed") as ei:
            ch.recv(10.0)
        assert time.monotonic() - t0 < 1.0 and isinstance(ei.value, StageFailed)
        with pytest.raises(ChannelClosed):
            for _ in range(100):  # the first sends may still land in the kernel buffer
                ch.send({"kind": "x", "mb": 0})
    finally:
        p.join(5), lis.close()


def test_close_wakes_a_blocked_receiver():
    """close() on one thread must wake a recv(None) blocked on another with ChannelClosed."""
    lis, a, b = _pair()
    err = []
    t = threading.Thread(target=lambda: err.append(pytest.raises(ChannelClosed, b.recv, None)))
    t.start()
    time.sleep(0.05)
    b.close()
    t.join(2)
    assert not t.is_alive() and err
    a.close(), lis.close()


def test_undecodable_and_oversized_frames_give_protocol_error():
    """Garbage, schema-less and over-long frames must raise ProtocolError naming the fault."""
    lis, a, b = _pair()
    try:
        for payload, msg in [(b"\xc1", "did not decode"), (msgpack.packb([1, 2]), "must be a map"),
                             (msgpack.packb({"kind": "k"}), "lacks required key 'mb'"),
                             (msgpack.packb({"kind": 1, "mb": 2}), "'kind' must be str"),
                             (msgpack.packb({"kind": "k", "mb": True}), "'mb' must be int")]:
            a._sock.sendall(struct.pack("<I", len(payload)) + payload)
            with pytest.raises(ProtocolError, match=msg):
                b.recv(1.0)
        a._sock.sendall(struct.pack("<I", 0xFFFFFFF0))
        with pytest.raises(ProtocolError, match="exceeds max_frame"):
            b.recv(1.0)
    finally:
        a.close(), b.close(), lis.close()


def test_address_refusals():
    """Non-loopback TCP hosts, relative and over-long Unix paths and a taken socket path must be refused by name."""
    with pytest.raises(ConfigError, match="only loopback"):
        parse_address("tcp:0.0.0.0:5000")
    with pytest.raises(ConfigError, match="ABSOLUTE"):
        parse_address("unix:relative.sock")
    with pytest.raises(ConfigError, match="AF_UNIX allows"):
        parse_address("/" + "d" * 200)
    lis = ChannelListener()
    try:
        with pytest.raises(ConfigError, match="exists"):
            ChannelListener(lis.address)
    finally:
        lis.close()
    assert not os.path.exists(lis.address[5:])


def test_header_roundtrip_dtypes_and_refusals():
    """Every carried array dtype must round-trip bit-exactly; encode must refuse schema-less dicts and odd dtypes."""
    for dt in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool, torch.float32):
        t = (torch.arange(12) % 2).to(dt).view(2, 3, 2)
        out = decode_header(encode_header({"kind": "k", "mb": 1, "t": t, "n": np.arange(3, dtype=np.int64)}))
        assert out["t"].dtype == dt and torch.equal(out["t"], t) and out["n"].tolist() == [0, 1, 2]
    assert decode_header(encode_header({"kind": "k", "mb": 1, "s": torch.tensor(5)}))["s"].item() == 5
    with pytest.raises(ValueError, match="lacks required key 'kind'"):
        encode_header({"mb": 1})
    with pytest.raises(TypeError, match="bfloat16"):
        encode_header({"kind": "k", "mb": 1, "t": torch.zeros(2, dtype=torch.bfloat16)})
    bad_ext = msgpack.packb({"kind": "k", "mb": 1, "t": msgpack.ExtType(1, b"\x03\x01\x05\x00\x00\x00abc")})
    with pytest.raises(ProtocolError, match="needs 20 bytes"):
        decode_header(bad_ext)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=256))
def test_fuzz_arbitrary_bytes_decode_to_dict_or_protocol_error(b):
    """Arbitrary bytes must decode to a dict or raise ProtocolError, never any other exception."""
    try:
        assert isinstance(decode_header(b), dict)
    except ProtocolError:
        pass


_leaf = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(), st.text(max_size=8),
                  st.binary(max_size=8), st.builds(msgpack.ExtType, st.integers(0, 3), st.binary(max_size=40)))
_tree = st.recursive(_leaf, lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=4), c, max_size=4),
                     max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["kind", "mb", "pos", "x"]), _tree, max_size=4))
def test_fuzz_structured_msgpack_decode_to_dict_or_protocol_error(obj):
    """Well-formed msgpack of any shape, with random ext payloads, must decode to a dict or raise ProtocolError."""
    try:
        assert isinstance(decode_header(msgpack.packb(obj)), dict)
    except ProtocolError:
        pass
