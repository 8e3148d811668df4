"""A tensor-parallel rank's place in the group, the same on rank 0 and on the workers: how many
ranks a node runs, a rank's device, torch threads and shard of the model, the size checks made
before any process is spawned, where the ranks meet (the rendezvous; over several nodes, node 0's
TCP store, which also carries a further node's report of a rank it lost), and rank 0's broadcast
of a Python object (start-up's runner sizes, each step's message over several nodes).
"""

from __future__ import annotations

import logging
import os

import torch

from mmserve.config import EngineConfig
from mmserve.model.parallel import ParallelGroup, collective

logger = logging.getLogger(__name__)

STORE_TIMEOUT_S = 2.0   # rank 0's client of its own store: connect and reads
REPORT_TIMEOUT_S = 30.0   # a worker node's report of a lost rank: node 0 may still be starting
LOST_KEY = "mmserve/lost/{rank}"   # a further node's report of a rank it lost: "node N, pid P, exit code C"


def broadcast_object(obj=None, group: ParallelGroup | None = None):
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


def use_device(device: str) -> str:
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
    from mmserve.model.spec import load_spec_without_transformers

    if config.tensor_parallel_size % config.nnodes:
        raise ValueError(f"--tensor-parallel-size {config.tensor_parallel_size} is not divisible by "
                         f"--nnodes {config.nnodes}")
    if config.node_rank >= config.nnodes:
        raise ValueError(f"--node-rank {config.node_rank}: there are only --nnodes {config.nnodes}")
    group = ParallelGroup(0, config.tensor_parallel_size)
    local_spec(load_spec_without_transformers(config.model), group)
    if config.speculative_model:
        from mmserve.model.assistant import Assistant
        from mmserve.model.assistant_spec import read_assistant_spec

        with torch.device("meta"):   # the same cuts the ranks make, on no storage
            Assistant(read_assistant_spec(config.speculative_model), group)
