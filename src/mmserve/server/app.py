"""Build and run the grpc.aio server (the front-end process) around an AsyncEngine.

`MMServer` owns the listener, the health states, the input worker pool and the engine's
lifetime. It listens before the model loads, so liveness probes pass during a long load while
readiness ("mmserve.v1.Generation") turns SERVING only once the engine process has reported ready
and warmed up. Extra interceptors and credentials can be passed in; drain is a method so a signal
handler, a test or an operator can call it. If the engine process dies, every request in flight
ends with UNAVAILABLE, health turns NOT_SERVING and `serve` raises, so the process exits non-zero
and its orchestrator restarts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import grpc
from PIL import Image

from mmserve.api import pb_grpc
from mmserve.config import EngineConfig, ServerConfig
from mmserve.engine.input.processor import ImageInput, InputMessage, InputProcessor, TextInput
from mmserve.errors import EngineUnavailableError
from mmserve.model.spec import ModelSpec, load_spec_without_transformers
from mmserve.multimodal.memory import freeze_startup_objects, thaw_startup_objects
from mmserve.sampling_params import SamplingParams
from mmserve.server.admission import MessageAdmission, MethodLimit, transport_receive_limit
from mmserve.server.auth import build_auth_interceptor
from mmserve.server.drain import UNGATED_GRACE_S, UPLOAD_METHOD, DrainGate, ShutdownSignals, drain
from mmserve.server.handlers import ClosingStreamsInterceptor
from mmserve.server.health import Health, enable_reflection
from mmserve.server.in_flight import InFlightRequests
from mmserve.server.media import RECOMMENDED_CHUNK_BYTES, UPLOAD_FRAMING_BYTES, MediaService
from mmserve.server.openai_gateway import OpenAIGateway, replica_address
from mmserve.server.rpc_metrics import RpcMetricsInterceptor
from mmserve.server.servicer import GenerationServicer
from mmserve.server.tls import bind, server_credentials
from mmserve.server.vllm_engine import VLLM_ENGINE_SERVICE, add_vllm_engine

logger = logging.getLogger(__name__)

QUERY_METHODS = tuple(f"/mmserve.v1.Generation/{name}" for name in ("Abort", "GetModelInfo", "GetServerLoad"))
# Every VllmEngine method but Generate: a few ids at most (a gateway aborts one request per call).
VLLM_ENGINE_QUERY_METHODS = tuple(f"/{VLLM_ENGINE_SERVICE}/{name}" for name in (
    "Abort", "Embed", "HealthCheck", "FlushCache", "StartProfile", "StopProfile", "GetModelInfo", "GetServerInfo",
    "GetLoads", "GetTokenizer", "SubscribeKvEvents"))
QUERY_MESSAGE_BYTES = 16 * 2**10


def server_options(config: ServerConfig) -> list[tuple[str, int]]:
    """Message limits from the config and keepalive that survives idle-timeout proxies.

    The server pings every 60 s so a long stream is not cut by a proxy's idle timer, and tolerates
    client pings down to every 10 s (clients pinging faster get GOAWAY "too_many_pings").
    """
    return [
        # Headroom above our limit so MessageAdmission can refuse with a message naming the flag.
        ("grpc.max_receive_message_length", transport_receive_limit(config.max_message_bytes)),
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.keepalive_time_ms", 60_000),
        ("grpc.keepalive_timeout_ms", 20_000),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
        ("grpc.http2.max_ping_strikes", 2),
        # A second server on a busy port must fail, not silently share its traffic.
        ("grpc.so_reuseport", 0),
    ]


class MMServer:
    """The serving process's gRPC side: `await start()`, then `drain()` or `stop()`."""

    def __init__(self, engine, server_config: ServerConfig, engine_config: EngineConfig, *, spec: ModelSpec,
                 interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                 credentials: grpc.ServerCredentials | None = None, metrics=None) -> None:
        self.engine = engine
        self.spec = spec
        self.server_config = server_config
        self.engine_config = engine_config
        self.health = Health()
        self.gate = DrainGate()
        auth = build_auth_interceptor(server_config)
        self.media = MediaService.from_config(server_config, engine_config, api_keys=auth is not None)
        # Auth first: a refused caller's message is never read (handlers.rejecting_handler).
        chain = ([auth] if auth else []) + [self._admission(), self.gate, *interceptors]
        if metrics is not None:  # first, so calls refused by auth, size or drain are counted too
            chain.insert(0, RpcMetricsInterceptor(metrics.count_rpc))
            metrics.watch_engine(engine, block_size=engine_config.block_size,
                                 enable_prefix_caching=engine_config.enable_prefix_caching,
                                 num_speculative_tokens=engine_config.num_speculative_tokens
                                 if engine_config.speculative_model else 0)
        chain.insert(0, ClosingStreamsInterceptor())   # outermost: a stream ends with its call (handlers.py)
        self._credentials = credentials if credentials is not None else server_credentials(server_config)
        self._executor = ThreadPoolExecutor(max_workers=server_config.worker_threads,
                                            thread_name_prefix="mmserve-input")
        self._processor: InputProcessor | None = None
        self._media_sweeper: asyncio.Task | None = None
        self.server = grpc.aio.server(interceptors=chain, options=server_options(server_config),
                                      maximum_concurrent_rpcs=server_config.max_concurrent_rpcs)
        self.in_flight = in_flight = InFlightRequests(engine)   # both doors': one id namespace, Abort by owner
        servicer = GenerationServicer(engine, engine_config, lambda: self._processor, lambda: self.gate.draining,
                                      self.media, in_flight, live_observer=metrics)
        pb_grpc.add_GenerationServicer_to_server(servicer, self.server)
        if server_config.enable_vllm_engine_api:   # the gateway door (SMG, llm-d): docs/gateway.md
            add_vllm_engine(self.server, engine, engine_config, server_config, lambda: self._processor,
                            lambda: self.gate.draining, in_flight)
        self.kv_publisher = kv_event_publisher(server_config, engine_config, metrics)
        self.health.add_to_server(self.server)
        enable_reflection(self.server, (VLLM_ENGINE_SERVICE,) if server_config.enable_vllm_engine_api else ())
        self.port = 0

    def _admission(self) -> MessageAdmission:
        """Message limits: --max-message-bytes for Generate (both doors), one chunk for UploadMedia, 16 KiB
        for the queries and Aborts of both doors, and the in-flight byte budget."""
        chunk = MethodLimit(self.media.max_chunk_bytes + UPLOAD_FRAMING_BYTES,
                            f"send the upload in chunks of {RECOMMENDED_CHUNK_BYTES} bytes")
        query = MethodLimit(QUERY_MESSAGE_BYTES, "its request carries a few request ids at most: abort fewer at once")
        return MessageAdmission(self.server_config.max_message_bytes, self.server_config.max_inflight_message_bytes,
                                {UPLOAD_METHOD: chunk, **dict.fromkeys(QUERY_METHODS + VLLM_ENGINE_QUERY_METHODS, query)})

    @property
    def address(self) -> str:
        return f"{self.server_config.host}:{self.port}"

    async def start(self) -> int:
        """Listen, then load and warm the engine, then report ready. Returns the bound port."""
        await self.listen()
        await self.load()
        return self.port

    async def listen(self) -> int:
        """Bind and serve health/reflection (live, not yet ready); Generate answers UNAVAILABLE."""
        self.port = bind(self.server, f"{self.server_config.host}:{self.server_config.port}", self._credentials)
        await self.health.set_live()
        await self.server.start()
        self._media_sweeper = asyncio.ensure_future(self.media.sweep_forever())
        logger.info("listening on %s (%s)", self.address, "TLS" if self._credentials else "plaintext")
        return self.port

    async def start_unless(self, stop: asyncio.Event) -> bool:
        """`start()`, unless `stop` is set first (SIGTERM/SIGINT during the load or warm-up): then the
        start is cancelled (the engine process killed) and False returned within moments."""
        starting = asyncio.ensure_future(self.start())
        stopping = asyncio.ensure_future(stop.wait())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        if not starting.done():
            starting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await starting
            logger.info("stopped during start-up")
            return False
        starting.result()   # a start-up failure raises here
        return True

    async def load(self) -> None:
        """Start the engine (loads the model), warm it up, then turn readiness SERVING; all of it within
        --engine-ready-timeout-s, so a start-up that hangs fails loudly instead of waiting forever."""
        limit = self.engine_config.engine_ready_timeout_s
        try:
            async with asyncio.timeout(limit):
                await self._load()
        except TimeoutError:
            raise EngineUnavailableError(f"the engine did not load and warm up within {limit:g}s "
                                         f"(--engine-ready-timeout-s)") from None

    async def _load(self) -> None:
        await self.engine.start()
        if self.kv_publisher is not None:
            self.kv_publisher.start(self.engine.subscribe_kv_events)
        processor = InputProcessor.from_checkpoint(self.engine_config, self._executor, spec=self.spec,
                                                   context_length=self.engine.model_info.context_length,
                                                   workers=self.server_config.worker_threads)
        await self._warm_up(processor)
        self.engine.watch_stalls()
        self._processor = processor
        await self.health.set_ready()
        logger.info("ready: serving %s on %s", self.engine_config.model, self.address)

    async def _warm_up(self, processor: InputProcessor) -> None:
        """One tiny request (an image when the model has vision) through the whole path, so lazy
        initialisation and kernel compilation happen before readiness, not in a client's TTFT."""
        parts: list = [TextInput("warm up")]
        if processor.spec.has_vision:
            image = io.BytesIO()
            Image.new("RGB", (32, 32), (127, 127, 127)).save(image, format="PNG")
            parts.insert(0, ImageInput(image.getvalue(), "image/png"))
        request = await processor.process(f"warmup-{uuid.uuid4().hex}", [InputMessage("user", tuple(parts))],
                                          SamplingParams(max_tokens=1))
        request.observed = False  # counted in no metric: clients' TTFT histogram starts with their own requests
        started = time.perf_counter()
        async for _ in self.engine.generate(request):
            pass
        logger.info("warm-up request done in %.2fs", time.perf_counter() - started)
        freeze_startup_objects()  # later garbage collections skip the process's lifelong objects

    async def drain(self, grace_s: float | None = None, forced: asyncio.Event | None = None) -> bool:
        """Readiness NOT_SERVING, refuse new Generate calls, let in-flight ones finish within the
        grace period, then stop. True when no stream was cut off."""
        grace = self.server_config.drain_grace_s if grace_s is None else grace_s
        clean = await drain(self.server, self.gate, grace, set_not_serving=self.health.set_draining, forced=forced)
        await self._close()
        return clean

    async def stop(self) -> None:
        """Stop at once, cancelling in-flight streams (each is aborted in the engine)."""
        await self.health.set_draining()
        await self.server.stop(0)
        await self._close()

    async def _close(self) -> None:
        await self.engine.shutdown()
        if self.kv_publisher is not None:
            await self.kv_publisher.close()
        self._executor.shutdown(wait=False, cancel_futures=True)
        if self._media_sweeper is not None:
            self._media_sweeper.cancel()
        self.media.close()
        thaw_startup_objects()  # a process that goes on (tests, embedding) collects them again
        logger.info("stopped")

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()

    async def run_until_stopped(self, signals: ShutdownSignals) -> bool:
        """Serve until SIGTERM/SIGINT (then drain; True when the drain cut nothing off) or until the
        engine process dies (then raise its EngineDeadError)."""
        asked = asyncio.ensure_future(signals.requested.wait())
        died = asyncio.ensure_future(self.engine.wait_dead())
        await asyncio.wait({asked, died}, return_when=asyncio.FIRST_COMPLETED)
        if died.done():
            asked.cancel()
            await self.engine_died(died.result())
        died.cancel()
        clean = await self.drain(forced=signals.forced)
        if self.engine.dead_error is not None:
            raise self.engine.dead_error
        return clean

    async def engine_died(self, error: BaseException) -> None:
        """The engine process is gone: not live, not ready; let the failed streams get their status out, stop."""
        logger.error("engine died: %s; stopping the server", error)
        await self.health.set_dead()
        self.gate.start_draining()
        await self.server.stop(UNGATED_GRACE_S)
        await self._close()
        raise error


def kv_event_publisher(server_config: ServerConfig, engine_config: EngineConfig, metrics=None):
    """The ZMQ publisher --kv-events-config asks for (server/kv_event_publisher.py), its sockets open;
    None when off."""
    from mmserve.server.kv_event_publisher import KvEventsConfig, ZmqKvEventPublisher

    config = KvEventsConfig.parse(server_config.kv_events_config)
    if not config.enabled:
        return None
    return ZmqKvEventPublisher(config, engine_config.block_size,
                               snapshot_interval_s=server_config.kv_events_snapshot_interval_s,
                               on_drop=metrics.count_kv_events_dropped if metrics is not None else None)


def build_server(engine, server_config: ServerConfig, engine_config: EngineConfig, *, spec: ModelSpec,
                 interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
                 credentials: grpc.ServerCredentials | None = None, metrics=None) -> MMServer:
    """`spec`: the served model's (`load_spec_without_transformers(engine_config.model)`, which the
    perf model shares); `metrics` (an EngineMetrics) adds the per-RPC status counter."""
    return MMServer(engine, server_config, engine_config, spec=spec, interceptors=interceptors,
                    credentials=credentials, metrics=metrics)


async def serve(engine_config: EngineConfig, server_config: ServerConfig) -> bool:
    """Run until SIGTERM/SIGINT, then drain. True when the drain cut nothing off."""
    import torch

    from mmserve.engine.async_engine import AsyncEngine
    from mmserve.server.observability import setup_observability

    torch.set_num_threads(1)   # the front end does no torch parallel work; the engine process owns the cores
    signals = ShutdownSignals()
    signals.install()
    spec = load_spec_without_transformers(engine_config.model)   # once: the perf model and the input processor share it
    observability = setup_observability(engine_config, server_config, spec=spec)
    engine = AsyncEngine(engine_config, observer=observability.observer)
    server = build_server(engine, server_config, engine_config, spec=spec, metrics=observability.metrics)
    gateway = None
    try:
        if not await server.start_unless(signals.requested):
            await server.stop()
            return True
        if server_config.openai_port:   # the OpenAI door: SMG in front of this replica (openai_gateway.py)
            gateway = OpenAIGateway(server_config.host, server_config.openai_port,
                                    replica_address(server_config.host, server.port))
            await gateway.wait_ready()
        return await server.run_until_stopped(signals)
    except BaseException:
        await server.stop()
        raise
    finally:
        if gateway is not None:
            gateway.stop()
        observability.close()
