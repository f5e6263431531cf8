"""LayerNorm: its defining properties and conventions, on every backend."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import pynorm

from .helpers import DTYPES, dtype

shapes = st.tuples(st.integers(1, 6), st.integers(2, 40))
seeds = st.integers(0, 2**32 - 1)


def _np(backend, a):
    return backend.to_numpy(a).astype(np.float64)


@given(shape=shapes, seed=seeds, shift=st.floats(-1e3, 1e3), scale=st.floats(1e-2, 1e2))
def test_invariant_to_row_shift_and_positive_scale(backend, shape, seed, shift, scale):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    shifts = shift * rng.random((shape[0], 1))
    y1 = pynorm.layer_norm(backend.asarray(x), eps=0.0, backend=backend.name)
    y2 = pynorm.layer_norm(backend.asarray(x * scale + shifts), eps=0.0, backend=backend.name)
    np.testing.assert_allclose(_np(backend, y2), _np(backend, y1), rtol=1e-9, atol=1e-9)


@given(shape=shapes, seed=seeds)
def test_plain_output_has_mean_zero_and_unit_variance(backend, shape, seed):
    x = np.random.default_rng(seed).standard_normal(shape) * 3 + 1
    eps = 1e-5
    y = _np(backend, pynorm.layer_norm(backend.asarray(x), eps=eps, backend=backend.name))
    np.testing.assert_allclose(y.mean(axis=1), 0, atol=1e-12)
    v = x.var(axis=1)
    np.testing.assert_allclose(y.var(axis=1), v / (v + eps), rtol=1e-10)


@given(shape=shapes, seed=seeds, conv=st.sampled_from([{}, {"correction": 1}, {"eps_mode": "std"}]))
def test_dx_rows_sum_to_zero_and_are_orthogonal_to_centered_x(backend, shape, seed, conv):
    rng = np.random.default_rng(seed)
    x, w, dy = rng.standard_normal(shape), rng.standard_normal(shape[1]), rng.standard_normal(shape)
    _, ctx = pynorm.layer_norm_forward(backend.asarray(x), backend.asarray(w), eps=0.0, backend=backend.name, **conv)
    dx = _np(backend, pynorm.layer_norm_backward(backend.asarray(dy), ctx).dx)
    # measured against the magnitude of the terms dx is made of: r * sum|dy * w|
    xc = x - x.mean(axis=1, keepdims=True)
    scale = np.abs(dy * w).sum(axis=1) / np.sqrt((xc * xc).mean(axis=1)) + 1e-300
    assert np.all(np.abs(dx.sum(axis=1)) <= 1e-12 * scale)
    # with eps = 0, y does not change along x - mean, so neither does the loss
    assert np.all(np.abs((dx * xc).sum(axis=1)) <= 1e-12 * scale * np.abs(xc).max(axis=1))


@pytest.mark.parametrize("dt", DTYPES)
def test_hidden_size_one_is_exact(backend, dt):
    x = backend.asarray(np.array([[3.0], [-7.5], [1e4]], dtype=dtype(dt)))
    w = backend.asarray(np.array([2.0], dtype=dtype(dt)))
    b = backend.asarray(np.array([0.25], dtype=dtype(dt)))
    y, ctx = pynorm.layer_norm_forward(x, w, b, backend=backend.name)
    assert np.all(_np(backend, y) == 0.25)
    g = pynorm.layer_norm_backward(backend.asarray(np.ones((3, 1), dtype(dt))), ctx)
    assert np.all(_np(backend, g.dweight) == 0.0)  # exactly 0: x - mean is exactly 0
    assert np.all(_np(backend, g.dx) == 0.0)
    assert np.all(_np(backend, g.dbias) == 3.0)


@pytest.mark.parametrize("dt", DTYPES)
def test_constant_rows_are_exact(backend, dt):
    vals = np.array([0.1, -3.3, 1e4, 65000.0 if dt == "float16" else 3e38 if dt != "float64" else 1e308])
    x = np.repeat(vals[:, None], 37, axis=1).astype(dtype(dt))
    b = np.linspace(-1, 1, 37).astype(dtype(dt))
    y, _ = pynorm.layer_norm_forward(backend.asarray(x), bias=backend.asarray(b), backend=backend.name)
    np.testing.assert_array_equal(_np(backend, y), np.broadcast_to(b.astype(np.float64), x.shape))
    dy = np.random.default_rng(0).standard_normal(x.shape).astype(dtype(dt))
    ctx_w = pynorm.layer_norm_forward(
        backend.asarray(x), backend.asarray(np.ones(37, dtype(dt))), backend=backend.name
    )[1]
    assert np.all(_np(backend, pynorm.layer_norm_backward(backend.asarray(dy), ctx_w).dweight) == 0.0)


def test_eps_zero_constant_row_is_nan(backend):
    y = pynorm.layer_norm(backend.asarray(np.full((2, 4), 3.0)), eps=0.0, backend=backend.name)
    assert np.all(np.isnan(_np(backend, y)))


def test_source_document_conventions(backend):
    # a tutorial LayerNorm: gamma * (x - mean) / (x.std() + eps) + beta, with torch's unbiased std
    rng = np.random.default_rng(0)
    x, w, b = rng.standard_normal((5, 9)), rng.standard_normal(9), rng.standard_normal(9)
    eps = 1e-5
    expected = w * (x - x.mean(-1, keepdims=True)) / (x.std(-1, ddof=1, keepdims=True) + eps) + b
    got = pynorm.layer_norm(
        backend.asarray(x),
        backend.asarray(w),
        backend.asarray(b),
        eps=eps,
        correction=1,
        eps_mode="std",
        backend=backend.name,
    )
    np.testing.assert_allclose(_np(backend, got), expected, rtol=1e-12, atol=1e-12)
    # another tutorial LayerNorm: biased std + eps
    expected = (x - x.mean(-1, keepdims=True)) / (x.std(-1, keepdims=True) + 1e-6)
    got = pynorm.layer_norm(backend.asarray(x), eps=1e-6, eps_mode="std", backend=backend.name)
    np.testing.assert_allclose(_np(backend, got), expected, rtol=1e-12, atol=1e-12)


def test_default_matches_pytorch_formula(backend):
    rng = np.random.default_rng(1)
    x, w, b = rng.standard_normal((4, 2, 6)), rng.standard_normal((2, 6)), rng.standard_normal((2, 6))
    m = x.mean(axis=(1, 2), keepdims=True)
    v = x.var(axis=(1, 2), keepdims=True)
    expected = (x - m) / np.sqrt(v + 1e-5) * w + b
    got = pynorm.layer_norm(backend.asarray(x), backend.asarray(w), backend.asarray(b), axis=1, backend=backend.name)
    np.testing.assert_allclose(_np(backend, got), expected, rtol=1e-12, atol=1e-12)


def test_weight_offset_equals_shifted_weight(backend):
    rng = np.random.default_rng(2)
    x, w, dy = rng.standard_normal((3, 8)), rng.standard_normal(8), rng.standard_normal((3, 8))
    y1, c1 = pynorm.layer_norm_forward(backend.asarray(x), backend.asarray(w), weight_offset=1.0, backend=backend.name)
    y2, c2 = pynorm.layer_norm_forward(backend.asarray(x), backend.asarray(1 + w), backend=backend.name)
    np.testing.assert_allclose(_np(backend, y1), _np(backend, y2), rtol=1e-13, atol=1e-13)
    g1 = pynorm.layer_norm_backward(backend.asarray(dy), c1)
    g2 = pynorm.layer_norm_backward(backend.asarray(dy), c2)
    np.testing.assert_allclose(_np(backend, g1.dweight), _np(backend, g2.dweight), rtol=1e-12)


def test_mixed_parameter_dtypes(backend):
    import ml_dtypes

    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 16)).astype(ml_dtypes.bfloat16)
    w = rng.standard_normal(16).astype(np.float32)
    b = rng.standard_normal(16).astype(np.float16)
    y, ctx = pynorm.layer_norm_forward(backend.asarray(x), backend.asarray(w), backend.asarray(b), backend=backend.name)
    assert y.dtype == x.dtype
    g = pynorm.layer_norm_backward(backend.asarray(np.ones_like(x)), ctx)
    assert g.dx.dtype == x.dtype and g.dweight.dtype == np.float32 and g.dbias.dtype == np.float16


@pytest.mark.parametrize("dt", DTYPES)
def test_huge_magnitudes_stay_finite(backend, dt):
    big = {"float16": 6e4, "bfloat16": 3e38, "float32": 3.4e38, "float64": 1.7e308}[dt]
    x = np.array([[big, -big, big, 0.5 * big], [big, big, big, -big]]).astype(dtype(dt))
    y, ctx = pynorm.layer_norm_forward(backend.asarray(x), backend=backend.name)
    g = pynorm.layer_norm_backward(backend.asarray(np.ones_like(x)), ctx)
    assert np.all(np.isfinite(_np(backend, y))) and np.all(np.isfinite(_np(backend, g.dx)))
    xf = x.astype(np.float64) / big
    expected = (xf - xf.mean(1, keepdims=True)) / xf.std(1, keepdims=True)
    np.testing.assert_allclose(_np(backend, y), expected, rtol=1e-2 if dt in ("float16", "bfloat16") else 1e-6)


def test_large_offset_keeps_full_accuracy(backend):
    rng = np.random.default_rng(4)
    n = rng.standard_normal((8, 512))
    x = (1e4 + n).astype(np.float32)
    xf = x.astype(np.float64)
    expected = (xf - xf.mean(1, keepdims=True)) / np.sqrt(xf.var(1, keepdims=True) + 1e-5)
    y = _np(backend, pynorm.layer_norm(backend.asarray(x), backend=backend.name))
    # full float32 accuracy on the deviations, not the ~5e-4 a float32 mean would leave
    np.testing.assert_allclose(y, expected, rtol=0, atol=2e-6)
