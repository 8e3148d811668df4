"""An exception inside an engine step fails exactly that step's requests with INTERNAL and their
request id; the requests it did not run, and later ones, are served as if nothing happened."""

from __future__ import annotations

import asyncio
import threading

import grpc
from rel_engine import read_stream, text_request, wait_load

from mmserve.api.mmserve.v1 import generation_pb2_grpc as pb_grpc


class FaultOnce:
    """Replaces the runner's `execute` on a live engine; when armed, the next step raises."""

    def __init__(self, runner) -> None:
        self.runner = runner
        self.armed = threading.Event()
        self.failed_ids: list[str] | None = None

    def __call__(self, out, *prev):   # (async scheduling: the step in flight's tokens)
        if self.armed.is_set():
            self.armed.clear()
            self.failed_ids = [s.request.request_id for s in out.scheduled]
            raise RuntimeError("injected fault in the model step")
        return type(self.runner).execute(self.runner, out, *prev)

    def __enter__(self) -> FaultOnce:
        self.runner.execute = self
        return self

    def __exit__(self, *exc) -> None:
        del self.runner.execute


def test_step_fault_fails_only_that_step(small_server, caplog):
    async def scenario(fault: FaultOnce):
        async with grpc.aio.insecure_channel(small_server.address) as ch:
            stub = pb_grpc.GenerationStub(ch)
            doomed = {rid: stub.Generate(text_request(rid, 200)) for rid in ("fault-a", "fault-b")}
            for call in doomed.values():
                await call.read()
            queued = {rid: stub.Generate(text_request(rid, 5)) for rid in ("fault-c", "fault-d")}
            await wait_load(stub, running=2, waiting=2)
            fault.armed.set()
            for rid, call in doomed.items():
                result = await read_stream(call)
                assert result.code == grpc.StatusCode.INTERNAL and rid in result.details, result
                assert result.final is None
            for call in queued.values():
                result = await read_stream(call)
                assert result.code is None and result.final.usage.completion_tokens == 5
            later = await read_stream(stub.Generate(text_request("fault-e", 4)))
            assert later.code is None and len(later.token_ids) == 4

    with caplog.at_level("ERROR", logger="mmserve"), FaultOnce(small_server.engine.core.runner) as fault:
        asyncio.run(scenario(fault))
    assert sorted(fault.failed_ids) == ["fault-a", "fault-b"]
    # The server log names the failed requests, so the id in the client's message can be grepped.
    assert any("fault-a" in r.getMessage() and "fault-b" in r.getMessage() for r in caplog.records)
    small_server.assert_nothing_leaked()
