# numba's type stubs do not model intrinsics, overload stubs or jitted calls:
# mypy: disable-error-code="call-arg,attr-defined,var-annotated,call-overload"
r"""The quantize family's kernels: one row skeleton, its source and its epilogue chosen by argument type.

Source (``src``, chosen by type at compile time, :func:`row_state` / :func:`value`):

* an int8 source, the tuple ``(x, x_scale, weff, bias, has_weight, has_bias, eps, correction, std)``: each
  row's exact integer sums ``S1 = sum x``, ``S2 = sum x^2`` (int64), then the fixed float64 sequence of
  :mod:`pynorm.reference.quant_norm` (the same operations in the same order, each rounded once, no
  contraction: every function here is compiled with ``fastmath=False``), and the row's ``mean`` and
  ``rstd``; ``weff``/``bias`` float64 arrays (empty when absent: run-time flags, one signature);
* a float source, the ``(R, H)`` storage array of an already normalized ``y`` (the statistics family's
  LayerNorm output): its values, exactly, in float64.

Epilogue (``mode``, a run-time value; outputs a mode does not write are empty arrays, so each source type
compiles once): :data:`FLOAT` -- store ``y`` rounded once to float32; :data:`AMAX` -- only the row's
``max |y|`` (NaN ignored: the first pass of a per-tensor scale); :data:`ROW` -- ``q`` with the row's own
scale ``s = float32(amax / 127)`` (1 where not positive finite), stored in ``srow``; :data:`GIVEN` -- ``q``
with the given ``s_given``, and ``keep`` (False where the clip changed the value) when it is not empty.
Rows are independent (tasks of :func:`._threads.launch`), so the results do not depend on the thread count.
"""

from __future__ import annotations

import numpy as np
from numba import types
from numba.extending import overload

from ._borrow import borrow
from ._cache import jit
from ._storage import JIT_ONLY, _bf16_to_f32, _bits_f32, _bits_f64, _half_to_f32, fma, ld

__all__ = [
    "AMAX",
    "FLOAT",
    "GIVEN",
    "ROW",
    "amax_of",
    "codes",
    "dequantize",
    "masked",
    "quant_rows",
    "quantize_row",
    "row_scale",
]

_QMAX = 127.0


def row_state(src, i):  # type: ignore[no-untyped-def]
    """``(S1, k, mean, rstd)`` of row ``i`` of an int8 source, ``(0, 0.0, 0.0, 0.0)`` for a float source."""
    raise RuntimeError(JIT_ONLY)


@overload(row_state, inline="always")
def _row_state_ol(src, i):  # type: ignore[no-untyped-def]
    if isinstance(src, types.Array):
        return lambda src, i: (np.int64(0), 0.0, 0.0, 0.0)

    def impl(src, i):  # type: ignore[no-untyped-def]
        x, xs, eps, corr, std = src[0], src[1], src[6], src[7], src[8]
        h = x.shape[1]
        s1 = np.int64(0)
        s2 = np.int64(0)
        for j in range(h):
            v = np.int64(x[i, j])
            s1 += v
            s2 += v * v
        d = np.int64(h) * s2 - s1 * s1
        hd = np.float64(h)
        xsi = xs[i]
        u = np.float64(d) / (hd * np.float64(h - corr))
        var = 0.0 if d == 0 else u * (xsi * xsi)
        r = 1.0 / (np.sqrt(var) + eps) if std else 1.0 / np.sqrt(var + eps)
        k = (xsi * r) / hd
        if np.isinf(var):  # xsi * xsi overflowed: the scale from the integer row's own spread
            r = 1.0 / (xsi * np.sqrt(u))
            k = 1.0 / (hd * np.sqrt(u))
        if d == 0 and eps > 0:
            k = 0.0  # a constant row: yhat = 0 exactly, even where xsi * r overflows
        return s1, k, (np.float64(s1) / hd) * xsi, r

    return impl


def load_row(src, st, i, buf):  # type: ignore[no-untyped-def]
    """Row ``i`` of ``y`` in float64 into ``buf`` (``st``: the row's :func:`row_state`)."""
    raise RuntimeError(JIT_ONLY)


@overload(load_row, inline="always")
def _load_row_ol(src, st, i, buf):  # type: ignore[no-untyped-def]
    if isinstance(src, types.Array):

        def load(src, st, i, buf):  # type: ignore[no-untyped-def]
            for j in range(buf.shape[0]):
                buf[j] = np.float64(ld(src[i, j]))

        return load

    def impl(src, st, i, buf):  # type: ignore[no-untyped-def]
        x, weff, b, has_w, has_b = src[0], src[2], src[3], src[4], src[5]
        s1, k = st[0], st[1]
        hh = np.int64(x.shape[1])
        xr = x[i]
        for j in range(buf.shape[0]):  # the difference is exact; then one rounding per operation
            buf[j] = np.float64(np.int64(xr[j]) * hh - s1) * k
        if has_w:
            for j in range(buf.shape[0]):
                buf[j] = buf[j] * weff[j]
        if has_b:
            for j in range(buf.shape[0]):
                buf[j] = buf[j] + b[j]

    return impl


@jit(inline="always")
def row_scale(amax):  # type: ignore[no-untyped-def]
    """``float32(amax / 127)``, 1 where that is not a positive finite float32."""
    s = np.float32(amax / _QMAX)
    if s > 0 and s < np.inf:
        return s
    return np.float32(1.0)


#: the scales (and quotients) within which :func:`_quotient`'s reciprocal path is the IEEE quotient (:func:`codes`)
_RCP_LO, _RCP_HI = 2.0**-500, 2.0**500


@jit(inline="always")
def _quotient(x, sd, r, rcp):  # type: ignore[no-untyped-def]
    """``x / sd`` as the IEEE float64 quotient: divided, or (``rcp``, a constant at the call sites) by the
    correctly rounded reciprocal ``r = 1 / sd`` and Markstein's correction, ``q = x r``, ``q + (x - sd q) r`` (two
    FMAs) -- the correctly rounded quotient where nothing overflows or underflows (:func:`codes` says where)."""
    if rcp:
        q = x * r
        return fma(fma(-q, sd, x), r, q)
    return x / sd


@jit(inline="always")
def _code_loop(buf, sd, r, qr, kr, with_keep, rcp):  # type: ignore[no-untyped-def]
    for j in range(buf.shape[0]):
        t = np.rint(_quotient(np.float64(ld(buf[j])), sd, r, rcp))
        c = t if t == t else 0.0
        c = _QMAX if c > _QMAX else c
        c = -_QMAX if c < -_QMAX else c
        qr[j] = np.int8(c)
    if with_keep:
        for j in range(buf.shape[0]):
            kr[j] = not (abs(np.rint(_quotient(np.float64(ld(buf[j])), sd, r, rcp))) > _QMAX)


@jit(inline="always")
def codes(buf, sd, qr, kr, with_keep, a):  # type: ignore[no-untyped-def]
    """``qr = clip(rint(buf / sd), -127, 127)`` (0 for NaN), branch-free; ``kr`` False where it clipped. ``a``:
    the row's ``max |buf|`` (:func:`amax_of`).

    The quotients are the IEEE ones either way. Where ``sd`` is in ``[2^-500, 2^500]`` and ``a <= sd 2^500`` (so
    no element is infinite and no quotient overflows) they are computed by the reciprocal and two FMAs
    (:func:`_quotient`; a float64 division is ~4 times the cost of the rest of the element's work): the residual
    ``x - sd q`` of every ``|x| >= 2^-970`` is then a normal number, and the quotients of smaller ``|x|`` are below
    ``2^-470``, which round to 0 whatever their last bits."""
    r = 1.0 / sd
    if sd >= _RCP_LO and sd <= _RCP_HI and a <= sd * _RCP_HI:
        _code_loop(buf, sd, r, qr, kr, with_keep, True)
    else:
        _code_loop(buf, sd, r, qr, kr, with_keep, False)


def amax_of(buf):  # type: ignore[no-untyped-def]
    """``max |buf|`` of a contiguous storage row as a float64, ignoring NaN; 0 for an empty or all-NaN row.

    On the bits (a vectorized integer maximum): for a non-NaN value the magnitude's order is that of its bits
    without the sign, and a NaN's are above infinity's, so they count as 0. Exact, so the same value in any
    order and any dtype the row's values are stored in."""
    raise RuntimeError(JIT_ONLY)


def _amax_bits(unsigned, signed, mask, inf, value):  # type: ignore[no-untyped-def]
    """:func:`amax_of` of a row viewed as the ``signed`` integers of its width (a magnitude's bits, the sign bit
    cleared by ``mask``, are non-negative there: LLVM vectorizes a signed maximum and comparison fully, an
    unsigned one it did not -- 0.22 against 0.05 ns a float32 element, one core, AVX-512), ``inf`` the bits of
    +inf, ``value`` the jitted conversion of a magnitude's bits (as the ``unsigned`` integer) to a float64."""
    mask, inf, zero = signed(mask), signed(inf), signed(0)

    def impl(buf):  # type: ignore[no-untyped-def]
        u = buf.view(signed)
        m = zero
        for j in range(u.shape[0]):
            b = signed(u[j] & mask)
            m = max(m, b if b <= inf else zero)  # (max(): a reduction LLVM vectorizes)
        return value(unsigned(m))

    return impl


@jit(inline="always")
def _f32_value(m):  # type: ignore[no-untyped-def]
    return np.float64(_bits_f32(m))


@jit(inline="always")
def _f64_value(m):  # type: ignore[no-untyped-def]
    return _bits_f64(m)


@jit(inline="always")
def _half_value(m):  # type: ignore[no-untyped-def]
    return np.float64(_half_to_f32(np.int16(m)))


@jit(inline="always")
def _bf16_value(m):  # type: ignore[no-untyped-def]
    return np.float64(_bf16_to_f32(m))


@overload(amax_of, jit_options={"fastmath": False, "error_model": "numpy"})
def _amax_of_ol(buf):  # type: ignore[no-untyped-def]
    dt = buf.dtype
    if dt == types.float32:
        return _amax_bits(np.uint32, np.int32, 0x7FFFFFFF, 0x7F800000, _f32_value)
    if dt == types.float64:
        return _amax_bits(np.uint64, np.int64, 0x7FFFFFFFFFFFFFFF, 0x7FF0000000000000, _f64_value)
    if dt == types.int16:  # float16 storage
        return _amax_bits(np.uint16, np.int16, 0x7FFF, 0x7C00, _half_value)
    if dt == types.uint16:  # bfloat16 storage
        return _amax_bits(np.uint16, np.int16, 0x7FFF, 0x7F80, _bf16_value)
    return None


#: epilogues of :func:`quant_rows`
FLOAT, AMAX, ROW, GIVEN = 0, 1, 2, 3


@jit()
def quant_rows(src, mode, s_given, y, q, srow, amax, keep, mean, rstd, lo, hi):  # type: ignore[no-untyped-def]
    """Rows ``lo <= i < hi`` of the source through the epilogue ``mode`` (see the module doc): :data:`FLOAT`
    writes ``y``, :data:`AMAX` ``amax``, :data:`ROW` ``q`` and ``srow``, :data:`GIVEN` ``q`` with ``s_given``
    and ``keep`` when it has rows; an int8 source's ``mean``/``rstd`` when they have rows. The outputs a call
    does not write may be empty arrays (one signature per source type). Each row is computed once into a
    float64 buffer, then stored or quantized from it."""
    src, y, q, srow, amax, keep, mean, rstd = borrow((src, y, q, srow, amax, keep, mean, rstd))
    h = _shape(src)[1]
    with_stats = mean.shape[0] > 0
    buf = np.empty(h)
    for i in range(lo, hi):
        st = row_state(src, i)
        if with_stats:
            mean[i] = st[2]
            rstd[i] = st[3]
        load_row(src, st, i, buf)
        if mode == FLOAT:
            yr = y[i]
            for j in range(h):
                yr[j] = np.float32(buf[j])
        else:
            quantize_row(buf, i, mode, s_given, q, srow, amax, keep)


@jit(inline="always")
def quantize_row(buf, i, mode, s_given, q, srow, amax, keep):  # type: ignore[no-untyped-def]
    """Row ``i``'s values ``buf`` (a storage row) through a quantizing epilogue ``mode`` of :func:`quant_rows`
    (:data:`AMAX`, :data:`ROW` or :data:`GIVEN`): what :func:`quant_rows` and the statistics kernels' quantize
    sink (:func:`._io.ydone`) both do with a row."""
    a = amax_of(buf)
    if mode == GIVEN:
        with_keep = keep.shape[0] > 0
        codes(buf, s_given, q[i], keep[i] if with_keep else keep[0:0].reshape(-1), with_keep, a)
        return
    if mode == AMAX:
        amax[i] = a
    else:
        s = row_scale(a)
        srow[i] = s
        codes(buf, np.float64(s), q[i], keep[0:0].reshape(-1), False, a)


def _shape(src):  # type: ignore[no-untyped-def]
    """``(rows, H)`` of a source."""
    raise RuntimeError(JIT_ONLY)


@overload(_shape, inline="always")
def _shape_ol(src):  # type: ignore[no-untyped-def]
    if isinstance(src, types.Array):
        return lambda src: src.shape
    return lambda src: src[0].shape


@jit()
def dequantize(x, xs, out, lo, hi):  # type: ignore[no-untyped-def]
    """``out = x * x_scale`` rounded to ``out``'s dtype (float32, or float64: exact) for rows ``lo <= i < hi``
    (the real input of an int8 ``x``, for the backward)."""
    x, xs, out = borrow((x, xs, out))
    h = x.shape[1]
    for i in range(lo, hi):
        s = xs[i]
        for j in range(h):
            out[i, j] = np.float64(x[i, j]) * s  # one rounding to out's dtype


@jit()
def masked(dy, keep, out, lo, hi):  # type: ignore[no-untyped-def]
    """``out = dy`` where ``keep``, else 0, for rows ``lo <= i < hi`` (storage arrays of one dtype; the
    straight-through gradient)."""
    dy, keep, out = borrow((dy, keep, out))
    h = dy.shape[1]
    for i in range(lo, hi):
        for j in range(h):
            if keep[i, j]:
                out[i, j] = dy[i, j]
            else:
                out[i, j] = 0
