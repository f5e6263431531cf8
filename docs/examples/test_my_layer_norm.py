"""A test file to copy into your kernel project: pynorm's oracle as a pytest test.

Replace ``my_layer_norm`` and ``my_layer_norm_backward`` by your implementation (a wrapper that takes and
returns NumPy arrays: ``x.numpy()`` / ``torch.from_numpy(...)`` around a CUDA or Triton kernel), and run
``pytest test_my_layer_norm.py``. A failing check raises ``AssertionError`` with the table of the cells that are
not exact, the joint diagnosis per dtype (the simplest combination of causes that reproduces the failing cells)
and the advice the checker ran before giving it. The calling convention of the functions is in pynorm's
``docs/oracle.md``.
"""

from __future__ import annotations

import numpy as np
import pytest

from pynorm.testing import assert_matches_reference


def _statistics(x2, eps):
    """Per row of ``x2`` (float64): the centred values and rstd, of the row scaled by a power of two near its
    largest magnitude first (the squares of huge or tiny rows neither overflow nor underflow), then rescaled."""
    big = np.max(np.abs(x2), axis=1, keepdims=True)
    scale = np.ldexp(1.0, np.frexp(np.where((big > 0) & np.isfinite(big), big, 1.0))[1])
    xs = x2 / scale
    d = xs - xs.mean(axis=1, keepdims=True)
    d = d - d.mean(axis=1, keepdims=True)  # the corrected two-pass mean: exact centring of offset rows
    # rstd of the scaled row in long double: eps / scale^2 underflows in float64 when scale is near float64's max
    rs = 1 / np.sqrt((d * d).mean(axis=1, keepdims=True).astype(np.longdouble) + eps / np.longdouble(scale) ** 2)
    xhat = np.where(d == 0, 0.0, (d * rs).astype(np.float64))
    return xhat, (rs / scale).astype(np.float64)


def my_layer_norm(x, weight, bias, eps=1e-5):
    """Your forward (here: a careful NumPy LayerNorm): normalize the trailing ``weight.ndim`` axes of ``x``."""
    xhat, _ = _statistics(x.reshape(-1, weight.size).astype(np.float64), eps)
    y = xhat * weight.reshape(-1).astype(np.float64) + bias.reshape(-1).astype(np.float64)
    return y.reshape(x.shape).astype(x.dtype)


def my_layer_norm_backward(dy, x, weight, bias, eps=1e-5):
    """Your backward: ``(dx, dweight, dbias)`` in the dtypes of ``x``, ``weight`` and ``bias``."""
    h = weight.size
    dy2 = dy.reshape(-1, h).astype(np.float64)
    xhat, r = _statistics(x.reshape(-1, h).astype(np.float64), eps)
    g = dy2 * weight.reshape(-1).astype(np.float64)
    bracket = g - g.mean(axis=1, keepdims=True) - xhat * (g * xhat).mean(axis=1, keepdims=True)
    dx = np.where(bracket == 0, 0.0, r * bracket)  # rows of one element: 0
    dweight = (dy2 * xhat).sum(axis=0).reshape(weight.shape)
    dbias = dy2.sum(axis=0).reshape(bias.shape)
    return dx.reshape(x.shape).astype(x.dtype), dweight.astype(weight.dtype), dbias.astype(bias.dtype)


def test_forward_matches_the_reference():
    assert_matches_reference(my_layer_norm, op="layer_norm")  # the quick grid, the four dtypes, batch invariance


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_forward_and_backward_per_dtype(dtype):
    assert_matches_reference(my_layer_norm, op="layer_norm", backward=my_layer_norm_backward, dtypes=[dtype])
