"""ScaleNorm's own properties, on every backend (the shared suite covers gradients and hard inputs)."""

from __future__ import annotations

import numpy as np
import pytest

import pynorm
from pynorm.errors import ArgumentError, ShapeError
from pynorm.testing import check_grads

from .helpers import OPS


@pytest.fixture
def sn(backend):
    if "scale_norm" not in backend.ops:
        pytest.skip(f"backend {backend.name!r} does not implement 'scale_norm'")
    return backend


def test_output_norm_is_g_above_the_floor(sn):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 5, 7))
    g = np.array([2.5])
    y = sn.to_numpy(pynorm.scale_norm(sn.asarray(x), sn.asarray(g), axis=1, backend=sn.name))
    np.testing.assert_allclose(np.sqrt((y.reshape(6, -1) ** 2).sum(1)), 2.5, rtol=1e-13)


def test_floor_branch_is_linear(sn):
    x = np.array([[1e-3, -2e-3, 5e-4]])  # norm < eps = 1: y = g x / eps
    y, ctx = pynorm.scale_norm_forward(sn.asarray(x), sn.asarray(np.array(3.0)), eps=1.0, backend=sn.name)
    np.testing.assert_allclose(sn.to_numpy(y), 3.0 * x, rtol=1e-15)
    g = pynorm.scale_norm_backward(sn.asarray(np.ones_like(x)), ctx)
    np.testing.assert_allclose(sn.to_numpy(g.dx), np.full_like(x, 3.0), rtol=1e-15)  # d(g x / eps)/dx = g / eps
    np.testing.assert_allclose(sn.to_numpy(g.dg), [x.sum()], rtol=1e-13)


@pytest.mark.parametrize("scale", [0.999, 1.001])  # rows just below and just above the floor eps = 1
def test_gradient_on_both_sides_of_the_switch(sn, scale):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 6))
    x = x / np.sqrt((x * x).sum(1, keepdims=True)) * scale
    spec = OPS["scale_norm"]
    rep = check_grads(
        sn.forward(pynorm.scale_norm_forward, eps=1.0), sn.backward(pynorm.scale_norm_backward),
        [x, np.array([1.3])], step=1e-5, full_jacobian=True,
    )  # fmt: skip
    assert rep.passed, str(rep)
    _, ctx = pynorm.scale_norm_forward(sn.asarray(x), sn.asarray(np.array([1.3])), eps=1.0, backend=sn.name)
    floor = np.asarray(sn.to_numpy(ctx.inner.floor)).astype(bool)
    assert floor.all() == (scale < 1) and floor.any() == (scale < 1), spec


def test_at_the_switch_the_norm_branch_is_used(sn):
    x = np.array([[0.6, 0.8]])  # norm exactly 1 = eps
    _, ctx = pynorm.scale_norm_forward(sn.asarray(x), eps=1.0, backend=sn.name)
    assert not np.asarray(sn.to_numpy(ctx.inner.floor)).any()
    dx = sn.to_numpy(pynorm.scale_norm_backward(sn.asarray(np.array([[1.0, 0.0]])), ctx).dx)
    np.testing.assert_allclose(dx, [[1 - 0.36, -0.48]], rtol=1e-14)  # r (dy - xhat (xhat . dy))


def test_root_mode(sn):
    x = np.array([[3.0, 4.0]])
    y = sn.to_numpy(pynorm.scale_norm(sn.asarray(x), eps=11.0, eps_mode="root", backend=sn.name))
    np.testing.assert_allclose(y, x / 6.0, rtol=1e-15)


@pytest.mark.parametrize("dt", [np.float32, np.float64])
def test_no_overflow_near_the_dtype_max(sn, dt):
    big = np.finfo(dt).max
    x = np.array([[big, -big, big / 2]], dt)
    y = sn.to_numpy(pynorm.scale_norm(sn.asarray(x), backend=sn.name))
    n = np.sqrt(1 + 1 + 0.25)
    np.testing.assert_allclose(y.astype(np.float64), [[1 / n, -1 / n, 0.5 / n]], rtol=1e-6)


def test_g_must_be_a_scalar(sn):
    x = sn.asarray(np.ones((2, 3)))
    with pytest.raises(ShapeError, match="g must be a scalar"):
        pynorm.scale_norm(x, sn.asarray(np.ones(3)), backend=sn.name)
    with pytest.raises(ArgumentError, match="eps_mode"):
        pynorm.scale_norm(x, eps_mode="std", backend=sn.name)


def test_layer_starts_at_sqrt_d():
    layer = pynorm.layers.ScaleNorm(16)
    np.testing.assert_allclose(layer.params["g"], [4.0])
    assert pynorm.layers.ScaleNorm(16, g_init=1.0).params["g"][0] == 1.0
    y, ctx = layer.forward(np.random.default_rng(0).standard_normal((3, 16)).astype(np.float32))
    dx = layer.backward(np.ones_like(y), ctx)
    assert dx.shape == (3, 16) and layer.grads["g"].shape == (1,)
