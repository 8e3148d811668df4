"""What a tensor-parallel worker rebuilds from rank 0's step messages (executor/step_messages.py):
through pickling, as broadcast_object_list sends them, each step's SchedulerOutput must read the
same to the runner as rank 0's: the chunk's tokens, `num_tokens`/`samples`, frames, block updates,
the pixels, the media to encode ahead (as the mirror's own requests: their pixels never travel
again); across decode, preemption and recompute, a rollback that replaces output tokens, a finished
id coming back as a new request in the same step, and requests released by steps that ran nothing."""

from __future__ import annotations

import pickle
import random

import pytest
import torch
from sched_helpers import samples

from mmserve.core.sched.output import BlockUpdate, ScheduledRequest, SchedulerOutput
from mmserve.executor.step_messages import StepEncoder, StepMirror
from mmserve.request import MultiModalInput, Request
from mmserve.sampling_params import SamplingParams


def assert_same_to_the_runner(ours: SchedulerOutput, theirs: SchedulerOutput) -> None:
    assert (ours.preempted_ids, ours.finished_ids) == (theirs.preempted_ids, theirs.finished_ids)
    assert len(ours.scheduled) == len(theirs.scheduled)
    for a, b in zip(ours.scheduled, theirs.scheduled, strict=True):
        ra, rb = a.request, b.request
        assert (ra.request_id, a.num_tokens, a.num_computed_tokens, a.frames, a.block_updates, samples(a)) == \
               (rb.request_id, b.num_tokens, b.num_computed_tokens, b.frames, b.block_updates, samples(b))
        assert ra.token_ids_slice(a.num_computed_tokens, a.seq_len) == rb.token_ids_slice(b.num_computed_tokens, b.seq_len)
        assert ra.num_tokens == rb.num_tokens and ra.sampling_params == rb.sampling_params
        assert ra.mm_ranges == rb.mm_ranges
        for x, y in zip(ra.mm_inputs, rb.mm_inputs, strict=True):
            assert x.content_hash == y.content_hash and torch.equal(x.pixel_values, y.pixel_values)
    assert [(r.request_id, frames) for r, frames in ours.encode_ahead] == \
           [(r.request_id, frames) for r, frames in theirs.encode_ahead]


def test_the_mirror_reads_like_rank_0_step_after_step():
    rng = random.Random(random.getrandbits(64))
    encoder, mirror = StepEncoder(), StepMirror()

    def send(out: SchedulerOutput) -> list[str]:
        """`out` through the wire; the ids of the requests whose prompt and pixels it carried."""
        msg = encoder.encode(out)
        assert not any(isinstance(v, list) and v and isinstance(v[0], tuple) and isinstance(v[0][0], Request)
                       for v in msg.rest.values())   # encode_ahead travels by id, in `ahead`
        ours = mirror.decode(pickle.loads(pickle.dumps(msg)))
        assert_same_to_the_runner(ours, out)
        assert all(r is mirror.requests[r.request_id] for r, _ in ours.encode_ahead)
        return [new.request_id for new in msg.new]

    pixels = MultiModalInput(torch.rand(4, 48), torch.zeros(4, 2, dtype=torch.long))
    a = Request("a", [rng.randrange(300) for _ in range(10)], SamplingParams(max_tokens=20, prompt_logprobs=True),
                mm_ranges=[(2, 5)], mm_inputs=[pixels])
    b = Request("b", [rng.randrange(300) for _ in range(6)], SamplingParams(max_tokens=20))
    # a's next chunk holds its frame: ahead, by id (its pixels travelled with it, this step)
    assert send(SchedulerOutput([ScheduledRequest(a, 1, 0, True), ScheduledRequest(b, 6, 0, True)],
                                encode_ahead=[(a, [0])])) == ["a", "b"]
    assert send(SchedulerOutput([ScheduledRequest(a, 5, 1, True, frames=[0],
                                                  block_updates={"p": BlockUpdate(0, [3, 4], 0)})])) == []
    b.output_token_ids.append(7)
    send(SchedulerOutput([ScheduledRequest(a, 4, 6, True), ScheduledRequest(b, 1, 6, False)]))
    for step in range(3):   # decode both
        a.output_token_ids.append(rng.randrange(300))
        b.output_token_ids.append(rng.randrange(300))
        send(SchedulerOutput([ScheduledRequest(a, 1, 10 + step, False), ScheduledRequest(b, 1, 7 + step, False)]))
    # b preempted, then recomputed from scratch in two chunks (prompt + its outputs)
    send(SchedulerOutput([ScheduledRequest(a, 1, 13, False)], preempted_ids=["b"]))
    a.output_token_ids.append(5)
    send(SchedulerOutput([ScheduledRequest(b, 5, 0, True), ScheduledRequest(a, 1, 14, False)]))
    send(SchedulerOutput([ScheduledRequest(b, b.num_tokens - 5, 5, True)]))
    # a rollback: a's last two tokens replaced (its KV rolled back to before them)
    a.output_token_ids[-2:] = [11, 12]
    send(SchedulerOutput([ScheduledRequest(a, 2, a.num_tokens - 2, False)]))
    # b finishes; a new request reuses its id in the very step that reports it finished
    b2 = Request("b", [rng.randrange(300) for _ in range(3)], SamplingParams(max_tokens=2))
    send(SchedulerOutput([ScheduledRequest(b2, 3, 0, True)], finished_ids=["b"]))
    assert mirror.requests["b"].prompt_token_ids == b2.prompt_token_ids
    # a running request no step sent yet, named ahead: introduced with its pixels, then only by id
    c = Request("c", [rng.randrange(300) for _ in range(8)], SamplingParams(max_tokens=3), mm_ranges=[(1, 4)],
                mm_inputs=[pixels])
    assert send(SchedulerOutput([ScheduledRequest(a, 1, a.num_tokens - 1, False)], encode_ahead=[(c, [0])])) == ["c"]
    assert send(SchedulerOutput([ScheduledRequest(c, 8, 0, True, frames=[0])], encode_ahead=[(c, [0])])) == []
    send(SchedulerOutput([], finished_ids=["a", "b"]))
    # c ends in a step that schedules nothing: released on both sides, so its id is new again
    encoder.release(["c"])
    mirror.release(["c"])
    assert not mirror.requests and not encoder.sent_outputs
    assert send(SchedulerOutput([ScheduledRequest(c, 8, 0, True)])) == ["c"]


def test_a_worker_runner_is_sized_like_rank_0_and_refuses_another_dtype():
    from mmserve.config import EngineConfig
    from mmserve.executor.worker_rank import runner_config

    leader = EngineConfig(device="cpu", dtype="float32", max_num_seqs=4, max_num_batched_tokens=256,
                          tensor_parallel_size=2, nnodes=2)
    own = EngineConfig(model="/elsewhere", device="cpu", dtype="float32", max_num_seqs=1, node_rank=1,
                       tensor_parallel_size=2, nnodes=2)
    sized = runner_config(own, leader)
    assert (sized.max_num_seqs, sized.max_num_batched_tokens, sized.model, sized.node_rank) == (4, 256, "/elsewhere", 1)
    with pytest.raises(ValueError, match="--dtype bfloat16 differs from rank 0's float32"):
        runner_config(EngineConfig(device="cpu", dtype="bfloat16"), leader)
    # every rank drafts (its shard of the assistant), so a node without --speculative-model is refused
    drafting = EngineConfig(device="cpu", dtype="float32", speculative_model="/assistant", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="--speculative-model is set on rank 0 but not set here"):
        runner_config(own, drafting)
    elsewhere = EngineConfig(model="/m", device="cpu", dtype="float32", speculative_model="/here/assistant")
    assert runner_config(elsewhere, drafting).speculative_model == "/here/assistant"   # this node's path
