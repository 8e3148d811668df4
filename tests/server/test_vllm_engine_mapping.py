"""The VllmEngine door's request mapping without a server: media_refs URLs and SamplingParams.

Every refusal names its field (INVALID_ARGUMENT at the edge); file:// stays inside
--allowed-local-media-path however the path is spelled (.., symlinks)."""

from __future__ import annotations

import base64
import dataclasses
import os
from types import SimpleNamespace

import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from mmserve.config import DEMO_MODEL_DIR, EngineConfig
from mmserve.engine.input.processor import AudioInput
from mmserve.errors import InvalidInputError, LimitExceededError
from mmserve.model.spec import load_spec
from mmserve.server.vllm_engine.media_refs import media_inputs
from mmserve.server.vllm_engine.sampling import CheckpointDefaults, map_sampling
from mmserve.server.vllm_engine.servicer import _prompt_ids

EOS = (1, 5)


def refs(*urls: str, modality=common_pb2.VIDEO) -> vpb.MediaRefs:
    return vpb.MediaRefs(items=[vpb.MediaRef(modality=modality, url=u) for u in urls])


def test_data_urls_decode_and_are_bounded_before_decoding():
    data = os.urandom(300)
    url = "data:video/mp4;base64," + base64.b64encode(data).decode()
    (video,) = media_inputs(refs(url), max_bytes=300, allowed_local_media_path="")
    assert video.data == data and video.mime_type == "video/mp4"
    with pytest.raises(LimitExceededError, match="301 bytes.*--max-video-bytes"):
        media_inputs(refs("data:video/mp4;base64," + base64.b64encode(data + b"x").decode()), max_bytes=300,
                     allowed_local_media_path="")
    for bad, why in (("data:video/mp4;base64,@@@@", "base64"), ("data:video/mp4,abc", "base64"),
                     ("data:image/svg+xml;base64,AAAA", "unsupported")):
        with pytest.raises(InvalidInputError, match=why) as e:
            media_inputs(refs(bad, modality=common_pb2.IMAGE if "image" in bad else common_pb2.VIDEO),
                         max_bytes=1000, allowed_local_media_path="")
        assert e.value.field == "media_refs.items[0].url"


def test_padding_inside_a_data_url_is_refused_wherever_it_falls():
    """The payload is decoded in pieces, each strict alone: padding ending the first piece passed."""
    from mmserve.server.vllm_engine.media_refs import DECODE_CHUNK_CHARS

    for payload in ("A" * (DECODE_CHUNK_CHARS - 1) + "=" + "AAAA", "AA==AAAA", "A===" + "AAAA"):
        with pytest.raises(InvalidInputError, match="not valid base64") as e:
            media_inputs(refs("data:video/mp4;base64," + payload), max_bytes=2**21, allowed_local_media_path="")
        assert e.value.field == "media_refs.items[0].url"
    (video,) = media_inputs(refs("data:video/mp4;base64," + "A" * DECODE_CHUNK_CHARS + "AA=="), max_bytes=2**21,
                            allowed_local_media_path="")
    assert len(video.data) == DECODE_CHUNK_CHARS * 3 // 4 + 1


def test_audio_items_are_audio_inputs():
    """SMG sends an OpenAI `input_audio` part as `data:audio/<its format>;base64,...`."""
    data = os.urandom(64)
    (audio,) = media_inputs(refs("data:audio/mp3;base64," + base64.b64encode(data).decode(), modality=common_pb2.AUDIO),
                            max_bytes=64, allowed_local_media_path="")
    assert isinstance(audio, AudioInput) and (audio.data, audio.mime_type) == (data, "audio/mp3")
    with pytest.raises(InvalidInputError, match="unsupported audio type 'audio/midi'") as e:
        media_inputs(refs("data:audio/midi;base64,AAAA", modality=common_pb2.AUDIO), max_bytes=10,
                     allowed_local_media_path="")
    assert e.value.field == "media_refs.items[0].url"


def test_remote_schemes_are_refused_naming_the_item():
    for url in ("http://127.0.0.1/x.mp4", "HTTPS://example.com/x.mp4", "s3://b/k", "no-scheme"):
        with pytest.raises(InvalidInputError, match="fetches nothing") as e:
            media_inputs(refs("data:video/mp4;base64,AAAA", url), max_bytes=1000, allowed_local_media_path="")
        assert e.value.field == "media_refs.items[1].url"
    with pytest.raises(InvalidInputError, match="99 is not served") as e:   # a modality newer than our stubs
        media_inputs(refs("data:video/mp4;base64,AAAA", modality=99), max_bytes=10, allowed_local_media_path="")
    assert e.value.field == "media_refs.items[0].modality"


def test_file_urls_only_inside_the_allowed_directory(tmp_path):
    allowed, outside = tmp_path / "media", tmp_path / "secret"
    allowed.mkdir()
    outside.mkdir()
    (allowed / "clip.mp4").write_bytes(b"v" * 10)
    (outside / "key.mp4").write_bytes(b"k")
    (allowed / "link.mp4").symlink_to(outside / "key.mp4")
    (video,) = media_inputs(refs(f"file://{allowed}/clip.mp4"), max_bytes=100, allowed_local_media_path=str(allowed))
    assert video.path == str(allowed / "clip.mp4")
    with pytest.raises(InvalidInputError, match="without --allowed-local-media-path"):
        media_inputs(refs(f"file://{allowed}/clip.mp4"), max_bytes=100, allowed_local_media_path="")
    for url in (f"file://{allowed}/../secret/key.mp4", f"file://{allowed}/link.mp4", "file://otherhost/x.mp4",
                f"file://{allowed}/missing.mp4", f"file://{allowed}/clip.mp4%00.png"):
        with pytest.raises(InvalidInputError):
            media_inputs(refs(url), max_bytes=100, allowed_local_media_path=str(allowed))
    with pytest.raises(LimitExceededError):
        media_inputs(refs(f"file://{allowed}/clip.mp4"), max_bytes=5, allowed_local_media_path=str(allowed))


def test_sampling_fields_map_onto_ours():
    config = EngineConfig(max_tokens_limit=100)
    defaults = CheckpointDefaults.from_checkpoint(DEMO_MODEL_DIR)
    assert defaults.temperature == 0.0   # the demo's generation_config: do_sample false
    p = vpb.SamplingParams(top_p=0.9, top_k=5, frequency_penalty=0.5, presence_penalty=-0.5,
                           repetition_penalty=1.2, max_tokens=20, min_tokens=2, stop=["x"], stop_token_ids=[5],
                           skip_special_tokens=True, spaces_between_special_tokens=True, n=3, logprobs=4,
                           prompt_logprobs=0, seed=7, logit_bias={10: 2.0})
    mapped = map_sampling(p, config, defaults, EOS)
    s = mapped.params
    assert not mapped.max_tokens_to_context
    assert (s.temperature, s.top_k, s.max_tokens, s.min_tokens, s.n, s.seed) == (0.0, 5, 20, 2, 3, 7)
    assert s.top_p == pytest.approx(0.9)
    assert (s.frequency_penalty, s.presence_penalty, s.repetition_penalty) == pytest.approx((0.5, -0.5, 1.2))
    assert (s.logprobs, s.top_logprobs, s.prompt_logprobs, s.stop, s.logit_bias) == (True, 4, True, ("x",),
                                                                                      ((10, 2.0),))
    assert s.response_format is None
    regex = map_sampling(vpb.SamplingParams(regex="[ab]+"), config, defaults, EOS).params.response_format
    assert (regex.kind, regex.spec) == ("regex", "[ab]+")
    unset = map_sampling(vpb.SamplingParams(temperature=0.5), config, defaults, EOS)
    assert unset.max_tokens_to_context and unset.params.max_tokens == 100 and unset.params.temperature == 0.5
    assert map_sampling(vpb.SamplingParams(json_object=True), config, defaults, EOS).params.response_format.kind == \
        "json_schema"
    choice = map_sampling(vpb.SamplingParams(choice=vpb.ChoiceConstraint(choices=['a"b', "c"])), config, defaults, EOS)
    assert choice.params.response_format.spec == 'root ::= "a\\"b" | "c"'


@pytest.mark.parametrize(("fields", "name"), [
    ({"min_p": 0.1}, "min_p"), ({"truncate_prompt_tokens": 5}, "truncate_prompt_tokens"),
    ({"stop_token_ids": [42]}, "stop_token_ids"), ({"include_stop_str_in_output": True}, "include_stop_str_in_output"),
    ({"structural_tag": "{}"}, "structural_tag"), ({"logprobs": -1}, "logprobs"), ({"n": 99}, "n"),
    ({"max_tokens": 101}, "max_tokens"), ({"temperature": -1}, "temperature"), ({"seed": -3}, "seed"),
    ({"logprobs": 2, "prompt_logprobs": 3}, "prompt_logprobs"), ({"json_schema": "{"}, "json_schema"),
    ({"regex": "x", "ignore_eos": True}, "ignore_eos"), ({"stop": [""]}, "stop[0]"),
    ({"logit_bias": {1: 500.0}}, "logit_bias[1]"),
])
def test_unsupported_or_out_of_range_fields_are_refused_by_name(fields, name):
    with pytest.raises(InvalidInputError) as e:
        map_sampling(vpb.SamplingParams(**fields), EngineConfig(max_tokens_limit=100, max_n=16),
                     CheckpointDefaults(), EOS)
    assert e.value.field == f"sampling_params.{name}"


def test_preprocessed_media_for_a_model_without_vision_is_refused_before_its_layout_is_read():
    """A gateway's mm_inputs, however well laid out, never reach a model with no vision tower (the
    demo checkpoint's spec with its vision dropped stands in for a text-only one)."""
    spec = load_spec(DEMO_MODEL_DIR)
    request = vpb.GenerateRequest(request_id="r", tokenized=vpb.TokenizedInput(input_ids=[2, spec.image_token_id]),
                                  mm_inputs=vpb.MultimodalInputs(modality=common_pb2.IMAGE))

    assert _prompt_ids(request, _processor(spec)) == [2, spec.image_token_id]
    with pytest.raises(InvalidInputError, match="takes no images or video") as e:
        _prompt_ids(request, _processor(dataclasses.replace(spec, vision=None)))
    assert e.value.field == "mm_inputs"


def test_file_url_refusals_quote_the_path_as_sent_bounded_never_resolved(tmp_path, monkeypatch):
    """The probe: a 6 KB file:// path came back whole, and the messages showed where a symlink points
    and the server's working directory (a relative-looking path resolved). Now: the spelled path,
    cut to a preview; no resolved path, target, working directory or allowed directory."""
    allowed, secret = tmp_path / "media", tmp_path / "secret-target"
    allowed.mkdir()
    secret.mkdir()
    (allowed / "link.mp4").symlink_to(secret / "key.mp4")
    (secret / "key.mp4").write_bytes(b"k")
    workdir = tmp_path / "server-workdir"
    workdir.mkdir()
    monkeypatch.chdir(workdir)
    long = "file://" + "/a" * 3000 + ".mp4"
    for url in (long, f"file://{allowed}/link.mp4", "file:relative/clip.mp4"):
        with pytest.raises(InvalidInputError) as e:
            media_inputs(refs(url), max_bytes=100, allowed_local_media_path=str(allowed))
        message = str(e.value)
        assert len(message) < 300, len(message)
        for hidden in (str(secret), str(workdir), str(allowed) if str(allowed) not in url else str(secret)):
            assert hidden not in message, (hidden, message)


def test_audio_is_refused_by_a_model_without_an_audio_tower_and_never_taken_preprocessed():
    """The demo checkpoint has no audio tower: an audio item is refused naming the model, before the
    anchors are paired (its template renders no `<|audio|>`); preprocessed audio is never taken."""
    spec = load_spec(DEMO_MODEL_DIR)
    request = vpb.GenerateRequest(request_id="r", tokenized=vpb.TokenizedInput(input_ids=[2, 4, 20]),
                                  media_refs=refs("data:audio/wav;base64,AAAA", modality=common_pb2.AUDIO))
    with pytest.raises(InvalidInputError, match="demo_model has no audio tower: it takes text, image, video") as e:
        _prompt_ids(request, _processor(spec))
    assert e.value.field == "media_refs.items"
    preprocessed = vpb.GenerateRequest(request_id="r", tokenized=vpb.TokenizedInput(input_ids=[2, spec.audio_token_id]),
                                       mm_inputs=vpb.MultimodalInputs(modality=common_pb2.AUDIO))
    with pytest.raises(InvalidInputError, match="preprocessed audio is not taken") as e:
        _prompt_ids(preprocessed, _processor(spec))
    assert e.value.field == "mm_inputs"


def _processor(spec):
    """A stand-in holding just what `_prompt_ids` reads."""
    return SimpleNamespace(spec=spec, max_model_len=spec.max_model_len, model_name=DEMO_MODEL_DIR.name,
                           tokenizer=SimpleNamespace(vocab_size=spec.vocab_size))
