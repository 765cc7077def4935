"""The battery's foreign_handle row, in process: the stage-side check run against a forged context of another
process, and the row's verdict, which must demand that both refusals be this refusal (each message naming the
foreign context, the stage's own and the fix), not any ResidencyError raised on the way."""
import types

from memra_pp.battery import foreign_refusals_named
from memra_pp.battery_stage import foreign_context
from memra_pp.engine import ContextId, Engine
from memra_pp.model.tiny import tiny_config


def _stage():
    import torch
    e = Engine("cpu")
    mc = types.SimpleNamespace(text=types.SimpleNamespace(hidden_size=tiny_config()["text_config"]["hidden_size"]))
    return types.SimpleNamespace(engine=e, mc=mc, dtype=torch.float32)


def test_the_foreign_check_refuses_twice_and_its_messages_name_both_contexts():
    r = _stage()
    mine = r.engine.ctx
    theirs = ContextId(mine.node, mine.pid + 1, mine.device, mine.uid)     # the same uid value, another process
    f = foreign_context(r, theirs)
    assert f["differ"] and f["same_uid_value"] and f["untouched"], f
    for k in ("require_resident", "splice"):
        assert f[k] != "NOT REFUSED" and str(theirs) in f[k] and str(mine) in f[k], f[k]
    assert foreign_refusals_named(f)


def test_a_refusal_that_names_another_context_or_no_fix_fails_the_row():
    r = _stage()
    mine = r.engine.ctx
    f = foreign_context(r, ContextId(mine.node, mine.pid + 1, mine.device, mine.uid))
    stranger = str(ContextId(mine.node, mine.pid + 2, mine.device, mine.uid))
    assert not foreign_refusals_named(dict(f, splice=f["splice"].replace(f["theirs"], stranger)))
    assert not foreign_refusals_named(dict(f, require_resident="splice target lives on cpu; "
                                                                "embed in the engine's own memory"))
    assert not foreign_refusals_named(dict(f, splice="NOT REFUSED"))
