"""Tests specific to the ``numba`` backend (the shared suite runs it through the functional API too).

Calls the backend's op implementations (``stats.OP_IMPLS``) and kernels directly and compares with
:mod:`pynorm.reference`: accuracy per dtype and convention, determinism (repeated calls, 1 vs 2
threads, the single-thread small-input path), ``out=``/``dx_out=`` buffers, long-column parameter
gradients, the hard inputs of the numerical contract, and every kernel path (fused vs column-tile
backward, streaming stores, slow rows) for every variant of the statistics family.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
import threading
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest

numba = pytest.importorskip("numba", reason="numba is not installed: the numba backend is unavailable")

from pynorm.backends.numba import _layout, _storage, _threads, stats  # noqa: E402
from pynorm.backends.numba import _stats_kernels as kern  # noqa: E402
from pynorm.backends.numba._args import Affine, Conventions, Grad, Partials, Rows, RowStats, plain  # noqa: E402
from pynorm.ops import SPECS  # noqa: E402
from pynorm.ops.families import affine_of, composed_options, kernel_args  # noqa: E402
from pynorm.reference import layer_norm as rln  # noqa: E402
from pynorm.reference import rms_norm as rrms  # noqa: E402
from pynorm.testing import make_input, max_ulp_error, term_scales  # noqa: E402

nln = stats.OP_IMPLS["layer_norm"]
nrms = stats.OP_IMPLS["rms_norm"]

try:
    import ml_dtypes

    BF16: Any = ml_dtypes.bfloat16
except ImportError:  # pragma: no cover
    BF16 = None

DTYPES = [np.float32, np.float64, np.float16] + ([BF16] if BF16 is not None else [])
# max |a - ref| / max |ref| allowed, per output dtype (half types: about one ulp of the output)
TOL = {"float32": 1e-6, "float64": 1e-12, "float16": 2e-3, "bfloat16": 1.6e-2}
TOL_PARAM = {"float32": 1e-5, "float64": 1e-12, "float16": 2e-3, "bfloat16": 1.6e-2}

# (rows, hidden): empty, tiny, H=1, odd sizes, and both backward paths (fused by row blocks; by rows then by
# column tiles for few rows of many elements); CHUNK + 1 columns exercise the chunked row sums
SHAPES = [(0, 5), (1, 1), (3, 1), (2, 3), (7, 33), (5, 9000), (_layout.FUSED_MIN_ROWS + 3, _layout.CHUNK + 1)]
COLS_SHAPE = (9, 4000)  # few rows, many elements: the column-tile path


#: the rows path of the backward by shape at small sizes: these tests reach it with inputs below the serial
#: threshold, which now take the fused path (:data:`pynorm.backends.numba._layout.FUSED_MAX_SMALL`)
ROWS_PATH_BELOW = 1 << 15


@pytest.fixture(autouse=True)
def _rows_path_at_small_sizes(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_layout, "FUSED_MAX_SMALL", ROWS_PATH_BELOW)


def test_shapes_cover_both_backward_paths() -> None:
    assert not _layout.use_fused(5, 9000) and not _layout.use_fused(*COLS_SHAPE)
    assert _layout.use_fused(7, 33) and _layout.use_fused(_layout.FUSED_MIN_ROWS + 3, 1)


def rel(a: Any, ref: Any) -> float:
    a = np.asarray(a, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if ref.size == 0:
        return 0.0
    scale = float(np.max(np.abs(ref)))
    return float(np.max(np.abs(a - ref))) / (scale if scale > 0 else 1.0)


def name(dt: Any) -> str:
    return np.dtype(dt).name


def data(shape: tuple[int, ...], dt: Any, seed: int = 0, offset: float = 3.0) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(seed)
    h = shape[1]
    x = (rng.standard_normal(shape) * 2 + offset).astype(dt)
    dy = rng.standard_normal(shape).astype(dt)
    w = (1 + 0.5 * rng.standard_normal(h)).astype(dt)
    b = rng.standard_normal(h).astype(dt)
    return x, dy, w, b


def ln_both(x: Any, dy: Any, w: Any, b: Any, **kw: Any) -> tuple[Any, Any, Any, Any]:
    y, ctx = nln.forward(x, w, b, **kw)
    yr, ctxr = rln.forward(x, w, b, **kw)
    return y, nln.backward(dy, ctx), yr, rln.backward(dy, ctxr)


def rms_both(x: Any, dy: Any, w: Any, **kw: Any) -> tuple[Any, Any, Any, Any]:
    y, ctx = nrms.forward(x, w, **kw)
    yr, ctxr = rrms.forward(x, w, **kw)
    return y, nrms.backward(dy, ctx), yr, rrms.backward(dy, ctxr)


def assert_close(g: Any, gr: Any, dt: Any, what: str = "") -> None:
    for i, (a, ref) in enumerate(zip(g, gr)):
        assert (a is None) == (ref is None), f"{what} output {i}: None mismatch"
        if a is None:
            continue
        assert a.dtype == ref.dtype, f"{what} output {i}: dtype {a.dtype} != {ref.dtype}"
        assert a.shape == ref.shape
        tol = (TOL if i == 0 else TOL_PARAM)[name(a.dtype)]
        err = rel(a, ref)
        assert err <= tol, f"{what} output {i} ({a.dtype}): relative error {err:.2e} > {tol:.0e}"


# every statistic and convention of the statistics family the backend serves, with its plain prologue and a vector
# (or scalar, which the kernels see as a vector) affine source: (op, options) from the specs' convention sets (the
# residual prologue and table affine source: test_residual_and_table_variants_on_every_path)
#: the rows-layout ops (the channel affine source's, GroupNorm's and InstanceNorm's: tests/test_channel_kernels.py)
ROW_IMPLS = {op: impl for op, impl in stats.OP_IMPLS.items() if isinstance(impl, stats.StatsOp)}
VARIANTS = [
    (op, conv)
    for op, impl in ROW_IMPLS.items()
    if not impl.residual and not affine_of(SPECS[op]).index
    for conv in SPECS[op].cases
]
VARIANT_IDS = [f"{op}-{','.join(f'{k}={v}' for k, v in c.items()) or 'default'}" for op, c in VARIANTS]


def _storage_of(a: Any) -> Any:
    from pynorm.backends.numba._common import storage

    return storage(a)


def _kernel_args(op: str, conv: dict[str, Any], x: Any, w: Any, b: Any) -> tuple[Any, Affine, Conventions, RowStats]:
    """``(stat, affine, conventions, row_stats)`` of the family's kernels for ``op``/``conv`` (the bundles of
    :mod:`pynorm.backends.numba._args`; ``x`` in storage form): the conventions as the host reads them
    (:func:`pynorm.ops.families.kernel_args`), the weight and bias as the host prepares them, fresh per-row
    outputs (an aux array where the statistic's record has an aux value)."""
    from pynorm.backends.numba import _common as common

    impl = stats.OP_IMPLS[op]
    ka = kernel_args(SPECS[op], {**SPECS[op].defaults(), **conv})
    mdt = common.math_dtype(x.dtype if x.dtype.kind == "f" else np.float32)
    rows = x.shape[0]
    we = common.effective_weight(w, ka.weight_offset, mdt)
    be = common.param(b, mdt) if impl.bias_name else None
    aux = np.empty(rows) if impl.statistic.aux else None
    return impl.stat, Affine(we, be), Conventions.of(ka), RowStats(aux, np.empty(rows))


# ---------------------------------------------------------------------------
# agreement with the reference


LN_CONVENTIONS = [
    {},
    {"eps_mode": "std"},
    {"correction": 1},
    {"eps_mode": "std", "correction": 1, "weight_offset": 1.0},
    {"weight_offset": 1.0},
]
# correction=1 needs H >= 2 (functional rejects H = 1): those pairs are not generated
LN_CASES = [(s, c) for s in SHAPES for c in LN_CONVENTIONS if c.get("correction", 0) < s[1]]


@pytest.mark.parametrize("dt", DTYPES, ids=name)
@pytest.mark.parametrize(
    "shape,conv",
    LN_CASES,
    ids=[f"{s}-{','.join(f'{k}={v}' for k, v in c.items()) or 'default'}" for s, c in LN_CASES],
)
def test_layer_norm_matches_reference(dt: Any, shape: tuple[int, int], conv: dict[str, Any]) -> None:
    x, dy, w, b = data(shape, dt)
    y, g, yr, gr = ln_both(x, dy, w, b, eps=1e-5, **conv)
    assert y.dtype == x.dtype and g.dx.dtype == x.dtype
    assert_close((y,), (yr,), dt, "y")
    assert_close(g, gr, dt, "grads")


@pytest.mark.parametrize("dt", DTYPES, ids=name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_matches_reference(dt: Any, shape: tuple[int, int], offset: float) -> None:
    x, dy, w, _ = data(shape, dt)
    y, g, yr, gr = rms_both(x, dy, w, eps=1e-6, weight_offset=offset)
    assert_close((y,), (yr,), dt, "y")
    if shape[1] == 1:
        # dx = r g (1 - xhat^2) = r g eps r^2: all cancellation, so compare on the scale of r * g
        _, ctx = nrms.forward(x, w, eps=1e-6, weight_offset=offset)
        scale = np.max(np.abs(ctx.rstd[:, None] * dy.astype(np.float64) * (w.astype(np.float64) + offset)))
        assert np.max(np.abs(g.dx.astype(np.float64) - gr.dx.astype(np.float64))) <= TOL[name(dt)] * scale
        g, gr = g[1:], gr[1:]
    assert_close(g, gr, dt, "grads")


@pytest.mark.parametrize("dt", [np.float32, np.float64], ids=name)
@pytest.mark.parametrize("params", ["none", "weight", "bias"])
@pytest.mark.parametrize("shape", [(7, 33), COLS_SHAPE, (_layout.FUSED_MIN_ROWS + 5, 40)], ids=str)
def test_optional_parameters(dt: Any, params: str, shape: tuple[int, int]) -> None:
    x, dy, w, b = data(shape, dt)
    wa = w if params == "weight" else None
    ba = b if params == "bias" else None
    y, g, yr, gr = ln_both(x, dy, wa, ba, eps=1e-5)
    assert_close((y,), (yr,), dt, "y")
    assert_close(g, gr, dt, "grads")
    y, g, yr, gr = rms_both(x, dy, wa, eps=1e-5)
    assert_close((y,), (yr,), dt, "y")
    assert_close(g, gr, dt, "grads")


@pytest.mark.parametrize("wdt", DTYPES, ids=name)
def test_mixed_parameter_dtypes(wdt: Any) -> None:
    x, dy, w, b = data((9, 20), np.float32)
    w, b = w.astype(wdt), b.astype(np.float64)
    y, g, yr, gr = ln_both(x, dy, w, b, eps=1e-5)
    assert g.dweight.dtype == np.dtype(wdt) and g.dbias.dtype == np.float64
    assert_close((y,), (yr,), np.float32, "y")
    # the math type follows x (float32): parameter gradients are float32-accurate, then rounded to their dtype
    tol = max(TOL_PARAM["float32"], TOL_PARAM[name(wdt)])
    assert rel(g.dx, gr.dx) <= TOL["float32"]
    assert rel(g.dweight, gr.dweight) <= tol and rel(g.dbias, gr.dbias) <= TOL_PARAM["float32"]


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "add_layer_norm", "quant_layer_norm"])
@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
def test_16bit_parameters_read_in_storage_form_are_their_float32_copies(op: str, dt: str) -> None:
    """The forward of a 16-bit x reads a 16-bit weight/bias in its storage form (half the bytes in cache): bitwise
    the forward given the same values as float32 arrays, which takes the math-type path; on ordinary rows and
    rows of the slow path (tiny rows with eps = 0: r beyond float32's normal range)."""
    import pynorm

    d = np.dtype(dt) if dt == "float16" else np.dtype(__import__("ml_dtypes").bfloat16)
    rng = np.random.default_rng(11)
    x = rng.standard_normal((70, 96)).astype(d)
    x[3] = (rng.standard_normal(96) * 2.0**-125).astype(d) if dt == "bfloat16" else x[3]
    w = (1 + 0.3 * rng.standard_normal(96)).astype(d)
    b = (0.2 * rng.standard_normal(96)).astype(d)
    f = getattr(pynorm, op)
    lead = (x, np.ones_like(x)) if op == "add_layer_norm" else (x,)
    extra: dict[str, Any] = {}
    if op == "quant_layer_norm":
        extra["quantize"] = "row"
    params = (w, b) if op != "rms_norm" else (w,)
    for eps in (1e-5, 0.0):
        narrow = f(*lead, *params, eps=eps, backend="numba", **extra)
        wide = f(*lead, *(p.astype(np.float32) for p in params), eps=eps, backend="numba", **extra)
        pairs = zip(narrow, wide, strict=True) if isinstance(narrow, tuple) else [(narrow, wide)]
        for a, c in pairs:
            a, c = np.asarray(a), np.asarray(c)
            assert a.dtype == c.dtype
            assert np.array_equal(a.view(np.uint8), c.view(np.uint8)), (op, eps)


def test_non_contiguous_inputs() -> None:
    x, dy, w, b = data((40, 24), np.float32)
    xf, dyf = np.asfortranarray(x), np.asfortranarray(dy)
    xs = np.zeros((40, 48), np.float32)[:, ::2]
    xs[...] = x
    dys = np.zeros((80, 24), np.float32)[::2]
    dys[...] = dy
    wide_w = np.zeros(48, np.float32)
    wide_w[::2] = w
    for xx, dd, ww in [(xf, dyf, w), (xs, dys, wide_w[::2])]:
        y, ctx = nln.forward(xx, ww, b, eps=1e-5)
        y0, ctx0 = nln.forward(x, w, b, eps=1e-5)
        assert np.array_equal(y, y0)
        g, g0 = nln.backward(dd, ctx), nln.backward(dy, ctx0)
        for a, a0 in zip(g, g0):
            assert np.array_equal(a, a0)
        y, ctx = nrms.forward(xx, ww, eps=1e-5)
        y0, ctx0 = nrms.forward(x, w, eps=1e-5)
        assert np.array_equal(y, y0)
        assert np.array_equal(nrms.backward(dd, ctx).dx, nrms.backward(dy, ctx0).dx)


def test_inputs_not_mutated_and_ctx_fields() -> None:
    x, dy, w, b = data((30, 17), BF16 if BF16 is not None else np.float16)
    copies = [a.copy() for a in (x, dy, w, b)]
    y, ctx = nln.forward(x, w, b, eps=1e-5, correction=1, eps_mode="std", weight_offset=0.5)
    g = nln.backward(dy, ctx)
    for a, c in zip((x, dy, w, b), copies):
        assert np.array_equal(a.view(np.uint16), c.view(np.uint16))
    assert isinstance(ctx, rln.LayerNormCtx) and isinstance(g, rln.LayerNormGrads)
    assert ctx.x is x and ctx.weight is w and ctx.bias is b
    assert ctx.mean.shape == (30,) and ctx.rstd.shape == (30,) and ctx.mean.dtype == np.float64
    assert (ctx.eps, ctx.correction, ctx.eps_mode, ctx.weight_offset) == (1e-5, 1, "std", 0.5)
    _, rctx = nrms.forward(x, w, eps=1e-5, weight_offset=0.5)
    assert isinstance(rctx, rrms.RMSNormCtx) and rctx.x is x and rctx.rstd.dtype == np.float64
    assert isinstance(nrms.backward(dy, rctx), rrms.RMSNormGrads)
    assert not np.shares_memory(y, x) and not np.shares_memory(g.dx, dy)


# ---------------------------------------------------------------------------
# output buffers


@pytest.mark.parametrize("dt", DTYPES, ids=name)
@pytest.mark.parametrize("shape", [(6, 50), COLS_SHAPE, (_layout.FUSED_MIN_ROWS + 1, 70)], ids=str)
def test_out_buffers(dt: Any, shape: tuple[int, int]) -> None:
    x, dy, w, b = data(shape, dt)
    y0, ctx = nln.forward(x, w, b, eps=1e-5)
    g0 = nln.backward(dy, ctx)
    out = np.full(shape, np.nan, dtype=dt)
    dx_out = np.full(shape, np.nan, dtype=dt)
    y, ctx = nln.forward(x, w, b, eps=1e-5, out=out)
    g = nln.backward(dy, ctx, dx_out=dx_out)
    assert y is out and g.dx is dx_out
    assert np.array_equal(y, y0) and np.array_equal(g.dx, g0.dx)
    assert np.array_equal(g.dweight, g0.dweight) and np.array_equal(g.dbias, g0.dbias)
    y0, ctx = nrms.forward(x, w, eps=1e-5)
    g0 = nrms.backward(dy, ctx)
    y, ctx = nrms.forward(x, w, eps=1e-5, out=out)
    g = nrms.backward(dy, ctx, dx_out=dx_out)
    assert y is out and g.dx is dx_out
    assert np.array_equal(y, y0) and np.array_equal(g.dx, g0.dx) and np.array_equal(g.dweight, g0.dweight)


# ---------------------------------------------------------------------------
# determinism


def _run_all(x: Any, dy: Any, w: Any, b: Any) -> list[np.ndarray]:
    res = []
    for conv in ({}, {"eps_mode": "std", "correction": 1}):
        y, ctx = nln.forward(x, w, b, eps=1e-5, **conv)
        res += [y, ctx.mean, ctx.rstd, *nln.backward(dy, ctx)]
    y, ctx = nrms.forward(x, w, eps=1e-5)
    res += [y, ctx.rstd, *nrms.backward(dy, ctx)]
    return res


DET_SHAPES = [(50, 300), (_layout.FUSED_MIN_ROWS * 4 + 7, 130), (3, 20000), COLS_SHAPE]


def _assert_bitwise(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    for i, (u, v) in enumerate(zip(a, b)):
        assert u.dtype == v.dtype
        assert np.array_equal(u.view(np.uint8), v.view(np.uint8)), f"result {i} differs"


@pytest.mark.parametrize("shape", DET_SHAPES, ids=str)
def test_repeated_calls_bitwise_identical(shape: tuple[int, int]) -> None:
    x, dy, w, b = data(shape, np.float32)
    first = _run_all(x, dy, w, b)
    for _ in range(3):
        _assert_bitwise(first, _run_all(x, dy, w, b))


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs NUMBA_NUM_THREADS >= 2")
@pytest.mark.parametrize("dt", [np.float32, np.float64], ids=name)
@pytest.mark.parametrize("shape", DET_SHAPES, ids=str)
def test_thread_count_does_not_change_results(dt: Any, shape: tuple[int, int]) -> None:
    x, dy, w, b = data(shape, dt)
    try:
        _threads.set_num_threads(2)
        two = _run_all(x, dy, w, b)
        assert _threads._workers, "no span ran on a pool thread"
        _threads.set_num_threads(1)
        one = _run_all(x, dy, w, b)
    finally:
        _threads.set_num_threads(None)
    _assert_bitwise(two, one)
    # numba's own per-thread setting is respected the same way
    old = numba.get_num_threads()
    try:
        numba.set_num_threads(1)
        assert _threads.get_num_threads() == 1
        _assert_bitwise(two, _run_all(x, dy, w, b))
    finally:
        numba.set_num_threads(old)


def test_serial_threshold_path_matches_parallel(monkeypatch: pytest.MonkeyPatch) -> None:
    x, dy, w, b = data((_layout.FUSED_MIN_ROWS * 2 + 3, 100), np.float32)
    monkeypatch.setattr(_threads, "SERIAL_THRESHOLD", 0)
    parallel = _run_all(x, dy, w, b)
    monkeypatch.setattr(_threads, "SERIAL_THRESHOLD", 1 << 62)
    serial = _run_all(x, dy, w, b)
    _assert_bitwise(parallel, serial)


def test_launch_uses_one_thread_below_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, int, int]] = []

    def kernel(tag: str, lo: int, hi: int) -> int:
        calls.append((threading.current_thread().name, lo, hi))
        return hi - lo

    monkeypatch.setattr(_threads, "SERIAL_THRESHOLD", 1000)
    me = threading.current_thread().name
    assert _threads.launch(kernel, 10, 7, "small") == 7
    assert calls == [(me, 0, 7)]
    calls.clear()
    n = _threads.get_num_threads()
    assert _threads.launch(kernel, 10**6, 7, "large") == 7
    assert sorted((lo, hi) for _, lo, hi in calls) == _threads.spans(7, min(n, 7))
    assert (me, 0, _threads.spans(7, min(n, 7))[0][1]) in calls  # the caller takes the first span
    if n > 1:
        assert any(name.startswith("pynorm-numba") for name, _, _ in calls)
    calls.clear()
    assert _threads.launch(kernel, 10**6, 1, "one task") == 1
    assert calls == [(me, 0, 1)]
    calls.clear()
    assert _threads.launch(kernel, 10**6, 0, "no task") == 0
    assert calls == [(me, 0, 0)]


def test_spans_cover_the_tasks_in_order() -> None:
    for tasks in (0, 1, 5, 7, 64, 1001):
        for n in (1, 2, 3, 8):
            parts = _threads.spans(tasks, n)
            assert len(parts) == n and parts[0][0] == 0 and parts[-1][1] == tasks
            assert all(a[1] == b[0] for a, b in itertools.pairwise(parts))
            sizes = [hi - lo for lo, hi in parts]
            assert max(sizes) - min(sizes) <= 1


def test_launch_waits_for_every_span_and_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    if _threads.get_num_threads() < 2:
        pytest.skip("needs 2 threads")
    done: list[int] = []

    def kernel(lo: int, hi: int) -> None:
        if lo == 0:
            raise RuntimeError("first span failed")
        time.sleep(0.2)  # still running when the caller's span raises
        done.append(lo)

    with pytest.raises(RuntimeError, match="first span failed"):
        _threads.launch(kernel, 10**6, 4)
    assert len(done) == min(_threads.get_num_threads(), 4) - 1  # the other spans finished before the raise


def test_concurrent_calls_from_python_threads() -> None:
    # numba's workqueue layer aborted the process on concurrent parallel kernels; the pool must serve them
    x, dy, w, b = data((512, 384), np.float32)
    expected = _run_all(x, dy, w, b)
    results: list[Any] = []
    errors: list[BaseException] = []

    def worker() -> None:
        try:
            for _ in range(3):
                results.append(_run_all(x, dy, w, b))
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert len(results) == 9
    for r in results:
        _assert_bitwise(expected, r)


def test_set_num_threads_validation() -> None:
    with pytest.raises(ValueError):
        _threads.set_num_threads(0)
    with pytest.raises(ValueError):
        _threads.set_num_threads(numba.config.NUMBA_NUM_THREADS + 1)
    with pytest.raises(TypeError):
        _threads.set_num_threads(1.5)  # type: ignore[arg-type]
    try:
        _threads.set_num_threads(1)
        assert _threads.get_num_threads() == 1
    finally:
        _threads.set_num_threads(None)
    assert _threads.get_num_threads() == numba.get_num_threads()


# ---------------------------------------------------------------------------
# accuracy on long columns and hard inputs


def test_parameter_gradients_over_65536_rows() -> None:
    rows, h = 65536, 48
    x, dy, w, b = data((rows, h), np.float32, seed=1)
    dy = (dy + 0.5).astype(np.float32)  # a common sign: the sums grow like the row count
    _, g, _, gr = ln_both(x, dy, w, b, eps=1e-5)
    assert rel(g.dweight, gr.dweight) <= 1e-5 and rel(g.dbias, gr.dbias) <= 1e-5
    assert np.max(np.abs(g.dbias / gr.dbias.astype(np.float64) - 1)) <= 1e-5
    _, g, _, gr = rms_both(x, dy, w, eps=1e-5)
    assert rel(g.dweight, gr.dweight) <= 1e-5


def test_large_offset_rows_keep_full_accuracy() -> None:
    rng = np.random.default_rng(3)
    x = (1e4 + rng.standard_normal((64, 512))).astype(np.float32)
    dy = rng.standard_normal((64, 512)).astype(np.float32)
    w = np.ones(512, np.float32)
    b = np.zeros(512, np.float32)
    y, g, yr, gr = ln_both(x, dy, w, b, eps=1e-5)
    assert rel(y, yr) <= 1e-6
    assert rel(g.dx, gr.dx) <= 1e-6
    assert rel(g.dweight, gr.dweight) <= 1e-5
    _, ctx = nln.forward(x, w, b, eps=1e-5)
    _, ctxr = rln.forward(x, w, b, eps=1e-5)
    assert np.max(np.abs(ctx.mean - ctxr.mean.astype(np.float64))) <= 1e-9 * 1e4


@pytest.mark.parametrize("dt", [np.float32, np.float64, np.float16] + ([BF16] if BF16 else []), ids=name)
def test_magnitudes_near_dtype_max_are_finite(dt: Any) -> None:
    big = float(np.finfo(dt).max) if dt is not BF16 else float(ml_dtypes.finfo(BF16).max)
    rng = np.random.default_rng(4)
    x = (rng.uniform(-1, 1, (6, 40)) * big).astype(dt)
    x[1] = x[1] * 0 + np.asarray(big, dtype=dt)  # constant row at the max
    x[2, :20] = np.asarray(big, dtype=dt)
    x[2, 20:] = np.asarray(-big, dtype=dt)  # largest spread: x - mean overflows the dtype
    dy = rng.standard_normal((6, 40)).astype(dt)
    w = np.ones(40, dt)
    b = np.zeros(40, dt)
    for y, g, yr, gr in (ln_both(x, dy, w, b, eps=1e-5), rms_both(x, dy, w, eps=1e-5)):
        for a in (y, *g):
            assert np.all(np.isfinite(a.astype(np.float64)))
        assert_close((y,), (yr,), dt, "y")
        assert_close(g[:1], gr[:1], dt, "dx")


@pytest.mark.parametrize("dt", [np.float32, np.float64], ids=name)
def test_tiny_magnitudes(dt: Any) -> None:
    tiny = float(np.finfo(dt).smallest_subnormal) * 1000
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((4, 64)) * tiny).astype(dt)
    dy = rng.standard_normal((4, 64)).astype(dt)
    w = np.ones(64, dt)
    for eps in (0.0, 1e-30):
        # y is O(1) either way; with eps = 0 the gradients are ~ 1/tiny and may overflow (as in the reference)
        y, g, yr, gr = ln_both(x, dy, w, None, eps=eps)
        assert np.all(np.isfinite(y)) and rel(y, yr) <= TOL[name(dt)]
        assert rel(g.dx, gr.dx) <= TOL[name(dt)] if eps else np.array_equal(np.isfinite(g.dx), np.isfinite(gr.dx))
        y, g, yr, gr = rms_both(x, dy, w, eps=eps)
        assert np.all(np.isfinite(y)) and rel(y, yr) <= TOL[name(dt)]
        assert rel(g.dx, gr.dx) <= TOL[name(dt)] if eps else np.array_equal(np.isfinite(g.dx), np.isfinite(gr.dx))


# float64 rows the fast path cannot take (their sums overflow: values up to the dtype's max, with and without
# a large common offset; or underflow: 1e-200 N(0, 1)) and tiny rows (1e-30 N(0, 1), which float64 takes on the
# fast path): every output within the suite's 16-ulp budget at the terms' magnitude
F64_BUDGET_ULPS = 16.0
EXTREME_KINDS = ["huge", "near_max", "max_offset", "huge_offset", "tiny", "very_tiny"]
# H = 1, 3; the fused backward (many rows, and few rows of few elements); the row-parallel backward with
# parameter gradients by column tiles (few rows of many elements)
EXTREME_SHAPES = [(4, 1), (4, 3), (_layout.FUSED_MIN_ROWS + 3, 257), (4, 4096), (9, 4096), (4, 65536)]
EXTREME_LN = [
    {"correction": c, "eps_mode": m, "weight_offset": o, "eps": e}
    for c in (0, 1)
    for m in ("var", "std")
    for o in (0.0, 1.0)
    for e in (1e-5, 0.1)
]
EXTREME_RMS = [{"weight_offset": o, "eps": e} for o in (0.0, 1.0) for e in (1e-5, 0.1)]


def _extreme_convs(op: str, shape: tuple[int, int]) -> list[dict[str, Any]]:
    """Every convention up to 4 x 4096 elements; beyond (test time), two that take each value once."""
    convs = EXTREME_LN if op == "layer_norm" else EXTREME_RMS
    return convs if shape[0] * shape[1] <= 1 << 14 else [convs[0], convs[-1]]


def extreme_f64(kind: str, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    n = rng.standard_normal(shape)
    if kind == "near_max":  # a third of the elements are +-max itself
        return np.clip(n, -1.0, 1.0) * float(np.finfo(np.float64).max)
    if kind == "max_offset":  # offset and spread near the max
        return 1e308 + np.clip(n, -1.0, 1.0) * 5e307
    if kind == "huge_offset":  # the offset is 1e10 times the spread: the stored float64 mean is not enough
        return 1e300 + n * 1e290
    if kind == "very_tiny":  # squares underflow (normal inputs and statistics, not subnormal ones)
        return n * 1e-200
    return make_input(kind, shape, np.float64, rng)


def _extreme_errors(op: str, kind: str, shape: tuple[int, int], convs: list[dict[str, Any]]) -> dict[str, Any]:
    """Largest ulp error of each output (against the reference, at the terms' magnitude) over ``convs``."""
    rng = np.random.default_rng([EXTREME_KINDS.index(kind), *shape])
    h = shape[1]
    x = extreme_f64(kind, shape, rng)
    dy = rng.standard_normal(shape)
    w = 1 + 0.5 * rng.standard_normal(h)
    b = rng.standard_normal(h)
    worst: dict[str, Any] = {}
    for conv in convs:
        if conv.get("correction", 0) >= h:
            continue
        if op == "layer_norm":
            y, g, yr, gr = ln_both(x, dy, w, b, **conv)
            params = {"weight": w, "bias": b}
            outs = {"y": (y, yr), "dx": (g.dx, gr.dx), "dweight": (g.dweight, gr.dweight), "dbias": (g.dbias, gr.dbias)}
        else:
            y, g, yr, gr = rms_both(x, dy, w, **conv)
            params = {"weight": w}
            outs = {"y": (y, yr), "dx": (g.dx, gr.dx), "dweight": (g.dweight, gr.dweight)}
        scales = term_scales(op, x, params, dy, conv)
        for k, (a, ref) in outs.items():
            err = max_ulp_error(a, ref, np.float64, scale=scales[k])
            if err > worst.get(k, (-1.0,))[0]:
                worst[k] = (err, conv)
    return worst


def _assert_within_budget(worst: dict[str, Any]) -> None:
    bad = {k: v for k, v in worst.items() if not v[0] <= F64_BUDGET_ULPS}
    summary = ", ".join(f"{k} {v[0]:.1f}" for k, v in worst.items())
    assert not bad, f"ulps over {F64_BUDGET_ULPS}: {bad} (all: {summary})"


# tiny rows take the float64 fast path, whose dweight over 4 rows of 65536 elements is limited by the accuracy
# of its mean (~ an ulp of the row's spread, which is not small next to |x̂| ~ 0 in the 4 rows of some column):
# 35 ulps on N(0, 1) rows too, so that shape measures the fast path, not these rows
EXTREME_CASES = [(k, s) for k in EXTREME_KINDS for s in EXTREME_SHAPES if not (k == "tiny" and s == (4, 65536))]
EXTREME_IDS = [f"{k}-{s}" for k, s in EXTREME_CASES]


@pytest.mark.parametrize("kind,shape", EXTREME_CASES, ids=EXTREME_IDS)
def test_layer_norm_float64_extreme_rows_within_16_ulps(kind: str, shape: tuple[int, int]) -> None:
    _assert_within_budget(_extreme_errors("layer_norm", kind, shape, _extreme_convs("layer_norm", shape)))


@pytest.mark.parametrize("kind,shape", EXTREME_CASES, ids=EXTREME_IDS)
def test_rms_norm_float64_extreme_rows_within_16_ulps(kind: str, shape: tuple[int, int]) -> None:
    _assert_within_budget(_extreme_errors("rms_norm", kind, shape, _extreme_convs("rms_norm", shape)))


@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_float64_extreme_rows_take_the_slow_path(variant: tuple[str, dict[str, Any]]) -> None:
    # the rows above that are meant to exercise the rescaled float64 path take it in the backward: the fast
    # kernel leaves every row pending (the huge_offset and very_tiny rows' r is in range: only their d^2 sum,
    # needed with eps_mode="std", overflows or underflows)
    op, conv = variant
    rng = np.random.default_rng(12)
    for kind in ("huge", "near_max", "max_offset", "huge_offset", "very_tiny"):
        if kind in ("huge_offset", "very_tiny") and conv.get("eps_mode") != "std":
            continue
        x = extreme_f64(kind, (5, 300), rng)
        dy = rng.standard_normal(x.shape)
        stat, aff, conv_k, row_stats = _kernel_args(op, conv, x, None, None)
        stats.forward_rows(stat, plain(Rows(x)), plain(aff), plain(conv_k), np.empty_like(x), plain(row_stats), False)
        scale = np.empty(5, np.int64)
        cs = np.empty(5) if stats.OP_IMPLS[op].statistic.mean else None
        aff_, rs_, conv_, grad_ = (plain(b) for b in (aff, row_stats, conv_k, Grad(np.empty_like(x))))
        pending = kern.bwd_rows(stat, x, dy, aff_, rs_, conv_, grad_, scale, cs, None, 0, x.shape[0])
        assert pending == 5 and np.all(scale == kern.PENDING), kind
        if kind not in ("huge_offset", "very_tiny"):  # ... and so do the forward's rows
            left = kern.fwd(stat, plain(Rows(x)), aff_, conv_, np.empty_like(x), rs_, None, 0, x.shape[0])
            assert left == 5, kind
            assert np.all(row_stats.rstd == -1.0)


@pytest.mark.parametrize("dt", DTYPES, ids=name)
def test_constant_rows_and_hidden_size_one(dt: Any) -> None:
    rng = np.random.default_rng(6)
    x = np.repeat(rng.standard_normal((5, 1)) * 100, 37, axis=1).astype(dt)
    x[4] = 0
    dy = rng.standard_normal((5, 37)).astype(dt)
    w = rng.standard_normal(37).astype(dt)
    b = rng.standard_normal(37).astype(dt)
    y, ctx = nln.forward(x, w, b, eps=1e-5)
    assert np.array_equal(y, np.broadcast_to(b, y.shape))  # xhat is exactly 0
    g = nln.backward(dy, ctx)
    assert np.all(g.dweight.astype(np.float64) == 0)
    assert np.all(np.isfinite(g.dx.astype(np.float64)))
    y, ctx = nln.forward(x, w, b, eps=1e-5, eps_mode="std")
    assert np.array_equal(y, np.broadcast_to(b, y.shape))
    assert np.all(nln.backward(dy, ctx).dweight.astype(np.float64) == 0)
    x1, dy1 = x[:, :1].copy(), dy[:, :1].copy()
    y, ctx = nln.forward(x1, w[:1], b[:1], eps=1e-5)
    g = nln.backward(dy1, ctx)
    assert np.array_equal(y, np.broadcast_to(b[:1], y.shape))
    assert g.dweight[0] == 0 and np.all(g.dx.astype(np.float64) == 0)


@pytest.mark.parametrize("shape", [(_layout.FUSED_MIN_ROWS + 4, 16), (9, 4000)], ids=str)
def test_nan_stays_in_its_row(shape: tuple[int, int]) -> None:
    x, dy, w, b = data(shape, np.float32)
    x[3, 5] = np.nan
    x[7, 2] = np.inf
    y, ctx = nln.forward(x, w, b, eps=1e-5)
    g = nln.backward(dy, ctx)
    assert np.all(np.isnan(y[3])) and np.all(np.isnan(g.dx[3]))
    ok = np.ones(len(x), bool)
    ok[[3, 7]] = False
    assert np.all(np.isfinite(y[ok])) and np.all(np.isfinite(g.dx[ok]))
    y, ctx = nrms.forward(x, w, eps=1e-5)
    assert np.all(np.isnan(y[3])) and np.all(np.isfinite(y[ok]))


# ---------------------------------------------------------------------------
# conversions inside the kernels


@numba.njit
def _store_f32(kind: Any, v: Any) -> Any:  # pragma: no cover - jitted
    out = np.empty(v.shape[0], kind)
    for j in range(v.shape[0]):
        _storage.st(out, j, v[j])
    return out


@numba.njit
def _store_f64(kind: Any, v: Any) -> Any:  # pragma: no cover - jitted
    out = np.empty(v.shape[0], kind)
    for j in range(v.shape[0]):
        _storage.st_exact(out, j, v[j])
    return out


@numba.njit
def _load(a: Any) -> Any:  # pragma: no cover - jitted
    out = np.empty(a.shape[0], np.float32)
    for j in range(a.shape[0]):
        out[j] = _storage.ld(a[j])
    return out


def _special_f32() -> np.ndarray:
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 2**32, 200000, dtype=np.uint64).astype(np.uint32)
    v = bits.view(np.float32)
    extra = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504, 65520, 1e-8, 3.4e38, 1.0 + 2**-8, 1.0 + 3 * 2**-9])
    return np.concatenate([v, extra.astype(np.float32)])


@pytest.mark.parametrize("target", ["float16", "bfloat16"])
def test_half_conversions_match_numpy(target: str) -> None:
    if target == "bfloat16" and BF16 is None:
        pytest.skip("ml_dtypes is not installed")
    dt = np.dtype(np.float16) if target == "float16" else np.dtype(BF16)
    bits = np.int16 if target == "float16" else np.uint16
    v = _special_f32()
    got = _store_f32(bits, v).view(dt)
    with np.errstate(over="ignore", invalid="ignore"):
        want = v.astype(dt)
    same = (got.view(bits) == want.view(bits)) | (np.isnan(got.astype(np.float32)) & np.isnan(want.astype(np.float32)))
    assert np.all(same)
    back = _load(want.view(bits))
    assert np.array_equal(back, want.astype(np.float32), equal_nan=True)
    # float64 -> half is rounded once, correctly (via round-to-odd float32)
    rng = np.random.default_rng(8)
    v64 = rng.standard_normal(100000) * np.exp2(rng.integers(-20, 20, 100000))
    from pynorm.reference._common import round_to

    assert np.array_equal(_store_f64(bits, v64).view(dt), round_to(v64, dt))


# ---------------------------------------------------------------------------
# output buffer pool


def test_output_pool_reuses_only_dropped_buffers() -> None:
    from pynorm.backends.numba._common import POOL, output

    shape = (POOL.min_bytes // 4 // 256 + 1, 256)
    a = output(None, shape, np.float32)
    pa = a.__array_interface__["data"][0]
    view = a[::2]
    del a
    b = output(None, shape, np.float32)
    assert b.__array_interface__["data"][0] != pa  # a view keeps the buffer alive
    del view
    c = output(None, shape, np.float32)
    assert c.__array_interface__["data"][0] == pa
    assert c.shape == shape and c.dtype == np.float32 and c.flags.c_contiguous and c.flags.writeable
    assert not np.shares_memory(b, c)
    x, _, w, bias = data(shape, np.float32)
    y1, _ = nln.forward(x, w, bias, eps=1e-5)
    y2, _ = nln.forward(x, w, bias, eps=1e-5)
    assert not np.shares_memory(y1, y2) and np.array_equal(y1, y2)


def test_pool_hands_out_arrays_of_the_request_whatever_the_dtypes_spelling() -> None:
    # the pool keeps each request's (dtype, bytes, size class) by (shape, dtype as given): the spellings of one dtype
    # share buffers, every kind its own dtype and shape, and the memo stays bounded
    from pynorm.backends.numba._common import _BufferPool

    pool = _BufferPool(min_bytes=1 << 12, max_bytes=1 << 24, scratch_bytes=1 << 12)
    a = pool.empty((8, 256), np.float32)
    pa = a.__array_interface__["data"][0]
    del a
    for spelling in (np.dtype(np.float32), "float32", np.float32):
        b = pool.empty((8, 256), spelling)
        assert b.dtype == np.float32 and b.shape == (8, 256) and b.flags.c_contiguous and b.flags.writeable
        assert b.__array_interface__["data"][0] == pa
        del b
    c = pool.empty((4, 256), np.float64)  # (the same bytes, another kind: the same size class)
    assert c.dtype == np.float64 and c.shape == (4, 256) and c.__array_interface__["data"][0] == pa
    held = pool.empty((3, 5, 7, 16), np.int64)
    assert held.shape == (3, 5, 7, 16) and held.dtype == np.int64 and held.base is not None
    for n in range(300):
        pool.empty((1024 + n,), np.float32)
    assert len(pool._kinds) <= 256
    listed = pool.empty([8, 256], np.float32)  # type: ignore[arg-type]  # (a shape as a list: served, not kept)
    assert listed.shape == (8, 256) and listed.dtype == np.float32


def test_pool_size_classes() -> None:
    from pynorm.backends.numba._common import size_class

    prev = 0
    for n in [*range(1, 300), *(int(v) for v in np.geomspace(300, 1 << 34, 400))]:
        c = size_class(n)
        assert c >= n and c >= prev, n
        assert n < 8 or c <= 1.25 * n, (n, c)
        assert size_class(c) == c
        prev = c


def test_pool_steady_state_of_a_layer_stack_takes_no_new_memory() -> None:
    # the pattern of a stack: every block's output alive until the backward, the next step reusing the same
    # buffers (0 fresh pages), and no live result ever overwritten
    import pynorm
    from pynorm.backends.numba._common import POOL

    x, dy, w, b = data((48, 1024), np.float32, seed=5)  # 192 KiB outputs: pooled from 64 KiB
    assert 4 * x.size >= POOL.min_bytes

    def step() -> list[Any]:
        h, ctxs = x, []
        for _ in range(3):
            h, c = pynorm.layer_norm_forward(h, w, b, backend="numba")
            ctxs.append((h, c))
        g = dy
        kept = [h.copy() for h, _ in ctxs]
        for (h, c), k in zip(reversed(ctxs), reversed(kept), strict=True):
            assert np.array_equal(h, k)  # a live output is never handed out again
            g = pynorm.layer_norm_backward(g, c).dx
        return [h for h, _ in ctxs]

    step()
    step()
    held = POOL.held_bytes()
    ids = {id(buf) for bufs in POOL._bufs.values() for buf in bufs}
    first = [a.copy() for a in step()]
    for _ in range(3):
        assert all(np.array_equal(a, b) for a, b in zip(first, step(), strict=True))
    assert POOL.held_bytes() == held
    assert {id(buf) for bufs in POOL._bufs.values() for buf in bufs} == ids


def test_pool_releases_idle_buffers() -> None:
    from pynorm.backends.numba._common import _BufferPool

    pool = _BufferPool(min_bytes=1 << 16, max_bytes=1 << 20, idle_seconds=3600.0)
    live = [pool.empty((1 << 16,), np.float32) for _ in range(8)]  # 8 x 256 KiB, all referenced
    assert pool.held_bytes() == 8 << 18
    del live[4:]
    assert pool.trim() == 4 << 18 and pool.held_bytes() == 4 << 18  # only the dropped ones
    dropped = [pool.empty((1 << 16,), np.float32) for _ in range(6)]
    del dropped
    pool.empty((1 << 15,), np.float32)  # a miss: idle buffers beyond max_bytes released (least recent first)
    idle = pool.held_bytes() - (4 << 18)
    assert idle <= 1 << 20
    pool.idle_seconds = 0.0
    new = pool.empty((3 << 15,), np.float32)  # a miss: every idle buffer is older than idle_seconds
    assert pool.held_bytes() == (4 << 18) + new.nbytes
    assert all(a.shape == (1 << 16,) for a in live)
    off = _BufferPool(max_bytes=0)
    a = off.empty((1 << 20,), np.float32)
    assert a.base is None and off.held_bytes() == 0


def test_backward_scratch_is_pooled_and_its_old_contents_never_leak() -> None:
    # the block partials of the backward come from the pool (no fresh pages per call); a reused buffer holds the
    # previous call's values (here: NaN), which the kernels must overwrite, never add to
    import pynorm
    from pynorm.backends.numba import _common

    rows, h = 4 * _layout.FUSED_MIN_ROWS, 4096  # the fused backward: (rows / ROW_BLOCK, h) partials
    shape = (_layout.blocks(rows), h)
    assert 4 * math.prod(shape) >= _common.POOL.scratch_bytes
    a = _common.scratch(shape, np.float32)
    pa = a.__array_interface__["data"][0]
    b = _common.scratch(shape, np.float32)
    pb = b.__array_interface__["data"][0]
    assert pb != pa  # a live scratch is never handed out twice
    a.fill(np.nan)
    b.fill(np.nan)
    del a, b
    c = _common.scratch(shape, np.float32)
    assert c.__array_interface__["data"][0] in (pa, pb) and np.isnan(c).all()  # dropped: reused as it was left
    del c
    x, dy, w, bias = data((rows, h), np.float32, seed=3)
    ops = (
        (pynorm.layer_norm_forward, pynorm.layer_norm_backward, (w, bias)),
        (pynorm.power_norm_forward, pynorm.power_norm_backward, (w, bias)),
    )
    least = _common.POOL.scratch_bytes
    for fwd, bwd, params in ops:
        _, ctx = fwd(x, *params, backend="numba")
        _common.POOL.scratch_bytes = 1 << 62
        try:
            fresh = bwd(dy, ctx)  # partials from numpy.empty
        finally:
            _common.POOL.scratch_bytes = least
        for _ in range(2):
            for _ in range(4):  # poison every idle pooled buffer of the partials' sizes (float32 or float64)
                junk = [_common.scratch(shape, t) for _ in range(4) for t in (np.float32, np.float64)]
                for j in junk:
                    j.fill(np.nan)
                del junk
            pooled = bwd(dy, ctx)
            for got, want in zip(pooled, fresh, strict=True):
                assert np.array_equal(got, want) and np.isfinite(got).all()


def test_one_block_gradients_are_its_partials_and_never_negative_zero() -> None:
    # with one row block the partials are returned as the gradients (no float64 pass that maps -0.0 to +0.0):
    # correct only because every kernel's partials are sums started from +0.0; a column whose every term is
    # -0.0 (dy = -0.0) must still give +0.0, as the multi-block reduction does
    import pynorm

    for rows, h in ((1, 64), (3, 40), (_layout.ROW_BLOCK, 16), (1, 3 * _layout.SPLIT_SEG)):
        x, dy, w, b = data((rows, h), np.float32, seed=rows)
        dy[:, 1] = -0.0
        dy[:, 2] = -dy[:, 2] * 0.0  # +-0.0 by row
        calls = (
            (pynorm.layer_norm_forward, pynorm.layer_norm_backward, (w, b), ()),
            (pynorm.rms_norm_forward, pynorm.rms_norm_backward, (w,), ()),
            (pynorm.power_norm_forward, pynorm.power_norm_backward, (w, b), ()),
            (pynorm.dyt_forward, pynorm.dyt_backward, (w, b), (np.array([0.5], np.float32),)),
        )
        for fwd, bwd, params, inputs in calls:
            _, ctx = fwd(x, *inputs, *params, backend="numba")
            grads = bwd(dy, ctx)
            _, ctx_r = fwd(x.astype(np.float64), *inputs, *(p.astype(np.float64) for p in params), backend="numpy")
            grads_r = bwd(dy.astype(np.float64), ctx_r)
            for name in ("dweight", "dbias"):
                g = getattr(grads, name, None)
                if g is None:
                    continue
                assert g.shape == (h,) and g.dtype == np.float32
                assert (g[1:3] == 0).all() and not np.signbit(g[1:3]).any(), (fwd.__name__, rows, h, name)
                np.testing.assert_allclose(g, getattr(grads_r, name), rtol=1e-4, atol=1e-5)


def test_column_total_is_fsum_bitwise() -> None:
    # the scalar parameters' gradient (DyT's alpha, ScaleNorm's g): math.fsum of the column sums, by a jitted copy of
    # CPython's algorithm; special values and intermediate overflow keep fsum's / the IEEE sum's answers
    from pynorm.backends.numba._common import column_total
    from pynorm.backends.numba._reduce import exact_sum

    rng = np.random.default_rng(11)
    cases = [np.zeros(0), np.array([-0.0]), np.array([-0.0, -0.0]), np.array([1e308, 1e308, -1e308])]
    for n in (1, 2, 3, 17, 1000, 65537):
        v = rng.standard_normal(n) * np.exp2(rng.integers(-1074, 1000, n).astype(np.float64))
        cases.append(v)
        cases.append(np.concatenate([v, -v[::-1], [1e-300]]))  # cancels but for 1e-300; ~90 partials
        w = rng.standard_normal(n)
        cases.append(np.concatenate([[1.0, 2.0**-53, 2.0**-106], w * 2.0**-60]))  # half-even ties across partials
        cases.append(np.concatenate([[2.0**53, 1.0, -(2.0**-52)], w * 0.0]))
    ties = [np.array([1.0, 2.0**-53]), np.array([1.0, 2.0**-53, 2.0**-106]), np.array([1.0, -(2.0**-54), -(2.0**-107)])]
    cases += [*ties, np.array([1e300, 1e300, 1e300, 1e300, -1e300]) * 1e8]
    for c in cases:
        want = math.fsum(c.tolist()) if np.isfinite(c).all() and np.abs(c).max(initial=0.0) < 1e308 else None
        got = column_total(c)
        if want is not None:
            assert np.float64(got).tobytes() == np.float64(want).tobytes(), (c[:4], got, want)
    ok, _ = exact_sum(np.array([1e308, 1e308, -1e308]))
    assert not ok  # fsum raises OverflowError here: column_total then gives the IEEE sum in column order
    assert column_total(np.array([1e308, 1e308, -1e308])) == np.inf
    assert column_total(np.array([1.0, np.inf, 2.0])) == np.inf
    assert np.isnan(column_total(np.array([1.0, np.nan])))
    assert np.isnan(column_total(np.array([np.inf, -np.inf])))


def test_no_fallback_to_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    # every path of the numba backend (fast rows, slow scaled rows, serial and parallel) must run
    # without the reference: make the reference unusable and run all of them
    import pynorm
    from pynorm.reference import layer_norm as ref_ln
    from pynorm.reference import rms_norm as ref_rms

    def boom(*a: Any, **k: Any) -> None:
        raise AssertionError("the numba backend called the reference")

    for mod in (ref_ln, ref_rms):
        monkeypatch.setattr(mod, "forward", boom)
        monkeypatch.setattr(mod, "backward", boom)
    rng = np.random.default_rng(0)
    for dt in DTYPES:
        big = float(
            np.finfo(np.float16).max if np.dtype(dt) == np.float16 else 1e38 if np.dtype(dt).itemsize <= 4 else 1e300
        )
        for shape in ((3, 5), (300, 257)):
            x = (np.clip(rng.standard_normal(shape), -1.8, 1.8) * 0.5 * big).astype(dt)
            x[0] = 1e-3  # a constant row beside huge ones
            w = np.ones(shape[1], dt)
            for f, b in (
                (pynorm.layer_norm_forward, pynorm.layer_norm_backward),
                (pynorm.rms_norm_forward, pynorm.rms_norm_backward),
            ):
                y, ctx = f(x, w, backend="numba")
                g = b(np.ones_like(x), ctx)
                assert np.all(np.isfinite(y.astype(np.float64))) and np.all(np.isfinite(g.dx.astype(np.float64)))


@pytest.mark.parametrize("params", ["wb", "w", "b", ""])
@pytest.mark.parametrize("h", [5, 16, 1000, 1037])
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_streaming_stores_match_plain_stores(variant: tuple[str, dict[str, Any]], params: str, h: int) -> None:
    # large float32 outputs are written with streaming stores (aligned part of each row);
    # the values must be bitwise those of the plain loops, for any alignment of the output
    op, conv = variant
    rng = np.random.default_rng(7)
    rows = 19
    x = rng.standard_normal((rows, h)).astype(np.float32) * 3 + 1
    x[3] = 1e30  # slow path (rounded to inf in float32: a non-finite row) and a constant row
    x[4] = 2.5
    x[5, ::3] = 3e38
    w = rng.standard_normal(h).astype(np.float32) if "w" in params else None
    b = rng.standard_normal(h).astype(np.float32) if "b" in params else None
    for off in range(0, 16, 3):
        outs = []
        for stream in (False, True):
            buf = np.full(rows * h + 16, np.float32(7.0))
            y = buf[off : off + rows * h].reshape(rows, h)
            stat, aff, conv_k, row_stats = _kernel_args(op, conv, x, w, b)
            stats.forward_rows(stat, plain(Rows(x)), plain(aff), plain(conv_k), y, plain(row_stats), stream)
            outs.append((buf.copy(), *row_stats))
        for a, c in zip(outs[0], outs[1], strict=True):
            np.testing.assert_array_equal(a, c)
    assert _layout.use_stream(np.empty((4096, 1024), np.float32))
    assert not _layout.use_stream(np.empty((4096, 1024), np.float64))
    assert not _layout.use_stream(np.empty((65536, 128), np.float32))


@pytest.mark.parametrize("params", ["wb", "w", "b", ""])
@pytest.mark.parametrize("h", [5, 1000, 1037])
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_streaming_backward_matches_plain_stores(variant: tuple[str, dict[str, Any]], params: str, h: int) -> None:
    # dx of large float32 inputs is written with streaming stores: bitwise the plain loops' values (a row's dx
    # must not depend on whether its batch was large enough to stream), partial sums and paths, on both paths
    op, conv = variant
    rng = np.random.default_rng(11)
    rows = 37
    x = rng.standard_normal((rows, h)).astype(np.float32) * 3 + 1
    x[3] = 2.5  # constant row
    x[5, ::3] = 3e38  # slow path
    dy = rng.standard_normal((rows, h)).astype(np.float32)
    w = rng.standard_normal(h).astype(np.float32) if "w" in params else None
    b = rng.standard_normal(h).astype(np.float32) if "b" in params and "bias" in SPECS[op].param_names else None
    stat, aff, conv_k, row_stats = _kernel_args(op, conv, x, w, b)
    stats.forward_rows(stat, plain(Rows(x)), plain(aff), plain(conv_k), np.empty_like(x), plain(row_stats), False)
    nb = -(-rows // _layout.ROW_BLOCK)
    streamed = []
    for off in (0, 5):
        got = []
        for stream in (False, True):
            res: list[Any] = []
            for path in ("fused", "rows"):
                buf = np.full(rows * h + 16, np.float32(7.0))
                dx = buf[off : off + rows * h].reshape(rows, h)
                pw = np.empty((nb, h), np.float32) if w is not None else None
                pb = np.empty((nb, h), np.float32) if b is not None else None
                scale, cs = stats.backward_rows(
                    stat, path, x, dy, plain(aff._replace(bias=None)), plain(row_stats), plain(conv_k),
                    plain(Grad(dx)), plain(Partials(pw, pb)), stream,
                )  # fmt: skip
                res += [buf.copy(), pw, pb, scale, cs]
            got.append(res)
        for a, c in zip(got[0], got[1], strict=True):
            if a is None:
                assert c is None
            else:  # the streamed elements are computed by the plain loops' functions: bitwise the plain stores
                np.testing.assert_array_equal(a, c)
        streamed.append([a if a is None or a.shape != (rows * h + 16,) else a[off : off + rows * h] for a in got[1]])
    # ... and, streamed, bitwise independent of the output's alignment
    for a, c in zip(streamed[0], streamed[1], strict=True):
        if a is None:
            assert c is None
        else:
            np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("shape", [(37, 300), (9, 4000), (3, 1), (_layout.FUSED_MIN_ROWS + 5, 70)], ids=str)
@pytest.mark.parametrize("dt", [np.float32, np.float64, np.float16], ids=name)
@pytest.mark.parametrize("variant", VARIANTS, ids=VARIANT_IDS)
def test_backward_paths_agree(variant: tuple[str, dict[str, Any]], dt: Any, shape: tuple[int, int]) -> None:
    # the fused and the row-then-column-tile backward compute each row's dx with the same code (bitwise equal)
    # and the parameter gradients with the same terms in another order (equal to rounding), slow rows included
    op, conv = variant
    if conv.get("correction", 0) >= shape[1]:
        pytest.skip("correction=1 needs H >= 2")
    x, dy, w, b = data(shape, dt, seed=13)
    x[1] = np.asarray(float(np.finfo(dt).max) / 2, dtype=dt)  # a constant huge row
    # a slow row (float16 rows never need it: float32 sums hold their squares; H = 1 rows may be constant)
    slow = np.dtype(dt) != np.float16 and shape[1] > 1
    x[-1, ::2] = np.asarray(float(np.finfo(dt).max) / 3, dtype=dt)
    xs, dys = _storage_of(x), _storage_of(dy)
    bias = b if "bias" in SPECS[op].param_names else None
    stat, aff, conv_k, row_stats = _kernel_args(op, conv, xs, w, bias)
    stats.forward_rows(stat, plain(Rows(xs)), plain(aff), plain(conv_k), np.empty_like(xs), plain(row_stats), False)
    nb = -(-shape[0] // _layout.ROW_BLOCK)
    mdt = np.float64 if np.dtype(dt) == np.float64 else np.float32
    out = {}
    for path in ("fused", "rows"):
        dx = np.empty_like(xs)
        pw, pb = np.empty((nb, shape[1]), mdt), (np.empty((nb, shape[1]), mdt) if bias is not None else None)
        scale, _ = stats.backward_rows(
            stat, path, xs, dys, plain(aff._replace(bias=None)), plain(row_stats), plain(conv_k), plain(Grad(dx)),
            plain(Partials(pw, pb)), False,
        )  # fmt: skip
        out[path] = (dx, scale, pw.astype(np.float64).sum(0), None if pb is None else pb.astype(np.float64).sum(0))
    (dx_f, sc_f, w_f, b_f), (dx_r, sc_r, w_r, b_r) = out["fused"], out["rows"]
    np.testing.assert_array_equal(dx_f, dx_r)
    np.testing.assert_array_equal(sc_f, sc_r)
    assert np.any(sc_f == kern.FAST) and (np.any(sc_f != kern.FAST) or not slow)  # both paths were taken
    tol = 1e-12 if mdt == np.float64 else 1e-5
    assert rel(w_f, w_r) <= tol and (b_f is None or rel(b_f, b_r) <= tol)


RESIDUAL_TABLE_OPS = [n for n, impl in ROW_IMPLS.items() if impl.residual or affine_of(SPECS[n]).index]


@pytest.mark.parametrize("shape", [(9, 4000), (_layout.FUSED_MIN_ROWS + 5, 70)], ids=str)
@pytest.mark.parametrize("op", RESIDUAL_TABLE_OPS)
def test_residual_and_table_variants_on_every_path(
    op: str, shape: tuple[int, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the residual prologue / dh epilogue and the table affine source on both backward paths (fused by row blocks;
    # rows then column tiles), with a slow row, a constant row and rows of every modality: each path matches the
    # reference, and the two paths give the same dx bitwise and the same parameter gradients to rounding
    import pynorm

    from .helpers import OPS, assert_close_scaled, flat_arrays, make_args

    spec = OPS[op]
    rng = np.random.default_rng(21)
    x = rng.standard_normal(shape).astype(np.float32) * 2 + 1
    x[1] = 2.5
    x[-1, ::2] = np.float32(1e38)  # sums of squares overflow float32: the slow path
    args = make_args(spec, shape, -1, np.float32, rng)
    dy = rng.standard_normal(shape).astype(np.float32)
    fwd, bwd = SPECS[op].generic_forward(), getattr(pynorm, f"{op}_backward")
    for conv in SPECS[op].cases[:2]:
        res_ref, c_ref = fwd(x, *args, backend="numpy", **conv)
        extra = {}
        if stats.OP_IMPLS[op].residual:
            extra["dh"] = rng.standard_normal(shape).astype(res_ref[1].dtype)
        g_ref = bwd(dy, c_ref, *extra.values())
        got = {}
        for fused in (True, False):
            monkeypatch.setattr(stats, "use_fused", lambda r, h, f=fused: f)
            res, c = fwd(x, *args, backend="numba", **conv)
            got[fused] = (res, bwd(dy, c, *extra.values()))
        (res_f, g_f), (res_r, g_r) = got[True], got[False]
        for a, b in zip(res_f if extra else (res_f,), res_r if extra else (res_r,), strict=True):
            np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(g_f[0], g_r[0])
        arrays = flat_arrays(spec, shape, -1, args)
        if extra:
            arrays.update(h=res_ref[1], **extra)
        sc = term_scales(op, x, arrays, dy, conv)
        y_ref = res_ref[0] if extra else res_ref
        for res, g in ((res_f, g_f), (res_r, g_r)):
            y = res[0] if extra else res
            assert_close_scaled(y, y_ref, sc["y"], 4e-6, f"{op} y")
            if extra:
                np.testing.assert_array_equal(res[1], res_ref[1])  # h: the same one rounding
            for gname, a, ref in zip(spec.grad_names, g, g_ref, strict=True):
                if ref is None:
                    assert a is None
                    continue
                assert a.dtype == ref.dtype and a.shape == ref.shape, gname
                assert_close_scaled(a, ref, sc[gname].reshape(ref.shape), 2e-5, f"{op} {gname}")


def test_op_impls_follow_the_specs() -> None:
    # every spec is served by its family's one module, with the spec's ctx and grads; OPS lists exactly those ops
    import pynorm
    import pynorm.backends.numba as nb
    from pynorm import _registry
    from pynorm.backends.numba import column, elementwise, quantize

    # composite ops (Python over other ops, pynorm/composite) are offered by the registry, not listed here
    kernel_ops = {n: s for n, s in SPECS.items() if s.family != "composite" and s.layout == "rows"}
    # (the channels-layout ops with numba kernels: tests/test_channel_kernels.py, tests/test_batch_norm_kernels.py)
    channel_ops = {n for n, s in SPECS.items() if s.layout == "channels" and nb._has_kernels(s)}
    assert {"group_norm", "instance_norm", "batch_norm"} <= channel_ops
    assert set(nb.OPS) == set(kernel_ops) | channel_ops
    families = {
        "stats": stats.OP_IMPLS, "elementwise": elementwise.OP_IMPLS, "quantize": quantize.OP_IMPLS,
        "column": column.OP_IMPLS,
    }  # fmt: skip
    rng = np.random.default_rng(0)
    for n, spec in kernel_ops.items():
        assert nb.OPS[n] == spec.family
        impl = _registry.op_module("numba", n)
        # (with the casting policies composed above the backend where the op has them: pynorm.composite.casting)
        assert (impl.impl if composed_options(spec) else impl) is families[spec.family][n]
        x = rng.standard_normal((4, 6)).astype(np.float32)
        inputs = [
            x.copy() if i.kind == "like_x" else None if i.kind in ("row_scale", "running") else np.arange(4) % 2
            for i in spec.inputs
        ]
        params = [np.ones({"table": (2, 6), "scalar": (1,)}.get(p.kind, (6,)), np.float32) for p in spec.params]
        _, ctx = spec.generic_forward()(x, *inputs, *params, backend="numba", **spec.cases[0])
        assert type(ctx.inner) is spec.ctx
        assert type(getattr(pynorm, f"{n}_backward")(np.ones_like(x), ctx)) is spec.grads
        with pytest.raises(TypeError):
            impl.forward(x, *inputs, *params, no_such_option=1)


def test_importing_the_backend_does_not_import_numba() -> None:
    import subprocess
    import sys

    code = (
        "import sys, pynorm, pynorm.backends.numba as nb; pynorm.list_ops(); "
        "print(sorted(nb.OPS), 'numba' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split()[-1] == "False"


def test_borrow_views_share_data_and_keep_references_balanced() -> None:
    import sys

    from pynorm.backends.numba._borrow import borrow

    @numba.njit
    def fill(t, v):  # type: ignore[no-untyped-def]
        a, flag, none, b = borrow(t)
        for i in range(a.shape[0]):
            a[i, 0] = v  # through a view of a borrowed array
        b[1] = v if flag and none is None else -v
        return a.shape[0] + b.shape[0]

    a = np.zeros((3, 2), np.float32)
    b = np.zeros(4)
    before = (sys.getrefcount(a), sys.getrefcount(b))
    for _ in range(5):
        assert fill((a, True, None, b), 7.0) == 7
    assert (sys.getrefcount(a), sys.getrefcount(b)) == before
    assert a[:, 0].tolist() == [7.0, 7.0, 7.0] and a[:, 1].tolist() == [0.0] * 3
    assert b.tolist() == [0.0, 7.0, 0.0, 0.0]


# ---------------------------------------------------------------------------
# few wide rows: rows split across threads (_split_kernels) give the plain kernels' bits

SPLIT_OPS = list(ROW_IMPLS)
# rows path with 1 and 3 rows, the fused path (>= FUSED_MIN_ROWS rows) with a ragged last segment
SPLIT_SHAPES = [
    (1, 2 * _layout.SPLIT_SEG + 5),
    (3, _layout.SPLIT_SEG + _layout.CHUNK + 3),
    (130, _layout.SPLIT_SEG + 7),
]


def _split_case(op: str, shape: tuple[int, int], dt: Any, options: dict[str, Any]) -> list[np.ndarray]:
    spec = SPECS[op]
    impl = stats.OP_IMPLS[op]
    rng = np.random.default_rng(sum(shape) + len(op))
    x = (rng.standard_normal(shape) * 2).astype(dt)
    if shape[0] >= 3:  # hard rows: an offset far larger than the spread, a constant row, a slow-path row
        x[1] += 300
        x[2] = 1.5
        x[-1] = (rng.standard_normal(shape[1]) * 1e30).astype(dt)  # its float32 sum of squares overflows
    args = spec.example_args(shape, -1, dt, rng)
    dy = rng.standard_normal(shape).astype(dt)
    out, ctx = impl.forward(x, *args, **options)
    outs = list(out) if isinstance(out, tuple) else [out]
    kw = {"dh": rng.standard_normal(shape).astype(outs[1].dtype)} if impl.residual else {}
    grads = impl.backward(dy, ctx, **kw)
    stat = [getattr(ctx, f) for f in ("mean", "rstd", "floor") if getattr(ctx, f, None) is not None]
    return [np.asarray(a) for a in (*outs, *stat, *grads) if a is not None]


#: ``(op, dtype)`` of the split tests: every op in float32; the 16-bit storage forms through bfloat16 for one op
#: with and one without the residual prologue (tests/test_paths.py forces the split path for every op in float16)
SPLIT_CASES = [(op, np.float32) for op in SPLIT_OPS] + (
    [("layer_norm", BF16), ("add_rms_norm", BF16)] if BF16 is not None else []
)


@pytest.mark.parametrize("shape", SPLIT_SHAPES, ids=str)
@pytest.mark.parametrize(("op", "dt"), SPLIT_CASES, ids=lambda v: v if isinstance(v, str) else name(v))
def test_split_rows_give_the_plain_kernels_bits(
    op: str, shape: tuple[int, int], dt: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    for options in SPECS[op].cases:  # every convention of the spec (a float64 h of a float32 x is not split)
        plain = _split_case(op, shape, dt, options)
        monkeypatch.setattr(stats, "FORCE_SPLIT", True)
        split = _split_case(op, shape, dt, options)
        monkeypatch.setattr(stats, "FORCE_SPLIT", False)
        assert len(plain) == len(split) >= 3
        _assert_bitwise(split, plain)


def test_split_rows_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    seg = _layout.SPLIT_SEG
    wide = np.zeros((1, 2 * seg), np.float32)
    monkeypatch.setattr(_threads, "get_num_threads", lambda: 4)
    monkeypatch.setattr(stats, "SPLIT_MIN_WORK", 0)
    assert stats.split_rows(1, wide)
    monkeypatch.setattr(stats, "SPLIT_MIN_WORK", wide.size + 1)
    assert not stats.split_rows(1, wide)  # too small a call
    monkeypatch.setattr(stats, "SPLIT_MIN_WORK", 0)
    assert stats.split_rows(1, wide)  # one row, four threads
    assert stats.split_rows(3, np.empty((3, 2 * seg), np.float32))
    assert not stats.split_rows(4, np.empty((4, 2 * seg), np.float32))  # a row per thread already
    assert not stats.split_rows(1, np.empty((1, 2 * seg - 1), np.float32))  # less than two segments
    assert not stats.split_rows(1, wide.astype(np.float64))  # float64 rows are never split (see split_rows)
    assert not stats.split_rows(1, np.empty((1, 2 * seg), np.uint16)[:0])
    monkeypatch.setattr(_threads, "SERIAL_THRESHOLD", 1 << 62)
    assert not stats.split_rows(1, wide)  # a one-thread call
    monkeypatch.setattr(stats, "FORCE_SPLIT", True)
    assert stats.split_rows(1, np.empty((1, 1), np.float32)) and not stats.split_rows(1, wide.astype(np.float64))


@pytest.mark.skipif(numba.config.NUMBA_NUM_THREADS < 2, reason="needs NUMBA_NUM_THREADS >= 2")
def test_one_wide_row_runs_on_every_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """A single row of many elements is cut into segments that run on the pool (and gives the 1-thread bits)."""
    from pynorm.backends.numba import _split_kernels

    monkeypatch.setattr(stats, "SPLIT_MIN_WORK", 0)  # (the tests' conftest already sends small calls to the pool)
    x, dy, w, b = data((1, 8 * _layout.SPLIT_SEG), np.float32)
    seen: list[tuple[int, set[int]]] = []
    real = _threads.launch

    def spy(kernel: Any, work: int, tasks: int, *args: Any) -> Any:
        if kernel is not _split_kernels.fwd_sums:
            return real(kernel, work, tasks, *args)
        ran: set[int] = set()

        def traced(*a: Any) -> Any:
            ran.add(threading.get_ident())
            return kernel(*a)

        seen.append((tasks, ran))
        return real(traced, work, tasks, *args)

    try:
        _threads.set_num_threads(2)
        monkeypatch.setattr(stats, "launch", spy)
        two = _run_all(x, dy, w, b)
        monkeypatch.setattr(stats, "launch", real)
        assert len(seen) == 3 and all(t == 8 and len(ran) == 2 for t, ran in seen), seen
        _threads.set_num_threads(1)
        one = _run_all(x, dy, w, b)
    finally:
        _threads.set_num_threads(None)
    _assert_bitwise(two, one)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_split_rows_with_streaming_stores(op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Outputs large enough for streaming stores: the split kernels' segments make the same stores."""
    shape = (2, _layout.STREAM_MIN_BYTES // 8 + 3 * _layout.LANES + 1)  # 16 MiB of float32, a ragged row end
    assert _layout.use_stream(np.empty(shape, np.float32))
    plain = _split_case(op, shape, np.float32, {})
    monkeypatch.setattr(stats, "FORCE_SPLIT", True)
    _assert_bitwise(_split_case(op, shape, np.float32, {}), plain)


# ---------------------------------------------------------------------------
# a statistic defined here, at run time: its record and pieces, no kernel edited


_tcast = _storage.tcast


def _centre_only_bwd_finish(stat, xr, k, c, sg, sgx, sd2, r, corr, mode, aux):  # type: ignore[no-untyped-def]
    # y = x - mean: dx = g - mean(g), no xhat term (r = 1 does not depend on x)
    return math.isfinite(sg), _tcast(xr, sg / xr.shape[0]), _tcast(xr, 0.0)


def _centre_only_pieces() -> dict[Any, Any]:
    from pynorm.backends.numba import _rowstats as rs

    return {
        **rs.CENTERED,
        rs.rfactor: lambda stat, v, eps, mode: 1.0,  # r = 1: the row is centred, not scaled
        rs.scaled_rstd: lambda stat, v_s, e, eps, mode: (1.0, math.ldexp(1.0, e)),
        rs.third_sum: lambda stat, mode: False,
        rs.bwd_finish: _centre_only_bwd_finish,
        rs.slow_finish: lambda stat, sg, sgx, s3, h, n, r_s, mode, aux: (sg / h, 0.0),
    }


#: its pieces (named by its record as "module:attribute")
CENTRE_ONLY = _centre_only_pieces()
#: its name carries a hash of this file: numba's disk cache stamps the backend's own sources only, and kernels of
#: this statistic compiled from an older version of these pieces must not be found under the same type
CENTRE_ONLY_NAME = "centre_only_" + hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:12]


@dataclasses.dataclass(frozen=True, eq=False)
class _CentreCtx:
    x: Any
    weight: Any
    bias: Any
    mean: Any
    rstd: Any
    weight_offset: float


class _CentreGrads(NamedTuple):
    dx: Any
    dweight: Any
    dbias: Any


def test_a_statistic_without_normalization_is_its_record_and_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    # y = (x - mean) (w + o) + b: a statistic whose r is 1 -- its own r rule in its pieces, no eps -- and which does
    # not normalize, so xhat keeps the input's magnitude: the kernels run unchanged, and the parameter-gradient
    # partials are float64 (float32 ones overflow on the rows of 1e37 here)
    from pynorm.backends.cupy import _loader
    from pynorm.ops import OpSpec, Option, Param, StatsVariant, families
    from pynorm.ops._spec import check_offset

    record = families.Statistic(
        CENTRE_ONLY_NAME, "the row centred, not scaled", mean=True, floor=False, rules={None: 3}, correction=False,
        eps=False, normalizes=False, numba=f"{__name__}:CENTRE_ONLY",
        rows_path=True,  # (claimed so that both backward paths run: this test is about their partials' dtype)
    )  # fmt: skip
    monkeypatch.setitem(families.STATISTICS, record.name, record)
    spec = OpSpec(
        name="centre_norm", params=(Param("weight"), Param("bias", init=0.0)),
        options=(Option("weight_offset", 0.0, check_offset),), grads=_CentreGrads, ctx=_CentreCtx,
        reference="", family="stats", variant=StatsVariant(record.name),  # type: ignore[arg-type]
        term_scales=lambda *a: {},
    )  # fmt: skip
    assert not _loader.supports(spec)  # the CUDA kernels keep sums of u = O(1) in the accumulation type
    op = stats.StatsOp(spec)
    assert op._partials_dtype(np.dtype(np.float32)) == np.float64
    rng = np.random.default_rng(5)
    rows, h = 2 * _layout.ROW_BLOCK, 257  # two row blocks, a ragged row
    x = (rng.standard_normal((rows, h)) * 3 + 1).astype(np.float32)
    # huge rows, alike: their sums of squares overflow float32 (the slow path), and so would a row block's sum of
    # dy * xhat in float32 partials -- dy > 0 in the first block, < 0 in the second: the total stays finite
    x[::3] = ((rng.standard_normal(h) * 3 + 1) * 5e36).astype(np.float32)
    x[1] = 2.5  # a constant row
    w = (1 + 0.5 * rng.standard_normal(h)).astype(np.float32)
    b = rng.standard_normal(h).astype(np.float32)
    dy = (np.abs(rng.standard_normal((rows, h))) + 0.5).astype(np.float32)
    dy[_layout.ROW_BLOCK :] *= -1
    for offset, fused in ((0.0, True), (1.0, True), (1.0, False)):  # row blocks; rows then column tiles
        monkeypatch.setattr(stats, "use_fused", lambda r, hh, f=fused: f)
        y, ctx = op.forward(x, w, b, weight_offset=offset)
        grads = op.backward(dy, ctx)
        x64, dy64, we = x.astype(np.float64), dy.astype(np.float64), w.astype(np.float64) + offset
        d = x64 - x64.mean(axis=1, keepdims=True)
        g = dy64 * we
        want = {
            "y": d * we + b, "dx": g - g.mean(axis=1, keepdims=True), "dweight": (dy64 * d).sum(0),
            "dbias": dy64.sum(0),
        }  # fmt: skip
        got = {"y": y, "dx": grads.dx, "dweight": grads.dweight, "dbias": grads.dbias}
        np.testing.assert_array_equal(ctx.rstd, 1.0)
        np.testing.assert_allclose(ctx.mean, x64.mean(axis=1), rtol=1e-6)
        for name, ref in want.items():
            a = got[name].astype(np.float64)
            assert np.all(np.isfinite(a)), name
            # (the two backward paths agree to rounding here, not bitwise: float64 partials beside float32 sums
            # vectorize the fused loop differently)
            scale = np.abs(ref).max(axis=-1, keepdims=True) if ref.ndim == 2 else np.abs(dy64 * d).sum(0) + 1
            assert np.all(np.abs(a - ref) <= 2e-6 * scale), (name, fused)
