"""The functional API: explicit, typed entry points for every op.

Every op ``name`` has three functions: ``name(...) -> y``, ``name_forward(...) -> (y, ctx)`` and
``name_backward(dy, ctx) -> grads``. Each is a few lines over :mod:`pynorm._dispatch`, which
validates the arguments against the op's spec (:mod:`pynorm.ops`) once, before dispatch, picks a
backend through :mod:`pynorm._registry`, flattens ``x`` to ``(rows, hidden)``, calls that backend
and reduces the parameter gradients back to the parameters' shapes. ``ctx`` is a
:class:`Context`; ``backward`` runs on the backend that ran ``forward``.

Shapes follow ONNX's ``axis`` rule: dims ``axis .. ndim-1`` of ``x`` are normalized together
(``axis`` may be negative); parameters have shape ``x.shape[axis:]`` or any shape that broadcasts
to it from the right (e.g. ``(H,)`` for a ``(..., 1, H)`` normalized block). Gradients come back
in each parameter's own shape and dtype.
"""

from __future__ import annotations

import numbers
from typing import Any

import numpy as np

from . import _dispatch
from ._dispatch import FLOAT_DTYPES, Context, check_axis
from .ops import (
    ADD_LAYER_NORM,
    ADD_RMS_NORM,
    CONDITIONAL_LAYER_NORM,
    CONDITIONAL_RMS_NORM,
    DYT,
    LAYER_NORM,
    LAYER_NORM_LINEAR,
    MODALITY_LAYER_NORM,
    MODALITY_RMS_NORM,
    POWER_NORM,
    QUANT_LAYER_NORM,
    RMS_NORM,
    RMS_NORM_LINEAR,
    SCALE_NORM,
    check_eps,
    check_real,
)
from .reference.add_norm import AddLayerNormGrads, AddRMSNormGrads
from .reference.conditional_norm import ConditionalLayerNormGrads, ConditionalRMSNormGrads
from .reference.dyt import DyTGrads
from .reference.layer_norm import LayerNormGrads
from .reference.modality_norm import ModalityLayerNormGrads, ModalityRMSNormGrads
from .reference.norm_linear import LayerNormLinearGrads, RMSNormLinearGrads
from .reference.power_norm import PowerNormGrads
from .reference.quant_norm import QuantLayerNormGrads
from .reference.rms_norm import RMSNormGrads
from .reference.scale_norm import ScaleNormGrads

__all__ = [
    "FLOAT_DTYPES",
    "LAYER_NORM",
    "RMS_NORM",
    "AddLayerNormGrads",
    "AddRMSNormGrads",
    "ConditionalLayerNormGrads",
    "ConditionalRMSNormGrads",
    "Context",
    "DyTGrads",
    "LayerNormGrads",
    "LayerNormLinearGrads",
    "ModalityLayerNormGrads",
    "ModalityRMSNormGrads",
    "PowerNormGrads",
    "QuantLayerNormGrads",
    "RMSNormGrads",
    "RMSNormLinearGrads",
    "ScaleNormGrads",
    "add_layer_norm",
    "add_layer_norm_backward",
    "add_layer_norm_forward",
    "add_rms_norm",
    "add_rms_norm_backward",
    "add_rms_norm_forward",
    "check_axis",
    "check_eps",
    "check_real",
    "conditional_layer_norm",
    "conditional_layer_norm_backward",
    "conditional_layer_norm_forward",
    "conditional_rms_norm",
    "conditional_rms_norm_backward",
    "conditional_rms_norm_forward",
    "dyt",
    "dyt_backward",
    "dyt_forward",
    "layer_norm",
    "layer_norm_backward",
    "layer_norm_forward",
    "layer_norm_linear",
    "layer_norm_linear_backward",
    "layer_norm_linear_forward",
    "modality_layer_norm",
    "modality_layer_norm_backward",
    "modality_layer_norm_forward",
    "modality_rms_norm",
    "modality_rms_norm_backward",
    "modality_rms_norm_forward",
    "power_norm",
    "power_norm_backward",
    "power_norm_forward",
    "quant_layer_norm",
    "quant_layer_norm_backward",
    "quant_layer_norm_forward",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_forward",
    "rms_norm_linear",
    "rms_norm_linear_backward",
    "rms_norm_linear_forward",
    "scale_norm",
    "scale_norm_backward",
    "scale_norm_forward",
]

Array = Any  # numpy.ndarray, cupy.ndarray, or another backend's array type


# ---------------------------------------------------------------------------
# LayerNorm


def layer_norm_forward(
    x: Array,
    weight: Array | None = None,
    bias: Array | None = None,
    *,
    axis: int = -1,
    eps: float = 1e-5,
    backend: str | None = None,
    correction: int = 0,
    eps_mode: str = "var",
    weight_offset: float = 0.0,
    casting: str = "fp32",
    out: Array | None = None,
) -> tuple[Array, Context]:
    r"""LayerNorm forward; returns ``(y, ctx)`` for :func:`layer_norm_backward`.

    .. math::

        \mu = \mathrm{mean}(x), \quad v = \frac{\sum (x - \mu)^2}{H - c}, \quad
        y = \frac{x - \mu}{\sqrt{v + \epsilon}}\,(w + o) + b

    over the normalized dims ``x.shape[axis:]`` (``H`` elements per row).

    Parameters
    ----------
    x : array of dtype float16, bfloat16, float32 or float64, at least 1-D.
    weight, bias : optional arrays of shape ``x.shape[axis:]`` (or broadcastable
        to it from the right), any of the four float dtypes.
    axis : first normalized axis (ONNX semantics), may be negative. Default -1.
    eps : added to the variance inside the root (default 1e-5, PyTorch/ONNX); >= 0.
    backend : force a backend by name (see :func:`pynorm.list_backends`).
    correction : 0 (default) biased variance; 1 the unbiased ``x.std()`` of
        ``torch.Tensor.std``, which tutorial LayerNorms often call.
    eps_mode : ``"var"`` (default) ``1/sqrt(v + eps)``; ``"std"`` ``1/(sqrt(v) + eps)``
        as in many tutorial LayerNorms.
    weight_offset : ``o`` above; 1.0 gives the zero-centred ``(1 + w)`` of Gemma
        and TransformerEngine's ``zero_centered_gamma``.
    casting : where intermediate values are rounded (:mod:`pynorm.reference.casting`):
        ``"fp32"`` (default: all math in float32 or wider, one rounding -- PyTorch,
        TransformerEngine), ``"llama"`` (the normalized value rounded to ``x``'s dtype, then
        times the weight: HF ``LlamaRMSNorm``), ``"gemma"`` (``(w + o)`` in float32, one
        rounding: HF ``GemmaRMSNorm``), ``"t5"`` (the normalized value rounded to a 16-bit
        *weight's* dtype: HF ``T5LayerNorm``), ``"apex"`` (forward as ``"llama"``, backward
        as ``"fp32"``: NVIDIA Apex), ``"none"`` (every operation in ``x``'s dtype). The
        backward follows the same sequence.
    out : optional C-contiguous array of ``x``'s shape and dtype to write ``y`` into.

    Returns
    -------
    y : array of ``x``'s shape and dtype (rounded once from the internal precision).
    ctx : :class:`Context` holding ``x``, the parameters and per-row mean and rstd.

    Notes
    -----
    The reference backend computes in float64 (extended precision for float64
    input) and rounds once; see ``docs/numerics.md`` for the accuracy promise.
    """
    options = {
        "eps": eps, "correction": correction, "eps_mode": eps_mode, "weight_offset": weight_offset, "casting": casting,
    }  # fmt: skip
    return _dispatch.forward(LAYER_NORM, x, (weight, bias), axis=axis, backend=backend, out=out, options=options)


def layer_norm_backward(dy: Array, ctx: Context, *, dx_out: Array | None = None) -> LayerNormGrads:
    r"""LayerNorm backward: ``LayerNormGrads(dx, dweight, dbias)`` for upstream gradient ``dy``.

    With :math:`\hat x = (x - \mu) r`, :math:`g = dy\,(w + o)` and :math:`n = H - c`:

    .. math::

        dx = r\,\big(g - \bar g - \hat x\, \textstyle\sum g \hat x / n\big), \quad
        dw = \textstyle\sum_{rows} dy\, \hat x, \quad db = \textstyle\sum_{rows} dy

    (``eps_mode="std"`` divides the last term of ``dx`` by :math:`s r` instead;
    see :mod:`pynorm.reference.layer_norm`). ``dweight``/``dbias`` are None where
    forward had no weight/bias; they have the parameters' shapes and dtypes.
    ``dy`` must have ``x``'s shape and dtype. ``dx_out`` optionally receives ``dx``.
    """
    return _dispatch.backward(LAYER_NORM, dy, ctx, dx_out)  # type: ignore[no-any-return]


def layer_norm(
    x: Array,
    weight: Array | None = None,
    bias: Array | None = None,
    *,
    axis: int = -1,
    eps: float = 1e-5,
    backend: str | None = None,
    correction: int = 0,
    eps_mode: str = "var",
    weight_offset: float = 0.0,
    casting: str = "fp32",
    out: Array | None = None,
) -> Array:
    """LayerNorm of ``x``; see :func:`layer_norm_forward` for the formula and options."""
    return layer_norm_forward(
        x,
        weight,
        bias,
        axis=axis,
        eps=eps,
        backend=backend,
        correction=correction,
        eps_mode=eps_mode,
        weight_offset=weight_offset,
        casting=casting,
        out=out,
    )[0]


# ---------------------------------------------------------------------------
# RMSNorm


def rms_norm_forward(
    x: Array,
    weight: Array | None = None,
    *,
    axis: int = -1,
    eps: float = 1e-6,
    backend: str | None = None,
    weight_offset: float = 0.0,
    casting: str = "fp32",
    out: Array | None = None,
) -> tuple[Array, Context]:
    r"""RMSNorm forward; returns ``(y, ctx)`` for :func:`rms_norm_backward`.

    .. math::

        r = \Big(\frac{1}{H}\sum x^2 + \epsilon\Big)^{-1/2}, \qquad y = x\, r\, (w + o)

    over the normalized dims ``x.shape[axis:]``.

    Parameters
    ----------
    x : array of dtype float16, bfloat16, float32 or float64, at least 1-D.
    weight : optional array of shape ``x.shape[axis:]`` (or broadcastable to it).
    axis : first normalized axis (ONNX semantics). Default -1.
    eps : inside the root; default 1e-6 (Hugging Face Llama, Liger). PyTorch's
        ``F.rms_norm(eps=None)`` uses ``finfo(float32).eps`` instead; pass it
        explicitly to match.
    backend : force a backend by name.
    weight_offset : ``o`` above; 1.0 gives Gemma's ``(1 + w)``, computed in the
        internal precision (in float32 with ``casting="gemma"``).
    casting : where intermediate values are rounded: ``"fp32"`` (default), ``"llama"``, ``"gemma"``,
        ``"t5"``, ``"apex"`` or ``"none"``, as for :func:`layer_norm_forward`.
    out : optional C-contiguous array of ``x``'s shape and dtype to write ``y`` into.
    """
    options = {"eps": eps, "weight_offset": weight_offset, "casting": casting}
    return _dispatch.forward(RMS_NORM, x, (weight,), axis=axis, backend=backend, out=out, options=options)


def rms_norm_backward(dy: Array, ctx: Context, *, dx_out: Array | None = None) -> RMSNormGrads:
    r"""RMSNorm backward: ``RMSNormGrads(dx, dweight)``.

    With :math:`\hat x = x r` and :math:`g = dy\,(w + o)`:

    .. math::

        dx = r\,\big(g - \hat x\, \tfrac{1}{H}\textstyle\sum g \hat x\big), \qquad
        dw = \textstyle\sum_{rows} dy\, \hat x
    """
    return _dispatch.backward(RMS_NORM, dy, ctx, dx_out)  # type: ignore[no-any-return]


def rms_norm(
    x: Array,
    weight: Array | None = None,
    *,
    axis: int = -1,
    eps: float = 1e-6,
    backend: str | None = None,
    weight_offset: float = 0.0,
    casting: str = "fp32",
    out: Array | None = None,
) -> Array:
    """RMSNorm of ``x``; see :func:`rms_norm_forward` for the formula and options."""
    return rms_norm_forward(
        x, weight, axis=axis, eps=eps, backend=backend, weight_offset=weight_offset, casting=casting, out=out
    )[0]


# ---------------------------------------------------------------------------
# ScaleNorm


def scale_norm_forward(
    x: Array,
    g: Array | None = None,
    *,
    axis: int = -1,
    eps: float = 1e-5,
    eps_mode: str = "floor",
    backend: str | None = None,
    out: Array | None = None,
) -> tuple[Array, Context]:
    r"""ScaleNorm forward (Nguyen & Salazar 2019); returns ``(y, ctx)`` for :func:`scale_norm_backward`.

    .. math::

        y = g\,\frac{x}{\max(\lVert x\rVert_2, \epsilon)} \quad (\texttt{eps\_mode="floor"}), \qquad
        y = g\,\frac{x}{\sqrt{\lVert x\rVert_2^2 + \epsilon}} \quad (\texttt{"root"})

    over the normalized dims ``x.shape[axis:]``.

    Parameters
    ----------
    x : float16, bfloat16, float32 or float64 array, at least 1-D.
    g : the learnable scalar, a 0-d or ``(1,)`` array (None means 1).
    axis : first normalized axis (ONNX semantics). Default -1.
    eps : the floor of the norm (default 1e-5, the authors' code), or what is added to its square.
    eps_mode : ``"floor"`` (default) or ``"root"``.
    backend, out : as for :func:`layer_norm_forward`.

    Notes
    -----
    The norm is computed without overflow for magnitudes up to the dtype's max. Gradient: see
    :func:`scale_norm_backward`; below the floor ``y = g x / eps`` is linear in ``x``.
    """
    options = {"eps": eps, "eps_mode": eps_mode}
    return _dispatch.forward(SCALE_NORM, x, (g,), axis=axis, backend=backend, out=out, options=options)


def scale_norm_backward(dy: Array, ctx: Context, *, dx_out: Array | None = None) -> ScaleNormGrads:
    r"""ScaleNorm backward: ``ScaleNormGrads(dx, dg)``.

    With :math:`r` the row's factor, :math:`\hat x = x r`, :math:`G = g\,dy`: where the norm is active
    (``"root"``, or ``"floor"`` with :math:`\lVert x\rVert \ge \epsilon`)
    :math:`dx = r\,(G - \hat x \sum G \hat x)`; on the floor branch (:math:`\lVert x\rVert < \epsilon`)
    :math:`dx = r\,G`; :math:`dg = \sum dy\,\hat x`. At :math:`\lVert x\rVert = \epsilon` exactly the
    norm branch's gradient is used (the one-sided derivative from above).
    """
    return _dispatch.backward(SCALE_NORM, dy, ctx, dx_out)  # type: ignore[no-any-return]


def scale_norm(
    x: Array,
    g: Array | None = None,
    *,
    axis: int = -1,
    eps: float = 1e-5,
    eps_mode: str = "floor",
    backend: str | None = None,
    out: Array | None = None,
) -> Array:
    """ScaleNorm of ``x``; see :func:`scale_norm_forward`."""
    return scale_norm_forward(x, g, axis=axis, eps=eps, eps_mode=eps_mode, backend=backend, out=out)[0]


# ---------------------------------------------------------------------------
# PowerNorm (the signed power)


def power_norm_forward(
    x: Array,
    weight: Array | None = None,
    bias: Array | None = None,
    *,
    p: float = 0.5,
    axis: int = -1,
    backend: str | None = None,
    out: Array | None = None,
) -> tuple[Array, Context]:
    r"""The signed-power "PowerNorm" of normalization tutorials: ``y = w * sign(x) * |x|**p + b``, element-wise.

    ``axis`` only fixes the parameters' shape (``x.shape[axis:]``); ``p > 0`` is a finite
    hyperparameter (default 0.5). This is **not** Shen et al.'s 2020 PowerNorm (a batch norm with
    running quadratic means, see ``docs/norms/power_norm.md``): no library implements this signed-power form.

    Returns ``(y, ctx)`` for :func:`power_norm_backward`.
    """
    return _dispatch.forward(POWER_NORM, x, (weight, bias), axis=axis, backend=backend, out=out, options={"p": p})


def power_norm_backward(dy: Array, ctx: Context, *, dx_out: Array | None = None) -> PowerNormGrads:
    r"""PowerNorm backward: ``PowerNormGrads(dx, dweight, dbias)``.

    :math:`dx = w\,p\,\lvert x\rvert^{p-1} dy` for :math:`x \ne 0`; at :math:`x = 0` the value 0 is
    used for :math:`p < 1` (the derivative is infinite there: a subgradient choice), ``w dy`` for
    :math:`p = 1`, 0 for :math:`p > 1`; where the exact ``dx`` exceeds ``x``'s dtype it saturates at
    the largest finite value. :math:`dw = \sum_{rows} dy\,\mathrm{sign}(x)\lvert x\rvert^p`,
    :math:`db = \sum_{rows} dy`.
    """
    return _dispatch.backward(POWER_NORM, dy, ctx, dx_out)  # type: ignore[no-any-return]


def power_norm(
    x: Array,
    weight: Array | None = None,
    bias: Array | None = None,
    *,
    p: float = 0.5,
    axis: int = -1,
    backend: str | None = None,
    out: Array | None = None,
) -> Array:
    """The signed-power PowerNorm of ``x``; see :func:`power_norm_forward`."""
    return power_norm_forward(x, weight, bias, p=p, axis=axis, backend=backend, out=out)[0]


# ---------------------------------------------------------------------------
# DyT


def dyt_forward(
    x: Array,
    alpha: Array,
    weight: Array | None = None,
    bias: Array | None = None,
    *,
    axis: int = -1,
    backend: str | None = None,
    out: Array | None = None,
) -> tuple[Array, Context]:
    r"""DyT ("Transformers without Normalization", 2025): ``y = w * tanh(alpha * x) + b``, element-wise.

    ``alpha`` is a learnable scalar (a 0-d or ``(1,)`` array, finite; the paper starts it at 0.5);
    ``weight``/``bias`` per-feature (shape ``x.shape[axis:]``). Returns ``(y, ctx)`` for
    :func:`dyt_backward`.
    """
    return _dispatch.forward(DYT, x, (alpha, weight, bias), axis=axis, backend=backend, out=out, options={})


def dyt_backward(dy: Array, ctx: Context, *, dx_out: Array | None = None) -> DyTGrads:
    r"""DyT backward: ``DyTGrads(dx, dalpha, dweight, dbias)``.

    With :math:`z = \alpha x`, :math:`G = w\,dy`: :math:`dx = \alpha\,\mathrm{sech}^2(z)\,G`,
    :math:`d\alpha = \sum x\,\mathrm{sech}^2(z)\,G`, :math:`dw = \sum_{rows} dy\tanh z`,
    :math:`db = \sum_{rows} dy`; :math:`\mathrm{sech}^2 z` is computed without cancellation
    (:math:`4s/(1+s)^2`, :math:`s = e^{-2|z|}`), accurate where ``tanh`` saturates.
    """
    return _dispatch.backward(DYT, dy, ctx, dx_out)  # type: ignore[no-any-return]


def dyt(
    x: Array,
    alpha: Array,
    weight: Array | None = None,
    bias: Array | None = None,
    *,
    axis: int = -1,
    backend: str | None = None,
    out: Array | None = None,
) -> Array:
    """DyT of ``x``; see :func:`dyt_forward`."""
    return dyt_forward(x, alpha, weight, bias, axis=axis, backend=backend, out=out)[0]


# ---------------------------------------------------------------------------
# fused residual add + norm


def add_layer_norm_forward(
    x: Array,
    residual: Array,
    weight: Array | None = None,
    bias: Array | None = None,
    *,
    alpha: float = 1.0,
    residual_dtype: Any = None,
    axis: int = -1,
    eps: float = 1e-5,
    backend: str | None = None,
    correction: int = 0,
    eps_mode: str = "var",
    weight_offset: float = 0.0,
    out: Array | None = None,
) -> tuple[tuple[Array, Array], Context]:
    r"""Fused residual add + LayerNorm: ``h = x + alpha * residual``, ``y = layer_norm(h)``; ``((y, h), ctx)``.

    ``h`` is rounded once to ``residual_dtype`` (default ``x``'s dtype; ``"float32"`` keeps the
    residual stream in fp32 for half inputs, as flash-attention's ``residual_in_fp32``) and the
    norm is that of the rounded ``h`` -- bitwise what the unfused two steps give. ``alpha`` is a
    float (DeepNorm's up-weighted skip). Every LayerNorm convention applies (see
    :func:`layer_norm_forward`); ``residual`` has ``x``'s shape and any float dtype. ``y`` has
    ``x``'s dtype; ``out`` receives ``y``.
    """
    options = {
        "eps": eps, "correction": correction, "eps_mode": eps_mode, "weight_offset": weight_offset,
        "alpha": alpha, "residual_dtype": residual_dtype,
    }  # fmt: skip
    return _dispatch.forward(  # type: ignore[return-value]
        ADD_LAYER_NORM, x, (weight, bias), inputs=(residual,), axis=axis, backend=backend, out=out, options=options
    )


def add_layer_norm_backward(
    dy: Array, ctx: Context, dh: Array | None = None, *, dx_out: Array | None = None
) -> AddLayerNormGrads:
    r"""Backward of the fused add + LayerNorm: ``AddLayerNormGrads(dx, dresidual, dweight, dbias)``.

    ``dh`` is the gradient arriving at ``h`` from later layers (None: none). With
    :math:`g_h = \mathrm{LN}'(h)^T dy + dh`: :math:`dx = g_h`, :math:`d\,\mathrm{residual} = \alpha\,g_h`
    (each rounded once to its input's dtype); ``dweight``/``dbias`` as for :func:`layer_norm_backward`.
    """
    return _dispatch.backward(ADD_LAYER_NORM, dy, ctx, dx_out, {"dh": dh})  # type: ignore[no-any-return]


def add_layer_norm(
    x: Array,
    residual: Array,
    weight: Array | None = None,
    bias: Array | None = None,
    *,
    alpha: float = 1.0,
    residual_dtype: Any = None,
    axis: int = -1,
    eps: float = 1e-5,
    backend: str | None = None,
    correction: int = 0,
    eps_mode: str = "var",
    weight_offset: float = 0.0,
    out: Array | None = None,
) -> tuple[Array, Array]:
    """``(y, h)`` of the fused residual add + LayerNorm; see :func:`add_layer_norm_forward`."""
    return add_layer_norm_forward(
        x, residual, weight, bias, alpha=alpha, residual_dtype=residual_dtype, axis=axis, eps=eps, backend=backend,
        correction=correction, eps_mode=eps_mode, weight_offset=weight_offset, out=out,
    )[0]  # fmt: skip


def add_rms_norm_forward(
    x: Array,
    residual: Array,
    weight: Array | None = None,
    *,
    alpha: float = 1.0,
    residual_dtype: Any = None,
    axis: int = -1,
    eps: float = 1e-6,
    backend: str | None = None,
    weight_offset: float = 0.0,
    out: Array | None = None,
) -> tuple[tuple[Array, Array], Context]:
    r"""Fused residual add + RMSNorm: ``h = x + alpha * residual``, ``y = rms_norm(h)``; ``((y, h), ctx)``.

    As :func:`add_layer_norm_forward`, with the RMSNorm conventions of :func:`rms_norm_forward`.
    """
    options = {"eps": eps, "weight_offset": weight_offset, "alpha": alpha, "residual_dtype": residual_dtype}
    return _dispatch.forward(  # type: ignore[return-value]
        ADD_RMS_NORM, x, (weight,), inputs=(residual,), axis=axis, backend=backend, out=out, options=options
    )


def add_rms_norm_backward(
    dy: Array, ctx: Context, dh: Array | None = None, *, dx_out: Array | None = None
) -> AddRMSNormGrads:
    r"""Backward of the fused add + RMSNorm: ``AddRMSNormGrads(dx, dresidual, dweight)``; see
    :func:`add_layer_norm_backward` for ``dh``."""
    return _dispatch.backward(ADD_RMS_NORM, dy, ctx, dx_out, {"dh": dh})  # type: ignore[no-any-return]


def add_rms_norm(
    x: Array,
    residual: Array,
    weight: Array | None = None,
    *,
    alpha: float = 1.0,
    residual_dtype: Any = None,
    axis: int = -1,
    eps: float = 1e-6,
    backend: str | None = None,
    weight_offset: float = 0.0,
    out: Array | None = None,
) -> tuple[Array, Array]:
    """``(y, h)`` of the fused residual add + RMSNorm; see :func:`add_rms_norm_forward`."""
    return add_rms_norm_forward(
        x, residual, weight, alpha=alpha, residual_dtype=residual_dtype, axis=axis, eps=eps, backend=backend,
        weight_offset=weight_offset, out=out,
    )[0]  # fmt: skip


# ---------------------------------------------------------------------------
# modality norms


def modality_layer_norm_forward(
    x: Array,
    modality_ids: Array,
    weight: Array,
    bias: Array | None = None,
    *,
    axis: int = -1,
    eps: float = 1e-5,
    backend: str | None = None,
    correction: int = 0,
    eps_mode: str = "var",
    weight_offset: float = 0.0,
    out: Array | None = None,
) -> tuple[Array, Context]:
    r"""Modality-specific LayerNorm: row ``i`` uses row ``modality_ids[i]`` of the parameter tables.

    .. math::

        y_i = \hat x_i\,(w_{\mathrm{ids}_i} + o) + b_{\mathrm{ids}_i}

    ``weight``/``bias`` have shape ``(M, *x.shape[axis:])``; ``modality_ids`` is an integer array
    of shape ``x.shape[:axis]`` with values in ``[0, M)``. Every LayerNorm convention applies.
    Returns ``(y, ctx)`` for :func:`modality_layer_norm_backward`.
    """
    options = {"eps": eps, "correction": correction, "eps_mode": eps_mode, "weight_offset": weight_offset}
    return _dispatch.forward(
        MODALITY_LAYER_NORM, x, (weight, bias), inputs=(modality_ids,), axis=axis, backend=backend, out=out,
        options=options,
    )  # fmt: skip


def modality_layer_norm_backward(dy: Array, ctx: Context, *, dx_out: Array | None = None) -> ModalityLayerNormGrads:
    r"""Backward of the modality LayerNorm: ``(dx, dweight, dbias)``, the table gradients summed per
    modality in a fixed order (deterministic), rows of unused modalities 0."""
    return _dispatch.backward(MODALITY_LAYER_NORM, dy, ctx, dx_out)  # type: ignore[no-any-return]


def modality_layer_norm(
    x: Array,
    modality_ids: Array,
    weight: Array,
    bias: Array | None = None,
    *,
    axis: int = -1,
    eps: float = 1e-5,
    backend: str | None = None,
    correction: int = 0,
    eps_mode: str = "var",
    weight_offset: float = 0.0,
    out: Array | None = None,
) -> Array:
    """The modality LayerNorm of ``x``; see :func:`modality_layer_norm_forward`."""
    return modality_layer_norm_forward(
        x, modality_ids, weight, bias, axis=axis, eps=eps, backend=backend, correction=correction,
        eps_mode=eps_mode, weight_offset=weight_offset, out=out,
    )[0]  # fmt: skip


def modality_rms_norm_forward(
    x: Array,
    modality_ids: Array,
    weight: Array,
    *,
    axis: int = -1,
    eps: float = 1e-6,
    backend: str | None = None,
    weight_offset: float = 0.0,
    out: Array | None = None,
) -> tuple[Array, Context]:
    r"""Modality-specific RMSNorm: row ``i`` uses row ``modality_ids[i]`` of the ``(M, *x.shape[axis:])``
    weight table; see :func:`modality_layer_norm_forward` and :func:`rms_norm_forward`."""
    options = {"eps": eps, "weight_offset": weight_offset}
    return _dispatch.forward(
        MODALITY_RMS_NORM, x, (weight,), inputs=(modality_ids,), axis=axis, backend=backend, out=out,
        options=options,
    )  # fmt: skip


def modality_rms_norm_backward(dy: Array, ctx: Context, *, dx_out: Array | None = None) -> ModalityRMSNormGrads:
    """Backward of the modality RMSNorm: ``(dx, dweight)``, ``dweight`` summed per modality."""
    return _dispatch.backward(MODALITY_RMS_NORM, dy, ctx, dx_out)  # type: ignore[no-any-return]


def modality_rms_norm(
    x: Array,
    modality_ids: Array,
    weight: Array,
    *,
    axis: int = -1,
    eps: float = 1e-6,
    backend: str | None = None,
    weight_offset: float = 0.0,
    out: Array | None = None,
) -> Array:
    """The modality RMSNorm of ``x``; see :func:`modality_rms_norm_forward`."""
    return modality_rms_norm_forward(
        x, modality_ids, weight, axis=axis, eps=eps, backend=backend, weight_offset=weight_offset, out=out
    )[0]


# ---------------------------------------------------------------------------
# conditional LayerNorm / RMSNorm (adaLN)


def conditional_layer_norm_forward(
    x: Array,
    cond: Array,
    W: Array,
    c: Array | None = None,
    *,
    zero_centered: bool = False,
    axis: int = -1,
    eps: float = 1e-5,
    backend: str | None = None,
    correction: int = 0,
    eps_mode: str = "var",
    out: Array | None = None,
) -> tuple[Array, Context]:
    r"""Conditional LayerNorm forward (adaLN); returns ``(y, ctx)`` for :func:`conditional_layer_norm_backward`.

    .. math::

        [\gamma, \beta] = \mathrm{cond}\,W^T + c, \qquad
        y = \hat x\,(\gamma + o) + \beta, \quad \hat x = \frac{x - \mu}{\sqrt{v + \epsilon}}

    with ``o = 1`` for ``zero_centered=True`` (the ``(1 + scale)`` of diffusion transformers), else 0, and
    :math:`\hat x` LayerNorm's (:func:`layer_norm_forward`, its ``correction`` and ``eps_mode``).

    Parameters
    ----------
    x : float array, at least 1-D; ``H`` = the number of elements of ``x.shape[axis:]``.
    cond : float array of conditioning vectors of ``C`` features. **Broadcast rule**: ``cond.shape[:-1]`` is
        ``x.shape[:axis]`` (one vector per row of ``x``), or a leading part ``x.shape[:k]`` with ``k < axis``,
        optionally followed by size-1 dims (one vector per sample, shared by the rows of ``x.shape[k:axis]``:
        ``(B, C)`` or ``(B, 1, C)`` for ``x`` of ``(B, T, H)``). Anything else is a ``ShapeError``.
    W : ``(2H, C)`` array (a torch ``Linear(C, 2H)`` weight): rows ``:H`` give ``gamma``, ``H:`` ``beta``.
    c : optional ``(2H,)`` bias of the projection.
    zero_centered, axis, eps, correction, eps_mode, backend, out : as above and for :func:`layer_norm_forward`.

    Returns
    -------
    y : ``x``'s shape and dtype. ctx : :class:`Context` (``x``, ``cond``, ``W``, ``c``, per-row statistics;
    on a composite backend the modality norm's ctx, whose tables hold ``gamma``/``beta`` per cond row).
    """
    options = {"eps": eps, "correction": correction, "eps_mode": eps_mode, "zero_centered": zero_centered}
    return _dispatch.forward(
        CONDITIONAL_LAYER_NORM, x, (W, c), axis=axis, backend=backend, out=out, options=options, inputs=(cond,)
    )


def conditional_layer_norm_backward(
    dy: Array, ctx: Context, *, dx_out: Array | None = None
) -> ConditionalLayerNormGrads:
    r"""Conditional LayerNorm backward: ``ConditionalLayerNormGrads(dx, dcond, dW, dc)``.

    ``dx`` is LayerNorm's with the row's own scale :math:`\gamma + o`; with
    :math:`d\gamma_g = \sum_{i \in g} dy_i \hat x_i`, :math:`d\beta_g = \sum_{i \in g} dy_i` over the rows
    ``i`` that cond row ``g`` serves and :math:`dP = [d\gamma, d\beta]`:

    .. math::

        d\,\mathrm{cond} = dP\,W, \qquad dW = dP^T \mathrm{cond}, \qquad dc = \textstyle\sum_g dP_g

    so ``dcond`` has ``cond``'s shape (summed over the broadcast rows); ``dc`` is None without ``c``.
    """
    return _dispatch.backward(CONDITIONAL_LAYER_NORM, dy, ctx, dx_out)  # type: ignore[no-any-return]


def conditional_layer_norm(
    x: Array,
    cond: Array,
    W: Array,
    c: Array | None = None,
    *,
    zero_centered: bool = False,
    axis: int = -1,
    eps: float = 1e-5,
    backend: str | None = None,
    correction: int = 0,
    eps_mode: str = "var",
    out: Array | None = None,
) -> Array:
    """Conditional LayerNorm of ``x``; see :func:`conditional_layer_norm_forward`."""
    return conditional_layer_norm_forward(
        x, cond, W, c, zero_centered=zero_centered, axis=axis, eps=eps, backend=backend, correction=correction,
        eps_mode=eps_mode, out=out,
    )[0]  # fmt: skip


def conditional_rms_norm_forward(
    x: Array,
    cond: Array,
    W: Array,
    c: Array | None = None,
    *,
    shift: bool = True,
    zero_centered: bool = False,
    axis: int = -1,
    eps: float = 1e-6,
    backend: str | None = None,
    out: Array | None = None,
) -> tuple[Array, Context]:
    r"""Conditional RMSNorm forward; returns ``(y, ctx)`` for :func:`conditional_rms_norm_backward`.

    .. math::

        [\gamma, \beta] = \mathrm{cond}\,W^T + c, \qquad
        y = \frac{x}{\sqrt{\mathrm{mean}(x^2) + \epsilon}}\,(\gamma + o) + \beta

    With ``shift=False`` ``W`` is ``(H, C)``, ``c`` ``(H,)`` and there is no :math:`\beta` (Liger's modulated
    RMSNorm). ``o``, ``cond``'s broadcast rule and the other arguments as for
    :func:`conditional_layer_norm_forward`.
    """
    options = {"eps": eps, "shift": shift, "zero_centered": zero_centered}
    return _dispatch.forward(
        CONDITIONAL_RMS_NORM, x, (W, c), axis=axis, backend=backend, out=out, options=options, inputs=(cond,)
    )


def conditional_rms_norm_backward(dy: Array, ctx: Context, *, dx_out: Array | None = None) -> ConditionalRMSNormGrads:
    r"""Conditional RMSNorm backward: ``ConditionalRMSNormGrads(dx, dcond, dW, dc)``.

    ``dx`` is RMSNorm's with the row's scale :math:`\gamma + o`; ``dP = [d\gamma, d\beta]`` (``[d\gamma]`` with
    ``shift=False``) summed per cond row, ``dcond = dP W``, ``dW = dP^T cond``, ``dc = sum_g dP_g``.
    """
    return _dispatch.backward(CONDITIONAL_RMS_NORM, dy, ctx, dx_out)  # type: ignore[no-any-return]


def conditional_rms_norm(
    x: Array,
    cond: Array,
    W: Array,
    c: Array | None = None,
    *,
    shift: bool = True,
    zero_centered: bool = False,
    axis: int = -1,
    eps: float = 1e-6,
    backend: str | None = None,
    out: Array | None = None,
) -> Array:
    """Conditional RMSNorm of ``x``; see :func:`conditional_rms_norm_forward`."""
    return conditional_rms_norm_forward(
        x, cond, W, c, shift=shift, zero_centered=zero_centered, axis=axis, eps=eps, backend=backend, out=out
    )[0]


# ---------------------------------------------------------------------------
# quantization-friendly LayerNorm


def quant_layer_norm_forward(
    x: Array,
    weight: Array | None = None,
    bias: Array | None = None,
    *,
    x_scale: Array | float | None = None,
    quantize: str | None = None,
    out_scale: float | None = None,
    axis: int = -1,
    eps: float = 1e-5,
    backend: str | None = None,
    correction: int = 0,
    eps_mode: str = "var",
    weight_offset: float = 0.0,
    out: Array | None = None,
) -> tuple[Any, Context]:
    r"""Quantization-friendly LayerNorm forward (int8 in and out, to sit between int8 matrix products).

    .. math::

        \tilde x = x \cdot s_x, \quad y = \mathrm{LayerNorm}(\tilde x)\,(w + o) + b, \quad
        q = \mathrm{clip}(\mathrm{round\_half\_even}(y / s), -127, 127)

    Parameters
    ----------
    x : int8 array with ``x_scale`` (the real input is ``x * x_scale``), or a float array (float16,
        bfloat16, float32, float64) without it.
    weight, bias : optional arrays of shape ``x.shape[axis:]`` (or broadcastable to it), as LayerNorm's.
    x_scale : for an int8 ``x``: a positive scalar (Python float, 0-d or ``(1,)`` array) or one positive
        scale per row (an array of ``x.shape[:axis]``).
    quantize : None (default: float output), ``"tensor"`` (int8 output, one scale ``s = amax / 127`` for
        the tensor) or ``"row"`` (one per row).
    out_scale : a given positive output scale (rounded to float32): int8 output ``clip(rint(y / s))``,
        values beyond ``127.5 s`` clip. With ``quantize=None`` or ``"tensor"``.
    axis, eps, backend, correction, eps_mode, weight_offset : as :func:`layer_norm_forward`.
    out : optional C-contiguous array for the first output (its shape and dtype).

    Returns
    -------
    result : float ``y`` (``x``'s dtype for a float ``x``, float32 for an int8 ``x``), or when quantizing
        the pair ``(q, s)``: ``q`` int8 of ``x``'s shape, ``s`` float32 of shape ``x.shape[:axis]``
        (``"row"``) or ``()`` (per tensor).
    ctx : :class:`Context` for :func:`quant_layer_norm_backward`.

    Notes
    -----
    A float ``x`` is normalized exactly as :func:`layer_norm` (bitwise its output), then quantized. An
    int8 ``x`` has exact integer row sums and a fixed float64 sequence after them, so its outputs (float
    or int8) are bitwise identical on every backend. ``s = 1`` where ``amax`` is 0 or not finite.
    Formulas: :mod:`pynorm.reference.quant_norm`, ``docs/norms/quant_layer_norm.md``.
    """
    options = {
        "eps": eps, "correction": correction, "eps_mode": eps_mode, "weight_offset": weight_offset,
        "quantize": quantize, "out_scale": out_scale,
    }  # fmt: skip
    if isinstance(x_scale, numbers.Real) and not isinstance(x_scale, bool):  # a Python scalar: in x's array module
        x = _dispatch.as_array(x, "x")  # (a DLPack exporter's view first)
        xp = _dispatch.xp_of(x)
        x_scale = xp.asarray(float(x_scale), dtype=np.float64)
    res, ctx = _dispatch.forward(
        QUANT_LAYER_NORM, x, (weight, bias), axis=axis, backend=backend, out=out, options=options, inputs=(x_scale,)
    )
    scale = ctx.inner.scale
    if scale is None:
        return res, ctx
    shape = tuple(ctx.x_shape[: ctx.axis]) if quantize == "row" and out_scale is None else ()
    return (res, scale.reshape(shape)), ctx


def quant_layer_norm_backward(dy: Array, ctx: Context, *, dx_out: Array | None = None) -> QuantLayerNormGrads:
    r"""Backward of :func:`quant_layer_norm_forward`: ``QuantLayerNormGrads(dx, dweight, dbias)``.

    ``dy`` is the gradient w.r.t. the dequantized output ``q * s`` (or ``y``): float32 for an int8 ``x``,
    ``x``'s dtype otherwise. Straight-through through the rounding (``s`` held constant): ``dy`` passes
    unchanged, but is 0 where a given ``out_scale`` clipped. Then LayerNorm's exact backward
    (:func:`layer_norm_backward`) at the real input: ``dx`` is w.r.t. ``x * x_scale`` (float32 for int8).
    """
    return _dispatch.backward(QUANT_LAYER_NORM, dy, ctx, dx_out)  # type: ignore[no-any-return]


def quant_layer_norm(
    x: Array,
    weight: Array | None = None,
    bias: Array | None = None,
    *,
    x_scale: Array | float | None = None,
    quantize: str | None = None,
    out_scale: float | None = None,
    axis: int = -1,
    eps: float = 1e-5,
    backend: str | None = None,
    correction: int = 0,
    eps_mode: str = "var",
    weight_offset: float = 0.0,
    out: Array | None = None,
) -> Any:
    """Quantization-friendly LayerNorm: ``y``, or ``(q, s)`` when quantizing; see :func:`quant_layer_norm_forward`."""
    return quant_layer_norm_forward(
        x, weight, bias, x_scale=x_scale, quantize=quantize, out_scale=out_scale, axis=axis, eps=eps,
        backend=backend, correction=correction, eps_mode=eps_mode, weight_offset=weight_offset, out=out,
    )[0]  # fmt: skip


# ---------------------------------------------------------------------------
# fused norm + Linear


def layer_norm_linear_forward(
    x: Array,
    weight: Array | None,
    bias: Array | None,
    W: Array,
    c: Array | None = None,
    *,
    return_norm: bool = False,
    axis: int = -1,
    eps: float = 1e-5,
    backend: str | None = None,
    correction: int = 0,
    eps_mode: str = "var",
    weight_offset: float = 0.0,
    out: Array | None = None,
) -> tuple[Any, Context]:
    r"""Fused LayerNorm + Linear forward: ``(out, ctx)``, or ``((out, n), ctx)`` with ``return_norm=True``.

    .. math::

        n = \mathrm{layer\_norm}(x; w, b), \qquad \mathrm{out} = n\,W^T + c

    ``weight``, ``bias`` and the conventions are LayerNorm's (:func:`layer_norm_forward`); ``W`` is
    ``(N, H)`` (a torch ``Linear(H, N)`` weight), ``c`` ``(N,)``; ``out`` has shape
    ``x.shape[:axis] + (N,)`` and ``x``'s dtype (``out=`` may receive it). The ctx keeps ``x``, the
    parameters and the per-row statistics -- never ``n``: backward recomputes it.
    """
    options = {"eps": eps, "correction": correction, "eps_mode": eps_mode, "weight_offset": weight_offset}
    (y, n), ctx = _dispatch.forward(
        LAYER_NORM_LINEAR, x, (weight, bias, W, c), axis=axis, backend=backend, out=out, options=options
    )
    return ((y, n) if _flag(return_norm, "return_norm") else y), ctx


def layer_norm_linear_backward(
    dy: Array, ctx: Context, dn: Array | None = None, *, dx_out: Array | None = None
) -> LayerNormLinearGrads:
    r"""Fused LayerNorm + Linear backward: ``LayerNormLinearGrads(dx, dweight, dbias, dW, dc)``.

    ``dy`` is the gradient at ``out`` (its shape); ``dn`` optionally the gradient arriving at a returned
    ``n``. With :math:`n` recomputed from the ctx and :math:`dn_t = dy\,W + dn`: ``dx``, ``dweight``,
    ``dbias`` are LayerNorm's backward of :math:`dn_t`; :math:`dW = dy^T n`, :math:`dc = \sum_{rows} dy`.
    """
    return _dispatch.backward(LAYER_NORM_LINEAR, dy, ctx, dx_out, {"dn": dn})  # type: ignore[no-any-return]


def layer_norm_linear(
    x: Array,
    weight: Array | None,
    bias: Array | None,
    W: Array,
    c: Array | None = None,
    *,
    return_norm: bool = False,
    axis: int = -1,
    eps: float = 1e-5,
    backend: str | None = None,
    correction: int = 0,
    eps_mode: str = "var",
    weight_offset: float = 0.0,
    out: Array | None = None,
) -> Any:
    """``layer_norm(x) @ W.T + c`` (and ``n`` with ``return_norm=True``); see :func:`layer_norm_linear_forward`."""
    return layer_norm_linear_forward(
        x, weight, bias, W, c, return_norm=return_norm, axis=axis, eps=eps, backend=backend, correction=correction,
        eps_mode=eps_mode, weight_offset=weight_offset, out=out,
    )[0]  # fmt: skip


def rms_norm_linear_forward(
    x: Array,
    weight: Array | None,
    W: Array,
    c: Array | None = None,
    *,
    return_norm: bool = False,
    axis: int = -1,
    eps: float = 1e-6,
    backend: str | None = None,
    weight_offset: float = 0.0,
    out: Array | None = None,
) -> tuple[Any, Context]:
    r"""Fused RMSNorm + Linear forward: ``(out, ctx)``, or ``((out, n), ctx)`` with ``return_norm=True``.

    .. math::

        n = \mathrm{rms\_norm}(x; w), \qquad \mathrm{out} = n\,W^T + c

    As :func:`layer_norm_linear_forward`, with RMSNorm's weight and conventions.
    """
    options = {"eps": eps, "weight_offset": weight_offset}
    (y, n), ctx = _dispatch.forward(
        RMS_NORM_LINEAR, x, (weight, W, c), axis=axis, backend=backend, out=out, options=options
    )
    return ((y, n) if _flag(return_norm, "return_norm") else y), ctx


def rms_norm_linear_backward(
    dy: Array, ctx: Context, dn: Array | None = None, *, dx_out: Array | None = None
) -> RMSNormLinearGrads:
    r"""Fused RMSNorm + Linear backward: ``RMSNormLinearGrads(dx, dweight, dW, dc)``; see
    :func:`layer_norm_linear_backward`."""
    return _dispatch.backward(RMS_NORM_LINEAR, dy, ctx, dx_out, {"dn": dn})  # type: ignore[no-any-return]


def rms_norm_linear(
    x: Array,
    weight: Array | None,
    W: Array,
    c: Array | None = None,
    *,
    return_norm: bool = False,
    axis: int = -1,
    eps: float = 1e-6,
    backend: str | None = None,
    weight_offset: float = 0.0,
    out: Array | None = None,
) -> Any:
    """``rms_norm(x) @ W.T + c`` (and ``n`` with ``return_norm=True``); see :func:`rms_norm_linear_forward`."""
    return rms_norm_linear_forward(
        x, weight, W, c, return_norm=return_norm, axis=axis, eps=eps, backend=backend, weight_offset=weight_offset,
        out=out,
    )[0]  # fmt: skip


def _flag(v: Any, name: str) -> bool:
    from .ops.conditional_norm import check_bool

    return check_bool(v, name)
