r"""DyT (Dynamic Tanh, "Transformers without Normalization", 2025), the reference definition.

.. math::

    y = w \tanh(\alpha x) + b

element by element, with :math:`\alpha` a learnable scalar (initialised to 0.5 by the paper) and
optional per-feature ``w`` and ``b``. Backward, with :math:`z = \alpha x`,
:math:`\operatorname{sech}^2 z = 1 - \tanh^2 z` and :math:`G = w\,\partial L/\partial y`:

.. math::

    \frac{\partial L}{\partial x} = \alpha\,\operatorname{sech}^2(z)\,G, \quad
    \frac{\partial L}{\partial \alpha} = \sum x\,\operatorname{sech}^2(z)\,G, \quad
    \frac{\partial L}{\partial w} = \sum_{rows} \frac{\partial L}{\partial y}\tanh z, \quad
    \frac{\partial L}{\partial b} = \sum_{rows} \frac{\partial L}{\partial y}.

Saturation stays accurate: :math:`\operatorname{sech}^2 z` is computed as
:math:`4 s / (1 + s)^2` with :math:`s = e^{-2\lvert z\rvert}`, never as :math:`1 - \tanh^2 z`, which
cancels to 0 (or to rounding noise) for :math:`\lvert z\rvert` beyond a few units while the true
value is :math:`\approx 4 e^{-2\lvert z\rvert}`; the form keeps full relative accuracy at every
:math:`z` (no subtraction) and underflows to 0 only where the true value does.

Numerics: the working precision of :mod:`._common`; one rounding per output.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..ops.dyt import DyTCtx, DyTGrads, sech2
from ._common import _ieee, round_to, working_dtype, write_result

__all__ = ["DyTCtx", "DyTGrads", "backward", "forward", "sech2"]


def _wp(x: Any, *params: Any) -> np.dtype[Any]:
    return working_dtype(x.dtype, *(getattr(p, "dtype", None) for p in params))


@_ieee
def forward(
    x: np.ndarray,
    alpha: np.ndarray,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    *,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, DyTCtx]:
    """DyT forward of the ``(R, H)`` array ``x`` with the ``(1,)`` scalar ``alpha``; returns ``(y, ctx)``."""
    wp = _wp(x, alpha, weight, bias)
    y = np.tanh(alpha.astype(wp)[0] * x.astype(wp))
    if weight is not None:
        y = y * weight.astype(wp)
    if bias is not None:
        y = y + bias.astype(wp)
    return write_result(y, x.dtype, out), DyTCtx(x, alpha, weight, bias)


@_ieee
def backward(dy: np.ndarray, ctx: DyTCtx, *, dx_out: np.ndarray | None = None) -> DyTGrads:
    """DyT backward: gradients of a scalar loss given ``dy = dL/dy`` (shape ``(R, H)``)."""
    x, alpha, weight, bias = ctx.x, ctx.alpha, ctx.weight, ctx.bias
    wp = _wp(x, alpha, weight, bias)
    xw = x.astype(wp)
    a = alpha.astype(wp)[0]
    z = a * xw
    dyw = dy.astype(wp)
    g = dyw * weight.astype(wp) if weight is not None else dyw
    gs = g * sech2(z)
    dalpha = round_to(np.sum(gs * xw).reshape(1), alpha.dtype)
    dweight = round_to(np.add.reduce(dyw * np.tanh(z), axis=0), weight.dtype) if weight is not None else None
    dbias = round_to(np.add.reduce(dyw, axis=0), bias.dtype) if bias is not None else None
    return DyTGrads(write_result(a * gs, x.dtype, dx_out), dalpha, dweight, dbias)
