# numba's type stubs do not model overload stubs or jitted calls:
# mypy: disable-error-code="call-arg,attr-defined,var-annotated,call-overload"
"""Reductions of per-block partial sums (parameter gradients), in a fixed order."""

from __future__ import annotations

import math

import numpy as np

from ._borrow import borrow
from ._cache import FM_SUM, jit
from ._layout import COL_TILE, ROW_BLOCK
from ._storage import st_exact

__all__ = ["exact_sum", "sum_blocks", "sum_slots", "table_slots"]


#: columns summed at once (a float64 scratch of 16 KiB): each column is independent, so this changes no result
_SUB = 2048


@jit(FM_SUM)
def sum_blocks(p, out, lo, hi):  # type: ignore[no-untyped-def]
    """``out[j] = sum_b p[b, j]`` in float64, blocks in order, rounded once to ``out``'s storage dtype, for the
    columns of tiles ``lo <= t < hi`` (:data:`._layout.COL_TILE` columns each)."""
    p, out = borrow((p, out))
    nb, h = p.shape
    buf = np.empty(_SUB)  # one scratch per span, not per tile: allocations cost about half of a short call
    c1 = min(hi * COL_TILE, h)
    for j0 in range(lo * COL_TILE, c1, _SUB):
        n = min(_SUB, c1 - j0)
        acc = buf[:n]
        acc[:] = 0.0
        for blk in range(nb):
            pr = p[blk, j0 : j0 + n]
            for j in range(n):
                acc[j] += np.float64(pr[j])
        o = out[j0 : j0 + n]
        for j in range(n):
            st_exact(o, j, acc[j])


@jit()
def table_slots(ids, slot, starts, ptr, order):  # type: ignore[no-untyped-def]
    """The table affine source's partials layout (:mod:`._io`) for rows selecting table rows ``ids`` (each in
    ``0 <= ids[i] < M``, ``M = ptr.shape[0] - 1``): one partials row per (row block, id the block holds), block by
    block, a block's ids in the order they first appear in it. Fills ``slot[i]`` (row ``i``'s partials row),
    ``starts`` (block ``blk``'s rows are ``starts[blk]:starts[blk + 1]``), and ``order[ptr[g]:ptr[g + 1]]`` (id
    ``g``'s partials rows, blocks in order: the order :func:`sum_slots` adds them in); returns the number of
    partials rows, at most ``min(R, blocks * M)``."""
    rows = ids.shape[0]
    nb = starts.shape[0] - 1
    held = np.empty(ROW_BLOCK, np.int64)  # the current block's ids, by slot
    owner = np.empty(rows, np.int64)  # each partials row's id
    ptr[:] = 0
    n = 0
    for blk in range(nb):
        starts[blk] = n
        k = 0
        for i in range(blk * ROW_BLOCK, min(blk * ROW_BLOCK + ROW_BLOCK, rows)):
            g = ids[i]
            s = -1
            for q in range(k):
                if held[q] == g:
                    s = n - k + q
                    break
            if s < 0:
                held[k] = g
                k += 1
                s = n
                owner[n] = g
                n += 1
                ptr[g + 1] += 1
            slot[i] = s
    starts[nb] = n
    for g in range(ptr.shape[0] - 1):
        ptr[g + 1] += ptr[g]
    fill = ptr[:-1].copy()
    for s in range(n):
        g = owner[s]
        order[fill[g]] = s
        fill[g] += 1
    return n


@jit(FM_SUM)
def sum_slots(p, order, ptr, out, lo, hi):  # type: ignore[no-untyped-def]
    """``out[g, j] = sum_k p[order[k], j]`` over ``ptr[g] <= k < ptr[g + 1]`` (:func:`table_slots`: id ``g``'s
    partials rows, blocks in order) in float64, rounded once to ``out``'s storage dtype (an id no row selects gets
    0), for the columns of tiles ``lo <= t < hi``. The sums equal :func:`sum_blocks` of a layout with a row for
    every (block, id), whose rows for an id a block does not hold are zeros: adding ``+0.0`` to a float64 sum
    begun at ``+0.0`` changes no bit."""
    p, order, ptr, out = borrow((p, order, ptr, out))
    m, h = out.shape
    buf = np.empty(_SUB)
    c1 = min(hi * COL_TILE, h)
    for j0 in range(lo * COL_TILE, c1, _SUB):
        n = min(_SUB, c1 - j0)
        acc = buf[:n]
        for g in range(m):
            acc[:] = 0.0
            for k in range(ptr[g], ptr[g + 1]):
                pr = p[order[k], j0 : j0 + n]
                for j in range(n):
                    acc[j] += np.float64(pr[j])
            o = out[g, j0 : j0 + n]
            for j in range(n):
                st_exact(o, j, acc[j])


#: room for :func:`exact_sum`'s partials (float64 has 2098 bit positions, from 2**-1074 to 2**1023)
_PARTIALS = 2100


@jit()
def exact_sum(a):  # type: ignore[no-untyped-def]
    """``(ok, s)``: ``s = math.fsum(a)`` for a float64 array ``a`` of finite values -- the correctly rounded sum --
    by CPython's own algorithm (Shewchuk's non-overlapping partials, then the half-even correction across them),
    compiled without fast-math flags; ``ok`` False where ``fsum`` raises (an intermediate sum overflows). The
    partials are non-overlapping: each holds bits of its own among the 2098 a float64 can hold, so no more than
    2098 are live (random values of every magnitude keep about 90); more would return ``ok`` False."""
    p = np.empty(_PARTIALS)
    n = 0
    for k in range(a.shape[0]):
        x = a[k]
        i = 0
        for j in range(n):
            y = p[j]
            if abs(x) < abs(y):
                x, y = y, x
            hi = x + y
            yr = hi - x
            lo = y - yr
            if lo != 0.0:
                p[i] = lo
                i += 1
            x = hi
        n = i
        if x != 0.0:
            if not math.isfinite(x) or n == _PARTIALS:
                return False, 0.0
            p[n] = x
            n += 1
    hi = 0.0
    if n > 0:
        n -= 1
        hi = p[n]
        lo = 0.0
        while n > 0:
            x = hi
            n -= 1
            y = p[n]
            hi = x + y
            yr = hi - x
            lo = y - yr
            if lo != 0.0:
                break
        if n > 0 and ((lo < 0.0 and p[n - 1] < 0.0) or (lo > 0.0 and p[n - 1] > 0.0)):
            y = lo * 2.0
            x = hi + y
            yr = x - hi
            if y == yr:
                hi = x
    return True, hi
