# numba's type stubs do not model intrinsics or overload stubs:
# mypy: disable-error-code="call-arg,attr-defined,var-annotated,call-overload"
"""Streaming (non-temporal) stores of large float32 outputs (jitted pieces only).

A large output is written with 64-byte aligned non-temporal vector stores: the cache lines are
not read before being overwritten (no read-for-ownership), which saves a third of the memory
traffic of a forward. :func:`out_vec` and :func:`dx_vec` build, per statistic, the same
operations with the same fastmath flags as the plain loops' elements (:func:`._rowstats.centre`,
:func:`._rowstats.dx_elem`), rounded once; :func:`dx_vec1` is one element of :func:`dx_vec`'s
arithmetic with a plain store (the unaligned ends of a streamed row are computed exactly as its
body, so ``dx`` does not depend on the output's alignment). :func:`stream_span` is the aligned
part of a row, :func:`sfence` orders a thread's streaming stores before its later stores.

The intrinsics are typed for every dtype (a caller's branch on :func:`streams` is typed even
where it is dead) and generate code for float32 only.
"""

from __future__ import annotations

import platform

from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from ...ops.families import STATISTICS
from ._cache import jit
from ._layout import LANES
from ._storage import JIT_ONLY

__all__ = ["dx_vec", "dx_vec1", "out_vec", "sfence", "stream_lines", "stream_span", "streams"]

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")


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
def sfence(typingctx, stream):  # type: ignore[no-untyped-def]
    """Order this thread's streaming stores before its later stores (x86 ``sfence``) where the kernel streams:
    nothing when its ``stream`` argument is None."""

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        from numba.core import cgutils

        if _X86 and not isinstance(stream, types.NoneType):
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse.sfence"
            )
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.none(stream), codegen


@jit()
def stream_span(yr):  # type: ignore[no-untyped-def]
    """``(j0, j1)``: the part of the float32 row ``yr`` made of whole 64-byte aligned lines."""
    h = yr.shape[0]
    m = _misalign(yr)
    j0 = min(h, ((64 - m) % 64) // 4) if m % 4 == 0 else h
    return j0, j0 + (h - j0) // LANES * LANES


@jit(inline="always")
def stream_lines(yr, lo, hi):  # type: ignore[no-untyped-def]
    """``(a, e)``: the part of ``yr[lo:hi]`` made of whole lines of :func:`stream_span` (``lo <= a <= e <= hi``;
    ``(j0, j1)`` of :func:`stream_span` for the whole row). A row written segment by segment this way gets the
    same stores as written whole."""
    j0, j1 = stream_span(yr)
    a = j0 if lo <= j0 else j0 + (lo - j0 + LANES - 1) // LANES * LANES
    a = min(a, hi)
    e = min(hi, j1)
    e = j0 + (e - j0) // LANES * LANES if e > j0 else a
    return a, max(a, e)


def streams(a):  # type: ignore[no-untyped-def]
    """True (a compile-time constant) when outputs of storage array ``a`` can be written by streaming stores."""
    raise RuntimeError(JIT_ONLY)


@overload(streams)
def _streams_ol(a):  # type: ignore[no-untyped-def]
    if a.dtype == types.float32:
        return lambda a: True
    return lambda a: False


def _centered(stat):  # type: ignore[no-untyped-def]
    """Whether the statistic's elements are centred as ``(x - k) - c`` (its record's ``mean``), else taken as they
    are: the two element forms the vector code below builds, as the statistic's pieces
    :func:`._rowstats.centre` / :func:`._rowstats.dx_elem` do."""
    record = STATISTICS.get(str(getattr(stat, "choice", ""))) if getattr(stat, "axis", None) == "statistic" else None
    if record is None:
        raise TypeError(f"no streaming stores for {stat}")
    return record.mean


def _wvec(context, builder, aty, a, j, n=LANES):  # type: ignore[no-untyped-def]
    """A parameter's ``a[j : j + n]`` as one vector, or the scalar ``a`` splat (one channel's value)."""
    if isinstance(aty, types.Float):
        return _splat(builder, a, n)
    return _vload(context, builder, aty, a, j, n)


@intrinsic
def out_vec(typingctx, stat, xr, w, b, k, c, r, yr, j):  # type: ignore[no-untyped-def]
    """``yr[j : j + LANES] = centre(x) * r [* w] [+ b]`` (float32, as the plain loop), streaming store (``w``, ``b``:
    vectors, or one channel's scalars)."""
    f32 = xr.dtype == types.float32 and yr.dtype == types.float32
    centered = _centered(stat)
    has_w = not isinstance(w, types.NoneType)
    has_b = not isinstance(b, types.NoneType)

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        if not f32:
            return context.get_dummy_value()
        _, ax, aw, ab, vk, vc, vr, ay, vj = args
        v = _vload(context, builder, sig.args[1], ax, vj)
        if centered:  # (x - k) - c without flags, as _centre
            v = builder.fsub(builder.fsub(v, _splat(builder, vk, LANES)), _splat(builder, vc, LANES))
        v = _fm(builder.fmul(v, _splat(builder, vr, LANES)))
        if has_w:
            v = _fm(builder.fmul(v, _wvec(context, builder, sig.args[2], aw, vj)))
        if has_b:
            v = _fm(builder.fadd(v, _wvec(context, builder, sig.args[3], ab, vj)))
        _vstore_nt(context, builder, sig.args[7], ay, vj, v)
        return context.get_dummy_value()

    return types.none(stat, xr, w, b, k, c, r, yr, j), codegen


def _dx_vec_make(n):  # type: ignore[no-untyped-def]
    @intrinsic
    def impl(typingctx, stat, xr, dyr, w, k, c, r, gbar, coef, dxr, j):  # type: ignore[no-untyped-def]
        """``dxr[j : j + n]`` = the statistic's ``dx`` (float32, as :func:`._rowstats.dx_elem`), streaming store
        (plain store for n = 1)."""
        f32 = xr.dtype == types.float32 and dyr.dtype == types.float32 and dxr.dtype == types.float32
        centered = _centered(stat)
        has_w = not isinstance(w, types.NoneType)

        def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
            if not f32:
                return context.get_dummy_value()
            _, ax, ady, aw, vk, vc, vr, vg, vco, adx, vj = args
            ta = sig.args
            if centered:  # xhat = ((x - k) - c) * r; g = dy * w without flags (as _prod); t = g - gbar
                d = builder.fsub(builder.fsub(_vload(context, builder, ta[1], ax, vj, n), _splat(builder, vk, n)),
                                 _splat(builder, vc, n))  # fmt: skip
                rv = _splat(builder, vr, n)
                xhat = _fm(builder.fmul(d, rv))
                g = _vload(context, builder, ta[2], ady, vj, n)
                if has_w:
                    g = builder.fmul(g, _wvec(context, builder, ta[3], aw, vj, n))
                t = _fm(builder.fsub(g, _splat(builder, vg, n)))
            else:  # mean square: g = dy * w with flags, xhat = x * r, no gbar
                rv = _splat(builder, vr, n)
                t = _vload(context, builder, ta[2], ady, vj, n)
                if has_w:
                    t = _fm(builder.fmul(t, _wvec(context, builder, ta[3], aw, vj, n)))
                xhat = _fm(builder.fmul(_vload(context, builder, ta[1], ax, vj, n), rv))
            u = _fm(builder.fsub(t, _fm(builder.fmul(xhat, _splat(builder, vco, n)))))
            _vstore_nt(context, builder, ta[9], adx, vj, _fm(builder.fmul(rv, u)), n > 1)
            return context.get_dummy_value()

        return types.none(stat, xr, dyr, w, k, c, r, gbar, coef, dxr, j), codegen

    return impl


dx_vec = _dx_vec_make(LANES)
dx_vec1 = _dx_vec_make(1)
