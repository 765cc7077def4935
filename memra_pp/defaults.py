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


def unwritable(p: Path, what: str, e: OSError):
    """The ConfigError for a tiny checkpoint that cannot be written (an unwritable or missing HOME)."""
    from .errors import ConfigError
    return ConfigError(f"{p}: cannot write {what} there ({e.strerror or e}); make ~/.cache writable or set HOME to "
                       f"a writable directory")


def ensure_tiny(path: Path = TINY_PATH) -> Path:
    """Write the tiny checkpoint if it is not there yet (reused across runs)."""
    from .model.tiny import make_tiny
    return make_tiny(path)


TINY_VISION_PATH = Path("~/.cache/memra_pp/tiny-qwen3_5-vision").expanduser()
# The checkpoints the shipped cluster_configs name, with make_tiny's arguments for each.
EMBEDDED = {TINY_PATH: {}, TINY_VISION_PATH: {"vision": True}}


def ensure_embedded(path: Path) -> bool:
    """Write one of the project's own tiny checkpoints where a placement names it and it is missing or incomplete
    (as a hub model would be downloaded), so `memra-pp launch / plan / battery` with a shipped YAML work on a
    fresh machine. Any other path: False (the caller refuses it). The driver meets it first on its own host; the
    stages of another node may meet it at once, so each writes a directory of its own and renames it into place
    (the first rename wins; a reader never sees a half-written checkpoint)."""
    p = Path(path).expanduser()
    if p not in EMBEDDED:
        return False
    if (p / "config.json").exists():        # written last: the checkpoint is complete
        return True
    import logging
    import os
    import shutil
    import uuid
    from .model.tiny import make_tiny
    logging.getLogger("memra_pp").warning(f"writing the embedded tiny checkpoint {p} (it was not there)")
    tmp = p.with_name(f".{p.name}.part-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    try:
        make_tiny(tmp, **EMBEDDED[p])
    except OSError as e:    # (an unwritable or missing HOME: a raw error from every command that reads it)
        shutil.rmtree(tmp, ignore_errors=True)
        raise unwritable(p, "the embedded tiny checkpoint", e) from None
    try:
        if p.exists() and not (p / "config.json").exists():
            shutil.rmtree(p, ignore_errors=True)      # an interrupted write's leftovers
        os.rename(tmp, p)
    except OSError:               # another process renamed its complete copy into place first
        shutil.rmtree(tmp, ignore_errors=True)
    return True
