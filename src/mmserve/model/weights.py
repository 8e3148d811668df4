"""Checkpoint tensors -> our modules: lazy safetensors reads, name mapping, strict checks.

Tensors are read one at a time from the memory-mapped files (single file or sharded with
`model.safetensors.index.json`) and converted to the target dtype/device, so peak host memory is
one tensor, not the model. Names are accepted in the hub / transformers-5.x layout
(`model.language_model.*`, `model.vision_tower.*`, `model.embed_vision.*`) and the legacy
llava/vLLM layout (`language_model.model.*`, `vision_tower.*`, `embed_vision.*`).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from mmserve.errors import MMServeError

logger = logging.getLogger(__name__)

# checkpoint prefix -> our module prefix; first match wins.
_PREFIXES: tuple[tuple[str, str], ...] = (
    ("model.language_model.", "decoder."),
    ("language_model.model.", "decoder."),
    ("language_model.lm_head.", "decoder.lm_head."),
    ("lm_head.", "decoder.lm_head."),
    ("model.vision_tower.", "vision.vision_tower."),
    ("vision_tower.", "vision.vision_tower."),
    ("model.embed_vision.", "vision.embed_vision."),
    ("embed_vision.", "vision.embed_vision."),
)
# Tensors that exist in some checkpoints but that we never use.
_IGNORED = re.compile(r"(^|\.)(audio_tower|embed_audio)\.|embed_vision\.embedding\.")


class WeightLoadError(MMServeError):
    """The checkpoint's tensors do not match the model its config describes."""


def checkpoint_files(path: str | Path) -> dict[str, Path]:
    """Map every tensor name in the checkpoint to the file that holds it."""
    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: root / fname for name, fname in weight_map.items()}
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"{root}: no *.safetensors files")
    names: dict[str, Path] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as handle:
            names.update({k: f for k in handle.keys()})
    return names


def our_name(checkpoint_name: str, *, tied: bool) -> str | None:
    """Our parameter name for a checkpoint tensor, or None when we ignore it."""
    if _IGNORED.search(checkpoint_name) or (tied and checkpoint_name.endswith("lm_head.weight")):
        return None
    for src, dst in _PREFIXES:
        if checkpoint_name.startswith(src):
            return dst + checkpoint_name[len(src):]
    return checkpoint_name


def iter_tensors(path: str | Path, wanted: dict[str, str]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (our_name, tensor) for `wanted` = {checkpoint_name: our_name}, one file open at a time."""
    files = checkpoint_files(path)
    by_file: dict[Path, list[str]] = {}
    for ckpt_name in wanted:
        by_file.setdefault(files[ckpt_name], []).append(ckpt_name)
    for f, names in by_file.items():
        with safe_open(str(f), framework="pt") as handle:
            for ckpt_name in names:
                yield wanted[ckpt_name], handle.get_tensor(ckpt_name)


def load_weights(model: nn.Module, path: str | Path, *, dtype: torch.dtype, device: torch.device,
                 tied: bool) -> None:
    """Fill every parameter and persistent buffer of `model` from the checkpoint, strictly.

    Floating tensors are cast to `dtype`; missing or unexpected tensors raise `WeightLoadError`
    naming them (first few), before anything is loaded.
    """
    expected = set(model.state_dict().keys())
    wanted: dict[str, str] = {}
    unexpected: list[str] = []
    for ckpt_name in checkpoint_files(path):
        name = our_name(ckpt_name, tied=tied)
        if name is None:
            continue
        if name in expected:
            wanted[ckpt_name] = name
        else:
            unexpected.append(ckpt_name)
    missing = sorted(expected - set(wanted.values()))
    if missing or unexpected:
        raise WeightLoadError(
            f"{path}: checkpoint does not match the config: "
            f"missing {len(missing)} {missing[:8]}, unexpected {len(unexpected)} {sorted(unexpected)[:8]}")
    state: dict[str, torch.Tensor] = {}
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    for name, tensor in iter_tensors(path, wanted):
        if tensor.shape != shapes[name]:
            raise WeightLoadError(f"{path}: {name} has shape {tuple(tensor.shape)}, expected {tuple(shapes[name])}")
        target_dtype = dtype if tensor.is_floating_point() else tensor.dtype
        state[name] = tensor.to(device=device, dtype=target_dtype)
    model.load_state_dict(state, strict=True, assign=True)
    logger.info("loaded %d tensors from %s (%s, %s)", len(state), path, dtype, device)
