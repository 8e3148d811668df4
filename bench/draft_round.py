"""One drafting round's host planning at long contexts: the round's message and the reader's tables.

What a round costs the host before its draft steps, at 16 requests of 1k / 32k / 128k tokens (block
size 16, so 64 / 2048 / 8192 table entries each): the async round's message (`DeviceDraftRound`)
pickled on rank 0 and unpickled on a worker (tensor parallelism sends it to every rank), and
`TargetKVReader.prepare`, which fills the round's block tables and builds its metadata per layer
type the assistant reads (every rank, TP=1 too). The demo checkpoint (config copied with a 128k
context) and its assistant, on the CPU; the backend is chosen by --backend (reference: the least
builder work, so the tables' share shows).

It runs against either tree: before 2026-12-05 (main at 10f3cb3) a round carried each request's
block table as Python lists (copied row by row into the reader's tables); since then it carries
request ids, and the reader gathers the runner's tables (`BlockTables`) by row. Run it once per tree
with --label, BEFORE being a checkout of the older tree:

    PYTHONPATH=BEFORE/src python bench/draft_round.py --label before
    PYTHONPATH=src python bench/draft_round.py --label after

Each run adds its rows (by label and backend) to the JSON (default bench/results/draft_round.json)
and prints a table. Timings are medians of --repeats rounds, one thread.
"""

from __future__ import annotations

import argparse
import json
import pickle
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from serving import machine

from mmserve.attention import get_backend
from mmserve.config import DEMO_ASSISTANT_DIR, DEMO_MODEL_DIR
from mmserve.model import load_model
from mmserve.spec_decode.speculator import DeviceDraftRound, Speculator

RESULTS = Path(__file__).resolve().parent / "results" / "draft_round.json"
BLOCK_SIZE = 16
MAX_MODEL_LEN = 131072
CONTEXTS = (1024, 32768, MAX_MODEL_LEN - BLOCK_SIZE)


def long_context_model(tmp: Path, backend: str):
    """The demo checkpoint with a 128k context (its weights linked, its config rewritten)."""
    for f in Path(DEMO_MODEL_DIR).iterdir():
        (tmp / f.name).symlink_to(f) if f.suffix == ".safetensors" else shutil.copy(f, tmp / f.name)
    config = json.loads((tmp / "config.json").read_text())
    config.get("text_config", config)["max_position_embeddings"] = MAX_MODEL_LEN
    (tmp / "config.json").write_text(json.dumps(config))
    return load_model(tmp, attention_backend=backend)


def kv_caches(model, num_blocks: int) -> list[torch.Tensor]:
    """One cache per layer type, shared by its layers (planning reads only their shapes)."""
    by_type = {t: torch.zeros(get_backend(model.attention_backends[t]).kv_cache_shape(
        num_blocks, BLOCK_SIZE, model.spec.attention_specs[t]), dtype=model.dtype) for t in model.spec.attention_specs}
    return [by_type[layer.layer_type] for layer in model.spec.layers]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", required=True, help="this tree's name in the results (before / after)")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--backend", default="reference")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    R, width = args.requests, MAX_MODEL_LEN // BLOCK_SIZE
    with tempfile.TemporaryDirectory() as tmp:
        model = long_context_model(Path(tmp), args.backend)
    speculator = Speculator.load(str(DEMO_ASSISTANT_DIR), model, 3, max_num_seqs=R)
    reader, caches = speculator.attention, kv_caches(model, width + 1)
    layer_types = [t for t in reader.stores if t in speculator.assistant.spec.attention]   # those a round reads
    by_ids = "request_ids" in DeviceDraftRound.__dataclass_fields__   # this branch; else main's lists
    gen = np.random.default_rng(0)
    rows = []
    for context in CONTEXTS:
        n = context // BLOCK_SIZE
        held = {f"req-{r}": gen.integers(1, width + 1, n).tolist() for r in range(R)}   # the KV manager's lists
        ids, num_keys = list(held), [context] * R
        if by_ids:
            from mmserve.core.sched.output import BlockUpdate, ScheduledRequest
            from mmserve.request import Request
            from mmserve.sampling_params import SamplingParams
            from mmserve.worker.block_table import BlockTables
            tables = BlockTables(layer_types, width)
            tables.apply([ScheduledRequest(Request(rid, [0], SamplingParams()), 1, 0, False,
                                           block_updates={t: BlockUpdate(0, blocks, 0) for t in layer_types})
                          for rid, blocks in held.items()])
        times: dict[str, list[float]] = {"message": [], "pickle": [], "unpickle": [], "prepare": []}
        size = 0
        for _ in range(args.repeats + 2):
            t0 = time.perf_counter()
            if by_ids:
                msg = DeviceDraftRound(R, list(range(R)), num_keys, ids, BLOCK_SIZE)
            else:
                msg = DeviceDraftRound(R, list(range(R)), num_keys,
                                       {t: [held[rid] for rid in ids] for t in layer_types}, BLOCK_SIZE)
            t1 = time.perf_counter()
            data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
            t2 = time.perf_counter()
            msg = pickle.loads(data)
            t3 = time.perf_counter()
            with torch.inference_mode():
                if by_ids:
                    reader.prepare(msg.num_keys, tables, tables.rows_of(msg.request_ids), BLOCK_SIZE, caches)
                else:
                    reader.prepare(msg.num_keys, msg.block_tables, BLOCK_SIZE, caches)
            t4 = time.perf_counter()
            size = len(data)
            for name, dt in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                times[name].append(dt)
        median = {name: round(statistics.median(v[2:]) * 1e3, 3) for name, v in times.items()}
        rows.append(dict(label=args.label, backend=args.backend, context=context, requests=R, message_bytes=size, **{f"{k}_ms": v for k, v in median.items()},
                         total_ms=round(sum(median.values()), 3)))
    print(f"{'label':<8} {'context':>8} {'reqs':>4} {'msg bytes':>10} {'build ms':>9} {'pickle ms':>10} "
          f"{'unpickle ms':>12} {'prepare ms':>11} {'total ms':>9}")
    for r in rows:
        print(f"{r['label']:<8} {r['context']:>8} {r['requests']:>4} {r['message_bytes']:>10} {r['message_ms']:>9.3f} "
              f"{r['pickle_ms']:>10.3f} {r['unpickle_ms']:>12.3f} {r['prepare_ms']:>11.3f} {r['total_ms']:>9.3f}")
    old = json.loads(args.out.read_text()) if args.out.exists() else {}
    runs = [r for r in old.get("rows", []) if (r["label"], r["backend"]) != (args.label, args.backend)] + rows
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(machine=machine(), block_size=BLOCK_SIZE, rows=runs), indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
