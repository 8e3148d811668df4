"""Gemma 4 mixture of experts (26B-A4B): a router and routed gated-GELU experts beside the dense MLP.

The block reads the attention residual `r` (not the pre-FF-normed state) for routing:
    weights, experts = top_k(softmax(proj(rmsnorm(r) * scale * H^-0.5)))   (fp32 softmax over all E)
    weights = weights / sum(weights) * per_expert_scale[experts]
    out = post_ff_ln_1(dense) + post_ff_ln_2(sum_k weights_k * expert_k(pre_ff_ln_2(r)))
Expert weights keep transformers' packed layout (`gate_up_proj` [E, 2I, H]: rows [0, I) gate, [I, 2I)
up; `down_proj` [E, H, I]), so a packed checkpoint loads without conversion.

Dispatch groups the step's (token, slot) pairs by expert with a counting sort: on CUDA one grouped GEMM
per projection (`torch._grouped_mm`, zero-size groups for experts without tokens), elsewhere one
matmul per expert that has tokens; never a loop over tokens. The CUDA path never reads a device
value on the host (no `bincount`, `.item()`, `int()`): a host sync per MoE layer would stall every
step and break CUDA-graph capture of decode steps (tests/model/test_model_moe.py checks it).

Tensor parallel (expert parallel inside the group): each rank holds a contiguous E/N of the experts
and the whole router; pairs routed to another rank's experts sort into one bucket past the last
local expert, never run, and are zeroed (a `where`, no host sync); the partial sums are all-reduced.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmserve.model import layer_pieces
from mmserve.model.compiled import layer_piece
from mmserve.model.norm import RMSNorm, rms_norm
from mmserve.model.parallel import SINGLE, ParallelGroup, mark_shard
from mmserve.model.spec import MoeSpec


def uses_grouped_mm(x: torch.Tensor) -> bool:
    """The grouped-GEMM path runs on CUDA (this torch also runs it on CPU; tests force it there)."""
    return x.is_cuda and hasattr(torch, "_grouped_mm")


def route(x: torch.Tensor, norm_eps: float, scale: torch.Tensor, proj_w: torch.Tensor,
          per_expert_scale: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (weights float32 [T, k], expert ids int64 [T, k]). The top k of the router's
    softmax renormalised over those k is the softmax of the top k scores (the softmax is monotonic
    and its denominator cancels): no softmax over all E experts."""
    scores = F.linear(rms_norm(x, None, norm_eps) * scale * x.shape[-1] ** -0.5, proj_w)
    top, experts = torch.topk(scores, top_k, dim=-1)
    return torch.softmax(top, dim=-1, dtype=torch.float32) * per_expert_scale[experts], experts


def dispatch(x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor, gate_up: torch.Tensor,
             down: torch.Tensor, touched: torch.Tensor, first_expert: int, sharded: bool) -> torch.Tensor:
    """x [T, H]; weights / experts [T, k] -> sum_k weights_k * expert_k(x) [T, H] over the experts
    `gate_up` [E, 2I, H] / `down` [E, H, I] hold (ids first_expert..first_expert + E); writes how
    many of them ran into `touched` (0-d, in place).

    The (token, slot) pairs are grouped by expert with a counting sort, not a sort: expert e's
    group starts after the pairs that chose a smaller id, and a pair's place in it is how many pairs
    before it chose the same expert (rank_pairwise at decode's few pairs, rank_by_scan beyond); the
    rows are scattered into that order and the expert outputs gathered back from it, each token
    summing its k (no index_add)."""
    k, num_experts = experts.shape[1], gate_up.shape[0]
    flat = experts.flatten()
    mine = None
    if sharded:   # other ranks' experts -> bucket num_experts, placed last
        flat = flat - first_expert
        mine = (flat >= 0) & (flat < num_experts)
        flat = torch.where(mine, flat, num_experts)
    ids = torch.arange(num_experts + 1, device=x.device)
    starts = (flat[:, None] < ids).sum(0)                                   # [E + 1]: each group's first row
    place = rank_pairwise(flat) if flat.shape[0] <= PAIRWISE_MAX else rank_by_scan(flat, starts, ids)
    pairs = x.unsqueeze(1).expand(-1, k, -1).reshape(-1, x.shape[1])
    rows = torch.empty_like(pairs).index_copy_(0, place, pairs)
    ends = starts[1:]                                                       # each local expert's last row + 1
    counts = ends - starts[:-1]
    if uses_grouped_mm(x):
        hidden = grouped(rows, ends, gate_up, down)
    else:
        hidden = per_expert(rows, counts.tolist(), gate_up, down)
    touched.copy_((counts > 0).sum())
    out = hidden[place] * weights.flatten()[:, None]   # float32 weights, as transformers weighs them
    if mine is not None:   # rows past the last local expert were never computed
        out = torch.where(mine[:, None], out, 0.0)
    return out.view(-1, k, x.shape[1]).sum(1).to(x.dtype)


PAIRWISE_MAX = 1024   # pairs ranked pairwise up to here (decode and verify steps: 128 rows at top-8)


def rank_pairwise(flat: torch.Tensor) -> torch.Tensor:
    """Each pair's row in the grouped order (`flat` [P]: its expert bucket): the pairs with a smaller
    bucket, plus the earlier pairs with the same one. One reduction over a [P, P] comparison: no scan,
    which is a kernel of its own (a cumsum), at the P^2 a decode step's few hundred pairs can afford."""
    i = torch.arange(flat.shape[0], device=flat.device)
    before = (flat[None, :] < flat[:, None]) | ((flat[None, :] == flat[:, None]) & (i[None, :] < i[:, None]))
    return before.sum(1)


def rank_by_scan(flat: torch.Tensor, starts: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The same rows for any P (a prefill chunk's): the bucket's first row plus how many pairs before
    this one chose it (a scan over one-hot rows, [P, buckets])."""
    same = torch.cumsum(flat[:, None] == ids, 0).gather(1, flat[:, None])[:, 0]   # this pair and those before it
    return starts[flat] + same - 1


def _act(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def per_expert(rows: torch.Tensor, counts: list[int], gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One matmul pair per expert that has rows (rows sorted by expert, `counts` on the host)."""
    out = rows.new_empty(rows.shape)
    start = 0
    for e, n in enumerate(counts):
        if n:
            chunk = rows[start:start + n]
            out[start:start + n] = F.linear(_act(F.linear(chunk, gate_up[e])), down[e])
            start += n
    return out


def grouped(rows: torch.Tensor, ends: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The same as two grouped GEMMs over every expert (zero-size groups); `ends` [E] on the
    device: where each expert's rows end (the cumulative counts)."""
    offsets = ends.to(torch.int32)
    hidden = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=offsets)
    return torch._grouped_mm(_act(hidden), down.transpose(1, 2), offs=offsets)


def routed_experts(h: torch.Tensor, router_scale: torch.Tensor, router_w: torch.Tensor, per_expert_scale: torch.Tensor,
                   pre_norm_w: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, touched: torch.Tensor, eps: float,
                   top_k: int, first_expert: int, sharded: bool) -> torch.Tensor:
    """The residual after attention -> this rank's routed experts' sum: route, then the pre-normed
    rows dispatched by expert."""
    weights, experts = route(h, eps, router_scale, router_w, per_expert_scale, top_k)
    return dispatch(rms_norm(h, pre_norm_w, eps), weights, experts, gate_up, down, touched, first_expert, sharded)


@layer_piece(token_args=2)
def mlp_moe_in(h: torch.Tensor, attn: torch.Tensor, post_attn_w: torch.Tensor, pre_ff_w: torch.Tensor,
               gate_up_w: torch.Tensor, down_w: torch.Tensor, router_scale: torch.Tensor, router_w: torch.Tensor,
               per_expert_scale: torch.Tensor, pre_norm_w: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
               touched: torch.Tensor, eps: float, top_k: int, first_expert: int, sharded: bool
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A MoE layer's piece (layer_pieces.py): mlp_in and the routed experts together, so one kernel
    norms the residual for the dense MLP, the router and the experts (three RMSNorms of one row).
    Returns (the residual after attention, the dense MLP's and the experts' partial sums)."""
    h, dense = layer_pieces.mlp_in.eager(h, attn, post_attn_w, pre_ff_w, gate_up_w, down_w, eps)
    return h, dense, routed_experts(h, router_scale, router_w, per_expert_scale, pre_norm_w, gate_up, down, touched,
                                    eps, top_k, first_expert, sharded)


class Router(nn.Module):
    def __init__(self, hidden: int, moe: MoeSpec, eps: float):
        super().__init__()
        self.top_k = moe.top_k
        self.norm = RMSNorm(hidden, eps, with_scale=False)
        self.proj = nn.Linear(hidden, moe.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(moe.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights float32 [T, k], expert ids int64 [T, k])."""
        return route(x, self.norm.eps, self.scale, self.proj.weight, self.per_expert_scale, self.top_k)


class Experts(nn.Module):
    """This rank's experts (all of them at size 1); `forward` returns their share of the sum."""

    def __init__(self, hidden: int, moe: MoeSpec, group: ParallelGroup = SINGLE):
        super().__init__()
        e0, e1 = group.shard_range(moe.num_experts, "num_experts")
        self.first_expert, self.num_experts, self.intermediate = e0, e1 - e0, moe.intermediate
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * moe.intermediate, hidden))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, hidden, moe.intermediate))
        for packed in (self.gate_up_proj, self.down_proj):
            mark_shard(packed, group, 0, e0, e1, moe.num_experts)
        self.sharded = group.size > 1
        self._touched: torch.Tensor | None = None   # see `touched`

    def forward(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """x [T, H]; weights / experts [T, k] -> sum_k weights_k * expert_k(x) [T, H] over this rank's experts."""
        return dispatch(x, weights, experts, self.gate_up_proj, self.down_proj, self.touched, self.first_expert,
                        self.sharded)

    @property
    def touched(self) -> torch.Tensor:
        """Distinct experts the last forward ran (a 0-d device tensor: the perf model bills their
        weights and reads it after the step). A fixed buffer written in place, so a replayed CUDA
        graph updates it too. Not a registered buffer: the loader builds modules on the meta device
        and assigns only checkpoint tensors."""
        device = self.gate_up_proj.device
        if self._touched is None or self._touched.device != device:
            self._touched = torch.zeros((), dtype=torch.int64, device=device)
        return self._touched


class MoeBlock(nn.Module):
    """Router + experts, and the three norms that join them to the dense MLP's output (applied by
    layer_pieces.layer_out, fused with the layer's residual add)."""

    def __init__(self, hidden: int, moe: MoeSpec, eps: float, group: ParallelGroup = SINGLE):
        super().__init__()
        self.group = group
        self.router = Router(hidden, moe, eps)
        self.experts = Experts(hidden, moe, group)
        self.pre_feedforward_layernorm_2 = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm_1 = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm_2 = RMSNorm(hidden, eps)

    def forward(self, h: torch.Tensor, attn: torch.Tensor, mlp, post_attn_norm: RMSNorm, pre_ff_norm: RMSNorm
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A MoE layer after attention, in place of `mlp.after_attention`: (h, attn) -> (the residual
        after attention, the dense MLP's output, the routed experts' sum), each sum all-reduced (not
        yet normed); the dense MLP, router, pre-norm and dispatch as one piece (`mlp_moe_in`)."""
        r, e = self.router, self.experts
        h, dense, routed = mlp_moe_in(h, attn, post_attn_norm.weight, pre_ff_norm.weight, mlp.gate_up_proj.weight,
                                      mlp.down_proj.weight, r.scale, r.proj.weight, r.per_expert_scale,
                                      self.pre_feedforward_layernorm_2.weight, e.gate_up_proj, e.down_proj, e.touched,
                                      r.norm.eps, r.top_k, e.first_expert, e.sharded)
        return h, mlp.reduce(dense), self.group.all_reduce(routed)
