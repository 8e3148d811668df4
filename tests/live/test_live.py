"""Generation.Live against a real server on 127.0.0.1: answers equal a one-shot request's, blocks are
freed however a session ends, bad input gets a status a person can act on, fall-behind policies.

References: a one-shot Generate of the same frames (VideoFrames, same timestamps) and question,
computed without the prefix cache (prompt_logprobs reads nothing from it), so the session's context
cannot lend it K/V; after a roll-over (timestamps no longer start at 0, which VideoFrames cannot say),
the engine-level one-shot path: `build_prompt` of the kept frames as one VideoPart + the question.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import queue
import re
import socket
import sys
import threading
import time
import urllib.request
from fractions import Fraction

import av
import grpc
import numpy as np
import pytest
import torch
from grafana_dashboard import dashboard_metric_names
from loopback_server import LoopbackServer, engine_config
from media_clips import encode
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from mmserve import cli
from mmserve.api import pb, pb_grpc
from mmserve.clients import Client
from mmserve.clients.live_cli import file_frames
from mmserve.config import DEMO_MODEL_DIR, ServerConfig
from mmserve.engine.live_session import MIN_QUESTION_ROOM, LiveOptions, LivePrompt, LiveSession
from mmserve.engine.types import EngineRequest
from mmserve.errors import InvalidInputError, LimitExceededError
from mmserve.ipc import serial
from mmserve.ipc.protocol import AddRequest
from mmserve.model.messages import ChatMessage, TextPart, VideoPart
from mmserve.model.prompt import build_prompt
from mmserve.multimodal.limits import MediaLimits
from mmserve.multimodal.live_stream import FRAME_SLACK_BYTES, READ_BYTES, StreamDecoder
from mmserve.sampling_params import SamplingParams

QUESTION = "What moves?"
FPS = 2.0


@pytest.fixture(scope="module")
def server():
    with socket.socket() as probe:   # a free port for the server's /metrics
        probe.bind(("127.0.0.1", 0))
        metrics_port = probe.getsockname()[1]
    srv = LoopbackServer(engine_config(DEMO_MODEL_DIR, live_idle_timeout_s=5.0, max_image_pixels=64 * 64,
                                       live_max_stream_buffer_bytes=64 * 1024),
                         ServerConfig(port=0, worker_threads=2, metrics_port=metrics_port)).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.GenerationStub(channel)


def png(rng: np.random.Generator, size=(16, 16)) -> bytes:
    out = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


def question(qid: str, *, max_tokens: int = 12, join: bool = False, parts=None,
             prompt_logprobs: bool = False) -> pb.LiveRequest:
    return pb.LiveRequest(question=pb.LiveQuestion(
        question_id=qid, join_context=join,
        messages=[pb.Message(role="user", parts=parts or [pb.Part(text=QUESTION)])],
        sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0, prompt_logprobs=prompt_logprobs)))


class Session:
    """A Live call driven from the test: `send` messages, `until` a response matches."""

    def __init__(self, stub, open_: pb.LiveOpen, *, timeout: float = 120.0, metadata=()):
        self._out: queue.Queue = queue.Queue()
        self._out.put(pb.LiveRequest(open=open_))
        self.call = stub.Live(iter(self._out.get, None), timeout=timeout, metadata=metadata)
        self.progress: pb.LiveProgress | None = None
        self.reports = 0   # LiveProgress messages received
        self.answers: dict[str, list[pb.LiveAnswer]] = {}

    def send(self, *messages: pb.LiveRequest) -> None:
        for m in messages:
            self._out.put(m)

    def close(self) -> None:
        self._out.put(None)

    def until(self, done) -> None:
        for response in self.call:
            kind = response.WhichOneof("kind")
            if kind == "progress":
                self.progress = response.progress
                self.reports += 1
            elif kind == "answer":
                self.answers.setdefault(response.answer.question_id, []).append(response.answer)
            if done(self):
                return
        raise AssertionError("the session ended before the condition held")

    def answered(self, qid: str) -> bool:
        return any(a.WhichOneof("kind") in ("final", "error") for a in self.answers.get(qid, ()))

    def tokens(self, qid: str) -> list[int]:
        return [t for a in self.answers[qid] if a.WhichOneof("kind") == "delta" for t in a.delta.token_ids]

    def final(self, qid: str) -> pb.Final:
        return next(a.final for a in self.answers[qid] if a.WhichOneof("kind") == "final")


def generate_tokens(stub, frames: list[bytes]) -> tuple[list[int], pb.Final]:
    request = pb.GenerateRequest(messages=[pb.Message(role="user", parts=[
        pb.Part(video=pb.Video(frames=pb.VideoFrames(frames=[pb.Image(data=f) for f in frames], fps=FPS))),
        pb.Part(text=QUESTION)])], sampling=pb.SamplingParams(max_tokens=12, temperature=0, prompt_logprobs=True))
    tokens, final = [], None
    for r in stub.Generate(request, timeout=120):
        if r.WhichOneof("kind") == "delta":
            tokens += r.delta.token_ids
        else:
            final = r.final
    return tokens, final


def held(server) -> dict:
    return asyncio.run_coroutine_threadsafe(server.engine.held_resources(), server._loop).result(30)


def wait_all_free(server) -> None:
    deadline = time.monotonic() + 30
    while True:
        h = held(server)
        if not (h["requests"] or h["kv_blocks_held"] or h["front_end_requests"] or h["streams"]
                or h["live_sessions_reserving"] or h["encoded_ahead_bytes"]):
            return
        assert time.monotonic() < deadline, h
        time.sleep(0.05)


@pytest.mark.parametrize("num_frames", [1, 4, 9])
def test_answer_equals_one_shot_generate(server, stub, num_frames):
    rng = np.random.default_rng(1000 + num_frames)
    frames = [png(rng) for _ in range(num_frames)]
    s = Session(stub, pb.LiveOpen())
    s.send(*(pb.LiveRequest(frame=pb.LiveFrame(image=f, time_s=100 + i / FPS)) for i, f in enumerate(frames)))
    s.until(lambda s: s.progress is not None and s.progress.frames_in_context == num_frames)
    s.send(question("q"))
    s.until(lambda s: s.answered("q"))
    s.close()
    list(s.call)
    assert s.call.code() == grpc.StatusCode.OK
    live_final = s.final("q")
    expected, final = generate_tokens(stub, frames)
    assert s.tokens("q") == expected and expected
    assert live_final.usage.prompt_tokens == final.usage.prompt_tokens
    assert list(live_final.videos[0].timestamps_s) == [i / FPS for i in range(num_frames)]
    # the context's blocks served the question: at most the last frame and the question were computed
    tokens_per_frame = final.usage.multimodal_tokens // num_frames
    assert live_final.usage.cached_tokens >= final.usage.prompt_tokens - 2 * tokens_per_frame - 48
    wait_all_free(server)


def test_rollover_answer_equals_one_shot_of_the_kept_frames(server, stub):
    rng = np.random.default_rng(7)
    frames = [png(rng) for _ in range(7)]
    s = Session(stub, pb.LiveOpen(max_history_frames=4))
    s.send(*(pb.LiveRequest(frame=pb.LiveFrame(image=f, time_s=i / FPS)) for i, f in enumerate(frames)))
    # every frame prefilled, or dropped: a rebuild that catches up first ends the old context, and its
    # frames not prefilled by then, which the rebuild does not keep, are dropped
    s.until(lambda s: s.progress is not None and s.progress.frames_prefilled + s.progress.frames_dropped == 7
            and s.progress.rollovers >= 1 and s.progress.frames_in_context > 0)
    s.send(question("q"))
    s.until(lambda s: s.answered("q"))
    s.close()
    list(s.call)
    seen = list(s.final("q").videos[0].timestamps_s)
    assert 0 < len(seen) <= 4 and seen == [i / FPS for i in range(7 - len(seen), 7)], seen
    expected = one_shot_engine(server, frames[7 - len(seen):], seen)
    assert s.tokens("q") == expected and expected
    wait_all_free(server)


def test_a_question_sends_its_context_no_pixels(server, stub, monkeypatch):
    """A question names its context's media (`context_request_id`) instead of carrying them: the bytes
    its AddRequest puts on the engine's socket grow with the context's token ids only, not with its
    frames' pixels; the answer still equals a one-shot Generate of the frames."""
    sent: dict[str, int] = {}
    post = server.engine.client._post

    def record(message):
        if isinstance(message, AddRequest):
            sent[message.request.request_id] = sum(memoryview(f).nbytes for f in serial.encode(message))
        post(message)

    monkeypatch.setattr(server.engine.client, "_post", record)
    rng = np.random.default_rng(29)
    frames = [png(rng) for _ in range(6)]
    s = Session(stub, pb.LiveOpen())
    s.send(pb.LiveRequest(frame=pb.LiveFrame(image=frames[0], time_s=0.0)))
    s.until(lambda s: s.progress is not None and s.progress.frames_in_context == 1)
    s.send(question("one"))
    s.until(lambda s: s.answered("one"))
    s.send(*(pb.LiveRequest(frame=pb.LiveFrame(image=f, time_s=i / FPS)) for i, f in enumerate(frames[1:], 1)))
    s.until(lambda s: s.progress.frames_in_context == 6)
    s.send(question("six"))
    s.until(lambda s: s.answered("six"))
    s.close()
    list(s.call)
    one, six = (next(n for rid, n in sent.items() if rid.endswith("#q-" + q)) for q in ("one", "six"))
    more_tokens = s.final("six").usage.prompt_tokens - s.final("one").usage.prompt_tokens
    pixels = sum(m.pixel_values.nbytes for m in decoded(server, frames[1:]))
    assert six - one <= 8 * more_tokens < pixels, (one, six, more_tokens, pixels)
    expected, _ = generate_tokens(stub, frames)
    assert s.tokens("six") == expected and expected
    wait_all_free(server)


def test_a_live_session_and_a_generate_of_one_key_share_one_owner(server, stub, monkeypatch):
    """The scheduler shares seats fairly by the `owner` each request reaches the engine with
    (core/sched/fair_share.py). A session's context and questions went with none (b""), while the
    same key's Generate carried its caller key: one client held two shares, and callers with no key
    were two owners, not one. Now every request of one key, through either door, has one owner."""
    owners: dict[str, bytes] = {}
    post = server.engine.client._post

    def record(message):
        if isinstance(message, AddRequest):
            owners[message.request.request_id] = message.request.owner
        post(message)

    monkeypatch.setattr(server.engine.client, "_post", record)
    rng = np.random.default_rng(int(torch.randint(0, 2**31, ())))
    for name, metadata in (("keyed", (("authorization", "Bearer one key"),)), ("keyless", ())):
        s = Session(stub, pb.LiveOpen(session_id=f"{name}-live"), timeout=60, metadata=metadata)
        s.send(pb.LiveRequest(frame=pb.LiveFrame(image=png(rng))))
        s.until(lambda s: s.progress is not None and s.progress.frames_prefilled == 1)
        s.send(question("q", max_tokens=2))
        s.until(lambda s: s.answered("q"))
        s.close()
        list(s.call)
        assert s.call.code() == grpc.StatusCode.OK
        list(stub.Generate(pb.GenerateRequest(request_id=f"{name}-generate", sampling=pb.SamplingParams(max_tokens=2),
                                              messages=[pb.Message(role="user", parts=[pb.Part(text="hi")])]),
                           timeout=60, metadata=metadata))
    live = {name: {owners[rid] for rid in owners if rid.startswith(f"{name}-live#")} for name in ("keyed", "keyless")}
    assert len(live["keyed"]) == len(live["keyless"]) == 1, owners   # the context and the question alike
    assert live["keyed"] == {owners["keyed-generate"]} and live["keyless"] == {owners["keyless-generate"]}, owners
    assert owners["keyed-generate"] != owners["keyless-generate"], owners
    assert sum(rid.startswith("keyed-live#") for rid in owners) >= 2, owners   # a context and a question
    wait_all_free(server)


def decoded(server, frames: list[bytes]) -> list:
    processor = server.app._processor

    async def run():
        return [(await processor.process_frame(object(), f, processor.spec.video_max_soft_tokens))[0] for f in frames]

    return asyncio.run_coroutine_threadsafe(run(), server._loop).result(60)


class _HeldRebuilds:
    """The server's engine, but a rebuilt context's progress reaches the session only once `release`
    is set: until then the session answers from the context it rolled over from. `caught_up` is set
    once the engine reported the rebuilt context's first prompt all computed."""

    def __init__(self, engine):
        self._engine, self.release, self.caught_up = engine, asyncio.Event(), asyncio.Event()

    def __getattr__(self, name):
        return getattr(self._engine, name)

    async def generate(self, request):
        held: list | None = [] if request.open_prompt and not request.request_id.endswith("#context-0") else None
        async for out in self._engine.generate(request):
            if held is None:
                yield out
                continue
            held.append(out)
            if out.prefilled_tokens >= len(request.prompt_token_ids):
                self.caught_up.set()
                await self.release.wait()
                for kept in held:
                    yield kept
                held = None


def test_a_question_asked_as_its_context_ends_is_answered_from_the_next(server):
    """The race: a question is asked in the same loop turn as the rebuilt context's progress arrives,
    which ends the context the session answered from. The question must reach the engine before that
    context's end (or be built from the new one): never fail for a context gone. A question that does
    name an ended context fails alone, retryably; one whose ranges are not its context's is refused."""
    processor = server.app._processor
    rng = np.random.default_rng(31)
    frames = [png(rng) for _ in range(3)]

    async def run():
        engine, answers, failures = _HeldRebuilds(server.engine), [], []
        session = LiveSession(engine, processor.tokenizer, processor.spec, "race",
                              LiveOptions(max_history_frames=2, max_tokens_per_frame=processor.spec.video_max_soft_tokens),
                              process_frame=processor.process_frame, emit=answers.append, fail=failures.append,
                              max_model_len=processor.max_model_len)
        try:
            for i, f in enumerate(frames):
                session.add_frame(f, i / FPS)
            async with asyncio.timeout(60):   # frames 0-1 in context 0; frame 2 rolled over into context 1
                while not (session.stats.frames_prefilled == 2 and session.stats.rollovers == 1):
                    await asyncio.sleep(0.01)
                await engine.caught_up.wait()
            engine.release.set()   # context 1's progress is delivered first: it ends context 0
            session.ask("q", QUESTION, SamplingParams(max_tokens=12, temperature=0.0))
            async with asyncio.timeout(60):
                while session.questions_in_flight:
                    await asyncio.sleep(0.01)
            mm, _ = await processor.process_frame(object(), frames[0], 1)
            ended = EngineRequest("race/ended", [1, 2, 3], [(1, 1)], [mm], SamplingParams(max_tokens=1),
                                  context_request_id="race#context-0")
            with pytest.raises(LimitExceededError, match="ended before question race/ended") as gone:
                [out async for out in server.engine.generate(ended)]
            misplaced = EngineRequest("race/misplaced", [1, 2, 3], [(1, 1)], [mm], SamplingParams(max_tokens=1),
                                      context_request_id="race#context-1")   # its frame is not at token 1
            with pytest.raises(InvalidInputError, match="context's first 1"):
                [out async for out in server.engine.generate(misplaced)]
        finally:
            session.close()
        return answers, failures, gone.value.retryable

    answers, failures, retryable = asyncio.run_coroutine_threadsafe(run(), server._loop).result(150)
    assert not failures and retryable
    outs = [out for item in answers if isinstance(item, tuple) for out in [item[1]]]
    assert not [out for out in outs if isinstance(out, BaseException)], outs
    assert [v.timestamps_s for v in outs[-1].videos] == [(2 / FPS,)]
    tokens = [t for out in outs for t in out.new_token_ids]
    assert tokens == one_shot_engine(server, frames[2:], [2 / FPS]) and tokens
    wait_all_free(server)


def one_shot_engine(server, frames: list[bytes], timestamps: list[float]) -> list[int]:
    """The kept frames and the question through build_prompt and the engine, bypassing the prefix cache."""
    return conversation_engine(server, [("user", [(frames, timestamps), QUESTION])])[0]


def conversation_engine(server, turns: list[tuple[str, list]]) -> tuple[list[int], list[int]]:
    """The greedy tokens and the prompt ids of a one-shot prompt of `turns` ((role, parts): a part is
    a text, or (frame images, their timestamps) for a video), through build_prompt and the engine,
    bypassing the prefix cache."""
    processor = server.app._processor

    async def run():
        owner, messages, inputs = object(), [], []
        for role, parts in turns:
            rendered = []
            for part in parts:
                if isinstance(part, str):
                    rendered.append(TextPart(part))
                    continue
                frames, timestamps = part
                decoded = [await processor.process_frame(owner, f, processor.spec.video_max_soft_tokens)
                           for f in frames]
                rendered.append(VideoPart(torch.stack([m.pixel_values for m, _ in decoded]),
                                          torch.stack([m.position_ids for m, _ in decoded]),
                                          [n for _, n in decoded], timestamps))
                inputs += [m for m, _ in decoded]
            messages.append(ChatMessage(role, rendered))
        layout = build_prompt(processor.tokenizer, processor.spec, messages)
        request = EngineRequest("one-shot", layout.token_ids, layout.mm_ranges, inputs,
                                SamplingParams(max_tokens=12, temperature=0.0, prompt_logprobs=True))
        tokens = [t async for out in server.engine.generate(request) for t in out.new_token_ids]
        return tokens, layout.token_ids

    return asyncio.run_coroutine_threadsafe(run(), server._loop).result(120)


def test_max_history_s_rolls_over_to_the_frames_within_it(server, stub):
    """Frames 1 s apart in a 2 s history: each frame past it starts a context of the kept frames within
    2 s of it; the answer equals a one-shot of exactly those frames at their timestamps."""
    rng = np.random.default_rng(17)
    frames = [png(rng) for _ in range(6)]
    s = Session(stub, pb.LiveOpen(max_history_s=2.0))
    s.send(*(pb.LiveRequest(frame=pb.LiveFrame(image=f, time_s=50.0 + i)) for i, f in enumerate(frames)))
    s.until(lambda s: s.progress is not None and s.progress.frames_prefilled + s.progress.frames_dropped == 6
            and s.progress.frames_in_context == 3)
    assert s.progress.rollovers == 3
    s.send(question("q"))
    s.until(lambda s: s.answered("q"))
    s.close()
    list(s.call)
    assert list(s.final("q").videos[0].timestamps_s) == [3.0, 4.0, 5.0]
    expected = one_shot_engine(server, frames[3:], [3.0, 4.0, 5.0])
    assert s.tokens("q") == expected and expected
    wait_all_free(server)


def test_a_joined_question_and_its_answer_join_the_context(server, stub):
    """join_context: the question and its answer become turns of the context, and a frame sent
    meanwhile waits for them and opens the next user turn: a later question's answer equals a one-shot
    of that conversation ([frames 1-2, question] [answer] [frame 3, question])."""
    rng = np.random.default_rng(19)
    frames = [png(rng) for _ in range(3)]
    s = Session(stub, pb.LiveOpen())
    s.send(*(pb.LiveRequest(frame=pb.LiveFrame(image=f, time_s=i / FPS)) for i, f in enumerate(frames[:2])))
    s.until(lambda s: s.progress is not None and s.progress.frames_in_context == 2)
    s.send(question("joined", join=True), pb.LiveRequest(frame=pb.LiveFrame(image=frames[2], time_s=2 / FPS)))
    s.until(lambda s: s.answered("joined") and s.progress.frames_in_context == 3)
    answer = "".join(a.delta.text for a in s.answers["joined"] if a.WhichOneof("kind") == "delta")
    s.send(question("after", prompt_logprobs=True))
    s.until(lambda s: s.answered("after"))
    s.close()
    list(s.call)
    final = s.final("after")
    assert list(final.videos[0].timestamps_s) == [0.0, 0.5, 1.0]
    expected, prompt = conversation_engine(server, [("user", [(frames[:2], [0.0, 0.5]), QUESTION]),
                                                    ("assistant", [answer]), ("user", [(frames[2:], [1.0]), QUESTION])])
    assert [lp.token_id for lp in final.prompt_logprobs] == prompt[1:] and answer.strip()
    assert s.tokens("after") == expected and expected
    wait_all_free(server)


def test_blocks_are_free_after_cancel_and_a_vanished_client(server, stub):
    rng = np.random.default_rng(11)
    s = Session(stub, pb.LiveOpen())
    s.send(*(pb.LiveRequest(frame=pb.LiveFrame(image=png(rng))) for _ in range(3)))
    s.until(lambda s: s.progress is not None and s.progress.frames_prefilled == 3)
    s.send(question("long", max_tokens=200))
    s.until(lambda s: "long" in s.answers)
    assert held(server)["kv_blocks_held"]
    s.call.cancel()   # the client cancels mid-answer
    wait_all_free(server)

    with Client(server.address) as client:   # a client that vanishes: its channel closes mid-session
        call = client.live(pb.LiveOpen(), timeout=60)
        call.frame(png(rng), 0.0)
        call.frame(png(rng), 0.5)
        for response in call:
            if response.WhichOneof("kind") == "progress" and response.progress.frames_prefilled == 2:
                break
    wait_all_free(server)


def test_abort_by_session_id_ends_the_session_cancelled_for_its_key_only(server, stub):
    """Abort of a live session's id ends the session (CANCELLED, its blocks freed, a question in
    flight with it). It used to say found and end nothing: the session has no engine request of
    its own id, and the Abort aborted that absent one."""
    rng = np.random.default_rng(int(torch.randint(0, 2**31, ())))
    s = Session(stub, pb.LiveOpen(session_id="aborted-live"), timeout=60)
    s.send(*(pb.LiveRequest(frame=pb.LiveFrame(image=png(rng))) for _ in range(2)))
    s.until(lambda s: s.progress is not None and s.progress.frames_prefilled == 2)
    s.send(question("long", max_tokens=200))
    s.until(lambda s: "long" in s.answers)
    other = (("authorization", "Bearer another key"),)
    assert not stub.Abort(pb.AbortRequest(request_id="aborted-live"), metadata=other).found
    assert stub.Abort(pb.AbortRequest(request_id="aborted-live")).found
    with pytest.raises(grpc.RpcError) as ended:
        s.until(lambda s: False)
    assert ended.value.code() == grpc.StatusCode.CANCELLED and "aborted-live" in ended.value.details()
    wait_all_free(server)
    assert not stub.Abort(pb.AbortRequest(request_id="aborted-live")).found


def test_another_key_cannot_name_or_abort_a_sessions_requests(server, stub):
    """A session's contexts and questions run under ids derived from its own ("victim#context-0"),
    which no client id may hold. When they were "victim/context-0", another key's Generate of that
    name, aborted while its video decoded (before the engine had it), aborted the session's context."""
    rng = np.random.default_rng(int(torch.randint(0, 2**31, ())))
    s = Session(stub, pb.LiveOpen(session_id="victim"), timeout=60)
    s.send(*(pb.LiveRequest(frame=pb.LiveFrame(image=png(rng))) for _ in range(2)))
    s.until(lambda s: s.progress is not None and s.progress.frames_prefilled == 2)
    video = encode([rng.integers(0, 255, (64, 64, 3), dtype=np.uint8) for _ in range(60)], fps=30.0)
    other = (("authorization", "Bearer another key"),)

    def generate(request_id: str):
        return stub.Generate(pb.GenerateRequest(request_id=request_id, sampling=pb.SamplingParams(max_tokens=2),
                                                messages=[pb.Message(role="user", parts=[
                                                    pb.Part(video=pb.Video(data=video, num_frames=8)),
                                                    pb.Part(text="hi")])]), timeout=60, metadata=other)

    with pytest.raises(grpc.RpcError) as refused:
        list(generate("victim#context-0"))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'#'" in refused.value.details()
    assert not stub.Abort(pb.AbortRequest(request_id="victim#context-0"), metadata=other).found
    for _ in range(20):   # the old name: its own request now, aborted mid-decode (retried until the abort lands)
        call = generate("victim/context-0")
        found = any(stub.Abort(pb.AbortRequest(request_id="victim/context-0"), metadata=other).found
                    for _ in range(50))
        with contextlib.suppress(grpc.RpcError):   # CANCELLED once aborted
            list(call)
        if found:
            break
    assert found
    s.send(question("q", max_tokens=3))
    s.until(lambda s: s.answered("q"))
    assert s.answers["q"][-1].WhichOneof("kind") == "final", s.answers["q"][-1]
    s.close()
    list(s.call)
    assert s.call.code() == grpc.StatusCode.OK
    wait_all_free(server)


def test_a_bad_question_fails_alone_and_bad_sessions_get_clear_statuses(server, stub):
    rng = np.random.default_rng(3)
    s = Session(stub, pb.LiveOpen())
    s.send(pb.LiveRequest(frame=pb.LiveFrame(image=png(rng))),
           question("img", parts=[pb.Part(image=pb.Image(data=png(rng)))]), question("ok"))
    s.until(lambda s: s.answered("img") and s.answered("ok"))
    error = s.answers["img"][-1].error
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] and "text parts only" in error.message
    assert s.final("ok").finish_reason != pb.FINISH_REASON_UNSPECIFIED
    s.send(pb.LiveRequest(frame=pb.LiveFrame(image=b"not an image")))
    with pytest.raises(grpc.RpcError) as e:
        s.until(lambda s: False)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "frame.image" in e.value.details()

    for first, words in ((pb.LiveRequest(frame=pb.LiveFrame(image=png(rng))), "first message"),
                         (pb.LiveRequest(open=pb.LiveOpen(max_history_frames=10_000)), "max_history_frames"),
                         (pb.LiveRequest(open=pb.LiveOpen(max_tokens_per_frame=17)), "max_tokens_per_frame")):
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Live(iter([first]), timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details(), e.value.details()
    wait_all_free(server)


def test_frame_times_that_are_not_finite_end_the_session_naming_frame_time_s(server, stub, monkeypatch):
    """A NaN or infinite capture time, or one whose distance from the first frame's overflows, is
    INVALID_ARGUMENT naming frame.time_s at once. Before, NaN passed the never-decreasing check and the
    prompt's timestamp text raised in a decode's done-callback, where the loop only logged it: the frame
    waited forever and the session ended at its idle timeout (RESOURCE_EXHAUSTED). A failure there now
    ends the session with a status of its own."""
    rng = np.random.default_rng(int(np.random.randint(1000)))
    for times in ([float("nan")], [0.0, float("nan")], [float("inf")], [0.0, float("-inf")], [-1e308, 1e308]):
        s = Session(stub, pb.LiveOpen(), timeout=60)
        s.send(*(pb.LiveRequest(frame=pb.LiveFrame(image=png(rng), time_s=t)) for t in times))
        with pytest.raises(grpc.RpcError) as e:
            s.until(lambda s: False)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (times, e.value.details())
        assert e.value.details().startswith("frame.time_s: ") and "finite" in e.value.details(), e.value.details()

    def broken(*args):
        raise RuntimeError("a bug while rendering a frame")

    monkeypatch.setattr(LivePrompt, "frame", broken)
    s = Session(stub, pb.LiveOpen(), timeout=60)
    s.send(pb.LiveRequest(frame=pb.LiveFrame(image=png(rng))))
    with pytest.raises(grpc.RpcError) as e:
        s.until(lambda s: False)
    assert e.value.code() == grpc.StatusCode.INTERNAL, e.value.details()
    wait_all_free(server)


def test_fall_behind_policies(server, stub):
    """BUFFER refuses past max_pending_frames with RESOURCE_EXHAUSTED; DROP drops the oldest and goes on.
    A bystander Generate is served meanwhile (its latency is the benchmark's to measure)."""
    rng = np.random.default_rng(5)
    burst = [png(rng) for _ in range(12)]
    s = Session(stub, pb.LiveOpen(fall_behind=pb.LIVE_FALL_BEHIND_BUFFER, max_pending_frames=2))
    s.send(*(pb.LiveRequest(frame=pb.LiveFrame(image=f)) for f in burst))
    with pytest.raises(grpc.RpcError) as e:
        s.until(lambda s: False)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_pending_frames" in e.value.details()

    s = Session(stub, pb.LiveOpen(fall_behind=pb.LIVE_FALL_BEHIND_DROP, max_pending_frames=2))
    s.send(*(pb.LiveRequest(frame=pb.LiveFrame(image=f)) for f in burst))
    bystander, _ = generate_tokens(stub, burst[:2])
    s.until(lambda s: s.progress is not None
            and s.progress.frames_prefilled + s.progress.frames_dropped == len(burst))
    assert s.progress.frames_dropped > 0 and bystander
    s.close()
    list(s.call)
    assert s.call.code() == grpc.StatusCode.OK
    wait_all_free(server)


def test_a_history_is_sized_exactly_as_build_prompt_renders_it(server, stub):
    """The most frames a session may keep is the most whose one-shot prompt (build_prompt: the system
    turn, a video of that many frames at the per-frame budget) leaves MIN_QUESTION_ROOM tokens of the
    context; that many open, one more is refused naming it."""
    processor = server.app._processor
    tok, spec, context = processor.tokenizer, processor.spec, processor.max_model_len
    system = " ".join(["Watch the shapes and say which way each one moves."] * 8)
    per_frame = spec.video_max_soft_tokens
    closing = len(LivePrompt(tok, spec).question("", ""))

    def history(n: int) -> int:   # the one-shot prompt of n frames, before the question
        part = VideoPart(torch.zeros(n, 1, 1), torch.zeros(n, 1, 2), [per_frame] * n, [i / FPS for i in range(n)])
        return len(build_prompt(tok, spec, [ChatMessage("system", [TextPart(system)]),
                                            ChatMessage("user", [part])]).token_ids) - closing

    fit = max(n for n in range(1, 64) if history(n) + MIN_QUESTION_ROOM <= context)
    assert fit < 32   # the server's --live-max-history-frames: the context is what bounds it here
    opened = next(iter(stub.Live(iter([pb.LiveRequest(open=pb.LiveOpen(system_prompt=system, max_history_frames=fit))]),
                                 timeout=60)))
    assert opened.opened.max_history_frames == fit
    with pytest.raises(grpc.RpcError) as e:
        list(stub.Live(iter([pb.LiveRequest(open=pb.LiveOpen(system_prompt=system, max_history_frames=fit + 1))]),
                       timeout=60))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"keep at most {fit} frames" in e.value.details(), e.value.details()
    wait_all_free(server)


def scrape(server) -> dict[str, float]:
    """The server's /metrics, parsed by prometheus_client: sample name -> value (label-free samples)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.observability.metrics_port}/metrics", timeout=10)
    return {sample.name: sample.value for family in text_string_to_metric_families(text.read().decode())
            for sample in family.samples if not sample.labels}


def test_live_metrics_count_what_the_session_reports(server, stub):
    """Prometheus' live metrics move by exactly what the session's own LiveProgress reports: sessions
    open, frames prefilled and dropped (DROP), one lag observation per progress report; and every live
    metric the Grafana dashboard's panels read is exported."""
    rng = np.random.default_rng(13)
    before = scrape(server)
    s = Session(stub, pb.LiveOpen(fall_behind=pb.LIVE_FALL_BEHIND_DROP, max_pending_frames=2))
    s.send(*(pb.LiveRequest(frame=pb.LiveFrame(image=png(rng))) for _ in range(10)))
    s.until(lambda s: s.progress is not None and s.progress.frames_prefilled + s.progress.frames_dropped == 10)
    during = scrape(server)
    s.close()
    reports = s.reports + sum(r.WhichOneof("kind") == "progress" for r in s.call)
    deadline = time.monotonic() + 10
    while (after := scrape(server))["mmserve_live_sessions"] != before.get("mmserve_live_sessions", 0):
        assert time.monotonic() < deadline, after["mmserve_live_sessions"]
        time.sleep(0.05)

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert during["mmserve_live_sessions"] == before.get("mmserve_live_sessions", 0) + 1
    assert s.progress.frames_dropped > 0
    assert delta("mmserve_live_frames_prefilled_total") == s.progress.frames_prefilled
    assert delta("mmserve_live_frames_dropped_total") == s.progress.frames_dropped
    assert delta("mmserve_live_lag_seconds_count") == reports
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.observability.metrics_port}/metrics", timeout=10)
    exported = {sample.name for family in text_string_to_metric_families(text.read().decode()) for sample in family.samples}
    panels = {name for name in dashboard_metric_names() if name.startswith("mmserve_live_")}
    assert len(panels) >= 4 and panels <= exported, panels - exported
    wait_all_free(server)


def live_stream(frames: list[np.ndarray], fps: float, container: str) -> bytes:
    """`frames` encoded as a live encoder sends them: x264 without frame reordering or lookahead, in
    MPEG-TS or fragmented MP4 (a fragment per keyframe, every 4 frames)."""
    out = io.BytesIO()
    fmt, options = {"mpegts": ("mpegts", {}),
                    "fmp4": ("mp4", {"movflags": "frag_keyframe+empty_moov+default_base_moof"})}[container]
    with av.open(out, "w", format=fmt, options=options) as box:
        stream = box.add_stream("libx264", rate=Fraction(fps).limit_denominator(1000),
                                options={"tune": "zerolatency", "preset": "ultrafast", "crf": "18"})
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = "yuv420p"
        stream.codec_context.gop_size = 4
        for frame in frames:
            box.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        box.mux(stream.encode())
    return out.getvalue()


@pytest.mark.parametrize("container", ["mpegts", "fmp4"])
def test_stream_chunks_answer_as_a_one_shot_of_the_same_file(server, stub, container):
    """A PyAV-encoded stream sent in random chunks: frames are decoded as they complete, sampled at
    stream_fps by presentation time, and a question's answer equals a one-shot Generate of the whole
    file sampled at that rate over the frames the question saw (same tokens, same timestamps)."""
    rng = np.random.default_rng({"mpegts": 21, "fmp4": 22}[container])
    frames = [rng.integers(0, 255, (24, 32, 3), dtype=np.uint8) for _ in range(12)]
    data = live_stream(frames, 16.0, container)
    cuts = sorted(set(rng.integers(1, len(data), 12).tolist()))
    chunks = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    s = Session(stub, pb.LiveOpen(stream_fps=8))
    s.send(*(pb.LiveRequest(stream_chunk=c) for c in chunks))
    # every sampled frame but (MPEG-TS) the last, whose packet ends only when the next one starts
    s.until(lambda s: s.progress is not None and s.progress.frames_in_context >= 5)
    s.send(question("q"))
    s.until(lambda s: s.answered("q"))
    s.close()
    list(s.call)
    assert s.call.code() == grpc.StatusCode.OK
    seen = list(s.final("q").videos[0].timestamps_s)
    assert seen == [i / 8 for i in range(len(seen))], seen   # every other frame of the 16 fps stream

    request = pb.GenerateRequest(messages=[pb.Message(role="user", parts=[
        pb.Part(video=pb.Video(data=data, fps=8, end_s=len(seen) / 8)), pb.Part(text=QUESTION)])],
        sampling=pb.SamplingParams(max_tokens=12, temperature=0, prompt_logprobs=True))
    expected, final = [], None
    for r in stub.Generate(request, timeout=120):
        if r.WhichOneof("kind") == "delta":
            expected += r.delta.token_ids
        else:
            final = r.final
    assert list(final.videos[0].timestamps_s) == seen
    assert s.tokens("q") == expected and expected
    wait_all_free(server)


def test_bad_streams_end_the_session_with_a_clear_status(server, stub):
    """What is not a stream we read, frames over --max-image-pixels (checked from the stream's declared
    size, before decoding), more bytes waiting than --live-max-stream-buffer-bytes, a stream whose clock
    goes back (a second stream after the first, as after an encoder restart: its frames were skipped
    until the clock caught up, so a short one was never seen and the session ended at its idle timeout),
    and a stream after images: each ends its session with a status that names the cause."""
    rng = np.random.default_rng(23)
    big = [rng.integers(0, 255, (80, 96, 3), dtype=np.uint8)] * 4   # 7680 pixels, over the module's 4096
    first, second = (live_stream([rng.integers(0, 255, (24, 32, 3), dtype=np.uint8) for _ in range(6)], 4.0,
                                 "mpegts") for _ in range(2))   # 1.25 s each: the second goes back > 1 s
    cases = [([b"\x00" * 600], grpc.StatusCode.INVALID_ARGUMENT, "MPEG-TS or fragmented MP4"),
             ([png(rng)], grpc.StatusCode.INVALID_ARGUMENT, "MPEG-TS or fragmented MP4"),
             ([live_stream(big, 8.0, "mpegts")], grpc.StatusCode.INVALID_ARGUMENT, "--max-image-pixels"),
             ([live_stream(big[:1], 8.0, "fmp4")[:700], bytes(70_000)], grpc.StatusCode.RESOURCE_EXHAUSTED,
              "--live-max-stream-buffer-bytes"),
             ([first, second], grpc.StatusCode.INVALID_ARGUMENT, "stream_chunk: the stream's clock went back")]
    for chunks, code, words in cases:
        s = Session(stub, pb.LiveOpen())
        s.send(*(pb.LiveRequest(stream_chunk=c) for c in chunks))
        with pytest.raises(grpc.RpcError) as e:
            s.until(lambda s: False)
        assert e.value.code() == code and words in e.value.details(), e.value.details()
    s = Session(stub, pb.LiveOpen())   # images, then a stream
    s.send(pb.LiveRequest(frame=pb.LiveFrame(image=png(rng))), pb.LiveRequest(stream_chunk=b"\x47" * 10))
    with pytest.raises(grpc.RpcError) as e:
        s.until(lambda s: False)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "come as images" in e.value.details()
    wait_all_free(server)
    deadline = time.monotonic() + 10   # and no stream's decoding thread outlives its session
    while any(t.name == "mmserve-live-stream" for t in threading.enumerate()):
        assert time.monotonic() < deadline, [t.name for t in threading.enumerate()]
        time.sleep(0.05)


@pytest.mark.parametrize("container", ["mpegts", "fmp4"])
def test_garbage_after_a_valid_stream_fails_it_within_a_frames_bytes(container):
    """Random bytes after half of a valid stream: the frames before them decode, then the stream fails
    with INVALID_ARGUMENT: FFmpeg's own error where it takes the garbage for packet data, else once one
    frame's worth of bytes (3 a pixel, plus the slack for other packets) went by without a frame.
    Before that bound the demuxers skipped garbage without end (MPEG-TS hunts for its next sync byte)
    and the session ended only at its idle timeout."""
    rng = np.random.default_rng({"mpegts": 24, "fmp4": 25}[container])
    data = live_stream([rng.integers(0, 255, (24, 32, 3), dtype=np.uint8) for _ in range(8)], 8.0, container)
    frames, failed = [], queue.Queue()
    decoder = StreamDecoder(fps=0, limits=MediaLimits(), max_buffered_bytes=8 << 20,
                            on_frame=lambda rgb, t: frames.append(t), on_error=failed.put)
    try:
        decoder.feed(data[:len(data) // 2])
        for _ in range(32):   # as a sender's chunks come; 4x the slack: a random PES may end a valid one late
            decoder.feed(rng.integers(0, 256, FRAME_SLACK_BYTES // 8, dtype=np.uint8).tobytes())
        error = failed.get(timeout=60)
    finally:
        decoder.close()
    assert isinstance(error, InvalidInputError) and str(error).startswith("stream_chunk: "), error
    assert frames and frames == sorted(frames), frames
    if skipped := re.search(r"(\d+) bytes of the stream after its last frame held none", str(error)):
        assert FRAME_SLACK_BYTES <= int(skipped.group(1)) <= 3 * 24 * 32 + FRAME_SLACK_BYTES + 2 * READ_BYTES, error


ANSWER_LINE = re.compile(r"^\[([\d.]+) s, (\d+) frames seen\] (.*) -> (.*)$")


def test_demo_live_answers_follow_the_motion(server, capsys):
    """`mmserve demo-live`, the smoke `make test` runs: the answer after the first leg names the shape's
    direction, the answer after the turn its reverse (the truths come from the clip's motions; seed
    1000010 is one of the 18 of 20 held-out seeds the demo model gets both right)."""
    assert cli.main(["demo-live", "--server", server.address, "--seed", "1000010"]) == 0
    out = capsys.readouterr().out
    truths = [line for line in out.splitlines() if "truth:" in line]
    assert len(truths) == 2 and all(line.endswith("MATCH") for line in truths), out
    first, second = (line.split("truth:")[1].split()[-2] for line in truths)
    assert (first, second) in (("left", "right"), ("right", "left"), ("up", "down"), ("down", "up")), out
    wait_all_free(server)


def test_live_cli_streams_a_file_and_answers_as_a_one_shot_of_the_frames_sent(server, stub, tmp_path, capsys):
    """`mmserve live FILE --ask ...`: the file's frames at 8 fps, paced in real time; the printed answer
    equals a one-shot Generate of the frames it saw (the CLI's own JPEGs as VideoFrames at 8 fps)."""
    rng = np.random.default_rng(31)
    path = tmp_path / "clip.mp4"
    path.write_bytes(encode([rng.integers(0, 255, (24, 32, 3), dtype=np.uint8) for _ in range(10)], fps=16.0))
    code = cli.main(["live", str(path), "--server", server.address, "--fps", "8", "--max-tokens", "12",
                     "--ask", f"5:{QUESTION}"])   # after the clip's end: asked once every frame is prefilled
    out = capsys.readouterr().out
    assert code == 0, out
    (answer,) = [m for line in out.splitlines() if (m := ANSWER_LINE.match(line))]
    frames = [jpeg for _, jpeg in file_frames(path, 8.0)]
    assert int(answer.group(2)) == len(frames) == 5, out
    request = pb.GenerateRequest(messages=[pb.Message(role="user", parts=[
        pb.Part(video=pb.Video(frames=pb.VideoFrames(frames=[pb.Image(data=f) for f in frames], fps=8))),
        pb.Part(text=QUESTION)])], sampling=pb.SamplingParams(max_tokens=12, temperature=0, prompt_logprobs=True))
    expected = "".join(r.delta.text for r in stub.Generate(request, timeout=120) if r.WhichOneof("kind") == "delta")
    assert answer.group(3) == QUESTION and answer.group(4) == expected.strip() and expected.strip()
    wait_all_free(server)


def test_live_cli_forwards_stdin_as_an_encoded_stream(server, monkeypatch, capsys, tmp_path):
    rng = np.random.default_rng(32)
    data = live_stream([rng.integers(0, 255, (24, 32, 3), dtype=np.uint8) for _ in range(8)], 8.0, "mpegts")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BufferedReader(io.BytesIO(data))))
    assert cli.main(["live", "-", "--server", server.address, "--ask", f"0:{QUESTION}", "--max-tokens", "4"]) == 0
    (answer,) = [m for line in capsys.readouterr().out.splitlines() if (m := ANSWER_LINE.match(line))]
    assert answer.group(3) == QUESTION and answer.group(4)
    assert cli.main(["live", str(tmp_path / "missing.mp4"), "--server", server.address]) == 2
    wait_all_free(server)
