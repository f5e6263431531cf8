# numba's type stubs do not model overload stubs or jitted calls:
# mypy: disable-error-code="call-arg,attr-defined,var-annotated,call-overload"
r"""The column-statistics family's kernels (BatchNorm): statistics per channel over the ``N x S`` values of an
``(N, C, S)`` array, then element-wise passes.

Every array is in its storage form (:mod:`._common`: half types as their bits) and 3-D ``(N, C, S)``; the
``(C,)`` per-channel coefficients are in the math type (float32, float64 for float64 data) or float64 where
named so. Tasks (:mod:`._threads`):

* :func:`col_stats` -- task ``t`` is the *block* ``(c, j) = divmod(t, nbk)``: samples ``j nb <= n < (j + 1) nb``
  of channel ``c`` (``nb`` from :func:`block_samples`, a function of the shape only). Each block takes a
  corrected two-pass mean and ``M2`` of its values in float64 while they are in cache: ``m = sum(x) / n_b``,
  then ``s1 = sum(x - m)``, ``s2 = sum((x - m)^2)``; the block's mean is the pair ``(m, s1 / n_b)`` and
  ``M2 = s2 - s1^2 / n_b``. Never ``E[x^2] - E[x]^2``.
* :func:`col_merge` -- task ``c``: the channel's blocks merged in block order by Chan's parallel formula
  (``delta = mean_b - mean_a``, ``mean += delta n_b / n``, ``M2 += M2_b + delta^2 n_a n_b / n``), then the mean
  re-centred: ``K`` (Chan's mean) and ``corr = sum_b n_b ((m_b - K) + s1_b / n_b) / n`` kept apart, so a channel
  with a large common offset keeps the accuracy of its deviations and a constant channel is exactly 0 after
  centring. The order is fixed by the shape: results do not depend on the thread count.
* :func:`col_bwd_sums` -- task ``(c, j)`` as :func:`col_stats`: the block's float64 ``sum(dy)``,
  ``sum(dy xc)``, ``sum(xc)`` with ``xc = (x - k_c) - cc_c``; :func:`col_sum_blocks` adds them in block order.
* :func:`col_apply`, :func:`col_dx`, :func:`col_scale` -- task ``t`` is the row ``(n, c) = divmod(t, C)`` of
  ``S`` values: ``y = ((x - k_c) - cc_c) sw_c [+ b_c]``, ``dx = a_c ((dy - m1_c) - xc q_c)``, ``dx = a_c dy``, in
  the math type (the two centring subtractions never refolded: ``contract`` only).

The deviation sums are written with eight independent accumulators and compiled without ``reassoc`` (so LLVM
cannot turn ``sum(x - m)`` into ``sum(x) - n m``); their order is fixed, the SLP vectorizer packs the lanes.
"""

from __future__ import annotations

import numpy as np

from ._borrow import borrow
from ._cache import FM_SUM, jit
from ._storage import ld, st

__all__ = [
    "BLOCK_ELEMENTS",
    "block_samples",
    "col_apply",
    "col_bwd_sums",
    "col_dx",
    "col_merge",
    "col_scale",
    "col_stats",
    "col_sum_blocks",
]

#: values per block of the column reductions (about 32 KiB of float32: the second pass reads them from cache)
BLOCK_ELEMENTS = 8192

_FM_EXACT = {"contract"}


def block_samples(n: int, s: int) -> int:
    """Samples per block of the column reductions for an ``(n, C, s)`` input (a function of the shape only)."""
    return max(1, min(n, BLOCK_ELEMENTS // max(s, 1)))


@jit(FM_SUM)
def _row_sum(xr):  # type: ignore[no-untyped-def]
    """float64 sum of a row (storage form)."""
    acc = 0.0
    for j in range(xr.shape[0]):
        acc += np.float64(ld(xr[j]))
    return acc


@jit(_FM_EXACT)
def _row_dev(xr, m):  # type: ignore[no-untyped-def]
    """``(sum(x - m), sum((x - m)^2))`` of a row in float64, eight accumulators in a fixed order."""
    n = xr.shape[0]
    n8 = n - n % 8
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = 0.0
    q0 = q1 = q2 = q3 = q4 = q5 = q6 = q7 = 0.0
    for j in range(0, n8, 8):
        d0 = np.float64(ld(xr[j])) - m
        d1 = np.float64(ld(xr[j + 1])) - m
        d2 = np.float64(ld(xr[j + 2])) - m
        d3 = np.float64(ld(xr[j + 3])) - m
        d4 = np.float64(ld(xr[j + 4])) - m
        d5 = np.float64(ld(xr[j + 5])) - m
        d6 = np.float64(ld(xr[j + 6])) - m
        d7 = np.float64(ld(xr[j + 7])) - m
        a0 += d0
        a1 += d1
        a2 += d2
        a3 += d3
        a4 += d4
        a5 += d5
        a6 += d6
        a7 += d7
        q0 += d0 * d0
        q1 += d1 * d1
        q2 += d2 * d2
        q3 += d3 * d3
        q4 += d4 * d4
        q5 += d5 * d5
        q6 += d6 * d6
        q7 += d7 * d7
    for j in range(n8, n):
        d = np.float64(ld(xr[j])) - m
        a0 += d
        q0 += d * d
    return ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7)), ((q0 + q1) + (q2 + q3)) + ((q4 + q5) + (q6 + q7))


@jit(_FM_EXACT)
def _col_stats_span(x, nb, part, t0, t1):  # type: ignore[no-untyped-def]
    n_ = x.shape[0]
    s_ = x.shape[2]
    nbk = (n_ + nb - 1) // nb
    for t in range(t0, t1):
        c = t // nbk
        j = t - c * nbk
        n0 = j * nb
        n1 = min(n0 + nb, n_)
        cnt = np.float64((n1 - n0) * s_)
        tot = 0.0
        for i in range(n0, n1):
            tot += _row_sum(x[i, c])
        m = tot / cnt
        s1 = 0.0
        s2 = 0.0
        for i in range(n0, n1):
            a, q = _row_dev(x[i, c], m)
            s1 += a
            s2 += q
        part[c, j, 0] = m
        part[c, j, 1] = s1 / cnt
        part[c, j, 2] = max(s2 - s1 * (s1 / cnt), 0.0)


@jit(_FM_EXACT)
def col_stats(x, nb, part, lo, hi):  # type: ignore[no-untyped-def]
    """Block statistics of ``x`` ``(N, C, S)`` into ``part`` ``(C, nbk, 3)`` float64 (``m``, ``s1 / n_b``,
    ``M2``) for tasks ``lo <= t < hi`` (see the module doc)."""
    _col_stats_span(*borrow((x, nb, part)), lo, hi)


@jit(_FM_EXACT)
def _col_merge_span(part, nb, n_, s_, kout, cout, vout, t0, t1):  # type: ignore[no-untyped-def]
    nbk = part.shape[1]
    total = np.float64(n_ * s_)
    for c in range(t0, t1):
        cnt_a = np.float64(min(nb, n_) * s_)
        mean = part[c, 0, 0] + part[c, 0, 1]
        m2 = part[c, 0, 2]
        for j in range(1, nbk):
            cnt_b = np.float64((min((j + 1) * nb, n_) - j * nb) * s_)
            tot = cnt_a + cnt_b
            delta = (part[c, j, 0] + part[c, j, 1]) - mean
            mean = mean + delta * (cnt_b / tot)
            m2 = m2 + part[c, j, 2] + delta * delta * (cnt_a * (cnt_b / tot))
            cnt_a = tot
        corr = 0.0
        for j in range(nbk):
            cnt_b = np.float64((min((j + 1) * nb, n_) - j * nb) * s_)
            corr += cnt_b * ((part[c, j, 0] - mean) + part[c, j, 1])
        kout[c] = mean
        cout[c] = corr / total
        vout[c] = m2 / total


@jit(_FM_EXACT)
def col_merge(part, nb, n, s, kout, cout, vout, lo, hi):  # type: ignore[no-untyped-def]
    """Channels ``lo <= c < hi``: the blocks of ``part`` merged (see the module doc) into the mean ``K`` (``kout``)
    and its correction (``cout``), and the biased variance (``vout``), float64 ``(C,)`` arrays."""
    _col_merge_span(*borrow((part, nb, n, s, kout, cout, vout)), lo, hi)


@jit(_FM_EXACT)
def _row_bwd(xr, dyr, k, cc):  # type: ignore[no-untyped-def]
    """``(sum dy, sum dy xc, sum xc)`` of a row in float64, ``xc = (x - k) - cc``; four accumulators each."""
    n = xr.shape[0]
    n4 = n - n % 4
    g0 = g1 = g2 = g3 = 0.0
    p0 = p1 = p2 = p3 = 0.0
    e0 = e1 = e2 = e3 = 0.0
    for j in range(0, n4, 4):
        x0 = (np.float64(ld(xr[j])) - k) - cc
        x1 = (np.float64(ld(xr[j + 1])) - k) - cc
        x2 = (np.float64(ld(xr[j + 2])) - k) - cc
        x3 = (np.float64(ld(xr[j + 3])) - k) - cc
        y0 = np.float64(ld(dyr[j]))
        y1 = np.float64(ld(dyr[j + 1]))
        y2 = np.float64(ld(dyr[j + 2]))
        y3 = np.float64(ld(dyr[j + 3]))
        g0 += y0
        g1 += y1
        g2 += y2
        g3 += y3
        p0 += y0 * x0
        p1 += y1 * x1
        p2 += y2 * x2
        p3 += y3 * x3
        e0 += x0
        e1 += x1
        e2 += x2
        e3 += x3
    for j in range(n4, n):
        xv = (np.float64(ld(xr[j])) - k) - cc
        yv = np.float64(ld(dyr[j]))
        g0 += yv
        p0 += yv * xv
        e0 += xv
    return (g0 + g1) + (g2 + g3), (p0 + p1) + (p2 + p3), (e0 + e1) + (e2 + e3)


@jit(_FM_EXACT)
def _col_bwd_sums_span(x, dy, k, cc, nb, part, t0, t1):  # type: ignore[no-untyped-def]
    n_ = x.shape[0]
    nbk = (n_ + nb - 1) // nb
    for t in range(t0, t1):
        c = t // nbk
        j = t - c * nbk
        kc = k[c]
        ccc = cc[c]
        g = 0.0
        p = 0.0
        e = 0.0
        for i in range(j * nb, min(j * nb + nb, n_)):
            a, b, d = _row_bwd(x[i, c], dy[i, c], kc, ccc)
            g += a
            p += b
            e += d
        part[c, j, 0] = g
        part[c, j, 1] = p
        part[c, j, 2] = e


@jit(_FM_EXACT)
def col_bwd_sums(x, dy, k, cc, nb, part, lo, hi):  # type: ignore[no-untyped-def]
    """Block sums ``(sum dy, sum dy xc, sum xc)`` into ``part`` ``(C, nbk, 3)`` float64 for tasks ``lo <= t < hi``
    (``k``, ``cc``: float64 ``(C,)``; see the module doc)."""
    _col_bwd_sums_span(*borrow((x, dy, k, cc, nb, part)), lo, hi)


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


@jit(_FM_EXACT)
def _col_apply_span(x, k, cc, sw, b, y, t0, t1):  # type: ignore[no-untyped-def]
    c_ = x.shape[1]
    s_ = x.shape[2]
    for t in range(t0, t1):
        i = t // c_
        c = t - i * c_
        xr = x[i, c]
        yr = y[i, c]
        kc = k[c]
        ccc = cc[c]
        swc = sw[c]
        if b is not None:
            bc = b[c]
            for j in range(s_):
                st(yr, j, ((ld(xr[j]) - kc) - ccc) * swc + bc)
        else:
            for j in range(s_):
                st(yr, j, ((ld(xr[j]) - kc) - ccc) * swc)


@jit(_FM_EXACT)
def col_apply(x, k, cc, sw, b, y, lo, hi):  # type: ignore[no-untyped-def]
    """``y = ((x - k_c) - cc_c) sw_c [+ b_c]`` for rows ``lo <= t < hi`` of ``(N, C, S)`` (coefficients ``(C,)``
    in the math type; ``b`` may be None)."""
    _col_apply_span(*borrow((x, k, cc, sw, b, y)), lo, hi)


@jit(_FM_EXACT)
def _col_dx_span(x, dy, k, cc, a, m1, q, dx, t0, t1):  # type: ignore[no-untyped-def]
    c_ = x.shape[1]
    s_ = x.shape[2]
    for t in range(t0, t1):
        i = t // c_
        c = t - i * c_
        xr = x[i, c]
        dyr = dy[i, c]
        dxr = dx[i, c]
        kc = k[c]
        ccc = cc[c]
        ac = a[c]
        mc = m1[c]
        qc = q[c]
        for j in range(s_):
            xc = (ld(xr[j]) - kc) - ccc
            st(dxr, j, ac * ((ld(dyr[j]) - mc) - xc * qc))


@jit(_FM_EXACT)
def col_dx(x, dy, k, cc, a, m1, q, dx, lo, hi):  # type: ignore[no-untyped-def]
    """Training backward: ``dx = a_c ((dy - m1_c) - ((x - k_c) - cc_c) q_c)`` for rows ``lo <= t < hi``."""
    _col_dx_span(*borrow((x, dy, k, cc, a, m1, q, dx)), lo, hi)


@jit(_FM_EXACT)
def _col_scale_span(dy, a, dx, t0, t1):  # type: ignore[no-untyped-def]
    c_ = dy.shape[1]
    s_ = dy.shape[2]
    for t in range(t0, t1):
        i = t // c_
        c = t - i * c_
        dyr = dy[i, c]
        dxr = dx[i, c]
        ac = a[c]
        for j in range(s_):
            st(dxr, j, ld(dyr[j]) * ac)


@jit(_FM_EXACT)
def col_scale(dy, a, dx, lo, hi):  # type: ignore[no-untyped-def]
    """Evaluation backward: ``dx = dy a_c`` for rows ``lo <= t < hi``."""
    _col_scale_span(*borrow((dy, a, dx)), lo, hi)
