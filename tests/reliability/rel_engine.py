"""A real MMServer + AsyncEngine on loopback, in its own thread and event loop, with a recording
observer, plus the "nothing leaked" check: every admitted request ended exactly once in the engine
and every KV block, encoder-cache entry and stream is released."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path

import loopback_server
from loopback_server import LoopbackServer, RecordingObserver

from mmserve.config import EngineConfig


def engine_config(model: Path, **overrides) -> EngineConfig:
    """The shared test options with room for this suite's concurrency and cheap 2-frame videos."""
    return loopback_server.engine_config(model, **{"max_num_seqs": 16, "default_num_frames": 2, **overrides})


@dataclass
class ServerThread(LoopbackServer):
    """A loopback server whose engine reports to a RecordingObserver, with the leak checks."""

    observer: RecordingObserver = field(default_factory=RecordingObserver)

    def leaks(self) -> list[str]:
        """What is still held, on both sides of the engine process boundary: requests, KV blocks,
        streams, gated calls; an encoder cache over its bound."""
        found = []
        ends = self.observer.end_counts()
        if set(ends) != set(self.observer.queued):
            found.append(f"queued but never ended: {sorted(set(self.observer.queued) - set(ends))}")
        found += [f"ended {n} times: {rid}" for rid, n in ends.items() if n > 1]
        held = self.call(self.engine.held_resources())
        if held["requests"] or held["front_end_requests"]:
            found.append(f"engine still holds {held['requests']}, front end {held['front_end_requests']}")
        if held["running"] or held["waiting"]:
            found.append(f"scheduler still holds {held['running']} running, {held['waiting']} waiting")
        # Free means empty or cached-unreferenced: the prefix and encoder caches outlive requests.
        found += [f"pool {name}: {n} blocks held" for name, n in held["kv_blocks_held"].items()]
        if held["encoded_ahead_bytes"]:
            found.append(f"{held['encoded_ahead_bytes']} bytes of embeddings encoded ahead still held")
        if held["live_sessions_reserving"]:
            found.append(f"live sessions still reserve KV blocks: {held['live_sessions_reserving']}")
        if held["encoder_cache_over_bytes"]:
            found.append(f"encoder cache is {held['encoder_cache_over_bytes']} bytes over its bound")
        if held["streams"]:
            found.append(f"open engine streams {held['streams']}")
        if self.app.gate.inflight:
            found.append(f"{self.app.gate.inflight} Generate calls still in flight")
        return found

    def wait_quiet(self, timeout_s: float = 30.0) -> list[str]:
        """Poll until nothing is held (the engine thread and handlers finish a moment after the
        client sees the end); returns what is still held at the timeout."""
        deadline = time.monotonic() + timeout_s
        while (found := self.leaks()) and time.monotonic() < deadline:
            time.sleep(0.02)
        return found

    def assert_nothing_leaked(self) -> None:
        """Every queued request ended exactly once; every pool, cache and stream is empty."""
        found = self.wait_quiet()
        assert not found, "; ".join(found)


@dataclass
class StreamResult:
    """What a client saw on one Generate stream."""

    token_ids: list[int] = field(default_factory=list)
    final: object = None
    code: object = None      # grpc.StatusCode when it ended with an error status
    details: str = ""
    trailers: tuple = ()


async def read_stream(call, result: StreamResult | None = None) -> StreamResult:
    """Read `call` to its end with `read()` (continuing `result` if given) without raising."""
    import grpc

    result = result or StreamResult()
    try:
        while (response := await call.read()) is not grpc.aio.EOF:
            if response.HasField("final"):
                result.final = response.final
            else:
                result.token_ids += list(response.delta.token_ids)
    except grpc.aio.AioRpcError as e:
        result.code, result.details, result.trailers = e.code(), e.details() or "", tuple(e.trailing_metadata() or ())
    return result


def steps_with(observer: RecordingObserver, request_id: str, after_perf: float) -> int:
    """How many engine steps that started after `after_perf` (time.perf_counter) ran `request_id`."""
    return sum(1 for step in list(observer.steps) if step.start_perf > after_perf
               and any(item.request_id == request_id for item in step.items))


def text_request(request_id: str, max_tokens: int, text: str = "go on"):
    """A text-only GenerateRequest that runs exactly `max_tokens` steps of decode (EOS ignored)."""
    from mmserve.api.mmserve.v1 import generation_pb2 as pb

    return pb.GenerateRequest(request_id=request_id, messages=[pb.Message(role="user", parts=[pb.Part(text=text)])],
                              sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))


async def wait_load(stub, *, running: int, waiting: int, timeout_s: float = 20, metadata=()) -> None:
    """Poll GetServerLoad (with `metadata`: an API key) until the engine has exactly `running`
    running and `waiting` waiting requests."""
    from mmserve.api.mmserve.v1 import generation_pb2 as pb

    deadline = time.monotonic() + timeout_s
    while True:
        load = await stub.GetServerLoad(pb.GetServerLoadRequest(), metadata=metadata)
        if (load.running_requests, load.waiting_requests) == (running, waiting):
            return
        assert time.monotonic() < deadline, f"load stuck at {load}"
        await asyncio.sleep(0.01)
