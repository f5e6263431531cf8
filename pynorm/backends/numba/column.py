"""The column-statistics family on the ``numba`` backend: every op of :data:`pynorm.ops.SPECS` whose family is
``"column"`` (BatchNorm).

:data:`OP_IMPLS` maps each such op to a :class:`ColumnOp`: ``forward(x3, running_mean, running_var, weight, bias,
out=None, **options) -> (y or (y, running_mean', running_var'), ctx)`` and ``backward(dy3, ctx, dx_out=None) ->
(dx, dweight, dbias)`` on ``(N, C, S)`` arrays, with the reference module's contract
(:mod:`pynorm.reference.batch_norm`; ``spec.ctx``, ``spec.grads``).

Forward, training: block statistics (:func:`._column_kernels.col_stats`, blocks of a fixed number of samples of
one channel), merged per channel in block order (:func:`._column_kernels.col_merge`), then the element-wise pass
(:func:`._column_kernels.col_apply`); evaluation: the element-wise pass from the running statistics. The running
statistics' update is ``(C,)`` host arithmetic in float64 (the unbiased variance), rounded once. The ctx holds the
float64 per-channel ``mean`` and ``rstd``.

Backward, training: block sums of ``dy``, ``dy xc`` and ``xc`` (:func:`._column_kernels.col_bwd_sums`; the last
corrects the stored mean's rounding, as the reference's re-centring does), added in block order, then the
element-wise ``dx`` pass; evaluation: ``dx = dy w / sqrt(v + eps)`` and the same column sums for the parameters'
gradients. Every reduction's order is fixed by the shape: results are bitwise identical across thread counts.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import numpy as np

from ..._dtypes import round_to
from ...ops import OpSpec, Served
from ...ops.families import column_args, column_statistic_of
from . import _column_kernels as kernels
from . import _common as common
from ._threads import launch

__all__ = ["OP_IMPLS", "ColumnOp"]


def _momentum(momentum: float | None, tracked: int) -> float:
    return 1.0 / (tracked + 1) if momentum is None else float(momentum)


def _split(mean: np.ndarray, corr: np.ndarray, mdt: np.dtype[Any]) -> tuple[np.ndarray, np.ndarray]:
    """The centring ``(k, cc)`` in the math type of a float64 mean pair ``mean + corr``: ``k`` rounded, ``cc``
    what it misses."""
    k = mean.astype(mdt)
    return np.ascontiguousarray(k), np.ascontiguousarray(((mean - k.astype(np.float64)) + corr).astype(mdt))


class ColumnOp:
    """One op of the column-statistics family on this backend (see the module doc)."""

    def __init__(self, spec: OpSpec) -> None:
        self.spec = spec
        self.name = spec.name
        self.statistic = column_statistic_of(spec)
        self._fields = tuple(f.name for f in fields(spec.ctx))
        self._options = spec.defaults()

    def __repr__(self) -> str:
        return f"<numba column op {self.name!r} (variant {self.spec.variant})>"

    def forward(self, x: np.ndarray, *args: Any, out: np.ndarray | None = None, **options: Any) -> tuple[Any, Any]:
        """Forward of the ``(N, C, S)`` array ``x``, then the running mean and variance (or None) and the weight
        and bias (or None); see the module doc."""
        if len(args) != 4:
            raise TypeError(f"{self.name} forward() takes x, running_mean, running_var, weight and bias")
        unknown = set(options) - set(self._options)
        if unknown:
            raise TypeError(f"{self.name} forward() got unexpected keyword argument(s) {sorted(unknown)}")
        o = {**self._options, **options}
        rm, rv, weight, bias = args
        ka = column_args(self.spec, o)
        training, eps = bool(ka.training), float(ka.eps)
        n, c, s = x.shape
        mdt = common.math_dtype(x.dtype)
        xs = common.storage(x)
        y = common.output(out, x.shape, x.dtype)
        if training:
            nb, g, tasks = kernels.layout(n, c, s)
            nbk = -(-n // nb)
            part = np.empty((c, nbk, 3))
            stats = kernels.col_stats_short if s < kernels.SHORT_ROW else kernels.col_stats
            launch(stats, n * c * s, tasks, xs, nb, g, part)
            mean, corr, var = np.empty(c), np.empty(c), np.empty(c)
            launch(kernels.col_merge, c * nbk * 64, c, part, nb, n, s, mean, corr, var)
        else:
            mean, corr = np.asarray(rm, np.float64), np.zeros(c)
            var = np.asarray(rv, np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            rstd = 1.0 / np.sqrt(var + eps)
        w = None if weight is None else np.asarray(weight, np.float64)
        scale = rstd if w is None else rstd * w
        k, cc = _split(mean, corr, mdt)
        b = None if bias is None else np.ascontiguousarray(bias, dtype=mdt)
        if y.size:
            if s < kernels.SHORT_ROW:
                launch(kernels.col_apply_short, n * c * s, n, xs, k, cc, np.ascontiguousarray(scale, dtype=mdt), b,
                       common.storage(y))  # fmt: skip
            else:
                launch(kernels.col_apply, n * c * s, n * c, xs, k, cc, np.ascontiguousarray(scale, dtype=mdt), b,
                       common.storage(y))  # fmt: skip
        full = mean + corr if training else mean.copy()
        values = {**o, "x": x, **dict(zip(self.spec.param_names, (weight, bias), strict=True))}
        values.update(zip(self.statistic.fills, (full, rstd), strict=True))
        ctx = self.spec.ctx(**{f: values[f] for f in self._fields})
        if not training or rm is None:
            return y, ctx
        m = _momentum(ka.momentum, int(ka.num_batches_tracked))
        count = n * s
        unbiased = var * (count / (count - 1))
        new_rm = round_to((1 - m) * np.asarray(rm, np.float64) + m * full, rm.dtype)
        new_rv = round_to((1 - m) * np.asarray(rv, np.float64) + m * unbiased, rv.dtype)
        return (y, new_rm, new_rv), ctx

    def backward(self, dy: np.ndarray, ctx: Any, dx_out: np.ndarray | None = None) -> Any:
        """Backward: ``(dx, dweight, dbias)`` of a scalar loss given ``dy = dL/dy`` (``(N, C, S)``)."""
        x = ctx.x
        weight, bias = (getattr(ctx, p) for p in self.spec.param_names)
        n, c, s = x.shape
        mdt = common.math_dtype(x.dtype)
        xs, dys = common.storage(x), common.storage(dy)
        dx = common.output(dx_out, x.shape, x.dtype)
        mean, rstd = (np.asarray(getattr(ctx, f), np.float64) for f in self.statistic.fills)
        w = np.ones(c) if weight is None else np.asarray(weight, np.float64)
        training = bool(column_args(self.spec, ctx).training)
        count = n * s
        want = training or weight is not None or bias is not None
        sums = np.zeros((c, 3))
        if want and x.size:
            nb, g, tasks = kernels.layout(n, c, s)
            nbk = -(-n // nb)
            part = np.empty((c, nbk, 3))
            reduce = kernels.col_bwd_sums_short if s < kernels.SHORT_ROW else kernels.col_bwd_sums
            launch(reduce, 2 * n * c * s, tasks, xs, dys, mean, np.zeros(c), nb, g, part)
            launch(kernels.col_sum_blocks, c * nbk * 64, c, part, sums)
        sdy, sdyxc, sxc = sums[:, 0], sums[:, 1], sums[:, 2]
        corr = sxc / count if training else np.zeros(c)
        sdyxhat = (sdyxc - corr * sdy) * rstd
        a = rstd * w
        dxs = common.storage(dx)
        if x.size:
            if training:
                k, cc = _split(mean, corr, mdt)
                short = s < kernels.SHORT_ROW
                launch(kernels.col_dx_short if short else kernels.col_dx, 3 * n * c * s, n if short else n * c, xs,
                       dys, k, cc, a.astype(mdt), (sdy / count).astype(mdt), (rstd * sdyxhat / count).astype(mdt),
                       dxs)  # fmt: skip
            else:
                launch(kernels.col_scale, 2 * n * c * s, n * c, dys, a.astype(mdt), dxs)
        dweight = None if weight is None else round_to(sdyxhat, weight.dtype)
        dbias = None if bias is None else round_to(sdy, bias.dtype)
        return self.spec.grads(dx, dweight, dbias)


def _serves(spec: OpSpec) -> bool:
    from . import OPS

    return OPS.get(spec.name) == __name__.rpartition(".")[2]


#: op name -> its implementation (read by :func:`pynorm._registry.op_module`)
OP_IMPLS: Served[ColumnOp] = Served(_serves, ColumnOp)
