"""Token sampling: greedy, temperature, top-k, top-p, each request with its own seeded generator.

Greedy rows are one batched argmax. Random rows draw from their request's `torch.Generator`, so a
seeded request samples the same tokens whatever else shares its batch (and after preemption).
"""

from __future__ import annotations

import random

import torch

from mmserve.engine.sampling_params import SamplingParams


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits [V] -> logits with everything outside the top-k / nucleus set to -inf."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (the top token always stays)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


class Sampler:
    def __init__(self, seed: int = 0):
        self._seeds = random.Random(seed)
        self._generators: dict[str, torch.Generator] = {}

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        gen = self._generators.get(request_id)
        if gen is None:
            seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
            gen = self._generators[request_id] = torch.Generator().manual_seed(seed)
        return gen

    def sample(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]) -> list[int]:
        """logits float32 [N, V] (row i for request_ids[i]) -> one token id per row."""
        tokens = logits.argmax(dim=-1).tolist()
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if not random_rows:
            return tokens
        host = logits[random_rows].float().cpu()  # one device-to-host copy for all random rows
        for row, i in zip(host, random_rows, strict=True):
            p = params[i]
            probs = torch.softmax(filter_logits(row / p.temperature, p.top_k, p.top_p), dim=-1)
            tokens[i] = int(torch.multinomial(probs, 1, generator=self._generator(request_ids[i], p)))
        return tokens

    def free(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
