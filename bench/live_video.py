"""Live video sessions vs one-shot requests on the demo model (CPU), against a real server on 127.0.0.1.

1. TTFT: a session streams 64 random frames at 8 fps; at frames 8, 32 and 64 (once every frame so far
   is prefilled) it asks a question, greedy, and the time from the question to its first token is set
   against a one-shot Generate of the same frames and question (VideoFrames at 8 fps: today's path,
   prompt_logprobs on so the prefix cache lends it nothing). One line per frame count, ending in the
   ratio live/one-shot as `N.NNx`. The answers' tokens must agree.
2. Absorbable fps: one session is sent frames as fast as it takes them (DROP policy off the table:
   BUFFER with a deep queue); frames prefilled per second.
3. Load: 4 sessions at 8 fps for 8 s each plus a Generate every 0.5 s: whether each session keeps up
   (dropped frames, final lag), and the bystander's median TTFT against the same Generate on the idle
   server.
4. Roll-over: a session with max_history_frames 16 streams 40 frames; the time a rebuild takes
   (roll-over seen -> the rebuilt context answers) is reported.

    python bench/live_video.py    # a minute or two on 2 shared cores
"""

from __future__ import annotations

import io
import platform
import queue
import statistics
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from loopback_server import LoopbackServer, engine_config  # noqa: E402

from mmserve.api import pb, pb_grpc  # noqa: E402
from mmserve.config import DEMO_MODEL_DIR  # noqa: E402

FPS = 8.0
QUESTION = "What moves?"
SIZE = (16, 16)   # 4 soft tokens per frame on the demo model: 64 frames fit its 1024-token context


def png(rng: np.random.Generator) -> bytes:
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (SIZE[1], SIZE[0], 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


def ask(qid: str) -> pb.LiveRequest:
    return pb.LiveRequest(question=pb.LiveQuestion(question_id=qid, messages=[
        pb.Message(role="user", parts=[pb.Part(text=QUESTION)])], sampling=pb.SamplingParams(max_tokens=8, temperature=0)))


def one_shot(stub, frames: list[bytes]) -> tuple[float, list[int]]:
    request = pb.GenerateRequest(messages=[pb.Message(role="user", parts=[
        pb.Part(video=pb.Video(frames=pb.VideoFrames(frames=[pb.Image(data=f) for f in frames], fps=FPS))),
        pb.Part(text=QUESTION)])], sampling=pb.SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=True))
    start, first, tokens = time.perf_counter(), None, []
    for r in stub.Generate(request, timeout=300):
        if r.WhichOneof("kind") == "delta":
            first = first or time.perf_counter()
            tokens += r.delta.token_ids
    return first - start, tokens


class Live:
    def __init__(self, stub, open_: pb.LiveOpen):
        self.out: queue.Queue = queue.Queue()
        self.out.put(pb.LiveRequest(open=open_))
        self.call = stub.Live(iter(self.out.get, None), timeout=600)
        self.progress = pb.LiveProgress()
        self.events: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        try:
            for r in self.call:
                if r.WhichOneof("kind") == "progress":
                    self.progress = r.progress
                self.events.put((time.perf_counter(), r))
        except grpc.RpcError as e:
            self.events.put((time.perf_counter(), e))

    def wait(self, cond, timeout=300):
        deadline = time.perf_counter() + timeout
        while not cond(self.progress):
            if not self.thread.is_alive():
                raise RuntimeError(f"the session ended: {self.call.code()} {self.call.details()}")
            if time.perf_counter() > deadline:
                raise TimeoutError(str(self.progress))
            time.sleep(0.002)

    def answer(self, qid: str) -> tuple[float, list[int]]:
        """(first-token time, tokens) of a question just asked."""
        first, tokens = None, []
        while True:
            at, r = self.events.get(timeout=300)
            if isinstance(r, Exception):
                raise r
            if r.WhichOneof("kind") == "answer" and r.answer.question_id == qid:
                kind = r.answer.WhichOneof("kind")
                if kind == "delta":
                    first = first or at
                    tokens += r.answer.delta.token_ids
                elif kind == "error":
                    raise RuntimeError(r.answer.error.message)
                else:
                    return first, tokens

    def close(self):
        self.out.put(None)
        self.thread.join(60)


def ttft_table(stub, rng) -> None:
    frames = [png(rng) for _ in range(64)]
    s = Live(stub, pb.LiveOpen(max_history_frames=64, max_tokens_per_frame=4))
    print("\n## TTFT: a question at frame N (live) vs a one-shot Generate of the same frames + question")
    print("| frames | live TTFT (ms) | one-shot TTFT (ms) | same tokens | live / one-shot |")
    print("|---|---|---|---|---|")
    start = time.perf_counter()
    for i, frame in enumerate(frames, 1):
        time.sleep(max(0.0, start + (i - 1) / FPS - time.perf_counter()))   # filmed at 8 fps
        s.out.put(pb.LiveRequest(frame=pb.LiveFrame(image=frame, time_s=(i - 1) / FPS)))
        if i in (8, 32, 64):
            s.wait(lambda p, i=i: p.frames_in_context >= i)
            asked = time.perf_counter()
            s.out.put(ask(f"q{i}"))
            first, tokens = s.answer(f"q{i}")
            live = first - asked
            base, expected = one_shot(stub, frames[:i])
            print(f"| {i} | {live * 1e3:.1f} | {base * 1e3:.1f} | {tokens == expected} | {live / base:.2f}x |")
    s.close()


def absorb(stub, rng) -> None:
    frames = [png(rng) for _ in range(48)]
    s = Live(stub, pb.LiveOpen(max_history_frames=64, max_tokens_per_frame=4, fall_behind=pb.LIVE_FALL_BEHIND_BUFFER, max_pending_frames=64))
    start = time.perf_counter()
    for f in frames:
        s.out.put(pb.LiveRequest(frame=pb.LiveFrame(image=f)))
    s.wait(lambda p: p.frames_prefilled >= len(frames))
    took = time.perf_counter() - start
    print(f"\n## Absorbable rate: one session, {len(frames)} frames sent at once: "
          f"{len(frames) / took:.1f} frames/s prefilled ({took:.2f} s)")
    s.close()


def load(stub, rng) -> None:
    idle = [one_shot(stub, [png(rng)])[0] for _ in range(6)]
    sessions = [Live(stub, pb.LiveOpen(max_history_frames=32)) for _ in range(4)]
    frames = [[png(rng) for _ in range(64)] for _ in sessions]
    bystander: list[float] = []
    stop = threading.Event()

    def generate_load():
        while not stop.is_set():
            bystander.append(one_shot(stub, [png(np.random.default_rng())])[0])
            time.sleep(0.5)

    t = threading.Thread(target=generate_load, daemon=True)
    t.start()
    start = time.perf_counter()
    for i in range(64):
        time.sleep(max(0.0, start + i / FPS - time.perf_counter()))
        for s, fs in zip(sessions, frames, strict=True):
            s.out.put(pb.LiveRequest(frame=pb.LiveFrame(image=fs[i], time_s=i / FPS)))
    time.sleep(1.0)
    stop.set()
    t.join(60)
    print("\n## 4 sessions at 8 fps (8 s each) + a one-frame Generate every 0.5 s")
    print("| session | received | prefilled | dropped | lag at the end (s) |")
    print("|---|---|---|---|---|")
    for k, s in enumerate(sessions):
        p = s.progress
        print(f"| {k} | {p.frames_received} | {p.frames_prefilled} | {p.frames_dropped} | {p.lag_s:.2f} |")
        s.close()
    print(f"bystander Generate TTFT median {statistics.median(bystander) * 1e3:.1f} ms under load, "
          f"{statistics.median(idle) * 1e3:.1f} ms idle: {statistics.median(bystander) / statistics.median(idle):.2f}x")


def rollover(stub, rng) -> None:
    s = Live(stub, pb.LiveOpen(max_history_frames=16))
    for i in range(40):
        s.out.put(pb.LiveRequest(frame=pb.LiveFrame(image=png(rng), time_s=i / FPS)))
    s.wait(lambda p: p.frames_prefilled + p.frames_dropped >= 40)
    print(f"\n## Roll-over: 40 frames into a 16-frame history: {s.progress.rollovers} roll-overs, "
          f"{s.progress.frames_in_context} frames in context at the end")
    s.close()


def main() -> None:
    server = LoopbackServer(engine_config(DEMO_MODEL_DIR, max_frames_per_video=64, engine_threads=0,
                                          kv_cache_bytes=64 * 2**20, live_max_history_frames=64,
                                          live_max_pending_frames=64)).start()
    print(f"# Live video on {platform.processor() or platform.machine()} (demo model, float32, CPU, "
          f"{SIZE[0]}x{SIZE[1]} frames)")
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            rng = np.random.default_rng(0)
            one_shot(stub, [png(rng)])   # warm
            ttft_table(stub, rng)
            absorb(stub, rng)
            load(stub, rng)
            rollover(stub, rng)
    finally:
        server.stop()


if __name__ == "__main__":
    main()
