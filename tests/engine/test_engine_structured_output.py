"""Structured output on a random model: whatever the weights want, sampled text matches the regex,
the EBNF grammar or the JSON schema; a grammar compiles once per spec; a constraint that cannot
finish within max_tokens ends with LENGTH and says so; bad specs (malformed, or matching nothing) are
refused naming the field."""

from __future__ import annotations

import dataclasses
import json
import random
import re

import pytest
from engine_helpers import build_request, make_llm

from mmserve.errors import InvalidInputError
from mmserve.sampling_params import ResponseFormat, SamplingParams

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "tag": {"enum": ["ab", "cd"]}},
          "required": ["n", "tag"], "additionalProperties": False}


def sampled(fmt: ResponseFormat, max_tokens: int = 28) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=random.randrange(2**32), response_format=fmt)


@pytest.mark.parametrize("loop", ["off", "on"])   # async: a step's mask waits for the token in flight
def test_random_model_output_matches_its_constraint(load_backend, loop):
    llm = make_llm(load_backend("sdpa"), attention_backend="sdpa", async_scheduling=loop)
    regex = ResponseFormat("regex", r"(yes|no) [0-9]{2,3}")
    grammar = ResponseFormat("grammar", 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c]+')
    schema = ResponseFormat("json_schema", json.dumps(SCHEMA))
    formats = [regex] * 3 + [grammar] * 3 + [schema] * 3
    prompts = [build_request(f"r{i}", [12], random.randrange(10_000)) for i in range(len(formats))]
    # constrained rows share the batch with unconstrained and greedy ones
    free = [build_request("free", [9], 1, max_tokens=20)]
    results = llm.generate(prompts + free, [sampled(f) for f in formats] + [None])
    assert llm.core.sampler.grammar.compiler.compiles == 3
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
    ("json_schema", "false", "cannot accept any value"),
    ("regex", "(ab", "parenthesis"),
    ("grammar", "root ::= missing", "missing"),
    ("grammar", "root ::= root", "matches nothing"),
    ("grammar", 'root ::= "a" rest\nrest ::= rest', "matches nothing: rules root, rest can never finish"),
    ("grammar", 'root ::= "a" rest | "b"\nrest ::= "c" rest', "rule rest can never finish"),
    ("grammar", 'root ::= "a" x{0,2}\nx ::= [^\\x00-\\U0010FFFF]', "rule x can never finish"),
    ("regex", "[^\\x00-\\U0010FFFF]", "matches nothing"),
])
def test_bad_specs_name_the_field_and_the_problem(load_backend, kind, spec, words):
    compiler = make_llm(load_backend("sdpa"), attention_backend="sdpa").core.sampler.grammar.compiler
    for _ in range(2):   # the second answer is the cached verdict: the same error, no second compile
        with pytest.raises(InvalidInputError) as info:
            compiler.compile(ResponseFormat(kind, spec))
        assert info.value.field == f"sampling.response_format.{kind}" and words in str(info.value)
    assert compiler.compiles == 1


def _constrained(rid: str, prompt_tokens: int, fmt: ResponseFormat):
    return dataclasses.replace(build_request(rid, [prompt_tokens], random.randrange(10_000)),
                               sampling=SamplingParams(max_tokens=8, response_format=fmt))


def _step_all(llm, requests) -> tuple[dict, dict, list[set]]:
    """Run `requests` together, stepping by hand: tokens per id, errors per id, and per step the ids
    that got a token (or their error) in it."""
    for r in requests:
        llm.add_request(r)
    tokens, errors, steps = {r.request_id: [] for r in requests}, {}, []
    while llm.has_work:
        moved = set()
        for rid, item in llm.step():
            moved.add(rid)
            if isinstance(item, BaseException):
                errors[rid] = item
            else:
                tokens.setdefault(rid, []).extend(item.new_token_ids)
        steps.append(moved)
    return tokens, errors, steps


@pytest.mark.parametrize("loop", ["off", "on"])   # async: it fails with its next step in flight
def test_a_grammar_that_cannot_go_on_fails_only_its_own_request(load_backend, loop):
    """Step-mates: a greedy bystander, a request whose grammar matches nothing (refused when its compile
    ends) and one whose matcher dead-ends after one token. Fault injection for the last: grammars that
    can dead-end are refused up front, so its matcher is swapped for one compiled from such a grammar
    past the checks, as a grammar the checks missed would be. Only the two end, with errors naming
    no one else; the bystander's tokens are those of its solo run. The dead-ending one is seeded
    and asks for logprobs: its row, all masked, has no mass to draw from, and must still end with
    the grammar's error, not a failed logprob gather of a token past the vocabulary."""
    llm = make_llm(load_backend("sdpa"), attention_backend="sdpa", async_scheduling=loop)
    bystander = build_request("bystander", [12], random.randrange(10_000), max_tokens=8, temperature=0.0)
    alone = llm.generate([bystander])[0].token_ids
    structured = llm.core.sampler.grammar
    bad = _constrained("bad", 12, ResponseFormat("regex", "a+"))
    bad = dataclasses.replace(bad, sampling=dataclasses.replace(bad.sampling, temperature=1.0, logprobs=True,
                                                                seed=random.randrange(2**32)))
    empty = _constrained("empty", 7, ResponseFormat("grammar", "root ::= root"))
    structured.compiler.compile(bad.sampling.response_format)   # cached: admitted at once, so it can be swapped
    for r in (bystander, bad, empty):
        llm.add_request(r)
    structured.add("bad", bad.sampling.response_format,
                   structured.compiler._xgrammar().compile_grammar('root ::= "a" rest\nrest ::= rest'))
    tokens, errors, steps = _step_all(llm, [])
    assert set(errors) == {"bad", "empty"}
    assert tokens["bystander"] == alone
    assert isinstance(errors["bad"], InvalidInputError) and "no token can continue" in str(errors["bad"])
    assert isinstance(errors["empty"], InvalidInputError) and "matches nothing" in str(errors["empty"])
    for error in errors.values():
        assert "bystander" not in str(error) and error.field.startswith("sampling.response_format.")
    assert any({"bad", "bystander"} <= moved for moved in steps[1:])   # it failed in a step it shared
    assert not structured._matchers and not llm.core.requests


@pytest.mark.parametrize("loop", ["off", "on"])   # async: the old request's step is in flight when its id returns
def test_a_request_id_used_again_gets_its_own_grammar_state(load_backend, loop):
    """A constrained request is aborted two tokens in and its id admitted again at once (a client
    reusing ids): the new request's output is the fresh run's, a whole match. Under the async loop
    a step that scheduled the old request is still in flight then: its token advances the old
    request's matcher, not the new one's (which would end the new output one 'a' short)."""
    llm = make_llm(load_backend("sdpa"), attention_backend="sdpa", async_scheduling=loop)
    request = _constrained("x", random.randrange(4, 30), ResponseFormat("regex", "a{6}"))
    fresh = llm.generate([request])[0]
    llm.add_request(request)
    emitted = 0
    while emitted < 2:
        emitted += sum(len(item.new_token_ids) for _, item in llm.step())
    assert llm.core.abort("x") and (loop == "off" or llm.core._in_flight is not None)
    llm.processor.forget("x")
    again = llm.generate([request])[0]
    assert re.fullmatch("a{6}", fresh.text), fresh.text
    assert (again.text, again.finish_reason) == (fresh.text, fresh.finish_reason)
    assert not llm.core.sampler.grammar._matchers and not llm.core.requests


def test_a_slow_compile_runs_beside_the_step_loop(load_backend):
    """A request whose schema takes a while to compile waits off the scheduler: a running request keeps
    getting tokens (its solo run's) while the compile runs, then the constrained one runs."""
    llm = make_llm(load_backend("sdpa"), attention_backend="sdpa")
    bystander = build_request("bystander", [12], random.randrange(10_000), max_tokens=12, temperature=0.0)
    alone = llm.generate([bystander])[0].token_ids
    properties = {f"p{i}": {"type": "integer"} for i in range(900)}
    fmt = ResponseFormat("json_schema", json.dumps({"type": "object", "properties": properties,
                                                    "additionalProperties": False}))
    slow = _constrained("slow", 9, fmt)
    compiler = llm.core.sampler.grammar.compiler
    llm.add_request(bystander)
    got = []
    while not got:   # the async loop reports a step's token at the next step
        got += [t for _, item in llm.step() for t in item.new_token_ids]
    llm.add_request(slow)                       # returns at once: the compile is the worker's
    while_compiling, slow_tokens = 0, []
    while len(got) < len(alone):
        compiling = compiler.compiles == 0
        for rid, item in llm.step():
            assert rid == "bystander" or not compiling
            assert not isinstance(item, BaseException), f"{rid}: {item}"
            if rid == "bystander":
                got += item.new_token_ids
            else:   # on a loaded machine the compile may end, and the slow one run, before the bystander does
                slow_tokens += item.new_token_ids
            while_compiling += compiling and rid == "bystander"
    assert got == alone and while_compiling >= 1
    tokens, errors, _ = _step_all(llm, [])
    assert not errors and slow_tokens + tokens.get("slow", []) and compiler.compiles == 1 and not llm.core.requests


def test_compile_time_limit_refuses_the_slow_and_skips_abandoned_work(load_backend):
    """One worker, a 0.2 s limit: a slow schema is refused (INVALID_ARGUMENT kind) and stays refused;
    a spec queued behind it times out as retryable (the worker was busy, not the spec at fault) and,
    nobody waiting for it any more, is never compiled."""
    import asyncio

    from mmserve.errors import LimitExceededError
    from mmserve.structured_output.compiler import FormatCompiler

    model, tok = load_backend("sdpa")
    compiler = FormatCompiler(tok, model.spec.vocab_size, model.spec.eos_token_ids, cache_bytes=2**26, timeout_s=0.2)
    slow = ResponseFormat("json_schema", json.dumps({"type": "object", "properties": {
        f"p{i}": {"type": "integer"} for i in range(900)}}))
    queued = ResponseFormat("regex", "[0-9]{3}")

    async def both():
        return await asyncio.gather(compiler.check(slow), compiler.check(queued), return_exceptions=True)

    refused, busy = asyncio.run(both())
    assert isinstance(refused, InvalidInputError) and "--grammar-compile-timeout-s" in str(refused)
    assert isinstance(busy, LimitExceededError) and busy.retryable
    with pytest.raises(InvalidInputError, match="did not compile within"):
        compiler.compile(slow)                 # the finished compile took too long: its verdict is kept
    assert compiler.compiles == 1              # the queued spec was skipped, not compiled
    compiler.compile(queued)                   # asked again, it compiles
    assert compiler.compiles == 2
    compiler.shutdown()
