"""Parallel samples (`n > 1`) held back until their first sample has computed the prompt.

Sample i > 0 of a request (`fork_of` set; the front end fans a request out in
engine/parallel_sampling.py) waits here, in the scheduler but off its queue, while sample 0 (its
parent) computes the prompt. Once it has, each joins the running batch on the parent's K/V of the
prompt (`KVCacheManager.share_prefix`: whole blocks by reference, the partial last one copied), with
or without prefix caching, so the prompt is computed and its frames encoded once. While a running
parent computes its prompt, a seat per held sample is kept free for it (`Scheduler`); a sample
whose parent has ended, or that finds no seat or no shared K/V, queues like any other request.
"""

from __future__ import annotations

from mmserve.request import Request


def prompt_done(parent: Request) -> bool:
    return parent.num_computed_tokens >= parent.num_prompt_tokens


class HeldForks:
    def __init__(self) -> None:
        self._held: dict[str, list[Request]] = {}   # parent id -> its samples waiting for the prompt's KV

    def hold(self, request: Request) -> None:
        self._held.setdefault(request.fork_of, []).append(request)

    def of(self, parent_id: str) -> list[Request]:
        """The samples held for a parent (empty if none)."""
        return self._held.get(parent_id, [])

    def release(self, parent_id: str) -> list[Request]:
        """The samples held for a parent, which leave the hold."""
        return self._held.pop(parent_id, [])

    def discard(self, request: Request) -> bool:
        """Forget a held sample that ended (aborted) before it was released; False if it is not held."""
        held = self._held.get(request.fork_of)
        if held is None or request not in held:
            return False
        held.remove(request)
        if not held:
            del self._held[request.fork_of]
        return True

    def __len__(self) -> int:
        return sum(len(forks) for forks in self._held.values())

    def __bool__(self) -> bool:   # (checked per request per step: no sum)
        return bool(self._held)
