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
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_process(code: int) -> NoReturn:
    threading._shutdown()       # what Py_FinalizeEx runs first: join the non-daemon threads
    atexit._run_exitfuncs()     # then the atexit handlers (each runs once: the list is cleared)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):   # a closed pipe or stream: nothing left to flush into it
            pass
    os._exit(code)
