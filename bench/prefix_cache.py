"""Prefix-cache benchmark: what a follow-up question about a video costs, and what a workload of
shared videos gains, on the real server (`mmserve serve`) with the prefix cache on and off, in one run.

For each server (cache on, then off; same model and options otherwise; "off" is the behaviour
before caching: --no-enable-prefix-caching keeps neither K/V nor vision embeddings across requests):

1. Follow-ups: for 8, 16 and 32 frames, a new video is asked one question, then 9 more questions
   (different text) one after another. Reported: TTFT of the first, median TTFT of the follow-ups,
   their ratio, and the frames the vision tower encoded per request (the server's
   `mmserve_vision_frames_encoded_total`, read between requests).
2. Shared videos: 16 concurrent users, user u asking 3 questions in turn about video u % 4
   (16 frames each); output tokens/s and requests/s over the whole run, TTFT p50, and the prefix
   hit rate (`mmserve_prefix_cache_hits_total / queries_total`).

Greedy decoding, a fixed number of output tokens (ignore_eos). The model is bench/serving.py's
"large" random-weight Gemma 4 (the demo model's tokenizer and vision tower, a 768-wide text decoder)
so that compute, not Python, dominates a step, with Gemma 4's video frame budget of 70 soft tokens
(the demo model's processor allows 16) and a 4096-token context for 32 such frames.

    python bench/prefix_cache.py            # full run (minutes on a 2-core CPU)
    python bench/prefix_cache.py --smoke    # seconds: demo model, cache on only, 2 and 4 frames; JSON to a temp file

Prints a table and writes JSON (default bench/results/prefix_cache.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import statistics
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from serving import _portable, free_port, machine, make_large_checkpoint, percentile, server_process

from mmserve.clients import AsyncClient, user_message
from mmserve.config import DEMO_MODEL_DIR
from mmserve.multimodal.synthetic import make_clip

logger = logging.getLogger("bench.prefix_cache")
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "prefix_cache.json"
QUESTIONS = [
    "What moves in the video?", "Which colour is the shape?", "Does it ever stop?", "Where does it end up?",
    "How fast is it going?", "Is there more than one object?", "Describe the background.",
    "What happens first?", "What happens last?", "Summarise the clip in one sentence.",
]


@dataclass
class FollowUps:
    num_frames: int
    prompt_tokens: int
    first_ttft_s: float
    follow_up_ttft_p50_s: float
    follow_up_over_first: float
    encodes_first: float
    encodes_per_follow_up: float
    cached_tokens_p50: float


@dataclass
class SharedLoad:
    users: int
    videos: int
    questions_per_user: int
    num_frames: int
    requests: int
    wall_s: float
    output_tokens_per_s: float
    requests_per_s: float
    ttft_p50_s: float
    hit_rate: float


@dataclass
class ServerResult:
    prefix_caching: bool
    follow_ups: list[FollowUps] = field(default_factory=list)
    shared: SharedLoad | None = None


def gemma4_frames(base: Path, out_dir: Path, soft_tokens: int = 70, context: int = 4096) -> Path:
    """`base` (weights linked, not copied) with Gemma 4's video frame budget and a longer context."""
    if (out_dir / "config.json").exists():
        return out_dir
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in base.iterdir():
        if f.suffix == ".safetensors":
            (tmp / f.name).symlink_to(f.resolve())
        elif f.is_file():
            shutil.copy(f, tmp / f.name)
    config = json.loads((tmp / "config.json").read_text())
    config["text_config"]["max_position_embeddings"] = context
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    video = json.loads((tmp / "video_preprocessor_config.json").read_text())
    video["max_soft_tokens"] = soft_tokens
    (tmp / "video_preprocessor_config.json").write_text(json.dumps(video, indent=2))
    tmp.rename(out_dir)
    return out_dir


def scrape(port: int) -> dict[str, float]:
    """The server's Prometheus counters (unlabelled sums by name)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{")[0].split(" ")[0]
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


async def ask(client: AsyncClient, video: bytes, num_frames: int, question: str, max_tokens: int):
    """One request; returns (TTFT seconds, output tokens, usage)."""
    start = time.perf_counter()
    ttft = None
    stream = client.stream([user_message(question, video=video, num_frames=num_frames)], max_tokens=max_tokens,
                           temperature=0.0, ignore_eos=True)
    async for delta in stream:
        if delta.token_ids and ttft is None:
            ttft = time.perf_counter() - start
    result = stream.result
    return ttft, len(result.token_ids), result.usage


async def follow_ups(address: str, metrics_port: int, video: bytes, num_frames: int, count: int,
                     max_tokens: int) -> FollowUps:
    ttfts, encodes, cached = [], [], []
    prompt_tokens = 0
    async with AsyncClient(address) as client:
        for i in range(count + 1):
            before = scrape(metrics_port).get("mmserve_vision_frames_encoded_total", 0.0)
            ttft, _, usage = await ask(client, video, num_frames, QUESTIONS[i % len(QUESTIONS)], max_tokens)
            encodes.append(scrape(metrics_port).get("mmserve_vision_frames_encoded_total", 0.0) - before)
            ttfts.append(ttft)
            cached.append(usage.cached_tokens)
            prompt_tokens = prompt_tokens or usage.prompt_tokens
    later = statistics.median(ttfts[1:])
    return FollowUps(num_frames, prompt_tokens, ttfts[0], later, later / ttfts[0], encodes[0],
                     statistics.mean(encodes[1:]), statistics.median(cached[1:]))


async def shared_load(address: str, metrics_port: int, videos: list[bytes], *, users: int, questions: int,
                      num_frames: int, max_tokens: int) -> SharedLoad:
    before = scrape(metrics_port)
    ttfts: list[float] = []
    tokens = 0

    async def user(client: AsyncClient, u: int) -> None:
        nonlocal tokens
        for q in range(questions):
            ttft, n, _ = await ask(client, videos[u % len(videos)], num_frames,
                                   QUESTIONS[(u + q) % len(QUESTIONS)], max_tokens)
            ttfts.append(ttft)
            tokens += n

    async with AsyncClient(address) as client:
        start = time.perf_counter()
        await asyncio.gather(*(user(client, u) for u in range(users)))
        wall = time.perf_counter() - start
    after = scrape(metrics_port)
    queries = after.get("mmserve_prefix_cache_queries_total", 0.0) - before.get("mmserve_prefix_cache_queries_total", 0.0)
    hits = after.get("mmserve_prefix_cache_hits_total", 0.0) - before.get("mmserve_prefix_cache_hits_total", 0.0)
    requests = users * questions
    return SharedLoad(users, len(videos), questions, num_frames, requests, wall, tokens / wall, requests / wall,
                      percentile(ttfts, 50), hits / queries if queries else 0.0)


def bench_server(model: Path, caching: bool, args: argparse.Namespace, log_dir: Path) -> ServerResult:
    """One server process: the follow-up series per frame count, then the shared-video load."""
    metrics_port = free_port()
    os.environ["MMSERVE_METRICS_PORT"] = str(metrics_port)
    os.environ["MMSERVE_MAX_FRAMES_PER_VIDEO"] = str(max(args.frames + [args.shared_frames]))
    result = ServerResult(caching)
    name = "on" if caching else "off"
    with server_process(str(model), threads=args.threads, max_num_seqs=args.users, prefix_caching=caching,
                        log_path=log_dir / f"server-cache-{name}.log") as address:
        for k, n in enumerate(args.frames):
            video = make_clip(100 + k, num_frames=n, fps=4.0).data
            result.follow_ups.append(asyncio.run(follow_ups(address, metrics_port, video, n, args.follow_ups,
                                                            args.max_tokens)))
            logger.info("cache %s, %d frames: %s", name, n, result.follow_ups[-1])
        videos = [make_clip(200 + v, num_frames=args.shared_frames, fps=4.0).data for v in range(args.videos)]
        result.shared = asyncio.run(shared_load(address, metrics_port, videos, users=args.users,
                                                questions=args.questions, num_frames=args.shared_frames,
                                                max_tokens=args.max_tokens))
        logger.info("cache %s, shared load: %s", name, result.shared)
    if caching and not any(f.cached_tokens_p50 for f in result.follow_ups):
        # A measurement of nothing: the server did not cache (a flag or env var lost on the way).
        raise RuntimeError(f"prefix caching was on but no follow-up reused a cached token (server log: "
                           f"{log_dir / f'server-cache-{name}.log'})")
    return result


def table(results: list[ServerResult]) -> str:
    head = (f"{'cache':<6}{'frames':>7}{'prompt':>7}{'TTFT 1st':>10}{'follow-up p50':>15}{'ratio':>7}"
            f"{'enc 1st':>8}{'enc/f-up':>9}{'cached p50':>11}")
    lines = [head, "-" * len(head)]
    for r in results:
        for f in r.follow_ups:
            lines.append(f"{'on' if r.prefix_caching else 'off':<6}{f.num_frames:>7}{f.prompt_tokens:>7}"
                         f"{f.first_ttft_s:>10.3f}{f.follow_up_ttft_p50_s:>15.3f}{f.follow_up_over_first:>7.1%}"
                         f"{f.encodes_first:>8.0f}{f.encodes_per_follow_up:>9.1f}{f.cached_tokens_p50:>11.0f}")
    head2 = f"{'cache':<6}{'requests':>9}{'wall s':>8}{'tok/s':>8}{'req/s':>7}{'TTFT p50':>10}{'hit rate':>9}"
    lines += ["", head2, "-" * len(head2)]
    for r in results:
        s = r.shared
        lines.append(f"{'on' if r.prefix_caching else 'off':<6}{s.requests:>9}{s.wall_s:>8.1f}"
                     f"{s.output_tokens_per_s:>8.1f}{s.requests_per_s:>7.2f}{s.ttft_p50_s:>10.3f}{s.hit_rate:>9.1%}")
    speedup = shared_speedup(results)
    if speedup is not None:
        s = results[0].shared
        lines.append(f"\nshared-video throughput, cache on / off: {speedup:.2f}x "
                     f"({s.users} users, {s.videos} videos of {s.num_frames} frames)")
    return "\n".join(lines)


def shared_speedup(results: list[ServerResult]) -> float | None:
    by_mode = {r.prefix_caching: r.shared for r in results}
    if len(by_mode) < 2:
        return None
    return by_mode[True].output_tokens_per_s / by_mode[False].output_tokens_per_s


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="seconds-long run: demo model, cache on only, 2 and 4 frames")
    p.add_argument("--caching", default="on,off", help="which servers to run: on, off or on,off")
    p.add_argument("--model", default="large", help="'large' (bench/serving.py's), 'demo', or a checkpoint path")
    p.add_argument("--frames", type=lambda s: [int(x) for x in s.split(",")], default=[8, 16, 32])
    p.add_argument("--follow-ups", type=int, default=9)
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--videos", type=int, default=4)
    p.add_argument("--questions", type=int, default=3, help="questions each user asks in turn")
    p.add_argument("--shared-frames", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=8, help="output tokens per request (fixed)")
    p.add_argument("--threads", type=int, default=2, help="torch threads of the server")
    p.add_argument("--large-dir", type=Path, default=Path(tempfile.gettempdir()) / "mmserve-bench-large",
                   help="where the random-weight larger checkpoint is made (reused when present)")
    p.add_argument("--out", type=Path, default=None, help=f"JSON output (default {DEFAULT_OUT}; smoke: a temp file)")
    args = p.parse_args(argv)
    if args.smoke:
        args.model, args.frames, args.follow_ups, args.caching = "demo", [2, 4], 2, "on"
        args.users, args.videos, args.questions, args.shared_frames, args.max_tokens = 4, 2, 2, 2, 2
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    model = {"demo": DEMO_MODEL_DIR, "large": None}.get(args.model, Path(args.model))
    if model is None:
        large = make_large_checkpoint(DEMO_MODEL_DIR, args.large_dir)
        model = gemma4_frames(large, large.with_name(large.name + "-70tok"))
    out = args.out or (Path(tempfile.mkdtemp()) / "prefix_cache.json" if args.smoke else DEFAULT_OUT)
    log_dir = Path(tempfile.mkdtemp(prefix="mmserve-bench-prefix-"))
    results = [bench_server(model, mode == "on", args, log_dir) for mode in args.caching.split(",")]
    report = dict(benchmark="prefix_cache", command=" ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
                  machine=machine(), smoke=args.smoke, model=_portable(Path(model)), server_logs=str(log_dir),
                  servers=[asdict(r) for r in results], shared_speedup=shared_speedup(results))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    sys.stdout.write(table(results) + f"\n\nJSON: {out}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
