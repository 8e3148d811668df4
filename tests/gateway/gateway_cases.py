"""Requests sent both ways, through SMG with the `openai` client and straight to a replica with our
mmserve.v1 client, and the comparison of their answers (shared by the gateway test modules)."""

from __future__ import annotations

import base64
import io
import random

import pytest
from PIL import Image
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from mmserve.clients.messages import audio_part, image_part, text_part, video_part


def png(seed: int, size: int = 48) -> bytes:
    """A random image of a few coloured squares (PNG)."""
    rng = random.Random(seed)
    image = Image.new("RGB", (size, size), tuple(rng.randrange(256) for _ in range(3)))
    for _ in range(6):
        x, y = rng.randrange(size - 8), rng.randrange(size - 8)
        image.paste(tuple(rng.randrange(256) for _ in range(3)), (x, y, x + 8, y + 8))
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def data_url(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def media_request(question: str, image: bytes | None = None, video: bytes | None = None,
                  audio: tuple[bytes, ...] = ()) -> tuple[list, list]:
    """(mmserve.v1 parts, OpenAI content) of one user turn: image, video, each WAV clip of `audio` (as
    OpenAI `input_audio` parts), then the question."""
    v1, content = [], []
    if image is not None:
        v1.append(image_part(image, "image/png"))
        content.append({"type": "image_url", "image_url": {"url": data_url(image, "image/png")}})
    if video is not None:
        v1.append(video_part(video, "video/mp4"))
        content.append({"type": "video_url", "video_url": {"url": data_url(video, "video/mp4")}})
    for clip in audio:
        v1.append(audio_part(clip, "audio/wav"))
        content.append({"type": "input_audio", "input_audio": {"data": base64.b64encode(clip).decode(),
                                                               "format": "wav"}})
    v1.append(text_part(question))
    content.append({"type": "text", "text": question})
    return v1, content


def assert_same(choice, ours, tokenizer) -> None:
    """SMG's choice (text; tokens and logprobs from its logprob entries) against our GenerateResult or
    Sample of the same greedy request."""
    assert choice.message.content == ours.text, (choice.message.content, ours.text)
    # SMG reports logprobs for the tokens it shows: our ids less the special ones (end of turn)
    shown = [(t, lp) for t, lp in zip(ours.token_ids, ours.logprobs, strict=True) if t not in tokenizer.special_ids]
    entries = choice.logprobs.content
    assert [bytes(e.bytes) for e in entries] == [tokenizer.decode([t]).encode() for t, _ in shown], (
        [(e.token, e.bytes) for e in entries], [(t, tokenizer.backend.id_to_token(t)) for t, _ in shown])
    assert [e.logprob for e in entries] == pytest.approx([lp.logprob for _, lp in shown], abs=1e-4)


def streamed_text(stream) -> tuple[str, list[str], list]:
    """(text, finish reasons, usages) of an OpenAI chat completion stream."""
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return text, reasons, [c.usage for c in chunks if c.usage]


def turn(tok, body: list[int]) -> list[int]:
    """`body` as one user turn of the documented prompt layout (docs/architecture.md), as ids."""
    return [2, 4, *body, 5, *tok.encode("\n"), 4, *tok.encode("model\n")]


def tensor_data(t) -> vpb.TensorData:
    return vpb.TensorData(shape=list(t.shape), dtype=str(t.dtype).removeprefix("torch."), inline=t.numpy().tobytes())


def mm_batch(modality, batch, placeholders) -> vpb.MultimodalInputs:
    """A `VisionBatch` as a gateway's preprocessed `mm_inputs`, with (offset, length) placeholders."""
    key = "pixel_position_ids_videos" if modality == common_pb2.VIDEO else "image_position_ids"
    return vpb.MultimodalInputs(pixel_values=tensor_data(batch.pixel_values),
                                model_specific_tensors={key: tensor_data(batch.position_ids)},
                                mm_placeholders=[vpb.PlaceholderRange(offset=o, length=n) for o, n in placeholders],
                                modality=modality)
