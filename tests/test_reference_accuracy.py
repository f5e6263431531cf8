"""The reference backend against an exact computation (mpmath, 50 digits) on small cases.

The oracle's promise (docs/numerics.md): y within 2 ulps and gradients within 8
ulps of the exact result, each measured at the magnitude of the terms it is
computed from (see :func:`tests.helpers.term_scales`), for every dtype, on
ordinary and hard inputs.
"""

from __future__ import annotations

import numpy as np
import pytest

mpmath = pytest.importorskip("mpmath", reason="mpmath is needed for the exact computations")

import pynorm  # noqa: E402
from pynorm.testing import finfo, max_ulp_error  # noqa: E402

from .helpers import DTYPES, dtype, make_rows, term_scales  # noqa: E402

mp = mpmath.mp


def _exact_layer_norm(x, w, b, dy, eps, correction, eps_mode, offset):
    mp.dps = 50
    rows, h = x.shape
    y = np.empty((rows, h), dtype=object)
    dx = np.empty((rows, h), dtype=object)
    dw = [mp.mpf(0)] * h
    db = [mp.mpf(0)] * h
    for i in range(rows):
        xs = [mp.mpf(float(v)) for v in x[i]]
        gs = [mp.mpf(float(v)) for v in dy[i]]
        m = mp.fsum(xs) / h
        d = [v - m for v in xs]
        n = h - correction
        var = mp.fsum(t * t for t in d) / n
        s = mp.sqrt(var)
        r = 1 / mp.sqrt(var + eps) if eps_mode == "var" else 1 / (s + eps)
        xh = [t * r for t in d]
        we = [mp.mpf(float(v)) + offset for v in w] if w is not None else [mp.mpf(1)] * h
        bb = [mp.mpf(float(v)) for v in b] if b is not None else [mp.mpf(0)] * h
        g = [gs[j] * we[j] for j in range(h)]
        gbar = mp.fsum(g) / h
        gx = mp.fsum(g[j] * xh[j] for j in range(h))
        if eps_mode == "var":
            coef = gx / n
        else:
            coef = gx / (n * s * r) if s > 0 else mp.mpf(0)
        for j in range(h):
            y[i, j] = xh[j] * we[j] + bb[j]
            dx[i, j] = r * (g[j] - gbar - xh[j] * coef)
            dw[j] += gs[j] * xh[j]
            db[j] += gs[j]
    f = np.vectorize(float, otypes=[np.float64])
    return f(y), f(dx), f(np.array(dw, dtype=object)), f(np.array(db, dtype=object))


def _exact_rms_norm(x, w, dy, eps, offset):
    mp.dps = 50
    rows, h = x.shape
    y = np.empty((rows, h), dtype=object)
    dx = np.empty((rows, h), dtype=object)
    dw = [mp.mpf(0)] * h
    for i in range(rows):
        xs = [mp.mpf(float(v)) for v in x[i]]
        gs = [mp.mpf(float(v)) for v in dy[i]]
        r = 1 / mp.sqrt(mp.fsum(t * t for t in xs) / h + eps)
        xh = [t * r for t in xs]
        we = [mp.mpf(float(v)) + offset for v in w] if w is not None else [mp.mpf(1)] * h
        g = [gs[j] * we[j] for j in range(h)]
        c = mp.fsum(g[j] * xh[j] for j in range(h)) / h
        for j in range(h):
            y[i, j] = xh[j] * we[j]
            dx[i, j] = r * (g[j] - xh[j] * c)
            dw[j] += gs[j] * xh[j]
    f = np.vectorize(float, otypes=[np.float64])
    return f(y), f(dx), f(np.array(dw, dtype=object))


KINDS = ("normal", "offset", "huge", "tiny", "constant")
LN_CONVENTIONS = (
    {},
    {"correction": 1},
    {"eps_mode": "std"},
    {"weight_offset": 1.0},
    {"eps": 0.0},
)


def _ulps(actual, exact, dt, scale):
    # an exact value beyond the dtype's range must round to inf of its sign
    big = float(finfo(dtype(dt)).max)
    exact = np.where(np.abs(exact) > big, np.copysign(np.inf, exact), exact)
    return max_ulp_error(actual, exact, dt, scale=np.where(np.isinf(exact), 0.0, scale))


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("conv", LN_CONVENTIONS, ids=str)
def test_layer_norm_reference_vs_mpmath(dt, kind, conv):
    rng = np.random.default_rng(abs(hash((dt, kind, str(conv)))) % 2**32)
    h = 7
    x = make_rows(kind, (3, h), dt, rng)
    w = (1 + 0.5 * rng.standard_normal(h)).astype(dtype(dt))
    b = (0.5 * rng.standard_normal(h)).astype(dtype(dt))
    dy = rng.standard_normal((3, h)).astype(dtype(dt))
    full = {"eps": 1e-5, "correction": 0, "eps_mode": "var", "weight_offset": 0.0, **conv}
    y, ctx = pynorm.layer_norm_forward(x, w, b, backend="numpy", **conv)
    g = pynorm.layer_norm_backward(dy, ctx)
    if full["eps"] == 0.0 and kind == "constant":
        # (x - mean) / sqrt(0) is 0/0 on a constant row: undefined, and reported as NaN
        assert np.all(np.isnan(y.astype(np.float64))) and np.all(np.isnan(g.dx.astype(np.float64)))
        return
    ey, edx, edw, edb = _exact_layer_norm(
        x, w, b, dy, mp.mpf(full["eps"]), full["correction"], full["eps_mode"], full["weight_offset"]
    )
    sc = term_scales("layer_norm", x, {"weight": w, "bias": b}, dy, full)
    assert _ulps(y, ey, dt, sc["y"]) <= 2
    assert _ulps(g.dx, edx, dt, sc["dx"]) <= 8
    assert _ulps(g.dweight, edw, dt, sc["dweight"]) <= 8
    assert _ulps(g.dbias, edb, dt, sc["dbias"]) <= 8


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("conv", ({}, {"weight_offset": 1.0}, {"eps": 0.0}), ids=str)
def test_rms_norm_reference_vs_mpmath(dt, kind, conv):
    rng = np.random.default_rng(abs(hash((dt, kind, str(conv), "rms"))) % 2**32)
    h = 6
    x = make_rows(kind, (3, h), dt, rng)
    w = (1 + 0.5 * rng.standard_normal(h)).astype(dtype(dt))
    dy = rng.standard_normal((3, h)).astype(dtype(dt))
    full = {"eps": 1e-6, "weight_offset": 0.0, **conv}
    y, ctx = pynorm.rms_norm_forward(x, w, backend="numpy", **conv)
    g = pynorm.rms_norm_backward(dy, ctx)
    ey, edx, edw = _exact_rms_norm(x, w, dy, mp.mpf(full["eps"]), full["weight_offset"])
    sc = term_scales("rms_norm", x, {"weight": w}, dy, full)
    assert _ulps(y, ey, dt, sc["y"]) <= 2
    assert _ulps(g.dx, edx, dt, sc["dx"]) <= 8
    assert _ulps(g.dweight, edw, dt, sc["dweight"]) <= 8


def test_results_are_correctly_rounded_most_of_the_time():
    # stronger than the 2-ulp promise: on ordinary float32 data, y is the exact value rounded once
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 16)).astype(np.float32)
    w = rng.standard_normal(16).astype(np.float32)
    b = rng.standard_normal(16).astype(np.float32)
    y = pynorm.layer_norm(x, w, b, backend="numpy")
    ey, *_ = _exact_layer_norm(x, w, b, np.zeros_like(x), mp.mpf(1e-5), 0, "var", 0.0)
    assert np.mean(y == ey.astype(np.float32)) >= 0.99
