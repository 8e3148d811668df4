"""One pool's KV blocks: reference counts, the prefix cache's key -> block map, two free lists.

A block is in use (its reference count > 0), free and cached (count 0 but still keyed, so a later
request with the same prefix takes it back instead of recomputing it), or free and empty. New
blocks come from the empty ones first; only when none is left is a cached one evicted, the least
recently freed first, and its key dropped with it. A block released as `evict_first` (a sliding
window block a running request has just left behind: rarely what a later prompt needs) goes to
the eviction end instead, so a long prefill recycles its own window instead of flushing the cache.
Block 0 is the null block: never handed out, counted, keyed or freed.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator

NULL_BLOCK = 0


class BlockPool:
    def __init__(self, num_blocks: int, on_evict: Callable[[bytes], None] | None = None):
        self.num_blocks = num_blocks
        self.on_evict = on_evict   # told each key eviction drops (the published pool's KV events)
        self.ref_cnt = [0] * num_blocks
        self._key: list[bytes | None] = [None] * num_blocks
        self._by_key: dict[bytes, int] = {}
        self._empty: list[int] = list(range(num_blocks - 1, 0, -1))    # pop() hands out 1, 2, ... first
        self._cached_free: OrderedDict[int, None] = OrderedDict()       # least recently freed first

    @property
    def num_usable(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free(self) -> int:
        """Blocks a request can get now: empty ones plus cached ones nobody holds."""
        return len(self._empty) + len(self._cached_free)

    @property
    def num_cached_free(self) -> int:
        return len(self._cached_free)

    def lookup(self, key: bytes) -> int | None:
        """The block holding the KV of the prefix `key` names, if it is still cached."""
        return self._by_key.get(key)

    def take(self, n: int) -> list[int]:
        """n blocks with a reference each; evicts cached blocks only when no empty one is left."""
        if n > self.num_free:
            raise RuntimeError(f"{n} blocks asked, {self.num_free} free")
        out = []
        for _ in range(n):
            if self._empty:
                block = self._empty.pop()
            else:
                block, _ = self._cached_free.popitem(last=False)
                key = self._key[block]
                del self._by_key[key]
                self._key[block] = None
                if self.on_evict is not None:
                    self.on_evict(key)
            self.ref_cnt[block] = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[int]) -> None:
        """Take one more reference on each block (a prefix hit): a free cached block leaves the free list."""
        for block in blocks:
            if block == NULL_BLOCK:
                continue
            if self.ref_cnt[block] == 0:
                del self._cached_free[block]
            self.ref_cnt[block] += 1

    def release(self, blocks: Iterable[int], *, evict_first: bool = False) -> None:
        """Drop one reference on each block, in the order given: a block nobody holds any more becomes
        free, and keeps its key if it has one (evicted last, or first with `evict_first`)."""
        for block in blocks:
            if block == NULL_BLOCK:
                continue
            if self.ref_cnt[block] <= 0:
                raise RuntimeError(f"block {block} released more often than taken")
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                if self._key[block] is None:
                    self._empty.append(block)
                else:
                    self._cached_free[block] = None
                    if evict_first:
                        self._cached_free.move_to_end(block, last=False)

    def cache(self, block: int, key: bytes) -> bool:
        """Key a full, computed block so later requests can reuse it; True if the key is new here. A
        key already held by another block keeps that block (tables stay append-only, so no duplicate
        is merged)."""
        if self._key[block] is None and key not in self._by_key:
            self._key[block] = key
            self._by_key[key] = block
            return True
        return False

    def keyed(self) -> Iterator[tuple[bytes, int]]:
        """Every (key, block) this pool holds, in use or free, oldest key first."""
        return iter(self._by_key.items())

    def drop_cached(self) -> None:
        """Forget every key (a flush): cached free blocks become empty, blocks in use stay unkeyed."""
        for block in self._cached_free:
            self._empty.append(block)
        self._cached_free.clear()
        self._by_key.clear()
        self._key = [None] * self.num_blocks

    def num_freed_by_release(self, blocks: Iterable[int]) -> int:
        """How many of `blocks` would become free if each lost one reference."""
        return sum(1 for b in blocks if b != NULL_BLOCK and self.ref_cnt[b] == 1)

    def num_taken_by_touch(self, blocks: Iterable[int]) -> int:
        """How many of `blocks` would leave the free list if each got one more reference."""
        return sum(1 for b in blocks if b != NULL_BLOCK and self.ref_cnt[b] == 0)
