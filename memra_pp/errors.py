"""Typed errors for everything a user can cause; each message names the key, value or tensor and the fix."""


class MemraError(Exception):
    """Base of every memra_pp error."""


class ConfigError(MemraError, ValueError):
    """A placement YAML, model config or checkpoint is wrong (names the key path, tensor or file)."""


class ResidencyError(MemraError):
    """A buffer was about to be read in a context it does not live in (names both contexts and the fix)."""


class OverlayError(MemraError):
    """Overlay rows or spans are malformed (overlap, out of range, vocabulary mismatch)."""


class InputError(MemraError, ValueError):
    """A request is malformed (token ids, lengths, images, adapters); only that request fails."""


class StageFailed(MemraError):
    """A stage died or stopped answering; names the stage. The affected requests end with this error."""

    def __init__(self, message: str, stage: int | None = None):
        super().__init__(message)
        self.stage = stage


class RequestTimeout(MemraError, TimeoutError):
    """A request produced nothing within its timeout; it was cancelled (its sequence freed), nothing else was."""


class ProtocolError(StageFailed):
    """A boundary message (slot header, control frame) did not decode: the link between two stages is broken."""
