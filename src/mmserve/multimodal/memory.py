"""Large media buffers go back to the operating system when freed, and soon.

glibc serves allocations above its mmap threshold (128 KiB at start) with their own mappings, and
unmaps them on free. But the threshold is dynamic: freeing such a mapping raises it to that size
(up to 32 MiB), so from then on a decoded 720p frame (2.7 MB), a request's video bytes or a
patchified tensor come from the heap arenas, which keep the memory after free and fragment. Over
repeated 720p/1080p requests the front end's RSS grew by ~200 MB in 30 requests that way, and a
refused 50 MB payload stayed resident. Pinning the threshold (which also stops its adjustment)
keeps every buffer of a megabyte or more in its own mapping: freed means returned. The cost is a
fresh mapping (page faults) per large buffer, small beside decoding the pixels that fill it.

Some of a finished request's memory is only freed by the cyclic garbage collector (reference
cycles through grpc's handler lookup, or an error's traceback and the frames it holds), and a full
collection runs rarely: RSS then climbed ~15 MB per 720p request until one ran. Collecting before
a media request that finds no other decoding (engine/input_processor.py: amid a burst it cost
throughput) bounds that, and is cheap once the objects that live for the whole process
(torch, the model's modules, grpc) are frozen after warm-up: a collection then visits only what
was made since (0.5 ms instead of ~400 ms).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
import logging

logger = logging.getLogger(__name__)

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter
LARGE_BUFFER_BYTES = 2**20


@functools.cache
def return_large_buffers(threshold: int = LARGE_BUFFER_BYTES) -> bool:
    """Pin glibc's mmap threshold at `threshold` bytes, once per process. False where the C
    library is not glibc (musl and macOS return large blocks on their own)."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        pinned = bool(libc.mallopt(M_MMAP_THRESHOLD, threshold))
    except (OSError, AttributeError, TypeError):
        pinned = False
    logger.debug("malloc mmap threshold %s at %d bytes", "pinned" if pinned else "not pinned (no glibc)", threshold)
    return pinned


def freeze_startup_objects() -> None:
    """After warm-up: what exists now lives for the whole process; collections skip it from here on."""
    gc.collect()
    gc.freeze()


def thaw_startup_objects() -> None:
    """When the server stops: the frozen objects may be garbage now; let collections see them."""
    gc.unfreeze()


def collect_finished_requests() -> None:
    """Free what earlier requests left in reference cycles, when that is cheap (after the freeze)."""
    if gc.get_freeze_count():
        gc.collect()
