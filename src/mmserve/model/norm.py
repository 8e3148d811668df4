"""Gemma 4 RMSNorm: `x * (mean(x^2) + eps)^-0.5 * w`, computed in float32, weight used as is.

Gemma 3 stored `w` as an offset (`1 + w`); Gemma 4 does not, and its V norm has no weight at all.
`rms_norm` is a dense kernel (compiled.py): one fused kernel per call when compilation is on.
"""

from __future__ import annotations

import torch
from torch import nn

from mmserve.model.compiled import dense_kernel


@dense_kernel
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    xf = x.float()
    # pow(-0.5) rather than rsqrt: the reference uses it and rsqrt rounds differently on some devices.
    out = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        out = out * weight.float()
    return out.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
