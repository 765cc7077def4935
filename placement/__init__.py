"""Placement YAML schema, validation and the pure stage planner (driver process); see schema.py and planner.py."""
from .format import format_plan
from .planner import (Plan, StagePlan, default_head_cost, default_layer_costs, make_plan, split_layers,
                      state_bytes)
from .schema import (AdapterSpec, ModelSpec, Placement, RaySpec, SchedulerSpec, StageSpec, TimeoutSpec,
                     VisionSpec, load_placement, parse_placement)

__all__ = ["AdapterSpec", "ModelSpec", "Placement", "Plan", "RaySpec", "SchedulerSpec", "StagePlan", "StageSpec",
           "TimeoutSpec", "VisionSpec", "default_head_cost", "default_layer_costs", "format_plan", "load_placement",
           "make_plan", "parse_placement", "split_layers", "state_bytes"]
