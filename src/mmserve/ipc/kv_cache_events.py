"""What the prefix cache tells the outside about itself: a block got a key, a key was dropped, all
keys were dropped. Plain data; the engine ships these with each step's outputs, and the front end
turns them into the routers' view (engine/kv_event_hub.py).

Built only while the front end asks for them (a router is subscribed): `KVCacheManager.set_events`.
Switching them on starts with `EventsStarted` and a `BlockStored` for every block cached then
(parents first), so whoever starts listening late still learns the whole cache.

Only one pool publishes: the first full-attention pool (the first pool if none is unwindowed). A
hit is bounded by the full-attention pools, every pool keys a block with the same key, and a
windowed pool's blocks leave as the window moves on, so its keys say nothing a router can use.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockStored:
    """Block `index` of `request_id`'s sequence now holds the prefix `key` names (chained on `parent`,
    None for block 0); `token_ids` are its block_size tokens; `extra_keys` the images/frames that went
    into its key beside them (block_hash.mm_extra_keys: what tells two videos with the same
    placeholder tokens apart), None for text."""

    key: bytes
    parent: bytes | None
    index: int
    token_ids: tuple[int, ...]
    request_id: str
    extra_keys: tuple[tuple[str, int], ...] | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """`key` no longer names any cached block (evicted for reuse)."""

    key: bytes


@dataclass(frozen=True)
class CacheCleared:
    """Every key was dropped (a prefix-cache flush)."""


@dataclass(frozen=True)
class EventsStarted:
    """Recording (re)started: the stores that follow up to the next step's changes describe the
    whole cache; whatever a listener held before is to be dropped."""


KvEvent = BlockStored | BlockRemoved | CacheCleared | EventsStarted
