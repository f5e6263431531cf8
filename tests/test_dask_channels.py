"""pynorm.dask for the channels layout (GroupNorm, InstanceNorm, BatchNorm) against the in-memory ops.

x is chunked along its batch axis only. Expectations, and why:

* GroupNorm, InstanceNorm and evaluation-mode BatchNorm have per-sample statistics (or none): ``y`` and ``dx`` are
  **bitwise** the in-memory ones on the same backend; the parameter gradients are sums over the blocks (each
  block's rounded to the parameter's dtype, added in float64, rounded once): to ``PARAM_RTOL`` of the terms'
  magnitude (the spec's term scales);
* training BatchNorm: each block's per-channel ``(count, mean, M2)`` in float64, merged by Chan's formula in the
  blocks' order, then each block normalized by the in-memory op with those statistics: ``y``, ``dx`` and the
  running statistics within ``PARAM_RTOL`` of the terms (a different order of the reduction), and bitwise the
  same from one compute to the next and for any scheduler.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

da = pytest.importorskip("dask.array", reason="pynorm.dask needs dask[array] (pip install 'pynorm[dask]')")
import dask  # noqa: E402

import pynorm  # noqa: E402
import pynorm.dask as pdask  # noqa: E402
from pynorm.errors import ArgumentError, ArrayTypeError, ShapeError  # noqa: E402

from .helpers import assert_close_scaled  # noqa: E402
from .test_dask import PARAM_RTOL, _numpy_only  # noqa: E402
from .test_dask import client as client  # noqa: E402  (the LocalCluster fixture)

RUNNING = {"running_mean": np.linspace(-0.5, 0.5, 6).astype(np.float32), "running_var": np.full(6, 2.0, np.float32)}

CASES = [
    ("group_norm", {"num_groups": 3}),
    ("group_norm", {"num_groups": 2, "channel_axis": -1}),
    ("instance_norm", {}),
    ("instance_norm", {**RUNNING}),
    ("instance_norm", {"use_input_stats": False, **RUNNING}),
    ("batch_norm", {"training": True}),
    ("batch_norm", {"training": True, "channel_axis": -1, **RUNNING}),
    ("batch_norm", {"training": True, "momentum": None, "num_batches_tracked": 3, **RUNNING}),
    ("batch_norm", {"training": False, **RUNNING}),
]


def _data(shape: tuple[int, ...], axis: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 3 + 2).astype(np.float32)
    c = shape[axis]
    w = rng.uniform(0.5, 2, c).astype(np.float32)
    b = rng.standard_normal(c).astype(np.float32)
    dy = rng.standard_normal(shape).astype(np.float32)
    return x, w, b, dy


def _scales(op: str, x: np.ndarray, w: np.ndarray, b: np.ndarray, dy: np.ndarray, kw: dict[str, Any]) -> dict:
    spec = pynorm.ops.SPECS[op]
    opts = spec.validate({k: v for k, v in kw.items() if not k.startswith("running")})
    ax = opts["channel_axis"] % x.ndim
    x3 = np.moveaxis(x, ax, 1).reshape(x.shape[0], x.shape[ax], -1)
    dy3 = np.moveaxis(dy, ax, 1).reshape(x3.shape)
    arrays = {"weight": w, "bias": b, **{k: v for k, v in kw.items() if k.startswith("running")}}
    return spec.term_scales(x3, arrays, dy3, opts)


def _serves(backend: Any, op: str) -> None:
    _numpy_only(backend)
    if op not in backend.ops:
        pytest.skip(f"backend {backend.name!r} does not implement {op!r}")


@pytest.mark.parametrize("spatial", [(7,), (4, 5), (2, 3, 2)], ids=["1d", "2d", "3d"])
@pytest.mark.parametrize("op,kw", CASES, ids=[f"{op}-{'-'.join(kw) or 'plain'}" for op, kw in CASES])
def test_matches_in_memory(backend: Any, op: str, kw: dict[str, Any], spatial: tuple[int, ...]) -> None:
    _serves(backend, op)
    last = kw.get("channel_axis") == -1
    shape = (10, *spatial, 6) if last else (10, 6, *spatial)
    x, w, b, dy = _data(shape, -1 if last else 1)
    outs, ctx = getattr(pynorm, f"{op}_forward")(x, w, b, backend=backend.name, **kw)
    want = getattr(pynorm, f"{op}_backward")(dy, ctx)
    xd = da.from_array(x, chunks=(3, *shape[1:]))
    dyd = da.from_array(dy, chunks=(4, *(max(1, d // 2) for d in shape[1:])))  # rechunked to x's
    outs_d, ctx_d = getattr(pdask, f"{op}_forward")(xd, w, b, backend=backend.name, **kw)
    grads_d = getattr(pdask, f"{op}_backward")(dyd, ctx_d)
    outs_t = outs if isinstance(outs, tuple) else (outs,)
    outs_dt = outs_d if isinstance(outs_d, tuple) else (outs_d,)
    assert len(outs_t) == len(outs_dt)
    got = dask.compute(*outs_dt, *grads_d)
    again = dask.compute(*outs_dt, *grads_d, scheduler="threads")
    for g, h in zip(got, again, strict=True):
        np.testing.assert_array_equal(g, h)  # deterministic, whatever the scheduler
    scales = _scales(op, x, w, b, dy, kw)
    batch = op == "batch_norm" and kw["training"]
    rtol = PARAM_RTOL["float32"]
    for name, g, e in zip(("y", "running_mean", "running_var")[: len(outs_t)], got, outs_t):
        assert g.dtype == e.dtype and g.shape == e.shape
        if name == "y" and not batch:
            np.testing.assert_array_equal(g, e)
        else:
            s = scales.get(name, np.abs(np.asarray(e, np.float64)) + 1)
            assert_close_scaled(g, e, np.broadcast_to(s.reshape(e.shape) if s.size == e.size else s, e.shape), rtol)
    for name, g, e in zip(want._fields, got[len(outs_t) :], want, strict=True):
        if e is None:
            assert g is None
            continue
        assert g.dtype == e.dtype and g.shape == e.shape, name
        if name == "dx" and not batch:
            np.testing.assert_array_equal(g, e)
        else:
            s = np.asarray(scales[name]).reshape(-1)
            if name == "dx":
                s = np.moveaxis(s.reshape(x.shape[0], x.shape[-1 if last else 1], -1), 1, -1 if last else 1)
            assert_close_scaled(g, e, np.asarray(s).reshape(e.shape), 4 * rtol, f"{op} {name}")


def test_batch_statistics_exact_on_hard_inputs(backend: Any) -> None:
    """A large offset and a constant channel over 16 blocks: Chan's merge keeps the variance of the centred values
    (a sum of squares would lose it to cancellation)."""
    _serves(backend, "batch_norm")
    rng = np.random.default_rng(5)
    x = (1e4 + rng.standard_normal((64, 3, 8))).astype(np.float32)
    x[:, 1] = 7.0
    y, _ = pynorm.batch_norm_forward(x, training=True, backend=backend.name)
    yd, _ = pdask.batch_norm_forward(da.from_array(x, chunks=(4, 3, 8)), training=True, backend=backend.name)
    got = yd.compute()
    assert np.all(got[:, 1] == 0) and np.all(y[:, 1] == 0)
    np.testing.assert_allclose(got, y, rtol=0, atol=4e-5)


def test_distributed_batch_and_group_norm(backend: Any, client: Any) -> None:
    """Training BatchNorm and GroupNorm forward + backward through two worker processes."""
    _serves(backend, "batch_norm")
    from distributed import get_task_stream

    x, w, b, dy = _data((32, 6, 4, 4), 1, seed=3)
    xd = da.from_array(x, chunks=(2, 6, 4, 4))
    dyd = da.from_array(dy, chunks=(2, 6, 4, 4))
    for op, kw in (("batch_norm", {"training": True, **RUNNING}), ("group_norm", {"num_groups": 2})):
        if op not in backend.ops:
            continue
        _, ctx = getattr(pynorm, f"{op}_forward")(x, w, b, backend=backend.name, **kw)
        want = getattr(pynorm, f"{op}_backward")(dy, ctx)
        outs_d, ctx_d = getattr(pdask, f"{op}_forward")(xd, w, b, backend=backend.name, **kw)
        outs_dt = outs_d if isinstance(outs_d, tuple) else (outs_d,)
        grads = getattr(pdask, f"{op}_backward")(dyd, ctx_d)
        with get_task_stream(client) as ts:
            got = client.gather(client.compute([*outs_dt, *grads]))
        assert len({t["worker"] for t in ts.data}) == 2
        local = dask.compute(*outs_dt, *grads, scheduler="sync")
        for g, h in zip(got, local, strict=True):
            np.testing.assert_array_equal(g, h)  # the same numbers wherever the blocks ran
        np.testing.assert_allclose(got[len(outs_dt)], want.dx, rtol=0, atol=2e-5)


def test_errors() -> None:
    x = da.zeros((4, 6, 5), chunks=(2, 6, 5), dtype=np.float32)
    with pytest.raises(ArgumentError, match="channel_axis must be 1"):
        pdask.group_norm(x, num_groups=2, channel_axis=0)
    with pytest.raises(ShapeError, match="num_groups=4 must divide"):
        pdask.group_norm(x, num_groups=4)
    with pytest.raises(ArrayTypeError, match="running_mean must be an in-memory array"):
        pdask.batch_norm(x, running_mean=da.zeros(6), running_var=np.ones(6), training=True)
    with pytest.raises(ShapeError, match="more than 1 value per channel"):
        pdask.batch_norm(da.zeros((1, 6), chunks=1, dtype=np.float32), training=True)
    with pytest.raises(ShapeError, match="one value per channel"):
        pdask.batch_norm(x, running_mean=np.zeros(5), running_var=np.ones(5), training=False)
    with pytest.raises(ArrayTypeError, match="dask.array.Array"):
        pdask.group_norm(np.zeros((4, 6, 5), np.float32), num_groups=2)
    _, ctx = pdask.batch_norm_forward(x, training=True)
    with pytest.raises(ArgumentError, match="no recompute"):
        pdask.batch_norm_backward(da.zeros_like(x), ctx, recompute=True)
