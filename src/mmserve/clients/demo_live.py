"""`mmserve demo-live`: a live session on a synthetic clip whose shape turns back half way.

A demo-task shape (multimodal/synthetic.py) moves one way for 4 frames, then retraces its path for
4 more; the 8 frames are streamed at 8 fps into a running server (`make run`) and the question is
asked twice: once the first 4 frames are in the context, and once the context holds just the last 4
(a 6-frame history: the roll-over at frame 7 keeps frames 5 and 6, so frame 8 completes frames 5-8).
The demo model was trained on 4-frame clips and one prompt, the demo task's "Describe the video."
(asked by default: both answers right on 18 of 20 held-out seeds; `--question "What moves?"` on 9 of
20): its first answer names the first direction, its second the reverse. Each answer is printed next
to the truth.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import sys
import time

import numpy as np
from PIL import Image

from mmserve.api import pb
from mmserve.clients.client import Client
from mmserve.clients.live_cli import LiveWatcher
from mmserve.clients.types import ClientError
from mmserve.multimodal.demo_task import HELDOUT_SEED_BASE, PROMPT
from mmserve.multimodal.synthetic import DIRECTIONS, Motion, plan, render

LEG = 4            # frames per direction: the demo task's clips are 4 frames
HISTORY = 6        # frames the context keeps: the second question sees frames 5-8 only (docstring)
FPS = 8.0
OPPOSITE = {"left": "right", "right": "left", "up": "down", "down": "up"}


def turning_clip(seed: int) -> tuple[list[np.ndarray], Motion, Motion]:
    """2 x LEG frames: `seed`'s shape moving one way, then back from where it got to; both motions."""
    (out,) = plan(seed, num_frames=LEG)
    dx, dy = DIRECTIONS[out.direction]
    turn = (out.start[0] + dx * out.speed * (LEG - 1), out.start[1] + dy * out.speed * (LEG - 1))
    back = dataclasses.replace(out, direction=OPPOSITE[out.direction], start=turn)
    return render([out], num_frames=LEG) + render([back], num_frames=LEG), out, back


def png(frame: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(frame).save(buffer, "PNG")
    return buffer.getvalue()


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("demo-live", help="stream a synthetic clip whose shape turns back half way into a "
                              "live session, ask what moves twice", description=__doc__)
    p.add_argument("--server", default="127.0.0.1:50051", help="HOST:PORT of a running `mmserve serve`")
    p.add_argument("--seed", type=int, default=None, help="clip seed (default: a random held-out one)")
    p.add_argument("--timeout", type=float, default=120.0, help="deadline of the session in seconds (default 120)")
    p.add_argument("--api-key", default=None, help="sent as 'authorization: Bearer KEY' (env MMSERVE_API_KEY)")
    p.add_argument("--question", default=PROMPT, help=f"what to ask (default {PROMPT!r}, the prompt the demo model "
                   "was trained on)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    seed = args.seed if args.seed is not None else HELDOUT_SEED_BASE + int.from_bytes(os.urandom(3), "big")
    frames, out, back = turning_clip(seed)
    sys.stdout.write(f"clip   seed {seed}: {out.words()}, then back; {len(frames)} frames at {FPS:g} fps\n")
    answers = []
    try:
        with Client(args.server, api_key=args.api_key or os.environ.get("MMSERVE_API_KEY")) as client:
            call = client.live(pb.LiveOpen(max_history_frames=HISTORY), timeout=args.timeout)
            watcher = LiveWatcher(call)
            start = time.monotonic()
            for i, frame in enumerate(frames, 1):
                time.sleep(max(0.0, start + (i - 1) / FPS - time.monotonic()))
                call.frame(png(frame), (i - 1) / FPS)
                if i == LEG:   # the first leg is in the context before the turn is sent
                    watcher.wait(lambda p: p.frames_in_context >= LEG)
                    call.ask(args.question, question_id="first", max_tokens=32, temperature=0.0)
            # the rebuilt context holds exactly the second leg
            watcher.wait(lambda p: p.rollovers >= 1 and p.frames_in_context == LEG and p.frames_prefilled == len(frames))
            call.ask(args.question, question_id="second", max_tokens=32, temperature=0.0)
            answers = [watcher.answer(qid) for qid in ("first", "second")]
            call.close()
            watcher.join()
    except ClientError as e:
        sys.stderr.write(f"error: {e}\n")
        return 1
    for answer, frame_no, truth in zip(answers, (LEG, 2 * LEG), (out, back), strict=True):
        said = answer.text.strip() if answer.error is None else f"(error: {answer.error.message})"
        sys.stdout.write(f"frame {frame_no} {args.question} -> {said}\n"
                         f"        truth: {truth.words()}  {'MATCH' if said == truth.words() else 'DIFFERENT'}\n")
    return 0
