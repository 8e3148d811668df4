"""The identity of one image, video frame or audio segment: a hash of exactly what determines its embeddings.

The vision tower's output is a function of the patchified pixels and their grid positions, so
hashing those two arrays (with dtype and shape) covers every way two inputs can differ: other
bytes, another frame sampled from the same video (num_frames, fps, another window), another resize,
rotation or deinterlacing. A frame with the same pixels in two windows of one file hashes the same
(its embeddings are the same), and the prompts still differ: each frame's timestamp is text in front
of it, so the prefix cache never serves one window's KV past that frame to the other. Two different
videos behind identical placeholder tokens get different hashes; the same bytes sampled the same
way get the same one. SHA-256: a collision would serve one user's KV to another, so the hash must
be cryptographic, and with the CPU's SHA extensions it is the fastest such hash in hashlib (about
3 ms for a 1.9 MB frame; the GIL is released while it runs).
"""

from __future__ import annotations

import hashlib

import torch


def content_hash(pixel_values: torch.Tensor, position_ids: torch.Tensor) -> bytes:
    """32 bytes naming one image/frame's vision input."""
    h = hashlib.sha256(b"mmserve-mm-v1;")
    for t in (pixel_values, position_ids):
        t = t.detach().to("cpu").contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.digest()


def audio_content_hash(features: torch.Tensor) -> bytes:
    """32 bytes naming one audio segment's input: its log-mel frames (the tower's whole input), under
    a prefix of its own so no audio can ever name the same entry as pixels."""
    h = hashlib.sha256(b"mmserve-audio-v1;")
    t = features.detach().to("cpu").contiguous()
    h.update(f"{t.dtype}{tuple(t.shape)};".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.digest()
