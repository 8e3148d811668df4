"""Graph coverage on a mixed workload: the share of engine steps that replay a CUDA graph.

    python bench/graph_coverage.py           # JSON to bench/results/graph_coverage.json
    python bench/graph_coverage.py --smoke   # fewer requests and tokens; JSON to a temp file

The embedded demo model and its trained assistant (speculation on, K = 3), flex attention (it can
be captured), graphs emulated on this CPU (--emulate-cuda-graphs: the same bucketing, padding and
persistent buffers as on CUDA). The workload: text requests decoding (greedy, seeded random, a
regex grammar, one with disable_speculation), then real PyAV video clips arriving while they
decode, so prefill chunks and frames land among the decodes. Each loop runs it from scratch:
  main        the loop before #35: a graph only for uniform steps (every request the same rows, no
              prefill); a speculating step only when every request verifies K drafts
  uniform     + every speculating request's chunk padded to 1 + K rows (scheduler.verify_width)
  piecewise   + every other step as piecewise graphs (dense pieces per token bucket, attention eager)
  async       + async scheduling (each step built while the one before runs; its drafts made and
              accepted on the device, its positions moved back there)
  eager       --enforce-eager: the tokens every loop must reproduce
One line per loop: steps, the share that replayed a graph (uniform, piecewise), whether greedy and
seeded tokens equal the eager loop's, whether every KV block is free at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import tempfile
from pathlib import Path

import torch
from offline import Inline
from serving import clips, machine

from mmserve.config import DEMO_ASSISTANT_DIR, DEMO_MODEL_DIR, EngineConfig
from mmserve.engine.input.processor import InputMessage, InputProcessor, TextInput, VideoInput
from mmserve.engine.llm import LLM
from mmserve.model import load_model
from mmserve.model.spec import load_spec
from mmserve.model.tokenizer import load_tokenizer
from mmserve.sampling_params import ResponseFormat, SamplingParams
from mmserve.worker.piecewise_graphs import PiecewiseGraphs

logger = logging.getLogger("bench.graph_coverage")
RESULTS = Path(__file__).resolve().parent / "results" / "graph_coverage.json"
LOOPS = ("main", "uniform", "piecewise", "async", "eager")
GRAMMAR = ResponseFormat("regex", r"(ab|cd)( [0-9]{1,3})+\.")


def workload(num_text: int, num_videos: int, max_tokens: int, num_frames: int) -> list[tuple[int, object]]:
    """(arrival step, EngineRequest): the text requests at step 0, a video every 4 steps from step 3."""
    config = EngineConfig(model=str(DEMO_MODEL_DIR))
    spec = load_spec(DEMO_MODEL_DIR)
    processor = InputProcessor.from_checkpoint(config, Inline(), spec=spec, context_length=spec.max_model_len)
    kinds = [dict(), dict(temperature=1.0, seed=7), dict(response_format=GRAMMAR, ignore_eos=False),
             dict(disable_speculation=True)]

    async def make(rid: str, parts, **sampling):
        params = {"max_tokens": max_tokens, "ignore_eos": True, **sampling}
        return await processor.process(rid, [InputMessage("user", parts)], SamplingParams(**params))

    out = [(0, asyncio.run(make(f"text-{i}", (TextInput(f"Say something about the number {i}."),),
                                **kinds[i % len(kinds)]))) for i in range(num_text)]
    for i, video in enumerate(clips(num_videos, num_frames)):
        parts = (VideoInput(data=video, num_frames=num_frames), TextInput("What happens here?"))
        out.append((3 + 4 * i, asyncio.run(make(f"video-{i}", parts))))
    return out


def run_loop(model, tokenizer, loop: str, work, max_num_batched_tokens: int, num_kv_blocks: int = 0,
             backend: str = "flex") -> dict:
    llm = LLM(loaded_model=model, tokenizer=tokenizer, device="cpu", attention_backend=backend, max_num_seqs=16,
              max_num_batched_tokens=max_num_batched_tokens, num_kv_blocks=num_kv_blocks,
              enforce_eager=loop == "eager", emulate_cuda_graphs=True,
              speculative_model=str(DEMO_ASSISTANT_DIR), num_speculative_tokens=3,
              async_scheduling="on" if loop == "async" else "off")
    core, runner = llm.core, llm.core.runner
    if loop == "main":   # no pads: a speculating step is uniform only when every request verifies K drafts
        core.scheduler.verify_width = 0
    if loop in ("main", "uniform"):   # no piecewise graphs: every other step eager
        runner.piecewise = PiecewiseGraphs((), mode=None, attn_width=0, dtype=model.dtype, device=model.device,
                                           hidden_size=0)
    steps, uniform, piecewise, prefill = 0, 0, 0, 0
    execute = runner.execute

    def counting(out, *prev):
        nonlocal steps, uniform, piecewise, prefill
        before = (runner.graphs.replays, runner.piecewise.replays)
        result = execute(out, *prev)
        steps += 1
        uniform += runner.graphs.replays > before[0]
        piecewise += runner.piecewise.replays > before[1]
        prefill += any(s.is_prefill for s in out.scheduled)
        return result

    runner.execute = counting
    tokens, step, pending = {r.request_id: [] for _, r in work}, 0, list(work)
    while pending or llm.has_work:
        for item in [p for p in pending if p[0] <= step]:
            llm.add_request(item[1])
            pending.remove(item)
        for rid, event in llm.step():
            if isinstance(event, BaseException):
                raise event
            tokens[rid] += event.new_token_ids
        step += 1
    free = all(p.num_free == p.num_usable and not any(p.ref_cnt) for p in core.kv.pools.values())
    return dict(loop=loop, steps=steps, prefill_steps=prefill, uniform_replays=uniform, piecewise_replays=piecewise,
                replayed_share=round((uniform + piecewise) / steps, 3), blocks_free=free, tokens=tokens)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="4 text requests, 1 video, 6 tokens, 512 KV blocks per pool, SDPA "
                   "attention (no flex compile: the smoke proves the script runs); JSON to a temp file")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    num_text, num_videos, max_tokens = (4, 1, 6) if args.smoke else (8, 3, 24)
    work = workload(num_text, num_videos, max_tokens, num_frames=4)
    backend = "sdpa" if args.smoke else "flex"   # flex, as FA4 on CUDA, reads positions on the device
    model = load_model(DEMO_MODEL_DIR, dtype="float32", device="cpu", attention_backend=backend)
    tokenizer = load_tokenizer(DEMO_MODEL_DIR)
    # The smoke sizes every loop's pools alike: sized from memory, async's position slack shifts a
    # few blocks between them, and flex compiles again for the new key lengths (~15 s on a cold cache).
    num_kv_blocks = 512 if args.smoke else 0
    rows = [run_loop(model, tokenizer, loop, work, max_num_batched_tokens=128, num_kv_blocks=num_kv_blocks,
                     backend=backend) for loop in LOOPS]
    eager = rows[-1]["tokens"]
    print(f"{'loop':<10}{'steps':>6}{'prefill':>8}{'uniform':>8}{'piecewise':>10}{'replayed':>9}{'tokens==eager':>14}"
          f"{'blocks free':>12}")
    for row in rows:
        row["tokens_equal_eager"] = row["tokens"] == eager
        print(f"{row['loop']:<10}{row['steps']:>6}{row['prefill_steps']:>8}{row['uniform_replays']:>8}"
              f"{row['piecewise_replays']:>10}{row['replayed_share']:>9.0%}{str(row['tokens_equal_eager']):>14}"
              f"{str(row['blocks_free']):>12}")
    out = args.out or (Path(tempfile.mkdtemp()) / "graph_coverage.json" if args.smoke else RESULTS)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine(), "workload": dict(text=num_text, videos=num_videos,
                                                                      max_tokens=max_tokens, frames=4),
                               "loops": [{k: v for k, v in r.items() if k != "tokens"} for r in rows]}, indent=2))
    logger.warning("wrote %s", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
