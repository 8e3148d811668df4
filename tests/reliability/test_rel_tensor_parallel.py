"""A worker rank of a real `mmserve serve --tensor-parallel-size 2` dies (kill -9) or hangs (SIGSTOP)
mid-run, or rank 0 (the engine process) is killed: every stream in flight ends UNAVAILABLE naming
what happened, within the collective timeout, and the server exits non-zero leaving no rank behind."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import time

import grpc
import pytest
from rel_engine import read_stream, text_request
from rel_process import ServeProcess, process_exists

from mmserve.api.mmserve.v1 import generation_pb2_grpc as pb_grpc

TIMEOUT_S = 3   # --tensor-parallel-timeout-s: how long rank 0 waits for a hung rank
WORKER_PID = re.compile(r"tensor-parallel rank 1: process (\d+) started")


def serving_port(server: ServeProcess) -> int:
    """The server's port, once its Generation service reports SERVING (the engine and every rank up)."""
    port = server.wait_port(180)

    async def serving():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            await server.wait_serving(ch)

    asyncio.run(serving())
    return port


@pytest.mark.slow
@pytest.mark.parametrize("victim, sig, names", [
    ("worker", signal.SIGKILL, r"rank 1 \(pid \d+, exit code -9\) died"),
    ("worker", signal.SIGSTOP, rf"did not answer within {TIMEOUT_S}s"),
    ("engine", signal.SIGKILL, "killed by SIGKILL")])
def test_a_lost_rank_fails_in_flight_requests_and_the_server_exits_nonzero(victim, sig, names, tiny_checkpoint):
    server = ServeProcess("--port", "0", "--model", str(tiny_checkpoint), "--device", "cpu", "--max-num-seqs", "4",
                          "--worker-threads", "1", "--tensor-parallel-size", "2",
                          "--tensor-parallel-timeout-s", str(TIMEOUT_S))
    worker = None
    try:
        port = server.wait_port(180)

        async def scenario():
            nonlocal worker
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                await server.wait_serving(ch)
                worker = int(WORKER_PID.search(server.log).group(1))
                stub = pb_grpc.GenerationStub(ch)
                calls = [stub.Generate(text_request(f"doomed-{i}", 500)) for i in range(2)]
                for call in calls:
                    assert (await call.read()).delta.token_ids
                os.kill(worker if victim == "worker" else server.engine_pid, sig)
                lost = time.monotonic()
                for call in calls:
                    result = await read_stream(call)
                    assert result.code == grpc.StatusCode.UNAVAILABLE, result
                    assert re.search(names, result.details) and result.final is None, result.details
                assert time.monotonic() - lost < TIMEOUT_S + 15

        asyncio.run(scenario())
        assert server.proc.wait(60) != 0, server.log
        assert not process_exists(worker), "the worker rank outlived the server"
    finally:
        server.stop()
        if worker is not None:   # a failed run must not leave a stopped rank behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)


@pytest.mark.slow
def test_a_worker_killed_during_start_up_fails_the_start_naming_it(tiny_checkpoint):
    """Killed the moment it is spawned (still importing, before it joins the rendezvous, where rank 0
    used to wait out the 900 s start-up timeout): `serve` exits 1 within seconds, naming the rank."""
    server = ServeProcess("--port", "0", "--model", str(tiny_checkpoint), "--device", "cpu",
                          "--worker-threads", "1", "--tensor-parallel-size", "2")
    try:
        deadline = time.monotonic() + 120
        while not (spawned := WORKER_PID.search(server.log)):
            assert time.monotonic() < deadline and server.proc.poll() is None, server.log
            time.sleep(0.01)
        os.kill(int(spawned.group(1)), signal.SIGKILL)
        assert server.proc.wait(60) == 1, server.log
        assert re.search(r"the engine failed to start: .*tensor-parallel rank 1 \(pid \d+, exit code -9\) died",
                         server.log), server.log
    finally:
        server.stop()


@pytest.mark.slow
def test_rank_0_failing_after_the_group_joined_kills_the_workers_at_once(tiny_checkpoint):
    """Rank 0 fails to build its core once every rank has joined (a KV cache of one block): rank 1
    still waits in the start-up broadcast, never reading a stop message. It is killed at once (it
    was waited for 10 s and logged as "did not stop; killing it"), and the log names the reason."""
    server = ServeProcess("--port", "0", "--model", str(tiny_checkpoint), "--device", "cpu",
                          "--worker-threads", "1", "--tensor-parallel-size", "2", "--num-kv-blocks", "1")
    try:
        assert server.proc.wait(180) == 1, server.log
        assert re.search(r"the engine failed to start: KVCacheTooSmall", server.log), server.log
        assert "did not stop" not in server.log, server.log
    finally:
        server.stop()


def test_a_size_the_model_cannot_split_is_refused_at_start_naming_the_dimension(tiny_checkpoint):
    """The tiny checkpoint's vocabulary (320) does not split 3 ways: `serve` exits 1 before any rank
    is spawned, and the log says which dimension."""
    server = ServeProcess("--port", "0", "--model", str(tiny_checkpoint), "--device", "cpu",
                          "--worker-threads", "1", "--tensor-parallel-size", "3")
    try:
        assert server.proc.wait(120) == 1, server.log
        assert "vocab_size (320) is not divisible by --tensor-parallel-size 3" in server.log
        assert "tensor-parallel rank" not in server.log
    finally:
        server.stop()


def test_the_offline_llm_refuses_tensor_parallelism():
    from mmserve import LLM

    with pytest.raises(ValueError, match="tensor_parallel_size > 1 runs in the server's engine process"):
        LLM(tensor_parallel_size=2)


@pytest.mark.slow
def test_two_nodes_serve_the_tokens_one_device_does(tiny_checkpoint, monkeypatch):
    """`mmserve serve --nnodes 2` (node 0: rank 0) and `mmserve worker --node-rank 1` (rank 1) meet
    through MASTER_ADDR/MASTER_PORT, here both on 127.0.0.1; greedy tokens equal the offline TP=1
    engine's for the same prompt; stopping the server ends the worker node with exit 0."""
    from mmserve import LLM
    from mmserve.clients import Client
    from mmserve.model.messages import ChatMessage
    from mmserve.model.prompt import build_prompt
    from mmserve.model.spec import load_spec
    from mmserve.model.tokenizer import load_tokenizer
    from mmserve.sampling_params import SamplingParams

    with socket.socket() as s:   # a free port for node 0's TCP store (ephemeral, loopback)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(port)), ("GLOO_SOCKET_IFNAME", "lo")):
        monkeypatch.setenv(name, value)
    group = ("--model", str(tiny_checkpoint), "--device", "cpu", "--tensor-parallel-size", "2", "--nnodes", "2")
    server = ServeProcess("--port", "0", "--max-num-seqs", "4", "--worker-threads", "1", *group)
    # the worker's own step sizes differ: its runner is sized by rank 0's (runner_config)
    worker = subprocess.Popen([sys.executable, "-m", "mmserve.cli", "worker", *group, "--node-rank", "1",
                               "--max-num-seqs", "1", "--max-num-batched-tokens", "16"],
                              env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        port = serving_port(server)
        with Client(f"127.0.0.1:{port}", timeout=120) as client:
            served = client.generate(prompt="go on", max_tokens=8, temperature=0, ignore_eos=True)
        assert not WORKER_PID.search(server.log)   # node 0 spawned no rank: rank 1 is the other node's
        ids = build_prompt(load_tokenizer(tiny_checkpoint), load_spec(tiny_checkpoint),
                           [ChatMessage("user", ["go on"])]).token_ids
        [ref] = LLM(model=str(tiny_checkpoint), device="cpu", dtype="float32").generate(
            [ids], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
        assert served.usage.prompt_tokens == len(ids)
        assert list(served.token_ids) == ref.token_ids
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(60) == 0, server.log
        assert worker.wait(60) == 0, worker.stdout.read()
    finally:
        server.stop()
        if worker.poll() is None:
            worker.kill()
            worker.wait()


def free_port() -> int:
    with socket.socket() as s:   # a free port for node 0's TCP store (ephemeral, loopback)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_a_rank_lost_on_another_node_is_named(tiny_checkpoint, monkeypatch):
    """Rank 1 runs on a second "node" (`mmserve worker`, both on 127.0.0.1) and is killed mid-stream:
    the stream ends UNAVAILABLE naming rank 1 with its node, pid and exit code (node 0 cannot see
    that process: the worker node reports it through node 0's store), and both nodes exit 1."""
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())), ("GLOO_SOCKET_IFNAME", "lo")):
        monkeypatch.setenv(name, value)
    group = ("--model", str(tiny_checkpoint), "--device", "cpu", "--tensor-parallel-size", "2", "--nnodes", "2",
             "--tensor-parallel-timeout-s", str(TIMEOUT_S))
    server = ServeProcess("--port", "0", "--max-num-seqs", "4", "--worker-threads", "1", *group)
    node = ServeProcess(*group, "--node-rank", "1", command="worker")
    try:
        port = serving_port(server)
        rank1 = int(WORKER_PID.search(node.log).group(1))

        async def scenario():
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
                call = pb_grpc.GenerationStub(ch).Generate(text_request("doomed", 500))
                assert (await call.read()).delta.token_ids
                os.kill(rank1, signal.SIGKILL)
                result = await read_stream(call)
                assert result.code == grpc.StatusCode.UNAVAILABLE, result
                assert re.search(rf"tensor-parallel rank 1 \(node 1, pid {rank1}, exit code -9\) died",
                                 result.details), result.details

        asyncio.run(scenario())
        assert server.proc.wait(60) == 1, server.log
        assert node.proc.wait(60) == 1, node.log
    finally:
        server.stop()
        node.stop()


@pytest.mark.slow
def test_a_rank_lost_on_another_node_during_start_up_fails_the_start_naming_it(tiny_checkpoint, monkeypatch):
    """Rank 1 (a second "node") killed the moment it is spawned, before it joins: its `mmserve worker`
    reports it, and `serve` exits 1 naming it within seconds, rather than waiting in the rendezvous
    for the 900 s start-up timeout."""
    for name, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(free_port())), ("GLOO_SOCKET_IFNAME", "lo")):
        monkeypatch.setenv(name, value)
    group = ("--model", str(tiny_checkpoint), "--device", "cpu", "--tensor-parallel-size", "2", "--nnodes", "2")
    server = ServeProcess("--port", "0", "--worker-threads", "1", *group)
    node = None
    try:
        deadline = time.monotonic() + 120
        while "waiting for 2 ranks to join" not in server.log:   # node 0's store is up
            assert time.monotonic() < deadline and server.proc.poll() is None, server.log
            time.sleep(0.01)
        node = ServeProcess(*group, "--node-rank", "1", command="worker")
        while not (spawned := WORKER_PID.search(node.log)):
            assert time.monotonic() < deadline and node.proc.poll() is None, node.log
            time.sleep(0.01)
        os.kill(int(spawned.group(1)), signal.SIGKILL)
        assert server.proc.wait(60) == 1, server.log
        assert re.search(rf"the engine failed to start: .*tensor-parallel rank 1 \(node 1, pid {spawned.group(1)}, "
                         r"exit code -9\) died", server.log), server.log
        assert node.proc.wait(60) == 1, node.log
    finally:
        server.stop()
        if node is not None:
            node.stop()


@pytest.mark.slow
def test_a_rank_lost_while_idle_stops_the_server_too(tiny_checkpoint):
    """No request in flight: the core loop's per-iteration check of the ranks notices the dead worker
    (within its 0.5 s idle poll) and the server exits 1 naming it, rather than failing the next request."""
    server = ServeProcess("--port", "0", "--model", str(tiny_checkpoint), "--device", "cpu",
                          "--worker-threads", "1", "--tensor-parallel-size", "2")
    try:
        serving_port(server)
        os.kill(int(WORKER_PID.search(server.log).group(1)), signal.SIGKILL)
        assert server.proc.wait(30) == 1, server.log
        assert re.search(r"tensor-parallel rank 1 \(pid \d+, exit code -9\) died", server.log), server.log
    finally:
        server.stop()


@pytest.mark.slow
def test_a_worker_node_serves_on_through_sigterm_and_stops_its_ranks_on_sigint(tiny_checkpoint):
    """A real `mmserve worker` (rank 1 of a two-node group) whose rank waits for rank 0 in the
    rendezvous, held by a TCP store this test runs as node 0's (no server: a TP=2 `serve` start would
    cost this module ~12 s more, and the report below is what node 0 reads, as in the tests above).
    SIGTERM killed the node's process alone: its rank, which ignores SIGTERM, went on until it saw
    itself orphaned, then exited 1 unlogged. Now SIGTERM (sent to every node of a group an orchestrator
    deletes) is logged and waited out, so node 0's drain keeps its ranks; SIGINT kills the rank at
    once, reports it stopped and exits 0."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    node = ServeProcess("--model", str(tiny_checkpoint), "--device", "cpu", "--tensor-parallel-size", "2",
                        "--nnodes", "2", "--node-rank", "1", command="worker",
                        env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "GLOO_SOCKET_IFNAME": "lo"})
    try:
        deadline = time.monotonic() + 120
        while store.num_keys() == 0:   # rank 1 has joined the rendezvous and waits there for rank 0
            assert time.monotonic() < deadline and node.proc.poll() is None, node.log
            time.sleep(0.01)
        rank1 = int(WORKER_PID.search(node.log).group(1))
        node.proc.send_signal(signal.SIGTERM)
        waiting = "mmserve worker: SIGTERM: ranks 1 of node 1 serve on until node 0 stops the group"
        deadline = time.monotonic() + 30
        while waiting not in node.log:
            assert time.monotonic() < deadline and node.proc.poll() is None, node.log
            time.sleep(0.01)
        assert node.proc.poll() is None, node.log
        os.kill(rank1, 0)   # the rank serves on (raises ProcessLookupError if it is gone)
        node.proc.send_signal(signal.SIGINT)
        assert node.proc.wait(60) == 0, node.log
        assert "mmserve worker: SIGINT: stopping ranks 1 of node 1; node 0's engine fails without them" in node.log
        assert not process_exists(rank1), "the rank outlived its node's process"
        assert store.get("mmserve/lost/1").decode() == f"node 1, pid {rank1}, stopped by SIGINT"
    finally:
        node.stop()
