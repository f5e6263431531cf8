# numba's type stubs do not model jitted calls:
# mypy: disable-error-code="call-arg,attr-defined,var-annotated,call-overload"
"""FP8 / FP4 quantization on the ``numba`` backend: the operations of :mod:`pynorm.reference.fp_quant` on the bits.

One kernel, :func:`fpq_rows`, quantizes rows of float32 ``y`` (passed as their ``uint32`` bits: one signature
whatever ``y``'s dtype): per block (the row, a group, an MX or NVFP4 block) the exact ``amax`` as an integer
maximum of the bits, the block's scale, then each element scaled and encoded by integer rounding
(:func:`_encode`: round to nearest even on the bits, branch-free, no libm). Each float32 operation of the reference
is a float32 operation here (IEEE, compiled without fastmath) or computed in float64 and rounded once to float32 --
the same correctly rounded result, as a quotient or product of two float32s is exact to well within float64's
precision. So the codes and scales are bitwise the reference's. The element loops run over views starting at 0
(they vectorize); each row's codes go through a scratch row, FP4 packed from it. Rows are independent tasks
(:func:`._threads.launch`); a per-tensor scale and NVFP4's global scale take a first pass of the rows' ``amax``
(:func:`row_amax`; their maximum is exact in any order). Swizzling block scales is the reference's integer layout
code.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...ops.fp_quant import ELEMENTS, Quantized, QuantSpec
from ...reference import fp_quant as ref
from ._cache import jit
from ._quant_kernels import _bits_f64
from ._storage import _bits_f32, _f32_bits
from ._threads import launch

__all__ = ["dequantize", "fpq_rows", "quantize", "row_amax"]

#: the scaling kinds of :func:`fpq_rows`
SCALED, MX, NVFP4 = 0, 1, 2
_KINDS = {"scaled": SCALED, "mx": MX, "nvfp4": NVFP4}
_E4M3 = ELEMENTS["e4m3"]
_E4M3_TABLE = ref.decode(np.arange(256, dtype=np.uint8), _E4M3)


@jit(inline="always")
def _f32(b):  # type: ignore[no-untyped-def]
    """The float32 of the bits ``b`` (an int64 holding 32 bits)."""
    return _bits_f32(np.uint32(b))


@jit(inline="always")
def _bits(v):  # type: ignore[no-untyped-def]
    """The bits of the float32 ``v`` as an int64."""
    return np.int64(_f32_bits(v))


@jit(inline="always")
def _encode(b, mbits, emin, max_code, sign_shift, over, nan):  # type: ignore[no-untyped-def]
    """The code of the float32 bits ``b`` (int64) in the element format (``over``: the code of a value beyond the
    largest finite one, ``max_code`` when saturating; ``nan``: the code of NaN) -- the reference's
    :func:`~pynorm.reference.fp_quant.encode`, branch-free (selects only: the loops calling it vectorize)."""
    a = b & 0x7FFFFFFF
    biased = a >> 23
    e = biased - 127
    m = (a & 0x7FFFFF) | 0x800000
    te = max(e, np.int64(emin))
    shift = min(23 - mbits + (te - e), np.int64(26))  # (float32 zeros and subnormals: replaced below)
    r = (m + (np.int64(1) << (shift - 1)) - 1 + ((m >> shift) & 1)) >> shift
    code = ((te - emin) << mbits) + r
    code = np.int64(over) if code > max_code else code
    code = np.int64(0) if biased == 0 else code
    code = code | ((b >> 31) << sign_shift)
    return np.uint8(np.int64(nan) if a > 0x7F800000 else code)


@jit(inline="always")
def _block_amax(br):  # type: ignore[no-untyped-def]
    """The largest magnitude's bits of ``br`` (NaN ignored: their bits count as 0)."""
    m = np.uint32(0)
    for j in range(br.shape[0]):
        u = br[j] & np.uint32(0x7FFFFFFF)
        m = max(m, u if u <= np.uint32(0x7F800000) else np.uint32(0))
    return np.int64(m)


@jit(inline="always")
def _mx_code(ab, emax, mt, ceil):  # type: ignore[no-untyped-def]
    """The E8M0 code of a block maximum's bits ``ab`` (``mt``: the format's largest significand's mantissa bits
    in float32 position, for the ceil rule)."""
    if ab == 0:
        return np.int64(0)
    if ab == 0x7F800000:
        return np.int64(255)
    biased = ab >> 23
    m = ab & 0x7FFFFF
    if biased == 0:  # a subnormal maximum: normalize its mantissa
        k = np.int64(0)
        while (m & 0x800000) == 0:
            m <<= 1
            k += 1
        fl = -126 - k
        m &= 0x7FFFFF
    else:
        fl = biased - 127
    e = fl - emax
    if ceil and m > mt:
        e += 1
    e = max(min(e, np.int64(127)), np.int64(-127))
    return e + 127


@jit()
def fpq_rows(bits, kind, el, block, s_tensor, ceil, g, e4m3, pack, codes, sf, sc, lo, hi):  # type: ignore[no-untyped-def]
    """Rows ``lo <= i < hi`` of the float32 bits ``bits`` (``(R, H)`` uint32) quantized: ``codes`` (``(R, H)``
    uint8; with ``pack`` 1 or 2, ``(R, ceil(H / 2))``, two codes a byte, the even one in the low (1) or high (2)
    nibble), per block float32 scales ``sf`` (FP8) or codes ``sc`` (MX, NVFP4), ``(R, blocks)``.

    ``el``: the element format ``(mbits, emin, max_code, sign_shift, over, nan, emax, mt)``; ``s_tensor`` the
    tensor's float32 scale (0: per block), ``g`` NVFP4's global scale, ``e4m3`` the E4M3 codes' float32 values."""
    mbits, emin, max_code, sign_shift, over, nan, emax, mt = el
    h = bits.shape[1]
    nb = (h + block - 1) // block
    fmax = np.float64(_f32(((emax + 127) << 23) | (mt & 0x7FFFFF)))
    gd = np.float64(g)
    row = np.zeros(h + 1, dtype=np.uint8)  # one row's codes (a zero nibble after an odd row's last)
    for i in range(lo, hi):
        for k in range(nb):
            j0 = k * block
            j1 = min(j0 + block, h)
            bb = bits[i, j0:j1]  # (views from 0: the element loops below vectorize)
            cb = row[j0:j1]
            if kind == SCALED:
                s = s_tensor
                if s == 0:
                    s = np.float32(np.float64(_f32(_block_amax(bb))) / fmax)
                    if not (s > 0 and s < np.inf):
                        s = np.float32(1.0)
                sf[i, k] = s
                _divided(bb, cb, s, el)
            elif kind == MX:
                c = _mx_code(_block_amax(bb), emax, mt, ceil)
                sc[i, k] = np.uint8(c)
                if c == 255:
                    cb[:] = 0
                    continue
                mul = _f64_pow2(127 - c)
                for j in range(cb.shape[0]):
                    v = np.float32(np.float64(_f32(np.int64(bb[j]))) * mul)
                    cb[j] = _encode(np.int64(_f32_bits(v)), mbits, emin, max_code, sign_shift, over, nan)
            else:
                d = np.float32(np.float64(_f32(_block_amax(bb))) / 6.0)
                t = np.float32(np.float64(d) / gd)
                sb = _encode(_bits(t), 3, -6, 0x7E, 7, 0x7E, 0x7F)
                sc[i, k] = sb
                big = np.float32(np.float64(e4m3[sb]) * gd)
                if big > 0 and big < np.inf:
                    _divided(bb, cb, big, el)
                else:
                    cb[:] = 0
        _store(row, codes[i], pack)


@jit(inline="always")
def _store(row, out, pack):  # type: ignore[no-untyped-def]
    """A row's codes into its output row: as they are, or packed two a byte (``pack`` 1: the even code in the low
    nibble, 2: in the high one)."""
    if pack == 0:
        for j in range(out.shape[0]):
            out[j] = row[j]
        return
    lo_shift = 0 if pack == 1 else 4
    hi_shift = 4 - lo_shift
    for k in range(out.shape[0]):
        out[k] = np.uint8(((row[2 * k] & 0xF) << lo_shift) | ((row[2 * k + 1] & 0xF) << hi_shift))


@jit(inline="always")
def _divided(bb, cb, sd, el):  # type: ignore[no-untyped-def]
    """``cb`` = the codes of the float32 quotients ``bb / sd`` (``bb``: bits, ``sd`` a float32; one rounding each)."""
    mbits, emin, max_code, sign_shift, over, nan = el[0], el[1], el[2], el[3], el[4], el[5]
    for j in range(cb.shape[0]):
        v = _f32(np.int64(bb[j])) / sd  # a float32 quotient, correctly rounded (IEEE division, no fastmath)
        cb[j] = _encode(np.int64(_f32_bits(v)), mbits, emin, max_code, sign_shift, over, nan)


@jit(inline="always")
def _f64_pow2(e):  # type: ignore[no-untyped-def]
    """``2^e`` as a float64 (``|e| <= 1022``)."""
    return _bits_f64(np.uint64(e + 1023) << np.uint64(52))


@jit()
def row_amax(bits, amax, lo, hi):  # type: ignore[no-untyped-def]
    """``amax[i]`` = the bits of row ``i``'s largest magnitude (NaN ignored), rows ``lo <= i < hi``."""
    for i in range(lo, hi):
        amax[i] = _block_amax(bits[i])


def _element_args(spec: QuantSpec) -> tuple[int, ...]:
    el = spec.fmt.element
    sat = el.over_code is None or spec.overflow == "saturate"
    over = el.max_code if sat or el.over_code is None else el.over_code
    mt = (el.max_code & ((1 << el.mbits) - 1)) << (23 - el.mbits)
    return (el.mbits, el.emin, el.max_code, el.nbits - 1, over, el.nan_code or 0, el.emax, mt)


def _tensor_amax(bits: np.ndarray) -> np.float32:
    r = bits.shape[0]
    amax = np.zeros(r, dtype=np.uint32)
    if r:
        launch(row_amax, bits.size, r, bits, amax)
    return np.uint32(amax.max() if r else 0).view(np.float32)  # type: ignore[no-any-return]


def quantize(y: Any, spec: QuantSpec, axis: int = -1) -> Quantized:
    """``y`` quantized by ``spec`` (:func:`pynorm.reference.fp_quant.quantize`'s result, bitwise)."""
    y = np.asarray(y)
    lead, r, h = ref.rows_of(tuple(y.shape), axis)
    with np.errstate(all="ignore"):
        bits = np.ascontiguousarray(y.reshape(r, h), dtype=np.float32).view(np.uint32)
    fmt = spec.fmt
    block = spec.block_size(h) if not (fmt.kind == "scaled" and spec.scaling == "tensor") else max(h, 1)
    block = max(block, 1)
    nb = -(-h // block)
    s_tensor = np.float32(0)
    g = np.float32(1)
    if fmt.kind == "scaled" and (spec.scaling == "tensor" or spec.scale is not None):
        s_tensor = ref.tensor_scale(_tensor_amax(bits), spec)[0]
    if fmt.kind == "nvfp4":
        g = ref.nvfp4_global(_tensor_amax(bits) if spec.global_scale is None else 0, spec.global_scale)
    pack = 0 if not fmt.packed else (1 if spec.nibble_order == "low_first" else 2)
    codes = np.empty((r, -(-h // 2) if pack else h), dtype=np.uint8)
    sf = np.empty((r, nb) if fmt.kind == "scaled" else (0, 0), dtype=np.float32)
    sc = np.empty((r, nb) if fmt.kind != "scaled" else (0, 0), dtype=np.uint8)
    if r:
        launch(
            fpq_rows, bits.size, r, bits, _KINDS[fmt.kind], _element_args(spec), block, s_tensor,
            spec.scale_rule == "ceil", g, _E4M3_TABLE, pack, codes, sf, sc,
        )  # fmt: skip
    scales: np.ndarray
    if fmt.kind == "scaled":
        per_row = s_tensor == 0 and spec.scaling == "row"
        scales = np.full(1, s_tensor, np.float32) if s_tensor != 0 else (sf.reshape(r) if per_row else sf)
    else:
        scales = sc
    g2 = g if fmt.kind == "nvfp4" else None
    return ref.quantized(codes, ref.scales_in_layout(scales, spec), g2, y, spec, tuple(y.shape), lead)


def dequantize(q: Quantized) -> np.ndarray:
    """The float32 values of ``q`` (the reference's table lookups and float32 products)."""
    return ref.dequantize(q)
