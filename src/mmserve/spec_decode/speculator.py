"""Speculative decoding with Gemma 4's assistant: who speculates, drafting, greedy acceptance.

After a step, every request that sampled and speculates gets K drafts from the assistant
(model/assistant.py) in one tight batched loop: the keys it reads (the target's K/V of its storing
layers, positions before the token drafted from) are read in place through the target's attention
backends, with one decode-shaped metadata per layer type built once per round (`TargetKVReader`),
and the K steps share it and one constant position, so they need no scheduling; where the target's
steps run as graphs, the K steps are one graph per batch-size bucket (draft_graphs.py). The next step verifies
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
inputs; the host learns them with the step's tokens. Under tensor parallelism the round goes to
the other ranks as a `DeviceDraftRound` (key counts, request ids) and the acceptance follows by one
device broadcast (`draft_on_device`), from which every rank also builds the next step's inputs
(`next_step_inputs`): its own drafts are rank 0's, being the argmax of the same all-gathered
logits (executor/step_messages.HeldOutcome checks it). Its drafts are not masked by a grammar (the
matchers have not seen the step's tokens yet): the target's masked rows reject what the grammar
refuses, so a constrained request keeps its tokens and may keep fewer drafts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from mmserve.attention import create_builder, create_impl, get_backend
from mmserve.attention.backend import CommonAttentionMetadata, LayerAttentionSpec, PoolConfig
from mmserve.attention.buffers import StagedBuffer, to_device
from mmserve.model.assistant import Assistant, TargetKV, load_assistant
from mmserve.model.assistant_spec import storing_layers
from mmserve.request import Request
from mmserve.spec_decode.draft_graphs import DraftGraphs

if TYPE_CHECKING:   # annotations only: a tensor-parallel worker rank need not import xgrammar
    from mmserve.structured_output.manager import DraftMasks, StructuredOutput
    from mmserve.worker.block_table import BlockTables


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
    request_ids: list[str]   # each rank reads their block tables from its own runner's (BlockTables)
    block_size: int
    masked: bool = False   # rank 0 masks some item's drafts by its grammar: every rank takes its tokens


@dataclass
class DeviceDraftRound:
    """An async drafting round as plain data (`Speculator.propose_on_device`): the step's sampled
    rows (`num_rows`), those that draft (`items`, row indices) with their keys as the host counts
    them and their request ids (each rank reads their block tables from its own runner's). The
    device's acceptance of every row (the token after what it kept, its hidden-state row, the
    shift) stays on rank 0's device and reaches the other ranks by one broadcast
    (`Speculator.draft_on_device`), from which every rank also builds the next step's inputs
    itself: that broadcast is the step's only one."""

    num_rows: int
    items: list[int]
    num_keys: list[int]
    request_ids: list[str]
    block_size: int


def next_step_inputs(next_token: torch.Tensor, num_drafts: int, index: torch.Tensor | None = None,
                     drafts: torch.Tensor | None = None) -> torch.Tensor:
    """The next step's inputs after a speculating step [S, 1 + num_drafts]: each sampled row's token
    after what it kept, then the drafts made from it (`drafts` [D, K] for the rows in `index`, or
    for every row without one), zeros for rows that made none. Built by this one function on every
    rank, so under tensor parallelism the workers' copy (from rank 0's acceptance and their own
    drafts) is rank 0's."""
    shape = (next_token.shape[0], 1 + num_drafts)
    if drafts is not None and index is None:   # every row drafted (the usual step): every entry written below
        tokens = torch.empty(shape, dtype=torch.int64, device=next_token.device)
        tokens[:, 1:] = drafts
    else:
        tokens = torch.zeros(shape, dtype=torch.int64, device=next_token.device)
        if drafts is not None:
            tokens[:, 1:].index_copy_(0, index, drafts)
    tokens[:, 0] = next_token
    return tokens


def _run_here(batch, loop: Callable[[], list[list[int]]]) -> list[list[int]]:
    return loop()


@dataclass
class _DraftLayerType:
    """One layer type the assistant reads: the target's backend for it, over the target's pool."""

    impl: object
    builder: object
    table: StagedBuffer     # [max_num_seqs, the runner's table width]: the round's block tables
    device_positions: bool  # its backend reads positions, context lengths and block tables on the device
    pool: tuple[int, int]   # (the cache's blocks, the table width) the builder was made for


class TargetKVReader:
    """The drafter's attention over the target's paged pools, read in place (no copies of the K/V).

    A drafting round is, to the attention backends, one decode step: request r's query row at
    position num_keys[r] - 1 over keys [0, num_keys[r]) (the drafted-from token itself is not in
    the cache; its position num_keys[r] only matters to RoPE, which the drafter applies itself),
    with the assistant's window + 1 as a sliding layer's window: it sees the last window + 1 keys.
    Per layer type the assistant reads, the target's backend for that type (after the runner's
    fallbacks) gives an implementation for this rank's assistant heads and a builder over the
    target's pool, made at the first round that reads a cache of its size (on CUDA the memory
    profile's rounds read the profiling runner's smaller pools, then serving's the serving ones;
    flex sizes its metadata by the pool); every round builds one metadata per type from persistent
    buffers, which its K draft steps share.

    The round's block tables are the runner's (worker/block_table.BlockTables), gathered by request
    row on the device into the reader's persistent tables: nothing per round grows with the context
    on the host, and no rank is sent a table. Which state of them a round reads, and why it is the
    one it needs (blocks for keys [0, num_keys - shift), the window's keys still held):
    - A runner row changes only when a step's `apply` takes the blocks the scheduler gave the
      request (and the window entries it released) when scheduling that step, and when the next
      step's `execute` (or `release`) frees the rows of requests that ended or were preempted. A
      rejected draft changes no table (`Scheduler.update` rolls back `num_computed_tokens` only).
      So from scheduling step X until scheduling X + 1, every request X scheduled has in the
      runner the table the KV manager holds for it (what the round read before this change).
    - Sync loop: schedule X, execute X (apply), sample, accept, update, then the round after X:
      it reads X's tables. Its keys, num_computed_tokens after X, were all allocated for X.
    - Async loop: schedule X, execute X (apply: its entries scattered on the stream before X's
      forward), finish X - 1 (requests that ended leave the round), queue X's sampling and the
      round after X (its gather queued after X's scatter), and only then schedule X + 1, whose
      apply and frees come after the round on the host and on the stream: the round reads X's
      tables too. Its keys num_keys - shift <= X's host end were allocated for X. X's scheduling
      released each window from the lowest position X's rows could run at on the device (the
      host's start less the rows X - 1 may reject: KVCacheManager._lowest_query), at most the
      round's position, keeping a window W >= assistant window + 1 (`Speculator.kv_specs`): every
      key the round's window reads.
    - Tensor parallelism: every rank applies the same steps and frees (`Released`) in the same
      order, so its runner's rows match rank 0's; the round names its request ids, and each rank
      reads its own rows after its own apply of X (the worker reads the step before the round).
    Entries past a request's blocks are the null block: rows only grow, and are zeroed when freed.
    """

    def __init__(self, assistant: Assistant, target, *, max_num_seqs: int, position_slack: int = 0):
        self.assistant, self.target = assistant, target
        self.max_num_seqs = max_num_seqs
        self.position_slack = position_slack   # async scheduling moves a round's positions back by up to this
        self.stores = storing_layers(target.spec)
        self.layer_types = [t for t in self.stores if t in assistant.spec.attention]
        device = target.device
        self.query_start_loc = StagedBuffer((max_num_seqs + 1,), torch.int32, device)
        self.seq_lens = StagedBuffer((max_num_seqs,), torch.int32, device)
        self.positions = StagedBuffer((max_num_seqs,), torch.int64, device)
        self.slot_mapping = StagedBuffer((max_num_seqs,), torch.int64, device)   # attend only: never written to
        self.query_start_loc.np[:] = np.arange(max_num_seqs + 1)
        self._types: dict[str, _DraftLayerType] = {}

    def _layer_type(self, t: str, kv_cache: torch.Tensor, block_size: int, width: int) -> _DraftLayerType:
        pool_shape = (kv_cache.shape[1], width)
        if t not in self._types or self._types[t].pool != pool_shape:
            attn = self.assistant.spec.attention[t]
            layer = self.assistant.model.layers[self.assistant.spec.layer_types.index(t)].self_attn
            window = None if attn.window is None else attn.window + 1
            spec = LayerAttentionSpec(t, layer.num_heads, kv_cache.shape[3], attn.head_dim, window=window,
                                      bidirectional=False, scale=1.0)
            backend = self.target.attention_backends[t]
            pool = PoolConfig(spec, num_blocks=kv_cache.shape[1], block_size=block_size,
                              max_num_tokens=self.max_num_seqs, max_num_reqs=self.max_num_seqs,
                              max_blocks_per_req=width, device=kv_cache.device, dtype=self.target.dtype,
                              position_slack=self.position_slack)
            table = StagedBuffer((self.max_num_seqs, width), torch.int32, kv_cache.device)
            self._types[t] = _DraftLayerType(create_impl(backend, spec), create_builder(backend, pool), table,
                                             get_backend(backend).device_positions, pool_shape)
        return self._types[t]

    def prepare(self, num_keys: Sequence[int], tables: BlockTables, rows: np.ndarray, block_size: int,
                kv_caches: list[torch.Tensor], *, shift: torch.Tensor | None = None) -> dict[str, TargetKV]:
        """The round's TargetKV per layer type the assistant reads: request r's keys [0, num_keys[r])
        through the runner's table row `rows[r]` (`tables`, `kv_caches`: this rank's); requests past
        `rows` are padding, reading the null block. With `shift` (async scheduling, on the device)
        request r has num_keys[r] - shift[r] keys: moved back on the device where every backend
        reads positions there, else read to the host first (a wait on CUDA). `positions` then holds
        each query's position."""
        R, n = len(num_keys), len(rows)
        if R > self.max_num_seqs:
            raise ValueError(f"a drafting round of {R} requests exceeds max_num_seqs ({self.max_num_seqs})")
        kinds = {t: self._layer_type(t, kv_caches[self.stores[t]], block_size, tables.max_blocks_per_req)
                 for t in self.layer_types}
        num_keys = np.asarray(num_keys, dtype=np.int64)
        if shift is not None and not all(kind.device_positions for kind in kinds.values()):
            num_keys, shift = num_keys - shift.cpu().numpy(), None
        self.seq_lens.np[:R] = num_keys
        self.positions.np[:R] = num_keys - 1
        qsl, seq_lens, positions = self.query_start_loc.push(R + 1), self.seq_lens.push(R), self.positions.push(R)
        if shift is not None:   # before any builder reads them (the host's counts stay an upper bound)
            seq_lens.sub_(shift.to(seq_lens.dtype))
            positions.sub_(shift)
        index = to_device(rows, tables.device)
        out = {}
        for t, kind in kinds.items():
            tables.gather(t, index, kind.table.dev[:n])
            if n < R:
                kind.table.dev[n:R].zero_()
            if kind.table.dev is not kind.table.cpu and not kind.device_positions:   # its builder reads the host's
                np.take(tables.rows[t], rows, axis=0, out=kind.table.np[:n])
                kind.table.np[n:R] = 0
            # (else, off a CPU, the host copy is never read: the backend plans from the device's)
            common = CommonAttentionMetadata(
                num_actual_tokens=R, num_reqs=R, max_query_len=1, max_seq_len=int(num_keys.max()),
                query_start_loc=qsl, seq_lens=seq_lens, positions=positions, block_table=kind.table.dev[:R],
                slot_mapping=self.slot_mapping.dev[:R], block_size=block_size, query_ranges=None,
                query_start_loc_cpu=self.query_start_loc.cpu[:R + 1], seq_lens_cpu=self.seq_lens.cpu[:R],
                positions_cpu=self.positions.cpu[:R], block_table_cpu=kind.table.cpu[:R], query_ranges_cpu=None)
            out[t] = TargetKV(kind.impl, kv_caches[self.stores[t]], kind.builder.build(common))
        return out


class Speculator:
    def __init__(self, assistant: Assistant, target, num_tokens: int, *, max_num_seqs: int = 64):
        self.assistant = assistant
        self.target = target
        self.num_tokens = num_tokens
        self.stores = storing_layers(target.spec)
        self.max_num_seqs = max_num_seqs
        self.use_graphs(None)
        # per draft position: drafts verified, drafts accepted (acceptance rate = accepted / verified)
        self.verified = [0] * num_tokens
        self.accepted = [0] * num_tokens
        # runs a round's loop on every rank: here alone, or (tensor parallelism) rank 0's runner
        # broadcasting the batch to the workers first (executor/tensor_parallel.py sets it)
        self.on_ranks: Callable[[DraftBatch | DeviceDraftRound, Callable], object] = _run_here

    def use_graphs(self, mode: str | None, *, max_num_seqs: int | None = None) -> None:
        """Run the K draft steps as one graph per batch-size bucket (spec_decode/draft_graphs.py):
        `mode` is the target's graph mode (worker/cuda_graphs.py: CUDA, emulated, or None: eager).
        The reader and the graphs are made anew for rounds of at most `max_num_seqs` requests (else
        as many as before): the engine passes the KV plan's, which may be fewer than the configured
        count the memory profile's round drafted for."""
        self.max_num_seqs = max_num_seqs or self.max_num_seqs
        self.attention = TargetKVReader(self.assistant, self.target, max_num_seqs=self.max_num_seqs,
                                        position_slack=self.num_tokens)
        self.graphs = DraftGraphs(self.attention, self.assistant, self._graph_loop, mode=mode,
                                  max_num_seqs=self.max_num_seqs, hidden_size=self.target.decoder.spec.hidden_size,
                                  dtype=self.target.dtype, device=self.target.device)

    def _graph_loop(self, tokens: torch.Tensor, hidden: torch.Tensor, rope: dict, target_kv: dict) -> torch.Tensor:
        return torch.stack(self._loop(tokens, hidden, rope, target_kv, self.num_tokens), dim=1)

    def _replayed(self, num_reqs: int, masked: bool, run: Callable[[], torch.Tensor | None]) -> torch.Tensor | None:
        """The round's drafts [R, K] from its bucket's graph, or None: it runs eagerly (counted, the
        reason logged once)."""
        reason = self.graphs.eager_reason(num_reqs, masked=masked)
        if reason is None:
            drafted = run()
            if drafted is not None:
                return drafted
            reason = f"capture failed: {self.graphs.failed}"
        self.graphs.count_eager(reason)
        return None

    def record(self, num_drafts: np.ndarray, num_accepted: np.ndarray) -> None:
        """A step's verify chunks: each one's drafts, and how many of them the target kept (position
        i counts the chunks with more than i: one histogram each, summed from the top)."""
        k = self.num_tokens
        for counter, values in ((self.verified, num_drafts), (self.accepted, num_accepted)):
            more_than = np.bincount(values, minlength=k + 1)[:0:-1].cumsum()[::-1].tolist()   # [i]: values > i
            for i in range(k):
                counter[i] += more_than[i]

    @classmethod
    def load(cls, path: str, target, num_tokens: int, *, max_num_seqs: int) -> Speculator:
        """The assistant at `path` for `target` (a rank's shard of it under tensor parallelism: the
        assistant is sharded by the same group); a round drafts for at most `max_num_seqs` requests."""
        assistant = load_assistant(path, target.decoder.spec, dtype=target.dtype, device=target.device,
                                   parallel=target.parallel)
        return cls(assistant, target, num_tokens, max_num_seqs=max_num_seqs)

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

    def propose(self, items: list[DraftFrom], tables: BlockTables, kv_caches: list[torch.Tensor],
                block_size: int, *, hidden: torch.Tensor, grammar: StructuredOutput | None = None
                ) -> list[list[int]]:
        """Greedy drafts for each item (num_drafts of them, fewer where its grammar ends them), all
        items batched in every draft step; `hidden`: the step's hidden states (StepResult.hidden),
        which the items' rows index; `tables`: the runner's block tables, after that step's;
        `grammar` masks the constrained items' drafts (on rank 0)."""
        if not items:
            return []
        ids = [i.request.request_id for i in items]
        batch = DraftBatch([i.token for i in items], [i.row for i in items], [i.num_keys for i in items],
                           [i.num_drafts for i in items], ids, block_size)
        masks = grammar.draft_masks(ids, batch.num_drafts) if grammar else None
        batch.masked = masks is not None
        return self.on_ranks(batch, lambda: self.draft(batch, hidden, kv_caches, tables, masks))

    def propose_on_device(self, requests: list[Request], items: list[int], tokens: torch.Tensor, rows: torch.Tensor,
                          shift: torch.Tensor, tables: BlockTables, kv_caches: list[torch.Tensor], block_size: int,
                          *, hidden: torch.Tensor) -> torch.Tensor:
        """The next step's inputs after an async speculating step, left on the device: per sampled row
        (the device's acceptance: `tokens`, each row's token after its kept drafts; `rows`, the row of
        the step's `hidden` that produced it; `shift`, the positions the host counted and the
        acceptance did not keep) its token, then K unmasked drafts for the rows `items` (those of
        `requests`, which speculate), drafted over keys up to each request's `num_computed_tokens`
        less its shift through the runner's block `tables` (after the step's): [S, 1 + K], the same
        on every rank under tensor parallelism (`on_ranks`). Nothing here waits for the device
        where the backends read positions there (`TargetKVReader.prepare`)."""
        batch = DeviceDraftRound(len(tokens), items, [r.num_computed_tokens for r in requests],
                                 [r.request_id for r in requests], block_size)
        return self.on_ranks(batch, lambda: self.draft_on_device(batch, hidden, kv_caches, tables,
                                                                 (tokens, rows, shift))[0])

    @torch.inference_mode()
    def draft_on_device(self, batch: DeviceDraftRound, hidden: torch.Tensor, kv_caches: list[torch.Tensor],
                        tables: BlockTables, accepted: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
        """An async round on this rank: the next step's inputs [S, 1 + K] (see `propose_on_device`)
        and the shift [S]. Rank 0 passes the acceptance (token, hidden-state row, shift per row);
        under tensor parallelism it is broadcast to the other ranks, which pass None and take both."""
        if self.target.parallel.size > 1:
            packed = (torch.stack(accepted).to(torch.int64) if accepted is not None
                      else torch.empty((3, batch.num_rows), dtype=torch.int64, device=hidden.device))
            accepted = self.target.parallel.broadcast(packed.contiguous()).unbind(0)
        tokens, rows, shift = accepted
        if len(batch.items) == batch.num_rows:   # every sampled row drafts (the usual step): no gather
            return next_step_inputs(tokens, self.num_tokens, None, self._drafts_on_device(
                batch, hidden, kv_caches, tables, tokens, rows, shift)), shift
        index = to_device(np.asarray(batch.items, dtype=np.int64), tokens.device)
        drafts = self._drafts_on_device(batch, hidden, kv_caches, tables, tokens.index_select(0, index),
                                        rows.index_select(0, index), shift.index_select(0, index))
        return next_step_inputs(tokens, self.num_tokens, index, drafts), shift

    def _drafts_on_device(self, batch: DeviceDraftRound, hidden: torch.Tensor, kv_caches: list[torch.Tensor],
                          tables: BlockTables, tokens: torch.Tensor, rows: torch.Tensor, shift: torch.Tensor
                          ) -> torch.Tensor:
        """The round's drafts [R, K] for its items: from `tokens` at `rows` of `hidden`, keys moved
        back by `shift`."""
        R = len(batch.num_keys)
        num_keys, table_rows = batch.num_keys, tables.rows_of(batch.request_ids)
        drafted = self._replayed(R, False, lambda: self.graphs.run(
            tokens, hidden.index_select(0, rows), num_keys, tables, table_rows, batch.block_size, kv_caches,
            shift=shift))
        if drafted is not None:
            return drafted
        target_kv = self.attention.prepare(num_keys, tables, table_rows, batch.block_size, kv_caches, shift=shift)
        positions = self.attention.positions.dev[:R] + 1   # the drafted-from tokens'
        drafted = self._loop(tokens, hidden.index_select(0, rows), self.assistant.rope(positions, self.target.dtype),
                             target_kv, self.num_tokens)
        return torch.stack(drafted, dim=1)

    def _loop(self, tokens: torch.Tensor, hidden: torch.Tensor, rope: dict, target_kv: dict, steps: int,
              masks: DraftMasks | None = None, masked: bool = False) -> list[torch.Tensor]:
        """`steps` batched draft steps from `tokens` and `hidden`: each step's tokens (masked by
        `masks`, and rank 0's under tensor parallelism when `masked`)."""
        drafted = []
        for step in range(steps):
            logits, hidden = self.assistant.step(self.target.decoder.embed(tokens, None, None), hidden, rope, target_kv)
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
    def draft(self, batch: DraftBatch, hidden: torch.Tensor, kv_caches: list[torch.Tensor], tables: BlockTables,
              masks: DraftMasks | None = None) -> list[list[int]]:
        """The draft loop, on every rank: `hidden`, `kv_caches` and `tables` are this rank's (its
        step's hidden states, its shard of the K/V, its runner's block tables); `masks` (rank 0's)
        the constrained items' grammar."""
        device = self.target.device
        tokens = torch.tensor(batch.tokens, device=device)
        hidden = hidden[torch.tensor(batch.rows, device=hidden.device)]
        lengths, table_rows = batch.num_drafts, tables.rows_of(batch.request_ids)
        drafted = self._replayed(len(lengths), masks is not None or batch.masked, lambda: self.graphs.run(
            tokens, hidden, batch.num_keys, tables, table_rows, batch.block_size, kv_caches))
        if drafted is not None:
            return [row[:n] for row, n in zip(drafted.tolist(), lengths, strict=True)]
        target_kv = self.attention.prepare(batch.num_keys, tables, table_rows, batch.block_size, kv_caches)
        rope = self.assistant.rope(torch.tensor(batch.num_keys, device=device), self.target.dtype)
        try:
            drafted = self._loop(tokens, hidden, rope, target_kv, max(lengths), masks, batch.masked)
        finally:
            if masks is not None:
                masks.rollback()
                lengths = masks.lengths
        rows = torch.stack(drafted, dim=1).tolist()
        return [row[:n] for row, n in zip(rows, lengths, strict=True)]
