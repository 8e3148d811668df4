"""The rows the perf model bills each collective for are the rows the real engine runs.

An E-style target (per-layer embeddings, KV-sharing layers) speculating with a tiny assistant runs
through the offline engine (one process, tp = 1: the rows a step runs do not depend on the layout)
with chunked prefill beside verify chunks; forward hooks count the rows every decoder layer, the
embedding, the logits and the drafter's steps really took in each step. At tp = 2 the perf model's
communication bytes per site, divided by one row's bytes, must give those counts for the same step
records, so its row accounting (KV-sharing layers on the sampled rows, or on every row beside a
verify chunk; logits of the sampled rows; R rows per draft step) is the engine's. The bytes per
row and the ring factors themselves are checked against real collectives in
tests/model/test_model_tensor_parallel.py.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
sys.path.insert(0, str(Path(__file__).parents[1] / "model"))

from engine_helpers import build_request, make_llm  # noqa: E402
from gemma4_fixtures import e_model_config, make_assistant, make_checkpoint  # noqa: E402

from mmserve.engine.observer import NullObserver  # noqa: E402
from mmserve.metrics.perf_model import PerfModel, StepContext  # noqa: E402
from mmserve.metrics.telemetry import draft_work, request_work  # noqa: E402
from mmserve.model import load_model  # noqa: E402
from mmserve.model.assistant_spec import load_assistant_spec  # noqa: E402
from mmserve.model.spec import load_spec  # noqa: E402
from mmserve.model.tokenizer import load_tokenizer  # noqa: E402


class StepWork(NullObserver):
    """Each step's requests as the perf model sees them, read when the step is reported, by the
    conversion metrics/telemetry.py bills with."""

    def __init__(self):
        self.steps = []

    def on_step(self, record) -> None:
        self.steps.append(StepContext(tuple(map(request_work, record.items)), drafts=draft_work(record)))


def counted_run(tmp_path, seed: int):
    """(the perf model's StepContext of each step, and per step: rows each decoder layer ran, rows
    embedded, logits rows, rows of each draft step)."""
    cfg = e_model_config()
    hf = make_checkpoint(tmp_path / "target", config=cfg, seed=seed)
    make_assistant(tmp_path / "assistant", cfg, seed=seed + 1, copy_from=hf)
    model = load_model(tmp_path / "target")
    steps: list[dict] = []

    def count(key: str, rows: int, layer: int | None = None) -> None:
        if steps:   # drafting after a step counts towards that step
            if layer is None:
                steps[-1][key].append(rows)
            else:
                steps[-1][key][layer] += rows

    for i, layer in enumerate(model.decoder.layers):
        layer.register_forward_pre_hook(lambda _m, args, i=i: count("layers", args[0].shape[0], i))
    llm = make_llm((model, load_tokenizer(tmp_path / "target")), block_size=4, max_num_batched_tokens=16,
                   speculative_model=str(tmp_path / "assistant"), num_speculative_tokens=3, observer=StepWork())
    execute, embed, logits = llm.core.runner.execute, model.decoder.embed, model.compute_logits
    assistant = llm.core.speculator.assistant
    draft_step = assistant.step

    def counting_execute(out, *prev):   # (async scheduling: the step in flight's tokens)
        steps.append(dict(layers=[0] * len(model.decoder.layers), embed=[], logits=[], drafts=[]))
        return execute(out, *prev)

    def counting_embed(ids, *args):
        count("embed", ids.shape[0])
        return embed(ids, *args)

    def counting_logits(hidden):
        count("logits", hidden.shape[0])
        return logits(hidden)

    def counting_draft_step(token_embeds, *args):
        count("drafts", token_embeds.shape[0])
        return draft_step(token_embeds, *args)

    llm.core.runner.execute, model.decoder.embed, model.compute_logits = counting_execute, counting_embed, counting_logits
    assistant.step = counting_draft_step
    requests = [build_request("short", [6], seed=seed, max_tokens=9),
                build_request("long", [40], seed=seed + 1, max_tokens=6),
                build_request("later", [3, ("image", 4), 12], seed=seed + 2, max_tokens=5)]
    llm.generate(requests)
    return llm.observer.steps, steps


def test_billed_rows_equal_the_rows_the_engine_ran(tmp_path):
    seed = int(torch.randint(0, 10_000, ()))
    contexts, steps = counted_run(tmp_path, seed)
    assert len(contexts) == len(steps)
    spec = load_spec(tmp_path / "target")
    perf = PerfModel(spec, dtype="float32", tp=2, drafter=load_assistant_spec(tmp_path / "assistant"))
    row = spec.hidden_size * 4 * 2 * (2 - 1) / 2   # one row's all-reduce: hidden fp32 bytes, sent per GPU of 2
    mixed = 0
    for ctx, ran in zip(contexts, steps, strict=True):
        work = ctx.requests
        comm = perf.step(ctx, per_gpu=True).comm_bytes
        target = ran["embed"][:1]   # the target's own lookup comes first; the drafter's follow it
        assert comm["comm.embed_all_reduce"] / row == sum(target), (seed, work)
        assert comm["comm.o_proj_all_reduce"] / row == sum(ran["layers"]), (seed, work)
        assert comm.get("comm.logits_all_gather", 0) / (spec.vocab_size * 4 / 2) == sum(ran["logits"]), seed
        drafted = comm.get("comm.drafter_embed_all_reduce", 0) / row
        assert drafted == sum(ran["drafts"]) == sum(ran["embed"][1:]), (seed, work)
        if any(w.num_tokens > 1 and not w.is_prefill for w in work) and any(w.is_prefill for w in work):
            mixed += 1   # beside a verify chunk the last (KV-sharing) layer ran every row of the step
            assert ran["layers"][-1] == sum(w.num_tokens for w in work), (seed, work)
    assert mixed, f"seed {seed}: no step held a verify chunk beside a prefill chunk"
    assert any(ctx.drafts for ctx in contexts), seed
