r"""A new *statistic* in one file, added at run time: ``mad_norm``, the row scaled by its mean absolute deviation.

.. math::

    y = w\,\frac{x - \mu}{s} + b, \qquad \mu = \frac1H \sum_j x_j, \qquad s = \frac1H \sum_j |x_j - \mu| + \epsilon

Gradient, with :math:`d = x - \mu`, :math:`r = 1/s`, :math:`\hat x = d r`, :math:`g = w\,dy`,
:math:`\sigma_j = \operatorname{sign}(d_j)` (0 at :math:`d_j = 0`, the subgradient every implementation takes):
since :math:`\partial s / \partial x_j = (\sigma_j - \bar\sigma)/H`,

.. math::

    dx_j = r\Big((g_j - \bar g) - \frac{\sum_i g_i \hat x_i}{H}\,(\sigma_j - \bar\sigma)\Big),
    \qquad dw = \sum_{rows} dy\,\hat x, \qquad db = \sum_{rows} dy.

Its backward needs a row sum no built-in statistic has, :math:`\sum_j \sigma_j`: the statistic's record names its
numba pieces (:data:`MAD_PIECES`), among them that third sum's term (``third_term``: ``sign(d)``) and how the row's
coefficients combine the sums (``bwd_finish``: ``gbar' = gbar - coef * mean(sign)``, ``coef = sum(g xhat) / H``, so
that ``dx = r ((g - gbar') - coef * sign(d))``, the element ``dx_elem`` computes) -- the kernels of the statistics
family run it unchanged, on every launch path (plain, split, streamed, slow, both backward paths). The CUDA kernels'
statistics are C++ policies (``kernels/stats.cu``); this record names none (``cuda=""``), so the ``cupy`` backend
does not offer the op and says so (``pynorm.list_ops()``).

``docs/adding_an_op.md`` walks through it; ``tests/test_mad_norm.py`` runs pynorm's generic suites on it (numpy and
numba, every launch path forced). Run it: ``python docs/examples/mad_norm.py``.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from pynorm.ops import OpSpec, Option, Param, StatsVariant, check_eps, families
from pynorm.ops._spec import check_offset
from pynorm.ops.families import Statistic
from pynorm.reference._common import _ieee, finite_rows, round_to, working_dtype, write_result

#: the statistic's name: numba's disk cache stamps pynorm's own sources only, so kernels compiled from an older
#: version of the pieces below must not be found under the same statistic type
NAME = "mad_" + hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]
#: its record (``pynorm.ops.families.Statistic``): centred on the mean (``ctx.mean``), one r rule of its own (code
#: 7: ``r = 1 / (s + eps)``, which its ``rfactor`` piece implements), numba pieces, no CUDA policy
RECORD = Statistic(
    NAME, "s = mean|x - mean| + eps, the row centred by (x - k) - c", rules={None: 7}, mean=True,
    numba=f"{__name__}:MAD_PIECES",
)  # fmt: skip
families.STATISTICS.setdefault(NAME, RECORD)  # (the spec below is checked against its statistic's record)


# ---------------------------------------------------------------------------
# the numba pieces (built on first use: numba is optional)


def _numba_pieces() -> dict[Any, Any]:
    import numba

    from pynorm.backends.numba import _rowstats as rs
    from pynorm.backends.numba._cache import FM_SUM
    from pynorm.backends.numba._layout import CHUNK
    from pynorm.backends.numba._storage import ld, tcast, wat

    fm = {"fastmath": FM_SUM, "error_model": "numpy"}

    @numba.njit(**fm)
    def abs_dev(xr, k, c):  # type: ignore[no-untyped-def]
        # mean |(x - k) - c| over chunks in the math type, added in float64 in chunk order: a function of the row
        # alone, so every launch path (the split kernels' finish included) gets the same bits
        s = 0.0
        zero = tcast(xr, 0.0)
        ct = tcast(xr, c)
        for c0 in range(0, xr.shape[0], CHUNK):
            xc = xr[c0 : min(c0 + CHUNK, xr.shape[0])]
            a = zero
            for j in range(xc.shape[0]):
                a += abs(rs._centre(ld(xc[j]), k, ct))
            s += np.float64(a)
        return s / xr.shape[0]

    @numba.njit(**fm)
    def finish(xr, k, s1, s2, corr):  # type: ignore[no-untyped-def]
        ok, k, c, v = rs._c_fwd_finish(xr, k, s1, s2, corr)
        if ok:
            v = abs_dev(xr, k, c)
            ok = math.isfinite(v)
        return ok, k, c, v

    @numba.njit(**fm)
    def stats(xr, corr):  # type: ignore[no-untyped-def]
        k = rs._row_shift(xr)
        s1, s2 = rs._shifted_sums(xr, k)
        return finish(xr, k, s1, s2, corr)

    @numba.njit(error_model="numpy")
    def scaled(xr, e, corr):  # type: ignore[no-untyped-def]
        # float64 of x * 2**-e, compensated: the mean (m1 + c), then mean |x * 2**-e - m1 - c|
        m1, c, _ = rs._centered_scaled_stats(xr, e, corr)
        sc = math.ldexp(1.0, -e)
        s, t = 0.0, 0.0
        for j in range(xr.shape[0]):
            s, t = rs._cadd(s, t, abs((np.float64(ld(xr[j])) * sc - m1) - c))
        return m1, c, (s + t) / xr.shape[0]

    @numba.njit(error_model="numpy")
    def scaled_r(v_s, e, eps):  # type: ignore[no-untyped-def]
        # r = 1 / (v_s 2**e + eps), r_s = r 2**e = 1 / (v_s + eps 2**-e)
        e_s = math.ldexp(eps, -e)
        if math.isfinite(e_s):
            r_s = 1.0 / (v_s + e_s)
            return math.ldexp(r_s, -e), r_s
        r = 1.0 / eps
        return r, math.ldexp(r, e)

    @numba.njit(**fm)
    def sign(d):  # type: ignore[no-untyped-def]
        # sign(d) (0 at 0) without a branch, in d's type: the loops that sum it vectorize alike on every path
        return (d > 0) * (d * 0 + 1) - (d < 0) * (d * 0 + 1)

    def bwd_finish(stat, xr, k, c, sg, sgx, ssign, r, corr, mode, aux):  # type: ignore[no-untyped-def]
        h = xr.shape[0]
        coef = sgx / h
        ok = math.isfinite(sg) and math.isfinite(sgx) and math.isfinite(ssign)
        return ok, tcast(xr, sg / h - coef * (ssign / h)), tcast(xr, coef)

    def dx_elem(stat, xr, dyr, w, k, c, r, gbar, coef, j):  # type: ignore[no-untyped-def]
        d = rs._centre(ld(xr[j]), k, c)
        dy = ld(dyr[j])
        g = rs._prod(dy, wat(w, j)) if w is not None else dy
        return r * ((g - gbar) - sign(d) * coef)

    def slow_finish(stat, sg, sgx, ssign, h, n, r_s, mode, aux):  # type: ignore[no-untyped-def]
        coef = sgx / h
        return sg / h - coef * (ssign / h), coef

    return {
        **rs.CENTERED,
        rs.rfactor: lambda stat, v, eps, mode: 1.0 / (v + eps),
        rs.scaled_rstd: lambda stat, v_s, e, eps, mode: scaled_r(v_s, e, eps),
        rs.fwd_stats: lambda stat, xr, corr: stats(xr, corr),
        rs.fwd_finish: lambda stat, xr, k, s1, s2, corr: finish(xr, k, s1, s2, corr),
        rs.scaled_stats: lambda stat, xr, e, corr: scaled(xr, e, corr),
        rs.third_sum: lambda stat, mode: True,
        rs.third_term: lambda stat, d, xhat: sign(d),
        rs.bwd_finish: bwd_finish,
        rs.dx_elem: dx_elem,
        rs.slow_finish: slow_finish,
        rs.slow_dx: lambda stat, g, gbar, d, xhat, coef, r: r * ((g - gbar) - np.sign(d) * coef),
    }


def __getattr__(name: str) -> Any:
    if name == "MAD_PIECES":  # built when the numba kernels first compile for the statistic
        pieces = _numba_pieces()
        globals()["MAD_PIECES"] = pieces
        return pieces
    raise AttributeError(name)


# ---------------------------------------------------------------------------
# the spec


@dataclass(frozen=True, eq=False)
class MADNormCtx:
    """What the backward needs: the fields the statistic fills (``mean``, ``rstd = 1 / s``) and the options."""

    x: Any
    weight: Any
    bias: Any
    mean: Any
    rstd: Any
    eps: float
    weight_offset: float


class MADNormGrads(NamedTuple):
    dx: Any
    dweight: Any
    dbias: Any


def term_scales(x2: np.ndarray, arrays: Mapping[str, Any], dy2: np.ndarray, options: Mapping[str, Any]) -> dict:
    """The magnitudes of the terms, as LayerNorm's (``pynorm.ops.layer_norm.term_scales``): with ``s`` the mean
    absolute deviation, ``(|x̂| + s r) |w| + |b|`` for ``y`` (the deviations at the row's own unit: a centred
    value carries an ulp of the row's spread); ``r (|G| + mean|G| + (s r + 1) mean|G x̂|)`` with ``G = |dy w|`` for
    ``dx``; ``sum_rows |dy| (|x̂| + s r)`` and ``sum_rows |dy|`` for the parameters."""
    x, dy = x2.astype(np.longdouble), dy2.astype(np.longdouble)
    w, b = arrays.get("weight"), arrays.get("bias")
    o = options.get("weight_offset", 0.0)
    w = np.ones(x.shape[1], np.longdouble) if w is None else np.asarray(w, np.longdouble).reshape(-1) + o
    d = x - x.mean(axis=1, keepdims=True)
    s = np.abs(d).mean(axis=1, keepdims=True)
    r = 1 / (s + options.get("eps", 1e-5))
    xhat = np.abs(d * r)
    g = np.abs(dy * w)
    bias = 0 if b is None else np.abs(np.asarray(b, np.longdouble).reshape(-1))
    out = {
        "y": (xhat + s * r) * np.abs(w) + bias,
        "dx": r * (g + g.mean(axis=1, keepdims=True) + (s * r + 1) * (g * xhat).mean(axis=1, keepdims=True)),
        "dweight": (np.abs(dy) * (xhat + s * r)).sum(axis=0),
        "dbias": np.abs(dy).sum(axis=0),
    }
    return {k: np.asarray(v, dtype=np.float64) for k, v in out.items()}


SPEC = OpSpec(
    name="mad_norm",
    params=(Param("weight", "feature", 1.0, "per-feature scale"), Param("bias", "feature", 0.0, "per-feature shift")),
    options=(
        Option("eps", 1e-5, check_eps, "added to the mean absolute deviation (>= 0)"),
        Option("weight_offset", 0.0, check_offset, "the scale is weight + weight_offset"),
    ),
    grads=MADNormGrads,
    ctx=MADNormCtx,
    reference=__name__,
    family="stats",
    variant=StatsVariant(NAME),
    term_scales=term_scales,
    cases=({}, {"eps": 0.5, "weight_offset": 1.0}),
    summary="y = w (x - mean) / (mean|x - mean| + eps) + b",
)


# ---------------------------------------------------------------------------
# the reference: the definition, on (R, H) rows, in the working precision (float64; extended for float64 input)


@_ieee
def forward(
    x: np.ndarray, weight: np.ndarray | None, bias: np.ndarray | None, *, eps: float, weight_offset: float = 0.0,
    out: np.ndarray | None = None,
) -> tuple[np.ndarray, MADNormCtx]:  # fmt: skip
    wp = working_dtype(x.dtype, getattr(weight, "dtype", None), getattr(bias, "dtype", None))
    xw = x.astype(wp)
    mean = xw.mean(axis=1)
    d = xw - mean[:, None]
    s = np.abs(d).mean(axis=1)
    rstd = finite_rows(1 / (s + wp.type(eps)), s)
    y = d * rstd[:, None]
    if weight is not None:
        y = y * (weight.astype(wp) + wp.type(weight_offset))
    if bias is not None:
        y = y + bias.astype(wp)
    ctx = MADNormCtx(x, weight, bias, mean, rstd, float(eps), float(weight_offset))
    return write_result(y, x.dtype, out), ctx


@_ieee
def backward(dy: np.ndarray, ctx: MADNormCtx, *, dx_out: np.ndarray | None = None) -> MADNormGrads:
    x, weight, bias = ctx.x, ctx.weight, ctx.bias
    wp = np.result_type(ctx.rstd.dtype, working_dtype(x.dtype, getattr(weight, "dtype", None)))
    r = ctx.rstd.astype(wp)[:, None]
    d = x.astype(wp) - ctx.mean.astype(wp)[:, None]
    xhat = d * r
    dyw = dy.astype(wp)
    g = dyw * (weight.astype(wp) + wp.type(ctx.weight_offset)) if weight is not None else dyw
    h = x.shape[1]
    sgn = np.sign(d)
    coef = np.sum(g * xhat, axis=1, keepdims=True) / h
    dx = r * ((g - g.mean(axis=1, keepdims=True)) - coef * (sgn - sgn.mean(axis=1, keepdims=True)))
    dweight = round_to(np.sum(dyw * xhat, axis=0), weight.dtype) if weight is not None else None
    dbias = round_to(np.sum(dyw, axis=0), bias.dtype) if bias is not None else None
    return MADNormGrads(write_result(dx, x.dtype, dx_out), dweight, dbias)


def add() -> None:
    """Register the statistic's record (done on import too) and add the op (``pynorm.add_op``)."""
    import pynorm

    families.STATISTICS[NAME] = RECORD
    pynorm.add_op(SPEC)


def remove() -> None:
    """Undo :func:`add`."""
    import pynorm

    pynorm.remove_op("mad_norm")
    families.STATISTICS.pop(NAME, None)


if __name__ == "__main__":
    import pynorm

    add()
    x = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32) * 3 + 1
    serving = [b.name for b in pynorm.list_backends() if b.available and "mad_norm" in b.ops]
    for backend in serving:
        y, ctx = pynorm.mad_norm_forward(x, backend=backend)  # type: ignore[attr-defined]
        g = pynorm.mad_norm_backward(np.ones_like(y), ctx)  # type: ignore[attr-defined]
        print(backend, "mean |y| per row:", np.abs(y).mean(axis=1).round(5), "max |dx|:", float(np.abs(g.dx).max()))
