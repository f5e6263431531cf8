"""Test helpers: the op table every cross-cutting test iterates over, and data makers.

The op table is built from :data:`pynorm.ops.SPECS`: adding an op's spec to pynorm makes the
gradient, cross-backend, invariance and input-safety tests cover it on every backend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import pynorm
from pynorm import ops
from pynorm import testing as _testing

DTYPES = ("float16", "bfloat16", "float32", "float64")


def dtype(name: str) -> np.dtype[Any]:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


@dataclass(frozen=True)
class OpSpec:
    """An op of :data:`pynorm.ops.SPECS` as the generic tests use it (entry points looked up by name)."""

    spec: ops.OpSpec

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def forward(self) -> Callable[..., Any]:
        return getattr(pynorm, f"{self.name}_forward")  # type: ignore[no-any-return]

    @property
    def backward(self) -> Callable[..., Any]:
        return getattr(pynorm, f"{self.name}_backward")  # type: ignore[no-any-return]

    @property
    def params(self) -> tuple[str, ...]:
        return self.spec.param_names

    @property
    def conventions(self) -> tuple[dict[str, Any], ...]:
        return self.spec.cases

    @property
    def centered(self) -> bool:
        """Output rows have mean 0 without affine (the centred statistic: LayerNorm)."""
        return self.spec.variant.statistic == "centered"


#: the one op table of the tests: every op pynorm has, from its spec
OPS = {name: OpSpec(s) for name, s in ops.SPECS.items()}


def make_params(spec: OpSpec, shape: tuple[int, ...], dt: Any, rng: np.random.Generator) -> list[np.ndarray]:
    """Random parameters of ``shape`` around each parameter's initial value (weights near 1, biases near 0)."""
    return [(p.init + 0.5 * rng.standard_normal(shape)).astype(dt) for p in spec.spec.params]


def assert_close_scaled(actual: Any, expected: Any, scale: Any, rtol: float, what: str = "", dtype: Any = None) -> None:
    """``|actual - expected| <= rtol * scale + spacing`` elementwise (``scale`` the magnitude of the terms).

    ``spacing`` is the smallest subnormal of ``actual``'s dtype: one ulp in the subnormal range,
    where the spacing of representable values no longer shrinks with the value. Two correct
    one-rounding results (a kernel's float32 value and the reference's float64 value, each
    rounded once to float16) may differ by that full spacing when they straddle a rounding
    boundary, however small ``rtol * scale`` is there (float16 gradients near 6e-6, e.g.).
    ``dtype``: the dtype the results were rounded to (default: ``actual``'s).
    """
    a_in = np.asarray(actual)
    a = a_in.astype(np.float64)
    e = np.asarray(expected).astype(np.float64)
    s = np.asarray(scale, dtype=np.float64)
    dt = np.dtype(a_in.dtype if dtype is None else dtype)
    spacing = float(_testing.finfo(dt).smallest_subnormal) if dt.kind == "f" or dt.name == "bfloat16" else 0.0
    with np.errstate(invalid="ignore"):
        err = np.where(a == e, 0.0, np.abs(a - e))  # equal infinities agree
    bad = ~(err <= rtol * s + max(spacing, 1e-300))
    if bad.any():
        i = np.unravel_index(int(np.argmax(np.where(bad, err / (s + 1e-300), -1))), a.shape)
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {a.size} elements differ by more than rtol={rtol:g} of their scale; "
            f"worst at {i}: actual {a[i]!r}, expected {e[i]!r}, scale {np.broadcast_to(s, a.shape)[i]!r}"
        )


# tolerance (relative to the magnitude of the terms) of a fast backend vs the reference
BACKEND_RTOL = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 4e-6, "float64": 1e-12}


term_scales = _testing.term_scales
make_rows = _testing.make_input
