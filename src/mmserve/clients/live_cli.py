"""`mmserve live`: stream a video into a live session (Generation.Live) and ask questions at given times.

A file is decoded here and its frames sent at their real rate (sampled at --fps by presentation
time), each as a JPEG with its time; `-` reads an encoded stream (MPEG-TS or fragmented MP4) from
stdin and forwards it in chunks as it arrives, for the server to decode (`ffmpeg ... -f mpegts - |
mmserve live -`). `--ask SECONDS:TEXT` asks TEXT that many seconds after the start (on the file's
clock); questions still due when the input ends are asked then (after a file, once every frame sent
is prefilled). Each answer is printed as it ends, with the number of frames it saw. Exits 0 once every question is answered, 2 on a bad request, 1 otherwise.
"""

from __future__ import annotations

import argparse
import io
import math
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import av
import grpc
from PIL import Image

from mmserve.api import pb
from mmserve.clients.cli import add_connection_args, connect
from mmserve.clients.client import LiveCall
from mmserve.clients.types import ClientError
from mmserve.multimodal.live_stream import FpsSampler

STDIN_CHUNK_BYTES = 64 * 1024
JPEG_QUALITY = 90


@dataclass
class LiveAnswer:
    """One question's answer as the session streamed it."""

    question_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    seen_s: list[float] = field(default_factory=list)   # the timestamps of the frames it saw
    error: pb.LiveError | None = None
    done: bool = False


class LiveWatcher:
    """Reads a live call on a thread: the latest LiveProgress, and each question's answer, handed to
    `on_answer` when it ends. `wait()` and `answer()` block until what they wait for, raising the
    session's ClientError if it ended first."""

    def __init__(self, call: LiveCall, on_answer: Callable[[LiveAnswer], None] | None = None,
                 on_progress: Callable[[pb.LiveProgress], None] | None = None):
        self.progress = pb.LiveProgress()
        self.opened: pb.LiveOpened | None = None
        self.answers: dict[str, LiveAnswer] = {}
        self.error: ClientError | None = None
        self.ended = False
        self._on_answer, self._on_progress = on_answer, on_progress
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(call,), name="mmserve-live-reader", daemon=True)
        self._thread.start()

    def _read(self, call: LiveCall) -> None:
        try:
            for response in call:
                kind, finished = response.WhichOneof("kind"), None
                with self._cond:
                    if kind == "opened":
                        self.opened = response.opened
                    elif kind == "progress":
                        self.progress = response.progress
                    else:
                        finished = self._record(response.answer)
                    self._cond.notify_all()
                if kind == "progress" and self._on_progress:
                    self._on_progress(response.progress)
                elif kind == "answer" and finished is not None and self._on_answer:
                    self._on_answer(finished)
        except ClientError as e:
            self.error = e
        finally:
            with self._cond:
                self.ended = True
                self._cond.notify_all()

    def _record(self, message: pb.LiveAnswer) -> LiveAnswer | None:
        """Add a LiveAnswer message to its question's answer; the answer when it just ended."""
        answer = self.answers.setdefault(message.question_id, LiveAnswer(message.question_id))
        kind = message.WhichOneof("kind")
        if kind == "delta":
            answer.text += message.delta.text
            answer.token_ids += message.delta.token_ids
            return None
        if kind == "final":
            answer.seen_s = list(message.final.videos[0].timestamps_s) if message.final.videos else []
        else:
            answer.error = message.error
        answer.done = True
        return answer

    def wait(self, condition: Callable[[pb.LiveProgress], bool], timeout_s: float | None = None) -> pb.LiveProgress:
        """Block until `condition(progress)` holds; the progress that satisfied it."""
        with self._cond:
            if not self._cond.wait_for(lambda: self.ended or condition(self.progress), timeout_s):
                raise TimeoutError(f"live session: still {self.progress} after {timeout_s}s")
            if not condition(self.progress):
                raise self._ended_error()
            return self.progress

    def answer(self, question_id: str, timeout_s: float | None = None) -> LiveAnswer:
        with self._cond:
            def done() -> bool:
                return self.ended or (question_id in self.answers and self.answers[question_id].done)
            if not self._cond.wait_for(done, timeout_s):
                raise TimeoutError(f"live session: question {question_id} not answered after {timeout_s}s")
            if question_id not in self.answers or not self.answers[question_id].done:
                raise self._ended_error()
            return self.answers[question_id]

    def join(self, timeout_s: float | None = None) -> None:
        """Wait for the call to end (after `close()`); raises its error if it failed."""
        self._thread.join(timeout_s)
        if self.error is not None:
            raise self.error

    def _ended_error(self) -> ClientError:
        return self.error or ClientError(grpc.StatusCode.UNKNOWN, "the live session ended")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("live", help="stream a video (a file at its real rate, or an encoded stream on stdin) "
                              "into a live session and ask questions at given times",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_connection_args(p)
    p.add_argument("source", help="a video file, or - for an encoded stream (MPEG-TS, fragmented MP4) on stdin")
    p.add_argument("--ask", action="append", default=[], type=_timed_question, metavar="SECONDS:TEXT",
                   help="ask TEXT this many seconds after the start (repeatable)")
    p.add_argument("--fps", type=float, default=8.0, help="frames per second (default 8): a file's frames sent, "
                   "at most its own rate (0 = every frame); stdin: the server samples the stream at this rate, at "
                   "most its --live-max-stream-fps (0 = that)")
    p.add_argument("--system", default="", help="a system turn before the frames")
    p.add_argument("--max-history-frames", type=int, default=0, help="frames the context keeps; 0 = server default")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per answer at most (default 32)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the default)")
    p.add_argument("--join", action="store_true", help="questions and their answers join the context (a conversation)")
    p.add_argument("--progress", action="store_true", help="print the session's progress to stderr once a second")
    p.set_defaults(func=run)


def _timed_question(value: str) -> tuple[float, str]:
    when, sep, text = value.partition(":")
    try:
        if not sep or not text.strip():
            raise ValueError
        seconds = float(when)
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected SECONDS:TEXT with SECONDS >= 0, got {value!r}") from None
    return seconds, text.strip()


def file_frames(path: Path, fps: float) -> Iterator[tuple[float, bytes]]:
    """(time in seconds from the first frame, JPEG) of the file's frames sampled at `fps` (0 = every
    frame) by presentation time, as the server samples a stream."""
    sampler = FpsSampler(fps)
    first = None
    with av.open(str(path)) as container:
        for frame in container.decode(container.streams.video[0]):
            if frame.time is None or not sampler.keep(frame.time):
                continue
            first = frame.time if first is None else first
            out = io.BytesIO()
            Image.fromarray(frame.to_ndarray(format="rgb24")).save(out, "JPEG", quality=JPEG_QUALITY)
            yield frame.time - first, out.getvalue()


def print_answer(answer: LiveAnswer, text: str, asked_s: float) -> None:
    out = sys.stdout
    if answer.error is not None:
        code = next((c.name for c in grpc.StatusCode if c.value[0] == answer.error.code), str(answer.error.code))
        out.write(f"[{asked_s:.1f} s] {text} -> error {code}: {answer.error.message}\n")
    else:
        out.write(f"[{asked_s:.1f} s, {len(answer.seen_s)} frames seen] {text} -> {answer.text.strip()}\n")
    out.flush()


def run(args: argparse.Namespace) -> int:
    if args.source != "-" and not Path(args.source).is_file():
        print(f"mmserve live: no such file: {args.source}", file=sys.stderr)
        return 2
    stdin = args.source == "-"
    questions = sorted(args.ask)
    asked: dict[str, tuple[str, float]] = {}   # question id -> (text, seconds after the start)
    lock = threading.Lock()
    last_progress = [0.0]

    def on_answer(answer: LiveAnswer) -> None:
        with lock:
            text, at = asked.get(answer.question_id, ("?", 0.0))
            print_answer(answer, text, at)

    def on_progress(p: pb.LiveProgress) -> None:
        if args.progress and time.monotonic() - last_progress[0] >= 1.0:
            last_progress[0] = time.monotonic()
            print(f"frames received {p.frames_received}, prefilled {p.frames_prefilled}, dropped {p.frames_dropped}, "
                  f"in context {p.frames_in_context}, lag {p.lag_s:.2f} s, roll-overs {p.rollovers}", file=sys.stderr)

    open_ = pb.LiveOpen(system_prompt=args.system, max_history_frames=args.max_history_frames,
                        stream_fps=args.fps if stdin else 0.0)
    try:
        with connect(args) as client:
            call = client.live(open_, timeout=args.timeout)
            watcher = LiveWatcher(call, on_answer=on_answer, on_progress=on_progress)
            start = time.monotonic()

            def ask_due(now_s: float) -> None:
                while questions and questions[0][0] <= now_s:
                    at, text = questions.pop(0)
                    qid = f"q{len(asked) + 1}"
                    with lock:
                        asked[qid] = (text, time.monotonic() - start)
                    call.ask(text, question_id=qid, max_tokens=args.max_tokens, temperature=args.temperature,
                             join_context=args.join)

            if stdin:
                while not watcher.ended and (chunk := sys.stdin.buffer.read1(STDIN_CHUNK_BYTES)):
                    ask_due(time.monotonic() - start)
                    call.stream_chunk(chunk)
            else:
                sent = 0
                for time_s, jpeg in file_frames(Path(args.source), args.fps):
                    if watcher.ended:
                        break
                    time.sleep(max(0.0, start + time_s - time.monotonic()))   # the file's real rate
                    ask_due(time_s)
                    call.frame(jpeg, time_s)
                    sent += 1
                if questions:   # asked after the whole file: let them see all of it
                    watcher.wait(lambda p: p.frames_prefilled + p.frames_dropped >= sent)
            ask_due(math.inf)   # the input ended: what is still due is asked now
            for qid in list(asked):
                watcher.answer(qid)
            call.close()
            watcher.join()
    except ClientError as e:
        print(f"mmserve live: {e.code.name}: {e.message}", file=sys.stderr)
        return 2 if e.code == grpc.StatusCode.INVALID_ARGUMENT else 1
    except (OSError, av.FFmpegError) as e:
        print(f"mmserve live: {e}", file=sys.stderr)
        return 2
    return 0
