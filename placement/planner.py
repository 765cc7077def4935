"""Pure planner (driver, no I/O): a Placement and a ModelConfig in, per-stage layer ranges, roles and warnings out."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping, Sequence

from memra_pp.errors import ConfigError
from memra_pp.model.config import ModelConfig, TextConfig

from .schema import Placement

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# how much more than the best largest stage cost a split may cost when its fullest stage holds less memory (stages
# on GPUs of their own: on equal cards the fullest stage bounds the KV pages every stage can give; split_layers)
SPLIT_SLACK = 0.01


@dataclasses.dataclass(frozen=True)
class StagePlan:
    index: int
    device: str
    layer_start: int          # the stage applies decoder layers [layer_start, layer_end)
    layer_end: int
    intake: bool              # embeds tokens and splices overlays in (stage 0)
    primary: bool             # owns norm + lm_head + sampler (the last stage)
    tower: bool               # runs the vision tower (vision.engine)
    num_cpus: float
    threads: int
    cost: float = 0.0         # estimated cost (default: bytes a full decode microbatch moves), for the share column
    memory: float = 0.0       # estimated bytes held: weights, max_batch sequences' cache at max_context (not LoRA
                              # pools, the tower, activations, graphs or slots: default_layer_memory)

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def roles(self) -> tuple[str, ...]:
        return tuple(r for r, on in (("intake", self.intake), ("primary", self.primary), ("tower", self.tower)) if on)


@dataclasses.dataclass(frozen=True)
class Plan:
    name: str
    stages: tuple[StagePlan, ...]
    intake_index: int
    primary_index: int
    tower_index: int
    microbatches: int         # resolved: scheduler.microbatches, or auto (planner.auto_microbatches)
    num_layers: int
    warnings: tuple[str, ...] = ()   # settings that are silently ineffective here; the caller logs them
    split_batch: int | None = None   # the byte model's decode batch (decode_batch); None: measured layer costs

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        try:
            return cls(**{**d, "stages": tuple(StagePlan(**s) for s in d["stages"]),
                          "warnings": tuple(d.get("warnings", ()))})
        except (KeyError, TypeError) as e:
            raise ConfigError(f"plan dict: {e}; build it with Plan.to_dict()") from None


def _mixer_params(t: TextConfig, full: bool) -> int:
    H = t.hidden_size
    if full:   # q_proj carries the output gate (2D per head), then k, v, o and the two per-head norms
        D = t.head_dim
        return H * D * (2 * t.num_attention_heads + 2 * t.num_key_value_heads + t.num_attention_heads) + 2 * D
    nv, Dv = t.linear_num_value_heads, t.linear_num_value_heads * t.linear_value_head_dim
    C, K = t.conv_dim, t.linear_conv_kernel_dim
    # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj, conv1d, gated norm, A_log, dt_bias
    return H * (C + Dv + 2 * nv) + H * Dv + C * K + t.linear_value_head_dim + 2 * nv


def experts_read(t: TextConfig, batch: int = 1) -> float:
    """Distinct routed experts a step of `batch` tokens reads, each token taking k of E at random: E (1 - (1 - k/E)^b)
    (k at one token; all E as the batch grows; none in a dense model)."""
    E, k = t.num_experts, t.num_experts_per_tok
    if not t.moe:
        return 0.0
    return float(k) if batch <= 1 else E * (1.0 - (1.0 - k / E) ** batch)


def _ffn_params(t: TextConfig, experts: float) -> float:
    """A layer's FFN weights with `experts` of its routed experts (a MoE layer: those, the router, the shared expert
    and its gate): all E for what it holds, experts_read for what a step reads."""
    H = t.hidden_size
    if not t.moe:
        return 3 * H * t.intermediate_size
    shared = 3 * H * t.shared_expert_intermediate_size + (H if t.shared_expert_intermediate_size else 0)
    return t.num_experts * H + experts * 3 * H * t.moe_intermediate_size + shared


def state_bytes(t: TextConfig) -> float:
    """The per-layer state term: a DeltaNet layer reads and writes its fp32 state (nv x dk x dv) per token."""
    return 2.0 * 4 * t.linear_num_value_heads * t.linear_key_head_dim * t.linear_value_head_dim


def default_layer_costs(model: ModelConfig, dtype_bytes: int = 2, batch: int = 1) -> tuple[float, ...]:
    """Bytes a decode step of `batch` sequences moves in each decoder layer: the memory-bound step costs what it
    moves (issue 7's step floor), so stages of equal cost take equal time per microbatch.

    Per layer: its mixer's weights (gated full attention and Gated DeltaNet differ), the FFN weights the step
    touches (dense: gate, up, down; MoE: the router, the distinct routed experts `batch` tokens of top-k reach
    (``experts_read``) and the shared expert with its gate), the two RMSNorms, all at ``dtype_bytes`` and read once
    per step; plus ``state_bytes`` for each sequence, charged to every layer alike (full-attention layers read a KV
    cache instead, comparable at a few thousand tokens of context). At batch 1 the weights dominate; at a
    saturated microbatch (hundreds of sequences) the per-sequence state does, and every layer costs about the same.
    """
    t = model.text
    ffn, norms, st = _ffn_params(t, experts_read(t, batch)), 2 * t.hidden_size, state_bytes(t)
    return tuple(float((_mixer_params(t, t.is_full(i)) + ffn + norms) * dtype_bytes) + max(1, batch) * st
                 for i in range(t.num_hidden_layers))


def default_head_cost(model: ModelConfig, dtype_bytes: int = 2, batch: int = 1) -> float:
    """lm_head (V x H, read whole once a step, tied or not) plus the final norm, at ``dtype_bytes``; and each
    sequence's logits, float32, written and read by the sampler (8 V bytes): charged to the last stage."""
    t = model.text
    return float((t.vocab_size + 1) * t.hidden_size * dtype_bytes + max(1, batch) * 2 * t.vocab_size * 4)


def seq_cache_bytes(t: TextConfig, layer: int, max_context: int, dtype_bytes: int = 2, kv_block: int = 64) -> int:
    """One sequence's cache in a layer: a Gated DeltaNet's conv state (C x (K - 1), model dtype) and fp32
    recurrent state (nv x dk x dv); a full-attention layer's keys and values for max_context positions in whole
    KV pages of kv_block positions."""
    if t.is_full(layer):
        return 2 * t.num_key_value_heads * t.head_dim * dtype_bytes * -(-max_context // kv_block) * kv_block
    return (t.conv_dim * (t.linear_conv_kernel_dim - 1) * dtype_bytes
            + 4 * t.linear_num_value_heads * t.linear_key_head_dim * t.linear_value_head_dim)


def layer_weight_bytes(t: TextConfig, layer: int, dtype_bytes: int = 2) -> int:
    """The weights a decoder layer holds: its mixer, every FFN weight (all experts), its two RMSNorms."""
    return int(_mixer_params(t, t.is_full(layer)) + _ffn_params(t, t.num_experts) + 2 * t.hidden_size) * dtype_bytes


def default_layer_memory(model: ModelConfig, dtype_bytes: int = 2, max_batch: int = 1, max_context: int = 0,
                         kv_block: int = 64) -> tuple[float, ...]:
    """Bytes each decoder layer holds on its stage: its weights, and the cache as StageCache holds it with every
    sequence at max_context (an upper bound: KV pages are taken as sequences grow): a Gated DeltaNet's states for
    max_batch rows and the scratch row, a full-attention layer's pages for max_batch sequences and the two reserved
    ones. Not counted: LoRA pools (adapters), the vision tower, the block table, activations, decode graphs' pools
    and the boundary slots."""
    t = model.text

    def cache(i: int) -> int:
        if t.is_full(i):
            return (max_batch * seq_cache_bytes(t, i, max_context, dtype_bytes, kv_block)
                    + seq_cache_bytes(t, i, 2 * kv_block, dtype_bytes, kv_block))
        return (max_batch + 1) * seq_cache_bytes(t, i, max_context, dtype_bytes)
    return tuple(float(layer_weight_bytes(t, i, dtype_bytes) + cache(i)) for i in range(t.num_hidden_layers))


def decode_batch(placement: Placement, microbatches: int) -> int:
    """Sequences in one decode microbatch when the deployment is full: max_batch spread over the microbatches."""
    return max(1, -(-placement.scheduler.max_batch // max(1, microbatches)))


def split_layers(costs: Sequence[float], n: int, first_extra: float = 0.0, last_extra: float = 0.0,
                 memory: Sequence[float] | None = None, mem_first: float = 0.0, mem_last: float = 0.0,
                 slack: float = 0.0) -> tuple[int, ...]:
    """Boundaries 0 = b0 < b1 < ... < bn = len(costs) minimising the largest stage cost, exactly (DP, O(n L^2)).

    Stage s costs sum(costs[b_s:b_s+1]), plus ``first_extra`` on stage 0 and ``last_extra`` on stage n-1.
    With ``memory`` (per layer, plus ``mem_first`` / ``mem_last`` on the end stages): among the splits whose every
    stage costs at most (1 + ``slack``) x that optimum, those with the smallest largest stage memory (a second exact
    DP), and among those the cheapest (a third), since the fullest stage of a card bounds what its cache can hold.
    Ties: each stage in turn takes as many layers as the optimum allows (the largest boundaries), so spare capacity
    lands on the later stages, whose primary also samples. Needs 1 <= n <= len(costs) and slack >= 0.
    """
    L = len(costs)
    assert 1 <= n <= L and slack >= 0, (n, L, slack)

    def prefix(xs: Sequence[float]) -> list[float]:
        out = [0.0]
        for x in xs:
            out.append(out[-1] + x)
        return out
    pre = prefix(costs)

    def cost(s: int, a: int, b: int) -> float:
        return pre[b] - pre[a] + (first_extra if s == 0 else 0.0) + (last_extra if s == n - 1 else 0.0)

    def solve(value, ok) -> tuple[list[list[float]], float]:
        """best[s][a]: the smallest max value of stages s..n-1 over layers [a, L), each non-empty and ok."""
        best = [[math.inf] * (L + 1) for _ in range(n + 1)]
        best[n][L] = 0.0
        for s in range(n - 1, -1, -1):
            for a in range(s, L - (n - s) + 1):
                best[s][a] = min((max(value(s, a, b), best[s + 1][b])
                                  for b in range(a + 1, L - (n - s - 1) + 1) if ok(s, a, b)), default=math.inf)
        return best, best[0][0]

    def anything(s: int, a: int, b: int) -> bool:
        return True
    ok = anything
    best, top = solve(cost, ok)
    if memory is not None:
        mpre, cap = prefix(memory), top * (1.0 + slack) + 1e-9 * abs(top)

        def mem(s: int, a: int, b: int) -> float:
            return mpre[b] - mpre[a] + (mem_first if s == 0 else 0.0) + (mem_last if s == n - 1 else 0.0)
        _, least = solve(mem, lambda s, a, b: cost(s, a, b) <= cap)
        mcap = least + 1e-9 * abs(least)

        def ok(s: int, a: int, b: int) -> bool:     # noqa: F811 - within the slack and the least memory
            return cost(s, a, b) <= cap and mem(s, a, b) <= mcap
        best, top = solve(cost, ok)
    bounds, a = [0], 0
    for s in range(n - 1):
        a = max(b for b in range(a + 1, L - (n - s - 1) + 1)
                if ok(s, a, b) and max(cost(s, a, b), best[s + 1][b]) <= top)
        bounds.append(a)
    bounds.append(L)
    return tuple(bounds)


def _ranges(placement: Placement, L: int, costs: Sequence[float], embed: float, head: float,
            memory: Sequence[float], mem_embed: float, mem_head: float) -> list[tuple[int, int]]:
    """Per-stage ranges: explicit stages are fixed; each run of auto stages splits the gap between its neighbours
    (by cost, then by memory among the splits within SPLIT_SLACK of the best cost)."""
    specs, n = placement.stages, len(placement.stages)
    if n > L:
        raise ConfigError(f"stages: {n} stages for a model of {L} layers; every stage needs at least one layer, "
                          f"so use at most {L} stages")
    out: list[tuple[int, int] | None] = [None] * n
    prev_end, prev_i = 0, -1
    for i in [j for j, s in enumerate(specs) if s.layers is not None] + [n]:
        lo, hi = prev_end, (specs[i].layers[0] if i < n else L)
        run = list(range(prev_i + 1, i))
        if i < n:
            a, b = specs[i].layers
            if b > L:
                raise ConfigError(f"stages[{i}].layers: [{a}, {b}) is out of range: the model has {L} layers, "
                                  f"so end must be <= {L}")
            if a < prev_end:
                raise ConfigError(f"stages[{i}].layers: [{a}, {b}) overlaps stages[{prev_i}].layers "
                                  f"(ends at {prev_end}); stages hold disjoint, increasing ranges in stage order")
        if not run and hi > lo:
            who = f"stages[{i}].layers starts at {hi}" if i < n else f"stages[{prev_i}].layers ends at {lo}"
            fix = "the first stage must start at 0" if lo == 0 else (
                f"the last stage must end at num_hidden_layers = {L}" if i == n else "make the ranges contiguous")
            raise ConfigError(f"{who}: layers [{lo}, {hi}) belong to no stage; {fix}")
        if run and hi - lo < len(run):
            raise ConfigError(f"stages[{run[0]}..{run[-1]}].layers: {len(run)} auto stage(s) but only "
                              f"{hi - lo} layer(s) left in [{lo}, {hi}); every stage needs at least one layer")
        if run:
            first, last = run[0] == 0, run[-1] == n - 1
            # memory decides among the cheapest only where each stage has a GPU of its own: stages sharing a card
            # (or the host's memory) draw on one pool, where one stage's bytes bound nothing alone
            own = all(specs[k].is_cuda for k in run) and len({specs[k].device for k in run}) == len(run)
            bounds = split_layers(costs[lo:hi], len(run), embed if first else 0.0, head if last else 0.0,
                                  memory[lo:hi] if own else None, mem_embed if first else 0.0,
                                  mem_head if last else 0.0, SPLIT_SLACK)
            for k, s in enumerate(run):
                out[s] = (lo + bounds[k], lo + bounds[k + 1])
        if i < n:
            out[i] = specs[i].layers
            prev_end, prev_i = specs[i].layers[1], i
    return out  # type: ignore[return-value]


def _tower(placement: Placement, n: int) -> int:
    eng = placement.vision.engine
    if eng == "primary":
        return n - 1
    if eng == "intake":
        return 0
    k = placement.vision.stage
    if k is None or k >= n:
        raise ConfigError(f"vision.engine: {eng!r} names no stage; use primary, intake or stage:N with "
                          f"N in 0..{n - 1}")
    return k


def auto_microbatches(placement: Placement) -> int:
    """`microbatches: auto`. One per stage when every stage is on a GPU: decode there is memory-bound and each
    microbatch reads the stage's weights once, so a third microbatch on two H200s cost more than the ring's bubble
    it hides (27B dims, same run: 64 concurrent 3,217 tokens/s with 2 against 2,353 with 3; docs/PERF.md). On
    CPU stages one more than stages, so the intake builds the next while the ring returns tokens."""
    n = len(placement.stages)
    if n == 1:
        return 1
    return n if all(s.is_cuda for s in placement.stages) else n + 1


def _warnings(placement: Placement, model: ModelConfig, n: int, tower: int, mb: int) -> tuple[str, ...]:
    """mb: the resolved microbatches (auto is never fewer than the stages)."""
    out = []
    if mb < n:
        out.append(f"scheduler.microbatches: {mb} is fewer microbatches than stages ({n}): stages will idle; "
                   f"use auto ({auto_microbatches(placement)}) or at least {n}")
    pc = placement.scheduler.pipeline_chunks
    if pc is not None and pc > 1 and (n == 1 or mb < 2):
        why = "a single-stage placement" if n == 1 else "one microbatch in flight"
        out.append(f"scheduler.pipeline_chunks: {pc} has no effect with {why}: a prompt's pieces could not run on "
                   f"two stages at once, so prompts keep whole chunks")
    mode = placement.overlay_publish
    if model.vision is None:       # (the tower's stage keeps its role: it simply has no tower to run)
        if placement.vision.engine != "primary":
            out.append(f"vision.engine: {placement.vision.engine} has no effect: the model has no vision tower "
                       f"(no vision_config)")
        if mode != "auto":
            out.append(f"overlay_publish: {mode} has no effect: the model has no vision tower, so no image rows are "
                       f"made or published")
    elif mode != "auto" and tower == 0:
        why = "a single-stage placement" if n == 1 else "vision.engine puts the tower on the intake stage"
        what = ("force only adds a host round trip for rows already resident" if mode == "force"
                else "there is nothing to publish or refuse, so never changes nothing")
        out.append(f"overlay_publish: {mode} is ineffective here ({why}): image rows are made in the engine "
                   f"that splices them, so publication never crosses a context; {what}")
    if placement.transport != "auto":
        if n == 1:
            out.append(f"transport: {placement.transport} has no effect: a single-stage placement has no "
                       "stage boundary")
        elif not any(s.is_cuda for s in placement.stages):
            out.append(f"transport: {placement.transport} has no effect: every stage is on cpu, so boundaries "
                       "use CPU shared-memory slots")
        elif not any(a.is_cuda and b.is_cuda for a, b in zip(placement.stages, placement.stages[1:])):
            # (Deployment._transports: a boundary with a cpu side takes the shared-memory slots whatever is asked)
            out.append(f"transport: {placement.transport} has no effect: every stage boundary has a cpu stage on "
                       "one side, so boundaries use CPU shared-memory slots")
    # positions past max_position_embeddings run (rotary embeddings have no end), but the model was not trained
    # there: said once at boot, as llama.cpp does for n_ctx above n_ctx_train
    ctx, mpe = placement.scheduler.max_context, model.text.max_position_embeddings
    if ctx > mpe:
        out.append(f"scheduler.max_context: {ctx} is more than the model's max_position_embeddings ({mpe}): "
                   f"sequences longer than {mpe} run past the context it was trained for")
    return tuple(out)


def plan_of(src, placement: Placement, model: ModelConfig) -> Plan:
    """make_plan for a placement read from `src` (load_placement's argument): a refusal names the file, as the
    schema's do (a dict's refusals name their keys only, as before)."""
    try:
        return make_plan(placement, model)
    except ConfigError as e:
        if isinstance(src, Mapping):
            raise
        raise ConfigError(f"{src}: {e}") from None


def make_plan(placement: Placement, model: ModelConfig, layer_costs: Sequence[float] | None = None,
              head_cost: float | None = None) -> Plan:
    """Resolve a placement against a model: layer ranges, roles, microbatches and warnings. Pure; refuses with
    ConfigError naming the key. The byte model costs a decode step of a full microbatch (``decode_batch``: max_batch
    over the microbatches). Measured ``layer_costs`` (one per layer) replace it; then the embedding is free and
    ``head_cost`` (default 0, same units as the measurement) is added to the last stage.
    """
    L, n = model.text.num_hidden_layers, len(placement.stages)
    mb = placement.scheduler.microbatches
    mb = mb if mb is not None else auto_microbatches(placement)
    t, db, sc = model.text, DTYPE_BYTES[placement.model.dtype], placement.scheduler
    batch = decode_batch(placement, mb) if layer_costs is None else None
    if batch is not None:
        costs = default_layer_costs(model, db, batch)
        embed, head = float(t.hidden_size * db * batch), default_head_cost(model, db, batch)
    else:
        costs = tuple(float(c) for c in layer_costs)
        if len(costs) != L or not all(math.isfinite(c) and c >= 0 for c in costs):
            raise ConfigError(f"layer_costs: need {L} finite costs >= 0 (one per layer), got {list(layer_costs)}")
        embed, head = 0.0, 0.0
    if head_cost is not None:
        if not (math.isfinite(head_cost) and head_cost >= 0):
            raise ConfigError(f"head_cost: must be a finite cost >= 0, got {head_cost!r}")
        head = float(head_cost)
    tower = _tower(placement, n)
    memory = default_layer_memory(model, db, sc.max_batch, sc.max_context)
    mem_embed = float(t.vocab_size * t.hidden_size * db)
    # the primary's lm_head (a tied one is the embedding: the same tensor on one stage, a copy on another) and norm
    mem_head = float(((0 if t.tie_word_embeddings and n == 1 else t.vocab_size) + 1) * t.hidden_size * db)
    ranges = _ranges(placement, L, costs, embed, head, memory, mem_embed, mem_head)
    stages = tuple(StagePlan(
        index=i, device=s.device, layer_start=a, layer_end=b, intake=i == 0, primary=i == n - 1, tower=i == tower,
        num_cpus=s.num_cpus, threads=s.threads,
        cost=sum(costs[a:b]) + (embed if i == 0 else 0.0) + (head if i == n - 1 else 0.0),
        memory=sum(memory[a:b]) + (mem_embed if i == 0 else 0.0) + (mem_head if i == n - 1 else 0.0))
        for i, (s, (a, b)) in enumerate(zip(placement.stages, ranges)))
    return Plan(name=placement.name, stages=stages, intake_index=0, primary_index=n - 1, tower_index=tower,
                microbatches=mb, num_layers=L, warnings=_warnings(placement, model, n, tower, mb), split_batch=batch)
