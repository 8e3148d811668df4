"""Tensor parallelism in the engine: rank 0 (the engine process) and its spawned worker ranks.

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

import dataclasses
import logging
import os
import shutil
import signal
import tempfile
import time

import torch

from mmserve.config import EngineConfig
from mmserve.core.sched.output import DEVICE_DRAFT, SchedulerOutput
from mmserve.executor.message_ring import MessageRing, RingReader
from mmserve.executor.step_messages import (
    DraftsCheck,
    HeldOutcome,
    HeldQuery,
    InFlightTokens,
    Released,
    StepEncoder,
    StepMirror,
    share_in_flight,
)
from mmserve.model.parallel import CollectiveError, ParallelGroup, collective, join_group
from mmserve.process_exit import exit_process, watch_parent
from mmserve.spec_decode.speculator import DeviceDraftRound, DraftBatch

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 10.0   # how long a worker may take to exit after the stop message
# A worker waits for rank 0's next step as long as it takes (an idle server sends none); rank 0
# gone closes the connection, which ends the wait. Rank 0's own waits are --tensor-parallel-timeout-s.
WORKER_WAIT_S = 365 * 24 * 3600.0
EXIT_SEEN_S = 3.0   # after a failed collective, how long to wait for a dying rank's exit (or report) to be seen
REMOTE_CHECK_S = 1.0   # how often the idle core loop reads the store for ranks lost on other nodes
STORE_TIMEOUT_S = 2.0   # rank 0's client of its own store: connect and reads
REPORT_TIMEOUT_S = 30.0   # a worker node's report of a lost rank: node 0 may still be starting
SIGNAL_POLL_S = 0.1   # how soon a worker node acts on SIGTERM or SIGINT
LOST_KEY = "mmserve/lost/{rank}"   # a further node's report of a rank it lost: "node N, pid P, exit code C"


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


def _broadcast(obj=None, group: ParallelGroup | None = None):
    """Rank 0 sends `obj`; every other rank returns what rank 0 sent. Over `group` (the model's, with
    the collective timeout), or else the default group (start-up's timeout)."""
    import torch.distributed as dist

    box = [obj]
    collective(dist.broadcast_object_list, box, src=0, group=None if group is None else group.group)
    return box[0]


def ranks_per_node(config: EngineConfig) -> int:
    return config.tensor_parallel_size // config.nnodes


def rank_threads(config: EngineConfig) -> int:
    """One rank's torch threads: the ranks of a node share its engine threads (at least one each;
    a size check_divisible refuses still gets one, so the refusal is the error the user sees)."""
    from mmserve.worker.cpu_threads import engine_threads

    return max(1, engine_threads(config.engine_threads) // max(1, ranks_per_node(config)))


def rank_device(config: EngineConfig, rank: int) -> str:
    """Rank r's device: cuda:(r mod ranks per node) on CUDA (`cuda:N` offsets them), the CPU elsewhere."""
    device, local = config.device, rank % ranks_per_node(config)
    if device in ("auto", "cuda") and (device == "cuda" or torch.cuda.is_available()):
        return f"cuda:{local}"
    if device.startswith("cuda:"):
        return f"cuda:{int(device.split(':')[1]) + local}"
    return device


def rendezvous(config: EngineConfig, private_dir: str) -> str:
    """Where the ranks meet: one node, a file in a private directory (no port to pick, loopback only);
    several, the standard torch.distributed env (MASTER_ADDR:MASTER_PORT, node 0's TCP store)."""
    if config.nnodes == 1:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        return f"file://{private_dir}/rendezvous"
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(name)]
    if missing:
        raise ValueError(f"--nnodes {config.nnodes}: set {' and '.join(missing)} (node 0's address and a free "
                         "port) on every node")
    return "env://"


def store_client(timeout_s: float = STORE_TIMEOUT_S):
    """A client of node 0's TCP store, the multi-node rendezvous's (MASTER_ADDR:MASTER_PORT)."""
    import datetime

    import torch.distributed as dist

    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


def report_lost(lost: dict[int, str], timeout_s: float = REPORT_TIMEOUT_S) -> None:
    """A worker node tells rank 0 which of its ranks it lost and how, `{rank: what}` (best effort:
    rank 0 may be gone; `timeout_s` bounds the connection)."""
    try:
        store = store_client(timeout_s)
        for rank, what in lost.items():
            store.set(LOST_KEY.format(rank=rank), what)
    except Exception:
        logger.debug("could not report the loss of ranks %s to node 0", list(lost), exc_info=True)


def _use_device(device: str) -> str:
    """The collective backend for a rank's device; on CUDA the device is made current first (NCCL
    and broadcast_object_list use the current device, which would be cuda:0 on every rank)."""
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
        return "nccl"
    return "gloo"


def load_rank_model(config: EngineConfig, group: ParallelGroup):
    """This rank's shard of the model, on this rank's device."""
    from mmserve.attention import resolve_backend
    from mmserve.model import load_model
    from mmserve.model.loader import resolve_device

    device = resolve_device(rank_device(config, group.rank))
    return load_model(config.model, dtype=config.dtype, device=device,
                      attention_backend=resolve_backend(config.attention_backend, device), parallel=group)


def check_divisible(config: EngineConfig) -> None:
    """Refuse a size the model cannot be split by (ShardingError naming the dimension) before any
    process is spawned."""
    from mmserve.model.parallel import local_spec
    from mmserve.model.spec import read_spec

    if config.tensor_parallel_size % config.nnodes:
        raise ValueError(f"--tensor-parallel-size {config.tensor_parallel_size} is not divisible by "
                         f"--nnodes {config.nnodes}")
    if config.node_rank >= config.nnodes:
        raise ValueError(f"--node-rank {config.node_rank}: there are only --nnodes {config.nnodes}")
    group = ParallelGroup(0, config.tensor_parallel_size)
    local_spec(read_spec(config.model), group)
    if config.speculative_model:
        from mmserve.model.assistant import Assistant
        from mmserve.model.assistant_spec import read_assistant_spec

        with torch.device("meta"):   # the same cuts the ranks make, on no storage
            Assistant(read_assistant_spec(config.speculative_model), group)


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
            self.group = join_group(0, self.size, init_method, backend=_use_device(rank_device(config, 0)),
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
            _broadcast(msg, self.group)
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
    Everything else (encoder cache, backend checks, ...) is the local runner's."""

    def __init__(self, tp: TensorParallelGroup, model, plans, config: EngineConfig, *, max_model_len: int):
        from mmserve.worker.model_runner import ModelRunner

        self.tp = tp
        self._encoder = StepEncoder()
        self._drafted = False   # an async drafting round ran since the last step: every rank holds its outcome
        self._took_held: list = []   # the last step's verify chunks that took their drafts from it
        # start-up: the workers may still be loading; they size their runners by rank 0's config
        tp.call(lambda: _broadcast((plans, max_model_len, config)))
        if tp.ring is not None:   # every worker mapped the ring before it joined: nothing may outlive us
            tp.ring.unlink()
        self.local = ModelRunner(model, plans, config, max_model_len=max_model_len)

    def __getattr__(self, name: str):
        if name == "local":   # not set yet: no recursion through __getattr__
            raise AttributeError(name)
        return getattr(self.local, name)

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
            return int(self.tp.group.all_reduce(self._held_bytes(self.local)).item())

        return self.tp.call(total)

    @staticmethod
    def _held_bytes(runner) -> torch.Tensor:
        return torch.tensor([runner.encoded_ahead_bytes()], dtype=torch.int64, device=runner.model.device)

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


def run_worker_node(config: EngineConfig, log_level: int = logging.INFO, log_format: str = "text") -> int:
    """`mmserve worker`: node `node_rank`'s ranks of a multi-node group, until rank 0 stops them (0),
    one of them fails (the others are killed, 1), or SIGINT reaches this process (0, see `_stop_ranks`).
    SIGTERM is logged and waited out: an orchestrator deleting the group sends it to every node at once,
    and node 0's drain needs these ranks until it ends the group (then they exit and so does this
    process). The ranks ignore both signals, as rank 0's node's do: this process decides."""
    import multiprocessing
    from multiprocessing.connection import wait

    from mmserve.worker.cpu_threads import passive_openmp_waits

    check_divisible(config)
    if config.node_rank == 0:
        raise ValueError("--node-rank 0 is `mmserve serve`'s node; give a worker node 1 .. nnodes - 1")
    init_method = rendezvous(config, "")
    passive_openmp_waits()   # read by each rank's OpenMP runtime as it loads
    ctx = multiprocessing.get_context("spawn")
    received: list[str] = []   # acted on between waits, so a signal never interrupts starting a rank
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: received.append(signal.Signals(signum).name))
    waiting_out = False   # SIGTERM logged: the ranks serve on until node 0 stops the group
    first = config.node_rank * ranks_per_node(config)
    ranks = {rank: ctx.Process(target=worker_main, name=f"mmserve-tp-rank{rank}",
                               args=(rank, config, init_method, log_level, log_format, os.getpid()))
             for rank in range(first, first + ranks_per_node(config))}
    for rank, p in ranks.items():
        p.start()
        logger.info("tensor-parallel rank %d: process %d started", rank, p.pid)
    while ranks:
        wait([p.sentinel for p in ranks.values()], SIGNAL_POLL_S)   # a rank's exit, or the poll for a signal
        if "SIGINT" in received:
            return _stop_ranks(ranks, config.node_rank, "SIGINT")
        if received and not waiting_out:
            waiting_out = True
            logger.warning("mmserve worker: SIGTERM: ranks %s of node %d serve on until node 0 stops the group "
                           "(its drain); SIGINT stops them now", ", ".join(map(str, ranks)), config.node_rank)
        for rank, p in list(ranks.items()):
            if p.exitcode is None:
                continue
            del ranks[rank]
            if p.exitcode != 0:
                logger.error("%s exited with code %s; stopping this node's other ranks", p.name, p.exitcode)
                report_lost({rank: f"node {config.node_rank}, pid {p.pid}, exit code {p.exitcode}"})
                for other in ranks.values():
                    other.kill()
                    other.join()
                return 1
    return 0


def _stop_ranks(ranks: dict, node_rank: int, signal_name: str) -> int:
    """A worker node told to stop now (SIGINT): kill its ranks at once (they may wait in a
    collective, where nothing else reaches them), report them to node 0 as stopped by the signal (so its
    engine fails naming them, rather than at its next step's collective or timeout) and exit 0. The
    group cannot go on without them: the server then exits 1, and its orchestrator restarts the group."""
    logger.warning("mmserve worker: %s: stopping ranks %s of node %d; node 0's engine fails without them",
                   signal_name, ", ".join(map(str, ranks)), node_rank)
    for p in ranks.values():
        p.kill()
    for p in ranks.values():
        p.join()
    report_lost({rank: f"node {node_rank}, pid {p.pid}, stopped by {signal_name}" for rank, p in ranks.items()},
                STORE_TIMEOUT_S)
    return 0


def runner_config(own: EngineConfig, leader: EngineConfig) -> EngineConfig:
    """A worker's runner is sized like rank 0's (step budgets, batch, blocks: another node's
    `mmserve worker` flags may differ); what its model was loaded with must match rank 0's."""
    for name in ("dtype", "attention_backend", "compile_dense"):
        if getattr(own, name) != getattr(leader, name):
            raise ValueError(f"--{name.replace('_', '-')} {getattr(own, name)} differs from rank 0's "
                             f"{getattr(leader, name)}: give every node the same engine flags")
    if bool(own.speculative_model) != bool(leader.speculative_model):
        raise ValueError(f"--speculative-model is {'set' if leader.speculative_model else 'not set'} on rank 0 "
                         f"but {'set' if own.speculative_model else 'not set'} here: give every node the same engine flags")
    return dataclasses.replace(leader, model=own.model, device=own.device, node_rank=own.node_rank,
                               engine_threads=own.engine_threads, speculative_model=own.speculative_model)


def worker_main(rank: int, config: EngineConfig, init_method: str, log_level: int, log_format: str,
                parent: int, ring: RingReader | None = None) -> None:
    """A worker rank's process: join the group, load this rank's shard, then run every step rank 0
    sends (through `ring` on rank 0's node, else the group's broadcast) until it sends None (or its
    collective fails, or its parent goes: rank 0 is gone). Logs like the engine process, to the
    stderr they share."""
    for sig in (signal.SIGINT, signal.SIGTERM):   # sent to the process group: rank 0 decides when the group stops
        signal.signal(sig, signal.SIG_IGN)
    watch_parent(parent)   # rank 0 gone: exit, whatever collective this rank waits in
    if ring is not None:
        ring.attach()
    if log_format == "json":
        from mmserve.logs import configure_logging

        configure_logging(logging.getLevelName(log_level), "json")
    else:
        logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s tp-rank{rank}[%(process)d] "
                                                    "%(name)s: %(message)s")
    from mmserve.worker.cpu_threads import configure_torch_threads
    from mmserve.worker.model_runner import ModelRunner

    configure_torch_threads(rank_threads(config))
    try:
        group = join_group(rank, config.tensor_parallel_size, init_method,
                           backend=_use_device(rank_device(config, rank)), timeout_s=WORKER_WAIT_S)
        model = load_rank_model(config, group)
        plans, max_model_len, leader = _broadcast()
        own = runner_config(config, leader)
        speculator = None
        if own.speculative_model:
            from mmserve.spec_decode.speculator import Speculator

            speculator = Speculator.load(own.speculative_model, model, own.num_speculative_tokens,
                                         max_num_seqs=own.max_num_seqs)
        runner = ModelRunner(model, plans, own, max_model_len=max_model_len)
        if speculator is not None:   # its K steps as graphs where the target's are, as on rank 0
            speculator.use_graphs(runner.graphs.mode)
        mirror, hidden, outcome = StepMirror(), None, HeldOutcome(rank)
        while (msg := ring.read() if ring is not None else _broadcast(group=group)) is not None:
            if isinstance(msg, DraftBatch):   # a drafting round over the last step's hidden states
                speculator.draft(msg, hidden, runner.kv_caches, runner.block_tables)
            elif isinstance(msg, DeviceDraftRound):   # async: from the acceptance rank 0 broadcasts
                outcome.hold(*speculator.draft_on_device(msg, hidden, runner.kv_caches, runner.block_tables))
            elif isinstance(msg, HeldQuery):
                group.all_reduce(TensorParallelRunner._held_bytes(runner))
            elif isinstance(msg, DraftsCheck):   # the last step's drafts, no step following it
                outcome.check(msg.verified)
                group.all_reduce(torch.zeros(1, device=model.device))
            elif isinstance(msg, Released):
                mirror.release(msg.finished_ids)
                runner.release(SchedulerOutput([], preempted_ids=msg.preempted_ids, finished_ids=msg.finished_ids))
            else:   # only the hidden states are kept (not the step's logits, vocabulary-wide)
                out = mirror.decode(msg)
                outcome.check(msg.verified)   # before its collectives: rank 0 then fails this step
                prev = outcome.take(msg.in_flight)
                if prev is None and msg.in_flight is not None:
                    prev = share_in_flight(group, msg.in_flight, device=model.device)
                hidden = runner.execute(out, prev).hidden
    except Exception:
        if os.getppid() == parent:
            logger.exception("tensor-parallel rank %d failed", rank)
        exit_process(1)   # at once: rank 0 learns of it when this process's sockets close
    import torch.distributed as dist

    dist.destroy_process_group()
    exit_process(0)   # the group is torn down: skip the interpreter's module teardown (process_exit.py)
