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
Rows are independent (tasks of :func:`._threads.launch`), so the results do not depend on the thread count.
"""

from __future__ import annotations

import numpy as np
from numba import types
from numba.extending import overload

from ._borrow import borrow
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
        u = np.float64(d) / (hd * np.float64(h - corr))
        var = 0.0 if d == 0 else u * (xsi * xsi)
        r = 1.0 / (np.sqrt(var) + eps) if std else 1.0 / np.sqrt(var + eps)
        k = (xsi * r) / hd
        if np.isinf(var):  # xsi * xsi overflowed: the scale from the integer row's own spread
            r = 1.0 / (xsi * np.sqrt(u))
            k = 1.0 / (hd * np.sqrt(u))
        if d == 0 and eps > 0:
            k = 0.0  # a constant row: yhat = 0 exactly, even where xsi * r overflows
        return s1, k, (np.float64(s1) / hd) * xsi, r

    return impl


def load_row(src, st, i, buf):  # type: ignore[no-untyped-def]
    """Row ``i`` of ``y`` in float64 into ``buf`` (``st``: the row's :func:`row_state`)."""
    raise RuntimeError(JIT_ONLY)


@overload(load_row, inline="always")
def _load_row_ol(src, st, i, buf):  # type: ignore[no-untyped-def]
    if isinstance(src, types.Array):

        def load(src, st, i, buf):  # type: ignore[no-untyped-def]
            for j in range(buf.shape[0]):
                buf[j] = np.float64(ld(src[i, j]))

        return load

    def impl(src, st, i, buf):  # type: ignore[no-untyped-def]
        x, weff, b, has_w, has_b = src[0], src[2], src[3], src[4], src[5]
        s1, k = st[0], st[1]
        hh = np.int64(x.shape[1])
        xr = x[i]
        for j in range(buf.shape[0]):  # the difference is exact; then one rounding per operation
            buf[j] = np.float64(np.int64(xr[j]) * hh - s1) * k
        if has_w:
            for j in range(buf.shape[0]):
                buf[j] = buf[j] * weff[j]
        if has_b:
            for j in range(buf.shape[0]):
                buf[j] = buf[j] + b[j]

    return impl


@jit(inline="always")
def _scale(amax):  # type: ignore[no-untyped-def]
    """``float32(amax / 127)``, 1 where that is not a positive finite float32."""
    s = np.float32(amax / _QMAX)
    if s > 0 and s < np.inf:
        return s
    return np.float32(1.0)


@jit(inline="always")
def _codes(buf, sd, qr, kr, with_keep):  # type: ignore[no-untyped-def]
    """``qr = clip(rint(buf / sd), -127, 127)`` (0 for NaN), branch-free; ``kr`` False where it clipped."""
    for j in range(buf.shape[0]):
        t = np.rint(buf[j] / sd)
        c = t if t == t else 0.0
        c = _QMAX if c > _QMAX else c
        c = -_QMAX if c < -_QMAX else c
        qr[j] = np.int8(c)
    if with_keep:
        for j in range(buf.shape[0]):
            kr[j] = not (abs(np.rint(buf[j] / sd)) > _QMAX)


@jit(inline="always")
def _amax(buf):  # type: ignore[no-untyped-def]
    """``max |buf|`` ignoring NaN (which never compares greater), 0 for an empty or all-NaN row; four
    independent maxima (exact and order-free, so the result is the same) to break the dependency chain."""
    a0 = a1 = a2 = a3 = 0.0
    n = buf.shape[0]
    j = 0
    while j + 4 <= n:
        v0, v1, v2, v3 = abs(buf[j]), abs(buf[j + 1]), abs(buf[j + 2]), abs(buf[j + 3])
        a0 = v0 if v0 > a0 else a0
        a1 = v1 if v1 > a1 else a1
        a2 = v2 if v2 > a2 else a2
        a3 = v3 if v3 > a3 else a3
        j += 4
    while j < n:
        v = abs(buf[j])
        a0 = v if v > a0 else a0
        j += 1
    a0 = a1 if a1 > a0 else a0
    a2 = a3 if a3 > a2 else a2
    return a2 if a2 > a0 else a0


#: epilogues of :func:`quant_rows`
FLOAT, AMAX, ROW, GIVEN = 0, 1, 2, 3


@jit()
def quant_rows(src, mode, s_given, y, q, srow, amax, keep, mean, rstd, lo, hi):  # type: ignore[no-untyped-def]
    """Rows ``lo <= i < hi`` of the source through the epilogue ``mode`` (see the module doc): :data:`FLOAT`
    writes ``y``, :data:`AMAX` ``amax``, :data:`ROW` ``q`` and ``srow``, :data:`GIVEN` ``q`` with ``s_given``
    and ``keep`` when it has rows; an int8 source's ``mean``/``rstd`` when they have rows. The outputs a call
    does not write may be empty arrays (one signature per source type). Each row is computed once into a
    float64 buffer, then stored or quantized from it."""
    src, y, q, srow, amax, keep, mean, rstd = borrow((src, y, q, srow, amax, keep, mean, rstd))
    h = _shape(src)[1]
    with_stats = mean.shape[0] > 0
    with_keep = keep.shape[0] > 0
    buf = np.empty(h)
    for i in range(lo, hi):
        st = row_state(src, i)
        if with_stats:
            mean[i] = st[2]
            rstd[i] = st[3]
        load_row(src, st, i, buf)
        if mode == FLOAT:
            yr = y[i]
            for j in range(h):
                yr[j] = np.float32(buf[j])
        elif mode == GIVEN:
            _codes(buf, s_given, q[i], keep[i] if with_keep else keep[0:0].reshape(-1), with_keep)
        else:
            a = _amax(buf)
            if mode == AMAX:
                amax[i] = a
            else:
                s = _scale(a)
                srow[i] = s
                _codes(buf, np.float64(s), q[i], keep[0:0].reshape(-1), False)


def _shape(src):  # type: ignore[no-untyped-def]
    """``(rows, H)`` of a source."""
    raise RuntimeError(JIT_ONLY)


@overload(_shape, inline="always")
def _shape_ol(src):  # type: ignore[no-untyped-def]
    if isinstance(src, types.Array):
        return lambda src: src.shape
    return lambda src: src[0].shape


@jit()
def dequantize(x, xs, out, lo, hi):  # type: ignore[no-untyped-def]
    """``out = x * x_scale`` rounded to ``out``'s dtype (float32, or float64: exact) for rows ``lo <= i < hi``
    (the real input of an int8 ``x``, for the backward)."""
    x, xs, out = borrow((x, xs, out))
    h = x.shape[1]
    for i in range(lo, hi):
        s = xs[i]
        for j in range(h):
            out[i, j] = np.float64(x[i, j]) * s  # one rounding to out's dtype


@jit()
def masked(dy, keep, out, lo, hi):  # type: ignore[no-untyped-def]
    """``out = dy`` where ``keep``, else 0, for rows ``lo <= i < hi`` (storage arrays of one dtype; the
    straight-through gradient)."""
    dy, keep, out = borrow((dy, keep, out))
    h = dy.shape[1]
    for i in range(lo, hi):
        for j in range(h):
            if keep[i, j]:
                out[i, j] = dy[i, j]
            else:
                out[i, j] = 0
