"""A prefill step's host work alone, on any machine (no GPU): the merged path's Python and torch dispatch with every
Triton kernel's launch a no-op (Triton's interpreter, its run replaced), the chunked rule a stand-in with fla's
interface and the attention (SDPA, flash's variable-length call) stand-ins, all returning empty tensors, so what is
timed is the engine's own work a step: index building, views, torch calls on tiny tensors (the projections' GEMMs
included, on this CPU), and the launches it asks for (counted). Side by side in one run: the Gated DeltaNet's
segments by groups of equal lengths and as one variable-length call (kernels/prefill.VARLEN), for prompts of equal
and of spread lengths. The numbers are this CPU's and leave out the CUDA launch itself and fla's own host work
(benchmarks/fla_host.py measures that on a GPU); what they show is how our host work scales with a step's shapes.

    python -u benchmarks/prefill_host.py [--prompts 8x64,8x64~0.5] [--layers 16] [--kind dense|moe] [--out F.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ["TRITON_INTERPRET"] = "1"        # before triton is imported: the kernels take the Triton path on CPU

import torch  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))


class StubRule:
    """fla's chunked and recurrent rule (memra_pp/model/fla_rule.FlaRule's methods) returning empty outputs of the
    right shapes: the host work of the call left out, as the kernels' is."""
    name, gva = "stub", True

    def __init__(self):
        self.calls = 0

    def _out(self, q, v, state):
        self.calls += 1
        return torch.empty_like(v), torch.empty_like(state, dtype=torch.float32)

    def chunk(self, q, k, v, g, beta, state):
        return self._out(q, v, state)

    def chunk_varlen(self, q, k, v, g, beta, state, cu, chunks):
        return self._out(q, v, state)

    def recurrent(self, q, k, v, g, beta, state):
        return self._out(q, v, state)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="8x64,8x64~0.5,16x32~0.75", help="comma-separated BxN~S (gpu_engine_step's "
                    "--prefill spelling, no decode rows)")
    ap.add_argument("--kind", choices=("dense", "moe"), default="dense")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", default="", help="JSON path")
    ap.add_argument("--cprofile", default="", help="WAY: cProfile that way's timed steps, the top functions by own "
                    "time printed after each shape")
    a = ap.parse_args()
    from memra_pp import switches
    switches.check_environment()   # strict: a typo in a MEMRA_PP_* switch must not run the default
    import triton.runtime.interpreter as ti
    from gpu_engine_step import prefill_shape, spread_lengths
    from memra_pp.kernels import fused_decode as fd, prefill as pf
    from memra_pp.model.batch import StepBatch
    from memra_pp.model.stage_model import StageModel
    from memra_pp.model.tiny import make_tiny
    from memra_pp.model.weights import SafetensorsSource
    launches = [0]

    def no_launch(self, *args, **kwargs):
        launches[0] += 1
    ti.InterpretedFunction.run = no_launch
    from memra_pp.model import attention, stage_model     # attention: SDPA, and the variable-length call (flash's

    def no_sdpa(q, k, v, **kw):                           # one kernel on a GPU), as no-ops of the right shapes
        return torch.empty(*q.shape[:-1], v.shape[-1])

    def no_varlen(q, k, v, cu32, lens):
        return torch.empty(q.shape[0], q.shape[1] * v.shape[-1])
    attention.sdpa, stage_model.attend_varlen = no_sdpa, no_varlen
    torch.set_num_threads(1)
    fd.USE_TRITON = True
    path = make_tiny(os.path.join(tempfile.gettempdir(), f"memra-prefill-host-{a.kind}-{a.layers}"),
                     moe=a.kind == "moe", num_layers=a.layers)
    src = SafetensorsSource(path)
    model = StageModel(src.config, 0, a.layers, True, True).load(src)
    rule = StubRule()
    for layer in model.layers:
        if not layer.full:
            layer.mixer.rule = rule
    shapes = [prefill_shape(p) for p in a.prompts.split(",")]
    cache = model.new_cache(max(B for B, *_ in shapes), 4096)
    rep = {"kind": a.kind, "layers": a.layers, "cpu": os.cpu_count(), "rows": []}
    print(f"tiny {a.kind}, {a.layers} layers ({sum(not x.full for x in model.layers)} Gated DeltaNet); host work a "
          f"prefill step with every kernel a no-op, {a.steps} steps a way, interleaved", flush=True)
    with torch.no_grad():
        for B, n, _, spread in shapes:
            lens = spread_lengths(B, n, spread)
            ids = torch.randint(4, 100, (sum(lens),))
            times: dict = {"groups": [], "varlen": []}
            counts: dict = {}
            import cProfile
            prof = cProfile.Profile()
            for i in range(a.steps + 2):
                for way in times:
                    pf.VARLEN = way == "varlen"
                    b = StepBatch(list(range(B)), [0] * B, lens, StepBatch.text_positions([0] * B, lens), [True] * B)
                    l0, r0, c0 = launches[0], rule.calls, dict(pf.CALLS)
                    profiled = way == a.cprofile and i >= 2
                    if profiled:
                        prof.enable()
                    t = time.perf_counter()
                    model(b, model.embed_ids(ids), cache)
                    dt = (time.perf_counter() - t) * 1e3
                    if profiled:
                        prof.disable()
                    if i >= 2:          # two warm steps a way
                        times[way].append(dt)
                    counts[way] = {"triton_launches": launches[0] - l0, "rule_calls": rule.calls - r0,
                                   "conv_calls": pf.CALLS["conv_prefill"] + pf.CALLS["conv_varlen"]
                                   - c0["conv_prefill"] - c0["conv_varlen"]}
            med = {w: sorted(v)[len(v) // 2] for w, v in times.items()}
            for way in times:
                rep["rows"].append({"prompts": [B, n], "spread": spread, "lens": lens, "way": way,
                                    "step_ms": times[way], "median_ms": med[way], **counts[way]})
                print(f"  {B} x {n}" + (f"~{spread:g}" if spread else "") + f" ({len(set(lens))} lengths) {way:6s}: "
                      f"median {med[way]:6.2f} ms a step, {counts[way]['triton_launches']} Triton launches, "
                      f"{counts[way]['rule_calls']} rule calls", flush=True)
            print(f"    groups / varlen: {med['groups'] / med['varlen']:.2f}x", flush=True)
            if a.cprofile:
                import io
                import pstats
                out = io.StringIO()
                pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
                print(out.getvalue(), flush=True)
    if a.out:
        json.dump(rep, open(a.out, "w"), indent=1)
        try:
            plot([rep], a.out.removesuffix(".json") + ".png")
        except ImportError as e:        # matplotlib is the test extra's: the JSON has every figure
            print(f"no plot: {e}", flush=True)
    return 0


def plot(reps: list[dict], path: str) -> None:
    """Median host time a step, groups against varlen, a bar pair a prompt shape (one panel a run)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(reps), figsize=(6 * len(reps), 4), squeeze=False)
    for ax, rep in zip(axes[0], reps, strict=True):
        shapes = list(dict.fromkeys((tuple(r["prompts"]), r["spread"]) for r in rep["rows"]))
        for j, way in enumerate(("groups", "varlen")):
            ys = [next(r["median_ms"] for r in rep["rows"] if (tuple(r["prompts"]), r["spread"]) == s_
                       and r["way"] == way) for s_ in shapes]
            ax.bar([i + (j - 0.5) * 0.4 for i in range(len(shapes))], ys, 0.4, label=way)
        ax.set_xticks(range(len(shapes)), [f"{B} x {n}" + (f"\nspread {sp:g}" if sp else "") for (B, n), sp in shapes])
        ax.set_ylabel("host ms a prefill step (kernels as no-ops)")
        ax.set_title(f"tiny {rep['kind']}, {rep['layers']} layers, {rep['cpu']} CPUs", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    raise SystemExit(main())
