# numba's type stubs do not model intrinsics, overload stubs or jitted calls:
# mypy: disable-error-code="call-arg,attr-defined,var-annotated,call-overload"
r"""The element-wise family's kernels: ``y = w * f(x) + b`` element by element, one skeleton for every function.

Every kernel takes the function tag first (``fn``, :mod:`._variant`); the function's pieces are
``@overload``-ed on it (:data:`PIECES`: a new function adds its two pieces and one entry there):

* :func:`f_value` -- ``f(v; a)`` (``a``: the function's scalar, PowerNorm's exponent ``p`` or DyT's ``alpha``);
* :func:`f_grad` -- ``(dx, f, da)`` of one element from ``v`` and ``G = w dy``: ``dx = G f'(v)`` (saturated at
  ``big``, the largest finite value of ``x``'s dtype, where the function says so), ``f(v)`` (for
  ``dweight``) and the element's term of ``dL/da`` (DyT's ``x sech^2(alpha x) G``; 0 for PowerNorm).

Functions:

* ``"signed_power"``: :math:`f = \operatorname{sign}(v)\,|v|^p`, :math:`f' = p\,|v|^{p-1}` for :math:`v \ne 0`;
  at :math:`v = 0` it is 1 for :math:`p = 1` and 0 otherwise (the reference's documented subgradient);
  ``p = 1/2, 1, 2`` are evaluated as a square root, the identity and a square (the tag's ``exponent``
  flag, so each loop is specialized at compile time and vectorizes). ``dx`` is clipped to
  ``+-big``; where ``p |v|^(p-1)`` itself overflows (float64 subnormals with small ``p``) ``|G| p |v|^(p-1)``
  is evaluated as an exponential of logarithms before clipping, and ``G = 0`` gives 0: no finite input
  gives NaN or an infinity.
* ``"tanh"``: :math:`f = \tanh(\alpha v)`, :math:`f' = \alpha\,\operatorname{sech}^2(\alpha v)` with
  :math:`\operatorname{sech}^2 z = 4s/(1+s)^2`, :math:`s = e^{-2|z|}` (full relative accuracy where tanh
  saturates, as the reference).
* ``"erf"``: :math:`f = \operatorname{erf}(\alpha v + s)`, :math:`f' = \alpha\,\tfrac{2}{\sqrt\pi}
  e^{-z^2}`; its scalar ``a`` is the pair ``(alpha, s)`` and its term of the scalars' gradient the pair
  ``(v e G, e G)`` (``dalpha``'s, ``dshift``'s), added to a partial of two rows per block (:func:`_add_term`).
  The fast tags evaluate erf and the exponential in float64 arithmetic without libm (:func:`._vmath.erf_d`,
  <= 1 ulp of the float32 result); float64 storage keeps libm's ``erf`` and ``exp``.

Values are computed in the *function math type*: float32 for float16/bfloat16 storage, float64 for
float32/float64 (:func:`fcast`; the transcendental functions cost the same either way, and float64 keeps
float32's gradients in range); the forward value of the fast tags' tanh and signed power ``p = 1/2, 1`` is a
float32 value, and the affine after it one float32 fma (correctly rounded, and without the float64
conversions that cost the loop half its speed). Tags with the ``fast`` flag (float32 and half storage)
evaluate the functions with :mod:`._vmath` instead of libm (float32 arithmetic for tanh / sech^2, float64
arithmetic without libm for the power), so that every loop vectorizes; their backward needs no fix-up pass:
one loop computes every output, or, for a function whose :data:`PIECES` entry says ``"split"`` (tanh), one loop
``dx`` (and the values the partials take, into scratch rows of their own type, :func:`_scratch`) and a second
the float64 partials (in one loop, the partials held the float32 math to 8 lanes). Parameter-gradient partials
are per block of :data:`._layout.ROW_BLOCK` rows and column tile, rows added in order, then summed over blocks in
float64 in block order (:func:`._reduce.sum_blocks`): results do not depend on the thread count.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numba import types
from numba.extending import overload

from . import _vmath as vm
from ._borrow import borrow
from ._cache import FM_SUM, INLINED, INLINED_VIEW, jit
from ._layout import EW_TILE, PF_CHUNK, ROW_BLOCK
from ._storage import JIT_ONLY, ld, prefetch, seg, seg2, st, tile

__all__ = ["PIECES", "bwd_scratch", "ew_bwd", "ew_bwd_row", "ew_fwd", "ew_row", "f_fix", "f_grad", "f_value", "fcast"]

_PIECE: Any = {"fastmath": False, "error_model": "numpy"}


def fcast(a, v):  # type: ignore[no-untyped-def]
    """``v`` in the function math type of storage array ``a`` (float32 for half types, else float64)."""
    raise RuntimeError(JIT_ONLY)


@overload(fcast)
def _fcast_ol(a, v):  # type: ignore[no-untyped-def]
    if isinstance(v, types.BaseTuple):  # a function with two scalars (Derf's alpha, shift)
        return lambda a, v: (fcast(a, v[0]), fcast(a, v[1]))
    if a.dtype in (types.int16, types.uint16):
        return lambda a, v: np.float32(v)
    return lambda a, v: np.float64(v)


def f_value(fn, v, a):  # type: ignore[no-untyped-def]
    """``f(v; a)`` (see the module doc)."""
    raise RuntimeError(JIT_ONLY)


def f_grad(fn, v, g, a, big):  # type: ignore[no-untyped-def]
    """``(dx, f(v), da term)`` of one element (see the module doc)."""
    raise RuntimeError(JIT_ONLY)


def f_fix(fn, v, g, a, big, dx):  # type: ignore[no-untyped-def]
    """``dx`` of an element whose :func:`f_grad` value is NaN or infinite (rare: computed again, carefully)."""
    raise RuntimeError(JIT_ONLY)


def _exponent(fn):  # type: ignore[no-untyped-def]
    return fn.flags.get("exponent", "any")


def _abs_power(fn, t, p):  # type: ignore[no-untyped-def]
    """``t^p`` for ``t >= 0``; the tag's ``exponent`` flag picks a square root, the identity, a square or ``pow``."""
    raise RuntimeError(JIT_ONLY)


def _power_deriv(fn, t, p):  # type: ignore[no-untyped-def]
    """``p t^(p-1)`` for ``t > 0`` (as :func:`_abs_power`)."""
    raise RuntimeError(JIT_ONLY)


def _power_at_zero(fn, p):  # type: ignore[no-untyped-def]
    """The documented derivative at 0: 1 for ``p = 1``, else 0."""
    raise RuntimeError(JIT_ONLY)


@overload(_power_at_zero, jit_options=_PIECE)
def _power_at_zero_ol(fn, p):  # type: ignore[no-untyped-def]
    if _exponent(fn) == "one":
        return lambda fn, p: p - p + np.float32(1.0)  # (in p's type: float32 for the fast tags of 16-bit storage)
    return lambda fn, p: p - p


@overload(_abs_power, jit_options=INLINED)
def _abs_power_ol(fn, t, p):  # type: ignore[no-untyped-def]
    if _fast(fn):
        return {
            "half": lambda fn, t, p: math.sqrt(np.float32(t)),
            "one": lambda fn, t, p: t,
            "two": lambda fn, t, p: t * t,
        }.get(_exponent(fn), lambda fn, t, p: vm.abs_pow_d(np.float64(t), p))
    return {
        "half": lambda fn, t, p: math.sqrt(t),
        "one": lambda fn, t, p: t,
        "two": lambda fn, t, p: t * t,
    }.get(_exponent(fn), lambda fn, t, p: t**p)


@overload(_power_deriv, jit_options=INLINED)
def _power_deriv_ol(fn, t, p):  # type: ignore[no-untyped-def]
    if _fast(fn):
        return {
            "half": lambda fn, t, p: np.float32(0.5) / math.sqrt(np.float32(t)),
            "one": lambda fn, t, p: p - p + np.float32(1.0),
            "two": lambda fn, t, p: t + t,
        }.get(_exponent(fn), lambda fn, t, p: p * vm.pow_d(np.float64(t), p - 1.0))
    return {
        "half": lambda fn, t, p: 0.5 / math.sqrt(t),
        "one": lambda fn, t, p: p - p + 1.0,
        "two": lambda fn, t, p: t + t,
    }.get(_exponent(fn), lambda fn, t, p: p * t ** (p - 1.0))


def _saturate(fn, dx, deriv, big):  # type: ignore[no-untyped-def]
    """``dx`` clipped to ``+-big`` (selects only, so that the loop vectorizes; NaN stays NaN)."""
    raise RuntimeError(JIT_ONLY)


@overload(_saturate, jit_options=_PIECE)
def _saturate_ol(fn, dx, deriv, big):  # type: ignore[no-untyped-def]
    if _fast(fn):  # the clip is the reference's, in dx's type (float32 for 16-bit storage, whose big is a float32)
        if dx == types.float32:

            def f32(fn, dx, deriv, big):  # type: ignore[no-untyped-def]
                b = np.float32(big)
                return b if dx > b else (-b if dx < -b else dx)

            return f32
        return lambda fn, dx, deriv, big: big if dx > big else (-big if dx < -big else dx)
    # an infinite p t^(p-1) (float64 subnormals with small p) is flagged by the returned NaN / inf and redone
    # by _spow_exact
    return lambda fn, dx, deriv, big: (
        dx if abs(dx) <= big else (math.copysign(big, dx) if dx == dx and not math.isinf(deriv) else dx)
    )


def _spow_fix(fn, v, g, a, big, dx):  # type: ignore[no-untyped-def]
    raise RuntimeError(JIT_ONLY)


@overload(_spow_fix, jit_options=_PIECE)
def _spow_fix_ol(fn, v, g, a, big, dx):  # type: ignore[no-untyped-def]
    if _fast(fn):  # nothing to redo: the fast pieces' dx is final
        return lambda fn, v, g, a, big, dx: dx
    return lambda fn, v, g, a, big, dx: _spow_exact(g, abs(v), a, big) if math.isfinite(g) and math.isfinite(v) else dx


def _spow_value(fn, v, p):  # type: ignore[no-untyped-def]
    """``sign(v) |v|^p``: a float32 value for the fast tags' ``p = 1/2, 1`` (a correctly rounded square root, or
    ``v`` itself; the affine after it is then float32 arithmetic, one fma), else in ``v``'s type."""
    raise RuntimeError(JIT_ONLY)


@overload(_spow_value, jit_options=INLINED)
def _spow_value_ol(fn, v, p):  # type: ignore[no-untyped-def]
    if _fast(fn) and _exponent(fn) in ("half", "one"):

        def f32(fn, v, p):  # type: ignore[no-untyped-def]
            u = np.float32(v)  # exact: v is a float32 value
            return math.copysign(_abs_power(fn, abs(u), p), u)

        return f32
    return lambda fn, v, p: math.copysign(_abs_power(fn, abs(v), p), v)


def _spow_grad(fn, v, g, p, big):  # type: ignore[no-untyped-def]
    t = abs(v)
    deriv = _power_deriv(fn, t, p) if t != 0 else _power_at_zero(fn, p)
    dx = _saturate(fn, g * deriv, deriv, big)
    return dx, f_value(fn, v, p), g - g


@jit()
def _spow_exact(g, t, p, big):  # type: ignore[no-untyped-def]
    """``dx`` where ``p t^(p-1)`` overflows: 0 for ``g = 0``, else ``|g| p t^(p-1)`` by logarithms, clipped."""
    if g == 0:
        return g - g
    return math.copysign(min(math.exp(math.log(abs(g)) + math.log(p) + (p - 1.0) * math.log(t)), big), g)


def _fast(fn):  # type: ignore[no-untyped-def]
    """Whether the tag asks for the vectorizable float32 math of :mod:`._vmath` (float32 and half storage)."""
    return bool(fn.flags.get("fast", False))


def _alpha_z(v, a):  # type: ignore[no-untyped-def]
    """``(z, zlo)``: ``alpha v`` as a float32 plus its rounding error (float32 arithmetic, ``alpha`` split
    into two float32 parts, the product's error by an fma), ``z + zlo`` exact to ~2^-48 relative."""
    raise RuntimeError(JIT_ONLY)


@overload(_alpha_z, jit_options=INLINED)
def _alpha_z_ol(v, a):  # type: ignore[no-untyped-def]
    def impl(v, a):  # type: ignore[no-untyped-def]
        x = np.float32(v)
        ahi = np.float32(a)
        alo = np.float32(np.float64(a) - np.float64(ahi))
        z = ahi * x
        lo = vm._fma(ahi, x, -z) + alo * x
        # an infinite z (x infinite, or the product overflowed) has no rounding error to carry: 0, not NaN
        return z, lo if abs(z) < np.float32(np.inf) else np.float32(0.0)

    return impl


def _tanh_value(fn, v, a):  # type: ignore[no-untyped-def]
    raise RuntimeError(JIT_ONLY)


def _tanh_grad(fn, v, g, a, big):  # type: ignore[no-untyped-def]
    raise RuntimeError(JIT_ONLY)


@overload(_tanh_value, jit_options=INLINED)
def _tanh_value_ol(fn, v, a):  # type: ignore[no-untyped-def]
    if not _fast(fn):
        return lambda fn, v, a: math.tanh(a * v)

    def impl(fn, v, a):  # type: ignore[no-untyped-def]
        z, zlo = _alpha_z(v, a)
        return vm.tanh_f32(z, zlo)

    return impl


@overload(_tanh_grad, jit_options=INLINED)
def _tanh_grad_ol(fn, v, g, a, big):  # type: ignore[no-untyped-def]
    if not _fast(fn):

        def exact(fn, v, g, a, big):  # type: ignore[no-untyped-def]
            z = a * v
            s = math.exp(-2.0 * abs(z))
            gs = g * (4.0 * s / ((1.0 + s) * (1.0 + s)))
            return a * gs, math.tanh(z), gs * v

        return exact

    def impl(fn, v, g, a, big):  # type: ignore[no-untyped-def]
        z, zlo = _alpha_z(v, a)
        t, s2, k = vm.tanh_sech2(z, zlo)  # one exponential and one division for tanh and sech^2
        # g sech^2(alpha v) = (g v2) 2^k, the scale in exact factors: full relative accuracy where sech^2 itself
        # is below float32's range (v2 <= 2^-1.5 keeps g v2 finite)
        gs = vm.scale_f32(np.float32(g) * s2, k)
        ahi = np.float32(a)
        alo = np.float32(np.float64(a) - np.float64(ahi))
        d = ahi * gs
        # alpha's tail only for a finite gs: alo gs + ahi gs is NaN for gs = inf (the reference's alpha gs is inf)
        d = vm._fma(alo, gs, d) if abs(gs) < np.float32(np.inf) else d
        return d, t, gs * np.float32(v)

    return impl


def _erf_value(fn, v, a):  # type: ignore[no-untyped-def]
    raise RuntimeError(JIT_ONLY)


def _erf_grad(fn, v, g, a, big):  # type: ignore[no-untyped-def]
    raise RuntimeError(JIT_ONLY)


@overload(_erf_value, jit_options=INLINED)
def _erf_value_ol(fn, v, a):  # type: ignore[no-untyped-def]
    if not _fast(fn):
        return lambda fn, v, a: math.erf(a[0] * v + a[1])
    return lambda fn, v, a: vm.erf_d(np.float64(a[0]) * np.float64(v) + np.float64(a[1]))


@overload(_erf_grad, jit_options=INLINED)
def _erf_grad_ol(fn, v, g, a, big):  # type: ignore[no-untyped-def]
    if not _fast(fn):

        def exact(fn, v, g, a, big):  # type: ignore[no-untyped-def]
            z = a[0] * v + a[1]
            ge = g * (1.1283791670955126 * math.exp(-(z * z)))
            return a[0] * ge, math.erf(z), (ge * v, ge)

        return exact

    def impl(fn, v, g, a, big):  # type: ignore[no-untyped-def]
        x = np.float64(v)
        z = np.float64(a[0]) * x + np.float64(a[1])
        f, e = vm.erf_and_prime_d(z)  # one exponential for both
        ge = np.float64(g) * e
        return np.float64(a[0]) * ge, f, (ge * x, ge)

    return impl


def _add_term(par, j, t):  # type: ignore[no-untyped-def]
    """``par[j] += t`` for one scalar's term, ``par[0][j] += t[0]; par[1][j] += t[1]`` for a pair (two scalars:
    ``par`` a pair of partial rows)."""
    raise RuntimeError(JIT_ONLY)


@overload(_add_term, jit_options=INLINED)
def _add_term_ol(par, j, t):  # type: ignore[no-untyped-def]
    if isinstance(t, types.BaseTuple):

        def pair(par, j, t):  # type: ignore[no-untyped-def]
            par[0][j] += t[0]
            par[1][j] += t[1]

        return pair
    if isinstance(par, types.BaseTuple):  # a placeholder's term (a loop the pair's tags never run)

        def first(par, j, t):  # type: ignore[no-untyped-def]
            par[0][j] += t

        return first

    def one(par, j, t):  # type: ignore[no-untyped-def]
        par[j] += t

    return one


def _zero(par):  # type: ignore[no-untyped-def]
    """``par[:] = 0`` for a partial row, or for both rows of a pair."""
    raise RuntimeError(JIT_ONLY)


@overload(_zero, jit_options=INLINED)
def _zero_ol(par):  # type: ignore[no-untyped-def]
    if isinstance(par, types.BaseTuple):

        def pair(par):  # type: ignore[no-untyped-def]
            par[0][:] = 0
            par[1][:] = 0

        return pair

    def one(par):  # type: ignore[no-untyped-def]
        par[:] = 0

    return one


def _put_term(ts, j, t):  # type: ignore[no-untyped-def]
    """``ts[j] = t`` into a split function's scratch row (a pair's functions are not split: its first part, never
    run)."""
    raise RuntimeError(JIT_ONLY)


@overload(_put_term, jit_options=INLINED)
def _put_term_ol(ts, j, t):  # type: ignore[no-untyped-def]
    if isinstance(t, types.BaseTuple):

        def first(ts, j, t):  # type: ignore[no-untyped-def]
            ts[j] = t[0]

        return first

    def one(ts, j, t):  # type: ignore[no-untyped-def]
        ts[j] = t

    return one


def _pseg2(a, i, lo, hi):  # type: ignore[no-untyped-def]
    """The scalar partial's row ``a[i, lo:hi]`` (for a pair's ``(blocks, 2, H)``, the two rows ``(a[i, 0, lo:hi],
    a[i, 1, lo:hi])``: contiguous, so that the loops adding to them vectorize), None for None."""
    raise RuntimeError(JIT_ONLY)


def _pseg(a, lo, hi):  # type: ignore[no-untyped-def]
    """``a[lo:hi]`` (of both rows of a pair), None for None."""
    raise RuntimeError(JIT_ONLY)


@overload(_pseg2, jit_options=INLINED_VIEW)
def _pseg2_ol(a, i, lo, hi):  # type: ignore[no-untyped-def]
    if isinstance(a, types.NoneType):
        return lambda a, i, lo, hi: None
    if a.ndim == 3:
        return lambda a, i, lo, hi: (a[i, 0, lo:hi], a[i, 1, lo:hi])
    return lambda a, i, lo, hi: a[i, lo:hi]


@overload(_pseg, jit_options=INLINED_VIEW)
def _pseg_ol(a, lo, hi):  # type: ignore[no-untyped-def]
    if isinstance(a, types.NoneType):
        return lambda a, lo, hi: None
    if isinstance(a, types.BaseTuple):
        return lambda a, lo, hi: (a[0][lo:hi], a[1][lo:hi])
    return lambda a, lo, hi: a[lo:hi]


#: each function's implementation of each piece (a new function is one more entry; ``"split"``: see :func:`_split`;
#: ``"ahead"``: whether the forward asks the cache for its next task's input, :func:`_ahead`)
PIECES: dict[str, dict[Any, Any]] = {
    "signed_power": {
        f_value: lambda fn, v, a: _spow_value(fn, v, a),
        f_grad: _spow_grad,
        f_fix: lambda fn, v, g, a, big, dx: _spow_fix(fn, v, g, a, big, dx),
    },
    "tanh": {
        f_value: lambda fn, v, a: _tanh_value(fn, v, a),
        f_grad: lambda fn, v, g, a, big: _tanh_grad(fn, v, g, a, big),
        f_fix: lambda fn, v, g, a, big, dx: dx,
        "split": True,
        "ahead": lambda fn: True,
    },
    "erf": {
        f_value: lambda fn, v, a: _erf_value(fn, v, a),
        f_grad: lambda fn, v, g, a, big: _erf_grad(fn, v, g, a, big),
        f_fix: lambda fn, v, g, a, big, dx: dx,
    },
}


def _register(stub):  # type: ignore[no-untyped-def]
    def typer(fn, *args):  # type: ignore[no-untyped-def]
        if getattr(fn, "axis", None) != "function" or fn.choice not in PIECES:
            raise TypeError(f"expected an element-wise function tag, got {fn}")
        return PIECES[fn.choice][stub]

    # inlined by LLVM: the loops' bodies are then one function to vectorize
    overload(stub, jit_options=INLINED, strict=False)(typer)


for _stub in (f_value, f_grad, f_fix):
    _register(_stub)


def _ahead(fn):  # type: ignore[no-untyped-def]
    """Whether the forward computes each tile while asking the cache for the next one (:func:`ew_row_next`): for a
    function whose arithmetic and memory traffic take comparable times (tanh), which then overlap. A cheap loop
    (a square root, the identity) is at memory speed without it and loses to its pieces; the signed power's
    general ``p`` (float64 logarithms) is so far from memory speed that nothing overlaps. Measured on 4096 x 4096
    float32, 2 threads, interleaved runs: DyT's forward 10.0 -> 7.4 ms (medians of four, loaded machine),
    PowerNorm's ``p = 1/2`` 4.5 -> 4.8 ms, ``p = 0.3`` 12.9 -> 13.0 ms (quiet)."""
    raise RuntimeError(JIT_ONLY)


@overload(_ahead, jit_options=INLINED)
def _ahead_ol(fn):  # type: ignore[no-untyped-def]
    ahead = PIECES[fn.choice].get("ahead", lambda fn: False)(fn)
    return lambda fn: ahead


@jit(FM_SUM, forceinline=True)
def ew_elem(fn, v, av, wr, br, j):  # type: ignore[no-untyped-def]
    """``f(v; av) [* wr[j]] [+ br[j]]`` of one element ``v`` (in the function math type): the forward's arithmetic,
    before its one rounding to the output's dtype."""
    v = f_value(fn, v, av)
    if wr is not None:
        v = v * ld(wr[j])
    if br is not None:
        v = v + ld(br[j])
    return v


@jit(FM_SUM, forceinline=True)
def _ew_loop(fn, xr, av, wr, br, yr):  # type: ignore[no-untyped-def]
    for j in range(xr.shape[0]):  # from 0: no negative-index select, so that the loop vectorizes without gathers
        st(yr, j, ew_elem(fn, fcast(xr, ld(xr[j])), av, wr, br, j))


@jit(FM_SUM)
def ew_row(fn, xr, av, wr, br, yr):  # type: ignore[no-untyped-def]
    """``yr[j] = f(xr[j]; av) [* wr[j]] [+ br[j]]`` over one row (or a row's column tile): the forward's loop
    (``av`` in the function math type, ``wr``/``br`` as :func:`ew_fwd`'s). Also the statistics kernels' epilogue
    for the casting policies that round ``xhat`` before the affine (:mod:`._io`'s element-wise sink; its fast rows
    of a 16-bit ``q`` take :func:`ew_elem` element by element instead)."""
    _ew_loop(fn, xr, av, wr, br, yr)


@jit(FM_SUM)
def ew_row_next(fn, xr, av, wr, br, yr, nx):  # type: ignore[no-untyped-def]
    """:func:`ew_row`, asking the cache for ``nx`` (the next task's input, as long as ``xr``) piece by piece
    meanwhile (:data:`._layout.PF_CHUNK` elements a piece, the same piece of ``nx``)."""
    n = xr.shape[0]
    for lo in range(0, n, PF_CHUNK):
        hi = min(lo + PF_CHUNK, n)
        prefetch(nx, lo, hi)
        _ew_loop(fn, xr[lo:hi], av, seg(wr, lo, hi), seg(br, lo, hi), yr[lo:hi])


@jit(FM_SUM, borrowed=True)
def _ew_fwd_span(fn, x, a, w, b, y, t0, t1):  # type: ignore[no-untyped-def]
    """Tasks ``t0 <= t < t1`` (task ``t``: row ``t // tiles``, one column tile) of :func:`ew_fwd` (its body: see
    :func:`._stats_kernels._fwd_span`)."""
    h = x.shape[1]
    av = fcast(x, a)
    for t in range(t0, t1):
        i, j0, j1 = tile(t, h, EW_TILE)
        if _ahead(fn):
            i2, k0, k1 = tile(min(t + 1, t1 - 1), h, EW_TILE)
            ew_row_next(fn, x[i, j0:j1], av, seg(w, j0, j1), seg(b, j0, j1), y[i, j0:j1], x[i2, k0:k1])
        else:
            ew_row(fn, x[i, j0:j1], av, seg(w, j0, j1), seg(b, j0, j1), y[i, j0:j1])


@jit(FM_SUM)
def ew_fwd(fn, x, a, w, b, y, lo, hi):  # type: ignore[no-untyped-def]
    """``y = f(x; a) [* w] [+ b]`` (storage arrays; ``w``/``b`` ``(H,)`` in float32 or wider, a 16-bit one in its
    storage form, or None) for tasks ``lo <= t < hi``: task ``t`` is row ``t // tiles``, one column tile of
    :data:`._layout.EW_TILE`."""
    _ew_fwd_span(*borrow((fn, x, a, w, b, y)), lo, hi)


def _fused(fn):  # type: ignore[no-untyped-def]
    """Whether the backward computes every output in one loop (the fast pieces: no fix-up pass)."""
    raise RuntimeError(JIT_ONLY)


@overload(_fused, jit_options=INLINED)
def _fused_ol(fn):  # type: ignore[no-untyped-def]
    if _fast(fn):
        return lambda fn: True
    return lambda fn: False


def _split(fn):  # type: ignore[no-untyped-def]
    """Whether the fused backward takes two loops (its function's ``"split"`` entry in :data:`PIECES`, fast tags
    only): a function whose float32 math costs more than one more pass over the row in L1 (tanh: 1.95 against
    2.55 ns per element in one loop, in cache, one thread; the signed power's float64 loop runs at 8 lanes
    either way, and loses a third to the second pass)."""
    raise RuntimeError(JIT_ONLY)


@overload(_split, jit_options=INLINED)
def _split_ol(fn):  # type: ignore[no-untyped-def]
    if _fast(fn) and PIECES[fn.choice].get("split", False):
        return lambda fn: True
    return lambda fn: False


def _scratch(fn, x, n):  # type: ignore[no-untyped-def]
    """A scratch row of ``n`` elements in the type of the fused backward's per-element values ``f`` and the
    scalar's term (:func:`f_grad`'s ``r[1]``, ``r[2]``): float32 where the function computes them in float32
    (half storage; the fast tanh and signed power ``p = 1/2, 1``), else float64."""
    raise RuntimeError(JIT_ONLY)


@overload(_scratch, jit_options=INLINED)
def _scratch_ol(fn, x, n):  # type: ignore[no-untyped-def]
    f32 = x.dtype in (types.int16, types.uint16) or (
        _fast(fn) and (fn.choice == "tanh" or _exponent(fn) in ("half", "one"))
    )
    if f32:
        return lambda fn, x, n: np.empty(n, np.float32)
    return lambda fn, x, n: np.empty(n, np.float64)


def _unfused_grad(fn, v, g, a, big):  # type: ignore[no-untyped-def]
    """:func:`f_grad` in the per-output loops: a placeholder for the fast tags, which never run them (their fused
    loop does), so that those loops add nothing to the fast kernels' compile time."""
    raise RuntimeError(JIT_ONLY)


def _unfused_value(fn, v, a):  # type: ignore[no-untyped-def]
    """:func:`f_value` in the per-output loops (as :func:`_unfused_grad`)."""
    raise RuntimeError(JIT_ONLY)


@overload(_unfused_grad, jit_options=INLINED)
def _unfused_grad_ol(fn, v, g, a, big):  # type: ignore[no-untyped-def]
    if _fast(fn):
        return lambda fn, v, g, a, big: (g, v, g)
    return lambda fn, v, g, a, big: f_grad(fn, v, g, a, big)


@overload(_unfused_value, jit_options=INLINED)
def _unfused_value_ol(fn, v, a):  # type: ignore[no-untyped-def]
    if _fast(fn):
        return lambda fn, v, a: v
    return lambda fn, v, a: f_value(fn, v, a)


@jit(FM_SUM, forceinline=True)
def bwd_scratch(fn, x, n, pw, pa):  # type: ignore[no-untyped-def]
    """The scratch rows ``(fs, ts)`` :func:`ew_bwd_row` takes for rows of up to ``n`` elements of storage array
    ``x`` with partials ``pw``, ``pa`` (None where not wanted): empty but for a split function's."""
    return _scratch(fn, x, n if _split(fn) and pw is not None else 0), _scratch(
        fn, x, n if _split(fn) and pa is not None else 0
    )


@jit(FM_SUM, forceinline=True)
def ew_bwd_row(fn, xr, dyr, av, wr, big, dxr, pwr, pbr, par, fs, ts):  # type: ignore[no-untyped-def]
    """One row (or a row's column tile) of the backward: ``dxr``, and its terms added to the block's partial rows
    ``pwr`` (``dy f(x)``), ``pbr`` (``dy``), ``par`` (the scalar's terms), each None where not wanted; ``fs``/``ts``:
    the scratch rows of :func:`bwd_scratch`. The loop of :func:`ew_bwd`; also the identity's
    backward inside the statistics family's fused casting backward (:func:`._stats_kernels.bwd_cast`)."""
    n = xr.shape[0]
    if _fused(fn) and not _split(fn):  # the fast pieces need no fix-up: every output in one pass
        for j in range(n):
            d = fcast(xr, ld(dyr[j]))
            g = d * wr[j] if wr is not None else d
            r = f_grad(fn, fcast(xr, ld(xr[j])), g, av, big)
            st(dxr, j, r[0])
            if pwr is not None:
                pwr[j] += d * r[1]
            if pbr is not None:
                pbr[j] += d
            if par is not None:
                _add_term(par, j, r[2])
        return
    if _fused(fn):  # ... or dx (and f, the scalar's term, into scratch rows) in one pass ...
        for j in range(n):
            d = fcast(xr, ld(dyr[j]))
            g = d * wr[j] if wr is not None else d
            r = f_grad(fn, fcast(xr, ld(xr[j])), g, av, big)
            st(dxr, j, r[0])
            if pwr is not None:
                fs[j] = r[1]
            if par is not None:
                _put_term(ts, j, r[2])
        # ... and the float64 partials in another (in one loop they held float32 math to 8 lanes)
        for j in range(n):
            d = fcast(xr, ld(dyr[j]))
            if pwr is not None:
                pwr[j] += d * fs[j]
            if pbr is not None:
                pbr[j] += d
            if par is not None:
                _add_term(par, j, ts[j])
        return
    for j in range(n):
        d = fcast(xr, ld(dyr[j]))
        g = d * wr[j] if wr is not None else d
        xv = fcast(xr, ld(xr[j]))
        dxv = _unfused_grad(fn, xv, g, av, big)[0]
        if not abs(dxv) <= big:
            dxv = f_fix(fn, xv, g, av, big, dxv)
        st(dxr, j, dxv)
    if pwr is not None:
        for j in range(n):
            pwr[j] += fcast(xr, ld(dyr[j])) * _unfused_value(fn, fcast(xr, ld(xr[j])), av)
    if pbr is not None:
        for j in range(n):
            pbr[j] += fcast(xr, ld(dyr[j]))
    if par is not None:
        for j in range(n):
            d = fcast(xr, ld(dyr[j]))
            g = d * wr[j] if wr is not None else d
            _add_term(par, j, _unfused_grad(fn, fcast(xr, ld(xr[j])), g, av, big)[2])


@jit(FM_SUM, borrowed=True)
def _ew_bwd_span(fn, x, dy, a, w, big, dx, pw, pb, pa, fs, ts, t0, t1):  # type: ignore[no-untyped-def]
    """Tasks ``t0 <= t < t1`` (task ``t``: row block ``t // tiles``, one column tile) of :func:`ew_bwd` (its body:
    see :func:`._stats_kernels._fwd_span`; ``fs``, ``ts``: the kernel's :func:`bwd_scratch`)."""
    rows, h = x.shape
    av = fcast(x, a)
    for t in range(t0, t1):
        blk, j0, j1 = tile(t, h, EW_TILE)
        pwr = seg2(pw, blk, j0, j1)
        pbr = seg2(pb, blk, j0, j1)
        par = _pseg2(pa, blk, j0, j1)
        if pw is not None:
            pwr[:] = 0
        if pb is not None:
            pbr[:] = 0
        if pa is not None:
            _zero(par)
        for i in range(blk * ROW_BLOCK, min(blk * ROW_BLOCK + ROW_BLOCK, rows)):
            n = min(i + 1, rows - 1)  # the next row's tile, asked of the cache piece by piece meanwhile
            for lo in range(j0, j1, PF_CHUNK):
                hi = min(lo + PF_CHUNK, j1)
                prefetch(x[n], lo, hi)
                prefetch(dy[n], lo, hi)
                p0, p1 = lo - j0, hi - j0
                ew_bwd_row(fn, x[i, lo:hi], dy[i, lo:hi], av, seg(w, lo, hi), big, dx[i, lo:hi], seg(pwr, p0, p1),
                           seg(pbr, p0, p1), _pseg(par, p0, p1), fs, ts)  # fmt: skip


@jit(FM_SUM)
def ew_bwd(fn, x, dy, a, w, big, dx, pw, pb, pa, lo, hi):  # type: ignore[no-untyped-def]
    """``dx = f'(x) * dy [* w]`` and the per-block partials of ``dy * f(x)`` (``pw``), ``dy`` (``pb``) and the
    scalar's terms (``pa``), each a ``(blocks, H)`` array in the function math type or None, for tasks
    ``lo <= t < hi``: task ``t`` is row block ``t // tiles`` (rows in order), one column tile of
    :data:`._layout.EW_TILE`. One loop per output (each writes one array, so that the loops vectorize); the
    partials' loops evaluate what they need of the function again."""
    fs, ts = bwd_scratch(fn, x, EW_TILE, pw, pa)
    _ew_bwd_span(*borrow((fn, x, dy, a, w, big, dx, pw, pb, pa, fs, ts)), lo, hi)
