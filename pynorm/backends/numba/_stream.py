# numba's type stubs do not model intrinsics or overload stubs:
# mypy: disable-error-code="call-arg,attr-defined,var-annotated,call-overload"
"""Streaming (non-temporal) stores of large float32 outputs (jitted pieces only).

A large output is written with 64-byte aligned non-temporal vector stores: the cache lines are
not read before being overwritten (no read-for-ownership), which saves a third of the memory
traffic of a forward. Nothing here computes an element: the kernels compute :data:`STAGE` elements at a time
with the plain loops' own functions (the statistic's pieces, :func:`._rowstats.dx_elem` and the forward's
element) into a scratch row on the stack (:func:`stage_buf`) and store them by :func:`nt_copy`, so a streamed
output is bitwise the plain stores' (and a row's result never depends on whether the batch's output was large
enough to stream). :func:`stream_span` is the aligned part of a row, :func:`sfence` orders a thread's streaming
stores before its later stores.

The intrinsics are typed for every dtype (a caller's branch on :func:`streams` is typed even
where it is dead) and generate code for float32 only.
"""

from __future__ import annotations

import platform

from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from ._cache import jit
from ._layout import LANES
from ._storage import JIT_ONLY

__all__ = ["STAGE", "nt_copy", "sfence", "stage_buf", "stream_lines", "stream_span", "streams"]

#: elements of a streamed row computed into the stack scratch at a time (a multiple of :data:`LANES`)
STAGE = 4 * LANES

_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")


def _vload(context, builder, aty, a, j, n=LANES):  # type: ignore[no-untyped-def]
    """``a[j : j + n]`` as one float32 vector (unaligned load)."""
    from numba.core import cgutils

    arr = context.make_array(aty)(context, builder, a)
    ptr = cgutils.get_item_pointer(context, builder, aty, arr, [j], wraparound=False)
    return builder.load(builder.bitcast(ptr, ir.VectorType(ir.FloatType(), n).as_pointer()), align=4)


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


@intrinsic
def stage_buf(typingctx, out):  # type: ignore[no-untyped-def]
    """A scratch row of :data:`STAGE` elements of ``out``'s dtype on the calling function's stack (allocated once in
    its entry block): where a streamed output's elements are computed, by the plain loops' own functions, before
    :func:`nt_copy` stores them."""
    if not isinstance(out, types.Array):
        return None
    ret = types.Array(out.dtype, 1, "C")

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        from numba.core import cgutils

        intp = context.get_value_type(types.intp)
        ety = context.get_data_type(ret.dtype)
        size = context.get_abi_sizeof(ety)
        data = cgutils.alloca_once(builder, ety, size=STAGE)
        ary = context.make_array(ret)(context, builder)
        context.populate_array(
            ary, data=data, shape=[intp(STAGE)], strides=[intp(size)], itemsize=intp(size), meminfo=None
        )
        return ary._getvalue()

    return ret(out), codegen


@intrinsic
def nt_copy(typingctx, buf, q, out, j):  # type: ignore[no-untyped-def]
    """``out[j : j + LANES] = buf[q : q + LANES]`` by one streaming store (float32; ``out[j]`` 64-byte aligned)."""
    f32 = isinstance(out, types.Array) and out.dtype == types.float32

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        if f32:
            ab, vq, ao, vj = args
            _vstore_nt(context, builder, sig.args[2], ao, vj, _vload(context, builder, sig.args[0], ab, vq))
        return context.get_dummy_value()

    return types.none(buf, q, out, j), codegen
