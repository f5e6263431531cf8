# numba's type stubs do not model intrinsics, overload stubs or jitted calls:
# mypy: disable-error-code="call-arg,attr-defined,var-annotated,call-overload"
r"""LayerNorm / RMSNorm with every operation rounded to ``x``'s dtype: ``casting="none"``.

The sequences are :mod:`pynorm.reference.casting`'s (``layer_norm_forward_none`` and the others), the same
operations in the same order. Each operation is evaluated in a wider *math type* and rounded once to the
storage dtype (:func:`rt`), which is the correctly rounded result in the dtype:

* float16: the element-wise operations (``+ - *`` of float16 values) in float32. Products of two float16
  values are exact in float32 (22 significant bits); sums and differences are rounded twice, to float32 then
  to float16, which is correct rounding because ``24 >= 2 * 11 + 2`` (Figueroa, "When is double rounding
  innocuous?", SIGNUM 1995) and float32's exponent range holds every such result without underflow. The
  conversions are F16C's ``vcvtps2ph``/``vcvtph2ps``, so the loops vectorize;
* bfloat16: likewise in float32, the rounding five integer operations (:func:`._storage._round_bf16`: to nearest
  even; a NaN of this arithmetic comes back as it is), so the loops vectorize. Sums and differences of two bfloat16
  values are rounded twice, correctly by the same theorem (``24 >= 2 * 8 + 2``; float32 has bfloat16's exponent
  range, and a subnormal sum is a multiple of ``2^-133``, exact in float32). A product has at most 16 significant
  bits, exact in float32 unless float32 must round it below ``2^-149``; then it has no bit at ``2^-134`` or above,
  so it lies below ``2^-134``, the midpoint between bfloat16's 0 and ``2^-133``, and float32's rounding (monotone,
  ``2^-134`` representable) reaches at most that midpoint, which bfloat16's tie to even takes to 0, as the exact
  product rounds. Checked on 167 million operand pairs (products across the float32 subnormal range, bfloat16
  subnormal operands, sums at exponent differences 0-39) against the float64 result rounded to odd in float32 then
  to bfloat16 (and the kernels' own rounding on 1.9 million of them in ``tests/test_casting.py``). An output,
  already rounded, is stored as its float32 bits' high half (:func:`put`; not rounded a second time);
* float32: in float64 (``53 >= 2 * 24 + 2``); float64: itself.

The per-row scalars (``sum / n``, ``rnd(v + eps)``, ``1/sqrt``, the ``std`` coefficients) are computed in float64
and rounded once (:func:`rw`): ``1/sqrt`` is one operation (``torch.rsqrt``), its float64 value rounded once.
Sums accumulate in float64 (as PyTorch's reductions accumulate wider than their dtype) and are rounded once
where the reference rounds them. Compiled with ``fastmath=False`` (nothing contracted), except one thing: a
row sum of float16 values over at most :data:`EXACT_H` elements is *exact* in float64 -- every float16 value is
a multiple of ``2^-24`` below ``2^16``, so such a sum is a multiple of ``2^-24`` below ``2^29``: 53 bits -- so
any order of its additions gives the same bits, and those sums are reassociated so they vectorize
(:func:`_sum_vec`; inf and NaN propagate the same in any order). Other rows are added in row order, or in any
order where the terms' exponents show that sum is exact (:func:`sum_terms`). Either way a row's terms are first
written to a scratch row of the math type (float32 for the 16-bit types: the loop computing them is as wide as
their arithmetic), then added in float64.

``centered`` selects LayerNorm (mean, centred variance, ``corr``, ``std``: eps outside the root) or
RMSNorm (mean square); ``we``/``bt`` (the weight ``rnd(w + o)`` and the bias ``rnd(b)``, arrays of values of
the dtype in the math type, :func:`math_dtype`) are None where absent. Rows are independent (tasks of
:func:`._threads.launch`); the parameter gradients are summed over rows in row order, per column
(:func:`params`): results do not depend on the thread count.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import types
from numba.extending import overload

from ._borrow import borrow
from ._cache import jit
from ._layout import COL_TILE
from ._storage import (
    JIT_ONLY,
    _bf16_to_f32,
    _bits_f32,
    _bits_f64,
    _f32_bits,
    _f32_to_bf16,
    _f32_to_half,
    _f64_bits,
    _f64_to_f32_odd,
    _half_to_f32,
    _round_bf16,
    ld,
    st,
)

__all__ = ["EXACT_H", "PARAMS_COLS", "bwd", "fwd", "math_dtype", "params", "precision_of", "rt", "rw", "sum_terms"]

#: the longest float16 row whose float64 sums are exact (see the module doc): ``8192 * 65504 < 2^29``
EXACT_H = 8192


def precision_of(dtype: Any) -> int:
    """Significant bits of ``dtype`` (float16 11, bfloat16 8, float32 24, float64 53): :func:`sum_terms`' ``p``."""
    return {2: 11 if np.dtype(dtype) == np.float16 else 8, 4: 24, 8: 53}[np.dtype(dtype).itemsize]


def math_dtype(dtype: np.dtype) -> type:
    """The math type of storage dtype ``dtype`` (the 16-bit types -> float32, else float64): the parameters' array
    dtype."""
    return np.float32 if np.dtype(dtype).itemsize == 2 else np.float64


def rt(a, v):  # type: ignore[no-untyped-def]
    """The math-type result ``v`` of one operation rounded once to storage array ``a``'s dtype, in the math type."""
    raise RuntimeError(JIT_ONLY)


def rw(a, v):  # type: ignore[no-untyped-def]
    """A float64 ``v`` (a per-row scalar) rounded once to ``a``'s dtype, in the math type."""
    raise RuntimeError(JIT_ONLY)


def lm(a, j):  # type: ignore[no-untyped-def]
    """Element ``j`` of storage array ``a`` in the math type (exact)."""
    raise RuntimeError(JIT_ONLY)


@overload(rt, inline="always")
def _rt_ol(a, v):  # type: ignore[no-untyped-def]
    if a.dtype == types.float64:
        return lambda a, v: np.float64(v)
    if a.dtype == types.float32:
        return lambda a, v: np.float64(np.float32(v))
    if a.dtype == types.uint16:
        return lambda a, v: _round_bf16(np.float32(v))
    if a.dtype == types.int16:
        return lambda a, v: _half_to_f32(_f32_to_half(np.float32(v)))
    return None


@overload(rw, inline="always")
def _rw_ol(a, v):  # type: ignore[no-untyped-def]
    if a.dtype == types.int16:
        return lambda a, v: _half_to_f32(_f32_to_half(_f64_to_f32_odd(v)))
    if a.dtype == types.uint16:
        return lambda a, v: _bf16_to_f32(_f32_to_bf16(_f64_to_f32_odd(v)))
    return lambda a, v: rt(a, v)


def put(a, j, v):  # type: ignore[no-untyped-def]
    """``a[j] = v`` for a ``v`` that :func:`rt` rounded (a value of ``a``'s dtype, any NaN quiet with zero low
    bits): what :func:`._storage.st` stores -- for bfloat16 without rounding again, ``v``'s high half (the other
    dtypes' stores are one exact conversion already)."""
    raise RuntimeError(JIT_ONLY)


@overload(put, inline="always")
def _put_ol(a, j, v):  # type: ignore[no-untyped-def]
    if a.dtype == types.uint16:

        def bf16(a, j, v):  # type: ignore[no-untyped-def]
            a[j] = np.uint16(_f32_bits(np.float32(v)) >> np.uint32(16))

        return bf16
    return lambda a, j, v: st(a, j, v)


@overload(lm, inline="always")
def _lm_ol(a, j):  # type: ignore[no-untyped-def]
    if a.dtype in (types.int16, types.uint16):
        return lambda a, j: ld(a[j])
    return lambda a, j: np.float64(ld(a[j]))


@jit()
def _dev(xr, j, centered, m):  # type: ignore[no-untyped-def]
    """``rnd(x_j - m)`` (LayerNorm), ``x_j`` (RMSNorm)."""
    return rt(xr, lm(xr, j) - m) if centered else lm(xr, j)


@jit()
def _xhat(xr, j, centered, m, r):  # type: ignore[no-untyped-def]
    return rt(xr, _dev(xr, j, centered, m) * r)


def precision(a):  # type: ignore[no-untyped-def]
    """Significant bits of storage array ``a``'s dtype (float16 11, bfloat16 8, float32 24, float64 53)."""
    raise RuntimeError(JIT_ONLY)


@overload(precision, inline="always")
def _precision_ol(a):  # type: ignore[no-untyped-def]
    bits = {types.int16: 11, types.uint16: 8, types.float32: 24, types.float64: 53}[a.dtype]
    return lambda a: bits


def terms(xr, buf):  # type: ignore[no-untyped-def]
    """The first ``len(xr)`` slots of the float64 scratch ``buf`` as an array of row ``xr``'s math type (a
    16-bit row's float32 terms: the loops filling them are as wide as their arithmetic)."""
    raise RuntimeError(JIT_ONLY)


@overload(terms, inline="always")
def _terms_ol(xr, buf):  # type: ignore[no-untyped-def]
    if xr.dtype in (types.int16, types.uint16):
        return lambda xr, buf: buf.view(np.float32)[: xr.shape[0]]
    return lambda xr, buf: buf[: xr.shape[0]]


@jit()
def _fill(xr, centered, m, sq, buf, dbuf):  # type: ignore[no-untyped-def]
    """A row sum's terms into ``buf`` (the math type, :func:`terms`; no sum: the loop vectorizes): ``x_j`` (the
    mean's), or ``rnd(d_j^2)`` (the variance's, ``sq``), ``d_j`` (:func:`_dev`) then also into ``dbuf`` where it
    has the row's length (the forward's output loop reads them back)."""
    keep = dbuf.shape[0] > 0
    for j in range(xr.shape[0]):
        if sq:
            d = _dev(xr, j, centered, m)
            if keep:
                dbuf[j] = d
            buf[j] = rt(xr, d * d)
        else:
            buf[j] = lm(xr, j)


@jit()
def _gfill(xr, dyr, we, centered, m, r, bg, bgx, bxh):  # type: ignore[no-untyped-def]
    """``bg[j] = g = rnd(dy_j we_j)`` (``dy`` without a weight), ``bgx[j] = rnd(g xhat_j)``, ``bxh[j] = xhat_j``
    for the row (arrays of the math type: the final loop of :func:`bwd` reads ``g`` and ``xhat`` back)."""
    for j in range(xr.shape[0]):
        g = lm(dyr, j)
        if we is not None:
            g = rt(xr, g * we[j])
        xh = _xhat(xr, j, centered, m, r)
        bg[j] = g
        bgx[j] = rt(xr, g * xh)
        bxh[j] = xh


@jit(inline="always")
def _exponent(t):  # type: ignore[no-untyped-def]
    """The biased float64 exponent of the float64 ``t`` (0: zero, 2047: inf or NaN)."""
    return np.int64((_f64_bits(t) >> np.uint64(52)) & np.uint64(0x7FF))


def _mag_range(t):  # type: ignore[no-untyped-def]
    """``(hi, lo)``: the largest magnitude of the float64 or float32 terms ``t`` and the smallest nonzero one
    (``t``'s dtype; NaN counts as the largest, ``lo`` is NaN where every term is 0): maxima and minima of the
    magnitudes' bits, signed integers of the terms' width (in any order, vectorized)."""
    raise RuntimeError(JIT_ONLY)


def _mag_range_impl(signed, unsigned, back):  # type: ignore[no-untyped-def]
    mask = signed(np.iinfo(signed).max)

    def impl(t):  # type: ignore[no-untyped-def]
        u = t.view(signed)
        hi = signed(0)
        lo = mask
        for j in range(u.shape[0]):
            a = signed(u[j] & mask)
            hi = max(hi, a)
            lo = min(lo, a if a != signed(0) else mask)
        return back(unsigned(hi)), back(unsigned(lo))

    return impl


@overload(_mag_range)
def _mag_range_ol(t):  # type: ignore[no-untyped-def]
    if t.dtype == types.float64:
        return _mag_range_impl(np.int64, np.uint64, _bits_f64)
    return _mag_range_impl(np.int32, np.uint32, _bits_f32)


@jit()
def _spread(t):  # type: ignore[no-untyped-def]
    """``(emax, emin)``: the largest biased float64 exponent of the terms ``t`` (float64 or float32) and the
    smallest of the nonzero ones, 4096 where there are none (:func:`_exponent` of :func:`_mag_range`'s two)."""
    hi, lo = _mag_range(t)  # (float32 terms: their float64 values, exact, subnormals normal there)
    return _exponent(np.float64(hi)), (_exponent(np.float64(lo)) if lo == lo else 4096)


@jit(inline="always")
def _any_order(emax, emin, n, p):  # type: ignore[no-untyped-def]
    """Whether the float64 sum of ``n`` terms of ``p`` significant bits, of largest biased exponent ``emax`` and
    smallest nonzero ``emin``, is exact in any order: every partial sum is a multiple of
    ``2^(emin - bias - p + 1)`` below ``n 2^(emax - bias + 1)``, so it is exact when
    ``(emax - emin) + ceil(log2 n) + p <= 53``. Not where a term is inf or NaN (exponent 2047)."""
    log_n = 0
    while (1 << log_n) < n:
        log_n += 1
    return emax < 2047 and (emax - emin) + log_n + p <= 53


@jit(fastmath={"reassoc"})
def _sum_vec(t):  # type: ignore[no-untyped-def]
    """``sum(t)`` in any order (vectorized): :func:`_sum_ord`'s loop with ``reassoc``, for exact sums only."""
    s = 0.0
    for j in range(t.shape[0]):
        s += np.float64(t[j])
    return s


@jit()
def _sum_ord(t):  # type: ignore[no-untyped-def]
    """``sum(t)`` in row order, in float64 (the flags are the only difference from :func:`_sum_vec`)."""
    s = 0.0
    for j in range(t.shape[0]):
        s += np.float64(t[j])
    return s


@jit()
def sum_terms(t, p):  # type: ignore[no-untyped-def]
    """The float64 sum of the terms ``t`` in row order, each a value of ``p`` significant bits: taken in any order
    (vectorized) where that sum is exact (:func:`_any_order`), else in row order."""
    emax, emin = _spread(t)
    if emax == 0:
        return 0.0
    if _any_order(emax, emin, t.shape[0], p):
        return _sum_vec(t)
    return _sum_ord(t)


@jit()
def _rowsum(xr, centered, m, sq, exact, buf, dbuf):  # type: ignore[no-untyped-def]
    """A row sum in row order: its terms written to the scratch ``buf`` (:func:`terms`, :func:`_fill`: ``dbuf``),
    then added in any order (vectorized) where that is exact -- always for ``exact`` (float16 rows of at most
    :data:`EXACT_H`), else where the terms' spread says so (:func:`sum_terms`) --, else in row order."""
    t = terms(xr, buf)
    _fill(xr, centered, m, sq, t, dbuf)
    return _sum_vec(t) if exact else sum_terms(t, precision(xr))


@jit()
def _stats(xr, centered, eps, corr, std, exact, buf, dbuf):  # type: ignore[no-untyped-def]
    """``(m, v, r)`` of one row in the math type: mean (0 for RMSNorm), variance or mean square, ``r``; the
    deviations ``d_j`` kept in ``dbuf`` where it has the row's length (:func:`_fill`)."""
    h = xr.shape[0]
    m = rw(xr, 0.0)
    if centered:
        m = rw(xr, _rowsum(xr, centered, m, False, exact, buf, dbuf) / h)
        v = rw(xr, _rowsum(xr, centered, m, True, exact, buf, dbuf) / (h - corr))
    else:
        v = rw(xr, _rowsum(xr, centered, m, True, exact, buf, dbuf) / h)
    v64 = np.float64(v)
    if std:
        r = rw(xr, 1.0 / np.float64(rw(xr, np.float64(rw(xr, math.sqrt(v64))) + eps)))
    else:
        r = rw(xr, 1.0 / math.sqrt(np.float64(rw(xr, v64 + eps))))
    return m, v, r


@jit()
def fwd(x, we, bt, centered, eps, corr, std, exact, y, mean, rstd, lo, hi):  # type: ignore[no-untyped-def]
    """``y`` (storage dtype) and the float64 ``mean``/``rstd`` of rows ``lo <= i < hi`` of ``x`` (``exact``: the
    row sums may be reassociated)."""
    x, y, mean, rstd = borrow((x, y, mean, rstd))  # (we/bt: optional, indexed only)
    buf = np.empty(x.shape[1])
    dbuf = np.empty(x.shape[1] if centered else 0)
    for i in range(lo, hi):
        xr = x[i]
        yr = y[i]
        d = terms(xr, dbuf)  # (LayerNorm's d_j as the variance's pass rounded them; RMSNorm's are x's)
        m, _, r = _stats(xr, centered, eps, corr, std, exact, buf, d)
        if centered:
            for j in range(xr.shape[0]):
                _affine(xr, yr, j, rt(xr, d[j] * r), we, bt)
        else:
            for j in range(xr.shape[0]):
                _affine(xr, yr, j, rt(xr, lm(xr, j) * r), we, bt)
        mean[i] = m
        rstd[i] = r


@jit()
def _affine(xr, yr, j, t, we, bt):  # type: ignore[no-untyped-def]
    """``y_j = rnd(rnd(xhat_j we_j) + bt_j)`` stored (``t``: ``xhat_j``; no weight, no bias: skipped)."""
    if we is not None:
        t = rt(xr, t * we[j])
    if bt is not None:
        t = rt(xr, t + bt[j])
    put(yr, j, t)


@jit()
def bwd(x, dy, we, centered, eps, corr, std, exact, mean, rstd, dx, lo, hi):  # type: ignore[no-untyped-def]
    """``dx`` of rows ``lo <= i < hi`` from the forward's ``mean``/``rstd`` (values of the dtype; the variance is
    taken again for ``std``): ``g = rnd(dy we)``, ``gbar = rnd(sum g / H)``, ``c = rnd(sum rnd(g xhat) / n)``
    (``std``: ``rnd(c / rnd(s r))``, 0 where ``s = 0``), ``dx = rnd(r rnd(rnd(g - gbar) - rnd(xhat c)))``
    (RMSNorm: ``rnd(r rnd(g - rnd(xhat c)))``)."""
    x, dy, mean, rstd, dx = borrow((x, dy, mean, rstd, dx))  # (we: optional, indexed only)
    bg = np.empty(x.shape[1])
    bgx = np.empty(x.shape[1])
    bxh = np.empty(x.shape[1])
    for i in range(lo, hi):
        xr = x[i]
        dyr = dy[i]
        dxr = dx[i]
        h = xr.shape[0]
        m = rw(xr, mean[i])
        r = rw(xr, rstd[i])
        v = m
        if std:
            m, v, r = _stats(xr, centered, eps, corr, std, exact, bg, terms(xr, bxh)[:0])
        tg, tgx, txh = terms(xr, bg), terms(xr, bgx), terms(xr, bxh)
        _gfill(xr, dyr, we, centered, m, r, tg, tgx, txh)
        if exact:
            sg, sgx = _sum_vec(tg), _sum_vec(tgx)
        else:
            sg, sgx = sum_terms(tg, precision(xr)), sum_terms(tgx, precision(xr))
        gbar = rw(xr, sg / h)
        coef = rw(xr, sgx / (h - corr if centered else h))
        if std:
            s = rw(xr, math.sqrt(np.float64(v)))
            sr = np.float64(rw(xr, np.float64(s) * np.float64(r)))
            coef = rw(xr, np.float64(coef) / sr) if s > 0 else rw(xr, 0.0)
        for j in range(h):  # (g and xhat as _gfill computed them)
            g = tg[j]
            tx = rt(xr, txh[j] * coef)
            if centered:
                t = rt(xr, r * rt(xr, rt(xr, g - gbar) - tx))
            else:
                t = rt(xr, r * rt(xr, g - tx))
            put(dxr, j, t)


@jit()
def _pw_row(xr, dyr, centered, m, r, aw, buf):  # type: ignore[no-untyped-def]
    """``aw[j] += rnd(dy_j xhat_j)`` over a row's columns: the terms into ``buf`` (:func:`terms`: their math
    type, so that loop is as wide as their arithmetic), then added (loops writing one array, indices from 0:
    they vectorize)."""
    t = terms(xr, buf)
    for j in range(t.shape[0]):
        t[j] = rt(xr, lm(dyr, j) * _xhat(xr, j, centered, m, r))
    for j in range(aw.shape[0]):
        aw[j] += np.float64(t[j])


@jit()
def _pb_row(dyr, ab):  # type: ignore[no-untyped-def]
    """``ab[j] += dy_j`` over a row's columns."""
    for j in range(ab.shape[0]):
        ab[j] += np.float64(lm(dyr, j))


#: the widest column range one pass of :func:`params` accumulates (its float64 sums stay in the L2 cache)
PARAMS_COLS = 4096


@jit()
def params(x, dy, centered, mean, rstd, pw, pb, lo, hi):  # type: ignore[no-untyped-def]
    """``pw[j] = sum_rows rnd(dy xhat)``, ``pb[j] = sum_rows dy`` in float64, rows in order (each None: skipped),
    for the columns of tiles ``lo <= c < hi`` (:data:`._layout.COL_TILE` columns each). The span's columns are
    taken in ranges of up to :data:`PARAMS_COLS`, each by one walk over the rows (long contiguous reads of every
    row; a column's sum is in row order whatever the ranges)."""
    x, dy, mean, rstd = borrow((x, dy, mean, rstd))  # (pw/pb: optional, indexed only)
    rows, h = x.shape
    for j0 in range(lo * COL_TILE, min(hi * COL_TILE, h), PARAMS_COLS):
        j1 = min(j0 + PARAMS_COLS, hi * COL_TILE, h)
        aw = np.zeros(j1 - j0)
        ab = np.zeros(j1 - j0)
        buf = np.empty(j1 - j0)
        for i in range(rows):
            if pw is not None:
                _pw_row(x[i, j0:j1], dy[i, j0:j1], centered, rw(x, mean[i]), rw(x, rstd[i]), aw, buf)
            if pb is not None:
                _pb_row(dy[i, j0:j1], ab)
        if pw is not None:
            pw[j0:j1] = aw
        if pb is not None:
            pb[j0:j1] = ab
