"""The embedded default: a tiny Qwen3.5 checkpoint the project writes itself, served by two CPU stages."""
from __future__ import annotations

from pathlib import Path

TINY_PATH = Path("~/.cache/memra_pp/tiny-qwen3_5").expanduser()

# Must equal cluster_configs/tiny-cpu.yaml (a test checks); embedded so an installed package needs no repo.
TINY_CPU = {
    "name": "tiny-cpu",
    "model": {"path": str(TINY_PATH), "format": "auto", "dtype": "float32"},
    "stages": [{"device": "cpu", "layers": "auto"}, {"device": "cpu", "layers": "auto"}],
}


def ensure_tiny(path: Path = TINY_PATH) -> Path:
    """Write the tiny checkpoint if it is not there yet (reused across runs)."""
    from .model.tiny import make_tiny
    return make_tiny(path)
