"""Audio: the audio tower's encode throughput, and the TTFT of a 30 s clip with and without its soundtrack.

    python bench/audio.py              # JSON to bench/results/audio.json
    python bench/audio.py --repeats 7  # more repeats of each measurement
    python bench/audio.py --smoke      # 1 repeat, a 10 s clip; JSON to a temp file

Throughput: transformers' Gemma 4 audio tower (our AudioEncoder) encoding 30 s segments of log-mel
features, in seconds of audio per second of wall time, for two towers with random weights: the
demo-sized E-model's (below; batches of 1 and 4 segments) and one of E2B's shape (transformers'
Gemma4AudioConfig defaults: 12 blocks of width 1024, projected to E2B's 1536; one segment a call),
fp32 on this machine.

TTFT: a real server (gRPC on 127.0.0.1, the engine in its own process) serving the demo-sized
E-model: the demo model's text and vision sizes (width 64, 6 layers, per-layer embeddings, the last
3 sharing KV) with a tower of width 64 (2 blocks) as its ears. The clip is generated here: 30 s of
64x64 video at 2 fps (MPEG-4 Part 2) with 30 s of PCM tones, in Matroska. Each request samples 8
frames and asks one question; `use_audio_in_video` adds the clip's 750 audio tokens after the
frames. Every request sends a clip of its own (frames and tones from a new seed), so nothing comes
from the prefix or encoder cache: the TTFT of a clip seen for the first time. TTFT is the server's
own Final.timings (arrival to first token: decode, features, towers, prefill), after one warm-up
request each; the repeats alternate (frames, frames + soundtrack, frames,
...) so that load from other processes falls on both alike, and the table gives their median and
range. The machine's load average before and after is printed and kept with the results: on a
shared machine the numbers are upper bounds on time.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "tests" / "model"))

from audio_clips import av_clip, tones  # noqa: E402
from gemma4_fixtures import e_model_config, make_checkpoint  # noqa: E402

from mmserve.model import load_model  # noqa: E402
from mmserve.multimodal.synthetic import plan, render  # noqa: E402

logger = logging.getLogger("bench.audio")
RESULTS = Path(__file__).resolve().parent / "results" / "audio.json"
SEGMENT_S = 30.0


def demo_e_config() -> dict:
    """The demo model's sizes as an E-model with an audio tower."""
    cfg = e_model_config(hidden_size=64, intermediate_size=128, num_attention_heads=4, head_dim=16,
                         global_head_dim=32, max_position_embeddings=4096)
    cfg["audio_config"].update(hidden_size=64, num_attention_heads=4, subsampling_conv_channels=[128, 8],
                               output_proj_dims=64, attention_chunk_size=12, attention_context_left=13)
    return cfg


def e2b_audio_tower():
    """transformers' Gemma4AudioConfig defaults (E2B's tower), projected to E2B's width 1536."""
    from transformers import Gemma4Config

    from mmserve.model.audio import AudioEncoder

    config = Gemma4Config(text_config=dict(hidden_size=1536), audio_config=dict(), vision_config=None)
    tower = AudioEncoder(config).eval()
    with torch.no_grad():
        for param in tower.parameters():
            param.normal_(0.0, 0.02)
    return tower


def throughput(encode, repeats: int, batches: tuple[int, ...] = (1, 4)) -> list[dict]:
    """`encode(list of segments' features) -> embeddings`, timed on batches of 30 s segments."""
    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor

    samples = (tones(0, SEGMENT_S).astype(np.float32) / 32768)
    batch = Gemma4AudioFeatureExtractor()([samples], return_tensors="pt")
    segment = batch["input_features"][0][batch["input_features_mask"][0]]
    rows = []
    for n in batches:
        encode([segment] * n)   # warm-up
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            encode([segment] * n)
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)
        rows.append({"segments": n, "seconds": seconds, "audio_s_per_s": n * SEGMENT_S / seconds})
    return rows


def ttft(model_dir: Path, clip_s: float, repeats: int) -> dict:
    from loopback_server import LoopbackServer, engine_config

    from mmserve.clients import Client
    from mmserve.clients.messages import message, text_part, video_part
    from mmserve.config import ServerConfig

    def request(seed: int) -> list:
        """A clip never seen before (its own frames and tones): no prefix- or encoder-cache hit."""
        frames = render(plan(seed, size=64, num_frames=int(clip_s * 2)), size=64, num_frames=int(clip_s * 2))
        clip = av_clip(frames, 2, tones(seed, clip_s))
        return [message("user", video_part(clip, num_frames=8), text_part("What happens?"))]

    server = LoopbackServer(engine_config(model_dir, engine_threads=0, max_model_len=4096),
                            ServerConfig(host="127.0.0.1", port=0, worker_threads=2)).start()
    kinds = {"frames": False, "frames+soundtrack": True}
    results: dict[str, list] = {label: [] for label in kinds}
    seeds = iter(range(1, 10**6))
    try:
        with Client(server.address, timeout=300) as client:
            for with_audio in kinds.values():   # warm-up
                client.generate(request(next(seeds)), max_tokens=1, use_audio_in_video=with_audio)
            for _ in range(repeats):   # alternating, so load drift falls on both
                for label, with_audio in kinds.items():
                    results[label].append(client.generate(request(next(seeds)), max_tokens=1,
                                                          use_audio_in_video=with_audio))
    finally:
        server.stop()
    out = {}
    for label, runs in results.items():
        ttfts = [r.timings.time_to_first_token_s for r in runs]
        out[label] = {"ttft_s": statistics.median(ttfts), "ttft_min_s": min(ttfts), "ttft_max_s": max(ttfts),
                      "ttfts_s": ttfts, "preprocess_s": statistics.median(r.timings.preprocess_s for r in runs),
                      "prompt_tokens": runs[0].usage.prompt_tokens,
                      "cached_tokens_max": max(r.usage.cached_tokens for r in runs)}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="1 repeat, a 10 s clip")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each measurement (default 5)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.manual_seed(0)
    repeats = 1 if args.smoke else args.repeats
    clip_s = 10.0 if args.smoke else 30.0
    load_before, started = os.getloadavg(), time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        demo = Path(tmp) / "demo_e"
        make_checkpoint(demo, config=demo_e_config(), seed=0)
        result = {"throughput": {"demo-sized": throughput(load_model(demo).encode_audio, repeats),
                                 "E2B-shaped": throughput(e2b_audio_tower(), repeats, batches=(1,))},
                  "ttft": ttft(demo, clip_s, repeats), "clip_s": clip_s, "repeats": repeats,
                  "threads": torch.get_num_threads(), "cpus": os.cpu_count()}
    result.update(load_average_before=load_before, load_average_after=os.getloadavg(),
                  wall_s=time.perf_counter() - started)
    print(f"{'tower':<12} {'segments':>8} {'s/call':>8} {'audio s/s':>10}")
    for tower, rows in result["throughput"].items():
        for row in rows:
            print(f"{tower:<12} {row['segments']:>8} {row['seconds']:>8.3f} {row['audio_s_per_s']:>10.1f}")
    print(f"\n{clip_s:g} s clip, 8 frames, {repeats} alternating runs   {'TTFT s (min-max)':>22} {'preprocess s':>13} "
          f"{'prompt tokens':>14} {'cached':>7}")
    for label, row in result["ttft"].items():
        spread = f"{row['ttft_s']:.3f} ({row['ttft_min_s']:.3f}-{row['ttft_max_s']:.3f})"
        print(f"{label:<41} {spread:>22} {row['preprocess_s']:>13.3f} {row['prompt_tokens']:>14} "
              f"{row['cached_tokens_max']:>7}")
    print(f"\nload average (1, 5, 15 min) before {result['load_average_before']}, after "
          f"{result['load_average_after']}, on {result['cpus']} CPUs; {result['wall_s']:.0f} s of wall time")
    path = Path(tempfile.mkstemp(suffix=".json")[1]) if args.smoke else RESULTS
    path.write_text(json.dumps(result, indent=2))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
