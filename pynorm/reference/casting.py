r"""Casting policies of LayerNorm and RMSNorm: where a 16-bit (or float32) model rounds, defined once.

Frameworks agree on the formula of a norm and disagree on where its intermediate values are rounded;
with float16/bfloat16 activations the outputs then differ by an ulp in a large share of the elements
(users see 1e-3 mismatches against Hugging Face and ask for a mode that matches). ``casting=`` selects
the rounding sequence; every backend honours it. Notation: ``T`` is ``x``'s dtype (also ``y``'s and
``dx``'s), ``W`` the weight's, ``rnd_D`` one correct rounding to ``D``, ``xhat`` the normalized row
computed as in ``"fp32"`` (working precision, at least float32), ``o`` the ``weight_offset``.

``"fp32"`` (default; PyTorch, TransformerEngine, flash-attention, Liger's LayerNorm)
    ``y = rnd_T(xhat (w + o) + b)``: all math in float32 or wider, one rounding. Backward: the op's
    formula (its module docstring), each gradient rounded once.
``"gemma"`` (HF ``GemmaRMSNorm``, Liger ``casting_mode="gemma"``)
    as ``"fp32"`` with the effective weight ``w_e = rnd_f32(rnd_f32(w) + rnd_f32(o))``: ``(1 + w)`` is
    evaluated in float32 (pass ``weight_offset=1.0`` for Gemma's ``(1 + w)``). ``dweight`` is unchanged
    (``d w_e / d w = 1``).
``"llama"`` (HF ``LlamaRMSNorm``, Liger ``casting_mode="llama"``)
    ``q = rnd_T(xhat)``, ``w_e = rnd_W(w + o)``, ``y = rnd_T(q w_e + b)``: the normalized value is rounded
    to the input dtype before the weight multiplies it. Backward as autograd differentiates that
    sequence (a cast passes the gradient through): ``g = rnd_T(dy w_e)`` is the gradient at ``q``,
    ``dx`` the op's formula with ``g`` in place of ``dy (w + o)``, ``dweight = rnd_W(sum_rows dy q)``,
    ``dbias = sum_rows dy``.
``"t5"`` (HF ``T5LayerNorm``)
    with a float16/bfloat16 weight: ``q = rnd_W(xhat)`` -- rounded to the **weight's** dtype --,
    ``y = rnd_T(rnd_W(q w_e + b))`` (HF returns ``W``; pynorm's output has ``x``'s dtype, exact when
    ``T`` is wider). Backward: ``dy`` arrives in ``W`` (``rnd_W(dy)``), ``g = rnd_W(dy_W w_e)``,
    ``dweight = rnd_W(sum dy_W q)``, ``dx`` from ``g``. With a float32/float64 weight or none, HF's T5
    does not round: as ``"fp32"``. With ``W == T`` it equals ``"llama"``.
``"apex"`` (NVIDIA Apex ``FusedLayerNorm``/``FusedRMSNorm``)
    forward as ``"llama"`` (``q = rnd_T(xhat)`` -- Apex rounds to the output dtype, which is ``T``
    here --, then ``w_e q + b`` rounded once, as its fused multiply-add); backward as ``"fp32"`` with
    ``w_e``: Apex's backward recomputes ``xhat`` in float32 from ``x``, the mean and ``rstd``.
``"none"`` (Liger ``casting_mode="none"``; a model run without upcasts)
    every operation rounded to ``T``; sums accumulate in the working precision and are rounded once
    (as PyTorch's reductions accumulate in float32). LayerNorm: ``m = rnd(sum x / H)``,
    ``d = rnd(x - m)``, ``v = rnd(sum rnd(d^2) / n)``, ``r = rnd(1/sqrt(rnd(v + eps)))``
    (``eps_mode="std"``: ``r = rnd(1 / rnd(rnd(sqrt v) + eps))``), ``xhat = rnd(d r)``,
    ``y = rnd(rnd(xhat w_e) + b_T)`` with ``w_e = rnd(w + o)``, ``b_T = rnd(b)``; RMSNorm:
    ``r = rnd(1/sqrt(rnd(rnd(sum rnd(x^2)) / H) + eps))``... see :func:`layer_norm_forward_none` and
    :func:`rms_norm_forward_none` for the exact sequences, and their backward counterparts. In float16
    the squares overflow for ``|x| > 256``: the rows then normalize to 0, as such a model does.

The numpy (reference) backend computes each sequence literally. The fast backends build the
``"llama"``/``"t5"``/``"apex"`` forms from their own kernels: the norm without its affine (``q``, one
rounding) and the element-wise family's identity (``PowerNorm`` with ``p = 1``: ``w q + b``, rounded
once; its backward gives ``g`` and the parameter gradients); ``"gemma"`` prepares ``w_e`` and runs the
``"fp32"`` kernels.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..ops.layer_norm import CASTINGS
from ._common import rounded, working_dtype, write_result

__all__ = [
    "CASTINGS",
    "backward_terms",
    "effective_weight",
    "layer_norm_backward_none",
    "layer_norm_forward_none",
    "quantized_dtype",
    "rms_norm_backward_none",
    "rms_norm_forward_none",
]


def _half(dtype: Any) -> bool:
    return dtype is not None and np.dtype(dtype).itemsize == 2


def quantized_dtype(casting: str, x_dtype: Any, w_dtype: Any) -> np.dtype[Any] | None:
    """The dtype ``xhat`` is rounded to before the affine (``q``), or None where the policy keeps it."""
    if casting in ("llama", "apex"):
        return np.dtype(x_dtype)
    if casting == "t5" and _half(w_dtype):
        return np.dtype(w_dtype)
    return None


def effective_weight(weight: np.ndarray | None, offset: float, wp: np.dtype[Any], casting: str) -> np.ndarray | None:
    """``w_e`` in working precision ``wp`` for ``casting`` (see the module doc)."""
    if weight is None:
        return None
    if casting == "gemma":
        f32 = np.float32
        return (weight.astype(f32) + f32(offset)).astype(wp)  # type: ignore[no-any-return]
    if quantized_dtype(casting, np.float32, weight.dtype) is None:  # "fp32", and "t5" without a 16-bit weight
        return weight.astype(wp) + float(offset)  # type: ignore[no-any-return]  # (a Python float: the same value)
    # llama, t5 (16-bit weight), apex: (w + o) in the weight's dtype
    return rounded(weight.astype(wp) + wp.type(offset), weight.dtype).astype(wp)  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------
# "none": every operation in x's dtype


def backward_terms(dy: np.ndarray, ctx: Any, wp: np.dtype[Any]) -> tuple[np.ndarray, np.ndarray, Any, Any]:
    """The start of a LayerNorm or RMSNorm backward under ``ctx.casting`` (any but ``"none"``), in ``wp``:
    ``(dyw, g, w, q)`` -- ``dy`` (rounded to the weight's dtype first for ``"t5"``), the gradient and weight the
    normalization's gradient formula takes (``g = rnd(dy w_e)`` and None where the gradient passes the rounded
    ``q``; else ``dy`` and ``w_e``), and the dtype of that ``q`` (None: none on the way; else ``xhat`` is rounded
    to it for the weight's gradient)."""
    dyw = dy.astype(wp)
    w = effective_weight(ctx.weight, ctx.weight_offset, wp, ctx.casting)
    qd = quantized_dtype(ctx.casting, ctx.x.dtype, getattr(ctx.weight, "dtype", None))
    if qd is None or ctx.casting == "apex":  # Apex's backward recomputes xhat in float32: no q on the way
        return dyw, dyw, w, None
    if ctx.casting == "t5":
        dyw = rounded(dyw, qd).astype(wp)  # HF's T5 output (and so its dy) is in the weight's dtype
    return dyw, (rounded(dyw * w, qd).astype(wp) if w is not None else dyw), None, qd


class _InDtype:
    """Arithmetic on working-precision arrays, each result rounded to ``dtype`` (``rnd``)."""

    def __init__(self, dtype: Any, wp: np.dtype[Any]) -> None:
        self.dtype = np.dtype(dtype)
        self.wp = wp

    def __call__(self, a: Any) -> np.ndarray:
        return rounded(np.asarray(a, dtype=self.wp), self.dtype).astype(self.wp)

    def mean(self, a: np.ndarray, n: int) -> np.ndarray:
        """``rnd(sum(a) / n)`` per row, the sum in working precision."""
        return self(np.add.reduce(a, axis=1) / self.wp.type(n))


def _none_setup(x: np.ndarray, *params: Any) -> tuple[_InDtype, np.ndarray]:
    wp = working_dtype(x.dtype, *(getattr(p, "dtype", None) for p in params))
    return _InDtype(x.dtype, wp), x.astype(wp)


def _none_weight(rnd: _InDtype, weight: Any, offset: float) -> np.ndarray | None:
    return None if weight is None else rnd(weight.astype(rnd.wp) + rnd.wp.type(offset))


def _ln_none_stats(rnd: _InDtype, xw: np.ndarray, eps: float, correction: int, eps_mode: str) -> tuple[Any, ...]:
    h = xw.shape[1]
    mean = rnd.mean(xw, h)
    d = rnd(xw - mean[:, None])
    var = rnd.mean(rnd(d * d), h - correction)
    e = rnd.wp.type(eps)
    if eps_mode == "var":
        rstd = rnd(1 / np.sqrt(rnd(var + e)))
    else:
        rstd = rnd(1 / rnd(rnd(np.sqrt(var)) + e))
    return d, mean, var, rstd


def layer_norm_forward_none(
    x: np.ndarray, weight: Any, bias: Any, *, eps: float, correction: int, eps_mode: str, weight_offset: float,
    out: Any = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """``(y, mean, rstd)`` of LayerNorm with every operation rounded to ``x``'s dtype (``casting="none"``)."""
    rnd, xw = _none_setup(x, weight, bias)
    d, mean, _, rstd = _ln_none_stats(rnd, xw, eps, correction, eps_mode)
    y = rnd(d * rstd[:, None])
    w = _none_weight(rnd, weight, weight_offset)
    if w is not None:
        y = rnd(y * w)
    if bias is not None:
        y = rnd(y + rnd(bias.astype(rnd.wp)))
    return write_result(y, x.dtype, out), mean, rstd


def layer_norm_backward_none(
    dy: np.ndarray, x: np.ndarray, weight: Any, bias: Any, *, eps: float, correction: int, eps_mode: str,
    weight_offset: float,
) -> tuple[np.ndarray, Any, Any]:  # fmt: skip
    """``(dx, dweight, dbias)`` of :func:`layer_norm_forward_none`: the op's gradient formula, each
    operation rounded to ``x``'s dtype (sums in working precision, rounded once):
    ``g = rnd(dy w_e)``, ``gbar = rnd(sum g / H)``, ``c = rnd(sum rnd(g xhat) / n)`` (``eps_mode="std"``:
    ``c = rnd(c / rnd(s r))`` with ``s = rnd(sqrt v)``, 0 where ``s = 0``),
    ``dx = rnd(r rnd(rnd(g - gbar) - rnd(xhat c)))``; ``dweight = rnd_W(sum rnd(dy xhat))``,
    ``dbias = rnd_B(sum dy)``."""
    rnd, xw = _none_setup(x, weight, bias)
    h = xw.shape[1]
    d, _, var, rstd = _ln_none_stats(rnd, xw, eps, correction, eps_mode)
    xhat = rnd(d * rstd[:, None])
    dyw = dy.astype(rnd.wp)
    w = _none_weight(rnd, weight, weight_offset)
    g = rnd(dyw * w) if w is not None else dyw
    gbar = rnd.mean(g, h)
    coef = rnd.mean(rnd(g * xhat), h - correction)
    if eps_mode == "std":
        s = rnd(np.sqrt(var))
        with np.errstate(divide="ignore", invalid="ignore"):
            coef = np.where(s > 0, rnd(coef / rnd(s * rstd)), rnd.wp.type(0))
    dx = rnd(rstd[:, None] * rnd(rnd(g - gbar[:, None]) - rnd(xhat * coef[:, None])))
    dweight = rounded(np.add.reduce(rnd(dyw * xhat), axis=0), weight.dtype) if weight is not None else None
    dbias = rounded(np.add.reduce(dyw, axis=0), bias.dtype) if bias is not None else None
    return rounded(dx, x.dtype), dweight, dbias


def _rms_none_rstd(rnd: _InDtype, xw: np.ndarray, eps: float) -> np.ndarray:
    ms = rnd.mean(rnd(xw * xw), xw.shape[1])
    return rnd(1 / np.sqrt(rnd(ms + rnd.wp.type(eps))))


def rms_norm_forward_none(
    x: np.ndarray, weight: Any, *, eps: float, weight_offset: float, out: Any = None
) -> tuple[np.ndarray, np.ndarray]:
    """``(y, rstd)`` of RMSNorm with every operation rounded to ``x``'s dtype (``casting="none"``):
    ``r = rnd(1/sqrt(rnd(rnd(sum rnd(x^2) / H) + eps)))``, ``y = rnd(rnd(x r) w_e)``."""
    rnd, xw = _none_setup(x, weight)
    rstd = _rms_none_rstd(rnd, xw, eps)
    y = rnd(xw * rstd[:, None])
    w = _none_weight(rnd, weight, weight_offset)
    if w is not None:
        y = rnd(y * w)
    return write_result(y, x.dtype, out), rstd


def rms_norm_backward_none(
    dy: np.ndarray, x: np.ndarray, weight: Any, *, eps: float, weight_offset: float
) -> tuple[np.ndarray, Any]:
    """``(dx, dweight)`` of :func:`rms_norm_forward_none`: ``g = rnd(dy w_e)``, ``c = rnd(sum rnd(g xhat) / H)``,
    ``dx = rnd(r rnd(g - rnd(xhat c)))``, ``dweight = rnd_W(sum rnd(dy xhat))``."""
    rnd, xw = _none_setup(x, weight)
    rstd = _rms_none_rstd(rnd, xw, eps)
    xhat = rnd(xw * rstd[:, None])
    dyw = dy.astype(rnd.wp)
    w = _none_weight(rnd, weight, weight_offset)
    g = rnd(dyw * w) if w is not None else dyw
    c = rnd.mean(rnd(g * xhat), xw.shape[1])
    dx = rnd(rstd[:, None] * rnd(g - rnd(xhat * c[:, None])))
    dweight = rounded(np.add.reduce(rnd(dyw * xhat), axis=0), weight.dtype) if weight is not None else None
    return rounded(dx, x.dtype), dweight
