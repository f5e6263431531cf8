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
from pynorm.reference import exact  # noqa: E402
from pynorm.testing import finfo, max_ulp_error  # noqa: E402

from .helpers import DTYPES, dtype, make_rows, term_scales  # noqa: E402

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
    ey, edx, edw, edb = exact.layer_norm(
        x, w, b, dy, full["eps"], full["correction"], full["eps_mode"], full["weight_offset"]
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
    ey, edx, edw = exact.rms_norm(x, w, dy, full["eps"], full["weight_offset"])
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
    ey, *_ = exact.layer_norm(x, w, b, np.zeros_like(x), 1e-5)
    assert np.mean(y == ey.astype(np.float32)) >= 0.99
