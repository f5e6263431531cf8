r"""ScaleNorm, the reference definition ("Transformers without Tears", Nguyen & Salazar 2019).

Forward, for each row :math:`x \in \mathbb{R}^H` of the ``(R, H)`` input and the learnable scalar
:math:`g` (1 without one):

* ``eps_mode="floor"`` (the authors' code, the default): :math:`y = g\,x / \max(\lVert x\rVert_2, \epsilon)`;
* ``eps_mode="root"``: :math:`y = g\,x / \sqrt{\lVert x\rVert_2^2 + \epsilon}`.

With :math:`r` the per-row factor (:math:`1/\max(n, \epsilon)` or :math:`(n^2 + \epsilon)^{-1/2}`,
:math:`n = \lVert x\rVert_2`), :math:`\hat x = x r` and :math:`G = g\,\partial L/\partial y`, the backward is

* where the norm is active (``root``, or ``floor`` with :math:`n \ge \epsilon`):
  :math:`\partial L/\partial x = r\,(G - \hat x \sum_j G_j \hat x_j)`;
* on the floor branch (:math:`n < \epsilon`: :math:`y = g x / \epsilon`, :math:`r = 1/\epsilon` constant):
  :math:`\partial L/\partial x = r\,G`;
* :math:`\partial L/\partial g = \sum_{rows, j} \partial L/\partial y_j\, \hat x_j`.

At the switch :math:`n = \epsilon` the max is not differentiable; the norm branch's gradient is
used there (the one-sided derivative from above: ``max(n, eps) = n`` for ``n >= eps``). ``ctx``
records per row whether the floor was taken (``floor``), so every backend uses the branch the
forward used.

Numerics: the working precision of :mod:`._common` (float64, or x87 extended for float64 input),
in which the squares of any finite input cannot overflow; one rounding per output.
"""

from __future__ import annotations

import numpy as np

from ..ops.scale_norm import ScaleNormCtx, ScaleNormGrads
from ._common import _ieee, finite_rows, round_to, working_dtype, write_result

__all__ = ["ScaleNormCtx", "ScaleNormGrads", "backward", "forward"]


@_ieee
def forward(
    x: np.ndarray, g: np.ndarray | None, *, eps: float, eps_mode: str = "floor", out: np.ndarray | None = None
) -> tuple[np.ndarray, ScaleNormCtx]:
    """ScaleNorm forward of the ``(R, H)`` array ``x`` with the ``(1,)`` scalar ``g`` (or None)."""
    wp = working_dtype(x.dtype, getattr(g, "dtype", None))
    xw = x.astype(wp)
    s2 = np.add.reduce(xw * xw, axis=1)
    e = wp.type(eps)
    if eps_mode == "floor":
        n = np.sqrt(s2)
        floor = n < e
        rstd = 1 / np.where(floor, e, n)
    else:
        floor = np.zeros(x.shape[0], dtype=bool)
        rstd = 1 / np.sqrt(s2 + e)
    rstd = finite_rows(rstd, s2)
    y = xw * rstd[:, None]
    if g is not None:
        y = y * g.astype(wp)[0]
    return write_result(y, x.dtype, out), ScaleNormCtx(x, g, rstd, floor, float(eps), eps_mode)


@_ieee
def backward(dy: np.ndarray, ctx: ScaleNormCtx, *, dx_out: np.ndarray | None = None) -> ScaleNormGrads:
    """ScaleNorm backward: gradients of a scalar loss given ``dy = dL/dy`` (shape ``(R, H)``)."""
    x, g = ctx.x, ctx.g
    wp = np.result_type(ctx.rstd.dtype, working_dtype(x.dtype, getattr(g, "dtype", None)))
    rstd = ctx.rstd.astype(wp)
    xhat = x.astype(wp) * rstd[:, None]
    dyw = dy.astype(wp)
    big_g = dyw * g.astype(wp)[0] if g is not None else dyw
    gx = np.add.reduce(big_g * xhat, axis=1)
    coef = finite_rows(np.where(ctx.floor, wp.type(0), gx), gx)
    dx = rstd[:, None] * (big_g - xhat * coef[:, None])
    dg = round_to(np.sum(dyw * xhat).reshape(1), g.dtype) if g is not None else None
    return ScaleNormGrads(write_result(dx, x.dtype, dx_out), dg)
