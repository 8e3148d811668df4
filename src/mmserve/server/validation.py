"""Wire format -> engine-level inputs, refusing bad requests with the offending field's name.

Everything checkable without decoding media is checked here, before any work is queued, so a
client learns about a typo in microseconds instead of after a video decode. Field names follow
the proto path (`messages[0].parts[1].video.mime_type`) so a client author can find the field.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import uuid
from collections.abc import Mapping
from dataclasses import dataclass

from mmserve.api import pb
from mmserve.config import EngineConfig
from mmserve.engine.input.processor import (
    AudioInput,
    ImageInput,
    InputMessage,
    InputPart,
    TextInput,
    VideoInput,
    check_counted_frames,
)
from mmserve.errors import InvalidInputError
from mmserve.sampling_params import (
    MAX_BIAS,
    MAX_LOGIT_BIAS,
    MAX_TOP_LOGPROBS,
    ResponseFormat,
    SamplingParams,
)
from mmserve.server.media_store import MEDIA_ID
from mmserve.structured_output.compiler import FormatCompiler

ROLES = ("system", "user", "assistant")
IMAGE_MIME_TYPES = frozenset({"image/png", "image/jpeg", "image/jpg", "image/webp", "image/gif", "image/bmp",
                              "image/tiff"})
# The containers the decoder accepts (it sniffs the real format from the bytes; the type is a hint).
VIDEO_MIME_TYPES = frozenset({"video/mp4", "video/quicktime", "video/3gpp", "video/webm", "video/x-matroska",
                              "video/matroska", "video/x-msvideo", "video/avi", "video/msvideo", "video/mp2t",
                              "image/gif", "image/webp"})  # animations sent as a video are decoded as one
AUDIO_MIME_TYPES = frozenset({"audio/wav", "audio/x-wav", "audio/wave", "audio/vnd.wave", "audio/flac",
                              "audio/x-flac", "audio/mpeg", "audio/mp3", "audio/ogg", "audio/opus", "audio/vorbis",
                              "audio/mp4", "audio/m4a", "audio/x-m4a", "audio/aac", "audio/webm"})
DEFAULT_MAX_TOKENS = 16
MAX_REQUEST_ID_CHARS = 128
MAX_STOP_STRING_CHARS = 256


@dataclass(frozen=True)
class ValidatedRequest:
    request_id: str
    messages: tuple[InputMessage, ...]
    sampling: SamplingParams
    priority: int  # higher runs first, on the wire and in the scheduler


def validate_request(request: pb.GenerateRequest, config: EngineConfig) -> ValidatedRequest:
    """Check a GenerateRequest and convert it; raises InvalidInputError naming the field."""
    messages = _messages(request.messages, config, with_audio=request.use_audio_in_video)
    return ValidatedRequest(
        request_id=_request_id(request.request_id),
        messages=messages,
        sampling=validate_sampling(request.sampling, config),
        priority=request.priority,
    )


def _request_id(value: str) -> str:
    if not value:
        return uuid.uuid4().hex
    if len(value) > MAX_REQUEST_ID_CHARS:
        raise InvalidInputError("request_id", f"at most {MAX_REQUEST_ID_CHARS} characters, got {len(value)}")
    if not value.isprintable():
        raise InvalidInputError("request_id", "must be printable characters only")
    return value


def _messages(messages, config: EngineConfig, *, with_audio: bool = False) -> tuple[InputMessage, ...]:
    """`with_audio` (use_audio_in_video): every video part also brings its soundtrack."""
    if not messages:
        raise InvalidInputError("messages", "at least one message is required")
    out = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if message.role not in ROLES:
            raise InvalidInputError(f"{where}.role", f"unknown role {message.role!r}; use one of {', '.join(ROLES)}")
        if not message.parts:
            raise InvalidInputError(f"{where}.parts", "a message needs at least one part")
        parts = tuple(_part(part, f"{where}.parts[{j}]", config, with_audio) for j, part in enumerate(message.parts))
        out.append(InputMessage(role=message.role, parts=parts))
    if not any(_has_content(p) for m in out for p in m.parts):
        raise InvalidInputError("messages", "the prompt is empty: give some text, an image, a video or audio")
    # Frames known before decoding; defaults and fps sampling depend on the clip, so the input
    # processor checks the decoded total again.
    check_counted_frames((p for m in out for p in m.parts if isinstance(p, VideoInput)), config.max_frames_per_request)
    return tuple(out)


def _has_content(part: InputPart) -> bool:
    return not isinstance(part, TextInput) or bool(part.text.strip())


def _part(part: pb.Part, where: str, config: EngineConfig, with_audio: bool = False) -> InputPart:
    kind = part.WhichOneof("content")
    if kind == "text":
        return TextInput(part.text)
    if kind == "image":
        return _image(part.image, f"{where}.image")
    if kind == "video":
        video = _video(part.video, f"{where}.video", config)
        if with_audio and video.frames:
            raise InvalidInputError(f"{where}.video.frames", "use_audio_in_video hears a container's soundtrack; "
                                    "given frames carry no sound (send the container, or an audio part beside them)")
        return dataclasses.replace(video, with_audio=with_audio)
    if kind == "audio":
        return _audio(part.audio, f"{where}.audio")
    raise InvalidInputError(where, "empty part: set one of text, image, video or audio")


def _audio(audio: pb.Audio, where: str) -> AudioInput:
    _mime(audio.mime_type, AUDIO_MIME_TYPES, f"{where}.mime_type")
    _window(audio, where)
    window = dict(mime_type=audio.mime_type, start_s=audio.start_s, end_s=audio.end_s)
    if audio.media_id:
        if audio.data:
            raise InvalidInputError(f"{where}.media_id", "set data or media_id, not both")
        return AudioInput(media_id=_media_id(audio.media_id, f"{where}.media_id"), **window)
    if not audio.data:
        raise InvalidInputError(f"{where}.data", "empty audio bytes")
    return AudioInput(data=audio.data, **window)


def _image(image: pb.Image, where: str) -> ImageInput:
    _mime(image.mime_type, IMAGE_MIME_TYPES, f"{where}.mime_type")
    if image.media_id:
        if image.data:
            raise InvalidInputError(f"{where}.media_id", "set data or media_id, not both")
        return ImageInput(mime_type=image.mime_type, media_id=_media_id(image.media_id, f"{where}.media_id"))
    if not image.data:
        raise InvalidInputError(f"{where}.data", "empty image bytes")
    return ImageInput(data=image.data, mime_type=image.mime_type)


def _media_id(value: str, where: str) -> str:
    """An UploadMedia id: the sha256 of the bytes, 64 hex digits."""
    media_id = value.lower()
    if not MEDIA_ID.fullmatch(media_id):
        raise InvalidInputError(where, f"{value[:80]!r} is not a media id (the 64 hex digits UploadMedia returned)")
    return media_id


def _video(video: pb.Video, where: str, config: EngineConfig) -> VideoInput:
    _mime(video.mime_type, VIDEO_MIME_TYPES, f"{where}.mime_type")
    if video.num_frames < 0:
        raise InvalidInputError(f"{where}.num_frames", f"must be >= 0, got {video.num_frames}")
    if video.num_frames > config.max_frames_per_video:
        raise InvalidInputError(f"{where}.num_frames", f"{video.num_frames} frames asked, at most "
                                f"{config.max_frames_per_video} per video (--max-frames-per-video)")
    if not math.isfinite(video.fps) or video.fps < 0:
        raise InvalidInputError(f"{where}.fps", f"must be a finite number >= 0, got {video.fps}")
    _window(video, where)
    source = video.WhichOneof("source")
    sampling = dict(mime_type=video.mime_type, num_frames=video.num_frames, fps=video.fps, start_s=video.start_s,
                    end_s=video.end_s)
    if source == "data":
        if not video.data:
            raise InvalidInputError(f"{where}.data", "empty video bytes")
        return VideoInput(data=video.data, **sampling)
    if source == "media_id":
        return VideoInput(media_id=_media_id(video.media_id, f"{where}.media_id"), **sampling)
    if source == "frames":
        if video.start_s or video.end_s:
            raise InvalidInputError(f"{where}.start_s", "a window applies to a container (data or media_id), "
                                    "not to frames: send only the frames you want")
        if video.num_frames or video.fps:   # every given frame is used: a count or rate would be ignored
            raise InvalidInputError(f"{where}.{'num_frames' if video.num_frames else 'fps'}", "frame sampling "
                                    "applies to a container (data or media_id), not to frames: send only the "
                                    "frames you want (their rate goes in frames.fps)")
        frames = video.frames
        if not frames.frames:
            raise InvalidInputError(f"{where}.frames.frames", "no frames given")
        if len(frames.frames) > config.max_frames_per_video:
            raise InvalidInputError(f"{where}.frames.frames", f"{len(frames.frames)} frames given, at most "
                                    f"{config.max_frames_per_video} per video (--max-frames-per-video)")
        if not math.isfinite(frames.fps) or frames.fps < 0:
            raise InvalidInputError(f"{where}.frames.fps", f"must be a finite number >= 0, got {frames.fps}")
        images = tuple(_image(f, f"{where}.frames.frames[{k}]").data for k, f in enumerate(frames.frames))
        return VideoInput(frames=images, frames_fps=frames.fps, mime_type=video.mime_type)
    raise InvalidInputError(f"{where}.source", "set one of data (container bytes), frames or media_id")


def _window(media: pb.Video | pb.Audio, where: str) -> None:
    """The window's own consistency; whether it fits the clip is known only once it is opened."""
    if not math.isfinite(media.start_s) or media.start_s < 0:
        raise InvalidInputError(f"{where}.start_s", f"must be a number of seconds >= 0, got {media.start_s}")
    if not math.isfinite(media.end_s) or media.end_s < 0:
        raise InvalidInputError(f"{where}.end_s", f"must be a number of seconds >= 0 (0 = to the end), got "
                                f"{media.end_s}")
    if media.end_s and media.end_s <= media.start_s:
        raise InvalidInputError(f"{where}.end_s", f"the window ends ({media.end_s:g} s) at or before it starts "
                                f"({media.start_s:g} s)")


def _mime(mime_type: str, allowed: frozenset[str], where: str) -> None:
    if mime_type and mime_type.lower() not in allowed:
        raise InvalidInputError(where, f"unsupported mime type {mime_type!r}; use one of "
                                f"{', '.join(sorted(allowed))} or leave it empty to sniff")


def validate_sampling(sampling: pb.SamplingParams, config: EngineConfig) -> SamplingParams:
    """Proto sampling fields -> the engine's SamplingParams, with proto defaults applied."""
    if sampling.max_tokens < 0:
        raise InvalidInputError("sampling.max_tokens", f"must be > 0 (or 0 for the default), got {sampling.max_tokens}")
    if sampling.max_tokens > config.max_tokens_limit:
        raise InvalidInputError("sampling.max_tokens", f"{sampling.max_tokens} is above the server limit "
                                f"{config.max_tokens_limit} (--max-tokens-limit)")
    temperature = sampling.temperature if sampling.HasField("temperature") else 1.0
    if not math.isfinite(temperature) or temperature < 0:
        raise InvalidInputError("sampling.temperature", f"must be >= 0 (0 = greedy), got {temperature}")
    top_p = sampling.top_p if sampling.HasField("top_p") else 1.0
    if not (0.0 < top_p <= 1.0):
        raise InvalidInputError("sampling.top_p", f"must be in (0, 1], got {top_p}")
    if sampling.top_k < 0:
        raise InvalidInputError("sampling.top_k", f"must be >= 0 (0 = disabled), got {sampling.top_k}")
    if len(sampling.stop) > config.max_stop_strings:
        raise InvalidInputError("sampling.stop", f"{len(sampling.stop)} stop strings, at most "
                                f"{config.max_stop_strings} (--max-stop-strings)")
    for i, stop in enumerate(sampling.stop):
        if not stop or len(stop) > MAX_STOP_STRING_CHARS:
            raise InvalidInputError(f"sampling.stop[{i}]", f"must be 1 to {MAX_STOP_STRING_CHARS} characters")
    max_tokens = sampling.max_tokens or min(DEFAULT_MAX_TOKENS, config.max_tokens_limit)
    _check_extras(sampling, max_tokens)
    if not 0 <= sampling.n <= config.max_n:
        raise InvalidInputError("sampling.n", f"must be in 1..{config.max_n} (0 = 1), got {sampling.n} (--max-n)")
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=sampling.top_k,
        seed=sampling.seed if sampling.HasField("seed") else None,
        stop=tuple(sampling.stop),
        ignore_eos=sampling.ignore_eos,
        logprobs=sampling.logprobs,
        top_logprobs=sampling.top_logprobs,
        prompt_logprobs=sampling.prompt_logprobs,
        presence_penalty=sampling.presence_penalty,
        frequency_penalty=sampling.frequency_penalty,
        repetition_penalty=sampling.repetition_penalty if sampling.HasField("repetition_penalty") else 1.0,
        min_tokens=sampling.min_tokens,
        logit_bias=tuple(sampling.logit_bias.items()),
        response_format=_response_format(sampling, config),
        n=sampling.n or 1,
        disable_speculation=sampling.disable_speculation,
    )


def _check_extras(sampling: pb.SamplingParams, max_tokens: int) -> None:
    """Logprobs, penalties, min_tokens and logit_bias: ranges, with the proto path in every message."""
    if not 0 <= sampling.top_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidInputError("sampling.top_logprobs", f"must be in 0..{MAX_TOP_LOGPROBS}, got {sampling.top_logprobs}")
    if sampling.top_logprobs and not (sampling.logprobs or sampling.prompt_logprobs):
        raise InvalidInputError("sampling.top_logprobs", "needs logprobs or prompt_logprobs set")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(sampling, name)
        if not (math.isfinite(value) and -2.0 <= value <= 2.0):
            raise InvalidInputError(f"sampling.{name}", f"must be in [-2, 2] (0 = off), got {value}")
    if sampling.HasField("repetition_penalty"):
        rp = sampling.repetition_penalty
        if not (math.isfinite(rp) and 0.0 < rp <= 10.0):
            raise InvalidInputError("sampling.repetition_penalty", f"must be in (0, 10] (1 = off), got {rp}")
    if not 0 <= sampling.min_tokens <= max_tokens:
        raise InvalidInputError("sampling.min_tokens", f"must be in 0..max_tokens ({max_tokens}), got {sampling.min_tokens}")
    check_logit_bias(sampling.logit_bias, "sampling.logit_bias")


def check_logit_bias(logit_bias: Mapping[int, float], field: str) -> None:
    """At most MAX_LOGIT_BIAS entries, token ids >= 0, finite biases within MAX_BIAS (both front doors)."""
    if len(logit_bias) > MAX_LOGIT_BIAS:
        raise InvalidInputError(field, f"{len(logit_bias)} entries, at most {MAX_LOGIT_BIAS}")
    for token, bias in logit_bias.items():
        if token < 0:
            raise InvalidInputError(f"{field}[{token}]", "token ids are >= 0")
        if not (math.isfinite(bias) and abs(bias) <= MAX_BIAS):
            raise InvalidInputError(f"{field}[{token}]", f"bias must be in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got {bias}")


def _response_format(sampling: pb.SamplingParams, config: EngineConfig) -> ResponseFormat | None:
    if not sampling.HasField("response_format"):
        return None
    kind = sampling.response_format.WhichOneof("format")
    where = "sampling.response_format"
    if kind is None:
        raise InvalidInputError(where, "set one of json_schema, regex or grammar")
    if sampling.ignore_eos:
        raise InvalidInputError("sampling.ignore_eos", "cannot be combined with response_format (the grammar decides the end)")
    if sampling.min_tokens:
        raise InvalidInputError("sampling.min_tokens", "cannot be combined with response_format (the grammar decides the length)")
    spec = getattr(sampling.response_format, kind)
    if not spec:
        raise InvalidInputError(f"{where}.{kind}", "must not be empty")
    if len(spec) > config.max_response_format_chars:
        raise InvalidInputError(f"{where}.{kind}", f"{len(spec)} characters, at most "
                                f"{config.max_response_format_chars} (--max-response-format-chars)")
    depth = nesting_depth(kind, spec)
    if depth > config.max_response_format_depth:
        raise InvalidInputError(f"{where}.{kind}", f"nested {depth} deep, at most {config.max_response_format_depth} "
                                "(--max-response-format-depth)")
    if kind == "json_schema":
        try:
            schema = json.loads(spec)
        except ValueError as e:
            raise InvalidInputError(f"{where}.{kind}", f"not valid JSON: {e}") from None
        if not isinstance(schema, dict | bool):
            raise InvalidInputError(f"{where}.{kind}", "a JSON schema is an object (or true/false)")
    return ResponseFormat(kind, spec)


def nesting_depth(kind: str, text: str) -> int:
    """How deep a response_format nests, counted without parsing it (so the bound holds before any
    parser recurses): JSON objects and arrays outside strings; parentheses of a regex or grammar
    outside character classes (and a grammar's quoted strings)."""
    opens, closes = ("{[", "}]") if kind == "json_schema" else ("(", ")")
    quote = None if kind == "regex" else '"'
    depth = deepest = 0
    in_string = in_class = escaped = False
    for ch in text:
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif in_string:
            in_string = ch != quote
        elif in_class:
            in_class = ch != "]"
        elif ch == quote:
            in_string = True
        elif ch == "[" and kind != "json_schema":
            in_class = True
        elif ch in opens:
            depth += 1
            deepest = max(deepest, depth)
        elif ch in closes:
            depth = max(0, depth - 1)
    return deepest


async def check_response_format(fmt: ResponseFormat | None, processor, config: EngineConfig) -> None:
    """Compile the request's response_format in the front end's compile worker (never on the event
    loop): INVALID_ARGUMENT when it is malformed, matches nothing or is over the compile time limit.
    Without a tokenizer there is nothing to compile against; the engine refuses such a request."""
    if fmt is None or processor.tokenizer is None:
        return
    spec = processor.spec
    compiler = _front_end_compiler(processor.tokenizer, spec.vocab_size, tuple(sorted(spec.eos_token_ids)),
                                   config.grammar_cache_bytes, config.grammar_compile_timeout_s)
    await compiler.check(fmt)


@functools.cache
def _front_end_compiler(tokenizer, vocab_size: int, eos_token_ids: tuple[int, ...], cache_bytes: int,
                        timeout_s: float) -> FormatCompiler:
    """One compiler (worker and cache) per served tokenizer and limits: in effect one per server."""
    return FormatCompiler(tokenizer, vocab_size, eos_token_ids, cache_bytes=cache_bytes, timeout_s=timeout_s)
