"""The MoE model through the fused MoE kernels (kernels/fused_moe.py, in Triton's CPU interpreter, float32) must
reproduce transformers' greedy tokens and logprobs within 5e-4, batched prefill and decode over two stages. Run
under TRITON_INTERPRET=1 (tests/test_decode_graphs.py does); prints the kernel paths' launch counts."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from memra_pp.kernels import fused_moe  # noqa: E402
from test_model_parity import check  # noqa: E402

check("moe", False, 2, chunk=None)
print("parity ok", fused_moe.CALLS)
