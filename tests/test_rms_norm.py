"""RMSNorm: its defining properties and conventions, on every backend."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import pynorm

from .helpers import DTYPES, dtype

shapes = st.tuples(st.integers(1, 6), st.integers(1, 40))
seeds = st.integers(0, 2**32 - 1)


def _np(backend, a):
    return backend.to_numpy(a).astype(np.float64)


@given(shape=shapes, seed=seeds, scale=st.floats(1e-3, 1e3))
def test_invariant_to_positive_scale(backend, shape, seed, scale):
    x = np.random.default_rng(seed).standard_normal(shape)
    y1 = pynorm.rms_norm(backend.asarray(x), eps=0.0, backend=backend.name)
    y2 = pynorm.rms_norm(backend.asarray(x * scale), eps=0.0, backend=backend.name)
    np.testing.assert_allclose(_np(backend, y2), _np(backend, y1), rtol=1e-12, atol=1e-13)


@given(shape=shapes, seed=seeds)
def test_plain_output_has_unit_rms(backend, shape, seed):
    x = np.random.default_rng(seed).standard_normal(shape) + 0.5
    y = _np(backend, pynorm.rms_norm(backend.asarray(x), eps=0.0, backend=backend.name))
    np.testing.assert_allclose(np.sqrt((y * y).mean(axis=1)), 1.0, rtol=1e-12)


@given(shape=shapes, seed=seeds)
def test_dx_is_orthogonal_to_x_without_eps(backend, shape, seed):
    rng = np.random.default_rng(seed)
    x, w, dy = rng.standard_normal(shape), rng.standard_normal(shape[1]), rng.standard_normal(shape)
    _, ctx = pynorm.rms_norm_forward(backend.asarray(x), backend.asarray(w), eps=0.0, backend=backend.name)
    dx = _np(backend, pynorm.rms_norm_backward(backend.asarray(dy), ctx).dx)
    scale = np.abs(dy * w).sum(axis=1) / np.sqrt((x * x).mean(axis=1)) * np.abs(x).max(axis=1) + 1e-300
    assert np.all(np.abs((dx * x).sum(axis=1)) <= 1e-12 * scale)


def test_matches_llama_and_gemma_formulas(backend):
    rng = np.random.default_rng(0)
    x, w = rng.standard_normal((4, 10)), rng.standard_normal(10)
    r = 1 / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)
    got = pynorm.rms_norm(backend.asarray(x), backend.asarray(w), backend=backend.name)
    np.testing.assert_allclose(_np(backend, got), w * (x * r), rtol=1e-13)
    got = pynorm.rms_norm(backend.asarray(x), backend.asarray(w), weight_offset=1.0, backend=backend.name)
    np.testing.assert_allclose(_np(backend, got), (1 + w) * (x * r), rtol=1e-13)


@pytest.mark.parametrize("dt", DTYPES)
def test_huge_and_tiny_magnitudes(backend, dt):
    big = {"float16": 6e4, "bfloat16": 3e38, "float32": 3.4e38, "float64": 1.7e308}[dt]
    x = np.array([[big, -big, 0.5 * big, big], [1e-3, -2e-3, 3e-3, 0]]).astype(dtype(dt))
    y, ctx = pynorm.rms_norm_forward(backend.asarray(x), eps=0.0, backend=backend.name)
    g = pynorm.rms_norm_backward(backend.asarray(np.ones_like(x)), ctx)
    assert np.all(np.isfinite(_np(backend, y))) and np.all(np.isfinite(_np(backend, g.dx)))
    xf = x.astype(np.float64)
    xf = xf / np.abs(xf).max(1, keepdims=True)
    expected = xf / np.sqrt((xf * xf).mean(1, keepdims=True))
    np.testing.assert_allclose(_np(backend, y), expected, rtol=1e-2 if dt in ("float16", "bfloat16") else 1e-6)


def test_zero_row(backend):
    y, ctx = pynorm.rms_norm_forward(backend.asarray(np.zeros((2, 5), np.float32)), backend=backend.name)
    assert np.all(_np(backend, y) == 0)
    dx = _np(backend, pynorm.rms_norm_backward(backend.asarray(np.ones((2, 5), np.float32)), ctx).dx)
    np.testing.assert_allclose(dx, 1 / np.sqrt(1e-6), rtol=1e-6)
