"""Bounds on media work, so one hostile payload cannot take a worker's memory or time."""

from __future__ import annotations

import math
from dataclasses import dataclass

from mmserve.config import EngineConfig
from mmserve.errors import LimitExceededError


@dataclass(frozen=True)
class MediaLimits:
    """Limits checked before and during decoding. Each names the flag that raises it."""

    max_video_bytes: int = 48 * 2**20
    max_image_bytes: int = 48 * 2**20
    max_frames_per_video: int = 32
    default_num_frames: int = 8
    max_video_duration_s: float = 4 * 3600.0
    max_audio_duration_s: float = 600.0  # an audio part, or a video's soundtrack window
    max_image_pixels: int = 4096 * 4096
    max_images_per_request: int = 16
    max_audio_per_request: int = 16  # audio parts; a video's soundtrack is bounded with its video
    max_pixels_per_request: int = 128 * 2**20  # images and given frame images, read from their headers
    # Frames larger than this are downscaled while decoding (preprocessing shrinks them anyway);
    # keeps 32 sampled 4K frames from holding gigabytes.
    max_decoded_frame_pixels: int = 1024 * 1024
    # Longest side of an image or frame, whatever its pixel count: Pillow's bicubic resize holds
    # weights growing with the longer side (a 1x16Mi PNG, within the pixel limit, peaked at 811 MiB;
    # a 32768x512 one costs what a 4096x4096 one does).
    max_image_side: int = 32768
    # Work bounds for the decoder itself: a tiny file may claim millions of empty frames.
    max_packets: int = 100_000
    max_decoded_frames: int = 100_000

    def check_size(self, width: int, height: int, subject: str) -> None:
        """Refuse an image or frame size (`subject`: "image is", "video frames are", ...) over the
        pixel limit or the side limit, from a header, before its pixels are decoded."""
        if width * height > self.max_image_pixels:
            raise LimitExceededError(f"{subject} {width}x{height} = {width * height} pixels, more than the limit of "
                                     f"{self.max_image_pixels}", "--max-image-pixels")
        if max(width, height) > self.max_image_side:
            raise LimitExceededError(f"{subject} {width}x{height}, a side longer than the limit of "
                                     f"{self.max_image_side} pixels for any aspect ratio")

    def decoded_frame_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) a video or animation frame is decoded at: downscaled, keeping its aspect, to
        at most `max_decoded_frame_pixels`; a frame within it keeps its size."""
        if width * height <= self.max_decoded_frame_pixels:
            return width, height
        scale = math.sqrt(self.max_decoded_frame_pixels / (width * height))
        return max(1, int(width * scale)), max(1, int(height * scale))

    @classmethod
    def from_config(cls, config: EngineConfig) -> MediaLimits:
        return cls(
            max_video_bytes=config.max_video_bytes,
            max_image_bytes=config.max_video_bytes,
            max_frames_per_video=config.max_frames_per_video,
            default_num_frames=config.default_num_frames,
            max_video_duration_s=config.max_video_duration_s,
            max_audio_duration_s=config.max_audio_duration_s,
            max_image_pixels=config.max_image_pixels,
            max_images_per_request=config.max_images_per_request,
            max_audio_per_request=config.max_audio_per_request,
            max_pixels_per_request=config.max_pixels_per_request,
        )
