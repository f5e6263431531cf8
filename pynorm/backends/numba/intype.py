"""``casting="none"`` of LayerNorm and RMSNorm on the ``numba`` backend: every operation in ``x``'s dtype.

:class:`InType` runs :mod:`._intype_kernels` for :class:`pynorm.composite.casting.Casting` (which builds the
op's ctx): ``forward(...) -> (y, mean, rstd)`` and ``backward(...) -> (dx, dweight, dbias)`` on ``(R, H)``
arrays, the sequences of :mod:`pynorm.reference.casting`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..._dtypes import round_to
from . import _common as cm
from . import _intype_kernels as k
from ._layout import tiles
from ._threads import launch

__all__ = ["InType"]


def _in_dtype(p: Any, dtype: Any, offset: float = 0.0) -> np.ndarray | None:
    """``rnd(p + offset)`` in ``dtype``, as contiguous float64 values (None stays None)."""
    if p is None:
        return None
    return np.ascontiguousarray(round_to(p.astype(np.float64) + offset, dtype), dtype=np.float64)


class InType:
    """The in-dtype kernels of LayerNorm (``centered``) or RMSNorm."""

    def __init__(self, centered: bool) -> None:
        self.centered = centered

    def forward(
        self, x: np.ndarray, weight: Any, bias: Any, *, eps: float, correction: int = 0, eps_mode: str = "var",
        weight_offset: float = 0.0, out: Any = None,
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
        rows, h = x.shape
        y = cm.output(out, x.shape, x.dtype)
        mean = np.zeros(rows)
        rstd = np.empty(rows)
        if rows:
            launch(
                k.fwd, rows * h, rows, cm.storage(x), _in_dtype(weight, x.dtype, weight_offset),
                _in_dtype(bias, x.dtype), self.centered, float(eps), int(correction), eps_mode == "std",
                cm.storage(y), mean, rstd,
            )  # fmt: skip
        return y, mean, rstd

    def backward(
        self, dy: np.ndarray, x: np.ndarray, weight: Any, bias: Any, mean: Any, rstd: Any, *, eps: float,
        correction: int = 0, eps_mode: str = "var", weight_offset: float = 0.0, dx_out: Any = None,
    ) -> tuple[np.ndarray, Any, Any]:  # fmt: skip
        rows, h = x.shape
        dx = cm.output(dx_out, x.shape, x.dtype)
        pw = np.zeros(h) if weight is not None else None
        pb = np.zeros(h) if bias is not None else None
        if rows:
            xs, dys = cm.storage(x), cm.storage(dy)
            we = _in_dtype(weight, x.dtype, weight_offset)
            std = eps_mode == "std"
            launch(k.bwd, rows * h, rows, xs, dys, we, self.centered, float(eps), int(correction), std, cm.storage(dx))
            if pw is not None or pb is not None:
                m = cm.stats(mean) if mean is not None else np.zeros(rows)
                launch(k.params, rows * h, tiles(h), xs, dys, self.centered, m, cm.stats(rstd), pw, pb)
        dweight = None if pw is None else round_to(pw, weight.dtype)
        dbias = None if pb is None else round_to(pb, bias.dtype)
        return dx, dweight, dbias
