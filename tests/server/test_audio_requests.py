"""Audio through a real server (gRPC, PyAV decode, feature extraction, the audio tower, paged
decoder) on a fresh random tiny E-model with an audio tower: greedy tokens equal transformers'
`generate` on the same checkpoint given the equivalent input, whose prompt is laid out here from
transformers' own processor rule (`Gemma4Processor.replace_audio_token` on its feature extractor's
mask) and whose features come from transformers' `Gemma4AudioFeatureExtractor` on the clip's exact
samples (WAV/PCM is lossless). Prefill runs at a step budget smaller than one audio segment, so
segments are split between chunks. Bad audio gets a clear status and leaves nothing held.
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import socket
import types
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from audio_clips import av_clip, encode, tones, wav, wav_declaring, wav_f32, wav_with_layout

from mmserve.clients import Client, ClientError
from mmserve.clients.messages import audio_part, message, text_part, video_part
from mmserve.multimodal.limits import MediaLimits
from mmserve.multimodal.preprocess import preprocess_images
from mmserve.multimodal.synthetic import plan, render
from mmserve.multimodal.video import decode_video

BUDGET = 40        # tokens per step: a 2 s clip's 50 audio tokens need two chunks
MAX_TOKENS = 6
MAX_AUDIO = 2      # --max-audio-per-request: the module's requests hear two clips at most
NOT_AUDIO = b"\x00\x01 not an audio file at all" * 8   # refused as unrecognised once its header is read


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, gemma4_fixtures):
    path = tmp_path_factory.mktemp("e_audio")
    gemma4_fixtures.make_checkpoint(path, config=gemma4_fixtures.e_model_config(), seed=int(np.random.randint(1000)))
    for name in ("preprocessor_config.json", "video_preprocessor_config.json"):   # every image fits the budget
        (path / name).write_text(json.dumps({"patch_size": 4, "pooling_kernel_size": 2, "max_soft_tokens": 16}))
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    from loopback_server import LoopbackServer, engine_config

    from mmserve.config import ServerConfig

    with socket.socket() as s:   # a free port for its /metrics
        s.bind(("127.0.0.1", 0))
        metrics_port = s.getsockname()[1]
    # The engine core on a thread of this process (the same core and IPC, no second interpreter to
    # start: this module's own start-up was mostly a spawned process importing torch again).
    server = LoopbackServer(engine_config(model_dir, max_num_batched_tokens=BUDGET, default_num_frames=2,
                                          max_audio_duration_s=60.0, max_audio_per_request=MAX_AUDIO,
                                          engine_process=False),
                            ServerConfig(host="127.0.0.1", port=0, worker_threads=2, metrics_port=metrics_port)).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def reference(model_dir):
    """transformers' Gemma4ForConditionalGeneration and feature extractor, and our tokenizer (the
    checkpoint's tokenizer.json) for the text pieces."""
    from transformers import Gemma4ForConditionalGeneration
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    from mmserve.model.tokenizer import load_tokenizer

    hf = Gemma4ForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    return types.SimpleNamespace(hf=hf, fe=Gemma4AudioFeatureExtractor(), tok=load_tokenizer(model_dir))


def _audio_text(fe, clips: list[np.ndarray]) -> tuple[list[str], dict]:
    """transformers' expansion of each clip's `<|audio|>` and the batched features for its forward."""
    from transformers.models.gemma4.processing_gemma4 import Gemma4Processor

    batch = fe([c.astype(np.float32) / 32768 for c in clips], return_tensors="pt")
    names = types.SimpleNamespace(boa_token="<|audio>", audio_token="<|audio|>", eoa_token="<audio|>")
    texts = [Gemma4Processor.replace_audio_token(names, {"input_features_mask": batch["input_features_mask"].numpy()}, i)
             for i in range(len(clips))]
    return texts, {"input_features": batch["input_features"], "input_features_mask": batch["input_features_mask"]}


def _greedy(ref, content: str, **inputs) -> tuple[list[int], list[int]]:
    """The prompt's ids (specials by name, text by the tokenizer) and transformers' greedy tokens."""
    ids = ref.tok.backend.encode(f"<bos><|turn>user\n{content}<turn|>\n<|turn>model\n", add_special_tokens=False).ids
    with torch.no_grad():
        out = ref.hf.generate(input_ids=torch.tensor([ids]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS,
                              do_sample=False, **inputs)
    return ids, out[0, len(ids):].tolist()


def _served(server, parts, **kwargs):
    with Client(server.address, timeout=120) as client:
        return client.generate([message("user", *parts)], max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS,
                               temperature=0, **kwargs)


def test_audio_prompts_greedy_match_transformers(server, reference):
    """Audio alone, audio + text, two audio parts + text; then the last again: a prefix-cache hit."""
    a, b = tones(int(np.random.randint(1000)), 2.0), tones(int(np.random.randint(1000)), 1.3)
    (ta, tb), _ = _audio_text(reference.fe, [a, b])
    cases = [
        ([audio_part(wav(a))], ta, [a]),
        ([audio_part(wav(a)), text_part("What is this sound?")], ta + "What is this sound?", [a]),
        ([audio_part(wav(a)), audio_part(wav(b)), text_part("Compare them.")], ta + tb + "Compare them.", [a, b]),
    ]
    for parts, content, clips in cases:
        _, inputs = _audio_text(reference.fe, clips)
        ids, expected = _greedy(reference, content, **inputs)
        assert len(ids) > BUDGET   # prefill is chunked, through the middle of a segment
        result = _served(server, parts)
        assert list(result.token_ids) == expected, content
        assert result.usage.prompt_tokens == len(ids)
    again = _served(server, cases[-1][0])
    assert list(again.token_ids) == expected
    assert again.usage.cached_tokens > 0


def test_video_soundtrack_greedy_matches_transformers(server, reference):
    """use_audio_in_video: the frames, then the window's sound as a segment after its mm:ss start."""
    frames = render(plan(int(np.random.randint(1000)), size=32, num_frames=8), size=32, num_frames=8)
    sound = tones(int(np.random.randint(1000)), 2.0)
    clip = av_clip(frames, 4, sound)
    spec_video = decode_video(clip, num_frames=2, limits=MediaLimits())   # the frames the server samples
    batch = preprocess_images(spec_video.frames, patch_size=4, pooling_kernel_size=2, max_soft_tokens=16)
    (text,), inputs = _audio_text(reference.fe, [sound])
    content = " ".join(f"00:0{int(t)} <|image>" + "<|video|>" * n + "<image|>"
                       for t, n in zip(spec_video.timestamps_s, batch.num_soft_tokens, strict=True))
    content += " 00:00 " + text + "What happens?"
    ids = reference.tok.backend.encode(f"<bos><|turn>user\n{content}<turn|>\n<|turn>model\n", add_special_tokens=False).ids
    types_ = torch.tensor([[2 if t == reference.hf.config.video_token_id else 0 for t in ids]])
    _, expected = _greedy(reference, content, pixel_values_videos=batch.pixel_values,
                          video_position_ids=batch.position_ids, num_frames_per_video=torch.tensor([2]),
                          mm_token_type_ids=types_, **inputs)
    result = _served(server, [video_part(clip, num_frames=2), text_part("What happens?")], use_audio_in_video=True)
    assert list(result.token_ids) == expected
    assert result.usage.prompt_tokens == len(ids)


def test_mixed_batch_gives_each_request_its_solo_tokens(server):
    """Audio, video-with-sound and text requests at once: each gets the tokens it gets alone."""
    frames = render(plan(5, size=32, num_frames=8), size=32, num_frames=8)
    requests = [
        dict(parts=[audio_part(wav(tones(11, 1.5))), text_part("Hear.")]),
        dict(parts=[video_part(av_clip(frames, 4, tones(12, 2.0)), num_frames=2)], use_audio_in_video=True),
        dict(parts=[text_part("Plain text, no media at all.")]),
        dict(parts=[audio_part(encode(tones(13, 1.0), fmt="flac", codec="flac"))]),
    ]
    alone = [list(_served(server, **r).token_ids) for r in requests]
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(lambda r: list(_served(server, **r).token_ids), requests))
    assert together == alone


BAD = {
    "lying header (hours declared)": (wav_declaring(6 * 3600, 4000), grpc.StatusCode.INVALID_ARGUMENT,
                                      "--max-audio-duration-s"),
    "0 samples": (wav_declaring(0, 0), grpc.StatusCode.INVALID_ARGUMENT, "no samples"),
    # refused from the header: FFmpeg said "avcodec_open2(...) returned 22", the resampler ran out of memory
    "1024 channels": (wav_with_layout(1024, 16000), grpc.StatusCode.INVALID_ARGUMENT, "1024 channels; at most 64"),
    "2^31 Hz": (wav_with_layout(1, 2**31 - 1, frames=4000), grpc.StatusCode.INVALID_ARGUMENT,
                "sample rate is 2147483647 Hz; at most 768000 Hz"),
    "silence": (wav(np.zeros(16000, np.int16)), grpc.StatusCode.INVALID_ARGUMENT, "silent"),
    "not audio": (NOT_AUDIO, grpc.StatusCode.INVALID_ARGUMENT, "unrecognised"),
    "truncated": (wav(tones(3, 1.0))[:30], grpc.StatusCode.INVALID_ARGUMENT, "audio"),
    # float samples a broken encoder wrote: NaN's peak passed the silence check and was answered, status OK
    "NaN samples": (wav_f32(np.where(np.arange(16000) % 97 == 0, np.nan, tones(4, 1.0) / 32768)),
                    grpc.StatusCode.INVALID_ARGUMENT, "not finite numbers"),
    "infinite samples": (wav_f32(np.where(np.arange(16000) % 97 == 0, np.inf, tones(5, 1.0) / 32768)),
                         grpc.StatusCode.INVALID_ARGUMENT, "not finite numbers"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_audio_gets_a_clear_status_and_holds_nothing(server, case):
    data, code, words = BAD[case]
    with pytest.raises(ClientError) as e:
        _served(server, [audio_part(data), text_part("?")])
    assert e.value.code == code and words in e.value.message, e.value.message
    assert "messages[0].parts[0].audio" in e.value.message or words.startswith("--"), e.value.message   # a limit names its flag
    assert len(e.value.message) < 400
    held = server.call(server.engine.held_resources())
    assert not held["requests"], held


def test_audio_parts_over_the_count_are_refused_before_any_is_read(server):
    """A request of many tiny clips (a few tokens each, within the context) had no bound but the
    context, each clip opened by PyAV. One clip over --max-audio-per-request is refused by its count,
    naming it, the limit and the flag: the clips are bytes that no header read survives, so a refusal
    naming the count proves none was read. At the limit, with a video's soundtrack beside (not a
    clip), the request is served; GetServerInfo advertises the same limit to a gateway."""
    refused = f"{MAX_AUDIO + 1} audio parts, at most {MAX_AUDIO} per request (--max-audio-per-request)"
    with pytest.raises(ClientError) as e:
        _served(server, [audio_part(NOT_AUDIO)] * (MAX_AUDIO + 1) + [text_part("?")])
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and refused in e.value.message, e.value.message
    held = server.call(server.engine.held_resources())
    assert not held["requests"], held
    with pytest.raises(ClientError) as e:   # at the limit the clips are read: the same bytes, another refusal
        _served(server, [audio_part(NOT_AUDIO)] * MAX_AUDIO + [text_part("?")])
    assert "unrecognised" in e.value.message and "--max-audio-per-request" not in e.value.message, e.value.message
    seed = int(np.random.randint(1000))
    frames = render(plan(seed, size=32, num_frames=4), size=32, num_frames=4)
    clips = [audio_part(wav(tones(seed + k, 0.5))) for k in range(MAX_AUDIO)]
    result = _served(server, [*clips, video_part(av_clip(frames, 4, tones(seed + 9, 1.0)), num_frames=2)],
                     use_audio_in_video=True)
    assert len(result.token_ids) == MAX_TOKENS and result.usage.num_frames == 2


def test_the_gateway_door_holds_and_advertises_the_audio_count(server, model_dir):
    """The VllmEngine door (a gateway's rendered ids, each clip a `media_refs` AUDIO item) counts the
    items as mmserve.v1 counts parts, before any is read; GetServerInfo's mm_item_limits says so."""
    import base64

    from smg_grpc_proto.generated import common_pb2
    from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
    from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

    from mmserve.model.spec import load_spec_without_transformers
    from mmserve.model.tokenizer import load_tokenizer

    tok, spec = load_tokenizer(model_dir), load_spec_without_transformers(model_dir)
    url = "data:audio/wav;base64," + base64.b64encode(NOT_AUDIO).decode()

    def request(clips: int) -> vpb.GenerateRequest:
        ids = ([spec.bos_token_id, tok.token_id("<|turn>")] + tok.encode("user\n") + [spec.audio_token_id] * clips
               + [tok.token_id("<turn|>")] + tok.encode("\n") + [tok.token_id("<|turn>")] + tok.encode("model\n"))
        return vpb.GenerateRequest(request_id=f"clips-{clips}", tokenized=vpb.TokenizedInput(input_ids=ids),
                                   sampling_params=vpb.SamplingParams(max_tokens=1),
                                   media_refs=vpb.MediaRefs(items=[vpb.MediaRef(modality=common_pb2.AUDIO, url=url)]
                                                            * clips))

    with grpc.insecure_channel(server.address) as channel:
        stub = vpb_grpc.VllmEngineStub(channel)
        limits = dict(item.split("=") for item in stub.GetServerInfo(vpb.GetServerInfoRequest(),
                                                                     timeout=30).mm_item_limits.split(","))
        outcomes = {}
        for clips in (MAX_AUDIO + 1, MAX_AUDIO):
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(request(clips), timeout=60))
            outcomes[clips] = e.value
    assert limits["audio"] == str(MAX_AUDIO)
    over = outcomes[MAX_AUDIO + 1]
    assert over.code() == grpc.StatusCode.INVALID_ARGUMENT, over.details()
    assert f"{MAX_AUDIO + 1} audio parts, at most {MAX_AUDIO} per request (--max-audio-per-request)" in over.details()
    assert "media_refs.items[0].audio" in outcomes[MAX_AUDIO].details()   # within the count: read, and refused


def _documented(present: str) -> dict[str, set[str]]:
    """docs/tracing.md's span table rows present only on `present` requests: span -> attribute names."""
    rows: dict[str, set[str]] = {}
    for line in (Path(__file__).parents[2] / "docs" / "tracing.md").read_text().splitlines():
        if m := re.match(rf"^\| `(mmserve\.[a-z_.]+)` \| `([a-z_.]+)` \| {present} \|", line):
            rows.setdefault(m.group(1), set()).add(m.group(2))
    return rows


def test_audio_spans_under_the_request_span_as_documented(server):
    """The front end's `mmserve.audio.decode` span (PyAV decode, resampling, log-mel features) and the
    engine's `mmserve.audio.encode` are children of the request's span, with what the window gave
    and docs/tracing.md's attribute names; a video's soundtrack is read in its `mmserve.video.decode`
    span (the same pass); a refused clip's span is an error with the reason."""
    from otlp_receiver import OtlpReceiver, global_traces_to

    seed = int(np.random.randint(1000))
    frames = render(plan(seed, size=32, num_frames=8), size=32, num_frames=8)
    asks = {"audio": dict(parts=[audio_part(wav(tones(seed, 3.0)), start_s=0.5, end_s=2.5), text_part("Hear.")]),
            "video": dict(parts=[video_part(av_clip(frames, 4, tones(seed + 1, 2.0)), num_frames=2)],
                          use_audio_in_video=True),
            "silent": dict(parts=[audio_part(wav(np.zeros(8000, np.int16)))])}
    receiver = OtlpReceiver()
    try:
        with global_traces_to(receiver):
            served = {}
            for name, ask in asks.items():
                try:
                    served[name] = _served(server, request_id=f"span-{name}-{seed}", **ask)
                except ClientError as e:
                    served[name] = e
        def tree(spans, name, child):
            roots = [s for s in spans if s.name == "mmserve.generate"
                     and s.attributes.get("mmserve.request.id") == f"span-{name}-{seed}"]
            return [s for s in spans if roots and s.parent_span_id == roots[0].span_id and s.name == child]

        wanted = (("audio", "mmserve.audio.decode"), ("audio", "mmserve.audio.encode"), ("video", "mmserve.video.decode"),
                  ("silent", "mmserve.audio.decode"))
        spans = receiver.wait_for(lambda spans: all(tree(spans, n, c) for n, c in wanted))
    finally:
        receiver.stop()
    (audio,) = tree(spans, "audio", "mmserve.audio.decode")
    encodes = tree(spans, "audio", "mmserve.audio.encode")
    docs = _documented("audio")
    assert set(docs) == {"mmserve.audio.decode", "mmserve.audio.encode"}
    assert set(audio.attributes) == docs["mmserve.audio.decode"]
    assert all(set(e.attributes) == docs["mmserve.audio.encode"] for e in encodes)
    assert sum(e.attributes["mmserve.audio.num_segments"] for e in encodes) == 1
    assert all(e.attributes["mmserve.perf.flops"] > 0 and e.attributes["mmserve.perf.attn_flops.sliding"] == 0
               == e.attributes["mmserve.perf.attn_flops.full"] for e in encodes)
    a = audio.attributes
    assert not audio.is_error and a["mmserve.audio.input_bytes"] == len(wav(tones(seed, 3.0)))
    assert a["mmserve.audio.duration_s"] == pytest.approx(3.0) and a["mmserve.audio.start_s"] == 0.5
    assert a["mmserve.audio.heard_s"] == pytest.approx(2.0, abs=1e-3) and a["mmserve.audio.segments"] == 1
    assert a["mmserve.audio.sample_bytes"] == 4 * 32000
    assert a["mmserve.audio.soft_tokens"] == served["audio"].usage.multimodal_tokens
    (video,) = tree(spans, "video", "mmserve.video.decode")
    assert _documented("soundtrack") == {"mmserve.video.decode": {"mmserve.video.soundtrack_s",
                                                                  "mmserve.video.soundtrack_segments"}}
    assert {"mmserve.video.soundtrack_s", "mmserve.video.soundtrack_segments"} <= set(video.attributes)
    assert video.attributes["mmserve.video.soundtrack_s"] == pytest.approx(2.0, abs=0.05)
    assert video.attributes["mmserve.video.soundtrack_segments"] == 1 and video.attributes["mmserve.video.num_frames"] == 2
    (silent,) = tree(spans, "silent", "mmserve.audio.decode")
    assert isinstance(served["silent"], ClientError) and silent.is_error and "silent" in silent.status_message


def test_video_without_sound_or_only_sound_is_refused_with_use_audio_in_video(server):
    frames = render(plan(2, size=32, num_frames=4), size=32, num_frames=4)
    for clip, words in ((av_clip(frames, 4, None), "no audio stream"),
                        (encode(tones(4, 1.0), fmt="matroska"), "no video stream")):
        with pytest.raises(ClientError) as e:
            _served(server, [video_part(clip, num_frames=2)], use_audio_in_video=True)
        assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and words in e.value.message, e.value.message


def test_model_info_lists_audio(server, mmserve_server):
    with Client(server.address) as client:
        assert list(client.model_info().supported_inputs) == ["text", "image", "video", "audio"]
    with Client(mmserve_server.address) as client:   # the demo model: no audio tower
        assert "audio" not in client.model_info().supported_inputs
        with pytest.raises(ClientError) as e:
            client.generate([message("user", audio_part(wav(tones(1, 0.5))))], max_tokens=1)
    assert e.value.code == grpc.StatusCode.INVALID_ARGUMENT and "has no audio tower" in e.value.message


def _counters(server) -> dict[tuple[str, str], float]:
    """(sample name, modality) -> value of the encoder-cache and frames-encoded counters on the server's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    port = server.observability.metrics_port
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {(sample.name, sample.labels.get("modality", "")): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.name.startswith(("mmserve_encoder_cache_", "mmserve_vision_frames_encoded"))}


def test_encoder_cache_counts_audio_segments_in_each_chunk_they_reach(server):
    """A segment split between two prefill chunks is looked up in both: encoded in the first, found in
    the second; the same sound after other text is found whole. Misses are the encoder's real runs."""
    sound = wav(tones(int(np.random.randint(1000)), 2.0))
    before = _counters(server)
    _served(server, [audio_part(sound), text_part("What is this?")])
    first = _counters(server)
    _served(server, [text_part("Listen carefully."), audio_part(sound)])   # other text first: no KV hit
    second = _counters(server)

    def delta(a, b, name, modality="audio"):
        return b.get((name, modality), 0) - a.get((name, modality), 0)

    q1, h1 = delta(before, first, "mmserve_encoder_cache_queries_total"), delta(before, first, "mmserve_encoder_cache_hits_total")
    q2, h2 = delta(first, second, "mmserve_encoder_cache_queries_total"), delta(first, second, "mmserve_encoder_cache_hits_total")
    assert q1 >= 2 and h1 == q1 - 1, (q1, h1)   # one run of the tower, the later chunks found it
    assert q2 >= 2 and h2 == q2, (q2, h2)
    assert delta(before, second, "mmserve_vision_frames_encoded_total", "") == (q1 - h1) + (q2 - h2)
    for modality in ("image", "video"):
        assert delta(before, second, "mmserve_encoder_cache_queries_total", modality) == 0
