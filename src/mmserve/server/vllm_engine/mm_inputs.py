"""Router-preprocessed media (`mm_inputs`, `extra_mm_inputs`): accepted when they describe our layout.

A gateway that runs its own Gemma 4 processor (SMG without worker-side processing, llm-d) sends
expanded prompt ids plus one batch of tensors per modality: `pixel_values` [items, patches, 3*p*p]
and their patch positions [items, patches, 2] (padding at (-1, -1)), with placeholder ranges into
the ids. We take them only if they are exactly what our own preprocessing would produce: our patch
size and padded patch count, each image/frame one run of its soft token between `<|image>` and
`<image|>` whose length is its real patches over the pooling window, and no soft token outside a
run, patch positions that form the image's grid in raster order and pixels in [0, 1]. Anything else
is refused, naming the batch, before it reaches the engine: a mismatched processor can never feed
the model a layout it was not trained on, and a hostile one can never index past the vision
tower's position table inside a step other requests share. Declared shapes are checked before
anything is allocated. Tensors travel inline (shared memory and remote handles: refused).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from mmserve.errors import InvalidInputError
from mmserve.model.prompt import MMItem
from mmserve.model.spec import ModelSpec

PIXEL_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
POSITION_DTYPES = {"int64": torch.int64, "int32": torch.int32}
MAX_SHOWN_DIMS = 4   # a refused shape is quoted with at most this many dimensions
PIXEL_SLACK = 1e-3   # pixel values outside [0, 1] by more than another processor's rounding are refused


@dataclass(frozen=True)
class Preprocessed:
    mm_ranges: list[tuple[int, int]]   # inclusive, absolute, sorted
    mm_items: list[MMItem]             # same order
    num_frames: int


def _shown(shape) -> str:
    dims = [str(int(d)) for d in shape[:MAX_SHOWN_DIMS]]
    return f"[{', '.join(dims)}{', ...' if len(shape) > MAX_SHOWN_DIMS else ''}]"


def tensor(data: vpb.TensorData, where: str, expected: tuple[int | None, ...], dtypes: dict[str, torch.dtype],
           layout: str) -> torch.Tensor:
    """An inline tensor whose declared dtype and shape are checked before anything is allocated:
    `expected` gives each dimension (None: any count, bounded by the bytes sent); `layout` names it."""
    if data.WhichOneof("payload") != "inline":
        raise InvalidInputError(where, "only inline tensors are accepted (no shared memory or remote handles)")
    dtype = dtypes.get(data.dtype)
    if dtype is None:
        raise InvalidInputError(f"{where}.dtype", f"{data.dtype[:32]!r} is not one of {', '.join(dtypes)}")
    shape = [int(d) for d in data.shape[:len(expected) + 1]]
    if len(shape) != len(expected) or any(d < 0 or (e is not None and d != e) for d, e in zip(shape, expected, strict=True)):
        raise InvalidInputError(where, f"shape {_shown(data.shape)} is not our layout {layout}")
    itemsize = torch.empty((), dtype=dtype).element_size()
    count = math.prod(shape)
    if count * itemsize != len(data.inline):
        raise InvalidInputError(where, f"shape {_shown(shape)} of {data.dtype} needs {count * itemsize} bytes, "
                                       f"got {len(data.inline)}")
    if not count:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data.inline), dtype=dtype).reshape(shape)


def preprocessed_media(request: vpb.GenerateRequest, spec: ModelSpec) -> Preprocessed:
    """Check every batch against our layout; raises InvalidInputError naming the batch."""
    ids = list(request.tokenized.input_ids)
    batches = [("mm_inputs", request.mm_inputs)] if request.HasField("mm_inputs") else []
    batches += [(f"extra_mm_inputs[{i}]", b) for i, b in enumerate(request.extra_mm_inputs)]
    found: list[tuple[tuple[int, int], MMItem]] = []
    for where, batch in batches:
        found += _batch(ids, batch, where, spec)
    found.sort(key=lambda f: f[0])
    ranges = [r for r, _ in found]
    if any(a[1] >= b[0] for a, b in zip(ranges, ranges[1:], strict=False)):
        raise InvalidInputError("mm_inputs.mm_placeholders", "placeholder ranges overlap")
    soft = {spec.image_token_id, spec.video_token_id}
    if sum(e - s + 1 for s, e in ranges) != sum(t in soft for t in ids):
        raise InvalidInputError("tokenized.input_ids", "image/video soft tokens outside every placeholder")
    return Preprocessed(ranges, [item for _, item in found], sum(item.kind == "video" for _, item in found))


def _batch(ids: list[int], batch: vpb.MultimodalInputs, where: str,
           spec: ModelSpec) -> list[tuple[tuple[int, int], MMItem]]:
    video = batch.modality == common_pb2.VIDEO
    kind, token = ("video", spec.video_token_id) if video else ("image", spec.image_token_id)
    max_soft = spec.video_max_soft_tokens if video else spec.image_max_soft_tokens
    patches, dim, window = max_soft * spec.pooling_kernel_size ** 2, 3 * spec.patch_size ** 2, spec.pooling_kernel_size ** 2
    if not batch.HasField("pixel_values"):
        raise InvalidInputError(f"{where}.pixel_values", "pixel values are required (no remote KV here)")
    pixels = tensor(batch.pixel_values, f"{where}.pixel_values", (None, patches, dim), PIXEL_DTYPES,
                    f"[items, {patches}, {dim}] (patch size {spec.patch_size}, {max_soft} soft tokens padded)")
    keys = [k for k in batch.model_specific_tensors if "position_ids" in k]
    if len(keys) != 1:
        raise InvalidInputError(f"{where}.model_specific_tensors", "expected one patch position tensor "
                                                                   f"(*position_ids*), got {len(keys)}")
    key = keys[0]
    at = f"{where}.model_specific_tensors[{key[:64]!r}]"
    positions = tensor(batch.model_specific_tensors[key], at, (pixels.shape[0], patches, 2), POSITION_DTYPES,
                       f"[{pixels.shape[0]}, {patches}, 2] (x, y) per patch")
    if pixels.numel() and not (torch.isfinite(pixels).all() and pixels.min() >= -PIXEL_SLACK
                               and pixels.max() <= 1 + PIXEL_SLACK):
        raise InvalidInputError(f"{where}.pixel_values", "pixel values must be finite and in [0, 1] (rescaled by "
                                                         "1/255, not normalized)")
    runs = []
    for p in batch.mm_placeholders:
        if p.offset + p.length > len(ids):
            raise InvalidInputError(f"{where}.mm_placeholders", f"[{p.offset}, +{p.length}) is past the prompt")
        runs += _runs(ids, p.offset, p.offset + p.length, token)
    if len(runs) != pixels.shape[0]:
        raise InvalidInputError(f"{where}.mm_placeholders", f"{len(runs)} {kind} token runs for "
                                                            f"{pixels.shape[0]} pixel rows")
    out = []
    for k, (start, end) in enumerate(runs):
        real = _patch_grid(positions[k], spec.pooling_kernel_size, f"{at}[{k}]")
        if end - start + 1 != real // window:
            raise InvalidInputError(f"{where}.mm_placeholders", f"{kind} {k}: {end - start + 1} soft tokens for "
                                                                f"{real} patches (pooling {window})")
        if start == 0 or ids[start - 1] != spec.boi_token_id or end + 1 >= len(ids) or ids[end + 1] != spec.eoi_token_id:
            raise InvalidInputError(f"{where}.mm_placeholders", f"{kind} {k} is not between <|image> and <image|>")
        out.append(((start, end), MMItem(kind, pixels[k].float(), positions[k].long(), end - start + 1)))
    return out


def _patch_grid(positions: torch.Tensor, k: int, where: str) -> int:
    """The number of real patches, once `positions` [P, 2] is checked to be what our preprocessing
    writes: a gh x gw grid in raster order (x fastest), both sides multiples of the pooling window k,
    then only padding at (-1, -1). Anything else would index past the vision tower's position table
    or pool into a different number of soft tokens than the prompt holds."""
    padding = (positions == -1).all(dim=-1)
    real = int((~padding).sum())
    if not real or bool(padding[:real].any()):
        raise InvalidInputError(where, "the real patches come first, then only padding at (-1, -1)")
    grid = positions[:real].long()
    if bool((grid < 0).any()):
        raise InvalidInputError(where, "a real patch has a negative position")
    gw, gh = int(grid[:, 0].max()) + 1, int(grid[:, 1].max()) + 1
    if gw * gh != real or gw % k or gh % k:
        raise InvalidInputError(where, f"{real} real patches do not form a grid whose sides are multiples of the "
                                       f"pooling window {k}")
    ys, xs = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
    if not torch.equal(grid, torch.stack([xs.flatten(), ys.flatten()], dim=-1)):
        raise InvalidInputError(where, f"patch positions are not the {gw} x {gh} grid in raster order "
                                       "((0, 0), (1, 0), ... row by row)")
    return real


def _runs(ids: list[int], start: int, stop: int, token: int) -> list[tuple[int, int]]:
    """Inclusive [first, last] of each maximal run of `token` in ids[start:stop]."""
    runs, i = [], start
    while i < stop:
        if ids[i] == token:
            j = i
            while j + 1 < stop and ids[j + 1] == token:
                j += 1
            runs.append((i, j))
            i = j + 1
        else:
            i += 1
    return runs
