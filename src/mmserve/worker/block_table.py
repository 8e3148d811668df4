"""The runner's block tables: one persistent int32 row per running request per KV pool.

The scheduler decides which blocks a request holds; the runner only learns the changes, as plain
data in each `ScheduledRequest.block_updates`, and keeps the tables its step inputs are copied
from, so building a step's block tables is one numpy gather over the scheduled rows.

On the device each pool's table lives too (`dev`), kept equal to the host's by the same changes:
a step copies only the entries that changed (its new blocks and newly reclaimed ones, as (flat
index, block) pairs through a pinned buffer), never rows of the table's full width (16k entries per
request at a 262k context), and the step's device table is a gather of the scheduled rows there.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

from mmserve.attention.buffers import StagedWorkspace
from mmserve.core.sched.output import ScheduledRequest

NULL_BLOCK = 0
STAGED_ENTRIES = 4096   # changed entries one step copies before the staging buffers grow


class BlockTables:
    def __init__(self, pools: Iterable[str], max_blocks_per_req: int, num_rows: int = 16,
                 device: torch.device | str = "cpu"):
        self.max_blocks_per_req = max_blocks_per_req
        self.device = torch.device(device)
        self.rows = {t: np.zeros((num_rows, max_blocks_per_req), dtype=np.int32) for t in pools}
        self.dev = {t: torch.zeros(table.shape, dtype=torch.int32, device=self.device) for t, table in self.rows.items()}
        self._reclaimed = {t: np.zeros(num_rows, dtype=np.int64) for t in self.rows}   # entries nulled per row
        self._row_of: dict[str, int] = {}
        self._free_rows = list(range(num_rows - 1, -1, -1))
        self._staged = StagedWorkspace(self.device)   # one step's changed entries: flat index, block
        for name, dtype in (("index", torch.int64), ("blocks", torch.int32)):
            self._staged.push(name, (STAGED_ENTRIES,), dtype)

    def apply(self, scheduled: list[ScheduledRequest]) -> np.ndarray:
        """Apply this step's block updates, on the host and on the device; return the scheduled
        requests' rows (int64, step order). The caller makes sure the last step's copies out of the
        staging buffers have run (the runner's inputs-copied event)."""
        row_of, rows = self._row_of, []
        changed: dict[str, list[np.ndarray]] = {}
        width = self.max_blocks_per_req
        for s in scheduled:   # one pass: the request's row, then its updates (none for most decode steps)
            row = row_of.get(s.request.request_id)
            if row is None:
                row = self._row(s.request.request_id)
            rows.append(row)
            if not s.block_updates:
                continue
            for t, update in s.block_updates.items():
                table = self.rows[t][row]
                end = update.start + len(update.new_block_ids)
                table[update.start: end] = update.new_block_ids
                table[: update.num_reclaimed] = NULL_BLOCK
                done = int(self._reclaimed[t][row])
                self._reclaimed[t][row] = max(done, update.num_reclaimed)
                changed.setdefault(t, []).append(row * width + np.concatenate([
                    np.arange(update.start, end), np.arange(done, update.num_reclaimed)]))
        for t, parts in changed.items():   # each entry once, with the host's final value
            index = np.unique(np.concatenate(parts))
            self._write(t, index, self.rows[t].reshape(-1)[index])
        return np.array(rows, dtype=np.int64)

    def rows_of(self, request_ids: list[str]) -> np.ndarray:
        """The rows (int64) of requests a step `apply` took and nothing freed since."""
        return np.fromiter((self._row_of[rid] for rid in request_ids), dtype=np.int64, count=len(request_ids))

    def gather(self, pool: str, rows: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The device tables of `rows` (device int64), into `out` (a persistent buffer's first rows)."""
        return torch.index_select(self.dev[pool], 0, rows, out=out)

    def free(self, request_id: str) -> None:
        row = self._row_of.pop(request_id, None)
        if row is not None:
            for t, table in self.rows.items():
                table[row] = NULL_BLOCK
                self.dev[t][row].zero_()
                self._reclaimed[t][row] = 0
            self._free_rows.append(row)

    def _write(self, pool: str, index: np.ndarray, blocks: np.ndarray) -> None:
        """Copy changed entries (flat index, block) into the pool's device table: one staged copy
        each (persistent buffers, grown only past the most changes a step ever had), one scatter."""
        n = len(index)
        self._staged.array("index", (n,), torch.int64)[:] = index
        self._staged.array("blocks", (n,), torch.int32)[:] = blocks
        self.dev[pool].view(-1).index_copy_(0, self._staged.push("index", (n,), torch.int64),
                                            self._staged.push("blocks", (n,), torch.int32))

    def _row(self, request_id: str) -> int:
        row = self._row_of.get(request_id)
        if row is None:
            if not self._free_rows:   # more requests hold blocks than ever before: double the rows
                n = len(self._row_of)
                for t, table in self.rows.items():
                    self.rows[t] = np.concatenate([table, np.zeros_like(table)])
                    self.dev[t] = torch.cat([self.dev[t], torch.zeros_like(self.dev[t])])
                    self._reclaimed[t] = np.concatenate([self._reclaimed[t], np.zeros_like(self._reclaimed[t])])
                self._free_rows = list(range(2 * n - 1, n - 1, -1))
            row = self._row_of[request_id] = self._free_rows.pop()
        return row
