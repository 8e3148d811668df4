"""`max_step_slowdown` through the engine (core/sched/step_time.py): the scheduler's step-time model
divides by the peaks the engine detected, and the shorter prompt chunks it schedules beside decodes
change no token."""

from __future__ import annotations

import torch
from engine_helpers import (
    PROMPTS,
    assert_tokens_agree,
    build_request,
    make_llm,
    record_decisions,
    step_through,
)

from mmserve.metrics.peaks import ENV_PEAK_BANDWIDTH, ENV_PEAK_FLOPS


def test_the_cap_shortens_chunks_beside_decodes_and_changes_no_token(load_backend, monkeypatch):
    model_tok = load_backend("reference")
    # Peaks this slow make every prompt token beside the decodes cost on the demo-sized model, so the
    # cap bites (on this CPU's own peaks the model's steps are all overhead and it would not).
    monkeypatch.setenv(ENV_PEAK_FLOPS, "1e9")
    monkeypatch.setenv(ENV_PEAK_BANDWIDTH, "1e9")
    seeds = torch.randint(0, 10_000, (4,)).tolist()
    decoders = [build_request(f"d{i}", [6], seed, max_tokens=48) for i, seed in enumerate(seeds[:3])]
    video = build_request("video", PROMPTS["video"], seeds[3], max_tokens=4)
    runs = {}
    for slowdown in (0.0, 1.5):
        llm = make_llm(model_tok, max_num_batched_tokens=64, max_step_slowdown=slowdown)
        if not slowdown:   # the reference
            decisions = record_decisions(llm)
        scheduler, beside_decodes = llm.core.scheduler, []

        def recording(schedule=scheduler.schedule, chunks=beside_decodes):
            out = schedule()
            if any(not s.is_prefill for s in out.scheduled):
                chunks += [s.num_tokens for s in out.scheduled if s.is_prefill]
            return out

        monkeypatch.setattr(scheduler, "schedule", recording)
        tokens, _ = step_through(llm, decoders + [video], arrivals={"video": 2})
        runs[slowdown] = tokens, beside_decodes
        model = scheduler.step_time
        if slowdown:
            assert (model.flops, model.bandwidth, model.slowdown) == (1e9, 1e9, 1.5)
            assert (llm.core.peaks.flops, llm.core.peaks.bandwidth) == (1e9, 1e9)
        else:
            assert model is None
    (plain, plain_chunks), (capped, capped_chunks) = runs[0.0], runs[1.5]
    assert_tokens_agree(plain, capped, decisions)   # (chunks of other lengths beside a decode: other sums)
    assert all(len(t) == 48 for rid, t in plain.items() if rid != "video")
    assert sum(capped_chunks) == sum(plain_chunks) == len(video.prompt_token_ids)   # all beside decodes
    assert max(capped_chunks) < max(plain_chunks), (capped_chunks, plain_chunks)
