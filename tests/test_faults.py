"""The fault suite: bad input generated from the op specs, non-finite values, byte order, the numba backend's
thread pool under fork, Ctrl-C and concurrent calls, and what an idle worker keeps alive.

The bad-input table (:func:`bad_cases`) is built from :data:`pynorm.ops.SPECS`: for every op, every argument
gets the wrong dtype, shape and kind, non-finite and huge values, non-native byte order, strides; every
option gets junk; the output buffers and the backward's arguments get theirs. Each case runs on the backend
under test and on the ``numpy`` reference, with one rule: **the same exception class, or the same result**
(NaN where the reference has NaN, the same infinities, finite values close). Where the reference raises, it
raises a :mod:`pynorm.errors` error (a clear message naming the argument), never NumPy's own.

The disk cache's faults (corrupt files, nowhere writable) are in ``tests/test_numba_cache.py``.
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

import pynorm
from pynorm import ops
from pynorm.errors import PynormError, ShapeError

from .helpers import N_MODALITIES

R, H = 6, 8


@dataclass
class Case:
    """One call: the forward's arguments (``args`` after ``x``; ``kw`` its options and ``out``), then -- when
    ``backward`` is set -- the backward's ``dy`` and keywords."""

    id: str
    x: Any
    args: list[Any]
    kw: dict[str, Any] = field(default_factory=dict)
    backward: bool = False
    dy: Any = None
    bkw: dict[str, Any] = field(default_factory=dict)


def _base(spec: ops.OpSpec, seed: int = 0) -> tuple[np.ndarray, list[Any]]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((R, H)).astype(np.float32)
    return x, spec.example_args((R, H), -1, np.float32, rng, N_MODALITIES)


def _y_shape(spec: ops.OpSpec, args: list[Any]) -> tuple[int, ...]:
    return spec.output_shape((R, H), 1, dict(zip((*spec.input_names, *spec.param_names), args, strict=True)))


def _with(args: list[Any], i: int, v: Any) -> list[Any]:
    out = list(args)
    out[i] = v
    return out


def _nonnative(a: np.ndarray) -> np.ndarray:
    return a.astype(a.dtype.newbyteorder("S"))


def _strided(a: np.ndarray) -> np.ndarray:
    big = np.zeros((*a.shape[:-1], 2 * a.shape[-1]), a.dtype)
    big[..., ::2] = a
    return big[..., ::2]


def _poke(a: np.ndarray, v: float) -> np.ndarray:
    a = a.copy()
    a.flat[min(2, a.size - 1)] = v
    return a


def _array_mutations(a: np.ndarray, float_kind: bool) -> Iterator[tuple[str, Any]]:
    """Bad (and odd but valid) versions of one array argument."""
    yield "int32", a.astype(np.int32) if float_kind else a.astype(np.float32)
    yield "bool", a.astype(bool)
    yield "complex", a.astype(np.complex64)
    yield "object", a.astype(object)
    yield "string", "abc"
    yield "extra_dim", a[None]
    yield "last_dim+1", np.concatenate([a, a[..., :1]], axis=-1)
    yield "0d", np.asarray(a.flat[0])
    yield "nonnative", _nonnative(a)
    yield "list", a.tolist()
    if a.ndim >= 1 and a.shape[-1] > 1:
        yield "strided", _strided(a)
    if float_kind:
        for v in (np.inf, -np.inf, np.nan):
            yield f"value_{v}", _poke(a, v)
        yield "huge", (a * np.float32(1e37)).astype(a.dtype)
        yield "float64", a.astype(np.float64)
        yield "float16", a.astype(np.float16)
    else:  # integer ids
        yield "negative", _poke(a, -1)
        yield "out_of_range", _poke(a, N_MODALITIES + 5)
        yield "int8", a.astype(np.int8)
        yield "uint8", a.astype(np.uint8)


_JUNK = (-1, 0, 1, 2, 0.5, -0.5, 1e300, float("nan"), float("inf"), "x", None, True, [1], np.float32(0.1))


def bad_cases(spec: ops.OpSpec) -> list[Case]:
    """Every bad-input case of ``spec`` (see the module doc)."""
    x, args = _base(spec)
    names = (*spec.input_names, *spec.param_names)
    kinds = (*(i.kind for i in spec.inputs), *(p.kind for p in spec.params))
    required = (*(i.required for i in spec.inputs), *(p.required for p in spec.params))
    cases: list[Case] = [Case("valid", x, args, backward=True)]
    for tag, bad in _array_mutations(x, True):
        cases.append(Case(f"x:{tag}", bad, args, backward=True))
    cases += [Case("x:rows0", x[:0], args[:], backward=False), Case("x:hidden0", x[:, :0], args)]
    for i, (n, kind, a) in enumerate(zip(names, kinds, args, strict=True)):
        if a is None:
            continue
        if required[i]:
            cases.append(Case(f"{n}:None", x, _with(args, i, None), backward=True))
        for tag, bad in _array_mutations(np.asarray(a), kind != "row_index"):
            cases.append(Case(f"{n}:{tag}", x, _with(args, i, bad), backward=True))
    if "int8" in spec.x_dtypes:  # an int8 x with its per-row scale (x_scale is None for a float x)
        cases += _int8_cases(spec, args)
    for o in spec.options:
        for j, v in enumerate(_JUNK):
            cases.append(Case(f"option {o.name}={v!r}#{j}", x, args, {o.name: v}, backward=True))
    cases.append(Case("unknown option", x, args, {"epsilon": 1e-5}))
    yshape = _y_shape(spec, args)
    ydt = spec.dtypes_of_outputs(np.dtype(np.float32), spec.defaults())[0]
    good_out = np.empty(yshape, ydt)
    for tag, out in (
        ("shape", np.empty((R + 1, yshape[1]), ydt)),
        ("dtype", np.empty(yshape, np.float64 if ydt != np.float64 else np.float32)),
        ("strided", _strided(good_out)),
        ("readonly", _readonly(good_out)),
        ("nonnative", _nonnative(good_out)),
        ("is_x", "x" if yshape == x.shape and ydt == x.dtype else good_out),
        ("list", good_out.tolist()),
    ):
        cases.append(Case(f"out:{tag}", x, args, {"out": out}, backward=True))
    dy = np.random.default_rng(1).standard_normal(yshape).astype(spec.grad_dtype(ydt))
    for tag, bad in _array_mutations(dy, True):
        cases.append(Case(f"dy:{tag}", x, args, backward=True, dy=bad))
    for tag, dxo in (
        ("shape", np.empty((R + 1, H), np.float32)),
        ("dtype", np.empty((R, H), np.float64)),
        ("is_x", "x"),
        ("is_dy", "dy"),
        ("readonly", _readonly(np.empty((R, H), np.float32))),
        ("nonnative", np.empty((R, H), ">f4" if sys.byteorder == "little" else "<f4")),
    ):
        cases.append(Case(f"dx_out:{tag}", x, args, backward=True, bkw={"dx_out": dxo}))
    for o in spec.outputs[1:]:
        cases.append(Case(f"d{o}:shape", x, args, backward=True, bkw={f"d{o}": np.ones((R + 1, H), np.float32)}))
        cases.append(
            Case(f"d{o}:inf", x, args, backward=True, bkw={f"d{o}": _poke(np.ones((R, H), np.float32), np.inf)})
        )
    cases.append(Case("ctx:None", x, args, backward=True, bkw={"ctx": None}))
    return cases


def _int8_cases(spec: ops.OpSpec, args: list[Any]) -> list[Case]:
    rng = np.random.default_rng(2)
    q = rng.integers(-100, 100, (R, H)).astype(np.int8)
    i = spec.input_names.index("x_scale")
    scales = (0.01 + rng.random(R)).astype(np.float64)
    dy = rng.standard_normal((R, H)).astype(np.float32)
    cases = [Case("x_scale:valid", q, _with(args, i, scales), backward=True, dy=dy)]
    cases.append(Case("x_scale:scalar", q, _with(args, i, np.float64(0.05)), backward=True, dy=dy))
    cases.append(Case("x_scale:None", q, _with(args, i, None), backward=True, dy=dy))
    for tag, bad in _array_mutations(scales, True):
        cases.append(Case(f"x_scale:{tag}", q, _with(args, i, bad), backward=True, dy=dy))
    for tag, v in (("zero", 0.0), ("negative", -1.0), ("tiny", 1e-300), ("1e300", 1e300)):
        cases.append(Case(f"x_scale:{tag}", q, _with(args, i, _poke(scales, v)), backward=True, dy=dy))
    for tag, bad in _array_mutations(q, False):
        cases.append(Case(f"x_scale:x_{tag}", bad, _with(args, i, scales), backward=True, dy=dy))
    return cases


def _readonly(a: np.ndarray) -> np.ndarray:
    a = a.copy()
    a.flags.writeable = False
    return a


def _convert(backend: Any, v: Any) -> Any:
    """NumPy arrays (and lists) of numbers as the backend's arrays; anything else as given."""
    if backend.xp is np:
        return v
    if isinstance(v, list):
        v = np.asarray(v)
    if isinstance(v, np.ndarray) and v.dtype != object:
        return backend.asarray(v)
    return v


def _portable(case: Case) -> bool:
    """Whether every argument of ``case`` exists as another library's array (no NumPy object arrays)."""
    vals = [case.x, *case.args, *case.kw.values(), case.dy, *case.bkw.values()]
    return not any(isinstance(v, np.ndarray) and v.dtype == object for v in vals)


def run_case(spec: ops.OpSpec, case: Case, backend: Any) -> Any:
    """``("error", class)`` or the outputs as NumPy float64 arrays (forward, then the backward's gradients)."""
    case = copy.deepcopy(case)  # a case may write into its own arrays (dx_out=x): each run gets fresh ones
    conv = (lambda v: _convert(backend, v)) if backend is not None else (lambda v: v)
    name = backend.name if backend is not None else "numpy"
    to_np = backend.to_numpy if backend is not None else np.asarray
    x = conv(case.x)
    args = [conv(a) for a in case.args]
    kw = {k: (conv(v) if k == "out" and not isinstance(v, list) else v) for k, v in case.kw.items()}
    if isinstance(kw.get("out"), str):  # "x": the forward's own input
        kw["out"] = x
    try:
        outs, ctx = spec.generic_forward()(x, *args, backend=name, **kw)
        first = outs[0] if isinstance(outs, tuple) else outs
        result = [to_np(o) for o in (outs if isinstance(outs, tuple) else (outs,))]
        if case.backward:
            dy = conv(case.dy) if case.dy is not None else backend_ones(first)
            bkw = dict(case.bkw)
            c = bkw.pop("ctx", ctx)
            if "dx_out" in bkw:
                bkw["dx_out"] = (
                    {"x": x, "dy": dy}.get(bkw["dx_out"], None)
                    if isinstance(bkw["dx_out"], str)
                    else conv(bkw["dx_out"])
                )
            bkw = {k: conv(v) for k, v in bkw.items()}
            grads = getattr(pynorm, f"{spec.name}_backward")(dy, c, **bkw)
            result += [None if g is None else to_np(g) for g in grads]
    except Exception as exc:  # the rule compares exception classes
        return ("error", type(exc))
    return [None if r is None else np.asarray(r) for r in result]


def backend_ones(y: Any) -> Any:
    mod = sys.modules[type(y).__module__.partition(".")[0]]
    return mod.ones(y.shape, y.dtype) if y.dtype.kind == "f" else mod.ones(y.shape, mod.float32)


def same_result(a: list[Any], b: list[Any]) -> str | None:
    """None when ``a`` and ``b`` agree (see the module doc), else what differs."""
    if len(a) != len(b):
        return f"{len(a)} outputs against {len(b)}"
    for k, (u, v) in enumerate(zip(a, b, strict=True)):
        if (u is None) != (v is None):
            return f"output {k}: None against an array"
        if u is None:
            continue
        if u.shape != v.shape or u.dtype != v.dtype:
            return f"output {k}: {u.shape} {u.dtype} against {v.shape} {v.dtype}"
        if u.dtype.kind not in "fc":
            u, v = u.astype(np.float64), v.astype(np.float64)
            if not np.array_equal(u, v):
                # quantized codes: within one step (a float path's rounding may fall either side of .5)
                if u.size and np.max(np.abs(u - v)) > 1:
                    return f"output {k}: integer codes differ by {np.max(np.abs(u - v))}"
            continue
        u, v = u.astype(np.float64), v.astype(np.float64)
        if not np.array_equal(np.isnan(u), np.isnan(v)):
            return f"output {k}: NaN at {np.argwhere(np.isnan(u) != np.isnan(v))[:3].tolist()}"
        inf = np.isinf(u) | np.isinf(v)
        if not np.array_equal(u[inf], v[inf]):
            return f"output {k}: infinities differ at {np.argwhere(inf & (u != v))[:3].tolist()}"
        fin = np.isfinite(u) & np.isfinite(v)
        # float32 math against float64: relative to the tensor's largest value (and at least 1e-3: a dx that
        # cancels to ~1e-16 in the reference is float32 noise of ~1e-7 in a fast backend)
        scale = max(float(np.max(np.abs(v[fin]), initial=0.0)), 1e-3)
        if fin.any() and float(np.max(np.abs(u[fin] - v[fin]))) > 2e-3 * scale:
            return f"output {k}: max difference {float(np.max(np.abs(u[fin] - v[fin]))):.3g} (scale {scale:.3g})"
    return None


ROWS = {n: s for n, s in ops.SPECS.items() if s.layout == "rows"}  # (channels-layout ops: tests/test_channel_norms.py)
CASES = [(name, c.id) for name, spec in ROWS.items() for c in bad_cases(spec)]


def _shown(r: Any) -> str:
    return r[1].__name__ if isinstance(r, tuple) else "a result"


@pytest.mark.parametrize("op", sorted(ROWS))
def test_bad_input_table_same_error_or_same_result(backend: Any, op: str) -> None:
    """Every generated case of ``op``: the backend raises what the reference raises, or returns what it returns;
    the reference's errors are pynorm's (a clear message naming the argument)."""
    spec = ops.SPECS[op]
    failures = []
    cases = bad_cases(spec)
    for case in cases:
        ref = run_case(spec, case, None)
        if isinstance(ref, tuple) and not issubclass(ref[1], (PynormError, TypeError)):
            failures.append(f"{case.id}: the reference raised {ref[1].__name__}, not a pynorm error")
            continue
        if isinstance(ref, tuple) and ref[1] is TypeError and not case.id.startswith(("unknown", "ctx:")):
            failures.append(f"{case.id}: the reference raised a bare TypeError")
            continue
        if backend.name == "numpy" or (backend.xp is not np and not _portable(case)):
            continue
        got = run_case(spec, case, backend)
        if isinstance(ref, tuple) or isinstance(got, tuple):
            if not (isinstance(ref, tuple) and isinstance(got, tuple) and ref[1] is got[1]):
                failures.append(f"{case.id}: reference {_shown(ref)}, {backend.name} {_shown(got)}")
            continue
        why = same_result(got, ref)
        if why:
            failures.append(f"{case.id}: {why}")
    assert not failures, f"{len(failures)} of {len(cases)} cases:\n" + "\n".join(failures)


def test_the_table_covers_every_op_and_kind() -> None:
    """The generator reaches every argument of every op (a spec's new input or option is in the table)."""
    for name, spec in ROWS.items():
        ids = {c.id.partition(":")[0] for c in bad_cases(spec)}
        for n in (*spec.input_names, *spec.param_names):
            assert n in ids, (name, n)
        for o in spec.options:
            assert any(c.id.startswith(f"option {o.name}=") for c in bad_cases(spec)), (name, o.name)
    assert len(CASES) > 1500


# ---------------------------------------------------------------------------
# the failures the fault battery found, one test each


@pytest.mark.parametrize("op", ["modality_layer_norm"])
@pytest.mark.parametrize("rows", [64, 1024])
@pytest.mark.parametrize("m_w, m_b", [(3, 2), (2, 3)])
def test_mismatched_tables_are_a_shape_error(backend: Any, op: str, rows: int, m_w: int, m_b: int) -> None:
    x = backend.asarray(np.random.default_rng(0).standard_normal((rows, 8)).astype(np.float32))
    ids = backend.asarray(np.arange(rows) % 2)
    w = backend.asarray(np.ones((m_w, 8), np.float32))
    b = backend.asarray(np.zeros((m_b, 8), np.float32))
    with pytest.raises(ShapeError, match=r"bias has \d rows .* but weight has \d: the tables selected by modality_ids"):
        pynorm.modality_layer_norm_forward(x, ids, w, b, backend=backend.name)


def test_non_native_byte_order_reads_as_native() -> None:
    """A big-endian array (dtype name float32 too) gives the native array's result on every NumPy backend, in the
    same process after an unaligned array went through the kernels; an out buffer of swapped bytes is a
    DTypeError."""
    from pynorm.errors import DTypeError

    rng = np.random.default_rng(0)
    buf = np.zeros(4 * R * H + 1, np.uint8)
    unaligned = buf[1:].view(np.float32).reshape(R, H)
    unaligned[...] = rng.standard_normal((R, H))
    assert not unaligned.flags.aligned
    names = [b.name for b in pynorm.list_backends() if b.available]
    for b in [n for n in names if pynorm._registry.get_backend(n).array_module == "numpy"]:
        for op, spec in ROWS.items():
            args = spec.example_args((R, H), -1, np.float32, np.random.default_rng(1), N_MODALITIES)
            want, _ = spec.generic_forward()(np.ascontiguousarray(unaligned), *args, backend="numpy")
            got_u, _ = spec.generic_forward()(unaligned, *args, backend=b)
            swapped = [None if a is None else _nonnative(np.asarray(a)) for a in args]
            got_s, _ = spec.generic_forward()(_nonnative(unaligned), *swapped, backend=b)
            for got in (got_u, got_s):
                g = got if isinstance(got, tuple) else (got,)
                w = want if isinstance(want, tuple) else (want,)
                assert same_result([np.asarray(v) for v in g], [np.asarray(v) for v in w]) is None, (b, op)
                assert all(np.asarray(v).dtype.isnative for v in g)
        with pytest.raises(DTypeError, match="out has non-native byte order"):
            pynorm.layer_norm(unaligned, out=np.empty((R, H), np.dtype(np.float32).newbyteorder("S")), backend=b)


@pytest.mark.parametrize("stat", ["rms_norm", "scale_norm", "layer_norm", "add_rms_norm", "modality_rms_norm"])
@pytest.mark.parametrize("v", [np.inf, -np.inf, np.nan])
def test_a_non_finite_row_is_nan_throughout(backend: Any, stat: str, v: float) -> None:
    """docs/numerics.md's rule: an inf or NaN in a row of x makes that row NaN in every element (not
    ``x * rsqrt(mean(x^2))``'s ``[nan, 0, 0, 0]``); other rows are untouched; an inf in dy makes its dx row NaN."""
    spec = ops.SPECS[stat]
    x, args = _base(spec)
    x[1, 2] = v
    conv = [None if a is None else backend.asarray(a) for a in args]
    y, _ = spec.generic_forward()(backend.asarray(x), *conv, backend=backend.name)
    y = backend.to_numpy(y[0] if isinstance(y, tuple) else y)
    assert np.isnan(y[1]).all()
    assert np.isfinite(np.delete(y, 1, axis=0)).all()
    dy = np.ones((R, H), np.float32)
    dy[3, 4] = np.inf
    x2, _ = _base(spec)
    _, ctx2 = spec.generic_forward()(backend.asarray(x2), *conv, backend=backend.name)
    g = getattr(pynorm, f"{stat}_backward")(backend.asarray(dy), ctx2)
    dx = backend.to_numpy(g.dx)
    assert np.isnan(dx[3]).all() and np.isfinite(np.delete(dx, 3, axis=0)).all()


@pytest.mark.parametrize("op", ["dyt", "scale_norm"])
@pytest.mark.parametrize("terms", ["+inf -inf", "+inf", "overflow"])
def test_a_scalar_parameters_gradient_of_non_finite_terms_is_the_references(backend: Any, op: str, terms: str) -> None:
    """A scalar parameter's gradient (DyT's ``alpha``, ScaleNorm's ``g``) is a sum over every element: where its
    terms are +inf and -inf it is NaN, where they are +inf it is inf, where finite terms overflow float64 it is inf
    -- as the reference's sum, never an exception (numba's correctly rounded sum raised ValueError there)."""
    x = np.linspace(-1.0, 1.0, R * H).reshape(R, H)
    dy = np.ones((R, H))
    if terms == "+inf -inf":
        dy[0, 0], dy[-1, -1] = np.inf, np.inf  # x = -1 and 1 there: terms -inf and +inf
    elif terms == "+inf":
        dy[-1, -1] = np.inf
    else:
        x, dy = np.abs(x) + 0.5, np.full((R, H), 1e308)  # positive terms near float64's max
    args = (np.array([0.5]),)
    grads = {}
    for be in ("numpy", backend.name):
        f, b = getattr(pynorm, f"{op}_forward"), getattr(pynorm, f"{op}_backward")
        with np.errstate(all="ignore"):
            _, ctx = f(backend.asarray(x) if be != "numpy" else x, *[backend.asarray(a) if be != "numpy" else a
                                                                       for a in args], backend=be)  # fmt: skip
            g = b(backend.asarray(dy) if be != "numpy" else dy, ctx)
        grads[be] = float((backend.to_numpy(g[1]) if be != "numpy" else g[1])[0])
    want, got = grads["numpy"], grads[backend.name]
    assert np.isnan(want) if terms == "+inf -inf" else np.isinf(want), (terms, want)
    assert np.array_equal(np.float64(got), np.float64(want), equal_nan=True), (got, want)


@pytest.mark.parametrize("shape", [(4, 3, 5), (4, 3, 40), (64, 2, 3), (2, 3, 1000)])
@pytest.mark.parametrize(("dt", "magnitude"), [("float64", 1e160), ("float64", 9e306), ("float32", 3e38)])
def test_batch_norm_of_huge_channels_is_the_references(backend: Any, shape: tuple, dt: str, magnitude: float) -> None:
    """BatchNorm in training on channels of magnitude ~1e160 and ~9e306 (float64) and ~3e38 (float32) beside an
    ordinary one: float64 sums of squares (and ``sum(dy xc)``) of such float64 values overflow, and a float32
    channel's rstd is subnormal; y, dx, dweight and dbias stay within a few ulps of the reference's. (numba's and
    cupy's column kernels gave y = b throughout for float64, an error of ~1e15 ulps, and NaN gradients; on a GPU
    the float32 scale, converted by a CuPy kernel, which flushes subnormals, was 0: y = b again.)"""
    rng = np.random.default_rng(3)
    x = magnitude * np.sign(rng.standard_normal(shape)) * rng.uniform(0.5, 1.0, shape)
    x[:, 0] /= magnitude  # an ordinary channel
    x = x.astype(dt)
    w, b = rng.uniform(0.5, 1.5, shape[1]).astype(dt), np.full(shape[1], 0.5, dtype=dt)
    dy = rng.standard_normal(shape).astype(dt)
    y_ref, c_ref = pynorm.batch_norm_forward(x, w, b, training=True, backend="numpy")
    g_ref = pynorm.batch_norm_backward(dy, c_ref)
    y, ctx = pynorm.batch_norm_forward(backend.asarray(x), backend.asarray(w), backend.asarray(b), training=True,
                                       backend=backend.name)  # fmt: skip
    g = pynorm.batch_norm_backward(backend.asarray(dy), ctx)
    for what, got, want in (("y", y, y_ref), *zip(("dx", "dweight", "dbias"), g, g_ref, strict=True)):
        got, want = backend.to_numpy(got), np.asarray(want, np.float64)
        assert np.all(np.isfinite(got)), what
        scale = np.abs(want) if want.ndim == 1 else np.abs(want).max(axis=(0, 2), keepdims=True)  # per channel
        err = np.abs(got.astype(np.float64) - want) / scale
        assert err.max() <= 64 * np.finfo(dt).eps, (what, float(err.max()))


@pytest.mark.parametrize("x_scale", [1e154, 1e200, 1e300, 1e-200, 0.05])
def test_int8_input_with_extreme_scales(backend: Any, x_scale: float) -> None:
    """The real input ``q * x_scale`` normalizes as the same values given in float64 do (the variance no longer
    overflows to ``y = bias``); dx is finite (0 where it underflows float32), constant rows have dweight = 0."""
    rng = np.random.default_rng(0)
    q = rng.integers(-100, 100, (R, H)).astype(np.int8)
    q[2] = 7  # a constant row
    w = (1 + 0.1 * rng.standard_normal(H)).astype(np.float32)
    b = np.full(H, 0.5, np.float32)
    y, ctx = pynorm.quant_layer_norm_forward(
        backend.asarray(q), backend.asarray(w), backend.asarray(b), x_scale=backend.asarray(np.float64(x_scale)),
        backend=backend.name,
    )  # fmt: skip
    # the same rows as float64 values, scaled by a power of two that keeps them in range (LayerNorm is invariant)
    real = q.astype(np.float64) * (x_scale / 2.0 ** np.floor(np.log2(x_scale)))
    want = pynorm.layer_norm(real, w.astype(np.float64), b.astype(np.float64), backend="numpy")
    got = backend.to_numpy(y).astype(np.float64)
    if x_scale < 1e-100:  # the variance is far below eps: y is the bias
        want = np.broadcast_to(b, (R, H)).astype(np.float64)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)
    dyv = np.tile(np.arange(H, dtype=np.float32), (R, 1))
    g = pynorm.quant_layer_norm_backward(backend.asarray(dyv), ctx)
    dx = backend.to_numpy(g.dx)
    assert np.isfinite(dx).all()
    q2 = np.repeat(q[:, :1], H, axis=1)  # every row constant: x_hat = 0 exactly, so dweight = 0
    _, c2 = pynorm.quant_layer_norm_forward(
        backend.asarray(q2), backend.asarray(w), backend.asarray(b), x_scale=backend.asarray(np.float64(x_scale)),
        backend=backend.name,
    )  # fmt: skip
    assert (backend.to_numpy(pynorm.quant_layer_norm_backward(backend.asarray(dyv), c2).dweight) == 0).all()


def test_residual_dtype_names_itself() -> None:
    from pynorm.errors import DTypeError

    x = np.ones((2, 4), np.float32)
    for v in (1, 1.5, "int8", object):
        with pytest.raises(DTypeError, match="residual_dtype must be None or one of"):
            pynorm.add_rms_norm(x, x, residual_dtype=v)


@pytest.mark.parametrize("op", ["conditional_layer_norm", "conditional_rms_norm"])
def test_dx_out_must_not_overlap_x_on_any_backend(backend: Any, op: str) -> None:
    from pynorm.errors import ArgumentError

    spec = ops.SPECS[op]
    x, args = _base(spec)
    xd = backend.asarray(x)
    y, ctx = spec.generic_forward()(xd, *[backend.asarray(a) for a in args], backend=backend.name)
    with pytest.raises(ArgumentError, match="dx_out must not overlap"):
        getattr(pynorm, f"{op}_backward")(backend.xp.ones_like(y), ctx, dx_out=xd)


# ---------------------------------------------------------------------------
# the numba backend's thread pool

numba_only = pytest.mark.skipif(
    os.environ.get("PYNORM_TEST_BACKENDS", "numba") != "numba"
    or pynorm._registry.unavailable_reason("numba") is not None,
    reason="the numba backend's thread pool (run in the numba env)",
)


def _script(body: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}
    code = "import numpy as np, pynorm\nfrom pynorm.backends.numba import _threads, _common\n" + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)


@numba_only
def test_threads_give_the_single_threaded_bits() -> None:
    """Six Python threads calling forward and backward at once, each call on the pool, give the bits of one
    thread alone."""
    from pynorm.backends.numba import _threads

    rng = np.random.default_rng(0)
    x = rng.standard_normal((512, 512)).astype(np.float32)
    w = rng.standard_normal(512).astype(np.float32)
    dy = rng.standard_normal((512, 512)).astype(np.float32)

    def once() -> tuple[np.ndarray, ...]:
        y, c = pynorm.layer_norm_forward(x, w, w, backend="numba")
        g = pynorm.layer_norm_backward(dy, c)
        return y.copy(), g.dx.copy(), g.dweight.copy()

    want = once()
    bad: list[str] = []

    def worker() -> None:
        for _ in range(15):
            for a, b in zip(once(), want, strict=True):
                if not np.array_equal(a, b):
                    bad.append("differs")

    ts = [threading.Thread(target=worker) for _ in range(6)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not bad and all(not t.is_alive() for t in ts)
    assert len(_threads._idle) == len(_threads._workers)


@numba_only
def test_a_fork_while_another_thread_holds_the_pools_locks_does_not_hang_the_child() -> None:
    r = _script(
        """
        import os, threading, time
        x = np.random.default_rng(0).standard_normal((2048, 1024)).astype(np.float32)  # 8 MiB: the buffer pool
        pynorm.layer_norm(x, backend="numba")
        held = threading.Event()
        def hold():
            with _common.POOL._lock, _threads._lock:
                held.set()
                time.sleep(5)
        threading.Thread(target=hold, daemon=True).start()
        held.wait()
        pid = os.fork()
        if pid == 0:
            y = pynorm.layer_norm(x, backend="numba")  # allocates from the pool; runs on new pool threads
            os._exit(0 if np.isfinite(y).all() else 3)
        _, status = os.waitpid(pid, 0)
        print("CHILD", os.waitstatus_to_exitcode(status))
        """,
        timeout=120,
    )
    assert "CHILD 0" in r.stdout, r.stdout + r.stderr[-2000:]


@numba_only
def test_forks_during_pool_use() -> None:
    """Twenty forks while another thread keeps the pool busy: every child finishes its own call."""
    r = _script(
        """
        import os, threading
        x = np.random.default_rng(0).standard_normal((2048, 1024)).astype(np.float32)
        pynorm.rms_norm(x, backend="numba")
        stop = threading.Event()
        def busy():
            while not stop.is_set():
                pynorm.rms_norm(x, backend="numba")
        t = threading.Thread(target=busy, daemon=True)
        t.start()
        codes = []
        for _ in range(20):
            pid = os.fork()
            if pid == 0:
                y = pynorm.rms_norm(x, backend="numba")
                os._exit(0 if np.isfinite(y).all() else 3)
            codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
        stop.set()
        t.join()
        print("CODES", codes)
        """,
        timeout=200,
    )
    assert "CODES [" + ", ".join(["0"] * 20) + "]" in r.stdout, r.stdout + r.stderr[-2000:]


@numba_only
def test_ctrl_c_during_a_call_loses_no_worker() -> None:
    """SIGINT while the calling thread waits for a pool worker's span (the caller's own span done first), then at
    many points of real calls: each time a KeyboardInterrupt, and afterwards every worker is idle again and a
    call runs on every thread with the single-threaded bits."""
    r = _script(
        """
        import os, signal, threading, time
        signal.signal(signal.SIGINT, signal.default_int_handler)  # (a test runner's worker may ignore SIGINT)
        pynorm.set_num_threads(2)

        def kernel(lo, hi):  # the caller's span returns at once, the worker's takes 0.4 s
            if lo > 0:
                time.sleep(0.4)
            return 0

        waits = 0
        for _ in range(3):
            threading.Timer(0.1, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
            try:
                _threads.launch(kernel, 1 << 30, 2)
            except KeyboardInterrupt:
                waits += 1
        print("WAITS", waits, "IDLE", len(_threads._idle), "WORKERS", len(_threads._workers))

        x = np.random.default_rng(0).standard_normal((4096, 4096)).astype(np.float32)
        dy = np.ones_like(x)
        y0, c0 = pynorm.layer_norm_forward(x, backend="numba")
        dx0 = pynorm.layer_norm_backward(dy, c0).dx.copy()
        t0 = time.perf_counter(); pynorm.layer_norm_backward(dy, c0); dt = time.perf_counter() - t0
        interrupted = 0
        for k in range(24):
            timer = threading.Timer(dt * (0.05 + 0.9 * k / 24), lambda: os.kill(os.getpid(), signal.SIGINT))
            try:
                timer.start()
                pynorm.layer_norm_backward(dy, c0)
                time.sleep(2 * dt + 0.05)  # a signal that lands after the call lands here
            except KeyboardInterrupt:
                interrupted += 1
            timer.join()
        print("INTERRUPTED", interrupted)
        print("IDLE", len(_threads._idle), "WORKERS", len(_threads._workers))
        seen = set()
        real = _threads._Worker.start
        def spy(self, kernel, args):
            seen.add(id(self)); real(self, kernel, args)
        _threads._Worker.start = spy
        dx = pynorm.layer_norm_backward(dy, c0).dx
        print("USED", len(seen), "SAME", bool(np.array_equal(dx, dx0)))
        """,
        timeout=300,
    )
    out = r.stdout
    assert "WAITS 3 IDLE 1 WORKERS 1" in out, out + r.stderr[-2000:]
    assert "INTERRUPTED 24" in out and "IDLE 1 WORKERS 1" in out and "USED 1 SAME True" in out, out


@numba_only
def test_an_idle_worker_keeps_no_array_alive() -> None:
    """After a multi-threaded call, the arrays it was given are freed when the caller drops them (a pool worker
    used to keep its last job's arguments until the next call: 256 MiB after an 8192x8192 LayerNorm)."""
    from pynorm.backends.numba import _threads

    x = np.random.default_rng(0).standard_normal((1024, 1024)).astype(np.float32)
    dy = np.ones_like(x)
    y, c = pynorm.layer_norm_forward(x, backend="numba")
    pynorm.layer_norm_backward(dy, c)
    assert _threads._workers, "no span ran on a pool thread"
    refs = [weakref.ref(a) for a in (x, dy)]
    del x, dy, y, c
    assert all(r() is None for r in refs)


def test_every_case_id_is_unique() -> None:
    assert len(set(CASES)) == len(CASES)
