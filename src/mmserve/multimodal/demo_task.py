"""The demo captioning task, as transformers sees it: clip -> reference model inputs -> caption.

The demo model is trained and checked with transformers on exactly the prompt layout that the
server builds (docs/architecture.md, "Prompt layout"), so that serving it through our engine must
reproduce transformers' greedy captions token for token. This module renders that layout as
text (tokenised in one call, as a processor would) and packs frames the way
`Gemma4ForConditionalGeneration` takes video.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mmserve.multimodal.limits import MediaLimits
from mmserve.multimodal.synthetic import COLOURS, DIRECTIONS, SHAPES, make_clip

# reference_inputs' libraries load when it runs: the client commands (`mmserve demo`, `mmserve
# eval-demo`) need only the prompt, the clips and the schema (torch alone is ~1.5 s of CPU).
if TYPE_CHECKING:
    import torch
    from tokenizers import Tokenizer

PROMPT = "Describe the video."
HELDOUT_SEED_BASE = 1_000_000  # training uses seeds below this; evaluation seeds start here
NUM_FRAMES = 4  # frames per demo clip; requests ask for all of them

BOS, EOS, TURN_OPEN, TURN_CLOSE = "<bos>", "<eos>", "<|turn>", "<turn|>"
BOI, EOI, IMAGE, VIDEO = "<|image>", "<image|>", "<|image|>", "<|video|>"


def timestamp(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 60:02d}:{s % 60:02d}"


def video_text(timestamps_s: list[float], tokens_per_frame: list[int]) -> str:
    """Frames joined by single spaces, each `mm:ss <|image>` + `<|video|>` x n + `<image|>`."""
    return " ".join(f"{timestamp(t)} {BOI}{VIDEO * n}{EOI}" for t, n in zip(timestamps_s, tokens_per_frame, strict=True))


def user_turn(parts: list[str]) -> str:
    """The generation prompt around already-rendered user parts (text parts stripped)."""
    return f"{BOS}{TURN_OPEN}user\n{''.join(parts)}{TURN_CLOSE}\n{TURN_OPEN}model\n"


@dataclass
class VisionParams:
    patch_size: int
    pooling_kernel_size: int
    max_soft_tokens: int


@dataclass
class ReferenceInputs:
    """Inputs for one prompt, batch dimension 1, in transformers' names."""

    input_ids: torch.Tensor  # [1, L]
    mm_token_type_ids: torch.Tensor  # [1, L], 2 on video soft tokens
    pixel_values_videos: torch.Tensor  # [frames, patches, 3*p*p]
    video_position_ids: torch.Tensor  # [frames, patches, 2]
    num_frames_per_video: torch.Tensor  # [1]

    def as_kwargs(self) -> dict[str, torch.Tensor]:
        return dict(vars(self))


def reference_inputs(tokenizer: Tokenizer, video: bytes, vision: VisionParams, *, video_first: bool = True,
                     prompt: str = PROMPT, num_frames: int = NUM_FRAMES,
                     limits: MediaLimits | None = None) -> ReferenceInputs:
    """Decode `video` with our decoder and build transformers' inputs in the serving layout."""
    import torch

    from mmserve.multimodal.preprocess import preprocess_images
    from mmserve.multimodal.video import decode_video

    decoded = decode_video(video, num_frames=num_frames, limits=limits or MediaLimits())
    batch = preprocess_images(decoded.frames, patch_size=vision.patch_size,
                              pooling_kernel_size=vision.pooling_kernel_size, max_soft_tokens=vision.max_soft_tokens)
    vid = video_text(decoded.timestamps_s, batch.num_soft_tokens)
    text = prompt.strip()
    ids = tokenizer.encode(user_turn([vid, text] if video_first else [text, vid]), add_special_tokens=False).ids
    input_ids = torch.tensor([ids], dtype=torch.long)
    video_id = tokenizer.token_to_id(VIDEO)
    return ReferenceInputs(
        input_ids=input_ids,
        mm_token_type_ids=(input_ids == video_id).long() * 2,
        pixel_values_videos=batch.pixel_values,
        video_position_ids=batch.position_ids,
        num_frames_per_video=torch.tensor([len(decoded.frames)]),
    )


def clip_for(seed: int, *, container: str = "mp4") -> tuple[bytes, str]:
    """The demo task's clip (bytes) and true caption for `seed`."""
    clip = make_clip(seed, container=container)
    return clip.data, clip.caption


# The demo task as structured output: the first shape of a caption as a JSON object. The demo model
# was never trained on JSON; constrained decoding still makes every answer parse and validate.
CAPTION_SCHEMA = {
    "type": "object",
    "properties": {
        "shape": {"enum": list(SHAPES)},
        "color": {"enum": list(COLOURS)},
        "direction": {"enum": list(DIRECTIONS)},
    },
    "required": ["shape", "color", "direction"],
    "additionalProperties": False,
}
