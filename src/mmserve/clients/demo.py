"""`mmserve demo`: make a synthetic clip, ask the server to describe it, print the streamed caption
next to the truth. With the embedded demo model the two should match.

`--json` asks for the answer as JSON constrained to the caption schema (shape, color, direction
enums) instead: the demo model was never trained on JSON, yet the constrained answer always parses
and validates; whether its fields match the clip is shown too."""

from __future__ import annotations

import argparse
import json
import os
import sys

import grpc

from mmserve.clients.client import Client
from mmserve.clients.types import ClientError
from mmserve.multimodal.demo_task import CAPTION_SCHEMA, NUM_FRAMES, PROMPT, clip_for


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("demo", help="send a generated video to a running server (`make run`) and print its "
                              "caption next to the truth",
                              description=__doc__)
    p.add_argument("--server", default="127.0.0.1:50051", help="HOST:PORT of a running `mmserve serve`")
    p.add_argument("--seed", type=int, default=None, help="clip seed (default: a random held-out one)")
    p.add_argument("--format", choices=("mp4", "webm", "mkv", "avi"), default="mp4",
                   help="container of the generated clip (default mp4)")
    p.add_argument("--timeout", type=float, default=60.0, help="deadline of the request in seconds (default 60)")
    p.add_argument("--api-key", default=None, help="sent as 'authorization: Bearer KEY' (env MMSERVE_API_KEY)")
    p.add_argument("--json", action="store_true", help="answer as JSON constrained to the caption schema (always "
                   "valid; the demo model never learnt JSON, so its fields are often wrong)")
    p.set_defaults(func=run)


def truth_fields(caption: str) -> dict[str, str]:
    """The first object of a caption ("a red circle moves left and ...") as the schema's fields."""
    _, color, shape, _, direction = caption.split(" and ")[0].split()
    return {"shape": shape, "color": color, "direction": direction}


def _check_json(text: str, truth: str) -> str:
    try:
        answer = json.loads(text)
    except ValueError:
        return "INVALID JSON"
    want = truth_fields(truth)
    valid = isinstance(answer, dict) and set(answer) == set(want) and all(
        answer[k] in CAPTION_SCHEMA["properties"][k]["enum"] for k in want)
    right = [k for k in want if answer.get(k) == want[k]] if isinstance(answer, dict) else []
    return (f"{'valid' if valid else 'INVALID'} against the schema; truth as JSON {json.dumps(want)}; "
            f"{len(right)}/3 fields right")


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
            constraint = dict(json_schema=CAPTION_SCHEMA, max_tokens=96) if args.json else dict(max_tokens=32)
            stream = client.stream(prompt=PROMPT, video=data, num_frames=NUM_FRAMES, temperature=0.0, **constraint)
            chunks = 0
            for delta in stream:
                out.write(delta.text)
                out.flush()
                chunks += bool(delta.token_ids)
            text, tokens = stream.result.text, len(stream.result.token_ids)
            drafts = client.model_info().num_speculative_tokens
    except ClientError as e:
        sys.stderr.write(f"\nerror: {e}\n")
        if e.code == grpc.StatusCode.UNAVAILABLE:
            sys.stderr.write(f"is a server running at {args.server}? Start one with `make run` (or `mmserve serve`) "
                             "in another terminal, wait for 'ready: serving', then run this again\n")
        return 1
    if args.json:
        out.write(f"\ntruth  {truth}\n{_check_json(text, truth)}\n")
    else:
        out.write(f"\ntruth  {truth}\n{'MATCH' if text.strip() == truth else 'DIFFERENT'}\n")
    # what speculation looks like from the client: several tokens per streamed chunk
    note = f" (speculative decoding: up to {drafts + 1} tokens per step)" if drafts else ""
    out.write(f"{tokens} tokens in {chunks} streamed chunks{note}\n")
    return 0
