"""Declarative op specs: one :class:`OpSpec` per op (``pynorm/ops/<op>.py``).

The functional API, the layers, :mod:`pynorm.testing`, the demo, the benchmarks and the tests
read these specs instead of keeping their own per-op tables; the fast backends read the
kernel family and variant from them. Adding an op: ``docs/adding_an_op.md``.
"""

from __future__ import annotations

from ._spec import (
    REQUIRED,
    ColumnVariant,
    Composite,
    ElementwiseVariant,
    Input,
    OpSpec,
    Option,
    Param,
    QuantizeVariant,
    StatsVariant,
    check_bool,
    check_eps,
    check_positive_int,
    check_real,
    one_of,
)
from .add_norm import ADD_LAYER_NORM, ADD_RMS_NORM
from .batch_norm import SPEC as BATCH_NORM
from .conditional_norm import CONDITIONAL_LAYER_NORM, CONDITIONAL_RMS_NORM
from .dyt import SPEC as DYT
from .group_norm import GROUP_NORM, INSTANCE_NORM
from .layer_norm import SPEC as LAYER_NORM
from .modality_norm import MODALITY_LAYER_NORM, MODALITY_RMS_NORM
from .norm_linear import LAYER_NORM_LINEAR, RMS_NORM_LINEAR
from .power_norm import SPEC as POWER_NORM
from .quant_norm import SPEC as QUANT_LAYER_NORM
from .rms_norm import SPEC as RMS_NORM
from .scale_norm import SPEC as SCALE_NORM

__all__ = [
    "ADD_LAYER_NORM",
    "ADD_RMS_NORM",
    "BATCH_NORM",
    "CONDITIONAL_LAYER_NORM",
    "CONDITIONAL_RMS_NORM",
    "DYT",
    "GROUP_NORM",
    "INSTANCE_NORM",
    "LAYER_NORM",
    "LAYER_NORM_LINEAR",
    "MODALITY_LAYER_NORM",
    "MODALITY_RMS_NORM",
    "POWER_NORM",
    "QUANT_LAYER_NORM",
    "REQUIRED",
    "RMS_NORM",
    "RMS_NORM_LINEAR",
    "SCALE_NORM",
    "SPECS",
    "ColumnVariant",
    "Composite",
    "ElementwiseVariant",
    "Input",
    "OpSpec",
    "Option",
    "Param",
    "QuantizeVariant",
    "StatsVariant",
    "check_bool",
    "check_eps",
    "check_positive_int",
    "check_real",
    "get",
    "one_of",
]

#: every op, by name, in the order of the docs
SPECS: dict[str, OpSpec] = {
    s.name: s
    for s in (
        LAYER_NORM,
        RMS_NORM,
        SCALE_NORM,
        POWER_NORM,
        DYT,
        ADD_LAYER_NORM,
        ADD_RMS_NORM,
        MODALITY_LAYER_NORM,
        MODALITY_RMS_NORM,
        CONDITIONAL_LAYER_NORM,
        CONDITIONAL_RMS_NORM,
        QUANT_LAYER_NORM,
        LAYER_NORM_LINEAR,
        RMS_NORM_LINEAR,
        GROUP_NORM,
        INSTANCE_NORM,
        BATCH_NORM,
    )
}


def get(name: str) -> OpSpec:
    """The spec of op ``name`` (:class:`pynorm.errors.UnknownOpError` if there is none)."""
    from ..errors import UnknownOpError

    try:
        return SPECS[name]
    except (KeyError, TypeError):
        raise UnknownOpError(f"no op named {name!r} (ops: {', '.join(SPECS)})") from None
