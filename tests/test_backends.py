"""Every backend against the reference, for every op, dtype and convention, on ordinary and hard inputs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import pynorm

from .helpers import (
    BACKEND_RTOL,
    DTYPES,
    OPS,
    assert_close_scaled,
    dtype,
    flat_arrays,
    make_args,
    make_rows,
    out_shape,
    term_scales,
)

KINDS = ("normal", "offset", "huge", "tiny", "constant")


def _compare(backend, op, x, args, conv, axis, dy_seed=0):
    spec = OPS[op]
    dt = x.dtype
    ax = axis % x.ndim
    rows, h = int(np.prod(x.shape[:ax])), int(np.prod(x.shape[ax:]))
    rng = np.random.default_rng(dy_seed)
    yshape = out_shape(spec, x.shape, ax, args)
    dy = rng.standard_normal(yshape).astype(dt)
    y_ref, c_ref = spec.forward(x, *args, axis=axis, backend="numpy", **conv)
    g_ref = spec.backward(dy, c_ref)
    dev = [None if a is None else backend.asarray(a) for a in args]
    y, c = spec.forward(backend.asarray(x), *dev, axis=axis, backend=backend.name, **conv)
    assert c.backend == backend.name
    g = spec.backward(backend.asarray(dy), c)
    assert y.dtype == dt and tuple(y.shape) == yshape
    arrays = flat_arrays(spec, x.shape, ax, args)
    yh = int(np.prod(yshape[ax:]))
    sc = term_scales(op, x.reshape(rows, h), arrays, dy.reshape(rows, yh), conv)
    rtol = BACKEND_RTOL[dt.name]
    y_h = backend.to_numpy(y).reshape(rows, yh)
    # a fused norm + Linear rounds twice: the norm's output n (at a rounding midpoint, one ulp apart between
    # backends), then n W^T: two units at the terms' scale (float16, H = 1, n at 2.1005859375: hypothesis found it)
    ry = 2 * rtol if "n" in spec.spec.outputs else rtol
    assert_close_scaled(y_h, y_ref.reshape(rows, yh), sc["y"], ry, f"{op} y")
    dx_h = backend.to_numpy(g[0]).reshape(rows, h)
    assert_close_scaled(dx_h, g_ref[0].reshape(rows, h), sc["dx"], rtol, "dx")
    originals = dict(zip(spec.arg_names, args, strict=True))
    for gname, ga, gr in zip(spec.grad_names[1:], g[1:], g_ref[1:], strict=True):
        a = originals[gname[1:]]
        if a is None:
            assert ga is None and gr is None
            continue
        assert ga.dtype == a.dtype and tuple(ga.shape) == tuple(a.shape), gname
        rt = max(rtol, BACKEND_RTOL[a.dtype.name])
        assert_close_scaled(backend.to_numpy(ga).ravel(), gr.ravel(), sc[gname].ravel(), rt * 4, gname)
        fin = np.isfinite(np.asarray(gr, dtype=np.float64))
        assert np.all(np.isfinite(backend.to_numpy(ga).astype(np.float64))[fin]), f"{gname} not finite"
    # finite where the reference is finite (the contract: finite input and eps > 0 give finite results
    # wherever the exact result is within the dtype's range)
    if np.all(np.isfinite(x.astype(np.float64))) and conv.get("eps", 1e-5) > 0:
        for what, a, e in (("y", y_h, y_ref), ("dx", dx_h, g_ref[0])):
            fin = np.isfinite(np.asarray(e, dtype=np.float64)).reshape(a.shape)
            assert np.all(np.isfinite(a.astype(np.float64))[fin]), f"finite input must give finite {what}"


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("op", sorted(OPS))
def test_matches_reference_on_hard_inputs(backend, op, kind, dt):
    rng = np.random.default_rng(7)
    spec = OPS[op]
    for h in (1, 3, 64, 257):
        x = make_rows(kind, (6, h), dt, rng)
        _compare(backend, op, x, make_args(spec, x.shape, -1, dtype(dt), rng), {}, -1)


@pytest.mark.parametrize("path", ["auto", "split"])
@pytest.mark.parametrize("h", [1000, 20000])
@pytest.mark.parametrize("op", sorted(OPS))
def test_long_rows_on_each_backward_path(backend, op, h, path, monkeypatch):
    """Rows of many items per thread: at H = 1000 every fast backend keeps a row in registers; at
    H = 20000 forward items spill to shared memory (cupy) and the backward streams. ``path``: the
    cupy backend's choice (the fused backward where a row fits) or its split backward forced
    (``PYNORM_CUPY_BACKWARD``; other backends ignore it)."""
    if path == "split":
        if backend.name != "cupy":
            pytest.skip(
                f"the split backward is the cupy backend's launch choice: {backend.name} ran these rows under 'auto'"
            )
        monkeypatch.setenv("PYNORM_CUPY_BACKWARD", "split")
    rng = np.random.default_rng(13)
    spec = OPS[op]
    for dt in DTYPES:
        x = make_rows("normal", (3, h), dt, rng)
        _compare(backend, op, x, make_args(spec, x.shape, -1, dtype(dt), rng), {}, -1)


@pytest.mark.parametrize("op", sorted(OPS))
def test_matches_reference_every_convention(backend, op):
    """Each convention of ``op`` in every dtype, with and without its optional arguments. On numba each 16-bit
    dtype takes the default convention and every other one of the rest (float16 the odd, bfloat16 the even): a
    convention is compute code, the same for both 16-bit formats, whose loads and stores are the storage pieces
    every op shares (each (convention, dtype) pair is a kernel signature of its own: ~1 s of compilation apiece)."""
    rng = np.random.default_rng(11)
    spec = OPS[op]
    for i, conv in enumerate(spec.conventions):
        for dt in DTYPES:
            if backend.name == "numba" and i and dt in ("float16", "bfloat16") and i % 2 != (dt == "float16"):
                continue
            x = make_rows("normal", (5, 2, 33), dt, rng)
            args = make_args(spec, x.shape, 1, dtype(dt), rng, options=conv)
            _compare(backend, op, x, args, conv, 1)
            _compare(backend, op, x, spec.without_optional(args), conv, -2)


@given(
    data=st.data(),
    dt=st.sampled_from(DTYPES),
    kind=st.sampled_from(KINDS),
    seed=st.integers(0, 2**32 - 1),
)
def test_matches_reference_random(backend, data, dt, kind, seed):
    op = data.draw(st.sampled_from(sorted(o for o in OPS if o in backend.ops)))
    spec = OPS[op]
    ndim = data.draw(st.integers(1, 4))
    shape = tuple(data.draw(st.lists(st.integers(1, 9), min_size=ndim, max_size=ndim)))
    k = data.draw(st.integers(1, min(3, ndim)))
    conv = data.draw(st.sampled_from(spec.conventions))
    if conv.get("correction") == 1 and np.prod(shape[ndim - k :]) == 1:
        conv = {}
    rng = np.random.default_rng(seed)
    x = make_rows(kind, shape, dt, rng)
    pdt = dtype(data.draw(st.sampled_from(DTYPES)))  # parameters may have another dtype than x
    args = make_args(spec, shape, -k, dtype(dt), rng, pdt, options=conv)
    if data.draw(st.booleans()):
        args = spec.without_optional(args)
    _compare(backend, op, x, args, conv, -k, dy_seed=seed)


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("layout", ["fortran", "strided", "transposed"])
def test_non_contiguous_inputs(backend, op, layout):
    rng = np.random.default_rng(5)
    spec = OPS[op]
    base = rng.standard_normal((8, 12, 10)).astype(np.float32)
    x = {
        "fortran": np.asfortranarray(base),
        "strided": base[::2, :, ::2],
        "transposed": base.transpose(1, 0, 2),
    }[layout]
    params = make_args(spec, x.shape, -1, np.float32, rng)
    y_c, _ = spec.forward(np.ascontiguousarray(x), *params, backend="numpy")
    xb = backend.asarray(x) if backend.xp is not np else x
    y, ctx = spec.forward(xb, *[backend.asarray(p) for p in params], backend=backend.name)
    np.testing.assert_allclose(backend.to_numpy(y), y_c, rtol=2e-6, atol=2e-6)
    dy = np.asfortranarray(rng.standard_normal(y_c.shape).astype(np.float32))
    g = spec.backward(backend.asarray(dy), ctx)
    _, c_ref = spec.forward(np.ascontiguousarray(x), *params, backend="numpy")
    np.testing.assert_allclose(backend.to_numpy(g[0]), spec.backward(dy, c_ref)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", sorted(OPS))
def test_inputs_unchanged_and_outputs_fresh(backend, op):
    rng = np.random.default_rng(2)
    spec = OPS[op]
    x = backend.asarray(rng.standard_normal((4, 16)).astype(np.float32))
    host = make_args(spec, (4, 16), -1, np.float32, rng)
    params = [backend.asarray(p) for p in host]
    dy = backend.asarray(rng.standard_normal(out_shape(spec, (4, 16), -1, host)).astype(np.float32))
    arrays = [a for a in (x, *params, dy) if a is not None]
    copies = [backend.to_numpy(a).copy() for a in arrays]
    y, ctx = spec.forward(x, *params, backend=backend.name)
    grads = spec.backward(dy, ctx)
    for a, c in zip(arrays, copies, strict=True):
        np.testing.assert_array_equal(backend.to_numpy(a), c)
    xp = backend.xp
    for out in (y, *grads):
        for inp in arrays:
            assert not xp.may_share_memory(out, inp)


@pytest.mark.parametrize("op", sorted(OPS))
def test_out_buffers(backend, op):
    rng = np.random.default_rng(4)
    spec = OPS[op]
    x = backend.asarray(rng.standard_normal((5, 7)).astype(np.float32))
    host = make_args(spec, (5, 7), -1, np.float32, rng)
    params = [backend.asarray(p) for p in host]
    yshape = out_shape(spec, (5, 7), -1, host)
    y0, ctx0 = spec.forward(x, *params, backend=backend.name)
    out = backend.xp.full(yshape, np.nan, dtype=np.float32)
    y1, ctx1 = spec.forward(x, *params, backend=backend.name, out=out)
    assert y1 is out
    np.testing.assert_array_equal(backend.to_numpy(out), backend.to_numpy(y0))
    dy = backend.asarray(rng.standard_normal(yshape).astype(np.float32))
    dx_out = backend.xp.full((5, 7), np.nan, dtype=np.float32)
    g = spec.backward(dy, ctx1, dx_out=dx_out)
    assert g[0] is dx_out
    np.testing.assert_array_equal(backend.to_numpy(dx_out), backend.to_numpy(spec.backward(dy, ctx0)[0]))


@pytest.mark.parametrize("op", sorted(OPS))
def test_zero_rows(backend, op):
    spec = OPS[op]
    x = backend.asarray(np.zeros((0, 3, 4), np.float32))
    args = make_args(spec, (0, 3, 4), 1, np.float32, np.random.default_rng(0))
    y, ctx = spec.forward(x, *[backend.asarray(a) for a in args], axis=1, backend=backend.name)
    assert y.shape == out_shape(spec, (0, 3, 4), 1, args)
    g = spec.backward(backend.asarray(np.zeros(y.shape, np.float32)), ctx)
    for gp, a in zip(g[1:], [a for a, d in zip(args, spec.differentiable, strict=True) if d], strict=True):
        assert tuple(gp.shape) == tuple(a.shape)
        np.testing.assert_array_equal(backend.to_numpy(gp), np.zeros(a.shape, np.float32))  # sums over no rows


def test_automatic_choice_prefers_fast_backend():
    x = np.ones((2, 3), np.float32)
    _, ctx = pynorm.layer_norm_forward(x)
    numba_ok = pynorm._registry.unavailable_reason("numba") is None
    expected = "numba" if numba_ok and "layer_norm" in pynorm._registry.backend_ops("numba") else "numpy"
    assert ctx.backend == expected
