# numba's type stubs do not model overload stubs or jitted calls:
# mypy: disable-error-code="call-arg,attr-defined,var-annotated,call-overload"
r"""The column-statistics family's kernels (BatchNorm): statistics per channel over the ``N x S`` values of an
``(N, C, S)`` array, then element-wise passes.

Every array is in its storage form (:mod:`._common`: half types as their bits) and 3-D ``(N, C, S)``; the
``(C,)`` per-channel coefficients are in the math type (float32, float64 for float64 data) or float64 where
named so. Tasks (:mod:`._threads`):

* :func:`col_stats` -- task ``t`` is ``(j, q) = divmod(t, ceil(C / G))``: samples ``j nb <= n < (j + 1) nb`` of
  the channel group ``q G <= c < (q + 1) G`` (``nb``, ``G`` from :func:`layout`, functions of the shape only),
  read in memory order. Each row ``(n, c)`` of ``S`` values takes a corrected two-pass mean and ``M2`` in float64
  while it is in cache: ``m = sum(x) / S``, then ``s1 = sum(x - m)``, ``s2 = sum((x - m)^2)``; the row's mean is
  the pair ``(m, s1 / S)``, its ``M2 = s2 - s1^2 / S``. Rows are merged into their block ``(c, j)`` in sample
  order by Chan's parallel formula (:func:`_chan`: ``delta = mean_b - mean_a``, ``mean += delta n_b / n``,
  ``M2 += M2_b + delta^2 n_a n_b / n``) with the mean kept as a (high, low) pair. Never ``E[x^2] - E[x]^2``.
* :func:`col_merge` -- task ``c``: the channel's blocks merged in block order by the same formula; the mean is
  returned as its pair ``(K, corr)``, kept apart, so a channel with a large common offset keeps the accuracy of
  its deviations (and of its variance) and a constant channel is exactly 0 after centring. Every order is fixed
  by the shape: results do not depend on the thread count.
* :func:`col_bwd_sums` -- tasks as :func:`col_stats`: the blocks' float64 ``sum(dy)``, ``sum(dy xc)``,
  ``sum(xc)`` with ``xc = (x - k_c) - cc_c``, rows in order; :func:`col_sum_blocks` adds them in block order.
* :func:`col_apply`, :func:`col_dx`, :func:`col_scale` -- task ``t`` is the row ``(n, c) = divmod(t, C)`` of
  ``S`` values: ``y = ((x - k_c) - cc_c) sw_c [+ b_c]``, ``dx = a_c ((dy - m1_c) - xc q_c)``, ``dx = a_c dy``, in
  the math type (the two centring subtractions never refolded: ``contract`` only). One row's pass is one inline
  helper (:func:`_apply_row`, :func:`_dx_row`), which the short-row kernels (:func:`col_apply_short`,
  :func:`col_dx_short`: task ``t`` is sample ``t``, its ``C`` rows in order) run as well.

The row sums are compiled with ``reassoc`` (vectorized); the centring subtractions inside them are helpers without
fastmath flags (:func:`_dev`, :func:`_centre`), which keep their flags when inlined, so LLVM cannot refold
``sum(x - m)`` into ``sum(x) - n m``. The order of every sum is fixed by the shape (never by the threads).
"""

from __future__ import annotations

import numpy as np

from ._borrow import borrow
from ._cache import FM_SUM, jit
from ._storage import at, ld, opt_add, st, tile

__all__ = [
    "BLOCK_ELEMENTS",
    "GROUP_ELEMENTS",
    "SHORT_BLOCK",
    "SHORT_ROW",
    "block_samples",
    "col_apply",
    "col_apply_short",
    "col_bwd_sums",
    "col_bwd_sums_short",
    "col_dx",
    "col_dx_short",
    "col_merge",
    "col_scale",
    "col_stats",
    "col_stats_short",
    "col_sum_blocks",
    "group_channels",
    "layout",
]

#: values per block of the column reductions (a block: the samples whose statistics are merged row by row)
BLOCK_ELEMENTS = 8192

_FM_EXACT = {"contract"}


#: contiguous values per task and sample of the column reductions (a task reads ``nb`` runs of ``G S`` values;
#: the grouping changes no result: every sum is per channel, rows in sample order)
GROUP_ELEMENTS = 32768


def block_samples(n: int, s: int) -> int:
    """Samples per block of the column reductions for an ``(n, C, s)`` input (a function of the shape only)."""
    return max(1, min(n, BLOCK_ELEMENTS // max(s, 1)))


def group_channels(c: int, s: int) -> int:
    """Channels per task of the column reductions (a function of the shape only): runs of at least
    :data:`GROUP_ELEMENTS` contiguous values."""
    return max(1, min(c, -(-GROUP_ELEMENTS // max(s, 1))))


#: rows shorter than this take the short-row kernels (:func:`col_stats_short`, :func:`col_bwd_sums_short`)
SHORT_ROW = 32
#: values of one channel per block of the short-row kernels
SHORT_BLOCK = 1024


def layout(n: int, c: int, s: int) -> tuple[int, int, int]:
    """``(nb, g, tasks)``: samples per block, channels per group, and the reductions' task count. Rows of fewer
    than :data:`SHORT_ROW` values: blocks of about :data:`SHORT_BLOCK` values per channel, groups of channels
    whose block fits a 256 KiB cache."""
    if s < SHORT_ROW:
        nb = max(1, min(n, -(-SHORT_BLOCK // max(s, 1))))
        g = max(1, min(c, 65536 // (nb * max(s, 1))))
    else:
        nb, g = block_samples(n, s), group_channels(c, s)
    return nb, g, -(-n // nb) * -(-c // g)


@jit(inline="always")
def _row_task(t, c_):  # type: ignore[no-untyped-def]
    """Task ``t`` of the element-wise passes: the row ``(n, c) = divmod(t, C)``."""
    i = t // c_
    return i, t - i * c_


@jit(FM_SUM)
def _row_sum(xr):  # type: ignore[no-untyped-def]
    """float64 sum of a row (storage form)."""
    acc = 0.0
    for j in range(xr.shape[0]):
        acc += np.float64(ld(xr[j]))
    return acc


@jit()
def _dev(v, m):  # type: ignore[no-untyped-def]
    # no fastmath flags: the subtraction keeps them when inlined, so a reassociating sum cannot refold it
    return np.float64(v) - m


@jit()
def _centre(v, k, c):  # type: ignore[no-untyped-def]
    # no fastmath flags (see _dev): (x - k) is exact for x near k, and c is small
    return (np.float64(v) - k) - c


@jit(FM_SUM)
def _row_dev(xr, m):  # type: ignore[no-untyped-def]
    """``(sum(x - m), sum((x - m)^2))`` of a row in float64 (the deviations by :func:`_dev`)."""
    a = 0.0
    q = 0.0
    for j in range(xr.shape[0]):
        d = _dev(ld(xr[j]), m)
        a += d
        q += d * d
    return a, q


@jit()
def _chan(mh, ml, m2, na, mean_h, mean_l, m2b, nb):  # type: ignore[no-untyped-def]
    """Chan's merge of ``(mean_h + mean_l, m2b)`` over ``nb`` values into ``(mh + ml, m2)`` over ``na``; the mean
    kept as a pair (the new high part's rounding error goes to the low part, exactly: two-sum), so ``delta`` has
    the accuracy of the values' spread even for a channel with a large common offset. No fastmath flags."""
    tot = na + nb
    w = nb / tot
    delta = (mean_h - mh) + (mean_l - ml)
    step = delta * w
    hi = mh + step
    bb = hi - mh
    err = (mh - (hi - bb)) + (step - bb)
    return hi, ml + err, m2 + m2b + delta * delta * (na * w)


@jit(_FM_EXACT)
def _col_stats_span(x, nb, g, part, t0, t1):  # type: ignore[no-untyped-def]
    n_, c_, s_ = x.shape
    sf = np.float64(s_)
    for t in range(t0, t1):
        j, c0, c1 = tile(t, c_, g)
        n0 = j * nb
        for i in range(n0, min(n0 + nb, n_)):
            na = np.float64((i - n0) * s_)
            for c in range(c0, c1):
                xr = x[i, c]
                m = _row_sum(xr) / sf
                s1, s2 = _row_dev(xr, m)
                cr = s1 / sf
                m2 = s2 - s1 * cr
                if m2 < 0.0:  # (not max(): an overflowed NaN must stay NaN, for the host to see it)
                    m2 = 0.0
                if i == n0:
                    part[c, j, 0] = m
                    part[c, j, 1] = cr
                    part[c, j, 2] = m2
                else:  # rows merged into the block in sample order
                    part[c, j, 0], part[c, j, 1], part[c, j, 2] = _chan(
                        part[c, j, 0], part[c, j, 1], part[c, j, 2], na, m, cr, m2, sf
                    )


@jit(_FM_EXACT)
def col_stats(x, nb, g, part, lo, hi):  # type: ignore[no-untyped-def]
    """Block statistics of ``x`` ``(N, C, S)`` into ``part`` ``(C, nbk, 3)`` float64 (the block's mean ``M``, its
    correction, ``M2``) for tasks ``lo <= t < hi`` (see the module doc)."""
    _col_stats_span(*borrow((x, nb, g, part)), lo, hi)


@jit(FM_SUM)
def _short_sums(x, n0, n1, c0, c1, acc):  # type: ignore[no-untyped-def]
    """``acc[c - c0] = sum of channel c's values of samples n0 <= n < n1`` (float64, samples in order)."""
    s_ = x.shape[2]
    for q in range(c1 - c0):
        acc[q] = 0.0
    for i in range(n0, n1):
        xi = x[i]
        for c in range(c0, c1):
            a = acc[c - c0]
            for j in range(s_):
                a += np.float64(ld(xi[c, j]))
            acc[c - c0] = a


@jit(FM_SUM)
def _short_devs(x, n0, n1, c0, c1, m, a1, a2):  # type: ignore[no-untyped-def]
    """``a1, a2[c - c0] = sum (x - m), sum (x - m)^2`` of channel c over samples n0 <= n < n1 (by :func:`_dev`)."""
    s_ = x.shape[2]
    for q in range(c1 - c0):
        a1[q] = 0.0
        a2[q] = 0.0
    for i in range(n0, n1):
        xi = x[i]
        for c in range(c0, c1):
            mc = m[c - c0]
            p = a1[c - c0]
            q = a2[c - c0]
            for j in range(s_):
                d = _dev(ld(xi[c, j]), mc)
                p += d
                q += d * d
            a1[c - c0] = p
            a2[c - c0] = q


@jit(_FM_EXACT)
def _col_stats_short_span(x, nb, g, part, t0, t1):  # type: ignore[no-untyped-def]
    n_, c_, s_ = x.shape
    m = np.empty(g)
    a1 = np.empty(g)
    a2 = np.empty(g)
    for t in range(t0, t1):
        j, c0, c1 = tile(t, c_, g)
        n0 = j * nb
        n1 = min(n0 + nb, n_)
        cnt = np.float64((n1 - n0) * s_)
        _short_sums(x, n0, n1, c0, c1, m)
        for q in range(c1 - c0):
            m[q] = m[q] / cnt
        _short_devs(x, n0, n1, c0, c1, m, a1, a2)
        for c in range(c0, c1):
            q = c - c0
            corr = a1[q] / cnt
            part[c, j, 0] = m[q]
            part[c, j, 1] = corr
            m2 = a2[q] - a1[q] * corr
            part[c, j, 2] = 0.0 if m2 < 0.0 else m2  # (a NaN stays NaN: see _col_stats_span)


@jit(_FM_EXACT)
def col_stats_short(x, nb, g, part, lo, hi):  # type: ignore[no-untyped-def]
    """:func:`col_stats` for rows of fewer than :data:`SHORT_ROW` values: each block ``(c, j)`` takes the corrected
    two-pass mean and ``M2`` of its ``nb S`` values at once (the rows are too short to be merged one by one), the
    block's channel group read sample by sample in memory order."""
    _col_stats_short_span(*borrow((x, nb, g, part)), lo, hi)


@jit(FM_SUM)
def _short_bwd(x, dy, k, cc, n0, n1, c0, c1, g0, p0, e0):  # type: ignore[no-untyped-def]
    s_ = x.shape[2]
    for q in range(c1 - c0):
        g0[q] = 0.0
        p0[q] = 0.0
        e0[q] = 0.0
    for i in range(n0, n1):
        xi = x[i]
        di = dy[i]
        for c in range(c0, c1):
            kc = k[c]
            ccc = cc[c]
            a = g0[c - c0]
            b = p0[c - c0]
            e = e0[c - c0]
            for j in range(s_):
                xv = _centre(ld(xi[c, j]), kc, ccc)
                yv = np.float64(ld(di[c, j]))
                a += yv
                b += yv * xv
                e += xv
            g0[c - c0] = a
            p0[c - c0] = b
            e0[c - c0] = e


@jit(_FM_EXACT)
def _col_bwd_sums_short_span(x, dy, k, cc, nb, g, part, t0, t1):  # type: ignore[no-untyped-def]
    n_, c_ = x.shape[0], x.shape[1]
    g0 = np.empty(g)
    p0 = np.empty(g)
    e0 = np.empty(g)
    for t in range(t0, t1):
        j, c0, c1 = tile(t, c_, g)
        _short_bwd(x, dy, k, cc, j * nb, min(j * nb + nb, n_), c0, c1, g0, p0, e0)
        for c in range(c0, c1):
            part[c, j, 0] = g0[c - c0]
            part[c, j, 1] = p0[c - c0]
            part[c, j, 2] = e0[c - c0]


@jit(_FM_EXACT)
def col_bwd_sums_short(x, dy, k, cc, nb, g, part, lo, hi):  # type: ignore[no-untyped-def]
    """:func:`col_bwd_sums` for rows of fewer than :data:`SHORT_ROW` values (the same sums, per channel, samples in
    order)."""
    _col_bwd_sums_short_span(*borrow((x, dy, k, cc, nb, g, part)), lo, hi)


@jit(_FM_EXACT)
def _col_merge_span(part, nb, n_, s_, kout, cout, vout, t0, t1):  # type: ignore[no-untyped-def]
    nbk = part.shape[1]
    for c in range(t0, t1):
        cnt = np.float64(min(nb, n_) * s_)
        mh, ml, m2 = part[c, 0, 0], part[c, 0, 1], part[c, 0, 2]
        for j in range(1, nbk):
            cnt_b = np.float64((min((j + 1) * nb, n_) - j * nb) * s_)
            mh, ml, m2 = _chan(mh, ml, m2, cnt, part[c, j, 0], part[c, j, 1], part[c, j, 2], cnt_b)
            cnt += cnt_b
        kout[c] = mh
        cout[c] = ml
        vout[c] = m2 / cnt


@jit(_FM_EXACT)
def col_merge(part, nb, n, s, kout, cout, vout, lo, hi):  # type: ignore[no-untyped-def]
    """Channels ``lo <= c < hi``: the blocks of ``part`` merged (see the module doc) into the mean ``K`` (``kout``)
    and its correction (``cout``), and the biased variance (``vout``), float64 ``(C,)`` arrays."""
    _col_merge_span(*borrow((part, nb, n, s, kout, cout, vout)), lo, hi)


@jit(FM_SUM)
def _row_bwd(xr, dyr, k, cc):  # type: ignore[no-untyped-def]
    """``(sum dy, sum dy xc, sum xc)`` of a row in float64, ``xc = (x - k) - cc`` (by :func:`_centre`)."""
    g = 0.0
    p = 0.0
    e = 0.0
    for j in range(xr.shape[0]):
        xv = _centre(ld(xr[j]), k, cc)
        yv = np.float64(ld(dyr[j]))
        g += yv
        p += yv * xv
        e += xv
    return g, p, e


@jit(_FM_EXACT)
def _col_bwd_sums_span(x, dy, k, cc, nb, g, part, t0, t1):  # type: ignore[no-untyped-def]
    n_, c_ = x.shape[0], x.shape[1]
    for t in range(t0, t1):
        j, c0, c1 = tile(t, c_, g)
        for c in range(c0, c1):
            part[c, j, 0] = 0.0
            part[c, j, 1] = 0.0
            part[c, j, 2] = 0.0
        for i in range(j * nb, min(j * nb + nb, n_)):
            for c in range(c0, c1):
                a, b, d = _row_bwd(x[i, c], dy[i, c], k[c], cc[c])
                part[c, j, 0] += a
                part[c, j, 1] += b
                part[c, j, 2] += d


@jit(_FM_EXACT)
def col_bwd_sums(x, dy, k, cc, nb, g, part, lo, hi):  # type: ignore[no-untyped-def]
    """Block sums ``(sum dy, sum dy xc, sum xc)`` into ``part`` ``(C, nbk, 3)`` float64 for tasks ``lo <= t < hi``
    (``k``, ``cc``: float64 ``(C,)``; see the module doc)."""
    _col_bwd_sums_span(*borrow((x, dy, k, cc, nb, g, part)), lo, hi)


@jit(_FM_EXACT)
def col_sum_blocks(part, out, lo, hi):  # type: ignore[no-untyped-def]
    """``out[c, :] = sum_j part[c, j, :]`` in block order (float64) for channels ``lo <= c < hi``."""
    part, out = borrow((part, out))
    for c in range(lo, hi):
        for q in range(part.shape[2]):
            acc = 0.0
            for j in range(part.shape[1]):
                acc += part[c, j, q]
            out[c, q] = acc


@jit(inline="always")
def _apply_row(xr, yr, k, cc, sw, bc, c):  # type: ignore[no-untyped-def]
    """One row ``(n, c)`` of the forward pass: ``y = ((x - k_c) - cc_c) sw_c + bc`` (``bc``: a scalar, or None:
    nothing added)."""
    kc = k[c]
    ccc = cc[c]
    swc = sw[c]
    for j in range(xr.shape[0]):
        st(yr, j, opt_add(((ld(xr[j]) - kc) - ccc) * swc, bc, 0))


@jit(_FM_EXACT)
def _col_apply_span(x, k, cc, sw, b, y, t0, t1):  # type: ignore[no-untyped-def]
    c_ = x.shape[1]
    for t in range(t0, t1):
        i, c = _row_task(t, c_)
        if b is not None:
            _apply_row(x[i, c], y[i, c], k, cc, sw, b[c], c)
        else:
            _apply_row(x[i, c], y[i, c], k, cc, sw, None, c)


@jit(_FM_EXACT)
def col_apply(x, k, cc, sw, b, y, lo, hi):  # type: ignore[no-untyped-def]
    """``y = ((x - k_c) - cc_c) sw_c [+ b_c]`` for rows ``lo <= t < hi`` of ``(N, C, S)`` (coefficients ``(C,)``
    in the math type; ``b`` may be None)."""
    _col_apply_span(*borrow((x, k, cc, sw, b, y)), lo, hi)


@jit(inline="always")
def _dx_row(xr, dyr, dxr, k, cc, a, m1, q, c):  # type: ignore[no-untyped-def]
    """One row ``(n, c)`` of the training backward: ``dx = a_c ((dy - m1_c) - ((x - k_c) - cc_c) q_c)``."""
    kc = k[c]
    ccc = cc[c]
    ac = a[c]
    mc = m1[c]
    qc = q[c]
    for j in range(xr.shape[0]):
        xc = (ld(xr[j]) - kc) - ccc
        st(dxr, j, ac * ((ld(dyr[j]) - mc) - xc * qc))


@jit(_FM_EXACT)
def _col_dx_span(x, dy, k, cc, a, m1, q, dx, t0, t1):  # type: ignore[no-untyped-def]
    c_ = x.shape[1]
    for t in range(t0, t1):
        i, c = _row_task(t, c_)
        _dx_row(x[i, c], dy[i, c], dx[i, c], k, cc, a, m1, q, c)


@jit(_FM_EXACT)
def col_dx(x, dy, k, cc, a, m1, q, dx, lo, hi):  # type: ignore[no-untyped-def]
    """Training backward: ``dx = a_c ((dy - m1_c) - ((x - k_c) - cc_c) q_c)`` for rows ``lo <= t < hi``."""
    _col_dx_span(*borrow((x, dy, k, cc, a, m1, q, dx)), lo, hi)


@jit(_FM_EXACT)
def _col_scale_span(dy, a, dx, t0, t1):  # type: ignore[no-untyped-def]
    c_ = dy.shape[1]
    s_ = dy.shape[2]
    for t in range(t0, t1):
        i, c = _row_task(t, c_)
        dyr = dy[i, c]
        dxr = dx[i, c]
        ac = a[c]
        for j in range(s_):
            st(dxr, j, ld(dyr[j]) * ac)


@jit(_FM_EXACT)
def col_scale(dy, a, dx, lo, hi):  # type: ignore[no-untyped-def]
    """Evaluation backward: ``dx = dy a_c`` for rows ``lo <= t < hi``."""
    _col_scale_span(*borrow((dy, a, dx)), lo, hi)


@jit(_FM_EXACT)
def _col_apply_short_span(x, k, cc, sw, b, y, t0, t1):  # type: ignore[no-untyped-def]
    c_ = x.shape[1]
    for i in range(t0, t1):
        xi = x[i]
        yi = y[i]
        for c in range(c_):
            _apply_row(xi[c], yi[c], k, cc, sw, at(b, c), c)


@jit(_FM_EXACT)
def col_apply_short(x, k, cc, sw, b, y, lo, hi):  # type: ignore[no-untyped-def]
    """:func:`col_apply` for rows of fewer than :data:`SHORT_ROW` values: task ``t`` is sample ``t`` (``b`` None:
    adds 0.0)."""
    _col_apply_short_span(*borrow((x, k, cc, sw, b, y)), lo, hi)


@jit(_FM_EXACT)
def _col_dx_short_span(x, dy, k, cc, a, m1, q, dx, t0, t1):  # type: ignore[no-untyped-def]
    c_ = x.shape[1]
    for i in range(t0, t1):
        xi = x[i]
        di = dy[i]
        oi = dx[i]
        for c in range(c_):
            _dx_row(xi[c], di[c], oi[c], k, cc, a, m1, q, c)


@jit(_FM_EXACT)
def col_dx_short(x, dy, k, cc, a, m1, q, dx, lo, hi):  # type: ignore[no-untyped-def]
    """:func:`col_dx` for rows of fewer than :data:`SHORT_ROW` values: task ``t`` is sample ``t``."""
    _col_dx_short_span(*borrow((x, dy, k, cc, a, m1, q, dx)), lo, hi)
