"""The signed-power "PowerNorm" of normalization tutorials: its own properties, on every backend."""

from __future__ import annotations

import math

import numpy as np
import pytest

import pynorm
from pynorm.errors import ArgumentError

from .helpers import DTYPES
from .helpers import dtype as dtype_of


@pytest.fixture
def pn(backend):
    if "power_norm" not in backend.ops:
        pytest.skip(f"backend {backend.name!r} does not implement 'power_norm'")
    return backend


def _special(dt):
    from pynorm.testing import finfo

    fi = finfo(dt)
    v = [0.0, -0.0, float(fi.smallest_subnormal), -float(fi.smallest_subnormal), float(fi.smallest_normal),
         1.0, -1.0, 0.5, float(fi.max), -float(fi.max)]  # fmt: skip
    return np.array([v], dtype=dt)


@pytest.mark.parametrize("p", [0.01, 0.25, 0.5, 1.0])
@pytest.mark.parametrize("dt", DTYPES)
def test_no_finite_input_gives_nan_or_inf(pn, dt, p):
    """Zeros, negative zeros, subnormals, the dtype's max: y and every gradient finite (p <= 1, |w| <= 1,
    so that the exact y itself is within range: |x|^p <= max(|x|, 1))."""
    x = _special(dtype_of(dt))
    h = x.shape[1]
    w = np.full(h, 0.75, dtype_of(dt))
    b = np.full(h, 0.25, dtype_of(dt))
    y, ctx = pynorm.power_norm_forward(pn.asarray(x), pn.asarray(w), pn.asarray(b), p=p, backend=pn.name)
    g = pynorm.power_norm_backward(pn.asarray(np.ones_like(x)), ctx)
    for name, a in (("y", y), ("dx", g.dx), ("dweight", g.dweight), ("dbias", g.dbias)):
        v = pn.to_numpy(a).astype(np.float64)
        assert np.isfinite(v).all(), (name, v)


def test_gradient_at_zero(pn):
    x = np.array([[0.0, -0.0, 4.0]])
    dy = np.ones_like(x)
    for p, at_zero in ((0.5, 0.0), (1.0, 1.0), (2.0, 0.0)):
        _, ctx = pynorm.power_norm_forward(pn.asarray(x), p=p, backend=pn.name)
        dx = pn.to_numpy(pynorm.power_norm_backward(pn.asarray(dy), ctx).dx)
        np.testing.assert_allclose(dx[0, :2], at_zero)
        np.testing.assert_allclose(dx[0, 2], p * 4.0 ** (p - 1), rtol=1e-14)


def test_signed_power_values(pn):
    x = np.array([[-4.0, 9.0, 0.0]])
    np.testing.assert_array_equal(pn.to_numpy(pynorm.power_norm(pn.asarray(x), backend=pn.name)), [[-2.0, 3.0, 0.0]])


def test_saturation_instead_of_overflow(pn):
    x = np.array([[np.float16(2.0**-24)]], np.float16)  # p |x|^(p-1) * 100 is beyond float16's max
    _, ctx = pynorm.power_norm_forward(pn.asarray(x), pn.asarray(np.array([100.0], np.float16)), p=0.1, backend=pn.name)
    dx = pn.to_numpy(pynorm.power_norm_backward(pn.asarray(np.ones_like(x)), ctx).dx)
    assert dx[0, 0] == np.finfo(np.float16).max


@pytest.mark.parametrize("p", [0.0, -1.0, float("nan"), float("inf"), "0.5", True])
def test_bad_p(pn, p):
    with pytest.raises(ArgumentError, match="p must be"):
        pynorm.power_norm(pn.asarray(np.ones((2, 2))), p=p, backend=pn.name)


def test_layer():
    layer = pynorm.layers.PowerNorm(4, p=0.25)
    y, ctx = layer.forward(np.ones((3, 4), np.float32))
    layer.backward(np.ones_like(y), ctx)
    np.testing.assert_allclose(layer.grads["bias"], 3.0)
    with pytest.raises(ArgumentError):
        pynorm.layers.PowerNorm(4, p=0)


@pytest.mark.parametrize("p", [0.5, 0.3, math.pi / 4, 3.0])
def test_float32_power_within_one_ulp(pn, p):
    """y = sign(x) |x|^p of float32 inputs, subnormals included, against mpmath: every backend within 1 ulp
    (numba: float32 sqrt or float64 exp2/log2 rounded once; cupy: double exp2/log2; the reference: float64 pow)."""
    import mpmath

    from .helpers import mpmath_ulps

    mpmath.mp.dps = 40
    rng = np.random.default_rng(6)
    e = rng.integers(-149, 128, 3000)
    x = (rng.uniform(1, 2, e.size) * 2.0 ** e.astype(np.float64) * rng.choice([-1, 1], e.size)).astype(np.float32)
    x = x[np.isfinite(x) & (x != 0)].reshape(1, -1)
    y = pn.to_numpy(pynorm.power_norm(pn.asarray(x), p=p, backend=pn.name))
    pm = mpmath.mpf(p)
    err = mpmath_ulps(y[0], [mpmath.sign(mpmath.mpf(float(v))) * abs(mpmath.mpf(float(v))) ** pm for v in x[0]])
    assert err.max() <= 1.0, (err.max(), x[0, err.argmax()])
