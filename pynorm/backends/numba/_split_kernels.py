# numba's type stubs do not model intrinsics, overload stubs or jitted calls:
# mypy: disable-error-code="call-arg,attr-defined,var-annotated,call-overload"
r"""Few wide rows: the statistics family's row kernels with each row split across threads.

The plain kernels (:mod:`._stats_kernels`) give each thread whole rows, or whole row blocks; with fewer of
those than threads, threads idle. Here a row is cut into segments of :data:`._layout.SPLIT_SEG` columns (a
multiple of :data:`._layout.CHUNK`) and each kernel's tasks are (row, segment) or (row block, segment)
pairs, in three steps:

1. *sums*: each task takes the chunk sums of its segments -- the same loop as the plain kernels
   (:func:`._rowstats.seg_sums`, :func:`._stats_kernels._bwd_sums`), storing each chunk's float64 sum;
2. *finish* (one thread; a few operations per chunk): each row's sums are added in chunk order, which is
   the order the plain kernels add them in, and the row's statistics or backward coefficients follow from
   the same pieces (:func:`._rowstats.fwd_finish`, :func:`._rowstats.bwd_finish`);
3. *write*: each task writes its segment of ``y`` or ``dx`` (:func:`._stats_kernels.write_y` / ``write_dx``,
   with the streaming stores of the whole-row kernels where they use them).

So every output is bitwise the plain kernels' (tested over every op and dtype, and by
``bench/bitwise_check.py --split``). Rows the fast path cannot take are left pending, as the plain kernels
leave them, for the same slow-path kernels.

The backward's *sums* step takes row blocks: with the weight/bias partials of the fused path, each block's
rows add into the partials of its segment in row order, exactly as :func:`._stats_kernels.bwd_fused` does.
"""

from __future__ import annotations

import numpy as np

from ._borrow import borrow
from ._cache import FM_SUM, jit
from ._io import _h_row, arow, ep_row, pslot, pzero
from ._layout import ROW_BLOCK, SPLIT_SEG
from ._rowstats import bwd_centring, bwd_finish, fwd_finish, fwd_shift, rfactor, row_aux, seg_sums, third_sum
from ._stats_kernels import FAST, FWD_PENDING, _bwd_sums, mark_pending, write_dx, write_y
from ._storage import at, r_ok, tcast, tile
from ._stream import sfence

__all__ = [
    "bwd_finish_rows",
    "bwd_prep",
    "bwd_sums",
    "bwd_write",
    "fwd_finish_rows",
    "fwd_sums",
    "fwd_write",
    "prologue",
]


# ---------------------------------------------------------------------------
# forward


@jit()
def _prologue_span(pro, x, t0, t1):  # type: ignore[no-untyped-def]
    for t in range(t0, t1):
        i, j0, j1 = tile(t, x.shape[1], SPLIT_SEG)
        _h_row(x[i, j0:j1], pro[0][i, j0:j1], pro[1], pro[2][i, j0:j1])


@jit()
def prologue(pro, x, lo, hi):  # type: ignore[no-untyped-def]
    """The prologue (``h = x + alpha * residual``, stored) of (row, segment) tasks ``lo <= t < hi``: the rows
    are then normalized from ``h`` (element-wise: bitwise what :func:`._io.src_row` stores)."""
    _prologue_span(*borrow((pro, x)), lo, hi)


@jit(FM_SUM)
def _fwd_sums_span(stat, x, k, s1, s2, t0, t1):  # type: ignore[no-untyped-def]
    for t in range(t0, t1):
        i, j0, j1 = tile(t, x.shape[1], SPLIT_SEG)
        xr = x[i]
        kk = fwd_shift(stat, xr)
        if j0 == 0:
            k[i] = np.float64(kk)
        seg_sums(stat, xr, kk, j0, j1, s1[i], s2[i])


@jit(FM_SUM)
def fwd_sums(stat, x, shifts, s1, s2, lo, hi):  # type: ignore[no-untyped-def]
    """Chunk sums of (row, segment) tasks ``lo <= t < hi`` around each row's shift (:func:`._rowstats.seg_sums`;
    ``s1``/``s2``: ``(rows, chunks)`` float64; ``shifts[i]``: row ``i``'s shift ``k``, stored by its first
    segment)."""
    _fwd_sums_span(*borrow((stat, x, shifts, s1, s2)), lo, hi)


@jit(FM_SUM)
def fwd_finish_rows(stat, x, shifts, s1, s2, conv, c, row_stats):  # type: ignore[no-untyped-def]
    """Each row's statistics from its chunk sums added in chunk order: ``shifts``/``c`` (the centring ``(x - k) -
    c``) and ``row_stats`` (:class:`._args.RowStats`) as :func:`._stats_kernels.fwd` stores them, with the
    conventions ``conv``; returns how many rows it left pending (``rstd == -1``)."""
    eps, corr, mode = conv
    aux, rstd = row_stats
    return _fwd_finish_rows(stat, x, shifts, s1, s2, eps, corr, mode, c, aux, rstd)


@jit(FM_SUM)
def _fwd_finish_rows(stat, x, k, s1, s2, eps, corr, mode, c, aux, rstd):  # type: ignore[no-untyped-def]
    pending = 0
    for i in range(x.shape[0]):
        xr = x[i]
        a = 0.0
        b = 0.0
        for q in range(s1.shape[1]):
            a += s1[i, q]
            b += s2[i, q]
        ok, kk, cc, v = fwd_finish(stat, xr, tcast(xr, k[i]), a, b, corr)
        if ok:
            r = rfactor(stat, v, eps, mode)
            k[i] = np.float64(kk)
            c[i] = cc
            if aux is not None:
                aux[i] = row_aux(stat, kk, cc, v, eps, mode)
            rstd[i] = r
        else:
            rstd[i] = FWD_PENDING
            pending += 1
    return pending


@jit(FM_SUM)
def _fwd_write_span(stat, x, w, b, tab, k, c, rstd, y, stream, t0, t1):  # type: ignore[no-untyped-def]
    for t in range(t0, t1):
        i, j0, j1 = tile(t, x.shape[1], SPLIT_SEG)
        if rstd[i] != FWD_PENDING:
            xr = x[i]
            write_y(stat, xr, arow(w, tab, i), arow(b, tab, i), tcast(xr, k[i]), tcast(xr, c[i]),
                    tcast(xr, rstd[i]), y[i], stream, j0, j1)  # fmt: skip
    sfence(stream)


@jit(FM_SUM)
def fwd_write(stat, x, affine, shifts, c, rstd, y, stream, lo, hi):  # type: ignore[no-untyped-def]
    """``y`` of (row, segment) tasks ``lo <= t < hi`` (rows not pending) from :func:`fwd_finish_rows`'s
    centring and ``rstd``, with the scale and shift of ``affine`` (:class:`._args.Affine`; ``stream``: as
    :func:`._stats_kernels.fwd`, the same stores)."""
    w, b, tab = affine
    _fwd_write_span(*borrow((stat, x, w, b, tab, shifts, c, rstd, y, stream)), lo, hi)


# ---------------------------------------------------------------------------
# backward


@jit(FM_SUM)
def bwd_prep(stat, x, row_stats, shifts, c, ok):  # type: ignore[no-untyped-def]
    """Each row's centring ``(shifts[i], c[i])`` (:func:`._rowstats.bwd_centring`, from the forward's
    ``row_stats``) and whether its ``r`` allows the fast path (``ok``), as :func:`._stats_kernels.bwd_fused` takes
    them."""
    mean, rstd = row_stats
    _bwd_prep(stat, x, mean, rstd, shifts, c, ok)


@jit(FM_SUM)
def _bwd_prep(stat, x, mean, rstd, k, c, ok):  # type: ignore[no-untyped-def]
    for i in range(x.shape[0]):
        xr = x[i]
        kk, cc = bwd_centring(stat, xr, at(mean, i), rstd[i])
        k[i] = np.float64(kk)
        c[i] = np.float64(cc)
        ok[i] = r_ok(xr, rstd[i])


@jit(FM_SUM)
def _bwd_sums_span(stat, x, dy, w, tab, k, c, rstd, ok, mode, pw, pb, sums, t0, t1):  # type: ignore[no-untyped-def]
    rows, h = x.shape
    for t in range(t0, t1):
        blk, j0, j1 = tile(t, h, SPLIT_SEG)
        pzero(pw, tab, blk, j0, j1)
        pzero(pb, tab, blk, j0, j1)
        for i in range(blk * ROW_BLOCK, min(blk * ROW_BLOCK + ROW_BLOCK, rows)):
            if ok[i]:
                xr = x[i]
                _bwd_sums(stat, xr, dy[i], arow(w, tab, i), tcast(xr, k[i]), tcast(xr, c[i]), tcast(xr, rstd[i]),
                          third_sum(stat, mode), pw, pb, pslot(tab, blk, i), j0, j1, sums[i])  # fmt: skip


@jit(FM_SUM)
def bwd_sums(stat, x, dy, affine, shifts, c, rstd, ok, mode, partials, sums, lo, hi):  # type: ignore[no-untyped-def]
    """Chunk sums (``sums``: ``(rows, chunks, 3)`` float64) of (row block, segment) tasks ``lo <= t < hi``, and
    the segment's weight/bias ``partials`` (:class:`._args.Partials`) in row order, as
    :func:`._stats_kernels.bwd_fused` adds them (rows whose ``ok`` is False are skipped: they go to the slow path).
    ``mode``: the r rule."""
    w, _, tab = affine
    pw, pb = partials
    _bwd_sums_span(*borrow((stat, x, dy, w, tab, shifts, c, rstd, ok, mode, pw, pb, sums)), lo, hi)


@jit(FM_SUM)
def bwd_finish_rows(stat, x, shifts, c, row_stats, ok, conv, sums, gbar, coef, scale):  # type: ignore[no-untyped-def]
    """Each row's ``gbar``/``coef`` from its chunk sums added in chunk order (:func:`._rowstats.bwd_finish`);
    ``scale[i]``: :data:`._stats_kernels.FAST` or ``PENDING``. Returns how many rows are pending."""
    mean, rstd = row_stats
    _, corr, mode = conv
    return _bwd_finish_rows(stat, x, shifts, c, rstd, ok, corr, mode, mean, sums, gbar, coef, scale)


@jit(FM_SUM)
def _bwd_finish_rows(stat, x, k, c, rstd, ok, corr, mode, mean, sums, gbar, coef, scale):  # type: ignore[no-untyped-def]
    pending = 0
    for i in range(x.shape[0]):
        good = ok[i]
        if good:
            xr = x[i]
            sg = 0.0
            sgx = 0.0
            sd2 = 0.0
            for q in range(sums.shape[1]):
                sg += sums[i, q, 0]
                sgx += sums[i, q, 1]
                sd2 += sums[i, q, 2]
            good, gb, cf = bwd_finish(stat, xr, tcast(xr, k[i]), tcast(xr, c[i]), sg, sgx, sd2, rstd[i], corr,
                                      mode, at(mean, i))  # fmt: skip
            gbar[i] = np.float64(gb)
            coef[i] = np.float64(cf)
        pending += mark_pending(scale, i, good)
    return pending


@jit(FM_SUM)
def _bwd_write_span(stat, x, dy, w, tab, k, c, rstd, gbar, coef, scale, ep, dx, stream, t0, t1):  # type: ignore[no-untyped-def]
    for t in range(t0, t1):
        i, j0, j1 = tile(t, x.shape[1], SPLIT_SEG)
        if scale[i] == FAST:
            xr = x[i]
            write_dx(stat, xr, dy[i], arow(w, tab, i), tcast(xr, k[i]), tcast(xr, c[i]), tcast(xr, rstd[i]),
                     tcast(xr, gbar[i]), tcast(xr, coef[i]), dx[i], ep_row(ep, i), stream, j0, j1)  # fmt: skip
    sfence(stream)


@jit(FM_SUM)
def bwd_write(stat, x, dy, affine, shifts, c, rstd, gbar, coef, scale, grad, stream, lo, hi):  # type: ignore[no-untyped-def]
    """``grad`` (:class:`._args.Grad`: ``dx``, through the epilogue) of (row, segment) tasks ``lo <= t < hi`` of the
    fast-path rows (``stream``: as :func:`._stats_kernels.bwd_fused`, the same stores)."""
    w, _, tab = affine
    dx, ep = grad
    _bwd_write_span(*borrow((stat, x, dy, w, tab, shifts, c, rstd, gbar, coef, scale, ep, dx, stream)), lo, hi)
