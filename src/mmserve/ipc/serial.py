"""Serialisation of what crosses the engine-process boundary: pickle protocol 5, tensors out of band.

Why pickle and not a schema format (msgpack/msgspec): the crossing types are dataclasses that other
engineers keep extending (logprobs, n samples, cached tokens, structured output); pickle carries any
of them, nested, with exceptions, with no schema to keep in step, so a new field needs no IPC change.
Its risk is executing code on load; the sockets live in a private 0700 directory that only this user
can reach, and that user can already run anything, so loading is as trusted as importing our modules.

Why out of band: pixel tensors are megabytes. Protocol 5 hands their memory to zmq as separate frames
(`send_multipart(copy=False)`: no copy into the pickle stream) and the receiver wraps each frame with
`torch.frombuffer`. Small tensors stay inline, where one frame is cheaper than many.

mmserve errors get their own reduction: their constructors take other arguments than `args`, so the
default pickling would lose `retryable`, `field` ... What must never cross (a live OTel context, the
front end's timings) is not in the crossing types at all (`EngineCoreRequest` vs the front end's
`EngineRequest`).
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from mmserve.errors import MMServeError

INLINE_BYTES = 4096   # tensors smaller than this travel inside the pickle stream


def _rebuild_tensor(buffer, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if len(memoryview(buffer)) == 0:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(buffer, dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)


def _rebuild_error(cls: type, args: tuple, state: dict) -> BaseException:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):   # not called for plain ints, strs, lists, dicts ... (fast)
        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu().contiguous()
            if t.numel():
                raw = t.reshape(-1).view(torch.uint8).numpy()
                return _rebuild_tensor, (pickle.PickleBuffer(raw), t.dtype, tuple(t.shape))
            return _rebuild_tensor, (b"", t.dtype, tuple(t.shape))
        if isinstance(obj, MMServeError):
            return _rebuild_error, (type(obj), obj.args, dict(obj.__dict__))
        return NotImplemented


def encode(obj: Any) -> list:
    """obj -> frames: the pickle stream, then one buffer per large tensor (zero-copy views)."""
    frames: list = [None]

    def out_of_band(buf: pickle.PickleBuffer) -> bool:
        raw = buf.raw()
        if raw.nbytes < INLINE_BYTES:
            return True            # true = serialise in band
        frames.append(raw)
        return False

    stream = io.BytesIO()
    _Pickler(stream, protocol=5, buffer_callback=out_of_band).dump(obj)
    frames[0] = stream.getbuffer()
    return frames


def decode(frames: list) -> Any:
    """frames (bytes-like, or zmq.Frame) -> the object; tensors share the frames' memory."""
    views = [f.buffer if hasattr(f, "buffer") else f for f in frames]
    return pickle.loads(views[0], buffers=views[1:])
