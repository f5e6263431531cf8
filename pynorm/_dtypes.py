"""Dtypes, at the bottom of pynorm's layers (it imports nothing of pynorm): names (bfloat16 through ``ml_dtypes``),
``finfo``, correct rounding to a dtype and the reference's working precision.

The reference computes every op in a *working precision* wider than its inputs and rounds each result once:

* float16, bfloat16 and float32 inputs are computed in float64 (53-bit significand, 11-bit exponent: the
  squares of any float32 value cannot overflow and sums of up to 2**29 products of two float32 numbers are
  exact);
* float64 inputs are computed in ``numpy.longdouble`` where that type is wider than float64 (x87 80-bit
  extended on x86-64: 64-bit significand, 15-bit exponent; IEEE quad on aarch64 Linux). There the squares of
  any float64 value cannot overflow either, so no row scaling is needed. Where ``longdouble`` is plain float64
  (Windows, macOS on Apple silicon) the reference falls back to float64 and :data:`EXTENDED_FLOAT64` is False:
  results stay correct to a few ulps on ordinary data but rows whose squares overflow float64 (|x| > 1e154)
  are not guaranteed finite there.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

__all__ = [
    "EXTENDED_FLOAT64",
    "FLOAT_DTYPES",
    "dtype_name",
    "dtype_of",
    "finfo",
    "have_bfloat16",
    "round_to",
    "rounded",
    "working_dtype",
]

#: the float dtypes every op takes (by name)
FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def have_bfloat16() -> bool:
    """Whether ``ml_dtypes`` (bfloat16) is installed."""
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        return False
    return True


def dtype_of(d: Any) -> np.dtype[Any]:
    """The NumPy dtype named ``d`` (``"bfloat16"`` through ``ml_dtypes``), or ``np.dtype(d)``."""
    if isinstance(d, np.dtype):
        return d
    if isinstance(d, str) and d == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(d)


def _name(d: Any) -> str:
    if isinstance(d, str):
        return d.rpartition(".")[2]
    name = getattr(d, "name", None)
    return name if isinstance(name, str) else str(d).rpartition(".")[2]


_NAMES: dict[Any, str] = {}


def dtype_name(d: Any) -> str:
    """The name of a dtype or dtype-like object (``torch.float16`` reads ``float16``), cached: NumPy computes
    ``dtype.name`` in Python, which costs microseconds on every call of a small op."""
    try:
        return _NAMES[d]
    except KeyError:
        n = _NAMES[d] = _name(d)
        return n
    except TypeError:  # an unhashable dtype-like object
        return _name(d)


def finfo(dtype: Any) -> Any:
    """``numpy.finfo`` that also knows ``ml_dtypes.bfloat16``."""
    dt = dtype_of(dtype)
    if dt.name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.finfo(dt)
    return np.finfo(dt)


_LD = np.finfo(np.longdouble)
#: True when ``numpy.longdouble`` has more significand and exponent bits than float64.
EXTENDED_FLOAT64: bool = bool(_LD.nmant > 52 and _LD.maxexp > 1024)
_WP64 = np.dtype(np.longdouble) if EXTENDED_FLOAT64 else np.dtype(np.float64)


@functools.lru_cache(maxsize=256)
def working_dtype(*dtypes: Any) -> np.dtype[Any]:
    """The dtype the reference computes in for inputs of ``dtypes`` (None entries ignored; cached: a small call's
    microseconds)."""
    widest = max(np.dtype(d).itemsize for d in dtypes if d is not None)
    return _WP64 if widest >= 8 else np.dtype(np.float64)


def _to_bfloat16(a: np.ndarray, dtype: np.dtype[Any]) -> np.ndarray:
    # ml_dtypes before 0.7 converted float64 -> bfloat16 through float32, rounding twice.
    # Rounding to float32 *to odd* first makes the second rounding exact-correct
    # (float32 carries 24 bits, more than bfloat16's 8 + 2), whichever version is installed.
    a = np.asarray(a)
    f = a.astype(np.float32)
    back = f.astype(a.dtype)
    inexact = np.isfinite(a) & (back != a)
    # truncate toward zero where round-to-nearest went away from zero
    away = inexact & (np.abs(back) > np.abs(a))
    f = np.where(away, np.nextafter(f, np.float32(0)), f)
    bits = f.view(np.uint32).copy()
    bits[inexact] |= np.uint32(1)
    return bits.view(np.float32).astype(dtype)


def round_to(a: Any, dtype: Any) -> np.ndarray:
    """Round ``a`` (working precision) once, correctly (to nearest, ties to even), to ``dtype``; beyond the
    dtype's range to ±inf, as IEEE says."""
    with np.errstate(over="ignore", invalid="ignore"):
        return rounded(a, dtype)


def rounded(a: Any, dtype: Any) -> np.ndarray:
    """:func:`round_to` for code that runs with NumPy's ``over`` and ``invalid`` errors ignored already (the bodies of
    the reference's ops, :func:`pynorm.reference._common._ieee`): ``round_to``'s own ``np.errstate`` costs about a
    microsecond, a large share of a small call."""
    dtype = dtype_of(dtype)
    if dtype_name(dtype) == "bfloat16":  # (cached: NumPy computes dtype.name in Python)
        return _to_bfloat16(a, dtype)
    return np.asarray(a).astype(dtype)
