"""GroupNorm and InstanceNorm on the fast backends: the statistics family's kernels with the channel affine source.

Against the reference at the backends' tolerances (tests/test_backends.py's term scales) on ordinary and hard
inputs, every running-statistics mode, long rows; the fast backend really runs them (no fallback); on numba, bitwise
the same results on 1 and 2 threads. The backend-parametrized tests of tests/test_channel_norms.py (finite
differences, channels last) run on these backends too.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import pynorm
from pynorm.ops import SPECS

from .helpers import BACKEND_RTOL, assert_close_scaled, make_rows

#: the backends with kernels for the channel affine source
FAST = ("numba", "cupy")

#: (op, options, running statistics given)
CASES = [
    ("group_norm", {"num_groups": 2}, False),
    ("group_norm", {"num_groups": 1, "eps": 0.1}, False),
    ("instance_norm", {}, False),
    ("instance_norm", {"momentum": 0.3}, True),
    ("instance_norm", {"use_input_stats": False}, True),
]
CASE_IDS = [f"{op}-{','.join(f'{k}={v}' for k, v in o.items()) or 'default'}-{'run' if r else 'norun'}"
            for op, o, r in CASES]  # fmt: skip

KINDS = ("normal", "offset", "huge", "tiny", "constant")


def _fast(backend: Any) -> None:
    if backend.name not in FAST:
        pytest.skip(f"{backend.name!r}: the channel kernels are the fast backends'")


def _compare(backend: Any, op: str, options: dict, running: bool, x: np.ndarray, seed: int = 0) -> None:
    spec = SPECS[op]
    rng = np.random.default_rng(seed)
    n, c = x.shape[:2]
    dt = x.dtype
    w = (1 + 0.5 * rng.standard_normal(c)).astype(dt)
    b = rng.standard_normal(c).astype(dt)
    dy = rng.standard_normal(x.shape).astype(dt)
    run = {}
    if running:
        run = {"running_mean": rng.standard_normal(c).astype(np.float32),
               "running_var": (0.5 + rng.random(c)).astype(np.float32)}  # fmt: skip
    fwd, bwd = getattr(pynorm, f"{op}_forward"), getattr(pynorm, f"{op}_backward")
    res_ref, ctx_ref = fwd(x, w, b, **run, backend="numpy", **options)
    g_ref = bwd(dy, ctx_ref)
    dev = {k: backend.asarray(v) for k, v in run.items()}
    res, ctx = fwd(backend.asarray(x), backend.asarray(w), backend.asarray(b), **dev, backend=backend.name, **options)
    assert ctx.backend == backend.name
    g = bwd(backend.asarray(dy), ctx)
    y_ref = res_ref[0] if isinstance(res_ref, tuple) else res_ref
    y = backend.to_numpy(res[0] if isinstance(res, tuple) else res)
    assert y.dtype == dt and y.shape == x.shape
    x3, dy3 = x.reshape(n, c, -1), dy.reshape(n, c, -1)
    big = float(np.max(np.abs(x3.astype(np.float64))))
    m = 2.0 ** np.floor(np.log2(big)) if big > 1e100 else 1.0  # float64 rows near the max: scales of x / m
    sc = spec.term_scales(x3 / m, {"weight": w, "bias": b}, dy3, {**spec.defaults(), **options})
    sc["dx"] = sc["dx"] / m  # (y and the parameter gradients do not change with the scale of x, dx goes as 1/x)
    rtol = BACKEND_RTOL[dt.name]
    rows = sc["y"].shape[0]
    given = not options.get("use_input_stats", True)
    if given:  # normalized by the running statistics: the terms are the element's own
        r = 1 / np.sqrt(run["running_var"].astype(np.float64) + 1e-5)
        xh = np.abs(x3 - run["running_mean"][None, :, None]) * r[None, :, None]
        sc = {"y": xh * np.abs(w)[None, :, None] + np.abs(b)[None, :, None],
              "dx": np.abs(dy3) * (np.abs(w) * r)[None, :, None],
              "dweight": (np.abs(dy3) * xh).sum(axis=(0, 2)), "dbias": np.abs(dy3).sum(axis=(0, 2))}  # fmt: skip
        rows = n * c
    assert_close_scaled(y.reshape(rows, -1), y_ref.reshape(rows, -1), sc["y"].reshape(rows, -1), rtol, f"{op} y")
    dx = backend.to_numpy(g.dx)
    assert_close_scaled(dx.reshape(rows, -1), g_ref.dx.reshape(rows, -1), sc["dx"].reshape(rows, -1), rtol, "dx")
    for name in ("dweight", "dbias"):
        a, e = backend.to_numpy(getattr(g, name)), getattr(g_ref, name)
        assert a.dtype == e.dtype and a.shape == e.shape, name
        assert_close_scaled(a, e, sc[name], 4 * rtol, name)
    if running and not given:
        for a, e in zip(res[1:], res_ref[1:], strict=True):
            np.testing.assert_allclose(backend.to_numpy(a), e, rtol=1e-5, atol=1e-6)
    if np.all(np.isfinite(x.astype(np.float64))):
        for what, a, e in (("y", y, y_ref), ("dx", dx, g_ref.dx)):
            fin = np.isfinite(np.asarray(e, dtype=np.float64))
            assert np.all(np.isfinite(a.astype(np.float64))[fin]), f"finite input must give finite {what}"


def test_the_fast_backends_serve_the_channel_ops(backend: Any) -> None:
    _fast(backend)
    for op in ("group_norm", "instance_norm"):
        assert backend.name in pynorm.list_ops()[op]
        assert op in backend.ops
    x = np.random.default_rng(0).standard_normal((2, 4, 3)).astype(np.float32)
    _, ctx = pynorm.group_norm_forward(backend.asarray(x), num_groups=2)
    assert ctx.backend == backend.name  # the automatic choice is the fast backend, not the reference


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dt", ["float32", "float64"])
@pytest.mark.parametrize("op, options, running", CASES, ids=CASE_IDS)
def test_matches_reference(backend: Any, op: str, options: dict, running: bool, dt: str, kind: str) -> None:
    _fast(backend)
    if kind == "huge" and running:
        pytest.skip("the running variance of a 1e38-scale input is beyond float32")
    rng = np.random.default_rng(1)
    x = make_rows(kind, (3, 4, 5, 6), np.dtype(dt), rng)
    _compare(backend, op, options, running, x)


@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
@pytest.mark.parametrize("op, options, running", [CASES[0], CASES[4]], ids=[CASE_IDS[0], CASE_IDS[4]])
def test_half_inputs_with_float32_math(backend: Any, op: str, options: dict, running: bool, dt: str) -> None:
    _fast(backend)
    from pynorm._dtypes import dtype_of

    try:
        d = dtype_of(dt)
    except Exception:  # (bfloat16 needs ml_dtypes)
        pytest.skip(f"no {dt}")
    x = make_rows("normal", (2, 4, 7, 5), d, np.random.default_rng(2))
    _compare(backend, op, options, running, x)


@pytest.mark.parametrize(
    "op, options, shape",
    [("group_norm", {"num_groups": 2}, (2, 4, 96, 96)), ("instance_norm", {}, (1, 2, 160, 160))],
    ids=["group_norm-rows_of_18432", "instance_norm-rows_of_25600"],
)
def test_long_rows(backend: Any, op: str, options: dict, shape: tuple) -> None:
    _fast(backend)
    rng = np.random.default_rng(3)
    x = (rng.standard_normal(shape) * 3 + 2).astype(np.float32)
    x[0, 0, :3] = 1e3  # a few large values in the first group
    _compare(backend, op, options, False, x)


@pytest.mark.parametrize("kind", ["normal", "offset", "huge"])
@pytest.mark.parametrize("dt", ["float32", "float64"])
@pytest.mark.parametrize("s", [1, 7, 8])
def test_few_positions_per_channel(backend: Any, s: int, dt: str, kind: str) -> None:
    """``S`` positions per channel on both sides of numba's switch to the table source
    (``pynorm.backends.numba.stats.TABLE_BELOW_S``: an ``(N, C)`` input is ``S = 1``), the slow path's rows included:
    the reference's values, and each sample's rows the same alone as in the batch."""
    _fast(backend)
    rng = np.random.default_rng(6)
    x = make_rows(kind, (5, 12, s), np.dtype(dt), rng)
    _compare(backend, "group_norm", {"num_groups": 3}, False, x)
    w, b = rng.standard_normal(12).astype(dt), rng.standard_normal(12).astype(dt)
    dy = rng.standard_normal(x.shape).astype(dt)
    y, ctx = pynorm.group_norm_forward(backend.asarray(x), backend.asarray(w), backend.asarray(b), num_groups=3)
    dx = pynorm.group_norm_backward(backend.asarray(dy), ctx).dx
    y1, ctx1 = pynorm.group_norm_forward(backend.asarray(x[3:4]), backend.asarray(w), backend.asarray(b), num_groups=3)
    dx1 = pynorm.group_norm_backward(backend.asarray(dy[3:4]), ctx1).dx
    assert np.array_equal(backend.to_numpy(y)[3:4], backend.to_numpy(y1), equal_nan=True)
    assert np.array_equal(backend.to_numpy(dx)[3:4], backend.to_numpy(dx1), equal_nan=True)


def test_slow_path_rows_next_to_fast_ones(backend: Any) -> None:
    # a group whose float32 sums overflow (the slow path) among ordinary groups: each matches the reference
    _fast(backend)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 6, 40)).astype(np.float32)
    x[1, 2:4] *= np.float32(1e37)
    _compare(backend, "group_norm", {"num_groups": 3}, False, x)


@pytest.mark.parametrize("op, options", [("group_norm", {"num_groups": 4}), ("instance_norm", {})])
def test_thread_count_does_not_change_results(backend: Any, op: str, options: dict) -> None:
    if backend.name != "numba":
        pytest.skip("numba's thread pool")
    from pynorm.backends.numba import _threads

    rng = np.random.default_rng(5)
    x = (rng.standard_normal((9, 8, 40, 40)) + 1).astype(np.float32)
    w, b = rng.standard_normal(8).astype(np.float32), rng.standard_normal(8).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    fwd, bwd = getattr(pynorm, f"{op}_forward"), getattr(pynorm, f"{op}_backward")

    def run() -> list[np.ndarray]:
        y, ctx = fwd(x, w, b, **options)
        return [np.array(y), *(np.array(g) for g in bwd(dy, ctx))]

    try:
        _threads.set_num_threads(2)
        two = run()
        assert _threads._workers, "no span ran on a pool thread"
        _threads.set_num_threads(1)
        one = run()
    finally:
        _threads.set_num_threads(None)
    for a, e in zip(two, one, strict=True):
        assert a.tobytes() == e.tobytes()
