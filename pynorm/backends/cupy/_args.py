"""The parameter lists of the statistics family's kernels (``kernels/stats.cu``), one dataclass each.

Each dataclass has one field per kernel parameter, in order, named as in the ``.cu`` source and
annotated with its C type (``Annotated[..., "const T*"]``); ``tests/test_cupy_kernels.py`` checks
names, order and types against the source. :meth:`_Args.pack` turns an instance into the
positional arguments of a launch: arrays and None (a null pointer) as they are, scalars at the
exact width of their C type (a Python ``int`` would be packed as 8 bytes by CuPy and shift every
later parameter of a kernel expecting ``int``). Arguments stay positional (not one struct passed
by value) so that every pointer of a launch is visible to CuPy -- and to the CPU execution
harness, which snapshots, compares and fences each buffer a kernel receives.

Importing this module does not import CuPy.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Annotated, Any, get_type_hints

import numpy as np

__all__ = ["KERNEL_ARGS", "BwdApplyArgs", "BwdArgs", "BwdStatsArgs", "FwdArgs", "c_types"]

# a field's C type is carried by its annotation (``Annotated[..., "<C type>"]``)
ConstT = Annotated[Any, "const T*"]
ConstW = Annotated[Any, "const W*"]
OutT = Annotated[Any, "T*"]
ConstAcc = Annotated[Any, "const acc_t<T, W>*"]
OutAcc = Annotated[Any, "acc_t<T, W>*"]
LongLong = Annotated[int, "long long"]
Int = Annotated[int, "int"]
Double = Annotated[float, "double"]

_SCALAR = {"long long": np.int64, "int": np.int32, "double": np.float64}


def c_types(cls: type) -> dict[str, str]:
    """Field name -> C type of one of the argument dataclasses, in field order."""
    hints = get_type_hints(cls, include_extras=True)
    return {f.name: hints[f.name].__metadata__[0] for f in fields(cls)}  # type: ignore[arg-type]


class _Args:
    """Positional kernel arguments from the fields: arrays and None (a null pointer) as they are,
    scalars converted to the exact width of their C type."""

    def pack(self) -> tuple[Any, ...]:
        return tuple(
            getattr(self, n) if ct.endswith("*") else _SCALAR[ct](getattr(self, n))
            for n, ct in c_types(type(self)).items()
        )


@dataclass(frozen=True)
class FwdArgs(_Args):
    """``stats_fwd``'s parameters."""

    x: ConstT
    weight: ConstW
    bias: ConstW
    y: OutT
    mean_out: OutAcc
    rstd_out: OutAcc
    rows: LongLong
    hidden: Int
    eps: Double
    correction: Int
    std_mode: Int
    weight_offset: Double
    log2g: Int
    vec: Int
    over_smem: Int


@dataclass(frozen=True)
class BwdArgs(_Args):
    """``stats_bwd``'s parameters (the fused backward)."""

    dy: ConstT
    x: ConstT
    weight: ConstW
    mean: ConstAcc
    rstd: ConstAcc
    dx: OutT
    part_w: OutAcc
    part_b: OutAcc
    rows: LongLong
    hidden: Int
    correction: Int
    std_mode: Int
    weight_offset: Double
    log2g: Int
    vec: Int


@dataclass(frozen=True)
class BwdStatsArgs(_Args):
    """``stats_bwd_stats``'s parameters (split backward, step 1)."""

    dy: ConstT
    x: ConstT
    weight: ConstW
    mean: ConstAcc
    rstd: ConstAcc
    coefs: OutAcc
    rows: LongLong
    hidden: Int
    correction: Int
    std_mode: Int
    weight_offset: Double
    log2g: Int
    vec: Int


@dataclass(frozen=True)
class BwdApplyArgs(_Args):
    """``stats_bwd_apply``'s parameters (split backward, step 2)."""

    dy: ConstT
    x: ConstT
    weight: ConstW
    mean: ConstAcc
    rstd: ConstAcc
    coefs: ConstAcc
    dx: OutT
    part_w: OutAcc
    part_b: OutAcc
    rows: LongLong
    hidden: Int
    rows_per_chunk: LongLong
    weight_offset: Double
    vec: Int


#: kernel name -> its argument dataclass
KERNEL_ARGS = {
    "stats_fwd": FwdArgs,
    "stats_bwd": BwdArgs,
    "stats_bwd_stats": BwdStatsArgs,
    "stats_bwd_apply": BwdApplyArgs,
}
