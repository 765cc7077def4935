"""Gated delta rule (Gated DeltaNet core) in pure torch: chunked (prefill) and recurrent (decode) forms.

Shapes: q, k [B, T, Hv, dk]; v [B, T, Hv, dv]; g, beta [B, T, Hv]; state S [B, Hv, dk, dv] float32.
Math (reference/qwen35.md 2.4): S <- e^g S; delta = beta (v - S^T k); S <- S + k delta^T; o = S^T q.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prep(q, k, v, g, beta, normed: bool = False):
    """fp32, l2-normalised q/k (normed: they are already), q scaled by dk^-1/2, heads moved before time:
    [B, Hv, T, d]."""
    q, k = (q.float(), k.float()) if normed else (l2norm(q.float()), l2norm(k.float()))
    q = q * q.shape[-1] ** -0.5
    return (q.transpose(1, 2), k.transpose(1, 2), v.float().transpose(1, 2),
            g.float().transpose(1, 2), beta.float().transpose(1, 2))


def recurrent_gated_delta_rule(q, k, v, g, beta, state):
    """Step-by-step recurrence; returns (o [B, T, Hv, dv] float32, final state). `state` is not modified."""
    q, k, v, g, beta = _prep(q, k, v, g, beta)
    S = state.float().clone()
    outs = []
    for t in range(q.shape[2]):
        S = S * g[:, :, t, None, None].exp()
        kt = k[:, :, t]
        delta = beta[:, :, t, None] * (v[:, :, t] - torch.einsum("bhkv,bhk->bhv", S, kt))
        S = S + kt[..., :, None] * delta[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, :, t]))
    return torch.stack(outs, 1), S


def recurrent_step(q, k, v, g, beta, state):
    """One token per sequence of the recurrence, for the eager decode off fla: q, k [B, Hv, dk] (heads repeated to
    Hv), v [B, Hv, dv], g, beta [B, Hv], state [B, Hv, dk, dv] (not modified) -> (o [B, Hv, dv] float32, the new
    state). recurrent_gated_delta_rule's arithmetic for T = 1, bit for bit, with matmuls for its einsums and no
    time axis: half its torch calls (on the CPU a call costs more than a tiny model's arithmetic)."""
    q = l2norm(q.float()) * q.shape[-1] ** -0.5
    k = l2norm(k.float())
    S = state.float() * g.float().exp()[..., None, None]
    delta = beta.float()[..., None] * (v.float() - (k.unsqueeze(-2) @ S).squeeze(-2))
    S = S + k.unsqueeze(-1) * delta.unsqueeze(-2)
    return (q.unsqueeze(-2) @ S).squeeze(-2), S


def chunk_gated_delta_rule(q, k, v, g, beta, state, chunk: int = 64, normed: bool = False):
    """Chunked (WY / UT-transform) form, state carried across chunks; same result as the recurrence. `normed`: q
    and k come l2-normalised (fla_rule.FlaRule.chunk_varlen's contract).

    Within a chunk with cumulative log-decay G: U = T(beta V) - T(beta e^G K) S0 with T = (I + L)^-1,
    L[t,s] = beta_t e^(G_t - G_s) k_t.k_s (s < t); O = e^G Q S0 + (Q K^T * D) U; S' = e^G_C S0 + (K e^(G_C-G))^T U.
    """
    q, k, v, g, beta = _prep(q, k, v, g, beta, normed)
    B, Hh, T, dk = k.shape
    chunk = min(chunk, 1 << max(T - 1, 0).bit_length())
    pad = (-T) % chunk
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    n = (T + pad) // chunk
    q, k, v = (x.reshape(B, Hh, n, chunk, -1) for x in (q, k, v))
    g, beta = g.reshape(B, Hh, n, chunk).cumsum(-1), beta.reshape(B, Hh, n, chunk)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    diff = g[..., :, None] - g[..., None, :]
    decay = diff.masked_fill(~lower, float("-inf")).exp()              # e^(G_t - G_s), s <= t
    kk = k @ k.transpose(-1, -2)
    L = (beta[..., None] * kk * decay).masked_fill(lower.logical_not() | torch.eye(
        chunk, dtype=torch.bool, device=q.device), 0)
    A = L + torch.eye(chunk, device=q.device)
    u0 = torch.linalg.solve_triangular(A, beta[..., None] * v, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(A, (beta * g.exp())[..., None] * k, upper=False, unitriangular=True)
    qk = (q @ k.transpose(-1, -2)) * decay
    S = state.float().clone()
    out = torch.empty_like(v)
    for i in range(n):
        u = u0[:, :, i] - w[:, :, i] @ S
        out[:, :, i] = (q[:, :, i] * g[:, :, i, :, None].exp()) @ S + qk[:, :, i] @ u
        gl = g[:, :, i, -1]
        S = S * gl[..., None, None].exp() + (k[:, :, i] * (gl[..., None] - g[:, :, i]).exp()[..., None]
                                              ).transpose(-1, -2) @ u
    out = out.reshape(B, Hh, n * chunk, -1)[:, :, :T]
    return out.transpose(1, 2), S


def chunk_gated_delta_rule_varlen(q, k, v, g, beta, state, lens: list[int]):
    """chunk_gated_delta_rule over packed segments of lengths `lens` (fla's variable-length call): q, k, v, g, beta
    [1, sum(lens), ...], state [len(lens), ...] -> (o [1, sum(lens), ...], states), the segments of one length in
    one call."""
    out = torch.empty(1, sum(lens), *v.shape[2:], dtype=torch.float32, device=v.device)
    states = torch.empty(len(lens), *state.shape[1:], dtype=torch.float32, device=v.device)
    for n, idx, rows in length_groups(lens, v.device):
        G = len(idx)
        o, s = chunk_gated_delta_rule(*(x[0, rows].reshape(G, n, *x.shape[2:]) for x in (q, k, v, g, beta)),
                                      state[idx])
        out[0, rows] = o.reshape(G * n, *o.shape[2:]).float()
        states[idx] = s
    return out, states


def length_groups(lens: list[int], device) -> list[tuple[int, list[int], torch.Tensor]]:
    """Packed segments of lengths `lens` grouped by length: (n, the segments of n rows, their rows in the packing
    [len * n], segment after segment), for one batched call a length where the torch forms take segments one by
    one (the variable-length rule and conv on the CPU)."""
    at = [0]
    for n in lens:
        at.append(at[-1] + n)
    by_len: dict[int, list[int]] = {}
    for i, n in enumerate(lens):
        by_len.setdefault(n, []).append(i)
    return [(n, idx, torch.tensor([at[i] + t for i in idx for t in range(n)], device=device))
            for n, idx in by_len.items()]


def gdn_gates(b: torch.Tensor, a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """(g, beta) from the raw b and a projections: g = -exp(A_log) softplus(a + dt_bias) in fp32, beta = sigmoid(b)
    in the model dtype (as transformers rounds it)."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias.float()), torch.sigmoid(b)


def causal_conv(x_TC: torch.Tensor, w_CK: torch.Tensor, state_CK1: torch.Tensor | None):
    """Depthwise causal conv + SiLU over one sequence. x [T, C]; state = the last K-1 inputs before x.

    Returns (y [T, C], new state [C, K-1]) where the new state holds the last K-1 inputs (zeros if never seen).
    """
    K = w_CK.shape[1]
    T, C = x_TC.shape
    prev = state_CK1 if state_CK1 is not None else x_TC.new_zeros(C, K - 1)
    xs = torch.cat([prev.to(x_TC.dtype), x_TC.transpose(0, 1)], 1)       # [C, K-1+T]
    y = depthwise_causal(xs, w_CK, T)                                     # [C, T]
    return F.silu(y).transpose(0, 1), xs[:, -(K - 1):]


def causal_conv_batch(x_GTC: torch.Tensor, w_CK: torch.Tensor, state_GCK1: torch.Tensor | None):
    """causal_conv over G sequences of the same length T at once. x [G, T, C]; state [G, C, K-1] or None (zeros).
    Returns (y [G, T, C], new states [G, C, K-1])."""
    K = w_CK.shape[1]
    G, T, C = x_GTC.shape
    prev = state_GCK1 if state_GCK1 is not None else x_GTC.new_zeros(G, C, K - 1)
    xs = torch.cat([prev.to(x_GTC.dtype), x_GTC.transpose(1, 2)], 2)    # [G, C, K-1+T]
    y = depthwise_causal(xs, w_CK, T)                                     # [G, C, T]
    return F.silu(y).transpose(1, 2), xs[:, :, -(K - 1):]


def causal_conv_step(x_BC: torch.Tensor, w_CK: torch.Tensor, state_BCK1: torch.Tensor):
    """One decode token per sequence, batched. Returns (y [B, C], new state [B, C, K-1])."""
    xs = torch.cat([state_BCK1.to(x_BC.dtype), x_BC[:, :, None]], 2)     # [B, C, K]
    y = depthwise_causal(xs, w_CK, 1)[:, :, 0]
    return F.silu(y), xs[:, :, 1:]


def depthwise_causal(xs: torch.Tensor, w_CK: torch.Tensor, T: int) -> torch.Tensor:
    """The depthwise conv's T outputs from xs [..., C, K-1+T] (the K-1 inputs before, then the T new ones): each
    the fp32 sum of its K products in order, rounded once to xs's dtype (the Triton kernels' rounding,
    kernels/prefill.conv_prefill). K multiply-adds over [..., C, T]: on the CPU, torch's depthwise conv1d (oneDNN)
    took 130-260 us a call at a tiny model's sizes, most of a decode step's Gated DeltaNet time."""
    w = w_CK.float()
    y = xs[..., 0:T].float() * w[:, 0:1]
    for k in range(1, w.shape[1]):
        y.add_(xs[..., k:k + T].float() * w[:, k:k + 1])
    return y.to(xs.dtype)
