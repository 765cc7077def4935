"""flash-linear-attention kernels for the gated delta rule on CUDA (same contract as gdn.py's torch forms:
raw q/k, l2-normalised in the kernel, scale dk^-1/2, fp32 state in and out)."""
from __future__ import annotations

import torch


def available() -> bool:
    try:
        import fla.ops.gated_delta_rule  # noqa: F401
    except Exception:  # fla is optional: absent on CPU machines, or built for another triton
        return False
    return torch.cuda.is_available()


class FlaRule:
    name = "fla"

    def __init__(self):
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
        self._chunk, self._rec = chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    def chunk(self, q, k, v, g, beta, state):
        o, s = self._chunk(q, k, v, g=g.float(), beta=beta, initial_state=state.float().contiguous(),
                           output_final_state=True, use_qk_l2norm_in_kernel=True)
        return o, s.float()

    def recurrent(self, q, k, v, g, beta, state):
        # keywords, as transformers calls it: the recurrent kernel's positional order differs from chunk's
        o, s = self._rec(q, k, v, g=g.float(), beta=beta, initial_state=state.float().contiguous(),
                         output_final_state=True, use_qk_l2norm_in_kernel=True)
        return o, s.float()

    def decode(self, q, k, v, g, beta, state_pool, slots):
        """One token per sequence, in place at the state pool's slots (kernels/gdn_decode.py: fla's arithmetic)."""
        from memra_pp.kernels.gdn_decode import gdn_decode
        return gdn_decode(q, k, v, g, beta, state_pool, slots, q.shape[-1] ** -0.5)
