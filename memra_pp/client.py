"""The Python client: generate / stream / agenerate over a deployment's intake stage (driver side).

One background pump per client long-polls the intake stage for this client's events (one Ray call per batch of
events, not per token) and routes them to per-request queues.
"""
from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import uuid
from typing import Iterator

import ray

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


def _error(etype: str, message: str) -> MemraError:
    cls = getattr(_errors, etype, None)
    if isinstance(cls, type) and issubclass(cls, MemraError):
        return cls(message)
    return StageFailed(f"{etype}: {message}")


class Client:
    def __init__(self, dep):
        self.dep = dep
        self.id = uuid.uuid4().hex
        self._intake = dep.actors[0]
        self._queues: dict[str, queue.Queue] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._pump = threading.Thread(target=self._run_pump, name="memra-client-pump", daemon=True)
        self._pump.start()

    def close(self) -> None:
        self._closed.set()

    # -- plumbing ---------------------------------------------------------------------------------------------
    def _run_pump(self):
        step = self.dep.placement.timeouts.step_s
        while not self._closed.is_set():
            with self._lock:
                idle = not self._queues
            if idle:
                self._closed.wait(0.02)
                continue
            try:
                evs = ray.get(self._intake.poll.remote(self.id, 0.2), timeout=step)
            except Exception as e:  # the intake stage is gone or silent: every waiting request fails, typed
                self._fail_all(StageFailed(f"stage 0 did not answer: {type(e).__name__}: {e}", stage=0))
                self._closed.wait(0.2)
                continue
            for rid, toks, lps, finish, err in evs:
                with self._lock:
                    q = self._queues.get(rid)
                if q is not None:
                    q((toks, lps, finish, err))

    def _fail_all(self, e: MemraError):
        with self._lock:
            for q in self._queues.values():
                q(([], [], "error", (type(e).__name__, str(e))))

    def _submit(self, prompt, max_new_tokens, temperature, top_k, top_p, min_p, seed, stop_token_ids,
                adapter, images, sink=None) -> tuple[str, queue.Queue, list[int]]:
        ids = self._encode(prompt)
        rid = uuid.uuid4().hex
        q: queue.Queue = queue.Queue()
        put = sink or q.put
        req = dict(rid=rid, client=self.id, prompt=ids, max_new_tokens=max_new_tokens, temperature=temperature,
                   top_k=top_k, top_p=top_p, min_p=min_p, seed=seed, stop_token_ids=stop_token_ids,
                   adapter=adapter)
        if images:
            req["images"] = list(images)
        with self._lock:
            self._queues[rid] = put
        try:
            from .rayutil import get
            get(self._intake.submit.remote(req), self.dep.placement.timeouts.step_s, "submit")
        except BaseException:
            with self._lock:
                self._queues.pop(rid, None)
            raise
        return rid, q, ids

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            tok = self.dep.tokenizer
            if tok is None:
                raise InputError("a text prompt needs a tokenizer.json in the model directory; pass token ids")
            return tok.encode(prompt)
        try:
            return [int(t) for t in prompt]
        except (TypeError, ValueError):
            raise InputError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}") from None

    def _events(self, rid, q, timeout):
        try:
            while True:
                try:
                    toks, lps, finish, err = q.get(timeout=timeout)
                except queue.Empty:
                    self._intake.abort.remote(rid)
                    raise TimeoutError(f"request {rid} produced nothing for {timeout} s") from None
                if err is not None:
                    raise _error(*err)
                yield toks, lps, finish
                if finish:
                    return
        finally:
            with self._lock:
                self._queues.pop(rid, None)

    # -- public -----------------------------------------------------------------------------------------------
    def generate(self, prompt, max_new_tokens: int = 16, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, min_p: float = 0.0, seed: int | None = None, logprobs: bool = True,
                 stop_token_ids: list[int] | None = None, adapter: str | None = None, images=None,
                 timeout: float | None = None) -> Result:
        rid, q, ids = self._submit(prompt, max_new_tokens, temperature, top_k, top_p, min_p, seed,
                                   stop_token_ids, adapter, images)
        toks, lps, finish = [], [], "length"
        for t, l, f in self._events(rid, q, timeout or self.dep.placement.timeouts.step_s * 10):
            toks += t
            lps += l
            finish = f or finish
        tok = self.dep.tokenizer
        return Result(toks, lps if logprobs else None, finish, tok.decode(toks) if tok else None, len(ids))

    def stream(self, prompt, max_new_tokens: int = 16, logprobs: bool = True, timeout: float | None = None,
               **kw) -> Iterator[StreamEvent]:
        rid, q, _ = self._submit(prompt, max_new_tokens, kw.pop("temperature", 0.0), kw.pop("top_k", 0),
                                 kw.pop("top_p", 1.0), kw.pop("min_p", 0.0), kw.pop("seed", None),
                                 kw.pop("stop_token_ids", None), kw.pop("adapter", None), kw.pop("images", None))
        if kw:
            raise InputError(f"unknown keyword arguments {sorted(kw)}")
        tok = self.dep.tokenizer
        dec = tok.incremental_decoder() if tok else None
        for t, l, f in self._events(rid, q, timeout or self.dep.placement.timeouts.step_s * 10):
            text = None
            if dec is not None:
                text = "".join(dec.push(x) for x in t) + (dec.flush() if f else "")
            yield StreamEvent(t, l if logprobs else None, text, f)

    async def agenerate(self, prompt, max_new_tokens: int = 16, logprobs: bool = True,
                        timeout: float | None = None, **kw) -> Result:
        """Same keywords as generate; any number in flight (no thread per request)."""
        loop = asyncio.get_running_loop()
        aq: asyncio.Queue = asyncio.Queue()
        sink = lambda item: loop.call_soon_threadsafe(aq.put_nowait, item)   # noqa: E731
        rid, _, ids = await loop.run_in_executor(None, lambda: self._submit(
            prompt, max_new_tokens, kw.pop("temperature", 0.0), kw.pop("top_k", 0), kw.pop("top_p", 1.0),
            kw.pop("min_p", 0.0), kw.pop("seed", None), kw.pop("stop_token_ids", None), kw.pop("adapter", None),
            kw.pop("images", None), sink))
        toks, lps, finish = [], [], "length"
        try:
            while True:
                try:
                    t, l, f, err = await asyncio.wait_for(aq.get(), timeout or self.dep.placement.timeouts.step_s * 10)
                except asyncio.TimeoutError:
                    self._intake.abort.remote(rid)
                    raise TimeoutError(f"request {rid} produced nothing for {timeout} s") from None
                if err is not None:
                    raise _error(*err)
                toks += t
                lps += l
                if f:
                    finish = f
                    break
        finally:
            with self._lock:
                self._queues.pop(rid, None)
        tok = self.dep.tokenizer
        return Result(toks, lps if logprobs else None, finish, tok.decode(toks) if tok else None, len(ids))
