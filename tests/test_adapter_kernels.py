"""Triton adapter kernels (GPU): the embedding override and lm_head recompute must match their torch references,
guards included. Selected by the gpu marker; fails without a GPU."""
import pytest
import torch

from adapter_kernel_cases import embed_inputs, lm_inputs, overlay_set
from memra_pp.kernels import adapter_ops as ops

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def cuda():
    assert torch.cuda.is_available(), "this test needs a CUDA GPU (it is selected with -m gpu)"
    assert ops.triton is not None, "Triton must be importable on a GPU machine"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_embed_override_kernel_matches_reference(dtype):
    """The Triton embedding override must equal the reference bit for bit (a copy), guards included."""
    tos = overlay_set("cuda", dtype)
    ids, slots, emb = embed_inputs("cuda", dtype)
    args = (ids, slots, tos.embed_map_SV, tos.embed_rows_RH, tos.embed_counts_S)
    want = ops.embed_override_ref(emb.clone(), *args)
    got = ops.embed_override_triton(emb.clone(), *args)
    assert torch.equal(got, want) and not torch.equal(got, emb)
    bad = tos.embed_map_SV.clone()
    bad[2, 1] = 0
    guarded = ops.embed_override_triton(emb.clone(), ids, slots, bad, tos.embed_rows_RH, tos.embed_counts_S)
    assert torch.equal(guarded[9], emb[9])


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lm_head_kernel_matches_reference(dtype, tied):
    """The Triton lm_head recompute must match the reference (f32 accumulate) and skip ids beyond the width."""
    tos = overlay_set("cuda", dtype, tied)
    hidden, slots, logits = lm_inputs("cuda", dtype)
    args = (hidden, slots, tos.lm_ids_R, tos.lm_slot_R, tos.lm_rows_RH)
    want = ops.lm_head_override_ref(logits.clone(), *args)
    got = ops.lm_head_override_triton(logits.clone(), *args)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-5) and not torch.equal(got, logits)
    narrow = logits[:, :8]           # ids >= 8 fall outside the width: the kernel must skip them like the reference
    assert torch.allclose(ops.lm_head_override_triton(narrow.clone(), *args),
                          ops.lm_head_override_ref(narrow.clone(), *args), atol=1e-4, rtol=1e-5)


def test_dispatch_on_cuda_takes_triton(monkeypatch):
    """apply_token_embedding / apply_token_lm_head on CUDA tensors must equal the references, through the Triton
    kernels: the references raise while the dispatch runs (a fallback to them would pass the comparison alone)."""
    tos = overlay_set("cuda")
    ids, slots, emb = embed_inputs("cuda")
    want = ops.embed_override_ref(emb.clone(), ids, slots, tos.embed_map_SV, tos.embed_rows_RH, tos.embed_counts_S)
    hidden, hs, logits = lm_inputs("cuda")
    want_lm = ops.lm_head_override_ref(logits.clone(), hidden, hs, tos.lm_ids_R, tos.lm_slot_R, tos.lm_rows_RH)

    def fell_back(*a, **k):
        raise AssertionError("the CUDA dispatch ran the torch reference, not the Triton kernel")
    monkeypatch.setattr(ops, "embed_override_ref", fell_back)
    monkeypatch.setattr(ops, "lm_head_override_ref", fell_back)
    assert torch.equal(ops.apply_token_embedding(tos, ids, slots, emb), want)
    assert torch.allclose(ops.apply_token_lm_head(tos, hidden, hs, logits), want_lm, atol=1e-4, rtol=1e-5)
