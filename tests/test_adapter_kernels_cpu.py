"""Torch references of the adapter kernels (CPU): they must agree with TokenOverlaySet's own references and
respect every bounds guard; the device dispatch must take them on CPU."""
import torch

from adapter_kernel_cases import embed_inputs, lm_inputs, overlay_set
from memra_pp.kernels import adapter_ops as ops


def test_embed_reference_matches_overlay_set_and_guards():
    """Rows must be replaced exactly where (slot, id) has a row; bad slots, ids and empty slots must be left alone."""
    tos = overlay_set()
    ids, slots, emb = embed_inputs()
    want = emb.clone()
    ok = (slots >= 0) & (slots < 3) & (ids >= 0) & (ids < 50)
    tos.apply_embedding(ids[ok], slots[ok], sub := want[ok].clone())
    want[ok] = sub
    got = ops.embed_override_ref(emb.clone(), ids, slots, tos.embed_map_SV, tos.embed_rows_RH, tos.embed_counts_S)
    assert torch.equal(got, want)
    changed = (got != emb).any(1).nonzero().squeeze(1).tolist()
    assert changed == [0, 1, 2, 3, 11]   # (0,1) (0,4) (2,4) (2,7) (0,4); (0,7) and (1,*) have no row


def test_embed_reference_row_guard_per_slot():
    """A map entry pointing at another slot's row (a corrupt table) must not be followed."""
    tos = overlay_set()
    ids, slots, emb = embed_inputs()
    bad = tos.embed_map_SV.clone()
    bad[2, 1] = 0          # slot 2 has rows [3, 5): row 0 belongs to slot 0
    got = ops.embed_override_ref(emb.clone(), ids, slots, bad, tos.embed_rows_RH, tos.embed_counts_S)
    assert torch.equal(got[9], emb[9])


def test_lm_head_reference_matches_overlay_set():
    """Untied: slot 0 rows must get hidden . lm_row at ids 2, 9, 49; other rows and ids must be untouched."""
    tos = overlay_set()
    hidden, slots, logits = lm_inputs()
    want = tos.apply_lm_head(hidden, slots, logits.clone())
    got = ops.lm_head_override_ref(logits.clone(), hidden, slots, tos.lm_ids_R, tos.lm_slot_R, tos.lm_rows_RH)
    assert torch.allclose(got, want, atol=1e-5, rtol=0)
    assert sorted(map(tuple, (got != logits).nonzero().tolist())) == [(0, 2), (0, 9), (0, 49), (4, 2), (4, 9), (4, 49)]


def test_lm_head_reference_id_guard_and_tied():
    """An lm id outside the logits width must be skipped; tied sets must use the embedding rows."""
    tos = overlay_set(tied=True)
    hidden, slots, logits = lm_inputs()
    got = ops.apply_token_lm_head(tos, hidden, slots, logits.clone())
    assert torch.allclose(got, tos.apply_lm_head(hidden, slots, logits.clone()), atol=1e-5, rtol=0)
    untied = overlay_set()
    narrow = logits[:, :8].clone()   # ids 9 and 49 fall outside: skipped, id 2 still recomputed
    ops.lm_head_override_ref(narrow, hidden, slots, untied.lm_ids_R, untied.lm_slot_R, untied.lm_rows_RH)
    assert sorted(map(tuple, (narrow != logits[:, :8]).nonzero().tolist())) == [(0, 2), (4, 2)]


def test_dispatch_on_cpu_uses_references():
    """apply_token_embedding on CPU tensors must equal the reference, in place."""
    tos = overlay_set()
    ids, slots, emb = embed_inputs()
    want = ops.embed_override_ref(emb.clone(), ids, slots, tos.embed_map_SV, tos.embed_rows_RH, tos.embed_counts_S)
    out = ops.apply_token_embedding(tos, ids, slots, emb)
    assert out is emb and torch.equal(out, want)
