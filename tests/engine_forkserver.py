"""Engine processes of the tests' in-process servers, forked from one preloaded forkserver per test process.

A spawned engine process is a fresh interpreter that imports torch, transformers' Gemma 4 modelling
and xgrammar (~3.6 s of CPU) before it loads its model, and a pytest worker starts dozens of engines
(the server fixtures of most modules): on the suite's two cores those imports were minutes of its
time. Here the first engine a test process starts also starts a multiprocessing forkserver that
imports the engine's modules once; every engine is a fork of it that runs the same entry point
(`run_engine_process`) with the same arguments, pickled the same way.

A forkserver's children inherit its environment and stdout/stderr from when it started (during some
earlier test); an engine process gets its launcher's at launch, as a spawned one does: the
environment travels with the arguments and is applied before the entry point runs, and fds 1 and 2
are passed through the forkserver's socket. The working directory and sys.path travel as spawn's
preparation data. What still differs from a spawn: the OpenMP runtime and anything read from the
environment at import time (TORCH_LOGS) are the forkserver's, and the engine's parent, which it
watches to stop when orphaned, is the forkserver (which ends with its test process). A test about
those asks for `spawned_engines`; every `mmserve serve` subprocess spawns its engine as production does.
"""

from __future__ import annotations

import multiprocessing
import os
import types
from multiprocessing import reduction

# The engine entry point's imports (mmserve.engine.core_client starts it from these modules).
PRELOAD = ["mmserve.core.process", "mmserve.executor.tensor_parallel", "mmserve.core.engine_core", __name__]


class _LaunchFd:
    """One of the launcher's fds, duplicated into the child through the forkserver as the child is pickled."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        return _received_fd, (reduction.DupFd(self.fd),)


def _received_fd(passed) -> int:
    return passed.detach()


def _run_as_launched(environ: dict[str, str], stdout: int, stderr: int, target, args) -> None:
    """In the forked child: the launcher's environment and stdout/stderr, then the engine's entry point."""
    os.environ.clear()
    os.environ.update(environ)
    for passed, fd in ((stdout, 1), (stderr, 2)):
        os.dup2(passed, fd)
        os.close(passed)
    target(*args)


class _ForkedEngineContext:
    """What core_client asks of `multiprocessing.get_context("spawn")`: a Process, here forked."""

    def __init__(self) -> None:
        self._forkserver = multiprocessing.get_context("forkserver")
        self._forkserver.set_forkserver_preload(PRELOAD)

    def Process(self, *, target, name, args=()):  # noqa: N802 (multiprocessing's name)
        return self._forkserver.Process(target=_run_as_launched, name=name,
                                        args=(dict(os.environ), _LaunchFd(1), _LaunchFd(2), target, args))


def forked_engines_module():
    """A stand-in for core_client's `multiprocessing`: "spawn" gives forked engines, the rest is multiprocessing's."""
    forked = _ForkedEngineContext()
    return types.SimpleNamespace(
        get_context=lambda method=None: forked if method == "spawn" else multiprocessing.get_context(method),
        process=multiprocessing.process)
