r"""Fused LayerNorm / RMSNorm + Linear, the reference definitions.

.. math::

    n = \mathrm{norm}(x), \qquad \mathrm{out} = n\,W^T + c

with the norm's own parameters and conventions (:mod:`.layer_norm`, :mod:`.rms_norm`), ``W`` of
``(N, H)`` as a torch ``Linear(H, N)`` stores it and ``c`` of ``(N,)``. ``n`` is the norm's output in
``x``'s dtype -- the array the product reads and ``return_norm=True`` returns -- and ``out`` is rounded
once from the product of that ``n`` computed in working precision.

Backward, with upstream gradients ``dout`` (and optionally ``dn``, the gradient arriving at a returned
``n``): :math:`dn_{\mathrm{tot}} = dout\,W + dn`, then the norm's backward of :math:`dn_{\mathrm{tot}}`
for ``dx`` and the norm parameters (in working precision: no rounding of :math:`dn_{\mathrm{tot}}`);
:math:`dW = dout^T n`, :math:`dc = \sum_{rows} dout`.

The ctx keeps ``x``, the norm parameters, ``W``, ``c`` and the per-row statistics -- never ``n``, which
backward recomputes (as flash-attention's fused dense modules do).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ..ops.norm_linear import LayerNormLinearCtx, LayerNormLinearGrads, RMSNormLinearCtx, RMSNormLinearGrads
from . import layer_norm as _ln
from . import rms_norm as _rms
from ._common import _ieee, round_to, working_dtype, write_result

__all__ = [
    "LayerNormLinearCtx",
    "LayerNormLinearGrads",
    "RMSNormLinearCtx",
    "RMSNormLinearGrads",
]


def _product(n: np.ndarray, W: np.ndarray, c: np.ndarray | None, out: np.ndarray | None) -> np.ndarray:
    wp = working_dtype(n.dtype, W.dtype, getattr(c, "dtype", None))
    y = n.astype(wp) @ W.astype(wp).T
    if c is not None:
        y = y + c.astype(wp)
    return write_result(y, n.dtype, out)


def _linear_grads(
    dy: np.ndarray, n: np.ndarray, W: np.ndarray, c: np.ndarray | None, dn: np.ndarray | None, wp: Any
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """``(dn_total, dW, dc)``: ``dn_total`` in working precision."""
    dyw = dy.astype(wp)
    dnt = dyw @ W.astype(wp)
    if dn is not None:
        dnt = dnt + dn.astype(wp)
    dW = round_to(dyw.T @ n.astype(wp), W.dtype)
    dc = round_to(dyw.sum(axis=0), c.dtype) if c is not None else None
    return dnt, dW, dc


def _wp(*arrays: Any) -> Any:
    return working_dtype(*(getattr(a, "dtype", None) for a in arrays))


@_ieee
def layer_norm_forward(
    x: np.ndarray,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    W: np.ndarray,
    c: np.ndarray | None,
    *,
    eps: float,
    correction: int = 0,
    eps_mode: str = "var",
    weight_offset: float = 0.0,
    out: np.ndarray | None = None,
) -> tuple[tuple[np.ndarray, np.ndarray], LayerNormLinearCtx]:
    """``((out, n), ctx)`` of the fused LayerNorm + Linear of the ``(R, H)`` array ``x``."""
    n, norm = _ln.forward(
        x, weight, bias, eps=eps, correction=correction, eps_mode=eps_mode, weight_offset=weight_offset
    )
    return (_product(n, W, c, out), n), LayerNormLinearCtx(norm, W, c)


@_ieee
def layer_norm_backward(
    dy: np.ndarray, ctx: LayerNormLinearCtx, *, dx_out: np.ndarray | None = None, dn: np.ndarray | None = None
) -> LayerNormLinearGrads:
    """``(dx, dweight, dbias, dW, dc)`` of the fused LayerNorm + Linear; ``n`` recomputed."""
    nc = ctx.norm
    x, weight, bias = nc.x, nc.weight, nc.bias
    n, _ = _ln.forward(
        x, weight, bias, eps=nc.eps, correction=nc.correction, eps_mode=nc.eps_mode, weight_offset=nc.weight_offset
    )
    wp = np.result_type(nc.mean.dtype, _wp(x, weight, bias, ctx.W, ctx.c))
    dnt, dW, dc = _linear_grads(dy, n, ctx.W, ctx.c, dn, wp)
    w = _ln._effective_weight(weight, nc.weight_offset, wp)
    dx, xhat = _ln.input_grad(
        dnt, x.astype(wp), nc.mean.astype(wp), nc.rstd.astype(wp), w, correction=nc.correction, eps_mode=nc.eps_mode
    )
    dweight = round_to(np.add.reduce(dnt * xhat, axis=0), weight.dtype) if weight is not None else None
    dbias = round_to(np.add.reduce(dnt, axis=0), bias.dtype) if bias is not None else None
    return LayerNormLinearGrads(write_result(dx, x.dtype, dx_out), dweight, dbias, dW, dc)


@_ieee
def rms_norm_forward(
    x: np.ndarray,
    weight: np.ndarray | None,
    W: np.ndarray,
    c: np.ndarray | None,
    *,
    eps: float,
    weight_offset: float = 0.0,
    out: np.ndarray | None = None,
) -> tuple[tuple[np.ndarray, np.ndarray], RMSNormLinearCtx]:
    """``((out, n), ctx)`` of the fused RMSNorm + Linear of the ``(R, H)`` array ``x``."""
    n, norm = _rms.forward(x, weight, eps=eps, weight_offset=weight_offset)
    return (_product(n, W, c, out), n), RMSNormLinearCtx(norm, W, c)


@_ieee
def rms_norm_backward(
    dy: np.ndarray, ctx: RMSNormLinearCtx, *, dx_out: np.ndarray | None = None, dn: np.ndarray | None = None
) -> RMSNormLinearGrads:
    """``(dx, dweight, dW, dc)`` of the fused RMSNorm + Linear; ``n`` recomputed."""
    nc = ctx.norm
    x, weight = nc.x, nc.weight
    n, _ = _rms.forward(x, weight, eps=nc.eps, weight_offset=nc.weight_offset)
    wp = np.result_type(nc.rstd.dtype, _wp(x, weight, ctx.W, ctx.c))
    dnt, dW, dc = _linear_grads(dy, n, ctx.W, ctx.c, dn, wp)
    w = _ln._effective_weight(weight, nc.weight_offset, wp)
    dx, xhat = _rms.input_grad(dnt, x.astype(wp), nc.rstd.astype(wp), w)
    dweight = round_to(np.add.reduce(dnt * xhat, axis=0), weight.dtype) if weight is not None else None
    return RMSNormLinearGrads(write_result(dx, x.dtype, dx_out), dweight, dW, dc)


class _Op(NamedTuple):
    forward: Any
    backward: Any


#: op name -> its forward/backward (read by the registry)
OP_IMPLS = {
    "layer_norm_linear": _Op(layer_norm_forward, layer_norm_backward),
    "rms_norm_linear": _Op(rms_norm_forward, rms_norm_backward),
}
