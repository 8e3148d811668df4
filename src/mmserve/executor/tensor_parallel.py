"""Tensor parallelism in the engine: rank 0 (the engine process) and its spawned worker ranks.
This module is rank 0's side: the group (`TensorParallelGroup`: spawn, liveness, stop) and the
runner that sends each step (`TensorParallelRunner`); a worker rank's loop is worker_rank.py, and
what every rank shares (device, shard, rendezvous) ranks.py.

The core (scheduler, KV manager, sampler) runs on rank 0 alone. Each step, rank 0's runner
(`TensorParallelRunner`, the same `execute(SchedulerOutput) -> StepResult` as ModelRunner) sends
one `StepMessage` of plain data to the other ranks (through a shared-memory ring on one node,
message_ring.py; `broadcast_object_list` over several), then every rank runs its own ordinary
ModelRunner over its shard;
the layers' collectives (model/parallel.py) meet inside the forward, and rank 0 returns its result
(logits already gathered over the vocab shards). A request's prompt, sampling parameters and pixels
travel once, the step it is first scheduled; afterwards only its new output tokens do. Workers
keep a mirror of those requests and rebuild each step's SchedulerOutput from it, the media to encode
ahead for the next step included (by request id and range: every rank encodes the same ones, in the
same batches, on its replicated towers). A step that schedules nothing sends no step, but the
requests that ended or were preempted meanwhile, if any (`Released`): every rank frees what it
holds for them (block-table rows, embeddings encoded ahead) at the same point.

With a speculative model every rank also holds its shard of the drafter, and each drafting round
is one more message (a `DraftBatch`, spec_decode/speculator.py: the round's request ids, not their
block tables) after which every rank runs the same draft loop (`Speculator.draft`) over its shards,
the hidden states of its own last step and its own runner's block tables.

Async scheduling: rank 0 sends step N+1 before step N's tokens reach its host. The message names
the layout of N's outcome (`InFlightTokens`); the outcome itself (the sampled tokens, and with
speculation the drafts made after them and the positions the acceptance rolled back) goes from
rank 0's device to every rank's by one broadcast queued after rank 0's sampling, and every rank
copies it into N+1's inputs on its device as rank 0 does. Rank 0 alone samples and accepts; an
async drafting round (`DeviceDraftRound`) sends its key counts and request ids (each rank reads
their block tables from its own runner's rows, on its device), then broadcasts the
device's acceptance (token, hidden-state row, shift per sampled row); every rank drafts from it and
builds N+1's inputs itself (`HeldOutcome`), so that broadcast is the step's only one, and each
worker checks its drafts against those rank 0 verified, one step later (in that step's message, or,
when no step follows, in a `DraftsCheck` of their own before the last step's tokens are emitted).

A rank that dies or hangs makes rank 0's next collective fail (gloo: closed connection, or
`--tensor-parallel-timeout-s`; the ring's writer, when it must wait for a slot, checks the ranks
and the same timeout); rank 0 then names the dead rank in the error, the core loop dies,
and the engine-crash path ends every request in flight with UNAVAILABLE. Rank 0 sees its own node's
ranks exit (its children); a further node's `mmserve worker` reports a rank it lost into node 0's
TCP store (the rendezvous's, MASTER_ADDR:MASTER_PORT), where rank 0 reads it. An error of rank 0's
own code in a step (not a collective: model/parallel.CollectiveError tells them apart) also ends the
engine, since the other ranks already wait in that step's collectives; its message says so.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from typing import TYPE_CHECKING

import torch

from mmserve.config import EngineConfig
from mmserve.core.sched.output import DEVICE_DRAFT, SchedulerOutput
from mmserve.executor.message_ring import MessageRing
from mmserve.executor.ranks import (
    LOST_KEY,
    broadcast_object,
    check_divisible,
    rank_device,
    ranks_per_node,
    rendezvous,
    store_client,
    use_device,
)
from mmserve.executor.step_messages import (
    DraftsCheck,
    HeldQuery,
    InFlightTokens,
    Released,
    StepEncoder,
    held_bytes,
    share_in_flight,
)
from mmserve.executor.worker_rank import worker_main
from mmserve.model.parallel import CollectiveError, join_group
from mmserve.spec_decode.speculator import DeviceDraftRound

if TYPE_CHECKING:
    from mmserve.worker.backend_check import BackendCheck
    from mmserve.worker.block_table import BlockTables
    from mmserve.worker.cuda_graphs import UniformStepGraphs
    from mmserve.worker.encoder_cache import EncoderCache

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 10.0   # how long a worker may take to exit after the stop message
EXIT_SEEN_S = 3.0   # after a failed collective, how long to wait for a dying rank's exit (or report) to be seen
REMOTE_CHECK_S = 1.0   # how often the idle core loop reads the store for ranks lost on other nodes


class RankLostError(BaseException):
    """A worker rank died or stopped answering: the group is gone, not one step. Not an `Exception`,
    so it passes the core's per-step handler (which fails only that step's requests) and ends the
    core loop: the engine-crash path then fails every request in flight with UNAVAILABLE."""


def _in_collective(exc: BaseException | None) -> bool:
    """Whether `exc` is, or was raised while handling, a failed collective."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, CollectiveError):
            return True
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return False


class TensorParallelGroup:
    """Rank 0's handle on the group: starts the worker ranks, joins them, stops them."""

    def __init__(self, config: EngineConfig, log_level: int = logging.INFO, log_format: str = "text",
                 private_dir: str | None = None):
        """`private_dir`: where the rendezvous directory goes (the server's engine: the front end's socket
        directory, which it removes even when it had to kill the engine); else the system's temp dir."""
        import multiprocessing

        check_divisible(config)
        if config.node_rank != 0:
            raise ValueError(f"--node-rank {config.node_rank}: `mmserve serve` is node 0; run `mmserve worker` there")
        self.config = config
        self.size = config.tensor_parallel_size
        self._dir = tempfile.mkdtemp(prefix="mmserve-tp-", dir=private_dir)   # the rendezvous file (no port to pick)
        init_method = rendezvous(config, self._dir)
        ctx = multiprocessing.get_context("spawn")
        # each step's message: through shared memory when every rank is on this node
        self.ring = MessageRing(self.size - 1, ctx) if config.nnodes == 1 else None
        self.workers = [ctx.Process(target=worker_main, name=f"mmserve-tp-rank{rank}",
                                    args=(rank, config, init_method, log_level, log_format, os.getpid(),
                                          self.ring.readers[rank - 1] if self.ring else None))
                        for rank in range(1, ranks_per_node(config))]   # this node's other ranks
        for rank, w in enumerate(self.workers, start=1):
            w.start()
            logger.info("tensor-parallel rank %d: process %d started", rank, w.pid)
        self.failed = False   # a collective failed: the group is unusable, nothing more is sent
        logger.info("tensor-parallel: waiting for %d ranks to join (%s)", self.size, init_method)
        # the ranks on other nodes (`mmserve worker`), whose losses come through the store
        self.remote = list(range(ranks_per_node(config), self.size))
        self._store = None
        self._next_remote_check = 0.0
        self.runner: TensorParallelRunner | None = None   # set once the core builds its runner (the workers' start)
        try:   # a rank that dies before it joins fails the start at once, naming it
            self.group = join_group(0, self.size, init_method, backend=use_device(rank_device(config, 0)),
                                    timeout_s=config.tensor_parallel_timeout_s,
                                    startup_timeout_s=config.engine_ready_timeout_s, check_peers=self.check_alive)
        except BaseException:
            self.failed = True
            self.close()
            raise

    def runner_factory(self, model, plans, config, *, max_model_len: int):
        self.runner = TensorParallelRunner(self, model, plans, config, max_model_len=max_model_len)
        return self.runner

    def dead_ranks(self, remote: bool = True) -> list[str]:
        """This node's exited worker ranks and (with `remote`) those other nodes reported lost."""
        dead = [f"rank {rank} (pid {w.pid}, exit code {w.exitcode})"
                for rank, w in enumerate(self.workers, start=1) if not w.is_alive()]
        return dead + self.remote_dead() if remote else dead

    def remote_dead(self) -> list[str]:
        """The ranks other nodes reported lost (none when the store cannot be read)."""
        if not self.remote:
            return []
        try:
            if self._store is None:
                self._store = store_client()
            keys = {rank: LOST_KEY.format(rank=rank) for rank in self.remote}
            return [f"rank {rank} ({self._store.get(key).decode()})" for rank, key in keys.items()
                    if self._store.check([key])]
        except Exception:
            logger.debug("could not read the store for lost ranks", exc_info=True)
            return []

    def check_alive(self) -> None:
        """Raise naming every worker rank that has exited (the core loop calls it each iteration, so
        a rank lost while the server is idle fails the engine too, not only the next step; other
        nodes' reports are read once per REMOTE_CHECK_S)."""
        now = time.monotonic()
        remote = bool(self.remote) and now >= self._next_remote_check
        if remote:
            self._next_remote_check = now + REMOTE_CHECK_S
        if dead := self.dead_ranks(remote):
            self.failed = True
            raise RankLostError(f"tensor-parallel {', '.join(dead)} died")

    def send(self, msg) -> None:
        """`msg` to every other rank: through the ring, or the group's broadcast over several nodes."""
        if self.ring is None:
            broadcast_object(msg, self.group)
        else:
            self.ring.write(msg, alive=self.check_alive, timeout_s=self.config.tensor_parallel_timeout_s)

    def call(self, fn):
        """Run `fn` (collectives with the workers); a failure names the dead ranks, or the hung one."""
        self.check_alive()
        try:
            return fn()
        except Exception as exc:
            self.failed = True   # either way the ranks are out of step: the others wait in a collective
            if not _in_collective(exc):
                raise RankLostError(f"tensor-parallel rank 0 failed outside a collective, so the ranks are out "
                                    f"of step: {type(exc).__name__}: {exc}") from exc
            deadline = time.monotonic() + EXIT_SEEN_S   # a killed rank's socket closes before it is reaped
            while not (dead := self.dead_ranks()) and time.monotonic() < deadline:
                time.sleep(0.02)
            who = (f"tensor-parallel {', '.join(dead)} died" if dead else
                   f"a tensor-parallel collective failed (a rank did not answer within "
                   f"{self.config.tensor_parallel_timeout_s:g}s, or failed)")
            raise RankLostError(f"{who}: {exc}") from exc

    def close(self) -> None:
        """Stop the workers (a None step) and wait for them, JOIN_TIMEOUT_S for all; after a failure,
        or when rank 0 failed to start before its runner did (the workers still wait in the start-up
        broadcast, not for steps), or past the wait, kill them."""
        import torch.distributed as dist

        stopping = (not self.failed and self.runner is not None and not self.dead_ranks()
                    and dist.is_initialized())
        if stopping:
            try:
                self.send(None)
            except Exception:
                stopping = False
                logger.debug("stop message not delivered", exc_info=True)
        deadline = time.monotonic() + (JOIN_TIMEOUT_S if stopping else 0.0)
        for w in self.workers:
            w.join(max(0.0, deadline - time.monotonic()))
            if w.is_alive():
                if stopping:
                    logger.error("tensor-parallel %s did not stop; killing it", w.name)
                w.kill()
                w.join()
        if dist.is_initialized() and stopping:   # a failed group may never finish tearing down
            dist.destroy_process_group()
        if self.ring is not None:
            self.ring.close()
        shutil.rmtree(self._dir, ignore_errors=True)


class TensorParallelRunner:
    """Rank 0's runner: broadcasts each step to the workers, then runs its own shard's ModelRunner.
    What the core reads of its runner (the properties below) is that local runner's; a call that
    changes a runner's state is a method here, which reaches every rank."""

    def __init__(self, tp: TensorParallelGroup, model, plans, config: EngineConfig, *, max_model_len: int):
        from mmserve.worker.model_runner import ModelRunner

        self.tp = tp
        self._encoder = StepEncoder()
        self._drafted = False   # an async drafting round ran since the last step: every rank holds its outcome
        self._took_held: list = []   # the last step's verify chunks that took their drafts from it
        # start-up: the workers may still be loading; they size their runners by rank 0's config
        tp.call(lambda: broadcast_object((plans, max_model_len, config)))
        if tp.ring is not None:   # every worker mapped the ring before it joined: nothing may outlive us
            tp.ring.unlink()
        self.local = ModelRunner(model, plans, config, max_model_len=max_model_len)

    @property
    def kv_caches(self) -> list[torch.Tensor]:
        return self.local.kv_caches

    @property
    def block_tables(self) -> BlockTables:
        return self.local.block_tables

    @property
    def graphs(self) -> UniformStepGraphs:
        return self.local.graphs

    @property
    def verify_graph_rows(self) -> int:
        return self.local.verify_graph_rows

    @property
    def encoder_cache(self) -> EncoderCache:
        return self.local.encoder_cache

    @property
    def backend_checks(self) -> list[BackendCheck]:
        return self.local.backend_checks

    @backend_checks.setter
    def backend_checks(self, checks: list[BackendCheck]) -> None:
        """The core merges in the memory-profiling runner's checks (rank 0's record of them)."""
        self.local.backend_checks = checks

    def execute(self, out: SchedulerOutput, prev=None):
        """The step on every rank; `prev` (async scheduling: the step in flight's tokens, on rank 0's
        device) goes to the workers by one broadcast after the message, which names only its layout,
        unless the drafting round after that step gave every rank its own copy (`held`)."""
        msg = self._encoder.encode(out)
        held, self._drafted = self._drafted, False
        if prev is not None:
            msg.in_flight = InFlightTokens.of(prev, held)
            msg.verified = self._held_verified()
        self._took_held = ([s for s in out.scheduled if s.draft_token_ids and s.draft_token_ids[0] == DEVICE_DRAFT]
                           if prev is not None and held else [])

        def run():
            if prev is not None and not held:
                share_in_flight(self.tp.group, msg.in_flight, prev)
            return self.local.execute(out, prev)

        return self._on_ranks(msg, run)

    def _held_verified(self) -> dict[str, list[int]]:
        """The drafts the last step took from the workers' own drafting round, as rank 0 made them
        (host-known once the step before it finished), for the workers to check."""
        return {s.request.request_id: list(s.draft_token_ids) for s in self._took_held
                if s.draft_token_ids and s.draft_token_ids[0] != DEVICE_DRAFT}   # (still the device's: it ended since)

    def confirm_drafts(self) -> None:
        """No step follows the one in flight: before its tokens are emitted, the drafts it took from
        the workers' own round are checked there (`DraftsCheck`: one message, one all-reduce, which
        raises RankLostError here if a worker's drafts differed). Nothing is sent when it took none."""
        verified, self._took_held = self._held_verified(), []
        if not verified:
            return

        def check() -> None:
            self.tp.send(DraftsCheck(verified))
            self.tp.group.all_reduce(torch.zeros(1, device=self.local.model.device))

        self.tp.call(check)

    def release(self, out: SchedulerOutput) -> None:
        """A step that scheduled nothing: every rank frees what it holds for the requests that ended
        or were preempted since (`ModelRunner.release`); nothing is sent when there are none."""
        self._encoder.release(out.finished_ids)
        if out.finished_ids or out.preempted_ids:
            self._on_ranks(Released(out.finished_ids, out.preempted_ids), lambda: self.local.release(out))

    def encoded_ahead_bytes(self) -> int:
        """Summed over the ranks (one message, one all-reduce): the core's leak check sees the workers'."""
        def total() -> int:
            self.tp.send(HeldQuery())
            return int(self.tp.group.all_reduce(held_bytes(self.local)).item())

        return self.tp.call(total)

    def serve_drafts(self, speculator) -> None:
        """Run `speculator`'s drafting rounds on every rank: each round's batch goes out first."""
        speculator.on_ranks = self._draft_on_ranks

    def _draft_on_ranks(self, batch, run):
        drafts = self._on_ranks(batch, run)
        self._drafted = isinstance(batch, DeviceDraftRound)   # the next step's outcome is every rank's now
        return drafts

    def _on_ranks(self, msg, run):
        """Send `msg` to the workers, then `run()` rank 0's part (each worker runs its own on `msg`);
        a failure names the lost rank or says rank 0's code failed (`TensorParallelGroup.call`)."""
        def both():
            self.tp.send(msg)
            return run()

        return self.tp.call(both)
