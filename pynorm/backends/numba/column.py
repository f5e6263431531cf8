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
from ...ops._spec import filled
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


def _statistics(xs: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per channel of the ``(N, C, S)`` storage array ``xs``: the float64 mean pair ``(mean, corr)`` and the biased
    variance (block statistics merged in block order)."""
    n, c, s = xs.shape
    nb, g, tasks = kernels.layout(n, c, s)
    nbk = -(-n // nb)
    part = np.empty((c, nbk, 3))
    launch(kernels.col_stats_short if s < kernels.SHORT_ROW else kernels.col_stats, n * c * s, tasks, xs, nb, g, part)
    mean, corr, var = np.empty(c), np.empty(c), np.empty(c)
    launch(kernels.col_merge, c * nbk * 64, c, part, nb, n, s, mean, corr, var)
    return mean, corr, var


def _apply(xs: np.ndarray, mean: Any, corr: Any, scale: Any, b: np.ndarray | None, ys: np.ndarray, mdt: Any) -> None:
    """``y = ((x - k) - cc) scale [+ b]`` per channel (``k + cc``: the mean pair in the math type ``mdt``)."""
    n, c, s = xs.shape
    if not ys.size:
        return
    k, cc = _split(mean, corr, mdt)
    sc = np.ascontiguousarray(scale, dtype=mdt)
    if s < kernels.SHORT_ROW:
        launch(kernels.col_apply_short, n * c * s, n, xs, k, cc, sc, b, ys)
    else:
        launch(kernels.col_apply, n * c * s, n * c, xs, k, cc, sc, b, ys)


def _sums(xs: np.ndarray, dys: np.ndarray, mean: np.ndarray) -> np.ndarray:
    """``(C, 3)`` float64: per channel ``sum(dy)``, ``sum(dy xc)``, ``sum(xc)`` with ``xc = x - mean`` (block sums
    added in block order)."""
    n, c, s = xs.shape
    sums = np.zeros((c, 3))
    if xs.size:
        nb, g, tasks = kernels.layout(n, c, s)
        nbk = -(-n // nb)
        part = np.empty((c, nbk, 3))
        reduce = kernels.col_bwd_sums_short if s < kernels.SHORT_ROW else kernels.col_bwd_sums
        launch(reduce, 2 * n * c * s, tasks, xs, dys, np.ascontiguousarray(mean), np.zeros(c), nb, g, part)
        launch(kernels.col_sum_blocks, c * nbk * 64, c, part, sums)
    return sums


def _dx(xs: Any, dys: Any, mean: Any, corr: Any, a: Any, m1: Any, q: Any, dxs: np.ndarray, mdt: Any) -> None:
    """Training backward: ``dx = a ((dy - m1) - ((x - k) - cc) q)`` per channel, in the math type ``mdt``."""
    n, c, s = xs.shape
    k, cc = _split(mean, corr, mdt)
    short = s < kernels.SHORT_ROW
    launch(kernels.col_dx_short if short else kernels.col_dx, 3 * n * c * s, n if short else n * c, xs, dys, k, cc,
           a.astype(mdt), m1.astype(mdt), q.astype(mdt), dxs)  # fmt: skip


def _overflowed(x: np.ndarray, values: np.ndarray | tuple[np.ndarray, ...]) -> np.ndarray:
    """The channels of a float64 ``x`` whose float64 ``values`` (``(C, k)``, or a tuple of ``(C,)`` columns: the
    statistics, or the sums with the centred values) are not all finite though every value of the channel is: the
    sums overflowed (``|x|`` near 1e154 and beyond; the kernels keep a NaN or inf of an overflowed sum, never clamp
    it). Empty for other dtypes (their squares cannot overflow float64) and in the common case, at the cost of one
    test of ``values``."""
    if x.dtype != np.float64:
        return np.zeros(0, np.intp)
    if isinstance(values, tuple):  # (stacked only for a float64 x: a small call's microseconds)
        values = np.stack(values, axis=1)
    if np.isfinite(values).all():
        return np.zeros(0, np.intp)
    bad = np.flatnonzero(~np.isfinite(values).all(axis=1))
    return bad[np.isfinite(x[:, bad, :]).all(axis=(0, 2))]


def _scaled(x: np.ndarray, chans: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The channels ``chans`` of a float64 ``x`` divided by ``2^e`` (per channel, ``e`` the exponent of its largest
    magnitude: scaled values below 1 in magnitude, their squares' sums finite), and ``e``. Exact but for values
    more than ~2^-1022 below the channel's largest, which only lose bits far below the channel's spread."""
    sub = x[:, chans, :]
    _, e = np.frexp(np.abs(sub).max(axis=(0, 2)))
    return np.ascontiguousarray(np.ldexp(sub, -e[None, :, None])), e


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
        w = None if weight is None else np.asarray(weight, np.float64)
        b = None if bias is None else np.ascontiguousarray(bias, dtype=mdt)
        if training:
            mean, corr, var = _statistics(xs)
        else:
            mean, corr = np.asarray(rm, np.float64), np.zeros(c)
            var = np.asarray(rv, np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            rstd = 1.0 / np.sqrt(var + eps)
        _apply(xs, mean, corr, rstd if w is None else rstd * w, b, common.storage(y), mdt)
        if training:
            redo = _overflowed(x, (mean, corr, var))
            if redo.size:  # float64 channels whose float64 sums of squares overflowed: again, scaled (see _scaled)
                xr, e = _scaled(x, redo)
                m_s, c_s, v_s = _statistics(xr)
                r_s = 1.0 / np.sqrt(v_s + np.ldexp(eps, -2 * e))
                yr = np.empty_like(xr)
                _apply(xr, m_s, c_s, r_s if w is None else r_s * w[redo], None if b is None else b[redo], yr, mdt)
                y[:, redo, :] = yr
                mean[redo], corr[redo] = np.ldexp(m_s, e), np.ldexp(c_s, e)
                with np.errstate(over="ignore"):  # the variance itself may be beyond float64 (as the reference's)
                    var[redo], rstd[redo] = np.ldexp(v_s, 2 * e), np.ldexp(r_s, -e)
        full = mean + corr if training else mean.copy()
        values = {**o, "x": x, **dict(zip(self.spec.param_names, (weight, bias), strict=True))}
        values.update(zip(self.statistic.fills, (full, rstd), strict=True))
        ctx = filled(self.spec.ctx, {f: values[f] for f in self._fields})
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
        sums = _sums(xs, dys, mean) if want and x.size else np.zeros((c, 3))
        sdy, sdyxc, sxc = sums[:, 0], sums[:, 1], sums[:, 2]
        a = rstd * w
        dxs = common.storage(dx)
        with np.errstate(over="ignore", invalid="ignore"):  # (overflowed sums: those channels are redone below)
            corr = sxc / count if training else np.zeros(c)
            sdyxhat = (sdyxc - corr * sdy) * rstd
            if x.size:
                if training:
                    _dx(xs, dys, mean, corr, a, sdy / count, rstd * sdyxhat / count, dxs, mdt)
                else:
                    launch(kernels.col_scale, 2 * n * c * s, n * c, dys, a.astype(mdt), dxs)
        redo = _overflowed(x, sums[:, 1:]) if want else np.zeros(0, np.intp)
        if redo.size:  # float64 channels whose float64 sum(dy xc) overflowed: again, scaled (see _scaled)
            xr, e = _scaled(x, redo)
            dyr = np.ascontiguousarray(dys[:, redo, :])
            m_s, r_s = np.ldexp(mean[redo], -e), np.ldexp(rstd[redo], e)
            sr = _sums(xr, dyr, m_s)
            c_s = sr[:, 2] / count if training else np.zeros(redo.size)
            sdyxhat[redo] = (sr[:, 1] - c_s * sr[:, 0]) * r_s
            if training:
                dxr = np.empty_like(xr)
                _dx(xr, dyr, m_s, c_s, a[redo], sr[:, 0] / count, r_s * sdyxhat[redo] / count, dxr, mdt)
                dx[:, redo, :] = dxr
        dweight = None if weight is None else round_to(sdyxhat, weight.dtype)
        dbias = None if bias is None else round_to(sdy, bias.dtype)
        return self.spec.grads(dx, dweight, dbias)


def _serves(spec: OpSpec) -> bool:
    from . import OPS

    return OPS.get(spec.name) == __name__.rpartition(".")[2]


#: op name -> its implementation (read by :func:`pynorm._registry.op_module`)
OP_IMPLS: Served[ColumnOp] = Served(_serves, ColumnOp)
