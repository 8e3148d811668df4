"""Rotary position embeddings for Gemma 4's two layer types (NeoX rotate-half layout).

Sliding layers rotate the whole head. Full layers use "proportional" RoPE: only the first
`rotary_dim / 2` frequency pairs rotate (denominator is the full head dim) and the other pairs get
frequency 0, so cos = 1 and sin = 0 leave those dims untouched exactly.
"""

from __future__ import annotations

import torch

from mmserve.model.compiled import dense_kernel
from mmserve.model.norm import rms_norm
from mmserve.model.spec import RopeSpec


class RotaryEmbedding:
    """Holds the inverse frequencies on one device (built in float32 on CPU, then moved)."""

    def __init__(self, spec: RopeSpec, device: torch.device | str = "cpu"):
        pairs = spec.rotary_dim // 2
        exponents = torch.arange(0, 2 * pairs, 2, dtype=torch.int64, device="cpu").float() / spec.head_dim
        inv_freq = 1.0 / (spec.theta ** exponents)
        inv_freq = torch.cat([inv_freq, torch.zeros(spec.head_dim // 2 - pairs, device="cpu")]) / spec.factor
        self.inv_freq = inv_freq.to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, head_dim], computed in float32 and then cast like the reference."""
        freqs = positions.float()[:, None] * self.inv_freq.float()[None, :]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


@dense_kernel
def norm_rope(x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE of the RMS-normed q or k heads ([T, heads, head_dim]): one fused kernel when compiled."""
    return apply_rope(rms_norm.eager(x, weight, eps), cos, sin)
