# numba's type stubs do not model intrinsics, overload stubs or jitted calls:
# mypy: disable-error-code="call-arg,attr-defined,var-annotated,call-overload"
r"""Every jitted function of the ``numba`` backend (one module, so numba's disk cache stays consistent).

numba's on-disk cache (``cache=True``) revalidates a kernel against the
timestamp of the file that defines it, not of the files its callees live in.
All kernels and the helpers they call are therefore kept in this module.

Layout, mirroring :mod:`pynorm.reference`:

* storage and rounding: :func:`ld` (stored value -> math type), :func:`st`
  (math value -> stored, one rounding), :func:`st_exact` (float64 -> stored,
  correctly rounded), with bfloat16 seen as ``uint16`` bits and float16 as
  ``int16`` bits (numba knows neither type);
* row statistics: :func:`_row_shift` and :func:`_shifted_sums` (the reference's
  ``row_mean``), :func:`_sum_squares`;
* per op: a row function for the fast path, a ``_slow`` row function for rows
  the fast path cannot take, and ``prange`` kernels over rows or row blocks.

Numerics
--------
*Math type* ``T``: float32 for float16 / bfloat16 / float32 inputs, float64 for
float64 inputs. Element-wise work runs in ``T``; every row sum is accumulated
in ``T`` over chunks of :data:`CHUNK` elements (vectorized, reassociated) and
the chunk sums are added in float64. Each output is rounded once from ``T``
(float64 -> half/bfloat16 goes through float32 rounded to odd: one correct rounding).

*LayerNorm statistics* (one pass over the row while it is in cache): the row is
shifted by ``K = x0 + mean(x[:16] - x0)`` (in ``T``) and ``S1 = sum(x - K)``,
``S2 = sum((x - K)^2)`` are accumulated; ``mean = K + S1/H`` and
``var = (S2 - S1^2/H) / (H - correction)``, never ``E[x^2] - E[x]^2``. The
subtraction cancels at most a factor ``1 + S1^2/(H S2 - S1^2)``; when
``S1^2 > S2 H / 4`` the sums are redone around the new mean (rare: rows whose
first elements are outliers, or sorted rows). The centred value is computed as
``(x - K) - S1/H`` with ``K`` and ``S1/H`` kept apart, so rows with a large common
offset (1e4 + N(0, 1) in float32) keep the accuracy of their deviations
(``x - K`` is exact there), and a constant row gives exactly 0. The backward
splits ctx's float64 mean the same way (:func:`_ln_kc`).

*Slow path*: a row whose fast-path sums overflow, underflow (``S2`` below
:func:`_tiny`, with a nonzero deviation) or are not finite, or whose ``r`` is
outside the normal range of ``T``, is recomputed in float64 after scaling by a
power of two taken from the row's largest magnitude (exact), so magnitudes up
to the dtype's maximum give finite, accurate results. Its row sums are
compensated (:func:`_cadd`: plain sequential float64 sums were off by hundreds
of ulps over 65536 elements), the mean's correction is taken from the exact
deviations, and the backward adds back what the stored float64 mean misses
(:func:`_ln_slow_residual`, for offsets much larger than the spread): float64
rows up to the maximum stay within a few ulps of the reference.

*Parameter gradients*: rows are grouped in blocks of :data:`ROW_BLOCK` (fixed,
independent of the thread count); each block accumulates its partial sums in
``T`` in row order (the fused path adds each row during its first pass) and the
partials are added in float64 in block order (:func:`sum_blocks`), so
``dweight``/``dbias`` are bitwise identical for any number of threads. Which
backward path runs depends on the shape only (:func:`use_fused`).

*fastmath*: kernels use ``{'reassoc', 'contract'}`` (never ``nnan``/``ninf``: NaN
and Inf keep their IEEE meaning). The few operations whose rounding matters are
tiny helpers compiled *without* flags, which keep their exact semantics when
inlined: :func:`_centre` (so ``(x - K) - c`` is never refolded into
``x - (K + c)``), :func:`_prod` (``g = dy * w`` rounded the same way in the
sums and in ``dx``) and the slow path's :func:`_two_sum` / :func:`_cadd`
(reassociation would fold their error terms to 0; the slow-path row functions
that call them have no flags either). The hot helpers are inlined into the
kernels at numba-IR level (``inline="always"``).

*Vectorization*: every hot loop writes at most two arrays and reads a few, so
LLVM's run-time alias checks stay under its limit and the loops vectorize (a
loop storing dx and both partials in one go would silently stay scalar).
"""

from __future__ import annotations

import math
import platform

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

#: message of the Python bodies of ``@overload``-ed helpers: numba replaces them inside jitted code
_JIT_ONLY = "this helper is a numba @overload: it exists only inside numba-jitted kernels"

#: elements per chunk of a row sum accumulated in the math type before it is added in float64.
CHUNK = 1024
#: rows per block of the weight/bias gradient partial sums (fixed => results independent of threads).
ROW_BLOCK = 32
#: columns per task of the reductions over blocks and of the column-parallel gradient kernels.
COL_TILE = 256
#: below this many rows the backward computes dx by rows, then dweight/dbias by column tiles
#: (unless the whole input is smaller than :data:`FUSED_MAX_SMALL` elements: one fused pass is then cheapest).
FUSED_MIN_ROWS = 4 * ROW_BLOCK
FUSED_MAX_SMALL = 1 << 15


def use_stream(out: np.ndarray) -> bool:
    """Whether a kernel writes ``out`` (storage form) with streaming stores: large float32 outputs only."""
    return bool(out.dtype == np.float32 and out.nbytes >= STREAM_MIN_BYTES and out.shape[-1] >= STREAM_MIN_ROW)


def use_fused(rows: int, hidden: int) -> bool:
    """The backward's path for an ``(rows, hidden)`` input: a function of the shape only (never of threads)."""
    return rows >= FUSED_MIN_ROWS or rows * hidden < FUSED_MAX_SMALL


_FM_SUM = {"reassoc", "contract"}
_EXACT = False


def _jit(fastmath: object = _EXACT, parallel: bool = False, inline: str = "never"):  # type: ignore[no-untyped-def]
    """``njit`` with disk caching, no GIL, IEEE division (``error_model="numpy"``: 1/0 is inf, not an
    exception) and an *explicit* fastmath setting.

    numba lets a callee without an explicit ``fastmath`` inherit its first
    caller's flags; every function here states its own so the code is the same
    whichever kernel compiles it first.
    """
    return njit(cache=True, nogil=True, fastmath=fastmath, parallel=parallel, inline=inline, error_model="numpy")


_SLOW = 1 << 20  # sentinel in the per-row scale arrays: the row took the fast path


# ---------------------------------------------------------------------------
# bit-level conversions


@intrinsic
def _f32_bits(typingctx, v):  # type: ignore[no-untyped-def]
    if v != types.float32:
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


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


# ---------------------------------------------------------------------------
# streaming (non-temporal) stores of float32 outputs
#
# A large output is written with 64-byte aligned non-temporal vector stores: the
# cache lines are not read before being overwritten (no read-for-ownership), which
# saves a third of the memory traffic of a forward. The arithmetic is the same as
# the plain loops' (same operations, same fastmath flags, rounded once).

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")
#: outputs of at least this many bytes are written with streaming stores (much larger than the caches).
STREAM_MIN_BYTES = 1 << 24
#: ... and rows of at least this many elements (shorter rows lose more to the split loops than they gain).
STREAM_MIN_ROW = 1024
#: rows per parallel task of the kernels that can stream (one store fence per task).
STREAM_GROUP = 8
#: float32 lanes per streaming store (one 64-byte cache line).
LANES = 16


def _splat(builder, v, n):  # type: ignore[no-untyped-def]
    vt = ir.VectorType(v.type, n)
    u = builder.insert_element(ir.Constant(vt, ir.Undefined), v, ir.IntType(32)(0))
    return builder.shuffle_vector(u, ir.Constant(vt, ir.Undefined), ir.Constant(ir.VectorType(ir.IntType(32), n), None))


def _vload(context, builder, aty, a, j, n=LANES):  # type: ignore[no-untyped-def]
    """``a[j : j + n]`` as one vector (unaligned load)."""
    from numba.core import cgutils

    arr = context.make_array(aty)(context, builder, a)
    ptr = cgutils.get_item_pointer(context, builder, aty, arr, [j], wraparound=False)
    return builder.load(builder.bitcast(ptr, ir.VectorType(ir.FloatType(), n).as_pointer()), align=4)


def _fm(instr):  # type: ignore[no-untyped-def]
    instr.flags.extend(["reassoc", "contract"])
    return instr


def _vstore_nt(context, builder, aty, a, j, v, nt=True):  # type: ignore[no-untyped-def]
    """Non-temporal store of ``v`` to ``a[j : j + LANES]`` (the address must be 64-byte aligned);
    a plain store when ``nt`` is False."""
    from numba.core import cgutils

    arr = context.make_array(aty)(context, builder, a)
    ptr = cgutils.get_item_pointer(context, builder, aty, arr, [j], wraparound=False)
    st = builder.store(v, builder.bitcast(ptr, v.type.as_pointer()), align=64 if nt else 4)
    if nt:
        st.set_metadata("nontemporal", builder.module.add_metadata([ir.IntType(32)(1)]))


@intrinsic
def _misalign(typingctx, a):  # type: ignore[no-untyped-def]
    """The address of ``a``'s data modulo 64 (bytes)."""
    if not isinstance(a, types.Array):
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        arr = context.make_array(sig.args[0])(context, builder, args[0])
        return builder.and_(builder.ptrtoint(arr.data, ir.IntType(64)), ir.IntType(64)(63))

    return types.int64(a), codegen


@intrinsic
def _sfence(typingctx):  # type: ignore[no-untyped-def]
    """Order this thread's streaming stores before its later stores (x86 ``sfence``)."""

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        from numba.core import cgutils

        if _X86:
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse.sfence"
            )
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.none(), codegen


@intrinsic
def _ln_out_nt(typingctx, xr, w, b, k, c, r, yr, j):  # type: ignore[no-untyped-def]
    """``yr[j : j + LANES] = ((x - k) - c) * r [* w] [+ b]`` (float32, as :func:`_ln_out`), streaming store."""
    # typed for every dtype (the caller's branch on _streams is typed even where it is dead); code for float32 only
    f32 = xr.dtype == types.float32 and yr.dtype == types.float32
    has_w = not isinstance(w, types.NoneType)
    has_b = not isinstance(b, types.NoneType)

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        if not f32:
            return context.get_dummy_value()
        ax, aw, ab, vk, vc, vr, ay, vj = args
        d = builder.fsub(builder.fsub(_vload(context, builder, sig.args[0], ax, vj), _splat(builder, vk, LANES)),
                         _splat(builder, vc, LANES))  # fmt: skip
        v = _fm(builder.fmul(d, _splat(builder, vr, LANES)))
        if has_w:
            v = _fm(builder.fmul(v, _vload(context, builder, sig.args[1], aw, vj)))
        if has_b:
            v = _fm(builder.fadd(v, _vload(context, builder, sig.args[2], ab, vj)))
        _vstore_nt(context, builder, sig.args[6], ay, vj, v)
        return context.get_dummy_value()

    return types.none(xr, w, b, k, c, r, yr, j), codegen


def _ln_dx_nt_make(n):  # type: ignore[no-untyped-def]
    @intrinsic
    def impl(typingctx, xr, dyr, w, k, c, r, gbar, coef, dxr, j):  # type: ignore[no-untyped-def]
        """``dxr[j : j + LANES] = r * ((g - gbar) - xhat * coef)`` (float32, as :func:`_ln_bwd_dx`), streaming store."""
        # typed for every dtype (see _ln_out_nt); code for float32 only
        f32 = xr.dtype == types.float32 and dyr.dtype == types.float32 and dxr.dtype == types.float32
        has_w = not isinstance(w, types.NoneType)

        def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
            if not f32:
                return context.get_dummy_value()
            ax, ady, aw, vk, vc, vr, vg, vco, adx, vj = args
            ta = sig.args
            d = builder.fsub(builder.fsub(_vload(context, builder, ta[0], ax, vj, n), _splat(builder, vk, n)),
                             _splat(builder, vc, n))  # fmt: skip
            rv = _splat(builder, vr, n)
            xhat = _fm(builder.fmul(d, rv))
            g = _vload(context, builder, ta[1], ady, vj, n)
            if has_w:
                g = builder.fmul(g, _vload(context, builder, ta[2], aw, vj, n))  # no flags, as _prod
            t = _fm(builder.fsub(g, _splat(builder, vg, n)))
            u = _fm(builder.fsub(t, _fm(builder.fmul(xhat, _splat(builder, vco, n)))))
            _vstore_nt(context, builder, ta[8], adx, vj, _fm(builder.fmul(rv, u)), n > 1)
            return context.get_dummy_value()

        return types.none(xr, dyr, w, k, c, r, gbar, coef, dxr, j), codegen

    return impl


_ln_dx_nt = _ln_dx_nt_make(LANES)
#: one element of :func:`_ln_dx_nt`'s arithmetic, plain store: the unaligned ends of a streamed row are computed
#: exactly as its body, so dx does not depend on the output's alignment.
_ln_dx_one = _ln_dx_nt_make(1)


def _rms_dx_nt_make(n):  # type: ignore[no-untyped-def]
    @intrinsic
    def impl(typingctx, xr, dyr, w, r, coef, dxr, j):  # type: ignore[no-untyped-def]
        """``dxr[j : j + LANES] = r * (g - xhat * coef)`` (float32, as :func:`_rms_bwd_dx`), streaming store."""
        # typed for every dtype (see _ln_out_nt); code for float32 only
        f32 = xr.dtype == types.float32 and dyr.dtype == types.float32 and dxr.dtype == types.float32
        has_w = not isinstance(w, types.NoneType)

        def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
            if not f32:
                return context.get_dummy_value()
            ax, ady, aw, vr, vco, adx, vj = args
            ta = sig.args
            rv = _splat(builder, vr, n)
            g = _vload(context, builder, ta[1], ady, vj, n)
            if has_w:
                g = _fm(builder.fmul(g, _vload(context, builder, ta[2], aw, vj, n)))
            xhat = _fm(builder.fmul(_vload(context, builder, ta[0], ax, vj, n), rv))
            u = _fm(builder.fsub(g, _fm(builder.fmul(xhat, _splat(builder, vco, n)))))
            _vstore_nt(context, builder, ta[5], adx, vj, _fm(builder.fmul(rv, u)), n > 1)
            return context.get_dummy_value()

        return types.none(xr, dyr, w, r, coef, dxr, j), codegen

    return impl


_rms_dx_nt = _rms_dx_nt_make(LANES)
#: one element of :func:`_rms_dx_nt` (see :data:`_ln_dx_one`).
_rms_dx_1 = _rms_dx_nt_make(1)


@intrinsic
def _rms_out_nt(typingctx, xr, w, r, yr, j):  # type: ignore[no-untyped-def]
    """``yr[j : j + LANES] = x * r [* w]`` (float32, as :func:`_rms_out`), streaming store."""
    # typed for every dtype (the caller's branch on _streams is typed even where it is dead); code for float32 only
    f32 = xr.dtype == types.float32 and yr.dtype == types.float32
    has_w = not isinstance(w, types.NoneType)

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        if not f32:
            return context.get_dummy_value()
        ax, aw, vr, ay, vj = args
        v = _fm(builder.fmul(_vload(context, builder, sig.args[0], ax, vj), _splat(builder, vr, LANES)))
        if has_w:
            v = _fm(builder.fmul(v, _vload(context, builder, sig.args[1], aw, vj)))
        _vstore_nt(context, builder, sig.args[3], ay, vj, v)
        return context.get_dummy_value()

    return types.none(xr, w, r, yr, j), codegen


@_jit()
def _stream_span(yr):  # type: ignore[no-untyped-def]
    """``(j0, j1)``: the part of the float32 row ``yr`` made of whole 64-byte aligned lines."""
    h = yr.shape[0]
    m = _misalign(yr)
    j0 = min(h, ((64 - m) % 64) // 4) if m % 4 == 0 else h
    return j0, j0 + (h - j0) // LANES * LANES


def _streams(a):  # type: ignore[no-untyped-def]
    """True (a compile-time constant) when outputs of storage array ``a`` can be written by streaming stores."""
    raise RuntimeError(_JIT_ONLY)


@overload(_streams)
def _streams_ol(a):  # type: ignore[no-untyped-def]
    if a.dtype == types.float32:
        return lambda a: True
    return lambda a: False


@_jit()
def _bf16_to_f32(u):  # type: ignore[no-untyped-def]
    return _bits_f32(np.uint32(u) << np.uint32(16))


@_jit()
def _f32_to_bf16(f):  # type: ignore[no-untyped-def]
    """float32 -> bfloat16 bits, round to nearest even; NaN stays NaN (quieted)."""
    u = _f32_bits(f)
    if (u & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000):
        return np.uint16((u >> np.uint32(16)) | np.uint32(0x40))
    return np.uint16((u + np.uint32(0x7FFF) + ((u >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16))


@_jit()
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
    raise RuntimeError(_JIT_ONLY)


def tcast(a, v):  # type: ignore[no-untyped-def]
    """``v`` converted to the math type of storage array ``a``."""
    raise RuntimeError(_JIT_ONLY)


def st(a, j, v):  # type: ignore[no-untyped-def]
    """``a[j] = v`` rounded once from the math type to ``a``'s storage dtype."""
    raise RuntimeError(_JIT_ONLY)


def st_exact(a, j, v):  # type: ignore[no-untyped-def]
    """``a[j] = v`` for a float64 ``v``, correctly rounded to ``a``'s storage dtype."""
    raise RuntimeError(_JIT_ONLY)


def _tiny(a):  # type: ignore[no-untyped-def]
    """Smallest row sum of squares the fast path trusts (smaller ones may hide subnormal squares)."""
    raise RuntimeError(_JIT_ONLY)


def _r_ok(a, r):  # type: ignore[no-untyped-def]
    """True when the float64 factor ``r`` is safely inside the normal range of the math type."""
    raise RuntimeError(_JIT_ONLY)


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


@overload(st)
def _st_ol(a, j, v):  # type: ignore[no-untyped-def]
    dt = a.dtype
    if dt == types.float32:

        def impl(a, j, v):  # type: ignore[no-untyped-def]
            a[j] = np.float32(v)

    elif dt == types.float64:

        def impl(a, j, v):  # type: ignore[no-untyped-def]
            a[j] = np.float64(v)

    elif dt == types.uint16:

        def impl(a, j, v):  # type: ignore[no-untyped-def]
            a[j] = _f32_to_bf16(np.float32(v))

    elif dt == types.int16:

        def impl(a, j, v):  # type: ignore[no-untyped-def]
            a[j] = _f32_to_half(np.float32(v))

    else:
        return None
    return impl


@overload(st_exact)
def _st_exact_ol(a, j, v):  # type: ignore[no-untyped-def]
    dt = a.dtype
    if dt == types.float32:

        def impl(a, j, v):  # type: ignore[no-untyped-def]
            a[j] = np.float32(v)

    elif dt == types.float64:

        def impl(a, j, v):  # type: ignore[no-untyped-def]
            a[j] = np.float64(v)

    elif dt == types.uint16:

        def impl(a, j, v):  # type: ignore[no-untyped-def]
            a[j] = _f32_to_bf16(_f64_to_f32_odd(np.float64(v)))

    elif dt == types.int16:

        def impl(a, j, v):  # type: ignore[no-untyped-def]
            a[j] = _f32_to_half(_f64_to_f32_odd(np.float64(v)))

    else:
        return None
    return impl


@overload(_tiny)
def _tiny_ol(a):  # type: ignore[no-untyped-def]
    if a.dtype == types.float64:
        return lambda a: 2.0**-900
    return lambda a: 2.0**-100


@overload(_r_ok)
def _r_ok_ol(a, r):  # type: ignore[no-untyped-def]
    if a.dtype == types.float64:
        return lambda a, r: 2.0**-1000 < r < 2.0**1000
    return lambda a, r: 2.0**-120 < r < 2.0**120


def _seg(a, lo, hi):  # type: ignore[no-untyped-def]
    """``a[lo:hi]``, or None when ``a`` is None (an unconditional definition keeps loops fast)."""
    raise RuntimeError(_JIT_ONLY)


def _seg2(a, i, lo, hi):  # type: ignore[no-untyped-def]
    """``a[i, lo:hi]``, or None when ``a`` is None."""
    raise RuntimeError(_JIT_ONLY)


@overload(_seg)
def _seg_ol(a, lo, hi):  # type: ignore[no-untyped-def]
    if isinstance(a, types.NoneType):
        return lambda a, lo, hi: None
    return lambda a, lo, hi: a[lo:hi]


@overload(_seg2)
def _seg2_ol(a, i, lo, hi):  # type: ignore[no-untyped-def]
    if isinstance(a, types.NoneType):
        return lambda a, i, lo, hi: None
    return lambda a, i, lo, hi: a[i, lo:hi]


def _wide(a):  # type: ignore[no-untyped-def]
    """True (a compile-time constant) when the math type of storage array ``a`` is float64."""
    raise RuntimeError(_JIT_ONLY)


@overload(_wide)
def _wide_ol(a):  # type: ignore[no-untyped-def]
    if a.dtype == types.float64:
        return lambda a: True
    return lambda a: False


# ---------------------------------------------------------------------------
# row statistics


@_jit()
def _centre(x, k, c):  # type: ignore[no-untyped-def]
    # no reassoc here: (x - k) is exact for x near k, and c is small
    return (x - k) - c


@_jit()
def _prod(a, b):  # type: ignore[no-untyped-def]
    # no contract here: g = dy * w is rounded the same way in the sums and in dx (exact cancellation when H = 1)
    return a * b


@_jit(_FM_SUM, inline="always")
def _row_shift(xr):  # type: ignore[no-untyped-def]
    """``K = x0 + mean(x[:16] - x0)`` in the math type: near the row mean; exactly the value of a constant row."""
    n0 = min(16, xr.shape[0])
    x0 = ld(xr[0])
    s = tcast(xr, 0.0)
    for j in range(n0):
        s += ld(xr[j]) - x0
    return x0 + s / tcast(xr, n0)


@_jit(_FM_SUM, inline="always")
def _shifted_sums(xr, k):  # type: ignore[no-untyped-def]
    """``(sum(x - k), sum((x - k)^2))`` in float64, chunk sums in the math type."""
    h = xr.shape[0]
    s1 = 0.0
    s2 = 0.0
    zero = tcast(xr, 0.0)
    for c in range(0, h, CHUNK):
        xc = xr[c : min(c + CHUNK, h)]
        a1 = zero
        a2 = zero
        for j in range(xc.shape[0]):
            d = _centre(ld(xc[j]), k, zero)
            a1 += d
            a2 += d * d
        s1 += np.float64(a1)
        s2 += np.float64(a2)
    return s1, s2


@_jit(_FM_SUM, inline="always")
def _sum_squares(xr):  # type: ignore[no-untyped-def]
    """``sum(x^2)`` in float64, chunk sums in the math type."""
    h = xr.shape[0]
    s2 = 0.0
    zero = tcast(xr, 0.0)
    for c in range(0, h, CHUNK):
        xc = xr[c : min(c + CHUNK, h)]
        a2 = zero
        for j in range(xc.shape[0]):
            v = ld(xc[j])
            a2 += v * v
        s2 += np.float64(a2)
    return s2


@_jit()
def _any_off(xr, k, c):  # type: ignore[no-untyped-def]
    """True if some ``(x - k) - c`` is nonzero (or NaN)."""
    for j in range(xr.shape[0]):
        if _centre(ld(xr[j]), k, c) != 0:
            return True
    return False


@_jit()
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


@_jit()
def _two_sum(a, b):  # type: ignore[no-untyped-def]
    """``(s, err)`` with ``s = fl(a + b)`` and ``s + err == a + b`` exactly (Knuth's branch-free two-sum).

    No fastmath flags (here and in its callers): reassociation would fold ``err`` to 0.
    """
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


@_jit()
def _cadd(s, t, v):  # type: ignore[no-untyped-def]
    """One step of a compensated sum: ``s' = fl(s + v)``, its exact rounding error added to ``t``.

    The sum of ``n`` terms is then ``s + t`` within about one ulp plus ``n u^2 sum|v|``,
    whatever their order: plain sequential sums over long rows are off by up to
    ``n u`` (hundreds of ulps of the outputs at ``H = 65536``). Slow-path rows only
    (a few times the cost of a plain sum).
    """
    r, err = _two_sum(s, v)
    return r, t + err


@_jit()
def _ln_scaled_stats(xr, e, corr):  # type: ignore[no-untyped-def]
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


@_jit()
def _scaled_rstd(var_s, e, eps, std_mode):  # type: ignore[no-untyped-def]
    """``(r, r_s)`` for the variance ``var_s * 4**e``: r = 1/sqrt(var + eps) (or 1/(sqrt(var) + eps)), r_s = r * 2**e.

    ``r_s`` (what multiplies the scaled deviations) is computed without overflow or
    underflow whenever eps scaled alongside is finite; ``r`` itself may be out of
    range for the most extreme float64 rows (it is then only stored in ctx).
    """
    if std_mode:
        e_s = math.ldexp(eps, -e)
        if math.isfinite(e_s):
            r_s = 1.0 / (math.sqrt(var_s) + e_s)
            return math.ldexp(r_s, -e), r_s
        r = 1.0 / eps
        return r, math.ldexp(r, e)
    e_s = math.ldexp(eps, -2 * e)
    if math.isfinite(e_s):
        r_s = 1.0 / math.sqrt(var_s + e_s)
        return math.ldexp(r_s, -e), r_s
    r = 1.0 / math.sqrt(eps)
    return r, math.ldexp(r, e)


# ---------------------------------------------------------------------------
# LayerNorm forward


@_jit(_FM_SUM, inline="always")
def _ln_out(xr, w, b, k, c, r, yr):  # type: ignore[no-untyped-def]
    for j in range(xr.shape[0]):
        v = _centre(ld(xr[j]), k, c) * r
        if w is not None:
            v = v * w[j]
        if b is not None:
            v = v + b[j]
        st(yr, j, v)


@_jit(_FM_SUM, inline="always")
def _ln_out_range(xr, w, b, k, c, r, yr, lo, hi):  # type: ignore[no-untyped-def]
    """:func:`_ln_out` of the elements ``lo <= j < hi`` (arguments as there, whole rows)."""
    for j in range(lo, hi):
        v = _centre(ld(xr[j]), k, c) * r
        if w is not None:
            v = v * w[j]
        if b is not None:
            v = v + b[j]
        st(yr, j, v)


@_jit(_FM_SUM, inline="always")
def _ln_out_stream(xr, w, b, k, c, r, yr):  # type: ignore[no-untyped-def]
    """:func:`_ln_out` with streaming stores for the 64-byte aligned part of a float32 row."""
    h = xr.shape[0]
    if _streams(yr):
        j0, j1 = _stream_span(yr)
        _ln_out_range(xr, w, b, k, c, r, yr, 0, j0)
        for j in range(j0, j1, LANES):
            _ln_out_nt(xr, w, b, k, c, r, yr, j)
        _ln_out_range(xr, w, b, k, c, r, yr, j1, h)
    else:
        _ln_out(xr, w, b, k, c, r, yr)


@_jit()
def _ln_fwd_row_slow(xr, w, b, eps, corr, std_mode, yr):  # type: ignore[no-untyped-def]
    e = _row_scale(xr)
    m1, c, var_s = _ln_scaled_stats(xr, e, corr)
    r, r_s = _scaled_rstd(var_s, e, eps, std_mode)
    sc = math.ldexp(1.0, -e)
    for j in range(xr.shape[0]):
        v = ((np.float64(ld(xr[j])) * sc - m1) - c) * r_s
        if w is not None:
            v = v * np.float64(w[j])
        if b is not None:
            v = v + np.float64(b[j])
        st_exact(yr, j, v)
    return math.ldexp(m1 + c, e), r


@_jit(_FM_SUM, inline="always")
def _ln_fwd_row(xr, w, b, eps, corr, std_mode, yr, stream):  # type: ignore[no-untyped-def]
    """Normalize one row into ``yr``; returns ``(mean, r)`` in float64."""
    h = xr.shape[0]
    k = _row_shift(xr)
    s1, s2 = _shifted_sums(xr, k)
    if not (math.isfinite(s1) and math.isfinite(s2)):
        return _ln_fwd_row_slow(xr, w, b, eps, corr, std_mode, yr)
    if s1 * s1 > 0.25 * h * s2:  # shift far from the mean: redo around the mean
        k = tcast(xr, np.float64(k) + s1 / h)
        s1, s2 = _shifted_sums(xr, k)
        if not (math.isfinite(s1) and math.isfinite(s2)):
            return _ln_fwd_row_slow(xr, w, b, eps, corr, std_mode, yr)
    c = s1 / h
    if s2 < _tiny(xr) and _any_off(xr, k, tcast(xr, 0.0)):
        return _ln_fwd_row_slow(xr, w, b, eps, corr, std_mode, yr)
    var = max(s2 - s1 * c, 0.0) / (h - corr)
    r = 1.0 / (math.sqrt(var) + eps) if std_mode else 1.0 / math.sqrt(var + eps)
    if stream:
        _ln_out_stream(xr, w, b, k, tcast(xr, c), tcast(xr, r), yr)
    else:
        _ln_out(xr, w, b, k, tcast(xr, c), tcast(xr, r), yr)
    return np.float64(k) + c, r


@_jit(_FM_SUM, parallel=True)
def ln_fwd(x, w, b, eps, corr, std_mode, y, mean, rstd, stream):  # type: ignore[no-untyped-def]
    """LayerNorm forward of every row of ``x`` (storage dtype) into ``y``; ``mean``/``rstd`` float64.

    ``stream``: write float32 ``y`` with streaming stores (for outputs much larger than the caches).
    """
    rows = x.shape[0]
    for g in prange((rows + STREAM_GROUP - 1) // STREAM_GROUP):
        for i in range(g * STREAM_GROUP, min(g * STREAM_GROUP + STREAM_GROUP, rows)):
            m, r = _ln_fwd_row(x[i], w, b, eps, corr, std_mode, y[i], stream)
            mean[i] = m
            rstd[i] = r
        if stream:
            _sfence()


# ---------------------------------------------------------------------------
# LayerNorm backward
#
# Fused path (>= FUSED_MIN_ROWS rows), per block of ROW_BLOCK rows and per row:
#   pass 1 (x, dy read from memory): sum g, sum g*xhat [, sum d^2], and the row's
#           dy*xhat, dy added to the block's partials pw[blk], pb[blk];
#   pass 2 (row in cache): dx.
# A row that needs the slow path computes its dx in float64; its block's partials
# are then recomputed from scratch (rare: extreme magnitudes only).
# Row-parallel path (few rows): dx by rows, then the partials by column tiles,
# rows by groups of 4.
# The partials pw, pb ((blocks, H) arrays or None) are always passed down as the
# kernel's own arguments with a block index: numba removes the ``is None``
# branches at compile time only for arguments.


@_jit(_FM_SUM, inline="always")
def _ln_bwd_sums(xr, dyr, w, k, c, r, with_d2, pw, pb, blk):  # type: ignore[no-untyped-def]
    """``(sum g, sum g*xhat, sum d^2)`` in float64 with ``g = dy * w``, ``d = (x - k) - c``, ``xhat = d * r``;
    adds ``dy * xhat`` to ``pw[blk]`` and ``dy`` to ``pb[blk]`` when given."""
    h = xr.shape[0]
    sg = 0.0
    sgx = 0.0
    sd2 = 0.0
    zero = tcast(xr, 0.0)
    for c0 in range(0, h, CHUNK):
        c1 = min(c0 + CHUNK, h)
        xc = xr[c0:c1]
        dc = dyr[c0:c1]
        ag = zero
        agx = zero
        ad2 = zero
        pwc = _seg2(pw, blk, c0, c1)
        pbc = _seg2(pb, blk, c0, c1)
        wc = _seg(w, c0, c1)
        if with_d2:
            for j in range(xc.shape[0]):
                d = _centre(ld(xc[j]), k, c)
                xhat = d * r
                dy = ld(dc[j])
                g = _prod(dy, wc[j]) if w is not None else dy
                ag += g
                agx += g * xhat
                ad2 += d * d
                if pw is not None:
                    pwc[j] += dy * xhat
                if pb is not None:
                    pbc[j] += dy
        else:
            for j in range(xc.shape[0]):
                xhat = _centre(ld(xc[j]), k, c) * r
                dy = ld(dc[j])
                g = _prod(dy, wc[j]) if w is not None else dy
                ag += g
                agx += g * xhat
                if pw is not None:
                    pwc[j] += dy * xhat
                if pb is not None:
                    pbc[j] += dy
        sg += np.float64(ag)
        sgx += np.float64(agx)
        sd2 += np.float64(ad2)
    return sg, sgx, sd2


@_jit(_FM_SUM, inline="always")
def _ln_bwd_dx(xr, dyr, w, k, c, r, gbar, coef, dxr):  # type: ignore[no-untyped-def]
    """``dx = r * (g - gbar - xhat * coef)`` of one row."""
    for j in range(xr.shape[0]):
        xhat = _centre(ld(xr[j]), k, c) * r
        dy = ld(dyr[j])
        g = _prod(dy, w[j]) if w is not None else dy
        st(dxr, j, r * ((g - gbar) - xhat * coef))


@_jit(_FM_SUM, inline="always")
def _ln_bwd_dx_s(xr, dyr, w, k, c, r, gbar, coef, dxr, stream):  # type: ignore[no-untyped-def]
    """:func:`_ln_bwd_dx`, with streaming stores for the aligned part of a float32 row when ``stream``."""
    if stream and _streams(dxr):
        h = xr.shape[0]
        j0, j1 = _stream_span(dxr)
        for j in range(j0):
            _ln_dx_one(xr, dyr, w, k, c, r, gbar, coef, dxr, j)
        for j in range(j0, j1, LANES):
            _ln_dx_nt(xr, dyr, w, k, c, r, gbar, coef, dxr, j)
        for j in range(j1, h):
            _ln_dx_one(xr, dyr, w, k, c, r, gbar, coef, dxr, j)
    else:
        _ln_bwd_dx(xr, dyr, w, k, c, r, gbar, coef, dxr)


@_jit(_FM_SUM, inline="always")
def _ln_acc(xr, dyr, k, c, r, pw, pb, blk, j0):  # type: ignore[no-untyped-def]
    """Add one fast-path row segment's ``dy * xhat`` to ``pw[blk, j0:]`` and ``dy`` to ``pb[blk, j0:]``."""
    n = xr.shape[0]
    if pw is not None:
        pwr = pw[blk, j0 : j0 + n]
        for j in range(n):
            pwr[j] += ld(dyr[j]) * (_centre(ld(xr[j]), k, c) * r)
    if pb is not None:
        pbr = pb[blk, j0 : j0 + n]
        for j in range(n):
            pbr[j] += ld(dyr[j])


@_jit(_FM_SUM, inline="always")
def _ln_acc4(x0, x1, x2, x3, d0, d1, d2, d3, kq, cq, rq, pw, pb, blk, j0):  # type: ignore[no-untyped-def]
    """``_ln_acc`` of four fast-path rows at once: ``pw += (row0 + row1) + (row2 + row3)``.

    One loop per output: few pointers per loop keep the compiler's run-time alias
    checks within its limit, so both loops vectorize.
    """
    n = x0.shape[0]
    if pw is not None:
        pwr = pw[blk, j0 : j0 + n]
        k0, k1, k2, k3 = tcast(x0, kq[0]), tcast(x0, kq[1]), tcast(x0, kq[2]), tcast(x0, kq[3])
        c0, c1, c2, c3 = tcast(x0, cq[0]), tcast(x0, cq[1]), tcast(x0, cq[2]), tcast(x0, cq[3])
        r0, r1, r2, r3 = tcast(x0, rq[0]), tcast(x0, rq[1]), tcast(x0, rq[2]), tcast(x0, rq[3])
        for j in range(n):
            p01 = ld(d0[j]) * (_centre(ld(x0[j]), k0, c0) * r0) + ld(d1[j]) * (_centre(ld(x1[j]), k1, c1) * r1)
            p23 = ld(d2[j]) * (_centre(ld(x2[j]), k2, c2) * r2) + ld(d3[j]) * (_centre(ld(x3[j]), k3, c3) * r3)
            pwr[j] += p01 + p23
    if pb is not None:
        pbr = pb[blk, j0 : j0 + n]
        for j in range(n):
            pbr[j] += (ld(d0[j]) + ld(d1[j])) + (ld(d2[j]) + ld(d3[j]))


@_jit()
def _ln_slow_xhat(xr, mean, r, e):  # type: ignore[no-untyped-def]
    """``(sc, m_s, r_s)``: with them and the residual ``c`` of :func:`_ln_slow_residual`,
    ``xhat = ((x * sc - m_s) - c) * r_s`` in float64 without overflow."""
    return math.ldexp(1.0, -e), math.ldexp(mean, -e), math.ldexp(r, e)


@_jit()
def _ln_slow_residual(xr, mean, e):  # type: ignore[no-untyped-def]
    """``mean(x * 2**-e - m_s)`` of the exact deviations (compensated, as in :func:`_ln_scaled_stats`),
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


@_jit()
def _ln_bwd_row_slow(xr, dyr, w, mean, r, corr, std_mode, dxr):  # type: ignore[no-untyped-def]
    """dx of one row in float64 after scaling by a power of two (compensated sums);
    returns ``(scale exponent, residual c)``."""
    h = xr.shape[0]
    n = h - corr
    e = _row_scale(xr)
    sc, m_s, r_s = _ln_slow_xhat(xr, mean, r, e)
    c = _ln_slow_residual(xr, mean, e)
    sg = 0.0
    tg = 0.0
    sgx = 0.0
    tgx = 0.0
    sd2 = 0.0
    td2 = 0.0
    for j in range(h):
        d = (np.float64(ld(xr[j])) * sc - m_s) - c
        g = np.float64(ld(dyr[j]))
        if w is not None:
            g *= np.float64(w[j])
        sg, tg = _cadd(sg, tg, g)
        sgx, tgx = _cadd(sgx, tgx, g * (d * r_s))
        sd2, td2 = _cadd(sd2, td2, d * d)
    sg = sg + tg
    sgx = sgx + tgx
    if std_mode:
        s_s = math.sqrt((sd2 + td2) / n)
        coef = sgx / (n * s_s * r_s) if s_s > 0 else 0.0
    else:
        coef = sgx / n
    gbar = sg / h
    for j in range(h):
        xhat = ((np.float64(ld(xr[j])) * sc - m_s) - c) * r_s
        g = np.float64(ld(dyr[j]))
        if w is not None:
            g *= np.float64(w[j])
        st_exact(dxr, j, r * ((g - gbar) - xhat * coef))
    return e, c


@_jit()
def _ln_acc_slow(xr, dyr, mean, r, e, c, pw, pb, blk, j0):  # type: ignore[no-untyped-def]
    """``_ln_acc`` of a slow-path row segment (float64, scaled by ``2**-e``; ``c``: the row's
    :func:`_ln_slow_residual`)."""
    sc, m_s, r_s = _ln_slow_xhat(xr, mean, r, e)
    for j in range(xr.shape[0]):
        dy = np.float64(ld(dyr[j]))
        if pw is not None:
            pw[blk, j0 + j] += tcast(xr, dy * (((np.float64(ld(xr[j])) * sc - m_s) - c) * r_s))
        if pb is not None:
            pb[blk, j0 + j] += tcast(xr, dy)


@_jit(_FM_SUM)
def _mean_fix(xr, k, c):  # type: ignore[no-untyped-def]
    """``sum((x - k) - c) / H`` in float64: what ``k + c`` misses of the row mean."""
    h = xr.shape[0]
    s = 0.0
    zero = tcast(xr, 0.0)
    for c0 in range(0, h, CHUNK):
        xc = xr[c0 : min(c0 + CHUNK, h)]
        a = zero
        for j in range(xc.shape[0]):
            a += _centre(ld(xc[j]), k, c)
        s += np.float64(a)
    return s / h


@_jit(_FM_SUM, inline="always")
def _ln_kc(xr, mean, r):  # type: ignore[no-untyped-def]
    """The centring ``(k, c)`` (math type) of the backward: ``x - mean = (x - k) - c``.

    ``k + c`` carries the float64 ``mean`` of ctx exactly for float32 and narrower
    inputs. A float64 mean is itself rounded: where that rounding matters at
    float64 accuracy (a row offset much larger than its spread) ``c`` gets the
    row's residual mean, as the forward did.
    """
    k = tcast(xr, mean)
    c = tcast(xr, mean - np.float64(k))
    if _wide(xr):
        if abs(mean) * r > 8.0 and math.isfinite(mean):
            c = c + tcast(xr, _mean_fix(xr, k, c))
    return k, c


@_jit(_FM_SUM, inline="always")
def _ln_bwd_rowdx(xr, dyr, w, mean, r, corr, std_mode, dxr, pw, pb, blk, stream):  # type: ignore[no-untyped-def]
    """dx of one row (and, on the fast path, its share of the partials ``pw[blk]``/``pb[blk]``).

    Returns ``(scale, k, c, r)``: ``scale == _SLOW`` on the fast path, else the slow
    path's exponent (the partials may then hold a wrong contribution: recompute them).
    """
    h = xr.shape[0]
    n = h - corr
    k, c = _ln_kc(xr, mean, r)
    rt = tcast(xr, r)
    if _r_ok(xr, r):
        sg, sgx, sd2 = _ln_bwd_sums(xr, dyr, w, k, c, rt, std_mode, pw, pb, blk)
        ok = math.isfinite(sg) and math.isfinite(sgx) and math.isfinite(sd2)
        if ok and std_mode and sd2 < _tiny(xr):
            ok = not _any_off(xr, k, c)
        if ok:
            if std_mode:
                s = math.sqrt(sd2 / n)
                coef = sgx / (n * s * r) if s > 0 else 0.0
            else:
                coef = sgx / n
            _ln_bwd_dx_s(xr, dyr, w, k, c, rt, tcast(xr, sg / h), tcast(xr, coef), dxr, stream)
            return _SLOW, k, c, rt
    e, cr = _ln_bwd_row_slow(xr, dyr, w, mean, r, corr, std_mode, dxr)
    return e, k, tcast(xr, cr), rt


@_jit(_FM_SUM)
def _ln_redo_block(x, dy, mean, rstd, i0, scale, pw, pb, blk):  # type: ignore[no-untyped-def]
    """Recompute a block's partials after a slow-path row: rows in order, each with the formula of its path."""
    if pw is not None:
        pw[blk, :] = 0
    if pb is not None:
        pb[blk, :] = 0
    for q in range(scale.shape[0]):
        xr = x[i0 + q]
        if scale[q] == _SLOW:
            k, c = _ln_kc(xr, mean[i0 + q], rstd[i0 + q])
            _ln_acc(xr, dy[i0 + q], k, c, tcast(xr, rstd[i0 + q]), pw, pb, blk, 0)
        else:
            e = scale[q]
            cr = _ln_slow_residual(xr, mean[i0 + q], e)
            _ln_acc_slow(xr, dy[i0 + q], mean[i0 + q], rstd[i0 + q], e, cr, pw, pb, blk, 0)


@_jit(_FM_SUM, parallel=True)
def ln_bwd_fused(x, dy, w, mean, rstd, corr, std_mode, dx, pw, pb, stream):  # type: ignore[no-untyped-def]
    """LayerNorm backward by row blocks: dx, and per-block partial sums ``pw``/``pb`` (or None)."""
    rows = x.shape[0]
    nb = (rows + ROW_BLOCK - 1) // ROW_BLOCK
    for blk in prange(nb):
        if pw is not None:
            pw[blk, :] = 0
        if pb is not None:
            pb[blk, :] = 0
        i0 = blk * ROW_BLOCK
        i1 = min(i0 + ROW_BLOCK, rows)
        scale = np.empty(i1 - i0, np.int64)
        slow = 0
        for i in range(i0, i1):
            e = _ln_bwd_rowdx(x[i], dy[i], w, mean[i], rstd[i], corr, std_mode, dx[i], pw, pb, blk, stream)[0]
            scale[i - i0] = e
            if e != _SLOW:
                slow += 1
        if slow:
            _ln_redo_block(x, dy, mean, rstd, i0, scale, pw, pb, blk)
        if stream:
            _sfence()


@_jit(_FM_SUM, parallel=True)
def ln_bwd_rows(x, dy, w, mean, rstd, corr, std_mode, dx, scale, cs, stream):  # type: ignore[no-untyped-def]
    """LayerNorm backward, dx only, row-parallel; ``scale[i]`` records the path row i took, ``cs[i]`` its ``c``."""
    for i in prange(x.shape[0]):
        e, _, c, _ = _ln_bwd_rowdx(x[i], dy[i], w, mean[i], rstd[i], corr, std_mode, dx[i], None, None, 0, stream)
        if stream:
            _sfence()
        scale[i] = e
        cs[i] = c


@_jit(_FM_SUM, parallel=True)
def ln_params_by_cols(x, dy, mean, rstd, scale, cs, pw, pb):  # type: ignore[no-untyped-def]
    """Per-block partial sums of ``dy * xhat`` and ``dy`` by column tiles (for few rows); rows by groups of 4."""
    rows, h = x.shape
    nb = (rows + ROW_BLOCK - 1) // ROW_BLOCK
    nt = (h + COL_TILE - 1) // COL_TILE
    for t in prange(nt):
        j0 = t * COL_TILE
        j1 = min(j0 + COL_TILE, h)
        kq = np.empty(4)
        cq = np.empty(4)
        rq = np.empty(4)
        for blk in range(nb):
            if pw is not None:
                pw[blk, j0:j1] = 0
            if pb is not None:
                pb[blk, j0:j1] = 0
            i = blk * ROW_BLOCK
            end = min(i + ROW_BLOCK, rows)
            while i < end:
                n4 = min(4, end - i)
                allfast = n4 == 4
                for q in range(n4):
                    kq[q] = tcast(x, mean[i + q])
                    cq[q] = cs[i + q]
                    rq[q] = tcast(x, rstd[i + q])
                    allfast = allfast and scale[i + q] == _SLOW
                if allfast:
                    _ln_acc4(x[i, j0:j1], x[i + 1, j0:j1], x[i + 2, j0:j1], x[i + 3, j0:j1],
                             dy[i, j0:j1], dy[i + 1, j0:j1], dy[i + 2, j0:j1], dy[i + 3, j0:j1],
                             kq, cq, rq, pw, pb, blk, j0)  # fmt: skip
                else:
                    for q in range(n4):
                        xr = x[i + q, j0:j1]
                        dyr = dy[i + q, j0:j1]
                        if scale[i + q] == _SLOW:
                            _ln_acc(xr, dyr, tcast(xr, kq[q]), tcast(xr, cq[q]), tcast(xr, rq[q]), pw, pb, blk, j0)
                        else:
                            e = scale[i + q]
                            _ln_acc_slow(xr, dyr, mean[i + q], rstd[i + q], e, cs[i + q], pw, pb, blk, j0)
                i += 4


# ---------------------------------------------------------------------------
# RMSNorm


@_jit(_FM_SUM, inline="always")
def _rms_out(xr, w, r, yr):  # type: ignore[no-untyped-def]
    for j in range(xr.shape[0]):
        v = ld(xr[j]) * r
        if w is not None:
            v = v * w[j]
        st(yr, j, v)


@_jit(_FM_SUM, inline="always")
def _rms_out_one(xr, w, r, yr, j):  # type: ignore[no-untyped-def]
    """Element ``j`` of :func:`_rms_out`."""
    v = ld(xr[j]) * r
    if w is not None:
        v = v * w[j]
    st(yr, j, v)


@_jit(_FM_SUM, inline="always")
def _rms_out_stream(xr, w, r, yr):  # type: ignore[no-untyped-def]
    """:func:`_rms_out` with streaming stores for the 64-byte aligned part of a float32 row."""
    h = xr.shape[0]
    if _streams(yr):
        j0, j1 = _stream_span(yr)
        for j in range(j0):
            _rms_out_one(xr, w, r, yr, j)
        for j in range(j0, j1, LANES):
            _rms_out_nt(xr, w, r, yr, j)
        for j in range(j1, h):
            _rms_out_one(xr, w, r, yr, j)
    else:
        _rms_out(xr, w, r, yr)


@_jit()
def _rms_rstd_scaled(xr, e, eps):  # type: ignore[no-untyped-def]
    h = xr.shape[0]
    sc = math.ldexp(1.0, -e)
    s2 = 0.0
    t2 = 0.0
    for j in range(h):
        v = np.float64(ld(xr[j])) * sc
        s2, t2 = _cadd(s2, t2, v * v)
    return _scaled_rstd((s2 + t2) / h, e, eps, False)


@_jit()
def _rms_fwd_row_slow(xr, w, eps, yr):  # type: ignore[no-untyped-def]
    e = _row_scale(xr)
    r, r_s = _rms_rstd_scaled(xr, e, eps)
    sc = math.ldexp(1.0, -e)
    for j in range(xr.shape[0]):
        v = np.float64(ld(xr[j])) * sc * r_s
        if w is not None:
            v = v * np.float64(w[j])
        st_exact(yr, j, v)
    return r


@_jit(_FM_SUM, inline="always")
def _rms_fwd_row(xr, w, eps, yr, stream):  # type: ignore[no-untyped-def]
    """RMS-normalize one row into ``yr``; returns ``r`` in float64."""
    s2 = _sum_squares(xr)
    if not math.isfinite(s2) or (s2 < _tiny(xr) and _any_off(xr, tcast(xr, 0.0), tcast(xr, 0.0))):
        return _rms_fwd_row_slow(xr, w, eps, yr)
    r = 1.0 / math.sqrt(s2 / xr.shape[0] + eps)
    if stream:
        _rms_out_stream(xr, w, tcast(xr, r), yr)
    else:
        _rms_out(xr, w, tcast(xr, r), yr)
    return r


@_jit(_FM_SUM, parallel=True)
def rms_fwd(x, w, eps, y, rstd, stream):  # type: ignore[no-untyped-def]
    """RMSNorm forward of every row of ``x`` into ``y``; ``rstd`` float64 (``stream``: as :func:`ln_fwd`)."""
    rows = x.shape[0]
    for g in prange((rows + STREAM_GROUP - 1) // STREAM_GROUP):
        for i in range(g * STREAM_GROUP, min(g * STREAM_GROUP + STREAM_GROUP, rows)):
            rstd[i] = _rms_fwd_row(x[i], w, eps, y[i], stream)
        if stream:
            _sfence()


@_jit(_FM_SUM, inline="always")
def _rms_bwd_sum(xr, dyr, w, r, pw, blk):  # type: ignore[no-untyped-def]
    """``sum(g * xhat)`` in float64 with ``g = dy * w``, ``xhat = x * r``; adds ``dy * xhat`` to ``pw[blk]``."""
    h = xr.shape[0]
    sgx = 0.0
    zero = tcast(xr, 0.0)
    for c0 in range(0, h, CHUNK):
        c1 = min(c0 + CHUNK, h)
        xc = xr[c0:c1]
        dc = dyr[c0:c1]
        pwc = _seg2(pw, blk, c0, c1)
        wc = _seg(w, c0, c1)
        agx = zero
        for j in range(xc.shape[0]):
            xhat = ld(xc[j]) * r
            dy = ld(dc[j])
            agx += (dy * wc[j] if w is not None else dy) * xhat
            if pw is not None:
                pwc[j] += dy * xhat
        sgx += np.float64(agx)
    return sgx


@_jit(_FM_SUM, inline="always")
def _rms_bwd_dx(xr, dyr, w, r, coef, dxr):  # type: ignore[no-untyped-def]
    """``dx = r * (g - xhat * coef)`` of one row."""
    for j in range(xr.shape[0]):
        dy = ld(dyr[j])
        g = dy * w[j] if w is not None else dy
        st(dxr, j, r * (g - (ld(xr[j]) * r) * coef))


@_jit(_FM_SUM, inline="always")
def _rms_bwd_dx_s(xr, dyr, w, r, coef, dxr, stream):  # type: ignore[no-untyped-def]
    """:func:`_rms_bwd_dx`, with streaming stores for the aligned part of a float32 row when ``stream``."""
    if stream and _streams(dxr):
        h = xr.shape[0]
        j0, j1 = _stream_span(dxr)
        for j in range(j0):
            _rms_dx_1(xr, dyr, w, r, coef, dxr, j)
        for j in range(j0, j1, LANES):
            _rms_dx_nt(xr, dyr, w, r, coef, dxr, j)
        for j in range(j1, h):
            _rms_dx_1(xr, dyr, w, r, coef, dxr, j)
    else:
        _rms_bwd_dx(xr, dyr, w, r, coef, dxr)


@_jit(_FM_SUM, inline="always")
def _rms_acc(xr, dyr, r, pw, blk, j0):  # type: ignore[no-untyped-def]
    """Add one fast-path row segment's ``dy * xhat`` to ``pw[blk, j0:]``."""
    pwr = pw[blk, j0 : j0 + xr.shape[0]]
    for j in range(xr.shape[0]):
        pwr[j] += ld(dyr[j]) * (ld(xr[j]) * r)


@_jit(_FM_SUM, inline="always")
def _rms_acc4(x0, x1, x2, x3, d0, d1, d2, d3, rq, pw, blk, j0):  # type: ignore[no-untyped-def]
    """``_rms_acc`` of four fast-path rows at once: ``pw += (row0 + row1) + (row2 + row3)``."""
    pwr = pw[blk, j0 : j0 + x0.shape[0]]
    r0, r1, r2, r3 = tcast(x0, rq[0]), tcast(x0, rq[1]), tcast(x0, rq[2]), tcast(x0, rq[3])
    for j in range(x0.shape[0]):
        p01 = ld(d0[j]) * (ld(x0[j]) * r0) + ld(d1[j]) * (ld(x1[j]) * r1)
        p23 = ld(d2[j]) * (ld(x2[j]) * r2) + ld(d3[j]) * (ld(x3[j]) * r3)
        pwr[j] += p01 + p23


@_jit()
def _rms_acc_slow(xr, dyr, r, e, pw, blk, j0):  # type: ignore[no-untyped-def]
    """``_rms_acc`` of a slow-path row segment (float64, scaled by ``2**-e``)."""
    sc = math.ldexp(1.0, -e)
    r_s = math.ldexp(r, e)
    for j in range(xr.shape[0]):
        pw[blk, j0 + j] += tcast(xr, np.float64(ld(dyr[j])) * (np.float64(ld(xr[j])) * sc * r_s))


@_jit()
def _rms_bwd_row_slow(xr, dyr, w, r, dxr):  # type: ignore[no-untyped-def]
    """dx of one row in float64 after scaling by a power of two (compensated sum); returns the scale exponent."""
    h = xr.shape[0]
    e = _row_scale(xr)
    sc = math.ldexp(1.0, -e)
    r_s = math.ldexp(r, e)
    sgx = 0.0
    tgx = 0.0
    for j in range(h):
        g = np.float64(ld(dyr[j]))
        if w is not None:
            g *= np.float64(w[j])
        sgx, tgx = _cadd(sgx, tgx, g * (np.float64(ld(xr[j])) * sc * r_s))
    coef = (sgx + tgx) / h
    for j in range(h):
        g = np.float64(ld(dyr[j]))
        if w is not None:
            g *= np.float64(w[j])
        st_exact(dxr, j, r * (g - (np.float64(ld(xr[j])) * sc * r_s) * coef))
    return e


@_jit(_FM_SUM, inline="always")
def _rms_bwd_rowdx(xr, dyr, w, r, dxr, pw, blk, stream):  # type: ignore[no-untyped-def]
    """dx of one row (and, on the fast path, its share of ``pw[blk]``); returns ``(scale, r)`` as
    :func:`_ln_bwd_rowdx`."""
    rt = tcast(xr, r)
    if _r_ok(xr, r):
        sgx = _rms_bwd_sum(xr, dyr, w, rt, pw, blk)
        if math.isfinite(sgx):
            _rms_bwd_dx_s(xr, dyr, w, rt, tcast(xr, sgx / xr.shape[0]), dxr, stream)
            return _SLOW, rt
    return _rms_bwd_row_slow(xr, dyr, w, r, dxr), rt


@_jit(_FM_SUM)
def _rms_redo_block(x, dy, rstd, i0, scale, pw, blk):  # type: ignore[no-untyped-def]
    """Recompute a block's partials after a slow-path row (see :func:`_ln_redo_block`)."""
    pw[blk, :] = 0
    for q in range(scale.shape[0]):
        xr = x[i0 + q]
        if scale[q] == _SLOW:
            _rms_acc(xr, dy[i0 + q], tcast(xr, rstd[i0 + q]), pw, blk, 0)
        else:
            _rms_acc_slow(xr, dy[i0 + q], rstd[i0 + q], scale[q], pw, blk, 0)


@_jit(_FM_SUM, parallel=True)
def rms_bwd_fused(x, dy, w, rstd, dx, pw, stream):  # type: ignore[no-untyped-def]
    """RMSNorm backward by row blocks: dx and per-block partial sums ``pw`` (or None)."""
    rows = x.shape[0]
    nb = (rows + ROW_BLOCK - 1) // ROW_BLOCK
    for blk in prange(nb):
        if pw is not None:
            pw[blk, :] = 0
        i0 = blk * ROW_BLOCK
        i1 = min(i0 + ROW_BLOCK, rows)
        scale = np.empty(i1 - i0, np.int64)
        slow = 0
        for i in range(i0, i1):
            e = _rms_bwd_rowdx(x[i], dy[i], w, rstd[i], dx[i], pw, blk, stream)[0]
            scale[i - i0] = e
            if e != _SLOW:
                slow += 1
        if pw is not None:
            if slow:
                _rms_redo_block(x, dy, rstd, i0, scale, pw, blk)
        if stream:
            _sfence()


@_jit(_FM_SUM, parallel=True)
def rms_bwd_rows(x, dy, w, rstd, dx, scale, stream):  # type: ignore[no-untyped-def]
    """RMSNorm backward, dx only, row-parallel; ``scale[i]`` records the path row i took."""
    for i in prange(x.shape[0]):
        scale[i] = _rms_bwd_rowdx(x[i], dy[i], w, rstd[i], dx[i], None, 0, stream)[0]
        if stream:
            _sfence()


@_jit(_FM_SUM, parallel=True)
def rms_params_by_cols(x, dy, rstd, scale, pw):  # type: ignore[no-untyped-def]
    """Per-block partial sums of ``dy * xhat`` by column tiles (for few rows); rows by groups of 4."""
    rows, h = x.shape
    nb = (rows + ROW_BLOCK - 1) // ROW_BLOCK
    nt = (h + COL_TILE - 1) // COL_TILE
    for t in prange(nt):
        j0 = t * COL_TILE
        j1 = min(j0 + COL_TILE, h)
        rq = np.empty(4)
        for blk in range(nb):
            pw[blk, j0:j1] = 0
            i = blk * ROW_BLOCK
            end = min(i + ROW_BLOCK, rows)
            while i < end:
                n4 = min(4, end - i)
                allfast = n4 == 4
                for q in range(n4):
                    rq[q] = tcast(x, rstd[i + q])
                    allfast = allfast and scale[i + q] == _SLOW
                if allfast:
                    _rms_acc4(x[i, j0:j1], x[i + 1, j0:j1], x[i + 2, j0:j1], x[i + 3, j0:j1],
                              dy[i, j0:j1], dy[i + 1, j0:j1], dy[i + 2, j0:j1], dy[i + 3, j0:j1],
                              rq, pw, blk, j0)  # fmt: skip
                else:
                    for q in range(n4):
                        xr = x[i + q, j0:j1]
                        dyr = dy[i + q, j0:j1]
                        if scale[i + q] == _SLOW:
                            _rms_acc(xr, dyr, tcast(xr, rq[q]), pw, blk, j0)
                        else:
                            _rms_acc_slow(xr, dyr, rstd[i + q], scale[i + q], pw, blk, j0)
                i += 4


# ---------------------------------------------------------------------------
# reduction of the per-block partial sums


@_jit(_FM_SUM, parallel=True)
def sum_blocks(p, out):  # type: ignore[no-untyped-def]
    """``out[j] = sum_b p[b, j]`` in float64, blocks in order, rounded once to ``out``'s storage dtype."""
    nb, h = p.shape
    nt = (h + COL_TILE - 1) // COL_TILE
    for t in prange(nt):
        j0 = t * COL_TILE
        j1 = min(j0 + COL_TILE, h)
        acc = np.zeros(j1 - j0)
        for blk in range(nb):
            pr = p[blk, j0:j1]
            for j in range(j1 - j0):
                acc[j] += np.float64(pr[j])
        o = out[j0:j1]
        for j in range(j1 - j0):
            st_exact(o, j, acc[j])
