"""Noisy neighbours: the CPU server's throughput with 0, 1 and 2 busy processes beside it, per thread setting.

On a CPU the engine's torch threads share the cores with the front end and with whatever else runs on
the machine. This starts one `mmserve serve` per setting (the default thread policy and fixed ones,
e.g. `--engine-threads 1`) on bench/serving.py's 55M checkpoint, then for each number of busy
processes (pure-Python spin loops at normal priority: a neighbour that wants a whole core) sends the
same 16 concurrent text requests and 16 concurrent video requests to each server in turn, the
settings' order alternating between rounds so that a drift in the machine's load favours none. A
setting's result is its best round. Per measurement it records output tok/s, the server's CPU time
(front end and engine process) per output token, TTFT p50, and how many cores the machine spent on
work that is not this benchmark's ("others": /proc/stat's busy time minus this run's processes), so
a table made on a shared machine says how shared it was.

    python bench/cpu_contention.py            # minutes: 55M model, busy 0,1,2; text and video; 2 rounds
    python bench/cpu_contention.py --smoke    # seconds: demo model, one server, busy 1; 2 short requests
    python bench/cpu_contention.py --setting "main=PYTHONPATH=/path/to/old/src"   # another tree's default

A setting is `LABEL=ARGS`: leading NAME=VALUE words are environment variables for that server (e.g.
OMP_WAIT_POLICY=PASSIVE, or PYTHONPATH of another checkout), the rest are `mmserve serve` flags.
Prints one table and writes JSON (default bench/results/cpu_contention.json).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving import (  # noqa: E402  (bench/ is not a package)
    RESULTS_DIR,
    clips,
    machine,
    make_large_checkpoint,
    percentile,
    server_process,
    stream_request,
)

from mmserve.clients import AsyncClient, user_message  # noqa: E402
from mmserve.config import DEMO_MODEL_DIR  # noqa: E402
from mmserve.multimodal.demo_task import PROMPT  # noqa: E402

logger = logging.getLogger("bench.cpu_contention")
DEFAULT_OUT = RESULTS_DIR / "cpu_contention.json"
DEFAULT_SETTINGS = ("default=", "1 thread=--engine-threads 1", "2 threads=--engine-threads 2")
TICKS = os.sysconf("SC_CLK_TCK")
SPIN = "while True: pass"
ENV_WORD = re.compile(r"^[A-Z_][A-Z0-9_]*=")


@dataclass(frozen=True)
class Setting:
    label: str
    env: dict[str, str]
    flags: tuple[str, ...]


def parse_setting(text: str) -> Setting:
    """`LABEL=ARGS`: ARGS' leading NAME=VALUE words are environment variables, the rest serve flags."""
    label, _, rest = text.partition("=")
    words = shlex.split(rest)
    env: dict[str, str] = {}
    while words and ENV_WORD.match(words[0]):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return Setting(label.strip(), env, tuple(words))


@dataclass
class Measurement:
    busy: int
    workload: str
    setting: str
    round: int
    requests: int
    output_tokens: int
    wall_s: float
    tok_s: float
    cpu_ms_per_token: float   # the server's processes (front end + engine), user + system
    ttft_p50_s: float
    others_cores: float       # cores busy with work outside this benchmark during the measurement
    load_avg_1m: float


# --- CPU accounting from /proc --------------------------------------------------------------------

def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2:].split()   # the fields after "pid (comm)"; comm may hold spaces


def process_tree(root: int) -> list[int]:
    """`root` and every live descendant."""
    parents: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := _stat_fields(int(entry.name))) is not None:
            parents.setdefault(int(fields[1]), []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(parents.get(pid, ()))
    return tree


def cpu_seconds(pids: list[int]) -> float:
    """User + system time of these processes (all their threads), in seconds."""
    ticks = 0
    for pid in pids:
        if (fields := _stat_fields(pid)) is not None:
            ticks += int(fields[11]) + int(fields[12])   # utime, stime
    return ticks / TICKS


def machine_busy_seconds() -> float:
    """CPU time the whole machine spent busy (not idle or waiting on I/O), in seconds."""
    values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = values[:8]
    return (user + nice + system + irq + softirq + steal) / TICKS


def server_pid(address: str) -> int:
    """The pid of this process's child serving on `address`'s port."""
    port = address.rsplit(":", 1)[1]
    for pid in process_tree(os.getpid())[1:]:
        with contextlib.suppress(OSError):
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            if b"serve" in argv and port.encode() in argv:
                return pid
    raise RuntimeError(f"no server process on {address}")


@contextlib.contextmanager
def busy_processes(count: int) -> Iterator[list[subprocess.Popen]]:
    procs = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(count)]
    try:
        yield procs
    finally:
        for p in procs:
            p.kill()
            p.wait()


# --- the workload ---------------------------------------------------------------------------------

def story_prompts(count: int) -> list[str]:
    """The text workload's prompts: distinct, a dozen tokens each."""
    return [f"Write a short story about the number {i}." for i in range(count)]


def workloads(names: list[str], concurrency: int, num_frames: int) -> dict[str, list]:
    """Per workload, one message per request: distinct texts; distinct synthetic clips."""
    out = {}
    if "text" in names:
        out["text"] = [user_message(text) for text in story_prompts(concurrency)]
    if "video" in names:
        out["video"] = [user_message(PROMPT, video=v, num_frames=num_frames) for v in clips(concurrency, num_frames)]
    return out


async def send_all(address: str, messages: list, *, max_tokens: int, tag: str) -> tuple[float, list]:
    """All messages at once (len(messages) in flight); wall seconds and the samples."""
    async with AsyncClient(address) as client:
        start = time.perf_counter()
        samples = await asyncio.gather(*(stream_request(client, m, max_tokens=max_tokens, request_id=f"{tag}-{i}")
                                         for i, m in enumerate(messages)))
        return time.perf_counter() - start, samples


def measure(address: str, messages: list, *, max_tokens: int, busy: int, workload: str, setting: str,
            round_: int) -> Measurement:
    server = process_tree(server_pid(address))
    ours = process_tree(os.getpid())
    ours_before, server_before, machine_before = cpu_seconds(ours), cpu_seconds(server), machine_busy_seconds()
    wall, samples = asyncio.run(send_all(address, messages, max_tokens=max_tokens,
                                         tag=f"b{busy}-{workload}-{round_}"))
    ours = process_tree(os.getpid())   # the same servers; busy processes started before, so all counted
    others = machine_busy_seconds() - machine_before - (cpu_seconds(ours) - ours_before)
    tokens = sum(s.completion_tokens for s in samples)
    return Measurement(busy=busy, workload=workload, setting=setting, round=round_, requests=len(samples),
                       output_tokens=tokens, wall_s=wall, tok_s=tokens / wall,
                       cpu_ms_per_token=(cpu_seconds(server) - server_before) * 1e3 / tokens,
                       ttft_p50_s=percentile([s.ttft_s for s in samples], 50),
                       others_cores=max(0.0, others) / wall, load_avg_1m=os.getloadavg()[0])


# --- report ---------------------------------------------------------------------------------------

def best_rounds(results: list[Measurement]) -> dict[tuple[int, str, str], Measurement]:
    best: dict[tuple[int, str, str], Measurement] = {}
    for m in results:
        key = (m.busy, m.workload, m.setting)
        if key not in best or m.tok_s > best[key].tok_s:
            best[key] = m
    return best


def table(results: list[Measurement], default: str) -> str:
    """One row per (busy, workload, setting): its best round; the first setting's ratio to the best other."""
    best = best_rounds(results)
    rounds: dict[tuple[int, str, str], list[float]] = {}
    for m in results:
        rounds.setdefault((m.busy, m.workload, m.setting), []).append(m.tok_s)
    lines = ["| busy | workload | setting | tok/s (best) | rounds | CPU ms/token | TTFT p50 | vs best other | others (cores) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for (busy, workload, setting), m in best.items():
        others = [b.tok_s for (bb, ww, ss), b in best.items() if bb == busy and ww == workload and ss != default]
        ratio = f"{m.tok_s / max(others):.2f}x" if setting == default and others else ""
        neighbours = [r.others_cores for r in results if r.busy == busy and r.workload == workload and r.setting == setting]
        lines.append(f"| {busy} | {workload} | {setting} | {m.tok_s:.1f} | "
                     f"{' / '.join(f'{t:.1f}' for t in rounds[busy, workload, setting])} | {m.cpu_ms_per_token:.2f} | "
                     f"{m.ttft_p50_s:.2f} s | {ratio} | {statistics.mean(neighbours):.2f} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="seconds-long run: demo model, the first setting, busy 1, 2 requests of 4 tokens")
    p.add_argument("--setting", action="append", default=[], metavar="LABEL=ARGS",
                   help=f"a server to measure (repeatable; the first is the one compared); default {DEFAULT_SETTINGS}")
    p.add_argument("--busy", type=lambda s: [int(x) for x in s.split(",")], default=[0, 1, 2])
    p.add_argument("--workloads", default="text,video")
    p.add_argument("--concurrency", type=int, default=16, help="requests per measurement, all in flight at once")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--text-tokens", type=int, default=32)
    p.add_argument("--video-tokens", type=int, default=16)
    p.add_argument("--num-frames", type=int, default=4)
    p.add_argument("--model", type=Path, default=None, help="default: bench/serving.py's 55M checkpoint (made once)")
    p.add_argument("--large-dir", type=Path, default=Path(tempfile.gettempdir()) / "mmserve-bench-large")
    p.add_argument("--out", type=Path, default=None, help=f"JSON output (default {DEFAULT_OUT}; smoke: a temp file)")
    args = p.parse_args(argv)
    args.setting = [parse_setting(s) for s in (args.setting or DEFAULT_SETTINGS)]
    if args.smoke:   # one server (a start is most of a smoke run's time), one busy process, 2 short requests
        args.busy, args.concurrency, args.rounds, args.text_tokens, args.video_tokens = [1], 2, 1, 4, 4
        args.setting = args.setting[:1]
        args.model = args.model or DEMO_MODEL_DIR
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("HF_ENDPOINT", "http://127.0.0.1:9")   # never reach the network
    args = parse_args(argv)
    model = args.model or make_large_checkpoint(DEMO_MODEL_DIR, args.large_dir)
    messages = workloads(args.workloads.split(","), args.concurrency, args.num_frames)
    tokens = {"text": args.text_tokens, "video": args.video_tokens}
    load_before = os.getloadavg()
    results: list[Measurement] = []
    with tempfile.TemporaryDirectory() as log_dir, contextlib.ExitStack() as servers:
        addresses = {}
        for s in args.setting:
            addresses[s.label] = servers.enter_context(server_process(
                str(model), threads=None, max_num_seqs=args.concurrency, flags=s.flags, env=s.env,
                log_path=Path(log_dir) / f"server-{len(addresses)}.log"))
            for workload, batch in messages.items():   # warm-up: first shapes, allocator growth
                asyncio.run(send_all(addresses[s.label], batch, max_tokens=2, tag=f"warm-{workload}"))
        for busy in args.busy:
            with busy_processes(busy):
                for round_ in range(args.rounds):
                    order = args.setting if round_ % 2 == 0 else args.setting[::-1]
                    for workload, batch in messages.items():
                        for s in order:
                            m = measure(addresses[s.label], batch, max_tokens=tokens[workload], busy=busy,
                                        workload=workload, setting=s.label, round_=round_)
                            logger.info("busy %d %s %s round %d: %.1f tok/s, %.2f CPU ms/token, others %.2f cores",
                                        busy, workload, s.label, round_, m.tok_s, m.cpu_ms_per_token, m.others_cores)
                            results.append(m)
    print(table(results, args.setting[0].label))
    out = args.out or (Path(tempfile.mkdtemp()) / "cpu_contention.json" if args.smoke else DEFAULT_OUT)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({
        "machine": machine(), "model": Path(model).name, "concurrency": args.concurrency,
        "tokens": tokens, "num_frames": args.num_frames, "load_avg_before": load_before,
        "settings": [asdict(s) for s in args.setting], "results": [asdict(m) for m in results],
    }, indent=2) + "\n")
    logger.info("wrote %s", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
