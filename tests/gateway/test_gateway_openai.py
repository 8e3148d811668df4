"""OpenAI clients through the real SMG gateway onto two real mmserve replicas (VllmEngine door).

One fleet per module: two replicas (`serve`'s options, served in-process: demo model, each engine its
own process; no test here needs a replica's process) behind `smg launch --policy cache_aware`,
everything on 127.0.0.1, HF_ENDPOINT pointing at a refusing loopback port and the
tokenizer fetched with GetTokenizer. Each request's answer through the official `openai` client
is compared with the same request through our own mmserve.v1 client, greedy: same text, same
token sequence (each logprob entry's bytes against our token ids' decoding), same logprobs.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import random
import string
import time
import uuid
import zipfile

import grpc
import openai
import pytest
from audio_clips import tones, wav
from gateway_cases import assert_same, data_url, media_request, png, streamed_text
from otlp_receiver import OtlpReceiver, global_traces_to
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc
from smg_harness import Fleet

from mmserve.api import pb, pb_grpc
from mmserve.clients import Client
from mmserve.clients.messages import audio_part, message, text_part, video_part
from mmserve.clients.types import ClientError
from mmserve.config import DEMO_MODEL_DIR
from mmserve.model.tokenizer import load_tokenizer
from mmserve.server.vllm_engine.tokenizer_archive import archive_members

pytestmark = pytest.mark.timeout(600)

MAX_VIDEO_BYTES = 400_000   # small, so the oversize test sends little


@pytest.fixture(scope="module")
def receiver():
    """OTLP/gRPC on loopback: both replicas and SMG export their spans here."""
    sink = OtlpReceiver()
    yield sink
    sink.stop()


@pytest.fixture(scope="module")
def fleet(receiver):
    # A replica's first grammar compile also builds xgrammar's tokenizer tables (seconds of CPU on the
    # front end's thread, niced): at load 10-14 it once took over the default 5 s limit, which no test
    # here is about.
    replica_args = ("--max-video-bytes", str(MAX_VIDEO_BYTES), "--otlp-traces-endpoint", receiver.endpoint,
                    "--grammar-compile-timeout-s", "60")
    smg_args = ("--enable-trace", "--otlp-traces-endpoint", f"127.0.0.1:{receiver.port}")
    # In-process replicas' request spans come from the global tracer (`serve` sets it up from the flag).
    with global_traces_to(receiver), Fleet(2, policy="cache_aware", replica_args=replica_args, smg_args=smg_args,
                                           in_process=2) as f:
        yield f


@pytest.fixture(scope="module")
def client(fleet):
    return fleet.openai()


@pytest.fixture(scope="module")
def model(fleet):
    return fleet.model_id()


@pytest.fixture(scope="module")
def direct(fleet):
    """Our own mmserve.v1 client on replica 0."""
    with Client(fleet.replicas[0].address) as c:
        yield c


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEMO_MODEL_DIR)


def test_text_streaming_and_not_match_mmserve_v1(client, model, direct, tokenizer):
    ours = direct.generate(prompt="Hello", max_tokens=12, temperature=0, logprobs=True, top_logprobs=2)
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello"}],
                                           temperature=0, max_tokens=12, logprobs=True, top_logprobs=2)
    assert_same(reply.choices[0], ours, tokenizer)
    assert reply.usage.prompt_tokens == ours.usage.prompt_tokens
    assert reply.usage.completion_tokens == ours.usage.completion_tokens
    top = reply.choices[0].logprobs.content[0].top_logprobs
    assert [t.logprob for t in top] == pytest.approx([t.logprob for t in ours.logprobs[0].top], abs=1e-4)

    stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hello"}],
                                            temperature=0, max_tokens=12, stream=True,
                                            stream_options={"include_usage": True})
    text, reasons, usage = streamed_text(stream)
    assert text == ours.text and reasons == ["stop"]
    assert usage and usage[-1].completion_tokens == ours.usage.completion_tokens


def test_image_and_video_match_and_share_the_prefix_cache(fleet, client, model, tokenizer, make_video):
    """Same prompt ids, pixels and content hashes through both doors: a request first computed through
    mmserve.v1 on both replicas is then served from their prefix cache through SMG."""
    v1_parts, openai_content = media_request("What happens?", png(7), make_video(3, num_frames=8))
    results = []
    for replica in fleet.replicas:
        with Client(replica.address) as c:
            results.append(c.generate([message("user", *v1_parts)], max_tokens=10, temperature=0, logprobs=True))
    ours = results[0]
    assert results[1].token_ids == ours.token_ids
    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": openai_content}],
                                           temperature=0, max_tokens=10, logprobs=True)
    assert_same(reply.choices[0], ours, tokenizer)
    assert reply.usage.prompt_tokens == ours.usage.prompt_tokens   # every frame expanded as ours
    block = 16
    assert reply.usage.prompt_tokens_details.cached_tokens >= (ours.usage.prompt_tokens - 1) // block * block - block


def test_x_request_id_prefixes_our_request_id(fleet, client, model):
    client.chat.completions.create(model=model, temperature=0, max_tokens=2, extra_headers={"x-request-id": "trace-me-42"},
                                   messages=[{"role": "user", "content": "Hi"}])
    deadline = time.monotonic() + 10
    while not any("request trace-me-42" in r.log for r in fleet.replicas):
        assert time.monotonic() < deadline, [r.log[-2000:] for r in fleet.replicas]
        time.sleep(0.05)


def test_traceparent_continues_through_smg_into_our_span(client, model, receiver):
    """The client's trace -> SMG's span -> our mmserve.generate span, one trace."""
    trace_id, client_span = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    client.chat.completions.create(model=model, temperature=0, max_tokens=2, messages=[{"role": "user", "content": "Hi"}],
                                   extra_headers={"traceparent": f"00-{trace_id}-{client_span}-01"})

    def ours(spans):
        return next((s for s in spans if s.name == "mmserve.generate" and s.trace_id == trace_id), None)

    span = ours(receiver.wait_for(lambda spans: ours(spans) is not None, timeout=60))
    assert span.parent_span_id and span.parent_span_id != client_span   # a gateway span sits between
    spans = receiver.wait_for(lambda spans: any(s.span_id == span.parent_span_id for s in spans), timeout=60)
    gateway = {s.span_id: s for s in spans if s.trace_id == trace_id and s.name != "mmserve.generate"}
    assert span.parent_span_id in gateway


def test_completions_take_the_raw_prompt(client, model, direct):
    """/v1/completions: SMG tokenizes the prompt as given (no chat template, no BOS added), so the
    template written out by hand gives mmserve.v1's answer. SMG 1.13.0 forwards `logprobs` but answers
    none (docs/gateway.md): pinned, so an SMG that answers them shows here."""
    ours = direct.generate(prompt="Hello", max_tokens=12, temperature=0)
    reply = client.completions.create(model=model, prompt="<bos><|turn>user\nHello<turn|>\n<|turn>model\n",
                                      max_tokens=12, temperature=0, logprobs=2)
    assert reply.choices[0].text == ours.text
    assert reply.choices[0].logprobs is None
    assert reply.usage.prompt_tokens == ours.usage.prompt_tokens


def test_n2_samples(client, model, direct, tokenizer):
    ours = direct.generate(prompt="Describe a red circle", max_tokens=8, temperature=0, n=2)
    reply = client.chat.completions.create(model=model, n=2, temperature=0, max_tokens=8,
                                           messages=[{"role": "user", "content": "Describe a red circle"}])
    assert sorted(c.index for c in reply.choices) == [0, 1]
    for choice in reply.choices:
        assert choice.message.content == ours.samples[choice.index].text == ours.text
    streamed: dict[int, str] = {}
    for chunk in client.chat.completions.create(model=model, n=2, temperature=0, max_tokens=8, stream=True,
                                                messages=[{"role": "user", "content": "Describe a red circle"}]):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
    assert streamed == {0: ours.text, 1: ours.text}
    fresh = "".join(random.choices(string.ascii_lowercase + " ", k=80))   # never seen: nothing cached
    reply = client.chat.completions.create(model=model, n=2, max_tokens=2, messages=[{"role": "user", "content": fresh}])
    assert reply.usage.prompt_tokens > 16 and reply.usage.prompt_tokens_details.cached_tokens == 0   # SMG keeps the max


def test_json_schema_response_format(client, model, direct):
    schema = {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "green"]}},
              "required": ["color"], "additionalProperties": False}
    ours = direct.generate(prompt="Which color?", max_tokens=24, temperature=0, json_schema=schema)
    reply = client.chat.completions.create(
        model=model, temperature=0, max_tokens=24, messages=[{"role": "user", "content": "Which color?"}],
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}})
    assert reply.choices[0].message.content == ours.text
    assert json.loads(ours.text)["color"] in ("red", "green")


def test_stop_string(client, model, direct):
    free = direct.generate(prompt="Hello", max_tokens=12, temperature=0)
    stop = free.text.split()[1]          # a word from the middle of the free run
    ours = direct.generate(prompt="Hello", max_tokens=12, temperature=0, stop=[stop])
    reply = client.chat.completions.create(model=model, temperature=0, max_tokens=12, stop=[stop],
                                           messages=[{"role": "user", "content": "Hello"}])
    assert ours.finish_reason == "stop"
    assert reply.choices[0].finish_reason == "stop"
    assert reply.choices[0].message.content == ours.text


def _idle(replica_address: str, deadline_s: float = 30.0) -> pb.ServerLoad:
    with Client(replica_address) as c:
        end = time.monotonic() + deadline_s
        while True:
            load = c.server_load()
            if (load.running_requests == 0 and load.waiting_requests == 0) or time.monotonic() > end:
                return load
            time.sleep(0.05)


def test_client_disconnect_aborts_in_the_engine(fleet, model):
    """SMG turns the client's disconnect into Abort (or cancels its Generate stream); the replica ends
    the request and frees its KV. About two seconds of decoding are left when the client goes. SMG
    notices a disconnect only when it next writes to the client, and it writes nothing for a token
    without text: the demo model's answer is five words, then `<turn|>` over and over (ignore_eos),
    which SMG skips by default. So a client gone after those five words reached it left SMG nothing
    to write, and the request ran to max_tokens: about one time in three when the client closed after
    its first chunk (on a busy machine it is slow to close), every time after eight chunks. Special tokens
    kept, every token is a chunk SMG writes: the client here closes after eight, past the words, and
    SMG must notice at its next write. The client has a connection of its own and closes it."""
    request_id = "client-gone"
    own = fleet.openai()
    stream = own.chat.completions.create(
        model=model, temperature=0, max_tokens=1000, stream=True,
        extra_body={"ignore_eos": True, "skip_special_tokens": False},
        messages=[{"role": "user", "content": "Count forever"}], extra_headers={"x-request-id": request_id})
    chunks = iter(stream)
    for _ in range(8):
        next(chunks)
    busy = [r for r in fleet.replicas if _load(r.address).running_requests]
    assert len(busy) == 1, "the request runs on exactly one replica"
    stream.close()
    own.close()
    load = _idle(busy[0].address)
    assert load.running_requests == 0 and load.kv_cache_usage == 0.0
    deadline = time.monotonic() + 10
    while f"request {request_id}" not in busy[0].log and f"aborted {request_id}" not in busy[0].log:
        assert time.monotonic() < deadline, busy[0].log[-3000:]
        time.sleep(0.05)
    lines = [line for line in busy[0].lines if request_id in line]
    assert not any("finished (length)" in line for line in lines), f"SMG did not abort the request: {lines}"


def _load(address: str) -> pb.ServerLoad:
    with Client(address) as c:
        return c.server_load()


def _both_doors(address: str, v1_request: pb.GenerateRequest, vllm_request: vpb.GenerateRequest):
    """(code, message) of the same bad request through mmserve.v1 and through VllmEngine."""
    with grpc.insecure_channel(address) as channel:
        out = []
        for call, request in ((pb_grpc.GenerationStub(channel).Generate, v1_request),
                              (vpb_grpc.VllmEngineStub(channel).Generate, vllm_request)):
            with pytest.raises(grpc.RpcError) as e:
                list(call(request, timeout=60))
            out.append((e.value.code(), e.value.details()))
        return out


def _prompt(tokenizer, text: str, anchor: int | None = None) -> list[int]:
    """What SMG renders for one user turn (the demo template): bos, turn, user, [anchor], text."""
    body = tokenizer.encode("user\n") + ([anchor] if anchor is not None else []) + tokenizer.encode(text)
    return [2, 4, *body, 5, *tokenizer.encode("\n"), 4, *tokenizer.encode("model\n")]


def test_bad_input_gets_the_same_statuses_through_both_doors(fleet, client, model, tokenizer):
    address = fleet.replicas[0].address
    video_anchor = 9
    # oversize media: the same limit, code and message
    junk = b"\0" * (MAX_VIDEO_BYTES + 1)
    v1, ours = _both_doors(address, pb.GenerateRequest(messages=[message("user", video_part(junk, "video/mp4"))]),
                           vpb.GenerateRequest(request_id="big", tokenized=vpb.TokenizedInput(
                               input_ids=_prompt(tokenizer, "", video_anchor)),
                               media_refs=vpb.MediaRefs(items=[vpb.MediaRef(modality=common_pb2.VIDEO,
                                                                            url=data_url(junk, "video/mp4"))])))
    assert v1 == ours and v1[0] == grpc.StatusCode.INVALID_ARGUMENT and "--max-video-bytes" in v1[1]
    # through SMG: a permanent refusal is 400, which it never retries (RESOURCE_EXHAUSTED was 429,
    # which SMG retried 5 times and the openai SDK twice more, decoding and refusing each time)
    with pytest.raises(openai.BadRequestError, match="--max-video-bytes"):
        client.chat.completions.create(model=model, max_tokens=4, messages=[
            {"role": "user", "content": media_request("What happens?", video=junk)[1]}])
    # n too large, and an unknown/unsupported constraint: INVALID_ARGUMENT naming the field
    text_ids = vpb.TokenizedInput(input_ids=_prompt(tokenizer, "Hi"))
    v1, ours = _both_doors(address, pb.GenerateRequest(messages=[message("user", text_part("Hi"))],
                                                       sampling=pb.SamplingParams(n=17)),
                           vpb.GenerateRequest(request_id="n", tokenized=text_ids, sampling_params=vpb.SamplingParams(n=17)))
    assert v1[0] == ours[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert "--max-n" in v1[1] and "--max-n" in ours[1] and "sampling_params.n" in ours[1]
    bad_format = pb.SamplingParams()
    bad_format.response_format.SetInParent()
    v1, ours = _both_doors(address, pb.GenerateRequest(messages=[message("user", text_part("Hi"))], sampling=bad_format),
                           vpb.GenerateRequest(request_id="c", tokenized=text_ids,
                                               sampling_params=vpb.SamplingParams(structural_tag="{}")))
    assert v1[0] == ours[0] == grpc.StatusCode.INVALID_ARGUMENT and "structural_tag" in ours[1]
    # refused URL schemes: SMG holds requests to the schemes we advertise (data only, here) and
    # answers 400; a gateway that sent one anyway gets INVALID_ARGUMENT naming the part
    image_ids = vpb.TokenizedInput(input_ids=_prompt(tokenizer, "what?", 8))
    with grpc.insecure_channel(address) as channel:
        for url in ("http://127.0.0.1:9/cat.png", "https://example.com/cat.png", "file:///etc/passwd", "ftp://x/y"):
            with pytest.raises(openai.BadRequestError):
                client.chat.completions.create(model=model, max_tokens=4, messages=[{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what?"}]}])
            request = vpb.GenerateRequest(request_id="url", tokenized=image_ids, media_refs=vpb.MediaRefs(
                items=[vpb.MediaRef(modality=common_pb2.IMAGE, url=url)]))
            with pytest.raises(grpc.RpcError) as e:
                list(vpb_grpc.VllmEngineStub(channel).Generate(request, timeout=30))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "media_refs.items[0].url" in e.value.details() and "refused" in e.value.details()
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, max_tokens=4, n=17, messages=[{"role": "user", "content": "Hi"}])
    assert "n" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:   # SMG's own cap, below our --max-n (16): docs/gateway.md
        client.chat.completions.create(model=model, max_tokens=4, n=11, messages=[{"role": "user", "content": "Hi"}])
    assert "--max-n" not in str(e.value)
    assert len(client.chat.completions.create(model=model, max_tokens=2, n=10, messages=[
        {"role": "user", "content": "Hi"}]).choices) == 10
    with pytest.raises(ClientError):   # and mmserve.v1 says the same for n
        with Client(address) as c:
            c.generate(prompt="Hi", n=17)


def test_audio_on_a_model_without_an_audio_tower_is_refused(fleet, client, model, tokenizer):
    """The demo model has no audio tower (its config has no audio_config): SMG 1.13.0 refuses an
    `input_audio` part itself (400, observed), and a gateway that forwards one anyway gets
    INVALID_ARGUMENT naming the model, as mmserve.v1 does."""
    clip = wav(tones(random.randrange(10**6), 0.5))
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model, max_tokens=4, messages=[{"role": "user", "content": [
            {"type": "input_audio", "input_audio": {"data": base64.b64encode(clip).decode(), "format": "wav"}},
            {"type": "text", "text": "What is this sound?"}]}])
    assert "modality audio is not supported" in str(e.value), str(e.value)
    request = vpb.GenerateRequest(request_id="audio", tokenized=vpb.TokenizedInput(
        input_ids=_prompt(tokenizer, "What is this sound?")), media_refs=vpb.MediaRefs(
        items=[vpb.MediaRef(modality=common_pb2.AUDIO, url=data_url(clip, "audio/wav"))]))
    v1, ours = _both_doors(fleet.replicas[0].address,
                           pb.GenerateRequest(messages=[message("user", audio_part(clip), text_part("What is this sound?"))]),
                           request)
    assert v1[0] == ours[0] == grpc.StatusCode.INVALID_ARGUMENT
    for _, message_ in (v1, ours):
        assert "demo_model has no audio tower: it takes text, image, video" in message_, (v1, ours)


def test_get_tokenizer_archive_is_the_checkpoint_byte_for_byte(fleet):
    with grpc.insecure_channel(fleet.replicas[0].address) as channel:
        chunks = list(vpb_grpc.VllmEngineStub(channel).GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=30))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    assert all(not c.sha256 for c in chunks[:-1])
    with zipfile.ZipFile(io.BytesIO(data)) as zf:
        unpacked = {name: zf.read(name) for name in zf.namelist()}
    expected = {p.name: p.read_bytes() for p in archive_members(DEMO_MODEL_DIR)}
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(unpacked)
    assert unpacked == expected
    # SMG registered its tokenizer from this archive (HF_ENDPOINT refuses, so nothing else could serve it)
    assert any("sending the tokenizer archive" in r.log for r in fleet.replicas)


def test_a_tiny_temperature_answers_as_greedy_through_smg(client, model):
    """The OpenAI door of the probe: temperature 1e-38 (valid JSON, a float32 on the wire to us) gave pad
    tokens up to max_tokens; below 1e-5 it is greedy now (tests/server/test_sampling_api.py: both
    gRPC doors, and the bound)."""
    kwargs = dict(model=model, max_tokens=6, messages=[{"role": "user", "content": "Name a colour."}])
    greedy = client.chat.completions.create(temperature=0, **kwargs).choices[0]
    tiny = client.chat.completions.create(temperature=1e-38, **kwargs).choices[0]
    assert greedy.message.content.strip()
    assert (tiny.message.content, tiny.finish_reason) == (greedy.message.content, greedy.finish_reason)
