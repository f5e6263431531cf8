# numba's type stubs do not model intrinsics, overload stubs or jitted calls:
# mypy: disable-error-code="call-arg,attr-defined,var-annotated,call-overload"
r"""The quantize family's kernels: one row skeleton, its source and its epilogue chosen by argument type.

Source (``src``, chosen by type at compile time, :func:`row_state` / :func:`value`):

* an int8 source, the tuple ``(x, x_scale, weff, bias, has_weight, has_bias, eps, correction, std)``: each
  row's exact integer sums ``S1 = sum x``, ``S2 = sum x^2`` (int64), then the fixed float64 sequence of
  :mod:`pynorm.reference.quant_norm` (the same operations in the same order, each rounded once, no
  contraction: every function here is compiled with ``fastmath=False``), and the row's ``mean`` and
  ``rstd``; ``weff``/``bias`` float64 arrays (empty when absent: run-time flags, one signature);
* a float source, the ``(R, H)`` storage array of an already normalized ``y`` (the statistics family's
  LayerNorm output): its values, exactly, in float64.

Epilogue (``mode``, a run-time value; outputs a mode does not write are empty arrays, so each source type
compiles once): :data:`FLOAT` -- store ``y`` rounded once to float32; :data:`AMAX` -- only the row's
``max |y|`` (NaN ignored: the first pass of a per-tensor scale); :data:`ROW` -- ``q`` with the row's own
scale ``s = float32(amax / 127)`` (1 where not positive finite), stored in ``srow``; :data:`GIVEN` -- ``q``
with the given ``s_given``, and ``keep`` (False where the clip changed the value) when it is not empty.
Rows are independent (``prange``), so the results do not depend on the thread count.
"""

from __future__ import annotations

import numpy as np
from numba import prange, types
from numba.extending import overload

from ._cache import jit
from ._storage import JIT_ONLY, ld

__all__ = ["AMAX", "FLOAT", "GIVEN", "ROW", "dequantize", "masked", "quant_rows"]

_QMAX = 127.0


def row_state(src, i):  # type: ignore[no-untyped-def]
    """``(S1, k, mean, rstd)`` of row ``i`` of an int8 source, ``(0, 0.0, 0.0, 0.0)`` for a float source."""
    raise RuntimeError(JIT_ONLY)


@overload(row_state, inline="always")
def _row_state_ol(src, i):  # type: ignore[no-untyped-def]
    if isinstance(src, types.Array):
        return lambda src, i: (np.int64(0), 0.0, 0.0, 0.0)

    def impl(src, i):  # type: ignore[no-untyped-def]
        x, xs, eps, corr, std = src[0], src[1], src[6], src[7], src[8]
        h = x.shape[1]
        s1 = np.int64(0)
        s2 = np.int64(0)
        for j in range(h):
            v = np.int64(x[i, j])
            s1 += v
            s2 += v * v
        d = np.int64(h) * s2 - s1 * s1
        hd = np.float64(h)
        xsi = xs[i]
        var = (np.float64(d) / (hd * np.float64(h - corr))) * (xsi * xsi)
        r = 1.0 / (np.sqrt(var) + eps) if std else 1.0 / np.sqrt(var + eps)
        return s1, (xsi * r) / hd, (np.float64(s1) / hd) * xsi, r

    return impl


def value(src, st, i, j):  # type: ignore[no-untyped-def]
    """Element ``(i, j)`` of ``y`` in float64 (``st``: the row's :func:`row_state`)."""
    raise RuntimeError(JIT_ONLY)


@overload(value, inline="always")
def _value_ol(src, st, i, j):  # type: ignore[no-untyped-def]
    if isinstance(src, types.Array):
        return lambda src, st, i, j: np.float64(ld(src[i, j]))

    def impl(src, st, i, j):  # type: ignore[no-untyped-def]
        x, weff, b, has_w, has_b = src[0], src[2], src[3], src[4], src[5]
        s1, k = st[0], st[1]
        v = np.float64(np.int64(x[i, j]) * np.int64(x.shape[1]) - s1) * k  # the difference is exact
        if has_w:
            v = v * weff[j]
        if has_b:
            v = v + b[j]
        return v

    return impl


@jit(inline="always")
def _scale(amax):  # type: ignore[no-untyped-def]
    """``float32(amax / 127)``, 1 where that is not a positive finite float32."""
    s = np.float32(amax / _QMAX)
    if s > 0 and s < np.inf:
        return s
    return np.float32(1.0)


@jit(inline="always")
def _code(v, sd):  # type: ignore[no-untyped-def]
    """``(q, keep)`` of one value: ``clip(rint(v / sd), -127, 127)``, 0 for NaN; keep False where it clipped."""
    t = np.rint(v / sd)
    if t != t:
        return np.int8(0), True
    if t > _QMAX:
        return np.int8(127), False
    if t < -_QMAX:
        return np.int8(-127), False
    return np.int8(t), True


#: epilogues of :func:`quant_rows`
FLOAT, AMAX, ROW, GIVEN = 0, 1, 2, 3


@jit(parallel=True)
def quant_rows(src, mode, s_given, y, q, srow, amax, keep, mean, rstd):  # type: ignore[no-untyped-def]
    """Every row of the source through the epilogue ``mode`` (see the module doc): :data:`FLOAT` writes ``y``,
    :data:`AMAX` ``amax``, :data:`ROW` ``q`` and ``srow``, :data:`GIVEN` ``q`` with ``s_given`` and ``keep`` when
    it has rows; an int8 source's ``mean``/``rstd`` when they have rows. The outputs a call does not write
    may be empty arrays (one signature per source type; arrays inside the source tuple are read only:
    numba's parallel loops do not write through them)."""
    rows, h = _shape(src)
    with_stats = mean.shape[0] > 0
    for i in prange(rows):
        st = row_state(src, i)
        if with_stats:
            mean[i] = st[2]
            rstd[i] = st[3]
        if mode == FLOAT:
            for j in range(h):
                y[i, j] = np.float32(value(src, st, i, j))
        elif mode == GIVEN:
            with_keep = keep.shape[0] > 0
            for j in range(h):
                c, kp = _code(value(src, st, i, j), s_given)
                q[i, j] = c
                if with_keep:
                    keep[i, j] = kp
        else:
            a = 0.0
            for j in range(h):
                v = abs(value(src, st, i, j))
                if v > a:
                    a = v
            if mode == AMAX:
                amax[i] = a
            else:
                s = _scale(a)
                srow[i] = s
                sd = np.float64(s)
                for j in range(h):
                    c, _ = _code(value(src, st, i, j), sd)
                    q[i, j] = c


def _shape(src):  # type: ignore[no-untyped-def]
    """``(rows, H)`` of a source."""
    raise RuntimeError(JIT_ONLY)


@overload(_shape, inline="always")
def _shape_ol(src):  # type: ignore[no-untyped-def]
    if isinstance(src, types.Array):
        return lambda src: src.shape
    return lambda src: src[0].shape


@jit(parallel=True)
def dequantize(x, xs, out):  # type: ignore[no-untyped-def]
    """``out = float32(x * x_scale)`` per row (the real input of an int8 ``x``, for the backward)."""
    rows, h = x.shape
    for i in prange(rows):
        s = xs[i]
        for j in range(h):
            out[i, j] = np.float32(np.float64(x[i, j]) * s)


@jit(parallel=True)
def masked(dy, keep, out):  # type: ignore[no-untyped-def]
    """``out = dy`` where ``keep``, else 0 (storage arrays of one dtype; the straight-through gradient)."""
    rows, h = dy.shape
    for i in prange(rows):
        for j in range(h):
            if keep[i, j]:
                out[i, j] = dy[i, j]
            else:
                out[i, j] = 0
