"""Which attention kernel runs each layer type on this hardware (pure functions over plain facts).

FA4 (flash-attn-4 4.0.0b36, pinned by the `gpu` extra) runs a layer type when its paged varlen
forward exists for the GPU's architecture, head dims and dtype:

- SM90 (Hopper): head dims 8..256, multiples of 8.
- SM100/SM110 (Blackwell datacenter): head dims <= 128 (multiples of 8), or 256 == 256. Its
  (512, 512) entry is the MLA-absorbed kernel, which computes softmax(Q V^T) V and so needs K == V;
  with distinct K and V (Gemma 4's global layers: cached K is normed and rotated, V only normed)
  b36 builds its generic kernel, which asserts on tensor memory (128 score + 512 output columns
  exceed 512). So head dim 512 never runs on FA4.
- SM80 and SM120: no paged-KV forward in FA4.
- fp16 / bf16 only.

Every other layer type takes the batched paged fallback: compiled FlexAttention over the paged
cache on CUDA (fixed shapes, so decode steps can be CUDA graphs; no per-step gather), the CPU
backend on CPU. tests/attention/test_attn_layer_choice.py checks `fa4_runs` against FA4's own kernel constructors.

Decode and verify steps (`split_kv_decode`) take our split-KV Triton kernel (attention/split_kv.py)
on the layer types where the backend's own kernel cannot spread one request's keys over the GPU:
- flex (head dim 512 on every GPU): Triton's flex kernel runs one program per (query block, KV
  head), one program per full layer of the 12B at batch 1;
- FA4 on SM90: b36 asserts "SplitKV not supported on SM 9.0", so a sliding layer at batch 1 runs
  8 CTAs (8 KV heads x one query tile) on 132 SMs, each streaming the whole window.
FA4 on SM100/SM110 keeps its own decode kernel (b36 has split-KV there).
"""

from __future__ import annotations

import os

import torch

from mmserve.attention.backend import LayerAttentionSpec

FA4_DTYPES = (torch.float16, torch.bfloat16)
GPU_FALLBACK = "flex"


def device_arch(device: torch.device | str) -> int | None:
    """SM major*10 + minor of `device` (FLASH_ATTENTION_ARCH=sm_90a wins, as in FA4), None off CUDA."""
    forced = os.environ.get("FLASH_ATTENTION_ARCH")
    if forced:
        return int(forced.removeprefix("sm_").rstrip("af"))
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def fa4_runs(arch: int | None, head_dim: int, head_dim_v: int, dtype: torch.dtype) -> bool:
    """Whether FA4 b36 has a paged varlen forward for this shape (with distinct K and V tensors)."""
    if arch is None or dtype not in FA4_DTYPES:
        return False
    aligned = head_dim % 8 == 0 and head_dim_v % 8 == 0
    family = arch // 10
    if family == 9:
        return aligned and 8 <= head_dim <= 256 and 8 <= head_dim_v <= 256
    if family in (10, 11):
        small = 8 <= head_dim <= 128 and 8 <= head_dim_v <= 128
        return aligned and (small or head_dim == head_dim_v == 256)
    return False


def split_kv_decode(backend: str, device_type: str, arch: int | None) -> bool:
    """Whether a layer type on `backend` runs its decode and verify steps on the split-KV kernel."""
    if device_type != "cuda" or arch is None:
        return False
    return backend == "flex" or (backend == "fa4" and arch // 10 == 9)


def choose_backends(specs: dict[str, LayerAttentionSpec], *, device_type: str, arch: int | None,
                    dtype: torch.dtype, fa4_installed: bool, requested: str = "auto") -> dict[str, str]:
    """The backend of each layer type for `--attention-backend requested`.

    "auto" and "fa4" give FA4 to every layer type it runs and the batched fallback to the rest
    (FlexAttention on CUDA, the CPU backend on CPU); any other name is taken for every layer type.
    """
    if requested not in ("auto", "fa4"):
        return {t: requested for t in specs}
    from mmserve.attention import CPU_AUTO_BACKEND

    fallback = GPU_FALLBACK if device_type == "cuda" else CPU_AUTO_BACKEND
    return {t: "fa4" if fa4_installed and fa4_runs(arch, s.head_dim, s.head_dim, dtype) else fallback
            for t, s in specs.items()}
