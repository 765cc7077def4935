"""Stage slices composed in one process: the reference path for tests and for checking a deployment's tokens."""
from __future__ import annotations

import torch

from .batch import StepBatch
from .stage_model import StageModel


class LocalPipeline:
    """Runs StepBatches through several StageModels in order (no actors, no transports)."""

    def __init__(self, src, splits: list[tuple[int, int]], dtype=torch.float32, device="cpu", max_seqs: int = 8,
                 max_context: int = 1024):
        n = len(splits)
        self.stages = [StageModel(src.config, a, b, intake=i == 0, primary=i == n - 1).load(src, dtype, device)
                       for i, (a, b) in enumerate(splits)]
        self.caches = [s.new_cache(max_seqs, max_context) for s in self.stages]
        self.loras = [None] * n           # per stage: a LoraPool, or None
        self.token_overlays = [None] * n  # per stage: a TokenOverlaySet (read on the intake and the primary)

    def step(self, b: StepBatch, ids_T: torch.Tensor, embeds_TH: torch.Tensor | None = None) -> torch.Tensor:
        h = self.stages[0].embed_ids(ids_T, b, self.token_overlays[0]) if embeds_TH is None else embeds_TH
        for s, c, lora, tos in zip(self.stages, self.caches, self.loras, self.token_overlays):
            h = s(b, h, c, lora=lora, token_overlay=tos if s.primary else None)
        return h

    def greedy(self, prompts: list[list[int]], max_new_tokens: int, chunk: int | None = None,
               adapter_slots: list[int] | None = None):
        """Batched greedy generation: prompts prefilled in chunks of `chunk` (all at once when None), then
        decoded together; `adapter_slots` gives each prompt's adapter slot (-1 none). Returns (tokens, logprobs)."""
        slots = list(range(len(prompts)))
        lens = [0] * len(prompts)
        toks = [[] for _ in prompts]
        lps = [[] for _ in prompts]
        todo = [list(p) for p in prompts]
        while any(todo):
            idx = [i for i in slots if todo[i]]
            counts = [len(todo[i]) if chunk is None else min(chunk, len(todo[i])) for i in idx]
            ids = [t for i, c in zip(idx, counts) for t in todo[i][:c]]
            sample = [len(todo[i]) == c for i, c in zip(idx, counts)]
            b = StepBatch([i for i in idx], [lens[i] for i in idx], counts,
                          StepBatch.text_positions([lens[i] for i in idx], counts), sample,
                          None if adapter_slots is None else [adapter_slots[i] for i in idx])
            logits = self.step(b, torch.tensor(ids))
            r = 0
            for i, c, s in zip(idx, counts, sample):
                todo[i] = todo[i][c:]
                lens[i] += c
                if s:
                    self._take(logits[r], toks[i], lps[i])
                    r += 1
        for _ in range(max_new_tokens - 1):
            b = StepBatch(slots, list(lens), [1] * len(slots), StepBatch.text_positions(lens, [1] * len(slots)),
                          [True] * len(slots), adapter_slots)
            logits = self.step(b, torch.tensor([t[-1] for t in toks]))
            for i in slots:
                lens[i] += 1
                self._take(logits[i], toks[i], lps[i])
        return toks, lps

    @staticmethod
    def _take(logits_V, toks, lps):
        lp = torch.log_softmax(logits_V.float(), -1)
        t = int(lp.argmax())
        toks.append(t)
        lps.append(float(lp[t]))
