"""Engine-level chat input: messages made of text, image, video and audio parts (no transport types).

The server and the offline `LLM` build these; `prompt.build_prompt` turns them into token ids.
Pixels are already patchified by `mmserve.multimodal.preprocess` (pixels in [0, 1], position ids
(x, y), padding patches at (-1, -1)); audio is already cut into segments and turned into log-mel
features by `mmserve.multimodal.audio`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class TextPart:
    text: str


@dataclass
class ImagePart:
    pixel_values: torch.Tensor   # [P, 3*p*p]
    position_ids: torch.Tensor   # [P, 2]
    num_soft_tokens: int


@dataclass
class AudioSegment:
    """At most 30 s of audio (the processor's 750 soft tokens), as the audio tower takes it."""

    features: torch.Tensor       # [mel frames, bins], the real frames only
    num_soft_tokens: int
    start_s: float = 0.0         # seconds from the start of its clip (a video's soundtrack: its first frame)


@dataclass
class AudioPart:
    """An audio clip: its segments in time order, laid out back to back, as consecutive audio items."""

    segments: list[AudioSegment]


@dataclass
class VideoPart:
    pixel_values: torch.Tensor   # [F, P, 3*p*p]
    position_ids: torch.Tensor   # [F, P, 2]
    num_soft_tokens: list[int]   # per frame
    timestamps_s: list[float]    # per frame, seconds from the start of the clip
    # use_audio_in_video: the window's sound, laid out after the frames with its start times
    soundtrack: list[AudioSegment] = field(default_factory=list)

    def __post_init__(self) -> None:
        frames = self.pixel_values.shape[0]
        if not (frames == self.position_ids.shape[0] == len(self.num_soft_tokens) == len(self.timestamps_s)):
            raise ValueError(f"video part: {frames} frames but {self.position_ids.shape[0]} position rows, "
                             f"{len(self.num_soft_tokens)} token counts, {len(self.timestamps_s)} timestamps")


Part = str | TextPart | ImagePart | VideoPart | AudioPart


@dataclass
class ChatMessage:
    role: str                    # "system" | "user" | "assistant" (rendered as "model")
    parts: list[Part]
