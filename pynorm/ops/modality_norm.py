"""The modality LayerNorm / RMSNorm ops: their specs (math in :mod:`pynorm.reference.modality_norm`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np

from . import layer_norm as _ln
from . import rms_norm as _rms
from ._spec import Input, OpSpec, Param, StatsVariant


@dataclass(frozen=True, eq=False)
class ModalityLayerNormCtx(_ln.CenteredCtx):
    """What the backward needs: ``x``, the tables, per-row mean and rstd, the conventions (the fields of
    :class:`~pynorm.ops.layer_norm.CenteredCtx`), then the ids."""

    modality_ids: Any


@dataclass(frozen=True, eq=False)
class ModalityRMSNormCtx:
    """What the backward needs: ``x``, the ids, the weight table, per-row rstd, the conventions."""

    x: Any
    modality_ids: Any
    weight: Any
    rstd: Any
    eps: float
    weight_offset: float


class ModalityLayerNormGrads(NamedTuple):
    """Gradients of the modality LayerNorm (``(M, H)`` tables; ``dbias`` None without a bias)."""

    dx: Any
    dweight: Any
    dbias: Any


class ModalityRMSNormGrads(NamedTuple):
    """Gradients of the modality RMSNorm."""

    dx: Any
    dweight: Any


def scatter_rows(values: np.ndarray, ids: np.ndarray, m: int) -> np.ndarray:
    """``out[k] = sum of values[i] over the rows i with ids[i] == k``, an ``(m, H)`` array.

    Each modality's rows are summed by the same reduction as the plain norm's column sums (``np.sum``
    over axis 0 of those rows, in order), so with one modality the result is bitwise the plain one.
    """
    out = np.zeros((m, values.shape[1]), dtype=values.dtype)
    for k in range(m):
        sel = ids == k
        if sel.any():
            out[k] = np.sum(values[sel], axis=0)
    return out


def _per_row(term_scales: Any, names: tuple[str, ...]) -> Any:
    """The plain norm's term scales with each row's own parameter rows; parameter gradients per modality."""

    def scales(x2: np.ndarray, arrays: Mapping[str, Any], dy2: np.ndarray, options: Mapping[str, Any]) -> dict:
        ids = np.asarray(arrays["modality_ids"]).astype(np.int64)
        tables = {n: (None if arrays.get(n) is None else np.asarray(arrays[n]).astype(np.float64)) for n in names}
        m = next(t.shape[0] for t in tables.values() if t is not None)
        out: dict[str, Any] = {}
        rows = []
        for i in range(x2.shape[0]):  # each row with its own parameters (a plain norm of one row)
            params = {n: (None if t is None else t[ids[i]]) for n, t in tables.items()}
            rows.append(term_scales(x2[i : i + 1], params, dy2[i : i + 1], options))
        for key in ("y", "dx"):
            out[key] = np.concatenate([r[key] for r in rows]) if rows else np.zeros(x2.shape)
        for n in names:
            per_row = np.concatenate([r[f"d{n}"][None] for r in rows]) if rows else np.zeros((0, x2.shape[1]))
            out[f"d{n}"] = scatter_rows(per_row, ids, m)
        return out

    return scales


_WEIGHT_TABLE = Param(
    "weight", "table", 1.0, "(M, *x.shape[axis:]) table of per-modality scales", True, index="modality_ids"
)


def _modality_spec(module: ModuleType, params: tuple[Param, ...], **own: Any) -> OpSpec:
    """The norm of ``module`` (its ``SPEC``) with parameter tables (``params``) whose rows the ``modality_ids``
    input selects: the norm's conventions (``CONVENTIONS``), cross-argument check and term scales (per row);
    ``own``: the rest (docs, grads, ctx, cases, summary)."""
    norm: OpSpec = module.SPEC
    assert isinstance(norm.variant, StatsVariant)
    return OpSpec(
        name=f"modality_{norm.name}",
        inputs=(Input("modality_ids", "row_index", "the modality of each row: an integer in [0, M)"),),
        params=params,
        options=module.CONVENTIONS,
        variant=StatsVariant(norm.variant.statistic, affine="table"),
        term_scales=_per_row(norm.term_scales, tuple(p.name for p in params)),
        check=norm.check,
        **own,
    )


_MODALITY_LAYER_NORM_DOC = r"""Modality-specific LayerNorm: row ``i`` uses row ``modality_ids[i]`` of the parameter
tables.

.. math::

    y_i = \hat x_i\,(w_{\mathrm{ids}_i} + o) + b_{\mathrm{ids}_i}

``weight``/``bias`` have shape ``(M, *x.shape[axis:])``; ``modality_ids`` is an integer array
of shape ``x.shape[:axis]`` with values in ``[0, M)``. Every LayerNorm convention applies.
Returns ``(y, ctx)`` for :func:`modality_layer_norm_backward`.
"""

_MODALITY_LAYER_NORM_BACKWARD_DOC = r"""Backward of the modality LayerNorm: ``(dx, dweight, dbias)``, the table
gradients summed per
modality in a fixed order (deterministic), rows of unused modalities 0.
"""

MODALITY_LAYER_NORM = _modality_spec(
    _ln,
    (
        _WEIGHT_TABLE,
        Param("bias", "table", 0.0, "(M, *x.shape[axis:]) table of per-modality shifts", index="modality_ids"),
    ),
    doc=_MODALITY_LAYER_NORM_DOC,
    backward_doc=_MODALITY_LAYER_NORM_BACKWARD_DOC,
    grads=ModalityLayerNormGrads,
    ctx=ModalityLayerNormCtx,
    cases=({}, {"correction": 1}, {"eps_mode": "std", "weight_offset": 1.0}),
    summary="y_i = layer_norm(x_i) with the weight/bias rows of modality ids[i]",
)


_MODALITY_RMS_NORM_DOC = r"""Modality-specific RMSNorm: row ``i`` uses row ``modality_ids[i]`` of the ``(M,
*x.shape[axis:])``
weight table; see :func:`modality_layer_norm_forward` and :func:`rms_norm_forward`.
"""

_MODALITY_RMS_NORM_BACKWARD_DOC = r"""Backward of the modality RMSNorm: ``(dx, dweight)``, ``dweight`` summed per
modality.
"""

MODALITY_RMS_NORM = _modality_spec(
    _rms,
    (_WEIGHT_TABLE,),
    doc=_MODALITY_RMS_NORM_DOC,
    backward_doc=_MODALITY_RMS_NORM_BACKWARD_DOC,
    grads=ModalityRMSNormGrads,
    ctx=ModalityRMSNormCtx,
    cases=({}, {"weight_offset": 1.0}),
    summary="y_i = rms_norm(x_i) with the weight row of modality ids[i]",
)
