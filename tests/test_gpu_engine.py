"""GPU residency: the primary context is torch's; a non-primary context's rows and another process's overlay are
refused at every door, each with its own message. Needs a CUDA GPU: fails (never skips) without one."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from memra_pp import gpu_checks as gpu_probe  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_gpu():
    assert torch.cuda.is_available(), "this test needs a CUDA GPU (run it on the GPU machine: pytest -m gpu)"


def test_primary_context_is_torchs():
    """The engine's context must be the device's primary context, the one torch allocates in, shared by engines."""
    r = gpu_probe.primary_context(0)
    assert r["two_engines_one_ctx"] and r["current_is_primary"] and r["torch_tensor_resident"]
    assert r["cpu_tensor_not_resident"]
    assert r["owns_torch_tensor"] and r["owns_no_cpu_tensor"] and r["is_current"], r


def test_secondary_context_rows_are_refused_everywhere():
    """Rows from a cuCtxCreate context must be refused at construction, at splice, at publish source and as a token
    overlay's rows; a splice into that context's memory is refused too."""
    r = gpu_probe.secondary_context(0)
    assert r["differs"] and r["uid_is_secondary"] and r["current_restored"], r
    assert r["owned"] is False and r["is_current_under_secondary"] is False, r    # Engine's one-call checks
    assert "they cannot be wrapped there: publish them" in r["construct"], r
    assert r["construct"].startswith(f"overlay rows live in {r['secondary_ctx']} but engine cuda:0 is ")
    assert "they must not be read there: publish them" in r["splice"], r
    assert r["publish_source"].startswith(f"rows to publish live in {r['secondary_ctx']}"), r
    assert r["token_overlay"].startswith(f"token overlay slot 0: embed rows live in {r['secondary_ctx']} but "
                                         f"engine cuda:0 is "), r
    assert r["splice_target"].startswith(f"the splice target's bytes live in {r['secondary_ctx']}"), r
    assert "the rows cannot be written there" in r["splice_target"], r
    assert r["splice_wrote_nothing"] and r["splices"] == 0 and r["torch_still_works"]


def test_publication_counts_and_is_bit_exact():
    """AUTO must publish across contexts only; FORCE always; both bit-exact and landed in the intake."""
    src, dst = gpu_probe.devices()
    r = gpu_probe.publication(src, dst)
    assert (r["auto_same_ctx_published"], r["auto_across_published"], r["force_published"]) == (0, 1, 1), r
    assert r["across_bit_exact"] and r["forced_bit_exact"] and r["across_resident_in_intake"]
    assert "they cannot be wrapped there" in r["wrong_engine_refused"]


def test_two_processes_are_two_contexts():
    """Two processes on one device must have different ContextIds; equal handle or uid values must not make a
    foreign overlay local."""
    r = gpu_probe.two_processes(0)
    assert r["differ"] and r["forged_equal_uid_not_local"], r
    assert r["pickled_overlay"].startswith(f"overlay rows live in {r['theirs']} but engine cuda:0 is {r['mine']}")
    assert "must not be read there" in r["pickled_splice"]


def test_publication_slots_are_page_locked_and_bit_exact():
    """A CUDA intake's publication slot and a CUDA tower's mapping of it are page-locked (DMA both ways); rows
    published into it land bit-exact, and closing unregisters both (no error, nothing left registered)."""
    from memra_pp import cuda
    from memra_pp.engine import Engine
    from memra_pp.overlay import publish_out
    from memra_pp.stages.pub_inbox import InboxWriter, PublicationInbox
    eng = Engine("cuda:0")
    inbox, writer = PublicationInbox("gputest", engine=eng), InboxWriter(eng)
    x = torch.randn(256, 5120, device="cuda:0")
    with inbox.slot(x.numel() * 4, 5) as (name, size, buf):
        assert len(inbox._pinned) == 1 and cuda.pointer_info(buf.data_ptr()) is not None
        with writer.lease(name, size) as into:
            pub = publish_out(eng, x, [(0, 0, 256)], into=into)
        assert writer.pinned == 1 and pub.data is None
        ov = pub.land(eng, host=buf)
    assert torch.equal(ov.rows, x)
    writer.close()
    inbox.close()
    assert not inbox._pinned


def test_unseeded_sampling_differs_between_samplers_on_the_gpu():
    """Two primaries' unseeded draws from the same CUDA logits differ (each sampler's generator lives on the device,
    seeded from the OS); before, both used torch's default CUDA generator, which starts at one fixed seed in every
    process, so fresh deployments repeated each other's "random" tokens."""
    from memra_pp.model.batch import StepBatch
    from memra_pp.stages.loops import Sampler
    logits = torch.zeros(1, 50_000, device="cuda")
    batch = StepBatch([0], [3], [1], StepBatch.text_positions([3], [1]), [True])
    draws = []
    for _ in range(2):
        s = Sampler()
        s.admit([(0, 1.0, 0, 1.0, 0.0, None, -1, 0)], [])
        draws.append([s(logits, batch).result()[0][0] for _ in range(20)])
        assert [g.device.type for g in s.rngs.values()] == ["cuda"]
    assert draws[0] != draws[1]
