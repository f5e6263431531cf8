r"""Conditional LayerNorm / RMSNorm, the reference (adaLN: Peebles & Xie 2023, "Scalable Diffusion Models with
Transformers").

The affine parameters of each row come from a conditioning vector through a linear map: with ``cond``
of ``(G, C)`` (cond row ``g`` serving the ``R / G`` consecutive rows ``g R/G ... (g+1) R/G - 1`` of the
``(R, H)`` input: one per row, or one per sample broadcast over the sequence), ``W`` of ``(2H, C)`` as a
torch ``Linear(C, 2H)`` stores it and ``c`` of ``(2H,)``:

.. math::

    [\gamma_g, \beta_g] = W\,\mathrm{cond}_g + c, \qquad
    y_i = \hat x_i\,(\gamma_{g(i)} + o) + \beta_{g(i)}

with :math:`\hat x` LayerNorm's (:mod:`.layer_norm`) or RMSNorm's (:mod:`.rms_norm`) normalized row and
``o = 1`` with ``zero_centered=True`` (adaLN's ``(1 + scale)``), else 0. RMSNorm with ``shift=False``:
``W`` is ``(H, C)``, ``c`` ``(H,)`` and only :math:`\gamma` is produced (no :math:`\beta`).

Backward: ``dx`` as for the plain norm with the row's own :math:`\gamma + o`; with
:math:`d\gamma_g = \sum_{i \in g} dy_i\,\hat x_i` and :math:`d\beta_g = \sum_{i \in g} dy_i` (the rows cond
row ``g`` serves), :math:`dP_g = [d\gamma_g, d\beta_g]`:

.. math::

    d\,\mathrm{cond} = dP\,W, \qquad dW = dP^T \mathrm{cond}, \qquad dc = \textstyle\sum_g dP_g

Numerics: everything (the products included) in the working precision of :mod:`._common`; each output
rounded once. ``ctx`` keeps ``x``, ``cond``, ``W``, ``c`` and the per-row statistics, not the normalized rows.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ..ops.conditional_norm import (
    ConditionalLayerNormCtx,
    ConditionalLayerNormGrads,
    ConditionalRMSNormCtx,
    ConditionalRMSNormGrads,
    expand,
    reduce_rows,
)
from . import layer_norm as _ln
from . import rms_norm as _rms
from ._common import _ieee, round_to, working_dtype, write_result

__all__ = [
    "ConditionalLayerNormCtx",
    "ConditionalLayerNormGrads",
    "ConditionalRMSNormCtx",
    "ConditionalRMSNormGrads",
    "layer_norm_backward",
    "layer_norm_forward",
    "rms_norm_backward",
    "rms_norm_forward",
]


def _modulation(cond: np.ndarray, W: np.ndarray, c: np.ndarray | None, wp: Any) -> np.ndarray:
    """``P = cond W^T + c``, ``(G, kH)`` in working precision."""
    p = cond.astype(wp) @ W.astype(wp).T
    return p + c.astype(wp) if c is not None else p


def _param_grads(parts: list[np.ndarray], ctx: Any, wp: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``(dcond, dW, dc)`` from the ``(R, H)`` per-row gradients of gamma (and beta), summed per cond row into
    ``dP``."""
    dp = np.concatenate([reduce_rows(part, ctx.cond.shape[0]) for part in parts], axis=1)
    dcond = round_to(dp @ ctx.W.astype(wp), ctx.cond.dtype)
    dW = round_to(dp.T @ ctx.cond.astype(wp), ctx.W.dtype)
    dc = round_to(dp.sum(axis=0), ctx.c.dtype) if ctx.c is not None else None
    return dcond, dW, dc


def _wp(x: np.ndarray, cond: np.ndarray, W: np.ndarray, c: np.ndarray | None) -> Any:
    return working_dtype(x.dtype, cond.dtype, W.dtype, getattr(c, "dtype", None))


@_ieee
def layer_norm_forward(
    x: np.ndarray,
    cond: np.ndarray,
    W: np.ndarray,
    c: np.ndarray | None,
    *,
    eps: float,
    correction: int = 0,
    eps_mode: str = "var",
    zero_centered: bool = False,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, ConditionalLayerNormCtx]:
    """``(y, ctx)`` of the conditional LayerNorm of the ``(R, H)`` array ``x`` with ``(G, C)`` ``cond``."""
    wp = _wp(x, cond, W, c)
    r, h = x.shape
    d, mean, rstd = _ln.statistics(x.astype(wp), eps=eps, correction=correction, eps_mode=eps_mode)
    p = expand(_modulation(cond, W, c, wp), r)
    y = d * rstd[:, None] * (p[:, :h] + wp.type(1.0 if zero_centered else 0.0)) + p[:, h:]
    ctx = ConditionalLayerNormCtx(x, cond, W, c, mean, rstd, float(eps), int(correction), eps_mode, bool(zero_centered))
    return write_result(y, x.dtype, out), ctx


def _upstream(dy: np.ndarray, ctx: Any) -> tuple[Any, np.ndarray, np.ndarray]:
    """The working dtype of a backward, the ``(R, H)`` per-row scale the forward applied (``gamma``, plus 1 with
    ``zero_centered``) and ``dy`` in that dtype."""
    wp = _wp(ctx.x, ctx.cond, ctx.W, ctx.c)
    r, h = ctx.x.shape
    gamma = expand(_modulation(ctx.cond, ctx.W, ctx.c, wp)[:, :h], r) + wp.type(1.0 if ctx.zero_centered else 0.0)
    return wp, gamma, dy.astype(wp)


@_ieee
def layer_norm_backward(
    dy: np.ndarray, ctx: ConditionalLayerNormCtx, *, dx_out: np.ndarray | None = None
) -> ConditionalLayerNormGrads:
    """``(dx, dcond, dW, dc)`` of the conditional LayerNorm."""
    wp, gamma, dyw = _upstream(dy, ctx)
    dx, xhat = _ln.input_grad(
        dyw, ctx.x.astype(wp), ctx.mean.astype(wp), ctx.rstd.astype(wp), gamma, correction=ctx.correction,
        eps_mode=ctx.eps_mode,
    )  # fmt: skip
    return ConditionalLayerNormGrads(write_result(dx, ctx.x.dtype, dx_out), *_param_grads([dyw * xhat, dyw], ctx, wp))


@_ieee
def rms_norm_forward(
    x: np.ndarray,
    cond: np.ndarray,
    W: np.ndarray,
    c: np.ndarray | None,
    *,
    eps: float,
    shift: bool = True,
    zero_centered: bool = False,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, ConditionalRMSNormCtx]:
    """``(y, ctx)`` of the conditional RMSNorm of the ``(R, H)`` array ``x`` with ``(G, C)`` ``cond``."""
    wp = _wp(x, cond, W, c)
    r, h = x.shape
    xw = x.astype(wp)
    rstd = _rms.statistics(xw, eps=eps)
    p = expand(_modulation(cond, W, c, wp), r)
    y = xw * rstd[:, None] * (p[:, :h] + wp.type(1.0 if zero_centered else 0.0))
    if shift:
        y = y + p[:, h:]
    ctx = ConditionalRMSNormCtx(x, cond, W, c, rstd, float(eps), bool(shift), bool(zero_centered))
    return write_result(y, x.dtype, out), ctx


@_ieee
def rms_norm_backward(
    dy: np.ndarray, ctx: ConditionalRMSNormCtx, *, dx_out: np.ndarray | None = None
) -> ConditionalRMSNormGrads:
    """``(dx, dcond, dW, dc)`` of the conditional RMSNorm."""
    wp, gamma, dyw = _upstream(dy, ctx)
    dx, xhat = _rms.input_grad(dyw, ctx.x.astype(wp), ctx.rstd.astype(wp), gamma)
    parts = [dyw * xhat, dyw] if ctx.shift else [dyw * xhat]
    return ConditionalRMSNormGrads(write_result(dx, ctx.x.dtype, dx_out), *_param_grads(parts, ctx, wp))


class _Op(NamedTuple):
    forward: Any
    backward: Any


#: op name -> its forward/backward (read by the registry)
OP_IMPLS = {
    "conditional_layer_norm": _Op(layer_norm_forward, layer_norm_backward),
    "conditional_rms_norm": _Op(rms_norm_forward, rms_norm_backward),
}
