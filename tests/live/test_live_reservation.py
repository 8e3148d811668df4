"""A live session's KV reservation lives exactly as long as its contexts in the core: a context the
core refuses (here a full waiting queue) reserves nothing, and the last context's end frees it, so
later sessions find the room (held_resources reports who reserves)."""

from __future__ import annotations

import pytest
import torch
from test_live_question_media import context_prompt, llm

from mmserve.engine.types import EngineRequest
from mmserve.errors import LimitExceededError
from mmserve.sampling_params import SamplingParams


def test_a_refused_context_reserves_nothing():
    gen = torch.Generator().manual_seed(int(torch.randint(0, 10_000, ())))
    # one session's two contexts take 32 of the 47 usable blocks: room for one session at a time
    engine = llm(num_kv_blocks=48, max_waiting_requests=1)
    ids, ranges, inputs = context_prompt(engine.core.model.spec, gen, 2)

    def open_context(session: str) -> None:
        engine.add_request(EngineRequest(f"{session}#context-0", ids, ranges, inputs, SamplingParams(max_tokens=1),
                                         open_prompt=len(ids) + 40, session_id=session))

    engine.add_request(EngineRequest("busy", ids, ranges, inputs, SamplingParams(max_tokens=4)))   # waits
    with pytest.raises(LimitExceededError, match="already waiting") as refused:
        open_context("a")
    assert refused.value.retryable
    assert engine.core.held_resources()["live_sessions_reserving"] == []
    while engine.core.requests:
        engine.step()

    open_context("b")   # the room "a" would have kept
    assert engine.core.held_resources()["live_sessions_reserving"] == ["b"]
    while engine.core.scheduler.waiting:   # admitted: only the reservation can refuse "c" now
        engine.step()
    with pytest.raises(LimitExceededError, match="already reserve"):   # the room is one session's
        open_context("c")
    engine.core.abort("b#context-0")
    while engine.core.requests:
        engine.step()
    held = engine.core.held_resources()
    assert held["live_sessions_reserving"] == [] and not held["kv_blocks_held"]
