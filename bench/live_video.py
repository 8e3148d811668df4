"""Live video sessions vs one-shot requests on the demo model (CPU), against a real server on 127.0.0.1.

The demo model's context is 1024 tokens: 64 frames fit one prompt only at 4 soft tokens per frame, so
the server runs the demo checkpoint with its video processor's frame budget set to 4 (a copy whose
video_preprocessor_config.json says max_soft_tokens 4; weights unchanged). Live and one-shot frames
then render alike and a greedy answer is the same tokens on both paths.

1. TTFT: a session streams 64 random frames at 8 fps; at frames 8, 32 and 64 (once every frame so far
   is prefilled) it asks a question, greedy, and the time from the question to its first token is set
   against a one-shot Generate of the same frames and question (VideoFrames at 8 fps: today's path,
   prompt_logprobs on so the prefix cache lends it nothing). `--repeats` sessions; medians. One line
   per frame count, ending in the ratio live/one-shot as `N.NNx`, with the tokens a live question
   computes (its prompt less what the prefix cache served: a number load cannot blur) and the TTFT the
   server measured beside the client's. The answers' tokens must agree (where they do not, the
   one-shot's top-two logprob gap at the first difference is printed).
2. Absorbable rate: one session is sent 48 frames at once (BUFFER with a deep queue); frames
   prefilled per second.
3. Load: 4 sessions at 8 fps for 8 s plus a one-frame Generate every 0.5 s: whether each session
   keeps up (dropped frames, lag), and the bystander Generate's median TTFT against the same Generate
   on the idle server.
4. Roll-over: a session with a 16-frame history streams 48 frames at 8 fps; each rebuild's time (the
   first progress that reports the roll-over -> the rebuilt context answers), and a question's TTFT
   asked during a rebuild against one asked outside.

    python bench/live_video.py    # a few minutes on 2 shared cores
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import queue
import shutil
import statistics
import sys
import tempfile
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
SIZE = (16, 16)          # pixels per frame
TOKENS_PER_FRAME = 4     # the checkpoint copy's video budget: 64 frames fit one 1024-token prompt
MAX_TOKENS = 8


def demo_model_at(tokens_per_frame: int, root: Path) -> Path:
    """The demo checkpoint with its video frames at `tokens_per_frame` soft tokens (weights linked)."""
    root.mkdir(parents=True, exist_ok=True)
    for f in Path(DEMO_MODEL_DIR).iterdir():
        (root / f.name).symlink_to(f.resolve())
    video = root / "video_preprocessor_config.json"
    config = json.loads(video.read_text())
    video.unlink()
    video.write_text(json.dumps({**config, "max_soft_tokens": tokens_per_frame}))
    return root


def png(rng: np.random.Generator) -> bytes:
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (SIZE[1], SIZE[0], 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


def ask(qid: str, text: str = QUESTION) -> pb.LiveRequest:
    return pb.LiveRequest(question=pb.LiveQuestion(question_id=qid, messages=[
        pb.Message(role="user", parts=[pb.Part(text=text)])],
        sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0)))


def one_shot(stub, frames: list[bytes], margins: list[float] | None = None) -> tuple[float, list[int]]:
    """(TTFT, tokens) of a Generate of `frames` at 8 fps + the question, computed without the prefix cache.
    `margins` receives each token's logprob lead over the runner-up (how close greedy was to a tie)."""
    request = pb.GenerateRequest(messages=[pb.Message(role="user", parts=[
        pb.Part(video=pb.Video(frames=pb.VideoFrames(frames=[pb.Image(data=f) for f in frames], fps=FPS))),
        pb.Part(text=QUESTION)])], sampling=pb.SamplingParams(
            max_tokens=MAX_TOKENS, temperature=0, prompt_logprobs=True, logprobs=margins is not None,
            top_logprobs=2 if margins is not None else 0))
    start, first, tokens = time.perf_counter(), None, []
    for r in stub.Generate(request, timeout=300):
        if r.WhichOneof("kind") == "delta":
            first = first or time.perf_counter()
            tokens += r.delta.token_ids
            if margins is not None:
                margins += [lp.top[0].logprob - lp.top[1].logprob for lp in r.delta.logprobs]
    return first - start, tokens


class Live:
    """One session driven from the benchmark: `out` takes messages, a thread reads the responses."""

    def __init__(self, stub, open_: pb.LiveOpen):
        self.out: queue.Queue = queue.Queue()
        self.out.put(pb.LiveRequest(open=open_))
        self.call = stub.Live(iter(self.out.get, None), timeout=600)
        self.progress = pb.LiveProgress()
        self.history: list[tuple[float, pb.LiveProgress]] = []   # (arrival, progress) of each report
        self.events: queue.Queue = queue.Queue()
        self.error: grpc.RpcError | None = None
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self):
        try:
            for r in self.call:
                at = time.perf_counter()
                if r.WhichOneof("kind") == "progress":
                    self.progress = r.progress
                    self.history.append((at, r.progress))
                self.events.put((at, r))
        except grpc.RpcError as e:
            self.error = e
            self.events.put((time.perf_counter(), e))

    def frame(self, image: bytes, time_s: float) -> None:
        self.out.put(pb.LiveRequest(frame=pb.LiveFrame(image=image, time_s=time_s)))

    def wait(self, cond, timeout=300):
        deadline = time.perf_counter() + timeout
        while not cond(self.progress):
            if not self.thread.is_alive():
                raise RuntimeError(f"the session ended: {self.call.code()} {self.call.details()}")
            if time.perf_counter() > deadline:
                raise TimeoutError(str(self.progress))
            time.sleep(0.002)

    def answer(self, qid: str) -> tuple[float, list[int], pb.Final]:
        """(first-token time, tokens, Final) of a question just asked."""
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
                    return first, tokens, r.answer.final

    def ttft(self, qid: str, text: str = QUESTION) -> tuple[float, list[int], pb.Final]:
        """(time from asking to the first token, tokens, Final) of a question."""
        asked = time.perf_counter()
        self.out.put(ask(qid, text))
        first, tokens, final = self.answer(qid)
        return first - asked, tokens, final

    def close(self):
        self.out.put(None)
        self.thread.join(60)


def ttft_table(stub, rng, repeats: int) -> None:
    points = (8, 32, 64)
    live: dict[int, list[float]] = {n: [] for n in points}
    base: dict[int, list[float]] = {n: [] for n in points}
    same: dict[int, list[bool]] = {n: [] for n in points}
    server: dict[int, list[float]] = {n: [] for n in points}   # the live TTFT the server measured
    computed: dict[int, list[tuple[int, int]]] = {n: [] for n in points}   # (prompt, cached) tokens
    ties: list[str] = []   # where live and one-shot differ: how close the one-shot's pick was
    for _ in range(repeats):
        frames = [png(rng) for _ in range(64)]
        s = Live(stub, pb.LiveOpen(max_history_frames=64))
        start = time.perf_counter()
        for i, frame in enumerate(frames, 1):
            time.sleep(max(0.0, start + (i - 1) / FPS - time.perf_counter()))   # filmed at 8 fps
            s.frame(frame, (i - 1) / FPS)
            if i in points:
                s.wait(lambda p, i=i: p.frames_in_context >= i)
                took, tokens, final = s.ttft(f"q{i}")
                live[i].append(took)
                server[i].append(final.timings.time_to_first_token_s)
                computed[i].append((final.usage.prompt_tokens, final.usage.cached_tokens))
                margins: list[float] = []
                took, expected = one_shot(stub, frames[:i], margins)
                base[i].append(took)
                same[i].append(tokens == expected)
                if tokens != expected:
                    n = min(len(tokens), len(expected))
                    k = next((j for j in range(n) if tokens[j] != expected[j]), n)
                    margin = f"{margins[k]:.4f}" if k < len(margins) else "?"
                    ties.append(f"{i} frames, token {k}: the one-shot's top two {margin} apart in logprob")
                start = time.perf_counter() - i / FPS   # resume filming after the pause
        s.close()
    print(f"\n## TTFT: a question at frame N (live) vs a one-shot Generate of the same frames + question "
          f"(median of {repeats})")
    print("| frames | prompt tokens | computed by a live question (cached) | live TTFT (ms) | (server-side) | "
          "one-shot TTFT (ms) | same tokens | live / one-shot |")
    print("|---|---|---|---|---|---|---|---|")
    for n in points:
        a, b = statistics.median(live[n]), statistics.median(base[n])
        prompt = computed[n][0][0]
        work = sorted({f"{p - c}" for p, c in computed[n]}, key=int)
        print(f"| {n} | {prompt} | {'/'.join(work)} | {a * 1e3:.1f} | {statistics.median(server[n]) * 1e3:.1f} | "
              f"{b * 1e3:.1f} | {sum(same[n])}/{repeats} | {a / b:.2f}x |")
    flat = statistics.median(live[64]) / statistics.median(live[8])
    print(f"live TTFT at 64 frames / at 8 frames: {flat:.2f}x")
    for tie in ties:
        print(f"answers differ at {tie}")


def absorb(stub, rng) -> None:
    frames = [png(rng) for _ in range(48)]
    s = Live(stub, pb.LiveOpen(max_history_frames=64, fall_behind=pb.LIVE_FALL_BEHIND_BUFFER, max_pending_frames=64))
    start = time.perf_counter()
    for i, f in enumerate(frames):
        s.frame(f, i / FPS)
    s.wait(lambda p: p.frames_prefilled >= len(frames))
    took = time.perf_counter() - start
    print(f"\n## Absorbable rate: one session, {len(frames)} frames sent at once: "
          f"{len(frames) / took:.1f} frames/s prefilled ({took:.2f} s)")
    s.close()


def load(stub, rng) -> None:
    idle = [one_shot(stub, [png(rng)])[0] for _ in range(8)]
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
            s.frame(fs[i], i / FPS)
    time.sleep(1.0)
    stop.set()
    t.join(60)
    idle += [one_shot(stub, [png(rng)])[0] for _ in range(8)]
    print("\n## 4 sessions at 8 fps (8 s each) + a one-frame Generate every 0.5 s")
    print("| session | received | prefilled | dropped | rollovers | max lag (s) | lag 1 s after the last frame (s) |")
    print("|---|---|---|---|---|---|---|")
    for k, s in enumerate(sessions):
        if s.error is not None:
            print(f"| {k} | refused: {s.error.code().name} {s.error.details()} |")
            continue
        p = s.progress
        worst = max((q.lag_s for _, q in s.history), default=0.0)
        print(f"| {k} | {p.frames_received} | {p.frames_prefilled} | {p.frames_dropped} | {p.rollovers} | "
              f"{worst:.2f} | {p.lag_s:.2f} |")
        s.close()
    print(f"bystander Generate TTFT median {statistics.median(bystander) * 1e3:.1f} ms under load "
          f"({len(bystander)} requests), {statistics.median(idle) * 1e3:.1f} ms idle (16, before and after): "
          f"{statistics.median(bystander) / statistics.median(idle):.2f}x")


def rollover(stub, rng) -> None:
    """A 16-frame history rolls over with frames 17, 25, 33, 41 (each rebuild keeps the newest 7 and
    the new one): a question sent with those frames is asked during a rebuild, one four frames later
    outside one."""
    s = Live(stub, pb.LiveOpen(max_history_frames=16))
    during: list[float] = []
    outside: list[float] = []
    start = time.perf_counter()
    for i in range(1, 49):
        time.sleep(max(0.0, start + (i - 1) / FPS - time.perf_counter()))
        s.frame(png(rng), (i - 1) / FPS)
        if i > 16 and i % 8 in (1, 5):
            (during if i % 8 == 1 else outside).append(s.ttft(f"q{i}", f"{QUESTION} ({i})")[0])
            start = time.perf_counter() - i / FPS   # resume filming after the question
    s.wait(lambda p: p.frames_prefilled + p.frames_dropped >= 48)
    s.close()
    times = rebuilds(s.history)
    print(f"\n## Roll-over: 48 frames at 8 fps into a 16-frame history: {s.progress.rollovers} roll-overs, "
          f"{s.progress.frames_in_context} frames in context at the end")
    if times:
        print(f"rebuild (first progress reporting the roll-over -> the rebuilt context answers): median "
              f"{statistics.median(times) * 1e3:.0f} ms, max {max(times) * 1e3:.0f} ms over {len(times)}")
    for name, values in (("asked with the frame that rolls over", during), ("asked 4 frames later", outside)):
        print(f"question TTFT {name}: median {statistics.median(values) * 1e3:.1f} ms ({len(values)} asked)")


def rebuilds(history: list[tuple[float, pb.LiveProgress]]) -> list[float]:
    """Each roll-over's rebuild time: the first progress reporting it -> the first where the frames a
    question sees drop (the rebuilt context, holding half the history, answers)."""
    times, reported, last = [], None, None
    for at, p in history:
        if last is not None and p.rollovers > last.rollovers:
            reported = at
        if reported is not None and last is not None and p.frames_in_context < last.frames_in_context:
            times.append(at - reported)
            reported = None
        last = p
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="sessions in the TTFT table (medians)")
    args = parser.parse_args()
    os.environ.setdefault("HF_ENDPOINT", "http://127.0.0.1:9")   # nothing leaves this machine
    root = Path(tempfile.mkdtemp(prefix="mmserve-live-bench-"))
    model = demo_model_at(TOKENS_PER_FRAME, root / "demo")
    # A live session reserves two contexts' KV (its answering context and a roll-over's rebuild), each
    # the blocks of one running request in the sliding pool: 4 sessions within --live-kv-share 0.5
    # need room for 16 requests there.
    server = LoopbackServer(engine_config(model, max_frames_per_video=64, engine_threads=0, max_num_seqs=16,
                                          kv_cache_bytes=64 * 2**20, live_max_history_frames=64,
                                          live_max_pending_frames=64)).start()
    print(f"# Live video on {platform.processor() or platform.machine()}, {os.cpu_count()} cores (demo model, "
          f"float32, CPU, {SIZE[0]}x{SIZE[1]} frames at {TOKENS_PER_FRAME} soft tokens); load average at the "
          f"start {os.getloadavg()[0]:.1f}")
    try:
        with grpc.insecure_channel(server.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            rng = np.random.default_rng(0)
            one_shot(stub, [png(rng)])   # warm
            ttft_table(stub, rng, args.repeats)
            absorb(stub, rng)
            load(stub, rng)
            rollover(stub, rng)
    finally:
        server.stop()
        shutil.rmtree(root, ignore_errors=True)
    print(f"\nload average at the end {os.getloadavg()[0]:.1f} (1 min), {os.getloadavg()[1]:.1f} (5 min)")


if __name__ == "__main__":
    main()
