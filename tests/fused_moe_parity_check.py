"""The MoE model through the fused MoE kernels (kernels/fused_moe.py, in Triton's CPU interpreter, float32) must
reproduce transformers' greedy tokens and logprobs within 5e-4, batched prefill and decode over two stages. Run
under TRITON_INTERPRET=1 (tests/test_decode_graphs.py does); prints the kernel paths' launch counts."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import interp  # noqa: E402
from memra_pp.kernels import fused_moe  # noqa: E402
from test_model_parity import check  # noqa: E402

interp.coarse_moe_tiles()
# prompts of 1 to 24 tokens (the interpreter is slow, the routing kernel a program a row; test_model_parity runs up to
# 130 through the torch paths): the prefill's 44 tokens (88 pairs) still take the grouped GEMM over several blocks,
# the decode batch the per-pair kernels (four tokens: the prefill's, then three batched decode steps)
check("moe", False, 2, chunk=None, prompts=[(5, 17, 42), tuple(range(1, 25)), (7,), tuple(range(200, 216))], new=4)
print("parity ok", fused_moe.CALLS)
