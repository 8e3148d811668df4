"""Embeddings encoded one step before the step that consumes them, held until it does.

The scheduler names the frames and audio segments the next step will likely consume
(`SchedulerOutput.encode_ahead`); the runner encodes them, batched across requests, after queueing
the current step's forward: on CUDA on a side stream, so the towers overlap that forward and the
consuming step waits on an event recorded after them (on the device, not the host); on a CPU
synchronously, after the forward. The next step then takes them here instead of running a tower.

Bounded and owned: the embeddings held never exceed `max_bytes` (an item that would is simply
encoded in its own step, as without encode-ahead); each entry belongs to the requests that asked
for it, and is dropped when the last of them ends or is preempted (`free`), so a guess the
scheduler got wrong is held only while its request may still consume it. Taking an entry removes
it (the runner then offers it to the cross-request encoder cache, as it does a fresh encode).
Under tensor parallelism every rank's runner keeps its own, the same (the step messages name the
same media to each, executor/step_messages.py, and the towers are replicated).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class _Entry:
    embeds: torch.Tensor
    ready: torch.cuda.Event | None          # recorded on the side stream after the tower call (CUDA)
    encoded: tuple[float, float]            # when that call ran (perf_counter): the consuming step reports it
    owners: set[str] = field(default_factory=set)

    @property
    def num_bytes(self) -> int:
        return self.embeds.numel() * self.embeds.element_size()


class EncodedAhead:
    def __init__(self, max_bytes: int):
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: dict[bytes, _Entry] = {}   # content hash -> embeddings
        self._by_request: dict[str, set[bytes]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def claim(self, key: bytes, request_id: str) -> bool:
        """True if `key` is held: `request_id` becomes one of its owners."""
        entry = self._entries.get(key)
        if entry is None:
            return False
        entry.owners.add(request_id)
        self._by_request.setdefault(request_id, set()).add(key)
        return True

    def fits(self, num_bytes: int) -> bool:
        return self.num_bytes + num_bytes <= self.max_bytes

    def put(self, key: bytes, request_id: str, embeds: torch.Tensor, ready: torch.cuda.Event | None,
            encoded: tuple[float, float]) -> None:
        entry = _Entry(embeds, ready, encoded, {request_id})
        self._entries[key] = entry
        self._by_request.setdefault(request_id, set()).add(key)
        self.num_bytes += entry.num_bytes

    def take(self, key: bytes) -> tuple[torch.Tensor, tuple[float, float]] | None:
        """The embeddings of `key` and when their tower call ran, removed from here, or None. On CUDA the current stream waits for
        the side stream's tower call first, and the tensor is marked as used by it (the allocator
        then cannot hand its memory to the side stream while this stream may still read it)."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        self.num_bytes -= entry.num_bytes
        for rid in entry.owners:
            keys = self._by_request[rid]
            keys.discard(key)
            if not keys:
                del self._by_request[rid]
        if entry.ready is not None:
            stream = torch.cuda.current_stream(entry.embeds.device)
            stream.wait_event(entry.ready)
            entry.embeds.record_stream(stream)
        return entry.embeds, entry.encoded

    def free(self, request_id: str) -> None:
        """A request ended or was preempted: drop what only it still owns."""
        for key in self._by_request.pop(request_id, ()):
            entry = self._entries[key]
            entry.owners.discard(request_id)
            if not entry.owners:
                del self._entries[key]
                self.num_bytes -= entry.num_bytes
