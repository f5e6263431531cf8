"""The conditional LayerNorm / RMSNorm ops (adaLN): their specs (math in :mod:`pynorm.reference.conditional_norm`)."""

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
from ._spec import Composite, Input, OpSpec, Option, Param, check_bool


@dataclass(frozen=True, eq=False)
class ConditionalLayerNormCtx:
    """What the reference backward needs: ``x``, ``cond``, ``W``, ``c``, per-row mean and rstd, the options."""

    x: Any
    cond: Any
    W: Any
    c: Any
    mean: Any
    rstd: Any
    eps: float
    correction: int
    eps_mode: str
    zero_centered: bool


@dataclass(frozen=True, eq=False)
class ConditionalRMSNormCtx:
    """What the reference backward needs: ``x``, ``cond``, ``W``, ``c``, per-row rstd, the options."""

    x: Any
    cond: Any
    W: Any
    c: Any
    rstd: Any
    eps: float
    shift: bool
    zero_centered: bool


class ConditionalLayerNormGrads(NamedTuple):
    """Gradients of the conditional LayerNorm (``dc`` None without ``c``; ``dcond`` in ``cond``'s shape)."""

    dx: Any
    dcond: Any
    dW: Any
    dc: Any


class ConditionalRMSNormGrads(NamedTuple):
    """Gradients of the conditional RMSNorm."""

    dx: Any
    dcond: Any
    dW: Any
    dc: Any


def expand(a: np.ndarray, rows: int) -> np.ndarray:
    """Each of the ``G`` rows of ``a`` repeated for the ``rows / G`` rows of ``x`` it serves."""
    g = a.shape[0]
    return np.repeat(a, rows // g if g else 0, axis=0)


def reduce_rows(a: np.ndarray, groups: int) -> np.ndarray:
    """Sums of ``a``'s ``(R, H)`` rows over each cond row's block: ``(G, H)``."""
    r, h = a.shape
    if groups == 0:
        return np.zeros((0, h), a.dtype)
    return a.reshape(groups, r // groups, h).sum(axis=1)


#: the conditioning dim of the example arguments (tests, demo)
EXAMPLE_COND_DIM = 5


def _k(options: Mapping[str, Any]) -> int:
    return 2 if options.get("shift", True) else 1


def _check_arrays(x_shape: tuple[int, ...], axis: int, arrays: Mapping[str, Any], options: Mapping[str, Any]) -> None:
    h = math.prod(x_shape[axis:])
    k = _k(options)
    cond, W, c = arrays["cond"], arrays["W"], arrays["c"]
    cdim = cond.shape[-1]
    what = "(2H, C)" if k == 2 else "(H, C) (shift=False: a scale only)"
    if tuple(W.shape) != (k * h, cdim):
        raise ShapeError(
            f"W has shape {tuple(W.shape)}, expected {what} = {(k * h, cdim)} for H = {h} normalized features "
            f"and cond's C = {cdim} (a torch Linear(C, {'2H' if k == 2 else 'H'}) weight)"
        )
    if c is not None and tuple(c.shape) != (k * h,):
        raise ShapeError(f"c has shape {tuple(c.shape)}, expected ({'2H' if k == 2 else 'H'},) = {(k * h,)}")


def _example_shapes(norm_shape: tuple[int, ...], options: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    h = math.prod(norm_shape)
    k = _k(options)
    return {"cond": (EXAMPLE_COND_DIM,), "W": (k * h, EXAMPLE_COND_DIM), "c": (k * h,)}


def _term_scales(norm_scales: Any) -> Any:
    """The plain norm's term scales with each row's own ``gamma + o`` and ``beta``, where the magnitude of
    ``gamma`` and ``beta`` is that of the terms of ``cond W^T + c``; gradients of the products likewise."""

    def scales(x2: np.ndarray, arrays: Mapping[str, Any], dy2: np.ndarray, options: Mapping[str, Any]) -> dict:
        r, h = x2.shape
        k = _k(options)
        cond = np.asarray(arrays["cond"]).astype(np.float64)
        W = np.asarray(arrays["W"]).astype(np.float64)
        c = arrays.get("c")
        cv = np.zeros(k * h) if c is None else np.asarray(c).astype(np.float64)
        mag = expand(np.abs(cond) @ np.abs(W).T + np.abs(cv), r)  # (R, kH): the terms of gamma, beta
        o = 1.0 if options.get("zero_centered", False) else 0.0
        rows: dict[str, list[Any]] = {"y": [], "dx": [], "dweight": [], "dbias": []}
        for i in range(r):  # each row as a plain norm with weight |gamma| + o (magnitudes) and bias |beta|
            params = {"weight": mag[i, :h] + abs(o), "bias": mag[i, h:] if k == 2 else None}
            opts = {**options, "weight_offset": 0.0}
            s = norm_scales(x2[i : i + 1], params, dy2[i : i + 1], opts)
            no_bias = "dbias" not in s  # RMSNorm's scales know no bias: beta's terms are added here
            rows["y"].append(s["y"] + (mag[i : i + 1, h:] if k == 2 and no_bias else 0))
            rows["dx"].append(s["dx"])
            rows["dweight"].append(s["dweight"][None])
            rows["dbias"].append(np.abs(dy2[i : i + 1]).astype(np.float64))
        if r == 0:
            return {"y": np.zeros((0, h)), "dx": np.zeros((0, h)), "dcond": np.zeros(cond.shape),
                    "dW": np.zeros(W.shape), "dc": np.zeros(k * h)}  # fmt: skip
        g = cond.shape[0]
        dp = reduce_rows(np.concatenate(rows["dweight"]), g)
        if k == 2:
            dp = np.concatenate([dp, reduce_rows(np.concatenate(rows["dbias"]), g)], axis=1)
        return {
            "y": np.concatenate(rows["y"]),
            "dx": np.concatenate(rows["dx"]),
            "dcond": dp @ np.abs(W),
            "dW": dp.T @ np.abs(cond),
            "dc": dp.sum(axis=0),
        }

    return scales


_COND = Input(
    "cond",
    "cond",
    "(..., C) conditioning vectors: one per row of x (x.shape[:axis] + (C,)) or one per sample "
    "(x.shape[:k] + (C,), broadcast over the remaining rows, e.g. (B, C) for x of (B, T, H))",
)
_W = Param("W", "matrix", 0.0, "(2H, C) projection of cond onto [gamma, beta] (a torch Linear(C, 2H) weight)", True)
_C = Param("c", "vector", 0.0, "(2H,) bias of the projection")
_ZERO = Option("zero_centered", False, check_bool, "y = (1 + gamma) xhat + beta (adaLN) instead of gamma xhat + beta")


def _conditional_spec(
    module: ModuleType, params: tuple[Param, ...], own_options: tuple[Option, ...] = (), **own: Any
) -> OpSpec:
    """The norm of ``module`` (its ``SPEC``) whose scale (and shift) a projection of the ``cond`` input gives,
    composed of the norm's modality op: ``params`` (the projection's), the norm's conventions (``CONVENTIONS``)
    but ``weight_offset`` (``zero_centered`` instead), then ``own_options``; its cross-argument check and term
    scales with the projection's; ``own``: the rest (docs, grads, ctx, cases, summary)."""
    norm: OpSpec = module.SPEC
    return OpSpec(
        name=f"conditional_{norm.name}",
        inputs=(_COND,),
        params=params,
        options=(*(o for o in module.CONVENTIONS if o.name != "weight_offset"), *own_options, _ZERO),
        variant=Composite((f"modality_{norm.name}",), "pynorm.composite.conditional_norm"),
        term_scales=_term_scales(norm.term_scales),
        check=norm.check,
        check_arrays=_check_arrays,
        example_shapes=_example_shapes,
        **own,
    )


_CONDITIONAL_LAYER_NORM_DOC = r"""Conditional LayerNorm forward (adaLN); returns ``(y, ctx)`` for
:func:`conditional_layer_norm_backward`.

.. math::

    [\gamma, \beta] = \mathrm{cond}\,W^T + c, \qquad
    y = \hat x\,(\gamma + o) + \beta, \quad \hat x = \frac{x - \mu}{\sqrt{v + \epsilon}}

with ``o = 1`` for ``zero_centered=True`` (the ``(1 + scale)`` of diffusion transformers), else 0, and
:math:`\hat x` LayerNorm's (:func:`layer_norm_forward`, its ``correction`` and ``eps_mode``).
"""

_CONDITIONAL_LAYER_NORM_BACKWARD_DOC = r"""Conditional LayerNorm backward: ``ConditionalLayerNormGrads(dx, dcond, dW,
dc)``.

``dx`` is LayerNorm's with the row's own scale :math:`\gamma + o`; with
:math:`d\gamma_g = \sum_{i \in g} dy_i \hat x_i`, :math:`d\beta_g = \sum_{i \in g} dy_i` over the rows
``i`` that cond row ``g`` serves and :math:`dP = [d\gamma, d\beta]`:

.. math::

    d\,\mathrm{cond} = dP\,W, \qquad dW = dP^T \mathrm{cond}, \qquad dc = \textstyle\sum_g dP_g

so ``dcond`` has ``cond``'s shape (summed over the broadcast rows); ``dc`` is None without ``c``.
"""

CONDITIONAL_LAYER_NORM = _conditional_spec(
    _ln,
    (_W, _C),
    doc=_CONDITIONAL_LAYER_NORM_DOC,
    backward_doc=_CONDITIONAL_LAYER_NORM_BACKWARD_DOC,
    grads=ConditionalLayerNormGrads,
    ctx=ConditionalLayerNormCtx,
    cases=({}, {"zero_centered": True}, {"correction": 1, "eps_mode": "std"}),
    summary="gamma, beta = split(cond @ W.T + c); y = layer_norm(x) * (gamma [+ 1]) + beta",
)


_CONDITIONAL_RMS_NORM_DOC = r"""Conditional RMSNorm forward; returns ``(y, ctx)`` for
:func:`conditional_rms_norm_backward`.

.. math::

    [\gamma, \beta] = \mathrm{cond}\,W^T + c, \qquad
    y = \frac{x}{\sqrt{\mathrm{mean}(x^2) + \epsilon}}\,(\gamma + o) + \beta

With ``shift=False`` ``W`` is ``(H, C)``, ``c`` ``(H,)`` and there is no :math:`\beta` (Liger's modulated
RMSNorm). ``o``, ``cond``'s broadcast rule and the other arguments as for
:func:`conditional_layer_norm_forward`.
"""

_CONDITIONAL_RMS_NORM_BACKWARD_DOC = r"""Conditional RMSNorm backward: ``ConditionalRMSNormGrads(dx, dcond, dW, dc)``.

``dx`` is RMSNorm's with the row's scale :math:`\gamma + o`; ``dP = [d\gamma, d\beta]`` (``[d\gamma]`` with
``shift=False``) summed per cond row, ``dcond = dP W``, ``dW = dP^T cond``, ``dc = sum_g dP_g``.
"""

CONDITIONAL_RMS_NORM = _conditional_spec(
    _rms,
    (
        Param("W", "matrix", 0.0, "(2H, C) projection of cond onto [gamma, beta] ((H, C) with shift=False)", True),
        Param("c", "vector", 0.0, "(2H,) bias of the projection ((H,) with shift=False)"),
    ),
    (Option("shift", True, check_bool, "produce beta too (W of (2H, C)); False: a scale only, W of (H, C)"),),
    doc=_CONDITIONAL_RMS_NORM_DOC,
    backward_doc=_CONDITIONAL_RMS_NORM_BACKWARD_DOC,
    grads=ConditionalRMSNormGrads,
    ctx=ConditionalRMSNormCtx,
    cases=({}, {"zero_centered": True}, {"shift": False}, {"shift": False, "zero_centered": True}),
    summary="gamma[, beta] = split(cond @ W.T + c); y = rms_norm(x) * (gamma [+ 1]) [+ beta]",
)
