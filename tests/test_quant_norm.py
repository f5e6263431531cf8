"""The quantization-friendly LayerNorm (``quant_layer_norm``): its own properties, on every backend.

Its float path (a float ``x``, no quantization) is LayerNorm and is covered by the generic tests of
the op table (gradients against finite differences, every backend against the reference). Here: the
int8 input (exact integer statistics), the int8 output (per-tensor, per-row and given scales), the
straight-through backward, bitwise agreement of the int8 path across backends, and bad input.
"""

from __future__ import annotations

import numpy as np
import pytest

import pynorm
from pynorm.errors import ArgumentError, DTypeError, ShapeError
from tests.helpers import dtype

F32_ULP_REL = 2.0**-23


def _int8(rng, shape):
    return rng.integers(-128, 128, shape).astype(np.int8)


def _params(rng, h, dt=np.float32):
    return (1 + 0.5 * rng.standard_normal(h)).astype(dt), (0.5 * rng.standard_normal(h)).astype(dt)


def _real(x, xs, axis=-1):
    """The real input x * x_scale in float64 (exact), per-row scales broadcast over the normalized dims."""
    xs = np.asarray(xs, dtype=np.float64)
    return x.astype(np.float64) * xs.reshape(xs.shape + (1,) * (x.ndim - xs.ndim))


def _exact_ln(x, w, b, **conv):
    """The reference LayerNorm (float64 input: extended-precision math) of the real input, in float64."""
    return pynorm.layer_norm(x, None if w is None else w.astype(np.float64),
                             None if b is None else b.astype(np.float64), backend="numpy", **conv)  # fmt: skip


def _on(backend, *arrays):
    return [None if a is None else backend.asarray(a) for a in arrays]


def _call(backend, x, w, b, xs=None, **kw):
    xd, wd, bd = _on(backend, x, w, b)
    xsd = xs if xs is None or np.ndim(xs) == 0 else backend.asarray(np.asarray(xs))
    return pynorm.quant_layer_norm_forward(xd, wd, bd, x_scale=xsd, backend=backend.name, **kw)


def _np(backend, res):
    if isinstance(res, tuple):
        return tuple(backend.to_numpy(r) for r in res)
    return backend.to_numpy(res)


CONVENTIONS = ({}, {"correction": 1}, {"eps_mode": "std"}, {"weight_offset": 1.0, "eps": 0.1})


@pytest.mark.parametrize("conv", CONVENTIONS, ids=str)
@pytest.mark.parametrize("h", [1, 3, 64, 1000])
def test_int8_input_float_output_is_layer_norm_of_the_real_input(backend, conv, h):
    if conv.get("correction") == 1 and h == 1:
        pytest.skip("correction=1 needs H > 1")
    rng = np.random.default_rng(h)
    x = _int8(rng, (5, h))
    xs = rng.uniform(0.005, 0.2, 5).astype(np.float32)
    w, b = _params(rng, h)
    y, _ = _call(backend, x, w, b, xs, **conv)
    y = backend.to_numpy(y)
    assert y.dtype == np.float32 and y.shape == x.shape
    exact = _exact_ln(_real(x, xs), w, b, **conv)
    scale = np.abs(exact) + np.abs(b) + 1.0  # the terms' magnitude: |xhat w| + |b| (xhat of order 1)
    assert np.all(np.abs(y - exact) <= F32_ULP_REL * scale), np.max(np.abs(y - exact) / scale)


@pytest.mark.parametrize("mode", ["tensor", "row", "given"])
@pytest.mark.parametrize("source", ["int8", "float32", "bfloat16"])
def test_dequantized_output_within_half_a_step(backend, mode, source):
    rng = np.random.default_rng(7)
    shape, h = (4, 3, 96), 96
    w, b = _params(rng, h)
    if source == "int8":
        x, xs = _int8(rng, shape), rng.uniform(0.01, 0.1, (4, 3)).astype(np.float32)
        exact = _exact_ln(_real(x, xs).reshape(-1, h), w, b).reshape(shape)
        slack = 2.0**-40  # the int8 path's float64 y: a few float64 ulps
    else:
        x, xs = (3 * rng.standard_normal(shape) + 1).astype(dtype(source)), None
        exact = _exact_ln(x.astype(np.float64).reshape(-1, h), w, b).reshape(shape)
        slack = 4 * float(np.finfo(np.float32).eps if source == "float32" else 2.0**-8)  # y rounded to x's dtype
    kw = {"out_scale": 0.02} if mode == "given" else {"quantize": mode}
    (q, s), _ = _call(backend, x, w, b, xs, **kw)
    q, s = backend.to_numpy(q), backend.to_numpy(s)
    assert q.dtype == np.int8 and q.shape == shape and s.dtype == np.float32
    assert s.shape == ((4, 3) if mode == "row" else ())
    sb = s[..., None] if mode == "row" else s
    amax = np.abs(exact).max(axis=-1, keepdims=True) if mode == "row" else np.abs(exact).max()
    if mode != "given":  # amax of the y the output is quantized from (x's dtype for a float x)
        np.testing.assert_allclose(sb, amax / 127, rtol=slack + 1e-7)
    inside = np.abs(exact) <= 127 * sb  # where nothing clipped
    if mode == "given":
        assert (~inside).any() and inside.any(), "the test data should clip somewhere with out_scale=0.02"
        assert np.all(q[~inside] == np.sign(exact[~inside]) * 127)
    err = np.abs(q.astype(np.float64) * sb - exact)
    bound = sb / 2 + slack * (np.abs(exact) + 1)
    assert np.all((err <= bound)[np.broadcast_to(inside, q.shape)])
    assert np.all(np.abs(q.astype(np.int64)) <= 127)


@pytest.mark.parametrize("kw", [{}, {"quantize": "tensor"}, {"quantize": "row"}, {"out_scale": 0.02}], ids=str)
@pytest.mark.parametrize("params", ["wb", "none", "w16"])
def test_int8_path_is_bitwise_the_reference_on_every_backend(backend, kw, params):
    rng = np.random.default_rng(11)
    x = _int8(rng, (9, 257))
    x[3] = 17  # a constant row
    x[4] = 0  # a zero row
    xs = rng.uniform(0.001, 0.3, 9).astype(np.float32)
    w, b = _params(rng, 257)
    w, b = {"wb": (w, b), "none": (None, None), "w16": (w.astype(np.float16), None)}[params]
    conv = {"weight_offset": 0.5} if params == "w16" else {}
    ref, cref = pynorm.quant_layer_norm_forward(x, w, b, x_scale=xs, backend="numpy", **kw, **conv)
    got, ctx = _call(backend, x, w, b, xs, **kw, **conv)
    got = _np(backend, got)
    for a, r in zip(got if isinstance(got, tuple) else (got,), ref if isinstance(ref, tuple) else (ref,), strict=True):
        assert a.dtype == r.dtype and a.shape == r.shape
        assert a.tobytes() == r.tobytes(), f"{int(np.sum(a != r))} elements differ from the reference"
    np.testing.assert_array_equal(backend.to_numpy(ctx.inner.mean), cref.inner.mean)
    np.testing.assert_array_equal(backend.to_numpy(ctx.inner.rstd), cref.inner.rstd)


def test_int8_quantize_matches_an_independent_restatement():
    """The reference's int8 outputs against a restatement of the documented sequence with Python integers and
    math (exact integer sums, then the float64 steps one by one)."""
    import math

    rng = np.random.default_rng(5)
    x = _int8(rng, (3, 50))
    xs = np.array([0.02, 0.5, 0.0625])
    w, b = _params(rng, 50, np.float64)
    (q, s), _ = pynorm.quant_layer_norm_forward(x, w, b, x_scale=xs, quantize="row", backend="numpy", eps=1e-3)
    for i in range(3):
        row = [int(v) for v in x[i]]
        h = len(row)
        s1, s2 = sum(row), sum(v * v for v in row)
        v = (float(h * s2 - s1 * s1) / float(h * h)) * (xs[i] * xs[i])
        r = 1.0 / math.sqrt(v + 1e-3)
        k = (xs[i] * r) / h
        ys = [float(h * xv - s1) * k * float(w[j]) + float(b[j]) for j, xv in enumerate(row)]
        si = float(np.float32(max(abs(t) for t in ys) / 127))
        assert s[i] == np.float32(si)
        want = [max(-127, min(127, round(t / si))) for t in ys]  # Python's round: half to even
        assert q[i].tolist() == want


@pytest.mark.parametrize("kw", [{}, {"quantize": "row"}, {"quantize": "tensor"}], ids=str)
def test_float_input_is_layer_norm_then_quantized(backend, kw):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((6, 40)) * 2).astype(np.float32)
    w, b = _params(rng, 40)
    y_ln = backend.to_numpy(pynorm.layer_norm(*_on(backend, x, w, b), backend=backend.name))
    res, _ = _call(backend, x, w, b, **kw)
    if not kw:
        assert backend.to_numpy(res).tobytes() == y_ln.tobytes()  # bitwise this backend's layer_norm
        return
    q, s = _np(backend, res)
    # independent restatement of the quantizer on this backend's LayerNorm output
    y64 = y_ln.astype(np.float64)
    amax = np.abs(y64).max(axis=-1) if kw["quantize"] == "row" else np.abs(y64).max()
    s_want = (amax / 127).astype(np.float32)
    np.testing.assert_array_equal(s, s_want)
    sb = s_want[:, None] if kw["quantize"] == "row" else s_want
    np.testing.assert_array_equal(q, np.clip(np.rint(y64 / sb.astype(np.float64)), -127, 127).astype(np.int8))


@pytest.mark.parametrize("dt", ["float16", "bfloat16", "float32", "float64"])
@pytest.mark.parametrize("kw", [{"quantize": "row"}, {"quantize": "tensor"}, {"out_scale": 0.02}], ids=str)
def test_float_input_quantized_in_every_dtype_with_hard_rows(backend, kw, dt):
    # the numba backend quantizes each row in the norm's own pass (its output never stored): the codes, scales
    # and clip mask must be this backend's layer_norm output through the quantizer, on rows its fast path
    # leaves to the slow one (offsets, huge and tiny values), NaN/inf elements and a constant row
    rng = np.random.default_rng(11)
    d = dtype(dt)
    big = 1e4 if d.itemsize >= 4 else 100.0
    x64 = rng.standard_normal((70, 300)) * 2
    x64[3] += big
    x64[5] *= 1e30 if d.itemsize >= 4 and d != np.float16 else 100.0
    x64[7] *= 1e-30 if d.itemsize >= 4 and d != np.float16 else 1e-4
    x64[9] = 2.5
    x64[11, 4], x64[13, 7] = np.nan, np.inf
    with np.errstate(over="ignore"):
        x = x64.astype(d)
    w, b = _params(rng, 300, d)
    y_ln = backend.to_numpy(pynorm.layer_norm(*_on(backend, x, w, b), backend=backend.name)).astype(np.float64)
    (q, s), ctx = _call(backend, x, w, b, **kw)
    q, s = backend.to_numpy(q), backend.to_numpy(s)
    mag = np.where(np.isnan(y_ln), 0.0, np.abs(y_ln))
    if "out_scale" in kw:
        s_want = np.float32([kw["out_scale"]])
    else:
        amax = mag.max(axis=-1) if kw["quantize"] == "row" else np.asarray([mag.max()])
        s_want = (amax / 127).astype(np.float32)
        s_want = np.where((s_want > 0) & np.isfinite(s_want), s_want, np.float32(1.0))
    np.testing.assert_array_equal(s, s_want)
    sb = s_want[:, None] if kw.get("quantize") == "row" else s_want
    with np.errstate(invalid="ignore"):
        t = np.rint(y_ln / sb.astype(np.float64))
        want = np.clip(np.where(np.isnan(t), 0.0, t), -127, 127).astype(np.int8)
    np.testing.assert_array_equal(q, want)
    if "out_scale" in kw:
        np.testing.assert_array_equal(backend.to_numpy(ctx.inner.keep), ~(np.abs(t) > 127))


def test_zero_and_nonfinite_scales_are_one_and_nan_codes_zero(backend):
    x = np.zeros((3, 8), np.int8)
    x[1, :4] = 5  # a half-constant row
    (q, s), _ = _call(backend, x, None, None, 1.0, quantize="row")
    q, s = backend.to_numpy(q), backend.to_numpy(s)
    assert s[0] == 1.0 and s[2] == 1.0 and q[0].tolist() == [0] * 8  # all-zero row: amax 0 -> s = 1
    assert np.all(np.abs(q[1]) == 127)
    # eps = 0 on a constant row is 0 * inf = NaN in y: its codes are 0, its scale 1
    xc = np.full((2, 4), 3, np.int8)
    (q, s), _ = _call(backend, xc, None, None, 1.0, quantize="row", eps=0.0)
    assert backend.to_numpy(q).tolist() == [[0] * 4] * 2 and backend.to_numpy(s).tolist() == [1.0, 1.0]


@pytest.mark.parametrize("source", ["int8", "float32"])
def test_backward_is_straight_through_then_layer_norm(backend, source):
    rng = np.random.default_rng(9)
    h = 24
    w, b = _params(rng, h)
    if source == "int8":
        x, xs = _int8(rng, (5, h)), rng.uniform(0.01, 0.1, 5).astype(np.float32)
        xr = _real(x, xs)
    else:
        x, xs = rng.standard_normal((5, h)).astype(np.float32), None
        xr = x.astype(np.float64)
    dy = rng.standard_normal((5, h)).astype(np.float32)
    exact = _exact_ln(xr, w, b)
    for kw in ({"quantize": "row"}, {"out_scale": 0.01}):
        _, ctx = _call(backend, x, w, b, xs, **kw)
        g = pynorm.quant_layer_norm_backward(backend.asarray(dy), ctx)
        keep = np.ones_like(dy, bool) if "quantize" in kw else ~(np.abs(np.rint(exact / 0.01)) > 127)
        if "out_scale" in kw:
            assert 0 < keep.sum() < keep.size
        # LayerNorm's backward at the real input (float64) for the masked upstream gradient
        _, c64 = pynorm.layer_norm_forward(xr, w.astype(np.float64), b.astype(np.float64), backend="numpy")
        want = pynorm.layer_norm_backward(np.where(keep, dy, 0).astype(np.float64), c64)
        dx = backend.to_numpy(g.dx)
        assert dx.dtype == np.float32 and dx.shape == x.shape
        tol = 2e-5 * (np.abs(want.dx).max() + 1)
        np.testing.assert_allclose(dx, want.dx, atol=tol, rtol=0)
        assert np.all(np.abs(backend.to_numpy(g.dweight) - want.dweight) <= 2e-5 * (np.abs(dy).sum(0) + 1))
        np.testing.assert_allclose(backend.to_numpy(g.dbias), np.where(keep, dy, 0).sum(0), rtol=1e-5, atol=1e-5)


def test_int8_gradient_against_finite_differences_of_the_real_input():
    """dx is w.r.t. the real input: central differences of sum(dy * y) in float64 where the int8 forward is
    the exact LayerNorm of x * x_scale (its float path run on the perturbed real input)."""
    rng = np.random.default_rng(4)
    x = _int8(rng, (3, 10))
    xs = np.array([0.05, 0.1, 0.02])
    w, b = _params(rng, 10, np.float64)
    dy = rng.standard_normal((3, 10)).astype(np.float32)
    _, ctx = pynorm.quant_layer_norm_forward(x, w, b, x_scale=xs, backend="numpy")
    dx = pynorm.quant_layer_norm_backward(dy, ctx).dx
    xr = _real(x, xs)
    num = np.zeros_like(xr)
    step = 1e-6
    for idx in np.ndindex(xr.shape):
        p, m = xr.copy(), xr.copy()
        p[idx] += step
        m[idx] -= step
        fp = np.sum(dy * pynorm.quant_layer_norm(p, w, b, backend="numpy"))
        fm = np.sum(dy * pynorm.quant_layer_norm(m, w, b, backend="numpy"))
        num[idx] = (fp - fm) / (2 * step)
    np.testing.assert_allclose(dx, num, rtol=1e-4, atol=1e-4)


def test_shapes_axis_and_no_mutation(backend):
    rng = np.random.default_rng(2)
    x = _int8(rng, (2, 3, 4, 5))
    xs = rng.uniform(0.01, 0.1, (2, 3)).astype(np.float32)
    w, b = _params(rng, 20)
    w, b = w.reshape(4, 5), b.reshape(4, 5)
    x0, xs0 = x.copy(), xs.copy()
    (q, s), ctx = _call(backend, x, w, b, xs, axis=2, quantize="row")
    assert tuple(q.shape) == (2, 3, 4, 5) and tuple(s.shape) == (2, 3)
    ref = pynorm.quant_layer_norm(x.reshape(6, 20), w.reshape(20), b.reshape(20), x_scale=xs.reshape(6),
                                  quantize="row", backend="numpy")  # fmt: skip
    assert backend.to_numpy(q).reshape(6, 20).tobytes() == ref[0].tobytes()
    g = pynorm.quant_layer_norm_backward(backend.asarray(np.ones((2, 3, 4, 5), np.float32)), ctx)
    assert tuple(g.dx.shape) == (2, 3, 4, 5) and tuple(g.dweight.shape) == (4, 5)
    np.testing.assert_array_equal(x, x0)
    np.testing.assert_array_equal(xs, xs0)
    out = backend.asarray(np.zeros((2, 3, 4, 5), np.int8))
    (q2, _), _ = _call(backend, x, w, b, xs, axis=2, quantize="row", out=out)
    assert q2 is out and backend.to_numpy(out).tobytes() == backend.to_numpy(q).tobytes()


def test_bad_input_gets_clear_errors(backend):
    rng = np.random.default_rng(0)
    x = _int8(rng, (3, 8))
    xf = rng.standard_normal((3, 8)).astype(np.float32)
    w, _ = _params(rng, 8)
    on = backend.asarray
    cases = [
        (ArgumentError, "x_scale is required", lambda: _call(backend, x, w, None)),
        (ArgumentError, "only for an int8 x", lambda: _call(backend, xf, w, None, 0.5)),
        (ShapeError, "x_scale must be a scalar", lambda: _call(backend, x, w, None, np.ones(4, np.float32))),
        (ArgumentError, "positive finite", lambda: _call(backend, x, w, None, np.array([1, 0, 1], np.float32))),
        (ArgumentError, "positive finite", lambda: _call(backend, x, w, None, float("nan"))),
        (DTypeError, "x_scale must have dtype", lambda: _call(backend, x, w, None, np.ones(3, np.int32))),
        (DTypeError, "x must have dtype int8, float16", lambda: _call(backend, x.astype(np.int16), w, None, 1.0)),
        (ArgumentError, "quantize must be", lambda: _call(backend, xf, w, None, quantize="channel")),
        (ArgumentError, "out_scale must be", lambda: _call(backend, xf, w, None, out_scale=0.0)),
        (ArgumentError, "out_scale must be", lambda: _call(backend, xf, w, None, out_scale=float("inf"))),
        (ArgumentError, "out_scale must be", lambda: _call(backend, xf, w, None, out_scale=1e-60)),
        (ArgumentError, "out_scale must be", lambda: _call(backend, xf, w, None, out_scale=True)),
        (ArgumentError, "whole tensor", lambda: _call(backend, xf, w, None, quantize="row", out_scale=0.1)),
    ]
    for err, msg, fn in cases:
        with pytest.raises(err, match=msg):
            fn()
    _, ctx = _call(backend, x, w, None, 0.5, quantize="row")
    with pytest.raises(DTypeError, match="expected float32 .for x of dtype int8"):
        pynorm.quant_layer_norm_backward(on(np.ones((3, 8), np.float16)), ctx)


def test_hidden_size_limit_of_int8_input():
    x = np.zeros((1, 1 << 24), np.int8)
    with pytest.raises(ShapeError, match="fewer than 2\\*\\*24"):
        pynorm.quant_layer_norm(x, x_scale=1.0, backend="numpy")


def test_layer(backend):
    from pynorm.layers import QuantLayerNorm

    rng = np.random.default_rng(1)
    layer = QuantLayerNorm(16, quantize="row", backend=backend.name, xp=backend.xp)
    x = backend.asarray(_int8(rng, (4, 16)))
    (q, s), ctx = layer.forward(x, x_scale=0.05)
    assert q.dtype == np.int8 and tuple(s.shape) == (4,)
    dx = layer.backward(backend.asarray(np.ones((4, 16), np.float32)), ctx)
    assert tuple(dx.shape) == (4, 16) and sorted(layer.grads) == ["bias", "weight"]
    ref = pynorm.quant_layer_norm(_int8(np.random.default_rng(1), (4, 16)), np.ones(16, np.float32),
                                  np.zeros(16, np.float32), x_scale=0.05, quantize="row", backend="numpy")  # fmt: skip
    assert backend.to_numpy(q).tobytes() == ref[0].tobytes()


@pytest.mark.parametrize("dt", ["float16", "bfloat16", "float32", "float64"])
def test_numba_row_amax_is_numpys_on_every_storage_dtype(dt):
    # the numba quantizers' max |y| of a row reads the values' bits in signed integer lanes: every magnitude,
    # infinities, subnormals and -0 ordered as numpy orders the values, NaN ignored, 0 for an all-NaN or empty row
    pytest.importorskip("numba")
    from numba import njit

    from pynorm.backends.numba._common import storage
    from pynorm.backends.numba._quant_kernels import amax_of

    @njit
    def run(b):
        return amax_of(b)

    d = dtype(dt)
    rng = np.random.default_rng(16)
    tiny = float(np.finfo(np.float16).smallest_subnormal) if d == np.float16 else 1e-40 if d.itemsize == 4 else 1e-310
    rows = [
        rng.standard_normal(37) * 3,
        np.array([-0.0, tiny, -tiny * 3, 0.0]),
        np.array([np.nan, -5.0, 2.0, np.nan]),
        np.array([1.0, -np.inf, np.nan]),
        np.array([np.inf, -2.0]),
        np.array([np.nan, np.nan]),
        np.array([-0.0]),
        np.zeros(0),
        -np.abs(rng.standard_normal(100)) * 1e3,  # (the largest magnitude negative, many vector lanes)
    ]
    for r in rows:
        with np.errstate(over="ignore"):
            v = r.astype(d)
        v64 = v.astype(np.float64)
        mag = np.abs(v64[~np.isnan(v64)])
        want = float(mag.max()) if mag.size else 0.0
        got = run(storage(v))
        assert got == want, (dt, r, got, want)


def test_numba_int8_codes_are_the_divisions_codes_at_ties_and_every_scale():
    # the numba int8 quantizer divides through the reciprocal and Markstein's correction where that is the IEEE
    # quotient: its codes (and clip mask) must be rint(x / s)'s on quotients at and next to every .5 tie, for
    # scales across the range it takes that path in and beyond it, subnormal and non-finite x included
    pytest.importorskip("numba")
    from numba import njit

    from pynorm.backends.numba._quant_kernels import amax_of, codes

    @njit
    def run(buf, sd, qr, kr):
        codes(buf, sd, qr, kr, True, amax_of(buf))

    rng = np.random.default_rng(17)
    ties = np.arange(-130, 131) + 0.5
    for e in (-1070, -600, -501, -500, -499, -100, -7, 0, 3, 60, 499, 500, 501, 900):
        for m in (1.0, 1.5, 1.0 / 3.0, 0.7071067811865476, rng.uniform(1, 2)):
            sd = float(np.ldexp(m, e))
            if not np.isfinite(sd) or sd == 0:
                continue
            q = np.concatenate([ties, rng.uniform(-200, 200, 64), [0.49999999999999994, 127.49999999999999]])
            x = q * sd  # (rounded: quotients at, above and below the ties)
            x = np.concatenate([x, np.nextafter(x, np.inf), np.nextafter(x, -np.inf), [5e-324, -0.0, np.nan]])
            for extra in ([], [np.inf], [np.nan, -np.inf]):
                buf = np.concatenate([x, extra])
                with np.errstate(all="ignore"):
                    t = np.rint(buf / sd)
                    want = np.clip(np.where(np.isnan(t), 0.0, t), -127, 127).astype(np.int8)
                qr, kr = np.empty(buf.size, np.int8), np.empty(buf.size, np.bool_)
                run(buf, sd, qr, kr)
                np.testing.assert_array_equal(qr, want, err_msg=f"sd={sd!r} extra={extra}")
                np.testing.assert_array_equal(kr, ~(np.abs(t) > 127), err_msg=f"sd={sd!r} keep")
                with np.errstate(all="ignore"):
                    b32 = buf.astype(np.float32)
                    t = np.rint(b32.astype(np.float64) / sd)
                run(b32, sd, qr, kr)  # (a float32 row, read exactly)
                want = np.clip(np.where(np.isnan(t), 0.0, t), -127, 127).astype(np.int8)
                np.testing.assert_array_equal(qr, want, err_msg=f"sd={sd!r} float32")
