"""Ending a process that has released what it holds, without the interpreter's module teardown.

With torch and transformers loaded, Python's teardown (clearing ~2,700 modules and ~400k objects,
collecting garbage between the steps) costs about a second of CPU per process and frees nothing
the kernel would not: memory, mappings and file descriptors go with the process. A `mmserve serve`
pays it twice (front end and engine process), the test suite dozens of times (docs/benchmarks.md,
"Suite time").

`exit_process` runs, in the interpreter's own order, everything Python's exit runs that can hold
or flush a resource: threading's shutdown (joins every non-daemon thread, thread-pool workers
included), then every atexit handler (logging's flush and close, multiprocessing's finalizers
and child joins, `weakref.finalize` callbacks such as temporary directories, exporters' flushes),
then the standard streams; then `os._exit`. Only the main thread of a process entry point whose
own resources (sockets, shared memory, child processes, spool files) are already closed may call it.

`watch_parent` is the other way out: a child process whose parent is gone exits at once, from a
thread of its own, whatever its main thread is stuck in.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import time
from typing import NoReturn

ORPHAN_POLL_S = 0.5   # how often a watched child checks that its parent is still there


def exit_process(code: int) -> NoReturn:
    threading._shutdown()       # what Py_FinalizeEx runs first: join the non-daemon threads
    atexit._run_exitfuncs()     # then the atexit handlers (each runs once: the list is cleared)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):   # a closed pipe or stream: nothing left to flush into it
            pass
    os._exit(code)


def watch_parent(parent: int) -> None:
    """Exit (code 1) as soon as the process `parent` is no longer this one's parent. A process that
    ignores SIGTERM (the engine, its tensor-parallel ranks: the front end decides when they stop)
    may be stuck where no loop checks its parent: a wedged step, a gloo wait that outlives its peer
    (a rank blocked in the rendezvous, or in a receive, was seen to)."""
    def exit_when_orphaned() -> None:
        while os.getppid() == parent:
            time.sleep(ORPHAN_POLL_S)
        os._exit(1)

    threading.Thread(target=exit_when_orphaned, name="parent-watch", daemon=True).start()
