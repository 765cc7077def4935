"""Placement YAML schema, validation and the pure stage planner (driver process); see schema.py and planner.py."""
from .format import format_plan
from .planner import (Plan, StagePlan, decode_batch, default_head_cost, default_layer_costs, default_layer_memory,
                      experts_read, layer_weight_bytes, make_plan, seq_cache_bytes, split_layers, state_bytes)
from .schema import (AdapterSpec, ModelSpec, Placement, RaySpec, SchedulerSpec, StageSpec, TimeoutSpec,
                     VisionSpec, load_placement, parse_placement)

__all__ = ["AdapterSpec", "ModelSpec", "Placement", "Plan", "RaySpec", "SchedulerSpec", "StagePlan", "StageSpec",
           "TimeoutSpec", "VisionSpec", "decode_batch", "default_head_cost", "default_layer_costs",
           "default_layer_memory", "experts_read", "format_plan", "layer_weight_bytes", "load_placement", "make_plan",
           "seq_cache_bytes", "parse_placement", "split_layers", "state_bytes"]
