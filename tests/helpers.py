"""Test helpers: the op table every cross-cutting test iterates over, and data makers.

Adding an op to pynorm means adding one :class:`OpSpec` here; the gradient,
cross-backend, invariance and input-safety tests then cover it on every backend.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import pynorm
from pynorm import testing as _testing

DTYPES = ("float16", "bfloat16", "float32", "float64")


def dtype(name: str) -> np.dtype[Any]:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


@dataclass(frozen=True)
class OpSpec:
    """An op's entry points and parameters, for generic tests."""

    name: str
    forward: Callable[..., Any]
    backward: Callable[..., Any]
    params: tuple[str, ...]  # names of the per-feature parameters, in call order
    conventions: tuple[dict[str, Any], ...] = field(default=({},))
    centered: bool = False  # output rows have mean 0 without affine (LayerNorm)


OPS = {
    "layer_norm": OpSpec(
        "layer_norm",
        pynorm.layer_norm_forward,
        pynorm.layer_norm_backward,
        ("weight", "bias"),
        (
            {},
            {"correction": 1},
            {"eps_mode": "std"},
            {"eps_mode": "std", "correction": 1, "weight_offset": 1.0},
            {"weight_offset": 1.0, "eps": 0.1},
        ),
        centered=True,
    ),
    "rms_norm": OpSpec(
        "rms_norm",
        pynorm.rms_norm_forward,
        pynorm.rms_norm_backward,
        ("weight",),
        ({}, {"weight_offset": 1.0}, {"eps": 0.1}),
    ),
}


def make_params(spec: OpSpec, shape: tuple[int, ...], dt: Any, rng: np.random.Generator) -> list[np.ndarray]:
    """Random parameters of ``shape``: weights near 1, biases near 0."""
    out = []
    for p in spec.params:
        base = 1.0 if p == "weight" else 0.0
        out.append((base + 0.5 * rng.standard_normal(shape)).astype(dt))
    return out


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
