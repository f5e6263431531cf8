"""FP8 / FP4 quantized outputs: the format records and the user's output spec (:class:`QuantSpec`).

A norm's output ``y`` (``layer_norm``, ``rms_norm``, ``add_layer_norm``, ``add_rms_norm`` with ``quantize=``) or
any float array (:func:`pynorm.quantize`) is quantized by one mechanism, in three steps each fixed here and
computed exactly by :mod:`pynorm.reference.fp_quant`:

1. ``y`` in float32 (exact for 16-bit outputs; a float64 ``y`` rounded once);
2. one scale per unit -- the tensor, a row, a 1 x G group of a row, or a block of 32 (MX) or 16 (NVFP4) -- from
   the unit's ``amax = max |y|`` (NaN ignored);
3. every element scaled into the element format and rounded to nearest, ties to even, saturating (or not) at the
   format's largest finite value.

The math, the non-finite rules and each convention are in :mod:`pynorm.reference.fp_quant`; the user
documentation in ``docs/norms/quantized_outputs.md``.
"""

from __future__ import annotations

import importlib
import math
import numbers
from dataclasses import dataclass
from typing import Any, NamedTuple

from ..errors import ArgumentError, ArgumentTypeError
from ._spec import Option, check_scale

__all__ = [
    "ELEMENTS",
    "FORMATS",
    "QUANTIZE",
    "QUANTIZE_OPTION_DOC",
    "QUANTIZE_RESULT_DOC",
    "Element",
    "Format",
    "QuantSpec",
    "Quantized",
    "check_quant_spec",
    "in_shape",
    "quantize_outputs",
    "quantize_result",
]


@dataclass(frozen=True)
class Element:
    """An element format: ``nbits`` bits, sign, ``ebits`` exponent bits of bias ``bias``, ``mbits`` mantissa bits.

    ``max_code``: the code of the largest finite magnitude; ``nan_code``: the canonical NaN (None: no NaN);
    ``over_code``: what a value beyond the largest finite becomes without saturation (e4m3: NaN, e5m2: inf;
    None: the format has neither, it always saturates)."""

    name: str
    nbits: int
    ebits: int
    mbits: int
    bias: int
    max_code: int
    nan_code: int | None
    over_code: int | None

    @property
    def emin(self) -> int:
        """The exponent of the smallest normal value (``1 - bias``)."""
        return 1 - self.bias

    @property
    def emax(self) -> int:
        """The exponent of the largest finite value (the MX scale's ``emax_elem``)."""
        return (self.max_code >> self.mbits) - self.bias

    @property
    def max_significand(self) -> float:
        """The largest finite value's significand (1.75 for e4m3 and e5m2, 1.5 for e2m1)."""
        return 1.0 + (self.max_code & ((1 << self.mbits) - 1)) / (1 << self.mbits)

    @property
    def fmax(self) -> float:
        """The largest finite value (448, 57344, 6)."""
        return math.ldexp(self.max_significand, self.emax)


#: the element formats: OCP FP8 e4m3 ("fn": no infinities, one NaN per sign) and e5m2 (IEEE-like), FP4 e2m1
ELEMENTS: dict[str, Element] = {
    "e4m3": Element("e4m3", 8, 4, 3, 7, 0x7E, 0x7F, 0x7F),
    "e5m2": Element("e5m2", 8, 5, 2, 15, 0x7B, 0x7E, 0x7C),
    "e2m1": Element("e2m1", 4, 2, 1, 1, 0x7, None, None),
}


@dataclass(frozen=True)
class Format:
    """A quantized output format: its element format, its scaling kind (``"scaled"``: one float32 scale per
    tensor, row or group; ``"mx"``: OCP Microscaling blocks with E8M0 scales; ``"nvfp4"``: blocks with E4M3 scales
    and a float32 global scale) and its block size (0 where the caller picks the unit)."""

    name: str
    element: Element
    kind: str
    block: int = 0

    @property
    def packed(self) -> bool:
        """Two codes per byte (a 4-bit element)."""
        return self.element.nbits == 4


FORMATS: dict[str, Format] = {
    "fp8_e4m3": Format("fp8_e4m3", ELEMENTS["e4m3"], "scaled"),
    "fp8_e5m2": Format("fp8_e5m2", ELEMENTS["e5m2"], "scaled"),
    "mxfp8_e4m3": Format("mxfp8_e4m3", ELEMENTS["e4m3"], "mx", 32),
    "mxfp8_e5m2": Format("mxfp8_e5m2", ELEMENTS["e5m2"], "mx", 32),
    "mxfp4": Format("mxfp4", ELEMENTS["e2m1"], "mx", 32),
    "nvfp4": Format("nvfp4", ELEMENTS["e2m1"], "nvfp4", 16),
}

_CHOICES = {
    "scaling": ("tensor", "row", "group"),
    "scale_rule": ("floor", "ceil"),
    "overflow": ("saturate", "nan"),
    "scale_layout": ("row_major", "swizzled"),
    "scale_dtype": ("code", "float32"),
    "nibble_order": ("low_first", "high_first"),
}


@dataclass(frozen=True)
class QuantSpec:
    """How a float output is quantized to FP8 or FP4 (see ``docs/norms/quantized_outputs.md``).

    Parameters
    ----------
    format : ``"fp8_e4m3"``, ``"fp8_e5m2"`` (one float32 scale per ``scaling`` unit), ``"mxfp8_e4m3"``,
        ``"mxfp8_e5m2"``, ``"mxfp4"`` (OCP Microscaling: blocks of 32 along the row, one E8M0 scale each),
        ``"nvfp4"`` (e2m1 elements, blocks of 16, one E4M3 scale each and a float32 global scale).
    scaling : FP8 only: ``"tensor"`` (one scale), ``"row"`` (one per row: per-token), ``"group"`` (one per
        ``1 x group_size`` slice of a row, the last one possibly shorter).
    group_size : the group length of ``scaling="group"`` (128: DeepSeek-V3 / vLLM group-wise FP8).
    scale : FP8 only: a given (static, calibrated) per-tensor scale ``s``; ``y`` is encoded as ``y / s``.
    scale_rule : MX only: the E8M0 exponent ``floor(log2(amax)) - emax_elem`` (``"floor"``, the OCP spec's) or
        the smallest exponent for which no element of the block exceeds the format's max (``"ceil"``).
    overflow : ``"saturate"`` (values beyond the largest finite value become it; ``__NV_SATFINITE``) or
        ``"nan"`` (plain round-to-nearest-even conversion: e4m3 gives NaN, e5m2 infinity). FP4 always saturates.
    global_scale : NVFP4 only: a given float32 global scale ``g`` (None: ``amax(y) / (448 * 6)``).
    scale_layout : block formats: ``"row_major"`` (``(*rows, blocks)``) or ``"swizzled"`` (the 128 x 4 tiles of
        cuBLAS/CUTLASS block-scaled GEMMs, padded with zeros, as a flat array).
    scale_dtype : block formats: ``"code"`` (uint8 E8M0 / E4M3 codes) or ``"float32"`` (their values).
    nibble_order : FP4: which nibble of a byte holds the even element (``"low_first"``: bits 0-3).
    keep_y : also return the float ``y`` (``Quantized.y``).
    """

    format: str
    scaling: str = "row"
    group_size: int = 128
    scale: float | None = None
    scale_rule: str = "floor"
    overflow: str = "saturate"
    global_scale: float | None = None
    scale_layout: str = "row_major"
    scale_dtype: str = "code"
    nibble_order: str = "low_first"
    keep_y: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.format, str) or self.format not in FORMATS:
            raise ArgumentError(f"format must be one of {', '.join(map(repr, FORMATS))}, got {self.format!r}")
        for name, choices in _CHOICES.items():
            v = getattr(self, name)
            if not isinstance(v, str) or v not in choices:
                raise ArgumentError(f"{name} must be one of {', '.join(map(repr, choices))}, got {v!r}")
        g = self.group_size
        if isinstance(g, bool) or not isinstance(g, numbers.Integral) or g < 1:
            raise ArgumentError(f"group_size must be a positive integer, got {g!r}")
        object.__setattr__(self, "group_size", int(g))
        if not isinstance(self.keep_y, bool):
            raise ArgumentTypeError(f"keep_y must be a bool, got {self.keep_y!r}")
        object.__setattr__(self, "scale", check_scale(self.scale, "scale"))
        object.__setattr__(self, "global_scale", check_scale(self.global_scale, "global_scale"))
        fmt = FORMATS[self.format]
        if fmt.kind != "scaled" and self.scale is not None:
            raise ArgumentError(f"scale is a per-tensor FP8 scale; {self.format} computes its block scales")
        if fmt.kind != "nvfp4" and self.global_scale is not None:
            raise ArgumentError(f"global_scale is NVFP4's; {self.format} has none")
        if self.scale is not None and self.scaling != "tensor":
            raise ArgumentError("a given scale is one scale for the whole tensor: use it with scaling='tensor'")
        if fmt.element.over_code is None and self.overflow != "saturate":
            raise ArgumentError(f"{self.format}'s e2m1 elements have no NaN nor infinity: overflow must be 'saturate'")

    @property
    def fmt(self) -> Format:
        """The :class:`Format` record."""
        return FORMATS[self.format]

    def block_size(self, hidden: int) -> int:
        """The number of consecutive elements of a row sharing a scale (``hidden`` for ``"row"``/``"tensor"``)."""
        f = self.fmt
        if f.block:
            return f.block
        return self.group_size if self.scaling == "group" else hidden

    def output_nbytes(self, rows: int, hidden: int) -> int:
        """The bytes of the codes and scales of ``rows`` rows of ``hidden`` elements (in this spec's layout)."""
        f = self.fmt
        codes = rows * (-(-hidden // 2) if f.packed else hidden)
        if f.kind == "scaled":
            n = (
                1
                if (self.scale is not None or self.scaling == "tensor")
                else rows * -(-hidden // self.block_size(hidden))
            )
            return codes + 4 * n
        nb = -(-hidden // f.block)
        n = rows * nb if self.scale_layout == "row_major" else 128 * -(-rows // 128) * 4 * -(-nb // 4)
        return codes + n * (4 if self.scale_dtype == "float32" else 1) + (4 if f.kind == "nvfp4" else 0)


class Quantized(NamedTuple):
    """A quantized array: what ``quantize=`` makes a norm return (and :func:`pynorm.quantize`).

    Attributes
    ----------
    codes : uint8, ``(*rows, H)`` (FP8) or ``(*rows, ceil(H / 2))`` (FP4, two codes per byte).
    scales : the scales: float32 ``()`` (``scaling="tensor"``), ``(*rows,)`` (``"row"``), ``(*rows, groups)``
        (``"group"``); block formats ``(*rows, blocks)`` uint8 codes (or float32), or a flat swizzled array.
    global_scale : NVFP4's float32 global scale (a 0-d array), else None.
    y : the float ``y`` when ``keep_y``, else None.
    spec : the :class:`QuantSpec`.
    shape : the shape of the quantized array (``y``'s).
    """

    codes: Any
    scales: Any
    global_scale: Any
    y: Any
    spec: QuantSpec
    shape: tuple[int, ...]


def check_quant_spec(v: Any, name: str) -> QuantSpec | None:
    """An option validator: None, a :class:`QuantSpec`, or a format name (``QuantSpec(name)``)."""
    if v is None or isinstance(v, QuantSpec):
        return v
    if isinstance(v, str):
        return QuantSpec(v)
    raise ArgumentTypeError(f"{name} must be None, a pynorm.QuantSpec or a format name, got {type(v).__name__}")


#: the ``quantize=`` option of the norms with a quantized output mode (public only, offered to the backends: an op
#: that serves it quantizes each row in the norm's output pass; else the backend computes ``y`` and the quantizer of
#: the same backend quantizes it, :func:`quantize_on`; ``Context.served`` says which)
QUANTIZE_OPTION_DOC = (
    "None (a float y), or a pynorm.QuantSpec (or a format name): y quantized to FP8 / MXFP8 / MXFP4 / NVFP4, "
    "returned as a pynorm.Quantized"
)


#: the ``quantize=`` option (see :data:`QUANTIZE_OPTION_DOC`)
QUANTIZE = Option(
    "quantize", None, check_quant_spec, QUANTIZE_OPTION_DOC, to_backend=False, annotation="Any", offered=True
)

#: what a norm with the ``quantize=`` option returns, for its docstring
QUANTIZE_RESULT_DOC = "``y`` (x's shape and dtype), or a ``pynorm.Quantized`` of ``y`` when ``quantize`` is given"


#: backend name -> the module holding its quantizer (``quantize(y, spec, axis)``, ``dequantize(q)``), loaded by its
#: import path when first used (as the registry loads a backend's package: these are the layers above the specs)
QUANTIZERS = {
    "numpy": "pynorm.reference.fp_quant",
    "numba": "pynorm.backends.numba.fp_quant",
    "cupy": "pynorm.backends.cupy.fp_quant",
}


def quantizer_module(backend: str | None, y: Any) -> Any:
    """The quantizer module of ``backend`` (:data:`QUANTIZERS`; a backend without its own, or None: the CUDA kernels'
    for a CuPy array, else the reference's)."""
    if backend is None or backend not in QUANTIZERS:
        backend = "cupy" if type(y).__module__.startswith("cupy") else "numpy"
    return importlib.import_module(QUANTIZERS[backend])


def quantize_on(backend: str | None, y: Any, spec: QuantSpec, axis: int = -1) -> Quantized:
    """``y`` quantized by ``spec`` with the quantizer of ``backend`` (:func:`quantizer_module`)."""
    return quantizer_module(backend, y).quantize(y, spec, axis)  # type: ignore[no-any-return]


def in_shape(q: Quantized, shape: tuple[int, ...], axis: int) -> Quantized:
    """``q`` of ``(R, .)`` codes and scales (row-major block scales ``(R, blocks)``, FP8 group scales
    ``(R, groups)``, row scales ``(R,)``, a tensor scale of one element; a swizzled layout is flat) for a ``y`` of
    ``shape`` whose rows are the dims before ``axis``: codes ``(*rows, .)``, scales per the scaling
    (:class:`Quantized`), ``y`` (when kept) in ``shape``."""
    spec, fmt = q.spec, q.spec.fmt
    lead = tuple(shape[: axis % len(shape)])
    codes = q.codes.reshape(*lead, q.codes.shape[-1])
    scales = q.scales
    if fmt.kind == "scaled":
        if spec.scale is not None or spec.scaling == "tensor":
            scales = scales.reshape(())
        elif spec.scaling == "row":
            scales = scales.reshape(lead)
        else:
            scales = scales.reshape(*lead, scales.shape[-1])
    elif spec.scale_layout == "row_major":
        scales = scales.reshape(*lead, scales.shape[-1])
    y = None if q.y is None else q.y.reshape(shape)
    return Quantized(codes, scales, q.global_scale, y, spec, tuple(shape))


def quantize_result(outs: tuple[Any, ...], ctx: Any, options: Any) -> Any:
    """The result of a norm with the ``quantize=`` option: its outputs, the first (``y``) quantized when the option
    is given (a :class:`Quantized`) -- by the backend's op in its output pass where it served the option
    (``"quantize" in ctx.served``: a :class:`Quantized` of the rows, shaped here), else by the quantizer of the
    backend that computed ``y`` (a second pass)."""
    spec = options.get("quantize")
    if spec is not None:
        outs = quantize_outputs(outs, spec, "quantize" in ctx.served, ctx.x_shape, ctx.axis, ctx.backend)
    return outs if len(outs) > 1 else outs[0]


def quantize_outputs(
    outs: tuple[Any, ...], spec: QuantSpec, served: bool, shape: tuple[int, ...], axis: int, backend: str
) -> tuple[Any, ...]:  # fmt: skip
    """:func:`quantize_result`'s outputs for a call on an ``x`` of ``shape`` (rows from ``axis``) on ``backend``:
    the first, ``served`` (a :class:`Quantized` of the rows) shaped, or quantized by ``backend``'s quantizer."""
    q = outs[0]
    if not served:
        q = quantize_on(backend, q, spec, axis)
    elif q.shape != shape or axis % len(shape) != len(shape) - 1:
        q = in_shape(q, shape, axis)
    # (else an (R, H) x's rows, which the backend shaped as in_shape does: a small call's microseconds)
    return (q, *outs[1:])
