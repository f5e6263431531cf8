"""The fused residual add + LayerNorm / RMSNorm: their own properties, on every backend."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

import pynorm
from pynorm.errors import ArgumentError, DTypeError, ShapeError
from pynorm.reference._common import round_to
from pynorm.testing import check_grads

from .helpers import DTYPES
from .helpers import dtype as dtype_of

OPS = ("add_layer_norm", "add_rms_norm")


def fns(op):
    return getattr(pynorm, f"{op}_forward"), getattr(pynorm, f"{op}_backward")


@pytest.mark.parametrize("alpha", [1.0, 2.5, -0.75])
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_h_is_the_sum_rounded_once(backend, op, dt, alpha):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 33)).astype(dtype_of(dt))
    r = (100 * rng.standard_normal((5, 33))).astype(dtype_of(dt))
    if dt == "float64":  # offset rows: x + r needs up to ~66 bits, so a sum in 64-bit longdouble then
        # rounded to float64 rounds twice (wrong in about 1 element of 2000; 4 of these 10000)
        x = 1e4 + rng.standard_normal((5, 2000))
        r = rng.standard_normal((5, 2000))
    (y, h), _ = fns(op)[0](backend.asarray(x), backend.asarray(r), alpha=alpha, backend=backend.name)
    if dt == "float64":  # x + alpha * r exactly (fractions), rounded once
        exact = np.array([float(Fraction(a) + Fraction(alpha) * Fraction(b)) for a, b in zip(x.ravel(), r.ravel())])
        exact = exact.reshape(x.shape)
    else:  # exact in float64 for these short operands, then rounded once
        exact = round_to(x.astype(np.float64) + alpha * r.astype(np.float64), dtype_of(dt))
    np.testing.assert_array_equal(backend.to_numpy(h).view(np.uint8), exact.view(np.uint8))
    y_plain = getattr(pynorm, op.removeprefix("add_"))(exact, backend="numpy")
    np.testing.assert_allclose(backend.to_numpy(y).astype(np.float64), y_plain.astype(np.float64), atol=2e-2, rtol=0)


@pytest.mark.parametrize("op", OPS)
def test_fp32_residual_stream_for_half_inputs(backend, op):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 16)).astype(np.float16)
    r = rng.standard_normal((3, 16)).astype(np.float32)
    (y, h), ctx = fns(op)[0](backend.asarray(x), backend.asarray(r), residual_dtype="float32", backend=backend.name)
    assert y.dtype == np.float16 and h.dtype == np.float32
    np.testing.assert_array_equal(backend.to_numpy(h), (x.astype(np.float64) + r).astype(np.float32))
    g = fns(op)[1](backend.asarray(np.ones_like(x)), ctx, backend.asarray(np.ones((3, 16), np.float32)))
    assert g.dx.dtype == np.float16 and g.dresidual.dtype == np.float32


@pytest.mark.parametrize("op", OPS)
def test_gradients_with_a_gradient_arriving_at_h(backend, op):
    """check_grads on the pair (y, h): dh from later layers joins the norm's gradient at h."""
    rng = np.random.default_rng(2)
    fwd, bwd = fns(op)
    h_ = 6

    def f(x, r, w):
        (y, h), ctx = fwd(backend.asarray(x), backend.asarray(r), backend.asarray(w), alpha=1.7, backend=backend.name)
        return np.concatenate([backend.to_numpy(y), backend.to_numpy(h)], axis=1), ctx

    def b(v, ctx):
        g = bwd(backend.asarray(np.ascontiguousarray(v[:, :h_])), ctx, backend.asarray(np.ascontiguousarray(v[:, h_:])))
        return [
            backend.to_numpy(g.dx),
            backend.to_numpy(g.dresidual),
            backend.to_numpy(g[-2 if op == "add_layer_norm" else -1]),
        ]

    rep = check_grads(f, b, [rng.standard_normal((4, h_)), rng.standard_normal((4, h_)), 1 + rng.standard_normal(h_)])
    assert rep.passed, str(rep)


@pytest.mark.parametrize("op", OPS)
def test_dresidual_is_alpha_times_dx(backend, op):
    rng = np.random.default_rng(3)
    x, r = rng.standard_normal((2, 3, 8)), rng.standard_normal((2, 3, 8))
    _, ctx = fns(op)[0](backend.asarray(x), backend.asarray(r), alpha=-3.0, backend=backend.name)
    g = fns(op)[1](backend.asarray(rng.standard_normal(x.shape)), ctx)
    np.testing.assert_allclose(backend.to_numpy(g.dresidual), -3.0 * backend.to_numpy(g.dx), rtol=1e-15)


@pytest.mark.parametrize("op", OPS)
def test_bad_inputs(backend, op):
    x = backend.asarray(np.ones((2, 4)))
    f = fns(op)[0]
    with pytest.raises(ShapeError, match="residual has shape"):
        f(x, backend.asarray(np.ones((2, 3))), backend=backend.name)
    with pytest.raises(DTypeError, match="residual must have dtype"):
        f(x, backend.asarray(np.ones((2, 4), np.int32)), backend=backend.name)
    with pytest.raises(DTypeError, match="residual_dtype"):
        f(x, x, residual_dtype="int8", backend=backend.name)
    with pytest.raises(ArgumentError, match="alpha"):
        f(x, x, alpha=float("nan"), backend=backend.name)
    _, ctx = f(x, x, backend=backend.name)
    with pytest.raises(ShapeError, match="dh must have"):
        fns(op)[1](x, ctx, backend.asarray(np.ones((2, 4), np.float32)))


def test_layers():
    rng = np.random.default_rng(4)
    for kind in ("layer", "rms"):
        layer = pynorm.layers.AddNorm(8, kind=kind, alpha=2.0)
        x, r = rng.standard_normal((3, 8)).astype(np.float32), rng.standard_normal((3, 8)).astype(np.float32)
        (y, h), ctx = layer.forward(x, r)
        np.testing.assert_array_equal(h, (x.astype(np.float64) + 2.0 * r).astype(np.float32))
        dx, dres = layer.backward(np.ones_like(y), ctx, dh=np.ones_like(h))
        np.testing.assert_allclose(dres, 2.0 * dx, rtol=1e-6)
