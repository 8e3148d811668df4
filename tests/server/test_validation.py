"""validate_request: bad requests name their field; good ones convert faithfully."""

from __future__ import annotations

import random

import pytest

from mmserve.api import pb
from mmserve.config import EngineConfig
from mmserve.engine.input.processor import ImageInput, TextInput, VideoInput
from mmserve.errors import InvalidInputError
from mmserve.server.validation import DEFAULT_MAX_TOKENS, validate_request

CONFIG = EngineConfig()


def _request(**sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        messages=[pb.Message(role="user", parts=[pb.Part(video=pb.Video(data=b"\x00video", mime_type="video/mp4")),
                                                 pb.Part(text="Describe the video.")])],
        sampling=pb.SamplingParams(**sampling))


def test_random_valid_requests_convert_field_by_field():
    rng = random.Random(random.getrandbits(64))
    for _ in range(50):
        parts, expected = [], []
        for _ in range(rng.randint(1, 4)):
            kind = rng.choice(["text", "image", "video", "frames"])
            data = rng.randbytes(rng.randint(1, 64))
            if kind == "text":
                text = "".join(rng.choice("ab c") for _ in range(rng.randint(1, 10))) + "x"
                parts.append(pb.Part(text=text))
                expected.append(TextInput(text))
            elif kind == "image":
                parts.append(pb.Part(image=pb.Image(data=data, mime_type="image/png")))
                expected.append(ImageInput(data, "image/png"))
            elif kind == "video":
                n, fps = rng.randint(0, 4), rng.choice([0.0, 0.5, 2.0])
                start, end = rng.choice([(0.0, 0.0), (1.5, 0.0), (0.0, 2.5), (1.5, 2.5)])
                parts.append(pb.Part(video=pb.Video(data=data, num_frames=n, fps=fps, start_s=start, end_s=end)))
                expected.append(VideoInput(data=data, num_frames=n, fps=fps, start_s=start, end_s=end))
            else:
                frames = [rng.randbytes(8) for _ in range(rng.randint(1, 3))]
                parts.append(pb.Part(video=pb.Video(frames=pb.VideoFrames(
                    frames=[pb.Image(data=f) for f in frames], fps=4.0))))
                expected.append(VideoInput(frames=tuple(frames), frames_fps=4.0))
        max_tokens, temperature, top_k = rng.randint(0, 100), rng.uniform(0, 2), rng.randint(0, 50)
        seed = rng.randint(0, 2**40)
        request = pb.GenerateRequest(request_id=f"r{rng.randint(0, 10**6)}", priority=rng.randint(-5, 5),
                                     messages=[pb.Message(role="user", parts=parts)],
                                     sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                                                top_k=top_k, seed=seed, stop=["\n"]))
        got = validate_request(request, CONFIG)
        assert got.request_id == request.request_id and got.priority == request.priority
        assert list(got.messages[0].parts) == expected
        assert got.sampling.max_tokens == (max_tokens or DEFAULT_MAX_TOKENS)
        assert got.sampling.temperature == pytest.approx(temperature, rel=1e-6)  # float32 on the wire
        assert (got.sampling.top_k, got.sampling.seed, got.sampling.stop) == (top_k, seed, ("\n",))


def test_proto_defaults_and_server_assigned_id():
    got = validate_request(_request(), CONFIG)
    assert got.sampling.temperature == 1.0 and got.sampling.top_p == 1.0 and got.sampling.seed is None
    assert got.sampling.max_tokens == DEFAULT_MAX_TOKENS
    other = validate_request(_request(), CONFIG)
    assert got.request_id and other.request_id and got.request_id != other.request_id


def test_default_max_tokens_stays_within_the_server_limit():
    """A --max-tokens-limit under the default (16) was ignored by it: 16 served, an explicit 16 refused."""
    limit = random.randint(1, DEFAULT_MAX_TOKENS - 1)
    config = EngineConfig(max_tokens_limit=limit)
    assert validate_request(_request(), config).sampling.max_tokens == limit
    assert validate_request(_request(max_tokens=limit), config).sampling.max_tokens == limit
    _bad(_request(max_tokens=limit + 1), config)


def _bad(request: pb.GenerateRequest, config: EngineConfig = CONFIG) -> InvalidInputError:
    with pytest.raises(InvalidInputError) as info:
        validate_request(request, config)
    assert info.value.field in str(info.value)
    return info.value


@pytest.mark.parametrize("sampling, field", [
    ({"max_tokens": -1}, "sampling.max_tokens"),
    ({"max_tokens": CONFIG.max_tokens_limit + 1}, "sampling.max_tokens"),
    ({"temperature": -0.5}, "sampling.temperature"),
    ({"temperature": float("nan")}, "sampling.temperature"),
    ({"top_p": 0.0}, "sampling.top_p"),
    ({"top_p": 1.5}, "sampling.top_p"),
    ({"top_k": -3}, "sampling.top_k"),
    ({"stop": ["x"] * (CONFIG.max_stop_strings + 1)}, "sampling.stop"),
    ({"stop": ["ok", ""]}, "sampling.stop[1]"),
    ({"top_logprobs": 21, "logprobs": True}, "sampling.top_logprobs"),
    ({"top_logprobs": 3}, "sampling.top_logprobs"),
    ({"presence_penalty": 2.5}, "sampling.presence_penalty"),
    ({"frequency_penalty": float("inf")}, "sampling.frequency_penalty"),
    ({"repetition_penalty": 0.0}, "sampling.repetition_penalty"),
    ({"min_tokens": 17}, "sampling.min_tokens"),
    ({"logit_bias": {5: 100.5}}, "sampling.logit_bias[5]"),
    ({"logit_bias": {-2: 1.0}}, "sampling.logit_bias[-2]"),
    ({"logit_bias": {i: 1.0 for i in range(301)}}, "sampling.logit_bias"),
    ({"response_format": {}}, "sampling.response_format"),
    ({"response_format": {"regex": ""}}, "sampling.response_format.regex"),
    ({"response_format": {"regex": "a+"}, "ignore_eos": True}, "sampling.ignore_eos"),
    ({"response_format": {"regex": "a+"}, "min_tokens": 2}, "sampling.min_tokens"),
])
def test_bad_sampling_names_the_field(sampling, field):
    assert _bad(_request(**sampling)).field == field


def test_new_sampling_fields_convert():
    got = validate_request(_request(max_tokens=20, logprobs=True, top_logprobs=4, prompt_logprobs=True,
                                    presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.25,
                                    min_tokens=3, logit_bias={7: -100.0, 3: 2.5}), CONFIG).sampling
    assert (got.logprobs, got.top_logprobs, got.prompt_logprobs, got.min_tokens) == (True, 4, True, 3)
    assert (got.presence_penalty, got.frequency_penalty, got.repetition_penalty) == (0.5, -1.0, 1.25)
    assert got.logit_bias == ((3, 2.5), (7, -100.0))
    constrained = validate_request(_request(response_format=pb.ResponseFormat(regex="[ab]+")), CONFIG).sampling
    assert (constrained.response_format.kind, constrained.response_format.spec) == ("regex", "[ab]+")
    plain = validate_request(_request(), CONFIG).sampling
    assert plain.repetition_penalty == 1.0 and plain.response_format is None and plain.num_logprobs is None


def test_limits_in_messages_mention_the_flag():
    err = _bad(_request(max_tokens=CONFIG.max_tokens_limit + 1))
    assert "--max-tokens-limit" in str(err)


def _one(part: pb.Part, role: str = "user") -> pb.GenerateRequest:
    return pb.GenerateRequest(messages=[pb.Message(role=role, parts=[part])])


@pytest.mark.parametrize("request_, field", [
    (pb.GenerateRequest(), "messages"),
    (pb.GenerateRequest(messages=[pb.Message(role="user")]), "messages[0].parts"),
    (_one(pb.Part(text="hi"), role="robot"), "messages[0].role"),
    (_one(pb.Part()), "messages[0].parts[0]"),
    (_one(pb.Part(text="   ")), "messages"),
    (_one(pb.Part(image=pb.Image(data=b"x", mime_type="image/x-nope"))), "messages[0].parts[0].image.mime_type"),
    (_one(pb.Part(image=pb.Image())), "messages[0].parts[0].image.data"),
    (_one(pb.Part(video=pb.Video(data=b"x", mime_type="text/html"))), "messages[0].parts[0].video.mime_type"),
    (_one(pb.Part(video=pb.Video(mime_type="video/mp4"))), "messages[0].parts[0].video.source"),
    (_one(pb.Part(video=pb.Video(data=b"x", num_frames=-2))), "messages[0].parts[0].video.num_frames"),
    (_one(pb.Part(video=pb.Video(data=b"x", num_frames=CONFIG.max_frames_per_video + 1))),
     "messages[0].parts[0].video.num_frames"),
    (_one(pb.Part(video=pb.Video(data=b"x", fps=-1.0))), "messages[0].parts[0].video.fps"),
    (_one(pb.Part(video=pb.Video(data=b"x", start_s=-1.0))), "messages[0].parts[0].video.start_s"),
    (_one(pb.Part(video=pb.Video(data=b"x", start_s=float("nan")))), "messages[0].parts[0].video.start_s"),
    (_one(pb.Part(video=pb.Video(data=b"x", end_s=float("inf")))), "messages[0].parts[0].video.end_s"),
    (_one(pb.Part(video=pb.Video(data=b"x", start_s=3.0, end_s=3.0))), "messages[0].parts[0].video.end_s"),
    (_one(pb.Part(video=pb.Video(frames=pb.VideoFrames(frames=[pb.Image(data=b"f")]), start_s=1.0))),
     "messages[0].parts[0].video.start_s"),
    (_one(pb.Part(video=pb.Video(frames=pb.VideoFrames()))), "messages[0].parts[0].video.frames.frames"),
    # were dropped silently: every given frame is used
    (_one(pb.Part(video=pb.Video(frames=pb.VideoFrames(frames=[pb.Image(data=b"f")] * 4), num_frames=2))),
     "messages[0].parts[0].video.num_frames"),
    (_one(pb.Part(video=pb.Video(frames=pb.VideoFrames(frames=[pb.Image(data=b"f")] * 4), fps=1.0))),
     "messages[0].parts[0].video.fps"),
    (_one(pb.Part(video=pb.Video(frames=pb.VideoFrames(frames=[pb.Image(data=b"f"), pb.Image()])))),
     "messages[0].parts[0].video.frames.frames[1].data"),
    (_one(pb.Part(audio=pb.Audio())), "messages[0].parts[0].audio.data"),
    (_one(pb.Part(audio=pb.Audio(data=b"RIFF", mime_type="video/mp4"))), "messages[0].parts[0].audio.mime_type"),
    (_one(pb.Part(audio=pb.Audio(data=b"RIFF", media_id="ab"))), "messages[0].parts[0].audio.media_id"),
    (_one(pb.Part(audio=pb.Audio(data=b"RIFF", start_s=2.0, end_s=1.0))), "messages[0].parts[0].audio.end_s"),
    (pb.GenerateRequest(use_audio_in_video=True, messages=[pb.Message(role="user", parts=[pb.Part(
        video=pb.Video(frames=pb.VideoFrames(frames=[pb.Image(data=b"f")])))])]), "messages[0].parts[0].video.frames"),
    (pb.GenerateRequest(request_id="x" * 1000, messages=[pb.Message(role="user", parts=[pb.Part(text="a")])]),
     "request_id"),
])
def test_bad_messages_name_the_field(request_, field):
    assert _bad(request_).field == field


def test_total_frames_over_the_request_limit():
    config = EngineConfig(max_frames_per_video=8, max_frames_per_request=10)
    video = pb.Part(video=pb.Video(data=b"x", num_frames=6))
    request = pb.GenerateRequest(messages=[pb.Message(role="user", parts=[video, video])])
    err = _bad(request, config)
    assert err.field == "messages" and "--max-frames-per-request" in str(err)
    # one fewer frame each fits; so do defaults and fps sampling, which only decoding can count
    for fits in (pb.Part(video=pb.Video(data=b"x", num_frames=5)), pb.Part(video=pb.Video(data=b"x")),
                 pb.Part(video=pb.Video(data=b"x", fps=2.0, num_frames=8))):
        validate_request(pb.GenerateRequest(messages=[pb.Message(role="user", parts=[fits, fits])]), config)
    frames = pb.Part(video=pb.Video(frames=pb.VideoFrames(frames=[pb.Image(data=b"f")] * 6)))
    assert _bad(pb.GenerateRequest(messages=[pb.Message(role="user", parts=[frames, frames])]), config).field == \
        "messages"
    # but each container decodes to a frame at least: 11 that name no count cannot fit 10, refused undecoded
    containers = [pb.Part(video=pb.Video(data=b"x", fps=2.0 * (k % 2))) for k in range(11)]
    err = _bad(pb.GenerateRequest(messages=[pb.Message(role="user", parts=containers)]), config)
    assert str(err).startswith("messages: 11 video frames at least") and "--max-frames-per-request" in str(err)
    validate_request(pb.GenerateRequest(messages=[pb.Message(role="user", parts=containers[:10])]), config)


@pytest.mark.parametrize("kind, spec, depth", [
    ("json_schema", '{"a": [{"b": 1}], "c": "{[{[{["}', 3),    # brackets inside strings do not count
    ("json_schema", '{"a": "\\"{"}', 1),                     # nor after an escaped quote
    ("regex", r"(a(b)\(\)[(((])", 2),                       # escaped parentheses and character classes neither
    ("grammar", 'root ::= ("(" (x | "))))")) [(]\nx ::= "a"', 2),
])
def test_nesting_depth_counts_structure_not_text(kind, spec, depth):
    from mmserve.server.validation import nesting_depth

    assert nesting_depth(kind, spec) == depth


def test_response_format_limits_name_their_flags():
    config = EngineConfig(max_response_format_chars=40, max_response_format_depth=3)
    deep = pb.ResponseFormat(json_schema='{"a": {"b": {"c": {}}}}')
    with pytest.raises(InvalidInputError, match="nested 4 deep, at most 3 .--max-response-format-depth."):
        validate_request(_request(response_format=deep), config)
    with pytest.raises(InvalidInputError, match="41 characters, at most 40 .--max-response-format-chars."):
        validate_request(_request(response_format=pb.ResponseFormat(regex="a" * 41)), config)
    assert validate_request(_request(response_format=pb.ResponseFormat(regex="((a))")), config).sampling.response_format
