r"""Derf (Dynamic erf, "Stronger Normalization-Free Transformers", Chen, Lu, Zhu, Sun & Liu 2025, arXiv
2512.10938), the reference definition.

.. math::

    y = w\,\operatorname{erf}(\alpha x + s) + b

element by element, with :math:`\alpha` and :math:`s` learnable scalars and optional per-feature ``w`` and ``b``.
Backward, with :math:`z = \alpha x + s`, :math:`e = \operatorname{erf}'(z) = \tfrac{2}{\sqrt\pi} e^{-z^2}` and
:math:`G = w\,\partial L/\partial y`:

.. math::

    \frac{\partial L}{\partial x} = \alpha\,e\,G, \quad
    \frac{\partial L}{\partial \alpha} = \sum x\,e\,G, \quad
    \frac{\partial L}{\partial s} = \sum e\,G, \quad
    \frac{\partial L}{\partial w} = \sum_{rows} \frac{\partial L}{\partial y}\operatorname{erf} z, \quad
    \frac{\partial L}{\partial b} = \sum_{rows} \frac{\partial L}{\partial y}.

NumPy has no erf: :func:`pynorm.ops.derf.erf` evaluates it (a series of positive terms below 2.5, a continued
fraction above; 5e-19 relative in extended precision). :math:`e` has no cancellation (an exponential) and
underflows to 0 only where the true value does. Saturation: :math:`\operatorname{erf} z` is :math:`\pm 1` in
float64 from :math:`|z| \ge 5.93`, in float32 from :math:`|z| \ge 3.92`.

Numerics: the working precision of :mod:`._common`; one rounding per output.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..ops.derf import DerfCtx, DerfGrads, erf, erf_prime
from ._common import _ieee, round_to, working_dtype, write_result

__all__ = ["DerfCtx", "DerfGrads", "backward", "forward"]


def _wp(x: Any, *params: Any) -> np.dtype[Any]:
    return working_dtype(x.dtype, *(getattr(p, "dtype", None) for p in params))


def _affine(v: np.ndarray, weight: np.ndarray | None, bias: np.ndarray | None, wp: Any) -> np.ndarray:
    if weight is not None:
        v = v * weight.astype(wp)
    if bias is not None:
        v = v + bias.astype(wp)
    return v


@_ieee
def forward(
    x: np.ndarray,
    alpha: np.ndarray,
    shift: np.ndarray,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    *,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, DerfCtx]:
    """Derf forward of the ``(R, H)`` array ``x`` with the ``(1,)`` scalars ``alpha``, ``shift``; returns
    ``(y, ctx)``."""
    wp = _wp(x, alpha, shift, weight, bias)
    z = alpha.astype(wp)[0] * x.astype(wp) + shift.astype(wp)[0]
    return write_result(_affine(erf(z), weight, bias, wp), x.dtype, out), DerfCtx(x, alpha, shift, weight, bias)


@_ieee
def backward(dy: np.ndarray, ctx: DerfCtx, *, dx_out: np.ndarray | None = None) -> DerfGrads:
    """Derf backward: gradients of a scalar loss given ``dy = dL/dy`` (shape ``(R, H)``)."""
    x, alpha, shift, weight, bias = ctx.x, ctx.alpha, ctx.shift, ctx.weight, ctx.bias
    wp = _wp(x, alpha, shift, weight, bias)
    xw = x.astype(wp)
    a = alpha.astype(wp)[0]
    z = a * xw + shift.astype(wp)[0]
    dyw = dy.astype(wp)
    ge = (dyw * weight.astype(wp) if weight is not None else dyw) * erf_prime(z)
    dalpha = round_to(np.sum(ge * xw).reshape(1), alpha.dtype)
    dshift = round_to(np.sum(ge).reshape(1), shift.dtype)
    dweight = round_to(np.add.reduce(dyw * erf(z), axis=0), weight.dtype) if weight is not None else None
    dbias = round_to(np.add.reduce(dyw, axis=0), bias.dtype) if bias is not None else None
    return DerfGrads(write_result(a * ge, x.dtype, dx_out), dalpha, dshift, dweight, dbias)
