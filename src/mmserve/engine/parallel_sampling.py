"""`n` samples of one prompt: one engine request per sample, sharing the prompt's KV.

Sample 0 is the request itself (its id, its seed); sample i > 0 is `"{id}#{i}"` with `fork_of` set
(`types.derived_id`: no client id contains `#`, so a sample's id never equals another request's),
which the engine holds back until sample 0 has computed the prompt; it then runs on sample 0's KV
of the prompt, with or without prefix caching (whole blocks shared by reference count, the partial
last one copied: core/forks.py), computing only the prompt's last token again. With a `seed`,
sample i draws from seed + i (mod 2**64), so each sample equals a separate request with that seed,
whatever else shares the batch.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable

from mmserve.engine.types import EngineRequest, RequestOutput, derived_id
from mmserve.errors import RequestAbortedError

SEED_MODULUS = 2**64


def sample_seed(seed: int | None, index: int) -> int | None:
    """The documented derivation: sample i of a request with `seed` uses seed + i (mod 2**64)."""
    return None if seed is None else (seed + index) % SEED_MODULUS


def sample_id(request_id: str, index: int) -> str:
    return request_id if index == 0 else derived_id(request_id, str(index))


def fan_out(request: EngineRequest) -> list[EngineRequest]:
    """The engine requests of a request's samples (just the request itself when n == 1)."""
    n = request.sampling.n
    if n == 1:
        return [request]
    out = [request]
    for i in range(1, n):
        sampling = dataclasses.replace(request.sampling, seed=sample_seed(request.sampling.seed, i),
                                       prompt_logprobs=False)
        out.append(dataclasses.replace(request, request_id=sample_id(request.request_id, i), sampling=sampling,
                                       fork_of=request.request_id))
    return out


async def generate_samples(engine, request: EngineRequest,
                           aborted: Callable[[], bool] = lambda: False) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(sample index, output) from every sample of `request` as they arrive; each sample ends with its
    own finished output. If one sample fails, the others are aborted and the error is raised; leaving
    early aborts every sample still running. The samples are admitted over a few turns of the event
    loop: an abort in those turns (`aborted()` true after them) found some not yet in the engine, so
    the request ends with RequestAbortedError once all are admitted."""
    requests = fan_out(request)
    if len(requests) == 1:
        async for out in engine.generate(request):
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, sub: EngineRequest) -> None:
        try:
            async for out in engine.generate(sub):
                await queue.put((index, out))
        except BaseException as e:   # noqa: BLE001 - handed to the reader, which re-raises it
            await queue.put((index, e))

    tasks = []
    try:
        for i, sub in enumerate(requests):
            tasks.append(asyncio.ensure_future(pump(i, sub)))
            await asyncio.sleep(0)   # admit in index order: sample 0 first, so the forks find their parent
        if aborted():
            raise RequestAbortedError(f"request {request.request_id} was aborted")
        remaining = len(requests)
        while remaining:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                remaining -= 1
            yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
