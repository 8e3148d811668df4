"""InputProcessor: real encoded videos and images -> EngineRequest, checked against the layout rules."""

from __future__ import annotations

import asyncio
import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from PIL import Image

from mmserve.config import EngineConfig
from mmserve.engine.input.processor import ImageInput, InputMessage, InputProcessor, TextInput, VideoInput
from mmserve.errors import InvalidInputError, LimitExceededError
from mmserve.model.prompt import timestamp_text
from mmserve.model.spec import load_spec_without_transformers
from mmserve.multimodal.limits import MediaLimits
from mmserve.multimodal.preprocess import preprocess_images
from mmserve.multimodal.video import decode_video
from mmserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def executor():
    with ThreadPoolExecutor(2) as pool:
        yield pool


def _processor(checkpoint, executor, context_length: int = 1024, **options) -> InputProcessor:
    config = EngineConfig(model=str(checkpoint), **{"default_num_frames": 4, **options})
    return InputProcessor.from_checkpoint(config, executor, spec=load_spec_without_transformers(checkpoint), context_length=context_length)


def _process(processor, *parts, sampling: SamplingParams | None = None):
    message = InputMessage("user", tuple(parts))
    return asyncio.run(processor.process("r1", [message], sampling or SamplingParams(max_tokens=8)))


def _png(rng: np.random.Generator, h: int, w: int) -> tuple[bytes, np.ndarray]:
    pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue(), pixels


def test_video_and_text_become_frames_with_timestamps(tiny_checkpoint, executor, make_video):
    processor = _processor(tiny_checkpoint, executor)
    spec, tok = processor.spec, processor.tokenizer
    num_frames = int(np.random.default_rng(np.random.randint(2**31)).integers(2, 6))
    data = make_video(int(np.random.default_rng(np.random.randint(2**31)).integers(0, 1000)), num_frames=8)
    request = _process(processor, VideoInput(data=data, num_frames=num_frames), TextInput("Describe the video."))

    # Reference: decode and patchify directly, then lay the prompt out by the documented rule.
    video = decode_video(data, num_frames=num_frames, limits=MediaLimits())
    batch = preprocess_images(video.frames, patch_size=spec.patch_size, pooling_kernel_size=spec.pooling_kernel_size,
                              max_soft_tokens=spec.video_max_soft_tokens)
    ids = [spec.bos_token_id, tok.token_id("<|turn>")] + tok.encode("user\n")
    ranges = []
    for i, (n, t) in enumerate(zip(batch.num_soft_tokens, video.timestamps_s, strict=True)):
        ids += tok.encode((" " if i else "") + timestamp_text(t) + " ") + [spec.boi_token_id]
        ranges.append((len(ids), len(ids) + n - 1))
        ids += [spec.video_token_id] * n + [spec.eoi_token_id]
    ids += tok.encode("Describe the video.") + [tok.token_id("<turn|>")] + tok.encode("\n")
    ids += [tok.token_id("<|turn>")] + tok.encode("model\n")

    assert request.prompt_token_ids == ids
    assert request.mm_ranges == ranges
    assert request.num_frames == num_frames == len(request.mm_inputs)
    assert request.num_mm_tokens == sum(batch.num_soft_tokens)
    for k, item in enumerate(request.mm_inputs):
        assert torch.equal(item.pixel_values, batch.pixel_values[k])
        assert torch.equal(item.position_ids, batch.position_ids[k])


def test_image_and_frames_parts(tiny_checkpoint, executor):
    rng = np.random.default_rng(np.random.randint(2**31))
    processor = _processor(tiny_checkpoint, executor)
    spec = processor.spec
    image, image_pixels = _png(rng, 24, 40)
    frames = [_png(rng, 16, 16) for _ in range(3)]
    request = _process(processor, ImageInput(image, "image/png"),
                       VideoInput(frames=tuple(f for f, _ in frames), frames_fps=0.5), TextInput("what?"))
    image_batch = preprocess_images([image_pixels], patch_size=spec.patch_size,
                                    pooling_kernel_size=spec.pooling_kernel_size,
                                    max_soft_tokens=spec.image_max_soft_tokens)
    assert request.num_frames == 3 and len(request.mm_ranges) == 4
    start, end = request.mm_ranges[0]
    assert end - start + 1 == image_batch.num_soft_tokens[0]
    assert set(request.prompt_token_ids[start:end + 1]) == {spec.image_token_id}
    assert torch.equal(request.mm_inputs[0].pixel_values, image_batch.pixel_values[0])
    text = processor.tokenizer.decode(request.prompt_token_ids)
    for k in range(3):  # frames at 0.5 fps are 2 s apart
        assert timestamp_text(2.0 * k) in text


def test_corrupt_video_names_the_part(tiny_checkpoint, executor, video_bytes):
    processor = _processor(tiny_checkpoint, executor)
    with pytest.raises(InvalidInputError) as info:
        _process(processor, TextInput("hi"), VideoInput(data=video_bytes[: len(video_bytes) // 3] + b"\x00" * 64))
    assert info.value.field == "messages[0].parts[1].video"


def test_prompt_longer_than_the_context(tiny_checkpoint, executor, video_bytes):
    short = _processor(tiny_checkpoint, executor, context_length=48)
    with pytest.raises(InvalidInputError) as info:
        _process(short, VideoInput(data=video_bytes, num_frames=4), TextInput("hi"))
    assert info.value.field == "messages" and "48" in str(info.value)
    request = _process(_processor(tiny_checkpoint, executor), TextInput("hi"))
    fits = _processor(tiny_checkpoint, executor, context_length=len(request.prompt_token_ids) + 4)
    with pytest.raises(InvalidInputError) as info:
        _process(fits, TextInput("hi"), sampling=SamplingParams(max_tokens=5))
    assert info.value.field == "sampling.max_tokens" and str(info.value).endswith("ask for at most 4")   # exact here
    _process(fits, TextInput("hi"), sampling=SamplingParams(max_tokens=4))


def test_decode_time_limit(tiny_checkpoint, executor, video_bytes):
    processor = _processor(tiny_checkpoint, executor, video_decode_timeout_s=1e-6)
    with pytest.raises(LimitExceededError) as info:
        _process(processor, VideoInput(data=video_bytes))
    assert "--video-decode-timeout-s" in str(info.value)


def test_decoded_frames_over_the_request_limit(tiny_checkpoint, executor, make_video):
    """Defaults and fps sampling are only countable after decoding: 2 (default) + 1 (0.5 fps of a 1.5 s
    clip) frames fit a limit of 3; one more default video does not."""
    processor = _processor(tiny_checkpoint, executor, default_num_frames=2, max_frames_per_request=3)
    clip = make_video(1, num_frames=6, fps=4.0)
    assert _process(processor, VideoInput(data=clip), VideoInput(data=clip, fps=0.5)).num_frames == 3
    with pytest.raises(InvalidInputError) as info:
        _process(processor, VideoInput(data=clip), VideoInput(data=clip, fps=0.5), VideoInput(data=clip))
    assert info.value.field == "messages" and "--max-frames-per-request" in str(info.value)


def test_container_videos_count_a_frame_each_before_decoding(tiny_checkpoint, executor):
    """A container decodes to one frame at least (or is refused), so more containers than
    --max-frames-per-request are refused by their count (the gateway's media_refs videos too, which
    name no frame count): garbage containers, refused as such once decoded, prove none was."""
    processor = _processor(tiny_checkpoint, executor, default_num_frames=2, max_frames_per_request=3)
    garbage = VideoInput(data=b"\x00 not a video container" * 8)
    with pytest.raises(InvalidInputError) as info:
        _process(processor, *[garbage] * 4)
    assert info.value.field == "messages" and str(info.value).endswith(
        "4 video frames at least (each video's given frames, its num_frames, or one), at most 3 per request "
        "(--max-frames-per-request)")
    with pytest.raises(InvalidInputError) as info:   # within the count: decoded, and refused for what it is
        _process(processor, *[garbage] * 3)
    assert info.value.field.endswith(".video") and "unrecognised container" in str(info.value)


def test_a_layout_laid_out_elsewhere_is_held_to_the_image_and_audio_counts(tiny_checkpoint, executor):
    """process_layout (a gateway's own preprocessing) counts its items as process counts parts,
    before anything else: the items here are empty, so only the counts can refuse them."""
    from mmserve.model.prompt import MMItem, PromptLayout

    processor = _processor(tiny_checkpoint, executor, max_images_per_request=1, max_audio_per_request=0)

    def refusal(*kinds: str) -> str:
        layout = PromptLayout([0] * 4, [(k, k) for k in range(len(kinds))], [MMItem(kind, None, None, 1) for kind in kinds])
        with pytest.raises(InvalidInputError) as info:
            asyncio.run(processor.process_layout(layout, "r1", SamplingParams(max_tokens=1), num_frames=0))
        return str(info.value)

    assert refusal("image", "image").endswith("2 images, at most 1 per request (--max-images-per-request)")
    assert refusal("audio").endswith("1 audio parts, at most 0 per request (--max-audio-per-request)")


def _png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height but whose pixel data is garbage: decoding it fails,
    so a refusal naming a limit proves the limit was checked from the header, before decoding."""
    import struct
    import zlib

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", b"garbage") + chunk(b"IEND", b"")


def test_text_beyond_the_context_is_refused_without_tokenizing(tiny_checkpoint, executor, monkeypatch):
    processor = _processor(tiny_checkpoint, executor, context_length=64)
    monkeypatch.setattr(processor.tokenizer, "encode", lambda text: pytest.fail("tokenized"))  # a spy
    text = "x" * (64 * processor.tokenizer.max_chars_per_token)
    with pytest.raises(InvalidInputError) as info:
        _process(processor, TextInput(text))
    assert info.value.field == "messages" and "at least 64 tokens" in str(info.value)
    with pytest.raises(InvalidInputError) as info:
        _process(processor, TextInput(text[: 40 * processor.tokenizer.max_chars_per_token]),
                 sampling=SamplingParams(max_tokens=30))
    assert info.value.field == "sampling.max_tokens" and "at least 40" in str(info.value)
    # 24 more fit the text's lower bound, not the rendered prompt (its turn markers): no promise of 24
    assert "ask for at most 24 less the prompt's tokens not counted yet" in str(info.value)


def test_image_count_and_pixels_are_checked_before_decoding(tiny_checkpoint, executor):
    processor = _processor(tiny_checkpoint, executor, max_images_per_request=2, max_pixels_per_request=1000)
    tiny = ImageInput(_png_claiming(10, 10))
    with pytest.raises(InvalidInputError) as info:
        _process(processor, tiny, tiny, tiny)
    assert "--max-images-per-request" in str(info.value)
    with pytest.raises(LimitExceededError) as info:
        _process(processor, VideoInput(frames=(_png_claiming(20, 20),) * 3))
    assert "--max-pixels-per-request" in str(info.value) and "video.frames[2]" in str(info.value)
    with pytest.raises(InvalidInputError) as info:  # within the limits: now it is decoded, and fails
        _process(processor, tiny, tiny)
    assert info.value.field == "messages[0].parts[0].image"


def test_an_image_over_a_size_limit_names_its_part(tiny_checkpoint, executor):
    """As an audio part's limit refusals do: a request with several images learns which one."""
    processor = _processor(tiny_checkpoint, executor, max_image_pixels=100)
    for part, field in ((ImageInput(_png_claiming(20, 20)), "messages[0].parts[1].image"),
                        (VideoInput(frames=(_png_claiming(8, 8), _png_claiming(20, 20))),
                         "messages[0].parts[1].video.frames[1]")):
        with pytest.raises(LimitExceededError) as info:
            _process(processor, ImageInput(_png_claiming(8, 8)), part)
        assert str(info.value).startswith(f"{field}: image is 20x20 = 400 pixels, more than the limit of 100")
        assert info.value.flag == "--max-image-pixels" and not info.value.retryable


def test_image_tokens_count_against_the_context_before_decoding(tiny_checkpoint, executor):
    """Soft tokens follow from the header's size, so images that cannot fit are refused undecoded."""
    processor = _processor(tiny_checkpoint, executor, context_length=64)
    big = ImageInput(_png_claiming(512, 512))
    assert processor.spec.image_max_soft_tokens * 4 >= 64
    with pytest.raises(InvalidInputError) as info:
        _process(processor, big, big, big, big, TextInput("hi"))
    assert info.value.field == "messages" and "at least" in str(info.value)


def test_an_image_too_elongated_for_the_position_table_is_invalid_argument(tiny_checkpoint, executor):
    """The tiny checkpoint's vision table holds 64 positions a side while its 280-token budget reaches
    560: a 4:1 image reached the tower's guard and ended INTERNAL. It is refused naming its part."""
    processor = _processor(tiny_checkpoint, executor)
    assert processor.spec.vision.position_table == 64
    wide, _ = _png(np.random.default_rng(0), 100, 400)
    with pytest.raises(InvalidInputError, match="needs 66 patch positions along one side at this model's "
                                                "resolution, more than the 64 its vision encoder holds") as info:
        _process(processor, ImageInput(wide))
    assert info.value.field == "messages[0].parts[0].image"
    square, _ = _png(np.random.default_rng(0), 200, 200)
    assert len(_process(processor, ImageInput(square)).mm_inputs) == 1


def test_given_frames_decode_one_at_a_time_to_the_same_patches(tiny_checkpoint, executor):
    """Frames decoded straight to the model's size give exactly the patches of full-size decoding."""
    rng = np.random.default_rng(np.random.randint(2**31))
    processor = _processor(tiny_checkpoint, executor)
    spec = processor.spec
    frames = [_png(rng, int(rng.integers(40, 200)), int(rng.integers(40, 200))) for _ in range(3)]
    request = _process(processor, VideoInput(frames=tuple(f for f, _ in frames)))
    want = preprocess_images([p for _, p in frames], patch_size=spec.patch_size,
                             pooling_kernel_size=spec.pooling_kernel_size, max_soft_tokens=spec.video_max_soft_tokens)
    for k, item in enumerate(request.mm_inputs):
        assert torch.equal(item.pixel_values, want.pixel_values[k])
        assert torch.equal(item.position_ids, want.position_ids[k])


def test_cancelling_a_request_stops_decoding_its_frames(tiny_checkpoint, monkeypatch):
    """A client cancel (or deadline) ends the request while its frames decode: the worker stops at
    the next frame instead of decoding them all. The spy only counts calls to the real decoder."""
    import threading
    import time

    from mmserve.engine.input import processor as input_processor

    calls, first = [], threading.Event()
    real = input_processor.decode_image

    def counting(*args, **kwargs):
        calls.append(1)
        first.set()
        time.sleep(0.02)  # a frame takes a while
        return real(*args, **kwargs)

    monkeypatch.setattr(input_processor, "decode_image", counting)
    frame, _ = _png(np.random.default_rng(0), 32, 32)

    async def main(pool):
        processor = _processor(tiny_checkpoint, pool, context_length=1 << 16)
        task = asyncio.ensure_future(processor.process(
            "r1", [InputMessage("user", (VideoInput(frames=(frame,) * 60),))], SamplingParams(max_tokens=4)))
        deadline = time.monotonic() + 30
        while not first.is_set():
            assert time.monotonic() < deadline and not task.done(), task
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.get_running_loop().run_in_executor(pool, lambda: None)  # the only worker is free again

    with ThreadPoolExecutor(1) as pool:
        asyncio.run(main(pool))
    assert len(calls) < 30, f"{len(calls)} of 60 frames decoded after the cancel"
