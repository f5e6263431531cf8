"""RMSNorm on the ``numba`` backend: same math, arguments and ctx as :mod:`pynorm.reference.rms_norm`.

Forward: one parallel pass over the rows (:func:`._kernels.rms_fwd`), ``ctx``
keeps ``x`` as given and the float64 ``rstd``. Backward: ``dx`` row by row,
``dweight`` from fixed row-block partial sums added in float64 in block order
(see :mod:`.layer_norm` and :mod:`._kernels`).
"""

from __future__ import annotations

import numpy as np

from ...reference.rms_norm import RMSNormCtx, RMSNormGrads
from . import _common as cm
from . import _kernels as k
from ._threads import launch

__all__ = ["RMSNormCtx", "RMSNormGrads", "backward", "forward"]


def forward(
    x: np.ndarray,
    weight: np.ndarray | None,
    *,
    eps: float,
    weight_offset: float = 0.0,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, RMSNormCtx]:
    """RMSNorm forward of the ``(R, H)`` array ``x``; returns ``(y, ctx)`` (``y`` is ``out`` if given)."""
    rows, h = x.shape
    y = cm.output(out, x.shape, x.dtype)
    rstd = np.empty(rows)
    if rows:
        w = cm.effective_weight(weight, weight_offset, cm.math_dtype(x.dtype))
        ys = cm.storage(y)
        launch(k.rms_fwd, rows * h, cm.storage(x), w, float(eps), ys, rstd, k.use_stream(ys))
    return y, RMSNormCtx(x, weight, rstd, float(eps), float(weight_offset))


def backward(dy: np.ndarray, ctx: RMSNormCtx, *, dx_out: np.ndarray | None = None) -> RMSNormGrads:
    """RMSNorm backward: gradients of a scalar loss given ``dy = dL/dy`` (shape ``(R, H)``)."""
    x, weight = ctx.x, ctx.weight
    rows, h = x.shape
    mdt = cm.math_dtype(x.dtype)
    dx = cm.output(dx_out, x.shape, x.dtype)
    pw = cm.block_partials(rows, h, mdt, weight is not None)
    if rows:
        xs, dys, dxs = cm.storage(x), cm.storage(dy), cm.storage(dx)
        w = cm.effective_weight(weight, ctx.weight_offset, mdt)
        rstd = cm.stats(ctx.rstd)
        if k.use_fused(rows, h):
            launch(k.rms_bwd_fused, rows * h, xs, dys, w, rstd, dxs, pw, k.use_stream(dxs))
        else:
            scale = np.empty(rows, np.int64)
            launch(k.rms_bwd_rows, rows * h, xs, dys, w, rstd, dxs, scale, k.use_stream(dxs))
            if pw is not None:
                launch(k.rms_params_by_cols, rows * h, xs, dys, rstd, scale, pw)
    dweight = cm.reduce_blocks(pw, weight.dtype) if pw is not None else None
    return RMSNormGrads(dx, dweight)
