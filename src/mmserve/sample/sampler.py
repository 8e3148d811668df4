"""Token sampling for one step's rows: logit adjustments, grammar masks, greedy/temperature/top-k/top-p,
and logprobs, batched on the logits' device.

Grammar masks (structured output) are filled on the host first, before anything waits on the
device, so on a GPU that work overlaps the step's forward pass. A row whose grammar cannot go on
comes back in `SamplerOutput.errors`: the core ends that request alone.

An unseeded row takes argmax(probs / noise) with exponential noise (an exact draw from probs; the
scale of probs does not matter, so the top-k/top-p filters need no renormalisation); all unseeded
rows draw their noise together from one generator (one kernel for the batch). A seeded row at
output position j inverts its distribution's CDF at one uniform, a counter-based hash of (seed, j)
(`position_seed`, splitmix64) computed on the host and sent with the step's values: every seeded row
of the step is drawn in the same few batched ops (a float64 cumsum and a search), so its tokens depend
neither on its batch-mates, their order, nor on how many rows a step gave it (speculation's verify
chunks, preemption). (Hashing (seed, j, vocab index) into noise, as SGLang does, takes ~40 unfused
elementwise passes over [seeded rows, vocab]: far more device traffic than one cumsum.) A seed
reproduces its tokens within a version of mmserve, as in vLLM (docs/api.md).

Speculative decoding needs no second draw: row j of a verify chunk is sampled like a plain step
at that position, and a greedy draft is kept exactly when its row's draw equals it (the core's
`accepted_prefix`, as for greedy requests). That is rejection sampling for a one-hot draft: kept
with probability p(d), and when not, the row's token is a draw from p conditioned on not being d,
the residual. So the target's distribution is kept exactly, and a seeded request gives the same
tokens with speculation on and off.

Top-k takes `torch.topk` of the largest k asked for (a sort of k values, not of the vocabulary);
top-p finds each row's nucleus threshold by searching float32 bit patterns (monotone for
non-negative floats; sample/nucleus.py): no sort, no host sync, one Triton launch on CUDA.

Nothing here waits for the device (so the async loop queues a step's sampling while the next
forward runs, whatever its rows ask for): per-row parameters and row indices go to the device in
one packed, pinned, non-blocking copy a step (`row_values.RowValues`), rows are gathered with those device indices
(`index_select`/`index_copy_`, never a device tensor indexed with a host list, which copies from
pageable memory and waits for the stream), and tokens and logprobs come back in one pinned copy.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from mmserve.attention.buffers import HostCopy
from mmserve.errors import MMServeError
from mmserve.ipc.protocol import TokenLogprobs
from mmserve.sample.logprobs import logprob_table, read_logprobs
from mmserve.sample.nucleus import filter_nucleus
from mmserve.sample.penalties import Adjustments, PenaltyState
from mmserve.sample.row_values import RowValues
from mmserve.spec_decode.verify import StepRows
from mmserve.structured_output.manager import StepMasks, StructuredOutput, apply_bitmask

_MASK64 = 2**64 - 1
_UNIFORM_BITS = 52   # a seeded row's uniform: the top 52 of position_seed's 63 bits (exact in float64)


def position_seed(seed: int, position: int) -> int:
    """The generator seed of a seeded request's draw at output position `position`: splitmix64 of
    both, so nearby positions and seeds give unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1


def mask_top_k(logits: torch.Tensor, top_k: torch.Tensor, k_max: int) -> torch.Tensor:
    """logits [N, V], top_k [N] (0 or >= V: off), k_max: the largest k a row asks for (< V) -> logits
    with everything below each row's k-th largest set to -inf (ties with it stay)."""
    largest = torch.topk(logits, k_max, dim=-1).values   # sorted: k_max values per row, not V
    on = (top_k > 0) & (top_k < logits.shape[-1])
    kth = largest.gather(1, (top_k.clamp(1, k_max) - 1).unsqueeze(1))
    return logits.masked_fill(on.unsqueeze(1) & (logits < kth), float("-inf"))


def inverse_cdf(probs: torch.Tensor, uniform_bits: torch.Tensor) -> torch.Tensor:
    """probs [S, V] (each row's filtered distribution, up to its scale), uniform_bits int64 [S] (52
    random bits each) -> [S] tokens: the first token whose cumulative mass reaches u * total with
    u = (bits + 1/2) / 2^52 in (0, 1), an exact draw from each row. Float64 sums keep a token of mass
    1e-12 its share; a zero-mass token is never the first to reach the threshold. A row of NaN (the
    softmax of a row with every token masked: a dead grammar's, whose row is void already) reaches
    no threshold and gets V - 1: an id the logprob gather can read, never V (past the vocabulary)."""
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)   # read once as float32, summed in float64
    threshold = uniform_bits.double().add_(0.5).mul_(2.0 ** -_UNIFORM_BITS).mul_(cdf[:, -1])
    return torch.searchsorted(cdf, threshold.unsqueeze(1)).squeeze(1).clamp_(max=probs.shape[-1] - 1)


class Draws:
    """The random rows of a step: their filters (temperature, top-k, top-p) and their seeds' uniforms,
    planned on the host into the step's `RowValues`, then drawn on the device (`filtered_probs`,
    `tokens`) in a fixed number of ops whatever the number of rows."""

    def __init__(self, values: RowValues, requests: Sequence, vocab: int):
        self.requests = list(requests)
        params = [r.sampling_params for r in self.requests]
        values.floats("temperature", [p.temperature for p in params])
        self.k_max = max((p.top_k for p in params if 0 < p.top_k < vocab), default=0)
        if self.k_max:
            values.ids("top_k", [p.top_k for p in params])
        nucleus_rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
        self.nucleus = bool(nucleus_rows)
        if self.nucleus:
            values.ids("nucleus_rows", nucleus_rows)
            values.floats("top_p", [params[i].top_p for i in nucleus_rows])
        seeded = [i for i, p in enumerate(params) if p.seed is not None]
        self.seeded = bool(seeded)
        if self.seeded:
            values.ids("seeded_rows", seeded)
            values.ids("uniform_bits", [position_seed(params[i].seed, len(self.requests[i].output_token_ids))
                                        >> (63 - _UNIFORM_BITS) for i in seeded])

    def filtered_probs(self, logits: torch.Tensor, dev: dict[str, torch.Tensor]) -> torch.Tensor:
        """softmax(logits / temperature) with each row's top-k, then top-p, filter applied (zeros
        outside; rows are not renormalised): the distribution a random row draws from, up to its scale."""
        scaled = logits / dev["temperature"].to(logits.dtype).unsqueeze(1)
        if self.k_max:
            scaled = mask_top_k(scaled, dev["top_k"], self.k_max)
        probs = torch.softmax(scaled, dim=-1)
        if self.nucleus:
            filter_nucleus(probs, dev["nucleus_rows"], dev["top_p"])
        return probs

    def tokens(self, probs: torch.Tensor, dev: dict[str, torch.Tensor], generator: torch.Generator) -> torch.Tensor:
        """One draw per row from `probs` ([rows, V], `filtered_probs`): unseeded rows race exponential
        noise from `generator` (one call for all), argmax(probs / noise); seeded rows invert their CDF
        at their (seed, output position)'s uniform (`inverse_cdf`), all in the same few ops."""
        noise = torch.empty_like(probs).exponential_(generator=generator)
        tokens = (probs / noise).argmax(dim=-1)
        if self.seeded:
            index = dev["seeded_rows"]
            tokens.index_copy_(0, index, inverse_cdf(probs.index_select(0, index), dev["uniform_bits"]))
        return tokens


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)   # per row; None where not asked
    errors: dict[int, MMServeError] = field(default_factory=dict)   # row -> why its token is void


@dataclass
class _Plan:
    """A step's sampling as the host planned it (`Sampler._plan`), for its device ops (`Sampler._queue`)."""

    rows: StepRows
    values: RowValues
    adjust: Adjustments
    masks: StepMasks | None
    draws: Draws | None
    want_lp: list[int]   # the rows that asked for logprobs
    num_top: list[int]   # ... and the alternatives each asked for


class PendingSample:
    """A step's tokens drawn on the device (`tokens`), on their way to the host with the logprobs
    asked for (float64 holds the ids exactly) in one pinned, non-blocking transfer; `result()` waits
    for that transfer's event, not for whatever the device queued after it."""

    def __init__(self, sampler: Sampler, requests: Sequence, tokens: torch.Tensor, table: torch.Tensor | None,
                 want_lp: list[int], num_top: list[int], masks: StepMasks | None):
        self.sampler, self.requests, self.tokens = sampler, requests, tokens
        self._table_shape = None if table is None else table.shape
        self._want_lp, self._num_top, self._masks = want_lp, num_top, masks
        self._copy = HostCopy(tokens if table is None else torch.cat([tokens.double(), table.flatten()]))

    def result(self) -> SamplerOutput:
        host = self._copy.result()
        n = len(self.requests)
        out = SamplerOutput([], [None] * n)
        if self._want_lp:
            out.token_ids = host[:n].long().tolist()
            lps = read_logprobs(host[n:].view(self._table_shape), [out.token_ids[i] for i in self._want_lp],
                                self._num_top)
            for i, lp in zip(self._want_lp, lps, strict=True):
                out.logprobs[i] = lp
        else:
            out.token_ids = host.tolist()
        if self._masks is not None:   # last: advancing the matchers is the only state a sample changes (never raises)
            rows, out.errors = self._masks.rows, self._masks.dead
            live = [k for k, i in enumerate(rows) if i not in out.errors and not hasattr(self.requests[i], "drafts")]
            refused = self.sampler.grammar.accept([self._masks.matchers[k] for k in live],
                                                  [self.requests[rows[k]] for k in live],
                                                  [out.token_ids[rows[k]] for k in live])
            out.errors.update({rows[live[j]]: error for j, error in refused.items()})
        return out


class Sampler:
    def __init__(self, seed: int = 0, eos_token_ids: Sequence[int] = (), grammar: StructuredOutput | None = None,
                 max_num_seqs: int = 64):
        """`max_num_seqs`: the most requests running at once (the penalty tables' rows)."""
        self._seed = seed
        self._batch_generators: dict[torch.device, torch.Generator] = {}   # every unseeded row's noise
        self.penalties = PenaltyState(max_num_seqs)
        self.eos_token_ids = tuple(eos_token_ids)
        self.grammar = grammar

    def sample(self, logits: torch.Tensor, requests: Sequence) -> SamplerOutput:
        """logits float32 [N, V] (row i for requests[i], scheduler Requests or a verify chunk's
        `VerifyRow`s) -> one token per row. Matchers advance past plain rows' tokens; a verify
        chunk's advance over the tokens the core accepts (`accept_verified`)."""
        return self.launch(logits, requests).result()

    def launch(self, logits: torch.Tensor, requests: Sequence) -> PendingSample:
        """`sample`'s device work, queued without waiting for it: the tokens stay on the device (the
        next step's inputs can take them there, async scheduling) and start their one transfer to
        the host; `PendingSample.result()` waits for that transfer alone and finishes on the host.

        Everything per row is gathered on the host first (the grammar's masks; the indices and
        parameters into one `RowValues`, sent in one copy), then a fixed sequence of batched ops
        runs on the device (`_queue`): the number of ops does not grow with the rows."""
        plan = self._plan(requests, logits.shape[-1])
        dev = plan.values.to(logits.device)   # the step's one copy of per-row values
        tokens, table = self._queue(logits, plan, dev)
        return PendingSample(self, plan.rows, tokens, table, plan.want_lp, plan.num_top, plan.masks)

    def _plan(self, requests: Sequence, vocab: int) -> _Plan:
        """The host's part of a step's sampling: per chunk (a verify chunk's 1 + K rows share its
        request's parameters), repeated over its rows with numpy."""
        rows = StepRows.of(requests)
        params = [r.sampling_params for r in rows.requests]
        logprob_rows = rows.rows_where(np.array([p.num_logprobs is not None for p in params], dtype=bool))
        random_rows = rows.rows_where(np.array([not p.greedy for p in params], dtype=bool))
        masks = self.grammar.fill(rows) if self.grammar is not None else None
        values = RowValues()
        values.ids("logprob_rows", logprob_rows)
        adjust = Adjustments(values, rows, params, self.eos_token_ids, self.penalties, vocab)
        if masks is not None:
            values.ids("mask_rows", masks.rows)
            values.words("mask_words", masks.bitmask.numpy())
        values.ids("random_rows", random_rows)
        draws = Draws(values, [rows[i] for i in random_rows.tolist()], vocab) if len(random_rows) else None
        num_top = [params[c].num_logprobs for c in rows.chunk_of_row[logprob_rows].tolist()] if len(logprob_rows) else []
        return _Plan(rows, values, adjust, masks, draws, logprob_rows.tolist(), num_top)

    def _queue(self, logits: torch.Tensor, plan: _Plan, dev: dict[str, torch.Tensor]
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The device's part: a fixed sequence of batched ops over every row -> the tokens [rows] and
        the logprob table of the rows that asked (or None)."""
        raw = logits.index_select(0, dev["logprob_rows"]) if plan.want_lp else None   # a copy: adjustments never touch it
        final = logits.clone() if plan.adjust.any or plan.masks is not None else logits
        plan.adjust.apply(final, dev)
        if plan.masks is not None:
            apply_bitmask(final, dev["mask_rows"], dev["mask_words"])
        tokens = final.argmax(dim=-1)
        if plan.draws is not None:
            index = dev["random_rows"]
            tokens.index_copy_(0, index, self._draw(final.index_select(0, index), plan.draws, dev))
        table = (logprob_table(raw, tokens.index_select(0, dev["logprob_rows"]), max(plan.num_top))
                 if plan.want_lp else None)
        return tokens, table

    def accept_verified(self, request, tokens: Sequence[int]) -> MMServeError | None:
        """Advance a verify chunk's grammar over the tokens accepted from it; why not, if it cannot."""
        return None if self.grammar is None else self.grammar.advance(request, tokens)

    def _draw(self, logits: torch.Tensor, draws: Draws, dev: dict[str, torch.Tensor]) -> torch.Tensor:
        """One draw per random row from its filtered distribution."""
        probs = draws.filtered_probs(logits, dev)
        return draws.tokens(probs, dev, self._generator(probs.device))

    def _generator(self, device: torch.device) -> torch.Generator:
        gen = self._batch_generators.get(device)
        if gen is None:
            gen = self._batch_generators[device] = torch.Generator(device=device).manual_seed(self._seed)
        return gen

    def grammar_complete(self, request_id: str) -> bool:
        """False when the request has a response_format that its output does not complete yet."""
        return self.grammar is None or self.grammar.is_complete(request_id)

    def preempted(self, request_id: str) -> None:
        """A preempted request gives its penalty slot back (its grammar's state stays: it resumes)."""
        self.penalties.free(request_id)

    def free(self, request_id: str) -> None:
        self.penalties.free(request_id)
        if self.grammar is not None:
            self.grammar.free(request_id)
