"""Structured output cost: the mask library per token, and the engine's decode step with masks on.

    python bench/structured.py            # JSON to bench/results/structured.json
    python bench/structured.py --smoke    # seconds; JSON to a temp file

1. Library: xgrammar and llguidance fill the allowed-token mask and advance past a token, on the
   demo model's tokenizer, along random valid paths through each schema (the measurement that
   chose xgrammar). Compile time per schema too.
2. Engine: the embedded demo model decodes the demo task's clips through `mmserve.LLM` at batch 1
   and 16, unconstrained vs constrained to the caption JSON schema, the same number of decode
   steps each (max_tokens cuts both); per-step time and the sampler's share. All mask work (fill,
   apply, advance) runs inside the sampler, so the overhead is the sampler's time difference; the
   whole step's difference is within the noise of a shared 2-core machine.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from mmserve.config import DEMO_MODEL_DIR, EngineConfig
from mmserve.multimodal.demo_task import CAPTION_SCHEMA, NUM_FRAMES, PROMPT, clip_for
from mmserve.multimodal.synthetic import COLOURS
from mmserve.sampling_params import ResponseFormat, SamplingParams

logger = logging.getLogger("bench.structured")
RESULTS = Path(__file__).resolve().parent / "results" / "structured.json"
SCHEMAS = {
    "caption": CAPTION_SCHEMA,
    "colours": {"type": "array", "items": {"enum": list(COLOURS)}, "minItems": 1, "maxItems": 4},
    "free": {"type": "object", "properties": {"label": {"type": "string", "maxLength": 24},
                                              "count": {"type": "integer"}}, "required": ["label", "count"]},
}


def _walk(fill, advance, done, vocab: int, rng: random.Random, max_steps: int = 64) -> list[float]:
    """One random valid path: per token, seconds to fill the mask and advance."""
    times, mask = [], torch.zeros(1, (vocab + 31) // 32, dtype=torch.int32)
    for _ in range(max_steps):
        if done():
            break
        t = time.perf_counter()
        fill(mask)
        bits = ((mask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab]
        dt = time.perf_counter() - t
        token = rng.choice(torch.nonzero(bits).flatten().tolist())
        t = time.perf_counter()
        advance(token)
        times.append(dt + time.perf_counter() - t)
    return times


def bench_libraries(runs: int) -> list[dict]:
    import llguidance
    import llguidance.torch as llg_torch
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    from mmserve.model.tokenizer import load_tokenizer

    tok = load_tokenizer(DEMO_MODEL_DIR)
    vocab, eos = tok.vocab_size, [1, 5]
    info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tok.backend),
                                              vocab_size=vocab, stop_token_ids=eos)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    ll_tok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=vocab, eos_token=eos)
    rows = []
    for name, schema in SCHEMAS.items():
        text = json.dumps(schema)
        t = time.perf_counter()
        compiled = compiler.compile_json_schema(text, any_whitespace=False, separators=(",", ":"))
        xgr_compile = time.perf_counter() - t
        t = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            text, defaults={"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"})
        llguidance.LLMatcher(ll_tok, grammar)
        llg_compile = time.perf_counter() - t
        per_lib = {}
        for lib in ("xgrammar", "llguidance"):
            rng, times = random.Random(0), []
            for _ in range(runs):
                if lib == "xgrammar":
                    m = xgr.GrammarMatcher(compiled)
                    times += _walk(lambda mask, m=m: m.fill_next_token_bitmask(mask, 0), m.accept_token,
                                   m.is_terminated, vocab, rng)
                else:
                    m = llguidance.LLMatcher(ll_tok, grammar)
                    times += _walk(lambda mask, m=m: llg_torch.fill_next_token_bitmask(m, mask, 0), m.consume_token,
                                   m.is_stopped, vocab, rng)
            per_lib[lib] = times
        for lib, times in per_lib.items():
            rows.append(dict(schema=name, library=lib, tokens=len(times),
                             median_us=1e6 * statistics.median(times), mean_us=1e6 * statistics.fmean(times),
                             p99_us=1e6 * sorted(times)[int(0.99 * (len(times) - 1))],
                             compile_ms=1e3 * (xgr_compile if lib == "xgrammar" else llg_compile)))
    return rows


def _requests(llm, config, n: int, sampling: SamplingParams) -> list:
    from mmserve.engine.input.processor import InputMessage, InputProcessor, TextInput, VideoInput

    clips = [clip_for(1_000_000 + i)[0] for i in range(n)]
    with ThreadPoolExecutor(2) as pool:
        processor = InputProcessor(config, llm.core.tokenizer, llm.core.model.spec, pool,
                                   max_model_len=llm.core.max_model_len)

        async def prepare():
            return await asyncio.gather(*(processor.process(
                f"b{i}-{random.getrandbits(32)}", [InputMessage("user", (VideoInput(data=c, num_frames=NUM_FRAMES),
                                                                      TextInput(PROMPT)))], sampling)
                for i, c in enumerate(clips)))
        return asyncio.run(prepare())


def bench_engine(batches: list[int], steps: int, repeats: int) -> list[dict]:
    from mmserve.engine.llm import LLM

    # the synchronous loop: it times the sampler's one call per step (the async loop queues it instead)
    config = EngineConfig(model=str(DEMO_MODEL_DIR), device="cpu", max_num_seqs=max(batches), async_scheduling="off")
    llm = LLM(**dataclasses.asdict(config))
    core = llm.core
    decode_steps: list[float] = []
    sampler_s: list[float] = []
    state = {"decode": False}
    execute, sample, step = core.runner.execute, core.sampler.sample, core.step

    def timed_execute(out):
        state["decode"] = all(not s.is_prefill for s in out.scheduled)
        return execute(out)

    def timed_sample(logits, requests):
        t = time.perf_counter()
        result = sample(logits, requests)
        if state["decode"]:
            sampler_s.append(time.perf_counter() - t)
        return result

    def timed_step():
        state["decode"] = False
        t = time.perf_counter()
        events = step()
        if state["decode"]:
            decode_steps.append(time.perf_counter() - t)
        return events

    core.runner.execute, core.sampler.sample, core.step = timed_execute, timed_sample, timed_step
    modes = {"unconstrained": SamplingParams(max_tokens=steps, temperature=1.0, ignore_eos=True),
             "json_schema": SamplingParams(max_tokens=steps, temperature=1.0, response_format=ResponseFormat(
                 "json_schema", json.dumps(CAPTION_SCHEMA)))}
    rows = []
    for batch in batches:
        for mode, sampling in modes.items():
            llm.generate(_requests(llm, config, batch, sampling))   # warm-up (and the grammar compile)
            decode_steps.clear()
            sampler_s.clear()
            for _ in range(repeats):
                llm.generate(_requests(llm, config, batch, sampling))
            rows.append(dict(batch=batch, mode=mode, steps=len(decode_steps),
                             step_ms=1e3 * statistics.median(decode_steps),
                             sampler_ms=1e3 * statistics.median(sampler_s)))
    for batch in batches:
        base, masked = (next(r for r in rows if r["batch"] == batch and r["mode"] == m)
                        for m in ("unconstrained", "json_schema"))
        masked["overhead_ms_per_step"] = masked["sampler_ms"] - base["sampler_ms"]
        masked["overhead_us_per_token"] = 1e3 * masked["overhead_ms_per_step"] / batch
        masked["overhead_share_of_step"] = masked["overhead_ms_per_step"] / base["step_ms"]
    return rows


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny sizes; results to a temp file")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    libs = bench_libraries(runs=2 if args.smoke else 40)
    engine = bench_engine([2] if args.smoke else [1, 16], steps=4 if args.smoke else 40,
                          repeats=1 if args.smoke else 3)
    print(f"{'schema':10} {'library':11} {'tokens':>6} {'median us':>10} {'mean us':>8} {'p99 us':>8} {'compile ms':>10}")
    for r in libs:
        print(f"{r['schema']:10} {r['library']:11} {r['tokens']:6d} {r['median_us']:10.1f} {r['mean_us']:8.1f} "
              f"{r['p99_us']:8.1f} {r['compile_ms']:10.2f}")
    print(f"\n{'batch':>5} {'mode':14} {'steps':>5} {'step ms':>8} {'sampler ms':>10} {'overhead us/token':>17} "
          f"{'of step':>7}")
    for r in engine:
        extra = (f"{r['overhead_us_per_token']:17.1f} {r['overhead_share_of_step']:7.1%}"
                 if "overhead_us_per_token" in r else "")
        print(f"{r['batch']:5d} {r['mode']:14} {r['steps']:5d} {r['step_ms']:8.2f} {r['sampler_ms']:10.3f} {extra}")
    out = Path(tempfile.mkstemp(suffix=".json")[1]) if args.smoke else RESULTS
    out.write_text(json.dumps({"command": "python bench/structured.py" + (" --smoke" if args.smoke else ""),
                               "torch_threads": 1, "libraries": libs, "engine": engine}, indent=2) + "\n")
    logger.info("wrote %s", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
