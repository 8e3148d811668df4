"""Engine-level chat inputs (raw bytes, no transport types) -> the engine's EngineRequest.

The edge validates the wire format and hands over `InputMessage`s; here the heavy work happens off
the event loop: decode videos and images in a worker pool under a time limit, turn pixels into
vision patches, render the prompt layout, and check the result against the context length and the
configured limits before the engine ever sees it.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

import numpy as np

from mmserve.config import EngineConfig
from mmserve.engine.sampling_params import SamplingParams
from mmserve.engine.types import EngineRequest
from mmserve.errors import InvalidInputError, LimitExceededError
from mmserve.metrics.tracing import set_video_decode_result, video_decode_span
from mmserve.model.messages import ChatMessage, ImagePart, TextPart, VideoPart
from mmserve.model.prompt import build_prompt
from mmserve.model.spec import ModelSpec, load_spec
from mmserve.model.tokenizer import load_tokenizer
from mmserve.multimodal.image import decode_image
from mmserve.multimodal.limits import MediaLimits
from mmserve.multimodal.preprocess import VisionBatch, preprocess_images
from mmserve.multimodal.video import decode_video, sample_indices
from mmserve.scheduler.request import MultiModalInput


@dataclass(frozen=True)
class TextInput:
    text: str


@dataclass(frozen=True)
class ImageInput:
    data: bytes
    mime_type: str = ""


@dataclass(frozen=True)
class VideoInput:
    """A video as container bytes (`data`) or as already decoded frame images (`frames`)."""

    data: bytes = b""
    frames: tuple[bytes, ...] = ()
    frames_fps: float = 0.0  # rate of `frames`, for timestamps; 0 = one frame per second
    mime_type: str = ""
    num_frames: int = 0  # 0 = the server default
    fps: float = 0.0  # 0 = sample num_frames uniformly


InputPart = TextInput | ImageInput | VideoInput


@dataclass(frozen=True)
class InputMessage:
    role: str
    parts: tuple[InputPart, ...]


@dataclass
class DecodedMedia:
    """One image or video after decoding and patchifying: one VisionBatch row per image/frame."""

    batch: VisionBatch
    timestamps_s: list[float] | None  # None for an image


class InputProcessor:
    """Turns validated messages into an EngineRequest; shared by all requests of a server."""

    def __init__(self, config: EngineConfig, tokenizer, spec: ModelSpec, executor: Executor, *,
                 max_model_len: int) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.spec = spec
        self.executor = executor
        self.max_model_len = max_model_len
        self.limits = MediaLimits.from_config(config)

    @classmethod
    def from_checkpoint(cls, config: EngineConfig, executor: Executor, *, context_length: int) -> InputProcessor:
        """Tokenizer and vision settings from the served checkpoint (`config.model`)."""
        return cls(config, load_tokenizer(config.model), load_spec(config.model), executor,
                   max_model_len=context_length)

    async def process(self, request_id: str, messages: Sequence[InputMessage], sampling: SamplingParams, *,
                      priority: int = 0, trace_context: Any = None) -> EngineRequest:
        jobs = [(f"messages[{i}].parts[{j}]", part) for i, m in enumerate(messages) for j, part in enumerate(m.parts)
                if not isinstance(part, TextInput)]
        decoded = await asyncio.gather(*(self._decode(where, part, trace_context) for where, part in jobs))
        media = {where: d for (where, _), d in zip(jobs, decoded, strict=True)}
        num_frames = sum(len(d.timestamps_s) for d in decoded if d.timestamps_s is not None)
        if num_frames > self.config.max_frames_per_request:
            raise InvalidInputError("messages", f"the videos decode to {num_frames} frames, at most "
                                    f"{self.config.max_frames_per_request} per request (--max-frames-per-request)")
        chat = [ChatMessage(m.role, [self._model_part(f"messages[{i}].parts[{j}]", p, media)
                                     for j, p in enumerate(m.parts)]) for i, m in enumerate(messages)]
        loop = asyncio.get_running_loop()
        layout = await loop.run_in_executor(self.executor, build_prompt, self.tokenizer, self.spec, chat)
        self._check_length(len(layout.token_ids), sampling)
        mm_inputs = [MultiModalInput(pixel_values=item.pixel_values, position_ids=item.position_ids)
                     for item in layout.mm_items]
        return EngineRequest(
            request_id=request_id, prompt_token_ids=list(layout.token_ids), mm_ranges=list(layout.mm_ranges),
            mm_inputs=mm_inputs, sampling=sampling, priority=priority, trace_context=trace_context,
            num_frames=num_frames, num_mm_tokens=sum(end - start + 1 for start, end in layout.mm_ranges))

    def _check_length(self, prompt_tokens: int, sampling: SamplingParams) -> None:
        if prompt_tokens >= self.max_model_len:
            raise InvalidInputError("messages", f"the prompt is {prompt_tokens} tokens (frames included), the "
                                    f"context length is {self.max_model_len}: send fewer frames or less text")
        if prompt_tokens + sampling.max_tokens > self.max_model_len:
            raise InvalidInputError("sampling.max_tokens", f"prompt {prompt_tokens} + max_tokens "
                                    f"{sampling.max_tokens} exceeds the context length {self.max_model_len}; "
                                    f"ask for at most {self.max_model_len - prompt_tokens}")

    async def _decode(self, where: str, part: ImageInput | VideoInput, trace_context: Any) -> DecodedMedia:
        """Decode in the worker pool; the time limit keeps one slow payload from holding a request."""
        loop = asyncio.get_running_loop()
        work = functools.partial(self._decode_blocking, where, part, trace_context)
        limit = self.config.video_decode_timeout_s
        try:
            return await asyncio.wait_for(loop.run_in_executor(self.executor, work), timeout=limit)
        except TimeoutError:
            raise LimitExceededError(f"{where}: decoding (with any wait for a free decode worker) took longer "
                                     f"than {limit:g}s",
                                     "--video-decode-timeout-s") from None

    def _decode_blocking(self, where: str, part: ImageInput | VideoInput, trace_context: Any) -> DecodedMedia:
        try:
            if isinstance(part, ImageInput):
                image = decode_image(part.data, self.limits)
                return DecodedMedia(self._patchify([image], self.spec.image_max_soft_tokens), None)
            if part.frames:
                frames = [decode_image(f, self.limits) for f in part.frames]
                rate = part.frames_fps or 1.0
                return DecodedMedia(self._patchify(frames, self.spec.video_max_soft_tokens),
                                    [k / rate for k in range(len(frames))])
            with video_decode_span(trace_context, num_bytes=len(part.data)) as span:
                video = decode_video(part.data, num_frames=None if part.fps else (part.num_frames or None),
                                     fps=part.fps or None, limits=self.limits)
                set_video_decode_result(span, num_frames=len(video.frames), duration_s=video.duration_s,
                                        frame_bytes=sum(f.nbytes for f in video.frames), num_bytes=len(part.data))
            frames, times = video.frames, video.timestamps_s
            if part.fps and part.num_frames and len(frames) > part.num_frames:
                keep = sample_indices(len(frames), part.num_frames)  # fps sampling, capped at num_frames
                frames, times = [frames[k] for k in keep], [times[k] for k in keep]
            return DecodedMedia(self._patchify(frames, self.spec.video_max_soft_tokens), list(times))
        except InvalidInputError as e:
            # Re-anchor the decoder's error at the request field, keeping its explanation.
            kind = "image" if isinstance(part, ImageInput) else "video"
            raise InvalidInputError(f"{where}.{kind}", str(e).removeprefix(f"{e.field}: ")) from e

    def _patchify(self, images: list[np.ndarray], max_soft_tokens: int) -> VisionBatch:
        return preprocess_images(images, patch_size=self.spec.patch_size,
                                 pooling_kernel_size=self.spec.pooling_kernel_size, max_soft_tokens=max_soft_tokens)

    @staticmethod
    def _model_part(where: str, part: InputPart, media: dict[str, DecodedMedia]):
        if isinstance(part, TextInput):
            return TextPart(part.text)
        decoded = media[where]
        batch = decoded.batch
        if decoded.timestamps_s is None:
            return ImagePart(batch.pixel_values[0], batch.position_ids[0], batch.num_soft_tokens[0])
        return VideoPart(batch.pixel_values, batch.position_ids, list(batch.num_soft_tokens), decoded.timestamps_s)
