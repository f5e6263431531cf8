r"""LayerNorm, the reference definition (NumPy; also the ``numpy`` backend).

Forward, for each row :math:`x \in \mathbb{R}^H` of the ``(R, H)`` input:

.. math::

    \mu = \frac{1}{H}\sum_i x_i, \qquad
    v = \frac{1}{H - c}\sum_i (x_i - \mu)^2, \qquad
    \hat x_i = (x_i - \mu)\, r, \qquad
    y_i = \hat x_i\,(w_i + o) + b_i

with ``c = correction`` (0: biased variance, the default of PyTorch, ONNX, Apex
and TransformerEngine; 1: the unbiased ``torch.Tensor.std()`` of the second source
document), ``o = weight_offset`` (1.0 gives Gemma's / TE's zero-centred
``(1 + w)``) and

* ``eps_mode="var"`` (default): :math:`r = 1/\sqrt{v + \epsilon}`;
* ``eps_mode="std"``: :math:`r = 1/(\sqrt{v} + \epsilon)`, as in both source
  documents' code.

Backward, with :math:`g_i = \partial L/\partial y_i \cdot (w_i + o)` and
:math:`n = H - c`:

* ``"var"``: :math:`\partial L/\partial x_i = r\,(g_i - \bar g - \hat x_i \sum_j g_j \hat x_j / n)`
* ``"std"``: :math:`\partial L/\partial x_i = r\,(g_i - \bar g - \hat x_i \sum_j g_j \hat x_j / (n\,s\,r))`
  with :math:`s = \sqrt v`; at :math:`s = 0` the last term is taken as 0 (its
  limit along any direction, since :math:`\hat x = 0` there).
* :math:`\partial L/\partial w_i = \sum_{rows} \partial L/\partial y_i\, \hat x_i`,
  :math:`\partial L/\partial b_i = \sum_{rows} \partial L/\partial y_i`.

Numerics: all arithmetic in the working precision of :mod:`._common`; the
mean by the corrected two-pass method, the variance from the centred values
(never :math:`E[x^2] - E[x]^2`); each output rounded once (``casting="fp32"``;
the other rounding sequences of ``casting=`` are defined in :mod:`.casting`). ``ctx`` keeps ``x``,
the parameters and the per-row ``mean`` and ``rstd`` (``r``) in working
precision, never the normalized activations.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ..ops._spec import filled
from ..ops.layer_norm import LayerNormCtx, LayerNormGrads
from . import casting as _cast
from ._common import (
    _ieee,
    _row_mean,
    backward_dtype,
    center,
    conventions,
    finite_rows,
    rounded,
    working_dtype,
    write_result,
)

__all__ = ["LayerNormCtx", "LayerNormGrads", "backward", "forward", "forward_for"]


def _effective_weight(weight: np.ndarray | None, offset: float, wp: np.dtype[Any]) -> np.ndarray | None:
    if weight is None:
        return None
    return weight.astype(wp) + float(offset)  # (a Python float: the same value in wp, added faster)


# ---------------------------------------------------------------------------
# the math, on working-precision arrays (shared by the ops built on LayerNorm: the residual-add
# and modality variants)


def statistics(xw: np.ndarray, *, eps: float, correction: int, eps_mode: str) -> tuple[np.ndarray, ...]:
    """``(d, mean, rstd)`` of the ``(R, H)`` working-precision rows ``xw``: the centred values, the mean
    and ``r`` (see the module docstring)."""
    d, mean, rstd = _statistics(xw, eps, correction, eps_mode)
    return d, mean.ravel(), rstd.ravel()


def _statistics(xw: np.ndarray, eps: float, correction: int, eps_mode: str) -> tuple[np.ndarray, ...]:
    # statistics with mean and rstd as (R, 1) columns (see _common._row_mean); the scalars as Python floats (faster
    # than NumPy scalars on small arrays; the same values in the working precision)
    mean = _row_mean(xw)
    d = center(xw, mean)
    var = np.add.reduce(d * d, axis=1, keepdims=True) / float(xw.shape[1] - correction)
    e = float(eps)
    rstd = 1.0 / np.sqrt(var + e) if eps_mode == "var" else 1.0 / (np.sqrt(var) + e)
    return d, mean, rstd


def affine(xhat: np.ndarray, w: np.ndarray | None, b: np.ndarray | None) -> np.ndarray:
    """``xhat * w + b`` with the effective weight ``w`` and bias ``b`` (each ``(H,)``, ``(R, H)`` or None)."""
    y = xhat * w if w is not None else xhat
    return y + b if b is not None else y


def input_grad(
    dyw: np.ndarray, xw: np.ndarray, mean: np.ndarray, rstd: np.ndarray, w: np.ndarray | None, *,
    correction: int, eps_mode: str,
) -> tuple[np.ndarray, np.ndarray]:  # fmt: skip
    """``(dx, xhat)`` in working precision for the upstream gradient ``dyw`` of ``y = xhat * w + b``."""
    h = xw.shape[1]
    n = float(h - correction)
    r = rstd[:, None]  # (the per-row values as (R, 1) columns)
    d = center(xw, mean)
    xhat = d * r
    g = dyw * w if w is not None else dyw
    gbar = np.add.reduce(g, axis=1, keepdims=True) / float(h)
    gx = np.add.reduce(g * xhat, axis=1, keepdims=True)
    if eps_mode == "var":
        coef = gx / n
    else:
        s = np.sqrt(np.add.reduce(d * d, axis=1, keepdims=True) / n)
        with np.errstate(divide="ignore", invalid="ignore"):
            coef = np.where(s > 0, gx / (n * s * r), xw.dtype.type(0))
    coef = finite_rows(coef, gbar, gx)
    return r * (g - gbar - xhat * coef), xhat


# ---------------------------------------------------------------------------
# the op


def forward(
    x: np.ndarray,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    *,
    eps: float,
    correction: int = 0,
    eps_mode: str = "var",
    weight_offset: float = 0.0,
    casting: str = "fp32",
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, LayerNormCtx]:
    """LayerNorm forward of the ``(R, H)`` array ``x``; returns ``(y, ctx)``.

    ``weight``/``bias`` are ``(H,)`` arrays or None; ``y`` has ``x``'s dtype and is
    written into ``out`` (a C-contiguous ``(R, H)`` array of that dtype) if given;
    ``casting`` is the rounding sequence (:mod:`.casting`).
    """
    return _forward(x, weight, bias, out, eps, correction, eps_mode, weight_offset, casting)


def forward_for(options: Mapping[str, Any]) -> Callable[..., tuple[np.ndarray, LayerNormCtx]]:
    """:func:`forward` with ``options`` (its keyword arguments but ``out``) bound: ``run(x, weight, bias, out=None)``,
    what the dispatcher's plan calls (:func:`pynorm._dispatch._target`)."""
    conv = conventions(forward, options)
    return lambda x, weight, bias, out=None: _forward(x, weight, bias, out, *conv)


@_ieee
def _forward(
    x: np.ndarray, weight: np.ndarray | None, bias: np.ndarray | None, out: np.ndarray | None, eps: float,
    correction: int, eps_mode: str, weight_offset: float, casting: str,
) -> tuple[np.ndarray, LayerNormCtx]:  # fmt: skip
    # forward, its arguments by position (out, then the conventions in forward's order)
    if casting == "none":
        y, mean, rstd = _cast.layer_norm_forward_none(
            x, weight, bias, eps=eps, correction=correction, eps_mode=eps_mode, weight_offset=weight_offset, out=out
        )
    else:
        wp = working_dtype(x.dtype, getattr(weight, "dtype", None), getattr(bias, "dtype", None))
        d, mean, rstd = _statistics(x.astype(wp), eps, correction, eps_mode)  # (mean and rstd as columns)
        w = _cast.effective_weight(weight, weight_offset, wp, casting)
        xhat = d * rstd
        qd = _cast.quantized_dtype(casting, x.dtype, getattr(weight, "dtype", None))
        if qd is not None:
            xhat = rounded(xhat, qd).astype(wp)
        y = affine(xhat, w, None if bias is None else bias.astype(wp))
        if casting == "t5" and qd is not None:
            y = rounded(y, qd)
        y, mean, rstd = write_result(y, x.dtype, out), mean.ravel(), rstd.ravel()
    # (LayerNormCtx(...) without the frozen dataclass's __init__, ops._spec.filled: half the cost of a small call's ctx)
    return y, filled(LayerNormCtx, {
        "x": x, "weight": weight, "bias": bias, "mean": mean, "rstd": rstd, "eps": float(eps),
        "correction": int(correction), "eps_mode": eps_mode, "weight_offset": float(weight_offset), "casting": casting,
    })  # fmt: skip


@_ieee
def backward(dy: np.ndarray, ctx: LayerNormCtx, *, dx_out: np.ndarray | None = None) -> LayerNormGrads:
    """LayerNorm backward: gradients of a scalar loss given ``dy = dL/dy`` (shape ``(R, H)``)."""
    x, weight, bias = ctx.x, ctx.weight, ctx.bias
    if ctx.casting == "none":
        dx, dweight, dbias = _cast.layer_norm_backward_none(
            dy, x, weight, bias, eps=ctx.eps, correction=ctx.correction, eps_mode=ctx.eps_mode,
            weight_offset=ctx.weight_offset,
        )  # fmt: skip
        return LayerNormGrads(write_result(dx, x.dtype, dx_out), dweight, dbias)
    wp = backward_dtype(ctx.mean.dtype, x.dtype, getattr(weight, "dtype", None))
    dyw, g, w, qd = _cast.backward_terms(dy, ctx, wp)
    dx, xhat = input_grad(
        g, x.astype(wp), ctx.mean.astype(wp, copy=False), ctx.rstd.astype(wp, copy=False), w,
        correction=ctx.correction, eps_mode=ctx.eps_mode,
    )  # fmt: skip
    if qd is not None:
        xhat = rounded(xhat, qd).astype(wp)
    dweight = rounded(np.add.reduce(dyw * xhat, axis=0), weight.dtype) if weight is not None else None
    dbias = rounded(np.add.reduce(dyw, axis=0), bias.dtype) if bias is not None else None
    return LayerNormGrads(write_result(dx, x.dtype, dx_out), dweight, dbias)
