"""PLE's projection kernel (model/ple_kernels.py, launched by ple.gated_projection on CUDA) without a GPU.

Numerics: Triton's interpreter runs the kernel on fresh random inputs against the eager reference,
proj(gelu_tanh(gate) * layer_input), at row counts that fill, straddle and undershoot its 16-64-row
tiles, with the per-layer input a strided slice of the [T, L, D] step tensor as the decoder passes it,
and a width that leaves a partial column block. In float32 (triton 3.9's interpreter multiplies bf16
tl.dot operands wrongly: bf16 is the GPU's to check). Compilation: the kernel compiles for sm_90a at
E4B's shape in bf16 (Triton's GPU compiler and ptxas)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import interpreted_kernels, reload_kernels

from mmserve.model import ple

triton = pytest.importorskip("triton", reason="triton (the fa4-check extra) runs the PLE kernel")


KERNELS = "mmserve.model.ple_kernels"


@pytest.fixture
def interpreted(monkeypatch):
    yield from interpreted_kernels(monkeypatch, KERNELS)


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
    fn = reload_kernels(KERNELS).gated_projection
    constexprs = dict(DIM=256, BLOCK_T=64, BLOCK_H=ple.BLOCK_H, BLOCK_D=64, PRECISION="tf32")
    signature = dict(zip(fn.arg_names, ["*bf16"] * 4 + ["i32"] * 6 + ["constexpr"] * len(constexprs), strict=True))
    kernel = triton.compile(triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs),
                            target=GPUTarget("cuda", 90, 32))
    assert "cubin" in kernel.asm and kernel.metadata.shared <= 227 * 1024, kernel.metadata.shared


def _e_model_layers(hidden: int = 72, dim: int = 80):
    """What the start-up check reads of a model: its decoder layers' PLE gates (random weights)."""
    from types import SimpleNamespace

    layers = [SimpleNamespace(ple=ple.LayerInputGate(hidden, dim, 1e-6)) for _ in range(2)]
    for layer in layers:
        torch.nn.init.normal_(layer.ple.per_layer_projection.weight, std=dim ** -0.5)
    return SimpleNamespace(decoder=SimpleNamespace(layers=layers))


def test_the_start_up_check_passes_the_kernel_and_keeps_it_on(interpreted):
    from mmserve.worker.backend_check import check_ple_kernel

    ple.use_kernel(False)
    try:
        [check] = check_ple_kernel(_e_model_layers(), strict=True)
        assert (check.component, check.running, check.reason) == ("ple_projection", "triton", "")
        assert ple.kernel_enabled()
    finally:
        ple.use_kernel(True)


@pytest.mark.parametrize("broken", ["wrong rows", "launch error"])
def test_a_kernel_that_fails_its_start_up_check_is_turned_off_or_refused(interpreted, monkeypatch, broken):
    """A GPU unlike the ones tested: a kernel off by a row's worth (the class of a stride bug) or one
    that cannot launch falls back to cuBLAS's GEMM with the reason recorded, or fails the start under
    --strict-backends. The fallback is what the op then runs on CUDA."""
    from mmserve.worker.backend_check import BackendCheckError, check_ple_kernel

    real = ple.launch_gated_projection

    def wrong(gate, layer_input, proj_w):
        if broken == "launch error":
            raise RuntimeError("no kernel image is available for execution on the device")
        out = real(gate, layer_input, proj_w)
        return torch.cat([out[1:], out[:1]])   # rows shifted by one

    monkeypatch.setattr(ple, "launch_gated_projection", wrong)
    try:
        [check] = check_ple_kernel(_e_model_layers(), strict=False)
        assert check.running == "cublas" and check.fell_back and "2 rows" in check.reason
        assert not ple.kernel_enabled()
        with pytest.raises(BackendCheckError, match="ple_projection"):
            check_ple_kernel(_e_model_layers(), strict=True)
    finally:
        ple.use_kernel(True)


def test_models_without_per_layer_inputs_are_not_checked():
    from types import SimpleNamespace

    from mmserve.worker.backend_check import check_ple_kernel

    model = SimpleNamespace(decoder=SimpleNamespace(layers=[SimpleNamespace(ple=None)]))
    assert check_ple_kernel(model, strict=True) == []
