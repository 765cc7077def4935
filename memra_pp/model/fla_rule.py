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
        """G sequences of n tokens each ([G, n, ...]) as one variable-length call (batch 1, cu_seqlens): fla's
        autotuned kernels key on the batch size (chunk_local_cumsum's `B`), so a batched call re-tuned at every new
        group size, seconds in the middle of a running prefill (a 4,096-token step took 10.4 s the first time its
        group size was seen, 0.16 s after). Chunks still start at each sequence's first token, so the arithmetic
        is the batched call's."""
        G, n = q.shape[:2]
        cu_cpu = torch.arange(0, G * n + 1, n, dtype=torch.long)
        flat = (lambda t: t.reshape(1, G * n, *t.shape[2:]))
        o, s = self._chunk(flat(q), flat(k), flat(v), g=flat(g).float(), beta=flat(beta),
                           initial_state=state.float().contiguous(), output_final_state=True,
                           use_qk_l2norm_in_kernel=True, cu_seqlens=cu_cpu.to(q.device), cu_seqlens_cpu=cu_cpu)
        return o.view(G, n, *o.shape[2:]), s.float()

    def warm_up(self, hv: int, dk: int, dv: int, dtype, device):
        """Autotune and compile the chunk and recurrent kernels at load, at the layer's head shapes (their tuning
        keys), on token counts of each of Triton's specialisations (1, a multiple of 16, neither): the first
        prefill then pays none of it (42 s for the 35B-A3B's first 8,192-token step before this)."""
        gen = torch.Generator(device=device).manual_seed(0)
        for G, n in ((1, 1), (1, 64), (2, 37)):
            q, k = (torch.randn(G, n, hv, dk, generator=gen, device=device, dtype=dtype) for _ in range(2))
            v = torch.randn(G, n, hv, dv, generator=gen, device=device, dtype=dtype)
            g = -torch.rand(G, n, hv, generator=gen, device=device)
            beta = torch.rand(G, n, hv, generator=gen, device=device).to(dtype)
            s0 = torch.zeros(G, hv, dk, dv, device=device)
            self.chunk(q, k, v, g, beta, s0)
            if n == 1:
                self.recurrent(q, k, v, g, beta, s0)

    def recurrent(self, q, k, v, g, beta, state):
        # keywords, as transformers calls it: the recurrent kernel's positional order differs from chunk's
        o, s = self._rec(q, k, v, g=g.float(), beta=beta, initial_state=state.float().contiguous(),
                         output_final_state=True, use_qk_l2norm_in_kernel=True)
        return o, s.float()

    def decode(self, q, k, v, g, beta, state_pool, slots):
        """One token per sequence, in place at the state pool's slots (kernels/gdn_decode.py: fla's arithmetic)."""
        from memra_pp.kernels.gdn_decode import gdn_decode
        return gdn_decode(q, k, v, g, beta, state_pool, slots, q.shape[-1] ** -0.5)
