"""Shared numerics of the reference backend: working precision, row statistics, rounding.

The reference computes every op in a *working precision* ``wp`` wider than its
inputs and rounds each result once to its output dtype (:mod:`pynorm._dtypes`:
:func:`~pynorm._dtypes.working_dtype`, :func:`~pynorm._dtypes.round_to`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import numpy as np

from .._dtypes import EXTENDED_FLOAT64, round_to, rounded, working_dtype

__all__ = [
    "EXTENDED_FLOAT64",
    "backward_dtype",
    "center",
    "conventions",
    "finite_rows",
    "round_to",
    "rounded",
    "row_mean",
    "working_dtype",
    "write_result",
]

F = TypeVar("F", bound=Callable[..., Any])


def _ieee(fn: F) -> F:
    """Run ``fn`` with IEEE semantics and no warnings: 0/0 is NaN, x/0 is inf, overflow is inf.

    Those results are the defined answers for eps = 0 on constant rows and for
    values beyond a dtype's range; they are not accidents to warn about. Code
    under it rounds with :func:`rounded` (and :func:`write_result`), which set no
    error state of their own.
    """
    if _ERRSTATE_DECORATES:
        return np.errstate(divide="ignore", invalid="ignore", over="ignore")(fn)  # type: ignore[no-any-return]

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


#: whether ``np.errstate`` has a decorator of its own (NumPy >= 2), which sets the state of each call in that call
#: (thread-safe) with no context manager to make and enter: half the cost of the ``with`` block, about 0.4 us a call.
#: NumPy 1's is ``contextlib.ContextDecorator``'s, which keeps the state to restore on the shared instance.
_ERRSTATE_DECORATES = "__call__" in vars(np.errstate)


def conventions(forward: Callable[..., Any], options: Mapping[str, Any]) -> tuple[Any, ...]:
    """The values of ``forward``'s keyword-only parameters but ``out``, in their order: from ``options``, else
    their defaults. An op's ``forward_for`` binds them once for the dispatcher's plan (:func:`pynorm._dispatch._target`)
    and passes them by position on each call: binding keywords costs about a microsecond a small call."""
    params = [p for p in inspect.signature(forward).parameters.values() if p.kind is p.KEYWORD_ONLY and p.name != "out"]
    unknown = set(options) - {p.name for p in params}
    missing = [p.name for p in params if p.name not in options and p.default is p.empty]
    if unknown or missing:
        raise TypeError(f"{forward.__qualname__}: unknown options {sorted(unknown)}, missing {missing}")
    return tuple(options[p.name] if p.name in options else p.default for p in params)


def row_mean(a: np.ndarray) -> np.ndarray:
    """Mean of each row of the 2-D array ``a`` by the corrected two-pass method.

    ``m1 = sum(a)/H``, then ``m = m1 + sum(a - m1)/H``. The correction term
    removes the rounding error of the first pass, so a constant row gives its
    value exactly (``a - m`` is then exactly 0) and rows with a large common
    offset keep the accuracy of their deviations.
    """
    return _row_mean(a).ravel()


def _row_mean(a: np.ndarray) -> np.ndarray:
    # row_mean as an (R, 1) column: ``keepdims`` reductions broadcast against the rows with no indexing, and a
    # Python float H divides a column faster than an int or a NumPy scalar (the same value, exactly)
    h = float(a.shape[1])
    m1 = np.add.reduce(a, axis=1, keepdims=True) / h
    return m1 + np.add.reduce(a - m1, axis=1, keepdims=True) / h


def finite_rows(v: np.ndarray, *sums: np.ndarray) -> np.ndarray:
    """``v`` (one value per row) with NaN in every row where one of ``sums`` (per-row reductions) is not finite.

    pynorm's rule for non-finite values (``docs/numerics.md``): a row whose statistic is not finite (its input
    holds an inf or a NaN) normalizes to NaN in every element, and a row whose backward reductions are not
    finite (an inf in ``dy`` or in the weight) has a NaN ``dx`` in every element -- never a mixture of
    ``inf - inf`` and ``finite * 0`` that depends on the order of the arithmetic. Element-wise parts (the
    affine, the parameter gradients' column sums) follow IEEE arithmetic. Called under :func:`_ieee` (the sum
    of the sums it checks first may overflow).
    """
    total = sums[0]
    for s in sums[1:]:  # (a sum of the sums is finite only where each is: one check for the common case)
        total = total + s
    if np.isfinite(total).all():
        return v
    ok = np.isfinite(sums[0])
    for s in sums[1:]:
        ok &= np.isfinite(s)
    return v if ok.all() else np.where(ok, v, np.asarray(np.nan, dtype=v.dtype))


def center(a: np.ndarray, mean: np.ndarray) -> np.ndarray:
    """``a - mean`` per row, re-centred once: ``d = (a - m) - mean(a - m)``.

    ``a - m`` is exact or nearly so for elements close to ``m`` (Sterbenz), but
    ``m`` itself carries the rounding error of the working precision, which is a
    common shift of every deviation: ~5e-16 relative for ``1e4 + N(0,1)``
    float64 rows in 64-bit extended precision, several float64 ulps. Subtracting
    the mean of the deviations removes that shift; constant rows stay exactly 0.
    ``mean`` is one value per row, an ``(R,)`` array or an ``(R, 1)`` column.
    """
    d = a - (mean if mean.ndim == 2 else mean[:, None])
    d -= np.add.reduce(d, axis=1, keepdims=True) / float(a.shape[1])
    return d


@functools.lru_cache(maxsize=256)
def backward_dtype(stat_dtype: Any, *dtypes: Any) -> np.dtype[Any]:
    """The dtype a backward computes in: the working dtype of ``dtypes`` (None entries ignored), widened to the
    dtype of the ctx's statistics ``stat_dtype`` (cached: ``numpy.result_type`` costs a microsecond)."""
    return np.result_type(stat_dtype, working_dtype(*dtypes))


def write_result(value: np.ndarray, dtype: Any, out: np.ndarray | None) -> np.ndarray:
    """Round ``value`` to ``dtype`` and return it, or copy it into ``out`` and return ``out`` (under :func:`_ieee`)."""
    r = rounded(value, dtype)  # (a result beyond the dtype's range rounds to +-inf, as IEEE says)
    if out is None:
        return r
    np.copyto(out, r, casting="no")
    return out
