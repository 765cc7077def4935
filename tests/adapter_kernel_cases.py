"""Shared cases for the adapter kernel tests: a TokenOverlaySet over 3 slots and inputs that hit every guard."""
import torch

from memra_pp.engine import Engine
from memra_pp.overlay import TokenOverlay, TokenOverlaySet

V, H, S = 50, 40, 3


def overlay_set(device="cpu", dtype=torch.float32, tied=False):
    """Slot 0: embed rows (and lm rows when untied); slot 1 empty; slot 2: embed rows only."""
    g = torch.Generator().manual_seed(0)
    lm = dict(lm_head_ids=torch.tensor([2, 9, 49]), lm_head_rows=torch.randn(3, H, generator=g).to(dtype))
    s0 = TokenOverlay(V, torch.tensor([1, 4, 9]), torch.randn(3, H, generator=g).to(dtype), **({} if tied else lm))
    s2 = TokenOverlay(V, torch.tensor([4, 7]), torch.randn(2, H, generator=g).to(dtype))
    return TokenOverlaySet.from_slots(Engine(device), {0: s0, 2: s2}, S, tied)


def embed_inputs(device="cpu", dtype=torch.float32):
    """ids with overridden, plain, out-of-vocab and negative ids under slots 0, 1 (empty), 2, -1 and 7 (bad)."""
    ids = torch.tensor([1, 4, 4, 7, 9, 4, 60, -3, 9, 1, 7, 4], device=device)
    slots = torch.tensor([0, 0, 2, 2, 1, -1, 0, 2, 7, 2, 0, 0], device=device)
    emb = torch.randn(ids.numel(), H, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    return ids, slots, emb


def lm_inputs(device="cpu", dtype=torch.float32):
    hidden = torch.randn(5, H, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    logits = torch.randn(5, V, generator=torch.Generator().manual_seed(3)).to(device)
    return hidden, torch.tensor([0, -1, 2, 1, 0], device=device), logits
