"""The overlay publication slots (stages/pub_inbox.py): the intake lends a slot, the tower writes the rows' bytes
into it through its own mapping, the rows land bit-exact from it; slots grow, are reused, block when all are lent
and vanish on close."""
import os
import threading
import time

import pytest
import torch

from memra_pp.engine import Engine
from memra_pp.errors import OverlayError, StageFailed
from memra_pp.overlay import publish_out
from memra_pp.stages.pub_inbox import MIN_BYTES, InboxWriter, PublicationInbox


def test_rows_land_bit_exact_through_a_slot():
    inbox, writer = PublicationInbox("t"), InboxWriter()
    rows = torch.randn(256, 640).to(torch.bfloat16)
    with inbox.slot(rows.numel() * 2, 5) as (name, size, buf):
        assert size >= rows.numel() * 2 and os.path.exists(f"/dev/shm/{name}")
        with writer.lease(name, size) as into:
            pub = publish_out(Engine("cpu"), rows, [(0, 0, 256)], into=into)
        assert pub.data is None                      # only the description travels
        ov = pub.land(Engine("cpu"), host=buf)
    assert torch.equal(ov.rows, rows) and ov.rows.dtype == torch.bfloat16
    with pytest.raises(OverlayError, match="publication slot"):
        pub.land(Engine("cpu"))                      # the bytes are in the slot, not in the answer
    inbox.close()
    assert not os.path.exists(f"/dev/shm/{name}")


def test_slot_too_small_carries_the_rows():
    rows = torch.randn(8, 16)
    small = torch.zeros(16, dtype=torch.uint8)
    pub = publish_out(Engine("cpu"), rows, [(0, 0, 8)], into=small)
    assert pub.data is not None and torch.equal(pub.land(Engine("cpu")).rows, rows)
    assert int(small.sum()) == 0


def test_slots_grow_are_reused_and_block_when_all_lent():
    inbox = PublicationInbox("g", n_slots=2)
    with inbox.slot(10, 5) as (n1, s1, _):
        assert s1 == MIN_BYTES
    with inbox.slot(10, 5) as (n2, _, _):
        assert n2 == n1                              # reused, not recreated
    with inbox.slot(3 * MIN_BYTES, 5) as (n3, s3, _):
        assert s3 == 4 * MIN_BYTES and n3 != n1 and not os.path.exists(f"/dev/shm/{n1}")
    held = threading.Event()
    release = threading.Event()

    def hold():
        with inbox.slot(10, 5), inbox.slot(10, 5):
            held.set()
            release.wait(5)

    th = threading.Thread(target=hold)
    th.start()
    assert held.wait(5)
    t = time.monotonic()
    with pytest.raises(StageFailed, match="no publication slot came free within 0 s"):
        with inbox.slot(10, 0.3):
            pass
    assert time.monotonic() - t >= 0.3
    release.set()
    th.join()
    with inbox.slot(10, 1):                          # free again
        pass
    inbox.close()
    with pytest.raises(StageFailed, match="closed"):
        with inbox.slot(10, 1):
            pass


def test_writer_keeps_a_few_mappings():
    inboxes = [PublicationInbox(f"w{i}", n_slots=1) for i in range(InboxWriter.KEEP + 2)]
    w = InboxWriter()
    for ib in inboxes:
        with ib.slot(10, 1) as (name, size, buf):
            with w.lease(name, size) as into:
                into[:3] = torch.tensor([1, 2, 3], dtype=torch.uint8)
            assert buf[:3].tolist() == [1, 2, 3]      # the same memory, two mappings
    assert len(w._maps) == InboxWriter.KEEP
    for ib in inboxes:
        ib.close()


def test_a_mapping_in_use_is_released_only_when_its_publication_returns():
    """The tower serves several publications at once: a mapping evicted (or the writer closed) while a publication
    still copies into it stays mapped until that publication returns, then goes; and an inbox closed while a slot
    is lent drops that slot when it comes back, not under the copy."""
    inboxes = [PublicationInbox(f"u{i}", n_slots=1) for i in range(InboxWriter.KEEP + 1)]
    w = InboxWriter()
    slots = [ib.slot(10, 1) for ib in inboxes]
    names = [s.__enter__()[:2] for s in slots]
    with w.lease(*names[0]) as first:
        for n in names[1:]:                          # evicts the first mapping while it is leased
            with w.lease(*n):
                pass
        assert names[0][0] not in w._maps and len(w._retired) == 1
        first[:2] = torch.tensor([7, 8], dtype=torch.uint8)   # still mapped and writable
    assert not w._retired                            # released on return
    inboxes[0].close()                               # lent: kept until returned
    assert inboxes[0]._segs[0] is not None
    slots[0].__exit__(None, None, None)
    assert inboxes[0]._segs[0] is None
    for s in slots[1:]:
        s.__exit__(None, None, None)
    w.close()
    for ib in inboxes[1:]:
        ib.close()


def test_a_failed_publication_discards_its_slot():
    """A publication that failed (the tower's answer timed out) must not lend its slot again: a late write from the
    tower would land in another request's rows. The slot gets a fresh segment; the old name is gone."""
    inbox = PublicationInbox("f", n_slots=1)
    with pytest.raises(TimeoutError):
        with inbox.slot(10, 1) as (name, size, _):
            raise TimeoutError("vision tower: no answer")
    assert not os.path.exists(f"/dev/shm/{name}")
    with inbox.slot(10, 1) as (again, _, _):
        assert again != name and os.path.exists(f"/dev/shm/{again}")
    inbox.close()


def test_a_failed_segment_creation_keeps_the_slot(monkeypatch):
    import memra_pp.stages.pub_inbox as pi
    inbox = PublicationInbox("e", n_slots=1)
    real = pi._create
    monkeypatch.setattr(pi, "_create", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    for _ in range(2):
        with pytest.raises(OSError, match="No space"):
            with inbox.slot(10, 1):
                pass
    monkeypatch.setattr(pi, "_create", real)
    with inbox.slot(10, 1) as (name, _, _):              # not lost: the next publication gets the slot
        assert os.path.exists(f"/dev/shm/{name}")
    inbox.close()


def test_unlink_by_prefix_cleans_up_after_a_killed_intake():
    """What the supervisor does for a killed intake: its replacement unlinks every segment under the prefix the
    intake reported at setup (its publication slots are made later, so their names are not known)."""
    from memra_pp.shm import shm_names, unlink_shm
    inbox = PublicationInbox("k", n_slots=2)
    with inbox.slot(10, 1) as (a, _, _), inbox.slot(3 * MIN_BYTES, 1) as (b, _, _):
        pass
    names = shm_names({"endpoint": None, "shm_prefixes": [inbox.prefix]})
    assert names == [inbox.prefix + "*"]
    assert unlink_shm(names) == 2                         # the inbox was "killed": never closed
    assert not os.path.exists(f"/dev/shm/{a}") and not os.path.exists(f"/dev/shm/{b}")
    assert unlink_shm(["not_ours", "/etc/passwd*"]) == 0   # only this project's names
    inbox.close()
