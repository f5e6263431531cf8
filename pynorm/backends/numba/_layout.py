"""Work layout of the ``numba`` backend: chunk, block and tile sizes, and which path a call takes.

Numba-free (the host code decides paths without importing the kernels). Every rule here is
a function of the shapes and dtypes only, never of the thread count, so results never depend
on the number of threads.
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "CHUNK",
    "COL_TILE",
    "EW_TILE",
    "FUSED_MAX_SMALL",
    "FUSED_MIN_ROWS",
    "LANES",
    "PF_CHUNK",
    "ROW_BLOCK",
    "SPLIT_SEG",
    "STREAM_MIN_BYTES",
    "STREAM_MIN_ROW",
    "blocks",
    "tiles",
    "use_fused",
    "use_stream",
]

#: elements per chunk of a row sum accumulated in the math type before it is added in float64.
CHUNK = 1024
#: rows per block of the weight/bias gradient partial sums (fixed => results independent of threads).
ROW_BLOCK = 32
#: columns per task of the reductions over blocks and of the column-parallel gradient kernels.
COL_TILE = 256
#: below this many rows the backward computes dx by rows, then dweight/dbias by column tiles, where the input has
#: at least :data:`FUSED_MAX_SMALL` elements; smaller inputs take the fused path at every row count. The rows path
#: is for calls that run on several threads with too few row blocks to share (a fused row block is 32 rows): a call
#: below :data:`._threads.SERIAL_THRESHOLD` elements runs on one thread, where the fused path (dx and the partials
#: in one pass over the rows) is 10-23 % faster than the rows path at every row count from 4 to 127 (LayerNorm and
#: RMSNorm float32, H = 1024-8192, 1 and 2 threads, AVX-512; docs/numba.md).
FUSED_MIN_ROWS = 4 * ROW_BLOCK
FUSED_MAX_SMALL = 1 << 20

#: columns per segment of a row split across threads (:mod:`._split_kernels`; a multiple of :data:`CHUNK`)
SPLIT_SEG = 4 * CHUNK

#: columns per task of the element-wise family's kernels (tasks: row, or row block, times column tile).
EW_TILE = 2048

#: elements per piece of the element-wise family's tile computed while the same piece of its next task's input is asked
#: of the cache (:func:`._storage.prefetch`)
PF_CHUNK = 512

#: outputs of at least this many bytes are written with streaming stores (much larger than the caches).
STREAM_MIN_BYTES = 1 << 24
#: ... and rows of at least this many elements (shorter rows lose more to the split loops than they gain).
STREAM_MIN_ROW = 1024
#: float32 lanes per streaming store (one 64-byte cache line).
LANES = 16


def use_stream(out: np.ndarray) -> bool:
    """Whether a kernel writes ``out`` (storage form) with streaming stores: large float32 outputs only."""
    return bool(out.dtype == np.float32 and out.nbytes >= STREAM_MIN_BYTES and out.shape[-1] >= STREAM_MIN_ROW)


def use_fused(rows: int, hidden: int) -> bool:
    """The backward's path for an ``(rows, hidden)`` input: a function of the shape only (never of threads)."""
    return rows >= FUSED_MIN_ROWS or rows * hidden < FUSED_MAX_SMALL


def blocks(rows: int) -> int:
    """Row blocks of :data:`ROW_BLOCK` rows in ``rows`` (the tasks of the fused backward's kernels)."""
    return -(-rows // ROW_BLOCK)


def tiles(hidden: int, tile: int = COL_TILE) -> int:
    """Column tiles of ``tile`` columns in ``hidden`` (the tasks of the column-parallel kernels)."""
    return -(-hidden // tile)
