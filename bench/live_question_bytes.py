"""What a live question sends to the engine process, and what that costs, at 8/32/64 context frames.

1. Demo model, real server on 127.0.0.1: one session (the demo checkpoint with frames at 4 soft tokens,
   as bench/live_video.py runs it, so 64 frames fit its 1024-token context) is sent 64 random frames;
   at 8, 32 and 64 frames prefilled it asks a greedy question. Per point: the bytes of the question's
   AddRequest on the engine's socket (`serial.encode` of what `EngineCoreClient` posts, read by
   wrapping its `_post`), the client's TTFT and the server's. `--repeats` sessions; medians. Run it on
   any checkout (PYTHONPATH) to compare before and after.
2. Realistic frames, the crossing alone: the demo model's context cannot hold 8 frames at a real
   budget, so no TTFT there. Instead the question's AddRequest as each path builds it (frames at
   `--budget` soft tokens: budget x 9 patches of 16x16x3 fp32, as the Gemma 4 processor pads them;
   1120 is the vision config's largest budget) goes through `serial.encode` -> a ZMQ ipc PUSH/PULL
   pair -> `serial.decode`, as between the front end and the engine core: before (the context's
   frames' pixels carried) and after (`context_request_id`: token ids only). Median of `--repeats`.

    python bench/live_question_bytes.py    # about a minute on 2 shared cores
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np
import torch
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from live_video import TOKENS_PER_FRAME, Live, demo_model_at, png  # noqa: E402
from loopback_server import LoopbackServer, engine_config  # noqa: E402

from mmserve.api import pb, pb_grpc  # noqa: E402
from mmserve.ipc import serial  # noqa: E402
from mmserve.ipc.protocol import AddRequest, EngineCoreRequest  # noqa: E402
from mmserve.request import MultiModalInput  # noqa: E402

POINTS = (8, 32, 64)
PATCH_FLOATS = 3 * 16 * 16   # a real Gemma 4 patch: 16x16 px, RGB
POOL = 3                     # its pooling kernel: budget x 9 patches per frame


def nbytes(message) -> int:
    return sum(memoryview(f).nbytes for f in serial.encode(message))


def demo_table(repeats: int) -> None:
    rng = np.random.default_rng(0)
    sent: dict[str, int] = {}
    rows: dict[int, list[tuple[int, float, float]]] = {n: [] for n in POINTS}
    with tempfile.TemporaryDirectory() as tmp:
        model = demo_model_at(TOKENS_PER_FRAME, Path(tmp) / "demo")
        server = LoopbackServer(engine_config(str(model), max_frames_per_video=64, engine_threads=0,
                                              live_max_history_frames=64, live_max_pending_frames=64)).start()
        try:
            post = server.engine.client._post

            def record(message):
                if isinstance(message, AddRequest):
                    sent[message.request.request_id] = nbytes(message)
                post(message)

            server.engine.client._post = record
            with grpc.insecure_channel(server.address) as channel:
                stub = pb_grpc.GenerationStub(channel)
                for r in range(repeats):
                    s = Live(stub, pb.LiveOpen(session_id=f"bench-{r}", max_history_frames=64))
                    for i in range(1, 65):
                        s.frame(png(rng), (i - 1) / 8.0)
                        if i in POINTS:
                            s.wait(lambda p, i=i: p.frames_in_context >= i)
                            took, _, final = s.ttft(f"q{i}")
                            size = next(n for rid, n in sent.items() if rid.endswith(f"bench-{r}/q{i}"))
                            rows[i].append((size, took, final.timings.time_to_first_token_s))
                    s.close()
        finally:
            server.stop()
    print(f"\n1. demo model ({TOKENS_PER_FRAME} soft tokens/frame), {repeats} sessions, medians")
    print(f"{'frames':>6} {'AddRequest bytes':>17} {'TTFT client ms':>15} {'TTFT server ms':>15}")
    for n in POINTS:
        size, took, srv = (statistics.median(x) for x in zip(*rows[n], strict=True))
        print(f"{n:>6} {size:>17,.0f} {took * 1e3:>15.1f} {srv * 1e3:>15.1f}")


def crossing_s(message, push: zmq.Socket, pull: zmq.Socket) -> float:
    start = time.perf_counter()
    push.send_multipart(serial.encode(message), copy=False)
    serial.decode(pull.recv_multipart(copy=False))
    return time.perf_counter() - start


def realistic_table(budget: int, repeats: int) -> None:
    patches = budget * POOL * POOL
    frames = [MultiModalInput(torch.rand(patches, PATCH_FLOATS), torch.zeros(patches, 2, dtype=torch.long), b"%d" % i)
              for i in range(max(POINTS))]   # distinct tensors, as a context's frames are (pickle sends each once)
    per_frame = budget + 8   # a frame's soft tokens, its <|image>/<image|> and timestamp text (about)
    ctx = zmq.Context()
    path = Path(tempfile.mkdtemp()) / "q.sock"
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind(f"ipc://{path}")
    push.connect(f"ipc://{path}")
    print(f"\n2. realistic frames: {budget} soft tokens, {patches} patches x {PATCH_FLOATS} fp32 = "
          f"{frames[0].pixel_values.nbytes / 2**20:.1f} MiB each; encode + ZMQ ipc + decode, median of {repeats}")
    print(f"{'frames':>6} {'before bytes':>14} {'before ms':>10} {'after bytes':>12} {'after ms':>9}")
    try:
        for n in POINTS:
            ids = np.random.default_rng(n).integers(0, 262_144, n * per_frame + 24).tolist()
            ranges = [(16 + i * per_frame, 16 + i * per_frame + budget - 1) for i in range(n)]
            before = AddRequest(EngineCoreRequest("s#q-1", ids, ranges, frames[:n]))
            after = AddRequest(EngineCoreRequest("s#q-1", ids, ranges, context_request_id="s#context-0"))
            t_before, t_after = (statistics.median([crossing_s(m, push, pull) for _ in range(repeats)])
                                 for m in (before, after))
            print(f"{n:>6} {nbytes(before):>14,} {t_before * 1e3:>10.1f} {nbytes(after):>12,} {t_after * 1e3:>9.2f}")
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        ctx.term()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--budget", type=int, default=1120, help="soft tokens per realistic frame (70..1120)")
    parser.add_argument("--part", choices=("all", "demo", "realistic"), default="all",
                        help="demo alone runs on a checkout from before context_request_id")
    args = parser.parse_args()
    os.environ.setdefault("HF_ENDPOINT", "http://127.0.0.1:9")
    print(f"machine: {platform.node()} {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} "
          f"(shared with other engineers' work)")
    if args.part in ("all", "demo"):
        demo_table(args.repeats)
    if args.part in ("all", "realistic"):
        realistic_table(args.budget, args.repeats)
    print(f"\nload average at the end {os.getloadavg()[0]:.2f} (1 min), {os.getloadavg()[1]:.2f} (5 min)")


if __name__ == "__main__":
    main()
