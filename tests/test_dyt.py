"""DyT's own properties, on every backend."""

from __future__ import annotations

import numpy as np
import pytest

import pynorm
from pynorm.errors import ArgumentError, ShapeError
from pynorm.testing import check_grads


@pytest.fixture
def dy_(backend):
    if "dyt" not in backend.ops:
        pytest.skip(f"backend {backend.name!r} does not implement 'dyt'")
    return backend


def test_sech2_keeps_relative_accuracy_where_tanh_saturates():
    import mpmath

    from pynorm.reference.dyt import sech2

    mpmath.mp.dps = 40
    z = np.array([0.0, 1e-8, 0.3, 5.0, 20.0, 50.0, 200.0, 350.0, -30.0])
    exact = np.array([float(mpmath.sech(mpmath.mpf(float(v))) ** 2) for v in z])
    np.testing.assert_allclose(sech2(z), exact, rtol=4e-16)
    assert (1 - np.tanh(z[4:6]) ** 2 == 0).all()  # the form it replaces: every digit lost


@pytest.mark.parametrize("alpha", [1e-8, 1e-3, 0.5, 7.0, 1e4])
def test_saturated_gradients_are_accurate(dy_, alpha):
    """|alpha x| from 1e-8 to 1e4: dx and dalpha match an exact computation (mpmath) in float64."""
    import mpmath

    mpmath.mp.dps = 40
    x = np.array([[-3.0, -0.5, 0.0, 0.25, 1.0, 2.0, 30.0]])
    a = np.array([alpha])
    y, ctx = pynorm.dyt_forward(dy_.asarray(x), dy_.asarray(a), backend=dy_.name)
    g = pynorm.dyt_backward(dy_.asarray(np.ones_like(x)), ctx)
    am = mpmath.mpf(alpha)
    s2 = [mpmath.sech(am * mpmath.mpf(float(v))) ** 2 for v in x[0]]
    np.testing.assert_allclose(dy_.to_numpy(g.dx)[0], [float(am * s) for s in s2], rtol=1e-13, atol=0)
    np.testing.assert_allclose(
        dy_.to_numpy(g.dalpha)[0], float(sum(mpmath.mpf(float(v)) * s for v, s in zip(x[0], s2))), rtol=1e-13
    )
    np.testing.assert_allclose(dy_.to_numpy(y)[0], [float(mpmath.tanh(am * mpmath.mpf(float(v)))) for v in x[0]])


def test_gradients_with_affine(dy_):
    rng = np.random.default_rng(0)
    rep = check_grads(
        dy_.forward(pynorm.dyt_forward), dy_.backward(pynorm.dyt_backward),
        [rng.standard_normal((3, 5)), np.array(0.8), rng.standard_normal(5), rng.standard_normal(5)],
    )  # fmt: skip
    assert rep.passed, str(rep)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_alpha_must_be_finite(dy_, bad):
    with pytest.raises(ArgumentError, match="alpha must be finite"):
        pynorm.dyt(dy_.asarray(np.ones((2, 3))), dy_.asarray(np.array([bad])), backend=dy_.name)


def test_alpha_is_required_and_scalar(dy_):
    x = dy_.asarray(np.ones((2, 3)))
    with pytest.raises(ArgumentError, match="alpha is required"):
        pynorm.dyt(x, None, backend=dy_.name)
    with pytest.raises(ShapeError, match="alpha must be a scalar"):
        pynorm.dyt(x, dy_.asarray(np.ones(3)), backend=dy_.name)


def test_layer():
    layer = pynorm.layers.DyT(8)
    assert layer.params["alpha"][0] == 0.5
    y, ctx = layer.forward(np.ones((2, 8), np.float32))
    layer.backward(np.ones_like(y), ctx)
    assert sorted(layer.grads) == ["alpha", "bias", "weight"] and layer.grads["alpha"].shape == (1,)


#: stated bound of each backend's float32 tanh, in ulps of y (docs/numba.md, docs/cupy.md; the reference: float64
#: rounded once)
TANH_F32_ULPS = {"numpy": 1.0, "numba": 2.0, "cupy": 3.0}


def test_float32_tanh_within_the_stated_ulps(dy_):
    """y = tanh(alpha x) of float32 inputs (every exponent that matters, random mantissas) against mpmath."""
    import mpmath

    from .helpers import mpmath_ulps

    mpmath.mp.dps = 40
    rng = np.random.default_rng(5)
    e = rng.integers(-40, 6, 4000)
    x = (rng.uniform(1, 2, e.size) * 2.0**e * rng.choice([-1, 1], e.size)).astype(np.float32)
    x = np.concatenate([x, np.float32([0.0, -0.0, 0.625, 9.02, 1e-40])]).reshape(1, -1)
    alpha = np.array([1.0], np.float32)
    y = dy_.to_numpy(pynorm.dyt(dy_.asarray(x), dy_.asarray(alpha), backend=dy_.name))
    err = mpmath_ulps(y[0], [mpmath.tanh(mpmath.mpf(float(v))) for v in x[0]])
    assert err.max() <= TANH_F32_ULPS.get(dy_.name, 2.0), (err.max(), x[0, err.argmax()])
