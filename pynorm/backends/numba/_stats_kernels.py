# numba's type stubs do not model intrinsics, overload stubs or jitted calls:
# mypy: disable-error-code="call-arg,attr-defined,var-annotated,call-overload"
r"""The statistics family's kernels: one skeleton for every statistic, store mode and optional parameter.

Every kernel takes the statistic tag first (``stat``, :mod:`._variant`; its pieces live in
:mod:`._rowstats`); parameters and choices a variant lacks are ``None`` and their branches are
pruned at compile time (``b`` without bias, ``mean`` for a statistic without a mean, ``pw``/``pb``
without weight/bias gradient, ``stream`` None for plain stores, True for streaming stores of
large float32 outputs, :mod:`._stream`). The conventions of a statistic (``corr``, ``mode``: eps inside the
root, outside it or as a floor, :data:`._rowstats.INSIDE`...) are run-time arguments. The other axes of
:class:`pynorm.ops.StatsVariant` are optional arguments whose helpers live in :mod:`._io`: the prologue
``pro`` (``h = x + alpha * residual``, stored, then normalized), the affine source ``tab`` (parameter
tables indexed per row; the partials get one row per block and table row the block uses) and the epilogue ``ep`` (the
gradient at ``h`` plus ``dh``, stored as ``dx`` and ``alpha`` times it as ``dresidual``).

Forward (:func:`fwd`): one pass over the rows (split across threads, :mod:`._threads`); each row's statistics are taken
while it is in cache (:func:`._rowstats.fwd_stats`), then ``y`` is written (:func:`write_y`).

Backward: ``dx`` of a row from its sums ``sum g``, ``sum g xhat`` (and ``sum d^2`` with eps
outside the root), then ``dx`` while the row is in cache. Parameter gradients are per-block
partial sums (blocks of :data:`._layout.ROW_BLOCK` rows, fixed), accumulated in row order in the
math type and added in float64 in block order (:func:`._reduce.sum_blocks`), so they do not
depend on the thread count:

* fused path (:func:`bwd_fused`, many rows): per row block, each row adds ``dy * xhat`` / ``dy``
  to the block's partials during the pass that takes its sums;
* rows path (:func:`bwd_rows` then :func:`params_by_cols`, few rows of many elements): ``dx`` by
  rows, then the partials by column tiles, rows by groups of four
  (``pw += (p0 + p1) + (p2 + p3)``).

Slow path (rows whose fast sums overflow, underflow or are not finite, or whose ``r`` is out of
the math type's normal range): the fast kernels leave such rows *pending* (``rstd = -1`` in the
forward, ``scale = PENDING`` in the backward) and return how many there are; the host then runs
:func:`fwd_slow` / :func:`bwd_slow` (float64 after exact power-of-two scaling, compensated sums)
and, in the fused path, :func:`redo_blocks` (the partials of a block with a slow row are
recomputed in row order, each row with its own path's formula). These kernels, and the slow
branch of :func:`params_by_cols` (``scale`` given instead of None), compile only when a call
needs them.

Vectorization: every hot loop writes at most two arrays and reads a few, so LLVM's run-time alias
checks stay under its limit and the loops vectorize.
"""

from __future__ import annotations

import math

import numpy as np
from numba import types
from numba.extending import overload

from ._borrow import borrow
from ._cache import FM_SUM, INLINED, jit
from ._ew_kernels import bwd_scratch, ew_bwd_row, fcast
from ._io import (
    aff_add,
    aff_mul,
    arow,
    chan_at,
    chan_scale,
    channel_row,
    ep_row,
    pput,
    pslot,
    put,
    put_exact,
    put_y,
    pzero,
    src_done,
    src_row,
    ydone,
    yfast,
    yfast_done,
    yrow,
    yscratch,
)
from ._layout import CHUNK, COL_TILE, LANES, ROW_BLOCK
from ._rowstats import (
    _cadd,
    _row_scale,
    bwd_centring,
    bwd_finish,
    centre,
    dx_elem,
    fwd_stats,
    gprod,
    rfactor,
    row_aux,
    scaled_rstd,
    scaled_stats,
    slow_aux,
    slow_dx,
    slow_finish,
    slow_residual,
    slow_shift,
    third_sum,
    third_term,
)
from ._storage import JIT_ONLY, at, ld, opt_add, opt_mul, r_ok, seg, seg2, shifted, st_exact, tcast, wat
from ._stream import STAGE, nt_copy, sfence, stage_buf, stream_lines, streams

__all__ = [
    "FAST",
    "FWD_PENDING",
    "PENDING",
    "bwd_cast",
    "bwd_fused",
    "bwd_given",
    "bwd_rows",
    "bwd_slow",
    "fwd",
    "fwd_given",
    "fwd_slow",
    "mark_pending",
    "params_by_cols",
    "prologue_rows",
    "redo_blocks",
    "redo_channel",
]

#: per-row ``scale`` of the backward: the row took the fast path (else the slow path's exponent)
FAST = 1 << 20
#: ... the row needs the slow path (set by the fast kernels, replaced by :func:`bwd_slow`)
PENDING = FAST + 1
#: ``rstd`` of a forward row that needs the slow path (set by :func:`fwd`, replaced by :func:`fwd_slow`)
FWD_PENDING = -1.0


@jit(FM_SUM, forceinline=True)
def mark_pending(scale, i, ok):  # type: ignore[no-untyped-def]
    """``scale[i]``: :data:`FAST` where row ``i``'s fast path succeeded (``ok``), else :data:`PENDING`; returns 1 for
    a pending row (the backward kernels count them), else 0."""
    scale[i] = FAST if ok else PENDING
    return 0 if ok else 1


# ---------------------------------------------------------------------------
# how a row's outputs are written: ``stream`` None (plain stores) or True (streaming stores for
# the 64-byte aligned part of float32 rows; the arithmetic is the plain loops')


#: _UNSIGNED: the element loops of :func:`_y_range` and :func:`_dx_range` index with an unsigned copy of the loop
#: variable. Their ranges start at run-time offsets (a split row's segments, the streamed stores' head and tail), and
#: numba indexes a signed value through its negative-index wraparound, a select per element that LLVM vectorized as
#: gathers and scatters at best (the split kernels' writes) or not at all; an unsigned index has no wraparound.
@jit(FM_SUM, forceinline=True)
def _y_range(stat, xr, w, b, k, c, r, yr, lo, hi):  # type: ignore[no-untyped-def]
    for i in range(lo, hi):
        j = np.uint64(i)  # (see _UNSIGNED)
        put_y(yr, j, opt_add(opt_mul(centre(stat, ld(xr[j]), k, c) * r, w, j), b, j))


@jit(FM_SUM, forceinline=True)
def write_y(stat, xr, w, b, k, c, r, yr, stream, lo, hi):  # type: ignore[no-untyped-def]
    """``yr[lo:hi] = centre(x) * r [* w] [+ b]``, rounded once to the storage dtype. With ``stream``, the aligned
    lines (:func:`._stream.stream_lines`: a row written whole or by segments gets the same stores) are computed
    by the same loop into a stack scratch row and streamed from there (:func:`._stream.nt_copy`): the bits do not
    depend on the store mode."""
    if stream is not None and streams(yr):
        j0, j1 = stream_lines(yr, lo, hi)
        _y_range(stat, xr, w, b, k, c, r, yr, lo, j0)
        buf = stage_buf(yr)
        for j in range(j0, j1, STAGE):
            m = min(STAGE, j1 - j)
            _y_range(stat, xr[j:], shifted(w, j), shifted(b, j), k, c, r, buf, 0, m)
            for q in range(0, m, LANES):
                nt_copy(buf, q, yr, j + q)
        _y_range(stat, xr, w, b, k, c, r, yr, j1, hi)
    else:
        _y_range(stat, xr, w, b, k, c, r, yr, lo, hi)


# (write_dx, _dx_range, write_dx_out and padd keep numba-IR inlining: compiled apart and inlined by LLVM
# (``forceinline``, :data:`._cache.INLINED`, as the other pieces here), the dx arithmetic contracts differently
# -- RMSNorm's dx, 226 of 40706 outputs of ``bench/bitwise_check.py --quick`` -- and padd's partials with it.)


@jit(FM_SUM, inline="always")
def write_dx(stat, xr, dyr, w, k, c, r, gbar, coef, dxr, er, stream, lo, hi):  # type: ignore[no-untyped-def]
    """``dxr[j] = dx_elem(...)`` for ``lo <= j < hi``, through the epilogue ``er`` (:func:`._io.put`; streaming
    stores only without one: the aligned lines computed by the same loop into a stack scratch row and streamed
    from there, as :func:`write_y`)."""
    if stream is not None and streams(dxr):
        j0, j1 = stream_lines(dxr, lo, hi)
        _dx_range(stat, xr, dyr, w, k, c, r, gbar, coef, dxr, er, lo, j0)
        buf = stage_buf(dxr)
        for j in range(j0, j1, STAGE):
            m = min(STAGE, j1 - j)
            _dx_range(stat, xr[j:], dyr[j:], shifted(w, j), k, c, r, gbar, coef, buf, er, 0, m)
            for q in range(0, m, LANES):
                nt_copy(buf, q, dxr, j + q)
        _dx_range(stat, xr, dyr, w, k, c, r, gbar, coef, dxr, er, j1, hi)
    else:
        _dx_range(stat, xr, dyr, w, k, c, r, gbar, coef, dxr, er, lo, hi)


@jit(FM_SUM, inline="always")
def _dx_range(stat, xr, dyr, w, k, c, r, gbar, coef, dxr, er, lo, hi):  # type: ignore[no-untyped-def]
    for i in range(lo, hi):
        j = np.uint64(i)  # (see _UNSIGNED)
        put(er, dxr, j, dx_elem(stat, xr, dyr, w, k, c, r, gbar, coef, j))


def padd(p, j, v):  # type: ignore[no-untyped-def]
    """``p[j] += v``, nothing when ``p`` is None."""
    raise RuntimeError(JIT_ONLY)


@overload(padd, inline="always")
def _padd_ol(p, j, v):  # type: ignore[no-untyped-def]
    if isinstance(p, types.NoneType):
        return lambda p, j, v: None

    def impl(p, j, v):  # type: ignore[no-untyped-def]
        p[j] += v

    return impl


def chunk_put(chunks, q, ag, agx, ad2):  # type: ignore[no-untyped-def]
    """``chunks[q] = (ag, agx, ad2)`` in float64, nothing when ``chunks`` is None."""
    raise RuntimeError(JIT_ONLY)


@overload(chunk_put, jit_options=INLINED)
def _chunk_put_ol(chunks, q, ag, agx, ad2):  # type: ignore[no-untyped-def]
    if isinstance(chunks, types.NoneType):
        return lambda chunks, q, ag, agx, ad2: None

    def impl(chunks, q, ag, agx, ad2):  # type: ignore[no-untyped-def]
        chunks[q, 0] = np.float64(ag)
        chunks[q, 1] = np.float64(agx)
        chunks[q, 2] = np.float64(ad2)

    return impl


def gmul(stat, dy, w, j):  # type: ignore[no-untyped-def]
    """``g = dy * w[j]`` as the statistic rounds it (:func:`._rowstats.gprod`), or ``dy`` when ``w`` is None."""
    raise RuntimeError(JIT_ONLY)


@overload(gmul, jit_options=INLINED)
def _gmul_ol(stat, dy, w, j):  # type: ignore[no-untyped-def]
    if isinstance(w, types.NoneType):
        return lambda stat, dy, w, j: dy
    return lambda stat, dy, w, j: gprod(stat, dy, wat(w, j))


# ---------------------------------------------------------------------------
# the affine source's shape of a row: a whole row at once, or a channel row (:mod:`._io`) channel by channel, each
# channel's S elements with its scalars (the same loops, streamed stores included). A channel's loops run on views
# of its S elements from index 0: a loop from ``q * S`` (an offset LLVM cannot prove non-negative) indexes through
# numba's negative-index wraparound, which kept it scalar (gathers and scatters at best) -- GroupNorm's and
# InstanceNorm's forward 7x slower than LayerNorm's over the same rows.


def write_out(stat, xr, w, b, k, c, r, yr, stream):  # type: ignore[no-untyped-def]
    """:func:`write_y` of the whole row (a channel row: channel by channel)."""
    raise RuntimeError(JIT_ONLY)


@overload(write_out, jit_options=INLINED)
def _write_out_ol(stat, xr, w, b, k, c, r, yr, stream):  # type: ignore[no-untyped-def]
    if not channel_row(w):
        return lambda stat, xr, w, b, k, c, r, yr, stream: write_y(stat, xr, w, b, k, c, r, yr, stream, 0,
                                                                   xr.shape[0])  # fmt: skip

    def chan(stat, xr, w, b, k, c, r, yr, stream):  # type: ignore[no-untyped-def]
        s = w[1]
        for q in range(w[2]):
            a = q * s  # (each channel's views from 0: see the section's note)
            write_y(stat, xr[a : a + s], chan_at(w, q), chan_at(b, q), k, c, r, yr[a : a + s], stream, 0, s)

    return chan


def row_sums(stat, xr, dyr, w, k, c, r, with_d2, pw, pb, blk):  # type: ignore[no-untyped-def]
    """:func:`_bwd_sums` of the whole row (a channel row: each channel's ``sum dy``, ``sum dy xhat`` set as its
    partials, the row's sums their ``w``-weighted float64 sums)."""
    raise RuntimeError(JIT_ONLY)


@overload(row_sums, jit_options=INLINED)
def _row_sums_ol(stat, xr, dyr, w, k, c, r, with_d2, pw, pb, blk):  # type: ignore[no-untyped-def]
    if not channel_row(w):
        return lambda stat, xr, dyr, w, k, c, r, with_d2, pw, pb, blk: _bwd_sums(
            stat, xr, dyr, w, k, c, r, with_d2, pw, pb, blk, 0, xr.shape[0], None
        )

    def chan(stat, xr, dyr, w, k, c, r, with_d2, pw, pb, blk):  # type: ignore[no-untyped-def]
        s = w[1]
        sg = 0.0
        sgx = 0.0
        sd2 = 0.0
        for q in range(w[2]):
            a, ax, d2 = _bwd_sums(stat, xr, dyr, None, k, c, r, with_d2, None, None, 0, q * s, q * s + s, None)
            sg += chan_scale(w, q, a)
            sgx += chan_scale(w, q, ax)
            sd2 += d2
            pput(pw, blk, q, ax)
            pput(pb, blk, q, a)
        return sg, sgx, sd2

    return chan


def write_dx_out(stat, xr, dyr, w, k, c, r, gbar, coef, dxr, er, stream):  # type: ignore[no-untyped-def]
    """:func:`write_dx` of the whole row (a channel row: channel by channel)."""
    raise RuntimeError(JIT_ONLY)


@overload(write_dx_out, inline="always")
def _write_dx_out_ol(stat, xr, dyr, w, k, c, r, gbar, coef, dxr, er, stream):  # type: ignore[no-untyped-def]
    if not channel_row(w):
        return lambda stat, xr, dyr, w, k, c, r, gbar, coef, dxr, er, stream: write_dx(
            stat, xr, dyr, w, k, c, r, gbar, coef, dxr, er, stream, 0, xr.shape[0]
        )

    if not isinstance(er, types.NoneType):
        raise TypeError("a channel row's dx takes no epilogue (the channel source has no prologue)")

    def chan(stat, xr, dyr, w, k, c, r, gbar, coef, dxr, er, stream):  # type: ignore[no-untyped-def]
        s = w[1]
        for q in range(w[2]):
            a = q * s
            write_dx(stat, xr[a : a + s], dyr[a : a + s], chan_at(w, q), k, c, r, gbar, coef, dxr[a : a + s], er,
                     stream, 0, s)  # fmt: skip

    return chan


# ---------------------------------------------------------------------------
# forward


@jit(FM_SUM, forceinline=True)
def _fwd_row(stat, xr, w, b, eps, corr, mode, yr, stream):  # type: ignore[no-untyped-def]
    """Normalize one row into ``yr``: ``(ok, aux, r)`` in float64 (``aux``: :func:`._rowstats.row_aux`; ``ok``
    False: nothing written, slow path)."""
    ok, k, c, v = fwd_stats(stat, xr, corr)
    if not ok:
        return False, 0.0, 0.0
    r = rfactor(stat, v, eps, mode)
    write_out(stat, xr, w, b, k, tcast(xr, c), tcast(xr, r), yr, stream)
    return True, row_aux(stat, k, c, v, eps, mode), r


@jit(FM_SUM, borrowed=True)
def _fwd_span(stat, x, pro, w, b, tab, eps, corr, mode, y, aux, rstd, stream, buf, i0, i1):  # type: ignore[no-untyped-def]
    """Rows ``i0 <= i < i1`` of :func:`fwd` (``buf``: the kernel's scratch row, :func:`._io.yscratch`); returns how
    many it left pending.

    Every span kernel of the backend is this pattern: the kernel borrows its arrays (:mod:`._borrow`) and hands
    them to its body as arguments (numba prunes ``is None`` branches on arguments only). A body marked
    ``borrowed`` (:func:`._cache.jit`) compiles without reference counting and allocates nothing: its kernel makes
    the scratch.
    """
    pending = 0
    for i in range(i0, i1):
        xr = src_row(pro, x, i)
        ok, m, r = _fwd_row(stat, xr, arow(w, tab, i), arow(b, tab, i), eps, corr, mode, yfast(y, i, buf), stream)
        if ok:
            yfast_done(y, i, buf)
            if aux is not None:
                aux[i] = m
            rstd[i] = r
        else:
            rstd[i] = FWD_PENDING
            pending += 1
    sfence(stream)
    return pending


@jit(FM_SUM)
def fwd(stat, rows, affine, conv, y, row_stats, stream, lo, hi):  # type: ignore[no-untyped-def]
    """Forward of rows ``lo <= i < hi`` of ``rows`` (:class:`._args.Rows`: ``x`` in storage form and its
    prologue) into ``y`` (storage form; or the quantize epilogue's sink, :mod:`._io`), with the scale and shift
    of ``affine`` (:class:`._args.Affine`) and the conventions ``conv`` (:class:`._args.Conventions`); writes
    ``row_stats`` (:class:`._args.RowStats`: the
    statistic's aux value, or None, and ``r``, float64).

    Returns the number of rows left for :func:`fwd_slow` (their ``rstd`` is -1). ``stream``: None, or
    True to write float32 ``y`` with streaming stores (outputs much larger than the caches; one store fence per
    span).
    """
    x, pro = rows
    w, b, tab = affine
    eps, corr, mode = conv
    aux, rstd = row_stats
    buf = yscratch(y, x.shape[1])
    return _fwd_span(*borrow((stat, x, pro, w, b, tab, eps, corr, mode, y, aux, rstd, stream, buf)), lo, hi)


@jit()
def prologue_rows(pro, x, lo, hi):  # type: ignore[no-untyped-def]
    """The prologue alone (``h = x + alpha * residual`` of rows ``lo <= i < hi``, stored): for an ``h`` narrower
    than the math type, which is then normalized from its float64 copy."""
    pro, x = borrow((pro, x))
    for i in range(lo, hi):
        src_row(pro, x, i)


@jit()
def _fwd_row_slow(stat, xr, w, b, eps, corr, mode, yr):  # type: ignore[no-untyped-def]
    """The slow path of one row: float64 after scaling by ``2**-e``; returns ``(aux, r)``."""
    e = _row_scale(xr)
    m1, c, v_s = scaled_stats(stat, xr, e, corr)
    r, r_s = scaled_rstd(stat, v_s, e, eps, mode)
    sc = math.ldexp(1.0, -e)
    for j in range(xr.shape[0]):
        v = ((np.float64(ld(xr[j])) * sc - m1) - c) * r_s
        st_exact(yr, j, aff_add(aff_mul(v, w, j), b, j))
    return slow_aux(stat, m1, c, e, v_s, eps, mode), r


@jit()
def fwd_slow(stat, rows, affine, conv, y, row_stats):  # type: ignore[no-untyped-def]
    """The rows :func:`fwd` left pending (``rstd == -1``), by the slow path (plain stores); arguments as
    :func:`fwd`'s."""
    x, pro = rows
    w, b, tab = affine
    eps, corr, mode = conv
    aux, rstd = row_stats
    _fwd_slow_rows(stat, x, pro, w, b, tab, eps, corr, mode, y, aux, rstd)


@jit()
def _fwd_slow_rows(stat, x, pro, w, b, tab, eps, corr, mode, y, aux, rstd):  # type: ignore[no-untyped-def]
    buf = yscratch(y, x.shape[1])
    for i in range(x.shape[0]):
        if rstd[i] == FWD_PENDING:
            xr = src_done(pro, x, i)
            m, r = _fwd_row_slow(stat, xr, arow(w, tab, i), arow(b, tab, i), eps, corr, mode, yrow(y, i, buf))
            ydone(y, i, buf)
            if aux is not None:
                aux[i] = m
            rstd[i] = r


@jit(FM_SUM, borrowed=True)
def _given_span(stat, x, w, b, tab, mean, rstd, y, stream, i0, i1):  # type: ignore[no-untyped-def]
    for i in range(i0, i1):
        xr = x[i]
        write_out(stat, xr, arow(w, tab, i), arow(b, tab, i), tcast(xr, mean[i]), tcast(xr, 0.0), tcast(xr, rstd[i]),
                  y[i], stream)  # fmt: skip
    sfence(stream)


@jit(FM_SUM)
def fwd_given(stat, x, affine, row_stats, y, stream, lo, hi):  # type: ignore[no-untyped-def]
    """Rows ``lo <= i < hi`` normalized by *given* statistics (InstanceNorm with its running statistics): ``y =
    (x - mean[i]) * rstd[i] [* w] [+ b]``, ``row_stats`` = ``(mean, rstd)`` given in the math type's values; the
    other arguments as :func:`fwd`'s."""
    w, b, tab = affine
    mean, rstd = row_stats
    _given_span(*borrow((stat, x, w, b, tab, mean, rstd, y, stream)), lo, hi)


# ---------------------------------------------------------------------------
# backward: a row's dx (and its share of the block partials)


@jit(FM_SUM, forceinline=True)
def _bwd_sums(stat, xr, dyr, w, k, c, r, with_d2, pw, pb, blk, j0, j1, chunks):  # type: ignore[no-untyped-def]
    """``(sum g, sum g*xhat, sum d^2)`` over columns ``j0:j1`` (``j0`` a multiple of :data:`._layout.CHUNK`) in
    float64 with ``g = dy * w``, ``d = centre(x)``, ``xhat = d * r`` (``sum d^2`` only with eps outside the
    root); adds ``dy * xhat`` to ``pw[blk]``, ``dy`` to ``pb[blk]``. ``chunks`` (None, or a float64
    ``(chunks, 3)`` array): each chunk's three sums are also stored there (the split kernels,
    :mod:`._split_kernels`, add them in chunk order afterwards, exactly as this loop does).

    The partials ``pw``, ``pb`` ((blocks, H) arrays or None) are passed down as the kernels' own
    arguments with a block index; the optional outputs are written by type-chosen helpers (:func:`padd`,
    :func:`chunk_put`), since a caller may reach this body through an inlined overload (:func:`row_sums`), where
    numba prunes no ``is None`` branch.
    """
    sg = 0.0
    sgx = 0.0
    sd2 = 0.0
    zero = tcast(xr, 0.0)
    for c0 in range(j0, j1, CHUNK):
        c1 = min(c0 + CHUNK, j1)
        xc = xr[c0:c1]
        dc = dyr[c0:c1]
        ag = zero
        agx = zero
        ad2 = zero
        pwc = seg2(pw, blk, c0, c1)
        pbc = seg2(pb, blk, c0, c1)
        wc = seg(w, c0, c1)
        if with_d2:
            for j in range(xc.shape[0]):
                d = centre(stat, ld(xc[j]), k, c)
                xhat = d * r
                dy = ld(dc[j])
                g = gmul(stat, dy, wc, j)
                ag += g
                agx += g * xhat
                ad2 += third_term(stat, d, xhat)
                padd(pwc, j, dy * xhat)
                padd(pbc, j, dy)
        else:
            for j in range(xc.shape[0]):
                xhat = centre(stat, ld(xc[j]), k, c) * r
                dy = ld(dc[j])
                g = gmul(stat, dy, wc, j)
                ag += g
                agx += g * xhat
                padd(pwc, j, dy * xhat)
                padd(pbc, j, dy)
        chunk_put(chunks, c0 // CHUNK, ag, agx, ad2)
        sg += np.float64(ag)
        sgx += np.float64(agx)
        sd2 += np.float64(ad2)
    return sg, sgx, sd2


@jit(FM_SUM, forceinline=True)
def _bwd_row(stat, xr, dyr, w, mean, r, corr, mode, dxr, er, pw, pb, blk, stream):  # type: ignore[no-untyped-def]
    """dx of one row on the fast path, and its share of ``pw[blk]``/``pb[blk]``: ``(ok, c)``.

    ``ok`` False: the row needs the slow path (the partials may then hold a wrong contribution).
    """
    k, c = bwd_centring(stat, xr, mean, r)
    rt = tcast(xr, r)
    if r_ok(xr, r):
        sg, sgx, sd2 = row_sums(stat, xr, dyr, w, k, c, rt, third_sum(stat, mode), pw, pb, blk)
        ok, gbar, coef = bwd_finish(stat, xr, k, c, sg, sgx, sd2, r, corr, mode, mean)
        if ok:
            write_dx_out(stat, xr, dyr, w, k, c, rt, gbar, coef, dxr, er, stream)
            return True, c
    return False, c


@jit()
def _bwd_row_slow(stat, xr, dyr, w, mean, r, corr, mode, dxr, er):  # type: ignore[no-untyped-def]
    """dx of one row in float64 after scaling by a power of two (compensated sums);
    returns ``(scale exponent, residual c)``."""
    h = xr.shape[0]
    n = h - corr
    e = _row_scale(xr)
    sc = math.ldexp(1.0, -e)
    m_s = slow_shift(stat, mean, e)
    r_s = math.ldexp(r, e)
    c = slow_residual(stat, xr, mean, e)
    sg = 0.0
    tg = 0.0
    sgx = 0.0
    tgx = 0.0
    sd2 = 0.0
    td2 = 0.0
    for j in range(h):
        d = (np.float64(ld(xr[j])) * sc - m_s) - c
        g = aff_mul(np.float64(ld(dyr[j])), w, j)
        sg, tg = _cadd(sg, tg, g)
        sgx, tgx = _cadd(sgx, tgx, g * (d * r_s))
        sd2, td2 = _cadd(sd2, td2, third_term(stat, d, d * r_s))
    sg = sg + tg
    sgx = sgx + tgx
    gbar, coef = slow_finish(stat, sg, sgx, sd2 + td2, h, n, r_s, mode, mean)
    for j in range(h):
        d = (np.float64(ld(xr[j])) * sc - m_s) - c
        g = aff_mul(np.float64(ld(dyr[j])), w, j)
        put_exact(er, dxr, j, slow_dx(stat, g, gbar, d, d * r_s, coef, r))
    return e, c


# ---------------------------------------------------------------------------
# backward: row contributions to the block partials


@jit(FM_SUM, forceinline=True)
def _acc(stat, xr, dyr, k, c, r, pw, pb, blk, j0):  # type: ignore[no-untyped-def]
    """Add one fast-path row segment's ``dy * xhat`` to ``pw[blk, j0:]`` and ``dy`` to ``pb[blk, j0:]``."""
    n = xr.shape[0]
    if pw is not None:
        pwr = pw[blk, j0 : j0 + n]
        for j in range(n):
            pwr[j] += ld(dyr[j]) * (centre(stat, ld(xr[j]), k, c) * r)
    if pb is not None:
        pbr = pb[blk, j0 : j0 + n]
        for j in range(n):
            pbr[j] += ld(dyr[j])


@jit(FM_SUM, forceinline=True)
def _acc4(stat, x0, x1, x2, x3, d0, d1, d2, d3, kq, cq, rq, pw, pb, blk, j0):  # type: ignore[no-untyped-def]
    """:func:`_acc` of four fast-path rows at once: ``pw += (row0 + row1) + (row2 + row3)``.

    One loop per output: few pointers per loop keep the compiler's run-time alias checks within
    its limit, so both loops vectorize.
    """
    n = x0.shape[0]
    if pw is not None:
        pwr = pw[blk, j0 : j0 + n]
        k0, k1, k2, k3 = tcast(x0, kq[0]), tcast(x0, kq[1]), tcast(x0, kq[2]), tcast(x0, kq[3])
        c0, c1, c2, c3 = tcast(x0, cq[0]), tcast(x0, cq[1]), tcast(x0, cq[2]), tcast(x0, cq[3])
        r0, r1, r2, r3 = tcast(x0, rq[0]), tcast(x0, rq[1]), tcast(x0, rq[2]), tcast(x0, rq[3])
        for j in range(n):
            p01 = ld(d0[j]) * (centre(stat, ld(x0[j]), k0, c0) * r0) + ld(d1[j]) * (
                centre(stat, ld(x1[j]), k1, c1) * r1
            )
            p23 = ld(d2[j]) * (centre(stat, ld(x2[j]), k2, c2) * r2) + ld(d3[j]) * (
                centre(stat, ld(x3[j]), k3, c3) * r3
            )
            pwr[j] += p01 + p23
    if pb is not None:
        pbr = pb[blk, j0 : j0 + n]
        for j in range(n):
            pbr[j] += (ld(d0[j]) + ld(d1[j])) + (ld(d2[j]) + ld(d3[j]))


@jit()
def _acc_slow(stat, xr, dyr, mean, r, e, c, pw, pb, blk, j0):  # type: ignore[no-untyped-def]
    """:func:`_acc` of a slow-path row segment (float64, scaled by ``2**-e``; ``c``: the row's residual)."""
    sc = math.ldexp(1.0, -e)
    m_s = slow_shift(stat, mean, e)
    r_s = math.ldexp(r, e)
    for j in range(xr.shape[0]):
        dy = np.float64(ld(dyr[j]))
        if pw is not None:  # each term rounded once to the partials' dtype (float64 where xhat is not O(1))
            pw[blk, j0 + j] += tcast(pw, dy * (((np.float64(ld(xr[j])) * sc - m_s) - c) * r_s))
        if pb is not None:
            pb[blk, j0 + j] += tcast(pb, dy)


# ---------------------------------------------------------------------------
# backward kernels


@jit(FM_SUM, borrowed=True)
def _bwd_blocks(stat, x, dy, w, tab, mean, rstd, corr, mode, ep, dx, pw, pb, scale, stream, b0, b1):  # type: ignore[no-untyped-def]
    """Row blocks ``b0 <= blk < b1`` of :func:`bwd_fused` (its body: see :func:`_fwd_span`); returns how many
    rows it left pending."""
    pending = 0
    for blk in range(b0, b1):
        pzero(pw, tab, blk, 0, x.shape[1])
        pzero(pb, tab, blk, 0, x.shape[1])
        for i in range(blk * ROW_BLOCK, min(blk * ROW_BLOCK + ROW_BLOCK, x.shape[0])):
            ok = _bwd_row(stat, x[i], dy[i], arow(w, tab, i), at(mean, i), rstd[i], corr, mode, dx[i],
                          ep_row(ep, i), pw, pb, pslot(tab, blk, i), stream)[0]  # fmt: skip
            pending += mark_pending(scale, i, ok)
    sfence(stream)
    return pending


@jit(FM_SUM)
def bwd_fused(stat, x, dy, affine, row_stats, conv, grad, partials, scale, stream, lo, hi):  # type: ignore[no-untyped-def]
    """Backward of row blocks ``lo <= blk < hi`` (:data:`._layout.ROW_BLOCK` rows each) of the normalized rows
    ``x`` given ``dy`` (storage form): ``grad`` (:class:`._args.Grad`: ``dx``, through the epilogue), and the
    blocks' partial sums ``partials`` (:class:`._args.Partials`; with a table affine source, one row per block
    and table row it uses, :mod:`._io`). ``affine``: the weight and table (:class:`._args.Affine`, no bias);
    ``row_stats``: the forward's; ``conv``: its conventions.

    ``scale[i]``: :data:`FAST`, or :data:`PENDING` for the rows left for :func:`bwd_slow` (their
    number is returned; their blocks' partials are then for :func:`redo_blocks`).
    """
    w, _, tab = affine
    mean, rstd = row_stats
    _, corr, mode = conv
    dx, ep = grad
    pw, pb = partials
    a = borrow((stat, x, dy, w, tab, mean, rstd, corr, mode, ep, dx, pw, pb, scale, stream))
    return _bwd_blocks(*a, lo, hi)


@jit(FM_SUM, borrowed=True)
def _bwd_rows_span(stat, x, dy, w, tab, mean, rstd, corr, mode, ep, dx, scale, cs, stream, i0, i1):  # type: ignore[no-untyped-def]
    """Rows ``i0 <= i < i1`` of :func:`bwd_rows` (its body: see :func:`_fwd_span`); returns how many it left
    pending."""
    pending = 0
    for i in range(i0, i1):
        ok, c = _bwd_row(stat, x[i], dy[i], arow(w, tab, i), at(mean, i), rstd[i], corr, mode, dx[i],
                         ep_row(ep, i), None, None, 0, stream)  # fmt: skip
        pending += mark_pending(scale, i, ok)
        if cs is not None:
            cs[i] = c
    sfence(stream)
    return pending


@jit(FM_SUM)
def bwd_rows(stat, x, dy, affine, row_stats, conv, grad, scale, cs, stream, lo, hi):  # type: ignore[no-untyped-def]
    """Backward of rows ``lo <= i < hi``, dx only (arguments as :func:`bwd_fused`'s); ``scale[i]`` as in
    :func:`bwd_fused`, ``cs[i]`` the row's centring residual ``c`` (or None). Returns the number of rows left for
    :func:`bwd_slow`."""
    w, _, tab = affine
    mean, rstd = row_stats
    _, corr, mode = conv
    dx, ep = grad
    a = borrow((stat, x, dy, w, tab, mean, rstd, corr, mode, ep, dx, scale, cs, stream))
    return _bwd_rows_span(*a, lo, hi)


@jit()
def bwd_slow(stat, x, dy, affine, row_stats, conv, grad, scale, cs):  # type: ignore[no-untyped-def]
    """dx of the rows left :data:`PENDING`, by the slow path (arguments as :func:`bwd_rows`'s); records their
    exponent in ``scale`` and (``cs`` not None) their residual ``c``."""
    w, _, tab = affine
    mean, rstd = row_stats
    _, corr, mode = conv
    dx, ep = grad
    _bwd_slow_rows(stat, x, dy, w, tab, mean, rstd, corr, mode, ep, dx, scale, cs)


@jit()
def _bwd_slow_rows(stat, x, dy, w, tab, mean, rstd, corr, mode, ep, dx, scale, cs):  # type: ignore[no-untyped-def]
    for i in range(x.shape[0]):
        if scale[i] == PENDING:
            e, c = _bwd_row_slow(stat, x[i], dy[i], arow(w, tab, i), at(mean, i), rstd[i], corr, mode, dx[i],
                                 ep_row(ep, i))  # fmt: skip
            scale[i] = e
            if cs is not None:
                cs[i] = tcast(x, c)


@jit(FM_SUM)
def redo_blocks(stat, x, dy, table, row_stats, scale, partials):  # type: ignore[no-untyped-def]
    """Recompute the partials of the blocks holding a slow-path row: rows in order, each with the
    formula of its path (as :func:`bwd_fused` adds them). ``table``: the affine source's (``Affine.table``)."""
    mean, rstd = row_stats
    pw, pb = partials
    _redo_blocks(stat, x, dy, table, mean, rstd, scale, pw, pb)


@jit(FM_SUM)
def _redo_blocks(stat, x, dy, tab, mean, rstd, scale, pw, pb):  # type: ignore[no-untyped-def]
    rows = x.shape[0]
    for blk in range((rows + ROW_BLOCK - 1) // ROW_BLOCK):
        i0 = blk * ROW_BLOCK
        i1 = min(i0 + ROW_BLOCK, rows)
        clean = True
        for i in range(i0, i1):
            clean = clean and scale[i] == FAST
        if clean:
            continue
        pzero(pw, tab, blk, 0, x.shape[1])
        pzero(pb, tab, blk, 0, x.shape[1])
        for i in range(i0, i1):
            xr = x[i]
            slot = pslot(tab, blk, i)
            if scale[i] == FAST:
                k, c = bwd_centring(stat, xr, at(mean, i), rstd[i])
                _acc(stat, xr, dy[i], k, c, tcast(xr, rstd[i]), pw, pb, slot, 0)
            else:
                cr = slow_residual(stat, xr, at(mean, i), scale[i])
                _acc_slow(stat, xr, dy[i], at(mean, i), rstd[i], scale[i], cr, pw, pb, slot, 0)


@jit(FM_SUM, borrowed=True)
def _bwd_given_span(stat, x, dy, w, tab, mean, rstd, dx, pw, pb, stream, i0, i1):  # type: ignore[no-untyped-def]
    for i in range(i0, i1):
        xr = x[i]
        k, zero, rt = tcast(xr, mean[i]), tcast(xr, 0.0), tcast(xr, rstd[i])
        wr = arow(w, tab, i)
        row_sums(stat, xr, dy[i], wr, k, zero, rt, False, pw, pb, pslot(tab, 0, i))
        write_dx_out(stat, xr, dy[i], wr, k, zero, rt, zero, zero, dx[i], None, stream)
    sfence(stream)


@jit(FM_SUM)
def bwd_given(stat, x, dy, affine, row_stats, grad, partials, stream, lo, hi):  # type: ignore[no-untyped-def]
    """Backward of :func:`fwd_given`'s rows ``lo <= i < hi``: ``dx = dy [* w] * rstd[i]`` (the statistics are
    constants), and the rows' partials (the channel source's, :mod:`._io`)."""
    w, _, tab = affine
    mean, rstd = row_stats
    dx, _ = grad
    pw, pb = partials
    _bwd_given_span(*borrow((stat, x, dy, w, tab, mean, rstd, dx, pw, pb, stream)), lo, hi)


@jit()
def redo_channel(stat, x, dy, table, row_stats, scale, partials):  # type: ignore[no-untyped-def]
    """The channel source's partials (:mod:`._io`: set per row) of the rows the slow path took, recomputed with its
    float64 formula (as :func:`redo_blocks` does for the other sources' blocks)."""
    mean, rstd = row_stats
    pw, pb = partials
    _redo_channel(stat, x, dy, table, mean, rstd, scale, pw, pb)


@jit()
def _redo_channel(stat, x, dy, tab, mean, rstd, scale, pw, pb):  # type: ignore[no-untyped-def]
    s = tab[1]
    for i in range(x.shape[0]):
        if scale[i] == FAST:
            continue
        e = scale[i]
        xr = x[i]
        dyr = dy[i]
        cr = slow_residual(stat, xr, at(mean, i), e)
        sc = math.ldexp(1.0, -e)
        m_s = slow_shift(stat, at(mean, i), e)
        r_s = math.ldexp(rstd[i], e)
        for q in range(tab[2]):
            a = 0.0
            ax = 0.0
            for j in range(q * s, q * s + s):
                g = np.float64(ld(dyr[j]))
                a += g
                ax += g * (((np.float64(ld(xr[j])) * sc - m_s) - cr) * r_s)
            pput(pw, i, q, ax)
            pput(pb, i, q, a)


#: column tiles :func:`params_by_cols` takes in one step (4 rows of x and dy: 32 KiB of float32, within L1)
_TILES_AT_ONCE = 4


@jit(FM_SUM)
def _params_tiles(stat, x, dy, tab, mean, rstd, scale, cs, pw, pb, t0, t1):  # type: ignore[no-untyped-def]
    """Column tiles ``t0 <= t < t1`` of :func:`params_by_cols` (its body: see :func:`_fwd_span`)."""
    rows, h = x.shape
    nb = (rows + ROW_BLOCK - 1) // ROW_BLOCK
    kq = np.empty(4)
    cq = np.empty(4)
    rq = np.empty(4)
    for t in range(t0, t1, _TILES_AT_ONCE):  # columns are independent: wider steps change no result
        j0 = t * COL_TILE
        j1 = min(min(t + _TILES_AT_ONCE, t1) * COL_TILE, h)
        for blk in range(nb):
            pzero(pw, tab, blk, j0, j1)
            pzero(pb, tab, blk, j0, j1)
            i = blk * ROW_BLOCK
            end = min(i + ROW_BLOCK, rows)
            while i < end:
                n4 = min(4, end - i)
                allfast = n4 == 4 and pslot(tab, blk, i) == pslot(tab, blk, i + n4 - 1)
                for q in range(n4):
                    kq[q] = tcast(x, at(mean, i + q))
                    cq[q] = at(cs, i + q)
                    rq[q] = tcast(x, rstd[i + q])
                    allfast = allfast and pslot(tab, blk, i + q) == pslot(tab, blk, i)
                    if scale is not None:
                        allfast = allfast and scale[i + q] == FAST
                if allfast:
                    _acc4(stat, x[i, j0:j1], x[i + 1, j0:j1], x[i + 2, j0:j1], x[i + 3, j0:j1],
                          dy[i, j0:j1], dy[i + 1, j0:j1], dy[i + 2, j0:j1], dy[i + 3, j0:j1],
                          kq, cq, rq, pw, pb, pslot(tab, blk, i), j0)  # fmt: skip
                else:
                    for q in range(n4):
                        xr = x[i + q, j0:j1]
                        dyr = dy[i + q, j0:j1]
                        slot = pslot(tab, blk, i + q)
                        if scale is None:
                            _acc(stat, xr, dyr, tcast(xr, kq[q]), tcast(xr, cq[q]), tcast(xr, rq[q]), pw, pb, slot, j0)
                        elif scale[i + q] == FAST:
                            _acc(stat, xr, dyr, tcast(xr, kq[q]), tcast(xr, cq[q]), tcast(xr, rq[q]), pw, pb, slot, j0)
                        else:
                            e = scale[i + q]
                            _acc_slow(stat, xr, dyr, at(mean, i + q), rstd[i + q], e, cq[q], pw, pb, slot, j0)
                i += 4


@jit(FM_SUM)
def params_by_cols(stat, x, dy, table, row_stats, scale, cs, partials, lo, hi):  # type: ignore[no-untyped-def]
    """Per-block partial sums (``partials``, :class:`._args.Partials`) of ``dy * xhat`` and ``dy`` for column
    tiles ``lo <= t < hi`` (:data:`._layout.COL_TILE` columns each; for few rows); rows by groups of 4.

    ``scale`` None: every row took the fast path; else the rows' paths from :func:`bwd_rows` /
    :func:`bwd_slow` (a group with a slow row is added row by row). ``cs``: the rows' ``c`` from
    :func:`bwd_rows`.
    """
    mean, rstd = row_stats
    pw, pb = partials
    _params_tiles(*borrow((stat, x, dy, table, mean, rstd, scale, cs, pw, pb)), lo, hi)


# ---------------------------------------------------------------------------
# the casting policies' backward in one pass (the element-wise identity between the norm and its affine)


@jit(FM_SUM, borrowed=True)
def _cast_blocks(stat, fn, x, dy, a, w, big, mean, rstd, eps, corr, mode, dx, pw, pb, stream, scratch, b0, b1):  # type: ignore[no-untyped-def]
    """Row blocks ``b0 <= blk < b1`` of :func:`bwd_cast` (its body: see :func:`_fwd_span`; ``scratch``: the
    kernel's rows ``q``, ``g`` and the identity's :func:`._ew_kernels.bwd_scratch`)."""
    h = x.shape[1]
    av = fcast(x, a)
    qb, gb, fs, ts = scratch
    for blk in range(b0, b1):
        pwr = seg2(pw, blk, 0, h)
        pbr = seg2(pb, blk, 0, h)
        if pw is not None:
            pwr[:] = 0
        if pb is not None:
            pbr[:] = 0
        for i in range(blk * ROW_BLOCK, min(blk * ROW_BLOCK + ROW_BLOCK, x.shape[0])):
            xr = x[i]
            # q: the row as the forward's sink received it (its fast path, else its slow path)
            if not _fwd_row(stat, xr, None, None, eps, corr, mode, qb, None)[0]:
                _fwd_row_slow(stat, xr, None, None, eps, corr, mode, qb)
            # the identity's backward of the row: g = rnd(dy w) into gb, its partials into the block's rows
            ew_bwd_row(fn, qb, dy[i], av, w, big, gb, pwr, pbr, None, fs, ts)
            # the norm's backward without affine, g its upstream gradient
            if not _bwd_row(stat, xr, gb, None, at(mean, i), rstd[i], corr, mode, dx[i], None, None, None, 0,
                            stream)[0]:  # fmt: skip
                _bwd_row_slow(stat, xr, gb, None, at(mean, i), rstd[i], corr, mode, dx[i], None)
    sfence(stream)


@jit(FM_SUM)
def bwd_cast(stat, x, dy, source, row_stats, conv, dx, partials, stream, lo, hi):  # type: ignore[no-untyped-def]
    """The backward of a casting policy that rounds ``xhat`` to ``x``'s dtype before the affine
    (:mod:`pynorm.composite.casting`: ``q = rnd(xhat)``, ``y = w q + b`` by the element-wise identity), for row
    blocks ``lo <= blk < hi``, each row in one pass while it is in cache: ``q`` by the forward's row kernel (as the
    forward's sink received it), the identity's backward of ``q`` (:func:`._ew_kernels.ew_bwd_row`: ``g = rnd(dy
    w)`` into a scratch row, its ``dweight``/``dbias`` partials per row block, the element-wise family's layout),
    then the norm's backward without affine with upstream gradient ``g`` into ``dx`` (rows its fast path cannot
    take: the slow path, at once). Bitwise the three kernels the composite runs otherwise (the same row functions
    on the same values), without ``q`` and ``g`` in memory.

    ``source``: ``(fn, a, w, big)``, the identity's function tag, scalar, weight and ``x``'s largest finite value
    (:meth:`pynorm.backends.numba.elementwise.ElementwiseOp.source`); ``partials``: the identity's ``(pw, pb)``
    (``(blocks, H)`` or None); ``row_stats``, ``conv``: the forward's (:class:`._args.RowStats`,
    :class:`._args.Conventions`)."""
    fn, a, w, big = source
    mean, rstd = row_stats
    eps, corr, mode = conv
    pw, pb = partials
    h = x.shape[1]
    scratch = (np.empty(h, x.dtype), np.empty(h, x.dtype), *bwd_scratch(fn, x, h, pw, None))
    _cast_blocks(*borrow((stat, fn, x, dy, a, w, big, mean, rstd, eps, corr, mode, dx, pw, pb, stream, scratch)),
                 lo, hi)  # fmt: skip
