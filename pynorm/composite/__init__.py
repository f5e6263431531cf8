"""Composite ops: Python over the norm ops of the chosen backend and matrix products in its array library.

One implementation per op, shared by every backend: ``bind(op, backend)`` returns an object with
``forward``/``backward`` of the reference contract (``(rows, hidden)`` arrays, validated by the
dispatcher) whose norm part runs the ``builds_on`` ops of the op's spec (:class:`pynorm.ops.Composite`)
on ``backend`` -- its own kernels -- and whose matrix products run in the module of the input arrays
(NumPy's BLAS for ``numpy.ndarray``, cuBLAS through CuPy for ``cupy.ndarray``). The registry offers a
composite op on every backend that implements the ops it builds on (:func:`pynorm.list_ops`).

* :mod:`.conditional_norm` -- conditional LayerNorm / RMSNorm: the modality norms with one table row per
  cond row (``ids`` = the cond row serving each row);
* :mod:`.norm_linear` -- fused LayerNorm / RMSNorm + Linear: the norm, then the product; backward
  recomputes the norm's output from the ctx instead of keeping it.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

__all__ = ["compute_dtype", "ieee", "norm_backward", "widened", "xp_of"]

F = TypeVar("F", bound=Callable[..., Any])


def ieee(fn: F) -> F:
    """``fn`` with NumPy's IEEE warnings off: an inf or NaN in the input propagates through the products as the
    reference's rule says (``docs/numerics.md``), not as a warning (CuPy does not warn)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


def xp_of(a: Any) -> Any:
    """The array module (``numpy``, ``cupy``...) of ``a``."""
    return sys.modules[type(a).__module__.partition(".")[0]]


def compute_dtype(*arrays: Any) -> np.dtype[Any]:
    """The dtype of the matrix products: float64 when any operand is float64, else float32 (16-bit operands
    are multiplied in float32, as cuBLAS accumulates them)."""
    return np.dtype(np.float64 if any(a is not None and a.dtype.itemsize >= 8 for a in arrays) else np.float32)


def widened(a: Any) -> Any:
    """``a`` itself for float32/float64, a float32 copy of a 16-bit array."""
    return a if a.dtype.itemsize >= 4 else a.astype(np.float32)


def norm_backward(impl: Any, upstream: Any, nctx: Any, x_dtype: Any, dx_dtype: Any, dx_out: Any) -> tuple[Any, Any]:
    """The inner norm's backward (``impl``'s, from its ctx ``nctx``, whose ``x`` has ``x_dtype``) at ``upstream``
    taken in ``x_dtype``: ``(grads, dx)`` with ``dx`` in ``dx_dtype`` (the outer op's ``dy``'s, wider where
    ``x`` was widened), written into ``dx_out`` if given."""
    wide = x_dtype != dx_dtype
    g = impl.backward(upstream.astype(x_dtype, copy=False), nctx, dx_out=None if wide else dx_out)
    dx = g.dx
    if wide:
        dx = dx.astype(dx_dtype)
        if dx_out is not None:
            dx_out[...] = dx
            dx = dx_out
    return g, dx
