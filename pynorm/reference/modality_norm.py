r"""Modality-specific LayerNorm / RMSNorm (one set of norm parameters per modality), the reference definitions.

Each row ``i`` of ``x`` is normalized as by :mod:`.layer_norm` / :mod:`.rms_norm`, with its
affine parameters taken from row ``ids[i]`` of parameter tables: ``weight`` and ``bias`` have
shape ``(M, H)`` (``M`` modalities, e.g. text, image, audio), ``ids`` holds one integer in
``[0, M)`` per row.

.. math::

    y_i = \hat x_i\,(w_{\mathrm{ids}_i} + o) + b_{\mathrm{ids}_i}

Backward: ``dx`` as for the plain norm with the row's own weights; the parameter gradients are
scattered per modality: :math:`\partial L/\partial w_m = \sum_{i:\,\mathrm{ids}_i = m} dy_i\,\hat x_i`,
:math:`\partial L/\partial b_m = \sum_{i:\,\mathrm{ids}_i = m} dy_i` (rows of unused modalities are
0). With every id equal, the results are bitwise those of the plain norm with that row of the
tables (the same operations, in the same order).

Numerics: the working precision of :mod:`._common`; one rounding per output.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ..ops.modality_norm import (
    ModalityLayerNormCtx,
    ModalityLayerNormGrads,
    ModalityRMSNormCtx,
    ModalityRMSNormGrads,
    scatter_rows,
)
from . import layer_norm as _ln
from . import rms_norm as _rms
from ._common import _ieee, round_to, working_dtype, write_result

__all__ = [
    "ModalityLayerNormCtx",
    "ModalityLayerNormGrads",
    "ModalityRMSNormCtx",
    "ModalityRMSNormGrads",
    "layer_norm_backward",
    "layer_norm_forward",
    "rms_norm_backward",
    "rms_norm_forward",
    "scatter_rows",
]


def _table_rows(table: np.ndarray | None, ids: np.ndarray, offset: float, wp: np.dtype[Any]) -> np.ndarray | None:
    return None if table is None else table.astype(wp)[ids] + wp.type(offset)


@_ieee
def layer_norm_forward(
    x: np.ndarray,
    modality_ids: np.ndarray,
    weight: np.ndarray,
    bias: np.ndarray | None,
    *,
    eps: float,
    correction: int = 0,
    eps_mode: str = "var",
    weight_offset: float = 0.0,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, ModalityLayerNormCtx]:
    """``(y, ctx)`` of the modality LayerNorm of the ``(R, H)`` array ``x`` with ``(R,)`` ids and ``(M, H)`` tables."""
    wp = working_dtype(x.dtype, weight.dtype, getattr(bias, "dtype", None))
    d, mean, rstd = _ln.statistics(x.astype(wp), eps=eps, correction=correction, eps_mode=eps_mode)
    w = _table_rows(weight, modality_ids, weight_offset, wp)
    y = _ln.affine(d * rstd[:, None], w, _table_rows(bias, modality_ids, 0.0, wp))
    ctx = ModalityLayerNormCtx(
        x, weight, bias, mean, rstd, float(eps), int(correction), eps_mode, float(weight_offset), modality_ids
    )
    return write_result(y, x.dtype, out), ctx


@_ieee
def layer_norm_backward(
    dy: np.ndarray, ctx: ModalityLayerNormCtx, *, dx_out: np.ndarray | None = None
) -> ModalityLayerNormGrads:
    """``(dx, dweight, dbias)`` of the modality LayerNorm; the table gradients scattered per modality."""
    x, ids, weight, bias = ctx.x, ctx.modality_ids, ctx.weight, ctx.bias
    wp = np.result_type(ctx.mean.dtype, working_dtype(x.dtype, weight.dtype))
    dyw = dy.astype(wp)
    w = _table_rows(weight, ids, ctx.weight_offset, wp)
    dx, xhat = _ln.input_grad(
        dyw, x.astype(wp), ctx.mean.astype(wp), ctx.rstd.astype(wp), w, correction=ctx.correction,
        eps_mode=ctx.eps_mode,
    )  # fmt: skip
    m = weight.shape[0]
    dweight = round_to(scatter_rows(dyw * xhat, ids, m), weight.dtype)
    dbias = round_to(scatter_rows(dyw, ids, m), bias.dtype) if bias is not None else None
    return ModalityLayerNormGrads(write_result(dx, x.dtype, dx_out), dweight, dbias)


@_ieee
def rms_norm_forward(
    x: np.ndarray,
    modality_ids: np.ndarray,
    weight: np.ndarray,
    *,
    eps: float,
    weight_offset: float = 0.0,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, ModalityRMSNormCtx]:
    """``(y, ctx)`` of the modality RMSNorm of the ``(R, H)`` array ``x`` with ``(R,)`` ids and an ``(M, H)`` table."""
    wp = working_dtype(x.dtype, weight.dtype)
    xw = x.astype(wp)
    rstd = _rms.statistics(xw, eps=eps)
    y = _ln.affine(xw * rstd[:, None], _table_rows(weight, modality_ids, weight_offset, wp), None)
    ctx = ModalityRMSNormCtx(x, modality_ids, weight, rstd, float(eps), float(weight_offset))
    return write_result(y, x.dtype, out), ctx


@_ieee
def rms_norm_backward(
    dy: np.ndarray, ctx: ModalityRMSNormCtx, *, dx_out: np.ndarray | None = None
) -> ModalityRMSNormGrads:
    """``(dx, dweight)`` of the modality RMSNorm; the weight gradient scattered per modality."""
    x, ids, weight = ctx.x, ctx.modality_ids, ctx.weight
    wp = np.result_type(ctx.rstd.dtype, working_dtype(x.dtype, weight.dtype))
    dyw = dy.astype(wp)
    dx, xhat = _rms.input_grad(dyw, x.astype(wp), ctx.rstd.astype(wp), _table_rows(weight, ids, ctx.weight_offset, wp))
    dweight = round_to(scatter_rows(dyw * xhat, ids, weight.shape[0]), weight.dtype)
    return ModalityRMSNormGrads(write_result(dx, x.dtype, dx_out), dweight)


class _Op(NamedTuple):
    forward: Any
    backward: Any


#: op name -> its forward/backward (read by the registry)
OP_IMPLS = {
    "modality_layer_norm": _Op(layer_norm_forward, layer_norm_backward),
    "modality_rms_norm": _Op(rms_norm_forward, rms_norm_backward),
}
