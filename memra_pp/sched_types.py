"""What the intake's scheduler keeps and hands out: a request, its sequence in a cache slot, a microbatch, and the
per-request events the clients receive. Runs in the stage 0 process (Request is built by the runner's submit).
"""
from __future__ import annotations

import dataclasses
import time

import torch

from .model.sampling import SamplingParams


@dataclasses.dataclass
class Request:
    rid: str
    client: str
    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams
    stop_ids: frozenset[int] = frozenset()
    positions_3L: torch.Tensor | None = None     # M-RoPE rows for the prompt (None: text positions)
    rope_delta: int = 0
    images: object = None                        # overlay payload for the intake (spliced by the runner)
    adapter: int = -1                            # adapter slot, -1 = base model
    adapter_name: str | None = None              # its name, for errors
    step0: int = 0                               # sampling steps already drawn (a replay continues at step0)
    submitted: float = dataclasses.field(default_factory=time.monotonic)


@dataclasses.dataclass
class Seq:
    req: Request
    slot: int
    fed: int = 0                                  # tokens whose cache entries exist on every stage
    sent: int = 0                                 # tokens dispatched in microbatches (fed + those in flight)
    out: list[int] = dataclasses.field(default_factory=list)
    lps: list[float] = dataclasses.field(default_factory=list)
    in_flight: int = 0                            # microbatches holding it (pipelined chunks, a continuation)
    admitted: bool = False                        # the primary has its sampling params
    done: bool = False                            # finished: tokens of a continuation still in flight are dropped
    last_run: int = 0                             # the tick of its last microbatch (of its admission, before one)
    pages: int = 0                                # KV pages reserved for it at admission (Scheduler.kv_pages)
    piece: int = 0                                # most prompt tokens a microbatch takes (Scheduler.piece; 0: unset)

    @property
    def prefilled(self) -> bool:
        """Every prompt token is sent: it decodes from here (its first token may still be on its way)."""
        return self.sent >= len(self.req.prompt)


@dataclasses.dataclass
class Microbatch:
    mb: int
    seqs: list[Seq]
    ids: list[int]
    starts: list[int]
    counts: list[int]
    sample: list[bool]
    pos_3T: torch.Tensor
    admit: list[list]                             # [slot, temperature, top_k, top_p, min_p, seed, adapter, step0]
    release: list[int]
    feed: list[int] | None = None                 # a continuation: ids are these rows of the previous
                                                  # microbatch's sampled tokens, still on the device (ids unknown)
    prompt_tokens: int = 0                        # the prompt tokens it carries (Scheduler.chunk_decoding)


@dataclasses.dataclass
class Event:
    client: str
    rid: str
    tokens: list[int]
    logprobs: list[float]
    finish: str | None = None                     # "length" | "stop" | "error"
    error: tuple | None = None                    # (error type name, message[, failed stage index])
