"""The guide's worked example, proven: ``docs/examples/l2_norm.py`` (``docs/adding_an_op.md``, section 8) -- a spec
and a reference in one file, of a combination of kernel-family choices no built-in op has -- added at run time
with :func:`pynorm.add_op`, then run through pynorm's generic test suites on the backend under test (numpy, numba,
and cupy on the CPU execution harness in CI): the same functions the suites run for every built-in op.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

import pynorm
from pynorm.errors import UnknownOpError
from pynorm.ops import SPECS, OpSpec, StatsVariant
from pynorm.ops.families import FamilyError

from . import helpers, test_backends, test_gradients, test_validation

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "examples" / "l2_norm.py"
MODULE = "pynorm_example_l2_norm"


@pytest.fixture(scope="module")
def example() -> Iterator[ModuleType]:
    """The example module, its op added (and the generic suites' op table holding it) for this module's tests."""
    mod = helpers.load_example(EXAMPLE, MODULE)
    pynorm.add_op(mod.SPEC)
    helpers.OPS["l2_norm"] = helpers.OpSpec(mod.SPEC)
    try:
        yield mod
    finally:
        del helpers.OPS["l2_norm"]
        pynorm.remove_op("l2_norm")
        del sys.modules[MODULE]


def _on(backend) -> None:
    if backend.name not in pynorm.list_ops()["l2_norm"]:
        pytest.fail(f"backend {backend.name!r} does not serve the example op: its family's kernels should")


def test_every_backend_serves_it(example) -> None:
    # numba specialises its kernels on the variant; cupy compiles the policies' instantiation on first use
    assert pynorm.list_ops()["l2_norm"] == ["cupy", "numba", "numpy"]
    assert SPECS["l2_norm"] is example.SPEC
    y = pynorm.l2_norm(np.ones((2, 4)), backend="numpy")  # type: ignore[attr-defined]
    np.testing.assert_allclose(y, 0.5)


@pytest.mark.parametrize("kind", test_backends.KINDS)
def test_matches_reference_on_hard_inputs(example, backend, kind) -> None:
    _on(backend)
    for dt in test_backends.DTYPES:
        test_backends.test_matches_reference_on_hard_inputs(backend, "l2_norm", kind, dt)


def test_matches_reference_on_layouts_buffers_and_conventions(example, backend, monkeypatch) -> None:
    _on(backend)
    test_backends.test_matches_reference_every_convention(backend, "l2_norm")
    for layout in ("fortran", "strided", "transposed"):
        test_backends.test_non_contiguous_inputs(backend, "l2_norm", layout)
    test_backends.test_inputs_unchanged_and_outputs_fresh(backend, "l2_norm")
    test_backends.test_out_buffers(backend, "l2_norm")
    test_backends.test_zero_rows(backend, "l2_norm")
    test_backends.test_long_rows_on_each_backward_path(backend, "l2_norm", 1000, "auto", monkeypatch)


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
def test_grads_match_finite_differences(example, backend, affine) -> None:
    _on(backend)
    spec = helpers.OPS["l2_norm"]
    for conv in spec.conventions:
        test_gradients.test_grads_match_finite_differences(backend, spec, conv, affine)
    test_gradients.test_broadcast_parameter_gradient_is_reduced(backend, "l2_norm")


def test_bad_input_is_a_clear_error(example, backend) -> None:
    _on(backend)
    test_validation.test_weight_shape(backend, "l2_norm")
    for axis in (2, -3, 1.0, True, "1"):
        test_validation.test_bad_axis(backend, "l2_norm", axis)
    for eps in (-1e-5, float("nan"), float("inf"), "1e-5", None, True):
        test_validation.test_bad_eps(backend, "l2_norm", eps)
    for dt in (np.int32, np.complex64, np.bool_):
        test_validation.test_unsupported_x_dtype(backend, "l2_norm", dt)
    test_validation.test_unsupported_weight_dtype(backend, "l2_norm")
    test_validation.test_dy_dtype_and_shape(backend, "l2_norm")
    test_validation.test_zero_dim_and_empty_normalized_dims(backend, "l2_norm")
    test_validation.test_bad_out_buffers(backend, "l2_norm")


def test_the_math_is_the_example_s(example) -> None:
    """Against a restatement in float64 (not the example's code): y = w x / max(|x|, eps), and the floor branch."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 7))
    w = rng.uniform(0.5, 2, 7)
    x[2] *= 1e-7  # below eps = 1e-5: the floor branch
    norm = np.linalg.norm(x, axis=1, keepdims=True)
    want = w * x / np.maximum(norm, 1e-5)
    np.testing.assert_allclose(pynorm.l2_norm(x, w, backend="numpy"), want, rtol=1e-14)  # type: ignore[attr-defined]
    root = w * x / np.sqrt(norm**2 + 1e-5)
    got = pynorm.l2_norm(x, w, eps_mode="root", backend="numpy")  # type: ignore[attr-defined]
    np.testing.assert_allclose(got, root, rtol=1e-14)


def test_add_op_refuses_and_undoes(example) -> None:
    with pytest.raises(ValueError, match="exists already"):
        pynorm.add_op(SPECS["layer_norm"])
    with pytest.raises(ValueError, match="built-in"):
        pynorm.remove_op("layer_norm")
    with pytest.raises(TypeError, match="OpSpec"):
        pynorm.ops.register("l2_norm")  # type: ignore[arg-type]
    # a spec that does not fit its family is refused when it is made, naming what is missing
    with pytest.raises(FamilyError, match="'eps'"):
        OpSpec(
            name="no_eps",
            params=example.SPEC.params,
            options=(),
            grads=example.L2NormGrads,
            ctx=example.L2NormCtx,
            reference=MODULE,
            family="stats",
            variant=StatsVariant("l2", affine="vector"),
            term_scales=example.term_scales,
        )
    # removed: no public function, and the registry no longer answers for it
    pynorm.add_op(dataclasses.replace(example.SPEC, name="l2_norm_copy"))
    assert pynorm.l2_norm_copy(np.ones((1, 4)), backend="numpy").shape == (1, 4)  # type: ignore[attr-defined]
    pynorm.remove_op("l2_norm_copy")
    assert not hasattr(pynorm, "l2_norm_copy") and "l2_norm_copy" not in pynorm.list_ops()
    with pytest.raises(UnknownOpError):
        pynorm.ops.get("l2_norm_copy")


def test_the_example_runs_as_a_script() -> None:
    """``python docs/examples/l2_norm.py``, as the guide says: the op added in ``__main__``, run on every available
    backend that serves it; each prints unit row norms of ``y / w``."""
    import subprocess

    out = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=600, check=True)
    lines = out.stdout.strip().splitlines()
    assert lines and all("row norms of y/w: [1. 1. 1. 1.]" in line for line in lines), out.stdout + out.stderr
    assert lines[-1].startswith("numpy")
