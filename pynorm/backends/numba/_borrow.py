# numba's type stubs do not model intrinsics or numba's types:
# mypy: disable-error-code="call-arg,attr-defined,var-annotated,arg-type"
"""Borrowed views of a kernel's arrays: the same data, shape and strides, no reference count.

Every array numba builds from an argument -- a row ``x[i]``, a chunk ``xr[c0:c1]`` -- takes a reference on the
argument's memory (an atomic increment, then a decrement when it dies). A kernel over many short rows spends
much of its time there (a LayerNorm backward of 1024x128 float32: 2.3x the time without), and two threads
working on the same arrays contend for the counter's cache line. numba's ``prange`` loops never paid it: their
bodies see arrays rebuilt from raw pointers. :func:`borrow` does the same for the span kernels
(:mod:`._threads`): they hand their bodies ``borrow((x, dy, ...))``, whose arrays have no memory-info, so the
reference counting of every view made from them is a null check.

Safe because a kernel's arguments are alive for the whole call (the caller holds them), and nothing a body
makes from a borrowed array outlives the call (kernels return only counts).

A null check is still a call: numba keeps ``NRT_incref``/``NRT_decref`` out of line, and a body over short rows
made about 16 of them a row (RMSNorm 8192 x 32 forward: 537 us with them, 182 without, docs/numba.md). So the hot
bodies go one step further and compile without reference counting at all (``jit(..., borrowed=True)``,
:func:`._cache.jit`): they allocate nothing (their kernel makes the scratch rows and borrows them in), and the
pieces they call that return a view of their arguments set ``_nrt`` themselves (numba returns no view without
it). A body handed an array its callee *allocated* would leak it every call: ``tests/test_paths.py`` counts
numba's allocations over repeated calls of every op down every path and fails on any difference.
"""

from __future__ import annotations

from typing import Any

from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

__all__ = ["borrow"]


def _strip(context: Any, builder: Any, typ: Any, val: Any) -> Any:
    """The LLVM value ``val`` of numba type ``typ`` with every array in it borrowed."""
    if isinstance(typ, types.Array):
        src = context.make_array(typ)(context, builder, val)
        dst = context.make_array(typ)(context, builder)
        for field in ("data", "shape", "strides", "itemsize", "nitems"):
            setattr(dst, field, getattr(src, field))
        dst.meminfo = cgutils.get_null_value(dst.meminfo.type)
        dst.parent = cgutils.get_null_value(dst.parent.type)
        return dst._getvalue()
    if isinstance(typ, types.BaseTuple):
        for i, t in enumerate(typ):
            val = builder.insert_value(val, _strip(context, builder, t, builder.extract_value(val, i)), i)
        return val
    if context.data_model_manager[typ].has_nrt_meminfo():  # only arrays may hold references here
        raise TypeError(f"borrow: cannot borrow a {typ}")
    return val


@intrinsic
def borrow(typingctx, v):  # type: ignore[no-untyped-def]
    """``v`` (an array, a tuple of arrays and plain values, None or a plain value) with every array borrowed: the
    same data, shape and strides, no memory-info. One intrinsic, so it adds nothing to compile."""

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        return _strip(context, builder, sig.args[0], args[0])

    return v(v), codegen
