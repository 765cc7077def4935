"""The greedy sampling kernel (kernels/greedy.py) against its torch reference, on one device: run as
`python greedy_check.py DEVICE [V]` (CPU under TRITON_INTERPRET=1, or cuda compiled). Prints "greedy ok" and the
kernel's launch count."""
import sys

import torch

from memra_pp.kernels import greedy as gr

torch.manual_seed(0)
dev = sys.argv[1]
V = int(sys.argv[2]) if len(sys.argv) > 2 else 3 * gr.BLOCK + 123      # three full blocks and a partial one


def check(x, what):
    tok, both = gr.greedy(x)
    rt, rb = gr.greedy_ref(x)
    assert tok.dtype == torch.int64 and both.dtype == torch.float64 and both.shape == (2, x.shape[0]), what
    assert torch.equal(tok, rt), (what, tok, rt)
    assert torch.equal(both[0], rb[0]), what
    nan = rb[1].isnan()
    assert torch.equal(both[1].isnan(), nan), (what, both[1], rb[1])
    d = (both[1] - rb[1])[~nan].abs().max().item() if (~nan).any() else 0.0
    assert d <= 1e-5 * max(1.0, rb[1][~nan].abs().max().item() if (~nan).any() else 1.0), (what, d)


before = gr.CALLS["greedy"]
for n in (1, 3):
    check(torch.randn(n, V, device=dev) * 4, f"random {n}")
check(torch.randn(2, 17, device=dev), "one partial block")
check(torch.randn(2, gr.BLOCK, device=dev), "one full block")
x = torch.randn(9, V, device=dev)
x[0, [5, gr.BLOCK + 9, 2 * gr.BLOCK + 1]] = 50.0          # equal maxima in three blocks: the first
x[1, [gr.BLOCK + 3, gr.BLOCK + 4]] = 50.0                 # two in one block
x[2, [gr.BLOCK + 7, 3 * gr.BLOCK + 2]] = float("nan")     # NaNs: the first one, logprob NaN
x[2, 0] = float("inf")
x[3, 9] = float("inf")                                    # +inf: its token, logprob NaN (inf - inf), as torch
x[4] = float("-inf")                                      # every logit -inf: token 0, logprob NaN
x[5, : 2 * gr.BLOCK] = float("-inf")                      # whole blocks of -inf beside finite ones
x[5, V - 1] = 3.0
x[6] = x[6] * 1e3 - 1e4                                   # far below 0: nothing overflows
x[7] = x[7] - 1e4                                         # a block of -inf beside a maximum far below 0: the
x[7, : gr.BLOCK] = float("-inf")                          # block adds nothing (0 * exp(-C) would be 0 * inf)
x[8, gr.BLOCK + 3] = float("inf")                         # +inf before a NaN in one block: the NaN
x[8, gr.BLOCK + 9] = float("nan")
check(x, "edges")
check(x[:, : V - 50], "strided rows")                     # rows of a wider tensor
W = V if dev == "cuda" else gr.BLOCK + 7                  # (the interpreter: two blocks a row, half the programs)
for _ in range(3):                                        # the counters reset themselves
    check(torch.randn(64, W, device=dev) * 2, "64 rows")
print("greedy ok", gr.CALLS["greedy"] - before)
