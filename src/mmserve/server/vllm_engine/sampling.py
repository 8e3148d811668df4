"""VllmEngine `SamplingParams` -> the engine's `SamplingParams`: every field mapped, or refused by name.

The gateway fills the proto from the OpenAI request (docs/gateway.md lists what it sends). Ranges are
the ones `mmserve.v1` enforces (server/validation.py), so a request means the same through both doors.
Fields this engine has no counterpart for are refused with INVALID_ARGUMENT naming them, never
silently ignored; the exceptions are the detokenization options, which only shape text the gateway
renders itself from our token ids.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from mmserve.config import EngineConfig
from mmserve.errors import InvalidInputError
from mmserve.sampling_params import (
    MAX_TOP_LOGPROBS,
    ResponseFormat,
    SamplingParams,
)
from mmserve.server.validation import MAX_STOP_STRING_CHARS, check_logit_bias, nesting_depth

WHERE = "sampling_params"


@dataclass(frozen=True)
class CheckpointDefaults:
    """What an unset `temperature`/`top_p`/`top_k` means: the checkpoint's generation_config.json,
    read as transformers reads it (`do_sample: false` is greedy)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path) -> CheckpointDefaults:
        path = Path(model_dir) / "generation_config.json"
        config = json.loads(path.read_text()) if path.is_file() else {}
        if not config.get("do_sample", True):
            return cls(temperature=0.0)
        return cls(temperature=float(config.get("temperature", 1.0)), top_p=float(config.get("top_p", 1.0)),
                   top_k=int(config.get("top_k", 0) or 0))

    def as_json(self) -> str:
        """GetModelInfo.default_sampling_params_json."""
        return json.dumps({"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k},
                          separators=(",", ":"))


@dataclass(frozen=True)
class MappedSampling:
    params: SamplingParams
    max_tokens_to_context: bool   # max_tokens was unset: generate up to the context (and --max-tokens-limit)


def _refuse(name: str, why: str) -> InvalidInputError:
    return InvalidInputError(f"{WHERE}.{name}", why)


def map_sampling(p: vpb.SamplingParams, config: EngineConfig, defaults: CheckpointDefaults,
                 eos_token_ids: tuple[int, ...]) -> MappedSampling:
    """Raises InvalidInputError naming `sampling_params.<field>`."""
    _refuse_unsupported(p, eos_token_ids)
    temperature = p.temperature if p.HasField("temperature") else defaults.temperature
    if not (math.isfinite(temperature) and temperature >= 0):
        raise _refuse("temperature", f"must be >= 0 (0 = greedy), got {temperature}")
    top_p = p.top_p or defaults.top_p
    if not 0.0 < top_p <= 1.0:
        raise _refuse("top_p", f"must be in (0, 1], got {top_p}")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(p, name)
        if not (math.isfinite(value) and -2.0 <= value <= 2.0):
            raise _refuse(name, f"must be in [-2, 2] (0 = off), got {value}")
    repetition = p.repetition_penalty or 1.0
    if not (math.isfinite(repetition) and 0.0 < repetition <= 10.0):
        raise _refuse("repetition_penalty", f"must be in (0, 10] (1 = off), got {repetition}")
    to_context = not p.HasField("max_tokens")
    max_tokens = config.max_tokens_limit if to_context else p.max_tokens
    if max_tokens < 1:
        raise _refuse("max_tokens", f"must be >= 1, got {max_tokens}")
    if max_tokens > config.max_tokens_limit:
        raise _refuse("max_tokens", f"{max_tokens} is above the server limit {config.max_tokens_limit} "
                                    "(--max-tokens-limit)")
    if p.min_tokens > max_tokens:
        raise _refuse("min_tokens", f"must be in 0..max_tokens ({max_tokens}), got {p.min_tokens}")
    _check_stop(p, config)
    if not 0 <= p.n <= config.max_n:
        raise _refuse("n", f"must be in 1..{config.max_n} (0 = 1), got {p.n} (--max-n)")
    logprobs, top, prompt_logprobs = _logprobs(p)
    seed = p.seed if p.HasField("seed") else None
    if seed is not None and seed < 0:
        raise _refuse("seed", f"must be >= 0, got {seed}")
    response_format = _constraint(p, config)
    if response_format is not None and p.ignore_eos:
        raise _refuse("ignore_eos", "cannot be combined with a constraint (the grammar decides the end)")
    if response_format is not None and p.min_tokens:
        raise _refuse("min_tokens", "cannot be combined with a constraint (the grammar decides the length)")
    params = SamplingParams(
        max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=p.top_k or defaults.top_k, seed=seed,
        stop=tuple(p.stop), ignore_eos=p.ignore_eos, logprobs=logprobs, top_logprobs=top,
        prompt_logprobs=prompt_logprobs, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty, repetition_penalty=repetition, min_tokens=p.min_tokens,
        logit_bias=_logit_bias(p), response_format=response_format, n=p.n or 1)
    return MappedSampling(params, to_context)


def _refuse_unsupported(p: vpb.SamplingParams, eos_token_ids: tuple[int, ...]) -> None:
    if p.min_p:
        raise _refuse("min_p", "min_p sampling is not supported here; use top_p or top_k")
    if p.HasField("truncate_prompt_tokens"):
        raise _refuse("truncate_prompt_tokens", "prompts are never truncated here; send a shorter prompt")
    extra = sorted(set(p.stop_token_ids) - set(eos_token_ids))
    if extra:
        raise _refuse("stop_token_ids", f"only the model's end tokens {list(eos_token_ids)} stop generation "
                                        f"here; {extra} cannot (use stop strings)")
    if p.include_stop_str_in_output:
        raise _refuse("include_stop_str_in_output", "not supported: a matched stop string is never part of the "
                                                    "output here")


def _check_stop(p: vpb.SamplingParams, config: EngineConfig) -> None:
    if len(p.stop) > config.max_stop_strings:
        raise _refuse("stop", f"{len(p.stop)} stop strings, at most {config.max_stop_strings} (--max-stop-strings)")
    for i, stop in enumerate(p.stop):
        if not stop or len(stop) > MAX_STOP_STRING_CHARS:
            raise _refuse(f"stop[{i}]", f"must be 1 to {MAX_STOP_STRING_CHARS} characters")


def _logprobs(p: vpb.SamplingParams) -> tuple[bool, int, bool]:
    """(logprobs, top alternatives, prompt_logprobs): one top-k serves both here."""
    for name in ("logprobs", "prompt_logprobs"):
        if p.HasField(name) and not 0 <= getattr(p, name) <= MAX_TOP_LOGPROBS:
            raise _refuse(name, f"must be in 0..{MAX_TOP_LOGPROBS} alternatives, got {getattr(p, name)}"
                                " (-1, every token, is not supported)")
    logprobs, prompt = p.HasField("logprobs"), p.HasField("prompt_logprobs")
    if logprobs and prompt and p.prompt_logprobs not in (0, p.logprobs):
        raise _refuse("prompt_logprobs", f"must be 0 or equal logprobs ({p.logprobs}): one number of "
                                         "alternatives serves both here")
    return logprobs, p.logprobs if logprobs else (p.prompt_logprobs if prompt else 0), prompt


def _logit_bias(p: vpb.SamplingParams) -> tuple[tuple[int, float], ...]:
    check_logit_bias(p.logit_bias, f"{WHERE}.logit_bias")
    return tuple(p.logit_bias.items())


def _constraint(p: vpb.SamplingParams, config: EngineConfig) -> ResponseFormat | None:
    """The `constraint` oneof onto our structured output (xgrammar): json_object is the schema of
    any object, a choice is a grammar of its literal alternatives. Bounded here as mmserve.v1 bounds
    a response_format; the servicer then compiles it off the event loop (`check_response_format`)."""
    kind = p.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == "structural_tag":
        raise _refuse("structural_tag", "structural tags are not supported; use json_schema, regex, grammar, "
                                        "json_object or choice")
    if kind == "json_object":
        if not p.json_object:
            return None
        fmt = ResponseFormat("json_schema", '{"type": "object"}')
    elif kind == "choice":
        if not p.choice.choices or any(not c for c in p.choice.choices):
            raise _refuse("choice.choices", "give at least one choice, none empty")
        fmt = ResponseFormat("grammar", "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False)
                                                                 for c in p.choice.choices))
    else:
        spec = getattr(p, kind)
        if not spec:
            raise _refuse(kind, "must not be empty")
        fmt = ResponseFormat(kind, spec)
    if len(fmt.spec) > config.max_response_format_chars:
        raise _refuse(kind, f"{len(fmt.spec)} characters, at most {config.max_response_format_chars} "
                            "(--max-response-format-chars)")
    depth = nesting_depth(fmt.kind, fmt.spec)
    if depth > config.max_response_format_depth:
        raise _refuse(kind, f"nested {depth} deep, at most {config.max_response_format_depth} "
                            "(--max-response-format-depth)")
    if fmt.kind == "json_schema":
        try:
            schema = json.loads(fmt.spec)
        except ValueError as e:
            raise _refuse(kind, f"not valid JSON: {e}") from None
        if not isinstance(schema, dict | bool):
            raise _refuse(kind, "a JSON schema is an object (or true/false)")
    return fmt
