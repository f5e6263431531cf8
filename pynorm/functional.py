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

from typing import Any

from . import _dispatch
from ._dispatch import FLOAT_DTYPES, Context, check_axis
from .ops import LAYER_NORM, RMS_NORM, check_eps, check_real
from .reference.layer_norm import LayerNormGrads
from .reference.rms_norm import RMSNormGrads

__all__ = [
    "FLOAT_DTYPES",
    "LAYER_NORM",
    "RMS_NORM",
    "Context",
    "LayerNormGrads",
    "RMSNormGrads",
    "check_axis",
    "check_eps",
    "check_real",
    "layer_norm",
    "layer_norm_backward",
    "layer_norm_forward",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_forward",
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
        ``torch.Tensor.std`` that the second source document's code uses.
    eps_mode : ``"var"`` (default) ``1/sqrt(v + eps)``; ``"std"`` ``1/(sqrt(v) + eps)``
        as in both source documents' code.
    weight_offset : ``o`` above; 1.0 gives the zero-centred ``(1 + w)`` of Gemma
        and TransformerEngine's ``zero_centered_gamma``.
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
    options = {"eps": eps, "correction": correction, "eps_mode": eps_mode, "weight_offset": weight_offset}
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
        internal precision.
    out : optional C-contiguous array of ``x``'s shape and dtype to write ``y`` into.
    """
    options = {"eps": eps, "weight_offset": weight_offset}
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
    out: Array | None = None,
) -> Array:
    """RMSNorm of ``x``; see :func:`rms_norm_forward` for the formula and options."""
    return rms_norm_forward(x, weight, axis=axis, eps=eps, backend=backend, weight_offset=weight_offset, out=out)[0]
