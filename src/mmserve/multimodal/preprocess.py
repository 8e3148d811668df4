"""Frames/images -> the vision tower's patch inputs, pixel-identical to transformers' Gemma 4
image processor (PIL backend), so our served model sees what the checkpoint was trained on.

Each image is resized (bicubic, aspect preserved) to the largest size whose sides are multiples
of patch_size * pooling_kernel_size and that yields at most max_soft_tokens after k x k pooling;
pixels are scaled to [0, 1] (the model itself maps them to [-1, 1]); patches are flattened
row-major over the grid, each as (py, px, C); rows are padded to max_soft_tokens * k^2 patches
with zero pixels and position (-1, -1).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image


@dataclass
class VisionBatch:
    """Patchified images ready for `encode_vision`."""

    pixel_values: torch.Tensor  # float32 [n, max_patches, 3 * p * p]
    position_ids: torch.Tensor  # int64 [n, max_patches, 2] as (x=col, y=row); padding (-1, -1)
    num_soft_tokens: list[int]  # soft tokens per image after pooling


def target_size(height: int, width: int, *, patch_size: int, pooling_kernel_size: int,
                max_soft_tokens: int) -> tuple[int, int]:
    """(height, width) after the aspect-preserving resize; same rule as transformers'."""
    max_patches = max_soft_tokens * pooling_kernel_size**2
    factor = math.sqrt(max_patches * patch_size**2 / (height * width))
    side = pooling_kernel_size * patch_size
    th = int(math.floor(factor * height / side)) * side
    tw = int(math.floor(factor * width / side)) * side
    if th == 0 and tw == 0:
        raise ValueError(f"cannot resize a {height}x{width} image to a multiple of {side}")
    longest = (max_patches // pooling_kernel_size**2) * side
    if th == 0:  # very wide image: one row of pooled cells
        th, tw = side, min(int(math.floor(width / height)) * side, longest)
    elif tw == 0:  # very tall image
        tw, th = side, min(int(math.floor(height / width)) * side, longest)
    return th, tw


def num_soft_tokens(height: int, width: int, *, patch_size: int, pooling_kernel_size: int,
                    max_soft_tokens: int) -> int:
    """Soft tokens an image of this size becomes; the prompt builder needs it before pixels."""
    th, tw = target_size(height, width, patch_size=patch_size, pooling_kernel_size=pooling_kernel_size,
                         max_soft_tokens=max_soft_tokens)
    return (th // patch_size) * (tw // patch_size) // pooling_kernel_size**2


def _resize(image: np.ndarray, height: int, width: int) -> np.ndarray:
    if image.shape[0] == height and image.shape[1] == width:
        return image
    return np.asarray(Image.fromarray(image).resize((width, height), resample=Image.BICUBIC))


def _patchify(image: np.ndarray, patch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """HxWxC float -> ([gh*gw, p*p*C] patches in (py, px, C) order, [gh*gw, 2] (x, y))."""
    h, w, c = image.shape
    gh, gw = h // patch_size, w // patch_size
    patches = image.reshape(gh, patch_size, gw, patch_size, c).transpose(0, 2, 1, 3, 4).reshape(gh * gw, -1)
    xs, ys = np.meshgrid(np.arange(gw), np.arange(gh), indexing="xy")
    return patches, np.stack([xs, ys], axis=-1).reshape(gh * gw, 2)


def preprocess_images(images: Iterable[np.ndarray], *, patch_size: int, pooling_kernel_size: int,
                      max_soft_tokens: int, count: int | None = None, resized: bool = False) -> VisionBatch:
    """uint8 HxWx3 images (or video frames) -> VisionBatch. `images` may be a generator yielding
    `count` images (each decoded only when its turn comes), so one full-size image at a time is held.
    `resized`: the images already have their target size (the decoder applied `target_size`, which is
    not idempotent: applied again to its own output it may pick another size)."""
    count = len(images) if count is None else count  # type: ignore[arg-type]
    max_patches = max_soft_tokens * pooling_kernel_size**2
    dim = 3 * patch_size * patch_size
    pixel_values = np.zeros((count, max_patches, dim), dtype=np.float32)
    position_ids = np.full((count, max_patches, 2), -1, dtype=np.int64)
    counts: list[int] = []
    for i, image in enumerate(images):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
            raise ValueError(f"expected uint8 HxWx3, got {image.dtype} {image.shape}")
        th, tw = image.shape[:2] if resized else target_size(
            image.shape[0], image.shape[1], patch_size=patch_size, pooling_kernel_size=pooling_kernel_size,
            max_soft_tokens=max_soft_tokens)
        scaled = (_resize(image, th, tw).astype(np.float64) * (1 / 255)).astype(np.float32)
        patches, positions = _patchify(scaled, patch_size)
        pixel_values[i, : len(patches)] = patches
        position_ids[i, : len(patches)] = positions
        counts.append(len(patches) // pooling_kernel_size**2)
        del image, scaled, patches  # before the generator decodes the next one
    if len(counts) != count:
        raise ValueError(f"expected {count} images, got {len(counts)}")
    return VisionBatch(torch.from_numpy(pixel_values), torch.from_numpy(position_ids), counts)
