"""Chat messages -> prompt token ids + one range per image, video frame and audio segment.

The layout (docs/architecture.md, and what the demo model was trained on):

    <bos><|turn>user\n{parts}<turn|>\n<|turn>model\n

Text parts are stripped and concatenated. An image is `<|image>` + `<|image|>` x n + `<image|>`; a
video is its frames joined by single spaces, each `"mm:ss <|image>" + "<|video|>" x n + "<image|>"`;
an audio clip is its segments back to back, each `<|audio>` + `<|audio|>` x n + `<audio|>`. This is
transformers' Gemma4Processor expansion with per-item token counts. A video's soundtrack
(use_audio_in_video) follows its frames, joined the same way, each segment `"mm:ss <|audio>" ...`
with its start time (docs/api.md says why after the frames). Each soft-token run is an inclusive
absolute [start, end] range, in prompt order, paired with its encoder input in `mm_items`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mmserve.model.messages import AudioPart, AudioSegment, ChatMessage, ImagePart, Part, TextPart, VideoPart
from mmserve.model.spec import ModelSpec
from mmserve.model.tokenizer import TextTokenizer

TURN_OPEN, TURN_CLOSE = "<|turn>", "<turn|>"
ROLES = {"system": "system", "user": "user", "assistant": "model", "model": "model"}


@dataclass
class MMItem:
    """The encoder input behind one range: an image's or a video frame's pixels, or an audio
    segment's features."""

    kind: str                           # "image" | "video" | "audio"
    pixel_values: torch.Tensor | None   # [P, 3*p*p]
    position_ids: torch.Tensor | None   # [P, 2]
    num_soft_tokens: int
    features: torch.Tensor | None = None   # audio: [mel frames, bins]


@dataclass
class PromptLayout:
    token_ids: list[int]
    mm_ranges: list[tuple[int, int]] = field(default_factory=list)   # inclusive, absolute
    mm_items: list[MMItem] = field(default_factory=list)


def timestamp_text(seconds: float) -> str:
    """mm:ss with truncated seconds, as the processor writes frame timestamps."""
    return f"{int(seconds // 60):02d}:{int(seconds % 60):02d}"


class _Builder:
    def __init__(self, tokenizer: TextTokenizer, spec: ModelSpec):
        self.tok, self.spec = tokenizer, spec
        self.ids: list[int] = []
        self.text = ""               # pending text; tokenized as one piece up to the next special id
        self.layout = PromptLayout(self.ids)

    def flush(self) -> None:
        self.ids.extend(self.tok.encode(self.text))
        self.text = ""

    def special(self, *ids: int) -> None:
        self.flush()
        self.ids.extend(ids)

    def soft_tokens(self, placeholder: int, item: MMItem) -> None:
        if item.num_soft_tokens < 1:
            raise ValueError(f"{item.kind} with {item.num_soft_tokens} soft tokens")
        audio = item.kind == "audio"
        self.special(self.spec.boa_token_id if audio else self.spec.boi_token_id)
        start = len(self.ids)
        self.ids.extend([placeholder] * item.num_soft_tokens)
        self.layout.mm_ranges.append((start, len(self.ids) - 1))
        self.layout.mm_items.append(item)
        self.special(self.spec.eoa_token_id if audio else self.spec.eoi_token_id)

    def audio(self, segment: AudioSegment) -> None:
        if self.spec.audio_token_id is None or self.spec.boa_token_id is None or self.spec.eoa_token_id is None:
            raise ValueError("this model has no audio tokens")
        self.soft_tokens(self.spec.audio_token_id,
                         MMItem("audio", None, None, segment.num_soft_tokens, features=segment.features))

    def part(self, part: Part) -> None:
        if isinstance(part, str | TextPart):
            self.text += (part if isinstance(part, str) else part.text).strip()
        elif isinstance(part, ImagePart):
            self.soft_tokens(self.spec.image_token_id,
                             MMItem("image", part.pixel_values, part.position_ids, part.num_soft_tokens))
        elif isinstance(part, VideoPart):
            for i, (n, t) in enumerate(zip(part.num_soft_tokens, part.timestamps_s, strict=True)):
                self.text += (" " if i else "") + timestamp_text(t) + " "
                self.soft_tokens(self.spec.video_token_id,
                                 MMItem("video", part.pixel_values[i], part.position_ids[i], n))
            for segment in part.soundtrack:
                self.text += " " + timestamp_text(segment.start_s) + " "
                self.audio(segment)
        elif isinstance(part, AudioPart):
            for segment in part.segments:
                self.audio(segment)
        else:
            raise TypeError(f"unknown message part {type(part).__name__}")


def build_prompt(tokenizer: TextTokenizer, spec: ModelSpec, messages: list[ChatMessage]) -> PromptLayout:
    """Render `messages` and the generation prompt (`<|turn>model\\n`) into ids and ranges."""
    if not messages:
        raise ValueError("no messages")
    b = _Builder(tokenizer, spec)
    turn_open, turn_close = tokenizer.token_id(TURN_OPEN), tokenizer.token_id(TURN_CLOSE)
    b.special(spec.bos_token_id)
    for message in messages:
        if message.role not in ROLES:
            raise ValueError(f"unknown role {message.role!r}; expected one of {sorted(ROLES)}")
        b.special(turn_open)
        b.text += ROLES[message.role] + "\n"
        for part in message.parts:
            b.part(part)
        b.special(turn_close)
        b.text += "\n"
    b.special(turn_open)
    b.text += "model\n"
    b.flush()
    return b.layout


def expand_anchors(tokenizer: TextTokenizer, spec: ModelSpec, token_ids: list[int],
                   media: list[ImagePart | VideoPart | AudioPart]) -> PromptLayout:
    """A prompt a gateway already rendered (one `<|image|>`/`<|video|>`/`<|audio|>` anchor per media
    item, in order) -> the same ids and ranges `build_prompt` gives for the same messages.

    Text ids stay as given; each anchor becomes its image's or frames' soft-token runs. The text run
    just before a video anchor is re-tokenized with the first frame's timestamp appended, as
    `build_prompt` tokenizes that text and the timestamp as one piece."""
    anchor_ids = {spec.image_token_id, spec.video_token_id} | ({spec.audio_token_id} if spec.has_audio else set())
    anchors = [i for i, t in enumerate(token_ids) if t in anchor_ids]
    if len(anchors) != len(media):
        raise ValueError(f"{len(anchors)} media anchors in the prompt but {len(media)} media items")
    b = _Builder(tokenizer, spec)
    special = set(tokenizer.special_ids)
    start = 0
    for at, part in zip(anchors, media, strict=True):
        segment = token_ids[start:at]
        start = at + 1
        if (isinstance(part, ImagePart) and token_ids[at] == spec.image_token_id
                or isinstance(part, AudioPart) and token_ids[at] == spec.audio_token_id):
            b.special(*segment)
            b.part(part)
        elif isinstance(part, VideoPart) and token_ids[at] == spec.video_token_id:
            run = len(segment)
            while run and segment[run - 1] not in special:
                run -= 1
            b.special(*segment[:run])
            b.text = tokenizer.decode(segment[run:], skip_special_tokens=False)
            b.part(part)
        else:
            raise ValueError(f"anchor {token_ids[at]} at position {at} does not match a {type(part).__name__}")
    b.special(*token_ids[start:])
    return b.layout
