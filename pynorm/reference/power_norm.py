r"""The signed-power "PowerNorm", the reference definition: an element-wise signed power.

.. math::

    y = w \cdot \operatorname{sign}(x)\,\lvert x\rvert^{p} + b

element by element (``axis`` only fixes the shape of the per-feature ``w`` and ``b``), with
``p > 0`` a hyperparameter (default 0.5). This is *not* the PowerNorm of Shen et al. (2020),
a batch normalization without mean subtraction that divides by a running quadratic mean of
each channel; see ``docs/norms/power_norm.md``.

Backward, with :math:`\partial L/\partial y` the upstream gradient:

* :math:`\partial L/\partial x = w\,p\,\lvert x\rvert^{p-1}\,\partial L/\partial y` for
  :math:`x \ne 0`. At :math:`x = 0` the derivative is :math:`+\infty` for :math:`p < 1`; the value
  **0** is used there (a subgradient choice: the one-sided limits are infinite); for
  :math:`p = 1` it is ``w dy``, for :math:`p > 1` it is 0. Where the exact value exceeds the
  largest finite value of ``x``'s dtype (tiny ``|x|`` with ``p < 1``), ``dx`` **saturates** at
  that value (keeping its sign) instead of overflowing: a finite input never gives an infinite
  or NaN gradient.
* :math:`\partial L/\partial w = \sum_{rows} \partial L/\partial y\,\operatorname{sign}(x)\lvert x\rvert^p`,
  :math:`\partial L/\partial b = \sum_{rows} \partial L/\partial y`.

Numerics: the working precision of :mod:`._common`; one rounding per output.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .._dtypes import finfo
from ..ops.power_norm import PowerNormCtx, PowerNormGrads
from ._common import _ieee, round_to, working_dtype, write_result

__all__ = ["PowerNormCtx", "PowerNormGrads", "backward", "forward", "saturate"]


def saturate(v: np.ndarray, dtype: Any) -> np.ndarray:
    """``v`` clipped to the finite range of ``dtype`` (NaN stays NaN)."""

    big = float(finfo(dtype).max)
    return np.clip(v, -big, big)


def _signed_power(xw: np.ndarray, p: float) -> np.ndarray:
    return np.sign(xw) * np.abs(xw) ** xw.dtype.type(p)


@_ieee
def forward(
    x: np.ndarray,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    *,
    p: float = 0.5,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, PowerNormCtx]:
    """PowerNorm forward of the ``(R, H)`` array ``x``; returns ``(y, ctx)``."""
    wp = working_dtype(x.dtype, getattr(weight, "dtype", None), getattr(bias, "dtype", None))
    y = _signed_power(x.astype(wp), p)
    if weight is not None:
        y = y * weight.astype(wp)
    if bias is not None:
        y = y + bias.astype(wp)
    return write_result(y, x.dtype, out), PowerNormCtx(x, weight, bias, float(p))


@_ieee
def backward(dy: np.ndarray, ctx: PowerNormCtx, *, dx_out: np.ndarray | None = None) -> PowerNormGrads:
    """PowerNorm backward: gradients of a scalar loss given ``dy = dL/dy`` (shape ``(R, H)``)."""
    x, weight, bias, p = ctx.x, ctx.weight, ctx.bias, ctx.p
    wp = working_dtype(x.dtype, getattr(weight, "dtype", None), getattr(bias, "dtype", None))
    xw = x.astype(wp)
    dyw = dy.astype(wp)
    a = np.abs(xw)
    deriv = np.where(a == 0, wp.type(1.0 if p == 1 else 0.0), wp.type(p) * a ** wp.type(p - 1))
    g = dyw * weight.astype(wp) if weight is not None else dyw
    dx = saturate(g * deriv, x.dtype)
    dweight = round_to(np.add.reduce(dyw * _signed_power(xw, p), axis=0), weight.dtype) if weight is not None else None
    dbias = round_to(np.add.reduce(dyw, axis=0), bias.dtype) if bias is not None else None
    return PowerNormGrads(write_result(dx, x.dtype, dx_out), dweight, dbias)
