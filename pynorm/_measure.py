"""Measuring results: errors in ulps (at the terms' magnitude), the hard inputs, the term scales of each op.

The helpers :mod:`pynorm.testing` offers (it re-exports them) and :mod:`pynorm.oracle` measures with; they live
below both, so that ``pynorm.testing`` can also run the oracle (:func:`pynorm.testing.assert_matches_reference`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ._dtypes import dtype_of, finfo

__all__ = [
    "HARD_CASES",
    "assert_ulp_close",
    "flat_arrays",
    "make_input",
    "max_ulp_error",
    "term_scales",
    "ulp",
    "ulp_error",
]


def ulp(value: Any, dtype: Any) -> np.ndarray:
    """Spacing of ``dtype``'s numbers at ``|value|`` (float64 array; subnormal spacing near 0)."""
    fi = finfo(dtype)
    a = np.abs(np.asarray(value, dtype=np.float64))
    tiny = float(fi.smallest_normal)
    with np.errstate(divide="ignore"):
        e = np.floor(np.log2(np.maximum(a, tiny)))
    return np.asarray(np.ldexp(1.0, (e - fi.nmant).astype(np.int64)), dtype=np.float64)


def ulp_error(actual: Any, expected: Any, dtype: Any = None, *, scale: Any = None) -> np.ndarray:
    """``|actual - expected|`` in ulps of ``dtype`` at ``max(|expected|, |scale|)``.

    ``dtype`` defaults to ``actual``'s dtype. ``scale`` (broadcastable) is the
    magnitude of the terms the result was computed from, e.g. ``sum(|terms|)`` of
    a reduction; without it the error is measured at the result itself. Both
    infinite or both NaN with the same sign count as 0 ulps; otherwise a
    non-finite mismatch is ``inf``.
    """
    actual = np.asarray(actual)
    dtype = actual.dtype if dtype is None else dtype
    a = actual.astype(np.float64)
    e = np.asarray(expected, dtype=np.float64)
    mag = np.abs(e) if scale is None else np.maximum(np.abs(e), np.abs(np.asarray(scale, dtype=np.float64)))
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.abs(a - e) / ulp(mag, dtype)
    same = (a == e) | (np.isnan(a) & np.isnan(e))
    err = np.where(same, 0.0, err)
    return np.where(np.isnan(err), np.inf, err)


def max_ulp_error(actual: Any, expected: Any, dtype: Any = None, *, scale: Any = None) -> float:
    """Largest :func:`ulp_error` (0.0 for empty arrays)."""
    err = ulp_error(actual, expected, dtype, scale=scale)
    return float(err.max()) if err.size else 0.0


def assert_ulp_close(
    actual: Any, expected: Any, max_ulps: float, dtype: Any = None, *, scale: Any = None, err_msg: str = ""
) -> None:
    """Raise AssertionError unless every element is within ``max_ulps`` (see :func:`ulp_error`)."""
    err = ulp_error(actual, expected, dtype, scale=scale)
    if err.size and not float(err.max()) <= max_ulps:
        i = np.unravel_index(int(np.argmax(err)), err.shape)
        a = np.asarray(actual).astype(np.float64)[i]
        e = np.asarray(expected, dtype=np.float64)
        e = e[i] if e.ndim else e
        raise AssertionError(
            f"{err_msg + ': ' if err_msg else ''}max error {float(err.max()):.3g} ulps > {max_ulps} "
            f"at index {tuple(int(j) for j in i)} (actual {a!r}, expected {float(e)!r}); "
            f"{int((err > max_ulps).sum())} of {err.size} elements out of bounds"
        )


HARD_CASES = ("normal", "offset", "huge", "tiny", "constant")


def make_input(kind: str, shape: tuple[int, ...], dtype: Any, rng: np.random.Generator) -> np.ndarray:
    """A random input of one of the :data:`HARD_CASES` kinds, in ``dtype``.

    ``normal``: N(0, 1). ``offset``: 1e4 + N(0, 1) (100 + N(0, 1) for 16-bit
    dtypes), where a variance by ``E[x^2] - E[x]^2`` or a low-precision mean
    loses everything. ``huge``: magnitudes up to 90% of the dtype's max (1e38 for
    float32/bfloat16, 1e307 for float64), where sums of squares overflow.
    ``tiny``: 1e-30 (1e-4 for float16) times N(0, 1), below eps. ``constant``:
    every row constant, where the exact deviations are 0.
    """
    dt = dtype_of(dtype)
    n = rng.standard_normal(shape)
    if kind == "normal":
        a = n
    elif kind == "offset":
        a = 1e4 + n if dt.itemsize >= 4 else 100 + n
    elif kind == "huge":
        big = float(np.finfo(np.float16).max if dt == np.float16 else 1e38 if dt.itemsize <= 4 else 1e307)
        a = np.clip(n, -1.0, 1.0) * big * 0.9
    elif kind == "tiny":
        a = n * (1e-30 if dt.itemsize >= 4 and dt.name != "float16" else 1e-4)
    elif kind == "constant":
        a = np.broadcast_to(rng.standard_normal((*shape[:-1], 1)) * 3, shape).copy()
    else:
        raise KeyError(kind)
    return a.astype(dt)


def term_scales(
    op: str, x2: np.ndarray, params: dict[str, Any], dy2: np.ndarray, conv: dict[str, Any]
) -> dict[str, Any]:
    """Magnitude of the terms each output of ``op`` is computed from (float64, ``(R, H)`` inputs).

    The fair yardstick for comparing two implementations: a result that is a small difference
    of large terms can only be as accurate as those terms. Each op defines its own in its spec
    (``pynorm.ops.<op>.term_scales``; e.g. LayerNorm measures ``y`` at the row's own unit, not at
    the offset ``|mean|``). Returns a dict of float64 arrays keyed ``y``, ``dx``, ``d<param>``.
    """
    from .ops import get

    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):  # scales beyond float64 are inf
        return get(op).term_scales(x2, params, dy2, conv)


def flat_arrays(spec: Any, x_shape: tuple[int, ...], axis: int, args: Sequence[Any]) -> dict[str, Any]:
    """The extra inputs and parameters of an op by name, flattened as backends see them (for :func:`term_scales`).

    ``spec`` is the op's :class:`pynorm.ops.OpSpec`; ``args`` the arguments after ``x`` (extra inputs, then
    parameters, None where absent) for ``x`` of ``x_shape`` normalized from ``axis``: ``like_x`` inputs become
    ``(R, H)``, row indices and row scales ``(R,)``, ``cond`` ``(G, C)``; feature parameters ``(H,)``, scalars
    ``(1,)``, tables ``(M, H)``, matrices and vectors as given.
    """
    ax = axis % len(x_shape)
    rows, h = int(np.prod(x_shape[:ax])), int(np.prod(x_shape[ax:]))
    out: dict[str, Any] = {}
    for i, a in zip(spec.inputs, args, strict=False):
        if a is None:
            out[i.name] = None
        elif i.kind == "cond":
            out[i.name] = np.asarray(a).reshape(-1, np.shape(a)[-1])
        elif i.kind == "like_x":
            out[i.name] = np.asarray(a).reshape(rows, h)
        else:
            out[i.name] = (
                np.broadcast_to(np.asarray(a).reshape(-1), (rows,)) if np.size(a) == 1 else np.asarray(a).reshape(rows)
            )
    for p, a in zip(spec.params, args[len(spec.inputs) :], strict=True):
        if a is None:
            out[p.name] = None
        elif p.kind in ("matrix", "vector"):
            out[p.name] = np.asarray(a)
        elif p.kind == "table":
            out[p.name] = np.asarray(a).reshape(np.shape(a)[0], h)
        elif p.kind == "scalar":
            out[p.name] = np.asarray(a).reshape(1)
        else:
            out[p.name] = np.broadcast_to(np.asarray(a), tuple(x_shape[ax:])).reshape(h)
    return out
