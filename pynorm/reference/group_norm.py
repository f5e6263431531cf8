r"""GroupNorm and InstanceNorm, the reference definitions (NumPy; also the ``numpy`` backend).

Both see ``x`` as ``(N, C, S)``: ``N`` samples, ``C`` channels, ``S`` spatial positions (the dispatcher moves the
channel axis to 1 and flattens the spatial dims; ``S = 1`` for ``(N, C)`` input).

GroupNorm (Wu & He 2018, "Group Normalization"), ``G = num_groups`` dividing ``C``: the statistics of each
``(sample, group)`` are over its ``C / G`` channels times ``S`` positions, and the affine is per channel:

.. math::

    \mu_{ng} = \mathrm{mean}_{c \in g, s}\, x_{ncs}, \quad
    v_{ng} = \mathrm{mean}_{c \in g, s}\, (x_{ncs} - \mu_{ng})^2, \quad
    y_{ncs} = \frac{x_{ncs} - \mu_{ng}}{\sqrt{v_{ng} + \epsilon}}\, w_c + b_c

(biased variance, eps inside the root: PyTorch's ``F.group_norm``). It is LayerNorm over the ``N G`` rows of
``C/G * S`` elements with a per-row weight -- each row's weights are its channels' ``w_c`` repeated over the
``S`` positions -- and its backward is LayerNorm's on those rows (:mod:`pynorm.reference.layer_norm`), with
:math:`\partial L / \partial w_c = \sum_{n, s} dy_{ncs} \hat x_{ncs}`, :math:`\partial L / \partial b_c =
\sum_{n, s} dy_{ncs}`.

InstanceNorm (Ulyanov et al. 2016, "Instance Normalization"): GroupNorm with ``G = C``, one statistic per sample
and channel -- with ``use_input_stats=True`` (PyTorch's default). Given running statistics, it also returns them
updated as PyTorch's ``F.instance_norm`` updates them in place: the batch means over ``N`` of each instance's mean
and of its *unbiased* variance (divisor ``S - 1``), blended with ``momentum``:
``running' = (1 - momentum) running + momentum * batch``. With ``use_input_stats=False`` every instance is
normalized by the running statistics instead (``(x - running_mean) / sqrt(running_var + eps)``), and the
backward is then element-wise: ``dx = dy w / sqrt(running_var + eps)``.

Numerics: the statistics by LayerNorm's corrected two-pass method in the working precision, each output rounded
once; the running statistics computed in the working precision and rounded once to their own dtype.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..ops.group_norm import GroupNormCtx, GroupNormGrads, InstanceNormCtx, InstanceNormGrads
from . import layer_norm as _ln
from ._common import _ieee, center, round_to, row_mean, working_dtype, write_result

__all__ = ["OP_IMPLS", "channel_rows", "group_norm_backward", "group_norm_forward"]


def channel_rows(a: np.ndarray | None, n: int, groups: int, s: int) -> np.ndarray | None:
    """A ``(C,)`` per-channel parameter as the ``(N G, C/G * S)`` rows of a grouped input see it."""
    if a is None:
        return None
    c = a.shape[0]
    per_group = np.repeat(a.reshape(groups, c // groups), s, axis=1)  # (G, C/G * S)
    return np.broadcast_to(per_group[None], (n, groups, per_group.shape[1])).reshape(n * groups, per_group.shape[1])


def _grouped(x: np.ndarray, groups: int) -> np.ndarray:
    n, c, s = x.shape
    return x.reshape(n * groups, (c // groups) * s)


def _channel_sums(a: np.ndarray, n: int, c: int) -> np.ndarray:
    """``sum_{n, s}`` of an ``(N G, C/G * S)`` array, per channel (``(C,)``)."""
    return a.reshape(n, c, a.size // (n * c) if n else 0).sum(axis=(0, 2))


def _forward(
    x: np.ndarray, weight: Any, bias: Any, groups: int, eps: float, out: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n, c, s = x.shape
    wp = working_dtype(x.dtype, getattr(weight, "dtype", None), getattr(bias, "dtype", None))
    d, mean, rstd = _ln.statistics(_grouped(x, groups).astype(wp), eps=eps, correction=0, eps_mode="var")
    xhat = d * rstd[:, None]
    w = channel_rows(None if weight is None else weight.astype(wp), n, groups, s)
    b = channel_rows(None if bias is None else bias.astype(wp), n, groups, s)
    y = _ln.affine(xhat, w, b).reshape(n, c, s)
    return write_result(y, x.dtype, out), mean, rstd


def _backward(
    dy: np.ndarray, x: np.ndarray, weight: Any, bias: Any, mean: np.ndarray, rstd: np.ndarray, groups: int
) -> tuple[np.ndarray, Any, Any]:
    n, c, s = x.shape
    wp = np.result_type(rstd.dtype, working_dtype(x.dtype, getattr(weight, "dtype", None)))
    dyw = _grouped(dy, groups).astype(wp)
    w = channel_rows(None if weight is None else weight.astype(wp), n, groups, s)
    dx, xhat = _ln.input_grad(
        dyw, _grouped(x, groups).astype(wp), mean.astype(wp), rstd.astype(wp), w, correction=0, eps_mode="var"
    )
    dweight = round_to(_channel_sums(dyw * xhat, n, c), weight.dtype) if weight is not None else None
    dbias = round_to(_channel_sums(dyw, n, c), bias.dtype) if bias is not None else None
    return dx.reshape(n, c, s), dweight, dbias


@_ieee
def group_norm_forward(
    x: np.ndarray, weight: Any, bias: Any, *, num_groups: int, eps: float, out: Any = None
) -> tuple[np.ndarray, GroupNormCtx]:
    """GroupNorm forward of the ``(N, C, S)`` array ``x`` (see the module doc)."""
    y, mean, rstd = _forward(x, weight, bias, num_groups, eps, out)
    return y, GroupNormCtx(x, weight, bias, mean, rstd, int(num_groups), float(eps))


@_ieee
def group_norm_backward(dy: np.ndarray, ctx: GroupNormCtx, *, dx_out: Any = None) -> GroupNormGrads:
    """GroupNorm backward: LayerNorm's on the ``(N G, C/G * S)`` rows, the parameter gradients per channel."""
    dx, dw, db = _backward(dy, ctx.x, ctx.weight, ctx.bias, ctx.mean, ctx.rstd, ctx.num_groups)
    return GroupNormGrads(write_result(dx, ctx.x.dtype, dx_out), dw, db)


def _running_update(
    old: np.ndarray, batch: np.ndarray, momentum: float, wp: np.dtype[Any]
) -> np.ndarray:  # fmt: skip
    return round_to((1 - wp.type(momentum)) * old.astype(wp) + wp.type(momentum) * batch, old.dtype)


@_ieee
def instance_norm_forward(
    x: np.ndarray, running_mean: Any, running_var: Any, weight: Any, bias: Any, *, use_input_stats: bool,
    momentum: float, eps: float, out: Any = None,
) -> tuple[Any, InstanceNormCtx]:  # fmt: skip
    """InstanceNorm forward of the ``(N, C, S)`` array ``x``: ``y``, or ``(y, running_mean', running_var')`` when
    running statistics are given and ``use_input_stats`` (see the module doc)."""
    n, c, s = x.shape
    if use_input_stats:
        y, mean, rstd = _forward(x, weight, bias, c, eps, out)
        ctx = InstanceNormCtx(x, weight, bias, mean, rstd, True, float(eps))
        if running_mean is None:
            return y, ctx
        wp = working_dtype(x.dtype, running_mean.dtype, running_var.dtype)
        xw = x.reshape(n * c, s).astype(wp)
        m = row_mean(xw)
        d = center(xw, m)
        unbiased = np.add.reduce(d * d, axis=1) / wp.type(s - 1)
        batch_mean = m.reshape(n, c).mean(axis=0)
        batch_var = unbiased.reshape(n, c).mean(axis=0)
        rm = _running_update(running_mean, batch_mean, momentum, wp)
        rv = _running_update(running_var, batch_var, momentum, wp)
        return (y, rm, rv), ctx
    wp = working_dtype(x.dtype, running_mean.dtype, getattr(weight, "dtype", None), getattr(bias, "dtype", None))
    rmean = np.tile(running_mean.astype(wp), n)
    rstd = 1 / np.sqrt(np.tile(running_var.astype(wp), n) + wp.type(eps))
    xhat = (x.reshape(n * c, s).astype(wp) - rmean[:, None]) * rstd[:, None]
    w = channel_rows(None if weight is None else weight.astype(wp), n, c, s)
    b = channel_rows(None if bias is None else bias.astype(wp), n, c, s)
    y = write_result(_ln.affine(xhat, w, b).reshape(n, c, s), x.dtype, out)
    ctx = InstanceNormCtx(x, weight, bias, rmean, rstd, False, float(eps))
    return y, ctx


@_ieee
def instance_norm_backward(dy: np.ndarray, ctx: InstanceNormCtx, *, dx_out: Any = None) -> InstanceNormGrads:
    """InstanceNorm backward: GroupNorm's with ``G = C``; with the running statistics, element-wise."""
    x, weight, bias = ctx.x, ctx.weight, ctx.bias
    n, c, s = x.shape
    if ctx.use_input_stats:
        dx, dw, db = _backward(dy, x, weight, bias, ctx.mean, ctx.rstd, c)
        return InstanceNormGrads(write_result(dx, x.dtype, dx_out), dw, db)
    wp = np.result_type(ctx.rstd.dtype, working_dtype(x.dtype, getattr(weight, "dtype", None)))
    dyw = dy.reshape(n * c, s).astype(wp)
    xhat = (x.reshape(n * c, s).astype(wp) - ctx.mean[:, None].astype(wp)) * ctx.rstd[:, None].astype(wp)
    w = channel_rows(None if weight is None else weight.astype(wp), n, c, s)
    dx = (dyw * w if w is not None else dyw) * ctx.rstd[:, None].astype(wp)
    dw = round_to(_channel_sums(dyw * xhat, n, c), weight.dtype) if weight is not None else None
    db = round_to(_channel_sums(dyw, n, c), bias.dtype) if bias is not None else None
    return InstanceNormGrads(write_result(dx.reshape(n, c, s), x.dtype, dx_out), dw, db)


class _Impl:
    def __init__(self, forward: Any, backward: Any) -> None:
        self.forward, self.backward = forward, backward


#: op name -> its implementation (read by :func:`pynorm._registry.op_module`)
OP_IMPLS = {
    "group_norm": _Impl(group_norm_forward, group_norm_backward),
    "instance_norm": _Impl(instance_norm_forward, instance_norm_backward),
}
