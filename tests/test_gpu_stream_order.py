"""Overlay rows freed on their allocation stream must not be recycled while a splice on another stream may still
read them: the splice is delayed on the consumer stream, the producer stream frees the rows and immediately
allocates and scribbles over new memory of the same size; the spliced rows must still be the originals."""
import pytest
import torch

from memra_pp.engine import Engine
from memra_pp.overlay import EmbedOverlay

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def eng():
    assert torch.cuda.is_available(), "this test needs a CUDA GPU (it is selected with -m gpu, never skipped)"
    return Engine("cuda:0")


def splice_after_free(eng, record: bool) -> bool:
    producer, consumer = torch.cuda.Stream(), torch.cuda.current_stream()
    N, H = 256, 1024
    with torch.cuda.stream(producer):
        rows = torch.randn(N, H, device=eng.device)
        want = rows.clone()
    consumer.wait_stream(producer)
    out = torch.zeros(N, H, device=eng.device)
    ov = EmbedOverlay(eng, rows, [(0, 0, N)])
    torch.cuda._sleep(200_000_000)                      # the consumer stream is busy for ~0.1 s ...
    if record:
        ov.splice_into(eng, out, 0)                     # ... so this read runs late (record_stream inside)
    else:
        out.copy_(rows)                                 # the same read without the stream bookkeeping
    del ov, rows                                        # freed: the allocator may hand the block to producer
    with torch.cuda.stream(producer):
        junk = torch.empty(N, H, device=eng.device)
        junk.fill_(7.0)                                 # runs at once on the idle producer stream
    torch.cuda.synchronize()
    return torch.equal(out, want)


def test_splice_keeps_rows_alive_until_read(eng):
    """With splice_into (record_stream on the consumer stream) the late read must see the original rows."""
    assert all(splice_after_free(eng, record=True) for _ in range(5))


def test_without_stream_bookkeeping_the_rows_are_recycled(eng):
    """Non-vacuity: the same schedule without record_stream must let the allocator recycle the rows at least once,
    or this setup does not exercise the hazard."""
    assert not all(splice_after_free(eng, record=False) for _ in range(5))
