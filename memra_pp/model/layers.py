"""Norms, dense MLP and the MoE block of Qwen3.5 (reference/qwen35.md 2.1, 2.5); no knowledge of stages."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

# which form each MoE call without the fused kernels took (tests: the static step's gathered and all-experts forms)
MOE_CALLS = {"gathered": 0, "all_experts": 0, "routed": 0}


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm: weights hold w, the scale is (1 + w)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + w.float())).to(x.dtype)


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The linear-attention output norm: plain w (not 1 + w), normalise first, then gate by silu(z)."""
    dt = x.dtype
    xf = x.float()
    y = (w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dt))
    return (y * F.silu(z.float())).to(dt)


def project(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w^T (F.linear), written into `out` [T, N] when given (a prefill graph's buffer)."""
    return F.linear(x, w) if out is None else torch.mm(x, w.t(), out=out)


class Param(nn.Module):
    """Holds named tensors loaded from a WeightSource (no init: weights are always assigned)."""

    def __init__(self, names: list[str]):
        super().__init__()
        self.names = names

    def load(self, prefix: str, src, dtype, device):
        for n in self.names:
            self.register_buffer(n.replace(".", "_"), src.get(prefix + n, dtype, device), persistent=False)

    def fuse(self, names: list[str]) -> torch.Tensor:
        """One matrix holding the named projections' rows in order (one GEMV for the decode graphs instead of
        several); the named buffers become views into it, so nothing is held twice. The merged matrix is a plain
        attribute: weights are loaded on their device and never moved (Module.to would split views from it)."""
        keys = [n.replace(".", "_") + "_weight" for n in names]
        ws = [getattr(self, k) for k in keys]
        W = torch.cat(ws, 0)
        off = 0
        for k, w in zip(keys, ws):
            self.register_buffer(k, W[off:off + w.shape[0]], persistent=False)
            off += w.shape[0]
        return W

    def lin(self, x, name: str, lora=None):
        """x @ W(name)^T, plus the batch's LoRA delta when a hook is given (lora.LoraStep.layer)."""
        y = F.linear(x, getattr(self, name.replace(".", "_") + "_weight"))
        return y if lora is None else lora(name, x, y)


class DenseMLP(Param):
    def __init__(self):
        super().__init__(["gate_proj.weight", "up_proj.weight", "down_proj.weight"])

    def load(self, prefix: str, src, dtype, device):
        super().load(prefix, src, dtype, device)
        self.gate_up = self.fuse(["gate_proj", "up_proj"])

    def decode_fused(self, h_BH, m_BH, w_norm, eps: float, live=None):
        """The decode graphs' MLP on rms_norm(h + m): the residual add and norm with the gate|up GEMV, one silu-mul
        kernel, the down GEMV (kernels/gemv.py at few rows). Returns (h + m, the MLP's output). `live` (the MoE's
        padding flags) is not used: a padding row costs a dense GEMV no more bytes."""
        from memra_pp.kernels.fused_decode import silu_mul
        from memra_pp.kernels.gemv import linear, norm_linear
        h_BH, gu = norm_linear(h_BH, m_BH, w_norm, eps, self.gate_up)
        return h_BH, linear(silu_mul(gu), self.down_proj_weight)

    def forward(self, x, lora=None):
        from memra_pp.kernels import prefill as pf
        if pf.merged(x, lora):      # one GEMM for gate|up and one silu-mul kernel (CUDA)
            from memra_pp.kernels.fused_decode import silu_mul
            return self.lin(silu_mul(F.linear(x, self.gate_up)), "down_proj")
        return self.lin(F.silu(self.lin(x, "gate_proj", lora)) * self.lin(x, "up_proj", lora), "down_proj", lora)


class MoE(Param):
    """Top-k routed experts (weights renormalised) plus a sigmoid-gated shared expert."""

    def __init__(self, top_k: int):
        super().__init__(["gate.weight", "shared_expert_gate.weight", "shared_expert.gate_proj.weight",
                          "shared_expert.up_proj.weight", "shared_expert.down_proj.weight",
                          "experts.gate_up_proj", "experts.down_proj"])
        self.top_k = top_k
        self.route_counter = None   # the router kernel's own counter (kernels/moe_route.py), made at load
        self.block_bar = None       # the block kernel's own barrier (kernels/moe_block.py), made at load

    def load(self, prefix: str, src, dtype, device):
        super().load(prefix, src, dtype, device)
        self.shared_gate_up = self.fuse(["shared_expert.gate_proj", "shared_expert.up_proj"])
        self.route_counter = torch.zeros(1, dtype=torch.int32, device=device)
        self.block_bar = torch.zeros(1, dtype=torch.int32, device=device)

    def decode_fused(self, h_BH, m_BH, w_norm, eps: float, live=None):
        """The decode graphs' MoE on rms_norm(h + m): for one row where it runs, the whole block in one kernel
        (kernels/moe_block.py); else on the fused path the add and norm inside the router kernel (one row;
        kernels/moe_route.py). Returns (h + m, the MoE's output). `live` (a flag a row, 0 for a decode graph's
        padding rows, or None): on the fused path those rows are routed to no expert (decode_graphs.SKIP_PADDING),
        and their output is not defined."""
        from memra_pp.kernels import fused_moe, moe_block
        from memra_pp.kernels.fused_decode import add_rms_norm
        shared = self._shared()
        if moe_block.takes(h_BH, m_BH, w_norm, self.gate_weight, self.top_k, self.experts_gate_up_proj,
                           self.experts_down_proj, shared):
            s, out, _, _ = moe_block.moe_block(h_BH, m_BH, w_norm, eps, self.gate_weight, self.top_k,
                                               self.experts_gate_up_proj, self.experts_down_proj, shared,
                                               self.block_bar)
            return s, out
        if fused_moe.enabled(h_BH, self.top_k):
            if fused_moe.PREMISE_ROUTE:     # benchmarks only: the router's cost in the step (wrong outputs)
                h_BH, x, w, idx = fused_moe.premise_route(h_BH, m_BH, w_norm, eps, self.top_k)
            else:
                h_BH, x, w, idx = fused_moe.norm_router_route(
                    h_BH, m_BH, w_norm, eps, self.gate_weight, self.top_k, h_BH.dtype, counter=self.route_counter,
                    live=live)
            return h_BH, fused_moe.moe_experts(x, self.experts_gate_up_proj, self.experts_down_proj, w, idx,
                                               shared)
        h_BH, x = add_rms_norm(h_BH, m_BH, w_norm, eps)
        return h_BH, self(x, None, True)

    def _shared(self):
        """The shared expert's weights as the fused kernels take them (fused_moe.shared_ref)."""
        return self.shared_gate_up, self.shared_expert_down_proj_weight, self.shared_expert_gate_weight

    WARM_ROWS = None    # rows warm_up runs (None: warm_rows(), every variant for this top_k)

    def warm_rows(self) -> list[int]:
        """Row counts whose pairs (rows x top_k) land in each variant of the fused path: per-pair kernels (one row),
        the grouped GEMM with its alignment kernel at 512 ids a step (up to 512 pairs), at 1,024 with each of the
        grouped GEMM's three block configs (up to the kernel's bound), then the torch alignment with the largest
        blocks (moe_align.align, moe_grouped.grouped_config)."""
        from memra_pp.kernels.moe_align import ALIGN_KERNEL_PAIRS
        from memra_pp.kernels.moe_grouped import CONFIG_BOUNDS
        k, bounds = self.top_k, (512, *CONFIG_BOUNDS, ALIGN_KERNEL_PAIRS)
        return sorted({1} | {max(1, n // k) for n in bounds} | {ALIGN_KERNEL_PAIRS // k + 1})

    def warm_up(self):
        """Run the fused kernels once at every variant a step can pick (the router kernel, with and without the
        input norm, the routing kernel with and without padding rows, the per-pair kernels with and without the
        shared expert riding along (adapter steps add it apart), the grouped GEMM at each block config with each
        alignment, and where it is on the one-row block kernel, kernels/moe_block.py), so Triton compiles them at
        load, not inside a running step where every waiting request would pay for it."""
        from memra_pp.kernels import fused_moe, moe_block
        x = self.gate_weight
        if not fused_moe.enabled(x, self.top_k):
            return
        g = torch.Generator(device=x.device).manual_seed(0)
        for T in self.WARM_ROWS or self.warm_rows():
            self(torch.randn(T, x.shape[1], generator=g, device=x.device, dtype=x.dtype))
        x1 = torch.randn(1, x.shape[1], generator=g, device=x.device, dtype=x.dtype)
        fused_moe.moe_experts(x1, self.experts_gate_up_proj, self.experts_down_proj,
                              *fused_moe.router_route(x1, x, self.top_k, x.dtype, counter=self.route_counter))
        # one row's decode step: the block kernel where it is on, else the router kernel with the input norm, which
        # is compiled where the block replaces it too (benchmarks switch the block off and on)
        self.decode_fused(x1, x1, x[0], 1e-6)
        # and a padded decode graph's: the routing kernel that routes a padding row to no expert
        x2 = torch.randn(2, x.shape[1], generator=g, device=x.device, dtype=x.dtype)
        self.decode_fused(x2, x2, x[0], 1e-6, live=torch.tensor([1, 0], device=x.device))
        if moe_block.takes(x1, x1, x[0], x, self.top_k, self.experts_gate_up_proj, self.experts_down_proj,
                           self._shared()):
            fused_moe.norm_router_route(x1, x1, x[0], 1e-6, x, self.top_k, x.dtype, counter=self.route_counter)

    def forward(self, x_TH, lora=None, static: bool = False):
        """On CUDA the fused routing and experts (kernels/fused_moe.py), eager and captured alike. Otherwise
        `static` (no host sync, no data-dependent shape: a CUDA graph captures it): few routed pairs copy their
        experts out (_gathered), more run every expert on every row in two batched matmuls mixed by the routing
        weights (zero where unrouted); not static: each routed expert on its rows (_routed)."""
        from memra_pp.kernels import fused_moe
        if fused_moe.enabled(x_TH, self.top_k):
            w, idx = fused_moe.router_route(x_TH, self.gate_weight, self.top_k, x_TH.dtype,
                                            counter=self.route_counter)
            if lora is None:     # the shared expert rides in the experts' kernels (few rows) or is added there
                return fused_moe.moe_experts(x_TH, self.experts_gate_up_proj, self.experts_down_proj, w, idx,
                                             self._shared())
            out = fused_moe.moe_experts(x_TH, self.experts_gate_up_proj, self.experts_down_proj, w, idx)
        else:
            w, idx = fused_moe.route_ref(F.linear(x_TH, self.gate_weight), self.top_k, x_TH.dtype)
            form = ("gathered" if 3 * idx.numel() <= self.experts_gate_up_proj.shape[0] else "all_experts") \
                if static else "routed"
            MOE_CALLS[form] += 1
            run = self._gathered if form == "gathered" else self._all_experts if form == "all_experts" else self._routed
            out = run(x_TH, w, idx)
        shared = self.lin(F.silu(self.lin(x_TH, "shared_expert.gate_proj", lora)) *
                          self.lin(x_TH, "shared_expert.up_proj", lora), "shared_expert.down_proj", lora)
        return out + torch.sigmoid(F.linear(x_TH, self.shared_expert_gate_weight)) * shared

    def _gathered(self, x_TH, w, idx):
        """Few routed (row, expert) pairs (small decode batches): copy just their experts' weights out and run
        them as batched matrix-vector products; the bytes moved stay a small multiple of the routed experts'."""
        from memra_pp.kernels.fused_moe import moe_experts_ref
        return moe_experts_ref(x_TH, self.experts_gate_up_proj, self.experts_down_proj, w, idx)

    def _all_experts(self, x_TH, w, idx):
        gate_up, down = self.experts_gate_up_proj, self.experts_down_proj
        E, inter = gate_up.shape[0], down.shape[-1]
        mix_TE = torch.zeros(x_TH.shape[0], E, dtype=x_TH.dtype, device=x_TH.device).scatter_(1, idx, w)
        gu = torch.bmm(x_TH[None].expand(E, -1, -1), gate_up.transpose(1, 2))          # [E, T, 2I]
        h = F.silu(gu[..., :inter]) * gu[..., inter:]
        y = torch.bmm(h, down.transpose(1, 2)) * mix_TE.transpose(0, 1)[..., None]       # [E, T, H]
        return y.sum(0)

    def _routed(self, x_TH, w, idx):
        out = torch.zeros_like(x_TH)
        gate_up, down = self.experts_gate_up_proj, self.experts_down_proj
        inter = down.shape[-1]
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
        tok = order // self.top_k
        start = 0
        for e, c in enumerate(counts):
            if c == 0:
                continue
            sel = order[start:start + c]
            rows = tok[start:start + c]
            start += c
            gu = F.linear(x_TH[rows], gate_up[e])
            h = F.silu(gu[:, :inter]) * gu[:, inter:]
            y = F.linear(h, down[e]) * w.reshape(-1)[sel, None]
            out.index_add_(0, rows, y)
        return out
