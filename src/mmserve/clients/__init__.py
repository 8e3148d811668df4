"""Python clients for mmserve: `Client` (blocking) and `AsyncClient` (asyncio)."""

from mmserve.clients.client import AsyncClient, Client, build_request
from mmserve.clients.messages import frames_part, image_part, message, text_part, user_message, video_part
from mmserve.clients.types import (
    ClientError,
    Delta,
    GenerateResult,
    MediaRef,
    Perf,
    Sample,
    Timings,
    TokenLogprob,
    TopLogprob,
    Usage,
)

__all__ = [
    "AsyncClient", "Client", "ClientError", "Delta", "GenerateResult", "MediaRef", "Perf", "Sample", "Timings",
    "TokenLogprob", "TopLogprob", "Usage",
    "build_request", "frames_part", "image_part", "message", "text_part", "user_message", "video_part",
]
