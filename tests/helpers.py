"""Test helpers: the op table every cross-cutting test iterates over, and data makers.

The op table is built from :data:`pynorm.ops.SPECS`: adding an op's spec to pynorm makes the
gradient, cross-backend, invariance and input-safety tests cover it on every backend.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import pynorm
from pynorm import ops
from pynorm import testing as _testing
from pynorm.ops import families

DTYPES = ("float16", "bfloat16", "float32", "float64")


def dtype(name: str) -> np.dtype[Any]:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


@dataclass(frozen=True)
class OpSpec:
    """An op of :data:`pynorm.ops.SPECS` as the generic tests use it (entry points looked up by name).

    ``forward(x, *args, **kw) -> (y, ctx)`` with ``args`` the op's extra inputs then its parameters
    (:func:`make_args`); for an op with several outputs it returns the first (``y``) -- the others
    and their upstream gradients are covered by the op's own tests. ``backward(dy, ctx)`` returns
    ``(dx, d<input>..., d<param>...)``.
    """

    spec: ops.OpSpec

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def forward(self) -> Callable[..., Any]:
        f = self.spec.generic_forward()
        if len(self.spec.outputs) == 1:
            return f  # type: ignore[no-any-return]

        def first_output(*args: Any, **kw: Any) -> Any:
            outs, ctx = f(*args, **kw)
            return (outs[0] if isinstance(outs, tuple) else outs), ctx

        return first_output

    @property
    def backward(self) -> Callable[..., Any]:
        return getattr(pynorm, f"{self.name}_backward")  # type: ignore[no-any-return]

    @property
    def params(self) -> tuple[str, ...]:
        return self.spec.param_names

    @property
    def arg_names(self) -> tuple[str, ...]:
        """Names of what follows ``x`` in a call: the extra inputs, then the parameters."""
        return (*self.spec.input_names, *self.spec.param_names)

    @property
    def grad_names(self) -> tuple[str, ...]:
        return self.spec.grad_names

    @property
    def conventions(self) -> tuple[dict[str, Any], ...]:
        return self.spec.cases

    @property
    def centered(self) -> bool:
        """Output rows have mean 0 without affine (a statistic centring the row: LayerNorm; its family record)."""
        statistic = getattr(self.spec.variant, "statistic", None)
        return statistic is not None and families.STATISTICS[statistic].mean

    @property
    def differentiable(self) -> tuple[bool, ...]:
        """Per argument after ``x``: whether a gradient check perturbs it (not integer indices)."""
        return (*(i.differentiable for i in self.spec.inputs), *(True for _ in self.spec.params))

    def without_optional(self, args: list[Any]) -> list[Any]:
        """``args`` with every optional parameter set to None (inputs and required parameters kept)."""
        n = len(self.spec.inputs)
        return [*args[:n], *(a if p.required else None for p, a in zip(self.spec.params, args[n:], strict=True))]


#: the one op table of the tests: every op pynorm has, from its spec
#: (the ops of the ``"rows"`` layout: the ``"channels"`` ones -- GroupNorm, InstanceNorm, BatchNorm -- read ``x`` as
#: ``(N, C, *spatial)`` and have their generic suite in ``tests/test_channel_norms.py``)
OPS = {name: OpSpec(s) for name, s in ops.SPECS.items() if s.layout == "rows"}
#: the ops of the ``"channels"`` layout
CHANNEL_OPS = {name: OpSpec(s) for name, s in ops.SPECS.items() if s.layout == "channels"}

#: modalities of the table parameters the tests make
N_MODALITIES = 3


def make_params(
    spec: OpSpec, shape: tuple[int, ...], dt: Any, rng: np.random.Generator, options: Any = None
) -> list[np.ndarray]:
    """Random parameters for normalized dims ``shape`` (:meth:`pynorm.ops.OpSpec.example_params`)."""
    return spec.spec.example_params(shape, dt, rng, N_MODALITIES, options)


def make_inputs(
    spec: OpSpec, x_shape: tuple[int, ...], axis: int, dt: Any, rng: np.random.Generator, options: Any = None
) -> list[Any]:
    """Random extra inputs of an op (:meth:`pynorm.ops.OpSpec.example_inputs`)."""
    return spec.spec.example_inputs(x_shape, axis, dt, rng, N_MODALITIES, options)


def make_args(
    spec: OpSpec,
    x_shape: tuple[int, ...],
    axis: int,
    dt: Any,
    rng: np.random.Generator,
    pdt: Any = None,
    options: Any = None,
) -> list[Any]:
    """The extra inputs then the parameters of an op (parameters in ``pdt``, default ``dt``); ``options``:
    the op's options the arguments are for (the shapes of some depend on them: ``shift=False``)."""
    ax = axis % len(x_shape)
    return [
        *make_inputs(spec, x_shape, ax, dt, rng, options),
        *make_params(spec, x_shape[ax:], dt if pdt is None else pdt, rng, options),
    ]


def out_shape(spec: OpSpec, x_shape: tuple[int, ...], axis: int, args: list[Any]) -> tuple[int, ...]:
    """Shape of the op's first output for ``x`` of ``x_shape`` and ``args`` (x's shape but for a fused Linear)."""
    return spec.spec.output_shape(tuple(x_shape), axis, dict(zip(spec.arg_names, args, strict=True)))


def flat_arrays(spec: OpSpec, x_shape: tuple[int, ...], axis: int, args: list[Any]) -> dict[str, Any]:
    """The extra inputs and parameters by name, flattened as backends see them (for ``term_scales``)."""
    ax = axis % len(x_shape)
    rows, h = int(np.prod(x_shape[:ax])), int(np.prod(x_shape[ax:]))
    out: dict[str, Any] = {}
    for i, a in zip(spec.spec.inputs, args, strict=False):
        if a is None:
            out[i.name] = None
        elif i.kind == "cond":
            out[i.name] = np.asarray(a).reshape(-1, a.shape[-1])
        else:
            out[i.name] = np.asarray(a).reshape(rows, h) if i.kind == "like_x" else np.asarray(a).reshape(rows)
    for p, a in zip(spec.spec.params, args[len(spec.spec.inputs) :], strict=True):
        if a is None:
            out[p.name] = None
        elif p.kind in ("matrix", "vector"):
            out[p.name] = np.asarray(a)
        elif p.kind == "table":
            out[p.name] = np.asarray(a).reshape(a.shape[0], h)
        elif p.kind == "scalar":
            out[p.name] = np.asarray(a).reshape(1)
        else:
            out[p.name] = np.broadcast_to(np.asarray(a), x_shape[ax:]).reshape(h)
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
        err = np.where((a == e) | (np.isnan(a) & np.isnan(e)), 0.0, np.abs(a - e))  # equal infinities, NaN and NaN
    bad = ~(err <= rtol * s + max(spacing, 1e-300))
    if bad.any():
        i = np.unravel_index(int(np.argmax(np.where(bad, err / (s + 1e-300), -1))), a.shape)
        si = float(np.broadcast_to(s, a.shape)[i])
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            ulps = float(_testing.ulp_error(a_in[i], e[i], dt, scale=si))
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {a.size} elements differ by more than rtol={rtol:g} of their scale; "
            f"worst at {tuple(int(k) for k in i)}: actual {float(a[i])!r}, expected {float(e[i])!r}, scale {si!r} "
            f"({ulps:.3g} ulps of {dt} at the scale)"
        )


def load_example(path: Any, module: str) -> Any:
    """The module of a Python file outside the package (a docs example ``docs/examples/<name>.py``, a docs or bench
    script), imported under ``module`` (kept in ``sys.modules``, as a statistic's record names its pieces by module;
    the caller deletes it where it must)."""
    import importlib.util
    import sys

    loader = importlib.util.spec_from_file_location(module, path)
    assert loader is not None and loader.loader is not None
    mod = importlib.util.module_from_spec(loader)
    sys.modules[module] = mod
    loader.loader.exec_module(mod)
    return mod


def assert_bitwise(actual: Any, expected: Any, what: str) -> None:
    """``actual`` bitwise ``expected`` (NaN payloads aside: any NaN equals any NaN), else an AssertionError saying
    ``what`` (the op, backend, path, dtype, input), how many elements differ, and the worst one: its index, both
    values and their distance in ulps of the dtype -- never a raw array dump."""
    a, e = np.asarray(actual), np.asarray(expected)
    if a.shape != e.shape or a.dtype != e.dtype:
        raise AssertionError(f"{what}: got {a.dtype}{a.shape}, expected {e.dtype}{e.shape}")
    af, ef = a.astype(np.float64), e.astype(np.float64)
    same = (a.view(np.uint8).reshape(*a.shape, -1) == e.view(np.uint8).reshape(*e.shape, -1)).all(axis=-1)
    same |= np.isnan(af) & np.isnan(ef)
    if same.all():
        return
    with np.errstate(invalid="ignore", over="ignore"):
        ulps = np.where(same, 0.0, _testing.ulp_error(a, e, a.dtype))
    ulps = np.where(np.isnan(ulps), np.inf, ulps)
    i = np.unravel_index(int(np.argmax(np.where(same, -1.0, ulps))), a.shape)
    raise AssertionError(
        f"{what}: {int((~same).sum())} of {a.size} elements differ; worst at {tuple(int(k) for k in i)}: "
        f"got {af[i]!r}, expected {ef[i]!r} ({ulps[i]:.3g} ulps of {a.dtype})"
    )


# tolerance (relative to the magnitude of the terms) of a fast backend vs the reference
BACKEND_RTOL = {"float16": 2.0**-10, "bfloat16": 2.0**-7, "float32": 4e-6, "float64": 1e-12}


term_scales = _testing.term_scales
make_rows = _testing.make_input


def grad_check_setup(backend: Any, spec: OpSpec, x: Any, args: list[Any], **kw: Any) -> tuple[Any, Any, list, list]:
    """``(forward, backward, inputs, names)`` for :func:`pynorm.testing.check_grads`: the differentiable
    arguments are the checked inputs, integer index inputs are held fixed (closed over)."""
    diff = spec.differentiable
    fwd = backend.forward(spec.forward, **kw)
    fixed = {i: a for i, (a, d) in enumerate(zip(args, diff, strict=True)) if not d}

    def forward(x_: Any, *free: Any) -> Any:
        it = iter(free)
        full = [fixed[i] if i in fixed else next(it) for i in range(len(args))]
        return fwd(x_, *full)

    inputs = [x, *(a for a, d in zip(args, diff, strict=True) if d)]
    names = ["x", *(n for n, d in zip(spec.arg_names, diff, strict=True) if d)]
    return forward, backend.backward(spec.backward), inputs, names


def mpmath_ulps(got: Any, exact: list) -> np.ndarray:
    """``|got - exact|`` in ulps of float32 at ``exact`` (mpf values); an exact value beyond float32's range
    must give inf (0 ulps then, else inf)."""
    import mpmath

    got = np.asarray(got, np.float32)
    out = np.empty(len(exact))
    for i, (g, ex) in enumerate(zip(got.tolist(), exact, strict=True)):
        if mpmath.isnan(ex):
            out[i] = 0.0 if math.isnan(g) else np.inf
            continue
        ef = float(ex)
        rounded = np.float32(ef) if abs(ef) < 2.0**128 * (1 - 2.0**-25) else np.float32(math.copysign(np.inf, ef))
        if np.isinf(rounded):
            out[i] = 0.0 if g == float(rounded) else np.inf
            continue
        if math.isinf(g):
            out[i] = np.inf
            continue
        with np.errstate(over="ignore"):  # the spacing at float32's max is beyond it
            spacing = max(float(np.spacing(np.abs(rounded))), 2.0**-149)
        out[i] = float(abs(mpmath.mpf(g) - ex)) / min(spacing, 2.0**104)
    return out
