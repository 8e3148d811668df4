"""preprocess_images must equal transformers' Gemma4ImageProcessorPil on random images."""

from __future__ import annotations

import numpy as np
import pytest
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

from mmserve.multimodal.preprocess import num_soft_tokens, preprocess_images

SIZES = [(480, 640), (37, 200), (300, 900), (224, 224), (20, 500), (700, 33), (48, 48), (1000, 1001)]


@pytest.mark.parametrize("patch,k,budget", [(16, 3, 70), (16, 3, 280), (8, 2, 140)])
def test_matches_transformers(patch: int, k: int, budget: int) -> None:
    rng = np.random.default_rng(patch * 1000 + budget)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in SIZES]
    ref = Gemma4ImageProcessorPil(patch_size=patch, pooling_kernel_size=k, max_soft_tokens=budget)
    want = ref(images=images, return_tensors="pt")
    got = preprocess_images(images, patch_size=patch, pooling_kernel_size=k, max_soft_tokens=budget)
    assert got.pixel_values.dtype == want["pixel_values"].dtype
    assert got.pixel_values.shape == want["pixel_values"].shape == (len(images), budget * k * k, 3 * patch * patch)
    assert np.array_equal(got.pixel_values.numpy(), want["pixel_values"].numpy())
    assert np.array_equal(got.position_ids.numpy(), want["image_position_ids"].numpy())
    assert got.num_soft_tokens == list(want["num_soft_tokens_per_image"])
    assert got.num_soft_tokens == [num_soft_tokens(h, w, patch_size=patch, pooling_kernel_size=k,
                                                   max_soft_tokens=budget) for h, w in SIZES]


def test_patch_layout_by_hand() -> None:
    """An image already at its target size: patch (row r, col c) holds pixels [r*p:(r+1)*p, c*p:(c+1)*p] as (py, px, C)."""
    rng = np.random.default_rng(5)
    img = rng.integers(0, 256, (32, 64, 3), dtype=np.uint8)  # 4x8 patches of 8 -> 8 soft tokens with k=2
    got = preprocess_images([img], patch_size=8, pooling_kernel_size=2, max_soft_tokens=10)
    assert got.num_soft_tokens == [8]
    for r in range(4):
        for c in range(8):
            i = r * 8 + c
            assert got.position_ids[0, i].tolist() == [c, r]
            want = img[r * 8:(r + 1) * 8, c * 8:(c + 1) * 8].astype(np.float32) / 255
            assert np.allclose(got.pixel_values[0, i].numpy(), want.reshape(-1), atol=1e-7)
    assert (got.position_ids[0, 32:] == -1).all() and (got.pixel_values[0, 32:] == 0).all()
