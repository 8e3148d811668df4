"""Plots for docs/benchmarks.md from the JSON in bench/results/ (matplotlib, PNG into docs/img/).

    python bench/plot.py [--results bench/results] [--out docs/img]

- serving_throughput.png: output tokens/s vs concurrency, mmserve against transformers
- serving_ttft.png: time to first token (p50, p99) vs concurrency
- metadata_fill.png: query-range table fill time vs frames per request, against the range scan

A plot whose JSON is missing is skipped with a warning, so the plots of one benchmark can be
remade without running the others.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
logger = logging.getLogger("bench.plot")


def _load(results: Path, name: str) -> dict | None:
    path = results / name
    if not path.exists():
        logger.warning("no %s: skipping its plots", path)
        return None
    return json.loads(path.read_text())


def _save(fig, out: Path) -> Path:
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    logger.info("wrote %s", out)
    return out


def plot_serving(report: dict, out_dir: Path) -> list[Path]:
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    fig_tp, ax_tp = plt.subplots(figsize=(6.4, 4.2))
    fig_tt, ax_tt = plt.subplots(figsize=(6.4, 4.2))
    baselines_drawn = set()   # transformers ran once per model; every server of that model shares its numbers
    for color, model in zip(colors, report["models"], strict=False):
        levels = model["levels"]
        n = [lv["concurrency"] for lv in levels]
        server = model.get("server", "this tree")
        name = model["name"] if server == "this tree" else f"{model['name']}, {server}"
        ax_tp.plot(n, [lv["output_tokens_per_s"] for lv in levels], "o-", color=color, label=f"mmserve ({name})")
        ax_tt.plot(n, [lv["ttft_p50_s"] for lv in levels], "o-", color=color, label=f"mmserve p50 ({name})")
        ax_tt.plot(n, [lv["ttft_p99_s"] for lv in levels], "^-", color=color, alpha=0.5,
                   label=f"mmserve p99 ({name})")
        if model["name"] in baselines_drawn:
            continue
        baselines_drawn.add(model["name"])
        ax_tp.plot(n, [lv["hf_batch_output_tokens_per_s"] for lv in levels], "s--", color=color,
                   label=f"transformers padded batch ({model['name']})")
        ax_tp.axhline(model["hf_sequential"]["output_tokens_per_s"], color=color, linestyle=":",
                      label=f"transformers one at a time ({model['name']})")
        ax_tt.plot(n, [lv["hf_batch_ttft_s"] for lv in levels], "s--", color=color,
                   label=f"transformers padded batch ({model['name']})")
    levels = sorted({lv["concurrency"] for model in report["models"] for lv in model["levels"]})
    for ax, ylabel, title in ((ax_tp, "output tokens/s", "Throughput vs concurrency"),
                              (ax_tt, "time to first token (s)", "TTFT vs concurrency")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(n) for n in levels])
        ax.set_yscale("log")
        ax.set_xlabel("concurrent requests (N)")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    return [_save(fig_tp, out_dir / "serving_throughput.png"), _save(fig_tt, out_dir / "serving_ttft.png")]


def plot_metadata(report: dict, out_dir: Path) -> list[Path]:
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    rows = report["rows"]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for color, requests in zip(colors, sorted({r["requests"] for r in rows}), strict=False):
        mine = sorted((r for r in rows if r["requests"] == requests), key=lambda r: r["frames"])
        frames = [r["frames"] for r in mine]
        ax.plot(frames, [r["fill_us"] for r in mine], "o-", color=color, label=f"table fill, {requests} req")
        ax.plot(frames, [r["scan_us"] for r in mine], "x--", color=color, alpha=0.6,
                label=f"Python range scan, {requests} req")
    frames = sorted({r["frames"] for r in rows})
    ax.set_xscale("log", base=2)
    ax.set_xticks(frames, [str(f) for f in frames])
    ax.set_yscale("log")
    ax.set_xlabel("video frames per request")
    ax.set_ylabel("time per step (µs)")
    ax.set_title(f"Query-range table fill ({report['budget_tokens']}-token step)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=6, ncol=2)
    return [_save(fig, out_dir / "metadata_fill.png")]


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    p.add_argument("--out", type=Path, default=ROOT / "docs" / "img")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    if (serving := _load(args.results, "serving.json")) is not None:
        written += plot_serving(serving, args.out)
    if (metadata := _load(args.results, "metadata.json")) is not None:
        written += plot_metadata(metadata, args.out)
    sys.stdout.write("".join(f"{path}\n" for path in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
