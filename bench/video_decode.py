"""Video decode time against video length: seek-based sampling against the full scan.

    python bench/video_decode.py            # 1, 10 and 60 min; JSON to bench/results/video_decode.json
    python bench/video_decode.py --smoke    # 1 and 3 min, seconds; JSON to a temp file

Each clip is generated here with PyAV: 1 fps at 64x64 (random 8x8 blocks drifting from frame to
frame), H.264 in mp4 with a keyframe every 10 s (in frames, what x264's default of 250 is at
25 fps). The server's decoder (`decode_video`, one thread) samples 16 frames from it by seeking to
the keyframe before each one ("seek") and by decoding from the start ("full", what it does where
a container has no index); both must return the same frames. The longest clip is also remuxed to
MPEG-TS, which has no seek index, to show what the fallback costs. Times are the median of the
repeats, file opening included. Target: the 60-minute seek decode at most 3x the 1-minute one.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from mmserve.multimodal.limits import MediaLimits
from mmserve.multimodal.synthetic import remux, write_video
from mmserve.multimodal.video import decode_video

logger = logging.getLogger("bench.video_decode")
RESULTS = Path(__file__).resolve().parent / "results" / "video_decode.json"
FPS, SIZE, KEYFRAME_S, SAMPLED, TARGET_RATIO = 1, 64, 10, 16, 3.0
LIMITS = MediaLimits(max_video_duration_s=4 * 3600.0, max_frames_per_video=SAMPLED)


def drifting_blocks(n: int, seed: int = 0):
    """Frames that change a little every second, as a static camera's do."""
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (SIZE // 8, SIZE // 8, 3))
    for _ in range(n):
        blocks = (blocks + rng.integers(-12, 13, blocks.shape)) % 256
        yield np.kron(blocks, np.ones((8, 8, 1))).astype(np.uint8)


def timed(path: Path, *, seek: bool, repeats: int):
    """Median seconds of `repeats` decodes, and the last decode's result."""
    times, video = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        video = decode_video(path, num_frames=SAMPLED, limits=LIMITS, seek=seek)
        times.append(time.perf_counter() - start)
    return statistics.median(times), video


def measure(path: Path, minutes: float, container: str, repeats: int) -> dict:
    seek_s, sought = timed(path, seek=True, repeats=repeats)
    full_s, scanned = timed(path, seek=False, repeats=repeats)
    same = len(sought.frames) == len(scanned.frames) and all(
        np.array_equal(a, b) for a, b in zip(sought.frames, scanned.frames, strict=True))
    return dict(minutes=minutes, container=container, size_mb=round(path.stat().st_size / 1e6, 2),
                frames=int(minutes * 60 * FPS), method=sought.method, seek_s=round(seek_s, 4),
                seek_frames_decoded=sought.frames_decoded, full_s=round(full_s, 4),
                full_frames_decoded=scanned.frames_decoded, same_frames=same)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="1 and 3 minutes, 2 repeats; JSON to a temp file")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    durations = [1, 3] if args.smoke else [1, 10, 60]
    repeats = 2 if args.smoke else 5
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for minutes in durations:
            path = Path(tmp) / f"{minutes}min.mp4"
            started = time.perf_counter()
            write_video(path, drifting_blocks(minutes * 60 * FPS), fps=FPS, keyframe_interval=KEYFRAME_S * FPS,
                        codec_options={"preset": "ultrafast"})
            logger.info("made %s in %.1fs", path.name, time.perf_counter() - started)
            rows.append(measure(path, minutes, "mp4", repeats))
        ts = Path(tmp) / f"{durations[-1]}min.ts"
        remux(str(path), str(ts), "mpegts")
        rows.append(measure(ts, durations[-1], "mpegts", repeats))
    base = rows[0]["seek_s"]
    print(f"{'minutes':>7} {'container':>9} {'MB':>6} {'frames':>6} {'method':>6} {'seek s':>8} {'decoded':>7} "
          f"{'full s':>8} {'decoded':>7} {'seek / 1 min':>12} {'full / seek':>11}")
    for row in rows:
        row["seek_vs_first"] = round(row["seek_s"] / base, 2)
        row["full_vs_seek"] = round(row["full_s"] / row["seek_s"], 2)
        print(f"{row['minutes']:>7} {row['container']:>9} {row['size_mb']:>6.2f} {row['frames']:>6} "
              f"{row['method']:>6} {row['seek_s']:>8.4f} {row['seek_frames_decoded']:>7} {row['full_s']:>8.4f} "
              f"{row['full_frames_decoded']:>7} {row['seek_vs_first']:>11.2f}x {row['full_vs_seek']:>10.2f}x")
    longest = [r for r in rows if r["container"] == "mp4"][-1]
    met = longest["seek_vs_first"] <= TARGET_RATIO
    print(f"target: {longest['minutes']} min seek decode <= {TARGET_RATIO:g}x the {durations[0]} min one: "
          f"{longest['seek_vs_first']:.2f}x, {'met' if met else 'NOT met'}")
    out = args.out or (Path(tempfile.mkdtemp()) / "video_decode.json" if args.smoke else RESULTS)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"fps": FPS, "size": SIZE, "keyframe_interval_s": KEYFRAME_S, "sampled_frames": SAMPLED,
                               "repeats": repeats, "target_ratio": TARGET_RATIO, "target_met": met, "rows": rows},
                              indent=2))
    logger.info("wrote %s", out)
    return 0 if all(r["same_frames"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
