"""Logit adjustments before sampling, each one batched over the rows that asked for it.

Rows are gathered into index tensors on the host (one pass over the step's requests), then every
adjustment is a handful of tensor ops on the logits' device: no per-row device work.
vLLM's semantics: `logit_bias` adds to a token's logit; `min_tokens` sets end-of-sequence tokens to
-inf until a row has that many output tokens; `repetition_penalty` divides a positive (multiplies a
negative) logit of every token seen in the prompt or the output; then `frequency_penalty` subtracts
once per occurrence in the output and `presence_penalty` once if the token occurred there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mmserve.sampling_params import SamplingParams


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """In place: logits[r, t] += bias for every (t, bias) of row r's logit_bias."""
    rows = [r for r, p in enumerate(params) for _ in p.logit_bias]
    if not rows:
        return
    tokens = [t for p in params for t, _ in p.logit_bias]
    values = [b for p in params for _, b in p.logit_bias]
    dev = logits.device
    logits.index_put_((torch.tensor(rows, device=dev), torch.tensor(tokens, device=dev)),
                      torch.tensor(values, dtype=logits.dtype, device=dev), accumulate=True)


def apply_min_tokens(logits: torch.Tensor, params: Sequence[SamplingParams], num_output: Sequence[int],
                     eos_token_ids: Sequence[int]) -> None:
    """In place: end-of-sequence logits of rows still short of min_tokens become -inf."""
    rows = [r for r, (p, n) in enumerate(zip(params, num_output, strict=True)) if n < p.min_tokens]
    if not rows or not eos_token_ids:
        return
    dev = logits.device
    logits[torch.tensor(rows, device=dev).unsqueeze(1), torch.tensor(list(eos_token_ids), device=dev).unsqueeze(0)] = \
        float("-inf")


def _padded(seqs: Sequence[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max((len(s) for s in seqs), default=0)
    return torch.tensor([list(s) + [pad] * (width - len(s)) for s in seqs], dtype=torch.int64,
                        device=device).view(len(seqs), width)


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams], prompt_ids: Sequence[Sequence[int]],
                    output_ids: Sequence[Sequence[int]]) -> None:
    """In place: repetition, frequency and presence penalties on the rows that set any."""
    rows = [r for r, p in enumerate(params) if p.has_penalties]
    if not rows:
        return
    dev, vocab = logits.device, logits.shape[1]
    sub = logits[rows]
    # counts of each token in the output; column `vocab` soaks up the padding
    out = _padded([output_ids[r] for r in rows], vocab, dev)
    counts = torch.zeros(len(rows), vocab + 1, device=dev).scatter_add_(1, out, torch.ones_like(out, dtype=torch.float32))
    counts = counts[:, :vocab]
    rep = torch.tensor([params[r].repetition_penalty for r in rows], device=dev).unsqueeze(1)
    if (rep != 1.0).any():
        prompt = _padded([prompt_ids[r] for r in rows], vocab, dev)
        seen = torch.zeros(len(rows), vocab + 1, dtype=torch.bool, device=dev).scatter_(1, prompt, True)[:, :vocab]
        seen |= counts > 0
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    freq = torch.tensor([params[r].frequency_penalty for r in rows], device=dev).unsqueeze(1)
    pres = torch.tensor([params[r].presence_penalty for r in rows], device=dev).unsqueeze(1)
    sub = sub - freq * counts - pres * (counts > 0)
    logits[rows] = sub.to(logits.dtype)
