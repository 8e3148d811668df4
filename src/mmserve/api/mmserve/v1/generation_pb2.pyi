from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_EOS: _ClassVar[FinishReason]
    FINISH_REASON_STOP_STRING: _ClassVar[FinishReason]

class LiveFallBehind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LIVE_FALL_BEHIND_UNSPECIFIED: _ClassVar[LiveFallBehind]
    LIVE_FALL_BEHIND_DROP: _ClassVar[LiveFallBehind]
    LIVE_FALL_BEHIND_BUFFER: _ClassVar[LiveFallBehind]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_EOS: FinishReason
FINISH_REASON_STOP_STRING: FinishReason
LIVE_FALL_BEHIND_UNSPECIFIED: LiveFallBehind
LIVE_FALL_BEHIND_DROP: LiveFallBehind
LIVE_FALL_BEHIND_BUFFER: LiveFallBehind

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "messages", "sampling", "priority", "use_audio_in_video")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    USE_AUDIO_IN_VIDEO_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    sampling: SamplingParams
    priority: int
    use_audio_in_video: bool
    def __init__(self, request_id: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., priority: _Optional[int] = ..., use_audio_in_video: _Optional[bool] = ...) -> None: ...

class Message(_message.Message):
    __slots__ = ("role", "parts")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    PARTS_FIELD_NUMBER: _ClassVar[int]
    role: str
    parts: _containers.RepeatedCompositeFieldContainer[Part]
    def __init__(self, role: _Optional[str] = ..., parts: _Optional[_Iterable[_Union[Part, _Mapping]]] = ...) -> None: ...

class Part(_message.Message):
    __slots__ = ("text", "image", "video", "audio")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    VIDEO_FIELD_NUMBER: _ClassVar[int]
    AUDIO_FIELD_NUMBER: _ClassVar[int]
    text: str
    image: Image
    video: Video
    audio: Audio
    def __init__(self, text: _Optional[str] = ..., image: _Optional[_Union[Image, _Mapping]] = ..., video: _Optional[_Union[Video, _Mapping]] = ..., audio: _Optional[_Union[Audio, _Mapping]] = ...) -> None: ...

class Image(_message.Message):
    __slots__ = ("data", "mime_type", "media_id")
    DATA_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    MEDIA_ID_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    mime_type: str
    media_id: str
    def __init__(self, data: _Optional[bytes] = ..., mime_type: _Optional[str] = ..., media_id: _Optional[str] = ...) -> None: ...

class Audio(_message.Message):
    __slots__ = ("data", "mime_type", "media_id", "start_s", "end_s")
    DATA_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    MEDIA_ID_FIELD_NUMBER: _ClassVar[int]
    START_S_FIELD_NUMBER: _ClassVar[int]
    END_S_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    mime_type: str
    media_id: str
    start_s: float
    end_s: float
    def __init__(self, data: _Optional[bytes] = ..., mime_type: _Optional[str] = ..., media_id: _Optional[str] = ..., start_s: _Optional[float] = ..., end_s: _Optional[float] = ...) -> None: ...

class Video(_message.Message):
    __slots__ = ("data", "frames", "media_id", "mime_type", "num_frames", "fps", "start_s", "end_s")
    DATA_FIELD_NUMBER: _ClassVar[int]
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    MEDIA_ID_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    START_S_FIELD_NUMBER: _ClassVar[int]
    END_S_FIELD_NUMBER: _ClassVar[int]
    data: bytes
    frames: VideoFrames
    media_id: str
    mime_type: str
    num_frames: int
    fps: float
    start_s: float
    end_s: float
    def __init__(self, data: _Optional[bytes] = ..., frames: _Optional[_Union[VideoFrames, _Mapping]] = ..., media_id: _Optional[str] = ..., mime_type: _Optional[str] = ..., num_frames: _Optional[int] = ..., fps: _Optional[float] = ..., start_s: _Optional[float] = ..., end_s: _Optional[float] = ...) -> None: ...

class VideoFrames(_message.Message):
    __slots__ = ("frames", "fps")
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    FPS_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedCompositeFieldContainer[Image]
    fps: float
    def __init__(self, frames: _Optional[_Iterable[_Union[Image, _Mapping]]] = ..., fps: _Optional[float] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "logprobs", "top_logprobs", "prompt_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "logit_bias", "response_format", "n", "disable_speculation")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    DISABLE_SPECULATION_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    ignore_eos: bool
    logprobs: bool
    top_logprobs: int
    prompt_logprobs: bool
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    min_tokens: int
    logit_bias: _containers.ScalarMap[int, float]
    response_format: ResponseFormat
    n: int
    disable_speculation: bool
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., min_tokens: _Optional[int] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., response_format: _Optional[_Union[ResponseFormat, _Mapping]] = ..., n: _Optional[int] = ..., disable_speculation: _Optional[bool] = ...) -> None: ...

class ResponseFormat(_message.Message):
    __slots__ = ("json_schema", "regex", "grammar")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    regex: str
    grammar: str
    def __init__(self, json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "delta", "final")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    delta: Delta
    final: Final
    def __init__(self, request_id: _Optional[str] = ..., delta: _Optional[_Union[Delta, _Mapping]] = ..., final: _Optional[_Union[Final, _Mapping]] = ...) -> None: ...

class Delta(_message.Message):
    __slots__ = ("token_ids", "text", "logprobs", "index")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    index: int
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., index: _Optional[int] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("token_id", "text", "logprob", "rank", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    text: str
    logprob: float
    rank: int
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., text: _Optional[str] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "text", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    text: str
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., text: _Optional[str] = ..., logprob: _Optional[float] = ...) -> None: ...

class Final(_message.Message):
    __slots__ = ("finish_reason", "usage", "timings", "perf", "matched_stop", "prompt_logprobs", "finish_detail", "samples", "videos")
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    PERF_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_DETAIL_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_FIELD_NUMBER: _ClassVar[int]
    VIDEOS_FIELD_NUMBER: _ClassVar[int]
    finish_reason: FinishReason
    usage: Usage
    timings: Timings
    perf: Perf
    matched_stop: str
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    finish_detail: str
    samples: _containers.RepeatedCompositeFieldContainer[SampleFinal]
    videos: _containers.RepeatedCompositeFieldContainer[SampledVideo]
    def __init__(self, finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., timings: _Optional[_Union[Timings, _Mapping]] = ..., perf: _Optional[_Union[Perf, _Mapping]] = ..., matched_stop: _Optional[str] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., finish_detail: _Optional[str] = ..., samples: _Optional[_Iterable[_Union[SampleFinal, _Mapping]]] = ..., videos: _Optional[_Iterable[_Union[SampledVideo, _Mapping]]] = ...) -> None: ...

class SampledVideo(_message.Message):
    __slots__ = ("part", "num_frames", "timestamps_s", "duration_s")
    PART_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMPS_S_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    part: str
    num_frames: int
    timestamps_s: _containers.RepeatedScalarFieldContainer[float]
    duration_s: float
    def __init__(self, part: _Optional[str] = ..., num_frames: _Optional[int] = ..., timestamps_s: _Optional[_Iterable[float]] = ..., duration_s: _Optional[float] = ...) -> None: ...

class SampleFinal(_message.Message):
    __slots__ = ("index", "finish_reason", "matched_stop", "completion_tokens", "finish_detail")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISH_DETAIL_FIELD_NUMBER: _ClassVar[int]
    index: int
    finish_reason: FinishReason
    matched_stop: str
    completion_tokens: int
    finish_detail: str
    def __init__(self, index: _Optional[int] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., matched_stop: _Optional[str] = ..., completion_tokens: _Optional[int] = ..., finish_detail: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "multimodal_tokens", "completion_tokens", "num_frames", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MULTIMODAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_FRAMES_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    multimodal_tokens: int
    completion_tokens: int
    num_frames: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., multimodal_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., num_frames: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class Timings(_message.Message):
    __slots__ = ("queue_s", "time_to_first_token_s", "end_to_end_s", "preprocess_s")
    QUEUE_S_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    END_TO_END_S_FIELD_NUMBER: _ClassVar[int]
    PREPROCESS_S_FIELD_NUMBER: _ClassVar[int]
    queue_s: float
    time_to_first_token_s: float
    end_to_end_s: float
    preprocess_s: float
    def __init__(self, queue_s: _Optional[float] = ..., time_to_first_token_s: _Optional[float] = ..., end_to_end_s: _Optional[float] = ..., preprocess_s: _Optional[float] = ...) -> None: ...

class Perf(_message.Message):
    __slots__ = ("flops", "read_bytes", "write_bytes", "mfu", "mbu", "attn_flops_sliding", "attn_flops_full")
    FLOPS_FIELD_NUMBER: _ClassVar[int]
    READ_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MFU_FIELD_NUMBER: _ClassVar[int]
    MBU_FIELD_NUMBER: _ClassVar[int]
    ATTN_FLOPS_SLIDING_FIELD_NUMBER: _ClassVar[int]
    ATTN_FLOPS_FULL_FIELD_NUMBER: _ClassVar[int]
    flops: float
    read_bytes: float
    write_bytes: float
    mfu: float
    mbu: float
    attn_flops_sliding: float
    attn_flops_full: float
    def __init__(self, flops: _Optional[float] = ..., read_bytes: _Optional[float] = ..., write_bytes: _Optional[float] = ..., mfu: _Optional[float] = ..., mbu: _Optional[float] = ..., attn_flops_sliding: _Optional[float] = ..., attn_flops_full: _Optional[float] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_id",)
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    def __init__(self, request_id: _Optional[str] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model_name", "context_length", "max_frames_per_video", "max_frames_per_request", "tokens_per_frame", "supported_inputs", "attention_backend", "dtype", "max_inline_media_bytes", "max_upload_bytes", "max_upload_chunk_bytes", "peaks", "backend_checks", "tensor_parallel_size", "num_speculative_tokens", "kv_cache")
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAMES_PER_VIDEO_FIELD_NUMBER: _ClassVar[int]
    MAX_FRAMES_PER_REQUEST_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_FRAME_FIELD_NUMBER: _ClassVar[int]
    SUPPORTED_INPUTS_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_BACKEND_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_INLINE_MEDIA_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_UPLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_UPLOAD_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    PEAKS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_CHECKS_FIELD_NUMBER: _ClassVar[int]
    TENSOR_PARALLEL_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_SPECULATIVE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_FIELD_NUMBER: _ClassVar[int]
    model_name: str
    context_length: int
    max_frames_per_video: int
    max_frames_per_request: int
    tokens_per_frame: int
    supported_inputs: _containers.RepeatedScalarFieldContainer[str]
    attention_backend: str
    dtype: str
    max_inline_media_bytes: int
    max_upload_bytes: int
    max_upload_chunk_bytes: int
    peaks: DevicePeaks
    backend_checks: _containers.RepeatedCompositeFieldContainer[BackendCheck]
    tensor_parallel_size: int
    num_speculative_tokens: int
    kv_cache: KvCacheCapacity
    def __init__(self, model_name: _Optional[str] = ..., context_length: _Optional[int] = ..., max_frames_per_video: _Optional[int] = ..., max_frames_per_request: _Optional[int] = ..., tokens_per_frame: _Optional[int] = ..., supported_inputs: _Optional[_Iterable[str]] = ..., attention_backend: _Optional[str] = ..., dtype: _Optional[str] = ..., max_inline_media_bytes: _Optional[int] = ..., max_upload_bytes: _Optional[int] = ..., max_upload_chunk_bytes: _Optional[int] = ..., peaks: _Optional[_Union[DevicePeaks, _Mapping]] = ..., backend_checks: _Optional[_Iterable[_Union[BackendCheck, _Mapping]]] = ..., tensor_parallel_size: _Optional[int] = ..., num_speculative_tokens: _Optional[int] = ..., kv_cache: _Optional[_Union[KvCacheCapacity, _Mapping]] = ...) -> None: ...

class KvCacheCapacity(_message.Message):
    __slots__ = ("pool_tokens", "full_context_requests", "num_bytes", "max_num_seqs", "sized_by")
    class PoolTokensEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    POOL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FULL_CONTEXT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    SIZED_BY_FIELD_NUMBER: _ClassVar[int]
    pool_tokens: _containers.ScalarMap[str, int]
    full_context_requests: int
    num_bytes: int
    max_num_seqs: int
    sized_by: str
    def __init__(self, pool_tokens: _Optional[_Mapping[str, int]] = ..., full_context_requests: _Optional[int] = ..., num_bytes: _Optional[int] = ..., max_num_seqs: _Optional[int] = ..., sized_by: _Optional[str] = ...) -> None: ...

class BackendCheck(_message.Message):
    __slots__ = ("component", "selected", "running", "reason")
    COMPONENT_FIELD_NUMBER: _ClassVar[int]
    SELECTED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    component: str
    selected: str
    running: str
    reason: str
    def __init__(self, component: _Optional[str] = ..., selected: _Optional[str] = ..., running: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class DevicePeaks(_message.Message):
    __slots__ = ("device", "flops", "bandwidth", "source", "spread")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    FLOPS_FIELD_NUMBER: _ClassVar[int]
    BANDWIDTH_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SPREAD_FIELD_NUMBER: _ClassVar[int]
    device: str
    flops: float
    bandwidth: float
    source: str
    spread: float
    def __init__(self, device: _Optional[str] = ..., flops: _Optional[float] = ..., bandwidth: _Optional[float] = ..., source: _Optional[str] = ..., spread: _Optional[float] = ...) -> None: ...

class GetServerLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ServerLoad(_message.Message):
    __slots__ = ("running_requests", "waiting_requests", "kv_cache_usage", "draining", "max_num_seqs", "kv_cache_cached_usage")
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_USAGE_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    MAX_NUM_SEQS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_CACHED_USAGE_FIELD_NUMBER: _ClassVar[int]
    running_requests: int
    waiting_requests: int
    kv_cache_usage: float
    draining: bool
    max_num_seqs: int
    kv_cache_cached_usage: float
    def __init__(self, running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., kv_cache_usage: _Optional[float] = ..., draining: _Optional[bool] = ..., max_num_seqs: _Optional[int] = ..., kv_cache_cached_usage: _Optional[float] = ...) -> None: ...

class UploadMediaRequest(_message.Message):
    __slots__ = ("metadata", "chunk")
    METADATA_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    metadata: UploadMetadata
    chunk: bytes
    def __init__(self, metadata: _Optional[_Union[UploadMetadata, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class UploadMetadata(_message.Message):
    __slots__ = ("mime_type", "size_bytes", "sha256")
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    mime_type: str
    size_bytes: int
    sha256: str
    def __init__(self, mime_type: _Optional[str] = ..., size_bytes: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class MediaRef(_message.Message):
    __slots__ = ("id", "size_bytes", "mime_type", "ttl_s")
    ID_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    MIME_TYPE_FIELD_NUMBER: _ClassVar[int]
    TTL_S_FIELD_NUMBER: _ClassVar[int]
    id: str
    size_bytes: int
    mime_type: str
    ttl_s: float
    def __init__(self, id: _Optional[str] = ..., size_bytes: _Optional[int] = ..., mime_type: _Optional[str] = ..., ttl_s: _Optional[float] = ...) -> None: ...

class LiveRequest(_message.Message):
    __slots__ = ("open", "frame", "question", "cancel_question_id", "stream_chunk")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    FRAME_FIELD_NUMBER: _ClassVar[int]
    QUESTION_FIELD_NUMBER: _ClassVar[int]
    CANCEL_QUESTION_ID_FIELD_NUMBER: _ClassVar[int]
    STREAM_CHUNK_FIELD_NUMBER: _ClassVar[int]
    open: LiveOpen
    frame: LiveFrame
    question: LiveQuestion
    cancel_question_id: str
    stream_chunk: bytes
    def __init__(self, open: _Optional[_Union[LiveOpen, _Mapping]] = ..., frame: _Optional[_Union[LiveFrame, _Mapping]] = ..., question: _Optional[_Union[LiveQuestion, _Mapping]] = ..., cancel_question_id: _Optional[str] = ..., stream_chunk: _Optional[bytes] = ...) -> None: ...

class LiveOpen(_message.Message):
    __slots__ = ("session_id", "system_prompt", "max_history_frames", "max_history_s", "max_tokens_per_frame", "fall_behind", "max_pending_frames", "stream_fps")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_PROMPT_FIELD_NUMBER: _ClassVar[int]
    MAX_HISTORY_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MAX_HISTORY_S_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_FRAME_FIELD_NUMBER: _ClassVar[int]
    FALL_BEHIND_FIELD_NUMBER: _ClassVar[int]
    MAX_PENDING_FRAMES_FIELD_NUMBER: _ClassVar[int]
    STREAM_FPS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    system_prompt: str
    max_history_frames: int
    max_history_s: float
    max_tokens_per_frame: int
    fall_behind: LiveFallBehind
    max_pending_frames: int
    stream_fps: float
    def __init__(self, session_id: _Optional[str] = ..., system_prompt: _Optional[str] = ..., max_history_frames: _Optional[int] = ..., max_history_s: _Optional[float] = ..., max_tokens_per_frame: _Optional[int] = ..., fall_behind: _Optional[_Union[LiveFallBehind, str]] = ..., max_pending_frames: _Optional[int] = ..., stream_fps: _Optional[float] = ...) -> None: ...

class LiveFrame(_message.Message):
    __slots__ = ("image", "time_s")
    IMAGE_FIELD_NUMBER: _ClassVar[int]
    TIME_S_FIELD_NUMBER: _ClassVar[int]
    image: bytes
    time_s: float
    def __init__(self, image: _Optional[bytes] = ..., time_s: _Optional[float] = ...) -> None: ...

class LiveQuestion(_message.Message):
    __slots__ = ("question_id", "messages", "sampling", "join_context")
    QUESTION_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    JOIN_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    question_id: str
    messages: _containers.RepeatedCompositeFieldContainer[Message]
    sampling: SamplingParams
    join_context: bool
    def __init__(self, question_id: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[Message, _Mapping]]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., join_context: _Optional[bool] = ...) -> None: ...

class LiveResponse(_message.Message):
    __slots__ = ("opened", "progress", "answer")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    opened: LiveOpened
    progress: LiveProgress
    answer: LiveAnswer
    def __init__(self, opened: _Optional[_Union[LiveOpened, _Mapping]] = ..., progress: _Optional[_Union[LiveProgress, _Mapping]] = ..., answer: _Optional[_Union[LiveAnswer, _Mapping]] = ...) -> None: ...

class LiveOpened(_message.Message):
    __slots__ = ("session_id", "max_history_frames", "max_history_s", "max_tokens_per_frame", "max_pending_frames", "fall_behind", "stream_fps")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    MAX_HISTORY_FRAMES_FIELD_NUMBER: _ClassVar[int]
    MAX_HISTORY_S_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_FRAME_FIELD_NUMBER: _ClassVar[int]
    MAX_PENDING_FRAMES_FIELD_NUMBER: _ClassVar[int]
    FALL_BEHIND_FIELD_NUMBER: _ClassVar[int]
    STREAM_FPS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    max_history_frames: int
    max_history_s: float
    max_tokens_per_frame: int
    max_pending_frames: int
    fall_behind: LiveFallBehind
    stream_fps: float
    def __init__(self, session_id: _Optional[str] = ..., max_history_frames: _Optional[int] = ..., max_history_s: _Optional[float] = ..., max_tokens_per_frame: _Optional[int] = ..., max_pending_frames: _Optional[int] = ..., fall_behind: _Optional[_Union[LiveFallBehind, str]] = ..., stream_fps: _Optional[float] = ...) -> None: ...

class LiveProgress(_message.Message):
    __slots__ = ("frames_received", "frames_prefilled", "frames_dropped", "frames_in_context", "lag_s", "rollovers")
    FRAMES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    FRAMES_PREFILLED_FIELD_NUMBER: _ClassVar[int]
    FRAMES_DROPPED_FIELD_NUMBER: _ClassVar[int]
    FRAMES_IN_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    LAG_S_FIELD_NUMBER: _ClassVar[int]
    ROLLOVERS_FIELD_NUMBER: _ClassVar[int]
    frames_received: int
    frames_prefilled: int
    frames_dropped: int
    frames_in_context: int
    lag_s: float
    rollovers: int
    def __init__(self, frames_received: _Optional[int] = ..., frames_prefilled: _Optional[int] = ..., frames_dropped: _Optional[int] = ..., frames_in_context: _Optional[int] = ..., lag_s: _Optional[float] = ..., rollovers: _Optional[int] = ...) -> None: ...

class LiveAnswer(_message.Message):
    __slots__ = ("question_id", "delta", "final", "error")
    QUESTION_ID_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    FINAL_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    question_id: str
    delta: Delta
    final: Final
    error: LiveError
    def __init__(self, question_id: _Optional[str] = ..., delta: _Optional[_Union[Delta, _Mapping]] = ..., final: _Optional[_Union[Final, _Mapping]] = ..., error: _Optional[_Union[LiveError, _Mapping]] = ...) -> None: ...

class LiveError(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...
