"""DLPack in: any object with ``__dlpack__`` / ``__dlpack_device__`` is read zero-copy as a NumPy array (CPU
memory) or a CuPy array (CUDA memory), then dispatched as usual; outputs are NumPy/CuPy arrays.

The foreign arrays here are a minimal exporter over NumPy memory that offers nothing but DLPack (its
torch-like ``dtype``/``shape`` attributes must not be trusted, its methods must not be called), so the tests
need no other library; with PyTorch installed (optional, ``torch==2.13.0``), the same checks run on real
tensors.
"""

from __future__ import annotations

import sys
import types

import numpy as np
import pytest

import pynorm
from pynorm.errors import ArgumentError, ArrayTypeError, DTypeError
from tests.helpers import OPS, dtype, make_args, out_shape


class Foreign:
    """An array of a library pynorm does not know: DLPack only."""

    def __init__(self, a: np.ndarray, device: tuple[int, int] = (1, 0)) -> None:
        self._a = a
        self._device = device

    def __dlpack__(self, **kw):  # type: ignore[no-untyped-def]
        return self._a.__dlpack__(**kw)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._device

    @property
    def dtype(self) -> str:  # what torch shows: not a NumPy dtype
        return f"fakelib.{self._a.dtype}"

    @property
    def shape(self) -> tuple[int, ...]:
        return self._a.shape

    def reshape(self, *shape):  # type: ignore[no-untyped-def]
        raise AssertionError("pynorm called a method of the foreign array instead of importing it")

    def view(self, dt):  # type: ignore[no-untyped-def]  # the exporter's own reinterpretation (bfloat16 path)
        return Foreign(self._a.view(dt), self._device)


Foreign.__module__ = "fakelib"
sys.modules.setdefault("fakelib", types.SimpleNamespace(int16=np.int16))  # type: ignore[arg-type]


def _wrap(a):  # type: ignore[no-untyped-def]
    return None if a is None else Foreign(a)


@pytest.fixture
def numpy_only(backend):  # type: ignore[no-untyped-def]
    if backend.xp is not np:
        pytest.skip("DLPack CPU imports become NumPy arrays; the GPU path needs a CUDA exporter and a device")
    return backend


@pytest.mark.parametrize("op", sorted(OPS))
def test_every_op_reads_dlpack_inputs_zero_copy(numpy_only, op):
    backend = numpy_only
    spec = OPS[op]
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 8)).astype(np.float32)
    args = make_args(spec, x.shape, -1, np.float32, rng)
    y0, c0 = spec.forward(x, *args, backend=backend.name)
    y1, c1 = spec.forward(Foreign(x), *[_wrap(a) for a in args], backend=backend.name)
    assert type(y1) is np.ndarray and y1.tobytes() == y0.tobytes()
    x0, x1 = getattr(c0.inner, "x", None), getattr(c1.inner, "x", None)
    if x0 is not None:  # zero-copy wherever a NumPy input is
        assert np.shares_memory(x1, x) == np.shares_memory(x0, x)
    dy = rng.standard_normal(out_shape(spec, x.shape, -1, args)).astype(np.float32)
    g0 = spec.backward(dy, c0)
    g1 = spec.backward(Foreign(dy), c1)
    for a, b in zip(g0, g1, strict=True):
        assert (a is None and b is None) or np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_zero_copy_and_outputs(numpy_only):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((5, 16)).astype(np.float32)
    w = rng.standard_normal(16).astype(np.float32)
    y, ctx = pynorm.layer_norm_forward(Foreign(x), Foreign(w), backend=numpy_only.name)
    assert np.shares_memory(ctx.inner.x, x) and np.shares_memory(ctx.inner.weight, w)
    out = np.zeros_like(x)
    y2 = pynorm.layer_norm(Foreign(x), Foreign(w), out=Foreign(out), backend=numpy_only.name)
    assert np.shares_memory(y2, out) and out.tobytes() == y.tobytes()  # written in place, through DLPack


def test_non_contiguous_and_16_bit(numpy_only):
    rng = np.random.default_rng(2)
    base = rng.standard_normal((6, 40)).astype(np.float32)
    strided = base[::2, ::3]
    np.testing.assert_array_equal(
        pynorm.rms_norm(Foreign(strided), backend=numpy_only.name), pynorm.rms_norm(strided, backend=numpy_only.name)
    )
    for name in ("float16", "bfloat16"):
        x = base.astype(dtype(name))
        y = pynorm.layer_norm(Foreign(x), backend=numpy_only.name)
        assert y.dtype == x.dtype and y.tobytes() == pynorm.layer_norm(x, backend=numpy_only.name).tobytes()


def test_int8_input_of_quant_layer_norm(numpy_only):
    x = np.arange(-64, 64, dtype=np.int8).reshape(4, 32)
    q, s = pynorm.quant_layer_norm(Foreign(x), x_scale=0.1, quantize="row", backend=numpy_only.name)
    q0, s0 = pynorm.quant_layer_norm(x, x_scale=0.1, quantize="row", backend=numpy_only.name)
    assert q.tobytes() == q0.tobytes() and s.tobytes() == s0.tobytes()


def test_clear_errors():
    x = np.ones((2, 4), np.float32)
    with pytest.raises(ArrayTypeError, match=r"x lives on DLPack device type 7 \(Vulkan\)"):
        pynorm.layer_norm(Foreign(x, (7, 0)))
    with pytest.raises(ArrayTypeError, match="weight lives on DLPack device type 4"):
        pynorm.layer_norm(x, Foreign(np.ones(4, np.float32), (4, 0)))
    with pytest.raises(DTypeError, match="x must have dtype float16, bfloat16, float32 or float64, got complex64"):
        pynorm.layer_norm(Foreign(x.astype(np.complex64)))
    with pytest.raises(ArrayTypeError, match="no usable __dlpack_device__"):
        bad = Foreign(x)
        bad.__dlpack_device__ = None  # type: ignore[method-assign, assignment]
        pynorm.layer_norm(bad)
    ro = np.zeros((2, 4), np.float32)
    ro.flags.writeable = False
    with pytest.raises((ArgumentError, ArrayTypeError), match="out"):
        pynorm.layer_norm(x, out=Foreign(ro))
    with pytest.raises(ArgumentError, match="out must be writable"):
        pynorm.layer_norm(x, out=ro)


def test_pytorch_tensors_round_trip():
    """PyTorch tensors in, PyTorch tensors out (outputs and gradients, zero-copy over pynorm's results; a gradient
    of a NumPy argument stays NumPy); bfloat16 both ways; ``out=`` returned as the tensor given."""
    torch = pytest.importorskip("torch", reason="PyTorch is an optional test dependency (pip install torch==2.13.0)")
    t = torch.randn(6, 32)
    w = torch.randn(32)
    b = np.zeros(32, np.float32)
    y, ctx = pynorm.layer_norm_forward(t, w, b)
    assert np.shares_memory(ctx.inner.x, t.numpy())  # no copy on input
    assert isinstance(y, torch.Tensor) and y.dtype == torch.float32
    np.testing.assert_array_equal(y.numpy(), pynorm.layer_norm(t.numpy(), w.numpy(), b))
    ref = torch.nn.functional.layer_norm(t, (32,), w)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    g = pynorm.layer_norm_backward(torch.ones(6, 32), ctx)
    assert isinstance(g.dx, torch.Tensor) and isinstance(g.dweight, torch.Tensor) and isinstance(g.dbias, np.ndarray)
    t2 = t.clone().requires_grad_(True)
    w2 = w.clone().requires_grad_(True)
    torch.nn.functional.layer_norm(t2, (32,), w2).sum().backward()
    torch.testing.assert_close(g.dx, t2.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(g.dweight, w2.grad, rtol=1e-4, atol=1e-5)
    yb = pynorm.rms_norm(t.to(torch.bfloat16))  # bfloat16 through the exporter's int16 view, and back
    assert isinstance(yb, torch.Tensor) and yb.dtype == torch.bfloat16
    want = pynorm.rms_norm(t.to(torch.bfloat16).view(torch.int16).numpy().view(dtype("bfloat16")))
    np.testing.assert_array_equal(yb.view(torch.int16).numpy(), want.view(np.int16))
    out = torch.empty(6, 32)
    assert pynorm.layer_norm(t, w, out=out) is out
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ArrayTypeError, match="could not be imported through DLPack"):
        pynorm.layer_norm(t.requires_grad_(True))  # torch refuses to export a tensor that requires grad
