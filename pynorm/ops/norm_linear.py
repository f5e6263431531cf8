"""The fused LayerNorm / RMSNorm + Linear ops: their specs (math in :mod:`pynorm.reference.norm_linear`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np

from ..errors import ShapeError
from . import layer_norm as _ln
from . import rms_norm as _rms
from ._spec import Composite, OpSpec, Option, Param, check_bool


@dataclass(frozen=True, eq=False)
class LayerNormLinearCtx:
    """``norm``: the LayerNorm ctx (``x``, weight, bias, per-row mean and rstd); ``W``, ``c``."""

    norm: Any
    W: Any
    c: Any


@dataclass(frozen=True, eq=False)
class RMSNormLinearCtx:
    """``norm``: the RMSNorm ctx (``x``, weight, per-row rstd); ``W``, ``c``."""

    norm: Any
    W: Any
    c: Any


class LayerNormLinearGrads(NamedTuple):
    """Gradients of the fused LayerNorm + Linear (None for absent parameters)."""

    dx: Any
    dweight: Any
    dbias: Any
    dW: Any
    dc: Any


class RMSNormLinearGrads(NamedTuple):
    """Gradients of the fused RMSNorm + Linear."""

    dx: Any
    dweight: Any
    dW: Any
    dc: Any


#: the output features of the example arguments (tests, demo): not H, so that a transposed W fails
EXAMPLE_OUT_FEATURES = 6


def _check_arrays(x_shape: tuple[int, ...], axis: int, arrays: Mapping[str, Any], options: Mapping[str, Any]) -> None:
    h = math.prod(x_shape[axis:])
    W, c = arrays["W"], arrays["c"]
    if W.shape[1] != h:
        raise ShapeError(
            f"W has shape {tuple(W.shape)}, expected (N, H) = (N, {h}) for H = {h} normalized features "
            f"(a torch Linear(H, N) weight)"
        )
    if c is not None and tuple(c.shape) != (W.shape[0],):
        raise ShapeError(f"c has shape {tuple(c.shape)}, expected (N,) = ({W.shape[0]},), W's rows")


def _out_shape(x_shape: tuple[int, ...], axis: int, arrays: Mapping[str, Any]) -> tuple[int, ...]:
    return (*x_shape[:axis], int(arrays["W"].shape[0]))


def _example_shapes(norm_shape: tuple[int, ...], options: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    n = EXAMPLE_OUT_FEATURES
    return {"W": (n, math.prod(norm_shape)), "c": (n,)}


def _term_scales(norm_scales: Any, norm_params: tuple[str, ...]) -> Any:
    """``out``: the norm's ``y`` scale through ``|W|`` plus ``|c|`` (the norm's output carries its own error
    into the product); the norm's gradients at the upstream magnitude ``|dout| |W| (+ |dn|)``;
    ``dW``: ``|dout|^T`` times the norm's ``y`` scale; ``dc``: ``sum |dout|``."""

    def scales(x2: np.ndarray, arrays: Mapping[str, Any], dy2: np.ndarray, options: Mapping[str, Any]) -> dict:
        W = np.abs(np.asarray(arrays["W"]).astype(np.float64))
        c = arrays.get("c")
        dyabs = np.abs(np.asarray(dy2).astype(np.float64))
        dn_mag = dyabs @ W
        if arrays.get("dn") is not None:
            dn_mag = dn_mag + np.abs(np.asarray(arrays["dn"]).astype(np.float64))
        params = {p: arrays.get(p) for p in norm_params}
        sn = norm_scales(x2, params, dn_mag, options)
        out = {
            "y": sn["y"] @ W.T + (0 if c is None else np.abs(np.asarray(c).astype(np.float64))),
            "n": sn["y"],
            "dx": sn["dx"],
            "dW": dyabs.T @ sn["y"],
            "dc": dyabs.sum(axis=0),
        }
        for p in norm_params:
            out[f"d{p}"] = sn[f"d{p}"]
        return out

    return scales


def _dtypes(x_dtype: Any, options: Mapping[str, Any]) -> tuple[Any, ...]:
    return (x_dtype, x_dtype)


#: the public functions' own option: also return the norm's output
_RETURN_NORM = Option(
    "return_norm",
    False,
    check_bool,
    "also return the norm's output ``n``: the result is then ``(out, n)``",
    to_backend=False,
)


def _result(outs: tuple[Any, ...], ctx: Any, options: Mapping[str, Any]) -> Any:
    return outs if options["return_norm"] else outs[0]


_RESULT_DOC = "``out`` of shape ``x.shape[:axis] + (N,)`` and ``x``'s dtype, or ``(out, n)`` with ``return_norm=True``"

_W = Param("W", "matrix", 0.0, "(N, H) weight of the Linear (a torch Linear(H, N) weight)", True)
_C = Param("c", "vector", 0.0, "(N,) bias of the Linear")


def _linear_spec(module: ModuleType, **own: Any) -> OpSpec:
    """The norm of ``module`` (its ``SPEC``) then a Linear, composed of the norm and matrix products: the norm's
    parameters, then ``W`` and ``c``; ``return_norm``, the norm's conventions (``CONVENTIONS``) and
    cross-argument check; ``own``: the rest (docs, grads, ctx, cases)."""
    norm: OpSpec = module.SPEC
    return OpSpec(
        name=f"{norm.name}_linear",
        params=(*norm.params, _W, _C),
        options=(_RETURN_NORM, *module.CONVENTIONS),
        result=_result,
        result_doc=_RESULT_DOC,
        variant=Composite((norm.name,), "pynorm.composite.norm_linear"),
        term_scales=_term_scales(norm.term_scales, norm.param_names),
        check=norm.check,
        summary=f"n = {norm.name}(x); out = n @ W.T + c (n recomputed in backward)",
        outputs=("y", "n"),
        output_dtypes=_dtypes,
        out_shape=_out_shape,
        check_arrays=_check_arrays,
        example_shapes=_example_shapes,
        **own,
    )


_LAYER_NORM_LINEAR_DOC = r"""Fused LayerNorm + Linear forward: ``(out, ctx)``, or ``((out, n), ctx)`` with
``return_norm=True``.

.. math::

    n = \mathrm{layer\_norm}(x; w, b), \qquad \mathrm{out} = n\,W^T + c

``weight``, ``bias`` and the conventions are LayerNorm's (:func:`layer_norm_forward`); ``W`` is
``(N, H)`` (a torch ``Linear(H, N)`` weight), ``c`` ``(N,)``; ``out`` has shape
``x.shape[:axis] + (N,)`` and ``x``'s dtype (``out=`` may receive it). The ctx keeps ``x``, the
parameters and the per-row statistics -- never ``n``: backward recomputes it.
"""

_LAYER_NORM_LINEAR_BACKWARD_DOC = r"""Fused LayerNorm + Linear backward: ``LayerNormLinearGrads(dx, dweight, dbias, dW,
dc)``.

``dy`` is the gradient at ``out`` (its shape); ``dn`` optionally the gradient arriving at a returned
``n``. With :math:`n` recomputed from the ctx and :math:`dn_t = dy\,W + dn`: ``dx``, ``dweight``,
``dbias`` are LayerNorm's backward of :math:`dn_t`; :math:`dW = dy^T n`, :math:`dc = \sum_{rows} dy`.
"""

LAYER_NORM_LINEAR = _linear_spec(
    _ln,
    doc=_LAYER_NORM_LINEAR_DOC,
    backward_doc=_LAYER_NORM_LINEAR_BACKWARD_DOC,
    grads=LayerNormLinearGrads,
    ctx=LayerNormLinearCtx,
    cases=({}, {"correction": 1, "eps_mode": "std"}, {"weight_offset": 1.0}),
)


_RMS_NORM_LINEAR_DOC = r"""Fused RMSNorm + Linear forward: ``(out, ctx)``, or ``((out, n), ctx)`` with
``return_norm=True``.

.. math::

    n = \mathrm{rms\_norm}(x; w), \qquad \mathrm{out} = n\,W^T + c

As :func:`layer_norm_linear_forward`, with RMSNorm's weight and conventions.
"""

_RMS_NORM_LINEAR_BACKWARD_DOC = r"""Fused RMSNorm + Linear backward: ``RMSNormLinearGrads(dx, dweight, dW, dc)``; see
:func:`layer_norm_linear_backward`.
"""

RMS_NORM_LINEAR = _linear_spec(
    _rms,
    doc=_RMS_NORM_LINEAR_DOC,
    backward_doc=_RMS_NORM_LINEAR_BACKWARD_DOC,
    grads=RMSNormLinearGrads,
    ctx=RMSNormLinearCtx,
    cases=({}, {"weight_offset": 1.0}),
)
