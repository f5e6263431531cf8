r"""BatchNorm, the reference definition (NumPy; also the ``numpy`` backend).

``x`` is seen as ``(N, C, S)`` (the dispatcher moves the channel axis to 1 and flattens the spatial dims). Each
channel's statistics are over its ``N S`` values (Ioffe & Szegedy 2015, "Batch Normalization"):

* ``training=True``: :math:`\mu_c = \mathrm{mean}_{n,s}\, x_{ncs}`, :math:`v_c = \mathrm{mean}_{n,s}\,(x_{ncs} -
  \mu_c)^2` (biased), :math:`y = (x - \mu_c) / \sqrt{v_c + \epsilon}\; w_c + b_c`; given running statistics,
  they are returned updated with the **unbiased** variance (PyTorch's convention): ``running_mean' = (1 - m)
  running_mean + m mu``, ``running_var' = (1 - m) running_var + m v N S / (N S - 1)``; ``momentum=None`` is the
  cumulative average, ``m = 1 / (num_batches_tracked + 1)``. ``N S < 2`` is an error (PyTorch's).
  Backward: LayerNorm's on the channel's values, :math:`dx = r (g - \bar g - \hat x\, \overline{g \hat x})` with
  :math:`g = dy\, w_c` and the means over ``(n, s)``.
* ``training=False``: the running statistics, :math:`y = (x - \mu^{run}_c) / \sqrt{v^{run}_c + \epsilon}\; w_c
  + b_c`; backward element-wise, :math:`dx = dy\, w_c / \sqrt{v^{run}_c + \epsilon}` (no statistics term).

In both modes :math:`\partial L/\partial w_c = \sum_{n,s} dy\,\hat x`, :math:`\partial L/\partial b_c =
\sum_{n,s} dy`. Numerics: the statistics by the corrected two-pass method in the working precision (float64, or
extended for float64 input), on the ``(C, N S)`` view of ``x``; every output rounded once.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ..ops.batch_norm import BatchNormCtx, BatchNormGrads
from ._common import _ieee, center, round_to, row_mean, working_dtype, write_result

__all__ = ["OP_IMPLS", "backward", "forward", "momentum_factor", "running_update"]


def momentum_factor(momentum: float | None, num_batches_tracked: int) -> float:
    """The weight of the batch statistics in the running ones: ``momentum``, or ``1 / (num_batches_tracked + 1)``
    (the cumulative average) for ``momentum=None``."""
    return 1.0 / (num_batches_tracked + 1) if momentum is None else float(momentum)


def _columns(x: np.ndarray, wp: np.dtype[Any]) -> np.ndarray:
    """The ``(C, N S)`` values of each channel, in working precision."""
    n, c, s = x.shape
    return np.ascontiguousarray(x.astype(wp).transpose(1, 0, 2)).reshape(c, n * s)


def _per_channel(a: np.ndarray | None, wp: np.dtype[Any]) -> np.ndarray | None:
    return None if a is None else a.astype(wp)[:, None]


@_ieee
def forward(
    x: np.ndarray, running_mean: Any, running_var: Any, weight: Any, bias: Any, *, training: bool,
    momentum: float | None, eps: float, num_batches_tracked: int = 0, out: Any = None,
) -> tuple[Any, BatchNormCtx]:  # fmt: skip
    """BatchNorm forward of the ``(N, C, S)`` array ``x``: ``y``, or ``(y, running_mean', running_var')`` in
    training with running statistics (see the module doc)."""
    n, c, s = x.shape
    wp = working_dtype(x.dtype, *(getattr(a, "dtype", None) for a in (running_mean, running_var, weight, bias)))
    cols = _columns(x, wp)
    if training:
        mean = row_mean(cols)
        d = center(cols, mean)
        var = np.add.reduce(d * d, axis=1) / wp.type(n * s)
        rstd = 1 / np.sqrt(var + wp.type(eps))
    else:
        mean, var = running_mean.astype(wp), running_var.astype(wp)
        d = cols - mean[:, None]
        rstd = 1 / np.sqrt(var + wp.type(eps))
    xhat = d * rstd[:, None]
    w, b = _per_channel(weight, wp), _per_channel(bias, wp)
    y = xhat * w if w is not None else xhat
    y = y + b if b is not None else y
    y = write_result(np.ascontiguousarray(y.reshape(c, n, s).transpose(1, 0, 2)), x.dtype, out)
    ctx = BatchNormCtx(x, weight, bias, mean, rstd, bool(training), float(eps))
    if not training or running_mean is None:
        return y, ctx
    m = momentum_factor(momentum, num_batches_tracked)
    return (y, *running_update(running_mean, running_var, mean, var, n * s, m)), ctx


def running_update(
    running_mean: np.ndarray, running_var: np.ndarray, mean: np.ndarray, var: np.ndarray, count: int, m: float
) -> tuple[np.ndarray, np.ndarray]:
    """The updated running statistics from a batch's per-channel ``mean`` and biased ``var`` over ``count`` values
    each (in the working precision, their dtype): ``(1 - m) running + m batch``, the variance unbiased, each
    rounded once to its running statistic's dtype (also :mod:`pynorm.dask`'s, from its reduced statistics)."""
    wp = np.result_type(mean.dtype, var.dtype)
    mw = wp.type(m)
    unbiased = var * wp.type(count) / wp.type(count - 1)
    rm = round_to((1 - mw) * running_mean.astype(wp) + mw * mean, running_mean.dtype)
    rv = round_to((1 - mw) * running_var.astype(wp) + mw * unbiased, running_var.dtype)
    return rm, rv


@_ieee
def backward(dy: np.ndarray, ctx: BatchNormCtx, *, dx_out: Any = None) -> BatchNormGrads:
    """BatchNorm backward (see the module doc): ``BatchNormGrads(dx, dweight, dbias)``."""
    x, weight, bias = ctx.x, ctx.weight, ctx.bias
    n, c, s = x.shape
    wp = np.result_type(ctx.rstd.dtype, working_dtype(x.dtype, getattr(weight, "dtype", None)))
    cols, g0 = _columns(x, wp), _columns(dy, wp)
    rstd = ctx.rstd.astype(wp)[:, None]
    d = center(cols, ctx.mean.astype(wp)) if ctx.training else cols - ctx.mean.astype(wp)[:, None]
    xhat = d * rstd
    w = _per_channel(weight, wp)
    g = g0 * w if w is not None else g0
    if ctx.training:
        k = wp.type(n * s)
        gbar = np.add.reduce(g, axis=1) / k
        dx = rstd * (g - gbar[:, None] - xhat * (np.add.reduce(g * xhat, axis=1) / k)[:, None])
    else:
        dx = rstd * g
    dx = np.ascontiguousarray(dx.reshape(c, n, s).transpose(1, 0, 2))
    dweight = round_to(np.add.reduce(g0 * xhat, axis=1), weight.dtype) if weight is not None else None
    dbias = round_to(np.add.reduce(g0, axis=1), bias.dtype) if bias is not None else None
    return BatchNormGrads(write_result(dx, x.dtype, dx_out), dweight, dbias)


class _Op(NamedTuple):
    forward: Any
    backward: Any


#: op name -> its forward/backward (read by the registry)
OP_IMPLS = {"batch_norm": _Op(forward, backward)}
