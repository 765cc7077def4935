"""EmbedOverlay, publication and TokenOverlaySet on CPU; a second context is a second (spawned) process."""
import multiprocessing as mp
import pickle
import re
import types
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from memra_pp.engine import Engine, EngineCounters
from memra_pp.errors import ConfigError, OverlayError, ResidencyError
from memra_pp.overlay import (EmbedOverlay, OverlayPublish, PublishedRows, TokenOverlay, TokenOverlaySet,
                              must_publish, overlay_publications, publish_out, resolve_overlay_publish)

H = 4


def _rows(n=6, dtype=torch.float32):
    return torch.arange(n * H, dtype=dtype).reshape(n, H) + 100


# -- child-process helpers (spawned: another process is another context) -----------------------------------------
def _child_overlay_pickle() -> bytes:
    return pickle.dumps(EmbedOverlay(Engine("cpu"), _rows(), [(2, 0, 3)]))


def _child_require(blob: bytes) -> str:
    ov = pickle.loads(blob)
    try:
        ov.require_resident(Engine("cpu"))
    except ResidencyError as e:
        return f"ResidencyError: {e}"
    return "accepted"


def _child_publish(bits: bytes) -> PublishedRows:
    rows = torch.frombuffer(bytearray(bits), dtype=torch.int16).view(torch.bfloat16).reshape(-1, H)
    return publish_out(Engine("cpu"), rows, [(0, 0, rows.shape[0])])


@pytest.fixture(scope="module")
def child():
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as ex:
        yield ex


@pytest.fixture(scope="module")
def foreign_ctx(child):
    return pickle.loads(child.submit(_child_overlay_pickle).result(timeout=120)).ctx


def _stub_engine(ctx):
    """An engine as a caller might wrongly believe it to be: claiming a context the rows do not live in."""
    return types.SimpleNamespace(ctx=ctx, is_cuda=False, device=torch.device("cpu"), counters=EngineCounters())


# -- modes ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("value,mode", [("auto", OverlayPublish.AUTO), ("FORCE", OverlayPublish.FORCE),
                                        (" Never ", OverlayPublish.NEVER), (OverlayPublish.AUTO, OverlayPublish.AUTO)])
def test_overlay_publish_resolves(value, mode):
    """Modes must resolve from the enum or case-insensitive strings."""
    assert resolve_overlay_publish(value) is mode


@pytest.mark.parametrize("bad", ["always", "", 1, None])
def test_overlay_publish_typo_is_refused(bad):
    """An unknown mode must be refused with ConfigError naming the key, the value and the choices."""
    with pytest.raises(ConfigError) as ei:
        resolve_overlay_publish(bad)
    assert str(ei.value) == f"overlay_publish: {bad!r} is not one of ['auto', 'force', 'never']"


# -- construction and spans -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("spans,msg", [
    ([(0, 0, 2), (1, 2, 2)], r"span 1 \(1, 2, 2\) overlaps span 0 \(0, 0, 2\) in prompt positions"),
    ([(0, 0, 3), (5, 2, 2)], r"span 1 \(5, 2, 2\) overlaps span 0 \(0, 0, 3\) in rows"),
    ([(0, 4, 3)], r"span 0 \(0, 4, 3\) is outside rows \[0, 6\)"),
    ([(0, 0, 0)], r"span 0 \(0, 0, 0\) is outside rows \[0, 6\) or empty"),
    ([(-1, 0, 1)], r"span 0 \(-1, 0, 1\) is outside"),
    ([(0, 0)], r"span 0 \(0, 0\) must be three ints"),
    ([(0.0, 0, 1)], r"must be three ints"),
    ([5], r"span 0 5 must be three ints"),
    (None, r"overlay spans must be a list of \(prompt_pos, row_off, n_rows\), got None"),
])
def test_bad_spans_are_refused(spans, msg):
    """Overlapping, out-of-range or malformed spans must be refused naming the span."""
    with pytest.raises(OverlayError, match=msg):
        EmbedOverlay(Engine("cpu"), _rows(), spans)


def test_rows_must_be_2d_and_non_empty():
    """Rows must be a non-empty (N, H) tensor."""
    with pytest.raises(OverlayError, match=r"non-empty \(N, H\) tensor, got shape \(6,\)"):
        EmbedOverlay(Engine("cpu"), torch.zeros(6), [(0, 0, 1)])
    with pytest.raises(OverlayError, match=r"got shape \(0, 4\)"):
        EmbedOverlay(Engine("cpu"), torch.zeros(0, H), [])


@pytest.mark.parametrize("bad", [None, "cpu", torch.device("cpu")])
def test_an_engine_argument_that_is_not_an_engine_is_refused_typed(bad):
    """Each public call taking an engine refuses anything else with an OverlayError naming the argument (None and
    a device string reached `.ctx` as a bare AttributeError)."""
    e = Engine("cpu")
    ov = EmbedOverlay(e, _rows(), [(0, 0, 2)])
    calls = {"EmbedOverlay's engine": lambda: EmbedOverlay(bad, _rows(), [(0, 0, 2)]),
             "resident_in's engine": lambda: ov.resident_in(bad),
             "require_resident's engine": lambda: ov.require_resident(bad),
             "require_resident's engine ": lambda: ov.splice_into(bad, torch.zeros(4, H), 0),
             "new_published's tower": lambda: EmbedOverlay.new_published(bad, e, "auto", _rows(), [(0, 0, 2)]),
             "new_published's intake": lambda: EmbedOverlay.new_published(e, bad, "auto", _rows(), [(0, 0, 2)]),
             "from_slots' engine": lambda: TokenOverlaySet.from_slots(bad, {}, 2, False)}
    for what, call in calls.items():
        with pytest.raises(OverlayError, match=re.escape(what.strip()) + r" must be a memra_pp.engine.Engine"):
            call()
    assert ov.resident_in(e) and ov.splice_into(e, torch.zeros(4, H), 0) == 2      # the overlay still works


def test_rows_must_be_a_floating_point_tensor():
    """Rows that are not a tensor, or not floating point (they replace embeddings), must be refused naming what
    they are, at construction and at the publication source."""
    with pytest.raises(OverlayError, match=r"overlay rows must be a torch.Tensor \(N, H\), got a list"):
        EmbedOverlay(Engine("cpu"), [[1.0] * H], [(0, 0, 1)])
    with pytest.raises(OverlayError, match="overlay rows must be floating point .* got torch.int64"):
        EmbedOverlay(Engine("cpu"), torch.ones(6, H, dtype=torch.long), [(0, 0, 1)])
    with pytest.raises(OverlayError, match="got torch.int32"):
        publish_out(Engine("cpu"), torch.ones(6, H, dtype=torch.int32), [(0, 0, 1)])
    # rows that are no dense tensor of values (their window, splice or publication raised torch's own errors)
    for rows, what in ((torch.randn(6, H).to_sparse(), "layout torch.sparse_coo on device cpu"),
                       (torch.empty(6, H, device="meta"), "layout torch.strided on device meta"),
                       (torch.nested.nested_tensor([torch.zeros(2, H), torch.zeros(3, H)], layout=torch.jagged),
                        "a nested tensor")):
        with pytest.raises(OverlayError, match=f"overlay rows must be a dense tensor holding values, got {what}"):
            EmbedOverlay(Engine("cpu"), rows, [(0, 0, 1)])
        with pytest.raises(OverlayError, match=f"overlay rows must be a dense tensor holding values, got {what}"):
            publish_out(Engine("cpu"), rows, [(0, 0, 1)])


def test_construction_refuses_rows_not_in_the_engines_context(foreign_ctx):
    """Rows whose real context differs from the engine the caller passed must be refused, naming both and the fix."""
    with pytest.raises(ResidencyError) as ei:
        EmbedOverlay(_stub_engine(foreign_ctx), _rows(), [(0, 0, 2)])
    here = Engine("cpu").ctx
    assert str(ei.value) == (f"overlay rows live in {here} but engine cpu is {foreign_ctx}; they cannot be wrapped "
                             f"there: publish them into the consuming engine with "
                             f"EmbedOverlay.new_published(tower, intake, mode, rows, spans)")


def test_overlay_pickled_to_another_process_is_refused_there(child):
    """An overlay that travelled to another process must be refused there, naming both contexts and the fix."""
    e = Engine("cpu")
    ov = EmbedOverlay(e, _rows(), [(2, 0, 3)])
    verdict = child.submit(_child_require, pickle.dumps(ov)).result(timeout=120)
    assert verdict.startswith(f"ResidencyError: overlay rows live in {e.ctx} but engine cpu is cpu ctx#")
    assert verdict.endswith("they must not be read there: publish them into the consuming engine with "
                            "EmbedOverlay.new_published(tower, intake, mode, rows, spans)")
    assert ov.resident_in(e)


def test_foreign_overlay_refuses_require_and_splice(foreign_ctx, child):
    """An overlay from another process must be refused by require_resident and splice_into before any write."""
    ov = pickle.loads(child.submit(_child_overlay_pickle).result(timeout=120))
    e = Engine("cpu")
    assert not ov.resident_in(e)
    with pytest.raises(ResidencyError, match=re.escape(f"overlay rows live in {ov.ctx}")):
        ov.require_resident(e)
    emb = torch.zeros(8, H)
    with pytest.raises(ResidencyError, match="must not be read there"):
        ov.splice_into(e, emb, 0)
    assert emb.abs().sum() == 0 and e.counters.splices == 0


# -- windows and splicing -------------------------------------------------------------------------------------------
def test_window_clips_rebases_and_aliases():
    """A window must clip and rebase spans and share the rows' storage (same data pointer, no copy)."""
    rows = _rows()
    ov = EmbedOverlay(Engine("cpu"), rows, [(2, 0, 3), (8, 3, 3)])
    w = ov.window(3, 6)  # prompt [3, 9)
    assert w.spans == ((0, 1, 2), (5, 3, 1))
    assert w.rows.data_ptr() == rows.data_ptr()
    assert w.rows.untyped_storage().data_ptr() == rows.untyped_storage().data_ptr()
    assert w.ctx == ov.ctx
    assert ov.window(5, 3) is None and ov.window(11, 4) is None and ov.window(0, 2) is None
    assert ov.window(10, 1).spans == ((0, 5, 1),)
    import numpy as np          # numpy bounds give plain-int spans, as the constructor's are
    assert all(type(v) is int for s in ov.window(np.int64(3), np.int32(6)).spans for v in s)
    with pytest.raises(OverlayError, match=r"window\(off=0, length=0\)"):
        ov.window(0, 0)


def test_splice_chunks_cutting_through_spans_match_one_splice():
    """Chunked splicing must write exactly the rows a whole-prompt splice writes, counting chunks that wrote and,
    apart, chunks that began strictly inside a span (a chunk beginning where a span begins cuts nothing)."""
    e = Engine("cpu")
    rows = _rows()
    ov = EmbedOverlay(e, rows, [(2, 0, 3), (8, 3, 3)])
    whole = torch.zeros(12, H)
    assert ov.splice_into(e, whole, 0) == 6
    assert (e.counters.splices, e.counters.mid_span_splices) == (1, 0)
    expect = torch.zeros(12, H)
    expect[2:5], expect[8:11] = rows[0:3], rows[3:6]
    assert torch.equal(whole, expect)
    e2, chunked = Engine("cpu"), []
    e2.counters = EngineCounters()
    for off in range(0, 12, 4):  # [0,4) [4,8) [8,12): the first span is cut at 4
        chunk = torch.zeros(min(4, 12 - off), H)
        ov.splice_into(e2, chunk, off)
        chunked.append(chunk)
    assert torch.equal(torch.cat(chunked), expect)
    assert (e2.counters.splices, e2.counters.mid_span_splices) == (3, 1)  # [4,8) began inside [2,5); [8,12) did not
    empty = torch.zeros(2, H)
    assert ov.splice_into(e2, empty, 5) == 0 and e2.counters.splices == 3  # nothing written, nothing counted
    assert e2.counters.mid_span_splices == 1
    assert ov.splice_into(e2, torch.zeros(1, H), 10) == 1 and e2.counters.mid_span_splices == 2  # inside [8,11)


def test_splice_refuses_wrong_width():
    """A splice target whose width differs from the rows must be refused."""
    e = Engine("cpu")
    with pytest.raises(OverlayError, match=r"splice target \(4, 5\) is not \(T, 4\)"):
        EmbedOverlay(e, _rows(), [(0, 0, 1)]).splice_into(e, torch.zeros(4, 5), 0)


# -- publication ----------------------------------------------------------------------------------------------------
def test_auto_within_one_context_does_not_publish():
    """AUTO with tower and intake in one context must alias the rows and not move the counter."""
    e, rows, before = Engine("cpu"), _rows(), overlay_publications()
    ov = EmbedOverlay.new_published(e, Engine("cpu"), "auto", rows, [(0, 0, 2)])
    assert ov.rows.data_ptr() == rows.data_ptr() and overlay_publications() == before


def test_force_publishes_bit_exact_in_one_context():
    """FORCE must host-bounce (a new buffer, bit-exact, NaN payloads kept) and move both counters."""
    tower, intake = Engine("cpu"), Engine("cpu")
    bits = torch.randint(-2**15, 2**15, (5, H), dtype=torch.int16, generator=torch.Generator().manual_seed(0))
    bits[0, 0] = 0x7FC1  # a NaN with a payload
    rows = bits.view(torch.bfloat16)
    before = overlay_publications()
    ov = EmbedOverlay.new_published(tower, intake, OverlayPublish.FORCE, rows, [(1, 0, 5)])
    assert overlay_publications() == before + 1 and intake.counters.publications == 1
    assert ov.rows.data_ptr() != rows.data_ptr() and ov.rows.dtype == torch.bfloat16
    assert torch.equal(ov.rows.view(torch.int16), bits) and ov.ctx == intake.ctx and ov.spans == ((1, 0, 5),)


def test_auto_across_contexts_publishes(child):
    """AUTO across processes must publish: dtoh in the tower's process, htod here, bit-exact, counted here."""
    bits = torch.randint(-2**15, 2**15, (3, H), dtype=torch.int16, generator=torch.Generator().manual_seed(1))
    pub = child.submit(_child_publish, bits.numpy().tobytes()).result(timeout=120)
    intake = Engine("cpu")
    assert must_publish(OverlayPublish.AUTO, pub.source, intake.ctx)
    before = overlay_publications()
    ov = pub.land(intake)
    assert overlay_publications() == before + 1 and intake.counters.publications == 1
    assert torch.equal(ov.rows.view(torch.int16), bits) and ov.resident_in(intake)


def test_never_across_contexts_is_refused(foreign_ctx):
    """NEVER with differing contexts must refuse, naming both contexts and the fix, and publish nothing."""
    before = overlay_publications()
    with pytest.raises(ResidencyError) as ei:
        EmbedOverlay.new_published(_stub_engine(foreign_ctx), Engine("cpu"), "never", _rows(), [(0, 0, 1)])
    assert str(ei.value) == (f"overlay_publish: never, but the vision tower runs in {foreign_ctx} and the intake in "
                             f"{Engine('cpu').ctx}; set overlay_publish to auto (or force), or place vision.engine "
                             f"on the intake stage")
    assert overlay_publications() == before
    assert not must_publish(OverlayPublish.NEVER, foreign_ctx, foreign_ctx)


def test_publish_source_refuses_rows_not_in_the_tower(foreign_ctx):
    """The source half must refuse rows that do not live in the tower engine, with its own message."""
    with pytest.raises(ResidencyError) as ei:
        EmbedOverlay.new_published(_stub_engine(foreign_ctx), Engine("cpu"), "force", _rows(), [(0, 0, 1)])
    assert str(ei.value) == (f"rows to publish live in {Engine('cpu').ctx} but engine cpu is {foreign_ctx}; the "
                             f"vision tower must produce its rows on its own engine (vision.engine) before they can "
                             f"be published")


def test_published_rows_pickle():
    """PublishedRows must travel by pickle unchanged."""
    pub = publish_out(Engine("cpu"), _rows(), [(0, 1, 2)])
    assert pickle.loads(pickle.dumps(pub)) == pub and pub.shape == (6, H) and pub.dtype == "float32"


# -- token overlays -------------------------------------------------------------------------------------------------
def _tok(ids, V=10, lm=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor(ids)
    lm_ids = None if lm is None else torch.tensor(lm)
    return TokenOverlay(V, ids, torch.randn(len(ids), H, generator=g), lm_ids,
                        None if lm is None else torch.randn(len(lm), H, generator=g))


def test_token_overlay_tables_and_reference_apply():
    """Tables must map (slot, id) to rows; the reference apply must equal a per-token loop."""
    s0, s2 = _tok([1, 7], lm=[3], seed=1), _tok([7], lm=[7, 9], seed=2)
    ts = TokenOverlaySet.from_slots(Engine("cpu"), {0: s0, 2: s2}, max_loras=3, tied=False)
    assert ts.any_active() and ts.embed_counts_S.tolist() == [2, 0, 1] and ts.lm_counts_S.tolist() == [1, 0, 2]
    assert ts.embed_map_SV[0, 7] == 1 and ts.embed_map_SV[2, 7] == 2 and ts.embed_map_SV[1].eq(-1).all()
    ids, slots = torch.tensor([1, 7, 7, 7, 5]), torch.tensor([0, 0, 2, -1, 2])
    emb = torch.zeros(5, H)
    ts.apply_embedding(ids, slots, emb)
    assert torch.equal(emb[0], s0.embed_rows[0]) and torch.equal(emb[1], s0.embed_rows[1])
    assert torch.equal(emb[2], s2.embed_rows[0]) and emb[3:].abs().sum() == 0
    hidden, logits = torch.randn(3, H), torch.zeros(3, 10)
    ts.apply_lm_head(hidden, torch.tensor([2, -1, 0]), logits)
    expect = torch.zeros(3, 10)
    expect[0, 7], expect[0, 9] = hidden[0] @ s2.lm_head_rows[0], hidden[0] @ s2.lm_head_rows[1]
    expect[2, 3] = hidden[2] @ s0.lm_head_rows[0]
    assert torch.allclose(logits, expect)


def test_tied_lm_head_uses_the_embedding_rows():
    """On a tied model the lm tables must be the embed tables."""
    ts = TokenOverlaySet.from_slots(Engine("cpu"), [_tok([4])], max_loras=2, tied=True)
    assert ts.lm_rows_RH is ts.embed_rows_RH and ts.lm_ids_R.tolist() == [4]
    assert not TokenOverlaySet.from_slots(Engine("cpu"), [None, None], max_loras=2, tied=True).any_active()


@pytest.mark.parametrize("overlays,tied,msg", [
    ({0: _tok([10])}, True, r"token overlay slot 0 overrides ids \[10\] outside \[0, vocab=10\)"),
    ({0: _tok([1]), 1: _tok([1], V=12)}, False, "token overlay slot 1 has vocab_size 12, other slots 10"),
    ({3: _tok([1])}, False, r"token overlay slot 3 is outside \[0, max_loras=2\)"),
    ({0: _tok([1], lm=[2])}, True, "token overlay slot 0 carries lm_head rows on a tied model"),
    ({0: _tok([1, 1])}, False, "token overlay slot 0 overrides some id more than once"),
    ({0: TokenOverlay(10, torch.tensor([1]), torch.zeros(2, H))}, False, r"ids \(K,\) and rows \(K, H\)"),
    ({0: _tok([1]), 1: TokenOverlay(10, torch.tensor([1]), torch.zeros(1, H + 1))}, False,
     "token overlay slot 1 has hidden size 5, other slots 4"),
    ({0: TokenOverlay(10, torch.tensor([1.7]), torch.zeros(1, H))}, False,
     "token overlay slot 0: embed ids must be an integer tensor, got torch.float32"),
    ({0: TokenOverlay(10, torch.tensor([True]), torch.zeros(1, H))}, False,
     "token overlay slot 0: embed ids must be an integer tensor, got torch.bool"),
    ({0: TokenOverlay(10, torch.tensor([1]), torch.ones(1, H, dtype=torch.long))}, False,
     "token overlay slot 0: embed rows must be floating point, got torch.int64"),
    ({1: TokenOverlay(10, torch.tensor([1]), torch.zeros(1, H), torch.tensor([2]), torch.full((1, H), float("nan")))},
     False, "token overlay slot 1: lm_head rows hold NaN or inf"),
    ({0: TokenOverlay(10, torch.tensor([1]), [[0.0] * H])}, False,
     "token overlay slot 0: embed rows must be a torch.Tensor, got a list"),
    ({0: TokenOverlay(-1, torch.zeros(0, dtype=torch.long), torch.zeros(0, H))}, False,
     "token overlay slot 0 has vocab_size -1: the model's vocabulary size, an integer >= 1"),
    ({"a": _tok([1])}, False, r"token overlay slot 'a' must be an int in \[0, max_loras=2\)"),
    ({0: _tok([1]), 1: "x"}, False, "token overlay slot 1 is a str, not a TokenOverlay"),
    ({0: TokenOverlay(10, torch.tensor([1]), torch.zeros(1, H, device="meta"))}, False,
     "token overlay slot 0: embed rows must be a dense tensor holding values, got layout torch.strided on device "
     "meta"),
    ({0: TokenOverlay(10, torch.tensor([1], device="meta"), torch.zeros(1, H))}, False,
     "token overlay slot 0: embed ids must be a dense tensor holding values, got layout torch.strided on device "
     "meta"),
    ({0: TokenOverlay(10, torch.tensor([1]), torch.zeros(1, H).to_sparse())}, False,
     "token overlay slot 0: embed rows must be a dense tensor holding values, got layout torch.sparse_coo"),
    ({0: _tok([1])}, "no", r"tied must be True or False \(the model ties its lm_head to the embedding\), got 'no'"),
])
def test_token_overlay_refusals(overlays, tied, msg):
    """Bad token overlays must be refused naming the slot."""
    with pytest.raises(OverlayError, match=msg):
        TokenOverlaySet.from_slots(Engine("cpu"), overlays, max_loras=2, tied=tied)


def test_publication_is_a_snapshot_and_lands_owned_rows():
    """Published CPU rows are a copy (the tower writing its rows afterwards changes nothing in transit); landed
    rows belong to the intake (writable, not the transit buffer); the bytes travel as one uint8 array (Ray moves
    it out of band) and land bit-exact, also from a read-only buffer (as the object store hands it out)."""
    import numpy as np
    rows = _rows()
    before = rows.clone()
    pub = publish_out(Engine("cpu"), rows, [(0, 0, 2)])
    rows.add_(1.0)
    assert isinstance(pub.data, np.ndarray) and pub.data.dtype == np.uint8
    ro = PublishedRows(np.frombuffer(pub.data.tobytes(), dtype=np.uint8), pub.dtype, pub.shape, pub.spans,
                       pub.source)
    assert not ro.data.flags.writeable
    for p in (pub, ro):
        ov = p.land(Engine("cpu"))
        assert torch.equal(ov.rows, before)
        ov.rows.add_(0.0)                       # writable: the intake's own tensor
        assert ov.rows.untyped_storage().data_ptr() != p.data.ctypes.data


def test_token_overlay_max_loras_must_be_positive():
    """A max_loras below 1 must be refused as the config value it is (adapters.max_loras), naming it."""
    for bad in (-1, 0, True):
        with pytest.raises(ConfigError, match=re.escape(f"max_loras (adapters.max_loras) must be an integer >= 1, "
                                                        f"got {bad!r}")):
            TokenOverlaySet.from_slots(Engine("cpu"), {}, max_loras=bad, tied=True)


def test_untied_overlay_with_lm_head_rows_only():
    """An untied slot that overrides lm_head rows only (no embedding rows) must build: no embed rows, its lm rows."""
    lm_rows = torch.randn(1, H)
    ts = TokenOverlaySet.from_slots(Engine("cpu"), {1: TokenOverlay(10, None, None, torch.tensor([3]), lm_rows)},
                                    max_loras=2, tied=False)
    assert ts.embed_counts_S.tolist() == [0, 0] and ts.embed_rows_RH.shape == (0, H)
    assert ts.lm_counts_S.tolist() == [0, 1] and ts.lm_ids_R.tolist() == [3] and torch.equal(ts.lm_rows_RH, lm_rows)


def test_token_overlay_mixed_dtypes_keep_every_slot_exact():
    """Slots whose rows differ in dtype must be stored in the widest (torch.promote_types), whatever the slot order:
    no slot's rows are cast down to another slot's dtype."""
    f32 = torch.randn(1, H, dtype=torch.float32) / 3
    bf16 = torch.randn(1, H).to(torch.bfloat16)
    for order in ((f32, bf16), (bf16, f32)):
        ts = TokenOverlaySet.from_slots(Engine("cpu"), [TokenOverlay(10, torch.tensor([1]), r) for r in order],
                                        max_loras=2, tied=True)
        assert ts.embed_rows_RH.dtype == torch.float32
        assert torch.equal(ts.embed_rows_RH[0], order[0][0].float()) and torch.equal(ts.embed_rows_RH[1],
                                                                                     order[1][0].float())
