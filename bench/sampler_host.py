"""The host's work to queue one step's sampling, per row kind and batch size: what grows with rows.

    python bench/sampler_host.py            # 1/16/64 rows of each kind; JSON to bench/results/sampler_host.json
    python bench/sampler_host.py --smoke    # 16 rows, few steps; JSON to a temp file

The real `Sampler` (penalties, seeds, top-k/top-p, logprobs) on CPU logits [rows, --vocab], stepped
as the engine steps it: each step's tokens are appended to the requests' outputs, so penalties see
new tokens and seeded rows a new output position every step. Per case:
- `ms/step`: wall time of `Sampler.launch` + `result()` (median over the timed steps). On CPU the
  device work runs inline, so this is host plus device time; a small vocabulary (`--vocab`) keeps
  the host's share visible;
- `copies/step`: host-to-device copies of per-row values (calls of `attention.buffers.to_device`
  from the sample package: each is one pinned, non-blocking copy and one launch on CUDA);
- `ops/step`: tensor operations `Sampler.launch` dispatches (ATen ops that are not views, counted with a
  TorchDispatchMode). On CUDA each such op is one kernel launch (a copy is one too), and even in
  a captured graph each costs ~1-2 us of device time, so this is the count that must not grow
  with rows.
Row kinds: seeded (temperature 1.0, every row its own seed), random (temperature 0.8, top-k 50,
top-p 0.9, unseeded), penalised (presence, frequency, repetition), logprobs (top 5), mix (the
rows cycle through greedy, seeded, random, penalised and logprobs, as OpenAI traffic does).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from serving import machine
from torch.utils._python_dispatch import TorchDispatchMode

import mmserve.sample.logprobs as logprobs_module
import mmserve.sample.penalties as penalties_module
import mmserve.sample.row_values as row_values_module
import mmserve.sample.sampler as sampler_module
from mmserve.request import Request
from mmserve.sample.sampler import Sampler
from mmserve.sampling_params import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results" / "sampler_host.json"
KINDS = ("seeded", "random", "penalised", "logprobs", "mix")
_SAMPLE_MODULES = (row_values_module, sampler_module, penalties_module, logprobs_module)


def row_params(kind: str, i: int) -> SamplingParams:
    """Row i's parameters in a batch of `kind` rows (module docstring)."""
    if kind == "mix":
        kind = ("greedy", "seeded", "random", "penalised", "logprobs")[i % 5]
    if kind == "seeded":
        return SamplingParams(temperature=1.0, seed=1000 + i)
    if kind == "random":
        return SamplingParams(temperature=0.8, top_k=50, top_p=0.9)
    if kind == "penalised":
        return SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2)
    if kind == "logprobs":
        return SamplingParams(temperature=1.0, logprobs=True, top_logprobs=5)
    return SamplingParams(temperature=0.0)


class OpCounter(TorchDispatchMode):
    """Counts the ATen ops dispatched that are not views (one kernel each on CUDA)."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view:
            self.ops[func.__name__] += 1
        return func(*args, **(kwargs or {}))


class CopyCounter:
    """Counts calls of `to_device` made by the sample package (one host-to-device copy each)."""

    def __init__(self):
        self.copies = 0
        self._patched = [(m, m.to_device) for m in _SAMPLE_MODULES if hasattr(m, "to_device")]

    def __enter__(self):
        for module, real in self._patched:
            def counted(*args, _real=real, **kwargs):
                self.copies += 1
                return _real(*args, **kwargs)
            module.to_device = counted
        return self

    def __exit__(self, *exc):
        for module, real in self._patched:
            module.to_device = real


def measure(kind: str, rows: int, vocab: int, steps: int) -> dict:
    gen = torch.Generator().manual_seed(rows)
    requests = [Request(f"r{i}", torch.randint(0, vocab, (16,), generator=gen).tolist(), row_params(kind, i))
                for i in range(rows)]
    sampler = Sampler(seed=0)
    logits = torch.randn(rows, vocab, generator=gen) * 3

    def step(counting: bool = False) -> None:
        if counting:   # the launch alone: result() reads a host tensor, which launches nothing on CUDA
            with counter, copies:
                pending = sampler.launch(logits, requests)
        else:
            pending = sampler.launch(logits, requests)
        for r, t in zip(requests, pending.result().token_ids, strict=True):
            r.output_token_ids.append(t)

    counter, copies = OpCounter(), CopyCounter()

    for _ in range(2):   # state built (penalty tables, generators)
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    step(counting=True)
    return dict(kind=kind, rows=rows, vocab=vocab, ms_per_step=round(statistics.median(times) * 1e3, 3),
                copies_per_step=copies.copies, ops_per_step=sum(counter.ops.values()),
                top_ops=dict(counter.ops.most_common(6)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="16 rows, 3 steps; JSON to a temp file")
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    if args.smoke:
        args.rows, args.steps = [16], 3
    load_before = os.getloadavg()
    results = [measure(kind, n, args.vocab, args.steps) for kind in args.kinds for n in args.rows]
    for r in results:
        print(f"rows={r['kind']:<9} n={r['rows']:<3} vocab={r['vocab']} {r['ms_per_step']:8.2f} ms/step "
              f"{r['copies_per_step']:4d} copies/step {r['ops_per_step']:5d} ops/step")
    print(f"load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after, on {os.cpu_count()} CPUs")
    out = args.out or (Path(tempfile.mkdtemp()) / "sampler_host.json" if args.smoke else RESULTS)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine(), "load_avg_before": load_before, "load_avg": os.getloadavg(),
                               "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
