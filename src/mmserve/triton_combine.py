"""Combine functions for `tl.reduce` in our Triton kernels (attention/split_kv_kernels.py,
sample/nucleus_kernels.py), used instead of tl.max / tl.sum: those are jit functions of triton's
own, interpreted or compiled as TRITON_INTERPRET was when triton was imported, while these are
interpreted or compiled as it was when this module was loaded. So Triton's interpreter runs the
kernels in any process: the tests reload this module, then the kernel module, after setting it
(tests/triton_interpreter.py).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def maximum(a, b):
    return tl.maximum(a, b)


@triton.jit
def add(a, b):
    return a + b
