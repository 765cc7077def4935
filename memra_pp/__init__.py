"""memra_pp: pipeline-parallel inference for Qwen3.5, one Ray actor and one context per stage."""
