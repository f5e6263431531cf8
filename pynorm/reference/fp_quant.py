r"""FP8 / FP4 quantization, the exact reference (NumPy; the ``numpy`` backend's quantizer and the oracle).

Every step is an exact integer operation or one IEEE float32 operation, so another implementation that performs
the same operations (the numba and CUDA quantizers) gives bitwise the same codes and scales.

Elements (:data:`pynorm.ops.fp_quant.ELEMENTS`). A float32 ``v`` is encoded by :func:`encode` on its bits: its
magnitude rounded to the element format's nearest value, ties to even (subnormals included, a carry into the next
binade as the format's own), then

* beyond the largest finite value (448, 57344, 6): that value (``overflow="saturate"``), or NaN (e4m3) /
  infinity (e5m2) (``overflow="nan"``, the plain conversion); FP4 has neither and always saturates;
* NaN: the format's NaN code ``0x7F`` (e4m3) / ``0x7E`` (e5m2); 0 in FP4 (which has no NaN);
* the sign is kept (``-0.0`` and negative values that round to zero give the negative zero code).

Scales. ``y`` is first converted to float32 (exact for float16/bfloat16); ``amax`` is the largest ``|y|`` of the
unit, NaN ignored (0 when none). Operations written ``/`` and ``*`` below are IEEE float32 operations (one
rounding each).

* FP8 ``"tensor"``/``"row"``/``"group"``: ``s = amax / fmax`` (1 where that is not a positive finite float32:
  ``amax`` 0 or infinite), or the given static ``s``; codes ``encode(y / s)``; decoded ``code * s``.
* MX (blocks of 32): the E8M0 exponent ``e = floor(log2 amax) - emax_elem`` (``emax_elem`` = 8, 15, 2 for e4m3,
  e5m2, e2m1; OCP MX v1.0) or, with ``scale_rule="ceil"``, the smallest ``e`` with ``amax <= fmax * 2^e``,
  clamped to ``[-127, 127]`` (``amax = 0``: ``e = -127``); scale code ``e + 127``; codes ``encode(y * 2^-e)`` (the
  product exact, in float64, then to float32); decoded ``code * 2^e``. A block holding an infinity gets the NaN
  scale ``0xFF`` and codes 0: it decodes to NaN (the spec's rule for a NaN scale).
* NVFP4 (blocks of 16): the global scale ``g`` (given, or ``amax_tensor / 2688`` with 2688 = 448 * 6; 1 where not
  a positive finite float32); the block scale code ``sb = encode_e4m3((amax / 6) / g)`` (saturating);
  ``S = decode(sb) * g``; codes ``encode_e2m1(y / S)`` (0 where ``S`` is 0 or infinite); decoded
  ``(code * decode(sb)) * g``.

Layouts. FP4 codes are packed two per byte, element ``2j`` in the low nibble of byte ``j``
(``nibble_order="low_first"``) or the high one; an odd row's last byte is padded with a zero nibble. Block scales
are ``(R, blocks)`` row-major, or ``"swizzled"``: padded to ``(128 * ceil(R / 128), 4 * ceil(blocks / 4))`` with
zeros, and scale ``(r, c)`` at byte ``512 * (ceil(C / 4) * (r // 128) + c // 4) + 16 * (r % 32) + 4 * ((r % 128)
// 32) + c % 4`` of a flat array (the 128 x 4 tiles of cuBLAS/CUTLASS block-scaled GEMMs).

Backward: the straight-through estimator -- the gradient w.r.t. the dequantized output passes to ``y`` unchanged
(scales constant, rounding and saturation not differentiated).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..ops.fp_quant import ELEMENTS, Element, Quantized, QuantSpec, in_shape

__all__ = [
    "NVFP4_GLOBAL",
    "block_amax",
    "decode",
    "decode_e8m0",
    "dequantize",
    "encode",
    "finite_amax",
    "mx_exponent",
    "nvfp4_global",
    "pack_fp4",
    "quantize",
    "quantize_rows",
    "rows_of",
    "scales_in_layout",
    "swizzle",
    "tensor_scale",
    "unpack_fp4",
    "unswizzle",
    "xp_of",
]

#: NVFP4's default global scale divisor: ``fmax(e4m3) * fmax(e2m1)``
NVFP4_GLOBAL = 448.0 * 6.0


def encode(v: np.ndarray, el: Element, overflow: str = "saturate", rounding: str = "rne") -> np.ndarray:
    """The ``el`` codes (uint8; 4-bit codes in the low nibble) of the float32 values ``v`` (see the module doc).
    ``rounding="trunc"`` truncates the magnitude instead (toward zero): not a convention of this library, the
    mistake :func:`pynorm.oracle.check_quantizer` emulates."""
    b = np.ascontiguousarray(v, dtype=np.float32).view(np.uint32).astype(np.int64)
    sign = b >> 31
    a = b & 0x7FFFFFFF
    biased = a >> 23
    e = biased - 127
    m = (a & 0x7FFFFF) | 0x800000
    te = np.maximum(e, el.emin)
    shift = np.minimum(23 - el.mbits + (te - e), 26)  # beyond 26 bits the value is below half the least subnormal
    if rounding == "trunc":
        r = m >> shift
    else:
        r = (m + (np.int64(1) << (shift - 1)) - 1 + ((m >> shift) & 1)) >> shift  # round to nearest, ties to even
    code = ((te - el.emin) << el.mbits) + r
    code = np.where(biased == 0, 0, code)  # float32 zeros and subnormals: below every format's least subnormal
    over = code > el.max_code  # (infinity too)
    sat = el.over_code is None or overflow == "saturate"
    code = np.where(over, el.max_code if sat or el.over_code is None else el.over_code, code)
    code = code | (sign << (el.nbits - 1))
    code = np.where(a > 0x7F800000, 0 if el.nan_code is None else el.nan_code, code)
    return code.astype(np.uint8)


def _table(el: Element) -> np.ndarray:
    """The float32 value of every code of ``el`` (from the format's definition)."""
    vals = []
    for c in range(1 << el.nbits):
        s = -1.0 if c >> (el.nbits - 1) else 1.0
        ef = (c >> el.mbits) & ((1 << el.ebits) - 1)
        mf = c & ((1 << el.mbits) - 1)
        mag = c & ((1 << (el.nbits - 1)) - 1)
        if el.nan_code is not None and mag > el.max_code:
            v = np.inf if (el.over_code != el.nan_code and mag == el.over_code) else np.nan
        elif ef == 0:
            v = np.ldexp(float(mf), el.emin - el.mbits)
        else:
            v = np.ldexp(1.0 + mf / (1 << el.mbits), ef - el.bias)
        vals.append(s * v)
    return np.array(vals, dtype=np.float32)


_TABLES = {name: _table(el) for name, el in ELEMENTS.items()}


def xp_of(a: Any) -> Any:
    """The array module of ``a``: CuPy for a CuPy array (a GPU backend's results laid out by this module's integer
    code), else NumPy."""
    mod = type(a).__module__
    if mod.startswith("cupy"):
        import cupy

        return cupy
    return np


def decode(codes: np.ndarray, el: Element) -> np.ndarray:
    """The float32 values of ``el`` codes (uint8; 4-bit codes in the low nibble)."""
    xp = xp_of(codes)
    return xp.asarray(_TABLES[el.name])[xp.asarray(codes, dtype=np.uint8) & ((1 << el.nbits) - 1)]  # type: ignore[no-any-return]


def decode_e8m0(codes: np.ndarray) -> np.ndarray:
    """E8M0 scale codes to float32: ``2^(code - 127)``, NaN for ``0xFF``."""
    xp = xp_of(codes)
    c = xp.asarray(codes, dtype=np.uint8)
    v = xp.ldexp(xp.ones(c.shape, dtype=np.float64), c.astype(np.int64) - 127)
    return xp.where(c == 0xFF, np.nan, v).astype(np.float32)  # type: ignore[no-any-return]


def mx_exponent(amax: np.ndarray, el: Element, rule: str) -> np.ndarray:
    """The E8M0 scale codes (uint8) of float32 block maxima ``amax`` (``>= 0``, NaN-free) for elements ``el``."""
    a = np.asarray(amax, dtype=np.float64)
    frac, ex = np.frexp(a)  # a = frac * 2^ex, frac in [0.5, 1): floor(log2 a) = ex - 1 (exact, subnormals too)
    e = ex.astype(np.int64) - 1 - el.emax
    if rule == "ceil":
        e = e + (2.0 * frac > el.max_significand)
    e = np.clip(e, -127, 127)
    code = np.where(a == 0, 0, e + 127)
    return np.where(np.isinf(a), 0xFF, code).astype(np.uint8)


def block_amax(y32: np.ndarray, block: int) -> np.ndarray:
    """``(R, ceil(H / block))`` float32 maxima of ``|y|`` over consecutive blocks of each row (NaN ignored)."""
    r, h = y32.shape
    nb = -(-h // block)
    a = np.abs(y32)
    a = np.where(np.isnan(a), np.float32(0), a)
    pad = np.zeros((r, nb * block), dtype=np.float32)
    pad[:, :h] = a
    return pad.reshape(r, nb, block).max(axis=2, initial=np.float32(0)) if r else np.zeros((0, nb), np.float32)


def _f32(v: Any) -> np.ndarray:
    return np.asarray(v, dtype=np.float32)


def _scaled_scale(amax: np.ndarray, el: Element) -> np.ndarray:
    """``amax / fmax`` in float32, 1 where not a positive finite float32."""
    with np.errstate(all="ignore"):
        s = _f32(amax) / np.float32(el.fmax)
    return np.where((s > 0) & np.isfinite(s), s, np.float32(1)).astype(np.float32)


def finite_amax(y32: np.ndarray) -> np.float32:
    """The largest ``|y|`` of a float32 array, NaN ignored (0 when none)."""
    a = np.abs(y32)
    return np.float32(np.max(np.where(np.isnan(a), np.float32(0), a), initial=np.float32(0)))


def tensor_scale(amax: Any, spec: QuantSpec) -> np.ndarray:
    """The ``(1,)`` float32 scale of an FP8 ``scaling="tensor"`` output: the given one or ``amax / fmax``."""
    if spec.scale is not None:
        return np.full(1, spec.scale, dtype=np.float32)
    return _scaled_scale(np.full(1, amax, dtype=np.float32), spec.fmt.element)


def nvfp4_global(amax: Any, given: float | None) -> np.float32:
    """NVFP4's global scale: ``given``, or ``amax / 2688`` in float32 (1 where not a positive finite float32)."""
    if given is not None:
        return np.float32(given)
    with np.errstate(all="ignore"):
        g = np.float32(amax) / np.float32(NVFP4_GLOBAL)
    return g if (g > 0 and np.isfinite(g)) else np.float32(1)


def _expand(s: np.ndarray, block: int, h: int) -> np.ndarray:
    """Per-block values ``(R, nb)`` repeated over each block's elements: ``(R, H)``."""
    return np.repeat(s, block, axis=1)[:, :h]


def quantize_rows(
    y: np.ndarray, spec: QuantSpec, emulate: Mapping[str, Any] | None = None
) -> tuple[np.ndarray, np.ndarray, Any]:  # fmt: skip
    """``(codes, scales, global_scale)`` of the ``(R, H)`` array ``y``: codes ``(R, H)`` uint8 (unpacked), scales
    row-major float32 ``(1,)``/``(R,)``/``(R, groups)`` or the block formats' ``(R, blocks)`` uint8 codes, the
    NVFP4 global scale (a float32) or None.

    ``emulate``: mistakes of other implementations, for :func:`pynorm.oracle.check_quantizer` only --
    ``rounding="trunc"`` (elements truncated), ``amax_block`` (a block's ``amax`` taken over its first
    ``amax_block`` elements only, or ``"row"``: over the whole row), ``no_global=True`` (NVFP4's global scale
    ignored: 1)."""
    em = dict(emulate or {})
    rounding = em.get("rounding", "rne")
    fmt = spec.fmt
    el = fmt.element
    with np.errstate(all="ignore"):
        y32 = np.asarray(y).astype(np.float32)
    r, h = y32.shape

    def amax_of(block: int) -> np.ndarray:
        wrong = em.get("amax_block")
        if wrong == "row":
            return np.repeat(block_amax(y32, max(h, 1)), -(-h // block), axis=1)
        if wrong is not None and wrong < block:
            nb = -(-h // block)
            part = np.zeros((r, nb * block), dtype=np.float32)
            part[:, :h] = np.where(np.isnan(y32), np.float32(0), np.abs(y32))
            return part.reshape(r, nb, block)[:, :, :wrong].max(axis=2, initial=np.float32(0))
        return block_amax(y32, block)

    with np.errstate(all="ignore"):
        if fmt.kind == "scaled":
            if spec.scale is not None or spec.scaling == "tensor":
                scales = tensor_scale(finite_amax(y32), spec)
                s = scales.reshape(1, 1)
            else:
                block = spec.block_size(h)
                s = _scaled_scale(amax_of(block), el)
                scales = s.reshape(r) if spec.scaling == "row" else s
            full = s if s.shape[0] == 1 and s.shape[1] == 1 else _expand(s, spec.block_size(h), h)
            codes = encode(y32 / full, el, spec.overflow, rounding)
            return codes, scales, None
        block = fmt.block
        am = amax_of(block)
        if fmt.kind == "mx":
            sc = mx_exponent(am, el, spec.scale_rule)
            e = _expand(sc.astype(np.int64) - 127, block, h)
            v = np.ldexp(y32.astype(np.float64), -e).astype(np.float32)
            codes = encode(v, el, spec.overflow, rounding)
            codes = np.where(_expand(sc, block, h) == 0xFF, np.uint8(0), codes)
            return codes, sc, None
        g = np.float32(1) if em.get("no_global") else nvfp4_global(finite_amax(y32), spec.global_scale)
        e4 = ELEMENTS["e4m3"]
        sb = encode((am / np.float32(6)) / g, e4, "saturate")
        big = decode(sb, e4) * g
        S = _expand(big, block, h)
        ok = (S > 0) & np.isfinite(S)
        v = np.where(ok, y32 / np.where(ok, S, np.float32(1)), np.float32(0)).astype(np.float32)
        return encode(v, el, "saturate", rounding), sb, np.float32(g)


def pack_fp4(codes: np.ndarray, order: str = "low_first") -> np.ndarray:
    """``(R, H)`` 4-bit codes packed two per byte: ``(R, ceil(H / 2))`` uint8."""
    r, h = codes.shape
    c = xp_of(codes).zeros((r, h + (h & 1)), dtype=np.uint8)
    c[:, :h] = codes & 0xF
    even, odd = c[:, 0::2], c[:, 1::2]
    return (even | (odd << 4)) if order == "low_first" else ((even << 4) | odd)


def unpack_fp4(packed: np.ndarray, h: int, order: str = "low_first") -> np.ndarray:
    """The inverse of :func:`pack_fp4`: ``(R, h)`` 4-bit codes."""
    p = np.asarray(packed, dtype=np.uint8)
    lo, hi = p & 0xF, p >> 4
    even, odd = (lo, hi) if order == "low_first" else (hi, lo)
    out = np.empty((p.shape[0], 2 * p.shape[1]), dtype=np.uint8)
    out[:, 0::2], out[:, 1::2] = even, odd
    return out[:, :h]


def swizzle_index(rows: int, cols: int) -> np.ndarray:
    """``(rows, cols)`` int64 positions of each scale in the flat swizzled array (see the module doc)."""
    r = np.arange(rows)[:, None]
    c = np.arange(cols)[None, :]
    ct = -(-cols // 4)
    return 512 * (ct * (r // 128) + c // 4) + 16 * (r % 32) + 4 * ((r % 128) // 32) + c % 4


def swizzle(s: np.ndarray) -> np.ndarray:
    """The ``(R, C)`` block scales in the 128 x 4 swizzled layout: a flat array of ``128 ceil(R/128) * 4 ceil(C/4)``
    elements, zeros in the padding."""
    rows, cols = s.shape
    xp = xp_of(s)
    out = xp.zeros(128 * -(-rows // 128) * 4 * -(-cols // 4), dtype=s.dtype)
    out[xp.asarray(swizzle_index(rows, cols))] = s
    return out  # type: ignore[no-any-return]


def unswizzle(flat: np.ndarray, rows: int, cols: int) -> np.ndarray:
    """The ``(rows, cols)`` block scales of a flat swizzled array."""
    return np.asarray(flat)[swizzle_index(rows, cols)]


def layout(codes: np.ndarray, scales: np.ndarray, g: Any, spec: QuantSpec) -> tuple[np.ndarray, np.ndarray, Any]:
    """Codes and scales of :func:`quantize_rows` in the spec's layout (FP4 packed; block scales as float32 values
    and/or swizzled), still with ``R`` rows."""
    if spec.fmt.packed:
        codes = pack_fp4(codes, spec.nibble_order)
    return codes, scales_in_layout(scales, spec), g


def scales_in_layout(scales: np.ndarray, spec: QuantSpec) -> np.ndarray:
    """Row-major scales (a block format's codes) in the spec's layout: their float32 values (``scale_dtype``)
    and/or swizzled (``scale_layout``)."""
    fmt = spec.fmt
    if fmt.kind != "scaled":
        if spec.scale_dtype == "float32":
            scales = decode_e8m0(scales) if fmt.kind == "mx" else decode(scales, ELEMENTS["e4m3"])
        if spec.scale_layout == "swizzled":
            scales = swizzle(scales)
    return scales


def quantized(
    codes: Any, scales: Any, g: Any, y: Any, spec: QuantSpec, shape: tuple[int, ...], lead: tuple[int, ...],
    xp: Any = np,
) -> Quantized:  # fmt: skip
    """The :class:`Quantized` of ``(R, .)`` results in the spec's layout for a ``y`` of ``shape`` whose rows are the
    leading dims ``lead``: codes ``(*lead, .)``, scales per the scaling (:func:`~pynorm.ops.fp_quant.in_shape`)."""
    gs = None if g is None else xp.asarray(np.float32(g)).reshape(())
    q = Quantized(codes, scales, gs, y if spec.keep_y else None, spec, tuple(shape))
    return in_shape(q, tuple(shape), len(lead))


def rows_of(shape: tuple[int, ...], axis: int) -> tuple[tuple[int, ...], int, int]:
    """``(lead, R, H)`` of an array of ``shape`` whose rows are the dims from ``axis`` on."""
    ax = axis % len(shape)
    lead = tuple(shape[:ax])
    return lead, math.prod(lead), math.prod(shape[ax:])  # (math.prod: numpy.prod is ~4 us of a small call)


def quantize(y: np.ndarray, spec: QuantSpec, axis: int = -1) -> Quantized:
    """``y`` quantized by ``spec`` along its rows: the dims ``y.shape[axis:]`` flattened (the last by default)."""
    y = np.asarray(y)
    lead, r, h = rows_of(tuple(y.shape), axis)
    codes, scales, g = layout(*quantize_rows(y.reshape(r, h), spec), spec)
    return quantized(codes, scales, g, y, spec, tuple(y.shape), lead)


def dequantize(q: Quantized) -> np.ndarray:
    """The float32 values a :class:`Quantized` stands for, in its shape."""
    spec, fmt = q.spec, q.spec.fmt
    el = fmt.element
    shape = q.shape
    codes = np.asarray(q.codes)
    r = int(np.prod(codes.shape[:-1]))
    h = int(np.prod(shape[codes.ndim - 1 :]))
    c2 = codes.reshape(r, -1)
    if fmt.packed:
        c2 = unpack_fp4(c2, h, spec.nibble_order)
    vals = decode(c2, el)
    with np.errstate(all="ignore"):
        if fmt.kind == "scaled":
            s = np.asarray(q.scales, dtype=np.float32)
            if s.ndim == 0:
                full = s.reshape(1, 1)
            elif spec.scaling == "row":
                full = s.reshape(r, 1)
            else:
                full = _expand(s.reshape(r, -1), spec.group_size, h)
            out = vals * full
        else:
            nb = -(-h // fmt.block)
            sc = np.asarray(q.scales)
            sc = unswizzle(sc, r, nb) if spec.scale_layout == "swizzled" else sc.reshape(r, nb)
            if spec.scale_dtype == "code":
                sc = decode_e8m0(sc) if fmt.kind == "mx" else decode(sc, ELEMENTS["e4m3"])
            sv = _expand(np.asarray(sc, dtype=np.float32), fmt.block, h)
            out = vals * sv
            if fmt.kind == "nvfp4":
                out = out * np.float32(q.global_scale)
    return out.astype(np.float32).reshape(shape)
