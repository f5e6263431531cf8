"""Every backend against the reference, for every op, dtype and convention, on ordinary and hard inputs."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import pynorm

from .helpers import BACKEND_RTOL, DTYPES, OPS, assert_close_scaled, dtype, make_params, make_rows, term_scales

KINDS = ("normal", "offset", "huge", "tiny", "constant")


def _compare(backend, op, x, params, conv, axis, dy_seed=0):
    spec = OPS[op]
    dt = x.dtype
    ax = axis % x.ndim
    rows, h = int(np.prod(x.shape[:ax])), int(np.prod(x.shape[ax:]))
    rng = np.random.default_rng(dy_seed)
    dy = rng.standard_normal(x.shape).astype(dt)
    y_ref, c_ref = spec.forward(x, *params, axis=axis, backend="numpy", **conv)
    g_ref = spec.backward(dy, c_ref)
    args = [None if p is None else backend.asarray(p) for p in params]
    y, c = spec.forward(backend.asarray(x), *args, axis=axis, backend=backend.name, **conv)
    assert c.backend == backend.name
    g = spec.backward(backend.asarray(dy), c)
    assert y.dtype == dt and tuple(y.shape) == x.shape
    pd = {n: p for n, p in zip(spec.params, params, strict=True)}
    sc = term_scales(op, x.reshape(rows, h), {k: v for k, v in pd.items() if v is not None}, dy.reshape(rows, h), conv)
    rtol = BACKEND_RTOL[dt.name]
    assert_close_scaled(backend.to_numpy(y).reshape(rows, h), y_ref.reshape(rows, h), sc["y"], rtol, f"{op} y")
    assert_close_scaled(backend.to_numpy(g[0]).reshape(rows, h), g_ref[0].reshape(rows, h), sc["dx"], rtol, "dx")
    for name, ga, gr in zip(spec.params, g[1:], g_ref[1:], strict=True):
        if pd[name] is None:
            assert ga is None and gr is None
            continue
        assert ga.dtype == pd[name].dtype and tuple(ga.shape) == pd[name].shape
        rt = max(rtol, BACKEND_RTOL[pd[name].dtype.name])
        assert_close_scaled(backend.to_numpy(ga).ravel(), gr.ravel(), sc["d" + name].ravel(), rt * 4, f"d{name}")
        assert np.all(np.isfinite(backend.to_numpy(ga).astype(np.float64)))
    if np.all(np.isfinite(x.astype(np.float64))) and conv.get("eps", 1e-5) > 0:
        assert np.all(np.isfinite(backend.to_numpy(y).astype(np.float64))), "finite input must give finite y"
        assert np.all(np.isfinite(backend.to_numpy(g[0]).astype(np.float64))), "finite input must give finite dx"


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("op", sorted(OPS))
def test_matches_reference_on_hard_inputs(backend, op, kind, dt):
    rng = np.random.default_rng(7)
    spec = OPS[op]
    for h in (1, 3, 64, 257):
        x = make_rows(kind, (6, h), dt, rng)
        params = make_params(spec, (h,), dtype(dt), rng)
        _compare(backend, op, x, params, {}, -1)


@pytest.mark.parametrize("op", sorted(OPS))
def test_matches_reference_every_convention(backend, op):
    rng = np.random.default_rng(11)
    spec = OPS[op]
    for conv in spec.conventions:
        for dt in DTYPES:
            x = make_rows("normal", (5, 2, 33), dt, rng)
            params = make_params(spec, (2, 33), dtype(dt), rng)
            _compare(backend, op, x, params, conv, 1)
            _compare(backend, op, x, [None] * len(params), conv, -2)


@given(
    data=st.data(),
    op=st.sampled_from(sorted(OPS)),
    dt=st.sampled_from(DTYPES),
    kind=st.sampled_from(KINDS),
    seed=st.integers(0, 2**32 - 1),
)
def test_matches_reference_random(backend, data, op, dt, kind, seed):
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
    params = make_params(spec, shape[ndim - k :], pdt, rng)
    if data.draw(st.booleans()):
        params = [None] * len(params)
    _compare(backend, op, x, params, conv, -k, dy_seed=seed)


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
    params = make_params(spec, x.shape[-1:], np.float32, rng)
    y_c, _ = spec.forward(np.ascontiguousarray(x), *params, backend="numpy")
    xb = backend.asarray(x) if backend.xp is not np else x
    y, ctx = spec.forward(xb, *[backend.asarray(p) for p in params], backend=backend.name)
    np.testing.assert_allclose(backend.to_numpy(y), y_c, rtol=2e-6, atol=2e-6)
    dy = np.asfortranarray(rng.standard_normal(x.shape).astype(np.float32))
    g = spec.backward(backend.asarray(dy), ctx)
    _, c_ref = spec.forward(np.ascontiguousarray(x), *params, backend="numpy")
    np.testing.assert_allclose(backend.to_numpy(g[0]), spec.backward(dy, c_ref)[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("op", sorted(OPS))
def test_inputs_unchanged_and_outputs_fresh(backend, op):
    rng = np.random.default_rng(2)
    spec = OPS[op]
    x = backend.asarray(rng.standard_normal((4, 16)).astype(np.float32))
    params = [backend.asarray(p) for p in make_params(spec, (16,), np.float32, rng)]
    dy = backend.asarray(rng.standard_normal((4, 16)).astype(np.float32))
    copies = [backend.to_numpy(a).copy() for a in (x, *params, dy)]
    y, ctx = spec.forward(x, *params, backend=backend.name)
    grads = spec.backward(dy, ctx)
    for a, c in zip((x, *params, dy), copies, strict=True):
        np.testing.assert_array_equal(backend.to_numpy(a), c)
    xp = backend.xp
    for out in (y, *grads):
        for inp in (x, *params, dy):
            assert not xp.may_share_memory(out, inp)


@pytest.mark.parametrize("op", sorted(OPS))
def test_out_buffers(backend, op):
    rng = np.random.default_rng(4)
    spec = OPS[op]
    x = backend.asarray(rng.standard_normal((5, 7)).astype(np.float32))
    params = [backend.asarray(p) for p in make_params(spec, (7,), np.float32, rng)]
    y0, ctx0 = spec.forward(x, *params, backend=backend.name)
    out = backend.xp.full((5, 7), np.nan, dtype=np.float32)
    y1, ctx1 = spec.forward(x, *params, backend=backend.name, out=out)
    assert y1 is out
    np.testing.assert_array_equal(backend.to_numpy(out), backend.to_numpy(y0))
    dy = backend.asarray(rng.standard_normal((5, 7)).astype(np.float32))
    dx_out = backend.xp.full((5, 7), np.nan, dtype=np.float32)
    g = spec.backward(dy, ctx1, dx_out=dx_out)
    assert g[0] is dx_out
    np.testing.assert_array_equal(backend.to_numpy(dx_out), backend.to_numpy(spec.backward(dy, ctx0)[0]))


@pytest.mark.parametrize("op", sorted(OPS))
def test_zero_rows(backend, op):
    spec = OPS[op]
    x = backend.asarray(np.zeros((0, 3, 4), np.float32))
    params = [backend.asarray(np.ones((3, 4), np.float32)) for _ in spec.params]
    y, ctx = spec.forward(x, *params, axis=1, backend=backend.name)
    assert y.shape == (0, 3, 4)
    g = spec.backward(backend.asarray(np.zeros((0, 3, 4), np.float32)), ctx)
    for gp in g[1:]:
        np.testing.assert_array_equal(backend.to_numpy(gp), np.zeros((3, 4), np.float32))


def test_automatic_choice_prefers_fast_backend():
    x = np.ones((2, 3), np.float32)
    _, ctx = pynorm.layer_norm_forward(x)
    numba_ok = pynorm._registry.unavailable_reason("numba") is None
    expected = "numba" if numba_ok and "layer_norm" in pynorm._registry.backend_ops("numba") else "numpy"
    assert ctx.backend == expected
