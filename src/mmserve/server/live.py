"""Generation.Live: a bidirectional stream per live video session (engine/live_session.py).

The first message opens the session (LiveOpen); then one task reads frames (images, or the chunks of
one encoded stream), questions and cancels while the handler writes what the session emits: LiveProgress after frames are prefilled, each
question's deltas and Final, or its LiveError (a failed question never ends the session). The
session ends with a status as Generate does: OK when the client half-closes and every question is
answered, the mapped error when its context fails or BUFFER overflows, RESOURCE_EXHAUSTED (as an
idle upload) when the client sends nothing for --live-idle-timeout-s, UNAVAILABLE when the server
drains. A span per session (`mmserve.live`) has a child per question (`mmserve.live.question`),
under which the question's engine request hangs. However it ends
(client cancel, deadline included), everything it started in the engine is aborted.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
import uuid
from collections.abc import AsyncIterator, Callable

import grpc
from opentelemetry import trace

from mmserve.api import pb
from mmserve.config import EngineConfig
from mmserve.engine.live_session import LiveOptions, LiveSession, LiveStats, widest_frame_texts
from mmserve.engine.types import RequestOutput
from mmserve.errors import (
    EngineUnavailableError,
    InvalidInputError,
    LimitExceededError,
    MMServeError,
    RequestAbortedError,
)
from mmserve.logs import bind_request, unbind_request
from mmserve.metrics.tracing import end_request_span, get_tracer, start_request_span
from mmserve.server.in_flight import InFlightRequests, caller_key
from mmserve.server.servicer import _token_texts, final_message, logprobs_messages
from mmserve.server.status import end_with, map_error
from mmserve.server.validation import _request_id, check_response_format, validate_sampling

logger = logging.getLogger(__name__)

POLICIES = {pb.LIVE_FALL_BEHIND_UNSPECIFIED: "drop", pb.LIVE_FALL_BEHIND_DROP: "drop",
            pb.LIVE_FALL_BEHIND_BUFFER: "buffer"}
SESSION_SPAN = "mmserve.live"
QUESTION_SPAN = "mmserve.live.question"
DRAIN_POLL_S = 0.25   # how often an idle session's writer checks for a drain
_END = object()       # the reader's mark: the client half-closed


class _SessionEnded(Exception):
    """The session must end with `error` (a status), from the reader or the session itself."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


class LiveService:
    """The sessions of one server. `processor()` is the InputProcessor (None while loading); `observer`
    has `live_event(what, value)` and `live_sessions(delta)` hooks (metrics.prometheus.EngineMetrics), optional."""

    def __init__(self, engine, config: EngineConfig, processor: Callable, draining: Callable[[], bool],
                 in_flight: InFlightRequests, observer=None) -> None:
        self._engine, self._config, self._processor = engine, config, processor
        self._draining, self._in_flight, self._observer = draining, in_flight, observer
        self._per_client: dict[bytes, int] = {}

    @property
    def num_sessions(self) -> int:
        return sum(self._per_client.values())

    def _options(self, open_: pb.LiveOpen, processor) -> LiveOptions:
        c = self._config
        tokens = processor.spec.video_max_soft_tokens
        for name, value, limit in (("max_history_frames", open_.max_history_frames, c.live_max_history_frames),
                                   ("max_pending_frames", open_.max_pending_frames, c.live_max_pending_frames),
                                   ("max_tokens_per_frame", open_.max_tokens_per_frame, tokens)):
            if not 0 <= value <= limit:
                raise InvalidInputError(f"open.{name}", f"must be in 0..{limit} (0 = {limit}), got {value}")
        if open_.max_history_s < 0:
            raise InvalidInputError("open.max_history_s", f"must be >= 0 (0 = no time bound), got {open_.max_history_s}")
        if not 0 <= open_.stream_fps <= c.live_max_stream_fps:
            raise InvalidInputError("open.stream_fps", f"must be in 0..{c.live_max_stream_fps:g} "
                                    f"(0 = {c.live_max_stream_fps:g}), got {open_.stream_fps:g}")
        if processor.tokenizer.min_tokens(len(open_.system_prompt)) >= processor.max_model_len:
            raise InvalidInputError("open.system_prompt", "longer than the context can hold")
        return LiveOptions(system_prompt=open_.system_prompt,
                           max_history_frames=open_.max_history_frames or c.live_max_history_frames,
                           max_history_s=open_.max_history_s, max_tokens_per_frame=open_.max_tokens_per_frame or tokens,
                           max_pending_frames=open_.max_pending_frames or c.live_max_pending_frames,
                           fall_behind=POLICIES.get(open_.fall_behind, "drop"),
                           stream_fps=open_.stream_fps or c.live_max_stream_fps,
                           max_stream_buffer_bytes=c.live_max_stream_buffer_bytes)

    def _admit(self, owner: bytes) -> None:
        c = self._config
        if self.num_sessions >= c.live_max_sessions:
            raise LimitExceededError(f"{self.num_sessions} live sessions are open", "--live-max-sessions", retryable=True)
        if self._per_client.get(owner, 0) >= c.live_max_sessions_per_client:
            raise LimitExceededError(f"this client has {self._per_client[owner]} live sessions open",
                                     "--live-max-sessions-per-client", retryable=True)
        self._per_client[owner] = self._per_client.get(owner, 0) + 1
        self._note_sessions(1)

    def _release(self, owner: bytes) -> None:
        self._per_client[owner] -= 1
        if not self._per_client[owner]:
            del self._per_client[owner]
        self._note_sessions(-1)

    def _note_sessions(self, delta: int) -> None:
        if self._observer is not None:
            with contextlib.suppress(Exception):
                self._observer.live_sessions(delta)

    async def live(self, requests: AsyncIterator[pb.LiveRequest],
                   context: grpc.aio.ServicerContext) -> AsyncIterator[pb.LiveResponse]:
        idle = self._config.live_idle_timeout_s
        session_id, owner = "", caller_key(context)
        outbox: asyncio.Queue = asyncio.Queue()
        try:
            processor = self._processor()
            if processor is None:
                raise EngineUnavailableError("the model is still loading; retry shortly")
            first = await _next(requests, idle)
            if first is _END or first.WhichOneof("kind") != "open":
                raise InvalidInputError("open", "the first message of a Live stream must be LiveRequest.open")
            session_id = _request_id(first.open.session_id)
            options = self._options(first.open, processor)
            await asyncio.to_thread(widest_frame_texts, processor.tokenizer)   # once per tokenizer, off the loop
            self._in_flight.add(session_id, owner, 0, "open.session_id", on_abort=functools.partial(
                outbox.put_nowait, _SessionEnded(RequestAbortedError(f"live session {session_id} was aborted"))))
        except (MMServeError, TimeoutError) as e:
            end_with(context, _idle_error(idle) if isinstance(e, TimeoutError) else e, session_id)
            return
        span, trace_context = start_request_span(context.invocation_metadata(), request_id=session_id,
                                                 model=self._engine.model_info.name)
        span.update_name(SESSION_SPAN)
        try:
            self._admit(owner)
            try:
                session = LiveSession(self._engine, processor.tokenizer, processor.spec, session_id, options,
                                      process_frame=processor.process_frame, emit=outbox.put_nowait,
                                      fail=lambda e: outbox.put_nowait(_SessionEnded(e)),
                                      max_model_len=processor.max_model_len,
                                      max_questions=self._config.live_max_questions, trace_context=trace_context,
                                      observer=self._observer, media_limits=processor.limits, owner=owner)
            except BaseException:
                self._release(owner)
                raise
        except MMServeError as e:
            self._in_flight.remove(session_id)
            end_with(context, e, session_id)
            end_request_span(span, error=e)
            return
        log_ids = bind_request(session_id, span)
        question_spans: dict[str, object] = {}
        reader = asyncio.ensure_future(self._read(requests, session, processor, outbox, idle, trace_context,
                                                  question_spans))
        text = _token_texts(processor.tokenizer)
        error: BaseException | None = None
        ended = False
        try:
            yield pb.LiveResponse(opened=pb.LiveOpened(
                session_id=session_id, max_history_frames=options.max_history_frames,
                max_history_s=options.max_history_s, max_tokens_per_frame=options.max_tokens_per_frame,
                max_pending_frames=options.max_pending_frames, stream_fps=options.stream_fps,
                fall_behind=pb.LIVE_FALL_BEHIND_BUFFER if options.fall_behind == "buffer" else pb.LIVE_FALL_BEHIND_DROP))
            while True:
                if self._draining():
                    raise _SessionEnded(EngineUnavailableError(
                        "server is draining (shutting down); open the session on another replica"))
                try:
                    item = await asyncio.wait_for(outbox.get(), DRAIN_POLL_S)
                except TimeoutError:
                    continue
                if isinstance(item, _SessionEnded):
                    raise item
                if item is _END:   # the client half-closed: end once every question is answered
                    if not session.questions_in_flight:
                        ended = True
                        return
                    session.on_idle = lambda: outbox.put_nowait(_END)
                    continue
                if isinstance(item, LiveStats):
                    yield pb.LiveResponse(progress=pb.LiveProgress(
                        frames_received=item.frames_received, frames_prefilled=item.frames_prefilled,
                        frames_dropped=item.frames_dropped, frames_in_context=item.frames_in_context,
                        lag_s=item.lag_s, rollovers=item.rollovers))
                    continue
                qid, out = item
                if isinstance(out, BaseException) or out.finished:
                    _end_question_span(question_spans.pop(qid, None), out)
                for answer in _answers(qid, out, text):
                    yield pb.LiveResponse(answer=answer)
        except _SessionEnded as e:
            error = e.error
            end_with(context, error, session_id)
        finally:
            reader.cancel()
            session.close()
            for qspan in question_spans.values():
                end_request_span(qspan, cancelled=True)
            self._release(owner)
            self._in_flight.remove(session_id)
            span.set_attribute("mmserve.live.frames_received", session.stats.frames_received)
            span.set_attribute("mmserve.live.frames_prefilled", session.stats.frames_prefilled)
            span.set_attribute("mmserve.live.frames_dropped", session.stats.frames_dropped)
            span.set_attribute("mmserve.live.rollovers", session.stats.rollovers)
            end_request_span(span, error=error, cancelled=error is None and not ended)
            unbind_request(log_ids)
            error = None

    async def _read(self, requests, session: LiveSession, processor, outbox: asyncio.Queue, idle: float,
                    trace_context, question_spans: dict) -> None:
        """Feed the session from the client's messages until it half-closes (then `_END`)."""
        try:
            while True:
                message = await _next(requests, idle)
                if message is _END:
                    outbox.put_nowait(_END)
                    return
                kind = message.WhichOneof("kind")
                if kind == "frame":
                    if not message.frame.image:
                        raise InvalidInputError("frame.image", "a frame needs the bytes of an encoded image")
                    if not math.isfinite(message.frame.time_s):
                        raise InvalidInputError("frame.time_s", "must be a finite number of seconds")
                    session.add_frame(message.frame.image,
                                      message.frame.time_s if message.frame.HasField("time_s") else None)
                elif kind == "question":
                    await self._ask(session, message.question, processor, outbox, trace_context, question_spans)
                elif kind == "cancel_question_id":
                    session.cancel_question(message.cancel_question_id)
                elif kind == "stream_chunk":
                    session.add_stream_chunk(message.stream_chunk)
                else:
                    raise InvalidInputError("open", "a Live stream is opened once, by its first message")
        except TimeoutError:
            outbox.put_nowait(_SessionEnded(_idle_error(idle)))
        except MMServeError as e:
            outbox.put_nowait(_SessionEnded(e))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - the stream broke (client gone): end the session
            outbox.put_nowait(_SessionEnded(e))

    async def _ask(self, session: LiveSession, question: pb.LiveQuestion, processor, outbox, trace_context,
                   question_spans: dict) -> None:
        qid = question.question_id or uuid.uuid4().hex[:12]
        try:
            if len(qid) > 128 or not qid.isprintable():
                raise InvalidInputError("question.question_id", "at most 128 printable characters")
            text = _question_text(question.messages)
            sampling = validate_sampling(question.sampling, self._config)
            if sampling.n != 1:
                raise InvalidInputError("question.sampling.n", "a live question has one sample")
            await check_response_format(sampling.response_format, processor, self._config)
            qspan = get_tracer().start_span(QUESTION_SPAN, context=trace_context, attributes={
                "mmserve.live.question_id": qid, "mmserve.live.frames_behind": session.frames_behind})
            try:
                session.ask(qid, text, sampling, join_context=question.join_context,
                            trace_context=trace.set_span_in_context(qspan))
            except BaseException:
                end_request_span(qspan, cancelled=True)
                raise
            question_spans[qid] = qspan
        except MMServeError as e:
            outbox.put_nowait((qid, e))


def _question_text(messages) -> str:
    """A question's text: one user message of text parts, stripped and joined as build_prompt does."""
    if len(messages) != 1 or messages[0].role != "user":
        raise InvalidInputError("question.messages", "a live question is one user message")
    if any(p.WhichOneof("content") != "text" for p in messages[0].parts):
        raise InvalidInputError("question.messages[0]", "a live question takes text parts only; send images as frames")
    text = "".join(p.text.strip() for p in messages[0].parts)
    if not text:
        raise InvalidInputError("question.messages[0]", "the question has no text")
    return text


def _end_question_span(span, out: RequestOutput | BaseException) -> None:
    if span is None:
        return
    if isinstance(out, BaseException):
        end_request_span(span, error=None if isinstance(out, asyncio.CancelledError) else out,
                         cancelled=isinstance(out, asyncio.CancelledError))
        return
    if out.timings is not None and out.timings.time_to_first_token_s is not None:
        span.set_attribute("gen_ai.server.time_to_first_token", out.timings.time_to_first_token_s)
    end_request_span(span)


def _answers(question_id: str, out: RequestOutput | BaseException, text) -> list[pb.LiveAnswer]:
    """What one of a question's outputs sends: its delta, and the Final (or its error) once it ends."""
    if isinstance(out, BaseException):
        if isinstance(out, asyncio.CancelledError):
            error = pb.LiveError(code=grpc.StatusCode.CANCELLED.value[0], message=f"question {question_id} was cancelled")
        else:
            status = map_error(out, question_id)
            error = pb.LiveError(code=status.code.value[0], message=status.message)
        return [pb.LiveAnswer(question_id=question_id, error=error)]
    answers = []
    if out.new_token_ids or out.new_text:
        answers.append(pb.LiveAnswer(question_id=question_id, delta=pb.Delta(
            token_ids=out.new_token_ids, text=out.new_text, logprobs=logprobs_messages(out.new_logprobs or (), text))))
    if out.finished:
        answers.append(pb.LiveAnswer(question_id=question_id, final=final_message(out, text)))
    return answers


async def _next(requests: AsyncIterator, timeout_s: float):
    """The client's next message, `_END` once it half-closed; TimeoutError after `timeout_s` of silence."""
    try:
        return await asyncio.wait_for(anext(requests), timeout_s)
    except StopAsyncIteration:
        return _END


def _idle_error(idle: float) -> BaseException:
    return LimitExceededError(f"the live session sent nothing for {idle:g}s; it was ended", "--live-idle-timeout-s",
                              retryable=True)   # may pass later: a session that keeps sending
