"""JAX interop: bfloat16 JAX arrays through DLPack (JAX arrays back), and docs/jax.md's examples
(:mod:`pynorm.jax`) under ``jit``, ``grad`` and ``vmap``. JAX is optional: the
tests that need it skip, with the reason, where it is not installed; the DLPack rule it relies on is also checked
on a stand-in exporter that needs no JAX."""

from __future__ import annotations

import importlib.util
import os
import re
import types
from pathlib import Path

import numpy as np
import pytest

import pynorm
from pynorm.errors import DTypeError

ROOT = Path(__file__).resolve().parent.parent
HAVE_JAX = importlib.util.find_spec("jax") is not None
needs_jax = pytest.mark.skipif(not HAVE_JAX, reason="JAX is an optional dependency: pip install jax to run this test")
pytestmark = pytest.mark.skipif(
    "numpy" not in os.environ.get("PYNORM_TEST_BACKENDS", "numpy").split(","),
    reason="JAX arrays are CPU arrays read by the numpy environment's tests",
)

bf16 = pytest.importorskip("ml_dtypes", reason="bfloat16 needs ml_dtypes").bfloat16


class _BF16:
    """A dtype that prints as bfloat16 (as ``jnp.bfloat16`` arrays' dtype does)."""

    name = "bfloat16"

    def __str__(self) -> str:
        return "bfloat16"


class _Bits:
    """A DLPack exporter of a bfloat16 buffer whose type's module has no ``int16`` (like jaxlib's array type):
    its ``view(int16)`` dtype is found through ``__array_namespace__()``, as JAX's is."""

    def __init__(self, a: np.ndarray, namespace: bool = True) -> None:
        self._a = a
        self.dtype = _BF16()
        self.shape = a.shape
        self._ns = namespace

    def __array_namespace__(self):
        if not self._ns:
            raise AttributeError("no namespace")
        return types.SimpleNamespace(int16=np.int16)

    def view(self, dtype):
        assert dtype is np.int16
        return self._a.view(np.uint16).view(np.int16)

    def __dlpack__(self, **kw):
        raise BufferError("bfloat16 is not exportable through DLPack to NumPy")

    def __dlpack_device__(self):
        return (1, 0)


def test_bfloat16_through_the_array_namespace_without_jax():
    x = np.random.default_rng(0).standard_normal((3, 16)).astype(bf16)
    w = np.ones(16, bf16)
    y = pynorm.rms_norm(_Bits(x), w, backend="numpy")
    want = pynorm.rms_norm(x, w, backend="numpy")
    assert y.dtype == want.dtype and np.array_equal(y.view(np.uint16), want.view(np.uint16))
    with pytest.raises(DTypeError, match="x is bfloat16.*view\\(int16\\)"):
        pynorm.rms_norm(_Bits(x, namespace=False), w, backend="numpy")


def _recipe() -> dict:
    """The python blocks of docs/jax.md, run in order in one namespace (as tests/test_docs.py runs a page)."""
    ns: dict = {"__name__": "docs_jax"}
    text = (ROOT / "docs" / "jax.md").read_text(encoding="utf-8")
    for block in re.findall(r"```python\n(.*?)```", text, re.S):
        exec(compile(block, "docs/jax.md", "exec"), ns)
    return ns


@needs_jax
def test_bfloat16_jax_arrays_through_dlpack():
    import jax.numpy as jnp

    x = np.random.default_rng(1).standard_normal((4, 32)).astype(bf16)
    w = (1 + 0.5 * np.random.default_rng(2).standard_normal(32)).astype(bf16)
    b = np.zeros(32, bf16)
    got = pynorm.layer_norm(jnp.asarray(x), jnp.asarray(w), jnp.asarray(b), backend="numpy")
    assert isinstance(got, jnp.ndarray) and got.dtype == jnp.bfloat16  # JAX in, JAX out
    want = pynorm.layer_norm(x, w, b, backend="numpy")
    assert np.array_equal(np.asarray(got).view(np.uint16), want.view(np.uint16))


@needs_jax
def test_the_pages_examples_under_jit_grad_and_vmap():
    """docs/jax.md's examples: the model trains under jit(value_and_grad), vmap's per-example gradients are the
    one-by-one ones, and pynorm.jax's LayerNorm under jit and grad equals the NumPy API's on the same values."""
    import jax
    import jax.numpy as jnp

    ns = _recipe()
    assert float(ns["value"]) < float(ns["first"])
    pj, w, xb = ns["pj"], ns["w"], ns["xb"]
    f = jax.grad(lambda w, xi: jnp.sum(pj.rms_norm(xi, w) ** 3))
    one_by_one = np.stack([np.asarray(f(w, xb[i])) for i in range(xb.shape[0])])
    np.testing.assert_array_equal(np.asarray(ns["per_example"]), one_by_one)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 40)).astype(np.float32)
    w = (1 + 0.5 * rng.standard_normal(40)).astype(np.float32)
    b = (0.5 * rng.standard_normal(40)).astype(np.float32)
    dy = rng.standard_normal((6, 40)).astype(np.float32)
    y = jax.jit(lambda x, w, b: pj.layer_norm(x, w, b))(x, w, b)
    np.testing.assert_array_equal(np.asarray(y), pynorm.layer_norm(x, w, b))
    grads = jax.grad(lambda x, w, b: jnp.sum(pj.layer_norm(x, w, b) * dy), argnums=(0, 1, 2))(x, w, b)
    _, ctx = pynorm.layer_norm_forward(x, w, b)
    for g, r in zip(grads, pynorm.layer_norm_backward(dy, ctx), strict=True):
        np.testing.assert_array_equal(np.asarray(g), r)
    # the documented check of a JAX RMSNorm: float64 computed in float32 (no x64) is named, per dtype
    report = ns["report"]
    codes = {d.code: set(d.dtypes) or {c.split()[0] for c in d.cells} for d in report.diagnoses}
    if not jax.config.jax_enable_x64:
        assert codes.get("wrong_dtype") == {"float64"} and codes.get("float32_math") == {"float64"}, str(report)
    assert all(r.verdict == "pass" for r in report.results if r.cell.dtype != "float64"), str(report)
