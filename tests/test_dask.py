"""pynorm.dask: every op on many-chunk Dask arrays against the in-memory path, laziness, rechunking, errors, and a
forward + backward through a ``dask.distributed`` LocalCluster (two worker processes).

Expectations, and why:

* outputs, ``dx`` and a residual's gradient are **bitwise** the in-memory ones on the same backend: each row is
  computed by the same kernel whatever block it is in (rows are independent) -- except for the ops with a matrix
  product (conditional norms, fused norm + Linear): the BLAS behind ``@`` may round a row's dot products
  differently for a different number of rows (the numba backend's float32 ``n @ W.T`` does), so those are
  compared like the parameter gradients below;
* parameter gradients (and a ``cond`` shared by several row blocks) are sums over blocks: each block's sum is
  rounded to the parameter's dtype, the blocks are added in float64 and rounded once, while the in-memory path
  sums all rows in its own order. They agree to ``PARAM_RTOL`` of the magnitude of the terms summed
  (:func:`pynorm.testing.term_scales`): a few roundings of the dtype, where a wrong block or a dropped block
  would be off by a whole term.
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any

import numpy as np
import pytest

da = pytest.importorskip("dask.array", reason="pynorm.dask needs dask[array] (pip install 'pynorm[dask]')")
import dask  # noqa: E402

import pynorm  # noqa: E402
import pynorm.dask as pdask  # noqa: E402
from pynorm.errors import (  # noqa: E402
    ArgumentError,
    ArrayTypeError,
    ContextError,
    DTypeError,
    RechunkWarning,
    ShapeError,
    UnknownOpError,
)

from .helpers import OPS, assert_close_scaled, flat_arrays, make_args, out_shape, term_scales  # noqa: E402

#: x of the tests and its chunks: 3 x 3 = 9 row blocks, the last dim split (so rechunked)
X_SHAPE = (12, 5, 16)
X_CHUNKS = (5, 2, 8)
#: chunks of the row inputs and dy: unlike x's, so that they are rechunked to x's rows
OTHER_CHUNKS = 3

#: parameter gradients vs the in-memory ones, relative to the magnitude of the terms: a few roundings
PARAM_RTOL = {"float32": 8 * 2.0**-24, "float64": 8 * 2.0**-53}


def _numpy_only(backend: Any) -> None:
    if backend.xp is not np:
        pytest.skip(f"these tests feed NumPy-backed Dask arrays; backend {backend.name!r} serves another array type "
                    f"(CuPy-backed Dask arrays: test_cupy_backed_dask_array)")  # fmt: skip


def _dask(a: Any, chunks: Any = OTHER_CHUNKS) -> Any:
    return a if a is None or np.ndim(a) == 0 else da.from_array(a, chunks=chunks)


def _split(op: str, args: list[Any]) -> tuple[list[Any], dict[str, Any]]:
    """``args`` (inputs then parameters, as helpers.make_args gives them) as positional and keyword arguments of
    ``pynorm.<op>``: inputs the public signature takes by keyword go by keyword."""
    spec = OPS[op].spec
    kw = {i.name: a for i, a in zip(spec.inputs, args, strict=False) if i.keyword}
    pos = [a for j, a in enumerate(args) if j >= len(spec.inputs) or not spec.inputs[j].keyword]
    return pos, kw


def _to_dask_args(op: str, args: list[Any]) -> list[Any]:
    """The row inputs as Dask arrays (chunked unlike x), the parameters as they are."""
    n = len(OPS[op].spec.inputs)
    return [_dask(a) if j < n else a for j, a in enumerate(args)]


def _in_memory(op: str, x: np.ndarray, args: list[Any], axis: int, backend: str, **kw: Any) -> tuple[Any, Any]:
    pos, kwi = _split(op, args)
    return getattr(pynorm, f"{op}_forward")(x, *pos, axis=axis, backend=backend, **kwi, **kw)  # type: ignore[no-any-return]


def _on_dask(op: str, X: Any, args: list[Any], axis: int, backend: str, **kw: Any) -> tuple[Any, Any]:
    pos, kwi = _split(op, _to_dask_args(op, args))
    return getattr(pdask, f"{op}_forward")(X, *pos, axis=axis, backend=backend, **kwi, **kw)  # type: ignore[no-any-return]


def _bitwise(op: str) -> bool:
    """Whether the op's outputs and dx are bitwise the in-memory ones on every backend: not for an op with a matrix
    product (conditional norms, fused norm + Linear), whose BLAS rounding may depend on the rows in the call."""
    return not any(p.kind == "matrix" for p in OPS[op].spec.params)


def _scales(op: str, x: np.ndarray, args: list[Any], axis: int, case: dict[str, Any], dy: np.ndarray) -> dict:
    """The op's term scales (:func:`pynorm.testing.term_scales`) at these arguments."""
    spec = OPS[op]
    ax = axis % x.ndim
    rows = math.prod(x.shape[:ax])
    flat = flat_arrays(spec, x.shape, ax, args)
    return term_scales(op, x.reshape(rows, -1), flat, dy.reshape(rows, -1), {**spec.spec.defaults(), **case})  # type: ignore[no-any-return]


def _shaped(scale: Any, like: np.ndarray) -> np.ndarray:
    """A term scale (flattened as backends see the parameter) in the gradient's shape."""
    s = np.asarray(scale)
    return s.reshape(like.shape) if s.size == like.size else np.broadcast_to(s, like.shape)


def _tuple(outs: Any) -> tuple[Any, ...]:
    return outs if isinstance(outs, tuple) else (outs,)


# ---------------------------------------------------------------------------
# forward


@pytest.mark.parametrize("axis", [-1, 1])
@pytest.mark.parametrize("op", list(OPS))
def test_forward_matches_in_memory(backend: Any, op: str, axis: int) -> None:
    """Every op and convention case: the outputs on 9 row blocks are bitwise the in-memory ones."""
    _numpy_only(backend)
    spec = OPS[op]
    rng = np.random.default_rng(list(OPS).index(op))
    x = rng.standard_normal(X_SHAPE).astype(np.float32)
    X = da.from_array(x, chunks=X_CHUNKS)
    for case in spec.conventions:
        args = make_args(spec, X_SHAPE, axis, np.float32, rng, options=case)
        want, _ = _in_memory(op, x, args, axis, backend.name, **case)
        got, ctx = _on_dask(op, X, args, axis, backend.name, **case)
        assert ctx.backend == backend.name
        got_t, want_t = _tuple(got), _tuple(want)
        assert len(got_t) == len(want_t)
        scales = None if _bitwise(op) else _scales(op, x, args, axis, case, np.ones(want_t[0].shape))
        for oname, g, w in zip(spec.spec.outputs, got_t, want_t, strict=False):
            assert isinstance(g, da.Array)
            assert g.shape == w.shape and g.dtype == w.dtype, (op, case)
            if scales is None:
                np.testing.assert_array_equal(g.compute(), w, err_msg=f"{op} {case}")
            else:
                assert_close_scaled(g.compute(), w, _shaped(scales[oname], w), PARAM_RTOL["float32"], f"{op} {oname}")
        assert got_t[0].numblocks[: axis % 3] == X.numblocks[: axis % 3]  # the row blocks were kept


@pytest.mark.parametrize(
    "kw",
    [
        {"quantize": "row"},
        {"quantize": "tensor", "out_scale": 0.03},
        {"quantize": None, "out_scale": 0.01},  # clips: the backward zeroes those elements
    ],
)
def test_quant_layer_norm_int8_and_quantized(backend: Any, kw: dict[str, Any]) -> None:
    """quant_layer_norm's int8 output with its per-row or given scale, from a float x and from an int8 x with a
    per-row (Dask) or scalar x_scale; forward and backward as in memory."""
    _numpy_only(backend)
    rng = np.random.default_rng(7)
    w = (1 + 0.5 * rng.standard_normal(16)).astype(np.float32)
    b = (0.5 * rng.standard_normal(16)).astype(np.float32)
    xf = rng.standard_normal(X_SHAPE).astype(np.float32)
    xi = rng.integers(-127, 128, X_SHAPE).astype(np.int8)
    row_scale = rng.uniform(0.01, 0.1, X_SHAPE[:2])
    for x, xs in ((xf, None), (xi, row_scale), (xi, 0.05)):
        want, wctx = pynorm.quant_layer_norm_forward(x, w, b, x_scale=xs, backend=backend.name, **kw)
        dxs = _dask(xs, (4, 2))
        got, ctx = pdask.quant_layer_norm_forward(da.from_array(x, chunks=X_CHUNKS), w, b, x_scale=dxs,
                                                  backend=backend.name, **kw)  # fmt: skip
        for g, e in zip(_tuple(got), _tuple(want), strict=True):
            assert g.shape == e.shape and g.dtype == e.dtype
            np.testing.assert_array_equal(g.compute(), e)
        dy = rng.standard_normal(X_SHAPE).astype(np.float32)
        grads = dask.compute(*pdask.quant_layer_norm_backward(_dask(dy), ctx))
        wgrads = pynorm.quant_layer_norm_backward(dy, wctx)
        np.testing.assert_array_equal(grads[0], wgrads[0])
        for g, e in zip(grads[1:], wgrads[1:], strict=True):
            np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5 * np.abs(e).max())


@pytest.mark.parametrize("cond_shape", [(12, 7), (12, 1, 7), (1, 7)])
def test_conditional_shared_cond(backend: Any, cond_shape: tuple[int, ...]) -> None:
    """A cond row shared by several row blocks (x chunked along T): dcond is tree-reduced over those blocks."""
    _numpy_only(backend)
    rng = np.random.default_rng(3)
    x = rng.standard_normal(X_SHAPE).astype(np.float64)
    cond = rng.standard_normal(cond_shape)
    W = 0.3 * rng.standard_normal((32, 7))
    c = rng.standard_normal(32)
    dy = rng.standard_normal(X_SHAPE)
    want, wctx = pynorm.conditional_layer_norm_forward(x, cond, W, c, backend=backend.name)
    got, ctx = pdask.conditional_layer_norm_forward(da.from_array(x, chunks=X_CHUNKS), _dask(cond), W, c,
                                                    backend=backend.name)  # fmt: skip
    np.testing.assert_array_equal(got.compute(), want)
    grads = dask.compute(*pdask.conditional_layer_norm_backward(_dask(dy), ctx))
    wgrads = pynorm.conditional_layer_norm_backward(dy, wctx)
    np.testing.assert_array_equal(grads[0], wgrads[0])
    for name, g, e in zip(wgrads._fields[1:], grads[1:], wgrads[1:], strict=True):
        assert g.shape == e.shape and g.dtype == e.dtype, name
        np.testing.assert_allclose(g, e, rtol=1e-12, atol=1e-12 * np.abs(e).max(), err_msg=name)


# ---------------------------------------------------------------------------
# backward


@pytest.mark.parametrize(
    ("dt", "axis", "recompute"), [("float32", -1, False), ("float64", -1, False), ("float32", 1, False),
                                  ("float32", -1, True)]
)  # fmt: skip
@pytest.mark.parametrize("op", list(OPS))
def test_backward_matches_in_memory(backend: Any, op: str, dt: str, axis: int, recompute: bool) -> None:
    """dx (and a residual's gradient) bitwise; parameter (and cond) gradients to PARAM_RTOL of their term scales;
    upstream gradients at the other outputs (dh, dn) included; from the forward blocks' ctx or recomputed."""
    _numpy_only(backend)
    spec = OPS[op]
    rng = np.random.default_rng(100 + list(OPS).index(op))
    x = rng.standard_normal(X_SHAPE).astype(dt)
    X = da.from_array(x, chunks=X_CHUNKS)
    case = spec.conventions[-1]
    args = make_args(spec, X_SHAPE, axis, np.dtype(dt), rng, options=case)
    _, wctx = _in_memory(op, x, args, axis, backend.name, **case)
    _, ctx = _on_dask(op, X, args, axis, backend.name, **case)
    ys = out_shape(spec, X_SHAPE, axis, args)
    dy = rng.standard_normal(ys).astype(spec.spec.grad_dtype(np.dtype(dt)))
    odts = spec.spec.dtypes_of_outputs(np.dtype(dt), {**spec.spec.defaults(), **case})
    ups = {f"d{o}": rng.standard_normal(X_SHAPE).astype(odt) for o, odt in zip(spec.spec.outputs[1:], odts[1:])}
    want = getattr(pynorm, f"{op}_backward")(dy, wctx, **ups)
    grads = getattr(pdask, f"{op}_backward")(
        _dask(dy), ctx, recompute=recompute, **{k: _dask(v) for k, v in ups.items()}
    )
    assert type(grads) is type(want)
    assert all(g is None or isinstance(g, da.Array) for g in grads)
    got = dask.compute(*grads)
    ax = axis % len(X_SHAPE)
    rows, h = math.prod(X_SHAPE[:ax]), math.prod(X_SHAPE[ax:])
    flat = flat_arrays(spec, X_SHAPE, ax, args)
    flat.update({k: v.reshape(rows, h) for k, v in ups.items()})
    scales = term_scales(op, x.reshape(rows, h), flat, dy.reshape(rows, -1), {**spec.spec.defaults(), **case})
    for name, g, e in zip(want._fields, got, want, strict=True):
        if e is None:
            assert g is None, name
            continue
        assert g.shape == e.shape and g.dtype == e.dtype, name
        if name in ("dx", "dresidual") and _bitwise(op):
            np.testing.assert_array_equal(g, e, err_msg=name)
        else:
            assert_close_scaled(g, e, _shaped(scales[name], e), PARAM_RTOL[dt], f"{op} {name}")


def test_backward_param_grads_are_tree_reduced(backend: Any) -> None:
    """The parameter gradients of 9 row blocks go through one tree reduction of fan-in split_every: with
    split_every=2 the graph has intermediate partial sums (log2(9) levels), none with split_every=9."""
    _numpy_only(backend)
    rng = np.random.default_rng(5)
    x = rng.standard_normal(X_SHAPE)
    w, b = rng.standard_normal(16), rng.standard_normal(16)
    depths = {}
    for se in (2, 9):
        _, ctx = pdask.layer_norm_forward(da.from_array(x, chunks=X_CHUNKS), w, b, backend=backend.name,
                                          split_every=se)  # fmt: skip
        g = pdask.layer_norm_backward(da.from_array(x, chunks=X_CHUNKS), ctx)
        layers = g.dweight.__dask_graph__().layers
        depths[se] = sum(1 for k in layers if "sum" in k or "partial" in k)
        _, wctx = pynorm.layer_norm_forward(x, w, b, backend=backend.name)
        e = pynorm.layer_norm_backward(x, wctx)
        np.testing.assert_allclose(g.dweight.compute(), e.dweight, rtol=1e-12)
        np.testing.assert_allclose(g.dbias.compute(), e.dbias, rtol=1e-12)
    assert depths[2] > depths[9]


# ---------------------------------------------------------------------------
# laziness


@pytest.mark.parametrize("recompute", [False, True])
def test_nothing_runs_until_compute(backend: Any, monkeypatch: pytest.MonkeyPatch, recompute: bool) -> None:
    """Building the forward and backward graphs runs no task and no pynorm op; computing y runs one forward per
    row block; computing the gradients with y and h runs one forward and one backward per block (the backward
    reads the forward blocks' ctx), or two forwards with recompute=True."""
    _numpy_only(backend)
    calls = {"forward": 0, "backward": 0}
    real_f, real_b = pynorm.add_rms_norm_forward, pynorm.add_rms_norm_backward

    def f(*a: Any, **k: Any) -> Any:
        calls["forward"] += 1
        return real_f(*a, **k)

    def b(*a: Any, **k: Any) -> Any:
        calls["backward"] += 1
        return real_b(*a, **k)

    monkeypatch.setattr(pynorm, "add_rms_norm_forward", f)
    monkeypatch.setattr(pynorm, "add_rms_norm_backward", b)
    tasks = []

    class Count(dask.callbacks.Callback):  # type: ignore[misc]
        def _pretask(self, key: Any, dsk: Any, state: Any) -> None:
            tasks.append(key)

    rng = np.random.default_rng(0)
    x = da.random.default_rng(1).standard_normal(X_SHAPE, chunks=X_CHUNKS)
    res = da.random.default_rng(2).standard_normal(X_SHAPE, chunks=OTHER_CHUNKS)
    w = rng.standard_normal(16)
    with Count():
        (y, hsum), ctx = pdask.add_rms_norm_forward(x, res, w, backend=backend.name)
        grads = pdask.add_rms_norm_backward(y * 0 + 1.0, ctx, dh=hsum, recompute=recompute)
        assert tasks == [] and calls == {"forward": 0, "backward": 0}
        y.compute(scheduler="sync")
        assert calls == {"forward": 9, "backward": 0}
        assert tasks
        got = dask.compute(y, *grads, scheduler="sync")
    assert calls == {"forward": 9 + (18 if recompute else 9), "backward": 9}
    xs, rs = dask.compute(x, res)
    (wy, wh), wctx = real_f(xs, rs, w, backend=backend.name)
    want = real_b(np.ones_like(wy), wctx, dh=wh)
    np.testing.assert_array_equal(got[0], wy)
    np.testing.assert_array_equal(got[1], want.dx)
    np.testing.assert_array_equal(got[2], want.dresidual)
    np.testing.assert_allclose(got[3], want.dweight, rtol=1e-12)


# ---------------------------------------------------------------------------
# rechunking


def test_rechunk_warning(backend: Any) -> None:
    _numpy_only(backend)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(X_SHAPE).astype(np.float32)
    res = rng.standard_normal(X_SHAPE).astype(np.float32)
    with pytest.warns(RechunkWarning, match=r"x \(") as rec:
        pdask.add_layer_norm(da.from_array(x, chunks=X_CHUNKS), _dask(res), rechunk_warn_bytes=1000)
    assert "residual" in str(rec[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RechunkWarning)
        # under the threshold (the default, 256 MiB): silent
        pdask.add_layer_norm(da.from_array(x, chunks=X_CHUNKS), _dask(res))
        # already chunked right: nothing is rechunked, whatever the threshold
        y, _h = pdask.add_layer_norm(da.from_array(x, chunks=(5, 2, 16)), da.from_array(res, chunks=(5, 2, 16)),
                                    rechunk_warn_bytes=0)  # fmt: skip
    assert y.chunks == ((5, 5, 2), (2, 2, 1), (16,))


def test_auto_row_chunks_when_merged_blocks_are_large(backend: Any) -> None:
    """Merging the normalized dims of tall blocks would exceed array.chunk-size: the row chunks are then "auto"."""
    _numpy_only(backend)
    x = da.zeros((4096, 64), chunks=(4096, 8), dtype=np.float32)  # blocks of 128 KiB; merged: 1 MiB
    with dask.config.set({"array.chunk-size": "256KiB"}):
        y = pdask.rms_norm(x, backend=backend.name)
    assert y.chunks[1] == (64,)
    assert max(y.chunks[0]) * 64 * 4 <= 256 * 1024
    np.testing.assert_array_equal(y.compute(), np.zeros((4096, 64), np.float32))


# ---------------------------------------------------------------------------
# errors


def test_errors() -> None:
    rng = np.random.default_rng(0)
    x = rng.standard_normal(X_SHAPE).astype(np.float32)
    X = da.from_array(x, chunks=X_CHUNKS)
    w = np.ones(16, np.float32)
    with pytest.raises(ArrayTypeError, match=r"x must be a dask\.array\.Array, got numpy\.ndarray"):
        pdask.layer_norm(x, w)
    with pytest.raises(UnknownOpError, match="no op named 'no_such_norm'"):
        pdask.forward("no_such_norm", X)
    with pytest.raises(ShapeError, match=r"weight has shape \(8,\)"):
        pdask.layer_norm(X, np.ones(8, np.float32))
    with pytest.raises(ArgumentError, match="eps must be"):
        pdask.layer_norm(X, w, eps=-1.0)
    with pytest.raises(TypeError, match="unexpected keyword"):
        pdask.layer_norm(X, w, epsilon=1e-5)
    with pytest.raises(ShapeError, match=r"residual has shape \(12, 5\)"):
        pdask.add_layer_norm(X, da.zeros((12, 5), chunks=3, dtype=np.float32))
    with pytest.raises(ArrayTypeError, match="residual must be a dask.array.Array"):
        pdask.add_layer_norm(X, x)
    ids = da.zeros((12, 5), chunks=3, dtype=np.float64)
    with pytest.raises(DTypeError, match="modality_ids must be an integer array"):
        pdask.modality_layer_norm(X, ids, np.ones((3, 16), np.float32))
    with pytest.raises(ArgumentError, match="quantize='tensor' and no out_scale"):
        pdask.quant_layer_norm(X, quantize="tensor")
    with pytest.raises(DTypeError, match="x must have dtype"):
        pdask.layer_norm(X.astype(np.int32))
    y, ctx = pdask.layer_norm_forward(X, w)
    with pytest.raises(ContextError, match="DaskContext"):
        pdask.layer_norm_backward(y, object())  # type: ignore[arg-type]
    with pytest.raises(ContextError, match="produced by layer_norm"):
        pdask.rms_norm_backward(y, ctx)
    with pytest.raises(ArrayTypeError, match="dy must be a dask.array.Array"):
        pdask.layer_norm_backward(x, ctx)
    with pytest.raises(ShapeError, match=r"dy has shape \(12, 5\)"):
        pdask.layer_norm_backward(y[..., 0], ctx)
    with pytest.raises(DTypeError, match="dy has dtype float64"):
        pdask.layer_norm_backward(y.astype(np.float64), ctx)
    (_, h), actx = pdask.add_rms_norm_forward(X, X, w)
    with pytest.raises(TypeError, match="unexpected keyword"):
        pdask.add_rms_norm_backward(y, actx, dn=h)


def test_value_errors_raise_at_compute() -> None:
    """Row inputs' values are checked by the blocks: an out-of-range modality id raises when computed."""
    X = da.zeros(X_SHAPE, chunks=X_CHUNKS, dtype=np.float32)
    ids = da.full((12, 5), 3, chunks=3, dtype=np.int64)
    y = pdask.modality_rms_norm(X, ids, np.ones((3, 16), np.float32))  # builds fine
    with pytest.raises(ArgumentError, match=r"modality_ids must hold values in \[0, 3\)"):
        y.compute(scheduler="sync")


def test_supported_ops_are_every_op() -> None:
    assert set(pdask.supported_ops()) == set(pynorm.ops.SPECS)
    for op in pynorm.ops.SPECS:
        for name in (op, f"{op}_forward", f"{op}_backward"):
            assert callable(getattr(pdask, name)) and name in pdask.__all__


# ---------------------------------------------------------------------------
# the distributed scheduler


@pytest.fixture(scope="module")
def client() -> Any:
    distributed = pytest.importorskip("distributed", reason="the LocalCluster tests need dask[distributed]")
    with (
        distributed.LocalCluster(
            processes=True,
            n_workers=2,
            threads_per_worker=1,
            memory_limit="1GiB",
            dashboard_address=None,
            silence_logs=logging.ERROR,
        ) as cluster,
        distributed.Client(cluster) as c,
    ):
        yield c


@pytest.mark.parametrize("op", ["layer_norm", "add_rms_norm", "modality_layer_norm"])
def test_distributed_forward_backward(backend: Any, client: Any, op: str) -> None:
    """Forward + backward on 48 row blocks through two worker processes: results as in memory (outputs and dx
    bitwise, parameter gradients to PARAM_RTOL of their term scales), and both workers ran blocks."""
    _numpy_only(backend)
    from distributed import get_task_stream

    spec = OPS[op]
    rng = np.random.default_rng(11)
    shape, chunks = (64, 12, 32), (8, 2, 16)
    x = rng.standard_normal(shape).astype(np.float32)
    args = make_args(spec, shape, -1, np.float32, rng)
    dy = rng.standard_normal(shape).astype(np.float32)
    ups = {f"d{o}": rng.standard_normal(shape).astype(np.float32) for o in spec.spec.outputs[1:]}
    want_y, wctx = _in_memory(op, x, args, -1, backend.name)
    want = getattr(pynorm, f"{op}_backward")(dy, wctx, **ups)
    pos, kwi = _split(
        op, [_dask(a, (16, 3, -1)[: a.ndim]) if j < len(spec.spec.inputs) else a for j, a in enumerate(args)]
    )
    y, ctx = getattr(pdask, f"{op}_forward")(da.from_array(x, chunks=chunks), *pos, backend=backend.name, **kwi)
    other = (16, 3, 32)  # row inputs and gradients: rechunked to x's rows
    grads = getattr(pdask, f"{op}_backward")(_dask(dy, other), ctx, **{k: _dask(v, other) for k, v in ups.items()})
    with get_task_stream(client) as ts:
        got_y, *got = client.gather(client.compute([_tuple(y)[0], *grads]))
    assert len({t["worker"] for t in ts.data}) == 2
    np.testing.assert_array_equal(got_y, _tuple(want_y)[0])
    flat = flat_arrays(spec, shape, 2, args)
    flat.update({k: v.reshape(-1, 32) for k, v in ups.items()})
    scales = term_scales(op, x.reshape(-1, 32), flat, dy.reshape(-1, 32), spec.spec.defaults())
    for name, g, e in zip(want._fields, got, want, strict=True):
        if name in ("dx", "dresidual") and _bitwise(op):
            np.testing.assert_array_equal(g, e, err_msg=name)
        elif e is not None:
            assert_close_scaled(g, e, _shaped(scales[name], e), PARAM_RTOL["float32"], f"{op} {name}")


# ---------------------------------------------------------------------------
# CuPy-backed Dask arrays


def test_cupy_backed_dask_array() -> None:
    """A Dask array of CuPy blocks resolves to the cupy backend and matches the in-memory CuPy path."""
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # no driver, no device
        pytest.skip(f"no CUDA device: {exc}")
    if n < 1:
        pytest.skip("no CUDA device")
    rng = np.random.default_rng(0)
    x = cupy.asarray(rng.standard_normal(X_SHAPE).astype(np.float32))
    w = cupy.asarray(rng.standard_normal(16).astype(np.float32))
    dy = cupy.asarray(rng.standard_normal(X_SHAPE).astype(np.float32))
    X = da.from_array(x, chunks=X_CHUNKS, asarray=False)
    y, ctx = pdask.rms_norm_forward(X, w)
    assert ctx.backend == "cupy"
    want, wctx = pynorm.rms_norm_forward(x, w)
    got = y.compute()
    assert isinstance(got, cupy.ndarray)
    cupy.testing.assert_array_equal(got, want)
    g = dask.compute(*pdask.rms_norm_backward(da.from_array(dy, chunks=OTHER_CHUNKS, asarray=False), ctx))
    e = pynorm.rms_norm_backward(dy, wctx)
    cupy.testing.assert_array_equal(g[0], e[0])
    cupy.testing.assert_allclose(g[1], e[1], rtol=1e-5, atol=1e-5 * float(abs(e[1]).max()))


@pytest.mark.parametrize("op", ["layer_norm_linear", "rms_norm_linear"])
def test_norm_linear_return_norm(backend: Any, op: str) -> None:
    """``return_norm=True`` gives ``(y, n)`` as in memory; the flag is checked."""
    _numpy_only(backend)
    rng = np.random.default_rng(9)
    x = rng.standard_normal(X_SHAPE).astype(np.float32)
    args = make_args(OPS[op], X_SHAPE, -1, np.float32, rng)
    want, _ = _in_memory(op, x, args, -1, backend.name, return_norm=True)
    got, _ = _on_dask(op, da.from_array(x, chunks=X_CHUNKS), args, -1, backend.name, return_norm=True)
    assert len(got) == 2
    for g, e in zip(got, want, strict=True):
        np.testing.assert_array_equal(g.compute(), e)
    with pytest.raises(ArgumentError, match="return_norm must be True or False"):
        _on_dask(op, da.from_array(x, chunks=X_CHUNKS), args, -1, backend.name, return_norm="yes")


def test_block_ctx_sizeof_counts_its_arrays() -> None:
    """The forward blocks' ctx reports the bytes of its arrays to Dask (memory accounting, spilling)."""
    from dask.sizeof import sizeof

    x = np.zeros((1000, 64), np.float32)
    _, ctx = pynorm.layer_norm_forward(x, np.ones(64, np.float32), backend="numpy")
    assert sizeof(ctx) >= x.nbytes + 2 * 1000 * 4


@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
def test_low_precision_and_one_dimensional_x(backend: Any, dt: str) -> None:
    """float16/bfloat16 outputs and dx bitwise as in memory (x of one row too: a 1-D x is one block)."""
    _numpy_only(backend)
    from .helpers import dtype

    rng = np.random.default_rng(4)
    for shape, chunks in (((10, 32), (3, 8)), ((64,), (16,))):
        x = rng.standard_normal(shape).astype(dtype(dt))
        w = rng.standard_normal(shape[-1:]).astype(dtype(dt))
        y, ctx = pdask.rms_norm_forward(da.from_array(x, chunks=chunks), w, backend=backend.name)
        want, wctx = pynorm.rms_norm_forward(x, w, backend=backend.name)
        got = y.compute()
        assert got.dtype == want.dtype
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))
        g = dask.compute(*pdask.rms_norm_backward(da.from_array(x, chunks=chunks), ctx))
        e = pynorm.rms_norm_backward(x, wctx)
        np.testing.assert_array_equal(g[0].view(np.uint16), e[0].view(np.uint16))
        assert g[1].dtype == e[1].dtype and g[1].shape == e[1].shape


def test_backend_resolved_on_the_client_as_in_memory() -> None:
    """No backend=: the in-memory choice for x's block type; use_backend and backend= are honoured; a backend that
    does not serve NumPy blocks is refused when the graph is built."""
    x = np.zeros((4, 8), np.float32)
    X = da.from_array(x, chunks=(2, 8))
    _, ctx = pdask.layer_norm_forward(X)
    assert ctx.backend == pynorm.layer_norm_forward(x)[1].backend
    with pynorm.use_backend("numpy"):
        assert pdask.layer_norm_forward(X)[1].backend == "numpy"
    assert pdask.layer_norm_forward(X, backend="numpy")[1].backend == "numpy"
    with pytest.raises(pynorm.errors.PynormError, match="cupy"):
        pdask.layer_norm_forward(X, backend="cupy")
