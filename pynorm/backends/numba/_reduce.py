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


@jit(FM_SUM)
def sum_blocks(p, out, lo, hi):  # type: ignore[no-untyped-def]
    """``out[j] = sum_b p[b, j]`` in float64, blocks in order, rounded once to ``out``'s storage dtype, for the
    columns of tiles ``lo <= t < hi`` (:data:`._layout.COL_TILE` columns each)."""
    p, out = borrow((p, out))
    nb, h = p.shape
    for t in range(lo, hi):
        j0 = t * COL_TILE
        j1 = min(j0 + COL_TILE, h)
        acc = np.zeros(j1 - j0)
        for blk in range(nb):
            pr = p[blk, j0:j1]
            for j in range(j1 - j0):
                acc[j] += np.float64(pr[j])
        o = out[j0:j1]
        for j in range(j1 - j0):
            st_exact(o, j, acc[j])
