# numba's type stubs do not model jitted calls:
# mypy: disable-error-code="call-arg,attr-defined,var-annotated,call-overload"
"""FP8 / FP4 quantization on the ``numba`` backend: the operations of :mod:`pynorm.reference.fp_quant`, bitwise.

One jitted piece quantizes one float32 row, :func:`fpq_take` (its blocks' ``amax``, their scales, every element
scaled and encoded, FP4 packed); two callers run it on rows:

* :func:`fpq_rows`, the standalone quantizer of a stored ``y`` (:func:`quantize`, ``pynorm.quantize``), and
* the statistics kernels' FP quantize sink (:mod:`._io`): a norm's forward normalizes each row into a scratch row
  (or into ``y`` when ``y`` is kept) and quantizes it from there while it is in cache, no ``y`` in memory
  (:func:`quantize_norm`, what ``quantize=`` on ``layer_norm``/``rms_norm``/``add_*`` runs on this backend).

The element loop is IEEE float32 arithmetic and 32-bit integer operations only (compiled without fastmath), so
it vectorizes 16 lanes wide (AVX-512): each value scaled -- divided by the FP8 or NVFP4 scale (through its
correctly rounded reciprocal and two FMAs where Markstein's theorem makes that the IEEE quotient,
:func:`_rcp_safe`; else a division), multiplied by the MX block's power of two (the same float32 as the
reference's ``ldexp``: one rounding of the exact product) -- then encoded by :func:`_encode`: the magnitude rounded
to the element format's spacing by one float32 addition of a power of two (round to nearest even is the FPU's own),
the code read off the sum's bits. Block sizes of the MX (32) and NVFP4 (16) formats are constants of their loops
(one vector operation per block, no remainder loop); each row's block maxima and scales are computed first, then
the elements. Scales are float32 operations as in the reference. So the codes and scales are bitwise the
reference's (tests/test_fp_quant.py).

A per-tensor FP8 scale and NVFP4's computed global scale take the tensor's ``amax`` first: a pass of the rows'
``amax`` (bits of the largest magnitude, NaN ignored: their maximum is exact in any order), then the codes. Rows
are independent tasks (:func:`._threads.launch`): the results do not depend on the thread count. Swizzling block
scales is the reference's integer layout code.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ...ops.fp_quant import ELEMENTS, Element, Quantized, QuantSpec
from ...reference import fp_quant as ref
from . import _common as common
from ._cache import jit
from ._storage import _bits_f32, _f32_bits, fma
from ._threads import launch

__all__ = [
    "NO_AMAX",
    "QuantPlan",
    "consts",
    "dequantize",
    "fpq_rows",
    "fpq_scratch",
    "fpq_take",
    "no_keep",
    "quantize",
    "quantize_norm",
]

#: the scaling kinds of :func:`fpq_take`
SCALED, MX, NVFP4 = 0, 1, 2
_KINDS = {"scaled": SCALED, "mx": MX, "nvfp4": NVFP4}
_I = np.int32
_U = np.uint32


def _element(el: Element, saturate: bool) -> tuple[np.int32, ...]:
    """The constants of :func:`_encode` for ``el`` (int32): ``(23 - mbits, bits of 2^emin, bits of 2^(23 - mbits),
    ((emin + 127) + (23 - mbits)) << mbits, first overflowing magnitude, sign bit, over, nan, emax, mt)`` -- the
    first overflowing magnitude the smallest float32 bits that round beyond the largest finite value (above the
    midpoint to the next binade's value, or at it where the largest value's last mantissa bit is odd: the tie goes
    to even), ``over`` the code of such a value (``max_code`` when saturating), ``mt`` the largest finite value's
    mantissa bits in float32 position (the MX ceil rule's test)."""
    over = el.max_code if saturate or el.over_code is None else el.over_code
    mt = (el.max_code & ((1 << el.mbits) - 1)) << (23 - el.mbits)
    off = 23 - el.mbits
    mid = np.float32(el.fmax + math.ldexp(1.0, el.emax - el.mbits - 1)).view(np.uint32)
    first = int(mid) + (0 if el.max_code & 1 else 1)
    vals = ((off, (el.emin + 127) << 23, off << 23, (el.emin + 127 + off) << el.mbits, first, 1 << (el.nbits - 1),
             over, el.nan_code or 0, el.emax, mt))  # fmt: skip
    return tuple(_I(v) for v in vals)


#: NVFP4's block scales: E4M3, saturating; the float32 value of each E4M3 code
_E4 = _element(ELEMENTS["e4m3"], True)
_E4M3_TABLE = ref.decode(np.arange(256, dtype=np.uint8), ELEMENTS["e4m3"])


@jit(inline="always")
def _encode(v, sb, el):  # type: ignore[no-untyped-def]
    """The code of the float32 ``v`` in the element format of ``el`` (:func:`_element`), with the sign of the bits
    ``sb`` (``v``'s own, or those of the value ``v`` is the quotient or product of by a positive scale: its sign
    also where ``v`` underflows): the reference's :func:`~pynorm.reference.fp_quant.encode`, branch-free in
    32-bit lanes.

    With ``te = max(e, emin)`` (``e``: the exponent of ``|v|``), the element format's spacing at ``|v|`` is
    ``2^(te - mbits)``; adding ``M = 2^(te - mbits + 23)`` puts ``|v| < 2^(te + 1)`` in ``M``'s binade, whose
    float32 spacing that is, so the IEEE sum rounds ``|v|`` to the format, ties to even (``M``'s mantissa is 0:
    even sums are even codes), and ``bits(sum) - bits(M)`` is the rounded magnitude in units of the spacing -- a
    normal value's implicit bit included, a carry into the next binade included; the code adds the binade,
    ``(te - emin) << mbits``. Magnitudes from the first overflowing one on are ``over`` whatever the sum gave;
    NaN is selected last."""
    off, e0s, offs, base, first = el[0], el[1], el[2], el[3], el[4]
    sign_bit, over, nan = el[5], el[6], el[7]
    a = _I(_I(_f32_bits(v)) & _I(0x7FFFFFFF))
    mb = _I(_I(max(a, e0s) & _I(0x7F800000)) + offs)
    k = _I(_I(_f32_bits(_bits_f32(_U(a)) + _bits_f32(_U(mb)))) - mb)
    code = _I(_I(k + _I(mb >> _I(off & _I(31)))) - base)  # (a shift known below 32: it stays 32-bit)
    code = over if a >= first else code
    code = _I(code | sign_bit) if _I(sb) < _I(0) else code
    return np.uint8(nan if a > _I(0x7F800000) else code)


@jit(inline="always")
def _amax(ub, j0, j1):  # type: ignore[no-untyped-def]
    """The bits of the largest magnitude of ``ub[j0:j1]`` (float32 bits; NaN ignored: its bits count as 0), int32.

    In signed 32-bit lanes (a magnitude's bits are non-negative as an int32): LLVM vectorizes the signed maximum
    and comparison fully, the unsigned ones of the same values it did not (0.22 against 0.05 ns an element, one
    core, AVX-512). (The maxima of 16, :func:`_maxima16`, stay unsigned: signed, their shuffled loop was slower.)"""
    m = _I(0)
    for j in range(j0, j1):
        u = _I(ub[np.uint64(j)] & _U(0x7FFFFFFF))
        m = max(m, u if u <= _I(0x7F800000) else _I(0))
    return m


#: how :func:`_codes` scales: divides, multiplies (MX: by a power of two), or divides through the reciprocal
_DIV, _MUL, _RCP = 0, 1, 2
#: the range of divisors (and of quotients) in which :data:`_RCP` is the IEEE quotient's bits (:func:`_rcp_safe`)
_RCP_LO, _RCP_HI = np.float32(2.0**-60), np.float32(2.0**60)


@jit(inline="always")
def _codes(yr, cb, s, r, j0, j1, el, op):  # type: ignore[no-untyped-def]
    """``cb[j0:j1]`` = the codes of ``yr / s`` (``op`` :data:`_DIV`, or :data:`_RCP`: the same quotient's float32
    by its reciprocal ``r = 1 / s``, :func:`_rcp_safe`) or of ``yr * s`` (:data:`_MUL`), each one IEEE float32
    result. ``op`` is a constant at the call sites."""
    for j in range(j0, j1):
        u = np.uint64(j)  # (unsigned: no negative-index wraparound in the vector loop)
        x = yr[u]
        if op == _MUL:
            v = x * s
        elif op == _DIV:
            v = x / s
        else:
            q = x * r
            v = fma(fma(-q, s, x), r, q)
        cb[u] = _encode(v, _f32_bits(x), el)


@jit(inline="always")
def _rcp_safe(ab, s):  # type: ignore[no-untyped-def]
    """Whether the quotients ``x / s`` of a block of largest magnitude bits ``ab`` may be computed as
    ``q = x r``, ``q' = q + (x - s q) r`` (two FMAs, ``r = 1 / s`` correctly rounded): Markstein's theorem makes
    ``q'`` the correctly rounded quotient when nothing overflows or underflows, which holds for ``s`` in
    ``[2^-60, 2^60]`` and quotients below ``2^60`` -- every quotient at least ``2^-20`` (smaller ones encode as
    zeros, and :func:`_encode` takes their sign from ``x``) has ``x >= 2^-80``, so ``x - s q`` is normal. Not for
    a block holding an infinity (``inf - s q`` is NaN)."""
    return s >= _RCP_LO and s <= _RCP_HI and ab < _I(0x7F800000) and _bits_f32(_U(ab)) <= s * _RCP_HI


@jit(inline="always")
def _mx_scale(ab, el, ceil):  # type: ignore[no-untyped-def]
    """``(E8M0 code, the float32 multiplier 2^-e)`` of a block maximum's bits ``ab`` (the multiplier 0 for the NaN
    scale of a block holding an infinity), branch-free (a subnormal maximum normalized by a factor 2^64)."""
    emax, mt = el[8], el[9]
    sub = ab < _I(0x800000)
    w = _bits_f32(_U(ab)) * np.float32(18446744073709551616.0) if sub else _bits_f32(_U(ab))
    wb = _I(_f32_bits(w))
    fl = _I(_I(wb >> _I(23)) - (_I(191) if sub else _I(127)))
    e = _I(fl - emax)
    e = _I(e + _I(1)) if ceil and _I(wb & _I(0x7FFFFF)) > mt else e
    e = max(min(e, _I(127)), _I(-127))
    c = _I(0) if ab == _I(0) else _I(e + _I(127))
    c = _I(255) if ab == _I(0x7F800000) else c
    p = _I(_I(254) - c)  # the multiplier's biased exponent (0: 2^-127, a subnormal)
    mul = _bits_f32(_U(_I(p << _I(23)) if p > _I(0) else _I(0x400000)))
    return np.uint8(c), (np.float32(0) if c == _I(255) else mul)


@jit(inline="always")
def _nv_scale(ab, g):  # type: ignore[no-untyped-def]
    """``(E4M3 code, the divisor S)`` of an NVFP4 block maximum's bits ``ab`` (``S`` 0 where not positive finite)."""
    t = (_bits_f32(_U(ab)) / np.float32(6.0)) / g
    sb = _encode(t, _f32_bits(t), _E4)
    big = _E4M3_TABLE[sb] * g
    return sb, (big if big > 0 and big < np.inf else np.float32(0))


@jit(inline="always")
def _mag(u):  # type: ignore[no-untyped-def]
    """The magnitude's bits of the float32 bits ``u`` (uint32), 0 for NaN."""
    u = u & _U(0x7FFFFFFF)
    return u if u <= _U(0x7F800000) else _U(0)


@jit(inline="always")
def _max4(a, u):  # type: ignore[no-untyped-def]
    return max(max(a[u], a[u + 1]), max(a[u + 2], a[u + 3]))


@jit(inline="always")
def _maxima16(ub, t4, m16, n):  # type: ignore[no-untyped-def]
    """``m16[k]`` = the bits of the largest magnitude of ``ub[16 k : 16 k + 16]``, ``k < n``: maxima of 4, then of
    4 of those (loops LLVM vectorizes with shuffles: a loop over blocks of 16 gathers its strided elements)."""
    for j in range(4 * n):
        u = np.uint64(4 * j)
        t4[np.uint64(j)] = max(max(_mag(ub[u]), _mag(ub[u + 1])), max(_mag(ub[u + 2]), _mag(ub[u + 3])))
    for k in range(n):
        m16[np.uint64(k)] = _max4(t4, np.uint64(4 * k))


@jit(inline="always")
def _blocked(yr, ub, row, scratch, sci, g, el, ceil, block, kind):  # type: ignore[no-untyped-def]
    """One row of an MX (``kind`` MX, ``block`` 32) or NVFP4 (16) format into ``row``: the blocks' maxima,
    their scale codes (``sci``) and scale factors, then the codes; blocks without a usable scale get codes 0.
    ``block`` and ``kind`` are constants at the call sites (the loops over a block's elements are one vector
    operation); an NVFP4 row divides through the reciprocals where every block allows it (:func:`_rcp_safe`)."""
    t4, m16, am, sv, rv = scratch[1], scratch[2], scratch[3], scratch[4], scratch[5]
    h = yr.shape[0]
    nb = sci.shape[0]
    full = h // block
    per = block // 16
    _maxima16(ub, t4, m16, full * per)
    if per == 1:
        for k in range(full):
            am[np.uint64(k)] = m16[np.uint64(k)]
    else:
        for k in range(full):
            am[np.uint64(k)] = max(m16[np.uint64(2 * k)], m16[np.uint64(2 * k + 1)])
    if nb > full:
        am[full] = _amax(ub, full * block, h)
    bad = False
    safe = True
    for k in range(nb):
        ak = _I(am[k])
        if kind == MX:
            c, f = _mx_scale(ak, el, ceil)
        else:
            c, f = _nv_scale(ak, g)
            rv[k] = np.float32(1.0) / f
            safe = safe & _rcp_safe(ak, f)
        sci[k] = c
        sv[k] = f
        bad = bad | (f == 0)
    op = _MUL if kind == MX else _DIV
    if kind == NVFP4 and safe:
        for k in range(full):
            _codes(yr, row, sv[k], rv[k], k * block, k * block + block, el, _RCP)
    else:
        for k in range(full):
            _codes(yr, row, sv[k], sv[k], k * block, k * block + block, el, op)
    if nb > full:
        _codes(yr, row, sv[full], sv[full], full * block, h, el, op)
    if bad:
        for k in range(nb):
            if sv[k] == 0:
                row[k * block : min(k * block + block, h)] = 0


@jit(inline="always")
def _store(row, out, pack):  # type: ignore[no-untyped-def]
    """A row's 4-bit codes packed two a byte into its output row (``pack`` 1: the even code in the low nibble, 2: in
    the high one)."""
    lo_shift = 0 if pack == 1 else 4
    hi_shift = 4 - lo_shift
    for k in range(out.shape[0]):
        out[k] = np.uint8(((row[2 * k] & 0xF) << lo_shift) | ((row[2 * k + 1] & 0xF) << hi_shift))


@jit(inline="always")
def fpq_scratch(h, q):  # type: ignore[no-untyped-def]
    """The scratch of :func:`fpq_take` for rows of ``h`` elements: one row's codes (a zero after an odd row's last,
    for packing), maxima of 4 and of 16 elements, the blocks' maxima and scale factors."""
    nb = (h + q[2] - 1) // q[2]
    return (np.zeros(h + 1, dtype=np.uint8), np.empty(h // 4, dtype=np.uint32), np.empty(h // 16, dtype=np.uint32),
            np.empty(nb, dtype=np.uint32), np.empty(nb, dtype=np.float32), np.empty(nb, dtype=np.float32))  # fmt: skip


@jit()
def fpq_take(yr, i, q, out, amax, scratch):  # type: ignore[no-untyped-def]
    """Row ``i``'s float32 values ``yr`` (contiguous) quantized by ``q`` into ``out`` -- or, where ``amax`` has
    rows, only ``amax[i]``, the bits of the row's largest magnitude (NaN ignored: the first pass of a per-tensor
    scale).

    ``q``: ``(kind, el, block, s_tensor, fmax, ceil, g, pack)`` -- the scaling kind, the element constants
    (:func:`_element`), the block size (the group's, the row's, 32, 16), the tensor's float32 scale (0: per block),
    the element format's largest value, the MX ceil rule, NVFP4's global scale, the packing (0: none, 1: low nibble
    first, 2: high). ``out``: ``(codes, sf, sc)`` -- codes ``(R, H)`` uint8 or ``(R, ceil(H / 2))`` packed, per
    block float32 scales ``sf`` (FP8) or codes ``sc`` (MX, NVFP4), ``(R, blocks)``. ``scratch``:
    :func:`fpq_scratch`."""
    ub = yr.view(np.uint32)
    if amax.shape[0] > 0:
        amax[i] = _amax(ub, 0, yr.shape[0])
        return
    pack = q[7]
    if pack:
        _row_codes(yr, ub, i, q, out, scratch[0], scratch)
        _store(scratch[0], out[0][i], pack)
    else:  # (unpacked codes go to their row at once)
        _row_codes(yr, ub, i, q, out, out[0][i], scratch)


@jit()
def _row_codes(yr, ub, i, q, out, row, scratch):  # type: ignore[no-untyped-def]
    """Row ``i``'s codes into ``row`` and its scales into ``out`` (:func:`fpq_take`)."""
    kind, el, block, s_tensor, fmax, ceil, g = q[0], q[1], q[2], q[3], q[4], q[5], q[6]
    sf, sc = out[1], out[2]
    h = yr.shape[0]
    if kind == SCALED:
        for k in range((h + block - 1) // block):
            j0 = k * block
            j1 = min(j0 + block, h)
            ab = _amax(ub, j0, j1)
            s = s_tensor
            if s == 0:
                s = _bits_f32(_U(ab)) / fmax
                if not (s > 0 and s < np.inf):
                    s = np.float32(1.0)
            sf[i, k] = s
            if _rcp_safe(ab, s):
                _codes(yr, row, s, np.float32(1.0) / s, j0, j1, el, _RCP)
            else:
                _codes(yr, row, s, s, j0, j1, el, _DIV)
    elif kind == MX:
        _blocked(yr, ub, row, scratch, sc[i], g, el, ceil, 32, MX)
    else:
        _blocked(yr, ub, row, scratch, sc[i], g, el, ceil, 16, NVFP4)


@jit()
def fpq_rows(y, q, out, amax, lo, hi):  # type: ignore[no-untyped-def]
    """Rows ``lo <= i < hi`` of the float32 ``(R, H)`` array ``y`` through :func:`fpq_take`."""
    scratch = fpq_scratch(y.shape[1], q)
    for i in range(lo, hi):
        fpq_take(y[i], i, q, out, amax, scratch)


class _Consts:
    """What :func:`fpq_take` takes for ``spec`` and rows of ``h`` elements that the rows' count does not change,
    computed once per ``(spec, h)`` (:func:`consts`): the block size, the element constants (:func:`_element`),
    the tensor scale and global scale where given, the packing, and the parameter tuple where no ``amax`` decides
    a scale."""

    __slots__ = ("block", "ceil", "el", "fmax", "fmt", "g", "h", "kind", "nb", "needs_amax", "pack", "q", "row",
                 "s_tensor", "scaled", "spec", "tensor")  # fmt: skip

    def __init__(self, spec: QuantSpec, h: int) -> None:
        fmt = self.fmt = spec.fmt
        self.spec, self.h = spec, h
        el = fmt.element
        self.scaled = fmt.kind == "scaled"
        tensor = self.tensor = self.scaled and (spec.scaling == "tensor" or spec.scale is not None)
        self.row = self.scaled and not tensor and spec.scaling == "row"
        self.block = max(fmt.block or (h if tensor else spec.block_size(h)), 1)
        self.nb = -(-h // self.block)
        self.el = _element(el, el.over_code is None or spec.overflow == "saturate")
        self.fmax = np.float32(el.fmax)
        #: the tensor's amax decides a scale: the per-tensor FP8 scale (not given), NVFP4's global scale (not given)
        self.needs_amax = (tensor and spec.scale is None) or (fmt.kind == "nvfp4" and spec.global_scale is None)
        self.s_tensor = np.float32(ref.tensor_scale(0, spec)[0]) if tensor and spec.scale is not None else _F0
        self.g = np.float32(ref.nvfp4_global(0, spec.global_scale)) if fmt.kind == "nvfp4" else np.float32(1)
        self.pack = 0 if not fmt.packed else (1 if spec.nibble_order == "low_first" else 2)
        self.ceil = spec.scale_rule == "ceil"
        self.kind = _KINDS[fmt.kind]
        self.q = self.params(self.s_tensor, self.g)

    def params(self, s_tensor: np.float32, g: np.float32) -> tuple[Any, ...]:
        """:func:`fpq_take`'s parameter tuple with the tensor scale ``s_tensor`` and global scale ``g``."""
        return (self.kind, self.el, self.block, s_tensor, self.fmax, self.ceil, g, self.pack)


#: :class:`_Consts` by ``(id(spec), h)``, each with its spec (so that the id is not another's)
_CONSTS: dict[tuple[int, int], _Consts] = {}
_CONSTS_MAX = 64


def consts(spec: QuantSpec, h: int) -> _Consts:
    """The :class:`_Consts` of ``spec`` and rows of ``h`` elements, kept (a repeated call computes nothing: a
    decode step's ``quantize=`` call is a few microseconds of kernel)."""
    c = _CONSTS.get((id(spec), h))
    if c is None or c.spec is not spec:
        if len(_CONSTS) >= _CONSTS_MAX:
            _CONSTS.clear()
        c = _CONSTS[(id(spec), h)] = _Consts(spec, h)
    return c


class QuantPlan:
    """One call's :func:`fpq_take` parameters (:meth:`q`: the kept constants, the tensor scale and global scale
    filled in by :meth:`take_amax` where they need the tensor's ``amax``) and its outputs, ``rows`` rows of
    ``h`` elements."""

    __slots__ = ("c", "codes", "g", "out", "rows", "s_tensor", "sc", "sf")

    def __init__(self, spec: QuantSpec, rows: int, h: int) -> None:
        c = self.c = consts(spec, h)
        self.rows = rows
        self.s_tensor, self.g = c.s_tensor, c.g
        self.codes = np.empty((rows, -(-h // 2) if c.pack else h), dtype=np.uint8)
        self.sf = np.empty((rows, c.nb) if c.scaled else (0, 0), dtype=np.float32)
        self.sc = np.empty((rows, c.nb) if not c.scaled else (0, 0), dtype=np.uint8)
        self.out = (self.codes, self.sf, self.sc)

    @property
    def needs_amax(self) -> bool:
        return self.c.needs_amax

    def q(self) -> tuple[Any, ...]:
        c = self.c
        return c.q if self.s_tensor is c.s_tensor and self.g is c.g else c.params(self.s_tensor, self.g)

    def take_amax(self, amax: np.ndarray) -> None:
        """The scales that need the tensor's ``amax`` from the rows' (``amax``: their bits)."""
        c = self.c
        m = amax.max() if amax.size > 1 else (amax[0] if amax.size else 0)  # (numpy's reduction: ~4 us)
        t = np.uint32(m).view(np.float32)  # (finite or +inf: no float warning below)
        if c.scaled:  # the reference's tensor_scale and nvfp4_global, as float32 scalars (their arrays cost ~8 us)
            s = t / c.fmax
            self.s_tensor = s if s > 0 and s < np.inf else np.float32(1)
        else:
            g = t / _NV_GLOBAL
            self.g = g if g > 0 and g < np.inf else np.float32(1)

    def passes(self, keep: np.ndarray, run: Callable[[tuple[Any, ...]], Any]) -> Any:
        """The rows quantized: ``run(sink)`` runs one pass of the rows into the sink ``(keep, q, out, amax)``
        (:func:`fpq_take`'s arguments and the kept ``y``, ``keep``), first the pass of the rows' ``amax`` where a
        scale needs the tensor's (``keep`` empty there), then the codes' pass, whose result it returns."""
        if self.c.needs_amax:
            amax = np.zeros(self.rows, dtype=np.uint32)
            run((keep[:0], self.q(), self.out, amax))
            self.take_amax(amax)
        return run((keep, self.q(), self.out, NO_AMAX))

    def scales(self) -> np.ndarray:
        """The scales in ``(R, .)`` form and the spec's layout (:func:`pynorm.ops.fp_quant.in_shape`'s input)."""
        c = self.c
        if not c.scaled:
            return ref.scales_in_layout(self.sc, c.spec)
        if self.s_tensor != 0:
            return np.full(1, self.s_tensor, np.float32)
        return self.sf.reshape(self.rows) if c.row else self.sf

    def result(self, y: Any, shape: tuple[int, ...], lead: tuple[int, ...]) -> Quantized:
        """The :class:`Quantized` of ``y`` (None where not kept) of ``shape``, whose rows are the dims ``lead``."""
        c = self.c
        g = self.g if c.kind == NVFP4 else None
        return ref.quantized(self.codes, self.scales(), g, y, c.spec, shape, lead)

    def rows_result(self, y: Any) -> Quantized:
        """:meth:`result` for an ``(R, H)`` ``y``, whose rows are its first dim: the outputs as they are."""
        c = self.c
        g = np.asarray(self.g).reshape(()) if c.kind == NVFP4 else None
        scales = self.scales()
        if c.scaled and self.s_tensor != 0:
            scales = scales.reshape(())
        return Quantized(self.codes, scales, g, y if c.spec.keep_y else None, c.spec, (self.rows, c.h))


_F0 = np.float32(0)
_NV_GLOBAL = np.float32(ref.NVFP4_GLOBAL)
NO_AMAX = np.empty(0, np.uint32)
#: the sink's ``keep`` where no ``y`` is kept: an empty ``(0, 0)`` array of the storage dtype of ``y``'s, by dtype
_NO_KEEP: dict[Any, np.ndarray] = {}


def no_keep(dtype: Any) -> np.ndarray:
    keep = _NO_KEEP.get(dtype)
    if keep is None:
        keep = _NO_KEEP[dtype] = np.empty((0, 0), common.storage(np.empty(0, dtype)).dtype)
    return keep


def quantize(y: Any, spec: QuantSpec, axis: int = -1) -> Quantized:
    """``y`` quantized by ``spec`` (:func:`pynorm.reference.fp_quant.quantize`'s result, bitwise)."""
    y = np.asarray(y)
    lead, r, h = ref.rows_of(tuple(y.shape), axis)
    y32 = y.reshape(r, h)
    if y32.dtype != np.float32 or not y32.flags.c_contiguous:
        with np.errstate(all="ignore"):  # (a float64 y may overflow float32)
            y32 = np.ascontiguousarray(y32, dtype=np.float32)
    p = QuantPlan(spec, r, h)
    if r:
        p.passes(y32[:0], lambda sink: launch(fpq_rows, y32.size, r, y32, *sink[1:]))  # (its q, out, amax)
    if y.ndim == 2 and len(lead) == 1:  # (the rows as they are: a small call's microseconds)
        return p.rows_result(y)
    return p.result(y, tuple(y.shape), lead)


def quantize_norm(
    run: Callable[[Any, Any], tuple[Any, Any]], shape: tuple[int, int], dtype: Any, spec: QuantSpec, out: Any,
    fuse: bool,
) -> tuple[Quantized, Any, Any]:  # fmt: skip
    """A norm's forward with its ``y`` quantized by ``spec``: ``(Quantized of the (R, H) rows, the forward's
    outputs, its ctx)``.

    ``run(out, sink)`` is the norm's forward (``(outputs, ctx)``; ``outputs`` ``y`` or ``(y, h, ...)``) writing
    ``y`` into ``out`` (None: a new array), or, with a ``sink``, taking each row into the sink (:mod:`._io`; ``y``
    None). ``fuse``: the rows are quantized in the forward's output pass (a per-tensor scale and NVFP4's computed
    global scale: a first forward for the rows' ``amax``, then the codes); else the forward stores ``y`` and
    :func:`fpq_rows` quantizes it (the second pass: few wide rows, which the split kernels cut across threads).
    ``y`` (``dtype``) is also kept where the spec asks for it or ``out`` is given: then it is the forward's own."""
    r, h = shape
    p = QuantPlan(spec, r, h)
    if not fuse:
        res, ctx = run(out, None)
        y = res[0] if isinstance(res, tuple) else res
        return quantize(y, spec), res, ctx
    y = out if out is not None else (common.output(None, shape, dtype) if spec.keep_y else None)
    keep = common.storage(y) if y is not None else no_keep(dtype)
    res, ctx = p.passes(keep, lambda sink: run(None, sink))
    res = (y, *res[1:]) if isinstance(res, tuple) else y
    return p.rows_result(y), res, ctx


def dequantize(q: Quantized) -> np.ndarray:
    """The float32 values of ``q`` (the reference's table lookups and float32 products)."""
    return ref.dequantize(q)
