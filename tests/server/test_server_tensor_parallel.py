"""A real server at --tensor-parallel-size 2 with a speculative model: the engine process (rank 0)
spawns rank 1, both gloo processes run their shard of a fresh random E-style checkpoint (per-layer
embeddings, KV sharing) and of its assistant, and a video prompt's greedy tokens, drafted and
verified, equal transformers' (the TP=1 ground truth our TP=1 server is tested against in
test_server_family.py, without speculation) with chunked prefill, a prefix-cache hit and n samples,
as do the same request's without speculation; a grammar request drafts through rank 0's masks;
GetModelInfo and the metrics report the layout. One server for the module."""

from __future__ import annotations

import json
import random
import time

import pytest
from loopback_server import LoopbackServer, engine_config
from prometheus_client import generate_latest
from test_server_family import BUDGET, reference_greedy

from mmserve.clients import Client
from mmserve.config import ServerConfig
from mmserve.metrics.perf_model import PerfModel
from mmserve.metrics.prometheus import EngineMetrics
from mmserve.metrics.telemetry import TelemetryObserver
from mmserve.model.spec import load_spec

MAX_TOKENS = 8
PROMPT = "What happens?"
REPEATS = "the cat sat on the mat and then the cat sat again on the other mat"
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tag": {"enum": ["ab", "cd"]}},
          "required": ["n", "tag"], "additionalProperties": False}


def checkpoint_with_a_reference(root, fixtures, make_video):
    """A fresh random E-style checkpoint, a video, and transformers' greedy tokens on it. A seed whose
    random model samples a media placeholder is drawn again: transformers then counts the sampled id
    as one more video slot and raises (our engine embeds it as the pad token)."""
    for _ in range(10):
        seed = random.randrange(10_000)
        path = root / f"e_model_{seed}"
        hf = fixtures.make_checkpoint(path, config=fixtures.e_model_config(), seed=seed)
        (path / "preprocessor_config.json").write_text(json.dumps(
            {"patch_size": 4, "pooling_kernel_size": 2, "max_soft_tokens": 70}))
        video = make_video(seed=seed, num_frames=6)
        try:
            return seed, path, hf, video, reference_greedy(path, video, 3, PROMPT, MAX_TOKENS)
        except ValueError as exc:
            if "do not match" not in str(exc):
                raise
    raise AssertionError("10 random checkpoints in a row sampled a media placeholder")


@pytest.fixture(scope="module")
def tp_server(tmp_path_factory, gemma4_fixtures, make_video):
    seed, path, hf, video, reference = checkpoint_with_a_reference(tmp_path_factory.mktemp("tp"), gemma4_fixtures,
                                                                   make_video)
    assistant = tmp_path_factory.mktemp("tp_assistant")
    gemma4_fixtures.make_assistant(assistant, gemma4_fixtures.e_model_config(), seed=seed + 1, copy_from=hf)
    metrics = EngineMetrics(prometheus=True)   # the observer setup_observability builds, with a registry to read
    observer = TelemetryObserver(PerfModel(load_spec(path), dtype="float32", tp=2), metrics=metrics)
    server = LoopbackServer(engine_config(path, max_num_batched_tokens=BUDGET, default_num_frames=3,
                                          tensor_parallel_size=2, speculative_model=str(assistant),
                                          num_speculative_tokens=3),
                            ServerConfig(host="127.0.0.1", port=0, worker_threads=2),
                            observer=observer, metrics=metrics).start()
    yield path, server, seed, metrics, (video, *reference)
    server.stop()
    metrics.shutdown()


def counter(metrics, name: str) -> float:
    """The sum of a counter's samples over its labels."""
    return sum(s.value for family in metrics.registry.collect() for s in family.samples if s.name == name)


def test_tp2_server_greedy_matches_transformers(tp_server):
    _, server, seed, metrics, (video, layout, expected) = tp_server
    assert len(layout.token_ids) > 2 * BUDGET   # prefill takes several chunks
    ask = dict(prompt=PROMPT, video=video, num_frames=3, max_tokens=MAX_TOKENS, temperature=0,
               ignore_eos=True)
    with Client(server.address, timeout=120) as client:
        first = client.generate(**ask)
        again = client.generate(**ask)                 # the prompt's blocks come from the prefix cache
        samples = client.generate(**ask, n=2)
        plain = client.generate(**ask, disable_speculation=True)
        text = dict(prompt=REPEATS, max_tokens=24, temperature=0, ignore_eos=True)
        long_fast, long_plain = client.generate(**text), client.generate(**text, disable_speculation=True)
    assert list(first.token_ids) == expected, f"seed {seed}"
    assert list(again.token_ids) == expected and again.usage.cached_tokens > 0, f"seed {seed}"
    assert [list(s.token_ids) for s in samples.samples] == [expected, expected], f"seed {seed}"
    assert list(plain.token_ids) == expected, f"seed {seed}"
    assert list(long_fast.token_ids) == list(long_plain.token_ids), f"seed {seed}"
    drafts = counter(metrics, "mmserve_speculative_draft_tokens_total")
    assert drafts >= 4, "each of the 4 speculating requests verified drafts"
    print(f"seed {seed}: {counter(metrics, 'mmserve_speculative_accepted_tokens_total'):g} of {drafts:g} drafts kept")


def test_tp2_grammar_request_drafts_through_rank_0s_masks(tp_server):
    """Only rank 0 holds the grammar: a constrained round's drafts are its masked argmax, which the
    other rank takes each draft step. Same greedy tokens as with `disable_speculation`, output the
    grammar allows, drafts verified and some kept (the grammar forces many of its tokens). The async
    loop drafts before the matcher sees the step's tokens, unmasked (architecture.md, the engine
    loop): its drafts are verified, kept only where they happen to fit."""
    _, server, seed, metrics, _ = tp_server
    with Client(server.address, timeout=120) as client:
        ask = dict(prompt="Answer:", max_tokens=40, temperature=0, json_schema=SCHEMA)
        plain = client.generate(**ask, disable_speculation=True)
        before = [counter(metrics, f"mmserve_speculative_{k}_tokens_total") for k in ("draft", "accepted")]
        fast = client.generate(**ask)
    assert list(fast.token_ids) == list(plain.token_ids), f"seed {seed}"
    if fast.finish_reason == "eos":
        assert set(json.loads(fast.text)) == {"n", "tag"}, fast.text
    deadline = time.monotonic() + 30   # the step records reach the metrics just after the reply
    while time.monotonic() < deadline and (after := [counter(metrics, f"mmserve_speculative_{k}_tokens_total")
                                                     for k in ("draft", "accepted")]) == before:
        time.sleep(0.05)
    assert after[0] > before[0] and (after[1] > before[1] or server.async_loop), (seed, before, after, fast.text)


def test_model_info_and_metrics_report_the_layout(tp_server):
    _, server, _, metrics, _ = tp_server
    with Client(server.address, timeout=60) as client:
        assert client.model_info().tensor_parallel_size == 2
    assert "mmserve_tensor_parallel_size 2.0" in generate_latest(metrics.registry).decode()
