"""Dtypes for the oracle: names (bfloat16 through ``ml_dtypes``), the constants of the ulp rule, correct rounding,
and the distance of two values in representable steps.

The ulp rule every yardstick of :mod:`pynorm.oracle` uses: ``ulp(v) = 2 ** (max(floor(log2 |v|), emin) - p)``
with ``p`` the explicit mantissa bits of the dtype and ``2 ** emin`` its smallest normal number (below it the
spacing is the subnormal one), as :func:`pynorm.testing.ulp` computes it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .._dtypes import dtype_name, dtype_of, finfo, have_bfloat16, round_to

__all__ = [
    "DTYPE_NAMES",
    "constants",
    "dtype_name",
    "dtype_of",
    "have_bfloat16",
    "round_to",
    "steps_apart",
    "unit_roundoff",
    "working_precision",
]

#: the float dtypes of the conformance grid and of the golden vectors
DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64")


def constants(d: Any) -> dict[str, Any]:
    """The constants of the ulp rule for dtype ``d``: ``mantissa_bits`` (explicit bits ``p``), ``smallest_normal``
    (``2 ** emin``), ``smallest_subnormal`` (the spacing below it, ``2 ** (emin - p)``), ``max`` and
    ``unit_roundoff`` (``2 ** -(p + 1)``), as JSON-ready numbers (exact decimal values of the binary ones)."""
    fi = finfo(dtype_of(d))
    p = int(fi.nmant)
    tiny = float(fi.smallest_normal)
    return {
        "mantissa_bits": p,
        "smallest_normal": tiny,
        "smallest_subnormal": math.ldexp(tiny, -p),
        "max": float(fi.max),
        "unit_roundoff": math.ldexp(1.0, -(p + 1)),
    }


def unit_roundoff(d: Any) -> float:
    """``2 ** -(p + 1)`` for the dtype ``d``: half its spacing at 1, the relative error bound of one rounding."""
    return math.ldexp(1.0, -(int(finfo(dtype_of(d)).nmant) + 1))


def working_precision(d: Any) -> np.dtype[Any]:
    """The precision a correct implementation computes in for input of dtype ``d``: float32 for float16, bfloat16
    and float32, float64 for float64 (what PyTorch, TransformerEngine, Apex and HF do)."""
    return np.dtype(np.float64) if dtype_of(d).itemsize >= 8 else np.dtype(np.float32)


def _ordered(a: np.ndarray, dt: np.dtype[Any]) -> np.ndarray:
    """The values of ``a`` (already of dtype ``dt``) as integers in the order of the reals (-0 and +0 equal)."""
    width = {2: np.int16, 4: np.int32, 8: np.int64}[dt.itemsize]
    i = np.ascontiguousarray(a).view(width).astype(np.int64)
    top = np.int64(1) << np.int64(8 * dt.itemsize - 1)
    return np.where(i < 0, -(i + top), i)


def steps_apart(a: Any, b: Any, d: Any) -> float:
    """The largest distance between ``a`` and ``b`` in representable values of dtype ``d`` (both rounded to ``d``
    first): 0 for equal values, 1 for neighbours; two NaNs are equal, a NaN and a number ``inf`` apart. 0.0 for
    empty arrays."""
    dt = dtype_of(d)
    x = round_to(np.asarray(a, dtype=np.float64), dt)
    y = round_to(np.asarray(b, dtype=np.float64), dt)
    if x.size == 0:
        return 0.0
    xf, yf = x.astype(np.float64), y.astype(np.float64)
    both_nan = np.isnan(xf) & np.isnan(yf)
    one_nan = np.isnan(xf) != np.isnan(yf)
    if one_nan.any():
        return math.inf
    ok = ~both_nan
    if not ok.any():
        return 0.0
    dist = np.abs(_ordered(x[ok], dt) - _ordered(y[ok], dt))
    return float(dist.max())
