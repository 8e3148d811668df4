"""Token sampling for one step's rows: logit adjustments, grammar masks, greedy/temperature/top-k/top-p,
and logprobs, batched on the logits' device.

Grammar masks (structured output) are filled on the host first, before anything waits on the
device, so on a GPU that work overlaps the step's forward pass. A row whose grammar cannot go on
comes back in `SamplerOutput.errors`: the core ends that request alone.
Random rows draw exponential noise from their request's own `torch.Generator` and take
argmax(probs / noise) (an exact draw from probs), so a seeded request samples the same tokens
whatever else shares its batch, and after preemption. The noise is the only per-row work.
A verify chunk of a random request (speculative decoding) is decided by rejection sampling
(`rejection_sampler.py`), from this sampler's generators and final logits.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from mmserve.errors import MMServeError
from mmserve.ipc.protocol import TokenLogprobs
from mmserve.sample.logprobs import logprob_table, read_logprobs
from mmserve.sample.penalties import apply_logit_bias, apply_min_tokens, apply_penalties
from mmserve.sampling_params import SamplingParams
from mmserve.structured_output.manager import StructuredOutput, apply_bitmask


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """logits [N, V], top_k [N] (0 = off), top_p [N] (1 = off) -> logits with everything outside each
    row's top-k / nucleus set to -inf. Ties with the k-th logit stay; the top token always stays."""
    vocab = logits.shape[-1]
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
    k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab).to(torch.int64)
    kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # drop a token when the mass before it already reaches top_p
    drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p.unsqueeze(1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)   # per row; None where not asked
    errors: dict[int, MMServeError] = field(default_factory=dict)   # row -> why its token is void


class PendingSample:
    """A step's tokens drawn on the device (`tokens`), on their way to the host through one pinned,
    non-blocking copy; `result()` waits for that copy (an event, not the whole device)."""

    def __init__(self, sampler: Sampler, requests: list, tokens: torch.Tensor, logprobs: torch.Tensor | None,
                 want_lp: list[int], masks):
        self.sampler, self.requests, self.tokens = sampler, requests, tokens
        self._want_lp, self._masks = want_lp, masks
        self._host, self._lp_host, self._copied = tokens, logprobs, None
        if tokens.is_cuda:
            self._host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self._host.copy_(tokens, non_blocking=True)
            if logprobs is not None:   # the same copy's wait covers them
                self._lp_host = torch.empty(logprobs.shape, dtype=logprobs.dtype, pin_memory=True)
                self._lp_host.copy_(logprobs, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record()

    def result(self) -> SamplerOutput:
        if self._copied is not None:
            self._copied.synchronize()
        params = [r.sampling_params for r in self.requests]
        out = SamplerOutput(self._host.tolist(), [None] * len(params))
        if self._want_lp:
            lps = read_logprobs(self._lp_host, [out.token_ids[i] for i in self._want_lp],
                                [params[i].num_logprobs for i in self._want_lp])
            for i, lp in zip(self._want_lp, lps, strict=True):
                out.logprobs[i] = lp
        if self._masks is not None:   # last: advancing the matchers is the only state a sample changes (never raises)
            rows, _, out.errors = self._masks
            live = [i for i in rows if i not in out.errors and not hasattr(self.requests[i], "drafts")]
            refused = self.sampler.grammar.accept([self.requests[i] for i in live], [out.token_ids[i] for i in live])
            out.errors.update({live[k]: error for k, error in refused.items()})
        return out


class Sampler:
    def __init__(self, seed: int = 0, eos_token_ids: Sequence[int] = (), grammar: StructuredOutput | None = None):
        self._seeds = random.Random(seed)
        self._generators: dict[str, torch.Generator] = {}
        self.eos_token_ids = tuple(eos_token_ids)
        self.grammar = grammar

    def generator(self, request_id: str, params: SamplingParams, device: torch.device) -> torch.Generator:
        gen = self._generators.get(request_id)
        if gen is None:
            seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
            gen = self._generators[request_id] = torch.Generator(device=device).manual_seed(seed % 2**64)
        return gen

    def sample(self, logits: torch.Tensor, requests: Sequence) -> SamplerOutput:
        """logits float32 [N, V] (row i for requests[i], scheduler Requests or a verify chunk's
        `VerifyRow`s) -> one token per row. Matchers advance past plain rows' tokens; a verify
        chunk's advance over the tokens the core accepts (`accept_verified`)."""
        return self.launch(logits, requests).result()

    def launch(self, logits: torch.Tensor, requests: Sequence) -> PendingSample:
        """`sample`'s device work, queued without waiting for it: the tokens stay on the device (the
        next step's inputs can take them there) and start one copy to the host; `result()` waits
        for that copy alone and finishes on the host (logprobs, matchers)."""
        params = [r.sampling_params for r in requests]
        want_lp = [i for i, p in enumerate(params) if p.num_logprobs is not None]
        raw = logits[want_lp] if want_lp else None   # a copy: the adjustments below never touch it
        logits, masks = self.final_logits(logits, requests, params)
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        if random_rows:
            tokens[random_rows] = self._draw(logits[random_rows], [requests[i] for i in random_rows])
        logprobs = None
        if want_lp:   # computed now, on the device: the host only reads them (PendingSample.result)
            logprobs = logprob_table(raw, tokens[want_lp], max(params[i].num_logprobs for i in want_lp))
        return PendingSample(self, list(requests), tokens, logprobs, want_lp, masks)

    def final_logits(self, logits: torch.Tensor, requests: Sequence, params: list[SamplingParams]):
        """The logits a row's token is chosen from (bias, min_tokens, penalties, grammar mask; a copy
        only when something changes them), and the grammar's masks (`StructuredOutput.fill`) or None.
        The masks are filled first, on the host, before anything waits on the device."""
        masks = self.grammar.fill(requests) if self.grammar is not None else None
        adjusted = self._adjust(logits, requests, params)
        if masks is not None:
            adjusted = logits.clone() if adjusted is logits else adjusted
            apply_bitmask(adjusted, torch.tensor(masks[0]), masks[1])
        return adjusted, masks

    def accept_verified(self, request, tokens: Sequence[int]) -> MMServeError | None:
        """Advance a verify chunk's grammar over the tokens accepted from it; why not, if it cannot."""
        return None if self.grammar is None else self.grammar.advance(request, tokens)

    def _adjust(self, logits: torch.Tensor, requests: Sequence, params: list[SamplingParams]) -> torch.Tensor:
        """Bias, min_tokens and penalties, on a copy only when some row needs one."""
        if not self._adjusts(params):
            return logits
        logits = logits.clone()
        apply_logit_bias(logits, params)
        apply_min_tokens(logits, params, [len(r.output_token_ids) for r in requests], self.eos_token_ids)
        apply_penalties(logits, params, [r.prompt_token_ids for r in requests], [r.output_token_ids for r in requests])
        return logits

    @staticmethod
    def _adjusts(params: list[SamplingParams]) -> bool:
        return any(p.logit_bias or p.min_tokens or p.has_penalties for p in params)

    @staticmethod
    def probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """softmax(filter(logits / temperature)) per row: the distribution a random row draws from."""
        dev = logits.device
        temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=dev)
        scaled = logits / temps.unsqueeze(1)
        if any(p.top_k or p.top_p < 1.0 for p in params):
            scaled = filter_logits(scaled, torch.tensor([p.top_k for p in params], device=dev),
                                   torch.tensor([p.top_p for p in params], dtype=logits.dtype, device=dev))
        return torch.softmax(scaled, dim=-1)

    def _draw(self, logits: torch.Tensor, requests: Sequence) -> torch.Tensor:
        """One draw per row from softmax(filter(logits / temperature)), each with its request's generator."""
        dev = logits.device
        probs = self.probs(logits, [r.sampling_params for r in requests])
        noise = torch.empty_like(probs)
        for row, r in zip(noise, requests, strict=True):
            row.exponential_(generator=self.generator(r.request_id, r.sampling_params, dev))
        return (probs / noise).argmax(dim=-1)

    def grammar_complete(self, request_id: str) -> bool:
        """False when the request has a response_format that its output does not complete yet."""
        return self.grammar is None or self.grammar.is_complete(request_id)

    def free(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        if self.grammar is not None:
            self.grammar.free(request_id)
