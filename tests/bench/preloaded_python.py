"""A Python process that imports the heavy libraries once and forks a child per script it is given,
so N bench smoke runs pay torch's and transformers' ~4 s import once instead of N times.

Each child is the script run as `python SCRIPT ARGS...` would run it: `__main__`, sys.argv, the
script's folder first on sys.path, its own stdout/stderr files and an ordinary interpreter exit
(atexit handlers, non-daemon threads joined). Forking after these imports is the path PyTorch's
DataLoader workers take; nothing here has started a thread pool, a channel or a model.

`python preloaded_python.py [MODULE...]` imports MODULEs instead of PRELOAD (the runner's own tests
use a light one). Protocol, one line each way per run: the parent writes `SCRIPT<TAB>STDOUT_FILE<TAB>STDERR_FILE<TAB>ARGS...`
and reads back `started PID`, then `exit CODE` (the negated signal number when one ended it).
"""

from __future__ import annotations

import os
import runpy
import sys

PRELOAD = ("numpy", "av", "torch", "transformers", "transformers.models.gemma4.modeling_gemma4")


def _run_child(script: str, out: str, err: str, args: list[str]) -> None:
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target, fd)
        os.close(target)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")   # its SystemExit (or exception) ends this child


def serve(modules: tuple[str, ...] | list[str]) -> None:
    import importlib

    for name in modules:
        importlib.import_module(name)
    for line in sys.stdin:
        script, out, err, *args = line.rstrip("\n").split("\t")
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _run_child(script, out, err, args)
            return   # the script returned without sys.exit: exit 0 like `python SCRIPT`
        print(f"started {pid}", flush=True)
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        print(f"exit {status}", flush=True)


if __name__ == "__main__":
    serve(sys.argv[1:] or PRELOAD)
