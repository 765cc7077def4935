"""The work one microbatch asks of a stage: a segment of new tokens per sequence, rows concatenated in order."""
from __future__ import annotations

import dataclasses

import torch


def h2d(t: torch.Tensor, device) -> torch.Tensor:
    """A host tensor on `device` without waiting for the device: on CUDA it goes through pinned memory with a
    non-blocking copy (a pageable copy returns only once every kernel queued before it has run, which stalls the
    stage's host loop behind its own previous step)."""
    device = torch.device(device)
    if device.type != "cuda" or t.device.type == "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


@dataclasses.dataclass
class StepBatch:
    slots: list[int]                 # cache slot of each sequence
    starts: list[int]                # cached length before this step (must equal the stage's own count)
    counts: list[int]                # new tokens of each sequence, >= 1
    pos_3T: torch.Tensor             # [3, T] rope positions (T, H, W rows) of every new token
    sample: list[bool]               # primary: produce logits for this sequence's last new token
    adapter_slots: list[int] | None = None   # adapter slot of each sequence (-1: none); None: no adapters
    # slots of sequences that finished before this step: their cache pages go back first (a slot may be in both
    # release and slots, a new sequence at start 0)
    release: list[int] = dataclasses.field(default_factory=list)

    def __post_init__(self):
        n = len(self.slots)
        assert len(self.starts) == n and len(self.counts) == n and len(self.sample) == n, "ragged batch"
        assert all(c >= 1 for c in self.counts), "empty segment"
        assert self.adapter_slots is None or len(self.adapter_slots) == n, "ragged adapter_slots"

    @property
    def total(self) -> int:
        return sum(self.counts)

    @property
    def offsets(self) -> list[int]:
        out, o = [], 0
        for c in self.counts:
            out.append(o)
            o += c
        return out

    def index_tensors(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(slots, starts) as int64 tensors on `device`, made once per step (not once per layer: each is a
        host-to-device copy)."""
        key = str(device)
        cache = self.__dict__.setdefault("_index", {})
        if key not in cache:
            cache[key] = tuple(aligned_rows([self.slots, self.starts], device))
        return cache[key]

    def token_index(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot, position) of every new token as int64 tensors on `device`, made once per step."""
        key = ("tokens", str(device))
        cache = self.__dict__.setdefault("_index", {})
        if key not in cache:
            sl = [s for s, c in zip(self.slots, self.counts) for _ in range(c)]
            ps = [st + i for st, c in zip(self.starts, self.counts) for i in range(c)]
            cache[key] = tuple(aligned_rows([sl, ps], device))
        return cache[key]

    def decode_only(self) -> bool:
        """Every segment is one token continuing a cached sequence: the batched decode path applies."""
        return all(c == 1 and s > 0 for c, s in zip(self.counts, self.starts))

    def uses_adapters(self) -> bool:
        """Some sequence names an adapter slot (>= 0)."""
        return self.adapter_slots is not None and any(s >= 0 for s in self.adapter_slots)

    def adapter_slot_per_token(self, device=None) -> torch.Tensor:
        """[T] int64: the adapter slot of every new token (-1 none); requires adapter_slots."""
        return torch.tensor(self.adapter_slots, device=device).repeat_interleave(
            torch.tensor(self.counts, device=device))

    def adapter_slot_per_sample(self, device=None) -> torch.Tensor:
        """[n_sample] int64: the adapter slot of every logits row (-1 none); requires adapter_slots."""
        return torch.tensor([a for a, s in zip(self.adapter_slots, self.sample) if s], dtype=torch.long,
                            device=device)

    def groups(self, kind: str, device) -> list[tuple[list[int], torch.Tensor, torch.Tensor, slice | None]]:
        """The step's sequences grouped so that each group runs as one batched call instead of one call per
        sequence: kind "length" groups by segment length and by fresh (start 0) or continuing, "start" by
        (start, length), "prompt_length" and "prompt_start" as those leaving out the one-token continuing segments
        (single_rows: the attention takes those in one decode call, where each has a start of its own, so that as
        groups a mixed step's hundreds of decode rows were hundreds of calls a layer; the Gated DeltaNet in the
        decode step's kernels, its states in place). Returns [(indices into the batch, token rows [G * n], slots
        [G], span)] with the tensors on `device`, made once per step and kind (every host-to-device copy from
        pageable memory waits for the stream: once per layer would stall the prefill 64 times). span: the rows as a
        slice of the step's rows where they are consecutive (every segment right after the one before), else None
        (then the row tensor gathers)."""
        cache = self.__dict__.setdefault("_groups", {})
        ck = (kind, str(device))
        if ck in cache:
            return cache[ck]
        key = {"length": lambda i: (self.counts[i], self.starts[i] == 0),
               "start": lambda i: (self.starts[i], self.counts[i])}[kind.removeprefix("prompt_")]
        single = set(self.single_rows(device)[0]) if kind.startswith("prompt_") else ()
        out: dict = {}
        for i in range(len(self.slots)):
            if i not in single:
                out.setdefault(key(i), []).append(i)
        offs = self.offsets
        idxs = list(out.values())
        rows = [offs[i] + t for idx in idxs for i in idx for t in range(self.counts[i])]
        slots = [self.slots[i] for idx in idxs for i in idx]
        flat = h2d(torch.tensor(rows + slots), device)               # one copy for every group
        res, r0, s0 = [], 0, len(rows)
        for idx in idxs:
            n = self.counts[idx[0]]
            nr = len(idx) * n
            consecutive = all(offs[i] == offs[idx[0]] + j * n for j, i in enumerate(idx))   # (one length a group)
            res.append((idx, flat[r0:r0 + nr], flat[s0:s0 + len(idx)],
                        slice(offs[idx[0]], offs[idx[0]] + nr) if consecutive else None))
            r0, s0 = r0 + nr, s0 + len(idx)
        cache[ck] = res
        return res

    def single_rows(self, device) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
        """The one-token continuing segments of a step that has prompt segments too (a mixed step's decode rows, or
        a prompt's one-token last chunk): (their indices into the batch, their rows, slots and lengths after this
        token, start + 1, as int64 tensors on `device`); none in a decode-only step (the decode path takes those).
        Made once per step, one host-to-device copy."""
        cache = self.__dict__.setdefault("_index", {})
        key = ("single", str(device))
        if key not in cache:
            idx = [] if self.decode_only() else [i for i, (c, s) in enumerate(zip(self.counts, self.starts))
                                                 if c == 1 and s > 0]
            offs = self.offsets
            cache[key] = (idx, *aligned_rows([[offs[i] for i in idx], [self.slots[i] for i in idx],
                                              [self.starts[i] + 1 for i in idx]], device))
        return cache[key]

    def sample_rows(self) -> list[int]:
        return [o + c - 1 for o, c, s in zip(self.offsets, self.counts, self.sample) if s]

    @staticmethod
    def text_positions(starts: list[int], counts: list[int], deltas: list[int] | None = None) -> torch.Tensor:
        """Text-only positions: all three rows equal start + i (+ the sequence's M-RoPE delta)."""
        deltas = deltas or [0] * len(starts)
        return positions_3T([range(s + d, s + d + c) for s, c, d in zip(starts, counts, deltas)])


def aligned_rows(rows: list[list[int]], device) -> list[torch.Tensor]:
    """Equal-length int lists as int64 tensors on `device` in one host-to-device copy, each starting 16-byte
    aligned: the rows padded to an even length. Triton compiles a pointer argument by its 16-byte alignment, so a
    row of an odd-length [k, n] tensor would compile a second binary of each kernel it reaches, inside a request."""
    n = len(rows[0])
    m = n + (n & 1)
    t = h2d(torch.tensor([list(r) + [0] * (m - n) for r in rows], dtype=torch.int64).view(len(rows), m), device)
    return [t[i, :n] for i in range(len(rows))]


def aligned_parts(parts: list[list[int]], device) -> list[torch.Tensor]:
    """Int lists of any lengths as int64 tensors on `device` in one host-to-device copy, each starting 16-byte
    aligned (aligned_rows' reason): each part padded to an even length."""
    flat, at = [], []
    for p in parts:
        at.append((len(flat), len(p)))
        flat += list(p) + [0] * (len(p) & 1)
    t = h2d(torch.tensor(flat, dtype=torch.int64), device)
    return [t[a:a + n] for a, n in at]


def positions_3T(parts) -> torch.Tensor:
    """[3, T] int64 rope positions of a step from its segments in order: a range (text: all three rows equal) or a
    [3, c] tensor (an image prompt's M-RoPE rows). Text is one tensor built at once (torch calls per sequence were
    most of a decode step's scheduling time at 64 sequences)."""
    if all(isinstance(p, range) for p in parts):
        return torch.tensor([x for p in parts for x in p], dtype=torch.long)[None].expand(3, -1).contiguous()
    return torch.cat([p if isinstance(p, torch.Tensor) else torch.tensor(p, dtype=torch.long)[None].expand(3, -1)
                      for p in parts], 1)
