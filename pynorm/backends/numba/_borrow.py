# numba's type stubs do not model intrinsics or overload stubs:
# mypy: disable-error-code="call-arg,attr-defined"
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
"""

from __future__ import annotations

from typing import Any

from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from ._storage import JIT_ONLY

__all__ = ["borrow"]


@intrinsic
def _borrow_array(typingctx, a):  # type: ignore[no-untyped-def]
    """``a`` without its memory-info (and parent object): a view whose reference counting does nothing."""
    if not isinstance(a, types.Array):
        return None

    def codegen(context, builder, sig, args):  # type: ignore[no-untyped-def]
        src = context.make_array(sig.args[0])(context, builder, args[0])
        dst = context.make_array(sig.return_type)(context, builder)
        for field in ("data", "shape", "strides", "itemsize", "nitems"):
            setattr(dst, field, getattr(src, field))
        dst.meminfo = cgutils.get_null_value(dst.meminfo.type)
        dst.parent = cgutils.get_null_value(dst.parent.type)
        return dst._getvalue()

    return a(a), codegen


def borrow(v):  # type: ignore[no-untyped-def]
    """``v`` with every array (in it, for a tuple) borrowed (:func:`_borrow_array`); other values unchanged."""
    raise RuntimeError(JIT_ONLY)


_TUPLE_IMPLS: dict[int, Any] = {}


def _tuple_impl(n: int) -> Any:
    """``lambda v: (borrow(v[0]), ..., borrow(v[n - 1]))``."""
    if n not in _TUPLE_IMPLS:
        items = "".join(f"borrow(v[{i}]), " for i in range(n))
        scope: dict[str, Any] = {"borrow": borrow}
        exec(f"def impl(v):\n    return ({items})\n", scope)  # a fixed template; n is an int
        _TUPLE_IMPLS[n] = scope["impl"]
    return _TUPLE_IMPLS[n]


@overload(borrow, inline="always")
def _borrow_ol(v):  # type: ignore[no-untyped-def]
    if isinstance(v, types.Array):
        return lambda v: _borrow_array(v)
    if isinstance(v, types.BaseTuple) and len(v) > 0:
        return _tuple_impl(len(v))
    return lambda v: v
