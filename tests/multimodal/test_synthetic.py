"""Synthetic clips: deterministic by seed, and the caption is true of the decoded pixels."""

from __future__ import annotations

import numpy as np
import pytest

from mmserve import cli
from mmserve.multimodal.limits import MediaLimits
from mmserve.multimodal.synthetic import COLOURS, DIRECTIONS, make_clip, plan
from mmserve.multimodal.video import decode_video


def test_same_seed_same_bytes() -> None:
    a, b, c = make_clip(11), make_clip(11), make_clip(12)
    assert a.data == b.data and a.caption == b.caption
    assert a.data != c.data


def test_captions_cover_the_task() -> None:
    captions = {make_clip(s).caption for s in range(300)}
    assert len(captions) > 50  # 6 colours x 3 shapes x 4 directions = 72 possible
    words = {tuple(c.split()[1:3]) + (c.split()[-1],) for c in captions}
    assert {w[0] for w in words} == set(COLOURS) and {w[2] for w in words} == set(DIRECTIONS)


@pytest.mark.parametrize("container", ["mp4", "webm"])
def test_caption_is_true_of_the_decoded_pixels(container: str) -> None:
    """Hand check on decoded frames: the shape's mean colour and its centroid's motion."""
    for seed in range(12):
        clip = make_clip(seed, container=container)
        (motion,) = plan(seed)
        assert clip.caption == f"a {motion.colour} {motion.shape} moves {motion.direction}"
        frames = decode_video(clip.data, num_frames=8, limits=MediaLimits()).frames
        assert len(frames) == 4

        def mask(f: np.ndarray) -> np.ndarray:
            return f.astype(int).sum(-1) > 200

        first, last = frames[0], frames[-1]
        colour = first[mask(first)].mean(0)
        nearest = min(COLOURS, key=lambda c: np.abs(np.array(COLOURS[c]) - colour).sum())
        assert nearest == motion.colour
        ys0, xs0 = np.nonzero(mask(first))
        ys1, xs1 = np.nonzero(mask(last))
        dx, dy = xs1.mean() - xs0.mean(), ys1.mean() - ys0.mean()
        want_dx, want_dy = DIRECTIONS[motion.direction]
        moved = dx if want_dx else dy
        assert moved * (want_dx or want_dy) > 8  # the shape travels 10-14 px
        assert abs(dy if want_dx else dx) < 2


def test_two_shapes_caption_order() -> None:
    clip = make_clip(4, num_shapes=2)
    first, second = clip.caption.split(" and ")
    shapes = ["circle", "square", "triangle"]
    assert shapes.index(first.split()[2]) < shapes.index(second.split()[2])


def test_demo_video_cli(tmp_path, capsys) -> None:
    out = tmp_path / "clip.webm"
    assert cli.main(["demo-video", "--out", str(out), "--seed", "5", "--format", "webm"]) == 0
    assert out.read_bytes() == make_clip(5, container="webm").data
    assert capsys.readouterr().out.strip() == make_clip(5).caption
