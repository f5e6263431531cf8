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


def assert_close_scaled(actual: Any, expected: Any, scale: Any, rtol: float, what: str = "") -> None:
    """``|actual - expected| <= rtol * scale`` elementwise (``scale`` the magnitude of the terms)."""
    a = np.asarray(actual).astype(np.float64)
    e = np.asarray(expected).astype(np.float64)
    s = np.asarray(scale, dtype=np.float64)
    err = np.abs(a - e)
    bad = ~(err <= rtol * s + 1e-300)
    if bad.any():
        i = np.unravel_index(int(np.argmax(np.where(bad, err / (s + 1e-300), -1))), a.shape)
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {a.size} elements differ by more than rtol={rtol:g} of their scale; "
            f"worst at {i}: actual {a[i]!r}, expected {e[i]!r}, scale {np.broadcast_to(s, a.shape)[i]!r}"
        )


# tolerance (relative to the magnitude of the terms) of a fast backend vs the reference
BACKEND_RTOL = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 4e-6, "float64": 1e-12}


def _weff(params: dict[str, Any], conv: dict[str, Any], h: int) -> np.ndarray:
    w = params.get("weight")
    if w is None:
        return np.ones(h)
    return np.asarray(w, dtype=np.float64).reshape(h) + conv.get("weight_offset", 0.0)


def term_scales(
    op: str, x2: np.ndarray, params: dict[str, Any], dy2: np.ndarray, conv: dict[str, Any]
) -> dict[str, Any]:
    """Magnitude of the terms each output is computed from (float64, ``(R, H)`` inputs).

    The fair yardstick for comparing two implementations: a result that is a
    small difference of large terms can only be as accurate as those terms.
    """
    wide = np.longdouble  # float64 squares of huge float64 inputs would overflow
    x = x2.astype(wide)
    dy = dy2.astype(wide)
    h = x.shape[1]
    w = _weff(params, conv, h).astype(wide)
    g = np.abs(dy * w)
    eps = conv.get("eps", 1e-5 if op == "layer_norm" else 1e-6)
    if op == "layer_norm":
        n = h - conv.get("correction", 0)
        d = x - x.mean(axis=1, keepdims=True)
        s = np.sqrt((d * d).sum(axis=1, keepdims=True) / n)
        std_mode = conv.get("eps_mode", "var") == "std"
        with np.errstate(divide="ignore", invalid="ignore"):
            r = 1 / (s + eps) if std_mode else 1 / np.sqrt(s * s + eps)
            k = np.where(s > 0, 1 / (s * r), 0.0) if std_mode else 1.0
        xhat = np.abs(d * r)
        b = params.get("bias")
        bias = 0 if b is None else np.abs(np.asarray(b, dtype=np.float64).reshape(h))
        dx = r * (g + g.mean(axis=1, keepdims=True) + xhat * (g * xhat).sum(axis=1, keepdims=True) * k / n)
        out = {
            "y": xhat * np.abs(w) + bias,
            "dx": dx,
            "dweight": np.abs(dy * xhat).sum(axis=0),
            "dbias": np.abs(dy).sum(axis=0),
        }
    elif op == "rms_norm":
        r = 1 / np.sqrt((x * x).mean(axis=1, keepdims=True) + eps)
        xhat = np.abs(x * r)
        dx = r * (g + xhat * (g * xhat).mean(axis=1, keepdims=True))
        out = {"y": xhat * np.abs(w), "dx": dx, "dweight": np.abs(dy * xhat).sum(axis=0)}
    else:
        raise KeyError(op)
    return {k: np.asarray(v, dtype=np.float64) for k, v in out.items()}


def make_rows(kind: str, shape: tuple[int, ...], dt: Any, rng: np.random.Generator) -> np.ndarray:
    """Inputs of a given difficulty: normal, offset (1e4 + N(0,1)), huge, tiny, constant rows."""
    n = rng.standard_normal(shape)
    if kind == "normal":
        a = n
    elif kind == "offset":
        a = 1e4 + n if dtype(dt).itemsize >= 4 else 100 + n
    elif kind == "huge":
        big = float(np.finfo(np.float16).max if dtype(dt) == np.float16 else 1e38 if dtype(dt).itemsize <= 4 else 1e307)
        a = np.clip(n, -1.0, 1.0) * big * 0.9
    elif kind == "tiny":
        a = n * (1e-30 if dtype(dt).itemsize >= 4 and dtype(dt).name != "float16" else 1e-4)
    elif kind == "constant":
        a = np.broadcast_to(rng.standard_normal((*shape[:-1], 1)) * 3, shape).copy()
    else:
        raise KeyError(kind)
    return a.astype(dtype(dt))
