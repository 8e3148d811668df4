"""API-key interceptor on a real loopback server: who gets in, who gets UNAUTHENTICATED, and why."""

from __future__ import annotations

import asyncio
import secrets

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from rel_server import serve, stream_status

from mmserve.api.mmserve.v1 import generation_pb2, generation_pb2_grpc
from mmserve.config import ServerConfig
from mmserve.server.auth import API_KEYS_ENV, build_auth_interceptor, load_api_keys, parse_api_keys


def _bearer(key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {key}"),)


@pytest.fixture
def keys(tmp_path, monkeypatch):
    """Two keys in a file (with comments) and one from the environment, all random."""
    file_keys = [secrets.token_urlsafe(24), secrets.token_urlsafe(8)]
    env_key = secrets.token_hex(16)
    path = tmp_path / "keys.txt"
    path.write_text(f"# production keys\n\n  {file_keys[0]}  \n# rotated 2026-11\n{file_keys[1]}\n")
    monkeypatch.setenv(API_KEYS_ENV, f" {env_key} ,,")
    return str(path), file_keys, env_key


def test_key_file_parsing(keys, tmp_path):
    path, file_keys, env_key = keys
    assert parse_api_keys("#a\n b \n\n#c\nd") == ["b", "d"]
    assert load_api_keys(path) == [*file_keys, env_key]
    assert load_api_keys("", env="") == []
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing yet\n\n")
    with pytest.raises(ValueError, match="--api-keys-file .*holds no API key"):
        load_api_keys(str(empty))
    with pytest.raises(ValueError, match="--api-keys-file .*unreadable"):
        load_api_keys(str(tmp_path / "missing.txt"))


def test_no_keys_means_auth_off(monkeypatch):
    monkeypatch.delenv(API_KEYS_ENV, raising=False)
    assert build_auth_interceptor(ServerConfig()) is None


async def _code(coro) -> tuple[grpc.StatusCode, str]:
    try:
        await coro
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""
    return grpc.StatusCode.OK, ""


def test_api_keys_on_real_server(keys):
    path, file_keys, env_key = keys
    cfg = ServerConfig(port=0, api_keys_file=path)
    wrong = secrets.token_urlsafe(24)

    async def scenario():
        async with serve(cfg, [build_auth_interceptor(cfg)]) as port, \
                grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            gen = generation_pb2_grpc.GenerationStub(ch)
            info = generation_pb2.GetModelInfoRequest()
            # Unary and server-streaming methods are both guarded.
            code, msg = await _code(gen.GetModelInfo(info))
            assert code == grpc.StatusCode.UNAUTHENTICATED and "authorization: Bearer <key>" in msg
            code, msg = await stream_status(gen.Generate(generation_pb2.GenerateRequest()))
            assert code == grpc.StatusCode.UNAUTHENTICATED and "missing API key" in msg
            code, msg = await _code(gen.UploadMedia(iter([generation_pb2.UploadMediaRequest()])))
            assert code == grpc.StatusCode.UNAUTHENTICATED and "missing API key" in msg
            code, msg = await _code(gen.GetModelInfo(info, metadata=_bearer(wrong)))
            assert (code, msg) == (grpc.StatusCode.UNAUTHENTICATED, "invalid API key")
            code, msg = await _code(gen.GetModelInfo(info, metadata=_bearer(file_keys[0][:-1])))
            assert code == grpc.StatusCode.UNAUTHENTICATED
            code, msg = await _code(gen.GetModelInfo(info, metadata=(("authorization", f"Basic {env_key}"),)))
            assert code == grpc.StatusCode.UNAUTHENTICATED and "Bearer" in msg
            # Every configured key gets through to the servicer (the base servicer: UNIMPLEMENTED).
            for key in [*file_keys, env_key]:
                code, _ = await _code(gen.GetModelInfo(info, metadata=_bearer(key)))
                assert code == grpc.StatusCode.UNIMPLEMENTED
            code, _ = await _code(gen.GetModelInfo(info, metadata=(("authorization", f"bearer  {env_key}"),)))
            assert code == grpc.StatusCode.UNIMPLEMENTED
            code, _ = await stream_status(gen.Generate(generation_pb2.GenerateRequest(), metadata=_bearer(env_key)))
            assert code == grpc.StatusCode.UNIMPLEMENTED
            code, _ = await _code(gen.UploadMedia(iter([generation_pb2.UploadMediaRequest()]), metadata=_bearer(env_key)))
            assert code == grpc.StatusCode.UNIMPLEMENTED
            # Probes and grpcurl need no key by default.
            reply = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            refl = reflection_pb2_grpc.ServerReflectionStub(ch)
            async for answer in refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])):
                services = {s.name for s in answer.list_services_response.service}
                assert "mmserve.v1.Generation" in services

    asyncio.run(scenario())


def test_auth_health_protects_probes(keys):
    path, file_keys, _ = keys
    cfg = ServerConfig(port=0, api_keys_file=path, auth_health=True)

    async def scenario():
        async with serve(cfg, [build_auth_interceptor(cfg)]) as port, \
                grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            code, msg = await _code(stub.Check(health_pb2.HealthCheckRequest()))
            assert code == grpc.StatusCode.UNAUTHENTICATED and "missing API key" in msg
            reply = await stub.Check(health_pb2.HealthCheckRequest(), metadata=_bearer(file_keys[1]))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            refl = reflection_pb2_grpc.ServerReflectionStub(ch)
            call = refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            code, _ = await stream_status(call)
            assert code == grpc.StatusCode.UNAUTHENTICATED

    asyncio.run(scenario())
