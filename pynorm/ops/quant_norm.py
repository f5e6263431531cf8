"""The quantization-friendly LayerNorm op: its spec (math in :mod:`pynorm.reference.quant_norm`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ..errors import ArgumentError, ShapeError
from . import layer_norm as _ln
from ._spec import Input, OpSpec, Option, QuantizeVariant, check_scale, one_of

#: the largest magnitude of the symmetric int8 code
QMAX = 127


#: the largest hidden size of an int8 input (``H * S_2`` must fit in int64)
MAX_INT8_HIDDEN = 1 << 24


@dataclass(frozen=True, eq=False)
class QuantLayerNormCtx(_ln.CenteredCtx):
    """What :func:`backward` needs. Every backend fills the same fields (those of
    :class:`~pynorm.ops.layer_norm.CenteredCtx` first).

    Attributes
    ----------
    x : (R, H) array, the input as given (int8 or float).
    weight, bias : (H,) arrays or None.
    mean, rstd : (R,) per-row statistics of the real input (float64 for an int8 ``x``; LayerNorm's
        ctx values for a float ``x``).
    eps, correction, eps_mode, weight_offset : the LayerNorm conventions.
    x_scale : (R,) float64 array, the per-row scale of an int8 ``x`` (None for a float ``x``).
    quantize, out_scale : the output mode (None, ``"row"``, ``"tensor"``; the given scale or None).
    scale : the scale ``s`` of a quantized output: (R,) float32 (``"row"``), (1,) float32 (``"tensor"``
        or ``out_scale``), None for a float output.
    keep : (R, H) bool, False where the output clipped (only with ``out_scale``; None: nowhere).
    """

    x_scale: Any
    quantize: str | None
    out_scale: float | None
    scale: Any
    keep: Any


class QuantLayerNormGrads(NamedTuple):
    """Gradients of the quantization-friendly LayerNorm: ``dx`` w.r.t. the real (dequantized) input."""

    dx: Any
    dweight: Any
    dbias: Any


def quantizing(quantize: str | None, out_scale: float | None) -> bool:
    """Whether the output is int8."""
    return quantize is not None or out_scale is not None


def output_dtype(x_dtype: Any, quantize: str | None, out_scale: float | None) -> np.dtype[Any]:
    """int8 when quantizing; float32 for an int8 input; else ``x``'s dtype."""
    if quantizing(quantize, out_scale):
        return np.dtype(np.int8)
    return np.dtype(np.float32) if np.dtype(x_dtype) == np.int8 else np.dtype(x_dtype)


def grad_dtype(x_dtype: Any) -> np.dtype[Any]:
    """The dtype of ``dy`` and ``dx``: float32 for an int8 input, else ``x``'s dtype."""
    return np.dtype(np.float32) if np.dtype(x_dtype) == np.int8 else np.dtype(x_dtype)


#: None, or a positive finite real whose float32 rounding is a positive finite float32 (returned as that)
check_out_scale = check_scale


def _check(options: Mapping[str, Any], hidden: int) -> None:
    _ln._check(options, hidden)
    if options["out_scale"] is not None and options["quantize"] == "row":
        raise ArgumentError("out_scale is one scale for the whole tensor: use it with quantize=None or 'tensor'")


def _check_arrays(x_shape: tuple[int, ...], axis: int, arrays: Mapping[str, Any], options: Mapping[str, Any]) -> None:
    x, xs = arrays["x"], arrays["x_scale"]
    if np.dtype(x.dtype) == np.int8:
        if xs is None:
            raise ArgumentError("x_scale is required for an int8 x (the real input is x * x_scale)")
        h = math.prod(x_shape[axis:])
        if h >= MAX_INT8_HIDDEN:
            raise ShapeError(f"an int8 x must have fewer than 2**24 normalized elements per row, got {h}")
    elif xs is not None:
        raise ArgumentError(f"x_scale is only for an int8 x, got x of dtype {x.dtype}: pass x_scale=None")


def _output_dtypes(x_dtype: Any, options: Mapping[str, Any]) -> tuple[Any, ...]:
    return (output_dtype(x_dtype, options.get("quantize"), options.get("out_scale")),)


def term_scales(x2: np.ndarray, arrays: Mapping[str, Any], dy2: np.ndarray, options: Mapping[str, Any]) -> dict:
    """LayerNorm's term scales (:func:`pynorm.ops.layer_norm.term_scales`) at the real input ``x * x_scale``."""
    xs = arrays.get("x_scale")
    xr = np.asarray(x2).astype(np.float64)
    if xs is not None:
        xr = xr * np.asarray(xs, dtype=np.float64).reshape(-1, 1)
    return _ln.term_scales(xr, arrays, dy2, options)


_QUANT_LAYER_NORM_DOC = r"""Quantization-friendly LayerNorm forward (int8 in and out, to sit between int8 matrix
products).

.. math::

    \tilde x = x \cdot s_x, \quad y = \mathrm{LayerNorm}(\tilde x)\,(w + o) + b, \quad
    q = \mathrm{clip}(\mathrm{round\_half\_even}(y / s), -127, 127)

Notes
-----
A float ``x`` is normalized exactly as :func:`layer_norm` (bitwise its output), then quantized. An
int8 ``x`` has exact integer row sums and a fixed float64 sequence after them, so its outputs (float
or int8) are bitwise identical on every backend. ``s = 1`` where ``amax`` is 0 or not finite.
Formulas: :mod:`pynorm.reference.quant_norm`, ``docs/norms/quant_layer_norm.md``.
"""

_QUANT_LAYER_NORM_BACKWARD_DOC = r"""Backward of :func:`quant_layer_norm_forward`: ``QuantLayerNormGrads(dx, dweight,
dbias)``.

``dy`` is the gradient w.r.t. the dequantized output ``q * s`` (or ``y``): float32 for an int8 ``x``,
``x``'s dtype otherwise. Straight-through through the rounding (``s`` held constant): ``dy`` passes
unchanged, but is 0 where a given ``out_scale`` clipped. Then LayerNorm's exact backward
(:func:`layer_norm_backward`) at the real input: ``dx`` is w.r.t. ``x * x_scale`` (float32 for int8).
"""


def _result(outs: tuple[Any, ...], ctx: Any, options: Mapping[str, Any]) -> Any:
    """``y``, or ``(q, s)`` when quantizing (``s`` of ``x.shape[:axis]`` per row, ``()`` per tensor)."""
    scale = ctx.inner.scale
    if scale is None:
        return outs[0]
    per_row = options["quantize"] == "row" and options["out_scale"] is None
    return outs[0], scale.reshape(tuple(ctx.x_shape[: ctx.axis]) if per_row else ())


SPEC = OpSpec(
    name="quant_layer_norm",
    result=_result,
    result_doc="float ``y`` (``x``'s dtype for a float ``x``, float32 for an int8 ``x``), or when quantizing the "
    "pair ``(q, s)``: ``q`` int8 of ``x``'s shape, ``s`` float32 of shape ``x.shape[:axis]`` (``quantize='row'``) "
    "or ``()`` (per tensor)",
    doc=_QUANT_LAYER_NORM_DOC,
    backward_doc=_QUANT_LAYER_NORM_BACKWARD_DOC,
    inputs=(
        Input(
            "x_scale",
            "row_scale",
            "scale of an int8 x (a scalar or one per row): the real input is x * x_scale",
            required=False,
            keyword=True,
        ),
    ),
    params=_ln.SPEC.params,
    options=(
        *_ln.CONVENTIONS,
        Option(
            "quantize",
            None,
            one_of(None, "tensor", "row", doc="None: float output; int8 with one scale per tensor or per row"),
            "symmetric int8 output q = clip(rint(y / s), -127, 127), s = amax / 127",
        ),
        Option("out_scale", None, check_out_scale, "a given output scale s (a calibrated static scale)"),
    ),
    grads=QuantLayerNormGrads,
    ctx=QuantLayerNormCtx,
    variant=QuantizeVariant("centered"),
    term_scales=term_scales,
    check=_check,
    cases=({}, {"correction": 1}, {"eps_mode": "std", "weight_offset": 1.0}),
    output_dtypes=_output_dtypes,
    check_arrays=_check_arrays,
    x_dtypes=("int8", "float16", "bfloat16", "float32", "float64"),
    dy_dtype=grad_dtype,
    summary="y = layer_norm(x * x_scale); int8 q = clip(rint(y / s), -127, 127)",
)
