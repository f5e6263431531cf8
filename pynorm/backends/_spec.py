"""What the numba and cupy hosts of the statistics and element-wise families read from an op's spec in the same
way."""

from __future__ import annotations

from typing import Any

from ..ops import OpSpec

__all__ = ["EW_SLOTS", "check_ew_slots", "param_names", "prologue_input_names"]


def param_names(spec: OpSpec) -> tuple[str, str]:
    """``(weight_name, bias_name)``: the spec's scale, then its shift (``""`` without one; the order is checked
    against the affine source's record)."""
    names = spec.param_names
    return names[0], names[1] if len(names) > 1 else ""


def prologue_input_names(spec: OpSpec, prologue: Any) -> tuple[str, str]:
    """``(residual_name, ids_name)``: the spec's inputs of the prologue's kind and of kind ``"row_index"``
    (``""`` where it has none)."""
    kinds: dict[str, str] = {i.kind: i.name for i in spec.inputs}
    return kinds.get(prologue.input_kind, ""), kinds.get("row_index", "")


#: the parameters the element-wise kernels (both backends) have a slot for, in the kernels' order
EW_SLOTS = ("alpha", "shift", "weight", "bias")


def check_ew_slots(spec: OpSpec) -> None:
    """ValueError unless every parameter of the element-wise op ``spec`` has a slot in :data:`EW_SLOTS`."""
    unknown = set(spec.param_names) - set(EW_SLOTS)
    if unknown:
        raise ValueError(f"op {spec.name!r}: the element-wise kernels have no parameter slot for {sorted(unknown)}")
