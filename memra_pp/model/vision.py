"""The Qwen3.5 vision tower: patches -> merged rows of the text model's width (reference/qwen35.md section 6).
Pure math on one device; it runs wherever the caller puts it (the tower engine) and knows nothing of stages.
"""
from __future__ import annotations

import math
import numbers
from typing import Callable, Iterable

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError, InputError
from .attention import sdpa
from .config import VisionConfig

# Legend: N patches (all images and frames stacked), Hv vision width, nh heads, hd head dim,
# R = N / merge^2 output rows, Ho = out_hidden_size (the text model's hidden size).

ACTS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu}


class _Attention(nn.Module):
    def __init__(self, vcfg: VisionConfig):
        super().__init__()
        self.nh = vcfg.num_heads
        self.qkv = nn.Linear(vcfg.hidden_size, 3 * vcfg.hidden_size)
        self.proj = nn.Linear(vcfg.hidden_size, vcfg.hidden_size)

    def forward(self, x_ND, seqlens: list[int], cos_Nd, sin_Nd):
        N = x_ND.shape[0]
        q, k, v = self.qkv(x_ND).reshape(N, 3, self.nh, -1).unbind(1)            # each [N, nh, hd]
        q, k = _rotate(q, cos_Nd, sin_Nd), _rotate(k, cos_Nd, sin_Nd)
        outs = []
        # Non-causal attention within one frame of one image; frames never see each other.
        for qs, ks, vs in zip(q.split(seqlens), k.split(seqlens), v.split(seqlens)):
            o = sdpa(qs.transpose(0, 1), ks.transpose(0, 1), vs.transpose(0, 1))
            outs.append(o.transpose(0, 1).reshape(qs.shape[0], -1))
        return self.proj(torch.cat(outs))


def _rotate(x_Nhd, cos_Nd, sin_Nd):
    """Rotary over the full head dim, in fp32, cast back (as HF does for every dtype)."""
    xf = x_Nhd.float()
    half = xf.shape[-1] // 2
    rot = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    return (xf * cos_Nd[:, None] + rot * sin_Nd[:, None]).to(x_Nhd.dtype)


class _MLP(nn.Module):
    def __init__(self, vcfg: VisionConfig):
        super().__init__()
        self.linear_fc1 = nn.Linear(vcfg.hidden_size, vcfg.intermediate_size)
        self.linear_fc2 = nn.Linear(vcfg.intermediate_size, vcfg.hidden_size)
        self.act = ACTS[vcfg.hidden_act]

    def forward(self, x):
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class _Block(nn.Module):
    def __init__(self, vcfg: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(vcfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(vcfg.hidden_size, eps=1e-6)
        self.attn = _Attention(vcfg)
        self.mlp = _MLP(vcfg)

    def forward(self, x, seqlens, cos, sin):
        x = x + self.attn(self.norm1(x), seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class _Merger(nn.Module):
    def __init__(self, vcfg: VisionConfig):
        super().__init__()
        self.width = vcfg.hidden_size * vcfg.spatial_merge_size ** 2
        self.norm = nn.LayerNorm(vcfg.hidden_size, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.width, self.width)
        self.linear_fc2 = nn.Linear(self.width, vcfg.out_hidden_size)

    def forward(self, x_ND):
        # merge^2 consecutive patches are one merge block (the preprocessor's row order guarantees it)
        x = self.norm(x_ND).view(-1, self.width)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class _PatchEmbed(nn.Module):
    def __init__(self, vcfg: VisionConfig):
        super().__init__()
        # Conv3d with kernel == stride over one (C, T, p, p) patch is this linear map.
        self.proj = nn.Linear(vcfg.in_channels * vcfg.temporal_patch_size * vcfg.patch_size ** 2, vcfg.hidden_size)


class VisionTower(nn.Module):
    """Built on the meta device (no memory, no init); `load` / `load_hf_state` materialise every tensor."""

    def __init__(self, vcfg: VisionConfig):
        super().__init__()
        vcfg.validate("vision tower")       # positive integer sizes, a square position table
        if vcfg.hidden_act not in ACTS:
            raise ConfigError(f"vision_config.hidden_act {vcfg.hidden_act!r} is not supported; expected one of "
                              f"{sorted(ACTS)}")
        if vcfg.hidden_size % vcfg.num_heads or (vcfg.hidden_size // vcfg.num_heads) % 4:
            raise ConfigError(f"vision_config.hidden_size {vcfg.hidden_size} must split into num_heads "
                              f"{vcfg.num_heads} heads of a head dim divisible by 4 (axial 2-D rotary)")
        self.side = math.isqrt(vcfg.num_position_embeddings)
        self.vcfg = vcfg
        with torch.device("meta"):
            self.patch_embed = _PatchEmbed(vcfg)
            # given its (meta) weight: nn.Embedding's own init goes through torch's refs, which import torch._dynamo
            # (1.2 s of CPU at the start of every stage that holds the tower)
            n, d = vcfg.num_position_embeddings, vcfg.hidden_size
            self.pos_embed = nn.Embedding(n, d, _weight=torch.empty(n, d))
            self.blocks = nn.ModuleList(_Block(vcfg) for _ in range(vcfg.depth))
            self.merger = _Merger(vcfg)

    # ---- loading -------------------------------------------------------------------------------------------
    def load(self, getter: Callable[[str], torch.Tensor]) -> "VisionTower":
        """Take every tensor by its checkpoint name after `model.visual.`, as the getter returns it (dtype, device).
        A missing (KeyError) or mis-shaped tensor raises ConfigError naming it."""
        v = self.vcfg
        conv_shape = (v.hidden_size, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
        for name, param in list(self.named_parameters()):
            want = conv_shape if name == "patch_embed.proj.weight" else tuple(param.shape)
            try:
                t = getter(name)
            except KeyError:
                raise ConfigError(f"vision tower: tensor visual.{name} {want} is missing from the checkpoint") \
                    from None
            if not isinstance(t, torch.Tensor) or tuple(t.shape) != want:
                raise ConfigError(f"vision tower: tensor visual.{name} has shape "
                                  f"{tuple(getattr(t, 'shape', ()))}, expected {want}; the checkpoint does not "
                                  "match vision_config")
            if name == "patch_embed.proj.weight":
                t = t.reshape(v.hidden_size, -1)
            mod, _, leaf = name.rpartition(".")
            setattr(self.get_submodule(mod), leaf, nn.Parameter(t.detach(), requires_grad=False))
        return self

    def load_hf_state(self, sd: dict[str, torch.Tensor]) -> "VisionTower":
        """Load from a transformers state dict: `model.visual.*`, `visual.*` or a bare Qwen3_5VisionModel's keys."""
        prefix = next((p for p in ("model.visual.", "visual.", "") if p + "pos_embed.weight" in sd), "")
        return self.load(lambda name: sd[prefix + name])

    # ---- forward ------------------------------------------------------------------------------------------
    def forward(self, pixel_values: torch.Tensor, grid_thw) -> torch.Tensor:
        """pixel_values [N, C*T*p*p], grid_thw (n, 3) ints -> rows [N / merge^2, Ho], images in order."""
        grids = _grids(grid_thw, self.vcfg.spatial_merge_size)
        n = sum(t * h * w for t, h, w in grids)
        if pixel_values.ndim != 2 or pixel_values.shape[0] != n:
            raise InputError(f"vision tower: pixel_values has shape {tuple(pixel_values.shape)}, but grid_thw "
                             f"{grids} describes {n} patches")
        w = self.patch_embed.proj.weight
        x = self.patch_embed.proj(pixel_values.to(device=w.device, dtype=w.dtype))         # [N, Hv]
        x = x + self._pos_embed(grids).to(x.dtype)
        cos, sin = self._rotary(grids, x.device)                                          # [N, hd] fp32
        seqlens = [h * w for t, h, w in grids for _ in range(t)]                          # one per frame
        for blk in self.blocks:
            x = blk(x, seqlens, cos, sin)
        return self.merger(x)                                                             # [R, Ho]

    def _merge_order(self, h: int, w: int):
        """(row, col) of each patch in merge-block order (h/m, w/m, m, m)."""
        m = self.vcfg.spatial_merge_size
        rows = torch.arange(h).view(h // m, 1, m, 1).expand(h // m, w // m, m, m).reshape(-1)
        cols = torch.arange(w).view(1, w // m, 1, m).expand(h // m, w // m, m, m).reshape(-1)
        return rows, cols

    def _pos_embed(self, grids) -> torch.Tensor:
        table = self.pos_embed.weight.float().T.reshape(1, -1, self.side, self.side)       # [1, Hv, s, s]
        out = []
        for t, h, w in grids:
            grid = F.interpolate(table, size=(h, w), mode="bilinear", align_corners=True)[0]  # [Hv, h, w]
            rows, cols = self._merge_order(h, w)
            out.append(grid[:, rows, cols].T.repeat(t, 1))
        return torch.cat(out)

    def _rotary(self, grids, device):
        hd = self.vcfg.hidden_size // self.vcfg.num_heads
        inv = 1.0 / self.vcfg.rope_theta ** (torch.arange(0, hd // 2, 2, dtype=torch.float) / (hd // 2))  # [hd/4]
        pos = torch.cat([torch.stack(self._merge_order(h, w), -1).repeat(t, 1) for t, h, w in grids])  # [N, 2]
        f = (pos[..., None].float() * inv).flatten(1)                                     # [N, hd/2]: rows, cols
        emb = torch.cat((f, f), dim=-1).to(device)
        return emb.cos(), emb.sin()


def _grids(grid_thw, merge: int) -> list[tuple[int, int, int]]:
    """(n, 3) grids, or one (t, h, w), as a list of int triples; what the merge cannot take is an InputError."""
    if isinstance(grid_thw, (torch.Tensor, np.ndarray)):
        grid_thw = grid_thw.tolist()
    if isinstance(grid_thw, Iterable) and len(grid_thw) == 3 and all(_is_size(v) for v in grid_thw):
        grid_thw = [grid_thw]
    grids = [tuple(g) if isinstance(g, Iterable) else g for g in grid_thw]
    for g in grids:
        if not (isinstance(g, tuple) and len(g) == 3 and all(_is_size(v) and v > 0 for v in g)) \
                or g[1] % merge or g[2] % merge:
            raise InputError(f"vision tower: grid_thw {grids} must be (t, h, w) triples of positive ints with h and w "
                             f"multiples of spatial_merge_size {merge}")
    return [tuple(int(v) for v in g) for g in grids]


def _is_size(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))
