"""Live sessions' contexts in the engine core: their shared KV reservation, and what may extend them.

A live session (server/live.py, engine/live_session.py) keeps an *open prompt* here: a request
whose prompt grows as frames arrive (`ExtendRequest`), which never samples and holds its blocks.
A session's contexts (the one answering and, during a history roll-over, its rebuild) share one
reservation of two contexts' blocks in every pool, bounded by `--live-kv-share`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mmserve.config import EngineConfig
from mmserve.core.kv_cache.manager import KVCacheManager
from mmserve.errors import InvalidInputError, LimitExceededError
from mmserve.ipc.protocol import EngineCoreRequest, ExtendRequest
from mmserve.request import EncoderInput, Request


@dataclass
class _Reservation:
    """A live session's KV reservation (blocks per pool) and the contexts that share it."""

    blocks: dict[str, int]
    contexts: set[str] = field(default_factory=set)


class LiveReservations:
    def __init__(self, kv: KVCacheManager, config: EngineConfig, max_model_len: int):
        self.kv = kv
        self.config = config
        self.max_model_len = max_model_len
        self._sessions: dict[str, _Reservation] = {}   # session id -> its contexts' reservation

    def reserve(self, req: EngineCoreRequest) -> None:
        """Admit a live context: the first of its session reserves blocks for two contexts of
        `open_prompt` tokens in every pool; refused when that is more than `--live-kv-share` of a pool
        (never fits) or than what other sessions left of it (retryable)."""
        if self.config.tensor_parallel_size > 1:   # the workers' step messages carry a prompt once
            raise InvalidInputError("open", "live sessions are not served with --tensor-parallel-size > 1 yet")
        if req.open_prompt > self.max_model_len:
            raise LimitExceededError(f"a live context of {req.open_prompt} tokens exceeds the context length "
                                     f"{self.max_model_len}", "--max-model-len")
        session = self._sessions.get(req.session_id)
        if session is None:
            need = {t: 2 * n for t, n in self.kv.max_blocks_needed(req.open_prompt, self.config.max_step_tokens).items()}
            for t, n in need.items():
                share = int(self.kv.pools[t].num_usable * self.config.live_kv_share)
                taken = sum(r.blocks[t] for r in self._sessions.values())
                if n > share:
                    raise LimitExceededError(
                        f"a live session of {req.open_prompt} tokens of history reserves {n} KV blocks in pool {t} "
                        f"(two contexts), more than live sessions may hold ({share})", "--live-kv-share")
                if taken + n > share:
                    raise LimitExceededError(
                        f"live sessions already reserve {taken} of the {share} KV blocks they may hold in pool {t}",
                        "--live-kv-share", retryable=True)
            session = self._sessions[req.session_id] = _Reservation(need)
        session.contexts.add(req.request_id)

    def sessions(self) -> list[str]:
        """The sessions holding a reservation."""
        return sorted(self._sessions)

    def release(self, request_id: str) -> None:
        """A context ended: its session's reservation goes with its last context."""
        for session_id, session in list(self._sessions.items()):
            session.contexts.discard(request_id)
            if not session.contexts:
                del self._sessions[session_id]


def check_extension(request: Request, msg: ExtendRequest, step_budget: int) -> None:
    """Raise unless `msg` may extend `request`: an open prompt, within its declared size, its ranges
    inside the new tokens, sorted, each with its pixels and within one step's budget."""
    rid = request.request_id
    if not request.open_prompt:
        raise InvalidInputError("request_id", f"{rid!r} is not a live context")
    start, end = request.num_prompt_tokens, request.num_prompt_tokens + len(msg.token_ids)
    if end > request.open_prompt:
        raise LimitExceededError(f"live context {rid} would hold {end} tokens, more than its {request.open_prompt}",
                                 "max_history_frames")
    if len(msg.mm_inputs) != len(msg.mm_ranges):
        raise InvalidInputError("mm_inputs", f"{len(msg.mm_inputs)} pixel inputs for {len(msg.mm_ranges)} ranges")
    last = request.mm_ranges[-1][1] if request.mm_ranges else -1
    for a, b in msg.mm_ranges:
        if not (start <= a <= b < end) or a <= last:
            raise InvalidInputError("mm_ranges", "an extension's ranges must lie in its own tokens, sorted and disjoint")
        if b - a + 1 > step_budget:
            raise LimitExceededError(f"a frame of {b - a + 1} tokens cannot fit one step's budget of {step_budget} tokens",
                                     "--max-num-batched-tokens")
        last = b


def context_media(context: Request | None, req: EngineCoreRequest) -> list[EncoderInput]:
    """A live question's media, taken from its context's request (`req.context_request_id`): the
    same objects, not copies, so the question keeps them for a recompute however long the context
    lives. The session posts a question before it ends the context it was built from; a context gone
    anyway (the session failed or closed meanwhile) fails this question alone, retryably."""
    if context is None or not context.open_prompt:
        raise LimitExceededError(f"live context {req.context_request_id} ended before question {req.request_id} "
                                 "reached the engine; ask again", retryable=True)
    n = len(req.mm_ranges)
    if req.mm_inputs or [tuple(r) for r in req.mm_ranges] != [tuple(r) for r in context.mm_ranges[:n]]:
        raise InvalidInputError("mm_ranges", f"a live question's media must be its context's first {n}, "
                                "at the same positions, and carry no pixels of their own")
    return context.mm_inputs[:n]
