"""LayerNorm on the ``numba`` backend: same math, arguments and ctx as :mod:`pynorm.reference.layer_norm`.

Forward: one parallel pass over the rows (:func:`._kernels.ln_fwd`); each row's
statistics are taken while it is in cache, then the output is written. ``ctx``
keeps ``x`` as given and float64 ``mean``/``rstd``.

Backward: ``dx`` row by row; ``dweight``/``dbias`` from per-block partial sums
(blocks of :data:`._kernels.ROW_BLOCK` rows, accumulated during the ``dx`` rows'
first pass, or -- for few rows of many elements, see :func:`._kernels.use_fused`
-- by column tiles afterwards) added in float64 in block order, so results do
not depend on the thread count. Outputs not passed as ``out=``/``dx_out=`` come
from a recycling pool (:class:`._common._BufferPool`). See :mod:`._kernels` for
the numerics.
"""

from __future__ import annotations

import numpy as np

from ...reference.layer_norm import LayerNormCtx, LayerNormGrads
from . import _common as cm
from . import _kernels as k
from ._threads import launch

__all__ = ["LayerNormCtx", "LayerNormGrads", "backward", "forward"]


def forward(
    x: np.ndarray,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    *,
    eps: float,
    correction: int = 0,
    eps_mode: str = "var",
    weight_offset: float = 0.0,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, LayerNormCtx]:
    """LayerNorm forward of the ``(R, H)`` array ``x``; returns ``(y, ctx)`` (``y`` is ``out`` if given)."""
    rows, h = x.shape
    mdt = cm.math_dtype(x.dtype)
    y = cm.output(out, x.shape, x.dtype)
    mean = np.empty(rows)
    rstd = np.empty(rows)
    if rows:
        launch(
            k.ln_fwd,
            rows * h,
            cm.storage(x),
            cm.effective_weight(weight, weight_offset, mdt),
            cm.param(bias, mdt),
            float(eps),
            int(correction),
            eps_mode == "std",
            cm.storage(y),
            mean,
            rstd,
            k.use_stream(cm.storage(y)),
        )
    ctx = LayerNormCtx(x, weight, bias, mean, rstd, float(eps), int(correction), eps_mode, float(weight_offset))
    return y, ctx


def backward(dy: np.ndarray, ctx: LayerNormCtx, *, dx_out: np.ndarray | None = None) -> LayerNormGrads:
    """LayerNorm backward: gradients of a scalar loss given ``dy = dL/dy`` (shape ``(R, H)``)."""
    x, weight, bias = ctx.x, ctx.weight, ctx.bias
    rows, h = x.shape
    mdt = cm.math_dtype(x.dtype)
    dx = cm.output(dx_out, x.shape, x.dtype)
    pw = cm.block_partials(rows, h, mdt, weight is not None)
    pb = cm.block_partials(rows, h, mdt, bias is not None)
    if rows:
        xs, dys, dxs = cm.storage(x), cm.storage(dy), cm.storage(dx)
        w = cm.effective_weight(weight, ctx.weight_offset, mdt)
        mean, rstd = cm.stats(ctx.mean), cm.stats(ctx.rstd)
        corr, std = int(ctx.correction), ctx.eps_mode == "std"
        if k.use_fused(rows, h):
            launch(k.ln_bwd_fused, rows * h, xs, dys, w, mean, rstd, corr, std, dxs, pw, pb, k.use_stream(dxs))
        else:
            scale = np.empty(rows, np.int64)
            cs = np.empty(rows)
            launch(k.ln_bwd_rows, rows * h, xs, dys, w, mean, rstd, corr, std, dxs, scale, cs, k.use_stream(dxs))
            if pw is not None or pb is not None:
                launch(k.ln_params_by_cols, rows * h, xs, dys, mean, rstd, scale, cs, pw, pb)
    dweight = cm.reduce_blocks(pw, weight.dtype) if pw is not None else None
    dbias = cm.reduce_blocks(pb, bias.dtype) if pb is not None else None
    return LayerNormGrads(dx, dweight, dbias)
