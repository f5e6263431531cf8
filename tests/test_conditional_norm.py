"""Conditional LayerNorm / RMSNorm (adaLN): their own properties, on every backend that has them."""

from __future__ import annotations

import numpy as np
import pytest

import pynorm
from pynorm import _registry
from pynorm.composite import conditional_norm as composite
from pynorm.errors import ArgumentError, ShapeError
from pynorm.testing import check_grads

OPS = ("conditional_layer_norm", "conditional_rms_norm")
PLAIN = {"conditional_layer_norm": "layer_norm", "conditional_rms_norm": "rms_norm"}


def _data(rng, b=2, t=3, h=8, c=4, k=2, dt=np.float64):
    x = rng.standard_normal((b, t, h)).astype(dt)
    cond = rng.standard_normal((b, c)).astype(dt)
    W = (0.5 * rng.standard_normal((k * h, c))).astype(dt)
    cv = (0.5 * rng.standard_normal(k * h)).astype(dt)
    return x, cond, W, cv


def _fwd(backend, op, *arrays, **kw):
    return getattr(pynorm, f"{op}_forward")(*[None if a is None else backend.asarray(a) for a in arrays],
                                            backend=backend.name, **kw)  # fmt: skip


@pytest.mark.parametrize("zero_centered", [False, True])
@pytest.mark.parametrize("op", OPS)
def test_per_sample_cond_equals_the_plain_norm_with_that_samples_gamma_beta(backend, op, zero_centered):
    """The definition, row by row: y[b] = plain norm of x[b] with weight gamma_b (+1) and beta_b added."""
    rng = np.random.default_rng(0)
    x, cond, W, cv = _data(rng)
    y, _ = _fwd(backend, op, x, cond, W, cv, zero_centered=zero_centered)
    y = backend.to_numpy(y)
    h = x.shape[-1]
    for b in range(x.shape[0]):
        p = W @ cond[b] + cv  # float64 on the host, independent of the op
        gamma, beta = p[:h] + (1.0 if zero_centered else 0.0), p[h:]
        n = getattr(pynorm, PLAIN[op])(x[b], backend="numpy")  # the plain norm, no affine
        np.testing.assert_allclose(y[b], n * gamma + beta, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("op", OPS)
def test_broadcast_forms_agree_and_dcond_is_summed_over_the_sequence(backend, op):
    rng = np.random.default_rng(1)
    x, cond, W, cv = _data(rng)
    per_row = np.repeat(cond[:, None, :], x.shape[1], axis=1)  # (B, T, C)
    dy = rng.standard_normal(x.shape)
    results = {}
    for name, cnd in (("sample", cond), ("sample1", cond[:, None, :]), ("row", per_row)):
        y, ctx = _fwd(backend, op, x, cnd, W, cv)
        g = getattr(pynorm, f"{op}_backward")(backend.asarray(dy), ctx)
        assert tuple(g.dcond.shape) == cnd.shape
        results[name] = (backend.to_numpy(y), [backend.to_numpy(a) for a in g])
    for name in ("sample1", "row"):
        np.testing.assert_allclose(results[name][0], results["sample"][0], rtol=1e-13, atol=1e-13)
        for i in (0, 2, 3):  # dx, dW, dc
            np.testing.assert_allclose(results[name][1][i], results["sample"][1][i], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(results["row"][1][1].sum(axis=1), results["sample"][1][1], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(results["sample1"][1][1][:, 0], results["sample"][1][1], rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("op", OPS)
def test_gradients_with_broadcast_cond_and_without_c(backend, op):
    rng = np.random.default_rng(2)
    x, cond, W, cv = _data(rng, b=2, t=3, h=4, c=3)
    for c_arg in (cv, None):
        args = [x, cond, W] + ([] if c_arg is None else [c_arg])

        def f(*a, _c=c_arg):
            full = list(a) + ([None] if _c is None else [])
            y, ctx = _fwd(backend, op, *full, zero_centered=True)
            return backend.to_numpy(y), ctx

        def b(dy, ctx):
            g = getattr(pynorm, f"{op}_backward")(backend.asarray(dy), ctx)
            out = [backend.to_numpy(a) for a in g[:3]]
            return out + ([] if g.dc is None else [backend.to_numpy(g.dc)])

        rep = check_grads(f, b, args, names=["x", "cond", "W", "c"][: len(args)], full_jacobian=True)
        assert rep.passed, str(rep)


def _needs(backend, op):
    if op not in backend.ops:
        pytest.skip(f"backend {backend.name!r} does not implement {op!r}")


def test_rms_shift_false_is_liger_modulated_rms_norm(backend):
    _needs(backend, "conditional_rms_norm")
    rng = np.random.default_rng(3)
    x, cond, W, cv = _data(rng, k=1)
    y, ctx = _fwd(backend, "conditional_rms_norm", x, cond, W, cv, shift=False)
    ms = np.mean(x * x, axis=-1, keepdims=True)
    want = x / np.sqrt(ms + 1e-6) * (cond @ W.T + cv)[:, None, :]
    np.testing.assert_allclose(backend.to_numpy(y), want, rtol=1e-12, atol=1e-12)
    g = pynorm.conditional_rms_norm_backward(backend.asarray(np.ones_like(x)), ctx)
    assert tuple(g.dW.shape) == (8, 4) and tuple(g.dc.shape) == (8,)


@pytest.mark.parametrize("op", OPS)
def test_cond_all_zeros_gives_c(backend, op):
    rng = np.random.default_rng(4)
    x, cond, W, cv = _data(rng, dt=np.float32)
    cond = np.zeros_like(cond)
    y, ctx = _fwd(backend, op, x, cond, W, cv)
    h = x.shape[-1]
    n = getattr(pynorm, PLAIN[op])(x.astype(np.float64), backend="numpy")
    np.testing.assert_allclose(backend.to_numpy(y), n * cv[:h].astype(np.float64) + cv[h:], rtol=2e-6, atol=2e-6)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    g = getattr(pynorm, f"{op}_backward")(backend.asarray(dy), ctx)
    assert not backend.to_numpy(g.dW).any()  # dW = dP^T cond = 0
    assert np.all(np.isfinite(backend.to_numpy(g.dcond)))


@pytest.mark.parametrize("op", OPS)
def test_bad_input_names_the_argument(backend, op):
    rng = np.random.default_rng(5)
    x, cond, W, cv = _data(rng, dt=np.float32)
    with pytest.raises(ShapeError, match=r"W has shape \(8, 4\), expected \(2H, C\) = \(16, 4\)"):
        _fwd(backend, op, x, cond, W[:8], cv)
    with pytest.raises(ShapeError, match="W has shape"):
        _fwd(backend, op, x, cond, W.T.copy(), cv)
    with pytest.raises(ShapeError, match="W must be a 2-D array"):
        _fwd(backend, op, x, cond, W[0], cv)
    with pytest.raises(ShapeError, match=r"c has shape \(8,\), expected \(2H,\)"):
        _fwd(backend, op, x, cond, W, cv[:8])
    with pytest.raises(ShapeError, match="cond has shape .* broadcasts neither way"):
        _fwd(backend, op, x, cond[:1].repeat(3, axis=0), W, cv)  # (3, C) against (B=2, T=3): neither
    with pytest.raises(ShapeError, match="cond has shape .* broadcasts neither way"):
        _fwd(backend, op, x, np.ones((2, 3, 1, 4), np.float32), W, cv)  # more leading dims than x's rows
    with pytest.raises(ArgumentError, match="W is required"):
        _fwd(backend, op, x, cond, None, cv)
    with pytest.raises(ArgumentError, match="zero_centered must be True or False"):
        _fwd(backend, op, x, cond, W, cv, zero_centered=1)
    with pytest.raises(ArgumentError, match="cond is required"):
        _fwd(backend, op, x, None, W, cv)


def test_rms_shift_false_wants_h_rows(backend):
    _needs(backend, "conditional_rms_norm")
    rng = np.random.default_rng(6)
    x, cond, W, cv = _data(rng, dt=np.float32)
    with pytest.raises(ShapeError, match=r"expected \(H, C\) \(shift=False: a scale only\) = \(8, 4\)"):
        _fwd(backend, "conditional_rms_norm", x, cond, W, cv, shift=False)


@pytest.mark.parametrize("dt", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("shift", [True, False])
@pytest.mark.parametrize("op", OPS)
def test_composite_on_numpy_kernels_matches_the_reference(op, shift, dt):
    """The shared composite implementation bound to the numpy backend's modality norms, against the
    reference definition (the CPU check of the code every other backend runs)."""
    if op == "conditional_layer_norm" and not shift:
        pytest.skip("conditional_layer_norm always shifts")
    rng = np.random.default_rng(7)
    k = 2 if shift else 1
    x, cond, W, cv = _data(rng, b=3, t=5, h=16, c=6, k=k, dt=dt)
    x2, c2 = x.reshape(15, 16), cond
    opts = {"eps": 1e-5, "zero_centered": True}
    opts |= {"correction": 0, "eps_mode": "var"} if op == "conditional_layer_norm" else {"shift": shift}
    ref = _registry.op_module("numpy", op)
    comp = composite.bind(op, "numpy")
    y_r, c_r = ref.forward(x2, c2, W, cv, **opts)
    y_c, c_c = comp.forward(x2, c2, W, cv, **opts)
    tol = {np.float16: 2e-3, np.float32: 2e-6, np.float64: 1e-13}[dt]
    np.testing.assert_allclose(y_c.astype(np.float64), y_r.astype(np.float64), rtol=tol, atol=tol * 4)
    dy = rng.standard_normal(y_r.shape).astype(dt)
    for a, b in zip(comp.backward(dy, c_c), ref.backward(dy, c_r), strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        scale = max(1.0, float(np.abs(b.astype(np.float64)).max()))
        np.testing.assert_allclose(a.astype(np.float64), b.astype(np.float64), rtol=tol, atol=tol * 4 * scale)


@pytest.mark.parametrize("kind", ["layer", "rms"])
def test_layers_start_as_the_plain_norm_adaln_zero(kind):
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 5, 8)).astype(np.float32)
    cond = rng.standard_normal((2, 3)).astype(np.float32)
    cls = pynorm.layers.ConditionalLayerNorm if kind == "layer" else pynorm.layers.ConditionalRMSNorm
    plain = pynorm.layer_norm if kind == "layer" else pynorm.rms_norm
    for zc in (False, True):
        layer = cls(8, 3, zero_centered=zc, backend="numpy")
        assert not layer.params["W"].any()
        y, ctx = layer.forward(x, cond)
        np.testing.assert_allclose(y, plain(x, backend="numpy"), rtol=1e-6, atol=1e-6)
        dx, dcond = layer.backward(np.ones_like(y), ctx)
        assert (
            dx.shape == x.shape
            and dcond.shape == cond.shape
            and layer.grads["W"].shape == (16, 3)
            and layer.grads["c"].shape == (16,)
        )
        assert layer.grads["W"].any()  # a zero W still learns
    shift_free = pynorm.layers.ConditionalRMSNorm(8, 3, shift=False)
    assert shift_free.params["W"].shape == (8, 3)
    with pytest.raises(ArgumentError):
        cls(8, 0)
