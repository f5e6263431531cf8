# numba's type stubs do not model intrinsics or overload stubs:
# mypy: disable-error-code="call-arg,attr-defined,var-annotated,call-overload"
r"""Per-row sources and sinks of the statistics family's variants (jitted pieces only).

Each axis of :class:`pynorm.ops.StatsVariant` other than the statistic is one optional argument of
the kernels (``None`` for the plain choice), and one ``@overload``-ed helper here picks the code
from that argument's numba type at compile time, so a plain variant compiles none of it:

* prologue ``pro`` -- ``None`` (the row is ``x[i]``) or ``(residual, alpha, h)``: :func:`src_row`
  computes ``h[i] = x[i] + alpha * residual[i]`` (in float64, rounded once to ``h``'s dtype: FMA when
  an operand is float64, so the sum is correctly rounded; else the float64 product and sum, as the
  reference), stores it, and returns ``h[i]`` -- the row the statistics are taken of, while it is in
  cache; :func:`src_done` is that row again (the slow path, after :func:`src_row` wrote it);
* affine source ``tab`` -- ``None`` (``w``/``b`` are ``(H,)`` vectors) or ``(ids, M)``: ``w``/``b``
  are ``(M, H)`` tables and row ``i`` uses row ``ids[i]`` (:func:`arow`). The backward's ``tab`` is
  ``(ids, M, slot, starts)`` (:func:`._reduce.table_slots`): the parameter-gradient partials have one row
  per (row block, id the block holds), row ``i`` adds into row ``slot[i]`` and block ``blk`` owns rows
  ``starts[blk]:starts[blk + 1]`` (:func:`pslot`, :func:`pzero`), so each id's sums keep the plain norm's
  order, and the partials are at most ``R`` rows whatever ``M`` is (a row for every (block, id) would be
  ``R / 32 * M``: quadratic in the rows when each row has its own table row, as a conditional norm's may);
* affine source ``tab`` = ``(G, S, P)`` (three integers: the channel source, GroupNorm's) -- row ``i`` is sample
  ``i // G``'s group ``g = i % G``: ``P = C / G`` channels of ``S`` positions each, element ``j`` scaled by
  ``w[g P + j // S]`` and shifted by ``b[...]``. :func:`arow` gives the row's *channel row* ``(w[g P : g P + P] or
  None, S, P)`` (for an absent parameter too: the kernels then cut the row into its channels all the same, and the
  slow path reads it through :func:`aff_mul`, :func:`aff_add`); the kernels write each channel's ``S`` elements
  with the channel's scalars (:func:`chan_at`), and the partials have one row per row (``pslot(tab, blk, i) = i``,
  ``P`` float64 columns: each channel's ``sum dy xhat`` / ``sum dy``, set by :func:`pput`, never accumulated), so
  the host's per-channel sums over the samples do not depend on the threads;
* the forward's sink ``y`` -- the ``(R, H)`` storage array ``y`` (row ``i`` written in place), or the quantize
  epilogue ``(mode, s_given, q, srow, amax, keep, proto)`` (``quant_layer_norm`` of a float input): row ``i`` is
  written into a scratch row of ``proto``'s dtype, ``y``'s (:func:`yscratch`, :func:`yrow`), still in cache
  when :func:`ydone` quantizes it by the epilogue ``mode`` of :func:`._quant_kernels.quant_rows` (``AMAX``:
  the row's ``max |y|`` only; ``ROW``: int8 ``q`` with the row's scale ``srow[i]``; ``GIVEN``: with
  ``s_given``, and ``keep`` where it has rows) -- the same values as that kernel on the stored ``y``, with no
  ``y`` in memory; or the element-wise sink ``(fn, a, w, b, y)`` (the casting policies ``"llama"``, ``"apex"``:
  ``q = rnd(xhat)`` then ``y = w q + b`` rounded once): the norm without its affine writes row ``i`` into a
  scratch row of ``y``'s dtype (that is ``q``) and :func:`ydone` runs the element-wise family's forward of that
  row into ``y[i]`` (:func:`._ew_kernels.ew_row` with function tag ``fn``, its scalar ``a``, ``w``/``b``), the
  same values as the element-wise op on a stored ``q``, with no ``q`` in memory. With a 16-bit ``y`` the fast path
  writes no scratch row either: :func:`yfast` gives its output loop the sink row ``(fn, a, w, b, y[i], scratch)``
  and :func:`put_y` takes each element's ``q`` (rounded to ``y``'s dtype) through the element function
  (:func:`._ew_kernels.ew_elem`) into ``y[i, j]`` (float32/float64 ``y``: the element-wise math is float64 there,
  and the compiler could re-associate ``xhat``'s product with the weight's, so they keep the scratch row);
* epilogue ``ep`` -- ``None`` (``dx`` is stored) or ``(dh, alpha, dresidual)``: the gradient at
  ``h`` is ``v + dh`` (``dh`` may be None), stored as ``dx`` and as ``dresidual = alpha * (v + dh)``,
  each rounded once (:func:`ep_row`, :func:`put`, :func:`put_exact`).
"""

from __future__ import annotations

import numpy as np
from numba import types
from numba.extending import overload

from ._cache import INLINED, VIEW, jit
from ._ew_kernels import ew_elem, ew_row, fcast
from ._quant_kernels import quantize_row
from ._storage import JIT_ONLY, fma, ld, st, st_exact, stv
from .fp_quant import fpq_scratch, fpq_take

__all__ = [
    "aff_add",
    "aff_mul",
    "arow",
    "chan_at",
    "chan_scale",
    "channel",
    "channel_row",
    "ep_row",
    "pput",
    "pslot",
    "put",
    "put_exact",
    "put_y",
    "pzero",
    "src_done",
    "src_row",
    "ydone",
    "yfast",
    "yfast_done",
    "yrow",
    "yscratch",
]


def _none(t):  # type: ignore[no-untyped-def]
    return t is None or isinstance(t, types.NoneType)


def _hsum(x, r, alpha):  # type: ignore[no-untyped-def]
    """``x + alpha * r`` in float64 (see the module doc)."""
    raise RuntimeError(JIT_ONLY)


@overload(_hsum, jit_options={"fastmath": False, "error_model": "numpy"})
def _hsum_ol(x, r, alpha):  # type: ignore[no-untyped-def]
    if x == types.float64 or r == types.float64:
        return lambda x, r, alpha: fma(alpha, np.float64(r), np.float64(x))
    return lambda x, r, alpha: np.float64(x) + alpha * np.float64(r)


@jit()
def _h_row(xr, rr, alpha, hr):  # type: ignore[no-untyped-def]
    for j in range(xr.shape[0]):
        st_exact(hr, j, _hsum(ld(xr[j]), ld(rr[j]), alpha))


def src_row(pro, x, i):  # type: ignore[no-untyped-def]
    """The row the statistics of row ``i`` are taken of: ``x[i]``, or ``h[i]`` after computing and storing it."""
    raise RuntimeError(JIT_ONLY)


def src_done(pro, x, i):  # type: ignore[no-untyped-def]
    """``x[i]``, or the ``h[i]`` :func:`src_row` stored."""
    raise RuntimeError(JIT_ONLY)


@overload(src_row, jit_options=VIEW)
def _src_row_ol(pro, x, i):  # type: ignore[no-untyped-def]
    if _none(pro):
        return lambda pro, x, i: x[i]

    def impl(pro, x, i):  # type: ignore[no-untyped-def]
        hr = pro[2][i]
        _h_row(x[i], pro[0][i], pro[1], hr)
        return hr

    return impl


@overload(src_done)
def _src_done_ol(pro, x, i):  # type: ignore[no-untyped-def]
    if _none(pro):
        return lambda pro, x, i: x[i]
    return lambda pro, x, i: pro[2][i]


def arow(p, tab, i):  # type: ignore[no-untyped-def]
    """Row ``i``'s parameter vector: ``p`` itself, ``p[ids[i]]`` for a table, None for no parameter."""
    raise RuntimeError(JIT_ONLY)


def channel(tab):  # type: ignore[no-untyped-def]
    """Whether the numba type ``tab`` is the channel source's ``(G, S, P)`` (see the module doc)."""
    return isinstance(tab, types.UniTuple) and len(tab) == 3 and isinstance(tab.dtype, types.Integer)


def channel_row(w):  # type: ignore[no-untyped-def]
    """Whether the numba type ``w`` is a channel row ``(w[g P : g P + P] or None, S, P)`` (:func:`arow`)."""
    return isinstance(w, types.BaseTuple) and len(w) == 3 and not isinstance(w.types[0], types.Integer)


@overload(arow, jit_options=VIEW)
def _arow_ol(p, tab, i):  # type: ignore[no-untyped-def]
    if channel(tab):
        if _none(p):
            return lambda p, tab, i: (None, tab[1], tab[2])

        def chan(p, tab, i):  # type: ignore[no-untyped-def]
            g0 = (i % tab[0]) * tab[2]
            return (p[g0 : g0 + tab[2]], tab[1], tab[2])

        return chan
    if _none(p):
        return lambda p, tab, i: None
    if _none(tab):
        return lambda p, tab, i: p
    return lambda p, tab, i: p[tab[0][i]]


def pslot(tab, blk, i):  # type: ignore[no-untyped-def]
    """The partials' row that row ``i`` of row block ``blk`` adds into."""
    raise RuntimeError(JIT_ONLY)


@overload(pslot)
def _pslot_ol(tab, blk, i):  # type: ignore[no-untyped-def]
    if _none(tab):
        return lambda tab, blk, i: blk
    if channel(tab):
        return lambda tab, blk, i: i
    return lambda tab, blk, i: tab[2][i]


def pzero(p, tab, blk, j0, j1):  # type: ignore[no-untyped-def]
    """Zero the partials of row block ``blk`` (columns ``j0:j1``); nothing when ``p`` is None."""
    raise RuntimeError(JIT_ONLY)


@overload(pzero)
def _pzero_ol(p, tab, blk, j0, j1):  # type: ignore[no-untyped-def]
    if _none(p) or channel(tab):  # (the channel source's partials are set per row, :func:`pput`)
        return lambda p, tab, blk, j0, j1: None
    if _none(tab):

        def vec(p, tab, blk, j0, j1):  # type: ignore[no-untyped-def]
            p[blk, j0:j1] = 0

        return vec

    def table(p, tab, blk, j0, j1):  # type: ignore[no-untyped-def]
        p[tab[3][blk] : tab[3][blk + 1], j0:j1] = 0

    return table


def chan_at(w, q):  # type: ignore[no-untyped-def]
    """Channel ``q``'s scalar of a channel row (None for an absent parameter)."""
    raise RuntimeError(JIT_ONLY)


@overload(chan_at, inline="always")
def _chan_at_ol(w, q):  # type: ignore[no-untyped-def]
    if _none(w[0]):
        return lambda w, q: None
    return lambda w, q: w[0][q]


def chan_scale(w, q, s):  # type: ignore[no-untyped-def]
    """``w_q * s`` in float64 (``s`` a float64 sum over channel ``q``), or ``s`` for an absent weight."""
    raise RuntimeError(JIT_ONLY)


@overload(chan_scale, inline="always")
def _chan_scale_ol(w, q, s):  # type: ignore[no-untyped-def]
    if _none(w[0]):
        return lambda w, q, s: s
    return lambda w, q, s: np.float64(w[0][q]) * s


def pput(p, slot, q, v):  # type: ignore[no-untyped-def]
    """``p[slot, q] = v`` (a channel's partial sum), nothing when ``p`` is None."""
    raise RuntimeError(JIT_ONLY)


@overload(pput, inline="always")
def _pput_ol(p, slot, q, v):  # type: ignore[no-untyped-def]
    if _none(p):
        return lambda p, slot, q, v: None

    def impl(p, slot, q, v):  # type: ignore[no-untyped-def]
        p[slot, q] = v

    return impl


def aff_mul(v, w, j):  # type: ignore[no-untyped-def]
    """``v * w[j]`` in float64 (the slow path's scale of element ``j``): ``v`` for no weight, the channel's value for
    a channel row."""
    raise RuntimeError(JIT_ONLY)


def aff_add(v, b, j):  # type: ignore[no-untyped-def]
    """``v + b[j]`` in float64, as :func:`aff_mul`."""
    raise RuntimeError(JIT_ONLY)


def _aff_make(op):  # type: ignore[no-untyped-def]
    def ol(v, w, j):  # type: ignore[no-untyped-def]
        if _none(w) or (channel_row(w) and _none(w[0])):
            return lambda v, w, j: v
        if channel_row(w):
            return lambda v, w, j: op(v, np.float64(w[0][j // w[1]]))
        return lambda v, w, j: op(v, np.float64(ld(w[j])))

    return ol


@jit(inline="always")
def _mul(a, b):  # type: ignore[no-untyped-def]
    return a * b


@jit(inline="always")
def _add(a, b):  # type: ignore[no-untyped-def]
    return a + b


overload(aff_mul, inline="always")(_aff_make(_mul))
overload(aff_add, inline="always")(_aff_make(_add))


def ep_row(ep, i):  # type: ignore[no-untyped-def]
    """Row ``i`` of the epilogue: None, or ``(dh[i] or None, alpha, dresidual[i])``."""
    raise RuntimeError(JIT_ONLY)


@overload(ep_row)
def _ep_row_ol(ep, i):  # type: ignore[no-untyped-def]
    if _none(ep):
        return lambda ep, i: None
    if _none(ep[0]):
        return lambda ep, i: (None, ep[1], ep[2][i])
    return lambda ep, i: (ep[0][i], ep[1], ep[2][i])


def _with_dh(er, j, v):  # type: ignore[no-untyped-def]
    raise RuntimeError(JIT_ONLY)


@overload(_with_dh, jit_options={"fastmath": False, "error_model": "numpy"})
def _with_dh_ol(er, j, v):  # type: ignore[no-untyped-def]
    if _none(er[0]):
        return lambda er, j, v: v
    return lambda er, j, v: v + ld(er[0][j])


def put(er, dxr, j, v):  # type: ignore[no-untyped-def]
    """Store the math-type gradient ``v`` of element ``j`` (see the module doc), rounded once."""
    raise RuntimeError(JIT_ONLY)


def put_exact(er, dxr, j, v):  # type: ignore[no-untyped-def]
    """:func:`put` of a float64 ``v``, correctly rounded."""
    raise RuntimeError(JIT_ONLY)


def _put_make(store):  # type: ignore[no-untyped-def]
    def ol(er, dxr, j, v):  # type: ignore[no-untyped-def]
        if _none(er):
            return lambda er, dxr, j, v: store(dxr, j, v)

        def impl(er, dxr, j, v):  # type: ignore[no-untyped-def]
            g = _with_dh(er, j, v)
            store(dxr, j, g)
            store(er[2], j, er[1] * g)

        return impl

    return ol


overload(put, jit_options={"fastmath": False, "error_model": "numpy"})(_put_make(st))
overload(put_exact, jit_options={"fastmath": False, "error_model": "numpy"})(_put_make(st_exact))


def _fp_sink(y):  # type: ignore[no-untyped-def]
    """Whether the numba type of a forward's sink is the FP quantize sink ``(keep, q, out, amax)``."""
    return isinstance(y, types.BaseTuple) and len(y) == 4


@jit(inline="always")
def _fp_row(y, i, buf):  # type: ignore[no-untyped-def]
    """Where the forward writes row ``i`` for the FP quantize sink: ``keep[i]`` where ``y`` is kept, else the scratch
    row ``buf[0]``."""
    return y[0][i] if y[0].shape[0] > 0 else buf[0]


def _as_f32(row, tmp):  # type: ignore[no-untyped-def]
    """A storage row as float32 values: itself (float32), or converted into ``tmp`` (16-bit: exactly; float64:
    rounded once, as NumPy's ``astype``)."""
    raise RuntimeError(JIT_ONLY)


@overload(_as_f32, jit_options={"fastmath": False, "error_model": "numpy"})
def _as_f32_ol(row, tmp):  # type: ignore[no-untyped-def]
    if row.dtype == types.float32:
        return lambda row, tmp: row

    def convert(row, tmp):  # type: ignore[no-untyped-def]
        for j in range(row.shape[0]):
            tmp[j] = np.float32(ld(row[j]))
        return tmp

    return convert


def _ew_sink(y):  # type: ignore[no-untyped-def]
    """Whether the numba type of a forward's sink is the element-wise sink ``(fn, a, w, b, y)``."""
    return isinstance(y, types.BaseTuple) and len(y) == 5


def _ew_sink16(y):  # type: ignore[no-untyped-def]
    """Whether ``y`` is an element-wise sink with a 16-bit ``y`` (:func:`yfast` then fuses it into the row)."""
    return _ew_sink(y) and y[4].dtype in (types.int16, types.uint16)


def yfast(y, i, buf):  # type: ignore[no-untyped-def]
    """Where the forward's fast path writes row ``i`` (with :func:`put_y`): :func:`yrow`'s, but for an element-wise
    sink of 16-bit ``y`` the *sink row* ``(fn, a, w, b, y[i], buf)``: each element's ``q`` is rounded to ``buf``'s
    dtype and becomes ``y[i, j]`` at once (:func:`put_y`), not stored."""
    raise RuntimeError(JIT_ONLY)


@overload(yfast, inline="always", jit_options=VIEW)
def _yfast_ol(y, i, buf):  # type: ignore[no-untyped-def]
    if isinstance(y, types.Array):
        return lambda y, i, buf: y[i]
    if _ew_sink16(y):
        return lambda y, i, buf: (y[0], y[1], y[2], y[3], y[4][i], buf)
    if _fp_sink(y):
        return lambda y, i, buf: _fp_row(y, i, buf)
    return lambda y, i, buf: buf


def yfast_done(y, i, buf):  # type: ignore[no-untyped-def]
    """Row ``i`` written by the fast path (into :func:`yfast`): :func:`ydone`, nothing for a sink row."""
    raise RuntimeError(JIT_ONLY)


@overload(yfast_done, jit_options={"fastmath": False, "error_model": "numpy"})
def _yfast_done_ol(y, i, buf):  # type: ignore[no-untyped-def]
    if isinstance(y, types.Array) or _ew_sink16(y):
        return lambda y, i, buf: None
    return lambda y, i, buf: ydone(y, i, buf)


def put_y(yr, j, v):  # type: ignore[no-untyped-def]
    """``yr[j] = v`` rounded once (:func:`st`); for a sink row (:func:`yfast`), ``q = v`` rounded to the scratch
    dtype, then the element-wise forward of ``q`` stored into the row of ``y`` -- bitwise :func:`ydone`'s
    :func:`._ew_kernels.ew_row` of the stored ``q``."""
    raise RuntimeError(JIT_ONLY)


@overload(put_y, jit_options=INLINED)
def _put_y_ol(yr, j, v):  # type: ignore[no-untyped-def]
    if isinstance(yr, types.Array):
        return lambda yr, j, v: st(yr, j, v)

    def fused(yr, j, v):  # type: ignore[no-untyped-def]
        q = ld(stv(yr[5], v))
        st(yr[4], j, ew_elem(yr[0], fcast(yr[5], q), yr[1], yr[2], yr[3], j))

    return fused


def yscratch(y, h):  # type: ignore[no-untyped-def]
    """The scratch row of a quantize sink ``y`` (``h`` elements of ``y``'s dtype), None for an array ``y``."""
    raise RuntimeError(JIT_ONLY)


@overload(yscratch, inline="always")
def _yscratch_ol(y, h):  # type: ignore[no-untyped-def]
    if isinstance(y, types.Array):
        return lambda y, h: None
    if _ew_sink(y):
        return lambda y, h: np.empty(h, y[4].dtype)
    if _fp_sink(y):
        n = 0 if y[0].dtype == types.float32 else 1
        return lambda y, h: (np.empty(h, y[0].dtype), np.empty(n * h, np.float32), fpq_scratch(h, y[1]))
    return lambda y, h: np.empty(h, y[6].dtype)


def yrow(y, i, buf):  # type: ignore[no-untyped-def]
    """Where the forward writes row ``i``: ``y[i]``, or the sink's scratch ``buf``."""
    raise RuntimeError(JIT_ONLY)


@overload(yrow, inline="always")
def _yrow_ol(y, i, buf):  # type: ignore[no-untyped-def]
    if isinstance(y, types.Array):
        return lambda y, i, buf: y[i]
    if _fp_sink(y):
        return lambda y, i, buf: _fp_row(y, i, buf)
    return lambda y, i, buf: buf


def ydone(y, i, buf):  # type: ignore[no-untyped-def]
    """Row ``i`` written (into :func:`yrow`): nothing for an array ``y``; the quantize sink's epilogue."""
    raise RuntimeError(JIT_ONLY)


@overload(ydone, jit_options={"fastmath": False, "error_model": "numpy"})
def _ydone_ol(y, i, buf):  # type: ignore[no-untyped-def]
    if isinstance(y, types.Array):
        return lambda y, i, buf: None
    if _ew_sink(y):
        return lambda y, i, buf: ew_row(y[0], buf, y[1], y[2], y[3], y[4][i])
    if _fp_sink(y):
        return lambda y, i, buf: fpq_take(_as_f32(_fp_row(y, i, buf), buf[1]), i, y[1], y[2], y[3], buf[2])
    return lambda y, i, buf: quantize_row(buf, i, y[0], y[1], y[2], y[3], y[4], y[5])
