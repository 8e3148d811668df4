"""Speculative decoding on the demo model with its trained assistant (src/mmserve/demo_assistant):
mmserve with and without speculation, beside transformers' padded batch and transformers' assisted
generation (batch 1, its only batch size), on the same identical video requests.

Requests are N held-out demo-task clips (4 frames, the demo prompt), greedy, a fixed 32 tokens each
(ignore_eos, as bench/serving.py; the assistant was trained on the target's 32-token continuations,
caption and what follows). K = 3. Per N = 1, 16, 64, the in-process systems run the same work,
interleaved, best of --repeats (3x as many below N = 16; a shared machine's load hits them alike), after one warm-up each:
mmserve's engine (mmserve.LLM: the server's engine core stepped in this process, no gRPC, no IPC)
without and with the assistant, and transformers. Then the real gRPC server (`mmserve serve` in its
own process, N streaming clients at once, bench/serving.py's client) without and with it, best of
--repeats. All use --threads torch threads. Reported: tok/s (all output tokens / wall, prefill
included), TPOT (median over requests of the time after the first token / tokens after the first;
transformers: its batch's), decode tok/s (N / TPOT), engine steps, and the engine's acceptance per
draft position in its timed runs; speculating rows also x the same system without speculation
(decode tok/s / all tok/s) and x transformers' padded batch (tok/s). The in-process systems get
decoded, patchified inputs; the server decodes the clips itself, so its reference is transformers'
batch timed from the video bytes too ("from bytes", as bench/serving.py times it). Greedy tokens
must be the same on every system (the script fails otherwise).

    python bench/speculative.py            # N = 1, 16, 64 (about 2 minutes on 2 cores)
    python bench/speculative.py --smoke    # seconds: N = 1, 2, 8 tokens, the speculating server only,
                                           # one run each, no warm-ups; JSON to a temp file

Prints a table and writes JSON (default bench/results/speculative.json).
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import dataclasses
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from offline import Inline
from serving import TokenClock, hf_generate, machine, pad_left, server_process
from serving import run_level as server_level

from mmserve.config import DEMO_ASSISTANT_DIR, DEMO_MODEL_DIR, EngineConfig
from mmserve.core.engine_core import load_engine_model
from mmserve.engine.input.processor import InputMessage, InputProcessor, TextInput, VideoInput
from mmserve.engine.llm import LLM
from mmserve.model.spec import load_spec
from mmserve.multimodal import demo_task
from mmserve.multimodal.demo_task import VisionParams, reference_inputs
from mmserve.sampling_params import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results" / "speculative.json"
FROM_BYTES = "transformers batch, from bytes"   # the server's reference: its time counts decoding the clips
FIRST_SEED = demo_task.HELDOUT_SEED_BASE + 500_000   # held out from training and from the script's own eval


def videos(n: int) -> list[bytes]:
    return [demo_task.clip_for(FIRST_SEED + i)[0] for i in range(n)]


def engine_requests(model_dir: Path, clips: list[bytes], max_tokens: int) -> list:
    config = EngineConfig(model=str(model_dir))
    spec = load_spec(model_dir)
    processor = InputProcessor.from_checkpoint(config, Inline(), spec=spec, context_length=spec.max_model_len)
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def one(i: int, video: bytes):
        message = InputMessage("user", (VideoInput(data=video, num_frames=demo_task.NUM_FRAMES),
                                        TextInput(demo_task.PROMPT)))
        return await processor.process(f"req-{i}", [message], sampling)
    return [asyncio.run(one(i, v)) for i, v in enumerate(clips)]


def hf_requests(model_dir: Path, clips: list[bytes]) -> list:
    spec = load_spec(model_dir)
    from tokenizers import Tokenizer
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    vision = VisionParams(spec.patch_size, spec.pooling_kernel_size, spec.video_max_soft_tokens)
    return [reference_inputs(tokenizer, v, vision) for v in clips]


class Engine:
    """One LLM over the shared loaded model (speculating or not), warmed up on the level's requests
    unless `warm_up` is off (the smoke run)."""

    def __init__(self, model, tokenizer, requests: list, n: int, assistant: Path | None, k: int, warm_up: bool):
        options = dict(device="cpu", attention_backend="sdpa", max_num_seqs=max(n, 2), kv_cache_bytes=192 * 2**20,
                       enable_prefix_caching=False)   # timed runs repeat the warm-up's requests
        if assistant is not None:
            options.update(speculative_model=str(assistant), num_speculative_tokens=k)
        self.llm = LLM(loaded_model=model, tokenizer=tokenizer, **options)
        self.requests, self.n, self.runs = requests[:n], n, 0
        if warm_up:
            self.run()

    def run(self) -> dict:
        batch = [dataclasses.replace(r, request_id=f"{r.request_id}-{self.runs}") for r in self.requests]
        self.runs += 1
        spec = self.llm.core.speculator
        before = (list(spec.verified), list(spec.accepted)) if spec else None
        first_step = self.llm.core.step_index
        start = time.perf_counter()
        done = self.llm.generate(batch)
        wall = time.perf_counter() - start
        tpot = [(c.timings.end_to_end_s - c.timings.time_to_first_token_s) / (len(c.token_ids) - 1) for c in done]
        out = dict(wall_s=wall, tpot_ms=1000 * statistics.median(tpot), steps=self.llm.core.step_index - first_step,
                   tokens=[c.token_ids for c in done])
        if spec:
            verified = [a - b for a, b in zip(spec.verified, before[0], strict=True)]
            accepted = [a - b for a, b in zip(spec.accepted, before[1], strict=True)]
            out["acceptance"] = [round(a / v, 3) if v else 0.0 for a, v in zip(accepted, verified, strict=True)]
        return out


def hf_batch_run(model, batch: dict, max_tokens: int) -> dict:
    start = time.perf_counter()
    out, clock = hf_generate(model, batch, max_tokens)
    wall = time.perf_counter() - start
    return dict(wall_s=wall, tpot_ms=1000 * (clock.steps[-1] - clock.steps[0]) / (len(clock.steps) - 1),
                steps=len(clock.steps), tokens=out.tolist())


def hf_assisted_run(model, assistant, inputs: dict, max_tokens: int) -> dict:
    """transformers' assisted generation (Gemma4AssistantCandidateGenerator), greedy, exactly max_tokens."""
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = model.config.get_text_config().vocab_size   # never chosen: ignore_eos (hf_generate)
    config.max_new_tokens, config.do_sample = max_tokens, False
    clock = TokenClock()
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**inputs, generation_config=config, assistant_model=assistant, streamer=clock)
    wall = time.perf_counter() - start
    # a put per verify step: the first put after the prompt holds the first token
    tpot = (clock.steps[-1] - clock.steps[0]) / (max_tokens - 1)
    return dict(wall_s=wall, tpot_ms=1000 * tpot, steps=len(clock.steps),
                tokens=out[:, inputs["input_ids"].shape[1]:].tolist())


def hf_from_bytes_run(model, model_dir: Path, clips: list[bytes], max_tokens: int) -> dict:
    """The padded batch timed from the video bytes (decode and preprocessing count), as the server's is."""
    start = time.perf_counter()
    batch = pad_left(hf_requests(model_dir, clips), load_spec(model_dir).pad_token_id)
    result = hf_batch_run(model, batch, max_tokens)
    return {**result, "wall_s": time.perf_counter() - start}


def level(n: int, args, model, tokenizer, requests, hf_model, hf_assistant, hf_inputs, clips) -> list[dict]:
    """Every system on the first n requests, interleaved, the fastest of repeats(n) each."""
    warm_up = not args.smoke   # the smoke run times nothing worth warming up for
    engines = {"mmserve": Engine(model, tokenizer, requests, n, None, args.k, warm_up),
               "mmserve + assistant": Engine(model, tokenizer, requests, n, args.assistant, args.k, warm_up)}
    batch = pad_left(hf_inputs[:n], load_spec(args.model).pad_token_id)
    systems = {name: e.run for name, e in engines.items()}
    systems["transformers padded batch"] = lambda: hf_batch_run(hf_model, batch, args.max_tokens)
    systems[FROM_BYTES] = lambda: hf_from_bytes_run(hf_model, args.model, clips[:n], args.max_tokens)
    if n == 1:
        single = {**hf_inputs[0].as_kwargs(), "attention_mask": torch.ones_like(hf_inputs[0].input_ids)}
        if warm_up:
            hf_assisted_run(hf_model, hf_assistant, single, 2)
        systems["transformers assisted (batch 1)"] = lambda: hf_assisted_run(hf_model, hf_assistant, single,
                                                                              args.max_tokens)
    if warm_up:
        hf_batch_run(hf_model, batch, 2)
    best: dict[str, dict] = {}
    for _ in range(repeats(args, n)):
        for name, run in systems.items():
            result = run()
            if name not in best or result["wall_s"] < best[name]["wall_s"]:
                best[name] = result
    reference = best["transformers padded batch"]["tokens"]
    for name, r in best.items():
        check_tokens(n, name, r["tokens"], reference)
    del engines
    gc.collect()
    return [row(n, name, r["wall_s"], r["tpot_ms"], args.max_tokens, steps=r["steps"], acceptance=r.get("acceptance"),
                tokens=reference if name == "transformers padded batch" else None) for name, r in best.items()]


def repeats(args, n: int) -> int:
    """Runs per system and level, the fastest counting: a level below N = 16 takes ~0.1 s, which one
    load spike on a shared machine doubles, so it runs three times as often (the smoke run: once)."""
    if args.smoke:
        return 1
    return args.repeats if n >= 16 else 3 * args.repeats


def check_tokens(n: int, name: str, tokens: list, reference: list) -> None:
    if [list(t) for t in tokens] != [list(t) for t in reference]:
        raise SystemExit(f"N={n}: {name}'s greedy tokens differ from transformers' padded batch")


def row(n: int, system: str, wall_s: float, tpot_ms: float, max_tokens: int, **extra) -> dict:
    return dict(n=n, system=system, tok_s=round(n * max_tokens / wall_s, 1), tpot_ms=round(tpot_ms, 2),
                decode_tok_s=round(n * 1000 / tpot_ms, 1), wall_s=round(wall_s, 3), **extra)


def server_rows(args, clips: list[bytes], references: dict[int, list], speculative_only: bool) -> list[dict]:
    """The gRPC server in its own process (`mmserve serve`, OMP threads = --threads), speculation off and
    on, N clients streaming at once, best of repeats(n); after the in-process systems (the same clips)."""
    rows = []
    for speculative in (True,) if speculative_only else (False, True):
        flags = ["--speculative-model", str(args.assistant), "--num-speculative-tokens", str(args.k)] \
            if speculative else []
        name = "server + assistant" if speculative else "server"
        with tempfile.TemporaryDirectory() as tmp, server_process(
                str(args.model), threads=args.threads, max_num_seqs=max(args.concurrency),
                log_path=Path(tmp) / "server.log", flags=flags) as address:
            if not args.smoke:   # warm-up
                asyncio.run(server_level(address, clips[:2], concurrency=2, max_tokens=4,
                                         num_frames=demo_task.NUM_FRAMES))
            for n in args.concurrency:
                runs = [asyncio.run(server_level(address, clips[:n], concurrency=n, max_tokens=args.max_tokens,
                                                 num_frames=demo_task.NUM_FRAMES)) for _ in range(repeats(args, n))]
                level, samples = max(runs, key=lambda run: run[0].output_tokens_per_s)
                check_tokens(n, name, [s.token_ids for s in samples], references[n])
                rows.append(row(n, name, level.wall_s, 1000 * level.tpot_p50_s, args.max_tokens))
    return rows


def add_ratios(rows: list[dict]) -> None:
    """On each speculating row: x the same system without speculation (decode tok/s, all tok/s) and x
    transformers' padded batch (all tok/s; for the server, the batch timed from the video bytes as the
    server is: bench/serving.py's comparison)."""
    by = {(r["n"], r["system"]): r for r in rows}
    for r in rows:
        if not r["system"].endswith(" + assistant"):
            continue
        reference = FROM_BYTES if r["system"].startswith("server") else "transformers padded batch"
        plain, hf = by.get((r["n"], r["system"].removesuffix(" + assistant"))), by[(r["n"], reference)]
        if plain is not None:
            r["x_no_speculation_decode"] = round(r["decode_tok_s"] / plain["decode_tok_s"], 2)
            r["x_no_speculation"] = round(r["tok_s"] / plain["tok_s"], 2)
        r["x_hf_batch"] = round(r["tok_s"] / hf["tok_s"], 2)


def table(rows: list[dict]) -> str:
    lines = [f"{'N':>3}  {'system':<32}{'tok/s':>8}{'TPOT ms':>9}{'decode tok/s':>13}{'steps':>6}  "
             "x plain (decode / all)  x hf batch  acceptance per position"]
    for r in rows:
        ratio = f"{r['x_no_speculation_decode']:.2f} / {r['x_no_speculation']:.2f}" \
            if "x_no_speculation" in r else ""
        acc = " ".join(f"{a:.2f}" for a in r["acceptance"]) if r.get("acceptance") else ""
        lines.append(f"{r['n']:>3}  {r['system']:<32}{r['tok_s']:>8.1f}{r['tpot_ms']:>9.2f}{r['decode_tok_s']:>13.1f}"
                     f"{r.get('steps') or '':>6}  {ratio:<22}  {r.get('x_hf_batch', ''):<9}  {acc}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=DEMO_MODEL_DIR)
    parser.add_argument("--assistant", type=Path, default=DEMO_ASSISTANT_DIR, help="the drafter checkpoint")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16, 64])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (both sides; 1: steadier when shared)")
    parser.add_argument("-k", type=int, default=3)
    parser.add_argument("--no-server", action="store_true", help="skip the gRPC server (in-process systems only)")
    args = parser.parse_args(argv)
    if args.smoke:
        args.concurrency, args.max_tokens, args.repeats = [1, 2], 8, 1
    out = args.out or (Path(tempfile.mkdtemp()) / "speculative.json" if args.smoke else RESULTS)
    torch.set_num_threads(args.threads)
    from transformers import Gemma4AssistantForCausalLM, Gemma4ForConditionalGeneration

    clips = videos(max(args.concurrency))
    requests = engine_requests(args.model, clips, args.max_tokens)
    model, tokenizer = load_engine_model(EngineConfig(model=str(args.model), device="cpu", attention_backend="sdpa"))
    hf_model = Gemma4ForConditionalGeneration.from_pretrained(str(args.model), dtype=torch.float32,
                                                              attn_implementation="sdpa").eval()
    hf_assistant = Gemma4AssistantForCausalLM.from_pretrained(str(args.assistant), dtype=torch.float32).eval()
    hf_assistant.generation_config.num_assistant_tokens = args.k
    hf_assistant.generation_config.num_assistant_tokens_schedule = "constant"
    inputs = hf_requests(args.model, clips)
    rows = []
    for n in args.concurrency:
        rows += level(n, args, model, tokenizer, requests, hf_model, hf_assistant, inputs, clips)
    references = {r["n"]: r.pop("tokens") for r in rows if r.get("tokens") is not None}
    for r in rows:
        r.pop("tokens", None)
    if not args.no_server:
        rows += server_rows(args, clips, references, speculative_only=args.smoke)
    rows.sort(key=lambda r: r["n"])
    add_ratios(rows)
    print(table(rows))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(machine=machine(), k=args.k, max_tokens=args.max_tokens, threads=args.threads,
                                   prompt_tokens=len(requests[0].prompt_token_ids), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
