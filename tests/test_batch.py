"""StepBatch's groups and their row spans (model/batch.py): the prefill's merged path reads a group's rows as a
slice only where the slice holds exactly the rows its row tensor names."""
import pytest
import torch

from memra_pp.model.batch import StepBatch


def batch(starts, counts):
    return StepBatch(list(range(len(counts))), starts, counts, StepBatch.text_positions(starts, counts),
                     [True] * len(counts))


@pytest.mark.parametrize("starts,counts,spans", [
    ([0, 0, 0], [4, 4, 4], {"length": [(0, 12)], "start": [(0, 12)]}),                # one group of every row
    ([0, 0, 0], [9, 5, 9], {"length": [None, (9, 14)], "start": [None, (9, 14)]}),    # 0 and 2 apart: gathered
    ([3, 3, 0], [2, 2, 2], {"length": [(0, 4), (4, 6)], "start": [(0, 4), (4, 6)]}),  # fresh and continuing
    ([7, 9, 0, 5], [1, 1, 6, 1], {"length": [None, (2, 8)], "start": [(0, 1), (1, 2), (2, 8), (8, 9)]}),
])
def test_a_span_is_the_groups_rows_or_none(starts, counts, spans):
    b = batch(starts, counts)
    for kind in ("length", "start"):
        got = []
        for idx, rows, _ in b.groups(kind, "cpu"):
            s = b.span(idx)
            got.append(None if s is None else (s.start, s.stop))
            if s is not None:       # exactly the rows the tensor names, in its order
                assert torch.equal(torch.arange(s.start, s.stop), rows)
            else:
                assert not torch.equal(rows, torch.arange(int(rows[0]), int(rows[0]) + len(rows)))
            assert b.span(idx) is s or b.span(idx) == s     # worked out once a step: the same answer
        assert got == spans[kind], (kind, got)


def test_a_span_of_many_rows_is_worked_out_once():
    """500 decode rows and a prompt: every layer asks for the same groups' spans (once each a step, not once a
    layer, and never once a sequence over every offset)."""
    b = batch([100] * 500 + [0], [1] * 500 + [512])
    groups = b.groups("length", "cpu")
    first = [b.span(idx) for idx, _, _ in groups]
    assert first == [slice(0, 500), slice(500, 1012)]
    assert all(b._spans[id(idx)][1] is s for (idx, _, _), s in zip(groups, first))
    assert [b.span(list(idx)) for idx, _, _ in groups] == first      # another list: worked out again, the same
