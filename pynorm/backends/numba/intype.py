"""The ``numba`` backend's pieces of the casting policies (``COMPOSED["casting"]`` of the package): what
:mod:`pynorm.composite.casting` -- composed above the backend by the registry -- runs besides the backend's ops.

* :class:`InType`: ``casting="none"`` of LayerNorm and RMSNorm, every operation in ``x``'s dtype:
  :mod:`._intype_kernels`, ``forward(...) -> (y, mean, rstd)`` and ``backward(...) -> (dx, dweight, dbias)`` on
  ``(R, H)`` arrays, the sequences of :mod:`pynorm.reference.casting` (the composite builds the op's ctx);
* :func:`cast`, :func:`copy_into`: the array conversions the policies need, for NumPy arrays.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..._dtypes import round_to
from ...ops.families import R_OUTSIDE, kernel_args, statistic_of
from . import _common as common
from . import _intype_kernels as kernels
from ._layout import tiles
from ._threads import launch

__all__ = ["InType", "cast", "copy_into"]


def cast(a: Any, dtype: Any) -> np.ndarray:
    """A copy of ``a`` rounded once to ``dtype`` (the reference's correct rounding), C-contiguous."""
    return np.ascontiguousarray(round_to(a, dtype))


def copy_into(dst: np.ndarray, src: np.ndarray) -> None:
    """``dst[...] = src`` for arrays of one dtype."""
    np.copyto(dst, src, casting="no")


def _in_dtype(p: Any, dtype: Any, offset: float = 0.0) -> np.ndarray | None:
    """``rnd(p + offset)`` in ``dtype``, as contiguous values of the kernels' math type (None stays None)."""
    if p is None:
        return None
    return np.ascontiguousarray(round_to(p.astype(np.float64) + offset, dtype), dtype=kernels.math_dtype(dtype))


def _exact(x: np.ndarray) -> bool:
    """Whether the kernels may reassociate ``x``'s row sums (exact: float16 rows of at most ``EXACT_H``)."""
    return x.dtype == np.float16 and x.shape[1] <= kernels.EXACT_H


class InType:
    """The in-dtype kernels of ``spec``'s op (LayerNorm or RMSNorm: whether its statistic centres the row, and its
    conventions read by :func:`pynorm.ops.families.kernel_args`)."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        self.centered = statistic_of(spec).mean

    def forward(
        self, x: np.ndarray, weight: Any, bias: Any, *, out: Any = None, **conventions: Any
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(y, mean, rstd)`` of ``x`` with the op's ``conventions`` (its options but ``casting``)."""
        kargs = kernel_args(self.spec, conventions)
        rows, h = x.shape
        y = common.output(out, x.shape, x.dtype)
        mean = np.zeros(rows)
        rstd = np.empty(rows)
        if rows:
            launch(
                kernels.fwd, rows * h, rows, common.storage(x), _in_dtype(weight, x.dtype, kargs.weight_offset),
                _in_dtype(bias, x.dtype), self.centered, kargs.eps, kargs.correction, kargs.mode == R_OUTSIDE,
                _exact(x), common.storage(y), mean, rstd,
            )  # fmt: skip
        return y, mean, rstd

    def backward(
        self, dy: np.ndarray, x: np.ndarray, weight: Any, bias: Any, mean: Any, rstd: Any, *, dx_out: Any = None,
        **conventions: Any,
    ) -> tuple[np.ndarray, Any, Any]:  # fmt: skip
        """``(dx, dweight, dbias)`` from the forward's ``mean``/``rstd`` and ``conventions``."""
        kargs = kernel_args(self.spec, conventions)
        rows, h = x.shape
        dx = common.output(dx_out, x.shape, x.dtype)
        pw = np.zeros(h) if weight is not None else None
        pb = np.zeros(h) if bias is not None else None
        if rows:
            xs, dys = common.storage(x), common.storage(dy)
            we = _in_dtype(weight, x.dtype, kargs.weight_offset)
            m = common.stats(mean) if mean is not None else np.zeros(rows)
            r = common.stats(rstd)
            launch(
                kernels.bwd, rows * h, rows, xs, dys, we, self.centered, kargs.eps, kargs.correction,
                kargs.mode == R_OUTSIDE, _exact(x), m, r, common.storage(dx),
            )  # fmt: skip
            if pw is not None or pb is not None:
                launch(kernels.params, rows * h, tiles(h), xs, dys, self.centered, m, r, pw, pb)
        dweight = None if pw is None else round_to(pw, weight.dtype)
        dbias = None if pb is None else round_to(pb, bias.dtype)
        return dx, dweight, dbias
