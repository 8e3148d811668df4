"""The prefill cap beside decodes (`--max-step-slowdown`, core/sched/step_time.py) on the real
scheduler, its steps priced by the perf model: a model, not a measurement.

For each Gemma 4 size (the family's config.json files), `--decodes` requests decode while one video
of `--frames` frames (70 soft tokens each, a text token before each) prefills, under CUDA's 2048-token
budget and encode-ahead (the server's defaults on CUDA), at an H200's and an H100's datasheet peaks
(metrics/peaks.py): the steps the video's prompt takes, its tokens per step, and the worst step's
roofline (with the frames it runs through the vision tower: its chunk's own less those encoded
ahead before it, and those it encodes ahead) over its decode rows' alone (what the cap
bounds: the decoding requests' inter-token latency while the video prefills, for an engine that runs
at its floor), with the cap off and at each `--slowdowns`; and the scheduler's host time per step.
The GPU's real ratio is bench/gpu_check.py's video_prefill section (a lease).

    python bench/prefill_cap.py            # table; JSON to bench/results/prefill_cap.json
    python bench/prefill_cap.py --smoke    # 12B and one slowdown; JSON to a temp file
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from mmserve.core.kv_cache.manager import KVCacheManager  # noqa: E402
from mmserve.core.kv_cache.planner import plan_pools  # noqa: E402
from mmserve.core.sched.scheduler import Scheduler  # noqa: E402
from mmserve.core.sched.step_time import StepTimeModel  # noqa: E402
from mmserve.metrics.peaks import lookup  # noqa: E402
from mmserve.metrics.perf_model import PerfModel, RequestWork, StepContext, VisionWork  # noqa: E402
from mmserve.model.spec import load_spec_without_transformers  # noqa: E402
from mmserve.request import Request  # noqa: E402
from mmserve.sampling_params import SamplingParams  # noqa: E402

FAMILY = ROOT / "tests" / "fixtures" / "gemma4_family"
DEVICES = {"H200": "NVIDIA H200", "H100": "NVIDIA H100 80GB HBM3"}
FRAME_TOKENS, BUDGET, BLOCK = 70, 2048, 16


def scheduler(spec, model: StepTimeModel | None, decodes: int) -> Scheduler:
    pools = plan_pools(list(spec.layer_types), spec.attention_specs, block_size=BLOCK, dtype_bytes=2,
                       num_kv_blocks=(decodes + 2) * 600).pools
    kv = KVCacheManager(pools, BLOCK, max_model_len=8192)
    return Scheduler(kv, max_num_batched_tokens=BUDGET, max_num_seqs=decodes + 1, max_model_len=8192, step_time=model,
                     encode_ahead=True)   # as the server runs (config.py)


def run(spec, perf: PerfModel, peaks, slowdown: float, decodes: int, frames: int) -> dict:
    model = StepTimeModel(perf, flops=peaks.flops, bandwidth=peaks.bandwidth, slowdown=slowdown) if slowdown else None
    sched = scheduler(spec, model, decodes)
    for i in range(decodes):
        sched.enqueue(Request(f"d{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + 64)), SamplingParams(max_tokens=4000)))
    ranges = [(1 + f * (FRAME_TOKENS + 1), (f + 1) * (FRAME_TOKENS + 1) - 1) for f in range(frames)]
    video = Request("video", list(range(50_000, 50_000 + frames * (FRAME_TOKENS + 1) + 16)),
                    SamplingParams(max_tokens=1), mm_ranges=ranges)

    def step() -> tuple[list, set, float]:
        begin = time.perf_counter()
        out = sched.schedule()
        host = time.perf_counter() - begin
        sched.update(out)
        for s in out.scheduled:
            if s.seq_len == s.request.num_tokens:
                s.request.output_token_ids.append(7)
        return out.scheduled, {(r.request_id, f) for r, frames in out.encode_ahead for f in frames}, host

    while sched.waiting or any(r.is_prefill for r in sched.running):
        step()
    sched.enqueue(video)
    chunks, ratios, hosts = [], [], []

    def roofline(rows, images=()):
        out = perf.step(StepContext(tuple(rows), images=tuple(images)))
        return max(out.total_bytes / peaks.bandwidth, out.total_flops / peaks.flops)

    pool = spec.vision.pool_kernel ** 2

    encoded_ahead = set()
    while video.is_prefill:
        scheduled, ahead, host = step()
        decode_rows = [RequestWork(1, s.seq_len, False) for s in scheduled if not s.is_prefill]
        prompt = [s for s in scheduled if s.is_prefill]
        chunks.append(sum(s.num_tokens for s in prompt))
        rows = decode_rows + [RequestWork(s.num_tokens, s.seq_len, True, samples=False) for s in prompt]
        # the frames the step runs through the tower: its chunk's own less those encoded ahead before, and
        # those it names to encode ahead beside it
        run = {(s.request.request_id, f) for s in prompt for f in s.frames} - encoded_ahead | ahead
        encoded_ahead = ahead
        ratios.append(roofline(rows, [VisionWork(FRAME_TOKENS * pool, FRAME_TOKENS)] * len(run)) / roofline(decode_rows))
        hosts.append(host)
    return {"steps": len(chunks), "median_tokens": statistics.median(chunks), "worst_ratio": max(ratios),
            "host_ms": 1e3 * statistics.median(hosts)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--decodes", type=int, nargs="+", default=[16, 64])
    p.add_argument("--frames", type=int, default=32)
    p.add_argument("--slowdowns", type=float, nargs="+", default=[1.4, 1.5, 2.0])
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    models = ["12b_unified"] if args.smoke else ["12b_unified", "e4b", "26b_a4b", "31b"]
    slowdowns = [0.0] + (args.slowdowns[:1] if args.smoke else args.slowdowns)
    devices = {"H200": DEVICES["H200"]} if args.smoke else DEVICES
    rows = []
    print(f"{'model':12} {'device':6} {'decodes':>7} {'slowdown':>8} {'steps':>5} {'tok/step':>8} "
          f"{'worst x':>7} {'host ms':>7}")
    for name in models:
        spec = load_spec_without_transformers(FAMILY / f"{name}.json")
        perf = PerfModel(spec)
        for device, sku in devices.items():
            peaks = lookup(sku, "bfloat16")
            for decodes in ([16] if args.smoke else args.decodes):
                for slowdown in slowdowns:
                    r = run(spec, perf, peaks, slowdown, decodes, args.frames)
                    rows.append({"model": name, "device": device, "decodes": decodes, "slowdown": slowdown, **r})
                    print(f"{name:12} {device:6} {decodes:>7} {slowdown or 'off':>8} {r['steps']:>5} "
                          f"{r['median_tokens']:>8.0f} {r['worst_ratio']:>6.2f}x {r['host_ms']:>7.3f}")
    out = args.out or (Path(tempfile.mkdtemp()) / "prefill_cap.json" if args.smoke
                       else ROOT / "bench" / "results" / "prefill_cap.json")
    out.write_text(json.dumps({"frames": args.frames, "frame_tokens": FRAME_TOKENS, "budget": BUDGET,
                               "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
