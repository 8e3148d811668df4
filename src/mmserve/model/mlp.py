"""The gated-GELU activation of Gemma 4's MLPs, as a dense kernel (compiled.py): gelu_tanh(gate) * up."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmserve.model.compiled import dense_kernel


@dense_kernel
def gelu_gate(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.gelu(gate, approximate="tanh") * up
