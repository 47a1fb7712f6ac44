"""The rank's block table: one row of block ids per running request, on the host and (off CPU) on the
device, both written by the scheduler's diffs only.

``BlockTable`` is the host table (numpy int32): a request takes a free row when it arrives, its blocks
are written as they arrive, and the row is released when it leaves. Rows are reused without being
cleared: a row's columns past a request's blocks may hold another request's old ids, which nothing
reads (a sequence reads positions below its length only), and every id in the table is a valid block.

``DeviceBlockTable`` keeps a copy of it on the device. Every write to the host table is also
recorded (row, first column, ids); a step sends the writes since the last step as two flat arrays
(index into the table, block id) with its other inputs and scatters them into the device table,
then gathers its own rows there. So a step moves its new block ids across, not its rows of the table
(at batch 256 and 4096-token contexts the rows are 256 KiB a step; the writes are a few ids).
Invariant: after ``apply``, ``device.table[:rows] == host.table`` for every row ever written.
"""

from __future__ import annotations

import numpy as np
import torch


class BlockTable:
    """Rows of block ids, one per request; grows (doubling) when more requests are held at once."""

    def __init__(self, max_blocks_per_request: int, rows: int = 64) -> None:
        self.table = np.zeros((rows, max_blocks_per_request), dtype=np.int32)
        self.free_rows = list(range(rows - 1, -1, -1))
        self.writes: list[tuple[int, int, list[int]]] | None = None  # recorded for a device copy

    def add(self, block_ids: list[int]) -> int:
        if not self.free_rows:
            rows = self.table.shape[0]
            self.grow_to(2 * rows)
            self.free_rows = list(range(2 * rows - 1, rows - 1, -1))
        row = self.free_rows.pop()
        self.append(row, 0, block_ids)
        return row

    def grow_to(self, rows: int) -> None:
        """At least ``rows`` rows (a window group's table keeps the rows of the block table it is parallel to)."""
        if self.table.shape[0] < rows:
            self.table = np.concatenate([self.table, np.zeros((rows - self.table.shape[0], self.table.shape[1]),
                                                              dtype=self.table.dtype)])

    def append(self, row: int, start: int, block_ids: list[int]) -> None:
        self.table[row, start:start + len(block_ids)] = block_ids
        if self.writes is not None and block_ids:
            self.writes.append((row, start, block_ids))

    def release(self, row: int) -> None:
        self.free_rows.append(row)

    def take_writes(self) -> tuple[np.ndarray, np.ndarray]:
        """The writes since the last call as (flat index into the table int64, block id int32)."""
        writes, self.writes = self.writes or [], []
        if not writes:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int32)
        width = self.table.shape[1]
        index = np.concatenate([np.arange(len(ids), dtype=np.int64) + (row * width + start)
                                for row, start, ids in writes])
        values = np.fromiter((b for _, _, ids in writes for b in ids), dtype=np.int32, count=index.size)
        return index, values


class DeviceBlockTable:
    """The host table's copy on ``device``, brought up to date by each step's writes."""

    def __init__(self, host: BlockTable, device: torch.device) -> None:
        self.host = host
        self.table = torch.from_numpy(host.table).to(device)  # everything written so far
        host.writes = []
        self.num_ids_written = 0  # block ids scattered by diffs (after the first copy)

    def apply(self, index: torch.Tensor, values: torch.Tensor) -> None:
        """Scatter a step's writes (``BlockTable.take_writes``, on the device) into the table."""
        rows = self.host.table.shape[0]
        if self.table.shape[0] < rows:  # the host table doubled: so does this one
            grown = torch.zeros((rows, self.table.shape[1]), dtype=self.table.dtype, device=self.table.device)
            grown[:self.table.shape[0]] = self.table
            self.table = grown
        if index.numel():
            self.table.view(-1).index_copy_(0, index, values)
            self.num_ids_written += index.numel()

    def gather(self, rows: torch.Tensor, width: int) -> torch.Tensor:
        """The step's rows (``rows`` on the device), their first ``width`` columns: [len(rows), width]."""
        return torch.index_select(self.table[:, :width], 0, rows)
