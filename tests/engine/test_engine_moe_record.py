"""A MoE model's step record carries that step's own expert count, in both loops.

The perf model bills a MoE step's expert weights by the distinct experts each layer ran
(`StepRecord.experts_touched`). In the async loop step N+1's forward runs before N's record is
made, so a count kept in one buffer per model would give N's record N+1's count. The reference is
the MoE layers' own counts read right after each forward; requests arrive between decodes, so
neighbouring steps' counts differ (a lone decode runs top-k experts per layer, a prefill chunk more).
"""

from __future__ import annotations

import pytest
import torch
from engine_helpers import make_llm
from gemma4_fixtures import NUM_SPECIALS, VOCAB, make_checkpoint, moe_config

from mmserve.engine.types import EngineRequest
from mmserve.model import load_model
from mmserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_record")
    make_checkpoint(root, config=moe_config(), seed=int(torch.randint(0, 1000, ())))
    return load_model(root)


@pytest.mark.parametrize("loop", ["off", "on"])
def test_each_step_record_has_its_own_forwards_expert_count(moe_model, loop):
    llm = make_llm((moe_model, None), async_scheduling=loop)
    core = llm.core
    layers = [layer.moe.experts for layer in moe_model.decoder.layers if layer.moe is not None]
    forward, counts = moe_model.forward, []

    def counting(*args, **kwargs):
        hidden = forward(*args, **kwargs)
        counts.append(float(torch.stack([e.touched for e in layers]).double().mean()))
        return hidden

    moe_model.forward = counting
    try:
        gen = torch.Generator().manual_seed(int(torch.randint(0, 1000, ())))
        arrivals = {0: 12, 4: 9, 9: 14}   # step -> prompt length: a prefill among lone decodes
        records, step = [], 0
        while step <= max(arrivals) or core.has_work:
            if step in arrivals:
                prompt = torch.randint(NUM_SPECIALS, VOCAB, (arrivals[step],), generator=gen).tolist()
                core.add_request(EngineRequest(f"r{step}", prompt, [], [], SamplingParams(max_tokens=4, ignore_eos=True)))
            result = core.step()
            if result.step is not None:
                records.append(result.step)
            step += 1
    finally:
        moe_model.forward = forward
    assert core.async_scheduling == (loop == "on")
    assert [r.step_index for r in records] == list(range(records[0].step_index, records[0].step_index + len(counts)))
    assert len(set(counts)) > 1, counts   # neighbouring steps differ, or the test could not tell
    assert [r.experts_touched for r in records] == counts
