"""Logit adjustments before sampling, each one batched over the rows that asked for it.

`Adjustments` is planned on the host first: one pass over the step's rows puts their indices and
values into the step's `RowValues` (one packed copy to the device for the whole step); `apply` then
runs a fixed handful of tensor ops on the device whatever the number of rows (never a device tensor
indexed with a host list, never an op per row). The penalties read per-request token statistics
kept on the device across steps (`PenaltyState`).
vLLM's semantics: `logit_bias` adds to a token's logit; `min_tokens` sets end-of-sequence tokens to
-inf until a row has that many output tokens; `repetition_penalty` divides a positive (multiplies a
negative) logit of every token seen in the prompt or the output; then `frequency_penalty` subtracts
once per occurrence in the output and `presence_penalty` once if the token occurred there.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from mmserve.sample.row_values import RowValues
from mmserve.sampling_params import SamplingParams
from mmserve.spec_decode.verify import StepRows


class PenaltyState:
    """What the penalties read, per request, kept on the logits' device across steps: rows of two
    tables, one per request (its slot): the counts of each token in its output so far, and a bitmask
    of its prompt's tokens (only once a repetition penalty needs it). A step adds only the tokens new
    since the last, for all its rows in one scatter (`plan` gathers them on the host, `rows` applies
    them), so a step costs O(vocab) per penalised row and a constant number of ops, never O(prompt):
    a 30k-token video prompt is not rebuilt into a tensor every step. A verify row's drafts (output it
    has not committed) are added to the gathered copy, not to the table. A freed slot is reused (and
    zeroed) by the next request. A request holds its slot while it runs: the core gives it back when
    the request ends or is preempted (a resumed request's counts and bitmask are rebuilt from its
    tokens once), so slots never outnumber the running requests, and each table is allocated once, at
    `capacity` rows (`--max-num-seqs`), on the first penalised request: 5 bytes per vocabulary entry
    per slot (1.3 MB a slot at a 262k vocabulary; 168 MB at 128 slots), what the memory profile's
    step allocates too, never regrown (a regrowth would hold the old and the new table at once)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._slot: dict[str, int] = {}
        self._counted: dict[str, int] = {}     # output tokens already in the slot's counts
        self._with_prompt: set[str] = set()    # requests whose prompt bitmask is built
        self._free: list[int] = []
        self._num_slots = 0
        self._counts: torch.Tensor | None = None   # [capacity, vocab] float32
        self._prompt: torch.Tensor | None = None   # [capacity, vocab] bool

    def plan(self, values: RowValues, requests: Sequence, vocab: int, with_prompt: bool) -> None:
        """Host side: the slots of `requests` (scheduler Requests or verify rows, whose drafts count
        as output), the output tokens new to each slot, the prompts to mark, the drafts to add."""
        slots, fresh, new_flat, prompt_flat, draft_rows, draft_tokens, seen = [], [], [], [], [], [], set()
        for i, r in enumerate(requests):
            rid, drafts = r.request_id, getattr(r, "drafts", ())
            slot = self._slot.get(rid)
            if slot is None:
                slot = self._slot[rid] = self._free.pop() if self._free else self._take_new_slot()
                self._counted[rid] = 0
                fresh.append(slot)
            slots.append(slot)
            draft_rows += [i] * len(drafts)
            draft_tokens += drafts
            if rid in seen:   # a verify chunk's rows share their request's committed output
                continue
            seen.add(rid)
            output = r.output_token_ids
            committed = len(output) - len(drafts)
            new_flat += [slot * vocab + t for t in output[self._counted[rid]:committed]]
            self._counted[rid] = committed
            if with_prompt and rid not in self._with_prompt:
                self._with_prompt.add(rid)
                prompt_flat += [slot * vocab + t for t in r.prompt_token_ids if 0 <= t < vocab]
        values.ids("penalty_slots", slots)
        values.ids("penalty_fresh", fresh)
        values.ids("penalty_new", new_flat)
        values.floats("penalty_ones", [1.0] * max(len(new_flat), len(draft_rows)))
        values.ids("penalty_prompt", prompt_flat)
        values.ids("penalty_draft_flat", [r * vocab + t for r, t in zip(draft_rows, draft_tokens, strict=True)])

    def _take_new_slot(self) -> int:
        if self._num_slots == self.capacity:   # the scheduler runs at most `capacity` requests at once
            raise RuntimeError(f"more than {self.capacity} penalised requests hold a penalty slot at once: "
                               "one that ended or was preempted kept its slot")
        self._num_slots += 1
        return self._num_slots - 1

    def rows(self, dev: dict[str, torch.Tensor], vocab: int, with_prompt: bool
             ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Device side of `plan`: (prompt bitmask [R, vocab] bool or None, output counts [R, vocab]
        float32) of its rows, the tables updated first."""
        device = dev["penalty_slots"].device
        if self._counts is None:
            self._counts = torch.zeros(self.capacity, vocab, dtype=torch.float32, device=device)
        if with_prompt and self._prompt is None:   # from then on every slot has its row in both tables
            self._prompt = torch.zeros(self.capacity, vocab, dtype=torch.bool, device=device)
        fresh = dev["penalty_fresh"]
        if fresh.numel():   # a reused slot starts empty
            self._counts.index_fill_(0, fresh, 0.0)
            if self._prompt is not None:
                self._prompt.index_fill_(0, fresh, False)
        ones = dev["penalty_ones"]
        if (new := dev["penalty_new"]).numel():
            self._counts.view(-1).index_add_(0, new, ones[:new.numel()])
        if (prompt_flat := dev["penalty_prompt"]).numel():
            self._prompt.view(-1).index_fill_(0, prompt_flat, True)
        slots = dev["penalty_slots"]
        counts = self._counts.index_select(0, slots)
        if (drafts := dev["penalty_draft_flat"]).numel():
            counts.view(-1).index_add_(0, drafts, ones[:drafts.numel()])
        return (self._prompt.index_select(0, slots) if with_prompt else None), counts

    def free(self, request_id: str) -> None:
        slot = self._slot.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)
        self._counted.pop(request_id, None)
        self._with_prompt.discard(request_id)


class Adjustments:
    """The logit bias, min_tokens and penalties a step's rows ask for: planned on the host into
    `values` at construction, applied on the device by `apply` once `values` are there."""

    def __init__(self, values: RowValues, requests: Sequence, params: Sequence[SamplingParams],
                 eos_token_ids: Sequence[int], state: PenaltyState, vocab: int):
        """`requests`: the step's rows (a `StepRows`, or rows one by one); `params[c]`: chunk c's."""
        self.state, self.vocab = state, vocab
        rows = StepRows.of(requests)
        biased, short, penalised = [], [], []   # one pass over the chunks; a chunk's rows share its parameters
        for c, p in enumerate(params):
            if p.logit_bias:
                biased.append(c)
            if p.min_tokens and len(rows.requests[c].output_token_ids) < p.min_tokens:   # its rows' are >= its
                short.append(c)
            if p.has_penalties:
                penalised.append(c)
        self.bias = bool(biased)
        if self.bias:
            bias_rows = [(r, params[c].logit_bias) for c in biased for r in range(rows.starts[c], rows.starts[c + 1])]
            values.ids("bias_rows", [r for r, bias in bias_rows for _ in bias])
            values.ids("bias_tokens", [t for _, bias in bias_rows for t, _ in bias])
            values.floats("bias_values", [b for _, bias in bias_rows for _, b in bias])
        if short:   # rows whose output (a verify row's: with the drafts before it) is below min_tokens
            min_tokens = np.zeros(len(params), dtype=np.int64)
            min_tokens[short] = [params[c].min_tokens for c in short]
            short = np.flatnonzero(rows.output_lengths() < min_tokens[rows.chunk_of_row])
        self.min_tokens = bool(len(short) and eos_token_ids)
        if self.min_tokens:
            values.ids("min_tokens_rows", short)
            values.ids("eos_ids", list(eos_token_ids))
        self.penalties, self.repetition = bool(penalised), False
        if self.penalties:
            chunks = np.zeros(len(params), dtype=bool)
            chunks[penalised] = True
            index = rows.rows_where(chunks)
            by_row = [params[c] for c in rows.chunk_of_row[index].tolist()]   # each penalised row's parameters
            self.repetition = any(p.repetition_penalty != 1.0 for p in by_row)
            values.ids("penalised_rows", index)
            values.floats("repetition", [p.repetition_penalty for p in by_row])
            values.floats("frequency", [p.frequency_penalty for p in by_row])
            values.floats("presence", [p.presence_penalty for p in by_row])
            state.plan(values, [rows[r] for r in index.tolist()], vocab, self.repetition)

    @property
    def any(self) -> bool:
        return self.bias or self.min_tokens or self.penalties

    def apply(self, logits: torch.Tensor, dev: dict[str, torch.Tensor]) -> None:
        """In place, on `logits` [N, vocab]: bias, then min_tokens, then penalties."""
        if self.bias:
            logits.index_put_((dev["bias_rows"], dev["bias_tokens"]), dev["bias_values"].to(logits.dtype),
                              accumulate=True)
        if self.min_tokens:
            logits[dev["min_tokens_rows"].unsqueeze(1), dev["eos_ids"].unsqueeze(0)] = float("-inf")
        if self.penalties:
            self._apply_penalties(logits, dev)

    def _apply_penalties(self, logits: torch.Tensor, dev: dict[str, torch.Tensor]) -> None:
        prompt, counts = self.state.rows(dev, self.vocab, self.repetition)
        index = dev["penalised_rows"]
        sub = logits.index_select(0, index)
        if self.repetition:
            rep = dev["repetition"].unsqueeze(1)
            seen = prompt | (counts > 0)
            sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub = sub - dev["frequency"].unsqueeze(1) * counts - dev["presence"].unsqueeze(1) * (counts > 0)
        logits.index_copy_(0, index, sub.to(logits.dtype))
