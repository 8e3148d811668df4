"""Gemma 4 mixture of experts (26B-A4B): a router and routed gated-GELU experts beside the dense MLP.

The block reads the attention residual `r` (not the pre-FF-normed state) for routing:
    weights, experts = top_k(softmax(proj(rmsnorm(r) * scale * H^-0.5)))   (fp32 softmax over all E)
    weights = weights / sum(weights) * per_expert_scale[experts]
    out = post_ff_ln_1(dense) + post_ff_ln_2(sum_k weights_k * expert_k(pre_ff_ln_2(r)))
Expert weights keep transformers' packed layout (`gate_up_proj` [E, 2I, H]: rows [0, I) gate, [I, 2I)
up; `down_proj` [E, H, I]), so a packed checkpoint loads without conversion.

Dispatch groups the step's (token, slot) pairs by expert with one sort: on CUDA one grouped GEMM
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

from mmserve.model.norm import RMSNorm
from mmserve.model.parallel import SINGLE, ParallelGroup, mark_shard
from mmserve.model.spec import MoeSpec


def uses_grouped_mm(x: torch.Tensor) -> bool:
    """The grouped-GEMM path runs on CUDA (this torch also runs it on CPU; tests force it there)."""
    return x.is_cuda and hasattr(torch, "_grouped_mm")


class Router(nn.Module):
    def __init__(self, hidden: int, moe: MoeSpec, eps: float):
        super().__init__()
        self.top_k = moe.top_k
        self.norm = RMSNorm(hidden, eps, with_scale=False)
        self.proj = nn.Linear(hidden, moe.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(moe.num_experts))
        self.root_size = hidden ** -0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights float32 [T, k], expert ids int64 [T, k])."""
        scores = self.proj(self.norm(x) * self.scale * self.root_size)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[experts], experts


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
        k = experts.shape[1]
        flat = experts.flatten()
        mine = None
        if self.sharded:   # other ranks' experts -> bucket num_experts, sorted last
            flat = flat - self.first_expert
            mine = (flat >= 0) & (flat < self.num_experts)
            flat = torch.where(mine, flat, self.num_experts)
        order = torch.argsort(flat, stable=True)
        token = order // k
        # scatter_add_, not bincount: CUDA's bincount reads the maximum on the host.
        counts = torch.zeros(self.num_experts + 1, dtype=torch.int64, device=x.device).scatter_add_(
            0, flat, torch.ones_like(flat))[:self.num_experts]
        rows = x[token]
        if uses_grouped_mm(x):
            hidden = self._grouped(rows, counts)
        else:
            hidden = self._per_expert(rows, counts.tolist())
        self._touched_buffer(x.device).copy_((counts > 0).sum())
        hidden = hidden * weights.flatten()[order, None]   # float32 weights, as transformers weighs them
        if mine is not None:   # rows past the last local expert were never computed
            hidden = torch.where(mine[order, None], hidden, 0.0)
        return torch.zeros_like(x).index_add_(0, token, hidden.to(x.dtype))

    @property
    def touched(self) -> torch.Tensor:
        """Distinct experts the last forward ran (a 0-d device tensor: the perf model bills their
        weights and reads it after the step). A fixed buffer written in place, so a replayed CUDA
        graph updates it too."""
        return self._touched_buffer(self.gate_up_proj.device)

    def _touched_buffer(self, device: torch.device) -> torch.Tensor:
        # Not a registered buffer: the loader builds modules on the meta device and assigns only
        # checkpoint tensors.
        if self._touched is None or self._touched.device != device:
            self._touched = torch.zeros((), dtype=torch.int64, device=device)
        return self._touched

    def _act(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def _per_expert(self, rows: torch.Tensor, counts: list[int]) -> torch.Tensor:
        out = rows.new_empty(rows.shape)
        start = 0
        for e, n in enumerate(counts):
            if n:
                chunk = rows[start:start + n]
                out[start:start + n] = F.linear(self._act(F.linear(chunk, self.gate_up_proj[e])), self.down_proj[e])
                start += n
        return out

    def _grouped(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        offsets = torch.cumsum(counts, 0).to(torch.int32)
        gate_up = torch._grouped_mm(rows, self.gate_up_proj.transpose(1, 2), offs=offsets)
        return torch._grouped_mm(self._act(gate_up), self.down_proj.transpose(1, 2), offs=offsets)


class MoeBlock(nn.Module):
    """Router + experts + the three norms that join them to the dense MLP's output."""

    def __init__(self, hidden: int, moe: MoeSpec, eps: float, group: ParallelGroup = SINGLE):
        super().__init__()
        self.group = group
        self.router = Router(hidden, moe, eps)
        self.experts = Experts(hidden, moe, group)
        self.pre_feedforward_layernorm_2 = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm_1 = RMSNorm(hidden, eps)
        self.post_feedforward_layernorm_2 = RMSNorm(hidden, eps)

    def forward(self, residual: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        """residual: the layer's state after attention; dense: the dense MLP's output."""
        weights, experts = self.router(residual)
        routed = self.group.all_reduce(self.experts(self.pre_feedforward_layernorm_2(residual), weights, experts))
        return self.post_feedforward_layernorm_1(dense) + self.post_feedforward_layernorm_2(routed)
