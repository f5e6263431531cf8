"""The fused residual add + LayerNorm / RMSNorm ops: their specs (math in :mod:`pynorm.reference.add_norm`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np

from .._dtypes import dtype_of
from ..errors import DTypeError
from . import layer_norm as _ln
from . import rms_norm as _rms
from ._spec import Input, OpSpec, Option, StatsVariant, check_real


@dataclass(frozen=True, eq=False)
class _Sum:
    h: Any


@dataclass(frozen=True, eq=False)
class AddLayerNormCtx(_ln.CenteredStats, _Sum):
    """What the backward needs: the rounded sum ``h``, then the parameters, ``h``'s per-row mean and rstd and the
    conventions (:class:`~pynorm.ops.layer_norm.CenteredStats`), then the residual add's."""

    alpha: float
    x_dtype: Any
    residual_in_dtype: Any
    residual_dtype: Any


@dataclass(frozen=True, eq=False)
class AddRMSNormCtx:
    """What the backward needs: the rounded sum ``h``, the weight and ``h``'s per-row rstd."""

    h: Any
    weight: Any
    rstd: Any
    eps: float
    weight_offset: float
    alpha: float
    x_dtype: Any
    residual_in_dtype: Any
    residual_dtype: Any


class AddLayerNormGrads(NamedTuple):
    """Gradients of the fused add + LayerNorm."""

    dx: Any
    dresidual: Any
    dweight: Any
    dbias: Any


class AddRMSNormGrads(NamedTuple):
    """Gradients of the fused add + RMSNorm."""

    dx: Any
    dresidual: Any
    dweight: Any


def h_dtype(x_dtype: Any, residual_dtype: Any) -> np.dtype[Any]:
    """The dtype of ``h``: ``residual_dtype``, or ``x``'s when None."""
    return np.dtype(x_dtype) if residual_dtype is None else dtype_of(residual_dtype)


_FLOATS = ("float16", "bfloat16", "float32", "float64")


def check_residual_dtype(v: Any, name: str) -> str | None:
    """None (``x``'s dtype) or one of the four float dtypes, returned by name."""
    if v is None:
        return None
    dt = v if isinstance(v, str) else getattr(v, "name", None)
    if not isinstance(dt, str) and not isinstance(v, (bool, int, float)):
        try:
            dt = np.dtype(v).name  # a NumPy scalar type (np.float32) or an ml_dtypes type
        except (TypeError, ValueError):
            dt = None
    if dt not in _FLOATS:
        raise DTypeError(f"{name} must be None or one of {', '.join(_FLOATS)}, got {v!r}")
    return dt


def _dtypes(x_dtype: Any, options: Mapping[str, Any]) -> tuple[Any, ...]:
    return (x_dtype, h_dtype(x_dtype, options.get("residual_dtype")))


_ADD_OPTIONS = (
    Option("alpha", 1.0, check_real, "scale of the residual: h = x + alpha * residual (DeepNorm's alpha)"),
    Option("residual_dtype", None, check_residual_dtype, "dtype of h (None: x's; float32 keeps the stream in fp32)"),
)


def _with_add(term_scales: Any) -> Any:
    """The norm's term scales, measured on ``h``, plus those of ``h`` itself and of ``dresidual``."""

    def scales(x2: np.ndarray, arrays: Mapping[str, Any], dy2: np.ndarray, options: Mapping[str, Any]) -> dict:
        alpha = abs(options.get("alpha", 1.0))
        res = np.asarray(arrays["residual"]).astype(np.float64)
        xs = np.asarray(x2).astype(np.float64)
        h = np.asarray(arrays["h"]) if arrays.get("h") is not None else xs + options.get("alpha", 1.0) * res
        sc = term_scales(h, arrays, dy2, options)
        dh = arrays.get("dh")
        if dh is not None:
            sc["dx"] = sc["dx"] + np.abs(np.asarray(dh).astype(np.float64))
        sc["dresidual"] = alpha * sc["dx"]
        sc["h"] = np.abs(xs) + alpha * np.abs(res)
        return sc

    return scales


#: options of a norm that its fused residual add does not take: the casting policies round ``x``'s dtype around the
#: norm alone (``pynorm.composite.casting``), which the fused op's single rounding of ``h`` has no place for
NOT_FUSED = frozenset({"casting"})


def _add_spec(module: ModuleType, **own: Any) -> OpSpec:
    """The fused residual add + the norm of ``module`` (its ``SPEC``): the norm's parameters, affine source,
    options (but :data:`NOT_FUSED`) and cross-argument check, the residual input and prologue, the add's options and
    term scales and the ``(y, h)`` outputs; ``own``: the rest (docs, grads, ctx, cases)."""
    norm: OpSpec = module.SPEC
    if not isinstance(norm.variant, StatsVariant):
        raise TypeError(f"a fused residual add needs a norm of the statistics family, not {norm.name}'s {norm.variant}")
    return OpSpec(
        name=f"add_{norm.name}",
        inputs=(Input("residual", "like_x", "the residual stream added to x (scaled by alpha)"),),
        params=norm.params,
        options=(*(o for o in norm.options if o.name not in NOT_FUSED), *_ADD_OPTIONS),
        variant=StatsVariant(
            norm.variant.statistic, prologue="residual", affine=norm.variant.affine, epilogue="prenorm"
        ),
        term_scales=_with_add(norm.term_scales),
        check=norm.check,
        outputs=("y", "h"),
        output_dtypes=_dtypes,
        result=norm.result,
        result_doc="``(y, h)``; ``y`` a ``pynorm.Quantized`` when ``quantize`` is given" if norm.result else "",
        summary=f"h = x + alpha * residual, y = {norm.name}(h)",
        **own,
    )


_ADD_LAYER_NORM_DOC = r"""Fused residual add + LayerNorm: ``h = x + alpha * residual``, ``y = layer_norm(h)``; ``((y,
h), ctx)``.

``h`` is rounded once to ``residual_dtype`` (default ``x``'s dtype; ``"float32"`` keeps the
residual stream in fp32 for half inputs, as flash-attention's ``residual_in_fp32``) and the
norm is that of the rounded ``h`` -- bitwise what the unfused two steps give. ``alpha`` is a
float (DeepNorm's up-weighted skip). Every LayerNorm convention applies (see
:func:`layer_norm_forward`); ``residual`` has ``x``'s shape and any float dtype. ``y`` has
``x``'s dtype; ``out`` receives ``y``.
"""

_ADD_LAYER_NORM_BACKWARD_DOC = r"""Backward of the fused add + LayerNorm: ``AddLayerNormGrads(dx, dresidual, dweight,
dbias)``.

``dh`` is the gradient arriving at ``h`` from later layers (None: none). With
:math:`g_h = \mathrm{LN}'(h)^T dy + dh`: :math:`dx = g_h`, :math:`d\,\mathrm{residual} = \alpha\,g_h`
(each rounded once to its input's dtype); ``dweight``/``dbias`` as for :func:`layer_norm_backward`.
"""

ADD_LAYER_NORM = _add_spec(
    _ln,
    doc=_ADD_LAYER_NORM_DOC,
    backward_doc=_ADD_LAYER_NORM_BACKWARD_DOC,
    grads=AddLayerNormGrads,
    ctx=AddLayerNormCtx,
    cases=(
        {},
        {"alpha": 2.5},
        {"correction": 1, "eps_mode": "std"},
        {"weight_offset": 1.0, "residual_dtype": "float32"},
        {"alpha": 0.5, "residual_dtype": "float64"},
    ),
)


_ADD_RMS_NORM_DOC = r"""Fused residual add + RMSNorm: ``h = x + alpha * residual``, ``y = rms_norm(h)``; ``((y, h),
ctx)``.

As :func:`add_layer_norm_forward`, with the RMSNorm conventions of :func:`rms_norm_forward`.
"""

_ADD_RMS_NORM_BACKWARD_DOC = r"""Backward of the fused add + RMSNorm: ``AddRMSNormGrads(dx, dresidual, dweight)``; see
:func:`add_layer_norm_backward` for ``dh``.
"""

ADD_RMS_NORM = _add_spec(
    _rms,
    doc=_ADD_RMS_NORM_DOC,
    backward_doc=_ADD_RMS_NORM_BACKWARD_DOC,
    grads=AddRMSNormGrads,
    ctx=AddRMSNormCtx,
    cases=({}, {"alpha": 2.5}, {"weight_offset": 1.0, "residual_dtype": "float32"}, {"alpha": -1.0}),
)
