"""The shipped demo assistant (src/mmserve/demo_assistant, from scripts/train_demo_assistant.py) with the
shipped demo model: it passes the start-up check, and on fresh held-out demo-task clips through the
engine its drafts are mostly right (the first accepted at least 60% of the time) while the greedy
tokens stay exactly those decoded without it; served as `make run` serves it, GetModelInfo and
`mmserve demo` show speculation on (several tokens per streamed chunk)."""

from __future__ import annotations

import asyncio
import random
import re
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from loopback_server import LoopbackServer, engine_config

from mmserve import cli
from mmserve.clients import Client
from mmserve.config import DEMO_ASSISTANT_DIR, DEMO_MODEL_DIR, EngineConfig, ServerConfig
from mmserve.core.engine_core import load_engine_model
from mmserve.engine.input.processor import InputMessage, InputProcessor, TextInput, VideoInput
from mmserve.engine.llm import LLM
from mmserve.model.assistant import load_assistant
from mmserve.model.spec import load_spec
from mmserve.multimodal import demo_task
from mmserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def seeds() -> list[int]:
    """16 held-out clips: never the training ones (seeds below HELDOUT_SEED_BASE) nor the script's eval
    ones; drawn from the seeded generator, so each salt draws its own and reproduces them."""
    return random.sample(range(demo_task.HELDOUT_SEED_BASE + 10_000, 2 * demo_task.HELDOUT_SEED_BASE), 16)


def test_shipped_assistant_fits_the_demo_model():
    assistant = load_assistant(DEMO_ASSISTANT_DIR, load_spec(DEMO_MODEL_DIR), dtype=torch.float32,
                               device=torch.device("cpu"))
    assert assistant.spec.model_type == "gemma4_assistant"
    size = sum(f.stat().st_size for f in DEMO_ASSISTANT_DIR.iterdir())
    assert size < 2**20, f"the demo assistant is {size} bytes; it ships in the wheel"


@pytest.fixture(scope="module")
def requests(seeds):
    config = EngineConfig(model=str(DEMO_MODEL_DIR))
    sampling = SamplingParams(max_tokens=32, temperature=0.0)
    with ThreadPoolExecutor(1) as pool:
        spec = load_spec(DEMO_MODEL_DIR)
        processor = InputProcessor.from_checkpoint(config, pool, spec=spec, context_length=spec.max_model_len)

        async def prepare():
            return await asyncio.gather(*(processor.process(
                f"clip-{seed}", [InputMessage("user", (VideoInput(data=demo_task.clip_for(seed)[0],
                                                                  num_frames=demo_task.NUM_FRAMES),
                                                       TextInput(demo_task.PROMPT)))], sampling) for seed in seeds))
        return asyncio.run(prepare())


def test_drafts_are_accepted_and_tokens_unchanged(requests, seeds):
    model, tokenizer = load_engine_model(EngineConfig(model=str(DEMO_MODEL_DIR), device="cpu"))
    options = dict(device="cpu", max_num_seqs=len(seeds), engine_threads=1)
    plain = LLM(loaded_model=model, tokenizer=tokenizer, **options).generate(requests)
    llm = LLM(loaded_model=model, tokenizer=tokenizer, speculative_model=str(DEMO_ASSISTANT_DIR),
              num_speculative_tokens=3, **options)
    drafted = llm.generate(requests)
    assert [c.token_ids for c in drafted] == [c.token_ids for c in plain], f"seeds {seeds}"
    spec = llm.core.speculator
    assert spec.verified[0] >= len(seeds), f"speculation barely ran: {spec.verified} (seeds {seeds})"
    rates = [a / v for a, v in zip(spec.accepted, spec.verified, strict=True)]
    assert rates[0] >= 0.6, f"first-draft acceptance {rates} on seeds {seeds}"


@pytest.fixture(scope="module")
def speculating_server():
    server = LoopbackServer(engine_config(DEMO_MODEL_DIR, speculative_model=str(DEMO_ASSISTANT_DIR)),
                            ServerConfig(host="127.0.0.1", port=0, worker_threads=2, drain_grace_s=5.0)).start()
    yield server
    server.stop()


def test_served_demo_shows_speculation(speculating_server, seeds, capsys):
    with Client(speculating_server.address, timeout=60) as client:
        assert client.model_info().num_speculative_tokens == 3   # --num-speculative-tokens' default
    assert cli.main(["demo", "--server", speculating_server.address, "--seed", str(seeds[0])]) == 0
    out = capsys.readouterr().out
    assert f"truth  {demo_task.clip_for(seeds[0])[1]}" in out
    tokens, chunks = map(int, re.search(r"(\d+) tokens in (\d+) streamed chunks \(speculative decoding: up to 4 "
                                        r"tokens per step\)", out).groups())
    assert chunks < tokens, out
