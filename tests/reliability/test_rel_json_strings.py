"""Constrained JSON output always parses, bounded strings included (#42 finding 6).

xgrammar 0.2.9 lets a string with `minLength`/`maxLength` hold raw control characters (the probe:
`"\\x15MMMMMM,"`, 20 of 42 outputs unparsable, 12 of them ended by EOS). The grammar the engine
masks with is walked at random over random schemas (the demo tokenizer, its byte tokens included;
any allowed token at each step, EOS whenever allowed with a small chance), and every output the
grammar lets finish must parse with Python's strict `json` and validate against its schema with
`jsonschema`. Then the same through a real server at temperature 1: every output finished by EOS
parses and validates."""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import xgrammar as xgr

from mmserve.clients import Client
from mmserve.config import DEMO_MODEL_DIR
from mmserve.model.spec import load_spec
from mmserve.model.tokenizer import load_tokenizer
from mmserve.sampling_params import ResponseFormat
from mmserve.structured_output.compiler import FormatCompiler

SCHEMAS = 12
WALKS = 6
MAX_STEPS = 120


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """An object of 1-3 properties: bounded strings most often, an unbounded one, integers, enums,
    arrays of bounded strings, a nested object (twice at most)."""
    def leaf() -> dict:
        kind = rng.choice(["bounded", "bounded", "bounded", "string", "integer", "enum", "array"])
        if kind == "bounded":
            low = rng.randint(0, 4)
            return {"type": "string", "minLength": low, "maxLength": low + rng.randint(0, 8)}
        if kind == "array":
            return {"type": "array", "items": {"type": "string", "maxLength": rng.randint(1, 5)},
                    "minItems": 1, "maxItems": 3}
        if kind == "enum":
            return {"enum": ["red", "green", "blue"]}
        return {"type": kind}
    names = rng.sample(["a", "b", "c", "d"], rng.randint(1, 3))
    properties = {n: random_schema(rng, depth + 1) if depth < 2 and rng.random() < 0.2 else leaf() for n in names}
    return {"type": "object", "properties": properties, "required": names, "additionalProperties": False}


@pytest.fixture(scope="module")
def compiler():
    spec = load_spec(DEMO_MODEL_DIR)
    return FormatCompiler(load_tokenizer(DEMO_MODEL_DIR), spec.vocab_size, spec.eos_token_ids, cache_bytes=2**26,
                          timeout_s=30.0), spec


def walk(compiled, vocab_size: int, eos: set[int], rng: random.Random) -> list[int] | None:
    """Random allowed tokens until the matcher terminates (the ids, EOS dropped), or None at MAX_STEPS."""
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    ids: list[int] = []
    for _ in range(MAX_STEPS):
        if matcher.is_terminated():
            return ids
        matcher.fill_next_token_bitmask(bitmask)
        words = bitmask[0]
        allowed = [t for t in range(vocab_size) if (int(words[t // 32]) >> (t % 32)) & 1]
        ends = [t for t in allowed if t in eos]
        token = rng.choice(ends) if ends and rng.random() < 0.3 else rng.choice([t for t in allowed if t not in eos]
                                                                              or ends)
        assert matcher.accept_token(token)
        if token not in eos:
            ids.append(token)
    return None


def test_every_output_the_grammar_lets_finish_parses_and_validates(compiler):
    compiler, spec = compiler
    tok = load_tokenizer(DEMO_MODEL_DIR)
    rng = random.Random(42)
    eos = set(spec.eos_token_ids)
    finished = bad = 0
    for _ in range(SCHEMAS):
        schema = random_schema(rng)
        compiled = compiler.compile(ResponseFormat("json_schema", json.dumps(schema)))
        for _ in range(WALKS):
            ids = walk(compiled, spec.vocab_size, eos, rng)
            if ids is None:
                continue
            finished += 1
            text = tok.decode(ids)
            try:
                jsonschema.validate(json.loads(text), schema)
            except (ValueError, jsonschema.ValidationError) as e:
                bad += 1
                print(f"{text!r} against {json.dumps(schema)}: {e}")
    assert finished >= SCHEMAS * WALKS // 2, finished
    assert bad == 0, f"{bad} of {finished} finished outputs do not parse or validate"


def test_a_bounded_string_with_control_characters_is_outside_the_grammar(compiler):
    """The probe's output itself, token by token: refused where the control character comes."""
    compiler, spec = compiler
    tok = load_tokenizer(DEMO_MODEL_DIR)
    schema = {"type": "object", "properties": {"a": {"type": "string", "minLength": 2, "maxLength": 9}},
              "required": ["a"], "additionalProperties": False}
    matcher = xgr.GrammarMatcher(compiler.compile(ResponseFormat("json_schema", json.dumps(schema))))
    prefix = tok.encode('{"a":"')
    assert all(matcher.accept_token(t) for t in prefix)
    control = [t for t in range(spec.vocab_size) if any(ord(c) < 0x20 for c in tok.decode([t]))]
    assert control, "the demo tokenizer has byte tokens for control characters"
    bitmask = xgr.allocate_token_bitmask(1, spec.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    allowed = {t for t in range(spec.vocab_size) if (int(bitmask[0][t // 32]) >> (t % 32)) & 1}
    assert not allowed & set(control) and allowed, sorted(allowed & set(control))[:5]


def test_sampled_outputs_finished_by_eos_parse_and_validate_on_a_server(mmserve_server):
    rng = random.Random(7)
    checked = 0
    with Client(mmserve_server.address, timeout=120) as client:
        for k in range(4):
            schema = random_schema(rng)
            result = client.generate(prompt="Describe it as JSON.", max_tokens=64, temperature=1.0, seed=k, n=4,
                                     json_schema=schema)
            for sample in result.samples:
                if sample.finish_reason == "eos":
                    checked += 1
                    jsonschema.validate(json.loads(sample.text), schema)
    assert checked >= 4, checked
