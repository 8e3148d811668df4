"""Engine-level chat input: messages made of text, image and video parts (no transport types).

The server and the offline `LLM` build these; `prompt.build_prompt` turns them into token ids.
Pixels are already patchified by `mmserve.multimodal.preprocess` (pixels in [0, 1], position ids
(x, y), padding patches at (-1, -1)).
"""

from __future__ import annotations

from dataclasses import dataclass

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
class VideoPart:
    pixel_values: torch.Tensor   # [F, P, 3*p*p]
    position_ids: torch.Tensor   # [F, P, 2]
    num_soft_tokens: list[int]   # per frame
    timestamps_s: list[float]    # per frame, seconds from the start of the clip

    def __post_init__(self) -> None:
        frames = self.pixel_values.shape[0]
        if not (frames == self.position_ids.shape[0] == len(self.num_soft_tokens) == len(self.timestamps_s)):
            raise ValueError(f"video part: {frames} frames but {self.position_ids.shape[0]} position rows, "
                             f"{len(self.num_soft_tokens)} token counts, {len(self.timestamps_s)} timestamps")


Part = str | TextPart | ImagePart | VideoPart


@dataclass
class ChatMessage:
    role: str                    # "system" | "user" | "assistant" (rendered as "model")
    parts: list[Part]
