"""Bad input gets a clear error naming the argument, the same on every backend."""

from __future__ import annotations

import numpy as np
import pytest

import pynorm
from pynorm.errors import ArgumentError, ArrayTypeError, ContextError, DTypeError, PynormError, ShapeError

from .helpers import OPS


def _x(backend, shape=(3, 4), dt=np.float32):
    return backend.asarray(np.ones(shape, dt) + np.arange(np.prod(shape)).reshape(shape).astype(dt))


@pytest.mark.parametrize("op", sorted(OPS))
def test_weight_shape(backend, op):
    f = OPS[op].forward
    with pytest.raises(ShapeError, match=r"weight has shape \(5,\), expected x.shape\[axis:\] = \(4,\)"):
        f(_x(backend), backend.asarray(np.ones(5, np.float32)), backend=backend.name)
    with pytest.raises(ShapeError, match="weight"):
        f(_x(backend), backend.asarray(np.ones((2, 4), np.float32)), backend=backend.name)


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("axis", [2, -3, 1.0, True, "1"])
def test_bad_axis(backend, op, axis):
    with pytest.raises(ArgumentError, match="axis"):
        OPS[op].forward(_x(backend), axis=axis, backend=backend.name)


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("eps", [-1e-5, float("nan"), float("inf"), "1e-5", None, True])
def test_bad_eps(backend, op, eps):
    with pytest.raises(ArgumentError, match="eps"):
        OPS[op].forward(_x(backend), eps=eps, backend=backend.name)


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("dt", [np.int32, np.int64, np.complex64, np.bool_, np.uint8])
def test_unsupported_x_dtype(backend, op, dt):
    with pytest.raises(DTypeError, match="x must have dtype float16, bfloat16, float32 or float64"):
        OPS[op].forward(backend.asarray(np.ones((2, 3), dt)), backend=backend.name)


@pytest.mark.parametrize("op", sorted(OPS))
def test_unsupported_weight_dtype(backend, op):
    with pytest.raises(DTypeError, match="weight must have dtype"):
        OPS[op].forward(_x(backend), backend.asarray(np.ones(4, np.int64)), backend=backend.name)


@pytest.mark.parametrize("op", sorted(OPS))
def test_dy_dtype_and_shape(backend, op):
    spec = OPS[op]
    _, ctx = spec.forward(_x(backend), backend=backend.name)
    with pytest.raises(DTypeError, match="dy has dtype float64, expected the dtype of x, float32"):
        spec.backward(backend.asarray(np.ones((3, 4), np.float64)), ctx)
    with pytest.raises(ShapeError, match=r"dy has shape \(4, 3\)"):
        spec.backward(backend.asarray(np.ones((4, 3), np.float32)), ctx)


def test_ctx_from_another_op(backend):
    _, ctx = pynorm.rms_norm_forward(_x(backend), backend=backend.name)
    with pytest.raises(ContextError, match="produced by rms_norm_forward"):
        pynorm.layer_norm_backward(_x(backend), ctx)
    with pytest.raises(ContextError, match="ctx must be the Context"):
        pynorm.layer_norm_backward(_x(backend), {"mean": 0})


@pytest.mark.parametrize("op", sorted(OPS))
def test_zero_dim_and_empty_normalized_dims(backend, op):
    with pytest.raises(ShapeError, match="at least 1 dimension"):
        OPS[op].forward(backend.asarray(np.float32(1.0).reshape(())), backend=backend.name)
    with pytest.raises(ShapeError, match="must not be empty"):
        OPS[op].forward(backend.asarray(np.ones((3, 0), np.float32)), backend=backend.name)


def test_layer_norm_conventions_validated(backend):
    x = _x(backend)
    with pytest.raises(ArgumentError, match="correction must be 0"):
        pynorm.layer_norm(x, correction=2, backend=backend.name)
    with pytest.raises(ArgumentError, match="correction must be 0"):
        pynorm.layer_norm(x, correction=True, backend=backend.name)
    with pytest.raises(ArgumentError, match="eps_mode must be 'var'"):
        pynorm.layer_norm(x, eps_mode="variance", backend=backend.name)
    with pytest.raises(ArgumentError, match="weight_offset"):
        pynorm.layer_norm(x, weight_offset=float("nan"), backend=backend.name)
    with pytest.raises(ArgumentError, match="H = 1"):
        pynorm.layer_norm(_x(backend, (3, 1)), correction=1, backend=backend.name)
    with pytest.raises(TypeError):
        pynorm.layer_norm(x, unknown_option=1, backend=backend.name)


@pytest.mark.parametrize("op", sorted(OPS))
def test_bad_out_buffers(backend, op):
    spec = OPS[op]
    x = _x(backend)
    with pytest.raises(ShapeError, match="out must have shape"):
        spec.forward(x, backend=backend.name, out=backend.xp.empty((3, 4), np.float64))
    with pytest.raises(ArgumentError, match="out must be C-contiguous"):
        spec.forward(x, backend=backend.name, out=backend.xp.empty((4, 3), np.float32).T)
    with pytest.raises(ArgumentError, match="must not overlap"):
        spec.forward(x, backend=backend.name, out=x)


def test_not_an_array():
    with pytest.raises(ArrayTypeError, match="x must be an array"):
        pynorm.layer_norm({"a": 1})


def test_lists_are_accepted_as_numpy():
    y = pynorm.layer_norm([[1.0, 2.0, 3.0]], backend="numpy")
    assert isinstance(y, np.ndarray) and y.dtype == np.float64


def test_errors_are_value_or_type_errors():
    for cls in (ShapeError, ArgumentError):
        assert issubclass(cls, ValueError) and issubclass(cls, PynormError)
    for cls in (DTypeError, ArrayTypeError, ContextError):
        assert issubclass(cls, TypeError) and issubclass(cls, PynormError)
