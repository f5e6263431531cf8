"""The modality LayerNorm / RMSNorm: their own properties, on every backend."""

from __future__ import annotations

import numpy as np
import pytest

import pynorm
from pynorm.errors import ArgumentError, DTypeError, ShapeError

OPS = {"modality_layer_norm": "layer_norm", "modality_rms_norm": "rms_norm"}


def _data(rng, op, rows=12, h=17, m=4, dt=np.float32):
    x = rng.standard_normal((rows, h)).astype(dt)
    w = (1 + 0.5 * rng.standard_normal((m, h))).astype(dt)
    b = (0.5 * rng.standard_normal((m, h))).astype(dt)
    return x, w, (b if op == "modality_layer_norm" else None)


def _fwd(backend, op, x, ids, w, b, **kw):
    f = getattr(pynorm, f"{op}_forward")
    args = [backend.asarray(x), backend.asarray(ids), backend.asarray(w)]
    if b is not None:
        args.append(backend.asarray(b))
    return f(*args, backend=backend.name, **kw)


@pytest.mark.parametrize("dt", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("op", sorted(OPS))
def test_all_ids_equal_is_the_plain_norm_bitwise(backend, op, dt, monkeypatch):
    # the cupy backend runs a table op's backward on its split path (rows grouped by modality); its
    # plain norm would take the fused path, whose row sums are added in another order
    monkeypatch.setenv("PYNORM_CUPY_BACKWARD", "split")
    rng = np.random.default_rng(0)
    x, w, b = _data(rng, op, dt=dt)
    ids = np.full(x.shape[0], 2)
    y, ctx = _fwd(backend, op, x, ids, w, b)
    plain = getattr(pynorm, f"{OPS[op]}_forward")
    args = [backend.asarray(w[2])] + ([] if b is None else [backend.asarray(b[2])])
    y_p, ctx_p = plain(backend.asarray(x), *args, backend=backend.name)
    np.testing.assert_array_equal(backend.to_numpy(y).view(np.uint8), backend.to_numpy(y_p).view(np.uint8))
    dy = rng.standard_normal(x.shape).astype(dt)
    g = getattr(pynorm, f"{op}_backward")(backend.asarray(dy), ctx)
    g_p = getattr(pynorm, f"{OPS[op]}_backward")(backend.asarray(dy), ctx_p)
    np.testing.assert_array_equal(backend.to_numpy(g.dx).view(np.uint8), backend.to_numpy(g_p.dx).view(np.uint8))
    for a, ap in zip(g[1:], g_p[1:], strict=True):
        t = backend.to_numpy(a)
        np.testing.assert_array_equal(t[2].view(np.uint8), backend.to_numpy(ap).view(np.uint8))
        assert not np.any(np.delete(t, 2, axis=0))  # unused modalities get 0


@pytest.mark.parametrize("op", sorted(OPS))
def test_every_id_used_but_one(backend, op):
    rng = np.random.default_rng(1)
    x, w, b = _data(rng, op, m=4, dt=np.float64)
    ids = rng.permutation(np.arange(12) % 3)  # modality 3 unused
    ids_copy = ids.copy()
    y, ctx = _fwd(backend, op, x, ids, w, b)
    dy = rng.standard_normal(x.shape)
    g = getattr(pynorm, f"{op}_backward")(backend.asarray(dy), ctx)
    np.testing.assert_array_equal(ids, ids_copy)
    for i in range(12):  # each row is the plain norm (same backend) with its modality's parameters
        plain = getattr(pynorm, OPS[op])
        args = [backend.asarray(w[ids[i]])] + ([] if b is None else [backend.asarray(b[ids[i]])])
        y_i = backend.to_numpy(plain(backend.asarray(x), *args, backend=backend.name))[i]
        np.testing.assert_array_equal(backend.to_numpy(y)[i].view(np.uint8), y_i.view(np.uint8))
    assert not backend.to_numpy(g.dweight)[3].any()


@pytest.mark.parametrize("op", sorted(OPS))
def test_bad_ids(backend, op):
    rng = np.random.default_rng(2)
    x, w, b = _data(rng, op, rows=4, m=3)
    with pytest.raises(ArgumentError, match=r"modality_ids must hold values in \[0, 3\)"):
        _fwd(backend, op, x, np.array([0, 1, 3, 0]), w, b)
    with pytest.raises(ArgumentError, match="modality_ids must hold values"):
        _fwd(backend, op, x, np.array([0, -1, 2, 0]), w, b)
    with pytest.raises(DTypeError, match="modality_ids must be an integer array"):
        _fwd(backend, op, x, np.array([0.0, 1.0, 2.0, 0.0]), w, b)
    with pytest.raises(ShapeError, match="modality_ids has shape"):
        _fwd(backend, op, x, np.array([0, 1]), w, b)
    with pytest.raises(ShapeError, match="weight must be a table"):
        _fwd(backend, op, x, np.array([0, 1, 2, 0]), w[0], b)
    with pytest.raises(ArgumentError, match="weight is required"):
        getattr(pynorm, op)(backend.asarray(x), backend.asarray(np.zeros(4, np.int64)), None, backend=backend.name)


def test_layer_specific_and_shared():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((2, 5, 8)).astype(np.float32)
    ids = np.array([[0, 1, 1, 2, 0], [2, 2, 0, 1, 1]])
    for kind in ("layer", "rms"):
        spec = pynorm.layers.ModalityNorm(8, 3, kind=kind, backend="numpy")
        assert spec.params["weight"].shape == (3, 8)
        y, ctx = spec.forward(x, ids)
        spec.backward(np.ones_like(y), ctx)
        assert spec.grads["weight"].shape == (3, 8)
        shared = pynorm.layers.ModalityNorm(8, 3, kind=kind, mode="shared", backend="numpy")
        assert shared.params["weight"].shape == (8,)
        y2, _ = shared.forward(x, ids)
        np.testing.assert_array_equal(y, y2)  # tables start equal: the same as one shared set
    with pytest.raises(ArgumentError):
        pynorm.layers.ModalityNorm(8, 0)


@pytest.mark.parametrize("op", sorted(OPS))
def test_one_table_row_per_row_keeps_the_backward_linear_in_memory(backend, op):
    # a conditional norm's table has a row per sample; a scratch of one partials row per (row block, table
    # row) is (R / 32) * R rows: 67 MB here, 17 GB at 4096 x 4096
    if backend.name not in ("numpy", "numba"):
        pytest.skip("host memory of the numpy-array backends (tracemalloc sees numpy's allocations)")
    import tracemalloc

    rows, h = 2048, 64
    rng = np.random.default_rng(4)
    x, w, b = _data(rng, op, rows=rows, h=h, m=rows)
    ids = rng.permutation(rows)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    _, ctx = _fwd(backend, op, x, ids, w, b)
    bwd = getattr(pynorm, f"{op}_backward")
    bwd(dy, ctx)  # compiled and pooled before the measured call
    tracemalloc.start()
    try:
        g = bwd(dy, ctx)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 32 * x.nbytes, f"backward peak {peak / 2**20:.1f} MiB for a {x.nbytes / 2**20:.1f} MiB x"
    f = getattr(pynorm, f"{op}_forward")
    _, ctx_r = f(x, ids, w, *([] if b is None else [b]), backend="numpy")
    g_r = bwd(dy, ctx_r)
    for a, ar in zip(g, g_r, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(ar), rtol=2e-5, atol=2e-5)
