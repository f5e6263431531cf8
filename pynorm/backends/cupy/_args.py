"""The parameter lists of the kernel families' kernels (``kernels/stats.cu``, ``elementwise.cu``, ``quantize.cu``,
``intype.cu``), one dataclass each.

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

import functools
from dataclasses import dataclass, fields
from typing import Annotated, Any, get_type_hints

import numpy as np

__all__ = [
    "KERNEL_ARGS",
    "BwdApplyArgs",
    "BwdArgs",
    "BwdStatsArgs",
    "EwBwdArgs",
    "EwFwdArgs",
    "FpqAmaxArgs",
    "FpqRowsArgs",
    "FwdArgs",
    "InTypeBwdArgs",
    "InTypeFwdArgs",
    "InTypeParamsArgs",
    "QuantDequantArgs",
    "QuantFloatArgs",
    "QuantInt8Args",
    "QuantMaskArgs",
    "c_types",
]

# a field's C type is carried by its annotation (``Annotated[..., "<C type>"]``)
ConstT = Annotated[Any, "const T*"]
ConstW = Annotated[Any, "const W*"]
OutT = Annotated[Any, "T*"]
ConstAcc = Annotated[Any, "const acc_t<T, W>*"]
OutAcc = Annotated[Any, "acc_t<T, W>*"]
ConstRow = Annotated[Any, "const row_t<Pro, T>*"]  # the normalized row: x, or the pre-norm sum h
OutRow = Annotated[Any, "row_t<Pro, T>*"]
ConstRes = Annotated[Any, "const res_t<Pro, T>*"]  # the residual input (and dresidual)
OutRes = Annotated[Any, "res_t<Pro, T>*"]
ConstIdx = Annotated[Any, "const long long*"]
ConstBool = Annotated[Any, "const bool*"]
OutBool = Annotated[Any, "bool*"]
OutU8 = Annotated[Any, "unsigned char*"]
LongLong = Annotated[int, "long long"]
Int = Annotated[int, "int"]
Double = Annotated[float, "double"]

_SCALAR = {"long long": np.int64, "int": np.int32, "double": np.float64}


@functools.cache
def c_types(cls: type) -> dict[str, str]:
    """Field name -> C type of one of the argument dataclasses, in field order (cached: evaluating the annotations
    took ~0.25-0.5 ms, more than a launch, and every launch packs its arguments)."""
    hints = get_type_hints(cls, include_extras=True)
    return {f.name: hints[f.name].__metadata__[0] for f in fields(cls)}  # type: ignore[arg-type]


class _Args:
    """Positional kernel arguments from the fields: arrays and None (a null pointer) as they are,
    scalars converted to the exact width of their C type."""

    def pack(self) -> tuple[Any, ...]:
        packers = _packers(type(self))  # type: ignore[arg-type]  # (a class is hashable)
        return tuple(getattr(self, n) if conv is None else conv(getattr(self, n)) for n, conv in packers)


@functools.cache
def _packers(cls: type) -> tuple[tuple[str, Any], ...]:
    """(field name, converter to its C type's width, or None for a pointer), in field order."""
    return tuple((n, None if ct.endswith("*") else _SCALAR[ct]) for n, ct in c_types(cls).items())


@dataclass(frozen=True)
class FwdArgs(_Args):
    """``stats_fwd``'s parameters."""

    x: ConstT
    residual: ConstRes
    weight: ConstW
    bias: ConstW
    ids: ConstIdx
    y: OutT
    h_out: OutRow
    mean_out: OutAcc
    rstd_out: OutAcc
    floor_out: OutBool
    rows: LongLong
    hidden: Int
    eps: Double
    correction: Int
    eps_mode: Int
    weight_offset: Double
    alpha: Double
    log2g: Int
    vec: Int
    over_smem: Int


@dataclass(frozen=True)
class BwdArgs(_Args):
    """``stats_bwd``'s parameters (the fused backward)."""

    dy: ConstT
    x: ConstRow
    dh: ConstRow
    weight: ConstW
    mean: ConstAcc
    rstd: ConstAcc
    floors: ConstBool
    dx: OutT
    dres: OutRes
    part_w: OutAcc
    part_b: OutAcc
    rows: LongLong
    hidden: Int
    correction: Int
    eps_mode: Int
    weight_offset: Double
    alpha: Double
    log2g: Int
    vec: Int


@dataclass(frozen=True)
class BwdStatsArgs(_Args):
    """``stats_bwd_stats``'s parameters (split backward, step 1)."""

    dy: ConstT
    x: ConstRow
    weight: ConstW
    ids: ConstIdx
    mean: ConstAcc
    rstd: ConstAcc
    floors: ConstBool
    coefs: OutAcc
    rows: LongLong
    hidden: Int
    correction: Int
    eps_mode: Int
    weight_offset: Double
    log2g: Int
    vec: Int


@dataclass(frozen=True)
class BwdApplyArgs(_Args):
    """``stats_bwd_apply``'s parameters (split backward, step 2)."""

    dy: ConstT
    x: ConstRow
    dh: ConstRow
    weight: ConstW
    ids: ConstIdx
    mean: ConstAcc
    rstd: ConstAcc
    coefs: ConstAcc
    order: ConstIdx
    chunk_rows: ConstIdx
    dx: OutT
    dres: OutRes
    part_w: OutAcc
    part_b: OutAcc
    rows: LongLong
    hidden: Int
    rows_per_chunk: LongLong
    weight_offset: Double
    alpha: Double
    vec: Int


@dataclass(frozen=True)
class EwFwdArgs(_Args):
    """``ew_fwd``'s parameters (the element-wise family)."""

    x: ConstT
    alpha: ConstW
    shift: ConstW
    weight: ConstW
    bias: ConstW
    y: OutT
    rows: LongLong
    hidden: Int
    rows_per_chunk: LongLong
    p: Double
    vec: Int


@dataclass(frozen=True)
class EwBwdArgs(_Args):
    """``ew_bwd``'s parameters."""

    dy: ConstT
    x: ConstT
    alpha: ConstW
    shift: ConstW
    weight: ConstW
    dx: OutT
    part_w: OutAcc
    part_b: OutAcc
    part_a: OutAcc
    part_s: OutAcc
    rows: LongLong
    hidden: Int
    rows_per_chunk: LongLong
    p: Double
    vec: Int


#: kernel name -> its argument dataclass
ConstI8 = Annotated[Any, "const signed char*"]
OutI8 = Annotated[Any, "signed char*"]
ConstF64 = Annotated[Any, "const double*"]
OutF64 = Annotated[Any, "double*"]
OutF32 = Annotated[Any, "float*"]


@dataclass(frozen=True)
class QuantInt8Args(_Args):
    """``quant_int8``'s parameters (the quantize family: an int8 input's exact statistics and the epilogue)."""

    x: ConstI8
    x_scale: ConstF64
    weight: ConstW
    bias: ConstW
    q: OutI8
    y: OutF32
    scale_out: OutF32
    amax_out: OutF64
    keep: OutBool
    mean_out: OutF64
    rstd_out: OutF64
    rows: LongLong
    hidden: Int
    eps: Double
    correction: Int
    eps_mode: Int
    offset: Double
    mode: Int
    scale: Double


@dataclass(frozen=True)
class QuantFloatArgs(_Args):
    """``quant_float``'s parameters (the quantize epilogue on a normalized float ``y``)."""

    y_in: ConstT
    q: OutI8
    scale_out: OutF32
    amax_out: OutF64
    keep: OutBool
    rows: LongLong
    hidden: Int
    mode: Int
    scale: Double


@dataclass(frozen=True)
class QuantDequantArgs(_Args):
    """``quant_dequant``'s parameters (the real input ``x * x_scale`` of an int8 ``x``)."""

    x: ConstI8
    x_scale: ConstF64
    out: OutT
    rows: LongLong
    hidden: Int


@dataclass(frozen=True)
class QuantMaskArgs(_Args):
    """``quant_mask``'s parameters (the straight-through gradient: ``dy`` where ``keep``, else 0)."""

    dy: ConstT
    keep: ConstBool
    out: OutT
    n: LongLong


@dataclass(frozen=True)
class InTypeFwdArgs(_Args):
    """``intype_fwd``'s parameters (``casting="none"``: every operation in x's type)."""

    x: ConstT
    we: ConstF64
    bt: ConstF64
    y: OutT
    mean_out: OutF64
    rstd_out: OutF64
    rows: LongLong
    hidden: Int
    eps: Double
    centered: Int
    correction: Int
    eps_mode: Int


@dataclass(frozen=True)
class InTypeBwdArgs(_Args):
    """``intype_bwd``'s parameters."""

    dy: ConstT
    x: ConstT
    we: ConstF64
    dx: OutT
    rows: LongLong
    hidden: Int
    eps: Double
    centered: Int
    correction: Int
    eps_mode: Int


@dataclass(frozen=True)
class InTypeParamsArgs(_Args):
    """``intype_params``'s parameters."""

    dy: ConstT
    x: ConstT
    mean: ConstF64
    rstd: ConstF64
    dweight: OutF64
    dbias: OutF64
    rows: LongLong
    hidden: Int
    centered: Int


@dataclass(frozen=True)
class FpqRowsArgs(_Args):
    """``quant_fp_rows``'s parameters (FP8 / FP4 codes and block scales of a float ``y``; :mod:`.fp_quant`)."""

    y: ConstT
    codes: OutU8
    sf: OutF32
    sc: OutU8
    rows: LongLong
    hidden: Int
    kind: Int
    mbits: Int
    emin: Int
    max_code: Int
    sign_shift: Int
    over: Int
    nan: Int
    emax: Int
    mt: Int
    block: Int
    s_tensor: Double
    ceil_rule: Int
    g: Double


@dataclass(frozen=True)
class FpqAmaxArgs(_Args):
    """``quant_fp_amax``'s parameters (each row's largest magnitude, NaN ignored)."""

    y: ConstT
    amax_out: OutF32
    rows: LongLong
    hidden: Int


KERNEL_ARGS = {
    "stats_fwd": FwdArgs,
    "stats_bwd": BwdArgs,
    "stats_bwd_stats": BwdStatsArgs,
    "stats_bwd_apply": BwdApplyArgs,
    "ew_fwd": EwFwdArgs,
    "ew_bwd": EwBwdArgs,
    "quant_int8": QuantInt8Args,
    "quant_fp_rows": FpqRowsArgs,
    "quant_fp_amax": FpqAmaxArgs,
    "quant_float": QuantFloatArgs,
    "quant_dequant": QuantDequantArgs,
    "quant_mask": QuantMaskArgs,
    "intype_fwd": InTypeFwdArgs,
    "intype_bwd": InTypeBwdArgs,
    "intype_params": InTypeParamsArgs,
}
