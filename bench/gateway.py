"""mmserve behind the real SMG gateway, on this machine (loopback, demo model, CPU).

1. Overhead: N concurrent video requests (streamed, greedy, a fixed number of output tokens) straight
   to one replica over mmserve.v1, then the same requests through SMG (OpenAI HTTP -> VllmEngine
   gRPC) to that replica: output tok/s over the batch and TTFT percentiles. The prefix cache is
   flushed (FlushCache) before each run, so neither reuses the other's work.
2. Routing: the shared-video workload of tests/gateway/test_gateway_routing.py (each clip described
   once, then asked follow-up questions in random order, each conversation naming its clip) through
   SMG over two replicas, under cache_aware and under round_robin: wall time, requests/s and the
   prefix-cache hit rate (cached / prompt tokens, from the responses' usage), and the prompt tokens
   computed (not served from the cache) under cache_aware over those under round_robin. Its two
   replicas sample --routing-frames per clip (SMG's video_url carries no frame count).

The fleet comes from tests/gateway/smg_harness.py (nothing leaves the machine: the Hub lookup points
at a refusing loopback port, the tokenizer comes from GetTokenizer).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import random
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
from serving import machine, percentile
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gateway"))
from smg_harness import DeadPort, Replica, Smg  # noqa: E402

from mmserve.clients import AsyncClient, user_message  # noqa: E402
from mmserve.multimodal.synthetic import make_clip  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "gateway.json"
NAMES = ["harbour", "meadow", "kitchen", "station", "garden", "bridge", "studio", "forest"]
QUESTIONS = ["What colour is the shape?", "Which way does it move?", "What shape is it?",
             "How many shapes are there?"]
SMG_ARGS = ("--worker-warmup-secs", "0", "--worker-warmup-divert-every", "0")


@dataclass
class Overhead:
    path: str
    requests: int
    output_tokens: int
    wall_s: float
    tok_s: float
    ttft_p50_ms: float
    ttft_p90_ms: float


@dataclass
class Routing:
    policy: str
    requests: int
    wall_s: float
    req_s: float
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    computed_tokens: int


def clips(n: int, frames: int) -> list[bytes]:
    return [make_clip(100 + i, num_frames=frames).data for i in range(n)]


def flush(replicas) -> None:
    for r in replicas:
        with grpc.insecure_channel(r.address) as channel:
            reply = vpb_grpc.VllmEngineStub(channel).FlushCache(common_pb2.FlushCacheRequest(timeout_s=60), timeout=90)
        if not reply.success:
            raise RuntimeError(f"FlushCache on {r.address}: {reply.message}")


async def direct(address: str, videos: list[bytes], frames: int, max_tokens: int) -> Overhead:
    async with AsyncClient(address) as client:
        async def one(video: bytes) -> tuple[float, int]:
            start = time.perf_counter()
            ttft = None
            stream = client.stream([user_message("Describe the clip.", video=video, num_frames=frames)],
                                   max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            async for delta in stream:
                if delta.token_ids and ttft is None:
                    ttft = time.perf_counter() - start
            return ttft, len(stream.result.token_ids)

        start = time.perf_counter()
        results = await asyncio.gather(*(one(v) for v in videos))
        wall = time.perf_counter() - start
    return _overhead("direct mmserve.v1", results, wall)


def through_smg(smg: Smg, videos: list[bytes], max_tokens: int) -> Overhead:
    import openai

    client = openai.OpenAI(base_url=smg.base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id

    def one(video: bytes) -> tuple[float, int]:
        url = "data:video/mp4;base64," + base64.b64encode(video).decode()
        start = time.perf_counter()
        ttft, tokens = None, 0
        stream = client.chat.completions.create(
            model=model, stream=True, max_tokens=max_tokens, temperature=0, stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
            messages=[{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}},
                                                   {"type": "text", "text": "Describe the clip."}]}])
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content and ttft is None:
                ttft = time.perf_counter() - start
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return ttft, tokens

    start = time.perf_counter()
    with ThreadPoolExecutor(len(videos)) as pool:
        results = list(pool.map(one, videos))
    return _overhead("through SMG (OpenAI)", results, time.perf_counter() - start)


def _overhead(path: str, results: list[tuple[float, int]], wall: float) -> Overhead:
    ttfts = [t * 1e3 for t, _ in results if t is not None]
    tokens = sum(n for _, n in results)
    return Overhead(path, len(results), tokens, wall, tokens / wall, percentile(ttfts, 50), percentile(ttfts, 90))


def routing(replicas, dead: DeadPort, policy: str, videos: list[bytes], questions: int) -> Routing:
    import openai

    flush(replicas)
    smg = Smg([r.url for r in replicas], policy=policy, hf_endpoint=dead.url, extra=SMG_ARGS)
    try:
        smg.wait_ready(time.monotonic() + 180, len(replicas))
        client = openai.OpenAI(base_url=smg.base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        urls = ["data:video/mp4;base64," + base64.b64encode(v).decode() for v in videos]
        totals = [0, 0]
        lock = threading.Lock()

        def ask(v: int, question: str) -> None:
            reply = client.chat.completions.create(
                model=model, max_tokens=8, temperature=0,
                messages=[{"role": "user", "content": [{"type": "text", "text": f"The {NAMES[v]} clip:"},
                                                       {"type": "video_url", "video_url": {"url": urls[v]}},
                                                       {"type": "text", "text": question}]}])
            details = reply.usage.prompt_tokens_details
            with lock:
                totals[0] += reply.usage.prompt_tokens
                totals[1] += (details.cached_tokens or 0) if details else 0

        start = time.perf_counter()
        for v in range(len(videos)):
            ask(v, "Describe the clip.")
        order = [(v, q) for v in range(len(videos)) for q in range(questions)]
        random.Random(24).shuffle(order)
        with ThreadPoolExecutor(2) as pool:   # two users at a time
            list(pool.map(lambda vq: ask(vq[0], QUESTIONS[vq[1]]), order))
        wall = time.perf_counter() - start
    finally:
        smg.stop()
    n = len(videos) * (1 + questions)
    return Routing(policy, n, wall, n / wall, totals[0], totals[1], totals[1] / max(1, totals[0]),
                   totals[0] - totals[1])


def table(overhead: list[Overhead], routed: list[Routing]) -> str:
    lines = [f"{'path':<24}{'requests':>9}{'out tok':>8}{'tok/s':>8}{'TTFT p50':>10}{'p90':>8}"]
    for o in overhead:
        lines.append(f"{o.path:<24}{o.requests:>9}{o.output_tokens:>8}{o.tok_s:>8.1f}{o.ttft_p50_ms:>8.0f}ms"
                     f"{o.ttft_p90_ms:>6.0f}ms")
    if len(overhead) == 2:
        d, s = overhead
        lines.append(f"SMG / direct: {s.tok_s / d.tok_s:.2f}x tok/s, TTFT p50 {s.ttft_p50_ms - d.ttft_p50_ms:+.0f} ms")
    lines += ["", f"{'policy':<14}{'requests':>9}{'wall s':>8}{'req/s':>7}{'prompt tok':>11}{'cached':>8}{'hit rate':>9}"
              f"{'computed':>9}"]
    for r in routed:
        lines.append(f"{r.policy:<14}{r.requests:>9}{r.wall_s:>8.1f}{r.req_s:>7.2f}{r.prompt_tokens:>11}"
                     f"{r.cached_tokens:>8}{r.hit_rate:>9.1%}{r.computed_tokens:>9}")
    if len(routed) == 2:
        aware, robin = routed
        lines.append(f"prompt tokens computed, cache_aware / round_robin: "
                     f"{aware.computed_tokens / max(1, robin.computed_tokens):.2f}x")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="seconds-long run: one replica, 2 concurrent requests, 2 clips")
    p.add_argument("--concurrency", type=int, default=16, help="video requests at once in the overhead part")
    p.add_argument("--frames", type=int, default=4, help="frames per clip in the overhead part")
    p.add_argument("--routing-frames", type=int, default=32, help="frames per clip in the routing part")
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens per request (fixed)")
    p.add_argument("--videos", type=int, default=8, help="clips of the routing workload")
    p.add_argument("--questions", type=int, default=4, help="follow-up questions per clip")
    p.add_argument("--out", type=Path, default=None, help=f"JSON output (default {DEFAULT_OUT}; smoke: a temp file)")
    args = p.parse_args(argv)
    if args.smoke:
        args.concurrency, args.max_tokens, args.videos, args.questions, args.frames = 2, 2, 2, 1, 2
        args.routing_frames = 2
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dead = DeadPort()
    # One replica for the overhead part, two for routing, each sampling its part's frames per clip by default
    # (what SMG's requests get); all load at once.
    # The smoke run (a check that the script works, in the test suite) starts one replica, which serves
    # both parts, and routes over it under one policy: two servers and a gateway fewer to start on 2 cores.
    replicas = [Replica("--block-size", "4", "--default-num-frames", str(args.routing_frames))
                for _ in range(1 if args.smoke else 2)]
    single = replicas[0] if args.smoke else Replica("--block-size", "4", "--default-num-frames", str(args.frames))
    policies = ("cache_aware",) if args.smoke else ("cache_aware", "round_robin")
    try:
        for r in {id(r): r for r in (single, *replicas)}.values():
            r.wait_ready(time.monotonic() + 300)
        videos = clips(args.concurrency, args.frames)
        flush([single])
        overhead = [asyncio.run(direct(single.address, videos, args.frames, args.max_tokens))]
        flush([single])
        smg = Smg([single.url], policy="round_robin", hf_endpoint=dead.url, extra=SMG_ARGS)
        try:
            smg.wait_ready(time.monotonic() + 180, 1)
            overhead.append(through_smg(smg, videos, args.max_tokens))
        finally:
            smg.stop()
        if single not in replicas:
            single.stop()
        shared = clips(args.videos, args.routing_frames)
        routed = [routing(replicas, dead, policy, shared, args.questions) for policy in policies]
    finally:
        for r in (single, *replicas):   # all drain at once, then each is waited for
            r.terminate()
        for r in (single, *replicas):
            r.stop()
        dead.close()
    out = args.out or (Path(tempfile.mkdtemp()) / "gateway.json" if args.smoke else DEFAULT_OUT)
    report = dict(benchmark="gateway", command=" ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
                  machine=machine(), smoke=args.smoke, overhead=[asdict(o) for o in overhead],
                  routing=[asdict(r) for r in routed])
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    sys.stdout.write(table(overhead, routed) + f"\n\nJSON: {out}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
