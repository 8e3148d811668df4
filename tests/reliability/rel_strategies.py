"""Hypothesis strategies for hostile-but-well-typed GenerateRequests: any field, any value the
proto allows, mixed with genuine media (real PNGs and PyAV-encoded clips) so some requests get deep."""

from __future__ import annotations

import io

import numpy as np
from hypothesis import strategies as st
from PIL import Image

from mmserve.api.mmserve.v1 import generation_pb2 as pb
from mmserve.multimodal.synthetic import make_clip

INT32 = st.integers(-(2**31), 2**31 - 1)
FLOATS = st.floats(width=32, allow_nan=True, allow_infinity=True)


def png(seed: int, size: int = 24) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


REAL_PNG = png(0)
REAL_MP4 = make_clip(1, size=32, num_frames=4).data


def _mangled(data: bytes) -> st.SearchStrategy[bytes]:
    """The real payload, a truncation of it, or a copy with a few bit flips."""
    def flip(args: tuple[bytes, list[tuple[float, int]]]) -> bytes:
        buf, flips = bytearray(args[0]), args[1]
        for where, bit in flips:
            buf[int(where * len(buf))] ^= 1 << bit
        return bytes(buf)
    cut = st.floats(0, 1).map(lambda f: data[: int(len(data) * f)])
    flipped = st.tuples(st.just(data), st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 7)),
                                                min_size=1, max_size=8)).map(flip)
    return st.one_of(st.just(data), cut, flipped)


media_bytes = {
    "image": st.one_of(st.binary(max_size=256), _mangled(REAL_PNG)),
    "video": st.one_of(st.binary(max_size=256), _mangled(REAL_MP4), st.just(REAL_PNG)),
}
mime = st.sampled_from(["", "image/png", "video/mp4", "video/webm", "text/html", "application/x-evil"])
texts = st.text(max_size=40) | st.sampled_from(["describe the video", "<|image|>" * 3, "<bos><turn|>", "\x00"])


@st.composite
def parts(draw) -> pb.Part:
    kind = draw(st.sampled_from(["text", "text", "image", "video", "frames", "empty"]))
    if kind == "text":
        return pb.Part(text=draw(texts))
    if kind == "image":
        return pb.Part(image=pb.Image(data=draw(media_bytes["image"]), mime_type=draw(mime)))
    if kind == "empty":
        return pb.Part()
    video = pb.Video(mime_type=draw(mime), num_frames=draw(st.integers(-3, 40) | INT32),
                     fps=draw(st.just(0.0) | FLOATS))
    if kind == "video":
        video.data = draw(media_bytes["video"])
    else:
        video.frames.CopyFrom(pb.VideoFrames(frames=[pb.Image(data=draw(media_bytes["image"]))
                                                     for _ in range(draw(st.integers(0, 3)))],
                                             fps=draw(st.just(0.0) | FLOATS)))
    return pb.Part(video=video)


@st.composite
def sampling(draw) -> pb.SamplingParams:
    params = pb.SamplingParams(max_tokens=draw(st.integers(-2, 6) | INT32), top_k=draw(st.integers(-1, 50) | INT32),
                               stop=draw(st.lists(st.text(max_size=6), max_size=4)),
                               ignore_eos=draw(st.booleans()))
    for name, values in (("temperature", st.just(0.0) | FLOATS), ("top_p", FLOATS),
                         ("seed", st.integers(0, 2**64 - 1))):
        if draw(st.booleans()):
            setattr(params, name, draw(values))
    return params


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    messages = [pb.Message(role=draw(st.sampled_from(["user", "user", "system", "assistant", "", "root"])),
                           parts=draw(st.lists(parts(), max_size=3)))
                for _ in range(draw(st.integers(0, 3)))]
    return pb.GenerateRequest(request_id=draw(st.just("") | st.text(max_size=20)), messages=messages,
                              sampling=draw(sampling()), priority=draw(INT32))


@st.composite
def plausible_requests(draw) -> pb.GenerateRequest:
    """Well-formed requests whose media are real, truncated or bit-flipped: they get past validation
    and into decoding, the prompt builder and the engine."""
    parts = [pb.Part(text=draw(texts))]
    for _ in range(draw(st.integers(1, 2))):
        if draw(st.booleans()):
            parts.append(pb.Part(image=pb.Image(data=draw(_mangled(REAL_PNG)))))
        elif draw(st.booleans()):
            parts.append(pb.Part(video=pb.Video(data=draw(_mangled(REAL_MP4)), num_frames=draw(st.integers(0, 3)))))
        else:
            frames = [pb.Image(data=draw(_mangled(REAL_PNG))) for _ in range(draw(st.integers(1, 2)))]
            parts.append(pb.Part(video=pb.Video(frames=pb.VideoFrames(frames=frames, fps=draw(st.floats(0, 30))))))
    draw(st.randoms()).shuffle(parts)
    params = pb.SamplingParams(max_tokens=draw(st.integers(1, 6)), top_k=draw(st.integers(0, 50)),
                               stop=draw(st.lists(st.text(min_size=1, max_size=4), max_size=2)),
                               ignore_eos=draw(st.booleans()))
    params.temperature = draw(st.floats(0, 2))
    params.top_p = draw(st.floats(0.05, 1))
    return pb.GenerateRequest(messages=[pb.Message(role="user", parts=parts)], sampling=params)
