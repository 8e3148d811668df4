"""`mmserve eval-demo`: exact-match caption accuracy of the demo model on held-out synthetic clips.

Through a server (`--server HOST:PORT`), or offline through the same engine core (`--offline`),
where `--break` swaps in a deliberately wrong pipeline to show the check has teeth:

  causal-frames        the bidirectional term is dropped: frame tokens see only earlier ones
  hide-earlier-frames  full layers get the sliding window too, so earlier frames' keys are hidden
  reversed-frames      frames are placed in reverse order (a decoder/timestamp ordering bug)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from mmserve.multimodal.demo_task import HELDOUT_SEED_BASE, NUM_FRAMES, PROMPT, clip_for

logger = logging.getLogger(__name__)

BREAKS = ("none", "causal-frames", "hide-earlier-frames", "reversed-frames")
MAX_TOKENS = 32


@dataclass
class EvalResult:
    correct: int
    total: int
    misses: list[tuple[int, str, str]]  # (seed, truth, answer)

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else 0.0


def score(seeds: list[int], answers: list[str], truths: list[str]) -> EvalResult:
    misses = [(s, t, a) for s, t, a in zip(seeds, truths, answers, strict=True) if a.strip() != t]
    return EvalResult(len(seeds) - len(misses), len(seeds), misses)


def held_out_seeds(n: int, start: int = 0) -> list[int]:
    return [HELDOUT_SEED_BASE + start + i for i in range(n)]


def eval_server(target: str, seeds: list[int], *, concurrency: int = 8, api_key: str | None = None,
                timeout: float = 120.0) -> tuple[EvalResult, list[tuple[int, ...]]]:
    """Greedy captions through a gRPC server; returns the score and every answer's token ids."""
    from mmserve.clients.client import Client

    clips = [clip_for(s) for s in seeds]
    with Client(target, api_key=api_key, timeout=timeout) as client, ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda c: client.generate(prompt=PROMPT, video=c[0], num_frames=NUM_FRAMES,
                                                          max_tokens=MAX_TOKENS, temperature=0.0), clips))
    return score(seeds, [r.text for r in results], [t for _, t in clips]), [r.token_ids for r in results]


def _broken_model(model, how: str) -> Callable[[list], list]:
    """Rewire `model` for `how`; returns the request transform that goes with it. Attention breaks
    change the layer type's spec, which its backend's metadata builder (the mask) and impl both read."""
    from mmserve.attention import create_impl

    spec = model.spec
    if how in ("causal-frames", "hide-earlier-frames"):
        window = spec.attention_specs["sliding_attention"].window
        broken = {}
        for layer_type, attn in spec.attention_specs.items():
            if how == "causal-frames" and attn.bidirectional:
                attn = dataclasses.replace(attn, bidirectional=False)
            if how == "hide-earlier-frames" and attn.window is None:
                attn = dataclasses.replace(attn, window=window)
            broken[layer_type] = attn
        model.spec = dataclasses.replace(spec, attention_specs=broken)
        for layer_type, layer in zip(spec.layer_types, model.decoder.layers, strict=True):
            layer.self_attn.impl = create_impl(model.attention_backends[layer_type], broken[layer_type])
    if how == "reversed-frames":
        def reverse(requests: list) -> list:
            return [dataclasses.replace(r, mm_inputs=r.mm_inputs[::-1]) for r in requests]
        return reverse
    return lambda requests: requests


def eval_offline(model_path: str, seeds: list[int], *, how: str = "none", **engine_options) -> EvalResult:
    """Greedy captions through `mmserve.LLM` (the server's engine core, no transport)."""
    from mmserve.config import EngineConfig
    from mmserve.core.engine_core import load_engine_model
    from mmserve.engine.input.processor import InputMessage, InputProcessor, TextInput, VideoInput
    from mmserve.engine.llm import LLM
    from mmserve.sampling_params import SamplingParams

    if how not in BREAKS:
        raise ValueError(f"unknown break {how!r}; choose from {BREAKS}")
    config = EngineConfig(model=model_path, **engine_options)
    model, tokenizer = load_engine_model(config)
    transform = _broken_model(model, how)
    llm = LLM(loaded_model=model, tokenizer=tokenizer, **dataclasses.asdict(config))
    sampling = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    clips = [clip_for(s) for s in seeds]
    with ThreadPoolExecutor(2) as pool:
        processor = InputProcessor(config, tokenizer, model.spec, pool, max_model_len=llm.core.max_model_len)

        def messages(data: bytes) -> list[InputMessage]:
            return [InputMessage("user", (VideoInput(data=data, num_frames=NUM_FRAMES), TextInput(PROMPT)))]

        async def prepare() -> list:
            return await asyncio.gather(*(processor.process(f"eval-{s}", messages(data), sampling)
                                          for s, (data, _) in zip(seeds, clips, strict=True)))

        requests = transform(asyncio.run(prepare()))
    completions = llm.generate(requests)
    return score(seeds, [c.text for c in completions], [t for _, t in clips])


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("eval-demo", help="caption accuracy of the demo model on held-out generated videos",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--server", help="HOST:PORT of a running `mmserve serve`")
    where.add_argument("--offline", action="store_true", help="run the engine in this process instead")
    p.add_argument("--model", default=None, help="checkpoint for --offline (default: the embedded demo model)")
    p.add_argument("--break", dest="how", choices=BREAKS, default="none", help="a deliberately broken pipeline "
                   "(--offline only)")
    p.add_argument("--n", type=int, default=200, help="number of held-out clips")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (--server)")
    p.add_argument("--api-key", default=None, help="sent as 'authorization: Bearer KEY' (env MMSERVE_API_KEY)")
    p.add_argument("--show-misses", type=int, default=5, help="print this many wrong answers")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    seeds = held_out_seeds(args.n)
    if args.server:
        if args.how != "none":
            sys.stderr.write("--break needs --offline (the server runs the real pipeline)\n")
            return 2
        result, _ = eval_server(args.server, seeds, concurrency=args.concurrency,
                                api_key=args.api_key or os.environ.get("MMSERVE_API_KEY"))
    else:
        from mmserve.config import DEMO_MODEL_DIR

        result = eval_offline(args.model or str(DEMO_MODEL_DIR), seeds, how=args.how)
    for seed, truth, answer in result.misses[: args.show_misses]:
        sys.stdout.write(f"miss seed {seed}: want {truth!r}, got {answer!r}\n")
    label = f"offline, break={args.how}" if args.offline else args.server
    sys.stdout.write(f"exact match {result.correct}/{result.total} = {result.accuracy:.1%} ({label})\n")
    return 0
