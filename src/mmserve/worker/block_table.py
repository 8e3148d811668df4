"""The runner's block tables: one persistent int32 row per running request per KV pool.

The scheduler decides which blocks a request holds; the runner only learns the changes, as plain
data in each `ScheduledRequest.block_updates`, and keeps the tables its step inputs are copied
from, so building a step's block tables is one numpy gather over the scheduled rows.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from mmserve.core.sched.output import ScheduledRequest

NULL_BLOCK = 0


class BlockTables:
    def __init__(self, pools: Iterable[str], max_blocks_per_req: int, num_rows: int = 16):
        self.max_blocks_per_req = max_blocks_per_req
        self.rows = {t: np.zeros((num_rows, max_blocks_per_req), dtype=np.int32) for t in pools}
        self._row_of: dict[str, int] = {}
        self._free_rows = list(range(num_rows - 1, -1, -1))

    def apply(self, scheduled: list[ScheduledRequest]) -> np.ndarray:
        """Apply this step's block updates; return the scheduled requests' rows (int64, step order)."""
        rows = np.fromiter((self._row(s.request.request_id) for s in scheduled), dtype=np.int64, count=len(scheduled))
        for s, row in zip(scheduled, rows, strict=True):
            for t, update in s.block_updates.items():   # empty for most decode steps
                table = self.rows[t][row]
                table[update.start: update.start + len(update.new_block_ids)] = update.new_block_ids
                table[: update.num_reclaimed] = NULL_BLOCK
        return rows

    def free(self, request_id: str) -> None:
        row = self._row_of.pop(request_id, None)
        if row is not None:
            for table in self.rows.values():
                table[row] = NULL_BLOCK
            self._free_rows.append(row)

    def _row(self, request_id: str) -> int:
        row = self._row_of.get(request_id)
        if row is None:
            if not self._free_rows:   # more requests hold blocks than ever before: double the rows
                n = len(self._row_of)
                for t, table in self.rows.items():
                    self.rows[t] = np.concatenate([table, np.zeros_like(table)])
                self._free_rows = list(range(2 * n - 1, n - 1, -1))
            row = self._row_of[request_id] = self._free_rows.pop()
        return row
