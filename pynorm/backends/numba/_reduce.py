# numba's type stubs do not model overload stubs or jitted calls:
# mypy: disable-error-code="call-arg,attr-defined,var-annotated,call-overload"
"""Reductions of per-block partial sums (parameter gradients), in a fixed order."""

from __future__ import annotations

import numpy as np

from ._borrow import borrow
from ._cache import FM_SUM, jit
from ._layout import COL_TILE
from ._storage import st_exact

__all__ = ["sum_blocks"]


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
