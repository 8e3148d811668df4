"""The worker ranks' processes: a rank's loop (`worker_main`: join the group, load this rank's
shard, then run every step rank 0 sends until it stops the group; spawned by rank 0 on its own
node, executor/tensor_parallel.py, and by `run_worker_node` on a further one) and a further node's
ranks (`run_worker_node`, `mmserve worker`: worker_cli.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal

import torch

from mmserve.config import EngineConfig
from mmserve.core.sched.output import SchedulerOutput
from mmserve.executor.message_ring import RingReader
from mmserve.executor.ranks import (
    STORE_TIMEOUT_S,
    broadcast_object,
    check_divisible,
    load_rank_model,
    rank_device,
    rank_threads,
    ranks_per_node,
    rendezvous,
    report_lost,
    use_device,
)
from mmserve.executor.step_messages import (
    DraftsCheck,
    HeldOutcome,
    HeldQuery,
    Released,
    StepMirror,
    held_bytes,
    share_in_flight,
)
from mmserve.model.parallel import join_group
from mmserve.process_exit import exit_process, watch_parent
from mmserve.spec_decode.speculator import DeviceDraftRound, DraftBatch

logger = logging.getLogger(__name__)

# A worker waits for rank 0's next step as long as it takes (an idle server sends none); rank 0
# gone closes the connection, which ends the wait. Rank 0's own waits are --tensor-parallel-timeout-s.
WORKER_WAIT_S = 365 * 24 * 3600.0
SIGNAL_POLL_S = 0.1   # how soon a worker node acts on SIGTERM or SIGINT


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
                           backend=use_device(rank_device(config, rank)), timeout_s=WORKER_WAIT_S)
        model = load_rank_model(config, group)
        plans, max_model_len, leader = broadcast_object()
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
        while (msg := ring.read() if ring is not None else broadcast_object(group=group)) is not None:
            if isinstance(msg, DraftBatch):   # a drafting round over the last step's hidden states
                speculator.draft(msg, hidden, runner.kv_caches, runner.block_tables)
            elif isinstance(msg, DeviceDraftRound):   # async: from the acceptance rank 0 broadcasts
                outcome.hold(*speculator.draft_on_device(msg, hidden, runner.kv_caches, runner.block_tables))
            elif isinstance(msg, HeldQuery):
                group.all_reduce(held_bytes(runner))
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
