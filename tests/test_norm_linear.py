"""Fused LayerNorm / RMSNorm + Linear: their own properties, on every backend that has them."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import pynorm
from pynorm import _registry
from pynorm.composite import norm_linear as composite
from pynorm.errors import ShapeError
from pynorm.testing import check_grads

OPS = ("layer_norm_linear", "rms_norm_linear")
PLAIN = {"layer_norm_linear": "layer_norm", "rms_norm_linear": "rms_norm"}


def _data(rng, op, r=6, h=8, n=5, dt=np.float64):
    x = rng.standard_normal((r, h)).astype(dt)
    w = (1 + 0.5 * rng.standard_normal(h)).astype(dt)
    b = (0.5 * rng.standard_normal(h)).astype(dt)
    W = rng.standard_normal((n, h)).astype(dt)
    c = rng.standard_normal(n).astype(dt)
    params = (w, b) if op == "layer_norm_linear" else (w,)
    return x, params, W, c


def _fwd(backend, op, x, params, W, c, **kw):
    args = [backend.asarray(a) if a is not None else None for a in (x, *params, W, c)]
    return getattr(pynorm, f"{op}_forward")(*args, backend=backend.name, **kw)


@pytest.mark.parametrize("op", OPS)
def test_equals_the_unfused_composition(backend, op):
    rng = np.random.default_rng(0)
    x, params, W, c = _data(rng, op)
    (y, n), ctx = _fwd(backend, op, x, params, W, c, return_norm=True)
    n_ref = getattr(pynorm, PLAIN[op])(x, *params, backend="numpy")
    np.testing.assert_allclose(backend.to_numpy(n), n_ref, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(backend.to_numpy(y), n_ref @ W.T + c, rtol=1e-12, atol=1e-12)
    assert tuple(y.shape) == (6, 5)
    # backward against the unfused chain: dn = dy W, the norm's backward of dn, dW = dy^T n, dc = sum dy
    dy = rng.standard_normal((6, 5))
    dn_extra = rng.standard_normal((6, 8))
    g = getattr(pynorm, f"{op}_backward")(backend.asarray(dy), ctx, backend.asarray(dn_extra))
    _, c_ref = getattr(pynorm, f"{PLAIN[op]}_forward")(x, *params, backend="numpy")
    g_n = getattr(pynorm, f"{PLAIN[op]}_backward")(dy @ W + dn_extra, c_ref)
    for a, b in zip(g[: len(g_n)], g_n, strict=True):
        np.testing.assert_allclose(backend.to_numpy(a), b, rtol=1e-11, atol=1e-11)
    np.testing.assert_allclose(backend.to_numpy(g.dW), dy.T @ n_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(backend.to_numpy(g.dc), dy.sum(axis=0), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("op", OPS)
def test_ctx_holds_no_normalized_activations(backend, op):
    rng = np.random.default_rng(1)
    x, params, W, c = _data(rng, op, r=16, h=32, n=7, dt=np.float32)
    _, ctx = _fwd(backend, op, x, params, W, c)

    def arrays(obj):
        if dataclasses.is_dataclass(obj):
            for f in dataclasses.fields(obj):
                yield from arrays(getattr(obj, f.name))
        elif hasattr(obj, "shape") and hasattr(obj, "dtype"):
            yield obj

    held = list(arrays(ctx.inner))
    big = [a for a in held if a.size >= 16 * 32]
    assert len(big) == 1 and tuple(big[0].shape) == (16, 32)  # x only (no n, no out)
    assert sum(a.size for a in held) <= 16 * 32 + 2 * 16 + 2 * 32 + 7 * 32 + 7


@pytest.mark.parametrize("op", OPS)
def test_gradients_with_return_norm_upstream(backend, op):
    rng = np.random.default_rng(2)
    x, params, W, c = _data(rng, op, r=3, h=4, n=3)
    dn_dir = rng.standard_normal(x.shape)

    def f(*a):
        (y, n), ctx = _fwd(backend, op, a[0], a[1:-2], a[-2], a[-1], return_norm=True)
        # a scalar-friendly output: out and n together, so both upstream paths are checked
        return np.concatenate([backend.to_numpy(y).ravel(), backend.to_numpy(n).ravel()]), ctx

    def b(v, ctx):
        dy, dn = v[: 3 * 3].reshape(3, 3), v[3 * 3 :].reshape(3, 4)
        g = getattr(pynorm, f"{op}_backward")(backend.asarray(dy), ctx, backend.asarray(dn))
        return [backend.to_numpy(t) for t in g]

    rep = check_grads(f, b, [x, *params, W, c], full_jacobian=True)
    assert rep.passed, str(rep)
    assert dn_dir.shape == x.shape


@pytest.mark.parametrize("op", OPS)
def test_bad_input_names_the_argument(backend, op):
    rng = np.random.default_rng(3)
    x, params, W, c = _data(rng, op, dt=np.float32)
    with pytest.raises(ShapeError, match=r"W has shape \(8, 5\), expected \(N, H\) = \(N, 8\)"):
        _fwd(backend, op, x, params, W.T.copy(), c)
    with pytest.raises(ShapeError, match=r"c has shape \(4,\), expected \(N,\) = \(5,\)"):
        _fwd(backend, op, x, params, W, c[:4])
    with pytest.raises(ShapeError, match="W must be a 2-D array"):
        _fwd(backend, op, x, params, W[0], c)
    _, ctx = _fwd(backend, op, x, params, W, c)
    with pytest.raises(ShapeError, match=r"dy has shape \(6, 8\), expected the shape of the output, \(6, 5\)"):
        getattr(pynorm, f"{op}_backward")(backend.asarray(np.ones((6, 8), np.float32)), ctx)
    with pytest.raises(ShapeError, match="dn must have the shape"):
        getattr(pynorm, f"{op}_backward")(
            backend.asarray(np.ones((6, 5), np.float32)), ctx, backend.asarray(np.ones((6, 5), np.float32))
        )


@pytest.mark.parametrize("dt", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("op", OPS)
def test_composite_on_numpy_kernels_matches_the_reference(op, dt):
    rng = np.random.default_rng(4)
    x, params, W, c = _data(rng, op, r=9, h=33, n=7, dt=dt)
    opts = {"eps": 1e-5, "weight_offset": 0.0} | (
        {"correction": 0, "eps_mode": "var"} if op == "layer_norm_linear" else {}
    )
    ref = _registry.op_module("numpy", op)
    comp = composite.bind(op, "numpy")
    (y_r, n_r), c_r = ref.forward(x, *params, W, c, **opts)
    (y_c, n_c), c_c = comp.forward(x, *params, W, c, **opts)
    tol = {np.float16: 2e-3, np.float32: 2e-6, np.float64: 1e-13}[dt]
    for a, b in ((y_c, y_r), (n_c, n_r)):
        assert a.dtype == b.dtype
        s = max(1.0, float(np.abs(b.astype(np.float64)).max()))
        np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=tol, atol=tol * s)
    dy = rng.standard_normal(y_r.shape).astype(dt)
    for a, b in zip(comp.backward(dy, c_c), ref.backward(dy, c_r), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        s = max(1.0, float(np.abs(b.astype(np.float64)).max()))
        np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=tol, atol=4 * tol * s)


def test_layers():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 8)).astype(np.float32)
    for cls, plain in (
        (pynorm.layers.LayerNormLinear, pynorm.layer_norm),
        (pynorm.layers.RMSNormLinear, pynorm.rms_norm),
    ):
        layer = cls(8, 4, seed=0, backend="numpy")
        (y, n), ctx = layer.forward(x, return_norm=True)
        np.testing.assert_allclose(n, plain(x, backend="numpy"), rtol=1e-6, atol=1e-6)
        want = n.astype(np.float64) @ layer.params["W"].T.astype(np.float64) + layer.params["c"]
        np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
        dx = layer.backward(np.ones_like(y), ctx)
        assert dx.shape == x.shape and layer.grads["W"].shape == (4, 8)
        np.testing.assert_allclose(layer.grads["c"], np.full(4, 6.0), rtol=0, atol=0)
