# numba's type stubs do not model intrinsics, overload stubs or jitted calls:
# mypy: disable-error-code="call-arg,attr-defined,var-annotated,call-overload"
r"""LayerNorm / RMSNorm with every operation rounded to ``x``'s dtype: ``casting="none"``.

The sequences are :mod:`pynorm.reference.casting`'s (``layer_norm_forward_none`` and the others), the same
operations in the same order. Each operation is evaluated in float64 and rounded once to the storage
dtype (:func:`rn`): for ``+ - * / sqrt`` of values of that dtype the float64 result, rounded again, is the
correctly rounded result in the dtype (float64 carries more than ``2p + 2`` bits of every narrower
format), so this *is* arithmetic in float16 / bfloat16 / float32. ``1/sqrt`` is one operation
(``torch.rsqrt``): its float64 value rounded once. Sums accumulate in float64 (as PyTorch's reductions
accumulate wider than their dtype) and are rounded once where the reference rounds them. Compiled with
``fastmath=False``: nothing is contracted or reassociated.

``centered`` selects LayerNorm (mean, centred variance, ``corr``, ``std``: eps outside the root) or
RMSNorm (mean square); ``we``/``bt`` (the weight ``rnd(w + o)`` and the bias ``rnd(b)``, float64 arrays
of values of the dtype) are None where absent. Rows are independent (tasks of :func:`._threads.launch`); the parameter
gradients are summed over rows in row order, per column (:func:`params`): results do not depend on the
thread count.
"""

from __future__ import annotations

import math

import numpy as np
from numba import types
from numba.extending import overload

from ._borrow import borrow
from ._cache import jit
from ._layout import COL_TILE
from ._storage import JIT_ONLY, _bf16_to_f32, _f32_to_bf16, _f32_to_half, _f64_to_f32_odd, _half_to_f32, ld, st_exact

__all__ = ["bwd", "fwd", "params", "rn"]


def rn(a, v):  # type: ignore[no-untyped-def]
    """The float64 ``v`` rounded once to storage array ``a``'s dtype, as a float64."""
    raise RuntimeError(JIT_ONLY)


@overload(rn, inline="always")
def _rn_ol(a, v):  # type: ignore[no-untyped-def]
    if a.dtype == types.float64:
        return lambda a, v: np.float64(v)
    if a.dtype == types.float32:
        return lambda a, v: np.float64(np.float32(v))
    if a.dtype == types.uint16:
        return lambda a, v: np.float64(_bf16_to_f32(_f32_to_bf16(_f64_to_f32_odd(v))))
    if a.dtype == types.int16:
        return lambda a, v: np.float64(_half_to_f32(_f32_to_half(_f64_to_f32_odd(v))))
    return None


@jit()
def _stats(xr, centered, eps, corr, std):  # type: ignore[no-untyped-def]
    """``(m, v, r)`` of one row: mean (0 for RMSNorm), variance or mean square, ``r``."""
    h = xr.shape[0]
    m = 0.0
    s2 = 0.0
    if centered:
        s = 0.0
        for j in range(h):
            s += np.float64(ld(xr[j]))
        m = rn(xr, s / h)
        for j in range(h):
            d = rn(xr, np.float64(ld(xr[j])) - m)
            s2 += rn(xr, d * d)
        v = rn(xr, s2 / (h - corr))
    else:
        for j in range(h):
            xv = np.float64(ld(xr[j]))
            s2 += rn(xr, xv * xv)
        v = rn(xr, s2 / h)
    if std:
        r = rn(xr, 1.0 / rn(xr, rn(xr, math.sqrt(v)) + eps))
    else:
        r = rn(xr, 1.0 / math.sqrt(rn(xr, v + eps)))
    return m, v, r


@jit()
def _xhat(xr, j, centered, m, r):  # type: ignore[no-untyped-def]
    xv = np.float64(ld(xr[j]))
    if centered:
        xv = rn(xr, xv - m)
    return rn(xr, xv * r)


@jit()
def fwd(x, we, bt, centered, eps, corr, std, y, mean, rstd, lo, hi):  # type: ignore[no-untyped-def]
    """``y`` (storage dtype) and the float64 ``mean``/``rstd`` of rows ``lo <= i < hi`` of ``x``."""
    x, y, mean, rstd = borrow((x, y, mean, rstd))  # (we/bt: optional, indexed only)
    for i in range(lo, hi):
        xr = x[i]
        yr = y[i]
        m, _, r = _stats(xr, centered, eps, corr, std)
        for j in range(xr.shape[0]):
            t = _xhat(xr, j, centered, m, r)
            if we is not None:
                t = rn(xr, t * we[j])
            if bt is not None:
                t = rn(xr, t + bt[j])
            st_exact(yr, j, t)
        mean[i] = m
        rstd[i] = r


@jit()
def bwd(x, dy, we, centered, eps, corr, std, dx, lo, hi):  # type: ignore[no-untyped-def]
    """``dx`` of rows ``lo <= i < hi``: ``g = rnd(dy we)``, ``gbar = rnd(sum g / H)``, ``c = rnd(sum rnd(g xhat) / n)``
    (``std``: ``rnd(c / rnd(s r))``, 0 where ``s = 0``), ``dx = rnd(r rnd(rnd(g - gbar) - rnd(xhat c)))``
    (RMSNorm: ``rnd(r rnd(g - rnd(xhat c)))``)."""
    x, dy, dx = borrow((x, dy, dx))  # (we: optional, indexed only)
    for i in range(lo, hi):
        xr = x[i]
        dyr = dy[i]
        dxr = dx[i]
        h = xr.shape[0]
        m, v, r = _stats(xr, centered, eps, corr, std)
        sg = 0.0
        sgx = 0.0
        for j in range(h):
            g = np.float64(ld(dyr[j]))
            if we is not None:
                g = rn(xr, g * we[j])
            sg += g
            sgx += rn(xr, g * _xhat(xr, j, centered, m, r))
        gbar = rn(xr, sg / h)
        coef = rn(xr, sgx / (h - corr if centered else h))
        if std:
            s = rn(xr, math.sqrt(v))
            coef = rn(xr, coef / rn(xr, s * r)) if s > 0 else 0.0
        for j in range(h):
            g = np.float64(ld(dyr[j]))
            if we is not None:
                g = rn(xr, g * we[j])
            tx = rn(xr, _xhat(xr, j, centered, m, r) * coef)
            if centered:
                t = rn(xr, r * rn(xr, rn(xr, g - gbar) - tx))
            else:
                t = rn(xr, r * rn(xr, g - tx))
            st_exact(dxr, j, t)


@jit()
def params(x, dy, centered, mean, rstd, pw, pb, lo, hi):  # type: ignore[no-untyped-def]
    """``pw[j] = sum_rows rnd(dy xhat)``, ``pb[j] = sum_rows dy`` in float64, rows in order (each None: skipped),
    for column tiles ``lo <= c < hi`` (:data:`._layout.COL_TILE` columns each), each walking the rows in order
    (contiguous reads within a row)."""
    x, dy, mean, rstd = borrow((x, dy, mean, rstd))  # (pw/pb: optional, indexed only)
    rows, h = x.shape
    for c in range(lo, hi):
        j0 = c * COL_TILE
        j1 = min(j0 + COL_TILE, h)
        aw = np.zeros(j1 - j0)
        ab = np.zeros(j1 - j0)
        for i in range(rows):
            xr = x[i]
            dyr = dy[i]
            m = mean[i]
            r = rstd[i]
            for j in range(j0, j1):
                dv = np.float64(ld(dyr[j]))
                if pw is not None:
                    aw[j - j0] += rn(xr, dv * _xhat(xr, j, centered, m, r))
                ab[j - j0] += dv
        for j in range(j0, j1):
            if pw is not None:
                pw[j] = aw[j - j0]
            if pb is not None:
                pb[j] = ab[j - j0]
