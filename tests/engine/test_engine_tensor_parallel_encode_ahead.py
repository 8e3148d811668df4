"""Encode-ahead under tensor parallelism: rank 0 (this process, the engine core over its shard)
and a real spawned worker rank over gloo, as `mmserve serve --tensor-parallel-size 2` runs them.

References: the same engine with encode-ahead off (each step encodes its own frames) and the TP=1
engine, on fresh random prompts: a video arriving beside decoding requests gives the same greedy
tokens. On every rank a spy on the vision tower records each call (in the step, or ahead of the
next) with a checksum of its embeddings, and what the rank holds after each step: the ranks must
record the same calls, batches and embeddings, and a step that consumes frames past a video's
first chunk calls no tower on any rank. A video aborted while its next frames are held is freed
on every rank by the step that schedules nothing after it. One TP group for the module.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import pytest
import torch
from engine_helpers import assert_tokens_agree, build_request, make_llm, record_decisions, step_core

from mmserve.config import EngineConfig
from mmserve.executor import ranks, tensor_parallel, worker_rank

SPY_DIR = "MMSERVE_TEST_TOWER_SPY_DIR"   # where each rank's spy writes (the spawned rank inherits it)


def spy_on_ranks(rank: int) -> None:
    """Record, in this process, each vision-tower call (phase, frames, checksum), each step (its
    frames, whether one is a first chunk, then the calls it made and the bytes held after it) and
    each release (the bytes held after it), one JSON line each, to SPY_DIR/rank{rank}.jsonl."""
    from mmserve.model.serving_model import Gemma4ServingModel
    from mmserve.worker.model_runner import ModelRunner

    log = open(Path(os.environ[SPY_DIR]) / f"rank{rank}.jsonl", "a")
    phase, calls = ["ahead"], []
    encode, execute, release, vision = (ModelRunner._encode, ModelRunner.execute, ModelRunner.release,
                                        Gemma4ServingModel.encode_vision)

    def write(record: dict) -> None:
        log.write(json.dumps(record) + "\n")
        log.flush()

    def tower(self, pixels, positions):
        out = vision(self, pixels, positions)
        calls.append([phase[0], pixels.shape[0], sum(e.double().sum().item() for e in out)])
        return out

    def in_step(self, scheduled):
        phase[0] = "in_step"
        try:
            return encode(self, scheduled)
        finally:
            phase[0] = "ahead"

    def step(self, out, prev=None):
        calls.clear()
        result = execute(self, out, prev)
        write({"frames": sum(len(s.frames) for s in out.scheduled),
               "first": any(s.frames and s.num_computed_tokens == 0 for s in out.scheduled),
               "calls": list(calls), "held": self.encoded_ahead.num_bytes})
        return result

    def released(self, out):
        release(self, out)
        write({"released": out.finished_ids + out.preempted_ids, "held": self.encoded_ahead.num_bytes})

    Gemma4ServingModel.encode_vision, ModelRunner._encode, ModelRunner.execute, ModelRunner.release = (
        tower, in_step, step, released)


def spied_worker_main(rank, *args) -> None:
    spy_on_ranks(rank)
    worker_main(rank, *args)


worker_main = worker_rank.worker_main


def read_spy(rank: int) -> list[dict]:
    path = Path(os.environ[SPY_DIR]) / f"rank{rank}.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    path.write_text("")   # (each rank appends: its next records start the file again)
    return records


def read_spies(core) -> tuple[list[dict], list[dict]]:
    """Both ranks' records, once the worker has run every message rank 0 sent (it runs behind: rank
    0 waits for it only in a step's collectives). The leak check's query is the barrier: the worker
    answers it, in an all-reduce, after the messages before it."""
    core.runner.encoded_ahead_bytes()
    return read_spy(0), read_spy(1)


@pytest.fixture(scope="module")
def tp_core(engine_checkpoint, tmp_path_factory):
    """A TP=2 engine core with encode-ahead on (the default), its worker rank spawned and spied on."""
    from mmserve.core.engine_core import EngineCore

    patch = pytest.MonkeyPatch()
    patch.setenv(SPY_DIR, str(tmp_path_factory.mktemp("tower_spy")))
    patch.setenv("GLOO_SOCKET_IFNAME", "lo")   # (the rendezvous would set it for good in this process)
    patch.setattr(tensor_parallel, "worker_main", spied_worker_main)
    config = EngineConfig(model=str(engine_checkpoint[0]), device="cpu", dtype="float32", attention_backend="sdpa",
                          tensor_parallel_size=2, engine_threads=2, block_size=4, num_kv_blocks=256,
                          max_num_seqs=8, max_num_batched_tokens=24, prefill_batched_tokens=0,
                          enable_prefix_caching=False)   # each run encodes afresh: no encoder cache
    threads = torch.get_num_threads()
    torch.set_num_threads(ranks.rank_threads(config))   # rank 0's threads, as in the engine process
    tp = tensor_parallel.TensorParallelGroup(config)
    try:
        with pytest.MonkeyPatch.context() as rank0:
            # rank 0 spied like the worker (class attributes: restored after the module)
            from mmserve.model.serving_model import Gemma4ServingModel
            from mmserve.worker.model_runner import ModelRunner

            for cls, name in ((Gemma4ServingModel, "encode_vision"), (ModelRunner, "_encode"), (ModelRunner, "execute"),
                              (ModelRunner, "release")):
                rank0.setattr(cls, name, getattr(cls, name))
            spy_on_ranks(0)
            core = EngineCore(config, model=ranks.load_rank_model(config, tp.group),
                              runner_factory=tp.runner_factory)
            yield core
    finally:
        tp.close()
        patch.undo()
        torch.set_num_threads(threads)


def run(core, requests, arrivals: dict[str, int], abort_when_held: str | None = None) -> dict[str, list[int]]:
    """Step `core` until idle, adding each request at its arrival step; with `abort_when_held`, that
    request is aborted as soon as rank 0 holds embeddings encoded ahead, when the core's leak
    check must count the worker's too (the ranks hold the same)."""
    def abort_once_held(step, result):
        nonlocal abort_when_held
        for out in result.outputs:
            assert out.error is None or out.request_id == abort_when_held, out
        if abort_when_held and (held := core.runner.local.encoded_ahead.num_bytes):
            assert core.held_resources()["encoded_ahead_bytes"] == 2 * held
            assert core.abort(abort_when_held)
            abort_when_held = None

    return step_core(core, requests, arrivals=arrivals, after_step=abort_once_held, check_errors=False)


def workload():
    rng = random.Random(int(torch.randint(0, 10_000, ())))
    decoders = [build_request(f"d{i}", [rng.randrange(5, 15)], seed=rng.randrange(1000), max_tokens=20,
                              temperature=0.0) for i in range(2)]
    # (no request ends while the video prefills: an end frees budget the step before could not foresee)
    video = build_request("v", [3, ("video", [8] * rng.randrange(4, 7)), 4], seed=rng.randrange(1000),
                          max_tokens=12, temperature=0.0)
    return decoders + [video], {"v": 2}


def test_tp2_encodes_ahead_on_every_rank_alike_with_the_tokens_of_tp1_and_of_encode_ahead_off(
        tp_core, load_backend):
    requests, arrivals = workload()
    runs, spies = {}, {}
    assert tp_core.scheduler.encode_ahead   # --encode-ahead's default holds under tensor parallelism
    for ahead in (True, False):
        tp_core.scheduler.encode_ahead = ahead   # what --no-encode-ahead sets (EngineCore builds its scheduler so)
        runs[ahead] = run(tp_core, requests, arrivals)
        spies[ahead] = read_spies(tp_core)
        assert tp_core.held_resources()["encoded_ahead_bytes"] == 0
    tp_core.scheduler.encode_ahead = True
    tp1 = make_llm(load_backend("sdpa"), max_num_batched_tokens=24, enable_prefix_caching=False)
    decisions = record_decisions(tp1)
    reference = run(tp1.core, requests, arrivals)
    read_spy(0)   # (that runner, in this process, was spied on too)
    for ahead in (True, False):   # (the ranks' halves sum in another order than TP=1's whole)
        assert_tokens_agree(reference, runs[ahead], decisions)
    frames = len(requests[-1].mm_inputs)
    for ahead, (rank0, rank1) in spies.items():
        assert rank0 == rank1, ahead   # the same calls, batches and embeddings, the same bytes held, on each rank
        steps = [s for s in rank0 if "frames" in s]
        assert sum(s["frames"] for s in steps) == sum(n for s in steps for _, n, _ in s["calls"]) == frames
        ahead_calls = [c for s in steps for c in s["calls"] if c[0] == "ahead"]
        if ahead:   # past the first chunk, every step that consumes frames took them from the step before
            later = [s for s in steps if s["frames"] and not s["first"]]
            assert later and ahead_calls, rank0
            assert all(c[0] == "ahead" for s in later for c in s["calls"]), rank0
            assert rank0[-1]["held"] == 0, rank0   # once the video ended
        else:
            assert not ahead_calls


def test_tp2_an_aborted_videos_frames_held_ahead_are_freed_on_every_rank(tp_core):
    """Aborted while its next frames are held on both ranks: the step after, which schedules nothing,
    releases them on both (rank 0's core reports nothing held; the worker's spy records 0 bytes)."""
    video = build_request("v", [3, ("video", [8] * 6), 4], seed=int(torch.randint(0, 1000, ())), max_tokens=4)
    run(tp_core, [video], {}, abort_when_held="v")
    rank0, rank1 = read_spies(tp_core)
    assert rank0 == rank1
    held = [s["held"] for s in rank1 if "frames" in s]
    assert held[-1] > 0, rank1   # the last step that ran left frames held ahead on the worker too
    assert rank1[-1] == {"released": ["v"], "held": 0}, rank1
    assert tp_core.held_resources()["encoded_ahead_bytes"] == 0
    assert not tp_core.held_resources()["requests"]
