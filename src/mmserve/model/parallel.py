"""The tensor-parallel group seen by the decoder's layers: rank, size and the two collectives
Megatron sharding needs (all-reduce after a row-parallel matmul, all-gather of vocab/width shards).

At size 1 (`SINGLE`) every collective is the identity, so code written against a group runs
unchanged without torch.distributed. `shard_range` is the one place a dimension is cut: contiguous,
equal parts, refused with a message naming the dimension when it does not divide.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from mmserve.errors import MMServeError


class ShardingError(MMServeError):
    """The model cannot be split over this many ranks (a dimension does not divide)."""


class CollectiveError(RuntimeError):
    """A collective with the other ranks failed: a peer closed its connection or did not answer in
    time. Raised in place of the backend's plain RuntimeError (gloo and NCCL raise those) so that the
    group can tell a lost rank from a failure of this rank's own code outside the collectives. torch's
    own argument checks inside a collective raise RuntimeError too and are reported the same way."""


def collective(fn, *args, **kwargs):
    """Call a torch.distributed collective, turning its failure into a `CollectiveError`."""
    try:
        return fn(*args, **kwargs)
    except RuntimeError as exc:
        raise CollectiveError(str(exc)) from exc


@dataclass(frozen=True)
class ParallelGroup:
    rank: int = 0
    size: int = 1
    group: Any = None   # the torch.distributed process group (None: the default group)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the ranks (in place)."""
        if self.size > 1:
            import torch.distributed as dist

            collective(dist.all_reduce, x, group=self.group)
        return x

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank (in place)."""
        if self.size > 1:
            import torch.distributed as dist

            collective(dist.broadcast, x, src=0, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` concatenated along `dim`, in rank order."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        collective(dist.all_gather, parts, x, group=self.group)
        return torch.cat(parts, dim)

    def shard_range(self, n: int, what: str) -> tuple[int, int]:
        """This rank's [start, end) of a dimension of size `n` cut into `size` equal parts."""
        if n % self.size:
            raise ShardingError(f"{what} ({n}) is not divisible by --tensor-parallel-size {self.size}")
        part = n // self.size
        return self.rank * part, (self.rank + 1) * part

    def kv_heads(self, num_kv_heads: int, what: str) -> tuple[int, int]:
        """This rank's [start, end) of the KV heads. With more ranks than KV heads each rank holds the
        one KV head its query heads read (replicated over size / num_kv_heads ranks, as vLLM does)."""
        if num_kv_heads >= self.size:
            return self.shard_range(num_kv_heads, f"{what} KV heads")
        if self.size % num_kv_heads:
            raise ShardingError(f"{what} KV heads ({num_kv_heads}) neither divisible by nor a divisor of "
                                f"--tensor-parallel-size {self.size}")
        head = self.rank * num_kv_heads // self.size
        return head, head + 1


SINGLE = ParallelGroup()


JOIN_POLL_S = 0.05   # how often a rank waiting in the rendezvous checks its peers


def join_group(rank: int, size: int, init_method: str, *, backend: str = "gloo", timeout_s: float = 300.0,
               startup_timeout_s: float | None = None, check_peers=None) -> ParallelGroup:
    """Join the torch.distributed group of `size` ranks (gloo on CPU, nccl on CUDA) at `init_method`
    (tcp://host:port, file://path or env://). The rendezvous and the default group (start-up hand-offs)
    wait up to `startup_timeout_s` (processes start and load at their own pace); the returned group's
    collectives, the model's, raise after `timeout_s`.

    The ranks meet in a store every rank first marks itself in (`_rendezvous_store`), so a rank
    given `check_peers` (rank 0: raises when a rank is known lost) waits for the others in polls
    that call it, rather than inside torch's rendezvous until the start-up timeout."""
    import datetime

    import torch.distributed as dist

    startup = datetime.timedelta(seconds=startup_timeout_s or timeout_s)
    store = _rendezvous_store(init_method, rank, size, startup)
    if store is None:
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=size, timeout=startup)
    else:
        store.set(f"mmserve/joined/{rank}", "1")
        if check_peers is not None:
            _wait_joined(store, size, check_peers, startup.total_seconds())
        dist.init_process_group(backend, store=dist.PrefixStore("default_pg", store), rank=rank, world_size=size,
                                timeout=startup)
    group = dist.new_group(list(range(size)), timeout=datetime.timedelta(seconds=timeout_s))
    return ParallelGroup(rank, size, group)


def _rendezvous_store(init_method: str, rank: int, size: int, timeout):
    """The store the ranks meet in, made here rather than by torch's rendezvous so each can mark
    itself in first: a file (one node), or node 0's TCP store at MASTER_ADDR:MASTER_PORT (env://,
    hosted by rank 0, as torch's env rendezvous does). None: torch's own (tcp://, torchrun's agent store)."""
    import os

    import torch.distributed as dist

    if init_method.startswith("file://"):
        store = dist.FileStore(init_method.removeprefix("file://"), size)
        store.set_timeout(timeout)
        return store
    if init_method == "env://" and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":   # as torch reads it
        return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world_size=size,
                             is_master=rank == 0, timeout=timeout, wait_for_workers=False, multi_tenant=True)
    return None


def _wait_joined(store, size: int, check_peers, timeout_s: float) -> None:
    """Until every rank has marked itself in `store` (or `timeout_s`: torch's rendezvous then says so)."""
    import time

    keys = [f"mmserve/joined/{r}" for r in range(size)]
    deadline = time.monotonic() + timeout_s
    while not store.check(keys) and time.monotonic() < deadline:
        check_peers()
        time.sleep(JOIN_POLL_S)


@dataclass(frozen=True)
class Shard:
    """Which part of a checkpoint tensor one rank's parameter holds: along `dim` (of size `full` in
    the checkpoint, seen as `blocks` equal blocks, e.g. one per layer of the packed PLE table), the
    rows [start, end) of every block."""

    dim: int
    start: int
    end: int
    full: int
    blocks: int = 1

    def read(self, source) -> torch.Tensor:
        """This shard of `source` (a safetensors slice: nothing outside the shard is read)."""
        shape = list(source.get_shape())
        block = shape[self.dim] // self.blocks
        pieces = []
        for b in range(self.blocks):
            index = [slice(None)] * len(shape)
            index[self.dim] = slice(b * block + self.start, b * block + self.end)
            pieces.append(source[tuple(index)])
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, self.dim)


def mark_shard(param: torch.Tensor, group: ParallelGroup, dim: int, start: int, end: int, full: int,
               blocks: int = 1) -> None:
    """Record on a (meta) parameter which part of the checkpoint tensor it loads (at size 1 every
    parameter is whole)."""
    if group.size > 1:
        param.shard = Shard(dim, start, end, full, blocks)


def shards_of(module: torch.nn.Module) -> dict[str, Shard]:
    """{parameter name: Shard} of every sharded parameter of `module`."""
    return {name: p.shard for name, p in module.named_parameters() if hasattr(p, "shard")}


@dataclass(frozen=True)
class MergedPart:
    """One checkpoint tensor stacked into a merged parameter (q/k/v into qkv_proj, gate/up into
    gate_up_proj): `name` is its module's name beside the merged one (`q_proj`), its rows are
    [start, end) of the merged parameter, read as `shard` of the checkpoint tensor (None: whole)."""

    name: str
    start: int
    end: int
    shard: Shard | None


def mark_merged(param: torch.Tensor, group: ParallelGroup, parts: list[tuple[str, int, int, int]]) -> None:
    """Record on a (meta) parameter that it stacks, along dim 0 and in order, this rank's rows
    [start, end) of each checkpoint tensor in `parts` = [(name, start, end, full rows)]: one GEMM
    where the checkpoint has several (the weight loader fills each slice)."""
    merged, offset = [], 0
    for name, start, end, full in parts:
        shard = Shard(0, start, end, full) if group.size > 1 else None
        merged.append(MergedPart(name, offset, offset + end - start, shard))
        offset += end - start
    if offset != param.shape[0]:
        raise ValueError(f"merged parts cover {offset} rows of a parameter of {param.shape[0]}")
    param.merged = tuple(merged)


def merged_of(module: torch.nn.Module) -> dict[str, tuple[str, MergedPart]]:
    """{our name of a checkpoint tensor: (the merged parameter holding it, where)} for `module`."""
    out = {}
    for name, p in module.named_parameters():
        prefix, _, leaf = name.rpartition(".")
        owner = prefix.rpartition(".")[0]
        for part in getattr(p, "merged", ()):
            out[f"{owner}.{part.name}.{leaf}" if owner else f"{part.name}.{leaf}"] = (name, part)
    return out


def local_spec(spec, group: ParallelGroup):
    """The spec one rank's modules, KV pools and attention kernels are built from: per layer type
    its own query and KV heads; every other dimension as in the checkpoint (vocab and widths are cut
    inside the modules, which gather what leaves them). Refuses sizes that do not divide, naming
    the dimension, before any weight is read."""
    if group.size == 1:
        return spec
    group.shard_range(spec.vocab_size, "vocab_size")
    for layer in spec.layers:
        group.shard_range(layer.mlp_width, f"layer {layer.index} MLP width")
        if layer.moe is not None:
            group.shard_range(layer.moe.num_experts, "num_experts")
    if spec.ple is not None:
        group.shard_range(spec.ple.dim, "hidden_size_per_layer_input")
    attention = {}
    for t, a in spec.attention_specs.items():
        q0, q1 = group.shard_range(a.num_heads, f"{t} attention heads")
        k0, k1 = group.kv_heads(a.num_kv_heads, t)
        attention[t] = replace(a, num_heads=q1 - q0, num_kv_heads=k1 - k0)
    return replace(spec, attention_specs=attention)
