# numba's type stubs do not model intrinsics or jitted calls:
# mypy: disable-error-code="call-arg,attr-defined,var-annotated,call-overload"
r"""Transcendental functions that LLVM vectorizes inside numba loops (no libm call in a hot loop).

numba without Intel SVML lowers ``math.tanh``, ``math.exp``, ``x ** p`` to scalar libm calls, which keep
LLVM from vectorizing the loop around them. The functions here are straight-line arithmetic, bit casts and
selects (no branch, no call), so a loop of them vectorizes (AVX-512: 16 float32 or 8 float64 lanes). They
serve the element-wise family's float32 and float16/bfloat16 storage (:mod:`._ew_kernels`); float64
storage keeps libm.

Error bounds (ulps of the float32 result against the exact value; the measured maxima are those of
``tests/test_vmath.py``, every float32 exponent sampled against mpmath):

* :func:`exp2_f32` -- :math:`2^t` on float32 arithmetic (range reduction ``t = n + f``, ``|f| <= 1/2``,
  degree-7 Taylor polynomial, the scale ``2^n`` built from exponent bits in two exact factors so that
  subnormal results are rounded once): <= 1 ulp, subnormal results included; ``2^t`` overflows to inf for
  ``t >= 128``, is 0 below ``-150``; NaN gives NaN, ``exp2(-inf) = 0``.
* :func:`log2_d` / :func:`exp2_d` -- float64 arithmetic, relative error <= 2^-40 (log2, from
  ``2 atanh((m-1)/(m+1))``, 7 terms) and <= 2^-31 (exp2, degree-8 Taylor polynomial): used for float32
  results, whose one final rounding dominates (:func:`log2_f32`, :func:`spow_f32`: <= 1 ulp).
* :func:`spow_f32` -- signed power :math:`\operatorname{sign}(x)|x|^p = \pm 2^{p \log_2|x|}`, ``p > 0``, in
  float64 arithmetic rounded once to float32: <= 1 ulp for every float32 ``x`` (subnormal ``x`` and
  results included) and every ``p > 0`` with ``|p log2|x|| <= 1000``; ``+-0 -> +-0``, ``+-inf -> +-inf``,
  NaN gives NaN (the reference's ``sign(x) |x|^p``).
* :func:`tanh_sech2` -- :math:`\tanh` and :math:`\operatorname{sech}^2` of ``z + zlo`` (a float32 ``z`` plus a
  correction ``zlo``, ``z + zlo`` to float64 accuracy, so that the rounding of ``alpha x`` to float32 is not
  amplified by ``2|z|``) from one exponential ``s = e^{-2|z + zlo|} = m 2^n`` (float32 arithmetic, ``f = -2|z|
  log2 e - n`` with the product's rounding and ``log2 e``'s tail added back, degree-7 polynomial) and one
  division ``1 / (1 + s)``:

  - ``tanh``: ``|z| < 0.625``: ``z + z^3 P(z^2)`` (a degree-4 weighted least-squares fit, relative error
    4.4e-9), ``zlo`` added to first order; else ``1 - 2 s r`` with ``r = 1 / (1 + s)`` (one fma: the product is not
    rounded, the subtraction last): <= 2 ulps (measured 1.08); odd, ``tanh(+-0) = +-0``, subnormals exact, ``+-1``
    from ``|z| >= 9.01``, NaN gives NaN;
  - ``sech^2 = 4s/(1+s)^2`` (the reference's form) as ``v 2^k`` with ``v`` a normal float32 and ``k`` an int32,
    so that a product with a large gradient keeps full relative accuracy where ``sech^2`` itself is below
    float32's range: relative error <= 2^-21 (8 ulps) for ``|z| <= 128``, 0 beyond (below ``2^-370``).

  The backward of DyT needs both (``dweight``'s ``dy tanh``, ``dx``'s ``alpha G sech^2``).
* :func:`tanh_f32` -- :math:`\tanh(z + z_{lo})` alone, DyT's forward: the same pieces with ``|z|`` clamped to 16
  first (``s >= 2^-47`` is then normal: no range clamps, no far-tail selects) and ``1 - 2s / (1 + s)`` above 0.625:
  <= 2 ulps (measured 1.18; the same special values). Fewer operations than :func:`tanh_sech2`'s ``t`` (DyT's
  forward loop 0.41 -> 0.35 ns per float32 element in cache, one thread); the two may differ by an ulp.
* :func:`erf_d` -- :math:`\operatorname{erf} z` in float64 arithmetic for float32 (and half) results, Derf's
  function: ``|z| < 1``: the Taylor series ``z sum_n (-1)^n 2 z^{2n} / (sqrt(pi) n! (2n+1))``, 15 terms (alternating:
  truncation below the first omitted term, 3e-14 relative); ``1 <= |z| < 4``: ``1 - e^{-z^2} R(z)`` with ``R`` the
  scaled complementary function ``erfcx`` as a degree-14 polynomial in ``(2|z| - 5) / 3`` (a Chebyshev fit against
  mpmath; the product's absolute error <= 1.8e-11) and ``e^{-z^2}`` by :func:`exp2_d` (relative 2^-31, times
  ``erfc(1) = 0.16``); ``|z| >= 4``: ``+-1`` (``erfc(4) = 1.5e-8`` is below half an ulp of float32's 1). Relative
  error <= 1e-10 below ``|z| = 4`` (1.5e-8 at most above, the saturation: made for float32 results), before the one
  rounding to float32: <= 1 ulp (measured 0.50 against mpmath on every float32
  exponent, ``tests/test_vmath.py``); odd, ``erf(+-0) = +-0``, subnormals exact, NaN gives NaN.
* :func:`erf_and_prime_d` -- ``erf z`` (as :func:`erf_d`) and :math:`\operatorname{erf}' z = \tfrac{2}{\sqrt\pi}
  e^{-z^2}` in float64 from one exponential (relative error <= 2^-30 while ``z^2 log2 e <= 1000``, 0 beyond: far
  below float32's range; NaN gives NaN): Derf's backward, which needs both.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from ._cache import FM_SUM, jit
from ._storage import bitcast
from ._storage import fma as _fma

# the scalar functions are inlined into their callers (numba IR) so that LLVM sees one loop body to vectorize

__all__ = [
    "abs_pow_d",
    "erf_and_prime_array",
    "erf_and_prime_d",
    "erf_d",
    "erf_f32_array",
    "exp2_d",
    "exp2_f32",
    "exp2_f32_array",
    "log2_d",
    "log2_f32",
    "log2_f32_array",
    "pow_d",
    "scale_d",
    "scale_f32",
    "spow_f32",
    "spow_f32_array",
    "tanh_f32",
    "tanh_f32_array",
    "tanh_sech2",
    "tanh_sech2_array",
]

_F32 = np.float32

# ---------------------------------------------------------------------------
# bit casts and fma


@intrinsic
def _i2f(typingctx, v):  # type: ignore[no-untyped-def]
    """The float32 whose bits are the low 32 bits of the integer ``v``."""
    if not isinstance(v, types.Integer) or v.bitwidth < 32:
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        i = args[0]
        if v.bitwidth > 32:
            i = builder.trunc(i, ir.IntType(32))
        return builder.bitcast(i, ir.FloatType())

    return types.float32(v), codegen


_f2i = bitcast(types.float32, types.int32, "_f2i")
_l2d = bitcast(types.int64, types.float64, "_l2d")
_d2l = bitcast(types.float64, types.int64, "_d2l")


@jit(FM_SUM, forceinline=True)
def _pow2i(k):  # type: ignore[no-untyped-def]
    """``2^k`` as a float32 for an int32 ``-126 <= k <= 127``."""
    return _i2f((k + np.int32(127)) << np.int32(23))


# ---------------------------------------------------------------------------
# float32 exp2 and tanh

# 2^f = e^(f ln2), Taylor coefficients ln2^k / k!  (|f| <= 1/2: truncation 5.2e-9 relative)
_E1 = _F32(0.6931471805599453)
_E2 = _F32(0.2402265069591007)
_E3 = _F32(0.05550410866482158)
_E4 = _F32(0.009618129107628477)
_E5 = _F32(0.0013333558146428443)
_E6 = _F32(0.00015403530393381606)
_E7 = _F32(1.525273380405984e-05)


@jit(FM_SUM, forceinline=True)
def _exp2_poly(f):  # type: ignore[no-untyped-def]
    """``2^f`` for a float32 ``|f| <= 1/2``: the degree-7 Taylor polynomial, by Horner's rule in fma."""
    p = _fma(f, _E7, _E6)
    p = _fma(f, p, _E5)
    p = _fma(f, p, _E4)
    p = _fma(f, p, _E3)
    p = _fma(f, p, _E2)
    p = _fma(f, p, _E1)
    return _fma(f, p, _F32(1.0))


@jit(FM_SUM, forceinline=True)
def _exp2_red(t):  # type: ignore[no-untyped-def]
    """``(m, n)``: ``2^t = m 2^n`` with ``n`` an int32 in ``[-370, 254]`` (``t`` clamped there; NaN -> -370)
    and ``m = 2^(t - n)`` (``|t - n| <= 1/2`` inside the range)."""
    tc = t if t > _F32(-370.0) else _F32(-370.0)
    tc = tc if tc < _F32(254.0) else _F32(254.0)
    nf = np.floor(tc + _F32(0.5))
    f = t - nf
    m = _exp2_poly(f)
    return m, np.int32(nf)


@jit(FM_SUM, forceinline=True)
def exp2_f32(t):  # type: ignore[no-untyped-def]
    """:math:`2^t` for a float32 ``t`` (see the module doc: <= 1 ulp)."""
    m, n = _exp2_red(t)
    n = n if n > np.int32(-252) else np.int32(-252)
    hi = (n + np.int32(1)) >> np.int32(1)  # ceil(n / 2): m 2^hi is normal, exact
    r = m * _pow2i(hi) * _pow2i(n - hi)
    return _F32(0.0) if t < _F32(-252.0) else r


_LOG2E = _F32(1.4426950408889634)
_LOG2E_LO = _F32(1.4426950408889634 - float(np.float32(1.4426950408889634)))
# tanh z = z + z^3 P(z^2) on |z| < 0.625 (relative error 4.4e-9)
_T0 = _F32(-0.33333281944527177)
_T1 = _F32(0.13331442246872482)
_T2 = _F32(-0.053739718040140876)
_T3 = _F32(0.020639094227819895)
_T4 = _F32(-0.005704992500996458)
_TANH_SMALL = _F32(0.625)


@jit(FM_SUM, forceinline=True)
def _tanh_poly(az):  # type: ignore[no-untyped-def]
    """``tanh |z|`` for ``|z| < 0.625``: ``|z| + |z|^3 P(z^2)`` (the module doc)."""
    w2 = az * az
    q = _fma(w2, _T4, _T3)
    q = _fma(w2, q, _T2)
    q = _fma(w2, q, _T1)
    q = _fma(w2, q, _T0)
    return _fma(az * w2, q, az)


@jit(FM_SUM, forceinline=True)
def _tanh_finish(t, z, zlo, small):  # type: ignore[no-untyped-def]
    """``tanh |z|`` given ``z``'s sign, and ``zlo`` added to first order where ``small`` (the polynomial's branch; not
    for ``zlo = 0``: tanh(-0) is -0); above it ``zlo`` is already in ``s``."""
    t = math.copysign(t, z)
    return _fma(zlo, _F32(1.0) - t * t, t) if small and zlo != _F32(0.0) else t


@jit(FM_SUM, forceinline=True)
def tanh_sech2(z, zlo):  # type: ignore[no-untyped-def]
    """``(t, v, k)``: :math:`\\tanh(z + z_{lo})` (float32 ``t``) and
    :math:`\\operatorname{sech}^2(z + z_{lo}) = v\\,2^k` (float32 ``v``, int32 ``k``) from one exponential and one
    division (see the module doc). ``v`` is 0 where the exact value is below ``2^-370`` (a float32 product with it
    is 0)."""
    az = abs(z)
    a2 = az + az
    u = -(a2 * _LOG2E)
    _, n = _exp2_red(u)
    # f = -(2|z| + 2 sign(z) zlo) log2 e - n, with the product's rounding and log2 e's tail added back
    lo = a2 * _LOG2E_LO + math.copysign(_F32(2.0), z) * zlo * _LOG2E
    f = _fma(-a2, _LOG2E, -_F32(n)) - lo
    m = _exp2_poly(f)
    far = u < _F32(-370.0)  # s below 2^-370 (|z| > 128, infinities): s = 0, tanh = +-1, sech^2 = 0
    s = m * _pow2i(n if n > np.int32(-126) else np.int32(-126))  # only 1 + s and 1 - s matter below 2^-126
    s = _F32(0.0) if far else s
    r = _F32(1.0) / (_F32(1.0) + s)
    v = (_F32(0.5) * m) * (r * r)  # 4 s / (1 + s)^2 = (m / 2 / (1 + s)^2) 2^(n + 3)
    v = _F32(0.0) if far else v
    # tanh |z|: z + z^3 P(z^2) below 0.625 (then zlo to first order), 1 - 2 s r above (zlo already in s)
    small = az < _TANH_SMALL
    t = _tanh_finish(_tanh_poly(az) if small else _fma(-(s + s), r, _F32(1.0)), z, zlo, small)
    return (t if z == z else z), v, n + np.int32(3)


#: |z| clamped here in :func:`tanh_f32`: tanh(16) = 1 - 2.5e-14 rounds to 1, and s = e^(-2|z|) >= 2^-47 stays normal
_TANH_CLAMP = _F32(16.0)


@jit(FM_SUM, forceinline=True)
def tanh_f32(z, zlo):  # type: ignore[no-untyped-def]
    """:math:`\tanh(z + z_{lo})` alone (float32; the forward of DyT, which needs no ``sech^2``): as
    :func:`tanh_sech2`'s ``t`` with fewer operations -- ``|z|`` clamped to 16 first, so that ``s = e^{-2|z|}`` needs
    no range clamps and no far-tail selects, and ``t = 1 - 2s / (1 + s)`` above 0.625 (the subtraction last: its
    rounding and the quotient's, ``2s/(1+s) <= 0.446``, give at most about 1.5 ulps). NaN takes the polynomial's
    branch, which propagates it. Bound: <= 2 ulps, as :func:`tanh_sech2`."""
    az = abs(z)
    big = az >= _TANH_SMALL  # False for NaN
    near = az < _TANH_CLAMP
    ac = az if near else _TANH_CLAMP
    a2 = ac + ac
    nf = np.floor(_F32(0.5) - a2 * _LOG2E)  # n of s = m 2^n, in [-47, 0]
    # f = -(2|z| + 2 sign(z) zlo) log2 e - n, with the product's rounding and log2 e's tail added back (zlo only
    # where |z| is not clamped: a huge z's zlo may be huge too)
    lo = a2 * _LOG2E_LO + math.copysign(_F32(2.0), z) * (zlo if near else _F32(0.0)) * _LOG2E
    f = _fma(-a2, _LOG2E, -nf) - lo
    s = _exp2_poly(f) * _pow2i(np.int32(nf))
    tb = _F32(1.0) - (s + s) / (_F32(1.0) + s)
    return _tanh_finish(tb if big else _tanh_poly(az), z, zlo, not big)


@jit(FM_SUM, forceinline=True)
def scale_f32(v, k):  # type: ignore[no-untyped-def]
    """``v 2^k`` in float32 for a float32 ``v`` and an int32 ``-378 <= k <= 127`` (int32 arithmetic: the loop keeps
    float32's 16 lanes): three exact power-of-two
    factors, the largest first (one rounding where the result is normal; in the subnormal range the
    intermediate roundings add at most one subnormal spacing)."""
    c1 = k if k > np.int32(-126) else np.int32(-126)
    r = k - c1
    c2 = r if r > np.int32(-126) else np.int32(-126)
    c3 = r - c2
    return v * _pow2i(c1) * _pow2i(c2) * _pow2i(c3)


@jit(FM_SUM, forceinline=True)
def scale_d(v, k):  # type: ignore[no-untyped-def]
    """``v 2^k`` in float64 for a float64 ``v`` and an int32 ``-1000 <= k <= 1000`` (exact but for over/underflow
    of the float64 product, far outside float32's range)."""
    return v * _l2d((np.int64(k) + np.int64(1023)) << np.int64(52))


# ---------------------------------------------------------------------------
# float64-arithmetic log2 / exp2 for float32 results

_INV_LN2 = 1.4426950408889634
_SQRT2 = 1.4142135623730951
# ln m = 2 s (1 + s^2/3 + ... + s^12/13), s = (m - 1) / (m + 1), |s| <= 0.1716
_L3 = 1.0 / 3.0
_L5 = 1.0 / 5.0
_L7 = 1.0 / 7.0
_L9 = 1.0 / 9.0
_L11 = 1.0 / 11.0
_L13 = 1.0 / 13.0
# 2^f, |f| <= 1/2: Taylor coefficients ln2^k / k!, k <= 8 (truncation 2.4e-10 relative)
_D1 = 0.6931471805599453
_D2 = 0.2402265069591007
_D3 = 0.05550410866482158
_D4 = 0.009618129107628477
_D5 = 0.0013333558146428443
_D6 = 0.00015403530393381606
_D7 = 1.525273380405984e-05
_D8 = 1.3215486790144307e-06


@jit(FM_SUM, forceinline=True)
def log2_d(t):  # type: ignore[no-untyped-def]
    """:math:`\\log_2 t` for a positive, finite, normal float64 ``t`` (relative error <= 2^-40; other values:
    garbage, the callers select)."""
    bits = _d2l(t)
    e = ((bits >> np.int64(52)) & np.int64(0x7FF)) - np.int64(1023)
    m = _l2d((bits & np.int64(0x000FFFFFFFFFFFFF)) | np.int64(0x3FF0000000000000))
    up = m > _SQRT2
    m = m * 0.5 if up else m
    e = e + np.int64(1) if up else e
    s = (m - 1.0) / (m + 1.0)
    s2 = s * s
    q = _L13
    q = q * s2 + _L11
    q = q * s2 + _L9
    q = q * s2 + _L7
    q = q * s2 + _L5
    q = q * s2 + _L3
    ln = (s + s) * (q * s2 + 1.0)
    return np.float64(e) + ln * _INV_LN2


@jit(FM_SUM, forceinline=True)
def exp2_d(y):  # type: ignore[no-untyped-def]
    """:math:`2^y` for a float64 ``y`` (relative error <= 2^-31 on ``[-1000, 1000]``; 0 below, inf above: far outside
    float32's range, so that ``p t^(p-1)`` for a huge ``p`` is 0 or inf as in the reference, not ``p 2^-1000``;
    NaN -> 2^-1000, the callers select)."""
    yc = y if y > -1000.0 else -1000.0
    yc = yc if yc < 1000.0 else 1000.0
    nf = np.floor(yc + 0.5)
    f = yc - nf
    p = _D8
    p = p * f + _D7
    p = p * f + _D6
    p = p * f + _D5
    p = p * f + _D4
    p = p * f + _D3
    p = p * f + _D2
    p = p * f + _D1
    p = p * f + 1.0
    r = scale_d(p, np.int32(nf))
    r = 0.0 if y < -1000.0 else r
    return np.inf if y > 1000.0 else r


# erf z = z sum_n C_n z^(2n) on |z| < 1: C_n = (-1)^n 2 / (sqrt(pi) n! (2n + 1)), n < 15
_ERF_TAYLOR = (
    1.1283791670955126, -0.37612638903183754, 0.11283791670955128, -0.026866170645131252, 0.005223977625442188,
    -0.0008548327023450853, 0.00012055332981789665, -1.4925650358406252e-05, 1.6462114365889248e-06,
    -1.6365844691234924e-07, 1.480719281587922e-08, -1.2290555301717928e-09, 9.422759064650411e-11,
    -6.711366855164111e-12, 4.4632242632864775e-13,
)  # fmt: skip
# erfcx(t) = e^(t^2) erfc(t) on 1 <= t <= 4: sum_k R_k w^k, w = (2t - 5) / 3 (Chebyshev fit, degree 14)
_ERFCX = (
    0.21080636405462613, -0.11152102074917282, 0.05611049427315022, -0.027005275783591322, 0.012489356649626119,
    -0.005570928958730586, 0.002403783826539751, -0.0010047884627347927, 0.00040855915191994474,
    -0.00016449745052409537, 6.36723688859228e-05, -2.0489641463345118e-05, 7.4735467094712184e-06,
    -5.0581791104424315e-06, 1.8130120813515955e-06,
)  # fmt: skip
_TWO_OVER_SQRT_PI = 1.1283791670955126


@jit(FM_SUM, forceinline=True)
def _horner14(c, u):  # type: ignore[no-untyped-def]
    """``sum_k c[k] u^k`` for the 15 coefficients ``c`` (written out: the loop body stays straight-line code)."""
    p = c[14]
    p = p * u + c[13]
    p = p * u + c[12]
    p = p * u + c[11]
    p = p * u + c[10]
    p = p * u + c[9]
    p = p * u + c[8]
    p = p * u + c[7]
    p = p * u + c[6]
    p = p * u + c[5]
    p = p * u + c[4]
    p = p * u + c[3]
    p = p * u + c[2]
    p = p * u + c[1]
    return p * u + c[0]


@jit(FM_SUM, forceinline=True)
def _erf_with(z, e):  # type: ignore[no-untyped-def]
    """:math:`\\operatorname{erf} z` given ``e`` = :math:`e^{-z^2}` (by :func:`exp2_d`, shared with the derivative)."""
    t = abs(z)
    ts = t if t < 1.0 else 1.0
    small = z * _horner14(_ERF_TAYLOR, ts * ts)
    tl = t if t > 1.0 else 1.0
    tl = tl if tl < 4.0 else 4.0
    big = 1.0 - e * _horner14(_ERFCX, (tl + tl - 5.0) / 3.0)
    r = math.copysign(big if t < 4.0 else 1.0, z)
    r = small if t < 1.0 else r
    return r if t == t else z


@jit(FM_SUM, forceinline=True)
def _exp_neg_sq(z):  # type: ignore[no-untyped-def]
    """:math:`e^{-z^2}` in float64 (:func:`exp2_d`: relative error <= 2^-30 while ``z^2 log2 e <= 1000``, 0 beyond)."""
    return exp2_d(-(z * z) * _INV_LN2)


@jit(FM_SUM, forceinline=True)
def erf_d(z):  # type: ignore[no-untyped-def]
    """:math:`\\operatorname{erf} z` for a float64 ``z`` (relative error <= 1e-10 below ``|z| = 4``, +-1 from there: for
    float32 results; see the module doc)."""
    return _erf_with(z, _exp_neg_sq(z))


@jit(FM_SUM, forceinline=True)
def erf_and_prime_d(z):  # type: ignore[no-untyped-def]
    """``(erf z, erf' z)`` for a float64 ``z``, from one exponential (the first is :func:`erf_d`'s value;
    ``erf'`` is :math:`\\tfrac{2}{\\sqrt\\pi} e^{-z^2}`, ``erf`` uses the same :math:`e^{-z^2}` on [1, 4))."""
    e = _exp_neg_sq(z)
    p = _TWO_OVER_SQRT_PI * e
    return _erf_with(z, e), (p if z == z else z)


@jit(FM_SUM, forceinline=True)
def log2_f32(x):  # type: ignore[no-untyped-def]
    """:math:`\\log_2 x` for a float32 ``x``, rounded once to float32 (<= 1 ulp): ``log2(0) = -inf``, negative
    and NaN give NaN, ``log2(inf) = inf``."""
    t = np.float64(x)
    r = _F32(log2_d(t))
    r = r if t > 0.0 else (-np.inf if t == 0.0 else np.nan)
    return r if t < np.inf else _F32(t)


@jit(FM_SUM, forceinline=True)
def abs_pow_d(t, p):  # type: ignore[no-untyped-def]
    """``t^p`` in float64 for a float64 ``t >= 0`` (a float32 value, or NaN) and ``p > 0`` (relative error
    <= 2^-30 for ``|p log2 t| <= 1000``): ``0^p = 0``, ``inf^p = inf``, NaN gives NaN."""
    r = exp2_d(p * log2_d(t))
    r = r if t > 0.0 else t * 0.0
    return r if t < np.inf else t


@jit(FM_SUM, forceinline=True)
def pow_d(t, q):  # type: ignore[no-untyped-def]
    """``t^q`` in float64 for a float64 ``t > 0`` (a float32 value, inf or NaN) and any finite ``q`` (as
    :func:`abs_pow_d`): ``inf^q`` is inf for ``q > 0``, 0 for ``q < 0``, 1 for ``q = 0``; NaN gives NaN."""
    r = exp2_d(q * log2_d(t))
    r = r if t < np.inf else (t if q > 0.0 else (0.0 if q < 0.0 else 1.0))
    return r if t == t else t


@jit(FM_SUM, forceinline=True)
def spow_f32(x, p):  # type: ignore[no-untyped-def]
    """``sign(x) |x|^p`` for a float32 ``x`` and a float64 ``p > 0``, rounded once to float32 (<= 1 ulp)."""
    return _F32(math.copysign(abs_pow_d(abs(np.float64(x)), p), np.float64(x)))


# ---------------------------------------------------------------------------
# array forms (the tests' view of the scalar functions)


def _array_form(f):  # type: ignore[no-untyped-def]
    """A jitted loop applying the one-argument scalar function ``f`` to every element of a 1-d float32 array
    (numba cannot pass ``*args`` to an inlined closure: :func:`spow_f32_array` is written out)."""

    @jit()
    def array_form(x):  # type: ignore[no-untyped-def]
        y = np.empty_like(x)
        for i in range(x.size):
            y[i] = f(x[i])
        return y

    array_form.__name__ = array_form.__qualname__ = f"{f.__name__}_array"
    array_form.__doc__ = f":func:`{f.__name__}` of every element of a 1-d float32 array."
    return array_form


exp2_f32_array = _array_form(exp2_f32)


@jit()
def erf_f32_array(x):  # type: ignore[no-untyped-def]
    """:func:`erf_d` of every element of a 1-d float32 array, rounded to float32."""
    y = np.empty_like(x)
    for i in range(x.size):
        y[i] = _F32(erf_d(np.float64(x[i])))
    return y


log2_f32_array = _array_form(log2_f32)


@jit()
def erf_and_prime_array(z):  # type: ignore[no-untyped-def]
    """:func:`erf_and_prime_d` of every element of a 1-d float64 array: ``(erf, erf')``."""
    f = np.empty_like(z)
    e = np.empty_like(z)
    for i in range(z.size):
        f[i], e[i] = erf_and_prime_d(z[i])
    return f, e


@jit()
def spow_f32_array(x, p):  # type: ignore[no-untyped-def]
    """:func:`spow_f32` of every element of a 1-d float32 array."""
    y = np.empty_like(x)
    for i in range(x.size):
        y[i] = spow_f32(x[i], p)
    return y


@jit()
def tanh_f32_array(z, zlo):  # type: ignore[no-untyped-def]
    """:func:`tanh_f32` of every element of two 1-d float32 arrays (``z``, ``zlo``)."""
    t = np.empty(z.size, np.float32)
    for i in range(z.size):
        t[i] = tanh_f32(z[i], zlo[i])
    return t


@jit()
def tanh_sech2_array(z, zlo):  # type: ignore[no-untyped-def]
    """:func:`tanh_sech2` of every element of two 1-d float32 arrays (``z``, ``zlo``): ``(tanh, sech^2)``, the
    second as float64 ``v 2^k`` (an exact product: the float64 value carries the parts' error only)."""
    t = np.empty(z.size, np.float32)
    y = np.empty(z.size, np.float64)
    for i in range(z.size):
        ti, v, k = tanh_sech2(z[i], zlo[i])
        t[i] = ti
        y[i] = scale_d(np.float64(v), k)
    return t, y
