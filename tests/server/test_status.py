"""status.map_error: each engine error gets its documented code and machine-readable details; a
request this server can never fit is INVALID_ARGUMENT on a real server."""

from __future__ import annotations

import grpc
import pytest
from google.rpc import code_pb2, error_details_pb2, status_pb2

from mmserve.clients import Client, ClientError
from mmserve.errors import (
    EngineInternalError,
    EngineUnavailableError,
    InvalidInputError,
    LimitExceededError,
    RequestAbortedError,
)
from mmserve.server.status import DETAILS_KEY, map_error


def _details(mapped) -> status_pb2.Status:
    (key, value), = mapped.trailing_metadata()
    assert key == DETAILS_KEY
    return status_pb2.Status.FromString(value)


@pytest.mark.parametrize("exc, code", [
    (InvalidInputError("sampling.top_k", "must be >= 0"), grpc.StatusCode.INVALID_ARGUMENT),
    (LimitExceededError("queue full", "--max-waiting-requests", retryable=True), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (LimitExceededError("video too big", "--max-video-bytes"), grpc.StatusCode.INVALID_ARGUMENT),
    (LimitExceededError("frame above the step budget", "--max-num-batched-tokens"), grpc.StatusCode.INVALID_ARGUMENT),
    (EngineUnavailableError("engine stopped"), grpc.StatusCode.UNAVAILABLE),
    (RequestAbortedError("aborted"), grpc.StatusCode.CANCELLED),
    (EngineInternalError("step failed"), grpc.StatusCode.INTERNAL),
    (RuntimeError("boom"), grpc.StatusCode.INTERNAL),
])
def test_codes(exc, code):
    assert map_error(exc, "req-7").code == code


def test_invalid_input_carries_a_field_violation():
    mapped = map_error(InvalidInputError("messages[0].parts[1].video.mime_type", "unsupported"))
    status = _details(mapped)
    assert status.code == code_pb2.INVALID_ARGUMENT and status.message == mapped.message
    bad = error_details_pb2.BadRequest()
    assert status.details[0].Unpack(bad)
    assert bad.field_violations[0].field == "messages[0].parts[1].video.mime_type"


def test_retryable_limit_carries_retry_info_and_the_flag():
    mapped = map_error(LimitExceededError("waiting queue is full", "--max-waiting-requests", retryable=True))
    assert "--max-waiting-requests" in mapped.message and "retry" in mapped.message
    info = error_details_pb2.RetryInfo()
    assert _details(mapped).details[0].Unpack(info)
    assert info.retry_delay.ToTimedelta().total_seconds() > 0
    assert map_error(LimitExceededError("video too big", "--max-video-bytes")).trailing_metadata() == ()


def test_internal_names_the_request_but_not_the_exception_text():
    assert "req-7" in map_error(EngineInternalError("step failed"), "req-7").message
    secret = map_error(RuntimeError("/secret/path"), "req-8").message
    assert "req-8" in secret and "/secret/path" not in secret


def test_a_request_larger_than_the_whole_kv_cache_is_invalid_argument(start_server, tiny_checkpoint):
    # 24 usable blocks of 16 tokens per pool: the warm-up (an image, ~280 tokens) fits, 400 + a few never can.
    server = start_server(tiny_checkpoint, num_kv_blocks=25)
    with Client(server.address, timeout=60) as client:
        assert client.model_info().context_length > 400 + 10
        with pytest.raises(ClientError) as refused:
            client.generate(prompt="hello", max_tokens=400, ignore_eos=True)
        fits = client.generate(prompt="hello", max_tokens=8, ignore_eos=True)
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "--kv-cache-bytes or --num-kv-blocks" in refused.value.message
    assert refused.value.retry_delay_s is None
    assert len(fits.token_ids) == 8


def test_a_message_quoting_9_kb_of_the_clients_input_arrives_bounded_through_both_doors(mmserve_server):
    """The probe: an invalid 9 KB json_schema whose parser error quotes it whole. grpc caps a status's
    metadata at 16 KiB, so the client got RESOURCE_EXHAUSTED "metadata size exceeds hard limit"
    instead of the real INVALID_ARGUMENT; now the message and its field violation are cut at 1 KiB."""
    from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
    from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vpb_grpc

    schema = '{"type": "' + "t" * 9000 + '"}'
    with Client(mmserve_server.address, timeout=60) as client, pytest.raises(ClientError) as v1:
        client.generate(prompt="hello", max_tokens=2, json_schema=schema)
    with grpc.insecure_channel(mmserve_server.address) as channel, pytest.raises(grpc.RpcError) as door:
        list(vpb_grpc.VllmEngineStub(channel).Generate(vpb.GenerateRequest(
            request_id="bounded", tokenized=vpb.TokenizedInput(input_ids=[2, 4, 10]),
            sampling_params=vpb.SamplingParams(max_tokens=2, json_schema=schema)), timeout=60))
    for code, message in ((v1.value.code, v1.value.message), (door.value.code(), door.value.details())):
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, message[:200])
        assert "Unsupported type" in message and "bytes cut" in message and len(message.encode()) <= 1024
    assert v1.value.field == "sampling.response_format.json_schema"
    status = _details(map_error(InvalidInputError("f" * 5000, "é" * 5000)))   # non-ASCII: bytes, not characters
    assert len(status.message.encode()) <= 1024 and len(status.SerializeToString()) < 3 * 1024
