"""Large media buffers go back to the operating system when freed, and soon.

glibc serves allocations above its mmap threshold (128 KiB at start) with their own mappings, and
unmaps them on free. But the threshold is dynamic: freeing such a mapping raises it to that size
(up to 32 MiB), so from then on a decoded 720p frame (2.7 MB), a request's video bytes or a
patchified tensor come from the heap arenas, which keep the memory after free and fragment. Over
repeated 720p/1080p requests the front end's RSS grew by ~200 MB in 30 requests that way, and a
refused 50 MB payload stayed resident. Pinning the threshold (which also stops its adjustment)
keeps every buffer of a megabyte or more in its own mapping: freed means returned. The cost is a
fresh mapping (page faults) per large buffer, small beside decoding the pixels that fill it.

A finished request's memory must also be freed by reference counting, at once, not by the cyclic
garbage collector: a full collection runs rarely (RSS climbed by each 720p clip's size until one
ran) and one on the event loop stalls every stream, yet collecting per media request cost up to
half the throughput of a burst. So nothing of a request may sit in a reference cycle. The cycles
found (a real `mmserve serve` with gc disabled: what stays alive, gc.get_referrers, DEBUG_SAVEALL):
the video seeker's suspended decode, a generator whose frame holds the seeker (and so the
container, its file and the payload's bytes: multimodal/video.py closes it); and an error's
traceback, which holds every frame it passed with their locals (the request and its media):
grpc's AbortError, kept on the call's state that the handler's frame holds (server/status.py's
`end_with` sets the status without raising), a task held in a local of a frame its own error passed
(server/in_flight.py, engine/input/processor.py's `_all_or_none`) or in asyncio.wait_for's frame
(asyncio.timeout instead). What is left per call is grpc's own handler lookup (a few small objects,
freed by young collections). Freezing the objects that live for the whole process after warm-up
(torch, the model's modules, grpc) keeps the collections that still run automatically short.
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

