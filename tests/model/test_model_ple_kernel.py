"""PLE's projection kernel (model/ple_kernels.py, launched by ple.gated_projection on CUDA) without a GPU.

Numerics: Triton's interpreter runs the kernel on fresh random inputs against the eager reference,
proj(gelu_tanh(gate) * layer_input), at row counts that fill, straddle and undershoot its 16-64-row
tiles, with the per-layer input a strided slice of the [T, L, D] step tensor as the decoder passes it,
and a width that leaves a partial column block. In float32 (triton 3.9's interpreter multiplies bf16
tl.dot operands wrongly: bf16 is the GPU's to check). Compilation: the kernel compiles for sm_90a at
E4B's shape in bf16 (Triton's GPU compiler and ptxas)."""

from __future__ import annotations

import importlib
import random

import pytest
import torch
import torch.nn.functional as F

from mmserve.model import ple

triton = pytest.importorskip("triton", reason="triton (the fa4-check extra) runs the PLE kernel")


def _kernels():
    """The kernel module as TRITON_INTERPRET says (read when a @triton.jit runs): reloaded."""
    return importlib.reload(importlib.import_module("mmserve.model.ple_kernels"))


@pytest.fixture
def interpreted(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield _kernels()
    monkeypatch.delenv("TRITON_INTERPRET")
    _kernels()


@pytest.mark.parametrize("rows", [1, 5, 16, 40, 64, 100])
def test_the_kernel_equals_the_eager_projection(interpreted, rows):
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    layers, dim, hidden = 3, 80, 72   # D not a multiple of the 64-wide D block, H not of the 32-wide column block
    gate = torch.randn(rows, dim, generator=gen) * 2
    layer_inputs = torch.randn(rows, layers, dim, generator=gen)
    proj_w = torch.randn(hidden, dim, generator=gen) / dim ** 0.5
    layer_input = layer_inputs[:, 1]   # row stride L * D, as decoder.forward slices it
    got = ple.launch_gated_projection(gate, layer_input, proj_w)
    want = F.linear(F.gelu(gate, approximate="tanh") * layer_input, proj_w)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_op_off_cuda_is_the_eager_projection():
    """Off CUDA (and above MAX_KERNEL_ROWS) the op is the elementwise op and a GEMM, bit for bit."""
    gen = torch.Generator().manual_seed(random.randrange(2**31))
    gate, layer_input = torch.randn(2, 7, 16, generator=gen).unbind(0)
    proj_w = torch.randn(24, 16, generator=gen)
    want = F.linear(F.gelu(gate, approximate="tanh") * layer_input, proj_w)
    assert torch.equal(ple.gated_projection(gate, layer_input, proj_w), want)


@pytest.mark.slow
def test_the_kernel_compiles_for_sm90(monkeypatch):
    """Triton's GPU compiler (through ptxas to a cubin) for sm_90a at E4B's decode shape (D = 256,
    H = 2560) in bf16, the 64-row tile: a tile past an H100/H200's registers or shared memory fails here."""
    from triton.backends.compiler import GPUTarget

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    fn = _kernels().gated_projection
    constexprs = dict(DIM=256, BLOCK_T=64, BLOCK_H=ple.BLOCK_H, BLOCK_D=64, PRECISION="tf32")
    signature = dict(zip(fn.arg_names, ["*bf16"] * 4 + ["i32"] * 6 + ["constexpr"] * len(constexprs), strict=True))
    kernel = triton.compile(triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                            target=GPUTarget("cuda", 90, 32))
    assert "cubin" in kernel.asm and kernel.metadata.shared <= 227 * 1024, kernel.metadata.shared
