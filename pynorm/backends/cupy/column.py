"""The column-statistics family on the GPU (BatchNorm): host launchers of ``kernels/column.cu``.

:data:`OP_IMPLS` maps each op of :data:`pynorm.ops.SPECS` whose family is ``"column"`` to a :class:`ColumnOp`:
``forward(x3, running_mean, running_var, weight, bias, out=None, **options)`` and ``backward(dy3, ctx,
dx_out=None) -> (dx, dweight, dbias)`` on ``(N, C, S)`` CuPy arrays, with the reference module's contract
(:mod:`pynorm.reference.batch_norm`; the spec's ctx dataclass and gradient tuple).

Forward, training: ``col_stats`` (a fixed grid of chunks of each channel's values, two-pass statistics in double),
``col_merge`` (the chunks merged in order by Chan's formula, the mean as a (high, low) pair), then ``col_apply``;
evaluation: ``col_apply`` from the running statistics. The ``(C,)`` coefficients and the running statistics'
update are CuPy array arithmetic in float64, each result rounded once. Backward: ``col_bwd_sums`` and
``col_sum_chunks`` (``sum dy``, ``sum dy xc``, ``sum xc`` per channel, chunks in order; the last corrects the stored
mean's rounding, as the reference's re-centring does), then ``col_dx`` (training) or ``col_scale`` (evaluation).
No atomics: bitwise reproducible. The element-wise math type is float, or double when ``x`` or one of the ``(C,)``
arrays is float64 (:func:`._launch.type_plan`).
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import cupy
import numpy as np

from ...errors import ShapeError
from ...ops import OpSpec, Served
from ...ops.families import column_args, column_statistic_of
from . import _host, _launch
from ._loader import FAMILY_FILES, get_kernel, supports

__all__ = ["OP_IMPLS", "ColumnOp"]

_FILE = FAMILY_FILES["column"]
_THREADS = _launch.DEFS["COLUMN_THREADS"]
_CHUNK = _launch.DEFS["COLUMN_CHUNK"]


def chunks(values: int) -> int:
    """Chunks of each channel's ``values`` values in the reductions (a function of the shape only)."""
    return -(-values // _CHUNK)


def _apply_grid(total: int) -> int:
    """Blocks of the element-wise grid-stride kernels (any count gives the same results)."""
    return max(1, min(-(-total // _THREADS), _host.device_limits().sm_count * 16))


def _momentum(momentum: float | None, tracked: int) -> float:
    return 1.0 / (tracked + 1) if momentum is None else float(momentum)


class ColumnOp:
    """One op of the column-statistics family on the GPU (see the module doc)."""

    def __init__(self, spec: OpSpec) -> None:
        self.spec = spec
        self.statistic = column_statistic_of(spec)
        self._fields = tuple(f.name for f in fields(spec.ctx))

    def _kernel(self, name: str, t: str, a: str) -> Any:
        return get_kernel(_FILE, name, (t, a))

    def _math(self, x: Any, *arrays: Any) -> tuple[str, str, Any]:
        plan = _launch.type_plan(x.dtype, extra=tuple(a.dtype for a in arrays if a is not None))
        return plan.T, plan.acc, np.dtype(plan.acc_dtype)

    def forward(self, x: cupy.ndarray, *args: Any, out: cupy.ndarray | None = None, **options: Any) -> Any:
        """Forward of the ``(N, C, S)`` array ``x`` (then the running mean and variance, the weight and the bias,
        each None or ``(C,)``); see the module doc."""
        rm, rv, weight, bias = args
        ka = column_args(self.spec, {**self.spec.defaults(), **options})
        training, eps = bool(ka.training), float(ka.eps)
        x = _host.contiguous(x)
        n, c, s = (int(d) for d in x.shape)
        if c > 65535:
            raise ShapeError(f"the cupy backend's BatchNorm takes at most 65535 channels, got {c}")
        t, a, adt = self._math(x, rm, rv, weight, bias)
        y = out if out is not None else _host.empty((n, c, s), x.dtype)
        values, total = n * s, n * c * s
        if training:
            nch = chunks(values)
            part = cupy.empty((c, nch, 3), dtype=cupy.float64)
            mean, corr, var = (cupy.empty(c, dtype=cupy.float64) for _ in range(3))
            if values:
                _host.launch(self._kernel("col_stats", t, a), (nch, c), _THREADS,
                             (x, np.int64(c), np.int64(s), np.int64(values), np.int32(nch), part))  # fmt: skip
                _host.launch(self._kernel("col_merge", t, a), -(-c // _THREADS), _THREADS,
                             (part, np.int32(c), np.int32(nch), np.int64(values), mean, corr, var))  # fmt: skip
        else:
            mean, corr, var = _host.cast(rm, "float64"), cupy.zeros(c, dtype=cupy.float64), _host.cast(rv, "float64")
        rstd = 1.0 / cupy.sqrt(var + eps)
        scale = rstd if weight is None else rstd * _host.cast(weight, "float64")
        k = mean.astype(adt)
        cc = ((mean - k.astype(cupy.float64)) + corr).astype(adt)
        b = None if bias is None else _host.cast(bias, adt)
        if total:
            _host.launch(self._kernel("col_apply", t, a), _apply_grid(total), _THREADS,
                         (x, y, k, cc, scale.astype(adt), _host.ptr_or_null(b), np.int64(total), np.int64(c),
                          np.int64(s)))  # fmt: skip
        full = mean + corr if training else mean
        values_ = {**options, "x": x, **dict(zip(self.spec.param_names, (weight, bias), strict=True))}
        values_.update(zip(self.statistic.fills, (full, rstd), strict=True))
        values_.update(ka._asdict())
        ctx = self.spec.ctx(**{f: values_[f] for f in self._fields})
        if not training or rm is None:
            return y, ctx
        m = _momentum(ka.momentum, int(ka.num_batches_tracked))
        unbiased = var * (values / (values - 1))
        new_rm = _host.cast((1 - m) * _host.cast(rm, "float64") + m * full, rm.dtype)
        new_rv = _host.cast((1 - m) * _host.cast(rv, "float64") + m * unbiased, rv.dtype)
        return (y, new_rm, new_rv), ctx

    def backward(self, dy: cupy.ndarray, ctx: Any, *, dx_out: cupy.ndarray | None = None) -> Any:
        """Backward: ``(dx, dweight, dbias)`` given ``dy = dL/dy`` (``(N, C, S)``)."""
        x = ctx.x
        weight, bias = (getattr(ctx, p) for p in self.spec.param_names)
        mean, rstd = (getattr(ctx, f) for f in self.statistic.fills)
        dy = _host.contiguous(dy)
        n, c, s = (int(d) for d in x.shape)
        t, a, adt = self._math(x, weight, bias, mean)
        training = bool(column_args(self.spec, ctx).training)
        values, total = n * s, n * c * s
        dx = dx_out if dx_out is not None else _host.empty((n, c, s), x.dtype)
        sums = cupy.zeros((c, 3), dtype=cupy.float64)
        if (training or weight is not None or bias is not None) and values:
            nch = chunks(values)
            part = cupy.empty((c, nch, 3), dtype=cupy.float64)
            _host.launch(self._kernel("col_bwd_sums", t, a), (nch, c), _THREADS,
                         (x, dy, mean, np.int64(c), np.int64(s), np.int64(values), np.int32(nch), part))  # fmt: skip
            _host.launch(self._kernel("col_sum_chunks", t, a), -(-c // _THREADS), _THREADS,
                         (part, np.int32(c), np.int32(nch), sums))  # fmt: skip
        sdy, sdyxc, sxc = sums[:, 0], sums[:, 1], sums[:, 2]
        corr = sxc / max(values, 1) if training else cupy.zeros(c, dtype=cupy.float64)
        sdyxhat = (sdyxc - corr * sdy) * rstd
        coef = rstd if weight is None else rstd * _host.cast(weight, "float64")
        if total and training:
            k = mean.astype(adt)
            cc = ((mean - k.astype(cupy.float64)) + corr).astype(adt)
            m1, q = (sdy / values).astype(adt), (rstd * sdyxhat / values).astype(adt)
            shape = (np.int64(total), np.int64(c), np.int64(s))
            _host.launch(self._kernel("col_dx", t, a), _apply_grid(total), _THREADS,
                         (x, dy, dx, k, cc, coef.astype(adt), m1, q, *shape))  # fmt: skip
        elif total:
            _host.launch(self._kernel("col_scale", t, a), _apply_grid(total), _THREADS,
                         (dy, dx, coef.astype(adt), np.int64(total), np.int64(c), np.int64(s)))  # fmt: skip
        dweight = None if weight is None else _host.cast(sdyxhat, weight.dtype)
        dbias = None if bias is None else _host.cast(sdy, bias.dtype)
        return self.spec.grads(dx, dweight, dbias)


#: op name -> its implementation, for every op of the column family
OP_IMPLS: Served[ColumnOp] = Served(lambda spec: spec.family == "column" and supports(spec), ColumnOp)
