"""What one `mmserve serve` start and stop cost, wall and CPU: the fixed price the test suite pays per
server process (docs/benchmarks.md, "Suite time").

    python bench/serve_start.py              # 5 starts of the demo model, JSON to bench/results/
    python bench/serve_start.py --smoke      # 1 start; JSON to a temp file
    python bench/serve_start.py --tensor-parallel-size 2 --out FILE   # rank 1 too

Each run starts `python -m mmserve.cli serve --port 0` (the embedded demo model, CPU, one torch
thread, as the tests start it), times the log lines it prints as they arrive (front end imported and
configured, listening, engine process started, engine ready, serving), polls gRPC health until
SERVING, then sends SIGTERM and times the drain and both interpreters' exits. CPU seconds come from
the kernel: /proc/PID/stat of the front end, its engine process and the engine's worker ranks at
SERVING (each process's own, per process), and wait4's rusage of the whole tree at exit (the front
end reaps its engine, so the engine's CPU is included). On the
suite's two shared cores CPU seconds are what a start really costs the other tests.

Then the imports alone, each in a fresh interpreter: the front end's (`mmserve.server.app`), the
engine process's (`mmserve.core.engine_core`), and which heavy libraries the front end loads.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results" / "serve_start.json"
# (phase, the log line that ends it); phases are measured from the previous mark
MARKS = (("front-end imports + config", re.compile(r"tracing (on|off)")),
         ("server built, listening", re.compile(r"listening on [\d.]+:(\d+)")),
         ("engine spawn, imports, load", re.compile(r"engine ready:")),
         ("warm-up, ready", re.compile(r"ready: serving")))
ENGINE_PID = re.compile(r"engine process (\d+) started")
RANK_STARTED = re.compile(r"tensor-parallel rank 1: process \d+ started")
CLK_TCK = os.sysconf("SC_CLK_TCK")
HEAVY = ("torch", "transformers", "xgrammar")


def _cpu_s(pid: int) -> float:
    """user + system seconds of a live process (its reaped children not included)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _serving(port: int, timeout_s: float) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest(service="mmserve.v1.Generation")
        while stub.Check(request, timeout=5).status != health_pb2.HealthCheckResponse.SERVING:
            if time.monotonic() > deadline:
                raise TimeoutError("the server never reported SERVING")
            time.sleep(0.01)


def one_start(timeout_s: float = 120.0, tensor_parallel_size: int = 1) -> dict:
    """One start and stop of `mmserve serve`: wall seconds per phase, CPU seconds of start and stop."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    t0 = time.monotonic()
    tp = ["--tensor-parallel-size", str(tensor_parallel_size)] if tensor_parallel_size > 1 else []
    proc = subprocess.Popen([sys.executable, "-m", "mmserve.cli", "serve", "--port", "0", "--device", "cpu", *tp],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    seen: dict[str, float] = {}
    found = {"port": None, "engine_pid": None}
    lines: list[str] = []
    marked = threading.Condition()

    def pump() -> None:
        for line in proc.stdout:
            now = time.monotonic() - t0
            lines.append(line)
            with marked:
                if found["engine_pid"] is None and (m := ENGINE_PID.search(line)):
                    found["engine_pid"] = int(m.group(1))
                if "rank 1 spawned" not in seen and RANK_STARTED.search(line):
                    seen["rank 1 spawned"] = now
                for name, pattern in MARKS:
                    if name not in seen and (m := pattern.search(line)):
                        seen[name] = now
                        if name == "server built, listening":
                            found["port"] = int(m.group(1))
                marked.notify_all()

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    with marked:
        if not marked.wait_for(lambda: found["port"] is not None or proc.poll() is not None, timeout_s):
            proc.kill()
            raise TimeoutError("no 'listening on' line:\n" + "".join(lines[-20:]))
    if found["port"] is None:
        raise RuntimeError("mmserve serve exited before listening:\n" + "".join(lines[-20:]))
    _serving(found["port"], timeout_s)
    serving = time.monotonic() - t0
    with marked:
        marked.wait_for(lambda: all(name in seen for name, _ in MARKS), 5)
    ranks = _children(found["engine_pid"])
    cpu = dict(front_end=_cpu_s(proc.pid), engine=_cpu_s(found["engine_pid"]),
               worker_ranks=sum(_cpu_s(pid) for pid in ranks))
    start_cpu = sum(cpu.values())
    proc.send_signal(signal.SIGTERM)
    stop_sent = time.monotonic() - t0
    _, status, usage = os.wait4(proc.pid, 0)
    exited = time.monotonic() - t0
    reader.join(5)
    stopped = next((s for s in (re.search(r"\bstopped\b", line) for line in lines) if s), None)
    if os.waitstatus_to_exitcode(status) != 0 or stopped is None:
        raise RuntimeError(f"mmserve serve exited {status}:\n" + "".join(lines[-20:]))
    phases, previous = {}, 0.0
    for name, _ in MARKS:
        phases[name] = round(seen[name] - previous, 3)
        previous = seen[name]
    total_cpu = usage.ru_utime + usage.ru_stime
    return dict(phases=phases, start_wall_s=round(serving, 3), stop_wall_s=round(exited - stop_sent, 3),
                cpu_s={k: round(v, 3) for k, v in cpu.items()},
                rank1_spawned_s=round(seen["rank 1 spawned"], 3) if "rank 1 spawned" in seen else None,
                start_cpu_s=round(start_cpu, 3), stop_cpu_s=round(total_cpu - start_cpu, 3),
                total_cpu_s=round(total_cpu, 3))


def import_cost(module: str) -> dict:
    """Wall and CPU seconds of importing `module` in a fresh interpreter, and which heavy libraries it loads."""
    probe = (f"import sys, resource, time; t = time.perf_counter(); import {module}; w = time.perf_counter() - t; "
             "r = resource.getrusage(resource.RUSAGE_SELF); "
             f"print(w, r.ru_utime + r.ru_stime, ','.join(m for m in {HEAVY!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    return dict(module=module, wall_s=round(float(out[0]), 3), process_cpu_s=round(float(out[1]), 3),
                heavy=out[2] if len(out) > 2 else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="one start, JSON to a temp file")
    p.add_argument("--starts", type=int, default=5)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    starts = 1 if args.smoke else args.starts
    runs = [one_start(tensor_parallel_size=args.tensor_parallel_size) for _ in range(starts)]
    imports = [import_cost(m) for m in ("mmserve.server.app", "mmserve.core.engine_core")]

    def median(key, sub=None):
        return round(statistics.median(r[key][sub] if sub else r[key] for r in runs), 3)

    print(f"mmserve serve, demo model, CPU, tensor-parallel size {args.tensor_parallel_size}: median of {starts} start(s); load average "
          f"{os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    print(f"{'phase':<32}{'wall s':>8}")
    for name, _ in MARKS:
        print(f"{name:<32}{median('phases', name):>8.3f}")
    print(f"{'start (to SERVING)':<32}{median('start_wall_s'):>8.3f}   CPU {median('start_cpu_s'):.3f} s")
    for process in runs[0]["cpu_s"]:
        print(f"{'  CPU at SERVING: ' + process:<32}{median('cpu_s', process):>8.3f}")
    spawned = [r["rank1_spawned_s"] for r in runs if r["rank1_spawned_s"] is not None]
    if args.tensor_parallel_size > 1:   # a start whose rank-1 line was not seen has none
        print(f"{'rank 1 spawned at':<32}" + (f"{statistics.median(spawned):>8.3f}" if spawned else f"{'not seen':>8}"))
    print(f"{'stop (SIGTERM to exit)':<32}{median('stop_wall_s'):>8.3f}   CPU {median('stop_cpu_s'):.3f} s")
    print(f"\n{'import (fresh interpreter)':<32}{'wall s':>8}{'CPU s':>8}  heavy libraries loaded")
    for row in imports:
        print(f"{row['module']:<32}{row['wall_s']:>8.3f}{row['process_cpu_s']:>8.3f}  {row['heavy'] or '-'}")
    out = args.out or (Path(tempfile.mkdtemp()) / "serve_start.json" if args.smoke else RESULTS)
    out.write_text(json.dumps(dict(starts=runs, imports=imports, load_average=os.getloadavg()[0],
                                   cores=os.cpu_count()), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
