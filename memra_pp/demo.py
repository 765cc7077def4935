"""`memra-pp demo`: the embedded default end to end: tiny checkpoint, two CPU stages on real Ray, concurrent
prompts, tokens/s and per-stage busy %, and a check that the tokens equal a one-stage run of the same weights.
"""
from __future__ import annotations

import asyncio
import json
import time

PROMPTS = ["The quick brown fox", "Pipeline parallelism cuts a model into stages", "Once upon a time",
           "Gated DeltaNet keeps a recurrent state", "Hello, world", "The river ran past the old mill",
           "Numbers: one two three", "A stage is a Ray actor"]


MAX_PROMPTS = 256


def _say(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, flush=True)


def run_demo(json_out: bool = False, prompts: int = 6, max_new_tokens: int = 24, out=None) -> int:
    """out: where the --json object goes (None: sys.stdout)."""
    import memra_pp
    from .defaults import TINY_CPU, ensure_tiny
    from .model.local import LocalPipeline
    from .model.weights import SafetensorsSource
    from .errors import InputError
    if prompts < 1 or max_new_tokens < 1:       # refused before anything is launched
        raise InputError(f"the demo needs --prompts and --max-new-tokens >= 1, got {prompts} and {max_new_tokens}")
    if prompts > MAX_PROMPTS:
        raise InputError(f"the demo runs at most {MAX_PROMPTS} prompts at once, got --prompts {prompts}; "
                         f"`memra-pp bench` measures larger loads")
    q = json_out
    t0 = time.time()
    try:
        path = ensure_tiny()
    except OSError as e:            # (an unwritable or missing HOME: a traceback before)
        from .defaults import TINY_PATH, unwritable
        raise unwritable(TINY_PATH, "the demo's tiny checkpoint", e) from None
    _say(f"[1/4] tiny checkpoint ready at {path} ({time.time() - t0:.1f} s)", q)
    from .model.tokenizer import Tokenizer
    from .placement.schema import load_placement
    ctx = load_placement(TINY_CPU).scheduler.max_context
    tok = Tokenizer.from_model_dir(path)        # (the deployment's: dep.tokenizer, not made yet)
    longest = max(len(tok.encode(PROMPTS[i % len(PROMPTS)])) for i in range(prompts))
    if longest + max_new_tokens - 1 > ctx:      # refused before the launch, as the deployment would refuse each
        raise InputError(f"--max-new-tokens {max_new_tokens}: the demo's prompts (up to {longest} tokens) would "
                         f"need {longest + max_new_tokens - 1} positions, more than its scheduler.max_context "
                         f"({ctx}); ask for at most {ctx - longest + 1}")
    t0 = time.time()
    dep = memra_pp.launch(TINY_CPU)
    try:
        plan = dep.plan
        _say(f"[2/4] launched {len(plan.stages)} CPU stages in {time.time() - t0:.1f} s: " + ", ".join(
            f"stage {s.index} layers [{s.layer_start},{s.layer_end}) {'/'.join(s.roles)}" for s in plan.stages), q)
        c = dep.client()
        texts = [PROMPTS[i % len(PROMPTS)] for i in range(prompts)]

        async def all_at_once():
            return await asyncio.gather(*[c.agenerate(t, max_new_tokens=max_new_tokens) for t in texts])

        dep.stats(reset=True)
        t0 = time.time()
        results = asyncio.run(all_at_once())
        wall = time.time() - t0
        st = dep.stats()["stages"]
        n_tok = sum(len(r.token_ids) for r in results)
        _say(f"[3/4] {prompts} concurrent requests: {n_tok} tokens in {wall:.2f} s = {n_tok / wall:.1f} tokens/s; "
             + ", ".join(f"stage {s['index']} busy {s['busy']:.0%}, handoff p50 {s['handoff_p50_us']:.0f} us"
                         for s in st), q)
        _say("    (random weights: the text is noise; what counts is that two stages give one stage's tokens, "
             "[4/4])", q)
        for t, r in zip(texts, results):
            _say(f"    {t!r} -> {r.text!r} ({r.finish_reason})", q)
        tok = dep.tokenizer
        ref = LocalPipeline(SafetensorsSource(path), [(0, plan.num_layers)], max_seqs=len(texts))
        ref_toks, _ = ref.greedy([tok.encode(t) for t in texts], max_new_tokens)
        eos = set(dep.eos)
        same = True
        for r, rt in zip(results, ref_toks):
            cut = next((i + 1 for i, x in enumerate(rt) if x in eos), len(rt))
            same &= r.token_ids == rt[:cut]
        _say(f"[4/4] tokens equal a one-stage run: {'yes' if same else 'NO'}", q)
        if json_out:
            print(json.dumps({"tokens": n_tok, "wall_s": wall, "tokens_per_s": n_tok / wall, "stages": st,
                              "equal_to_one_stage": same,
                              "generations": [{"prompt": t, "text": r.text, "token_ids": r.token_ids}
                                              for t, r in zip(texts, results)]}, indent=1, default=str),
                  file=out, flush=True)
        return 0 if same else 1
    finally:
        dep.shutdown()
