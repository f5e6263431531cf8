"""Shared fixtures: the ``backend`` fixture runs a test on every available backend.

``PYNORM_TEST_BACKENDS`` (comma-separated names) narrows the set; a named backend
that is unavailable here is reported as a skip with the registry's reason, never
silently dropped. The ``numpy`` reference backend is always the oracle.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from . import cuda_cpu

if cuda_cpu.requested():  # the cuda_cpu tox env: CuPy's kernels on the CPU execution harness
    _reason = cuda_cpu.unavailable_reason()
    if _reason is None:
        cuda_cpu.install()
    else:
        import warnings

        warnings.warn(f"PYNORM_CUDA_CPU=1 but the CPU execution harness cannot run here: {_reason}", stacklevel=1)

import pynorm
from pynorm import _registry

settings.register_profile(
    "ci",
    max_examples=100,
    derandomize=True,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(
    "dev",
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


@dataclass(frozen=True)
class BackendUnderTest:
    """A backend plus the conversions a test needs to feed it NumPy data."""

    name: str
    asarray: Callable[[Any], Any]
    to_numpy: Callable[[Any], np.ndarray]
    xp: Any

    @property
    def ops(self) -> tuple[str, ...]:
        """The ops this backend implements."""
        return _registry.backend_ops(self.name)

    def forward(self, fn: Callable[..., Any], **kw: Any) -> Callable[..., Any]:
        """Wrap ``op_forward`` to take and return NumPy arrays (for :func:`pynorm.testing.check_grads`)."""

        def f(*args: Any) -> Any:
            y, ctx = fn(*[None if a is None else self.asarray(a) for a in args], backend=self.name, **kw)
            return self.to_numpy(y), ctx

        return f

    def backward(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def b(dy: Any, ctx: Any) -> list[Any]:
            return [None if g is None else self.to_numpy(g) for g in fn(self.asarray(dy), ctx)]

        return b


def _or_none(convert: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``convert``, passing None (an absent optional argument) through."""
    return lambda a: None if a is None else convert(a)


def _make(name: str) -> BackendUnderTest:
    b = _registry.get_backend(name)
    if b.array_module == "numpy":
        return BackendUnderTest(name, _or_none(np.asarray), _or_none(np.asarray), np)
    if b.array_module == "cupy":
        import cupy

        return BackendUnderTest(name, _or_none(cupy.asarray), _or_none(cupy.asnumpy), cupy)
    raise RuntimeError(f"no test adapter for backend {name!r} serving {b.array_type_name}")


def _selected() -> list[str]:
    env = os.environ.get("PYNORM_TEST_BACKENDS")
    if env:
        return [n.strip() for n in env.split(",") if n.strip()]
    return [b.name for b in pynorm.list_backends()]


def _params() -> list[Any]:
    out = []
    for name in _selected():
        reason = _registry.unavailable_reason(name)
        marks = [pytest.mark.skip(reason=f"backend {name!r} unavailable: {reason}")] if reason else []
        out.append(pytest.param(name, marks=marks, id=name))
    return out


@pytest.fixture(params=_params())
def backend(request: pytest.FixtureRequest) -> BackendUnderTest:
    """Each selected backend in turn (skipped, with the reason, where unavailable).

    A test parametrized by ``op`` is skipped, saying so, for an op the backend does not implement
    (``tests/test_registry.py`` checks separately which ops every backend must implement).
    """
    b = _make(request.param)
    params = getattr(getattr(request.node, "callspec", None), "params", {})
    op = params.get("op", getattr(params.get("spec"), "name", None))
    if isinstance(op, str) and op not in b.ops:
        pytest.skip(f"backend {b.name!r} does not implement {op!r}")
    return b


def pytest_report_header(config: pytest.Config) -> list[str]:
    lines = [f"pynorm backends under test: {', '.join(_selected())}"]
    for info in pynorm.list_backends():
        state = "available" if info.available else f"unavailable ({info.reason})"
        lines.append(f"  {info.name:6s} {info.array_type:14s} priority {info.priority:3d} {state}")
    lines.append(f"python {sys.version.split()[0]}, numpy {np.__version__}")
    return lines


@pytest.fixture(autouse=True)
def _numba_spans_on_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every numba call of two tasks or more runs on the thread pool (``SERIAL_THRESHOLD = 0``), whatever its size:
    the tests' arrays are small, and would otherwise all take the one-thread path, leaving the kernels' spans
    that do not start at task 0 untested. ``test_serial_threshold_path_matches_parallel`` covers the one-thread
    path. (Importing ``pynorm.backends.numba._threads`` does not import numba.)"""
    from pynorm.backends.numba import _threads

    monkeypatch.setattr(_threads, "SERIAL_THRESHOLD", 0)


@pytest.fixture
def real_thresholds() -> Iterator[None]:
    """The numba backend as a user's process runs it, for tests of behaviour at the real thresholds: the default
    serial threshold (not the suite's 0) and two threads; both restored after the test."""
    pytest.importorskip("numba", reason="numba is not installed: the numba backend is unavailable")
    from pynorm.backends.numba import _threads

    saved, threads = _threads.SERIAL_THRESHOLD, _threads.get_num_threads()
    _threads.SERIAL_THRESHOLD = _threads.DEFAULT_SERIAL_THRESHOLD
    try:
        _threads.set_num_threads(2)
        yield
    finally:
        _threads.SERIAL_THRESHOLD = saved
        _threads.set_num_threads(threads)
