r"""Quantization-friendly LayerNorm, the reference definition (NumPy; also the ``numpy`` backend).

A ``QuantLayerNorm``: a LayerNorm whose input may be int8 (with a scale)
and whose output may be int8 (with a scale), so that it sits between int8 matrix products.

Input. Either a float array ``x`` (``x_scale`` None), or an int8 array with ``x_scale`` -- a scalar or
one positive scale per row: the *real* input is :math:`\tilde x = x \cdot s_x` (exact in float64).

Normalization: :mod:`pynorm.reference.layer_norm`'s LayerNorm of the real input with its conventions
(``eps``, ``correction``, ``eps_mode``, ``weight_offset``):
:math:`y_i = (\tilde x_i - \mu)\, r\, (w_i + o) + b_i`.

* float input: ``y`` is exactly :func:`pynorm.layer_norm`'s output (rounded once to ``x.dtype``);
* int8 input: the statistics are *exact integers*: :math:`S_1 = \sum_j x_j`,
  :math:`S_2 = \sum_j x_j^2` (int64), :math:`D = H S_2 - S_1^2` (int64; ``H < 2^24``), then this fixed
  float64 sequence, each operation rounded once (IEEE round to nearest, no fused multiply-add) -- every
  backend performs the same one, so the outputs are bitwise identical across backends:

  .. code-block:: text

      u    = double(D) / (H (H - c))                             variance of the integer row
      v    = u * (s_x * s_x)      (0 when D = 0)                 variance of the real row
      r    = 1 / sqrt(v + eps)   ("var")   or   1 / (sqrt(v) + eps)   ("std")
      k    = (s_x * r) / H
      if v = inf (s_x beyond ~1e152; then eps is below half an ulp of the row's variance in either mode):
          r = 1 / (s_x * sqrt(u)),   k = 1 / (H * sqrt(u))
      if D = 0 and eps > 0 (a constant row): k = 0               (yhat = 0 whatever s_x)
      yhat = double(H x_j - S_1) * k                             (H x_j - S_1 exact)
      y    = yhat * (double(w_j) + o) + double(b_j)              (each factor only when present)

  The float output is ``y`` rounded once to float32 (within a few float64 ulps of the exact LayerNorm
  before that rounding: at most 1 float32 ulp from the correctly rounded value, and equal to it except
  within ~1e-8 of a rounding boundary).

Output. Float (``quantize=None`` and no ``out_scale``), or symmetric int8
:math:`q = \mathrm{clip}(\mathrm{round\_half\_even}(y / s), -127, 127)` with

* ``quantize="row"``: one ``s = float32(amax / 127)`` per row, ``amax = max_j |y_j|``;
* ``quantize="tensor"``: one ``s`` for the whole tensor, ``amax`` over every element;
* ``out_scale``: the given ``s`` (rounded to float32), for a calibrated static scale; then values
  beyond ``127.5 s`` clip.

``y`` here is the float64 ``y`` of the int8 path, or the float output (in ``x.dtype``) of the float path;
``amax`` ignores NaN; ``s = 1`` where it would not be a positive finite float32 (``amax = 0``, not
finite, or so small that ``amax / 127`` underflows); ``q = 0`` where ``y / s`` is NaN. ``y / s`` is
one float64 division by the float32 ``s``. The quantized result is the pair ``(q, s)``; ``q * s`` is
within half a quantization step ``s / 2`` of ``y`` wherever nothing clipped.

Backward (``dy`` = the gradient w.r.t. the *dequantized* output ``q * s``, or ``y``; float32 for an
int8 input, ``x.dtype`` otherwise): straight-through through the rounding -- ``dy`` passes unchanged,
except where clipping happened with a given ``out_scale`` (``|round(y / s)| > 127``), where it is 0;
``s`` is treated as a constant (the usual straight-through estimator; ``amax`` is not differentiated).
Then LayerNorm's exact backward at the real input: ``dx`` is w.r.t. :math:`\tilde x` (float32 for an
int8 input), ``dweight``, ``dbias`` as LayerNorm's.
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np

from ..ops.quant_norm import (
    QMAX,
    QuantLayerNormCtx,
    QuantLayerNormGrads,
    output_dtype,
    quantizing,
)
from . import layer_norm as _ln
from ._common import _ieee, round_to, working_dtype, write_result

__all__ = [
    "QMAX",
    "QuantLayerNormCtx",
    "QuantLayerNormGrads",
    "backward",
    "forward",
    "int8_layer_norm",
    "output_scale",
    "quantize_values",
]


def output_scale(amax: np.ndarray) -> np.ndarray:
    """``s = float32(amax / 127)``, 1 where that is not a positive finite float32."""
    with np.errstate(all="ignore"):
        s = (np.asarray(amax, dtype=np.float64) / QMAX).astype(np.float32)
    return np.where((s > 0) & np.isfinite(s), s, np.float32(1)).astype(np.float32)


def quantize_values(y: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(q, keep)``: ``q = clip(rint(y / s), -127, 127)`` (0 where ``y / s`` is NaN) from float64 ``y`` and
    the float32 scale(s) ``s`` (broadcast against ``y``); ``keep`` False where the clip changed the value."""
    with np.errstate(all="ignore"):
        t = np.rint(y / np.asarray(s, dtype=np.float64))
    keep = ~(np.abs(t) > QMAX)
    q = np.where(np.isnan(t), 0.0, np.clip(t, -QMAX, QMAX)).astype(np.int8)
    return q, keep


@_ieee
def int8_layer_norm(
    x: np.ndarray, x_scale: np.ndarray, weight: np.ndarray | None, bias: np.ndarray | None, *,
    eps: float, correction: int, eps_mode: str, weight_offset: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """``(y, mean, rstd)`` in float64 of the int8 ``(R, H)`` array ``x`` with per-row scales ``x_scale``: the
    exact-integer statistics and the fixed float64 sequence of the module docstring (every backend's)."""
    h = x.shape[1]
    xi = x.astype(np.int64)
    s1 = xi.sum(axis=1)
    s2 = (xi * xi).sum(axis=1)
    d = h * s2 - s1 * s1
    hd = np.float64(h)
    xs = np.asarray(x_scale, dtype=np.float64)
    u = d.astype(np.float64) / (hd * np.float64(h - correction))
    v = np.where(d == 0, 0.0, u * (xs * xs))
    e = np.float64(eps)
    r = 1.0 / np.sqrt(v + e) if eps_mode == "var" else 1.0 / (np.sqrt(v) + e)
    k = (xs * r) / hd
    huge = np.isinf(v)  # s_x * s_x overflowed: the scale from the integer row's own spread
    r = np.where(huge, 1.0 / (xs * np.sqrt(u)), r)
    k = np.where(huge, 1.0 / (hd * np.sqrt(u)), k)
    if eps > 0:
        k = np.where(d == 0, 0.0, k)  # a constant row: yhat = 0 exactly, even where s_x * r overflows
    y = (xi * h - s1[:, None]).astype(np.float64) * k[:, None]
    if weight is not None:
        y = y * (weight.astype(np.float64) + np.float64(weight_offset))
    if bias is not None:
        y = y + bias.astype(np.float64)
    mean = (s1.astype(np.float64) / hd) * xs
    return y, mean, r


def scales_for(y: np.ndarray, quantize: str | None, out_scale: float | None) -> np.ndarray:
    """The scale(s) of ``y`` (float64 values): ``(R,)`` for ``"row"``, ``(1,)`` for ``"tensor"``/``out_scale``."""
    if out_scale is not None:
        return np.asarray([out_scale], dtype=np.float32)
    a = np.abs(y)
    if quantize == "row":
        amax = np.fmax.reduce(a, axis=1) if y.size else np.zeros(y.shape[0])
    else:
        amax = np.asarray([np.fmax.reduce(a, axis=None) if y.size else 0.0])
    return output_scale(amax)


def real_input(x: np.ndarray, x_scale: np.ndarray | None) -> np.ndarray:
    """The real input: ``x`` itself, or ``x * x_scale`` per row in float64 (exact) for an int8 ``x``."""
    if x_scale is None:
        return x
    return x.astype(np.float64) * np.asarray(x_scale, dtype=np.float64)[:, None]


#: LayerNorm's conventions but ``eps`` (which a caller must give), with the defaults of its reference forward
_LN_DEFAULTS: dict[str, Any] = {
    n: p.default
    for n, p in inspect.signature(_ln.forward).parameters.items()
    if n in ("correction", "eps_mode", "weight_offset")
}


@_ieee
def forward(
    x: np.ndarray,
    x_scale: np.ndarray | None,
    weight: np.ndarray | None,
    bias: np.ndarray | None,
    *,
    quantize: str | None = None,
    out_scale: float | None = None,
    out: np.ndarray | None = None,
    **conventions: Any,
) -> tuple[np.ndarray, QuantLayerNormCtx]:
    """Forward of the ``(R, H)`` array ``x`` (int8 with ``x_scale`` of shape ``(R,)``, or float); returns
    ``(y_or_q, ctx)`` with the scale of a quantized output in ``ctx.scale`` (see the module docstring).
    ``conventions``: LayerNorm's (``eps``, ``correction``, ``eps_mode``, ``weight_offset``), with the defaults
    and meaning of :func:`pynorm.reference.layer_norm.forward`."""
    conv = {**_LN_DEFAULTS, **conventions}
    odt = output_dtype(x.dtype, quantize, out_scale)
    if x_scale is not None:
        xs = np.asarray(x_scale, dtype=np.float64).reshape(x.shape[0])
        y64, mean, rstd = int8_layer_norm(x, xs, weight, bias, **conv)
        yfloat = None
    else:
        xs = None
        yfloat, lctx = _ln.forward(x, weight, bias, **conv)
        y64, mean, rstd = yfloat.astype(np.float64), lctx.mean, lctx.rstd
    scale = keep = None
    if quantizing(quantize, out_scale):
        scale = scales_for(y64, quantize, out_scale)
        q, kept = quantize_values(y64, scale[:, None] if quantize == "row" else scale[0])
        keep = kept if out_scale is not None else None
        result = q
    else:
        result = yfloat if yfloat is not None else y64
    ctx = QuantLayerNormCtx(
        x, weight, bias, mean, rstd, float(conv["eps"]), int(conv["correction"]), conv["eps_mode"],
        float(conv["weight_offset"]), xs, quantize,
        None if out_scale is None else float(out_scale), scale, keep,
    )  # fmt: skip
    return write_result(result, odt, out), ctx


@_ieee
def backward(dy: np.ndarray, ctx: QuantLayerNormCtx, *, dx_out: np.ndarray | None = None) -> QuantLayerNormGrads:
    """Backward: straight-through through the quantization (``dy`` zeroed where a given ``out_scale`` clipped),
    then LayerNorm's backward at the real input, from the reference's own statistics of it; each gradient
    rounded once."""
    g = dy if ctx.keep is None else np.where(ctx.keep, dy, np.zeros((), dy.dtype))
    if ctx.x_scale is None:
        lctx = _ln.LayerNormCtx(
            ctx.x, ctx.weight, ctx.bias, ctx.mean, ctx.rstd, ctx.eps, ctx.correction, ctx.eps_mode, ctx.weight_offset
        )
        grads = _ln.backward(g, lctx)
        return QuantLayerNormGrads(write_result(grads.dx, dy.dtype, dx_out), grads.dweight, grads.dbias)
    wp = working_dtype(np.float64)  # the real input x * x_scale is exact in float64
    xr = real_input(ctx.x, ctx.x_scale).astype(wp)
    _, mean, rstd = _ln.statistics(xr, eps=ctx.eps, correction=ctx.correction, eps_mode=ctx.eps_mode)
    dyw = g.astype(wp)
    w = _ln._effective_weight(ctx.weight, ctx.weight_offset, wp)
    dx, xhat = _ln.input_grad(dyw, xr, mean, rstd, w, correction=ctx.correction, eps_mode=ctx.eps_mode)
    dweight = round_to(np.add.reduce(dyw * xhat, axis=0), ctx.weight.dtype) if ctx.weight is not None else None
    dbias = round_to(np.add.reduce(dyw, axis=0), ctx.bias.dtype) if ctx.bias is not None else None
    return QuantLayerNormGrads(write_result(dx, dy.dtype, dx_out), dweight, dbias)
