"""Oversize request messages get INVALID_ARGUMENT naming --max-message-bytes, before parsing (grpc's own
refusal of one far over the limit stays RESOURCE_EXHAUSTED)."""

from __future__ import annotations

import asyncio
import secrets

import grpc
from rel_server import serve, stream_status

from mmserve.api.mmserve.v1 import generation_pb2, generation_pb2_grpc
from mmserve.config import ServerConfig
from mmserve.server.admission import TRANSPORT_HEADROOM_BYTES, MessageAdmission, transport_receive_limit

LIMIT = 256 * 1024


def _request(video_bytes: int) -> generation_pb2.GenerateRequest:
    video = generation_pb2.Video(data=secrets.token_bytes(video_bytes), mime_type="video/mp4")
    return generation_pb2.GenerateRequest(messages=[generation_pb2.Message(
        role="user", parts=[generation_pb2.Part(text="describe"), generation_pb2.Part(video=video)])])


def test_message_size_limit():
    options = [("grpc.max_receive_message_length", transport_receive_limit(LIMIT))]

    async def scenario():
        async with serve(ServerConfig(port=0), [MessageAdmission(LIMIT, 2**30)], options) as port, \
                grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = generation_pb2_grpc.GenerationStub(ch)
            small = _request(LIMIT // 2)
            assert small.ByteSize() <= LIMIT
            # Under the limit the request reaches the servicer (the generated base: UNIMPLEMENTED).
            assert (await stream_status(stub.Generate(small)))[0] == grpc.StatusCode.UNIMPLEMENTED
            over = _request(LIMIT + 100)
            code, message = await stream_status(stub.Generate(over))
            assert code == grpc.StatusCode.INVALID_ARGUMENT   # resending it can never succeed
            assert f"{over.ByteSize()} bytes" in message and f"limit of {LIMIT} bytes" in message
            assert "--max-message-bytes" in message and "UploadMedia" in message and "client.upload(" in message
            # Unary methods too; far beyond the limit, grpc itself refuses (RESOURCE_EXHAUSTED, its own words).
            try:
                await stub.Abort(generation_pb2.AbortRequest(request_id="x" * (LIMIT + 1)))
                raise AssertionError("an oversize Abort was accepted")
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "--max-message-bytes" in e.details()
            code, message = await stream_status(stub.Generate(_request(LIMIT + TRANSPORT_HEADROOM_BYTES + 1)))
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in message

    asyncio.run(scenario())
