"""StepBatch's groups, their row spans and a mixed step's one-token rows (model/batch.py): the prefill's merged path
reads a group's rows as a slice only where the slice holds exactly the rows its row tensor names, and the attention
takes a step's one-token continuing segments in one decode call instead of a group each."""
import pytest
import torch

from memra_pp.model.batch import StepBatch


def batch(starts, counts):
    return StepBatch(list(range(10, 10 + len(counts))), starts, counts, StepBatch.text_positions(starts, counts),
                     [True] * len(counts))


@pytest.mark.parametrize("starts,counts,spans,single", [
    # one group of every row
    ([0, 0, 0], [4, 4, 4], {"length": [(0, 12)], "start": [(0, 12)], "prompt_start": [(0, 12)],
                            "prompt_length": [(0, 12)]}, []),
    # sequences 0 and 2 apart: gathered
    ([0, 0, 0], [9, 5, 9], {"length": [None, (9, 14)], "start": [None, (9, 14)], "prompt_start": [None, (9, 14)],
                            "prompt_length": [None, (9, 14)]}, []),
    # fresh and continuing
    ([3, 3, 0], [2, 2, 2], {"length": [(0, 4), (4, 6)], "start": [(0, 4), (4, 6)], "prompt_start": [(0, 4), (4, 6)],
                            "prompt_length": [(0, 4), (4, 6)]}, []),
    # a mixed step: three decode rows around a prompt; the "prompt_" kinds leave them to the decode kernels
    ([7, 9, 0, 5], [1, 1, 6, 1], {"length": [None, (2, 8)], "start": [(0, 1), (1, 2), (2, 8), (8, 9)],
                                  "prompt_start": [(2, 8)], "prompt_length": [(2, 8)]}, [0, 1, 3]),
    # a prompt's one-token last chunk is a single row too; two fresh prompts of one length stay one group
    ([0, 4, 0, 6], [3, 1, 3, 1], {"length": [None, None], "start": [None, (3, 4), (7, 8)],
                                  "prompt_start": [None], "prompt_length": [None]}, [1, 3]),
])
def test_a_span_is_the_groups_rows_or_none(starts, counts, spans, single):
    b = batch(starts, counts)
    for kind in ("length", "start", "prompt_start", "prompt_length"):
        got = []
        groups = b.groups(kind, "cpu")
        for idx, rows, _, s in groups:
            got.append(None if s is None else (s.start, s.stop))
            if s is not None:       # exactly the rows the tensor names, in its order
                assert torch.equal(torch.arange(s.start, s.stop), rows)
            else:
                assert not torch.equal(rows, torch.arange(int(rows[0]), int(rows[0]) + len(rows)))
        assert b.groups(kind, "cpu") is groups      # worked out once a step: the same groups and spans back
        assert got == spans[kind], (kind, got)
    idx, rows, slots, lens = b.single_rows("cpu")
    offs = b.offsets
    assert idx == single and rows.tolist() == [offs[i] for i in single]
    assert slots.tolist() == [10 + i for i in single] and lens.tolist() == [starts[i] + 1 for i in single]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_single_rows_tensors_are_16_byte_aligned(n):
    """Triton compiles a pointer argument by its 16-byte alignment: the rows, slots and lengths of any count of
    decode rows must start aligned, as the load-time warm-up's do (one binary, not one more for odd counts)."""
    b = batch([5 + i for i in range(n)] + [0], [1] * n + [4])
    idx, *ts = b.single_rows("cpu")
    assert idx == list(range(n)) and all(t.data_ptr() % 16 == 0 for t in ts), [t.data_ptr() % 16 for t in ts]
    # and every step's token and sequence index tensors (kv_write, the eager decode's kernels), odd counts too
    d = batch([5 + i for i in range(n)], [1] * n)
    for ts in (b.token_index("cpu"), d.index_tensors("cpu")):
        assert all(t.data_ptr() % 16 == 0 for t in ts), [t.data_ptr() % 16 for t in ts]
    assert b.token_index("cpu")[1].tolist() == [5 + i for i in range(n)] + [0, 1, 2, 3]


def test_a_decode_only_step_has_no_single_rows():
    """The decode path takes those (not the attention's prompt path)."""
    b = batch([5, 9], [1, 1])
    assert b.decode_only() and b.single_rows("cpu")[0] == []


def test_spans_read_the_offsets_once_a_step(monkeypatch):
    """500 decode rows and a prompt: every layer asks for every group's span. The offsets (a property that walks
    the counts) are read once for the groups and their spans, not once a group or a sequence."""
    reads = []
    prop = StepBatch.offsets
    monkeypatch.setattr(StepBatch, "offsets", property(lambda self: reads.append(1) or prop.fget(self)))
    b = batch([100 + i for i in range(500)] + [0], [1] * 500 + [512])
    first = [g[3] for g in b.groups("length", "cpu")]
    n = len(reads)
    for _ in range(80):         # the layers
        assert [g[3] for g in b.groups("length", "cpu")] == first
    assert first == [slice(0, 500), slice(500, 1012)] and len(reads) == n <= 2, len(reads)


def test_fresh_segments_follow_the_switch_over_one_step(monkeypatch):
    """kernels/prefill.fresh_segments is made once a step and kept on the StepBatch; a benchmark that times the
    groups way and then the varlen way over one StepBatch must get the variable-length segments the second time
    (cached under the switch), not the first way's None."""
    from memra_pp.kernels import prefill as pf
    counts, starts = [3, 5, 1, 4], [0, 0, 7, 0]
    b = StepBatch(list(range(4)), starts, counts, StepBatch.text_positions(starts, counts), [True] * 4)
    monkeypatch.setattr(pf, "VARLEN", False)
    assert pf.fresh_segments(b, "cpu", torch.float32) is None
    monkeypatch.setattr(pf, "VARLEN", True)
    seg = pf.fresh_segments(b, "cpu", torch.float32)
    assert seg is not None and seg.lens == [3, 5, 4] and seg.cu32.tolist() == [0, 3, 8, 12]
    assert pf.fresh_segments(b, "cpu", torch.float32) is seg          # once a step
