r"""Fused residual add + LayerNorm / RMSNorm, the reference definitions.

.. math::

    h = x + \alpha\,\mathrm{residual}, \qquad y = \mathrm{norm}(h)

``h`` is rounded once to ``residual_dtype`` (default: ``x``'s dtype; float32 keeps the residual
stream in fp32 for half inputs, as flash-attention's ``residual_in_fp32``) and the norm is taken
of that rounded ``h`` -- exactly what the unfused ``h = x + alpha * r; y = norm(h)`` computes --
with every convention of :mod:`.layer_norm` / :mod:`.rms_norm`. ``alpha`` is a float (DeepNorm's
up-weighted skip ``alpha * x + f(x)`` is ``add_layer_norm(f(x), x, alpha=alpha)``). Forward
returns both ``y`` and ``h``, so the caller keeps the residual stream.

Backward, with :math:`\partial L/\partial h` the gradient arriving at ``h`` from later layers
(``dh``, None for none) and :math:`g_h = \mathrm{norm}'(h)^T dy + \partial L/\partial h`:
:math:`\partial L/\partial x = g_h`, :math:`\partial L/\partial\,\mathrm{residual} = \alpha\,g_h`,
and the norm's parameter gradients as for the norm alone; ``dx`` and ``dresidual`` have the dtypes of
``x`` and ``residual``.

Numerics: the working precision of :mod:`._common`; ``h``, ``y`` and each gradient rounded once.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from ..ops.add_norm import AddLayerNormCtx, AddLayerNormGrads, AddRMSNormCtx, AddRMSNormGrads, h_dtype
from . import layer_norm as _ln
from . import rms_norm as _rms
from ._common import _ieee, backward_dtype, round_to, rounded, working_dtype, write_result

__all__ = [
    "AddLayerNormCtx",
    "AddLayerNormGrads",
    "AddRMSNormCtx",
    "AddRMSNormGrads",
    "layer_norm_backward",
    "layer_norm_forward",
    "residual_sum",
    "rms_norm_backward",
    "rms_norm_forward",
]


def _two_sum(a: Any, b: Any) -> tuple[Any, Any]:
    """``s + e == a + b`` exactly, ``s = fl(a + b)`` (Knuth)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def _veltkamp(a: Any) -> tuple[Any, Any]:
    c = 134217729.0 * a  # 2**27 + 1 (Veltkamp)
    hi = c - (c - a)
    return hi, a - hi


def _two_prod(a: float, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``p + e == a * b`` exactly, ``p = fl(a * b)`` (Dekker), barring overflow and underflow."""
    p = a * b
    ah, al = _veltkamp(a)
    bh, bl = _veltkamp(b)
    return p, ((ah * bh - p) + ah * bl + al * bh) + al * bl


def _odd_or_even(c: np.ndarray, rem: np.ndarray, narrower: bool) -> np.ndarray:
    """``c`` (float64, ``fl(v)``) with ``v - c`` of the sign of ``rem``: for a narrower target, the float64
    next to ``v`` with an odd last bit where ``v`` is not a float64 (round to odd: rounding that once more
    to a dtype of at most 51 significand bits rounds ``v`` correctly); else ``c``."""
    if not narrower:
        return c
    odd = (c.view(np.int64) & 1) == 1
    step = np.nextafter(c, np.where(rem > 0, np.inf, -np.inf))
    return np.where((rem == 0) | odd | ~np.isfinite(c), c, step)


def residual_sum(x: np.ndarray, residual: np.ndarray, alpha: float, residual_dtype: Any) -> np.ndarray:
    """``h = x + alpha * residual``, the exact value rounded once to ``h``'s dtype.

    Error-free transformations in float64 (Dekker's product, Knuth's sum) give ``c = fl(x + alpha r)``
    and the sign of the remainder; the rare elements where that rounding could be off by one (a
    remainder within its own error of half an ulp, or operands where the transformations overflow or
    underflow) are redone exactly with :class:`fractions.Fraction`. For a ``h`` narrower than float64
    the value is rounded to odd first, so that the rounding to ``h``'s dtype is the only one.
    (Computing in ``longdouble`` and rounding to float64 would round twice.)
    """
    from fractions import Fraction

    hd = h_dtype(x.dtype, residual_dtype)
    narrower = hd.itemsize < 8
    xd = np.ascontiguousarray(x, dtype=np.float64)
    rd = np.ascontiguousarray(residual, dtype=np.float64)
    a = float(alpha)
    with np.errstate(all="ignore"):
        p, pe = _two_prod(a, rd)
        s, se = _two_sum(xd, p)
        t, te = _two_sum(se, pe)
        c, w = _two_sum(s, t)  # x + alpha r == c + w + te exactly
        rem = w + te  # its sign is the sign of the exact remainder
        sp = np.spacing(np.abs(c))
        pow2 = (c != 0) & (np.frexp(np.abs(c))[0] == 0.5)
        near_half = (np.abs(np.abs(w) - sp / 2) <= np.abs(te)) | (pow2 & (np.abs(np.abs(w) - sp / 4) <= np.abs(te)))
        mag = np.abs(p)
        unsafe = ~np.isfinite(c) | (np.abs(rd) > 2.0**990) | (mag > 2.0**990) | ((mag < 2.0**-960) & (p != 0))
        unsafe |= (np.abs(xd) > 2.0**1020) | ((a != 0) & (np.abs(rd) < 2.0**-960) & (rd != 0))
        out = _odd_or_even(c, rem, narrower)
    redo = (near_half & (te != 0)) | unsafe
    for i in zip(*np.nonzero(redo), strict=True):
        xv, rv = float(xd[i]), float(rd[i])
        if not (np.isfinite(xv) and np.isfinite(rv)):
            with np.errstate(all="ignore"):
                out[i] = xv + a * rv
            continue
        exact = Fraction(xv) + Fraction(a) * Fraction(rv)
        try:
            f = float(exact)
        except OverflowError:
            out[i] = np.inf if exact > 0 else -np.inf
            continue
        if narrower and Fraction(f) != exact and (np.float64(f).view(np.int64) & 1) == 0:
            f = float(np.nextafter(f, np.inf if exact > Fraction(f) else -np.inf))
        out[i] = f
    with np.errstate(over="ignore", invalid="ignore"):
        return round_to(out, hd)


def _upstream(g: np.ndarray, dh: np.ndarray | None, wp: np.dtype[Any]) -> np.ndarray:
    return g if dh is None else g + dh.astype(wp)


def _split(g: np.ndarray, ctx: Any, dx_out: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """``(dx, dresidual)`` from the gradient at ``h``: ``g`` and ``alpha * g``, each rounded once to the
    dtype of its input."""
    dx = write_result(g, ctx.x_dtype, dx_out)
    return dx, round_to(g.dtype.type(ctx.alpha) * g, ctx.residual_in_dtype)


@_ieee
def layer_norm_forward(
    x: np.ndarray,
    residual: np.ndarray,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    *,
    eps: float,
    correction: int = 0,
    eps_mode: str = "var",
    weight_offset: float = 0.0,
    alpha: float = 1.0,
    residual_dtype: Any = None,
    out: np.ndarray | None = None,
) -> tuple[tuple[np.ndarray, np.ndarray], AddLayerNormCtx]:
    """``((y, h), ctx)`` of the fused add + LayerNorm of ``(R, H)`` arrays."""
    h = residual_sum(x, residual, alpha, residual_dtype)
    wp = working_dtype(h.dtype, x.dtype, getattr(weight, "dtype", None), getattr(bias, "dtype", None))
    d, mean, rstd = _ln.statistics(h.astype(wp), eps=eps, correction=correction, eps_mode=eps_mode)
    w = _ln._effective_weight(weight, weight_offset, wp)
    y = _ln.affine(d * rstd[:, None], w, None if bias is None else bias.astype(wp))
    ctx = AddLayerNormCtx(
        h, weight, bias, mean, rstd, float(eps), int(correction), eps_mode, float(weight_offset), float(alpha),
        x.dtype, residual.dtype, residual_dtype,
    )  # fmt: skip
    return (write_result(y, x.dtype, out), h), ctx


@_ieee
def layer_norm_backward(
    dy: np.ndarray, ctx: AddLayerNormCtx, *, dx_out: np.ndarray | None = None, dh: np.ndarray | None = None
) -> AddLayerNormGrads:
    """``(dx, dresidual, dweight, dbias)`` of the fused add + LayerNorm; ``dh`` arrives at ``h`` from later layers."""
    h, weight, bias = ctx.h, ctx.weight, ctx.bias
    wp = backward_dtype(ctx.mean.dtype, h.dtype, ctx.x_dtype, getattr(weight, "dtype", None))
    dyw = dy.astype(wp)
    w = _ln._effective_weight(weight, ctx.weight_offset, wp)
    g, xhat = _ln.input_grad(
        dyw, h.astype(wp), ctx.mean.astype(wp, copy=False), ctx.rstd.astype(wp, copy=False), w,
        correction=ctx.correction, eps_mode=ctx.eps_mode,
    )  # fmt: skip
    dx, dres = _split(_upstream(g, dh, wp), ctx, dx_out)
    dweight = rounded(np.add.reduce(dyw * xhat, axis=0), weight.dtype) if weight is not None else None
    dbias = rounded(np.add.reduce(dyw, axis=0), bias.dtype) if bias is not None else None
    return AddLayerNormGrads(dx, dres, dweight, dbias)


@_ieee
def rms_norm_forward(
    x: np.ndarray,
    residual: np.ndarray,
    weight: np.ndarray | None,
    *,
    eps: float,
    weight_offset: float = 0.0,
    alpha: float = 1.0,
    residual_dtype: Any = None,
    out: np.ndarray | None = None,
) -> tuple[tuple[np.ndarray, np.ndarray], AddRMSNormCtx]:
    """``((y, h), ctx)`` of the fused add + RMSNorm of ``(R, H)`` arrays."""
    h = residual_sum(x, residual, alpha, residual_dtype)
    wp = working_dtype(h.dtype, x.dtype, getattr(weight, "dtype", None))
    hw = h.astype(wp)
    rstd = _rms.statistics(hw, eps=eps)
    y = _ln.affine(hw * rstd[:, None], _ln._effective_weight(weight, weight_offset, wp), None)
    ctx = AddRMSNormCtx(
        h, weight, rstd, float(eps), float(weight_offset), float(alpha), x.dtype, residual.dtype, residual_dtype
    )
    return (write_result(y, x.dtype, out), h), ctx


@_ieee
def rms_norm_backward(
    dy: np.ndarray, ctx: AddRMSNormCtx, *, dx_out: np.ndarray | None = None, dh: np.ndarray | None = None
) -> AddRMSNormGrads:
    """``(dx, dresidual, dweight)`` of the fused add + RMSNorm; ``dh`` arrives at ``h`` from later layers."""
    h, weight = ctx.h, ctx.weight
    wp = backward_dtype(ctx.rstd.dtype, h.dtype, ctx.x_dtype, getattr(weight, "dtype", None))
    dyw = dy.astype(wp)
    g, xhat = _rms.input_grad(
        dyw, h.astype(wp), ctx.rstd.astype(wp, copy=False), _ln._effective_weight(weight, ctx.weight_offset, wp)
    )
    dx, dres = _split(_upstream(g, dh, wp), ctx, dx_out)
    dweight = rounded(np.add.reduce(dyw * xhat, axis=0), weight.dtype) if weight is not None else None
    return AddRMSNormGrads(dx, dres, dweight)


class _Op(NamedTuple):
    forward: Any
    backward: Any


#: op name -> its forward/backward (read by the registry)
OP_IMPLS = {
    "add_layer_norm": _Op(layer_norm_forward, layer_norm_backward),
    "add_rms_norm": _Op(rms_norm_forward, rms_norm_backward),
}
