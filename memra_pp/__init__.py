"""memra_pp: pipeline-parallel inference for Qwen3.5, one Ray actor and one context per stage."""
from __future__ import annotations

from . import errors
from .errors import ConfigError, InputError, MemraError, OverlayError, RequestTimeout, ResidencyError, StageFailed

__all__ = ["launch", "connect", "ImageInput", "errors", "MemraError", "ConfigError", "ResidencyError",
           "OverlayError", "InputError", "StageFailed", "RequestTimeout"]


def launch(config, detached: bool = False):
    """Start a deployment from a placement YAML (path or dict); returns once every stage is ready."""
    from .deployment import Deployment
    return Deployment.launch(config, detached=detached)


def connect(name: str, namespace: str = "memra", address: str = "auto"):
    """Attach to a detached deployment by name."""
    from .deployment import Deployment
    return Deployment.connect(name, namespace, address)


def __getattr__(name):
    if name == "ImageInput":
        from .model.image import ImageInput
        return ImageInput
    raise AttributeError(name)
