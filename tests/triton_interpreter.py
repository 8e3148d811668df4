"""Our Triton kernels run by Triton's interpreter on a CPU (tests of attention/split_kv_kernels.py,
sample/nucleus_kernels.py and model/ple_kernels.py). Triton reads TRITON_INTERPRET when a @triton.jit
function runs (and again when a kernel calls a jit helper), so a kernel module is reloaded after the
variable changes, the combine functions its reductions call (mmserve/triton_combine.py) first."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from types import ModuleType

import pytest


def reload_kernels(module: str) -> ModuleType:
    """`module` as TRITON_INTERPRET now says (and the combine functions it imports)."""
    importlib.reload(importlib.import_module("mmserve.triton_combine"))
    return importlib.reload(importlib.import_module(module))


def interpreted_kernels(monkeypatch: pytest.MonkeyPatch, module: str) -> Iterator[ModuleType]:
    """A fixture's body: `module`'s kernels interpreted for one test, as the GPU compiler sees them after."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield reload_kernels(module)
    monkeypatch.delenv("TRITON_INTERPRET")
    reload_kernels(module)
