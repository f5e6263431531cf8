# numba's type stubs do not model intrinsics, overload stubs or jitted calls:
# mypy: disable-error-code="call-arg,attr-defined,var-annotated,call-overload"
r"""Row statistics of the stats family: shared helpers, and the pieces each statistic implements.

Helpers (statistic-independent): :func:`_row_shift` and :func:`_shifted_sums` (a row's sums around
a shift, the reference's ``row_mean``), :func:`_sum_squares`, :func:`_row_scale` (the power of two
of the slow path), the compensated sums :func:`_two_sum` / :func:`_cadd`, :func:`_scaled_rstd`.

Pieces (``@overload``-ed on the statistic tag, :mod:`._variant`): each statistic implements every one of
:data:`STUBS` in a mapping (:data:`CENTERED`, :data:`MEAN_SQUARE`, :data:`L2`) that its record names
(``pynorm.ops.families.Statistic.numba``), so a new statistic adds its functions, that mapping and its record,
nothing in the kernels -- ``r`` included (:func:`rfactor`, :func:`scaled_rstd`):

========================  ==================================================================
:func:`fwd_stats`         fast forward statistics of a row: ``(ok, k, c, var)``
:func:`rfactor`           ``r`` from the row's ``v`` by the r rule ``mode`` (float64)
:func:`scaled_rstd`       the slow path's ``(r, r * 2**e)`` from the statistics of ``x * 2**-e``
:func:`fwd_shift`,        the same in three steps, for a row split across threads: its shift, the
:func:`seg_sums`,         chunk sums of a segment, and the statistics from the sums added in chunk
:func:`fwd_finish`        order (:mod:`._split_kernels`; bitwise the results of :func:`fwd_stats`)
:func:`scaled_stats`      slow-path statistics of a row scaled by ``2**-e``: ``(m1, c, var_s)``
:func:`centre`            an element's centred value ``x - mean`` from ``(k, c)`` (math type)
:func:`bwd_centring`      the backward's ``(k, c)`` from ctx's float64 mean
:func:`gprod`             ``g = dy * w`` as the statistic's gradient rounds it
:func:`third_sum`,        whether the backward takes a third row sum besides ``sum g`` and ``sum g xhat``,
:func:`third_term`        and its term (``d^2`` for eps outside the root; a statistic's own sum)
:func:`bwd_finish`        ``(ok, gbar, coef)`` of the backward from the row's sums
:func:`dx_elem`           one element of ``dx``
:func:`slow_shift`,       the slow path's float64 centring ``(x * 2**-e - m_s) - c``: the shift, and
:func:`slow_residual`     the residual mean the stored float64 mean misses
:func:`is_centered`       compile-time constant: the statistic subtracts the mean
:func:`row_aux`,          the per-row aux value ctx keeps besides ``r`` (the mean, the floor flag), from
:func:`slow_aux`          the fast / the slow path's statistics
:func:`slow_finish`,      the slow path's ``(gbar, coef)`` from its float64 sums, and one element of its
:func:`slow_dx`           ``dx`` (float64)
========================  ==================================================================

Statistics: ``"centered"`` (LayerNorm: ``v`` the variance with ``H - correction`` degrees),
``"mean_square"`` (RMSNorm: ``v = mean(x^2)``, ``k = c = 0``, no ``gbar``) and ``"l2"`` (ScaleNorm: ``v =
sum(x^2)``, the floor flag as aux value).

Numerics of the centred statistic (one pass over the row while it is in cache): the row is
shifted by ``K = x0 + mean(x[:16] - x0)`` (in ``T``) and ``S1 = sum(x - K)``, ``S2 = sum((x - K)^2)``
are accumulated; ``mean = K + S1/H`` and ``var = (S2 - S1^2/H) / (H - correction)``, never
``E[x^2] - E[x]^2``. When ``S1^2 > S2 H / 4`` the sums are redone around the new mean. The centred
value is ``(x - K) - S1/H`` with ``K`` and ``S1/H`` kept apart (:func:`_centre`, compiled without
flags), so ``1e4 + N(0, 1)`` rows keep the accuracy of their deviations and a constant row gives
exactly 0. The backward splits ctx's float64 mean the same way (:func:`bwd_centring`).
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import numpy as np
from numba import types
from numba.extending import overload

from ...ops.families import R_FLOOR, R_INSIDE, R_OUTSIDE, STATISTICS
from ._cache import FM_SUM, jit
from ._layout import CHUNK
from ._storage import JIT_ONLY, ld, tcast, tiny_sum, wat

__all__ = [
    "CENTERED",
    "FLOOR",
    "INSIDE",
    "L2",
    "MEAN_SQUARE",
    "OUTSIDE",
    "STUBS",
    "bwd_centring",
    "bwd_finish",
    "centre",
    "dx_elem",
    "fwd_finish",
    "fwd_shift",
    "fwd_stats",
    "gprod",
    "is_centered",
    "pieces",
    "rfactor",
    "row_aux",
    "scaled_rstd",
    "scaled_stats",
    "seg_sums",
    "slow_aux",
    "slow_dx",
    "slow_finish",
    "slow_residual",
    "slow_shift",
    "third_sum",
    "third_term",
]

#: options of the pieces' implementations: the kernels' fastmath flags and IEEE division
_PIECE: Any = {"fastmath": FM_SUM, "error_model": "numpy"}


def pieces(stat):  # type: ignore[no-untyped-def]
    """The pieces of the statistic a tag's numba type names: the mapping its record names
    (:attr:`pynorm.ops.families.Statistic.numba`, ``"module:attribute"``)."""
    record = STATISTICS.get(str(getattr(stat, "choice", ""))) if getattr(stat, "axis", None) == "statistic" else None
    if record is None or not record.numba:
        raise TypeError(f"expected the tag of a statistic with numba pieces, got {stat}")
    module, _, name = record.numba.partition(":")
    return getattr(importlib.import_module(module), name)


# ---------------------------------------------------------------------------
# shared helpers


@jit()
def _centre(x, k, c):  # type: ignore[no-untyped-def]
    # no reassoc here: (x - k) is exact for x near k, and c is small
    return (x - k) - c


@jit()
def _prod(a, b):  # type: ignore[no-untyped-def]
    # no contract here: g = dy * w is rounded the same way in the sums and in dx (exact cancellation when H = 1)
    return a * b


@jit(FM_SUM, inline="always")
def _row_shift(xr):  # type: ignore[no-untyped-def]
    """``K = x0 + mean(x[:16] - x0)`` in the math type: near the row mean; exactly the value of a constant row."""
    n0 = min(16, xr.shape[0])
    x0 = ld(xr[0])
    s = tcast(xr, 0.0)
    for j in range(n0):
        s += ld(xr[j]) - x0
    return x0 + s / tcast(xr, n0)


@jit(FM_SUM, inline="always")
def _chunk_range(xr, k, c, j0, j1, c1s, c2s):  # type: ignore[no-untyped-def]
    """``(sum(d), sum(d^2))`` over ``xr[j0:j1]`` (``j0`` a multiple of :data:`CHUNK`) with ``d = (x - k) - c``,
    in float64 over chunk sums in the math type (a caller using one of the two sums leaves the other to
    dead-code elimination). ``c1s``/``c2s`` (None, or float64 arrays indexed by chunk): each chunk's sum is
    also stored there -- the split kernels (:mod:`._split_kernels`) add them in chunk order afterwards,
    exactly as this loop does."""
    s1 = 0.0
    s2 = 0.0
    zero = tcast(xr, 0.0)
    for c0 in range(j0, j1, CHUNK):
        xc = xr[c0 : min(c0 + CHUNK, j1)]
        a1 = zero
        a2 = zero
        for j in range(xc.shape[0]):
            d = _centre(ld(xc[j]), k, c)
            a1 += d
            a2 += d * d
        if c1s is not None:
            c1s[c0 // CHUNK] = np.float64(a1)
        if c2s is not None:
            c2s[c0 // CHUNK] = np.float64(a2)
        s1 += np.float64(a1)
        s2 += np.float64(a2)
    return s1, s2


@jit(FM_SUM, inline="always")
def _chunked_sums(xr, k, c):  # type: ignore[no-untyped-def]
    """``(sum(d), sum(d^2))`` over the row, see :func:`_chunk_range`."""
    return _chunk_range(xr, k, c, 0, xr.shape[0], None, None)


@jit(FM_SUM, inline="always")
def _shifted_sums(xr, k):  # type: ignore[no-untyped-def]
    """``(sum(x - k), sum((x - k)^2))``."""
    return _chunked_sums(xr, k, tcast(xr, 0.0))


@jit(FM_SUM, inline="always")
def _sum_squares(xr):  # type: ignore[no-untyped-def]
    """``sum(x^2)``."""
    zero = tcast(xr, 0.0)
    return _chunked_sums(xr, zero, zero)[1]


@jit()
def _any_off(xr, k, c):  # type: ignore[no-untyped-def]
    """True if some ``(x - k) - c`` is nonzero (or NaN)."""
    for j in range(xr.shape[0]):
        if _centre(ld(xr[j]), k, c) != 0:
            return True
    return False


@jit()
def _row_scale(xr):  # type: ignore[no-untyped-def]
    """Exponent ``e`` with ``max|x| * 2**-e`` in [0.5, 1) (0 for zero or non-finite rows), clamped to +-1000."""
    amax = 0.0
    for j in range(xr.shape[0]):
        a = abs(np.float64(ld(xr[j])))
        if not a <= amax:  # also catches NaN
            amax = a
    if amax == 0.0 or not math.isfinite(amax):
        return 0
    e = math.frexp(amax)[1]
    return max(-1000, min(1000, e))


@jit()
def _two_sum(a, b):  # type: ignore[no-untyped-def]
    """``(s, err)`` with ``s = fl(a + b)`` and ``s + err == a + b`` exactly (Knuth's branch-free two-sum).

    No fastmath flags (here and in its callers): reassociation would fold ``err`` to 0.
    """
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


@jit()
def _cadd(s, t, v):  # type: ignore[no-untyped-def]
    """One step of a compensated sum: ``s' = fl(s + v)``, its exact rounding error added to ``t``.

    The sum of ``n`` terms is then ``s + t`` within about one ulp plus ``n u^2 sum|v|``,
    whatever their order: plain sequential sums over long rows are off by up to
    ``n u`` (hundreds of ulps of the outputs at ``H = 65536``). Slow-path rows only
    (a few times the cost of a plain sum).
    """
    r, err = _two_sum(s, v)
    return r, t + err


@jit()
def _centered_scaled_stats(xr, e, corr):  # type: ignore[no-untyped-def]
    """Two-pass float64 statistics of ``x * 2**-e``: ``(m1, c, var_s)`` with mean_s = m1 + c.

    Every sum is compensated (:func:`_cadd`), and ``c`` is the mean of the *exact*
    deviations ``x * 2**-e - m1`` (each difference's rounding error is added in):
    the rounded differences share the low bits of ``m1``, so their rounding errors
    do not average out and would bias ``c`` by up to half an ulp of ``x``.
    """
    h = xr.shape[0]
    sc = math.ldexp(1.0, -e)
    s = 0.0
    t = 0.0
    for j in range(h):
        s, t = _cadd(s, t, np.float64(ld(xr[j])) * sc)
    m1 = (s + t) / h
    s1 = 0.0
    t1 = 0.0
    s2 = 0.0
    t2 = 0.0
    for j in range(h):
        d, lo = _two_sum(np.float64(ld(xr[j])) * sc, -m1)
        s1, t1 = _cadd(s1, t1 + lo, d)
        s2, t2 = _cadd(s2, t2, d * d)
    s1 = s1 + t1
    c = s1 / h
    return m1, c, max((s2 + t2) - s1 * c, 0.0) / (h - corr)


#: the r rules of the kernels (``mode`` argument, :mod:`pynorm.ops.families`): eps inside the root, outside it
#: (LayerNorm's "std"), a floor of the root (ScaleNorm's "floor": ``r = 1 / max(sqrt(v), eps)``)
INSIDE, OUTSIDE, FLOOR = R_INSIDE, R_OUTSIDE, R_FLOOR


@jit()
def _rfactor(v, eps, mode):  # type: ignore[no-untyped-def]
    """``r`` of the variance-like ``v`` (float64) under eps mode ``mode`` (:data:`INSIDE`, ...)."""
    if mode == OUTSIDE:
        return 1.0 / (math.sqrt(v) + eps)
    if mode == FLOOR:
        return 1.0 / max(math.sqrt(v), eps)
    return 1.0 / math.sqrt(v + eps)


@jit()
def _scaled_rstd(var_s, e, eps, mode):  # type: ignore[no-untyped-def]
    """``(r, r_s)`` for the variance ``var_s * 4**e``: ``r`` as :func:`_rfactor`, ``r_s = r * 2**e``.

    ``r_s`` (what multiplies the scaled deviations) is computed without overflow or
    underflow whenever eps scaled alongside is finite; ``r`` itself may be out of
    range for the most extreme float64 rows (it is then only stored in ctx).
    """
    if mode == OUTSIDE or mode == FLOOR:
        e_s = math.ldexp(eps, -e)
        if math.isfinite(e_s):
            r_s = 1.0 / (math.sqrt(var_s) + e_s) if mode == OUTSIDE else 1.0 / max(math.sqrt(var_s), e_s)
            return math.ldexp(r_s, -e), r_s
        r = 1.0 / eps
        return r, math.ldexp(r, e)
    e_s = math.ldexp(eps, -2 * e)
    if math.isfinite(e_s):
        r_s = 1.0 / math.sqrt(var_s + e_s)
        return math.ldexp(r_s, -e), r_s
    r = 1.0 / math.sqrt(eps)
    return r, math.ldexp(r, e)


@jit()
def _scaled_floor(var_s, e, eps, mode):  # type: ignore[no-untyped-def]
    """1.0 where the floor branch is taken (``sqrt(var_s) * 2**e < eps`` in :data:`FLOOR` mode), else 0.0."""
    if mode != FLOOR:
        return 0.0
    e_s = math.ldexp(eps, -e)
    return 1.0 if (not math.isfinite(e_s)) or math.sqrt(var_s) < e_s else 0.0


@jit(FM_SUM)
def _mean_fix(xr, k, c):  # type: ignore[no-untyped-def]
    """``sum((x - k) - c) / H`` in float64: what ``k + c`` misses of the row mean."""
    return _chunked_sums(xr, k, c)[0] / xr.shape[0]


@jit()
def _slow_residual(xr, mean, e):  # type: ignore[no-untyped-def]
    """``mean(x * 2**-e - m_s)`` of the exact deviations (compensated, as in :func:`_centered_scaled_stats`),
    in the math type: what the stored float64 ``mean`` misses of the row's mean.

    The slow path's centring is ``(x * sc - m_s) - c`` as in the forward: rows with
    a common offset much larger than their spread (``1e300 + 1e290 N(0, 1)``) keep
    the accuracy of their deviations, which the rounded ``mean`` alone would lose.
    """
    sc = math.ldexp(1.0, -e)
    m_s = math.ldexp(mean, -e)
    s = 0.0
    t = 0.0
    for j in range(xr.shape[0]):
        d, lo = _two_sum(np.float64(ld(xr[j])) * sc, -m_s)
        s, t = _cadd(s, t + lo, d)
    return np.float64(tcast(xr, (s + t) / xr.shape[0]))


@jit(FM_SUM)
def _prod_fm(a, b):  # type: ignore[no-untyped-def]
    # the mean-square statistic's g = dy * w: with the kernels' flags (as it has always been rounded)
    return a * b


@jit()
def _scaled_sum_squares(xr, e):  # type: ignore[no-untyped-def]
    """``sum((x * 2**-e)^2)`` in float64, compensated."""
    sc = math.ldexp(1.0, -e)
    s2 = 0.0
    t2 = 0.0
    for j in range(xr.shape[0]):
        v = np.float64(ld(xr[j])) * sc
        s2, t2 = _cadd(s2, t2, v * v)
    return s2 + t2


@jit()
def _ms_scaled_stats(xr, e):  # type: ignore[no-untyped-def]
    """``mean((x * 2**-e)^2)`` in float64, compensated."""
    return _scaled_sum_squares(xr, e) / xr.shape[0]


@jit(FM_SUM, inline="always")
def _squares_ok(xr, s2):  # type: ignore[no-untyped-def]
    """False where the row's ``sum(x^2)`` is not finite or may hide subnormal squares (slow path)."""
    zero = tcast(xr, 0.0)
    return not (not math.isfinite(s2) or (s2 < tiny_sum(xr) and _any_off(xr, zero, zero)))


@jit(FM_SUM, inline="always")
def _squares_row(xr):  # type: ignore[no-untyped-def]
    """``(ok, sum(x^2))``: ``ok`` as :func:`_squares_ok`."""
    s2 = _sum_squares(xr)
    return _squares_ok(xr, s2), s2


# ---------------------------------------------------------------------------
# the pieces: what the kernels call (each statistic implements every one, see STUBS)


def is_centered(stat):  # type: ignore[no-untyped-def]
    """True (a compile-time constant) when the statistic subtracts the row mean."""
    raise RuntimeError(JIT_ONLY)


def third_sum(stat, mode):  # type: ignore[no-untyped-def]
    """Whether the backward takes a third row sum (of :func:`third_term`) besides ``sum g`` and ``sum g xhat``:
    ``mode == OUTSIDE`` for the statistics whose eps may sit outside the root (``sum d^2``, LayerNorm's
    ``eps_mode="std"``), a compile-time False where nothing needs it, True for a statistic with a sum of its own."""
    raise RuntimeError(JIT_ONLY)


def third_term(stat, d, xhat):  # type: ignore[no-untyped-def]
    """The term of the backward's third row sum for the element of centred value ``d`` and ``xhat = d r`` (in
    their type: the math type on the fast path, float64 scaled on the slow one): ``d^2`` here."""
    raise RuntimeError(JIT_ONLY)


def row_aux(stat, k, c, v, eps, mode):  # type: ignore[no-untyped-def]
    """The per-row value a statistic keeps in ctx besides ``r`` (float64): the mean (centred), the floor flag
    (``l2``: 1.0 where ``sqrt(v) < eps`` in :data:`FLOOR` mode), nothing (0.0, mean square)."""
    raise RuntimeError(JIT_ONLY)


def slow_aux(stat, m1, c, e, v_s, eps, mode):  # type: ignore[no-untyped-def]
    """:func:`row_aux` of a slow-path row (statistics of ``x * 2**-e``)."""
    raise RuntimeError(JIT_ONLY)


def slow_finish(stat, sg, sgx, s3, h, n, r_s, mode, aux):  # type: ignore[no-untyped-def]
    """The slow path's ``(gbar, coef)`` (float64) from ``sum g``, ``sum g xhat``, the third sum (scaled deviations),
    ``h = H`` and ``n = H - correction``."""
    raise RuntimeError(JIT_ONLY)


def slow_dx(stat, g, gbar, d, xhat, coef, r):  # type: ignore[no-untyped-def]
    """One element of the slow path's ``dx`` (float64) from ``g``, the scaled centred value ``d`` and ``xhat``, the
    row's ``gbar``/``coef`` and its ``r``: ``r ((g - gbar) - xhat coef)`` here."""
    raise RuntimeError(JIT_ONLY)


def fwd_stats(stat, xr, corr):  # type: ignore[no-untyped-def]
    """Fast-path statistics of row ``xr``: ``(ok, k, c, v)`` with the centring ``(x - k) - c`` (``k`` in the
    math type, ``c`` float64) and the variance-like ``v`` of ``r``; ``ok`` False: the row needs the slow path."""
    raise RuntimeError(JIT_ONLY)


def rfactor(stat, v, eps, mode):  # type: ignore[no-untyped-def]
    """``r`` (float64) of the row's variance-like ``v`` by the r rule ``mode`` (:data:`INSIDE`, ...): the
    statistic's own rule, so a statistic with another ``r`` changes no kernel."""
    raise RuntimeError(JIT_ONLY)


def scaled_rstd(stat, v_s, e, eps, mode):  # type: ignore[no-untyped-def]
    """The slow path's ``(r, r_s)`` from ``v_s``, the variance-like value of ``x * 2**-e``: ``r`` as
    :func:`rfactor` of ``v_s * 4**e``, and ``r_s = r * 2**e``, the factor of the scaled centred values."""
    raise RuntimeError(JIT_ONLY)


def fwd_shift(stat, xr):  # type: ignore[no-untyped-def]
    """The shift ``k`` (math type) :func:`fwd_stats` first takes its sums around (0 for the uncentred ones)."""
    raise RuntimeError(JIT_ONLY)


def seg_sums(stat, xr, k, j0, j1, c1s, c2s):  # type: ignore[no-untyped-def]
    """The chunk sums of ``xr[j0:j1]`` around ``k`` that :func:`fwd_stats` takes first, stored by chunk into
    ``c1s`` (``sum(x - k)``; not for the uncentred statistics) and ``c2s``."""
    raise RuntimeError(JIT_ONLY)


def fwd_finish(stat, xr, k, s1, s2, corr):  # type: ignore[no-untyped-def]
    """:func:`fwd_stats` from the row's sums around ``k`` (:func:`fwd_shift`, :func:`seg_sums` added in chunk
    order): ``(ok, k, c, v)``."""
    raise RuntimeError(JIT_ONLY)


def scaled_stats(stat, xr, e, corr):  # type: ignore[no-untyped-def]
    """Slow-path float64 statistics of ``x * 2**-e``: ``(m1, c, v_s)``, centring ``(x * 2**-e - m1) - c``."""
    raise RuntimeError(JIT_ONLY)


def centre(stat, v, k, c):  # type: ignore[no-untyped-def]
    """The centred value of the element ``v`` (math type)."""
    raise RuntimeError(JIT_ONLY)


def gprod(stat, dy, w):  # type: ignore[no-untyped-def]
    """``g = dy * w`` in the math type, rounded as the statistic's sums and ``dx`` need it."""
    raise RuntimeError(JIT_ONLY)


def bwd_centring(stat, xr, mean, r):  # type: ignore[no-untyped-def]
    """The backward's centring ``(k, c)`` (math type) from ctx's float64 ``mean``: ``x - mean = (x - k) - c``."""
    raise RuntimeError(JIT_ONLY)


def bwd_finish(stat, xr, k, c, sg, sgx, sd2, r, corr, mode, aux):  # type: ignore[no-untyped-def]
    """``(ok, gbar, coef)`` (math type) of a row's backward from its sums ``sum g``, ``sum g xhat``,
    ``sum d^2`` (the last only with :func:`eps_outside`) and its :func:`row_aux`; ``ok`` False: the row needs
    the slow path."""
    raise RuntimeError(JIT_ONLY)


def dx_elem(stat, xr, dyr, w, k, c, r, gbar, coef, j):  # type: ignore[no-untyped-def]
    """Element ``j`` of a fast-path row's ``dx`` (math type)."""
    raise RuntimeError(JIT_ONLY)


def slow_shift(stat, mean, e):  # type: ignore[no-untyped-def]
    """The slow path's float64 shift ``m_s`` of ``x * 2**-e`` (from ctx's mean)."""
    raise RuntimeError(JIT_ONLY)


def slow_residual(stat, xr, mean, e):  # type: ignore[no-untyped-def]
    """What the stored mean misses of the row mean, at the scale ``2**-e`` (float64 of the math type)."""
    raise RuntimeError(JIT_ONLY)


# ---------------------------------------------------------------------------
# statistic "centered" (LayerNorm): mean and variance, the row centred by (x - k) - c


def _wide_fix(xr, mean, r, k, c):  # type: ignore[no-untyped-def]
    """``c`` plus, for float64 math, the residual mean a float64 ``mean`` misses where that matters."""
    raise RuntimeError(JIT_ONLY)


@overload(_wide_fix, jit_options=_PIECE)
def _wide_fix_ol(xr, mean, r, k, c):  # type: ignore[no-untyped-def]
    # k + c carries a float64 mean exactly for narrower math types only; a float64 mean is itself rounded:
    # where that matters (an offset much larger than the spread) c gets the row's residual mean
    if xr.dtype != types.float64:
        return lambda xr, mean, r, k, c: c

    def wide(xr, mean, r, k, c):  # type: ignore[no-untyped-def]
        if abs(mean) * r > 8.0 and math.isfinite(mean):
            return c + tcast(xr, _mean_fix(xr, k, c))
        return c

    return wide


def _c_fwd_stats(stat, xr, corr):  # type: ignore[no-untyped-def]
    k = _row_shift(xr)
    s1, s2 = _shifted_sums(xr, k)
    return _c_fwd_finish(xr, k, s1, s2, corr)


@jit(FM_SUM, inline="always")
def _c_fwd_finish(xr, k, s1, s2, corr):  # type: ignore[no-untyped-def]
    h = xr.shape[0]
    if not (math.isfinite(s1) and math.isfinite(s2)):
        return False, k, 0.0, 0.0
    if s1 * s1 > 0.25 * h * s2:  # shift far from the mean: redo around the mean
        k = tcast(xr, np.float64(k) + s1 / h)
        s1, s2 = _shifted_sums(xr, k)
        if not (math.isfinite(s1) and math.isfinite(s2)):
            return False, k, 0.0, 0.0
    c = s1 / h
    if s2 < tiny_sum(xr) and _any_off(xr, k, tcast(xr, 0.0)):
        return False, k, c, 0.0
    return True, k, c, max(s2 - s1 * c, 0.0) / (h - corr)


def _c_bwd_centring(stat, xr, mean, r):  # type: ignore[no-untyped-def]
    k = tcast(xr, mean)
    return k, _wide_fix(xr, mean, r, k, tcast(xr, mean - np.float64(k)))


def _c_bwd_finish(stat, xr, k, c, sg, sgx, sd2, r, corr, mode, aux):  # type: ignore[no-untyped-def]
    h = xr.shape[0]
    n = h - corr
    ok = math.isfinite(sg) and math.isfinite(sgx) and math.isfinite(sd2)
    if ok and mode == OUTSIDE and sd2 < tiny_sum(xr):
        ok = not _any_off(xr, k, c)
    coef = 0.0
    if ok:
        if mode == OUTSIDE:
            s = math.sqrt(sd2 / n)
            coef = sgx / (n * s * r) if s > 0 else 0.0
        else:
            coef = sgx / n
    return ok, tcast(xr, sg / h), tcast(xr, coef)


def _c_dx_elem(stat, xr, dyr, w, k, c, r, gbar, coef, j):  # type: ignore[no-untyped-def]
    xhat = _centre(ld(xr[j]), k, c) * r
    dy = ld(dyr[j])
    g = _prod(dy, wat(w, j)) if w is not None else dy
    return r * ((g - gbar) - xhat * coef)


# ---------------------------------------------------------------------------
# statistic "mean_square" (RMSNorm): v = mean(x^2), no centring, no gbar


def _ms_fwd_stats(stat, xr, corr):  # type: ignore[no-untyped-def]
    ok, s2 = _squares_row(xr)
    return ok, tcast(xr, 0.0), 0.0, (s2 / xr.shape[0] if ok else 0.0)


def _ms_fwd_finish(stat, xr, k, s1, s2, corr):  # type: ignore[no-untyped-def]
    ok = _squares_ok(xr, s2)
    return ok, tcast(xr, 0.0), 0.0, (s2 / xr.shape[0] if ok else 0.0)


def _ms_seg_sums(stat, xr, k, j0, j1, c1s, c2s):  # type: ignore[no-untyped-def]
    zero = tcast(xr, 0.0)
    _chunk_range(xr, zero, zero, j0, j1, None, c2s)


def _ms_bwd_finish(stat, xr, k, c, sg, sgx, sd2, r, corr, mode, aux):  # type: ignore[no-untyped-def]
    return math.isfinite(sgx), tcast(xr, 0.0), tcast(xr, sgx / xr.shape[0])


def _c_slow_finish(stat, sg, sgx, sd2, h, n, r_s, mode, aux):  # type: ignore[no-untyped-def]
    if mode == OUTSIDE:
        s_s = math.sqrt(sd2 / n)
        return sg / h, (sgx / (n * s_s * r_s) if s_s > 0 else 0.0)
    return sg / h, sgx / n


# ---------------------------------------------------------------------------
# statistic "l2" (ScaleNorm): v = sum(x^2), r = 1 / max(sqrt(v), eps) (FLOOR) or 1 / sqrt(v + eps); on the floor
# branch r is a constant (coef = 0). Elements, products and dx are the mean square's.


def _l2_fwd_stats(stat, xr, corr):  # type: ignore[no-untyped-def]
    ok, s2 = _squares_row(xr)
    return ok, tcast(xr, 0.0), 0.0, (s2 if ok else 0.0)


def _l2_fwd_finish(stat, xr, k, s1, s2, corr):  # type: ignore[no-untyped-def]
    ok = _squares_ok(xr, s2)
    return ok, tcast(xr, 0.0), 0.0, (s2 if ok else 0.0)


def _l2_bwd_finish(stat, xr, k, c, sg, sgx, sd2, r, corr, mode, aux):  # type: ignore[no-untyped-def]
    return math.isfinite(sgx), tcast(xr, 0.0), tcast(xr, 0.0 if aux != 0.0 else sgx)


def _ms_dx_elem(stat, xr, dyr, w, k, c, r, gbar, coef, j):  # type: ignore[no-untyped-def]
    dy = ld(dyr[j])
    g = dy * wat(w, j) if w is not None else dy
    return r * (g - (ld(xr[j]) * r) * coef)


# ---------------------------------------------------------------------------
# registration: each statistic's implementation of each piece (a new statistic is one more mapping, named by its
# record)

#: the r rules of :func:`_rfactor` / :func:`_scaled_rstd`, as every statistic here forms ``r``; the third sum's
#: term and the slow path's dx element, as every statistic here has them
_R_PIECES = {
    rfactor: lambda stat, v, eps, mode: _rfactor(v, eps, mode),
    scaled_rstd: lambda stat, v_s, e, eps, mode: _scaled_rstd(v_s, e, eps, mode),
    third_term: lambda stat, d, xhat: d * d,
    slow_dx: lambda stat, g, gbar, d, xhat, coef, r: r * ((g - gbar) - xhat * coef),
}

MEAN_SQUARE = {
    is_centered: lambda stat: False,
    third_sum: lambda stat, mode: False,
    **_R_PIECES,
    row_aux: lambda stat, k, c, v, eps, mode: 0.0,
    slow_aux: lambda stat, m1, c, e, v_s, eps, mode: 0.0,
    slow_finish: lambda stat, sg, sgx, s3, h, n, r_s, mode, aux: (0.0, sgx / n),
    fwd_stats: _ms_fwd_stats,
    fwd_shift: lambda stat, xr: tcast(xr, 0.0),
    seg_sums: _ms_seg_sums,
    fwd_finish: _ms_fwd_finish,
    scaled_stats: lambda stat, xr, e, corr: (0.0, 0.0, _ms_scaled_stats(xr, e)),
    centre: lambda stat, v, k, c: v,
    gprod: lambda stat, dy, w: _prod_fm(dy, w),
    bwd_centring: lambda stat, xr, mean, r: (tcast(xr, 0.0), tcast(xr, 0.0)),
    bwd_finish: _ms_bwd_finish,
    dx_elem: _ms_dx_elem,
    slow_shift: lambda stat, mean, e: 0.0,
    slow_residual: lambda stat, xr, mean, e: 0.0,
}

CENTERED = {
    is_centered: lambda stat: True,
    third_sum: lambda stat, mode: mode == OUTSIDE,
    **_R_PIECES,
    row_aux: lambda stat, k, c, v, eps, mode: np.float64(k) + c,
    slow_aux: lambda stat, m1, c, e, v_s, eps, mode: math.ldexp(m1 + c, e),
    slow_finish: _c_slow_finish,
    fwd_stats: _c_fwd_stats,
    fwd_shift: lambda stat, xr: _row_shift(xr),
    seg_sums: lambda stat, xr, k, j0, j1, c1s, c2s: _chunk_range(xr, k, tcast(xr, 0.0), j0, j1, c1s, c2s),
    fwd_finish: lambda stat, xr, k, s1, s2, corr: _c_fwd_finish(xr, k, s1, s2, corr),
    scaled_stats: lambda stat, xr, e, corr: _centered_scaled_stats(xr, e, corr),
    centre: lambda stat, v, k, c: _centre(v, k, c),
    gprod: lambda stat, dy, w: _prod(dy, w),
    bwd_centring: _c_bwd_centring,
    bwd_finish: _c_bwd_finish,
    dx_elem: _c_dx_elem,
    slow_shift: lambda stat, mean, e: math.ldexp(mean, -e),
    slow_residual: lambda stat, xr, mean, e: _slow_residual(xr, mean, e),
}

#: l2 (ScaleNorm): the mean square's elements, products and dx; its own sum, floor and coefficient
L2 = {
    **MEAN_SQUARE,
    row_aux: lambda stat, k, c, v, eps, mode: 1.0 if mode == FLOOR and math.sqrt(v) < eps else 0.0,
    slow_aux: lambda stat, m1, c, e, v_s, eps, mode: _scaled_floor(v_s, e, eps, mode),
    slow_finish: lambda stat, sg, sgx, s3, h, n, r_s, mode, aux: (0.0, 0.0 if aux != 0.0 else sgx),
    fwd_stats: _l2_fwd_stats,
    fwd_finish: _l2_fwd_finish,
    scaled_stats: lambda stat, xr, e, corr: (0.0, 0.0, _scaled_sum_squares(xr, e)),
    bwd_finish: _l2_bwd_finish,
}

#: every piece a statistic implements (the keys of its mapping)
STUBS = tuple(CENTERED)


#: the pieces compiled without fastmath flags: the slow path's float64 arithmetic, rounded as written
_EXACT_PIECE: Any = {"error_model": "numpy"}


def _register(stub):  # type: ignore[no-untyped-def]
    def typer(stat, *args):  # type: ignore[no-untyped-def]
        return pieces(stat).get(stub)

    overload(stub, jit_options=_EXACT_PIECE if stub is slow_dx else _PIECE, strict=False)(typer)


for _stub in STUBS:
    _register(_stub)
