"""A test backend with FA4's paging, capturable, so CPU tests can run the graph path as the H200 does.

What it shares with FA4 (attention/fa4.py on the frame-free path) and not with our CPU backends:
- a request's page table is read as it is: the null block 0 is a page like any other (the CPU
  backends drop its keys: mask.key_valid, flex's logical_block[0] = -1);
- every key of [0, seq_len) is loaded and a masked one weighs 0, so a NaN loaded beside kept keys
  reaches the row (0 x NaN), as in any tiled kernel;
- K/V writes to one slot from several tokens land in no fixed order (an index_put_ on CUDA):
  `register` makes the model's writes (`layer_pieces.write_kv`) take their rows in a fresh random
  order every call (`write_order`).
Every tensor it reads is a persistent buffer refilled in place, so emulated graphs can replay it.
No ranges (frames): graph steps carry none. Registered as backend "fa4_paging" by `register`.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from mmserve.attention.backend import AttentionBackend, CommonAttentionMetadata, PoolConfig
from mmserve.attention.mask import token_request_ids
from mmserve.model import layer_pieces

write_order = torch.Generator().manual_seed(0)
_write_kv = layer_pieces.write_kv


def write_kv_unordered(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """The model's K/V write (layer_pieces.write_kv, inside attn_in) with its rows in a fresh random
    order: the last writer of a slot wins, and which one varies, as on CUDA."""
    order = torch.randperm(slots.shape[0], generator=write_order)
    _write_kv(kv_cache, k[order], v[order], slots[order])


@dataclass
class PagingMetadata:
    common: CommonAttentionMetadata
    tok_req: torch.Tensor      # [T]
    seq_lens: torch.Tensor     # [R]
    table: torch.Tensor        # [R, width]


class PagingBuilder:
    def __init__(self, pool: PoolConfig):
        self.tok_req = torch.zeros(pool.max_num_tokens, dtype=torch.int64)
        self.seq_lens = torch.zeros(pool.max_num_reqs, dtype=torch.int64)
        self.table = torch.zeros(pool.max_num_reqs, pool.max_blocks_per_req, dtype=torch.int64)

    def buffers(self) -> list[torch.Tensor]:
        return [self.tok_req, self.seq_lens, self.table]

    def build(self, common: CommonAttentionMetadata) -> PagingMetadata:
        T, R = common.num_actual_tokens, common.num_reqs
        self.tok_req[:T] = token_request_ids(common.query_start_loc, T)
        self.seq_lens[:R] = common.seq_lens[:R]
        self.table[:R] = common.block_table[:R]
        return PagingMetadata(common, self.tok_req[:T], self.seq_lens[:R], self.table[:R])


class PagingImpl:
    def __init__(self, spec):
        self.spec = spec

    def forward(self, q, k, v, kv_cache, md: PagingMetadata):
        common = md.common   # (the model wrote this step's K/V before: attn_in)
        T, bs = common.num_actual_tokens, common.block_size
        _, num_blocks, _, hkv, d = kv_cache.shape
        keys = torch.arange(md.table.shape[1] * bs)
        slots = md.table[md.tok_req][:, keys // bs] * bs + keys % bs                  # [T, L]: pages as they are
        pos = common.positions[:T, None]
        loaded = keys[None] < md.seq_lens[md.tok_req][:, None]
        keep = loaded & (keys[None] <= pos)
        if self.spec.window is not None:
            keep &= pos - keys[None] < self.spec.window
        kc = kv_cache[0].reshape(-1, hkv, d)[slots].float()                             # [T, L, Hkv, D]
        vc = kv_cache[1].reshape(-1, hkv, d)[slots].float()
        kc, vc = (torch.where(loaded[..., None, None], x, 0.0) for x in (kc, vc))   # past seq_len: never read
        g = q.shape[1] // hkv
        scores = torch.einsum("thd,tlhd->thl", q[:T].float(), kc.repeat_interleave(g, 2)) * self.spec.scale
        p = torch.softmax(scores.masked_fill(~keep[:, None], float("-inf")), -1).nan_to_num(0.0)
        out = torch.zeros_like(q)
        out[:T] = torch.einsum("thl,tlhd->thd", p, vc.repeat_interleave(g, 2)).to(q.dtype)
        return out


BACKEND = AttentionBackend("fa4_paging", PagingImpl, PagingBuilder, cuda_graphs=True, device_positions=True)


def register(monkeypatch) -> None:
    """The backend by name, and the model's K/V writes unordered."""
    from mmserve import attention

    monkeypatch.setitem(attention._BACKENDS, "fa4_paging", __name__)
    monkeypatch.setattr(layer_pieces, "write_kv", write_kv_unordered)
    sys.modules.setdefault(__name__, sys.modules[__name__])
