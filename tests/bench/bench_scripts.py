"""A bench/ script loaded as a module for a test (registered in sys.modules while in use: its
dataclasses look their module up there), with bench/ on sys.path meanwhile for the siblings it
imports, as when it runs as `python bench/SCRIPT`."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


@contextlib.contextmanager
def bench_script(name: str) -> Iterator:
    module_name = f"bench_{name}"
    spec = importlib.util.spec_from_file_location(module_name, BENCH_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    sys.path.append(str(BENCH_DIR))   # last: never in front of an installed package of the same name
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(BENCH_DIR))
        del sys.modules[module_name]
