"""Router-preprocessed media (`mm_inputs`, `extra_mm_inputs`): accepted when they describe our layout.

A gateway that runs its own Gemma 4 processor (SMG without worker-side processing, llm-d) sends
expanded prompt ids plus one batch of tensors per modality: `pixel_values` [items, patches, 3*p*p]
and their patch positions [items, patches, 2] (padding at (-1, -1)), with placeholder ranges into
the ids. We take them only if they are exactly what our own preprocessing would produce: our patch
size and padded patch count, each image/frame one run of its soft token between `<|image>` and
`<image|>` whose length is its real patches over the pooling window, and no soft token outside a
run. Anything else is refused, naming the batch, so a mismatched processor can never feed the model
a layout it was not trained on. Tensors travel inline (shared memory and remote handles: refused).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

from mmserve.errors import InvalidInputError
from mmserve.model.prompt import MMItem
from mmserve.model.spec import ModelSpec

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int64": torch.int64,
          "int32": torch.int32}


@dataclass(frozen=True)
class Preprocessed:
    mm_ranges: list[tuple[int, int]]   # inclusive, absolute, sorted
    mm_items: list[MMItem]             # same order
    num_frames: int


def tensor(data: vpb.TensorData, where: str) -> torch.Tensor:
    """An inline tensor, its byte count checked against shape and dtype before it is read."""
    if data.WhichOneof("payload") != "inline":
        raise InvalidInputError(where, "only inline tensors are accepted (no shared memory or remote handles)")
    dtype = DTYPES.get(data.dtype)
    if dtype is None:
        raise InvalidInputError(f"{where}.dtype", f"{data.dtype!r} is not one of {', '.join(DTYPES)}")
    shape = [int(d) for d in data.shape]
    count = 1
    for d in shape:
        count *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    if count * itemsize != len(data.inline):
        raise InvalidInputError(where, f"shape {shape} of {data.dtype} needs {count * itemsize} bytes, "
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
    pixels = tensor(batch.pixel_values, f"{where}.pixel_values")
    if pixels.dim() != 3 or tuple(pixels.shape[1:]) != (patches, dim):
        raise InvalidInputError(f"{where}.pixel_values", f"shape {list(pixels.shape)} is not our layout "
                                                         f"[items, {patches}, {dim}] (patch size {spec.patch_size}, "
                                                         f"{max_soft} soft tokens padded)")
    keys = [k for k in batch.model_specific_tensors if "position_ids" in k]
    if len(keys) != 1:
        raise InvalidInputError(f"{where}.model_specific_tensors", "expected one patch position tensor "
                                                                   f"(*position_ids*), got {sorted(keys)}")
    positions = tensor(batch.model_specific_tensors[keys[0]], f"{where}.model_specific_tensors[{keys[0]}]")
    if tuple(positions.shape) != (pixels.shape[0], patches, 2) or positions.is_floating_point():
        raise InvalidInputError(f"{where}.model_specific_tensors[{keys[0]}]", f"integer shape "
                                f"[{pixels.shape[0]}, {patches}, 2] expected, got {list(positions.shape)}")
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
        real = int((positions[k] >= 0).all(dim=-1).sum())
        if real % window or end - start + 1 != real // window:
            raise InvalidInputError(f"{where}.mm_placeholders", f"{kind} {k}: {end - start + 1} soft tokens for "
                                                                f"{real} patches (pooling {window})")
        if start == 0 or ids[start - 1] != spec.boi_token_id or end + 1 >= len(ids) or ids[end + 1] != spec.eoi_token_id:
            raise InvalidInputError(f"{where}.mm_placeholders", f"{kind} {k} is not between <|image> and <image|>")
        out.append(((start, end), MMItem(kind, pixels[k].float(), positions[k].long(), end - start + 1)))
    return out


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
