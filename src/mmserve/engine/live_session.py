"""A live video session: frames prefilled into a resident context as they arrive; questions branch off it.

The session keeps one open prompt in the engine (a *context*: `EngineRequest.open_prompt`), laid out
exactly as `build_prompt` lays out one user turn holding a video of the frames so far
(`LivePrompt`). Each frame is decoded in the input pool, appended to the context (`AsyncEngine.extend`)
and prefilled in the steps that follow, after every other request's work (core/sched/scheduler.py).
The context holds its KV blocks while it lives, so nothing evicts them.

A question's prompt is the context up to its last prefilled frame plus the question, the same tokens
a one-shot Generate of those frames and that question renders; the prefix cache serves the context's
blocks, so only the question's tokens (and at most the last frame, when a block boundary falls inside
it: the encoder cache then serves its embedding) are computed. Its frames' pixels do not cross to the
engine again: the request names the context (`context_request_id`) and the engine core takes them from
it. The question is an ordinary request: frames keep arriving while it is answered. A question that
joins the context (a conversation) is appended to it after its answer, and frames wait for that.

History: when a frame would make the context hold more than `max_history_frames` (or span more than
`max_history_s`), a new context is built from the newest half of the kept frames plus the new one
(a *roll-over*: every kept frame is prefilled again, at its new position; the encoder cache spares the
vision tower). Until the new context has caught up, questions are answered from the old one, which
then ends: answers never wait for a rebuild. A roll-over keeps frames only, not a conversation.

Falling behind: frames received and not yet prefilled are at most `max_pending_frames`; past that the
DROP policy drops the oldest frames not yet sent to the engine, BUFFER ends the session with
RESOURCE_EXHAUSTED. At most `PIPELINE_FRAMES` frames are in the engine unprefilled at once, so frames
arriving faster than steps are batched into one extension.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from mmserve.engine.types import EngineRequest, SampledVideo, derived_id
from mmserve.errors import InvalidInputError, LimitExceededError, MMServeError
from mmserve.model.prompt import ROLES, TURN_CLOSE, TURN_OPEN, timestamp_text
from mmserve.multimodal.limits import MediaLimits
from mmserve.multimodal.live_stream import StreamDecoder
from mmserve.request import MultiModalInput
from mmserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PIPELINE_FRAMES = 4   # frames sent to the engine and not yet prefilled, at most; later ones batch up
MIN_QUESTION_ROOM = 64   # tokens every context leaves free for a question and its answer
TIMESTAMP_MINUTES = 100  # a history is sized for timestamps "00:00".."99:59"; later ones may roll over sooner
LIVE_PART = "live"    # SampledVideo.part of an answer's frames


class LivePrompt:
    """The session's prompt, rendered piece by piece exactly as `build_prompt` renders
    [system, user: video(frames) + question] (and, after a joined answer, [assistant: answer, user: ...]).

    Text is tokenized in the same pieces build_prompt makes (between special ids): the text before a
    frame's `<|image>` joins whatever text is pending (`user\\n` for a turn's first frame), so each
    method returns the ids up to its last special id and keeps the text after it pending."""

    def __init__(self, tokenizer, spec, system_prompt: str = ""):
        self.tok, self.spec = tokenizer, spec
        self.turn_open, self.turn_close = tokenizer.token_id(TURN_OPEN), tokenizer.token_id(TURN_CLOSE)
        ids = [spec.bos_token_id]
        if system_prompt.strip():
            ids += [self.turn_open, *tokenizer.encode(ROLES["system"] + "\n" + system_prompt.strip()), self.turn_close,
                    *tokenizer.encode("\n")]
        self.header = [*ids, self.turn_open]
        self.pending = ROLES["user"] + "\n"   # text not yet tokenized (it merges with what follows)
        self.after_frame = False              # the pending text follows a frame in the same turn

    def _frame_text(self, time_s: float) -> str:
        return self.pending + (" " if self.after_frame else "") + timestamp_text(time_s) + " "

    def frame(self, time_s: float, num_soft_tokens: int) -> tuple[list[int], tuple[int, int]]:
        """One frame's ids and its soft-token range relative to them."""
        ids = [*self.tok.encode(self._frame_text(time_s)), self.spec.boi_token_id]
        start = len(ids)
        ids += [self.spec.video_token_id] * num_soft_tokens + [self.spec.eoi_token_id]
        self.pending, self.after_frame = "", True
        return ids, (start, start + num_soft_tokens - 1)

    def frames_tokens(self, frames: list[tuple[float, int]]) -> int:
        """How many ids `frame()` would render for `frames` ((time_s, soft tokens) each), from here."""
        texts = [self._frame_text(t) if i == 0 else " " + timestamp_text(t) + " " for i, (t, _) in enumerate(frames)]
        return sum(len(self.tok.encode(text)) + 2 + n for text, (_, n) in zip(texts, frames, strict=True))

    def history_tokens(self, num_frames: int, soft_tokens: int) -> int:
        """The most ids `num_frames` frames of at most `soft_tokens` soft tokens each render as a user
        turn's frames, whatever their timestamps below TIMESTAMP_MINUTES minutes."""
        if not num_frames:
            return 0
        first, later = widest_frame_texts(self.tok)
        return first + (num_frames - 1) * later + num_frames * (2 + soft_tokens)

    def question(self, text: str, pending: str) -> list[int]:
        """The ids that end a prompt with `text` asked (after `pending`, the text pending where it is
        asked) and the model's turn opened."""
        return [*self.tok.encode(pending + text.strip()), self.turn_close, *self.tok.encode("\n"), self.turn_open,
                *self.tok.encode(ROLES["assistant"] + "\n")]

    def joined(self, text: str, answer: str) -> list[int]:
        """The ids of a question and its answer joining the context; the next user turn is opened."""
        ids = [*self.tok.encode(self.pending + text.strip()), self.turn_close, *self.tok.encode("\n"), self.turn_open,
               *self.tok.encode(ROLES["assistant"] + "\n" + answer.strip()), self.turn_close, *self.tok.encode("\n"),
               self.turn_open]
        self.pending, self.after_frame = ROLES["user"] + "\n", False
        return ids


@functools.lru_cache(maxsize=8)
def widest_frame_texts(tokenizer) -> tuple[int, int]:
    """The most ids a user turn's first frame's text ("user\nmm:ss ") and a later frame's (" mm:ss ")
    tokenize to, over every timestamp below TIMESTAMP_MINUTES minutes. Computed once per tokenizer
    (a fraction of a second: the server calls it off the event loop before a session opens)."""
    stamps = [timestamp_text(60.0 * m + s) for m in range(TIMESTAMP_MINUTES) for s in range(60)]
    return (max(len(tokenizer.encode(ROLES["user"] + "\n" + t + " ")) for t in stamps),
            max(len(tokenizer.encode(" " + t + " ")) for t in stamps))


@dataclass(frozen=True)
class LiveOptions:
    system_prompt: str = ""
    max_history_frames: int = 32
    max_history_s: float = 0.0       # 0 = no time bound
    max_tokens_per_frame: int = 0    # the checkpoint's video budget when 0 (the server resolves it)
    max_pending_frames: int = 16
    fall_behind: str = "drop"        # "drop" | "buffer"
    stream_fps: float = 8.0          # frames per second sampled from an encoded stream's chunks
    max_stream_buffer_bytes: int = 8 * 2**20   # a stream's bytes received and not yet demuxed, at most


@dataclass
class LiveFrame:
    """A decoded frame: its vision input, soft tokens, timestamp in the prompt, and arrival."""

    mm: MultiModalInput
    num_soft_tokens: int
    time_s: float
    arrival: float
    index: int                       # the session's frame number (received order)


@dataclass
class _Cut:
    """A point of a context where a question may be asked: tokens before it, the text pending there,
    and the frames it follows."""

    num_tokens: int
    pending: str
    num_frames: int
    frame_index: int = -1   # the session's number of the frame it follows (-1: not after a frame)


@dataclass
class _Context:
    """One open prompt in the engine and what the session put in it."""

    request_id: str
    prompt: LivePrompt
    token_ids: list[int]
    mm_ranges: list[tuple[int, int]] = field(default_factory=list)
    mm_inputs: list[MultiModalInput] = field(default_factory=list)
    frames: list[LiveFrame] = field(default_factory=list)
    cuts: list[_Cut] = field(default_factory=list)
    prefilled: int = 0
    submitted: bool = False
    task: asyncio.Task | None = None

    @property
    def caught_up(self) -> bool:
        return self.prefilled >= len(self.token_ids)

    def cut(self) -> _Cut:
        """The latest point whose tokens are all prefilled (the header's, before any)."""
        return next((c for c in reversed(self.cuts) if c.num_tokens <= self.prefilled), self.cuts[0])


@dataclass
class LiveStats:
    """What LiveProgress reports."""

    frames_received: int = 0
    frames_prefilled: int = 0
    frames_dropped: int = 0
    frames_in_context: int = 0
    lag_s: float = 0.0
    rollovers: int = 0


class LiveSession:
    """One session. `emit(item)` receives what the client is sent: `LiveStats` after progress, and per
    question `(question_id, RequestOutput | BaseException)`. `fail(error)` ends the session (its
    context failed, BUFFER overflowed, its stream cannot be decoded). `process_frame(owner, frame,
    max_soft_tokens)` turns an encoded image or a stream's RGB frame into the model's input
    (InputProcessor.process_frame). Frames come as images (`add_frame`) or as one encoded stream
    (`add_stream_chunk`, decoded under `media_limits`), not both. `owner` is the caller's key
    (server/in_flight.py caller_key) on every engine request the session makes, so the scheduler
    counts a client's sessions and its Generate calls as one share. Call `close()` however it ends:
    it aborts everything it started. Created on the event loop it then runs on."""

    def __init__(self, engine, tokenizer, spec, session_id: str, options: LiveOptions, *,
                 process_frame: Callable, emit: Callable[[object], None], fail: Callable[[BaseException], None],
                 max_model_len: int, max_questions: int = 4, trace_context=None, observer=None,
                 media_limits: MediaLimits | None = None, owner: bytes = b""):
        self.engine, self.tokenizer, self.spec = engine, tokenizer, spec
        self.session_id, self.options, self.owner = session_id, options, owner
        self._process_frame, self._emit, self._fail = process_frame, emit, fail
        self.max_questions = max_questions
        self.trace_context = trace_context
        self.observer = observer          # metrics hooks (EngineMetrics.live_event), optional
        self.stats = LiveStats()
        self.capacity = self._capacity(max_model_len)
        self._decode_share = object()     # this session's share of the decode pool
        self._loop = asyncio.get_running_loop()
        self._media_limits = media_limits or MediaLimits()
        self._stream: StreamDecoder | None = None   # when frames come as one encoded stream
        self._ids = itertools.count()
        self._start_time: float | None = None   # the first frame's capture time (timestamps count from it)
        self._last_time = float("-inf")
        self._waiting: dict[int, float] = {}    # frame index -> arrival, received and not yet prefilled or dropped
        self._decoding: deque[tuple[int, asyncio.Task]] = deque()   # frames being decoded, in order
        self._ready: deque[LiveFrame] = deque()         # decoded, not yet sent to the engine
        self._contexts: list[_Context] = []   # [answering] or [answering, rebuilding]
        self._questions: dict[str, asyncio.Task] = {}
        self._joining: asyncio.Task | None = None   # a joined question: frames wait until it is in the context
        self.on_idle: Callable[[], None] | None = None   # called when the last question in flight ends
        self._closed = False
        self._open_context(frames=[])

    # -- frames -------------------------------------------------------------------------------------

    def _capacity(self, max_model_len: int) -> int:
        """Most tokens one context may hold: the header and a full history of frames (exactly as they
        render at the per-frame budget, LivePrompt.history_tokens), plus room for joined questions (a
        quarter of the context), leaving MIN_QUESTION_ROOM of the context for a question. Raises when
        the history alone leaves a question no room, naming how many frames fit."""
        prompt = LivePrompt(self.tokenizer, self.spec, self.options.system_prompt)
        room = max_model_len - MIN_QUESTION_ROOM - len(prompt.header)
        per_frame = self.options.max_tokens_per_frame

        def history(num_frames: int) -> int:
            return prompt.history_tokens(num_frames, per_frame)

        frames = self.options.max_history_frames
        if history(frames) > room:
            fit = next(n for n in range(frames, -1, -1) if history(n) <= room)
            raise InvalidInputError("open.max_history_frames", f"{frames} frames of {per_frame} soft tokens take "
                                    f"{history(frames)} tokens and leave a question no room in the context of "
                                    f"{max_model_len} tokens: keep at most {fit} frames, or fewer tokens per frame")
        return min(max_model_len - MIN_QUESTION_ROOM, len(prompt.header) + history(frames) + max_model_len // 4)

    def _fits(self, context: _Context, num_tokens: int) -> bool:
        return len(context.token_ids) + num_tokens <= self.capacity

    def add_frame(self, data: bytes, time_s: float | None) -> None:
        """An encoded image arrived: decode it (in order) and prefill it when the engine has room."""
        if self._stream is not None:
            raise InvalidInputError("frame", "this session's frames come as an encoded stream; it takes no images")
        self._add(data, time_s)

    def add_stream_chunk(self, data: bytes) -> None:
        """The next bytes of the session's encoded stream: its frames are decoded as they complete,
        sampled at `stream_fps` by their presentation times, and added as frames of that time."""
        if self._stream is None:
            if self.stats.frames_received:
                raise InvalidInputError("stream_chunk", "this session's frames come as images; it takes no stream")
            self._stream = StreamDecoder(
                fps=self.options.stream_fps, limits=self._media_limits,
                max_buffered_bytes=self.options.max_stream_buffer_bytes,
                on_frame=lambda rgb, t: self._loop.call_soon_threadsafe(self._stream_frame, rgb, t),
                on_error=lambda e: self._loop.call_soon_threadsafe(self._closed_with, e))
        self._stream.feed(data)

    def _stream_frame(self, rgb: np.ndarray, time_s: float) -> None:
        if self._closed:
            return
        try:
            self._add(rgb, time_s)
        except MMServeError as e:   # BUFFER overflowed: the session ends
            self._closed_with(e)

    def _add(self, data: bytes | np.ndarray, time_s: float | None) -> None:
        now = time.monotonic()
        if time_s is None:
            time_s = now
        if time_s < self._last_time:
            raise InvalidInputError("frame.time_s", f"capture times must not decrease ({time_s} after {self._last_time})")
        start = time_s if self._start_time is None else self._start_time
        if not math.isfinite(time_s - start):   # e.g. -1e308 then 1e308: the prompt's timestamp would be inf
            raise InvalidInputError("frame.time_s", f"{time_s} s after a first frame at {start} s is not a finite "
                                    "number of seconds")
        self._last_time, self._start_time = time_s, start
        index = self.stats.frames_received
        self.stats.frames_received += 1
        self._waiting[index] = now
        if len(self._waiting) > self.options.max_pending_frames:
            if self.options.fall_behind == "buffer":
                raise LimitExceededError(
                    f"{len(self._waiting)} frames are waiting to be prefilled, more than max_pending_frames "
                    f"({self.options.max_pending_frames}): the server cannot keep up with this frame rate",
                    "max_pending_frames", retryable=True)   # may pass later, on a less loaded server
            self._drop_oldest()
        task = asyncio.ensure_future(self._decode(data, time_s - start, now, index))
        self._decoding.append((index, task))
        task.add_done_callback(lambda _: self._feed())

    def _drop_oldest(self) -> None:
        """DROP: forget the oldest frame not yet sent to the engine (decoded or still decoding)."""
        if self._ready:
            index = self._ready.popleft().index
        elif self._decoding:
            index, task = self._decoding.popleft()
            task.cancel()
        else:
            return   # every waiting frame is already in the engine: nothing left to drop
        del self._waiting[index]
        self.stats.frames_dropped += 1
        self._note("frames_dropped", 1)

    async def _decode(self, data: bytes | np.ndarray, time_s: float, arrival: float, index: int) -> LiveFrame:
        mm, n = await self._process_frame(self._decode_share, data, self.options.max_tokens_per_frame)
        return LiveFrame(mm, n, time_s, arrival, index)

    def _feed(self) -> None:
        """Move decoded frames, in order, into the engine while the pipeline has room. It runs from
        callbacks (a decode's end, a step's progress), where an exception would only be logged and the
        frame wait forever: any failure ends the session instead."""
        try:
            self._feed_frames()
        except Exception as e:  # noqa: BLE001 - the session cannot go on; its status says why
            self._closed_with(e)

    def _feed_frames(self) -> None:
        if self._closed:
            return
        while self._decoding and self._decoding[0][1].done():
            _, task = self._decoding.popleft()
            if task.cancelled():
                continue
            if (error := task.exception()) is not None:
                self._closed_with(error)
                return
            self._ready.append(task.result())
        if self._joining is not None or not self._ready:
            return
        context = self._contexts[-1]
        in_flight = sum(1 for f in context.frames if f.index in self._waiting)
        batch: list[LiveFrame] = []
        while self._ready and in_flight + len(batch) < PIPELINE_FRAMES:
            frame = self._ready.popleft()
            if self._needs_rollover(context, batch, frame):
                if batch:
                    self._append(context, batch)
                    batch = []
                context = self._roll_over(context, frame)
                continue
            batch.append(frame)
        if batch:
            self._append(context, batch)

    def _needs_rollover(self, context: _Context, batch: list[LiveFrame], frame: LiveFrame) -> bool:
        frames = context.frames + batch
        if len(frames) + 1 > self.options.max_history_frames:
            return True
        room = context.prompt.frames_tokens([(f.time_s, f.num_soft_tokens) for f in (*batch, frame)])
        if not self._fits(context, room):   # joined questions filled it, or timestamps past TIMESTAMP_MINUTES
            return True
        return bool(frames and self.options.max_history_s and frame.time_s - frames[0].time_s > self.options.max_history_s)

    def _append(self, context: _Context, frames: list[LiveFrame]) -> None:
        self._extend(context, *self._render(context, frames))

    def _render(self, context: _Context, frames: list[LiveFrame]):
        """The ids, ranges and inputs of `frames` after the context's tokens; records their cuts."""
        ids: list[int] = []
        ranges: list[tuple[int, int]] = []
        base = len(context.token_ids)
        for frame in frames:
            piece, (a, b) = context.prompt.frame(frame.time_s, frame.num_soft_tokens)
            offset = base + len(ids)
            ranges.append((offset + a, offset + b))
            ids += piece
            context.cuts.append(_Cut(offset + len(piece), "", len(context.frames) + len(ranges), frame.index))
        context.frames += frames
        return ids, ranges, [f.mm for f in frames]

    def _extend(self, context: _Context, ids: list[int], ranges: list[tuple[int, int]],
                inputs: list[MultiModalInput]) -> None:
        context.token_ids += ids
        context.mm_ranges += ranges
        context.mm_inputs += inputs
        if not context.submitted:
            return   # its first prompt will hold them
        try:
            self.engine.extend(context.request_id, ids, ranges, inputs)
        except MMServeError as e:   # the context ended under us (its stream reports why)
            logger.debug("session %s: extend failed: %s", self.session_id, e)

    # -- contexts -----------------------------------------------------------------------------------

    def _open_context(self, frames: list[LiveFrame]) -> _Context:
        prompt = LivePrompt(self.tokenizer, self.spec, self.options.system_prompt)
        context = _Context(derived_id(self.session_id, f"context-{next(self._ids)}"), prompt, list(prompt.header))
        context.cuts.append(_Cut(len(context.token_ids), prompt.pending, 0))
        ids, ranges, inputs = self._render(context, frames)   # a rebuild's kept frames: in its first prompt
        context.token_ids += ids
        context.mm_ranges += ranges
        context.mm_inputs += inputs
        self._contexts.append(context)
        context.task = asyncio.ensure_future(self._follow(context))
        return context

    def _roll_over(self, context: _Context, frame: LiveFrame) -> _Context:
        """Start a context from the newest half of `context`'s frames plus `frame`; the answering
        context keeps answering until the new one has caught up. A third context is never kept: a
        roll-over during a rebuild ends the context that was answering."""
        if len(self._contexts) > 1:
            self._end_context(self._contexts[0])
        keep = max(0, self.options.max_history_frames // 2 - 1)
        frames = [f for f in context.frames[len(context.frames) - keep:] if keep] + [frame]
        if self.options.max_history_s:
            frames = [f for f in frames if frame.time_s - f.time_s <= self.options.max_history_s]
        self.stats.rollovers += 1
        self._note("rollovers", 1)
        return self._open_context(frames)

    def _end_context(self, context: _Context) -> None:
        """End a context in the engine; its frames no other context holds and none prefilled are dropped."""
        self._contexts.remove(context)
        if not self._closed:
            elsewhere = {f.index for c in self._contexts for f in c.frames}
            lost = [f.index for f in context.frames if f.index in self._waiting and f.index not in elsewhere]
            for index in lost:
                del self._waiting[index]
            self.stats.frames_dropped += len(lost)
            if lost:
                self._note("frames_dropped", len(lost))
        if context.task is not None:
            context.task.cancel()   # leaving generate() aborts the context in the engine
        self.engine.abort(context.request_id)

    async def _follow(self, context: _Context) -> None:
        """Submit a context (what it holds by now: extensions before this task ran are in its first
        prompt) and stream its progress: prefilled frames -> stats, lag, the next frames, roll-over's end."""
        request = EngineRequest(context.request_id, list(context.token_ids), list(context.mm_ranges),
                                list(context.mm_inputs), sampling=SamplingParams(max_tokens=1), owner=self.owner,
                                open_prompt=self.capacity, session_id=self.session_id,
                                trace_context=self.trace_context, num_frames=len(context.frames),
                                arrival_time=time.monotonic())
        # From here the engine knows the context: generate() registers it before its first wait.
        context.submitted = True
        try:
            async for out in self.engine.generate(request):
                if out.prefilled_tokens:
                    self._prefilled(context, out.prefilled_tokens)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # noqa: BLE001 - the context failed: the session cannot go on
            if context in self._contexts:
                self._closed_with(e)

    def _prefilled(self, context: _Context, prefilled: int) -> None:
        context.prefilled = max(context.prefilled, prefilled)
        done = [c.frame_index for c in context.cuts if c.num_tokens <= context.prefilled and c.frame_index in self._waiting]
        for index in done:
            del self._waiting[index]
        if done:
            self.stats.frames_prefilled += len(done)
            self._note("frames_prefilled", len(done))
        if len(self._contexts) > 1 and self._contexts[-1].caught_up:
            self._end_context(self._contexts[0])   # the rebuilt context answers from now on
        answering = self._contexts[0]
        self.stats.frames_in_context = answering.cut().num_frames
        self.stats.lag_s = time.monotonic() - next(iter(self._waiting.values())) if self._waiting else 0.0
        self._note("lag_s", self.stats.lag_s)
        self._emit(dataclasses.replace(self.stats))
        self._feed()

    # -- questions ----------------------------------------------------------------------------------

    def ask(self, question_id: str, text: str, sampling: SamplingParams, *, join_context: bool = False,
            trace_context=None) -> None:
        """Answer `text` from the frames prefilled when it reaches the engine (within a loop turn);
        the answer streams through `emit`."""
        if question_id in self._questions:
            raise InvalidInputError("question.question_id", f"{question_id!r} is already being answered")
        if len(self._questions) >= self.max_questions:
            raise LimitExceededError(f"{len(self._questions)} questions of this session are in flight",
                                     "--live-max-questions", retryable=True)
        if join_context and self._joining is not None:
            raise LimitExceededError("a question joining the context is still being answered", "join_context",
                                     retryable=True)
        asked = time.monotonic()
        task = asyncio.ensure_future(self._answer(question_id, text, sampling, join_context, trace_context, asked))
        self._questions[question_id] = task
        if join_context:
            self._joining = task

    def _question(self, question_id: str, text: str, sampling: SamplingParams, trace_context,
                  asked: float) -> EngineRequest:
        """The question's request, from the answering context's last prefilled frame. Its media are
        the context's (`context_request_id`): the engine takes them from the context, so no pixels
        cross per question. Built right before `generate` posts it, with no await between, so the
        engine admits it before any later end of that context (both go down one ordered socket)."""
        context = self._contexts[0]
        cut = context.cut()
        ranges = [r for r in context.mm_ranges if r[1] < cut.num_tokens]
        suffix = context.prompt.question(text, cut.pending)
        frames = context.frames[:cut.num_frames]
        return EngineRequest(
            derived_id(self.session_id, f"q-{question_id}"), context.token_ids[:cut.num_tokens] + suffix, ranges,
            context.mm_inputs[:len(ranges)], sampling, owner=self.owner, trace_context=trace_context,
            num_frames=len(frames), num_mm_tokens=sum(b - a + 1 for a, b in ranges), arrival_time=asked,
            videos=[SampledVideo(LIVE_PART, tuple(f.time_s for f in frames))],
            context_request_id=context.request_id if ranges else "")

    async def _answer(self, question_id: str, text: str, sampling: SamplingParams, join_context: bool,
                      trace_context, asked: float) -> None:
        answer: list[str] = []
        try:
            async for out in self.engine.generate(self._question(question_id, text, sampling, trace_context, asked)):
                answer.append(out.new_text)
                self._emit((question_id, out))
            if join_context:
                self._join(text, "".join(answer))
        except asyncio.CancelledError:
            self._emit((question_id, asyncio.CancelledError()))
            raise
        except BaseException as e:  # noqa: BLE001 - this question failed; the session goes on
            self._emit((question_id, e))
        finally:
            self._questions.pop(question_id, None)
            if self._joining is asyncio.current_task():
                self._joining = None
                self._feed()
            if not self._questions and self.on_idle is not None:
                self.on_idle()

    def _join(self, text: str, answer: str) -> None:
        """Append a joined question and its answer to the newest context (frames waited for it)."""
        context = self._contexts[-1]
        before = context.prompt.pending, context.prompt.after_frame
        ids = context.prompt.joined(text, answer)
        if not self._fits(context, len(ids)):
            logger.info("session %s: a joined question does not fit the context; it was not joined", self.session_id)
            context.prompt.pending, context.prompt.after_frame = before   # the frames' turn goes on
            return
        context.cuts.append(_Cut(len(context.token_ids) + len(ids), context.prompt.pending, len(context.frames)))
        self._extend(context, ids, [], [])

    @property
    def questions_in_flight(self) -> int:
        return len(self._questions)

    @property
    def frames_behind(self) -> int:
        """Frames received that a question asked now would not see (not yet prefilled)."""
        return len(self._waiting)

    def cancel_question(self, question_id: str) -> bool:
        task = self._questions.get(question_id)
        if task is None:
            return False
        task.cancel()
        return True

    # -- end ----------------------------------------------------------------------------------------

    def _note(self, what: str, value: float) -> None:
        if self.observer is not None:
            try:
                self.observer.live_event(what, value)
            except Exception:
                logger.exception("live metrics hook failed")

    def _closed_with(self, error: BaseException) -> None:
        if not self._closed:
            self._fail(error)

    def close(self) -> None:
        """End everything the session started: decodes, questions, contexts (their blocks are freed
        within a step)."""
        self._closed = True
        if self._stream is not None:
            self._stream.close()
        for _, task in self._decoding:
            task.cancel()
        self._decoding.clear()
        self._ready.clear()
        for task in list(self._questions.values()):
            task.cancel()
        for context in list(self._contexts):
            self._end_context(context)

