# numba's type stubs do not model intrinsics or overload stubs:
# mypy: disable-error-code="call-arg,attr-defined,var-annotated,call-overload"
"""Storage and rounding: how the kernels read and write each dtype (jitted pieces only).

The kernels see every array in its *storage* form (see :mod:`._common`): bfloat16 as ``uint16``
bits and float16 as ``int16`` bits (numba computes on neither type). The *math type* ``T`` of a
storage array is float32 for float16 / bfloat16 / float32 and float64 for float64.

* :func:`ld` (stored value -> math type, exact), :func:`st` (math value -> stored, one rounding),
  :func:`st_exact` (float64 -> stored, correctly rounded: float64 -> half/bfloat16 goes through
  float32 rounded *to odd*), :func:`tcast` (a value -> the math type of an array);
* per math type: :func:`tiny_sum` (smallest sum of squares the fast path trusts), :func:`r_ok`
  (``r`` safely inside the normal range);
* optional arrays: :func:`seg` / :func:`seg2` (a segment; None stays None), :func:`at` (an element;
  0.0 when the array is None);
* :func:`prefetch` (ask the cache for a 1-d array's ``a[lo:hi]`` ahead of its loop: a hint, no value changes).

All are ``@overload``-ed or intrinsics chosen by the storage dtype at compile time.
"""

from __future__ import annotations

import math

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from ._cache import VIEW, jit

__all__ = [
    "JIT_ONLY",
    "at",
    "bitcast",
    "fma",
    "ld",
    "opt_add",
    "opt_mul",
    "prefetch",
    "r_ok",
    "seg",
    "seg2",
    "shifted",
    "st",
    "st_exact",
    "stv",
    "tcast",
    "tile",
    "tiny_sum",
    "wat",
]

#: message of the Python bodies of ``@overload``-ed helpers: numba replaces them inside jitted code
JIT_ONLY = "this helper is a numba @overload: it exists only inside numba-jitted kernels"

# ---------------------------------------------------------------------------
# bit-level conversions


def bitcast(src, dst, name):  # type: ignore[no-untyped-def]
    """An intrinsic ``name(v)``: the value of numba type ``dst`` with the bits of ``v`` of type ``src`` (of the
    same width); no other argument type."""

    def cast(typingctx, v):  # type: ignore[no-untyped-def]
        if v != src:
            return None

        def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
            return builder.bitcast(args[0], context.get_value_type(dst))

        return dst(src), codegen

    cast.__name__ = cast.__qualname__ = name
    cast.__doc__ = f"The bits of the {src} ``v`` as a {dst}."
    return intrinsic(cast)


@intrinsic
def fma(typingctx, a, b, c):  # type: ignore[no-untyped-def]
    """``a * b + c`` rounded once (``llvm.fma``; the three arguments of one float type)."""
    if not (a == b == c and a in (types.float32, types.float64)):
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        return builder.fma(*args)

    return a(a, a, a), codegen


_f32_bits = bitcast(types.float32, types.uint32, "_f32_bits")
_f64_bits = bitcast(types.float64, types.uint64, "_f64_bits")
_bits_f64 = bitcast(types.uint64, types.float64, "_bits_f64")


@intrinsic
def _bits_f32(typingctx, v):  # type: ignore[no-untyped-def]
    """The float32 whose bits are the low 32 bits of the unsigned integer ``v``."""
    if not isinstance(v, types.Integer) or v.signed:
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        i = args[0]
        if v.bitwidth > 32:
            i = builder.trunc(i, ir.IntType(32))
        elif v.bitwidth < 32:
            i = builder.zext(i, ir.IntType(32))
        return builder.bitcast(i, ir.FloatType())

    return types.float32(v), codegen


@intrinsic
def _half_to_f32(typingctx, v):  # type: ignore[no-untyped-def]
    """float16 bits (int16) -> float32, exact (F16C ``vcvtph2ps`` where available)."""
    if v != types.int16:
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

    return types.float32(types.int16), codegen


@intrinsic
def _f32_to_half(typingctx, v):  # type: ignore[no-untyped-def]
    """float32 -> float16 bits (int16), rounded to nearest even."""
    if v != types.float32:
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

    return types.int16(types.float32), codegen


@jit()
def _bf16_to_f32(u):  # type: ignore[no-untyped-def]
    return _bits_f32(np.uint32(u) << np.uint32(16))


@jit()
def _f32_to_bf16(f):  # type: ignore[no-untyped-def]
    """float32 -> bfloat16 bits, round to nearest even; NaN stays NaN (quieted)."""
    u = _f32_bits(f)
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((u >> np.uint32(16)) | np.uint32(0x40))
    return np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@jit()
def _round_bf16(f):  # type: ignore[no-untyped-def]
    """The float32 ``f`` rounded to bfloat16 (to nearest, ties to even), as a float32: the value of
    ``_bf16_to_f32(_f32_to_bf16(f))`` in five integer operations (a loop's vectors need half those of the two
    conversions) -- for an ``f`` whose low 16 bits are 0 if it is a NaN: every NaN of float32 arithmetic on
    bfloat16 values is (the default NaN, or an operand's, quieted), and then its bits come back as they are,
    which a store's :func:`_f32_to_bf16` takes as the conversions would have. (Another NaN's low bits would
    carry into its exponent: not for other callers.)"""
    u = _f32_bits(f)
    return _bits_f32((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000))


@jit()
def _f64_to_f32_odd(v):  # type: ignore[no-untyped-def]
    """float64 -> float32 rounded *to odd*: a second rounding to a <= 22-bit format is then exact-correct."""
    f = np.float32(v)
    back = np.float64(f)
    if back != v and math.isfinite(f):
        u = _f32_bits(f)
        if abs(back) > abs(v):
            u = u - np.uint32(1)  # one step toward zero (f != 0 here)
        f = _bits_f32(u | np.uint32(1))
    return f


# ---------------------------------------------------------------------------
# storage <-> math type (overloads chosen by the storage dtype of the array)


def ld(v):  # type: ignore[no-untyped-def]
    """A stored element as a value of the math type (exact)."""
    raise RuntimeError(JIT_ONLY)


def tcast(a, v):  # type: ignore[no-untyped-def]
    """``v`` converted to the math type of storage array ``a``."""
    raise RuntimeError(JIT_ONLY)


def st(a, j, v):  # type: ignore[no-untyped-def]
    """``a[j] = v`` rounded once from the math type to ``a``'s storage dtype."""
    raise RuntimeError(JIT_ONLY)


def st_exact(a, j, v):  # type: ignore[no-untyped-def]
    """``a[j] = v`` for a float64 ``v``, correctly rounded to ``a``'s storage dtype."""
    raise RuntimeError(JIT_ONLY)


def tiny_sum(a):  # type: ignore[no-untyped-def]
    """Smallest row sum of squares the fast path trusts (smaller ones may hide subnormal squares)."""
    raise RuntimeError(JIT_ONLY)


def r_ok(a, r):  # type: ignore[no-untyped-def]
    """True when the float64 factor ``r`` is safely inside the normal range of the math type."""
    raise RuntimeError(JIT_ONLY)


@overload(ld)
def _ld_ol(v):  # type: ignore[no-untyped-def]
    if v == types.float32 or v == types.float64:
        return lambda v: v
    if v == types.uint16:
        return lambda v: _bf16_to_f32(v)
    if v == types.int16:
        return lambda v: _half_to_f32(v)
    return None


@overload(tcast)
def _tcast_ol(a, v):  # type: ignore[no-untyped-def]
    if a.dtype == types.float64:
        return lambda a, v: np.float64(v)
    return lambda a, v: np.float32(v)


@jit()
def _to_f32(v):  # type: ignore[no-untyped-def]
    return np.float32(v)


@jit()
def _to_f32_exact(v):  # type: ignore[no-untyped-def]
    return _f64_to_f32_odd(np.float64(v))


def _store(dt, half):  # type: ignore[no-untyped-def]
    """A store into storage dtype ``dt``; ``half(v)``: the float32 a half type is rounded from."""
    if dt == types.float32:

        def impl(a, j, v):  # type: ignore[no-untyped-def]
            a[j] = np.float32(v)

    elif dt == types.float64:

        def impl(a, j, v):  # type: ignore[no-untyped-def]
            a[j] = np.float64(v)

    elif dt == types.uint16:

        def impl(a, j, v):  # type: ignore[no-untyped-def]
            a[j] = _f32_to_bf16(half(v))

    elif dt == types.int16:

        def impl(a, j, v):  # type: ignore[no-untyped-def]
            a[j] = _f32_to_half(half(v))

    else:
        return None
    return impl


def stv(a, v):  # type: ignore[no-untyped-def]
    """The value :func:`st` would store for ``v`` into storage array ``a`` (16-bit types: their bits), not stored."""
    raise RuntimeError(JIT_ONLY)


@overload(stv)
def _stv_ol(a, v):  # type: ignore[no-untyped-def]
    if a.dtype == types.uint16:
        return lambda a, v: _f32_to_bf16(_to_f32(v))
    if a.dtype == types.int16:
        return lambda a, v: _f32_to_half(_to_f32(v))
    return None


@overload(st)
def _st_ol(a, j, v):  # type: ignore[no-untyped-def]
    return _store(a.dtype, _to_f32)


@overload(st_exact)
def _st_exact_ol(a, j, v):  # type: ignore[no-untyped-def]
    return _store(a.dtype, _to_f32_exact)


@overload(tiny_sum)
def _tiny_sum_ol(a):  # type: ignore[no-untyped-def]
    if a.dtype == types.float64:
        return lambda a: 2.0**-900
    return lambda a: 2.0**-100


@overload(r_ok)
def _r_ok_ol(a, r):  # type: ignore[no-untyped-def]
    if a.dtype == types.float64:
        return lambda a, r: 2.0**-1000 < r < 2.0**1000
    return lambda a, r: 2.0**-120 < r < 2.0**120


@jit(inline="always")
def tile(t, n, size):  # type: ignore[no-untyped-def]
    """``(i, j0, j1)`` of task ``t`` over rows of ``n`` values cut into tiles of ``size`` (``ceil(n / size)``
    tasks a row, in order): the row (or row block) ``i`` and the tile's values ``j0 <= j < j1``."""
    nt = (n + size - 1) // size
    i = t // nt
    j0 = (t - i * nt) * size
    return i, j0, min(j0 + size, n)


def seg(a, lo, hi):  # type: ignore[no-untyped-def]
    """``a[lo:hi]``, or None when ``a`` is None (an unconditional definition keeps loops fast)."""
    raise RuntimeError(JIT_ONLY)


def seg2(a, i, lo, hi):  # type: ignore[no-untyped-def]
    """``a[i, lo:hi]``, or None when ``a`` is None."""
    raise RuntimeError(JIT_ONLY)


@overload(seg, jit_options=VIEW)
def _seg_ol(a, lo, hi):  # type: ignore[no-untyped-def]
    if isinstance(a, types.NoneType):
        return lambda a, lo, hi: None
    return lambda a, lo, hi: a[lo:hi]


@overload(seg2, jit_options=VIEW)
def _seg2_ol(a, i, lo, hi):  # type: ignore[no-untyped-def]
    if isinstance(a, types.NoneType):
        return lambda a, i, lo, hi: None
    return lambda a, i, lo, hi: a[i, lo:hi]


def shifted(a, j):  # type: ignore[no-untyped-def]
    """``a[j:]`` of a parameter vector; ``a`` itself for None or a scalar (one channel's value, :mod:`._io`)."""
    raise RuntimeError(JIT_ONLY)


@overload(shifted, inline="always", jit_options=VIEW)
def _shifted_ol(a, j):  # type: ignore[no-untyped-def]
    if isinstance(a, (types.NoneType, types.Float)):
        return lambda a, j: a
    return lambda a, j: a[j:]


def at(a, i):  # type: ignore[no-untyped-def]
    """``a[i]``, or 0.0 when ``a`` is None (a per-row statistic a variant does not have)."""
    raise RuntimeError(JIT_ONLY)


@overload(at)
def _at_ol(a, i):  # type: ignore[no-untyped-def]
    if isinstance(a, types.NoneType):
        return lambda a, i: 0.0
    return lambda a, i: a[i]


def opt_mul(v, a, j):  # type: ignore[no-untyped-def]
    """``v * a[j]`` (``a`` a float array, or a 16-bit parameter in storage form, read by :func:`ld`), or ``v`` when
    ``a`` is None (chosen by type: inlined callers cannot prune a local None); ``v * a`` for a scalar ``a`` (the
    channel affine source's per-channel value, :mod:`._io`)."""
    raise RuntimeError(JIT_ONLY)


def opt_add(v, a, j):  # type: ignore[no-untyped-def]
    """``v + a[j]``, or ``v`` when ``a`` is None (``v + a`` for a scalar ``a``)."""
    raise RuntimeError(JIT_ONLY)


@overload(opt_mul, inline="always")
def _opt_mul_ol(v, a, j):  # type: ignore[no-untyped-def]
    if isinstance(a, types.NoneType):
        return lambda v, a, j: v
    if isinstance(a, types.Float):
        return lambda v, a, j: v * a
    return lambda v, a, j: v * ld(a[j])


@overload(opt_add, inline="always")
def _opt_add_ol(v, a, j):  # type: ignore[no-untyped-def]
    if isinstance(a, types.NoneType):
        return lambda v, a, j: v
    if isinstance(a, types.Float):
        return lambda v, a, j: v + a
    return lambda v, a, j: v + ld(a[j])


def wat(a, j):  # type: ignore[no-untyped-def]
    """``a[j]`` of a parameter vector, or ``a`` itself for a scalar (one channel's value, :mod:`._io`)."""
    raise RuntimeError(JIT_ONLY)


@overload(wat, inline="always")
def _wat_ol(a, j):  # type: ignore[no-untyped-def]
    if isinstance(a, types.Float):
        return lambda a, j: a
    return lambda a, j: a[j]


# ---------------------------------------------------------------------------
# prefetch


@intrinsic
def _prefetch_at(typingctx, a, j):  # type: ignore[no-untyped-def]
    """A prefetch of the cache line of ``a[j]`` (a 1-d array; LLVM's ``llvm.prefetch``: read, every cache level,
    data): a hint, which never faults; the caller keeps ``j`` within ``a``."""
    if not isinstance(a, types.Array) or a.ndim != 1:
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        from numba.core import cgutils

        arr = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, sig.args[0], arr, [args[1]], wraparound=False)
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0"
        )
        builder.call(fn, [builder.bitcast(ptr, i8p), i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.none(a, j), codegen


def prefetch(a, lo, hi):  # type: ignore[no-untyped-def]
    """Ask the cache for the lines of ``a[lo:hi]`` (``a`` a 1-d array, or None: nothing; the range clipped to ``a``),
    one prefetch per 64-byte line: a loop whose arithmetic outweighs its memory traffic asks for its next piece
    while it computes on the current one (the hardware prefetcher follows the loads, and leaves such a loop waiting
    on memory at the start of each piece). A hint: values never change."""
    raise RuntimeError(JIT_ONLY)


@overload(prefetch, inline="always")
def _prefetch_ol(a, lo, hi):  # type: ignore[no-untyped-def]
    if isinstance(a, types.NoneType):
        return lambda a, lo, hi: None
    step = max(1, 512 // a.dtype.bitwidth)  # elements per 64-byte line

    def impl(a, lo, hi):  # type: ignore[no-untyped-def]
        for j in range(max(lo, 0), min(hi, a.shape[0]), step):
            _prefetch_at(a, j)

    return impl
