"""The Triton kernel of PLE's projection with its operand computed in the prologue (E2B/E4B decode
on CUDA; model/ple.gated_projection launches it).

`gated_projection`: out[t, h] = sum_d (gelu_tanh(gate[t, d]) * layer_input[t, d]) * proj_w[h, d].
One program per (BLOCK_T rows, BLOCK_H output columns): it loads its rows' gate and per-layer input
(D = 256: a few KiB), makes the GEMM's A operand in registers (float32, rounded once to the weight's
dtype, as inductor's fused elementwise kernel rounds it), and multiplies it on tensor cores with its
[BLOCK_H, D] slice of the weight. Inductor, calling cuBLAS for the GEMM, launches the operand as a
kernel of its own (bench/kernel_count.py): here it is one launch fewer per E-model layer.

gelu_tanh(g) = 0.5 g (1 + tanh(z)) = g / (1 + exp(-2 z)), z = sqrt(2/pi) (g + 0.044715 g^3), through
tl.exp: libdevice's tanh is not in Triton's interpreter, and tl.sigmoid (a jit function of triton's
own) runs only as TRITON_INTERPRET was when triton was imported; tests/model/test_model_ple_kernel.py
runs this kernel in the interpreter.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gated_projection(
    gate_ptr, input_ptr, w_ptr, out_ptr, rows, cols, stride_gate, stride_input, stride_w, stride_out,
    DIM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_ok, h_ok = t < rows, h < cols
    acc = tl.full((BLOCK_T, BLOCK_H), 0.0, tl.float32)   # not tl.zeros: a jit function of triton's own
    for d0 in range(0, DIM, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        d_ok = d < DIM
        td_ok = t_ok[:, None] & d_ok[None, :]
        g = tl.load(gate_ptr + t[:, None] * stride_gate + d[None, :], mask=td_ok, other=0.0).to(tl.float32)
        x = tl.load(input_ptr + t[:, None] * stride_input + d[None, :], mask=td_ok, other=0.0).to(tl.float32)
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        w = tl.load(w_ptr + h[None, :] * stride_w + d[:, None], mask=d_ok[:, None] & h_ok[None, :], other=0.0)
        a = (g / (1.0 + tl.exp(-2.0 * z)) * x).to(w.dtype)   # gelu_tanh(g) * x
        acc += tl.dot(a, w, input_precision=PRECISION)
    tl.store(out_ptr + t[:, None] * stride_out + h[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=t_ok[:, None] & h_ok[None, :])
