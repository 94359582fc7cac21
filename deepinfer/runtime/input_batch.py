"""Persistent input batch: per-request block-table rows kept across steps.

A request keeps one row of a preallocated [rows, blocks] table from its first step until the
scheduler reports it finished or preempted. Each step only writes what changed (a new block at
a block boundary, a new request's table); decode rows' slots, context lengths and padded
block tables come from tensor ops over the rows the step schedules, instead of Python lists
rebuilt and padded every step. The prepared tensors equal `ModelRunner._prepare`'s (the plain
build, kept as the reference: tests compare the two every step).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import torch

from deepinfer.core.scheduler_output import ScheduledRequest
from deepinfer.runtime.paged_attention import AttentionMetadata, DecodeMetadata, PrefillChunkMetadata

# Rows are kept for requests that may run again; past this many (and 4x the step's batch),
# rows of requests the step does not schedule are dropped (ids never reported finished).
_MAX_IDLE_ROWS = 1024


class PersistentInputBatch:
    def __init__(self, block_size: int, device: torch.device, rows: int = 64, blocks: int = 64) -> None:
        self.block_size = block_size
        self.device = device
        self.table = np.zeros((rows, blocks), dtype=np.int64)  # host copy of the block tables
        self._row_of: dict[str, int] = {}
        self._blocks: list[list[int] | None] = [None] * rows  # what each row holds, for the diff
        self._free = list(range(rows - 1, -1, -1))

    @property
    def num_rows(self) -> int:
        return len(self._row_of)

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop the rows of requests that finished or were preempted (their blocks are freed;
        a preempted request gets a new row, and new blocks, when it runs again)."""
        for request_id in request_ids:
            row = self._row_of.pop(request_id, None)
            if row is not None:
                self._blocks[row] = None
                self._free.append(row)

    def prepare(self, ordered: list[ScheduledRequest], as_decode: Callable[[ScheduledRequest], bool],
                prefill_meta: Callable[[ScheduledRequest, int], PrefillChunkMetadata], need_mask: bool):
        """ModelRunner._prepare's (input_ids, positions, metadata, sample_idx, sample_reqs) for
        `ordered` (decode rows first), from the persistent rows."""
        bs = self.block_size
        rows = self._sync(ordered)
        input_ids: list[int] = []
        sample_idx: list[int] = []
        sample_reqs: list[ScheduledRequest] = []
        dec_rows: list[int] = []  # one entry per decode token row
        dec_pos: list[int] = []
        dec_blocks: list[int] = []  # blocks the row's table shows (its request's context)
        chunks: list[tuple[int, ScheduledRequest, int]] = []  # (row, request, flat start)
        leading = True
        for r, row in zip(ordered, rows):
            first = len(input_ids)
            input_ids.extend(r.token_ids)
            if r.sample:
                sample_idx.append(len(input_ids) - 1)
                sample_reqs.append(r)
            leading = leading and as_decode(r)
            if not leading:
                chunks.append((row, r, first))
                continue
            p0, n = r.num_computed_tokens, len(r.token_ids)
            nblk = -(-(p0 + n) // bs)
            if n == 1:
                dec_rows.append(row)
                dec_pos.append(p0)
                dec_blocks.append(nblk)
            else:  # a short chunk: one decode row per token, causal by its own position
                dec_rows.extend([row] * n)
                dec_pos.extend(range(p0, p0 + n))
                dec_blocks.extend([nblk] * n)
        num_dec = len(dec_rows)
        # Host arithmetic in numpy (about 1 us per op on small arrays, torch's CPU ops ~5 us),
        # handed to torch without copies.
        table = self.table
        parts_pos: list[np.ndarray] = []
        parts_slots: list[np.ndarray] = []
        tables = context_lens = None
        if num_dec:
            pos = np.array(dec_pos, dtype=np.int64)
            nblk = np.array(dec_blocks, dtype=np.int64)
            width = int(nblk.max())
            tables = table[dec_rows, :width]  # [B, width], a copy
            # Columns past a row's context are padding (block 0), as the plain build pads.
            tables[np.arange(width) >= nblk[:, None]] = 0
            parts_slots.append(tables[np.arange(num_dec), pos // bs] * bs + pos % bs)
            parts_pos.append(pos)
            context_lens = pos + 1
        for row, r, _ in chunks:
            pos = np.arange(r.num_computed_tokens, r.num_computed_tokens + len(r.token_ids), dtype=np.int64)
            parts_pos.append(pos)
            parts_slots.append(table[row, pos // bs] * bs + pos % bs)
        dev = self.device
        positions = parts_pos[0] if len(parts_pos) == 1 else np.concatenate(parts_pos)
        slots = parts_slots[0] if len(parts_slots) == 1 else np.concatenate(parts_slots)
        decode_meta = None
        if tables is not None:
            context_lens = torch.from_numpy(context_lens).to(dev)
            mask = None
            if need_mask:  # the C kernel reads context_lens, SDPA needs a mask
                ctx = torch.arange(tables.shape[1] * bs, device=dev)
                mask = (ctx.unsqueeze(0) < context_lens.unsqueeze(1))[:, None, None, :]
            decode_meta = DecodeMetadata(num_dec, torch.from_numpy(tables.reshape(-1)).to(dev), mask,
                                         context_lens)
        prefills = [prefill_meta(r, first) for _, r, first in chunks]
        meta = AttentionMetadata(torch.from_numpy(slots).to(dev), decode_meta, prefills)
        return (torch.tensor(input_ids, dtype=torch.long, device=dev), torch.from_numpy(positions).to(dev), meta,
                torch.tensor(sample_idx, dtype=torch.long, device=dev), sample_reqs)

    # ---- rows ------------------------------------------------------------------------------
    def _sync(self, ordered: list[ScheduledRequest]) -> list[int]:
        """Each request's row, its table brought up to date: only new tail blocks are
        written when the old blocks are unchanged (the usual decode step: nothing, or one)."""
        rows = []
        for r in ordered:
            row = self._row_of.get(r.request_id)
            if row is None:
                row = self._new_row(r.request_id, ordered)
            new = r.block_ids
            old = self._blocks[row]
            if new != old:
                n = len(old)
                if len(new) > self.table.shape[1]:
                    self._grow(self.table.shape[0], max(len(new), 2 * self.table.shape[1]))
                if n and len(new) > n and new[:n] == old:
                    self.table[row, n:len(new)] = new[n:]
                elif new:
                    self.table[row, :len(new)] = new
                self._blocks[row] = list(new)
            rows.append(row)
        return rows

    def _new_row(self, request_id: str, ordered: list[ScheduledRequest]) -> int:
        if not self._free:
            if len(self._row_of) >= max(_MAX_IDLE_ROWS, 4 * len(ordered)):
                scheduled = {r.request_id for r in ordered}
                self.forget([rid for rid in self._row_of if rid not in scheduled])
            if not self._free:
                self._grow(2 * self.table.shape[0], self.table.shape[1])
        row = self._free.pop()
        self._row_of[request_id] = row
        self._blocks[row] = []
        return row

    def _grow(self, rows: int, blocks: int) -> None:
        old_rows = self.table.shape[0]
        table = np.zeros((rows, blocks), dtype=np.int64)
        table[:old_rows, :self.table.shape[1]] = self.table
        self.table = table
        if rows > old_rows:
            self._blocks.extend([None] * (rows - old_rows))
            self._free.extend(range(rows - 1, old_rows - 1, -1))
