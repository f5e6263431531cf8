"""Bad input gets a clear error naming the argument, the same on every backend."""

from __future__ import annotations

import numpy as np
import pytest

import pynorm
from pynorm.errors import ArgumentError, ArrayTypeError, ContextError, DTypeError, PynormError, ShapeError

from .helpers import OPS, make_args, out_shape


def _x(backend, shape=(3, 4), dt=np.float32):
    return backend.asarray(np.ones(shape, dt) + np.arange(np.prod(shape)).reshape(shape).astype(dt))


def _args(backend, op, shape=(3, 4)):
    """Valid extra inputs and required parameters for ``x`` of ``shape`` (optional parameters None)."""
    spec = OPS[op]
    args = spec.without_optional(make_args(spec, shape, -1, np.float32, np.random.default_rng(0)))
    return [None if a is None else backend.asarray(a) for a in args]


def _call(backend, op, x, *, replace=None, **kw):
    """``op``'s forward of ``x`` with valid arguments, ``replace`` mapping argument names to other values."""
    spec = OPS[op]
    args = _args(backend, op, tuple(x.shape))
    for name, v in (replace or {}).items():
        args[spec.arg_names.index(name)] = v
    return spec.forward(x, *args, backend=backend.name, **kw)


WITH_WEIGHT = sorted(op for op in OPS if any(p.name == "weight" and p.kind == "feature" for p in OPS[op].spec.params))
WITH_EPS = sorted(op for op in OPS if "eps" in OPS[op].spec.defaults())


@pytest.mark.parametrize("op", WITH_WEIGHT)
def test_weight_shape(backend, op):
    with pytest.raises(ShapeError, match=r"weight has shape \(5,\), expected x.shape\[axis:\] = \(4,\)"):
        _call(backend, op, _x(backend), replace={"weight": backend.asarray(np.ones(5, np.float32))})
    with pytest.raises(ShapeError, match="weight"):
        _call(backend, op, _x(backend), replace={"weight": backend.asarray(np.ones((2, 4), np.float32))})


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("axis", [2, -3, 1.0, True, "1"])
def test_bad_axis(backend, op, axis):
    with pytest.raises(ArgumentError, match="axis"):
        _call(backend, op, _x(backend), axis=axis)


@pytest.mark.parametrize("op", WITH_EPS)
@pytest.mark.parametrize("eps", [-1e-5, float("nan"), float("inf"), "1e-5", None, True])
def test_bad_eps(backend, op, eps):
    with pytest.raises(ArgumentError, match="eps"):
        _call(backend, op, _x(backend), eps=eps)


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("dt", [np.int32, np.int64, np.complex64, np.bool_, np.uint8])
def test_unsupported_x_dtype(backend, op, dt):
    with pytest.raises(DTypeError, match="x must have dtype (int8, )?float16, bfloat16, float32 or float64, got"):
        _call(backend, op, backend.asarray(np.ones((2, 3), dt)))


@pytest.mark.parametrize("op", WITH_WEIGHT)
def test_unsupported_weight_dtype(backend, op):
    with pytest.raises(DTypeError, match="weight must have dtype"):
        _call(backend, op, _x(backend), replace={"weight": backend.asarray(np.ones(4, np.int64))})


@pytest.mark.parametrize("op", sorted(OPS))
def test_dy_dtype_and_shape(backend, op):
    spec = OPS[op]
    _, ctx = _call(backend, op, _x(backend))
    yshape = out_shape(spec, (3, 4), -1, _args(backend, op))
    with pytest.raises(DTypeError, match="dy has dtype float64, expected the dtype of x, float32"):
        spec.backward(backend.asarray(np.ones(yshape, np.float64)), ctx)
    with pytest.raises(ShapeError, match=r"dy has shape \(4, 3\)"):
        spec.backward(backend.asarray(np.ones((4, 3), np.float32)), ctx)


@pytest.mark.parametrize("op", ["layer_norm", "group_norm"])
def test_a_ctx_of_other_arrays_leaves_a_numpy_dy_to_the_checks(op, backend):
    """A ctx carries its call shape's plan, whose short backward takes a NumPy ``dy`` of that shape: not for a
    forward that ran on another array type (CuPy), where the general path names the mix -- twice, so that the
    second call meets the plan's kept backward too."""
    from pynorm import _registry

    served = _registry.get_backend(backend.name)
    if (served.array_module, served.array_type) == ("numpy", "ndarray"):
        pytest.skip(f"{backend.name} serves NumPy arrays: a NumPy dy is its own type")
    rng = np.random.default_rng(47)
    x = rng.standard_normal((4, 8)).astype(np.float32)
    w, b = (rng.standard_normal(8).astype(np.float32) for _ in range(2))
    opts = {"num_groups": 2} if op == "group_norm" else {}
    fwd, bwd = getattr(pynorm, f"{op}_forward"), getattr(pynorm, f"{op}_backward")
    for _ in range(2):
        _, ctx = fwd(*(backend.asarray(a) for a in (x, w, b)), backend=backend.name, **opts)
        with pytest.raises(pynorm.errors.ArrayTypeError, match="cannot be mixed"):
            bwd(np.ones_like(x), ctx)
        assert bwd(backend.asarray(np.ones_like(x)), ctx).dx.shape == x.shape


def test_ctx_from_another_op(backend):
    _, ctx = pynorm.rms_norm_forward(_x(backend), backend=backend.name)
    with pytest.raises(ContextError, match="produced by rms_norm_forward"):
        pynorm.layer_norm_backward(_x(backend), ctx)
    with pytest.raises(ContextError, match="ctx must be the Context"):
        pynorm.layer_norm_backward(_x(backend), {"mean": 0})


@pytest.mark.parametrize("op", sorted(OPS))
def test_zero_dim_and_empty_normalized_dims(backend, op):
    spec = OPS[op]
    with pytest.raises(ShapeError, match="at least 1 dimension"):
        spec.forward(backend.asarray(np.float32(1.0).reshape(())), *_args(backend, op), backend=backend.name)
    with pytest.raises(ShapeError, match="must not be empty"):
        spec.forward(backend.asarray(np.ones((3, 0), np.float32)), *_args(backend, op), backend=backend.name)


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
    x = _x(backend)
    r, n = out_shape(OPS[op], (3, 4), -1, _args(backend, op))
    with pytest.raises(ShapeError, match="out must have shape"):
        _call(backend, op, x, out=backend.xp.empty((r, n), np.float64))
    with pytest.raises(ArgumentError, match="out must be C-contiguous"):
        _call(backend, op, x, out=backend.xp.empty((n, r), np.float32).T)
    if (r, n) == (3, 4):  # an output of x's shape: x itself overlaps an input
        with pytest.raises(ArgumentError, match="must not overlap"):
            _call(backend, op, x, out=x)


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
