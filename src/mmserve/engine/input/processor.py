"""Engine-level chat inputs (raw bytes, no transport types) -> the engine's EngineRequest.

The edge validates the wire format and hands over `InputMessage`s; here the heavy work happens off
the event loop: decode videos and images in a worker pool under a time limit, turn pixels into
vision patches, decode audio (and, with use_audio_in_video, each video's soundtrack) and cut it into
segments of log-mel features, render the prompt layout, and check the result against the context
length and the configured limits before the engine ever sees it.

Work is bounded before it is done, cheapest check first: the text's length against the fewest
tokens it can become (on the loop, no tokenizing), then counts of images, audio clips and frames
(a container video counts one frame at least), then every
image's header (pixels and soft tokens, no decoding) and every audio clip's (its declared duration
and so its tokens), and only then decoding, one image at a time.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import functools
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mmserve.config import EngineConfig
from mmserve.engine.input.fair_pool import FairPool
from mmserve.engine.types import EngineRequest, SampledVideo
from mmserve.errors import InvalidInputError, LimitExceededError
from mmserve.metrics.tracing import (
    audio_decode_span,
    set_audio_decode_result,
    set_video_decode_result,
    video_decode_span,
)
from mmserve.model.messages import AudioPart, AudioSegment, ChatMessage, ImagePart, TextPart, VideoPart
from mmserve.model.prompt import PromptLayout, build_prompt, expand_anchors
from mmserve.model.spec import ModelSpec
from mmserve.model.tokenizer import load_tokenizer
from mmserve.multimodal.audio import AudioFeaturizer, Segment, check_audible, decode_audio, probe_duration
from mmserve.multimodal.decode_control import DecodeControl
from mmserve.multimodal.image import decode_image, read_header
from mmserve.multimodal.limits import MediaLimits
from mmserve.multimodal.memory import return_large_buffers
from mmserve.multimodal.preprocess import VisionBatch, num_soft_tokens, preprocess_images, target_size
from mmserve.multimodal.video import decode_video, sample_indices
from mmserve.request import AudioFeatures, MultiModalInput
from mmserve.sampling_params import SamplingParams

# How long past the time limit the event loop still waits for a worker stuck inside one packet.
DECODE_GRACE_S = 1.0


@dataclass(frozen=True)
class TextInput:
    text: str


@dataclass(frozen=True)
class ImageInput:
    """An image as encoded bytes (`data`), or uploaded media: `media_id` (the sha256 of its bytes)
    and, once the server has leased it, the spooled file's `path`."""

    data: bytes = b""
    mime_type: str = ""
    media_id: str = ""
    path: str = ""


@dataclass(frozen=True)
class VideoInput:
    """A video as container bytes (`data`), as already decoded frame images (`frames`), or as
    uploaded media (`media_id`, the sha256 of the container's bytes, and its spooled `path`)."""

    data: bytes = b""
    frames: tuple[bytes, ...] = ()
    frames_fps: float = 0.0  # rate of `frames`, for timestamps; 0 = one frame per second
    mime_type: str = ""
    num_frames: int = 0  # 0 = the server default
    fps: float = 0.0  # 0 = sample num_frames uniformly
    media_id: str = ""
    path: str = ""
    start_s: float = 0.0  # the window [start_s, end_s) to sample from; end_s 0 = to the end
    end_s: float = 0.0
    with_audio: bool = False  # use_audio_in_video: also hear the window's soundtrack (a container only)

    @property
    def counted_frames(self) -> int:
        """What this part counts against --max-frames-per-request before it is decoded: its given
        frames, the count it asks (without fps), else one: a container decodes to a frame at least or
        is refused, so a request cannot carry more containers than the limit into the decoder."""
        return len(self.frames) or (0 if self.fps else self.num_frames) or 1


@dataclass(frozen=True)
class AudioInput:
    """An audio clip as encoded bytes (`data`), or uploaded media (`media_id` and its spooled `path`),
    heard in the window [start_s, end_s) (end_s 0 = to the end)."""

    data: bytes = b""
    mime_type: str = ""
    media_id: str = ""
    path: str = ""
    start_s: float = 0.0
    end_s: float = 0.0


MediaInput = ImageInput | VideoInput | AudioInput
InputPart = TextInput | MediaInput


@dataclass(frozen=True)
class InputMessage:
    role: str
    parts: tuple[InputPart, ...]


@dataclass
class DecodedMedia:
    """One image or video after decoding and patchifying (one VisionBatch row per image/frame), or
    one audio clip after decoding and cutting (`audio`: its segments; a video's: its soundtrack's)."""

    batch: VisionBatch | None
    timestamps_s: list[float] | None  # None for an image or an audio clip
    duration_s: float = 0.0  # a container's (0 for images and given frames)
    audio: list[Segment] = dataclasses.field(default_factory=list)

    @property
    def num_ranges(self) -> int:
        """The soft-token runs this part becomes in the prompt: one per image, frame and audio segment."""
        visual = 0 if self.batch is None else len(self.timestamps_s) if self.timestamps_s is not None else 1
        return visual + len(self.audio)


def check_counted_frames(videos: Iterable[VideoInput], limit: int) -> None:
    """Refuse a request whose videos' frames known before decoding (`VideoInput.counted_frames`)
    exceed `limit` (--max-frames-per-request)."""
    frames = sum(video.counted_frames for video in videos)
    if frames > limit:
        raise InvalidInputError("messages", f"{frames} video frames at least (each video's given frames, its "
                                f"num_frames, or one), at most {limit} per request (--max-frames-per-request)")


def _naming(field: str, e: LimitExceededError) -> LimitExceededError:
    """The same limit error (its flag and status) with the request field it came from in front, as
    InvalidInputError names its field: a request with several audio parts learns which one."""
    named = copy.copy(e)
    named.args = (f"{field}: {e}",)
    return named


def _encoded(part: VideoInput | AudioInput) -> tuple[bytes | Path, int]:
    """A container part's bytes, or its spooled file, and its size."""
    if part.path:
        path = Path(part.path)
        return path, path.stat().st_size
    return part.data, len(part.data)


async def _all_or_none(coroutines: list) -> list:
    """Run concurrently; when one fails, cancel the others (so their decodes stop) and raise."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        task = None
        raise
    finally:
        tasks.clear()  # the failed task holds the error whose traceback holds this frame: no cycle


class InputProcessor:
    """Turns validated messages into an EngineRequest; shared by all requests of a server."""

    def __init__(self, config: EngineConfig, tokenizer, spec: ModelSpec, executor: Executor, *,
                 max_model_len: int, workers: int | None = None) -> None:
        """`workers`: the executor's threads (default: a ThreadPoolExecutor's own count)."""
        self.config = config
        self.tokenizer = tokenizer
        self.spec = spec
        self.pool = FairPool(executor, workers or getattr(executor, "_max_workers", 1))
        self.max_model_len = max_model_len
        self.limits = MediaLimits.from_config(config)
        self.featurizer = AudioFeaturizer(spec.audio) if spec.audio is not None else None
        return_large_buffers()  # decoded frames and payloads must not stay resident after a request

    @classmethod
    def from_checkpoint(cls, config: EngineConfig, executor: Executor, *, spec: ModelSpec, context_length: int,
                        workers: int | None = None) -> InputProcessor:
        """The served checkpoint's (`config.model`) tokenizer; `spec` its
        `load_spec_without_transformers`, which the caller has read once (the front end's perf model
        shares it)."""
        return cls(config, load_tokenizer(config.model), spec, executor, max_model_len=context_length,
                   workers=workers)

    async def process(self, request_id: str, messages: Sequence[InputMessage], sampling: SamplingParams, *,
                      priority: int = 0, trace_context: Any = None, arrival_time: float | None = None) -> EngineRequest:
        """`arrival_time` (time.monotonic(); default now) is when the server got the request: its
        timings count from there, so they include this processing (reported as preprocess_s)."""
        arrival = time.monotonic() if arrival_time is None else arrival_time
        owner = object()  # this request's share of the worker pool
        jobs = [(f"messages[{i}].parts[{j}]", part) for i, m in enumerate(messages) for j, part in enumerate(m.parts)
                if not isinstance(part, TextInput)]
        text_tokens = self.tokenizer.min_tokens(sum(len(p.text.strip()) for m in messages for p in m.parts
                                                    if isinstance(p, TextInput)))
        media, num_frames = await self._decode_all(owner, jobs, text_tokens, sampling, trace_context)
        chat = [ChatMessage(m.role, [self._model_part(f"messages[{i}].parts[{j}]", p, media)
                                     for j, p in enumerate(m.parts)]) for i, m in enumerate(messages)]
        render = functools.partial(build_prompt, self.tokenizer, self.spec, chat)
        return await self._request(owner, request_id, render, sampling, priority=priority,
                                   trace_context=trace_context, num_frames=num_frames, arrival=arrival, media=media)

    async def process_tokens(self, request_id: str, token_ids: Sequence[int], media: Sequence[MediaInput],
                             sampling: SamplingParams, *, where: str = "media", max_tokens_to_context: bool = False,
                             priority: int = 0, trace_context: Any = None,
                             arrival_time: float | None = None) -> EngineRequest:
        """A prompt rendered elsewhere (a gateway): `token_ids` hold one image/video anchor per item of
        `media`, in order. The media are decoded and each anchor expanded exactly as `process` lays
        out the same content, so both reach the engine alike (prefix cache included), after the
        same checks. `max_tokens_to_context`: `sampling.max_tokens` is only a cap; use what the
        context leaves."""
        arrival = time.monotonic() if arrival_time is None else arrival_time
        owner = object()
        jobs = [(f"{where}[{i}]", part) for i, part in enumerate(media)]
        early = dataclasses.replace(sampling, max_tokens=1, min_tokens=0) if max_tokens_to_context else sampling
        decoded, num_frames = await self._decode_all(owner, jobs, len(token_ids) - len(jobs), early, trace_context)
        parts = [self._model_part(w, p, decoded) for w, p in jobs]
        render = functools.partial(expand_anchors, self.tokenizer, self.spec, list(token_ids), parts)
        return await self._request(owner, request_id, render, sampling, priority=priority,
                                   trace_context=trace_context, num_frames=num_frames,
                                   max_tokens_to_context=max_tokens_to_context, arrival=arrival, media=decoded)

    async def process_frame(self, owner: object, data: bytes | np.ndarray,
                            max_soft_tokens: int) -> tuple[MultiModalInput, int]:
        """One live frame -> its vision input and soft-token count, in the pool under `owner`'s fair
        share. An encoded image is decoded straight to the size `max_soft_tokens` allows, like a
        VideoFrames frame of the same image; RGB pixels (a live stream's decoded frame) are resized as
        decode_video's frames are (same pixels, same content hash as a one-shot of that video)."""
        def work(control: DecodeControl) -> tuple[MultiModalInput, int]:
            control.check()
            if isinstance(data, np.ndarray):
                batch = self._patchify([data], max_soft_tokens)
                return MultiModalInput(batch.pixel_values[0], batch.position_ids[0]), int(batch.num_soft_tokens[0])
            try:
                image = decode_image(data, self.limits, fit=self._fit(max_soft_tokens))
            except InvalidInputError as e:
                raise InvalidInputError("frame.image", str(e).removeprefix(f"{e.field}: ")) from e
            batch = self._patchify([image], max_soft_tokens, resized=True)
            return MultiModalInput(batch.pixel_values[0], batch.position_ids[0]), int(batch.num_soft_tokens[0])
        return await self._in_pool(owner, "frame", work)

    async def process_layout(self, layout: PromptLayout, request_id: str, sampling: SamplingParams, *, num_frames: int,
                             max_tokens_to_context: bool = False, priority: int = 0,
                             trace_context: Any = None) -> EngineRequest:
        """A prompt laid out and patchified elsewhere (a gateway's own preprocessing), already
        checked to be our layout: held to the same count and length limits."""
        # (an audio item is a segment, so one clip at least; the door refuses preprocessed audio today)
        self._check_item_counts(images=sum(item.kind == "image" for item in layout.mm_items),
                                clips=sum(item.kind == "audio" for item in layout.mm_items))
        if num_frames > self.config.max_frames_per_request:
            raise InvalidInputError("messages", f"{num_frames} video frames, at most "
                                    f"{self.config.max_frames_per_request} per request (--max-frames-per-request)")
        return await self._request(object(), request_id, lambda: layout, sampling, priority=priority,
                                   trace_context=trace_context, num_frames=num_frames,
                                   max_tokens_to_context=max_tokens_to_context)

    async def _decode_all(self, owner: object, jobs: list[tuple[str, MediaInput]], text_tokens: int,
                          sampling: SamplingParams, trace_context: Any) -> tuple[dict[str, DecodedMedia], int]:
        """Check what is known before decoding (length lower bounds, counts, headers), decode every
        (field, part) concurrently, then check the request's decoded frame total."""
        self._check_length(text_tokens, sampling, at_least=True)
        self._check_counts(jobs)
        if any(self._header_sources(jobs)) or any(isinstance(part, AudioInput) for _, part in jobs):
            media_tokens = await self._in_pool(owner, "messages", functools.partial(self._headers_blocking, jobs))
            self._check_length(text_tokens + media_tokens, sampling, at_least=True)
        decoded = await _all_or_none([self._decode(owner, where, part, trace_context) for where, part in jobs])
        num_frames = sum(len(d.timestamps_s) for d in decoded if d.timestamps_s is not None)
        if num_frames > self.config.max_frames_per_request:
            raise InvalidInputError("messages", f"the videos decode to {num_frames} frames, at most "
                                    f"{self.config.max_frames_per_request} per request (--max-frames-per-request)")
        return {where: d for (where, _), d in zip(jobs, decoded, strict=True)}, num_frames

    async def _request(self, owner: object, request_id: str, render: Callable[[], PromptLayout],
                       sampling: SamplingParams, *, priority: int, trace_context: Any, num_frames: int,
                       max_tokens_to_context: bool = False, arrival: float | None = None,
                       media: dict[str, DecodedMedia] | None = None) -> EngineRequest:
        """The EngineRequest; timings count from `arrival` (default now), and the Final will list
        the frames each video part of `media` sampled."""
        arrival = time.monotonic() if arrival is None else arrival
        layout, mm_inputs = await self._in_pool(owner, "messages", functools.partial(self._layout_blocking, render),
                                                timed=False)
        if max_tokens_to_context:
            room = max(1, self.max_model_len - len(layout.token_ids))
            sampling = dataclasses.replace(sampling, max_tokens=min(sampling.max_tokens, room),
                                           min_tokens=min(sampling.min_tokens, room))
        self._check_length(len(layout.token_ids), sampling)
        videos = [SampledVideo(where, tuple(d.timestamps_s), d.duration_s) for where, d in (media or {}).items()
                  if d.timestamps_s is not None]
        return EngineRequest(
            request_id=request_id, prompt_token_ids=list(layout.token_ids), mm_ranges=list(layout.mm_ranges),
            mm_inputs=mm_inputs, sampling=sampling, priority=priority, trace_context=trace_context,
            num_frames=num_frames, num_mm_tokens=sum(end - start + 1 for start, end in layout.mm_ranges),
            arrival_time=arrival, preprocess_s=time.monotonic() - arrival, videos=videos,
            ranges_per_part={where: d.num_ranges for where, d in (media or {}).items()})

    @staticmethod
    def _layout_blocking(render: Callable[[], PromptLayout],
                         control: DecodeControl) -> tuple[PromptLayout, list[MultiModalInput]]:
        """Render the prompt, and name every image/frame by its content hash (the prefix and
        encoder caches' key), in the worker pool: hashing megabytes of pixels must not block the loop."""
        control.check()  # the request may have ended while this job waited for a worker
        layout = render()
        return layout, [AudioFeatures(item.features) if item.kind == "audio"
                        else MultiModalInput(pixel_values=item.pixel_values, position_ids=item.position_ids)
                        for item in layout.mm_items]

    def _check_counts(self, jobs: list[tuple[str, MediaInput]]) -> None:
        """What this model cannot hear, and the counts of image parts, audio clips and video frames (given,
        asked, or one a container): known before anything is read."""
        for where, part in jobs:
            if self.spec.audio is None and (isinstance(part, AudioInput)
                                            or isinstance(part, VideoInput) and part.with_audio):
                raise InvalidInputError(f"{where}.audio" if isinstance(part, AudioInput) else "use_audio_in_video",
                                        f"{self.model_name} has no audio tower: it takes "
                                        f"{', '.join(self.spec.modalities)}")
        self._check_item_counts(images=sum(isinstance(part, ImageInput) for _, part in jobs),
                                clips=sum(isinstance(part, AudioInput) for _, part in jobs))
        check_counted_frames((part for _, part in jobs if isinstance(part, VideoInput)),
                             self.config.max_frames_per_request)

    def _check_item_counts(self, *, images: int, clips: int) -> None:
        """Image parts and audio clips against their per-request limits, by count alone: a request of
        thousands of tiny clips (a few tokens each, so within the context) is refused before any is opened."""
        for count, limit, what, flag in (
                (images, self.limits.max_images_per_request, "images", "--max-images-per-request"),
                (clips, self.limits.max_audio_per_request, "audio parts", "--max-audio-per-request")):
            if count > limit:
                raise InvalidInputError("messages", f"{count} {what}, at most {limit} per request ({flag})")

    @property
    def model_name(self) -> str:
        return Path(self.config.model).name or str(self.config.model)

    def _headers_blocking(self, jobs: list[tuple[str, MediaInput]], control: DecodeControl) -> int:
        """Read every image's and given frame's header (no pixels): refuse the request once their pixels
        exceed its budget; and every audio clip's (its declared duration, refused over the limit);
        return their soft tokens, so the context check precedes decoding. A container video is
        bounded while it decodes (frames downscaled, counted after)."""
        pixels = tokens = 0
        for where, part in jobs:
            if isinstance(part, AudioInput):
                control.check()
                try:
                    declared = probe_duration(Path(part.path) if part.path else part.data, self.limits)
                except InvalidInputError as e:
                    raise InvalidInputError(f"{where}.audio", str(e).removeprefix(f"{e.field}: ")) from e
                except LimitExceededError as e:
                    raise _naming(f"{where}.audio", e) from e
                if declared is not None:
                    end = min(declared, part.end_s or declared)
                    tokens += self._audio_tokens(max(0.0, end - part.start_s))
        for field, source, max_soft in self._header_sources(jobs):
            control.check()
            try:
                header = read_header(source, self.limits)
            except InvalidInputError as e:
                raise InvalidInputError(field, str(e).removeprefix(f"{e.field}: ")) from e
            except LimitExceededError as e:
                raise _naming(field, e) from e
            pixels += header.pixels
            if pixels > self.limits.max_pixels_per_request:
                raise LimitExceededError(f"{field}: the request's images and frames hold more than "
                                         f"{self.limits.max_pixels_per_request} pixels", "--max-pixels-per-request")
            tokens += num_soft_tokens(header.height, header.width, patch_size=self.spec.patch_size,
                                      pooling_kernel_size=self.spec.pooling_kernel_size, max_soft_tokens=max_soft)
        return tokens

    def _audio_tokens(self, seconds: float) -> int:
        """Soft tokens of `seconds` of audio cut into segments (a lower bound: rounding down)."""
        spec = self.spec.audio
        samples = int(seconds * spec.sampling_rate)
        whole, rest = divmod(samples, spec.segment_samples)
        return whole * spec.max_soft_tokens + spec.num_soft_tokens(rest)

    def _header_sources(self, jobs: list[tuple[str, MediaInput]]):
        """(field, encoded image, its soft-token cap) for each image and given frame."""
        for where, part in jobs:
            if isinstance(part, ImageInput):
                yield f"{where}.image", Path(part.path) if part.path else part.data, self.spec.image_max_soft_tokens
            for k, frame in enumerate(part.frames if isinstance(part, VideoInput) else ()):
                yield f"{where}.video.frames[{k}]", frame, self.spec.video_max_soft_tokens

    def _check_length(self, prompt_tokens: int, sampling: SamplingParams, *, at_least: bool = False) -> None:
        """`at_least`: `prompt_tokens` is a lower bound known before tokenizing or decoding everything."""
        if not prompt_tokens and at_least:
            return
        size = f"at least {prompt_tokens}" if at_least else f"{prompt_tokens}"
        if prompt_tokens >= self.max_model_len:
            raise InvalidInputError("messages", f"the prompt is {size} tokens (frames included), the "
                                    f"context length is {self.max_model_len}: send fewer frames or less text")
        if prompt_tokens + sampling.max_tokens > self.max_model_len:
            # a lower bound's room is an upper bound: the rendered prompt takes more of it
            rest = " less the prompt's tokens not counted yet" if at_least else ""
            raise InvalidInputError("sampling.max_tokens", f"prompt {size} + max_tokens "
                                    f"{sampling.max_tokens} exceeds the context length {self.max_model_len}; "
                                    f"ask for at most {self.max_model_len - prompt_tokens}{rest}")

    async def _decode(self, owner: object, where: str, part: MediaInput, trace_context: Any) -> DecodedMedia:
        return await self._in_pool(owner, where, functools.partial(self._decode_blocking, where, part, trace_context))

    async def _in_pool(self, owner: object, label: str, work: Callable[[DecodeControl], Any], *,
                       timed: bool = True) -> Any:
        """Run `work(control)` on a worker (fairly shared between requests) under the decode time
        limit, which counts any wait for a free worker (`timed=False`: no limit, still cancellable).

        The worker checks `control` between packets/frames, so the limit, a client cancel or an Abort
        (both cancel this coroutine) really stop the work; the wait here gives up a little after the
        limit even if one step takes longer."""
        limit = self.config.video_decode_timeout_s if timed else None
        control = DecodeControl(limit, label=label)
        try:
            # asyncio.timeout, not wait_for: wait_for's frame holds a task holding the job's error,
            # whose traceback holds that frame (a cycle keeping the request's media alive)
            async with asyncio.timeout(None if limit is None else limit + DECODE_GRACE_S):
                return await self.pool.run(owner, functools.partial(work, control))
        except TimeoutError:
            raise control.timeout_error() from None
        finally:
            control.cancel()  # no-op once the worker returned; stops it when we stopped waiting

    def _decode_blocking(self, where: str, part: MediaInput, trace_context: Any,
                         control: DecodeControl) -> DecodedMedia:
        control.check()  # the limit may have passed while this job waited for a worker
        try:
            if isinstance(part, AudioInput):
                source, num_bytes = _encoded(part)
                with audio_decode_span(trace_context, num_bytes=num_bytes) as span:
                    audio = decode_audio(source, rate=self.spec.audio.sampling_rate, start_s=part.start_s,
                                         end_s=part.end_s or None, limits=self.limits, control=control)
                    segments = self.featurizer.segments(audio.samples, part.start_s, control)
                    set_audio_decode_result(span, audio, segments)
                return DecodedMedia(None, None, audio.duration_s, segments)
            if isinstance(part, ImageInput):
                image = decode_image(Path(part.path) if part.path else part.data, self.limits,
                                     fit=self._fit(self.spec.image_max_soft_tokens))
                return DecodedMedia(self._patchify([image], self.spec.image_max_soft_tokens, resized=True), None)
            if part.frames:
                rate = part.frames_fps or 1.0
                return DecodedMedia(self._patchify(self._frames(part.frames, control), self.spec.video_max_soft_tokens,
                                                   count=len(part.frames), resized=True),
                                    [k / rate for k in range(len(part.frames))])
            source, num_bytes = _encoded(part)
            rate = self.spec.audio.sampling_rate if part.with_audio else 0
            with video_decode_span(trace_context, num_bytes=num_bytes) as span:
                video = decode_video(source, num_frames=None if part.fps else (part.num_frames or None),
                                     fps=part.fps or None, start_s=part.start_s, end_s=part.end_s or None,
                                     limits=self.limits, control=control, audio_rate=rate or None)
                soundtrack = []
                if video.soundtrack is not None:
                    check_audible(video.soundtrack, rate, "the video's soundtrack")
                    soundtrack = self.featurizer.segments(video.soundtrack, video.soundtrack_start_s, control)
                set_video_decode_result(span, video, sample_rate=rate, soundtrack=soundtrack)
            frames, times = video.frames, video.timestamps_s
            if part.fps and part.num_frames and len(frames) > part.num_frames:
                keep = sample_indices(len(frames), part.num_frames)  # fps sampling, capped at num_frames
                frames, times = [frames[k] for k in keep], [times[k] for k in keep]
            return DecodedMedia(self._patchify(frames, self.spec.video_max_soft_tokens), list(times), video.duration_s,
                                soundtrack)
        except InvalidInputError as e:
            # Re-anchor the decoder's error at the request field, keeping its explanation.
            kind = {ImageInput: "image", VideoInput: "video", AudioInput: "audio"}[type(part)]
            raise InvalidInputError(f"{where}.{kind}", str(e).removeprefix(f"{e.field}: ")) from e
        except LimitExceededError as e:
            if isinstance(part, AudioInput):   # a clip that decodes past the duration limit: which one
                raise _naming(f"{where}.audio", e) from e
            raise

    def _frames(self, frames: tuple[bytes, ...], control: DecodeControl):
        """Given frame images decoded one at a time, as the patchifier asks for the next, each straight
        to the model's resolution: one full-size frame is held (in Pillow), never the whole list."""
        fit = self._fit(self.spec.video_max_soft_tokens)
        for frame in frames:
            control.check()
            yield decode_image(frame, self.limits, fit=fit)

    def _fit(self, max_soft_tokens: int) -> Callable[[int, int], tuple[int, int]]:
        """The preprocessing's resize rule, for decode_image to apply while decoding."""
        return functools.partial(target_size, patch_size=self.spec.patch_size,
                                 pooling_kernel_size=self.spec.pooling_kernel_size, max_soft_tokens=max_soft_tokens)

    def _patchify(self, images, max_soft_tokens: int, *, count: int | None = None,
                  resized: bool = False) -> VisionBatch:
        """Patches and positions, refused (INVALID_ARGUMENT) when an elongated image needs positions past
        the encoder's table: the tower's own guard would end the request INTERNAL. Gemma 4's table
        (10240) outreaches any budget (3 x 1120 along a side); a small checkpoint's may not."""
        batch = preprocess_images(images, patch_size=self.spec.patch_size, pooling_kernel_size=self.spec.pooling_kernel_size,
                                  max_soft_tokens=max_soft_tokens, count=count, resized=resized)
        table = self.spec.vision.position_table if self.spec.vision is not None else 0
        reach = int(batch.position_ids.max()) + 1 if batch.position_ids.numel() else 0
        if table and reach > table:
            raise InvalidInputError("image", f"its aspect ratio needs {reach} patch positions along one side at this "
                                             f"model's resolution, more than the {table} its vision encoder holds: "
                                             "send a less elongated image or video")
        return batch

    @staticmethod
    def _model_part(where: str, part: InputPart, media: dict[str, DecodedMedia]):
        if isinstance(part, TextInput):
            return TextPart(part.text)
        decoded = media[where]
        batch = decoded.batch
        segments = [AudioSegment(s.features, s.num_soft_tokens, s.start_s) for s in decoded.audio]
        if isinstance(part, AudioInput):
            return AudioPart(segments)
        if decoded.timestamps_s is None:
            return ImagePart(batch.pixel_values[0], batch.position_ids[0], batch.num_soft_tokens[0])
        return VideoPart(batch.pixel_values, batch.position_ids, list(batch.num_soft_tokens), decoded.timestamps_s,
                         segments)
