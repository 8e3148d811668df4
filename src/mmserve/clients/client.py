"""`Client` (blocking) and `AsyncClient` (asyncio) for the mmserve.v1 Generation API.

Both speak the same protocol the same way: one server-streaming Generate per request, deltas
then exactly one Final. `generate()` collects the stream into a `GenerateResult`; `stream()`
yields `Delta`s and exposes the result once the stream ends. A target may name several servers
(`ipv4:10.0.0.1:50051,10.0.0.2:50051` or `dns:///svc:50051`); calls are spread round-robin,
except uploads (`upload()`) and the requests naming uploaded media, which stay on one replica,
where the media are.
"""

from __future__ import annotations

import asyncio
import json
import queue
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from mmserve.api import pb, pb_grpc
from mmserve.clients.messages import message, text_part, user_message
from mmserve.clients.types import ClientError, Delta, GenerateResult, MediaRef, logprobs_from, result_from
from mmserve.clients.upload import (
    CHUNK_BYTES,
    UploadSource,
    local_media,
    lost_media,
    media_ref,
    names_uploaded_media,
    opened,
    progress_bar,
    upload_requests,
    upload_requests_async,
    upload_source,
)

DEFAULT_MAX_MESSAGE_BYTES = 64 * 2**20
Metadata = tuple[tuple[str, str], ...]


ROUND_ROBIN = {"round_robin": {}}
# One replica per client, picked at random among the resolved addresses: uploaded media live on
# the replica that received them, so an upload and the requests naming it must meet there.
STICKY = {"pick_first": {"shuffleAddressList": True}}


def channel_options(max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                    balancing: dict = ROUND_ROBIN) -> list[tuple[str, object]]:
    """Round-robin over every resolved address (unless `balancing` says otherwise); message limits
    matching the server's default; a keepalive ping each minute (the server allows one every 10 s) so
    a dead peer is noticed mid-stream."""
    service_config = {"loadBalancingConfig": [balancing]}
    return [
        ("grpc.service_config", json.dumps(service_config)),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.keepalive_timeout_ms", 20_000),
    ]


def channel_credentials(root_certificates: bytes | None, private_key: bytes | None,
                        certificate_chain: bytes | None) -> grpc.ChannelCredentials:
    return grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)


def build_request(messages: Sequence[pb.Message] | None = None, *, prompt: str | None = None,
                  video: bytes | MediaRef | None = None, image: bytes | MediaRef | None = None,
                  audio: bytes | MediaRef | None = None, use_audio_in_video: bool = False,
                  system: str | None = None, start_s: float = 0.0, end_s: float = 0.0, max_tokens: int = 0,
                  temperature: float | None = None, top_p: float | None = None, top_k: int = 0,
                  seed: int | None = None, stop: Sequence[str] = (), ignore_eos: bool = False,
                  request_id: str = "", priority: int = 0, num_frames: int = 0,
                  fps: float = 0.0, logprobs: bool = False, top_logprobs: int = 0, prompt_logprobs: bool = False,
                  presence_penalty: float = 0.0, frequency_penalty: float = 0.0,
                  repetition_penalty: float | None = None, min_tokens: int = 0,
                  logit_bias: Mapping[int, float] | None = None, json_schema: str | Mapping | None = None,
                  regex: str | None = None, grammar: str | None = None, n: int = 0,
                  disable_speculation: bool = False) -> pb.GenerateRequest:
    """Either explicit `messages`, or one user turn from prompt/video/image/audio (after a `system`
    turn, when given; start_s/end_s: the video's window). `use_audio_in_video`: the model also hears
    each video's soundtrack. At most one of `json_schema` (a dict or JSON text), `regex` and
    `grammar` (EBNF) constrains the output."""
    if messages is None:
        messages = [user_message(prompt, video=video, image=image, audio=audio, num_frames=num_frames, fps=fps,
                                 start_s=start_s, end_s=end_s)]
        if system is not None:
            messages.insert(0, message("system", text_part(system)))
    elif prompt is not None or video is not None or image is not None or audio is not None or system is not None:
        raise ValueError("pass either messages or prompt/video/image/audio/system, not both")
    sampling = pb.SamplingParams(max_tokens=max_tokens, top_k=top_k, stop=list(stop), ignore_eos=ignore_eos,
                                 logprobs=logprobs, top_logprobs=top_logprobs, prompt_logprobs=prompt_logprobs,
                                 presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
                                 min_tokens=min_tokens, logit_bias=dict(logit_bias or {}), n=n,
                                 disable_speculation=disable_speculation)
    formats = {k: v for k, v in (("json_schema", json_schema), ("regex", regex), ("grammar", grammar)) if v is not None}
    if len(formats) > 1:
        raise ValueError(f"pass at most one of json_schema, regex and grammar, not {sorted(formats)}")
    for kind, spec in formats.items():
        setattr(sampling.response_format, kind, spec if isinstance(spec, str) else json.dumps(spec))
    if repetition_penalty is not None:
        sampling.repetition_penalty = repetition_penalty
    if temperature is not None:
        sampling.temperature = temperature
    if top_p is not None:
        sampling.top_p = top_p
    if seed is not None:
        sampling.seed = seed
    return pb.GenerateRequest(request_id=request_id, messages=list(messages), sampling=sampling, priority=priority,
                              use_audio_in_video=use_audio_in_video)


class _Collector:
    """Turns GenerateResponse messages into deltas and remembers the Final."""

    def __init__(self) -> None:
        self.request_id = ""
        self.deltas: list[Delta] = []
        self.result: GenerateResult | None = None

    def feed(self, response: pb.GenerateResponse) -> Delta | None:
        self.request_id = response.request_id or self.request_id
        kind = response.WhichOneof("kind")
        if kind == "delta":
            d = response.delta
            delta = Delta(d.text, tuple(d.token_ids), logprobs_from(d.logprobs), d.index)
            self.deltas.append(delta)
            return delta
        if kind == "final":
            self.result = result_from(self.request_id, self.deltas, response.final)
        return None

    def finish(self) -> GenerateResult:
        if self.result is None:
            raise ClientError(grpc.StatusCode.UNKNOWN, "stream ended without a final message")
        return self.result


class _Base:
    """What the blocking and asyncio clients share: the channel, stubs, credentials and metadata.
    `_channels` is the grpc module whose channels the subclass uses (grpc or grpc.aio)."""

    _channels = grpc

    def __init__(self, target: str, *, api_key: str | None = None, root_certificates: bytes | None = None,
                 private_key: bytes | None = None, certificate_chain: bytes | None = None,
                 timeout: float | None = None, metadata: Metadata = (), trace: bool = False,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        extra = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self._static_metadata: Metadata = tuple(metadata) + extra
        self._trace = trace
        creds = None
        if root_certificates is not None or certificate_chain is not None:
            creds = channel_credentials(root_certificates, private_key, certificate_chain)

        def open_channel(balancing: dict):
            options = channel_options(max_message_bytes, balancing)
            if creds is not None:
                return self._channels.secure_channel(target, creds, options=options)
            return self._channels.insecure_channel(target, options=options)

        self._channel = open_channel(ROUND_ROBIN)
        # Uploads and the requests that name uploaded media go over a channel that sticks to one replica.
        self._media_channel = open_channel(STICKY)
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._media_stub = pb_grpc.GenerationStub(self._media_channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self.timeout = timeout
        self._inline_limit: int | None = None  # the server's max_inline_media_bytes, asked once

    def _start_generate(self, request: pb.GenerateRequest, timeout: float | None):
        stub = self._media_stub if names_uploaded_media(request) else self._stub
        return stub.Generate(request, metadata=self._metadata, timeout=timeout or self.timeout)

    @property
    def _metadata(self) -> Metadata:
        """Per call: with `trace=True`, the current OpenTelemetry span travels as W3C traceparent,
        so the server's `mmserve.generate` span joins the caller's trace."""
        if not self._trace:
            return self._static_metadata
        from mmserve.metrics.tracing import inject_trace_context

        return tuple(inject_trace_context(self._static_metadata))


class _StreamBase:
    """A Generate call and what it has received so far. `start()` makes the call; it is made again
    when it failed before any delta and `recover(error)` repaired the cause (uploaded lost media again)."""

    def __init__(self, start: Callable[[], object], recover: Callable[[ClientError], object]) -> None:
        self._start = start
        self._recover = recover
        self._call = start()
        self._collector = _Collector()

    @property
    def result(self) -> GenerateResult:
        return self._collector.finish()

    @property
    def request_id(self) -> str:
        return self._collector.request_id

    def cancel(self) -> None:
        """Stop the request; the server aborts it in the engine and frees its cache."""
        self._call.cancel()


class GenerateStream(_StreamBase):
    """Iterate for deltas; `result` holds the GenerateResult after the stream ends."""

    def __iter__(self) -> Iterator[Delta]:
        while True:
            try:
                for response in self._call:
                    delta = self._collector.feed(response)
                    if delta is not None:
                        yield delta
                return
            except grpc.RpcError as e:
                error = ClientError.from_rpc_error(e)
                if self._collector.deltas or not self._recover(error):
                    raise error from None
                self._call = self._start()


class LiveCall:
    """One live session from a blocking client: `frame()` and `ask()` queue messages (sent in order
    by grpc's own thread), iterating yields the server's `pb.LiveResponse`s, `close()` half-closes
    (the server ends the session once every question is answered), `cancel()` ends it at once."""

    def __init__(self, method, open_: pb.LiveOpen, timeout: float | None, metadata) -> None:
        self._out: queue.Queue = queue.Queue()
        self._out.put(pb.LiveRequest(open=open_))
        self._call = method(iter(self._out.get, None), timeout=timeout, metadata=metadata)

    def frame(self, image: bytes, time_s: float | None = None) -> None:
        frame = pb.LiveFrame(image=image)
        if time_s is not None:
            frame.time_s = time_s
        self._out.put(pb.LiveRequest(frame=frame))

    def stream_chunk(self, data: bytes) -> None:
        """The next bytes of an encoded stream (MPEG-TS or fragmented MP4), instead of frames."""
        self._out.put(pb.LiveRequest(stream_chunk=data))

    def ask(self, text: str, *, question_id: str = "", max_tokens: int = 0, temperature: float | None = None,
            join_context: bool = False) -> None:
        sampling = pb.SamplingParams(max_tokens=max_tokens)
        if temperature is not None:
            sampling.temperature = temperature
        self._out.put(pb.LiveRequest(question=pb.LiveQuestion(
            question_id=question_id, messages=[user_message(text)], sampling=sampling, join_context=join_context)))

    def close(self) -> None:
        self._out.put(None)

    def cancel(self) -> None:
        self._call.cancel()

    def __iter__(self) -> Iterator[pb.LiveResponse]:
        try:
            yield from self._call
        except grpc.RpcError as e:
            raise ClientError.from_rpc_error(e) from e


class Client(_Base):
    """Blocking client. Use as a context manager or call close()."""

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()
        self._media_channel.close()

    def _unary(self, method, request, timeout: float | None):
        try:
            return method(request, metadata=self._metadata, timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise ClientError.from_rpc_error(e) from None

    def stream(self, messages: Sequence[pb.Message] | None = None, *, timeout: float | None = None,
               **kwargs) -> GenerateStream:
        """Start a request; keyword arguments are those of `build_request`, except that `video=`,
        `image=` and `audio=` may also be a path, and bytes or a file larger than the server takes in one message
        are uploaded first (with a progress bar on a terminal). A `video=`/`image=` MediaRef the
        server no longer has is uploaded again from its file, once."""
        kwargs = dict(kwargs)
        for key, value, size in local_media(kwargs):
            if size > self._inline(timeout) > 0:
                kwargs[key] = self.upload(upload_source(value), timeout=timeout)
            elif isinstance(value, Path):
                kwargs[key] = value.read_bytes()
        retried = False

        def recover(error: ClientError) -> bool:
            nonlocal retried
            key = None if retried else lost_media(error, kwargs)
            if key is not None:
                retried = True
                kwargs[key] = self.upload(kwargs[key].source, mime_type=kwargs[key].mime_type, timeout=timeout)
            return key is not None

        return GenerateStream(lambda: self._start_generate(build_request(messages, **kwargs), timeout), recover)

    def _inline(self, timeout: float | None) -> int:
        if self._inline_limit is None:
            self._inline_limit = self.model_info(timeout).max_inline_media_bytes
        return self._inline_limit

    def upload(self, source: UploadSource, *, mime_type: str = "", progress: bool = True,
               chunk_bytes: int = CHUNK_BYTES, timeout: float | None = None) -> MediaRef:
        """Upload a video or image (a path, or a binary file from its current position) in chunks,
        with a progress bar on a terminal; returns its MediaRef (`.id` is the bytes' sha256), to pass
        as `video=` / `image=`. Bytes the server already holds are not sent again."""
        with opened(source) as src, progress_bar(src, progress) as bar:
            response = self._unary(self._media_stub.UploadMedia, upload_requests(src, mime_type, chunk_bytes, bar),
                                   timeout)
            return media_ref(response, src, bar)

    def generate(self, messages: Sequence[pb.Message] | None = None, *, timeout: float | None = None,
                 **kwargs) -> GenerateResult:
        stream = self.stream(messages, timeout=timeout, **kwargs)
        for _ in stream:
            pass
        return stream.result

    def live(self, open_: pb.LiveOpen | None = None, *, timeout: float | None = None) -> LiveCall:
        """Open a live video session (Generation.Live, docs/api.md): send frames and questions on the
        returned call, iterate it for `pb.LiveResponse`s (progress, answers), `close()` when done."""
        return LiveCall(self._stub.Live, open_ or pb.LiveOpen(), timeout, self._metadata)

    def abort(self, request_id: str, timeout: float | None = None) -> bool:
        return self._unary(self._stub.Abort, pb.AbortRequest(request_id=request_id), timeout).found

    def model_info(self, timeout: float | None = None) -> pb.ModelInfo:
        return self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout)

    def server_load(self, timeout: float | None = None) -> pb.ServerLoad:
        return self._unary(self._stub.GetServerLoad, pb.GetServerLoadRequest(), timeout)

    def health(self, service: str = "", timeout: float | None = None) -> str:
        """"SERVING" / "NOT_SERVING" for `service` ("" = the process, "mmserve.v1.Generation" = ready)."""
        response = self._unary(self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


class AsyncGenerateStream(_StreamBase):
    """`async for` the deltas; `result` holds the GenerateResult after the stream ends."""

    async def __aiter__(self) -> AsyncIterator[Delta]:
        while True:
            try:
                async for response in self._call:
                    delta = self._collector.feed(response)
                    if delta is not None:
                        yield delta
                return
            except grpc.RpcError as e:
                error = ClientError.from_rpc_error(e)
                if self._collector.deltas or not await self._recover(error):
                    raise error from None
                self._call = self._start()


class AsyncClient(_Base):
    """asyncio client; create it inside the event loop that uses it."""

    _channels = grpc.aio

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()
        await self._media_channel.close()

    async def _unary(self, method, request, timeout: float | None):
        try:
            return await method(request, metadata=self._metadata, timeout=timeout or self.timeout)
        except grpc.RpcError as e:
            raise ClientError.from_rpc_error(e) from None

    def stream(self, messages: Sequence[pb.Message] | None = None, *, timeout: float | None = None,
               **kwargs) -> AsyncGenerateStream:
        """As `Client.stream`, but `video=`/`image=` go as given (bytes or a MediaRef): `generate()`
        reads paths and uploads what is too large inline, which needs awaiting first."""
        kwargs = dict(kwargs)
        retried = False

        async def recover(error: ClientError) -> bool:
            nonlocal retried
            key = None if retried else lost_media(error, kwargs)
            if key is not None:
                retried = True
                kwargs[key] = await self.upload(kwargs[key].source, mime_type=kwargs[key].mime_type, timeout=timeout)
            return key is not None

        return AsyncGenerateStream(lambda: self._start_generate(build_request(messages, **kwargs), timeout), recover)

    async def upload(self, source: UploadSource, *, mime_type: str = "", progress: bool = True,
                     chunk_bytes: int = CHUNK_BYTES, timeout: float | None = None) -> MediaRef:
        """As `Client.upload`; the file is read off the event loop."""
        with opened(source) as src, progress_bar(src, progress) as bar:
            requests = upload_requests_async(src, mime_type, chunk_bytes, bar)
            return media_ref(await self._unary(self._media_stub.UploadMedia, requests, timeout), src, bar)

    async def _inline(self, timeout: float | None) -> int:
        if self._inline_limit is None:
            self._inline_limit = (await self.model_info(timeout)).max_inline_media_bytes
        return self._inline_limit

    async def generate(self, messages: Sequence[pb.Message] | None = None, *, timeout: float | None = None,
                       **kwargs) -> GenerateResult:
        """As `Client.generate`: paths are read, and media too large inline are uploaded first."""
        for key, value, size in local_media(kwargs):
            if size > await self._inline(timeout) > 0:
                kwargs[key] = await self.upload(upload_source(value), timeout=timeout)
            elif isinstance(value, Path):
                kwargs[key] = await asyncio.to_thread(value.read_bytes)
        stream = self.stream(messages, timeout=timeout, **kwargs)
        async for _ in stream:
            pass
        return stream.result

    async def abort(self, request_id: str, timeout: float | None = None) -> bool:
        return (await self._unary(self._stub.Abort, pb.AbortRequest(request_id=request_id), timeout)).found

    async def model_info(self, timeout: float | None = None) -> pb.ModelInfo:
        return await self._unary(self._stub.GetModelInfo, pb.GetModelInfoRequest(), timeout)

    async def server_load(self, timeout: float | None = None) -> pb.ServerLoad:
        return await self._unary(self._stub.GetServerLoad, pb.GetServerLoadRequest(), timeout)

    async def health(self, service: str = "", timeout: float | None = None) -> str:
        response = await self._unary(self._health.Check, health_pb2.HealthCheckRequest(service=service), timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
