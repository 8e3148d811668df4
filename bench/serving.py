"""Serving benchmark: mmserve's gRPC server against transformers' generate, in one run.

For each model (the embedded demo model, and a larger random-weight Gemma 4 whose compute
dominates Python overhead) it starts the real server in its own process, sends N concurrent
video+text requests from an AsyncClient (N = 1, 4, 16, 64; at most N in flight), and measures
output tokens/s, requests/s, TTFT and TPOT percentiles (seen by the client) and the mean MFU/MBU
the server reports in each Final. With the server stopped, the same requests then go through
transformers' `generate` one at a time and as one left-padded batch per N. All requests use greedy
decoding with a fixed output length (ignore_eos; no EOS in transformers) so both sides emit the same
number of tokens; the share of requests whose tokens agree is reported as a sanity check. Both sides
first warm up on one batch of the first level's size, and each level runs `--repeats` times on each
side, the fastest counting: on a shared 2-core machine one run of the same work varies by up to 2x.

    python bench/serving.py                 # full run (minutes on a 2-core CPU)
    python bench/serving.py --smoke         # seconds: demo model, N = 1, 2; JSON to a temp file

A second mode, `--modes mixed` (bench/mixed_traffic.py), sends unlike requests (1-16 frames, 4-128
tokens) at Poisson arrival times and compares the server with transformers' static batching of N
(`--static-batch`) on a virtual clock of measured batch times: useful tokens/s, wasted tokens,
TTFT/TPOT/e2e p50/p99.

`--compare-src DIR` also runs every server measurement against the mmserve source in DIR (e.g. a
checkout of an older commit), and `--variant LABEL=FLAGS` against this tree's server started with
extra `mmserve serve` flags (e.g. `--variant "compiled=--compile-dense"`), in the same run, so
before/after ratios share the machine's state.

Prints tables and writes JSON (default bench/results/serving.json).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import logging
import math
import os
import platform
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from mmserve.clients import AsyncClient, ClientError, user_message
from mmserve.config import DEMO_MODEL_DIR
from mmserve.model.spec import load_spec
from mmserve.multimodal.demo_task import PROMPT, VisionParams, reference_inputs
from mmserve.multimodal.synthetic import make_clip
from mmserve.server.health import GENERATION_SERVICE

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mixed_traffic  # noqa: E402  (bench/ is not a package)

logger = logging.getLogger("bench.serving")
RESULTS_DIR = Path(__file__).resolve().parent / "results"
DEFAULT_OUT = RESULTS_DIR / "serving.json"

# The larger model: same tokenizer and vision tower as the demo model, a wider and deeper text
# decoder with random weights. Sized so one engine step is dominated by matmuls on a CPU.
LARGE_TEXT = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=6, num_attention_heads=8,
                  num_key_value_heads=4, head_dim=96, global_head_dim=192, num_global_key_value_heads=2)


@dataclass
class RequestSample:
    """One request as the client saw it."""

    ttft_s: float
    tpot_s: float | None
    e2e_s: float
    completion_tokens: int
    token_ids: tuple[int, ...]
    mfu: float
    mbu: float
    prompt_tokens: int = 0


@dataclass
class LevelResult:
    """Everything measured at one concurrency level."""

    concurrency: int
    requests: int
    wall_s: float
    output_tokens_per_s: float
    requests_per_s: float
    ttft_p50_s: float
    ttft_p99_s: float
    tpot_p50_s: float
    tpot_p99_s: float
    mfu_mean: float
    mbu_mean: float
    hf_batch_output_tokens_per_s: float = 0.0
    hf_batch_wall_s: float = 0.0
    hf_batch_ttft_s: float = 0.0
    speedup_vs_hf_sequential: float = 0.0
    speedup_vs_hf_batch: float = 0.0


@dataclass
class ModelResult:
    name: str
    path: str
    parameters: int
    prompt_tokens: int
    max_tokens: int
    num_frames: int
    levels: list[LevelResult] = field(default_factory=list)
    hf_sequential: dict = field(default_factory=dict)
    tokens_match_hf: float = 0.0
    server: str = "this tree"      # or the --compare-src tree / --variant label the server ran as
    mixed: list[dict] = field(default_factory=list)   # mixed-traffic summaries: server, static batching


# --- workload -----------------------------------------------------------------------------------

def clips(count: int, num_frames: int) -> list[bytes]:
    """Distinct synthetic clips of one size (so a padded batch needs no patch padding)."""
    return [make_clip(seed, num_frames=num_frames).data for seed in range(count)]


# Both sides warm up alike before anything is timed: one batch of the first level's size (at most 16)
# and a few tokens, so neither side's first-ever batch (allocator growth, first batched shapes; the
# server's first steps of a size also measure their thread count) lands in a timed level.
WARM_UP_TOKENS = 4


def warm_up_size(levels: list[int]) -> int:
    return min(levels[0] if levels else 4, 16)


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


# --- the server, in its own process ---------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server_process(model: str, *, threads: int | None, max_num_seqs: int, log_path: Path,
                   src: Path | None = None, flags: Sequence[str] = (), prefix_caching: bool = False,
                   env: Mapping[str, str] | None = None) -> Iterator[str]:
    """`mmserve serve` on a free loopback port (from the mmserve source in `src` when given); yields
    its address once readiness is SERVING. `threads` sets OMP_NUM_THREADS (None: unset, the
    server's own thread policy decides); `env` is added to the environment. Prefix caching is off unless
    asked for: this bench's levels reuse clips (level 64's first 16 are level 16's), so a cache would
    skip work transformers does; bench/prefix_cache.py measures the cache. (Older trees ignore it.)"""
    port = free_port()
    cmd = [sys.executable, "-m", "mmserve.cli", "--log-level", "WARNING", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--model", model, "--device", "cpu", "--max-num-seqs", str(max_num_seqs),
           "--max-waiting-requests", str(4 * max_num_seqs), *flags]
    environ = dict(os.environ, MMSERVE_ENABLE_PREFIX_CACHING=str(int(prefix_caching)))
    environ.pop("OMP_NUM_THREADS", None)
    if threads is not None:
        environ["OMP_NUM_THREADS"] = str(threads)
    if src is not None:
        environ["PYTHONPATH"] = str(src)
    environ.update(env or {})
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=environ)
        try:
            address = f"127.0.0.1:{port}"
            start = time.perf_counter()
            asyncio.run(wait_ready(address, proc, timeout_s=600))
            logger.info("server for %s ready in %.1f s (log: %s)", model, time.perf_counter() - start, log_path)
            yield address
        finally:
            stop(proc)


def stop(proc: subprocess.Popen, timeout_s: float = 60) -> None:
    """SIGTERM (a server drains), then SIGKILL after `timeout_s`."""
    proc.terminate()
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def wait_ready(address: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    async with AsyncClient(address) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode} before becoming ready")
            with contextlib.suppress(ClientError):
                if await client.health(GENERATION_SERVICE, timeout=1.0) == "SERVING":
                    return
            await asyncio.sleep(0.2)
    raise TimeoutError(f"server at {address} not ready after {timeout_s} s")


# --- the engine side ------------------------------------------------------------------------------

async def one_request(client: AsyncClient, video: bytes, *, max_tokens: int, num_frames: int,
                      request_id: str) -> RequestSample:
    return await stream_request(client, user_message(PROMPT, video=video, num_frames=num_frames),
                                max_tokens=max_tokens, request_id=request_id)


async def stream_request(client: AsyncClient, message, *, max_tokens: int, request_id: str) -> RequestSample:
    """One greedy request of exactly `max_tokens` tokens, timed as the client sees it."""
    start = time.perf_counter()
    stamps: list[float] = []
    stream = client.stream([message], max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
                           request_id=request_id)
    async for delta in stream:
        if delta.token_ids:
            stamps.extend([time.perf_counter()] * len(delta.token_ids))
    result = stream.result
    n = len(result.token_ids)
    return RequestSample(
        ttft_s=stamps[0] - start,
        tpot_s=(stamps[-1] - stamps[0]) / (n - 1) if n > 1 else None,
        e2e_s=stamps[-1] - start,
        completion_tokens=result.usage.completion_tokens or n,
        token_ids=result.token_ids,
        mfu=result.perf.mfu,
        mbu=result.perf.mbu,
        prompt_tokens=result.usage.prompt_tokens,
    )


async def run_level(address: str, videos: list[bytes], *, concurrency: int, max_tokens: int,
                    num_frames: int) -> tuple[LevelResult, list[RequestSample]]:
    """Send len(videos) requests with at most `concurrency` in flight (a closed loop)."""
    limit = asyncio.Semaphore(concurrency)
    async with AsyncClient(address) as client:
        async def bounded(i: int, video: bytes) -> RequestSample:
            async with limit:
                return await one_request(client, video, max_tokens=max_tokens, num_frames=num_frames,
                                         request_id=f"bench-{concurrency}-{i}")

        start = time.perf_counter()
        samples = await asyncio.gather(*(bounded(i, v) for i, v in enumerate(videos)))
        wall = time.perf_counter() - start
    tokens = sum(s.completion_tokens for s in samples)
    ttfts = [s.ttft_s for s in samples]
    tpots = [s.tpot_s for s in samples if s.tpot_s is not None]
    perf = [s for s in samples if s.mfu > 0]
    return LevelResult(
        concurrency=concurrency, requests=len(samples), wall_s=wall, output_tokens_per_s=tokens / wall,
        requests_per_s=len(samples) / wall, ttft_p50_s=percentile(ttfts, 50), ttft_p99_s=percentile(ttfts, 99),
        tpot_p50_s=percentile(tpots, 50), tpot_p99_s=percentile(tpots, 99),
        mfu_mean=float(np.mean([s.mfu for s in perf])) if perf else 0.0,
        mbu_mean=float(np.mean([s.mbu for s in perf])) if perf else 0.0,
    ), samples


# --- the transformers side ------------------------------------------------------------------------

class TokenClock:
    """A `generate` streamer that timestamps each generated step (the first `put` is the prompt)."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.steps: list[float] = []
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        self.steps.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_inputs(model_dir: Path, videos: list[bytes], num_frames: int) -> list:
    spec = load_spec(model_dir)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    vision = VisionParams(spec.patch_size, spec.pooling_kernel_size, spec.video_max_soft_tokens)
    return [reference_inputs(tokenizer, v, vision, num_frames=num_frames) for v in videos]


def pad_left(inputs: list, pad_id: int) -> dict[str, torch.Tensor]:
    """One left-padded batch in transformers' names (generation appends on the right)."""
    length = max(x.input_ids.shape[1] for x in inputs)
    batch = len(inputs)
    ids = torch.full((batch, length), pad_id, dtype=torch.long)
    mask = torch.zeros((batch, length), dtype=torch.long)
    types = torch.zeros((batch, length), dtype=torch.long)
    for row, x in enumerate(inputs):
        n = x.input_ids.shape[1]
        ids[row, length - n:] = x.input_ids[0]
        mask[row, length - n:] = 1
        types[row, length - n:] = x.mm_token_type_ids[0]
    return dict(input_ids=ids, attention_mask=mask, mm_token_type_ids=types,
                pixel_values_videos=torch.cat([x.pixel_values_videos for x in inputs]),
                video_position_ids=torch.cat([x.video_position_ids for x in inputs]),
                num_frames_per_video=torch.cat([x.num_frames_per_video for x in inputs]))


def hf_generate(model, kwargs: dict[str, torch.Tensor], max_tokens: int) -> tuple[torch.Tensor, TokenClock]:
    """Greedy, exactly `max_tokens` new tokens, like the server's ignore_eos: EOS may be chosen but does
    not stop. (`min_new_tokens` would ban EOS from the argmax instead; an unset eos_token_id falls back
    to the model's, so the stop id is one past the vocabulary, which argmax never picks.)"""
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = model.config.get_text_config().vocab_size
    config.max_new_tokens, config.do_sample = max_tokens, False
    clock = TokenClock()
    with torch.inference_mode():
        out = model.generate(**kwargs, generation_config=config, streamer=clock)
    return out[:, kwargs["input_ids"].shape[1]:], clock


def run_hf(model_dir: Path, videos: list[bytes], levels: list[int], *, max_tokens: int, num_frames: int,
           sequential_requests: int, repeats: int = 1) -> tuple[dict, dict[int, dict], list[tuple[int, ...]]]:
    """Sequential generate over the first `sequential_requests` videos, then one padded batch per level
    (the fastest of `repeats`, as for the server).

    Timings start from the video bytes, as the server's do: decoding and preprocessing (the same
    functions the server uses) count, so neither side gets its inputs for free."""
    from transformers import Gemma4ForConditionalGeneration

    model = Gemma4ForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32,
                                                           attn_implementation="sdpa").eval()
    pad_id = load_spec(model_dir).pad_token_id
    warm_n = warm_up_size(levels)
    hf_generate(model, pad_left(hf_inputs(model_dir, videos[:warm_n], num_frames), pad_id), WARM_UP_TOKENS)

    tokens: list[tuple[int, ...]] = []
    ttfts, tpots = [], []
    start = time.perf_counter()
    for video in videos[:sequential_requests]:
        begin = time.perf_counter()
        (x,) = hf_inputs(model_dir, [video], num_frames)
        out, clock = hf_generate(model, {**x.as_kwargs(), "attention_mask": torch.ones_like(x.input_ids)}, max_tokens)
        tokens.append(tuple(out[0].tolist()))
        ttfts.append(clock.steps[0] - begin)
        tpots.append((clock.steps[-1] - clock.steps[0]) / (len(clock.steps) - 1) if len(clock.steps) > 1 else 0.0)
    wall = time.perf_counter() - start
    sequential = dict(requests=len(tokens), wall_s=wall, output_tokens_per_s=len(tokens) * max_tokens / wall,
                      ttft_p50_s=percentile(ttfts, 50), tpot_p50_s=percentile(tpots, 50))

    batches = {}
    for n in levels:
        for _ in range(repeats):
            start = time.perf_counter()
            batch = pad_left(hf_inputs(model_dir, videos[:n], num_frames), pad_id)
            out, clock = hf_generate(model, batch, max_tokens)
            wall = time.perf_counter() - start
            if n not in batches or wall < batches[n]["wall_s"]:
                batches[n] = dict(requests=n, wall_s=wall, output_tokens_per_s=n * max_tokens / wall,
                                  ttft_s=clock.steps[0] - start)
    return sequential, batches, tokens


# --- the larger random-weight checkpoint ----------------------------------------------------------

def make_large_checkpoint(base_dir: Path, out_dir: Path, seed: int = 0) -> Path:
    """`base_dir`'s tokenizer, vision tower and layer pattern with a bigger random text decoder."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    if (out_dir / "config.json").exists():
        return out_dir
    raw = json.loads((base_dir / "config.json").read_text())
    text = raw["text_config"]
    text.pop("per_layer_config", None)  # re-derived from global_head_dim / num_global_key_value_heads
    # Repeat the base's sliding...full period; whole periods, so the last layer stays full.
    types = text["layer_types"]
    period = types[: types.index("full_attention") + 1] if "full_attention" in types else types[:1]
    repeats = max(1, round(LARGE_TEXT["num_hidden_layers"] / len(period)))
    text.update(LARGE_TEXT, num_hidden_layers=repeats * len(period), layer_types=period * repeats)
    torch.manual_seed(seed)
    model = Gemma4ForConditionalGeneration(Gemma4Config.from_dict(raw))
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp))
    for extra in base_dir.iterdir():
        if extra.is_file() and extra.suffix != ".safetensors" and extra.name not in ("config.json",
                                                                                     "model.safetensors.index.json"):
            shutil.copy(extra, tmp / extra.name)
    tmp.rename(out_dir)
    return out_dir


def parameter_count(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for name in st.keys():
                total += math.prod(st.get_slice(name).get_shape())
    return total


# --- one model, end to end ----------------------------------------------------------------------

def _portable(path: Path) -> str:
    """Paths inside the repository are recorded relative to it, so committed results name no machine."""
    root = Path(__file__).resolve().parents[1]
    try:
        return str(path.resolve().relative_to(root))
    except ValueError:
        return path.name

@dataclass(frozen=True)
class ServerUnderTest:
    """One server the run measures: this tree's, a --compare-src tree's, or this tree's with extra flags."""
    label: str
    src: Path | None = None
    flags: tuple[str, ...] = ()


def servers_under_test(args: argparse.Namespace) -> list[ServerUnderTest]:
    variants = [ServerUnderTest(label, None, tuple(shlex.split(flags)))
                for label, _, flags in (v.partition("=") for v in args.variant)]
    return [ServerUnderTest("this tree"), *(ServerUnderTest(src.name, src) for src in args.compare_src), *variants]


def bench_server(name: str, model_dir: Path, args: argparse.Namespace, log_dir: Path, videos: list[bytes],
                 mixed: tuple[list, dict] | None, server: ServerUnderTest) -> tuple[ModelResult, list[tuple[int, ...]]]:
    """Every server measurement of one model, against one server."""
    levels = args.concurrency if "identical" in args.modes else []
    result = ModelResult(name=name, path=_portable(model_dir), parameters=parameter_count(model_dir), prompt_tokens=0,
                         max_tokens=args.max_tokens, num_frames=args.num_frames,
                         server=server.label)
    engine_tokens: list[tuple[int, ...]] = []
    tag = name if server.label == "this tree" else f"{name}-{server.label}"
    with server_process(str(model_dir), threads=args.threads, max_num_seqs=max([*levels, args.static_batch, 16]),
                        log_path=log_dir / f"server-{tag}.log", src=server.src, flags=server.flags) as address:
        warm_n = warm_up_size(levels)
        asyncio.run(run_level(address, videos[:warm_n], concurrency=warm_n, max_tokens=WARM_UP_TOKENS,
                              num_frames=args.num_frames))
        for n in levels:
            runs = [asyncio.run(run_level(address, videos[: max(n, args.min_requests)], concurrency=n,
                                          max_tokens=args.max_tokens, num_frames=args.num_frames))
                    for _ in range(args.repeats)]
            level, samples = max(runs, key=lambda run: run[0].output_tokens_per_s)
            logger.info("%s (%s) N=%d: %.1f tok/s", name, result.server, n, level.output_tokens_per_s)
            result.levels.append(level)
            if not engine_tokens:
                engine_tokens = [s.token_ids for s in samples]
        if mixed is not None:
            requests, mixed_videos = mixed
            timings = asyncio.run(mixed_traffic.run_server(address, requests, mixed_videos, PROMPT))
            result.mixed.append(mixed_traffic.summary(f"mmserve ({result.server})", requests, timings))
    return result, engine_tokens


def bench_model(name: str, model_dir: Path, args: argparse.Namespace, log_dir: Path) -> list[ModelResult]:
    levels = args.concurrency if "identical" in args.modes else []
    videos = clips(max([*levels, args.min_requests]), args.num_frames)
    mixed = None
    if "mixed" in args.modes:
        requests = mixed_traffic.workload(args.mixed_requests, args.mixed_rate[name], seed=args.seed,
                                          max_frames=args.mixed_max_frames, max_tokens=args.mixed_max_tokens)
        mixed = (requests, {r.index: make_clip(r.seed, num_frames=r.num_frames).data for r in requests})
    results = []
    engine_tokens: list[tuple[int, ...]] = []
    for server in servers_under_test(args):
        result, tokens = bench_server(name, model_dir, args, log_dir, videos, mixed, server)
        results.append(result)
        engine_tokens = engine_tokens or tokens
    torch.set_num_threads(args.threads)
    if levels:
        sequential, batches, hf_tokens = run_hf(model_dir, videos, levels, max_tokens=args.max_tokens,
                                                num_frames=args.num_frames, sequential_requests=args.hf_sequential,
                                                repeats=args.repeats)
    if mixed is not None:
        static = run_hf_static(model_dir, *mixed, batch_size=args.static_batch)
    for result in results:
        if mixed is not None:
            result.mixed.append(static)
        if not levels:
            continue
        result.prompt_tokens = int(hf_inputs(model_dir, videos[:1], args.num_frames)[0].input_ids.shape[1])
        result.hf_sequential = sequential
        pairs = list(zip(engine_tokens, hf_tokens, strict=False))
        result.tokens_match_hf = sum(a == b for a, b in pairs) / len(pairs) if pairs else 0.0
        for level in result.levels:
            batch = batches[level.concurrency]
            level.hf_batch_output_tokens_per_s = batch["output_tokens_per_s"]
            level.hf_batch_wall_s = batch["wall_s"]
            level.hf_batch_ttft_s = batch["ttft_s"]
            level.speedup_vs_hf_sequential = level.output_tokens_per_s / sequential["output_tokens_per_s"]
            level.speedup_vs_hf_batch = level.output_tokens_per_s / batch["output_tokens_per_s"]
    return results


def run_hf_static(model_dir: Path, requests: list, videos: dict[int, bytes], *, batch_size: int) -> dict:
    """transformers' static batching of the mixed workload (bench/mixed_traffic.py) on a virtual clock."""
    from transformers import Gemma4ForConditionalGeneration

    model = Gemma4ForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32,
                                                           attn_implementation="sdpa").eval()
    spec = load_spec(model_dir)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    vision = VisionParams(spec.patch_size, spec.pooling_kernel_size, spec.video_max_soft_tokens)

    def make_batch(batch: list) -> dict[str, torch.Tensor]:
        inputs = [reference_inputs(tokenizer, videos[r.index], vision, num_frames=r.num_frames) for r in batch]
        return pad_left(inputs, spec.pad_token_id)

    hf_generate(model, make_batch(requests[:1]), 2)   # warm-up
    timings, wasted = mixed_traffic.run_static(model, make_batch, requests, batch_size, hf_generate)
    return mixed_traffic.summary(f"static batch {batch_size}", requests, timings, wasted)


def machine() -> dict:
    cpu = platform.processor()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return dict(cpu=cpu, cores=os.cpu_count(), python=platform.python_version(), torch=torch.__version__,
                platform=platform.platform())


def mixed_table(results: list[ModelResult]) -> str:
    head = (f"{'model':<7}{'system':<24}{'useful tok/s':>13}{'wasted':>8}{'TTFT p50':>9}{'p99':>7}"
            f"{'TPOT p50':>9}{'p99':>7}{'e2e p50':>8}{'p99':>7}{'x static':>9}")
    lines, seen = [head, "-" * len(head)], set()
    for r in results:
        for m in r.mixed:
            if (r.name, m["system"]) in seen:   # the static baseline is shared by every server of a model
                continue
            seen.add((r.name, m["system"]))
            ratio = m["useful_tokens_per_s"] / r.mixed[-1]["useful_tokens_per_s"]
            lines.append(f"{r.name:<7}{m['system']:<24}{m['useful_tokens_per_s']:>13.1f}{m['wasted_tokens']:>8}"
                         f"{m['ttft_p50_s']:>9.2f}{m['ttft_p99_s']:>7.2f}{m['tpot_p50_s']:>9.3f}{m['tpot_p99_s']:>7.3f}"
                         f"{m['e2e_p50_s']:>8.2f}{m['e2e_p99_s']:>7.2f}{ratio:>9.2f}")
    return "\n".join(lines)


def table(results: list[ModelResult]) -> str:
    head = (f"{'model':<7}{'server':<11}{'N':>4}{'tok/s':>9}{'req/s':>8}{'TTFT p50':>10}{'p99':>8}{'TPOT p50':>10}{'p99':>8}"
            f"{'MFU':>8}{'MBU':>8}{'HF batch':>10}{'x seq':>7}{'x batch':>8}")
    lines = [head, "-" * len(head)]
    for r in results:
        for lv in r.levels:
            lines.append(f"{r.name:<7}{r.server[:10]:<11}{lv.concurrency:>4}{lv.output_tokens_per_s:>9.1f}{lv.requests_per_s:>8.2f}"
                         f"{lv.ttft_p50_s:>10.3f}{lv.ttft_p99_s:>8.3f}{lv.tpot_p50_s:>10.4f}{lv.tpot_p99_s:>8.4f}"
                         f"{lv.mfu_mean:>8.2%}{lv.mbu_mean:>8.2%}{lv.hf_batch_output_tokens_per_s:>10.1f}"
                         f"{lv.speedup_vs_hf_sequential:>7.2f}{lv.speedup_vs_hf_batch:>8.2f}")
        seq = r.hf_sequential
        if not seq:
            continue
        lines.append(f"{r.name:<7} HF sequential: {seq['output_tokens_per_s']:.1f} tok/s, TTFT p50 "
                     f"{seq['ttft_p50_s']:.3f} s; tokens equal to HF greedy on {r.tokens_match_hf:.0%} of requests; "
                     f"{r.parameters / 1e6:.1f} M params, {r.prompt_tokens} prompt tokens")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="seconds-long run: demo model, N = 1, 2, 4 tokens")
    p.add_argument("--models", default="demo,large", help="comma-separated: demo, large")
    p.add_argument("--demo-model", type=Path, default=DEMO_MODEL_DIR,
                   help="checkpoint benchmarked as 'demo' and used as the base of 'large'")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 16, 64])
    p.add_argument("--repeats", type=int, default=2,
                   help="runs per identical-request level on each side; the fastest counts (this machine's noise)")
    p.add_argument("--min-requests", type=int, default=4, help="requests per level at least (N below it)")
    p.add_argument("--max-tokens", type=int, default=32, help="output tokens per request (fixed)")
    p.add_argument("--num-frames", type=int, default=8)
    p.add_argument("--hf-sequential", type=int, default=4, help="requests for the one-at-a-time baseline")
    p.add_argument("--threads", type=int, default=2, help="torch threads for the server and for transformers")
    p.add_argument("--large-dir", type=Path, default=Path(tempfile.gettempdir()) / "mmserve-bench-large",
                   help="where the random-weight larger checkpoint is made (reused when present)")
    p.add_argument("--out", type=Path, default=None, help=f"JSON output (default {DEFAULT_OUT}; smoke: a temp file)")
    p.add_argument("--modes", default="identical,mixed", help="comma-separated: identical, mixed")
    p.add_argument("--compare-src", type=Path, action="append", default=[],
                   help="also run the server from this mmserve src/ directory (before/after in one run)")
    p.add_argument("--variant", action="append", default=[], metavar="LABEL=FLAGS",
                   help="also run this tree's server with these extra `mmserve serve` flags, e.g. 'compiled=--compile-dense'")
    p.add_argument("--mixed-requests", type=int, default=48, help="requests in the mixed-traffic run")
    p.add_argument("--mixed-rate", type=lambda s: dict(kv.split("=") for kv in s.split(",")),
                   default="demo=40,large=4",
                   help="Poisson arrival rate (requests/s) per model; above what either system serves, so useful "
                        "tokens/s measures capacity, not the arrival rate")
    p.add_argument("--mixed-max-frames", type=int, default=16)
    p.add_argument("--mixed-max-tokens", type=int, default=128)
    p.add_argument("--static-batch", type=int, default=8, help="transformers' static batch size N (mixed mode)")
    p.add_argument("--seed", type=int, default=0, help="seed of the mixed workload")
    args = p.parse_args(argv)
    args.mixed_rate = {k: float(v) for k, v in args.mixed_rate.items()}
    args.modes = set(args.modes.split(","))
    args.compare_src = [src.resolve() for src in args.compare_src]
    if args.smoke:
        args.models, args.concurrency, args.min_requests = "demo", [1, 2], 2
        args.max_tokens, args.num_frames, args.hf_sequential, args.repeats = 4, 2, 1, 1
        args.mixed_requests, args.mixed_max_frames, args.mixed_max_tokens, args.static_batch = 3, 2, 6, 2
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    out = args.out or (Path(tempfile.mkdtemp()) / "serving.json" if args.smoke else DEFAULT_OUT)
    log_dir = Path(tempfile.mkdtemp(prefix="mmserve-bench-"))
    results = []
    for name in args.models.split(","):
        model_dir = args.demo_model if name == "demo" else make_large_checkpoint(args.demo_model, args.large_dir)
        results += bench_model(name, model_dir, args, log_dir)
    report = dict(benchmark="serving", command=" ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
                  machine=machine(), smoke=args.smoke, server_logs=str(log_dir),
                  models=[asdict(r) for r in results])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    if "identical" in args.modes:
        sys.stdout.write(table(results) + "\n\n")
    if "mixed" in args.modes:
        sys.stdout.write(mixed_table(results) + "\n\n")
    sys.stdout.write(f"JSON: {out}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
