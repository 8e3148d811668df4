"""Per-request sampling options. Validated once at admission so the step loop never has to."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

from mmserve.errors import InvalidInputError

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 300          # entries per request (the OpenAI API's bound)
MAX_BIAS = 100.0              # |bias| per entry
RESPONSE_FORMAT_KINDS = ("json_schema", "regex", "grammar")
# Temperatures below this are greedy (vLLM's bound): logits / 1e-38 overflow to inf, their softmax to
# NaN, and the sampler would draw pad tokens up to max_tokens.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class ResponseFormat:
    """A constraint on the output: a JSON schema (JSON text), a regex, or an EBNF grammar whose
    root rule is `root`. The engine compiles it (cached by a hash of kind and spec)."""

    kind: str     # one of RESPONSE_FORMAT_KINDS
    spec: str

    def __post_init__(self) -> None:
        if self.kind not in RESPONSE_FORMAT_KINDS:
            raise InvalidInputError("response_format", f"unknown kind {self.kind!r}; use one of {RESPONSE_FORMAT_KINDS}")
        if not self.spec:
            raise InvalidInputError(f"response_format.{self.kind}", "must not be empty")


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy (so does any below GREEDY_TEMPERATURE: it becomes 0 here, whichever
    door it came through); top_k 0 and top_p 1.0 mean "no cut"; seed None draws from the engine's seed.

    Penalties follow vLLM: `repetition_penalty` divides positive (multiplies negative) logits of
    tokens seen in the prompt or output; `frequency_penalty` subtracts once per occurrence in the
    output, `presence_penalty` once if present. `min_tokens` holds back end-of-sequence tokens and
    stop strings until that many tokens exist. `logit_bias` adds to the raw logits (token id -> bias).
    `logprobs` returns each sampled token's log-probability (and `top_logprobs` alternatives) under
    the model's own distribution: soft-capped logits, before any penalty, bias, mask or temperature.
    """

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    response_format: ResponseFormat | None = None
    n: int = 1                    # samples of the prompt (engine/parallel_sampling.py)
    disable_speculation: bool = False   # decode one token per step even with a speculative model

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidInputError("max_tokens", f"must be >= 1, got {self.max_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):   # as the gRPC doors: NaN and inf too
            raise InvalidInputError("temperature", f"must be finite and >= 0 (0 = greedy), got {self.temperature}")
        if self.temperature < GREEDY_TEMPERATURE:
            object.__setattr__(self, "temperature", 0.0)
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidInputError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidInputError("top_k", f"must be >= 0, got {self.top_k}")
        if any(not s for s in self.stop):
            raise InvalidInputError("stop", "stop strings must be non-empty")
        if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidInputError("top_logprobs", f"must be in 0..{MAX_TOP_LOGPROBS}, got {self.top_logprobs}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                raise InvalidInputError(name, f"must be in [-2, 2], got {value}")
        if not (math.isfinite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 10.0):
            raise InvalidInputError("repetition_penalty", f"must be in (0, 10] (1 = off), got {self.repetition_penalty}")
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidInputError("min_tokens", f"must be in 0..max_tokens ({self.max_tokens}), got {self.min_tokens}")
        bias = tuple(sorted((int(t), float(b)) for t, b in dict(self.logit_bias).items()))
        if len(bias) > MAX_LOGIT_BIAS:
            raise InvalidInputError("logit_bias", f"{len(bias)} entries, at most {MAX_LOGIT_BIAS}")
        for token, b in bias:
            if token < 0:
                raise InvalidInputError("logit_bias", f"token id {token} is negative")
            if not (math.isfinite(b) and abs(b) <= MAX_BIAS):
                raise InvalidInputError("logit_bias", f"bias {b} for token {token} is outside [-{MAX_BIAS:g}, {MAX_BIAS:g}]")
        if self.n < 1:
            raise InvalidInputError("n", f"must be >= 1, got {self.n}")
        if self.response_format is not None and self.ignore_eos:
            raise InvalidInputError("ignore_eos", "cannot be combined with response_format (the grammar decides the end)")
        if self.response_format is not None and self.min_tokens:
            raise InvalidInputError("min_tokens", "cannot be combined with response_format (the grammar decides the length)")
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "logit_bias", bias)

    # cached: the engine core's sampler reads these for every request every step (the fields never change)
    @cached_property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @cached_property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @cached_property
    def num_logprobs(self) -> int | None:
        """Alternatives per sampled token, or None when the request asked for no logprobs."""
        return self.top_logprobs if self.logprobs else None

    @property
    def needs_whole_prompt(self) -> bool:
        """True when every prompt token must be computed (prompt logprobs): no prefix-cache read."""
        return self.prompt_logprobs


def check_vocab(params: SamplingParams, vocab_size: int) -> None:
    """Admission check of the fields that depend on the model: logit_bias token ids."""
    bad = [t for t, _ in params.logit_bias if t >= vocab_size]
    if bad:
        raise InvalidInputError("sampling.logit_bias", f"token id {bad[0]} is outside the vocabulary (size {vocab_size})")
