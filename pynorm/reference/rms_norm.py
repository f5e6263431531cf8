r"""RMSNorm, the reference definition (NumPy; also the ``numpy`` backend).

Forward, for each row :math:`x \in \mathbb{R}^H` of the ``(R, H)`` input:

.. math::

    r = \Big(\frac{1}{H}\sum_i x_i^2 + \epsilon\Big)^{-1/2}, \qquad
    \hat x_i = x_i\, r, \qquad y_i = \hat x_i\,(w_i + o)

with ``o = weight_offset`` (1.0 gives Gemma's ``(1 + w)``, computed in the
working precision). eps sits inside the root, as in every implementation in
``conventions.md``.

Backward, with :math:`g_i = \partial L/\partial y_i \cdot (w_i + o)`:

.. math::

    \frac{\partial L}{\partial x_i} = r\Big(g_i - \hat x_i\,\frac{1}{H}\sum_j g_j \hat x_j\Big),
    \qquad \frac{\partial L}{\partial w_i} = \sum_{rows} \frac{\partial L}{\partial y_i}\,\hat x_i .

Numerics: working precision of :mod:`._common`, one rounding per output
(``casting="fp32"``; the other rounding sequences of ``casting=`` are defined in :mod:`.casting`);
``ctx`` keeps ``x``, ``weight`` and the per-row ``rstd``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..ops._spec import filled
from ..ops.rms_norm import RMSNormCtx, RMSNormGrads
from . import casting as _cast
from ._common import _ieee, backward_dtype, conventions, finite_rows, rounded, working_dtype, write_result

__all__ = ["RMSNormCtx", "RMSNormGrads", "backward", "forward", "forward_for"]


def statistics(xw: np.ndarray, *, eps: float) -> np.ndarray:
    """``r`` of each row of the ``(R, H)`` working-precision array ``xw``."""
    return _statistics(xw, eps).ravel()


def _statistics(xw: np.ndarray, eps: float) -> np.ndarray:
    # statistics as an (R, 1) column (keepdims: no indexing to broadcast it); the scalars as Python floats (faster
    # than NumPy scalars on small arrays; the same values in the working precision)
    ms = np.add.reduce(xw * xw, axis=1, keepdims=True) / float(xw.shape[1])
    return finite_rows(1.0 / np.sqrt(ms + float(eps)), ms)


def input_grad(
    dyw: np.ndarray, xw: np.ndarray, rstd: np.ndarray, w: np.ndarray | None
) -> tuple[np.ndarray, np.ndarray]:
    """``(dx, xhat)`` in working precision for the upstream gradient ``dyw`` of ``y = xhat * w``."""
    r = rstd[:, None]  # (the per-row values as (R, 1) columns)
    xhat = xw * r
    g = dyw * w if w is not None else dyw
    c = np.add.reduce(g * xhat, axis=1, keepdims=True) / float(xw.shape[1])
    c = finite_rows(c, c)
    return r * (g - xhat * c), xhat


def forward(
    x: np.ndarray,
    weight: np.ndarray | None,
    *,
    eps: float,
    weight_offset: float = 0.0,
    casting: str = "fp32",
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, RMSNormCtx]:
    """RMSNorm forward of the ``(R, H)`` array ``x``; returns ``(y, ctx)`` (``casting``: :mod:`.casting`)."""
    return _forward(x, weight, out, eps, weight_offset, casting)


def forward_for(options: Mapping[str, Any]) -> Callable[..., tuple[np.ndarray, RMSNormCtx]]:
    """:func:`forward` with ``options`` (its keyword arguments but ``out``) bound: ``run(x, weight, out=None)``, what
    the dispatcher's plan calls (:func:`pynorm._dispatch._target`)."""
    conv = conventions(forward, options)
    return lambda x, weight, out=None: _forward(x, weight, out, *conv)


@_ieee
def _forward(
    x: np.ndarray, weight: np.ndarray | None, out: np.ndarray | None, eps: float, weight_offset: float, casting: str
) -> tuple[np.ndarray, RMSNormCtx]:
    # forward, its arguments by position (out, then the conventions in forward's order)
    if casting == "none":
        y, rstd = _cast.rms_norm_forward_none(x, weight, eps=eps, weight_offset=weight_offset, out=out)
    else:
        wp = working_dtype(x.dtype, getattr(weight, "dtype", None))
        xw = x.astype(wp)
        rstd = _statistics(xw, eps)  # (an (R, 1) column)
        y = xw * rstd
        qd = _cast.quantized_dtype(casting, x.dtype, getattr(weight, "dtype", None))
        if qd is not None:
            y = rounded(y, qd).astype(wp)
        w = _cast.effective_weight(weight, weight_offset, wp, casting)
        if w is not None:
            y = y * w
        if casting == "t5" and qd is not None:
            y = rounded(y, qd)
        y, rstd = write_result(y, x.dtype, out), rstd.ravel()
    # (RMSNormCtx(...) without the frozen dataclass's __init__, ops._spec.filled: half the cost of a small call's ctx)
    return y, filled(RMSNormCtx, {
        "x": x, "weight": weight, "rstd": rstd, "eps": float(eps), "weight_offset": float(weight_offset),
        "casting": casting,
    })  # fmt: skip


@_ieee
def backward(dy: np.ndarray, ctx: RMSNormCtx, *, dx_out: np.ndarray | None = None) -> RMSNormGrads:
    """RMSNorm backward: gradients of a scalar loss given ``dy = dL/dy`` (shape ``(R, H)``)."""
    x, weight = ctx.x, ctx.weight
    if ctx.casting == "none":
        dx, dweight = _cast.rms_norm_backward_none(dy, x, weight, eps=ctx.eps, weight_offset=ctx.weight_offset)
        return RMSNormGrads(write_result(dx, x.dtype, dx_out), dweight)
    wp = backward_dtype(ctx.rstd.dtype, x.dtype, getattr(weight, "dtype", None))
    dyw, g, w, qd = _cast.backward_terms(dy, ctx, wp)
    dx, xhat = input_grad(g, x.astype(wp), ctx.rstd.astype(wp, copy=False), w)
    if qd is not None:
        xhat = rounded(xhat, qd).astype(wp)
    dweight = rounded(np.add.reduce(dyw * xhat, axis=0), weight.dtype) if weight is not None else None
    return RMSNormGrads(write_result(dx, x.dtype, dx_out), dweight)
