"""Logit adjustments before sampling, each one batched over the rows that asked for it.

Rows are gathered into index arrays on the host (one pass over the step's requests) and copied to
the logits' device with the per-row values through pinned memory, without waiting for the device
(`row_values`; never a device tensor indexed with a host list); then every adjustment is a handful of
tensor ops there. The penalties read per-request token
statistics kept on the device across steps (`PenaltyState`).
vLLM's semantics: `logit_bias` adds to a token's logit; `min_tokens` sets end-of-sequence tokens to
-inf until a row has that many output tokens; `repetition_penalty` divides a positive (multiplies a
negative) logit of every token seen in the prompt or the output; then `frequency_penalty` subtracts
once per occurrence in the output and `presence_penalty` once if the token occurred there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mmserve.sample.row_values import device_floats, device_ids
from mmserve.sampling_params import SamplingParams


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """In place: logits[r, t] += bias for every (t, bias) of row r's logit_bias."""
    rows = [r for r, p in enumerate(params) for _ in p.logit_bias]
    if not rows:
        return
    tokens = [t for p in params for t, _ in p.logit_bias]
    values = [b for p in params for _, b in p.logit_bias]
    dev = logits.device
    logits.index_put_((device_ids(rows, dev), device_ids(tokens, dev)), device_floats(values, dev).to(logits.dtype), accumulate=True)


def apply_min_tokens(logits: torch.Tensor, params: Sequence[SamplingParams], num_output: Sequence[int],
                     eos_token_ids: Sequence[int]) -> None:
    """In place: end-of-sequence logits of rows still short of min_tokens become -inf."""
    rows = [r for r, (p, n) in enumerate(zip(params, num_output, strict=True)) if n < p.min_tokens]
    if not rows or not eos_token_ids:
        return
    dev = logits.device
    logits[device_ids(rows, dev).unsqueeze(1), device_ids(eos_token_ids, dev).unsqueeze(0)] = float("-inf")


class PenaltyState:
    """What the penalties read, per request, kept on the logits' device across steps: a bitmask of the
    prompt's tokens (built once, and only for a repetition penalty) and the counts of each token in
    its output so far (each step adds only the tokens new since the last). So a step costs O(vocab)
    per penalised row, never O(prompt): a 30k-token video prompt is not rebuilt into a tensor every
    step. A verify row's drafts (`drafts`: output it has not committed) are added to a copy."""

    def __init__(self):
        self._prompt: dict[str, torch.Tensor] = {}
        self._counts: dict[str, torch.Tensor] = {}
        self._counted: dict[str, int] = {}

    def rows(self, requests: Sequence, vocab: int, device: torch.device, with_prompt: bool
             ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """(prompt bitmask [R, vocab] bool or None, output counts [R, vocab] float32) of `requests`
        (scheduler Requests or verify rows, whose drafts count as output)."""
        counts, extra_rows, extra_tokens = [], [], []
        for i, r in enumerate(requests):
            drafts = getattr(r, "drafts", ())
            output = r.output_token_ids
            counts.append(self._output_counts(r.request_id, output[:len(output) - len(drafts)], vocab, device))
            extra_rows += [i] * len(drafts)
            extra_tokens += drafts
        counts = torch.stack(counts)
        if extra_rows:
            counts.index_put_((device_ids(extra_rows, device), device_ids(extra_tokens, device)),
                              torch.ones(len(extra_rows), device=device), accumulate=True)
        prompt = None
        if with_prompt:
            prompt = torch.stack([self._prompt_mask(r.request_id, r.prompt_token_ids, vocab, device) for r in requests])
        return prompt, counts

    def _output_counts(self, request_id: str, committed: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
        counts = self._counts.get(request_id)
        if counts is None:
            counts = self._counts[request_id] = torch.zeros(vocab, device=device)
            self._counted[request_id] = 0
        new = committed[self._counted[request_id]:]
        if new:
            counts.index_put_((device_ids(new, device),), torch.ones(len(new), device=device), accumulate=True)
            self._counted[request_id] = len(committed)
        return counts

    def _prompt_mask(self, request_id: str, prompt: Sequence[int], vocab: int, device: torch.device) -> torch.Tensor:
        mask = self._prompt.get(request_id)
        if mask is None:
            mask = self._prompt[request_id] = torch.zeros(vocab, dtype=torch.bool, device=device)
            mask[device_ids([t for t in prompt if 0 <= t < vocab], device)] = True
        return mask

    def free(self, request_id: str) -> None:
        for table in (self._prompt, self._counts, self._counted):
            table.pop(request_id, None)


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams], requests: Sequence,
                    state: PenaltyState) -> None:
    """In place: repetition, frequency and presence penalties on the rows that set any."""
    rows = [r for r, p in enumerate(params) if p.has_penalties]
    if not rows:
        return
    dev, vocab = logits.device, logits.shape[1]
    repetition = any(params[r].repetition_penalty != 1.0 for r in rows)   # host values: no device read
    prompt, counts = state.rows([requests[r] for r in rows], vocab, dev, with_prompt=repetition)
    index = device_ids(rows, dev)
    sub = logits.index_select(0, index)
    if repetition:
        rep = device_floats([params[r].repetition_penalty for r in rows], dev).unsqueeze(1)
        seen = prompt | (counts > 0)
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    freq = device_floats([params[r].frequency_penalty for r in rows], dev).unsqueeze(1)
    pres = device_floats([params[r].presence_penalty for r in rows], dev).unsqueeze(1)
    sub = sub - freq * counts - pres * (counts > 0)
    logits.index_copy_(0, index, sub.to(logits.dtype))
