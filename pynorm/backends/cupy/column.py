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

    def _stats(self, x: cupy.ndarray, t: str, a: str) -> tuple[Any, Any, Any]:
        """Per channel of ``(N, C, S)`` ``x``: the float64 mean pair ``(mean, corr)`` and the biased variance."""
        n, c, s = (int(d) for d in x.shape)
        values = n * s
        nch = chunks(values)
        part = cupy.empty((c, nch, 3), dtype=cupy.float64)
        mean, corr, var = (cupy.empty(c, dtype=cupy.float64) for _ in range(3))
        if values:
            _host.launch(self._kernel("col_stats", t, a), (nch, c), _THREADS,
                         (x, np.int64(c), np.int64(s), np.int64(values), np.int32(nch), part))  # fmt: skip
            _host.launch(self._kernel("col_merge", t, a), -(-c // _THREADS), _THREADS,
                         (part, np.int32(c), np.int32(nch), np.int64(values), mean, corr, var))  # fmt: skip
        return mean, corr, var

    def _apply(self, x: Any, y: Any, mean: Any, corr: Any, scale: Any, b: Any, t: str, a: str, adt: Any) -> None:
        """``y = ((x - k) - cc) scale [+ b]`` per channel (``k + cc``: the mean pair in the math type ``adt``)."""
        n, c, s = (int(d) for d in x.shape)
        total = n * c * s
        if total:
            k, cc = _centring(mean, corr, adt)
            _host.launch(self._kernel("col_apply", t, a), _apply_grid(total), _THREADS,
                         (x, y, k, cc, _host.cast(scale, adt), _host.ptr_or_null(b), np.int64(total), np.int64(c),
                          np.int64(s)))  # fmt: skip

    def _sums(self, x: Any, dy: Any, mean: Any, t: str, a: str) -> Any:
        """``(C, 3)`` float64: per channel ``sum(dy)``, ``sum(dy xc)``, ``sum(xc)``, ``xc = x - mean``."""
        n, c, s = (int(d) for d in x.shape)
        values = n * s
        sums = cupy.zeros((c, 3), dtype=cupy.float64)
        if values:
            nch = chunks(values)
            part = cupy.empty((c, nch, 3), dtype=cupy.float64)
            _host.launch(self._kernel("col_bwd_sums", t, a), (nch, c), _THREADS,
                         (x, dy, mean, np.int64(c), np.int64(s), np.int64(values), np.int32(nch), part))  # fmt: skip
            _host.launch(self._kernel("col_sum_chunks", t, a), -(-c // _THREADS), _THREADS,
                         (part, np.int32(c), np.int32(nch), sums))  # fmt: skip
        return sums

    def _dx(self, x: Any, dy: Any, dx: Any, mean: Any, corr: Any, coef: Any, m1: Any, q: Any, t: str, a: str,
            adt: Any) -> None:  # fmt: skip
        """Training backward: ``dx = coef ((dy - m1) - ((x - k) - cc) q)`` per channel, in ``adt``."""
        n, c, s = (int(d) for d in x.shape)
        total = n * c * s
        if total:
            k, cc = _centring(mean, corr, adt)
            shape = (np.int64(total), np.int64(c), np.int64(s))
            _host.launch(self._kernel("col_dx", t, a), _apply_grid(total), _THREADS,
                         (x, dy, dx, k, cc, *(_host.cast(v, adt) for v in (coef, m1, q)), *shape))  # fmt: skip

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
        values = n * s
        if training:
            mean, corr, var = self._stats(x, t, a)
        else:
            mean, corr, var = _host.cast(rm, "float64"), cupy.zeros(c, dtype=cupy.float64), _host.cast(rv, "float64")
        rstd = 1.0 / cupy.sqrt(var + eps)
        w = None if weight is None else _host.cast(weight, "float64")
        b = None if bias is None else _host.cast(bias, adt)
        self._apply(x, y, mean, corr, rstd if w is None else rstd * w, b, t, a, adt)
        redo = _overflowed(x, cupy.stack((mean, corr, var), axis=1)) if training else None
        if redo is not None:  # float64 channels whose float64 sums of squares overflowed: again, scaled
            xr, e = _scaled(x, redo)
            m_s, c_s, v_s = self._stats(xr, t, a)
            r_s = 1.0 / cupy.sqrt(v_s + cupy.ldexp(cupy.float64(eps), -2 * e))
            yr = cupy.empty_like(xr)
            self._apply(xr, yr, m_s, c_s, r_s if w is None else r_s * w[redo], None if b is None else b[redo], t, a,
                        adt)  # fmt: skip
            y[:, redo, :] = yr
            mean[redo], corr[redo] = cupy.ldexp(m_s, e), cupy.ldexp(c_s, e)
            var[redo], rstd[redo] = cupy.ldexp(v_s, 2 * e), cupy.ldexp(r_s, -e)
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
        want = training or weight is not None or bias is not None
        sums = self._sums(x, dy, mean, t, a) if want else cupy.zeros((c, 3), dtype=cupy.float64)
        sdy, sdyxc, sxc = sums[:, 0], sums[:, 1], sums[:, 2]
        corr = sxc / max(values, 1) if training else cupy.zeros(c, dtype=cupy.float64)
        sdyxhat = (sdyxc - corr * sdy) * rstd
        coef = rstd if weight is None else rstd * _host.cast(weight, "float64")
        if total and training:
            self._dx(x, dy, dx, mean, corr, coef, sdy / values, rstd * sdyxhat / values, t, a, adt)
        elif total:
            _host.launch(self._kernel("col_scale", t, a), _apply_grid(total), _THREADS,
                         (dy, dx, _host.cast(coef, adt), np.int64(total), np.int64(c), np.int64(s)))  # fmt: skip
        redo = _overflowed(x, sums[:, 1:]) if want else None
        if redo is not None:  # float64 channels whose float64 sum(dy xc) overflowed: again, scaled
            xr, e = _scaled(x, redo)
            dyr = cupy.ascontiguousarray(dy[:, redo, :])
            m_s, r_s = cupy.ldexp(mean[redo], -e), cupy.ldexp(rstd[redo], e)
            sr = self._sums(xr, dyr, m_s, t, a)
            c_s = sr[:, 2] / values if training else cupy.zeros(int(redo.size), dtype=cupy.float64)
            sdyxhat[redo] = (sr[:, 1] - c_s * sr[:, 0]) * r_s
            if training:
                dxr = cupy.empty_like(xr)
                self._dx(xr, dyr, dxr, m_s, c_s, coef[redo], sr[:, 0] / values, r_s * sdyxhat[redo] / values, t, a,
                         adt)  # fmt: skip
                dx[:, redo, :] = dxr
        dweight = None if weight is None else _host.cast(sdyxhat, weight.dtype)
        dbias = None if bias is None else _host.cast(sdy, bias.dtype)
        return self.spec.grads(dx, dweight, dbias)


def _centring(mean: Any, corr: Any, adt: Any) -> tuple[Any, Any]:
    """The float64 mean pair ``mean + corr`` as ``(k, cc)`` in the math type: ``k`` rounded, ``cc`` what it misses.
    Converted by pynorm's cast kernel, not ``astype``: CuPy compiles its own kernels with ``-ftz=true``, which
    flushes float32 subnormals (a float32 scale of ~1e-38 became 0 and y = b: the first H200 run's oracle)."""
    k = _host.cast(mean, adt)
    return k, _host.cast((mean - _host.cast(k, "float64")) + corr, adt)


def _overflowed(x: cupy.ndarray, values: cupy.ndarray) -> Any:
    """The channels (an index array, or None) of a float64 ``x`` whose float64 ``values`` (``(C, k)``: the
    statistics, or the sums with the centred values) are not all finite though every value of the channel is: the
    sums overflowed (``|x|`` near 1e154 and beyond; the kernels keep the NaN or inf of an overflowed sum). None for
    other dtypes (their squares cannot overflow float64); for float64 ``x``, one test of ``values`` on the host."""
    if x.dtype != np.float64:
        return None
    bad = ~cupy.isfinite(values).all(axis=1)
    if not bool(bad.any()):
        return None
    chans = cupy.flatnonzero(bad)
    chans = chans[cupy.isfinite(x[:, chans, :]).all(axis=(0, 2))]
    return chans if int(chans.size) else None


def _scaled(x: cupy.ndarray, chans: Any) -> tuple[cupy.ndarray, Any]:
    """The channels ``chans`` of a float64 ``x`` divided by ``2^e`` per channel (``e`` the exponent of its largest
    magnitude: the sums of squares of the scaled values are finite), and ``e`` (exact but for values ~2^-1022
    below the channel's largest, far below its spread)."""
    sub = x[:, chans, :]
    _, e = cupy.frexp(cupy.abs(sub).max(axis=(0, 2)))
    return cupy.ascontiguousarray(cupy.ldexp(sub, -e[None, :, None])), e


#: op name -> its implementation, for every op of the column family
OP_IMPLS: Served[ColumnOp] = Served(lambda spec: spec.family == "column" and supports(spec), ColumnOp)
