"""What a request is on the driver side: the keywords generate / stream / agenerate share, token ids as Python
ints, the Result and StreamEvent a caller gets back, and an intake's error turned back into its memra_pp type."""
from __future__ import annotations

import array
import contextlib
import dataclasses
import numbers
import operator

from .errors import InputError, MemraError, StageFailed
from . import errors as _errors


@dataclasses.dataclass
class Result:
    token_ids: list[int]
    logprobs: list[float] | None
    finish_reason: str
    text: str | None = None
    prompt_tokens: int = 0


@dataclasses.dataclass
class StreamEvent:
    token_ids: list[int]               # the new tokens of this event
    logprobs: list[float] | None
    text: str | None = None            # the new text, when the model has a tokenizer
    finish_reason: str | None = None


def _error(etype: str, message: str, stage: int | None = None) -> MemraError:
    cls = getattr(_errors, etype, None)
    if isinstance(cls, type) and issubclass(cls, StageFailed):
        return cls(message, stage=stage)
    if isinstance(cls, type) and issubclass(cls, MemraError):
        return cls(message)
    return StageFailed(f"{etype}: {message}", stage=stage)


# The request keywords generate / stream / agenerate share, with their defaults.
REQUEST_DEFAULTS = dict(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, seed=None, stop_token_ids=None,
                        ignore_eos=False, adapter=None, images=None)


def _token_ids(value) -> list[int] | str | None:
    """Token ids as Python ints from a list, tuple, numpy array or tensor (0-d items too): the list; a value that
    is not a sequence: None; an item that is not an integer (5.7, True): that item's description."""
    # a set's or a dict's order is not the caller's: refused, not read in some order; bytes are text, also behind a
    # memoryview or in an array of bytes (array('B', b"hi") and memoryview(b"hi") list as ids 104, 105)
    if isinstance(value, (str, bytes, bytearray, set, frozenset, dict)) or \
            (isinstance(value, (memoryview, array.array)) and value.itemsize == 1):
        return None
    try:
        items = value.tolist() if hasattr(value, "tolist") else list(value)
    except (TypeError, RuntimeError):       # (a meta or sparse tensor has no list of values)
        return None
    if not isinstance(items, list):
        return None
    out = []
    for t in items:
        try:
            if hasattr(t, "ndim") and getattr(t, "ndim", 1) == 0:     # a 0-d tensor or array: its scalar
                t = t.item()
            if isinstance(t, bool):
                raise TypeError
            out.append(int(operator.index(t)))     # (an int subclass as a plain int: what a stage can unpickle)
        except (TypeError, RuntimeError):
            return f"{t!r:.60} ({type(t).__name__})"
    return out


def flag(name: str, value) -> bool:
    """A True / False argument (numpy's bools too) as Python's; 0, 1, "no" or an array: InputError, not a guess."""
    if isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_")):
        return bool(value)
    if getattr(value, "ndim", None) == 0 and str(getattr(value, "dtype", "")) in ("torch.bool", "bool"):
        with contextlib.suppress(RuntimeError):     # (a meta tensor has no value: refused below)
            return bool(value.item())         # a 0-d torch (or numpy) bool
    raise InputError(f"{name} must be True or False, got {value!r} ({type(value).__name__})")


def _scalar(value):
    """A numpy scalar or 0-d array or tensor as its Python value (a bool one: a bool); anything else as given."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        try:
            return value.item()
        except (RuntimeError, TypeError, ValueError):   # a meta tensor has no value: the check names it as given
            return value
    return value


SAMPLING_KEYS = ("temperature", "top_k", "top_p", "min_p", "seed")


def request_dict(kw: dict, raw_image=None, **fixed) -> dict:
    """generate's keywords (known ones only: the client refuses others first) as the intake's request: defaults
    filled, numpy / torch scalars (0-d tensors too) as Python's, stop ids as a list of ints, images as a list (none:
    no key). A value of a wrong kind is an InputError here; ranges and the vocabulary are the intake's checks."""
    if "max_new_tokens" in fixed:
        # a bool, 0-d bool tensor included (operator.index took torch.tensor(True) for 1), is no count of tokens
        mnt = _scalar(fixed["max_new_tokens"])
        if isinstance(mnt, bool) or not isinstance(mnt, numbers.Integral):
            given = fixed["max_new_tokens"]
            raise InputError(f"max_new_tokens must be an integer >= 0, got {given!r:.60} ({type(given).__name__})")
        fixed["max_new_tokens"] = int(mnt)
    req = dict(REQUEST_DEFAULTS, **kw, **fixed)
    for k in SAMPLING_KEYS:     # (a 0-d tensor was refused as "temperature must be a finite number, got tensor(0.7)")
        req[k] = _scalar(req[k])
    sampling_params(req)        # (the intake's check, here too: see sampling_params)
    if req["stop_token_ids"] is not None:
        stops = _token_ids(req["stop_token_ids"])
        if stops is None or isinstance(stops, str):
            raise InputError(f"stop_token_ids is a list of token ids, got {req['stop_token_ids']!r}")
        req["stop_token_ids"] = stops
    req["ignore_eos"] = flag("ignore_eos", req["ignore_eos"])
    if req["adapter"] is not None and not isinstance(req["adapter"], str):
        raise InputError(f"adapter must be a loaded adapter's name (a string) or None, got {req['adapter']!r:.60} "
                         f"({type(req['adapter']).__name__})")
    if req["adapter"] is not None:
        req["adapter"] = str.__str__(req["adapter"])    # (a str subclass's string: what a stage can unpickle)
    images = req.pop("images")
    if images is not None:
        if isinstance(images, (str, bytes)) or not hasattr(images, "__iter__") or \
                type(images).__name__ == "ImageInput":
            raise InputError(f"images is a list of memra_pp.ImageInput, got {type(images).__name__}")
        if images := list(images):
            req["images"] = [sendable_image(x, raw_image) for x in images]
    return req


def sampling_params(req: dict):
    """A request's sampling parameters (absent ones: the defaults), checked and normalised (SamplingParams.validate);
    a value of a wrong kind is InputError naming it. The intake's check; the client makes it too, so that a value of
    no number type is refused by name before Ray is asked to send it (one only the caller can unpickle would fail
    in the intake unnamed)."""
    from .model.sampling import SamplingParams
    try:
        return SamplingParams(*(req.get(k, REQUEST_DEFAULTS[k]) for k in SAMPLING_KEYS)).validate()
    except (TypeError, ValueError, ArithmeticError) as e:
        if isinstance(e, MemraError):
            raise
        raise InputError(f"bad sampling parameters in the request: {type(e).__name__}: {e}") from None


def sendable_image(x, raw_image=None):
    """One image as the client sends it: an ImageInput (a processor's dict made one; anything else, or a malformed
    dict: InputError, before a stage is asked to unpickle it), its grid and its pixels' dtype checked as the intake
    checks them (the intake checks the rest). `raw_image(x)`: the ImageInput of a raw image (is_raw_image)."""
    from .model.image import check_grid, check_pixel_dtype
    from .multimodal import as_image_input, is_raw_image
    if raw_image is not None and is_raw_image(x):       # (a tensor's pixels as the processor takes them: numpy)
        x = raw_image(x.detach().cpu().numpy() if hasattr(x, "detach") else x)
    x = as_image_input(x)
    check_grid(x.grid_thw)
    pv = x.pixel_values
    if hasattr(pv, "is_floating_point") and pv.is_floating_point():
        check_pixel_dtype(pv)
    return x
