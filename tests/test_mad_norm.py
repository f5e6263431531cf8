"""A new statistic defined at run time, proven: ``docs/examples/mad_norm.py`` -- mean absolute deviation, whose
backward needs a row sum of its own (``sum sign(x - mean)``) -- is its record, its numba pieces, a spec and a
reference in one file. Added with :func:`pynorm.add_op`, it runs pynorm's generic suites on the backend under test
(numpy and numba: every launch path forced, batch-invariant rows; the cupy backend declines it, its record naming
no CUDA policy), with no kernel file touched.

On numba the generic suites run the example in float32 and float16 (:data:`NUMBA_DTYPES`): its kernels compile
per dtype and per path, and bfloat16 and float64 -- the same generated code over other storage and math types,
which the built-in statistics run in every dtype -- would add about two minutes of compilation to CI. The numpy
backend runs all four dtypes.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

import pynorm

from . import helpers, test_backends, test_gradients, test_paths, test_validation

EXAMPLE = Path(__file__).resolve().parents[1] / "docs" / "examples" / "mad_norm.py"
MODULE = "pynorm_example_mad_norm"
OP = "mad_norm"


@pytest.fixture(scope="module")
def example() -> Iterator[ModuleType]:
    mod = helpers.load_example(EXAMPLE, MODULE)
    mod.add()
    helpers.OPS[OP] = helpers.OpSpec(mod.SPEC)
    try:
        yield mod
    finally:
        del helpers.OPS[OP]
        mod.remove()
        del sys.modules[MODULE]


#: the dtypes the generic suites run the example in on numba (see the module doc)
NUMBA_DTYPES = ("float32", "float16")


@pytest.fixture(autouse=True)
def _numba_dtypes(request, monkeypatch) -> None:
    """On numba, the generic suites' dtypes narrowed to :data:`NUMBA_DTYPES` (they read ``test_backends.DTYPES``
    when they run)."""
    backend = request.getfixturevalue("backend") if "backend" in request.fixturenames else None
    if backend is not None and backend.name == "numba":
        monkeypatch.setattr(test_backends, "DTYPES", NUMBA_DTYPES)


def _on(backend) -> None:
    if backend.name == "cupy":
        assert backend.name not in pynorm.list_ops()[OP]
        pytest.skip("the statistic's record names no CUDA policy: the cupy backend does not offer mad_norm")
    if backend.name not in pynorm.list_ops()[OP]:
        pytest.fail(f"backend {backend.name!r} does not serve {OP}: its record names numba pieces")


def test_served_where_its_record_says(example) -> None:
    served = pynorm.list_ops()[OP]
    assert "numpy" in served and "cupy" not in served
    try:
        import numba  # noqa: F401
    except ImportError:
        return
    assert "numba" in served


def test_the_math_against_a_restatement(example) -> None:
    """Forward and backward against an independent float64 statement, its gradient by central differences."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((3, 9)) * 2 + 1
    w, b, dy = rng.uniform(0.5, 2, 9), rng.standard_normal(9), rng.standard_normal((3, 9))
    eps = 0.1

    def f(x_: np.ndarray) -> np.ndarray:
        d = x_ - x_.mean(axis=1, keepdims=True)
        return w * d / (np.abs(d).mean(axis=1, keepdims=True) + eps) + b

    y, ctx = pynorm.mad_norm_forward(x, w, b, eps=eps, backend="numpy")  # type: ignore[attr-defined]
    np.testing.assert_allclose(y, f(x), rtol=1e-13)
    dx = pynorm.mad_norm_backward(dy, ctx).dx  # type: ignore[attr-defined]
    num = np.zeros_like(x)
    for i in np.ndindex(x.shape):
        e = np.zeros_like(x)
        e[i] = 1e-6
        num[i] = ((f(x + e) - f(x - e)) * dy).sum() / 2e-6
    np.testing.assert_allclose(dx, num, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("kind", test_backends.KINDS)
def test_matches_reference_on_hard_inputs(example, backend, kind) -> None:
    _on(backend)
    for dt in test_backends.DTYPES:
        test_backends.test_matches_reference_on_hard_inputs(backend, OP, kind, dt)


def test_matches_reference_on_layouts_buffers_and_conventions(example, backend, monkeypatch) -> None:
    _on(backend)
    test_backends.test_matches_reference_every_convention(backend, OP)
    for layout in ("fortran", "strided", "transposed"):
        test_backends.test_non_contiguous_inputs(backend, OP, layout)
    test_backends.test_inputs_unchanged_and_outputs_fresh(backend, OP)
    test_backends.test_out_buffers(backend, OP)
    test_backends.test_zero_rows(backend, OP)
    test_backends.test_long_rows_on_each_backward_path(backend, OP, 1000, "auto", monkeypatch)


@pytest.mark.parametrize("affine", [True, False], ids=["affine", "plain"])
def test_grads_match_finite_differences(example, backend, affine) -> None:
    _on(backend)
    spec = helpers.OPS[OP]
    for conv in spec.conventions:
        test_gradients.test_grads_match_finite_differences(backend, spec, conv, affine)


def test_bad_input_is_a_clear_error(example, backend) -> None:
    _on(backend)
    test_validation.test_weight_shape(backend, OP)
    for eps in (-1e-5, float("nan"), "1e-5"):
        test_validation.test_bad_eps(backend, OP, eps)
    test_validation.test_dy_dtype_and_shape(backend, OP)


@pytest.mark.parametrize("dt", ["float32", "float16"])
def test_rows_do_not_depend_on_the_batch(example, backend, dt) -> None:
    _on(backend)
    test_paths.test_rows_do_not_depend_on_the_batch(backend, OP, dt)


def test_every_launch_path(example) -> None:
    """Every numba path forced at small sizes: the plain path's bits (the slow path: the reference's values), every
    path taken but the rows path, which the statistic's record does not claim -- the generic test of the built-in
    statistics, on this one."""
    pytest.importorskip("numba")
    assert not example.RECORD.rows_path
    test_paths.test_every_launch_path_gives_the_plain_bits(test_paths._make_backend("numba"), OP)


def test_rows_do_not_depend_on_the_batch_where_the_builtins_take_the_rows_path(example, real_thresholds) -> None:
    """At the real thresholds, a batch the built-in statistics' backward takes by the rows path (96 rows of 16384
    elements: fewer than 128 rows of 2^20 elements or more) goes down the fused path for this statistic, whose
    record does not claim the rows path (its sums loop, compiled without the partials' stores, vectorized in
    another order and gave dx within rounding, not bitwise): each row's dx is the bits of the row alone."""
    from pynorm.backends.numba import _paths

    rng = np.random.default_rng(31)
    x = (rng.standard_normal((96, 16384)) * 2 + 0.5).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(x.shape[1])).astype(np.float32)

    def dx(lo: int, hi: int) -> np.ndarray:
        _, ctx = pynorm.mad_norm_forward(x[lo:hi], w, backend="numba")  # type: ignore[attr-defined]
        return pynorm.mad_norm_backward(dy[lo:hi], ctx).dx  # type: ignore[attr-defined]

    with _paths.recording() as seen:
        whole = dx(0, 96)
    assert "fused" in seen and "rows" not in seen, f"the whole batch took {sorted(seen)}"
    for lo, hi in [(0, 1), (5, 8), (40, 96)]:
        np.testing.assert_array_equal(dx(lo, hi), whole[lo:hi], err_msg=f"rows {lo}:{hi} alone")


def test_the_example_runs_as_a_script() -> None:
    import os
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(EXAMPLE.parents[2]), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    lines = out.stdout.strip().splitlines()
    assert lines and all("mean |y| per row: [1." in line for line in lines), out.stdout + out.stderr
    assert lines[-1].startswith("numpy")
