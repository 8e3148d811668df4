"""A live question's media come from its context's request in the core (`context_request_id`), and stay
with the question: preempted under a tiny KV cache after its context ended, it recomputes its frames'
embeddings from them (no prefix or encoder cache), to the tokens of the same prompt sent with its pixels to a fresh engine."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from mmserve.config import DEMO_MODEL_DIR
from mmserve.engine.llm import LLM
from mmserve.engine.types import EngineRequest
from mmserve.request import MultiModalInput
from mmserve.sampling_params import SamplingParams

sys.path.insert(0, str(Path(__file__).parents[1] / "model"))
from gemma4_fixtures import patchify  # noqa: E402

FRAME_TOKENS = 4   # a 16x16 frame: 4x4 patches of 4 px, pooled 2x2


def llm(**options) -> LLM:
    return LLM(DEMO_MODEL_DIR, device="cpu", block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
               prefill_batched_tokens=0, live_kv_share=1.0, **options)


def context_prompt(spec, gen: torch.Generator, num_frames: int) -> tuple[list[int], list, list]:
    ids, ranges, inputs = [spec.bos_token_id, *torch.randint(300, 1000, (9,), generator=gen).tolist()], [], []
    for _ in range(num_frames):
        ids += [int(torch.randint(300, 1000, (), generator=gen)), spec.boi_token_id]
        ranges.append((len(ids), len(ids) + FRAME_TOKENS - 1))
        ids += [spec.video_token_id] * FRAME_TOKENS + [spec.eoi_token_id]
        inputs.append(MultiModalInput(*patchify(torch.rand(3, 16, 16, generator=gen), 4)))
    return ids, ranges, inputs


def run(engine: LLM, until) -> dict[str, list]:
    """Step until `until(outputs)`; outputs: request id -> its TokenLogprobs (":done" keys once finished)."""
    outputs: dict[str, list] = {}
    while not until(outputs):
        for rid, item in engine.step():
            assert not isinstance(item, BaseException), (rid, item)
            outputs.setdefault(rid, []).extend(item.new_logprobs or [])
            if item.finished:
                outputs[rid + ":done"] = []
    return outputs


def test_a_preempted_question_recomputes_from_its_contexts_media():
    gen = torch.Generator().manual_seed(int(torch.randint(0, 10_000, ())))
    engine = llm(num_kv_blocks=48, enable_prefix_caching=False)   # no cached K/V or embeddings: a recompute reads pixels
    spec = engine.core.model.spec
    ids, ranges, inputs = context_prompt(spec, gen, 4)
    question = ids + torch.randint(300, 1000, (6,), generator=gen).tolist()
    # the demo model's greedy tokens hardly depend on random frames; their logprobs do (by 5e-4 to 1e-2)
    greedy = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=True)

    engine.add_request(EngineRequest("s#context-0", ids, ranges, inputs, SamplingParams(max_tokens=1),
                                     open_prompt=len(ids) + 16, session_id="s"))
    run(engine, lambda _: engine.core.requests["s#context-0"].num_computed_tokens == len(ids))
    for i in range(3):   # requests admitted before the question: it is the one preempted when blocks run out
        engine.add_request(EngineRequest(f"filler-{i}", torch.randint(300, 1000, (40,), generator=gen).tolist(),
                                         sampling=SamplingParams(max_tokens=24, ignore_eos=True)))
    engine.add_request(EngineRequest("s#q-1", question, ranges, inputs, greedy, context_request_id="s#context-0"))
    asked = engine.core.requests["s#q-1"]
    preempted, schedule = [], engine.core.scheduler.schedule   # each step's preempted ids

    def recording_schedule():
        out = schedule()
        preempted.extend(out.preempted_ids)
        return out
    engine.core.scheduler.schedule = recording_schedule
    assert len(asked.mm_inputs) == 4   # the context's own objects, not copies
    assert all(a is b for a, b in zip(asked.mm_inputs, engine.core.requests["s#context-0"].mm_inputs[:4], strict=True))
    got = run(engine, lambda _: "s#q-1" in preempted)
    engine.core.abort("s#context-0")   # the context ends while its question waits to be recomputed
    engine.processor.forget("s#context-0")
    got = {rid: got.get(rid, []) + more for rid, more in
           run(engine, lambda t: "s#q-1:done" in t and all(f"filler-{i}:done" in t for i in range(3))).items()}
    assert "s#q-1" in preempted and "s#q-1:done" in got
    assert all(not any(p.ref_cnt) for p in engine.core.kv.pools.values()) and not engine.core.requests

    alone = llm(num_kv_blocks=256)
    expected = alone.generate([EngineRequest("s#q-1", question, ranges, inputs, greedy)])[0].logprobs
    assert [t.token_id for t in got["s#q-1"]] == [t.token_id for t in expected] and len(expected) == 10
    # preempted and recomputed in other batches vs alone: 8 salts differed by at most 2.6e-6 (fp32 sums in
    # another order); 5e-5 leaves room for the tail, as the sibling tests' 1e-4 does
    torch.testing.assert_close([t.logprob for t in got["s#q-1"]], [t.logprob for t in expected], rtol=0, atol=5e-5)
