"""The prefill's merged path (kernels/prefill.py MERGED: one GEMM for each layer's input projections, silu-mul as
one kernel, the conv writing q, k and v as contiguous tensors, a group's rows as a slice where they are consecutive)
through the Triton kernels (Triton's CPU interpreter, float32), against the eager step through the torch ops: same
greedy tokens, logprobs within 5e-4, for a chunked prefill whose steps are one group of every row, and groups
consecutive (a slice) and scattered (gathered). Run under TRITON_INTERPRET=1 (tests/test_decode_graphs.py
does); prints the counters."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import interp  # noqa: E402,F401
from memra_pp.kernels import fused_decode as fd, prefill as pf  # noqa: E402
from test_decode_graphs import pipelines  # noqa: E402

# prompts of 9, 5 and 9 tokens: whole, sequences 0 and 2 are one group (rows 0-8 and 14-22: gathered) and 1 another
# (a slice); in chunks of 3 the first step is one group of every row (its output is the layer's, no copy), the second
# groups 0 and 2 (rows 0-2 and 5-7: gathered) apart from 1 (2 tokens: a slice)
PROMPTS, CHUNK, NEW = [list(range(3, 12)), [40, 41, 42, 43, 44], list(range(60, 69))], 3, 3
# the test runs the dense model in chunks (every row path; a minute); `prefill_check.py all` adds whole prompts and
# the MoE (its layers take the same path but for the MLP)
ALL = sys.argv[1:] == ["all"]
for kind in ["dense", "moe"] if ALL else ["dense"]:
    for chunk in (None, CHUNK) if ALL else (CHUNK,):
        eager, _ = pipelines(kind, [(0, 8)])
        fd.USE_TRITON = False          # the reference: the eager step through the torch ops
        te, le = eager.greedy(PROMPTS, NEW, chunk=chunk)
        fd.USE_TRITON = True
        before = dict(pf.CALLS)
        tk, lk = eager.greedy(PROMPTS, NEW, chunk=chunk)
        ran = {k: pf.CALLS[k] - before[k] for k in pf.CALLS}
        assert tk == te, (kind, chunk, tk, te)
        d = max(abs(a - b) for x, y in zip(le, lk, strict=True) for a, b in zip(x, y, strict=True))
        assert d < 5e-4, (kind, chunk, d)
        assert ran["merged"] > 0 and ran["conv_prefill"] > 0, ran
        assert ran["rows_gather"] > 0 and ran["rows_slice"] > 0 and (ran["rows_whole"] > 0) == (chunk is not None), \
            (chunk, ran)
        print(kind, "chunk", chunk, "ok", ran, f"logprob diff {d:.1e}")
print("prefill ok")
