"""`mmserve worker`: the ranks of one further node of a multi-node tensor-parallel group.

Node 0 runs `mmserve serve --tensor-parallel-size N --nnodes K` (the gRPC server, the core and rank
0); every other node runs `mmserve worker` with the same engine flags and its `--node-rank`, and
MASTER_ADDR/MASTER_PORT naming node 0 (docs/deploy.md#tensor-parallelism). It exits 0 when rank 0
stops the group, 1 when one of its ranks fails, and 0 on SIGINT, its ranks killed at once and reported
to node 0 as stopped; SIGTERM is logged and waited out for node 0's drain (docs/operations.md, "Stopping").
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from mmserve.config import EngineConfig, add_dataclass_args, from_args
from mmserve.errors import MMServeError
from mmserve.process_exit import exit_process

logger = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("worker", help="a further node's ranks of a multi-node tensor-parallel group",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_dataclass_args(p.add_argument_group("engine"), EngineConfig)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        config = from_args(EngineConfig, args)
    except ValueError as e:   # flags valid alone that conflict (EngineConfig.__post_init__)
        logger.error("mmserve worker: %s", e)
        return 2
    if not (Path(config.model) / "config.json").is_file():
        logger.error("no checkpoint at %s (config.json is missing); pass --model DIR", config.model)
        return 2
    from mmserve.executor.worker_rank import run_worker_node

    try:
        code = run_worker_node(config, logging.getLogger().getEffectiveLevel(), args.log_format)
    except (OSError, ValueError, MMServeError) as e:
        logger.error("mmserve worker: %s", e)
        code = 1
    # The ranks have exited and been joined: skip the interpreter's module teardown (process_exit.py).
    exit_process(code)
