"""`mmserve demo`: make a synthetic clip, ask the server to describe it, print the streamed caption
next to the truth. With the embedded demo model the two should match."""

from __future__ import annotations

import argparse
import os
import sys

from mmserve.clients.client import Client
from mmserve.clients.types import ClientError
from mmserve.multimodal.demo_task import NUM_FRAMES, PROMPT, clip_for


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("demo", help="send a generated video to a server and print its caption next to the truth",
                              description=__doc__)
    p.add_argument("--server", default="127.0.0.1:50051", help="HOST:PORT of a running `mmserve serve`")
    p.add_argument("--seed", type=int, default=None, help="clip seed (default: a random held-out one)")
    p.add_argument("--format", choices=("mp4", "webm", "mkv", "avi"), default="mp4")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--api-key", default=None, help="sent as 'authorization: Bearer KEY' (env MMSERVE_API_KEY)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    seed = args.seed if args.seed is not None else 1_000_000 + int.from_bytes(os.urandom(3), "big")
    data, truth = clip_for(seed, container=args.format)
    out = sys.stdout
    out.write(f"clip   seed {seed}, {len(data)} bytes {args.format}\n")
    out.write(f"prompt {PROMPT}\nmodel  ")
    out.flush()
    api_key = args.api_key or os.environ.get("MMSERVE_API_KEY")
    try:
        with Client(args.server, api_key=api_key, timeout=args.timeout) as client:
            stream = client.stream(prompt=PROMPT, video=data, num_frames=NUM_FRAMES, max_tokens=32, temperature=0.0)
            for delta in stream:
                out.write(delta.text)
                out.flush()
            text = stream.result.text
    except ClientError as e:
        sys.stderr.write(f"\nerror: {e}\n")
        return 1
    out.write(f"\ntruth  {truth}\n{'MATCH' if text.strip() == truth else 'DIFFERENT'}\n")
    return 0
