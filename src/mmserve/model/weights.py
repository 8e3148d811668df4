"""Checkpoint tensors -> our modules: lazy safetensors reads, name mapping, strict checks.

Tensors are read one at a time from the memory-mapped files (single file or sharded with
`model.safetensors.index.json`) and converted to the target dtype/device, so peak host memory is
one tensor, not the model. Names are accepted in the hub / transformers-5.x layout
(`model.language_model.*`, `model.vision_tower.*`, `model.embed_vision.*`, gemma4_unified's
`model.vision_embedder.*`), the legacy llava/vLLM layout (`language_model.model.*`,
`vision_tower.*`, `embed_vision.*`) and a text-only model's (`Gemma4ForCausalLM` /
`Gemma4UnifiedForCausalLM`: `model.layers.*`, `model.embed_tokens.*`, `lm_head.*`). Experts load packed (`experts.gate_up_proj` [E, 2I, H],
`experts.down_proj` [E, H, I], transformers' layout) or per expert (`experts.{e}.gate_proj` /
`up_proj` / `down_proj`), which are copied into their slice of one packed tensor as they stream,
so no second copy of the experts is ever held. Merged projections (`qkv_proj`, `gate_up_proj`:
parallel.mark_merged) are filled the same way, each checkpoint tensor (`q_proj`, `k_proj`, ...)
copied into its rows as it streams. A tensor given twice (in two files without an index, under two
spellings of its name, or experts both packed and per expert) is refused naming both copies: which
one is meant is unknown.
Tensor parallel: a parameter marked with a `Shard` (parallel.py) is read as that slice of its
checkpoint tensor (safetensors' `get_slice`), and per-expert matrices of other ranks' experts are
never opened, so no rank materialises another rank's shard; `load_weights` returns the bytes read.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from mmserve.errors import MMServeError
from mmserve.model.parallel import MergedPart, Shard, merged_of, shards_of

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
    ("model.vision_embedder.", "vision.vision_embedder."),
    ("vision_embedder.", "vision.vision_embedder."),
    ("model.audio_tower.", "audio.audio_tower."),
    ("audio_tower.", "audio.audio_tower."),
    ("model.embed_audio.", "audio.embed_audio."),
    ("embed_audio.", "audio.embed_audio."),
    ("model.", "decoder."),   # a text-only model's (Gemma4ForCausalLM's `model.layers.*`): after all the above
)
# Our modules group a concept's tensors under one submodule (decoder.ple.*, layers.N.moe.*).
_REGROUP: tuple[tuple[re.Pattern, str], ...] = (
    (re.compile(r"^decoder\.(embed_tokens_per_layer|per_layer_model_projection|per_layer_projection_norm)\."),
     r"decoder.ple.\1."),
    (re.compile(r"^(decoder\.layers\.\d+)\.(per_layer_input_gate|per_layer_projection|post_per_layer_input_norm)\."),
     r"\1.ple.\2."),
    (re.compile(r"^(decoder\.layers\.\d+)\.(router|experts|pre_feedforward_layernorm_2|post_feedforward_layernorm_[12])\."),
     r"\1.moe.\2."),
)
# One expert's matrix in a per-expert checkpoint -> (packed tensor, expert, which rows of it).
_PER_EXPERT = re.compile(r"^(?P<layer>.*\.moe\.experts)\.(?P<e>\d+)\.(?P<kind>gate_proj|up_proj|down_proj)\.weight$")
# Tensors that exist in some checkpoints but that we never use.
_IGNORED = re.compile(r"embed_vision\.embedding\.")


class WeightLoadError(MMServeError):
    """The checkpoint's tensors do not match the model its config describes."""


def _open(f: Path):
    """safe_open, failing as a `WeightLoadError` that names the file (truncated, not safetensors)."""
    try:
        return safe_open(str(f), framework="pt")
    except (SafetensorError, OSError) as exc:
        raise WeightLoadError(f"{f}: not a readable safetensors file: {exc}") from exc


def _index_files(root: Path, index: Path) -> dict[str, Path]:
    """The index's weight_map, each file checked to be there."""
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (ValueError, AttributeError) as exc:
        raise WeightLoadError(f"{index}: not a JSON object: {exc}") from exc
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise WeightLoadError(f"{index}: no weight_map of tensor name -> file name")
    absent = sorted({f for f in weight_map.values() if not (root / f).is_file()})
    if absent:
        raise WeightLoadError(f"{index} places tensors in {absent[:4]}, which {root} does not hold")
    return {name: root / fname for name, fname in weight_map.items()}


def checkpoint_files(path: str | Path) -> dict[str, Path]:
    """Map every tensor name in the checkpoint to the file that holds it."""
    root = Path(path)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        return _index_files(root, index)
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"{root}: no *.safetensors files")
    names: dict[str, Path] = {}
    for f in files:
        with _open(f) as handle:
            for name in handle.keys():
                if name in names:   # a stray copy beside the checkpoint: which one is meant is unknown
                    raise WeightLoadError(f"{root}: {name} is in both {names[name].name} and {f.name} "
                                          f"(without model.safetensors.index.json every *.safetensors is read)")
                names[name] = f
    return names


def our_name(checkpoint_name: str, *, tied: bool) -> str | None:
    """Our parameter name for a checkpoint tensor, or None when we ignore it."""
    if _IGNORED.search(checkpoint_name) or (tied and checkpoint_name.endswith("lm_head.weight")):
        return None
    name = checkpoint_name
    for src, dst in _PREFIXES:
        if name.startswith(src):
            name = dst + name[len(src):]
            break
    for pattern, replacement in _REGROUP:
        name = pattern.sub(replacement, name)
    return name


@dataclass(frozen=True)
class ExpertSlice:
    """Where one per-expert matrix goes inside its packed tensor."""

    packed: str           # our name of the packed tensor
    expert: int
    kind: str             # gate_proj (rows [0, I)), up_proj (rows [I, 2I)) or down_proj


def expert_slice(name: str) -> ExpertSlice | None:
    match = _PER_EXPERT.match(name)
    if match is None:
        return None
    kind = match["kind"]
    packed = f"{match['layer']}.{'down_proj' if kind == 'down_proj' else 'gate_up_proj'}"
    return ExpertSlice(packed, int(match["e"]), kind)


def _copy_expert(packed: torch.Tensor, part: ExpertSlice, tensor: torch.Tensor) -> None:
    rows = packed.shape[1] // 2
    target = packed[part.expert]
    if part.kind == "gate_proj":
        target = target[:rows]
    elif part.kind == "up_proj":
        target = target[rows:]
    if tensor.shape != target.shape:
        raise WeightLoadError(f"expert {part.expert} {part.kind} of {part.packed} has shape "
                              f"{tuple(tensor.shape)}, expected {tuple(target.shape)}")
    target.copy_(tensor)


def copy_merged(state: dict[str, torch.Tensor], shapes: dict, name: str, into: str, part: MergedPart,
                 tensor: torch.Tensor, dtype: torch.dtype, device: torch.device) -> None:
    """Copy checkpoint tensor `name` into its rows of the merged parameter `into`."""
    target = state.setdefault(into, torch.empty(shapes[into], dtype=dtype, device=device))[part.start:part.end]
    if tensor.shape != target.shape:
        raise WeightLoadError(f"{name} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
    target.copy_(tensor)


def check_floating(path: str | Path, ckpt_name: str, tensor: torch.Tensor) -> None:
    """A floating parameter's checkpoint tensor must be a float of 16 bits or more: integer and
    float8 tensors are quantized weights, whose scales are not read here, so a cast would load
    wrong values (and an integer tensor fails inside load_state_dict, naming no file)."""
    if not tensor.is_floating_point() or tensor.element_size() < 2:
        raise WeightLoadError(f"{path}: {ckpt_name} is {tensor.dtype}, expected float32, bfloat16 or float16 "
                              f"(quantized checkpoints are not served)")


def iter_tensors(path: str | Path, wanted: dict[str, str], shards: dict[str, Shard] | None = None
                 ) -> Iterator[tuple[str, str, torch.Tensor]]:
    """Yield (checkpoint_name, our_name, tensor) for `wanted` = {checkpoint_name: our_name}, one file
    open at a time; a name in `shards` (ours) is read as that shard only."""
    shards = shards or {}
    files = checkpoint_files(path)
    by_file: dict[Path, list[str]] = {}
    for ckpt_name in wanted:
        by_file.setdefault(files[ckpt_name], []).append(ckpt_name)
    for f, names in by_file.items():
        with _open(f) as handle:
            absent = sorted(set(names) - set(handle.keys()))
            if absent:   # the index places them in this file
                raise WeightLoadError(f"{f}: holds no {absent[0]}" + (f" (and {len(absent) - 1} more)" if
                                      len(absent) > 1 else "") + ", which model.safetensors.index.json places there")
            for ckpt_name in names:
                shard = shards.get(wanted[ckpt_name])
                if shard is None:
                    yield ckpt_name, wanted[ckpt_name], handle.get_tensor(ckpt_name)
                    continue
                source = handle.get_slice(ckpt_name)
                full = source.get_shape()
                if len(full) <= shard.dim or full[shard.dim] != shard.full:
                    raise WeightLoadError(f"{path}: {ckpt_name} has shape {tuple(full)}, expected {shard.full} "
                                          f"along dim {shard.dim}")
                yield ckpt_name, wanted[ckpt_name], shard.read(source)


def load_weights(model: nn.Module, path: str | Path, *, dtype: torch.dtype, device: torch.device,
                 tied: bool, ignore: re.Pattern | None = None) -> int:
    """Fill every parameter and persistent buffer of `model` from the checkpoint, strictly; returns
    the checkpoint bytes read (a rank's own shards and the replicated tensors).

    Floating tensors are cast to `dtype` (integer or float8 ones for floating parameters are refused:
    quantized); missing or unexpected tensors raise `WeightLoadError`
    naming them (first few), before anything is loaded. `ignore` matches our names of tensors a
    checkpoint may carry that the model does not use (KV-sharing layers' K/V projections).
    """
    state_dict = model.state_dict()
    expected = set(state_dict)
    shards = shards_of(model)
    merged = merged_of(model)   # our name of a checkpoint tensor -> (the merged parameter, its rows)
    wanted: dict[str, str] = {}
    parts: dict[str, ExpertSlice] = {}
    unexpected: list[str] = []
    fills: dict[object, str] = {}   # what a checkpoint tensor fills (a name, or one expert's matrix) -> it
    for ckpt_name in checkpoint_files(path):
        name = our_name(ckpt_name, tied=tied)
        if name is None or (ignore is not None and ignore.search(name)):
            continue
        part = expert_slice(name)
        target = name if part is None else part
        if target in fills:   # two spellings of one tensor (legacy and hub prefixes): which one is meant is unknown
            raise WeightLoadError(f"{path}: {fills[target]} and {ckpt_name} are the same tensor ({name})")
        fills[target] = ckpt_name
        if part is not None and part.packed in expected:   # all ranks' experts (a rank's tensor holds its own)
            num_experts = shards[part.packed].full if part.packed in shards else state_dict[part.packed].shape[0]
            if part.expert >= num_experts:
                unexpected.append(ckpt_name)
                continue
        if part is not None and part.packed in shards:   # another rank's expert: skipped, never read
            first = shards[part.packed]
            if not first.start <= part.expert < first.end:
                continue
            part = ExpertSlice(part.packed, part.expert - first.start, part.kind)
        if part is not None and part.packed in expected:
            parts[ckpt_name] = part
            wanted[ckpt_name] = part.packed
        elif name in expected or name in merged:
            wanted[ckpt_name] = name
        else:
            unexpected.append(ckpt_name)
    for target, ckpt_name in fills.items():
        if isinstance(target, ExpertSlice) and target.packed in fills:
            raise WeightLoadError(f"{path}: {fills[target.packed]} and the per-expert {ckpt_name} both fill "
                                  f"{target.packed}")
    merged_into = {m for m, _ in merged.values()}
    missing = sorted((expected - merged_into - set(wanted.values())) | (set(merged) - set(wanted.values())))
    shapes = {k: v.shape for k, v in state_dict.items()}
    floating = {k for k, v in state_dict.items() if v.is_floating_point()}
    for packed in {part.packed for part in parts.values()}:
        need = shapes[packed][0] * (1 if packed.endswith("down_proj") else 2)
        have = {(p.expert, p.kind) for p in parts.values() if p.packed == packed}
        if len(have) != need:
            missing.append(f"{packed} ({need - len(have)} per-expert matrices)")
    if missing or unexpected:
        raise WeightLoadError(
            f"{path}: checkpoint does not match the config: "
            f"missing {len(missing)} {missing[:8]}, unexpected {len(unexpected)} {sorted(unexpected)[:8]}")
    state: dict[str, torch.Tensor] = {}
    for part in parts.values():   # packed tensors that per-expert matrices are copied into
        state.setdefault(part.packed, torch.empty(shapes[part.packed], dtype=dtype, device=device))
    read = 0
    per_expert = {p.packed for p in parts.values()}   # whole matrices, own experts only: never sliced
    sliced = {k: v for k, v in shards.items() if k not in per_expert}
    sliced.update({name: part.shard for name, (_, part) in merged.items() if part.shard is not None})
    for ckpt_name, name, tensor in iter_tensors(path, wanted, sliced):
        read += tensor.numel() * tensor.element_size()
        if (merged[name][0] if name in merged else name) in floating:
            check_floating(path, ckpt_name, tensor)
        if ckpt_name in parts:
            _copy_expert(state[name], parts[ckpt_name], tensor)
            continue
        if name in merged:
            copy_merged(state, shapes, name, *merged[name], tensor, dtype, device)
            continue
        if tensor.shape != shapes[name]:
            raise WeightLoadError(f"{path}: {name} has shape {tuple(tensor.shape)}, expected {tuple(shapes[name])}")
        target_dtype = dtype if tensor.is_floating_point() else tensor.dtype
        state[name] = tensor.to(device=device, dtype=target_dtype)
    model.load_state_dict(state, strict=True, assign=True)
    logger.info("loaded %d tensors (%d MiB read) from %s (%s, %s)", len(state), read >> 20, path, dtype, device)
    return read
