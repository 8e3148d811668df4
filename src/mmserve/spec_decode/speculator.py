"""Speculative decoding with Gemma 4's assistant: who speculates, drafting, greedy acceptance.

After a step, every request that sampled and speculates gets K drafts from the assistant
(model/assistant.py) in one tight batched loop: the keys it reads (the target's K/V of its storing
layers, positions before the token drafted from) are gathered once, and the K steps share them and
one constant position, so they need no scheduling and no metadata. The next step verifies
`[last token, d1..dK]` as one chunk of K + 1 rows; greedy acceptance keeps the longest prefix of
drafts equal to the target's argmax, plus the target's own next token: the same tokens as
without speculation, up to K + 1 per step. A random request's chunk is accepted the same way,
against its rows' draws (`sample/rejection_sampler.py`: rejection sampling for a one-hot draft,
the target's distribution exactly).

Every request speculates except those that opt out (`disable_speculation`): they decode one token
per step, as before. Penalties, min_tokens, logit_bias and a grammar's mask apply to each verify
row as if its drafts were already output (`verify.VerifyRow`); a constrained request's drafts are masked
by its grammar as they are drafted (structured_output.DraftMasks); logprobs of a verify chunk's
tokens are each token's under the target's row that scored it.

Under tensor parallelism the draft loop (`Speculator.draft`) runs on every rank over its shards of
the assistant and of the target's K/V: rank 0 turns the round into a `DraftBatch` of plain data,
its runner broadcasts it (`on_ranks`), and each rank reads its own copy of the step's hidden states
(replicated by the final all-reduce) by row. The logits each rank takes the argmax of are the same
all-gathered bits everywhere, so every rank feeds the same drafts to its next step. Grammar masks
are rank 0's alone: a round that masks some request's drafts (`DraftBatch.masked`) takes each
draft step's tokens from rank 0 (one broadcast of R ids per draft step).

Async scheduling (`propose_on_device`): a round starts before the step's tokens reach the host, so
it takes each request's token, hidden-state row and key count from the device's acceptance
(sample/rejection_sampler.accept_on_device) and leaves its drafts there for the next step's
inputs; the host learns them with the step's tokens. Its drafts are not masked by a grammar (the
matchers have not seen the step's tokens yet): the target's masked rows reject what the grammar
refuses, so a constrained request keeps its tokens and may keep fewer drafts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from mmserve.attention.backend import LayerAttentionSpec
from mmserve.attention.buffers import to_device
from mmserve.core.kv_cache.manager import KVCacheManager
from mmserve.model.assistant import Assistant, gather_shared_kv, load_assistant
from mmserve.model.assistant_spec import storing_layers
from mmserve.request import Request
from mmserve.structured_output.manager import DraftMasks, StructuredOutput


@dataclass
class DraftFrom:
    """One request to draft for: `token` (its last, not yet computed) at position `num_keys`, and
    the row of the step's hidden states (`StepResult.hidden`) that produced it."""

    request: Request
    token: int
    row: int
    num_keys: int
    num_drafts: int


@dataclass
class DraftBatch:
    """One drafting round as plain data: everything a rank needs beside its own shards and its own
    copy of the step's hidden states (tensor parallelism broadcasts it to every rank)."""

    tokens: list[int]
    rows: list[int]
    num_keys: list[int]
    num_drafts: list[int]
    block_tables: dict[str, list[list[int]]]   # per layer type the assistant reads, per item
    block_size: int
    masked: bool = False   # rank 0 masks some item's drafts by its grammar: every rank takes its tokens


def _run_here(batch: DraftBatch, loop: Callable[[], list[list[int]]]) -> list[list[int]]:
    return loop()


class Speculator:
    def __init__(self, assistant: Assistant, target, num_tokens: int):
        self.assistant = assistant
        self.target = target
        self.num_tokens = num_tokens
        self.stores = storing_layers(target.spec)
        # per draft position: drafts verified, drafts accepted (acceptance rate = accepted / verified)
        self.verified = [0] * num_tokens
        self.accepted = [0] * num_tokens
        # runs a round's loop on every rank: here alone, or (tensor parallelism) rank 0's runner
        # broadcasting the batch to the workers first (executor/tensor_parallel.py sets it)
        self.on_ranks: Callable[[DraftBatch, Callable[[], list[list[int]]]], list[list[int]]] = _run_here

    def record(self, num_drafts: int, num_accepted: int) -> None:
        for i in range(num_drafts):
            self.verified[i] += 1
            self.accepted[i] += i < num_accepted

    @classmethod
    def load(cls, path: str, target, num_tokens: int) -> Speculator:
        """The assistant at `path` for `target` (a rank's shard of it under tensor parallelism: the
        assistant is sharded by the same group)."""
        assistant = load_assistant(path, target.decoder.spec, dtype=target.dtype, device=target.device,
                                   parallel=target.parallel)
        return cls(assistant, target, num_tokens)

    def kv_specs(self, specs: dict[str, LayerAttentionSpec]) -> dict[str, LayerAttentionSpec]:
        """The target's attention specs with each window wide enough for the assistant too: its sliding
        layers read window + 1 keys before the token drafted from, which sliding-window freeing must keep."""
        out = dict(specs)
        for t, attn in self.assistant.spec.attention.items():
            if attn.window is not None and specs[t].window is not None:
                out[t] = dataclasses.replace(specs[t], window=max(specs[t].window, attn.window + 1))
        return out

    def num_drafts(self, request: Request) -> int:
        """Drafts worth making: never more than the tokens the request may still emit after the next one."""
        left = request.sampling_params.max_tokens - len(request.output_token_ids) - 1
        return max(0, min(self.num_tokens, left))

    def propose(self, items: list[DraftFrom], kv: KVCacheManager, kv_caches: list[torch.Tensor],
                block_size: int, *, hidden: torch.Tensor, grammar: StructuredOutput | None = None
                ) -> list[list[int]]:
        """Greedy drafts for each item (num_drafts of them, fewer where its grammar ends them), all
        items batched in every draft step; `hidden`: the step's hidden states (StepResult.hidden),
        which the items' rows index; `grammar` masks the constrained items' drafts (on rank 0)."""
        if not items:
            return []
        tables = {t: [kv.block_table(i.request.request_id, t) for i in items]
                  for t in self.stores if t in self.assistant.spec.attention}
        batch = DraftBatch([i.token for i in items], [i.row for i in items], [i.num_keys for i in items],
                           [i.num_drafts for i in items], tables, block_size)
        masks = grammar.draft_masks([i.request.request_id for i in items], batch.num_drafts) if grammar else None
        batch.masked = masks is not None
        return self.on_ranks(batch, lambda: self.draft(batch, hidden, kv_caches, masks))

    @torch.inference_mode()
    def propose_on_device(self, requests: list[Request], tokens: torch.Tensor, rows: torch.Tensor,
                          shift: torch.Tensor, kv: KVCacheManager, kv_caches: list[torch.Tensor], block_size: int,
                          *, hidden: torch.Tensor) -> torch.Tensor:
        """K unmasked drafts for each request, left on the device ([R, K]): drafted from `tokens`
        (each request's token after its kept drafts) at `rows` of the step's `hidden`, over keys
        up to its `num_computed_tokens` less `shift` (the positions the host counted and the
        device's acceptance did not keep). Nothing here waits for the device."""
        device = self.target.device
        num_keys = [r.num_computed_tokens for r in requests]
        shared = {t: gather_shared_kv(kv_caches[self.stores[t]], [kv.block_table(r.request_id, t) for r in requests],
                                      num_keys, self.assistant.spec.attention[t].window, block_size, shift)
                  for t in self.stores if t in self.assistant.spec.attention}
        positions = to_device(np.asarray(num_keys, dtype=np.int64), device) - shift
        drafted = self._loop(tokens, hidden.index_select(0, rows), self.assistant.rope(positions, self.target.dtype),
                             shared, self.num_tokens)
        return torch.stack(drafted, dim=1)

    def _loop(self, tokens: torch.Tensor, hidden: torch.Tensor, rope: dict, shared: dict, steps: int,
              masks: DraftMasks | None = None, masked: bool = False) -> list[torch.Tensor]:
        """`steps` batched draft steps from `tokens` and `hidden`: each step's tokens (masked by
        `masks`, and rank 0's under tensor parallelism when `masked`)."""
        drafted = []
        for step in range(steps):
            logits, hidden = self.assistant.step(self.target.decoder.embed(tokens, None, None), hidden, rope, shared)
            if masks is not None:
                masks.apply(logits)
            tokens = logits.argmax(dim=-1)
            if masked:   # only rank 0 applied the masks: its tokens are the drafts
                tokens = self.target.parallel.broadcast(tokens)
            drafted.append(tokens)
            if masks is not None:   # a host sync per draft step, only when some item is constrained
                masks.advance(step, tokens.tolist())
        return drafted

    @torch.inference_mode()
    def draft(self, batch: DraftBatch, hidden: torch.Tensor, kv_caches: list[torch.Tensor],
              masks: DraftMasks | None = None) -> list[list[int]]:
        """The draft loop, on every rank: `hidden` and `kv_caches` are this rank's (its step's hidden
        states, its shard of the K/V); `masks` (rank 0's) the constrained items' grammar."""
        device = self.target.device
        shared = {t: gather_shared_kv(kv_caches[self.stores[t]], tables, batch.num_keys,
                                      self.assistant.spec.attention[t].window, batch.block_size)
                  for t, tables in batch.block_tables.items()}
        rope = self.assistant.rope(torch.tensor(batch.num_keys, device=device), self.target.dtype)
        tokens = torch.tensor(batch.tokens, device=device)
        hidden = hidden[torch.tensor(batch.rows, device=hidden.device)]
        lengths = batch.num_drafts
        try:
            drafted = self._loop(tokens, hidden, rope, shared, max(lengths), masks, batch.masked)
        finally:
            if masks is not None:
                masks.rollback()
                lengths = masks.lengths
        rows = torch.stack(drafted, dim=1).tolist()
        return [row[:n] for row, n in zip(rows, lengths, strict=True)]
