"""Plain-text rendering of a Plan for ``memra-pp plan CONFIG`` (driver); ``Plan.to_dict()`` serves ``--json``."""
from __future__ import annotations

from .planner import Plan


def _bytes(n: float) -> str:
    return f"{n / 2 ** 30:.1f} GiB" if n >= 2 ** 30 else f"{n / 2 ** 20:.1f} MiB"


def format_plan(plan: Plan) -> str:
    """A fixed-width table: stage, device, layers, layer count, roles, estimated cost share, estimated memory
    (weights and max_batch sequences' cache at max_context; not LoRA pools, the vision tower, activations, decode
    graphs or boundary slots: planner.default_layer_memory); then the warnings."""
    total = sum(s.cost for s in plan.stages) or 1.0
    head = ("stage", "device", "layers", "n", "roles", "cost %", "memory")
    rows = [head] + [(str(s.index), s.device, f"[{s.layer_start}, {s.layer_end})", str(s.num_layers),
                      ",".join(s.roles) or "-", f"{100.0 * s.cost / total:.1f}", _bytes(s.memory))
                     for s in plan.stages]
    widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
    lines = [f"plan {plan.name}: {len(plan.stages)} stage(s), {plan.num_layers} layers, "
             f"{plan.microbatches} microbatch(es)"
             + (f", split for decode steps of {plan.split_batch} sequence(s) (max_batch / microbatches)"
                if plan.split_batch else "")]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
    lines += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(lines)
