"""Structured output on a random model: whatever the weights want, sampled text matches the regex,
the EBNF grammar or the JSON schema; a grammar compiles once per spec; a constraint that cannot
finish within max_tokens ends with LENGTH and says so; bad specs are refused naming the field."""

from __future__ import annotations

import json
import random
import re

import pytest
from engine_helpers import build_request, make_llm

from mmserve.engine.sampling_params import ResponseFormat, SamplingParams
from mmserve.engine.structured_output import check_format
from mmserve.errors import InvalidInputError

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "tag": {"enum": ["ab", "cd"]}},
          "required": ["n", "tag"], "additionalProperties": False}


def sampled(fmt: ResponseFormat, max_tokens: int = 28) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=random.randrange(2**32), response_format=fmt)


def test_random_model_output_matches_its_constraint(load_backend):
    llm = make_llm(load_backend("sdpa"), attention_backend="sdpa")
    regex = ResponseFormat("regex", r"(yes|no) [0-9]{2,3}")
    grammar = ResponseFormat("grammar", 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c]+')
    schema = ResponseFormat("json_schema", json.dumps(SCHEMA))
    formats = [regex] * 3 + [grammar] * 3 + [schema] * 3
    prompts = [build_request(f"r{i}", [12], random.randrange(10_000)) for i in range(len(formats))]
    # constrained rows share the batch with unconstrained and greedy ones
    free = [build_request("free", [9], 1, max_tokens=20)]
    results = llm.generate(prompts + free, [sampled(f) for f in formats] + [None])
    assert llm.core.sampler.grammar.compiles == 3
    for fmt, got in zip(formats, results, strict=False):
        assert got.finish_reason in ("eos", "length"), got
        if got.finish_reason == "length":   # a grammar with an unbounded repeat may run past max_tokens
            assert fmt is grammar
            continue
        if fmt is regex:
            assert re.fullmatch(r"(yes|no) [0-9]{2,3}", got.text), got.text
        elif fmt is grammar:
            assert re.fullmatch(r"\([a-c]+(,[a-c]+)*\)", got.text), got.text
        else:
            value = json.loads(got.text)
            assert set(value) == {"n", "tag"} and 0 <= value["n"] <= 99 and value["tag"] in ("ab", "cd")
    assert not llm.core.sampler.grammar._matchers


def test_constraint_cut_by_max_tokens_says_so(load_backend):
    llm = make_llm(load_backend("sdpa"), attention_backend="sdpa")
    fmt = ResponseFormat("regex", "a{6}")
    cut, done = llm.generate([build_request("cut", [5], 3), build_request("done", [5], 3)],
                             [SamplingParams(max_tokens=4, response_format=fmt),
                              SamplingParams(max_tokens=6, response_format=fmt)])
    assert cut.finish_reason == "length" and cut.text == "a" * 4 and "response_format" in cut.finish_detail
    assert done.text == "a" * 6 and done.finish_detail is None


@pytest.mark.parametrize("kind, spec, words", [
    ("json_schema", '{"type": "strnig"}', "strnig"),
    ("json_schema", "{not json", "not valid JSON"),
    ("regex", "(ab", "parenthesis"),
    ("grammar", "root ::= missing", "missing"),
])
def test_bad_specs_name_the_field_and_the_problem(kind, spec, words):
    with pytest.raises(InvalidInputError) as info:
        check_format(ResponseFormat(kind, spec))
    assert info.value.field == f"sampling.response_format.{kind}" and words in str(info.value)
