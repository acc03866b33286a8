"""The recall tier (``question:recall=tier|window``, issue 68): the pairs a request's prefill evicts, kept outside the
pool.

Per request (its pool row) and every layer and local KV head: each evicted pair's key and value, its position and
its attention sum, appended in eviction order (``store``), until the eviction before the prompt's last block
(``tier``), or the window's choice after it (``window``), ranks them with the pairs held (``core.bounded``) and the
row's tier is dropped (``drop``). The tier is slower memory: on a
CPU a file on disk, mapped (a request's share of the fast memory, the pool's row, never grows with its prompt); beside
a GPU pinned host memory. A file is unlinked as soon as it is mapped: it has no name while it is used, and the
system frees it when its request's tier is dropped, or when the process ends however it ends (a killed run leaves
nothing behind; a resumed one starts without it).

One tier holds ``capacity`` pairs per (layer, head): the request's padded prompt length, every pair its prefill can
evict.
"""

from __future__ import annotations

import logging
import mmap
import os
import tempfile
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

#: Where a CPU tier's files are made (default: the system's temporary folder).
DIR_ENV = "BATCHMAX_TIER_DIR"


@dataclass
class RowTier:
    """One request's tier: keys/values [L, H, M, D], positions [L, H, M] (int64), attention sums [L, H, M] (float32)
    (how many are stored: the evictions' descriptions say, ``Eviction.tier``)."""

    keys: torch.Tensor
    values: torch.Tensor
    pos: torch.Tensor
    score: torch.Tensor
    nbytes: int
    handle: object = None  # the mapping behind a file-backed tier (closed by ``Tier.drop``)


def _file_backed(nbytes: int, folder: str) -> tuple[torch.Tensor, mmap.mmap]:
    """A byte tensor over a new file of ``nbytes`` in ``folder``, unlinked once mapped."""
    fd, path = tempfile.mkstemp(prefix="batchmax-tier-", suffix=".bin", dir=folder)
    try:
        os.unlink(path)  # nameless from here on: freed when the mapping closes, or when the process ends
        os.ftruncate(fd, max(nbytes, 1))
        mapped = mmap.mmap(fd, max(nbytes, 1))
    finally:
        os.close(fd)
    return torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes), mapped


class Tier:
    """The recall tiers of a pool's rows (``rows``: pool row -> ``RowTier``) for ``layers`` layers of ``heads`` local KV
    heads of ``dim``-wide keys/values in ``dtype``; on the device ``device``'s slower memory (the CPU: files in
    ``folder``, default ``$BATCHMAX_TIER_DIR`` or the temporary folder; a GPU: pinned host memory)."""

    def __init__(self, layers: int, heads: int, dim: int, dtype: torch.dtype, device, folder: str | None = None):
        self.layers, self.heads, self.dim, self.dtype = layers, heads, dim, dtype
        self.device = torch.device(device)
        self.folder = folder or os.environ.get(DIR_ENV) or tempfile.gettempdir()
        self.rows: dict[int, RowTier] = {}
        self.peak_row_bytes = 0  # the most one request's tier held (bytes)

    def row_bytes(self, capacity: int) -> int:
        """Bytes of one request's tier of ``capacity`` pairs per (layer, head)."""
        n = self.layers * self.heads * capacity
        return n * (2 * self.dim * self.dtype.itemsize + 8 + 4)

    def open(self, row: int, capacity: int) -> RowTier:
        """Row ``row``'s tier, made for ``capacity`` pairs per (layer, head) when it has none."""
        if row in self.rows:
            return self.rows[row]
        L, H, M, D = self.layers, self.heads, capacity, self.dim
        kv = 2 * L * H * M * D * self.dtype.itemsize
        nbytes = self.row_bytes(capacity)
        if self.device.type == "cpu":
            raw, handle = _file_backed(nbytes, self.folder)
        else:
            raw, handle = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), None
        keys, values = raw[:kv].view(self.dtype).view(2, L, H, M, D).unbind(0)
        pos = raw[kv : kv + 8 * L * H * M].view(torch.int64).view(L, H, M)
        score = raw[kv + 8 * L * H * M :].view(torch.float32).view(L, H, M)
        tier = self.rows[row] = RowTier(keys, values, pos, score, nbytes, handle=handle)
        self.peak_row_bytes = max(self.peak_row_bytes, nbytes)
        log.debug("recall tier of row %d: %.1f MiB (%s)", row, nbytes / 2**20, self.folder if handle else "host")
        return tier

    def store(
        self,
        row: int,
        capacity: int,
        offset: int,
        layers: slice,
        keys: torch.Tensor,
        values: torch.Tensor,
        pos: torch.Tensor,
        score: torch.Tensor,
    ) -> None:
        """Store the pairs ``keys``/``values`` [n, H, k, D] with ``pos``/``score`` [n, H, k] of the layers ``layers`` of
        row ``row`` at ``[offset, offset + k)`` (the eviction's place in the row's order, from its description: a wide
        pass stores its blocks' evictions a layer at a time)."""
        tier = self.open(row, capacity)
        at = slice(offset, offset + keys.shape[2])
        if at.stop > tier.pos.shape[-1]:
            raise RuntimeError(f"recall tier of row {row}: {at.stop} pairs a head, made for {tier.pos.shape[-1]}")
        tier.keys[layers, :, at] = keys.cpu()
        tier.values[layers, :, at] = values.cpu()
        tier.pos[layers, :, at] = pos.cpu()
        tier.score[layers, :, at] = score.cpu()

    def drop(self, row: int) -> None:
        """Row ``row``'s tier is over (recalled, or its request ended): its memory or file freed."""
        tier = self.rows.pop(row, None)
        if tier is not None:
            tier.keys = tier.values = tier.pos = tier.score = None
            if tier.handle is not None:
                try:
                    tier.handle.close()
                except BufferError:  # a view still exported: freed with it
                    pass

    def close(self) -> None:
        for row in list(self.rows):
            self.drop(row)

    def held_bytes(self) -> int:
        return sum(t.nbytes for t in self.rows.values())
