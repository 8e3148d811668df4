"""One EngineConfig that CLI flags and MMSERVE_* environment variables both map onto.

Flag `--max-num-seqs` <-> env `MMSERVE_MAX_NUM_SEQS` <-> field `max_num_seqs`. A flag given on the
command line wins over the environment, which wins over the default.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).parent / "demo_model"
DEMO_ASSISTANT_DIR = Path(__file__).parent / "demo_assistant"   # its drafter (scripts/train_demo_assistant.py)

# The batching options' defaults per device, for the fields left at their "device default" value
# (docs/configuration.md, "Defaults per device", says how the CUDA ones were chosen).
DEVICE_DEFAULTS = {
    "cpu": {"max_num_batched_tokens": 512, "prefill_batched_tokens": 2048, "max_num_seqs": 64, "max_step_slowdown": 0.0},
    "cuda": {"max_num_batched_tokens": 2048, "prefill_batched_tokens": 8192, "max_num_seqs": 128,
             "max_step_slowdown": 1.4},
}


def slowdown_valid(value: float) -> bool:
    """--max-step-slowdown's values: off, the device's default, or a limit above the decode rows' own."""
    return value in (0, -1) or value > 1


ASYNC_SCHEDULING_CHOICES = ("auto", "on", "off")
BACKEND_SELF_CHECK_CHOICES = ("auto", "on", "off")   # worker/backend_check.py reads it (this module imports no torch)
SDPA_BATCHING_CHOICES = ("auto", "batched", "loop")   # attention/sdpa.py's plans, one per choice
SCHEDULING_POLICY_CHOICES = ("fcfs", "priority")   # the scheduler's orders (core/sched/scheduler.py)
PERF_ACCOUNTING_CHOICES = ("exact", "upper-bound")   # metrics/perf_model.py's, also `mmserve perf --accounting`
# What a boolean variable may say (any case, spaces around ignored); anything else is a usage error.
BOOLEAN_WORDS = {**dict.fromkeys(("1", "true", "yes", "on"), True), **dict.fromkeys(("0", "false", "no", "off"), False)}
CPU_KV_CACHE_BYTES = 256 * 2**20   # a CPU's KV cache when no size is given (host memory is shared)


@dataclass
class EngineConfig:
    """What the engine needs to run a model. Server-only options live in ServerConfig."""

    model: str = field(default=str(DEMO_MODEL_DIR), metadata={"help": "checkpoint directory (default: the embedded demo model)"})
    dtype: str = field(default="auto", metadata={"help": "auto: bfloat16 on CUDA, float32 on CPU",
                                                 "choices": ("auto", "float32", "bfloat16", "float16")})
    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda | cuda:N", "pattern": r"auto|cpu|cuda(:\d+)?"})
    attention_backend: str = field(default="auto", metadata={"help": "attention kernels",
                                                             "choices": ("auto", "reference", "sdpa", "flex", "fa4")})
    compile_dense: bool = field(default=False, metadata={
        "help": "CPU: torch.compile RMSNorm, norm+RoPE and gated GELU for steps of >= 128 tokens (once per "
                "process); on CUDA the decoder's layers are compiled (fused) at every step size regardless"})
    sdpa_batching: str = field(default="auto", metadata={
        "help": "sdpa backend: auto (one padded call per layer type unless padding costs more), batched, loop "
                "(one call per request)", "choices": SDPA_BATCHING_CHOICES})
    max_num_batched_tokens: int = field(default=0, metadata={
        "help": "token budget per engine step; 0 = the device's default (512 on a CPU, 2048 on CUDA)", "min": 0})
    prefill_batched_tokens: int = field(default=-1, metadata={
        "help": "token budget of a step while no request is decoding (only prefill runs, so no TPOT pays "
                "for a longer step); 0 = max_num_batched_tokens; -1 = the device's default (2048 on a CPU, "
                "8192 on CUDA)", "min": -1})
    max_step_slowdown: float = field(default=-1.0, metadata={
        "help": "while a request decodes, a step's prefill tokens stop where the step's roofline time (the perf "
                "model's bytes and FLOPs over the device's peaks) would pass this multiple of its decode rows' "
                "alone: their inter-token latency stays bounded while a long prompt (a video) prefills; 0 = the "
                "token budgets only; -1 = the device's default (1.4 on CUDA, 0 on a CPU)", "min": -1.0,
        "valid": (slowdown_valid, "must be above 1, or 0 (off), or -1 (the device's default)")})
    max_num_seqs: int = field(default=0, metadata={
        "help": "most requests running at once; 0 = the device's default (64 on a CPU, 128 on CUDA)", "min": 0})
    max_model_len: int = field(default=0, metadata={"help": "context length cap; 0 = the model's", "min": 0})
    block_size: int = field(default=16, metadata={"help": "tokens per KV cache block", "min": 1})
    num_kv_blocks: int = field(default=0, metadata={"help": "KV blocks per pool; 0 = derive from kv_cache_bytes", "min": 0})
    kv_cache_bytes: int = field(default=0, metadata={
        "help": "KV cache memory for all pools; 0 = on CUDA what --gpu-memory-utilization leaves, on a CPU 256 MiB",
        "min": 0})
    window_cache_share: float = field(default=0.1, metadata={
        "help": "share of the KV cache left beyond the sliding pools' room for running requests and one request "
                "of the full context that keeps the sliding windows of cached prefixes (a prefix hit, e.g. a "
                "follow-up question about a video, needs the window before its end); the rest holds "
                "full-attention context. Unused with prefix caching off", "min": 0.0, "max": 1.0})
    gpu_memory_utilization: float = field(default=0.9, metadata={
        "help": "CUDA: the share of the device's memory this engine may use in all (weights, activations, KV cache), "
                "as vLLM's flag; the KV cache gets what a profiling step at the largest step leaves of it "
                "(unless --kv-cache-bytes or --num-kv-blocks is given)", "min": 0.01, "max": 1.0})
    max_waiting_requests: int = field(default=256, metadata={"help": "bounded queue; beyond it RESOURCE_EXHAUSTED", "min": 0})
    scheduling_policy: str = field(default="fcfs", metadata={"help": "order of the waiting queue", "choices": SCHEDULING_POLICY_CHOICES})
    seed: int = field(default=0, metadata={"help": "default sampling seed", "min": 0, "max": 2**64 - 1})
    enable_prefix_caching: bool = field(default=True, metadata={
        "help": "reuse the KV cache of prompt prefixes seen before (keyed by token ids and image/frame content) "
                "and the vision embeddings of frames seen before; off = nothing is reused across requests"})
    kv_events_buffer: int = field(default=65536, metadata={
        "help": "KV cache event blocks buffered per SubscribeKvEvents subscriber; one that falls further behind is "
                "ended with RESOURCE_EXHAUSTED and must subscribe again", "min": 1})
    encoder_cache_bytes: int = field(default=0, metadata={
        "help": "vision embeddings kept across requests, keyed by image/frame content (LRU); "
                "0 = room for 256 video frames of the served model (none with prefix caching off)", "min": 0})
    encode_ahead: bool = field(default=True, metadata={
        "help": "encode the frames and audio segments the next step will consume while this step runs, batched "
                "across requests (on CUDA on a side stream), so decodes beside a video's prefill do not wait for "
                "the vision tower (under tensor parallelism, every rank alike); off = each step encodes its own"})
    enforce_eager: bool = field(default=False, metadata={"help": "no CUDA graphs: run every step eagerly (CUDA only; CPU steps are always eager)"})
    # The one field whose default is read from its variable when the config is built in Python too
    # (mmserve.LLM, the eval client, a test's engine): one variable switches every engine a process and
    # the processes it starts build, e.g. the test suite run on the loop CUDA users run.
    async_scheduling: str = field(default_factory=lambda: os.environ.get(_env_name("async_scheduling"), "auto"), metadata={
        "help": "schedule and launch step N+1 while step N runs, its sampled tokens (and, with --speculative-model, "
                "its acceptance and the drafts made after it) fed to N+1 on the device and reaching the front end one "
                "step late (under tensor parallelism the workers take them from rank 0's device by one broadcast): "
                "auto (on CUDA) | on | off", "choices": ASYNC_SCHEDULING_CHOICES})
    emulate_cuda_graphs: bool = field(default=False, metadata={
        "help": "on a CPU, run the steps CUDA graphs would run the way they would (the same bucketing, padding and "
                "persistent buffers; the forward re-run at replay): a graph path's tokens and coverage without a GPU"})
    backend_self_check: str = field(default="auto", metadata={
        "help": "at start-up, run each selected fa4/flex attention kernel (and the CUDA graphs, E-models' PLE kernel) once "
                "against the dense reference, falling back on an error or mismatch: auto (on CUDA) | on | off",
        "choices": BACKEND_SELF_CHECK_CHOICES})
    strict_backends: bool = field(default=False, metadata={
        "help": "a backend failing the start-up self-check fails the start instead of falling back "
                "(CI on GPUs, bench/gpu_check.py)"})
    # Process layout (docs/deploy.md: threads, crash and restart).
    engine_process: bool = field(default=True, metadata={
        "help": "run the engine core in its own process (off: a thread of the server process, for debugging)"})
    engine_threads: int = field(default=0, metadata={
        "help": "torch threads of the engine; 0 = OMP_NUM_THREADS if set, else the container's cores (cgroup "
                "quota, affinity); they wait for work passively (OMP_WAIT_POLICY=PASSIVE unless set)", "min": 0})
    engine_ready_timeout_s: float = field(default=900.0, metadata={
        "help": "how long the engine may take to load, warm up and report ready", "min": 0.001})
    engine_stall_timeout_s: float = field(default=120.0, metadata={
        "help": "once serving, how long the engine may send nothing (it sends at least once a second while its "
                "loop runs) before the server kills it as wedged, failing every request (0 = never)", "min": 0})
    tensor_parallel_size: int = field(default=1, metadata={
        "help": "ranks the decoder is split over (Megatron tensor parallelism, torch.distributed: gloo on CPU, "
                "nccl on CUDA); the engine process is rank 0 and spawns the others, one per device", "min": 1})
    tensor_parallel_timeout_s: float = field(default=60.0, metadata={
        "help": "how long a tensor-parallel collective may wait for a rank before the engine fails", "min": 1})
    nnodes: int = field(default=1, metadata={
        "help": "nodes the tensor-parallel group spans (each runs tensor_parallel_size / nnodes ranks); above 1 "
                "the ranks meet at MASTER_ADDR:MASTER_PORT and nodes 1.. run `mmserve worker`", "min": 1})
    node_rank: int = field(default=0, metadata={
        "help": "this node's index in a multi-node group: 0 is `mmserve serve`, 1..nnodes-1 `mmserve worker`", "min": 0})
    # Multimodal limits (checked at the edge before any work starts).
    max_frames_per_video: int = field(default=32, metadata={"help": "frames sampled from one video at most", "min": 1})
    max_frames_per_request: int = field(default=64, metadata={"help": "frames over all videos of a request", "min": 1})
    default_num_frames: int = field(default=8, metadata={"help": "frames sampled when the request names none", "min": 1})
    max_video_bytes: int = field(default=48 * 2**20, metadata={
        "help": "largest video payload; also bounds an image part (inline or uploaded) and an inline audio part",
        "min": 1})
    max_video_duration_s: float = field(default=4 * 3600.0, metadata={"help": "longest video accepted", "min": 0.001})
    max_audio_duration_s: float = field(default=600.0, metadata={
        "help": "longest audio part, or video soundtrack window (use_audio_in_video), in seconds; refused from the "
                "header before decoding (30 s of audio is 750 tokens)", "min": 0.001})
    max_image_pixels: int = field(default=4096 * 4096, metadata={"help": "largest decoded frame/image, in pixels", "min": 1})
    max_images_per_request: int = field(default=16, metadata={"help": "image parts per request at most", "min": 0})
    max_audio_per_request: int = field(default=16, metadata={
        "help": "audio parts (clips) per request at most, counted before any is read; 0 = no audio. A video's "
                "soundtrack (use_audio_in_video) is not one: its video counts against --max-frames-per-request",
        "min": 0})
    max_pixels_per_request: int = field(default=128 * 2**20, metadata={
        "help": "pixels over all images and given frame images of a request, from their headers, before any is decoded",
        "min": 1})
    video_decode_timeout_s: float = field(default=30.0, metadata={
        "help": "time limit for each job of the media worker pool, the wait for a free worker included: decoding "
                "a video, an image or an audio part, reading a request's media headers, a live session's frame; "
                "one over it is refused", "min": 0.001})
    max_tokens_limit: int = field(default=4096, metadata={"help": "largest max_tokens a request may ask", "min": 1})
    max_stop_strings: int = field(default=16, metadata={"help": "most stop strings per request", "min": 0})
    max_n: int = field(default=16, metadata={"help": "most samples (sampling.n) per request", "min": 1})
    # Live video sessions (Generation.Live, engine/live_session.py; docs/security.md).
    live_max_sessions: int = field(default=16, metadata={"help": "live sessions open at once, all clients", "min": 0})
    live_max_sessions_per_client: int = field(default=4, metadata={
        "help": "live sessions open at once per API key (all clients alike without keys)", "min": 1})
    live_max_history_frames: int = field(default=32, metadata={
        "help": "frames a live session keeps in its context at most (LiveOpen.max_history_frames may ask fewer)",
        "min": 1})
    live_max_pending_frames: int = field(default=16, metadata={
        "help": "frames a live session may have received and not yet prefilled at most (LiveOpen.max_pending_frames "
                "may ask fewer); past it the session's fall_behind policy drops frames or ends it", "min": 1})
    live_max_questions: int = field(default=4, metadata={"help": "questions one live session may have in flight", "min": 1})
    live_idle_timeout_s: float = field(default=60.0, metadata={
        "help": "a live session that sends nothing for this long is ended (RESOURCE_EXHAUSTED, as an idle upload)", "min": 0.001})
    live_max_stream_fps: float = field(default=8.0, metadata={
        "help": "frames per second a live session samples from its encoded stream at most (LiveOpen.stream_fps "
                "may ask fewer)", "min": 0.001})
    live_max_stream_buffer_bytes: int = field(default=8 * 2**20, metadata={
        "help": "bytes of a live session's encoded stream received and not yet decoded at most; past it the "
                "session ends (RESOURCE_EXHAUSTED)", "min": 1})
    live_kv_share: float = field(default=0.5, metadata={
        "help": "share of each KV pool live sessions may reserve together (each reserves room for two contexts of "
                "its history); the rest stays for other requests", "min": 0, "max": 1})
    # Structured output (response_format): bounded before and while compiling (structured_output/compiler.py).
    max_response_format_chars: int = field(default=64 * 1024, metadata={
        "help": "longest response_format (JSON schema, regex or grammar text), in characters", "min": 1})
    max_response_format_depth: int = field(default=64, metadata={
        "help": "deepest nesting of a response_format: JSON objects/arrays of a schema, parentheses of a regex or grammar",
        "min": 1})
    grammar_compile_timeout_s: float = field(default=5.0, metadata={
        "help": "time limit for compiling one response_format (waiting for the compile worker included); "
                "a format over it is refused", "min": 0.001})
    grammar_cache_bytes: int = field(default=256 * 2**20, metadata={
        "help": "compiled response_formats kept per process (front end and engine each), LRU by size", "min": 0})
    # Metrics.
    perf_accounting: str = field(default="exact", metadata={"help": "attention FLOPs/bytes accounting",
                                                                       "choices": PERF_ACCOUNTING_CHOICES})
    step_trace_ratio: float = field(default=0.01, metadata={"help": "share of engine steps traced", "min": 0, "max": 1})
    # Speculative decoding (spec_decode/speculator.py).
    speculative_model: str = field(default="", metadata={
        "help": "a gemma4_assistant / gemma4_unified_assistant checkpoint directory that drafts tokens for "
                "the target to verify (greedy requests); empty = off"})
    num_speculative_tokens: int = field(default=3, metadata={
        "help": "draft tokens per request per step with --speculative-model", "min": 1, "max": 16})

    @property
    def max_step_tokens(self) -> int:
        """The most tokens one step may schedule (either budget): what step buffers and KV plans size for."""
        return max(self.max_num_batched_tokens, self.prefill_batched_tokens)

    def __post_init__(self) -> None:
        if self.async_scheduling not in ASYNC_SCHEDULING_CHOICES:   # the CLI checks its flag, not the variable read here
            raise ValueError(f"async_scheduling must be one of {', '.join(ASYNC_SCHEDULING_CHOICES)}, got "
                             f"{str(self.async_scheduling)[:40]!r} (given, or else from {_env_name('async_scheduling')})")
        # Resolved once here, so every reader (model loader, perf model, peaks, model info) sees a real dtype.
        if self.dtype == "auto":
            self.dtype = default_dtype(self.device)
        # ... and the batching options left to the device (front end and engine alike)
        defaults = DEVICE_DEFAULTS["cuda" if on_cuda(self.device) else "cpu"]
        for name, auto in (("max_num_batched_tokens", 0), ("prefill_batched_tokens", -1), ("max_num_seqs", 0),
                           ("max_step_slowdown", -1.0)):
            if getattr(self, name) == auto:
                setattr(self, name, defaults[name])
        if not slowdown_valid(self.max_step_slowdown):   # (NaN too; -1 is resolved above)
            raise ValueError(f"max_step_slowdown must be above 1, or 0 (off), or -1 (the device's default); "
                             f"got {self.max_step_slowdown}")
        if self.tensor_parallel_size > 1 and 0 < self.engine_stall_timeout_s <= self.tensor_parallel_timeout_s:
            raise ValueError(f"--engine-stall-timeout-s {self.engine_stall_timeout_s:g} is not above "
                             f"--tensor-parallel-timeout-s {self.tensor_parallel_timeout_s:g}: a rank that hangs "
                             "a collective would be reported as a wedged engine instead of by name")
        default_frames = min(self.default_num_frames, self.max_frames_per_video)   # a video naming no count
        if self.max_frames_per_request < default_frames:   # would be decoded, then refused: every one
            raise ValueError(f"--max-frames-per-request {self.max_frames_per_request} is below the {default_frames} "
                             f"frames a video is sampled to by default (the lower of --default-num-frames "
                             f"{self.default_num_frames} and --max-frames-per-video {self.max_frames_per_video}): "
                             "every video that names no frame count would be decoded and then refused")


def on_cuda(device: str) -> bool:
    """Whether `device` (a --device value) is a CUDA device: `auto` is one when CUDA is available."""
    if device == "auto":
        import torch

        return torch.cuda.is_available()
    return device.startswith("cuda")


def default_dtype(device: str) -> str:
    """What `--dtype auto` means on `device`: bfloat16 on CUDA (what FA4 runs), float32 on CPU."""
    return "bfloat16" if on_cuda(device) else "float32"


def _env_name(name: str) -> str:
    return "MMSERVE_" + name.upper()


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def field_type(f: dataclasses.Field, env: str | None = None) -> Callable[[str], object]:
    """The argparse `type` of a field: converts the text (flag or env var) and checks the field's
    `choices`, `pattern`, `min` and `max` metadata, so a bad value is a usage error (exit 2) that
    lists what is valid, never a traceback or a hang at start-up. Numbers must be finite (an `inf`
    timeout overflows where it is used); a boolean is one of BOOLEAN_WORDS (only a variable's text
    reaches it: the flags take no value). `env`: the env var's text, if set, so a refusal of that
    text names the variable."""
    kind = type(f.default if f.default is not dataclasses.MISSING else f.default_factory())  # type: ignore[misc]
    meta = f.metadata

    def problem(text: str, value) -> str | None:
        if "choices" in meta and value not in meta["choices"]:
            return f"{text!r} is not one of {', '.join(meta['choices'])}"
        if "pattern" in meta and not re.fullmatch(meta["pattern"], value):
            return f"{text!r} is not one of {meta['help']}"
        if "min" in meta and value < meta["min"]:
            return f"{text} is below the minimum {meta['min']}"
        if "max" in meta and value > meta["max"]:
            return f"{text} is above the maximum {meta['max']}"
        if "valid" in meta and not meta["valid"][0](value):
            return f"{text}: {meta['valid'][1]}"
        return None

    def convert(text: str):
        value, why = _parsed(kind, text)
        why = why or problem(text, value)
        if why is None:
            return value
        raise argparse.ArgumentTypeError(why + (f" (from {_env_name(f.name)})" if text == env else ""))

    convert.__name__ = kind.__name__  # argparse names the type in its own messages
    return convert


def _parsed(kind: type, text: str) -> tuple[object, str | None]:
    """`text` as a `kind`, or why it is not one."""
    if kind is bool:
        value = BOOLEAN_WORDS.get(text.strip().lower())
        return value, None if value is not None else f"{text!r} is not one of 1/true/yes/on, 0/false/no/off"
    try:
        value = kind(text)
    except ValueError:
        return None, f"{text!r} is not a valid {kind.__name__}"
    if kind is float and not math.isfinite(value):
        return None, f"{text!r} is not a number" if value != value else f"{text!r} is not finite"
    return value, None


def _valid_values(meta) -> str:
    """What the help text says about valid values (the choices or the range)."""
    if "choices" in meta:
        return f"one of {', '.join(meta['choices'])}; "
    bounds = [f">= {meta['min']}" if "min" in meta else "", f"<= {meta['max']}" if "max" in meta else ""]
    return f"{' and '.join(b for b in bounds if b)}; " if any(bounds) else ""


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one flag per field of `cls`; defaults come from MMSERVE_* env vars, then the field default.
    An env var's text goes through the same checks as the flag's (argparse converts string defaults)."""
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        env = os.environ.get(_env_name(f.name))
        if type(default) is bool:
            action = parser.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction,
                                         default=default if env is None else env,
                                         help=f"{f.metadata.get('help', '')} [env {_env_name(f.name)}]")
            # argparse converts a string default (the variable's text) with the action's type, when no
            # --flag/--no-flag was given; set here, since BooleanOptionalAction(type=...) is gone in 3.14
            action.type = field_type(f, env)
            continue
        parser.add_argument(_flag(f.name), type=field_type(f, env), default=default if env is None else env, dest=f.name,
                            help=f"{f.metadata.get('help', '')} ({_valid_values(f.metadata)}default {default!r}) "
                                 f"[env {_env_name(f.name)}]")


def from_args(cls: type, args: argparse.Namespace):
    """Build a config dataclass from parsed args (ignores unrelated args)."""
    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in vars(args).items() if k in names})


def flag_names(cls: type) -> list[str]:
    return [_flag(f.name) for f in dataclasses.fields(cls)]


def env_names(cls: type) -> list[str]:
    return [_env_name(f.name) for f in dataclasses.fields(cls)]


@dataclass
class ServerConfig:
    """Options of the gRPC edge (`mmserve serve`)."""

    host: str = field(default="127.0.0.1", metadata={"help": "address to bind"})
    port: int = field(default=50051, metadata={"help": "port to bind; 0 = pick a free one", "min": 0, "max": 65535})
    max_message_bytes: int = field(default=64 * 2**20, metadata={"help": "largest request message", "min": 1})
    max_concurrent_rpcs: int = field(default=1024, metadata={
        "help": "calls in progress at once, of every method (health included); beyond it RESOURCE_EXHAUSTED", "min": 1})
    max_inflight_message_bytes: int = field(default=2**30, metadata={
        "help": "request bytes held by unary-request calls in progress, all together; beyond it a retryable "
                "RESOURCE_EXHAUSTED", "min": 1})
    worker_threads: int = field(default=4, metadata={"help": "threads decoding video and building prompts", "min": 1})
    drain_grace_s: float = field(default=30.0, metadata={"help": "how long in-flight streams may finish on SIGTERM", "min": 0})
    tls_cert: str = field(default="", metadata={"help": "server certificate (PEM); enables TLS"})
    tls_key: str = field(default="", metadata={"help": "server private key (PEM)"})
    tls_client_ca: str = field(default="", metadata={"help": "CA bundle for client certificates; enables mutual TLS"})
    api_keys_file: str = field(default="", metadata={"help": "file with one API key per line; env MMSERVE_API_KEYS also works"})
    auth_health: bool = field(default=False, metadata={"help": "require the API key for health and reflection too"})
    otlp_traces_endpoint: str = field(default="", metadata={"help": "OTLP endpoint for traces (else OTEL_EXPORTER_OTLP_ENDPOINT)"})
    metrics_port: int = field(default=0, metadata={"help": "Prometheus /metrics HTTP port; 0 = off", "min": 0, "max": 65535})
    # Uploaded media (UploadMedia): a content-addressed spool on local disk.
    media_dir: str = field(default="", metadata={"help": "directory for uploaded media, one server each; empty = a temporary directory removed at exit"})
    media_dir_max_bytes: int = field(default=16 * 2**30, metadata={"help": "uploaded media kept at most; unused media are evicted oldest first: media no key holds, the uploading key's own, then the heaviest key's (never a lighter key's than the uploader)", "min": 1})
    media_max_bytes_per_client: int = field(default=0, metadata={
        "help": "uploaded media and uploads in progress of one API key at most; room is made by evicting that key's "
                "own unused media first; 0 = a quarter of --media-dir-max-bytes (at least "
                "--max-upload-bytes) with API keys, all of it without (all clients alike without keys)", "min": 0})
    media_ttl_s: float = field(default=3600.0, metadata={"help": "uploaded media unused this long are deleted", "min": 0.001})
    upload_idle_timeout_s: float = field(default=30.0, metadata={
        "help": "an UploadMedia stream with no message for this long is ended and its bytes dropped", "min": 0.001})
    upload_max_duration_s: float = field(default=1800.0, metadata={
        "help": "an UploadMedia stream still open this long after it began is ended and its bytes dropped, however "
                "steadily it sends", "min": 0.001})
    max_upload_bytes: int = field(default=4 * 2**30, metadata={"help": "largest single upload", "min": 1})
    # The vllm.grpc.engine.VllmEngine door for gateways (SMG, llm-d): docs/gateway.md.
    enable_vllm_engine_api: bool = field(default=True, metadata={
        "help": "serve vllm.grpc.engine.VllmEngine (the worker protocol of the SMG and llm-d gateways) on the "
                "same port as mmserve.v1"})
    allowed_local_media_path: str = field(default="", metadata={
        "help": "directory whose files VllmEngine media_refs may name as file:// URLs; empty = file:// refused"})
    kv_events_config: str = field(default="", metadata={
        "help": "publish KV cache events over ZMQ in vLLM's wire format, for llm-d's precise prefix-cache "
                "routing: vLLM's JSON, e.g. '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", "
                "\"endpoint\": \"tcp://*:5557\", \"topic\": \"kv@POD@MODEL\"}' (fields endpoint, replay_endpoint, "
                "buffer_steps, hwm, max_queue_size, topic; vLLM's defaults); empty = off"})
    kv_events_snapshot_interval_s: float = field(default=60.0, metadata={
        "help": "the --kv-events-config publisher sends a fresh snapshot of the prefix cache when none went out "
                "for this long (besides one every buffer_steps // 2 batches), so a router that (re)subscribed "
                "without replay learns an idle or quiet replica within it; 0 = by batches only", "min": 0})
    kv_events_max_subscribers: int = field(default=16, metadata={
        "help": "SubscribeKvEvents streams open at once, of all clients; beyond it RESOURCE_EXHAUSTED", "min": 1})
    kv_events_max_subscribers_per_client: int = field(default=4, metadata={
        "help": "SubscribeKvEvents streams open at once from one client address; beyond it RESOURCE_EXHAUSTED",
        "min": 1})
    openai_port: int = field(default=0, metadata={
        "help": "also serve the OpenAI HTTP API on this port: the SMG gateway (the smg package) started in front "
                "of this server once it is ready, stopped with it; 0 = off", "min": 0, "max": 65535})
    gateway_media: str = field(default="worker", metadata={
        "help": "who decodes the media of VllmEngine requests: worker = this server (the gateway forwards "
                "media_refs); gateway = advertise no media processor, so the gateway preprocesses and sends "
                "mm_inputs", "choices": ("worker", "gateway")})
