"""Parallel samples (`n > 1`) held back until their first sample has computed the prompt.

Sample i > 0 of a request (`fork_of` set; the front end fans a request out in
engine/parallel_sampling.py) waits here, off the scheduler, while sample 0 computes the prompt, so
that it is admitted onto the prompt's KV instead of computing it again; a fork whose parent has
ended is released at once.
"""

from __future__ import annotations

from mmserve.request import Request


def _prompt_done(parent: Request | None) -> bool:
    return parent is None or parent.num_computed_tokens >= parent.num_prompt_tokens


class HeldForks:
    def __init__(self) -> None:
        self._held: dict[str, list[Request]] = {}   # parent id -> its samples waiting for the prompt's KV

    def hold(self, request: Request, parent: Request | None) -> bool:
        """Hold `request` (a fork of `parent`) while the parent is computing its prompt; False if it may run now."""
        if _prompt_done(parent):
            return False
        self._held.setdefault(request.fork_of, []).append(request)
        return True

    def release(self, requests: dict[str, Request]) -> list[Request]:
        """The held samples whose parent (looked up in `requests`, the requests in flight) has computed
        its prompt or has ended: they leave the hold."""
        out = []
        for parent_id in [p for p, forks in self._held.items() if forks or p not in requests]:
            if _prompt_done(requests.get(parent_id)):
                out += self._held.pop(parent_id)
        return out

    def discard(self, request: Request) -> None:
        """Forget a held request that ended (aborted) before it was released."""
        held = self._held.get(request.fork_of)
        if held is not None and request in held:
            held.remove(request)

    def __len__(self) -> int:
        return sum(len(forks) for forks in self._held.values())
