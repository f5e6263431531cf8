"""The dispatcher's plan cache (``pynorm._dispatch._PLANS``): a repeated call shape skips the shape checks but
never the checks that depend on the values, and every argument that changes the plan makes a new one."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

import pynorm
from pynorm import _dispatch
from pynorm.errors import ArgumentError, ArrayTypeError, ShapeError
from pynorm.ops import SPECS


def test_a_repeated_call_reuses_its_plan_and_gives_the_same_result() -> None:
    x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
    _dispatch._PLANS.clear()
    y1, _ = pynorm.layer_norm_forward(x, eps=1e-3, backend="numpy")
    assert len(_dispatch._PLANS) == 1
    y2, _ = pynorm.layer_norm_forward(x, eps=1e-3, backend="numpy")
    assert len(_dispatch._PLANS) == 1 and np.array_equal(y1, y2)
    pynorm.layer_norm_forward(x, eps=1e-4, backend="numpy")  # another option value: another plan
    pynorm.layer_norm_forward(x[:, :4], backend="numpy")  # another shape
    pynorm.layer_norm_forward(x.astype(np.float64), backend="numpy")  # another dtype
    assert len(_dispatch._PLANS) == 4


def test_an_option_of_another_type_is_another_plan() -> None:
    x = np.ones((2, 4), np.float32)
    pynorm.layer_norm(x, eps=1, backend="numpy")  # a valid eps
    with pytest.raises(ArgumentError, match="eps must be a real number"):
        pynorm.layer_norm(x, eps=True, backend="numpy")  # True == 1, but a bool is no eps


def test_value_checks_run_on_every_call() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((6, 4)).astype(np.float32)
    w = np.ones((3, 4), np.float32)
    ids = np.array([0, 1, 2, 0, 1, 2])
    pynorm.modality_layer_norm(x, ids, w, backend="numpy")
    bad = ids.copy()
    bad[3] = 7  # same dtype, shape and strides: the cached plan, but the ids are out of range
    with pytest.raises(ArgumentError, match=r"modality_ids must hold values in \[0, 3\)"):
        pynorm.modality_layer_norm(x, bad, w, backend="numpy")
    q = rng.integers(-100, 100, (6, 4)).astype(np.int8)
    scales = np.full(6, 0.1)
    pynorm.quant_layer_norm(q, x_scale=scales, backend="numpy")
    scales[2] = -1.0
    with pytest.raises(ArgumentError, match="x_scale must hold positive finite scales"):
        pynorm.quant_layer_norm(q, x_scale=scales, backend="numpy")
    alpha = np.array([0.5], np.float32)
    pynorm.dyt(x, alpha, backend="numpy")
    with pytest.raises(ArgumentError, match="alpha must be finite"):
        pynorm.dyt(x, np.array([np.inf], np.float32), backend="numpy")


def test_out_overlap_is_checked_on_every_call() -> None:
    x = np.random.default_rng(2).standard_normal((4, 8)).astype(np.float32)
    buf = np.empty_like(x)
    pynorm.rms_norm(x, out=buf, backend="numpy")
    pynorm.rms_norm(x, out=buf, backend="numpy")
    with pytest.raises(ArgumentError, match="out must not overlap"):
        pynorm.rms_norm(buf, out=buf, backend="numpy")


def test_the_backend_is_resolved_on_every_call() -> None:
    x = np.random.default_rng(3).standard_normal((4, 8)).astype(np.float32)
    _, c1 = pynorm.rms_norm_forward(x, backend="numpy")
    with pynorm.use_backend("numpy"):
        _, c2 = pynorm.rms_norm_forward(x)
    assert c1.backend == c2.backend == "numpy"


def test_a_call_that_cannot_have_a_plan_takes_the_full_path() -> None:
    _dispatch._PLANS.clear()
    pynorm.layer_norm([[1.0, 2.0, 3.0]], backend="numpy")  # a list
    big = np.random.default_rng(4).standard_normal((2, 4)).astype(">f4")  # read as a native copy every time
    y1 = pynorm.layer_norm(big, backend="numpy")
    assert not _dispatch._PLANS
    assert np.array_equal(pynorm.layer_norm(big, backend="numpy"), y1)
    assert np.array_equal(y1, pynorm.layer_norm(big.astype("<f4"), backend="numpy"))
    # a parameter of a non-native byte order beside a native x: no plan either (the key holds the dtype, the
    # byte order with it, but the plan would run on the array the checks read as a native copy)
    _dispatch._PLANS.clear()
    native, wbig = big.astype("<f4"), np.arange(4, dtype=">f4")
    for b in [i.name for i in pynorm.list_backends() if i.available and i.name in ("numpy", "numba")]:
        y2 = pynorm.layer_norm(native, wbig, backend=b)
        assert not _dispatch._PLANS
        assert np.array_equal(pynorm.layer_norm(native, wbig, backend=b), y2)
        assert np.array_equal(pynorm.layer_norm(native, wbig.astype("<f4"), backend=b), y2)
        _dispatch._PLANS.clear()
    with pytest.raises(ShapeError):
        pynorm.layer_norm(np.ones((2, 0)), backend="numpy")


def _numpy_arrays_only(backend: Any) -> None:
    """Skip, saying why, for a backend of other arrays: the test's calls are on NumPy arrays (plans are kept for
    ``numpy.ndarray`` calls only; ``pynorm.plan`` takes them alone)."""
    from pynorm import _registry

    served = _registry.get_backend(backend.name)
    if (served.array_module, served.array_type) != ("numpy", "ndarray"):
        pytest.skip(f"plans are kept for numpy.ndarray calls only; {backend.name} serves other arrays")


def test_a_number_for_a_parameter_is_read_as_its_array_and_the_call_has_a_plan(backend: Any) -> None:
    """``alpha=0.5`` (a Python or NumPy scalar) is ``numpy.asarray(0.5)``, as validation reads it: the call shape
    has a plan (its key the array's), the value is read at each call, its checks run at each call, and the
    result is the array's."""
    _numpy_arrays_only(backend)
    _dispatch._PLANS.clear()
    x = np.random.default_rng(5).standard_normal((3, 16)).astype(np.float32)
    y = pynorm.dyt(x, 0.5, backend=backend.name)
    assert len(_dispatch._PLANS) == 1
    for _ in range(2):
        assert np.array_equal(pynorm.dyt(x, 0.5, backend=backend.name), y)
        assert np.array_equal(pynorm.dyt_forward(x, 0.5, backend=backend.name)[0], y)
    assert np.array_equal(pynorm.dyt(x, np.asarray(0.5), backend=backend.name), y)  # the same plan
    assert len(_dispatch._PLANS) == 1
    assert np.array_equal(pynorm.dyt(x, 0.25, backend=backend.name), pynorm.dyt(x, np.asarray(0.25),
                          backend=backend.name))  # fmt: skip
    assert not np.array_equal(pynorm.dyt(x, 0.25, backend=backend.name), y)
    assert np.array_equal(pynorm.dyt(x, np.float32(0.5), backend=backend.name),
                          pynorm.dyt(x, np.array(0.5, np.float32), backend=backend.name))  # fmt: skip
    assert len(_dispatch._PLANS) == 2  # (a float32 alpha: a plan of its own)
    with pytest.raises(ArgumentError, match="alpha must be finite"):
        pynorm.dyt(x, float("inf"), backend=backend.name)
    with pytest.raises(ArrayTypeError, match="alpha must be an array"):
        pynorm.dyt(x, True, backend=backend.name)  # type: ignore[arg-type]
    q = np.arange(8, dtype=np.int8).reshape(2, 4)
    want = pynorm.quant_layer_norm(q, x_scale=np.asarray(0.5), backend=backend.name)
    for _ in range(2):
        assert np.array_equal(pynorm.quant_layer_norm(q, x_scale=0.5, backend=backend.name), want)


def test_every_ctx_type_can_be_filled_without_its_init() -> None:
    # ops._spec.filled makes a ctx (and the dispatcher's Context) without the dataclass's __init__: a type with a
    # __post_init__ or an InitVar would lose it
    import dataclasses

    from pynorm.ops import SPECS

    for t in {*(s.ctx for s in SPECS.values()), _dispatch.Context}:
        assert dataclasses.is_dataclass(t), t
        assert not hasattr(t, "__post_init__"), t
        assert all(f.init for f in dataclasses.fields(t)), t


def _fields(ctx: object) -> dict[str, object]:
    import dataclasses

    return {f.name: getattr(ctx, f.name) for f in dataclasses.fields(ctx)}  # type: ignore[arg-type]


def _same(a: object, b: object) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return bool(a == b) and type(a) is type(b)


@pytest.mark.parametrize("op", ["layer_norm", "add_rms_norm", "modality_layer_norm", "scale_norm"])
def test_a_planned_call_gives_the_context_of_the_full_path(op: str, backend: Any) -> None:
    # the plan's Context and the backend's ctx are built from what the first call kept (the dispatcher's plan, the
    # backend's setup): every field must be what the first call, through the full checks, gave
    from pynorm import _registry
    from pynorm.ops import SPECS

    served = _registry.get_backend(backend.name)
    if (served.array_module, served.array_type) != ("numpy", "ndarray"):
        pytest.skip(f"plans are kept for numpy.ndarray calls only; {backend.name}'s arrays take the full path")
    spec = SPECS[op]
    rng = np.random.default_rng(5)
    x = rng.standard_normal((6, 8)).astype(np.float32)
    inputs = {"residual": rng.standard_normal((6, 8)).astype(np.float32), "modality_ids": np.arange(6) % 2}
    params = {"weight": rng.standard_normal((2, 8) if op.startswith("modality") else 8).astype(np.float32)}
    if op == "scale_norm":
        params = {"g": np.array([1.5], np.float32)}
    if op == "add_rms_norm":
        params["weight"] = params["weight"].reshape(8)
    fwd = getattr(pynorm, f"{op}_forward")
    args = [inputs[n] for n in spec.input_names]
    _dispatch._PLANS.clear()
    full = fwd(x, *args, **params, backend=backend.name)
    planned = fwd(x, *args, **params, backend=backend.name)
    (y1, c1), (y2, c2) = planned, full
    for a, b in zip(y1 if isinstance(y1, tuple) else (y1,), y2 if isinstance(y2, tuple) else (y2,), strict=True):
        assert np.array_equal(a, b)
    outer1, outer2 = _fields(c1), _fields(c2)
    inner1, inner2 = _fields(outer1.pop("inner")), _fields(outer2.pop("inner"))
    for k in outer1:
        assert _same(outer1[k], outer2[k]), k
    assert inner1.keys() == inner2.keys()
    for k in inner1:
        assert _same(inner1[k], inner2[k]), (k, inner1[k], inner2[k])


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "modality_rms_norm", "scale_norm", "dyt", "power_norm"])
def test_numba_planned_calls_run_the_row_kernel_they_typed_once(op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # a plan runs numba's statistics and element-wise forwards through a runner (forward_for, a PlanForward): the
    # setup and the row kernel's compiled entry point found by its first call. Calls whose arrays numba types
    # apart -- an unaligned array, another dtype, a read-only x -- have keys (and runners) of their own and must
    # give the full path's bits, never run a kernel typed for other arrays
    pytest.importorskip("numba")
    from pynorm.backends.numba import _threads
    from pynorm.backends.numba._common import PlanForward
    from pynorm.backends.numba._threads import EntryMemo

    monkeypatch.setattr(_threads, "SERIAL_THRESHOLD", 1 << 17)  # (the suite's default puts every call on the pool)

    fn = getattr(pynorm, f"{op}_forward")
    rng = np.random.default_rng(6)
    h = 8

    def args(dtype: Any, x: np.ndarray) -> tuple[Any, ...]:
        if op == "modality_rms_norm":
            return (x, np.arange(4) % 2, rng.standard_normal((2, h)).astype(dtype))
        if op == "scale_norm":
            return (x, np.array([1.5], dtype))
        if op == "dyt":
            wb = rng.standard_normal((2, h)).astype(dtype)
            return (x, np.array([0.7], dtype), wb[0], wb[1])
        return (x, rng.standard_normal(h).astype(dtype))

    for dtype in (np.float32, np.float16):  # (another dtype: its own key and runner)
        x = rng.standard_normal((4, h)).astype(dtype)
        a = args(dtype, x)
        _dispatch._PLANS.clear()
        first = fn(*a, backend="numba")[0]
        runners = [t for p in _dispatch._PLANS.values() for t in p.targets.values() if isinstance(t, PlanForward)]
        assert len(runners) == 1 and isinstance(runners[0].entry, EntryMemo)
        assert runners[0].entry.entry is not None  # (found by the first call)
        again = fn(*a, backend="numba")[0]
        assert np.array_equal(first, again, equal_nan=True) and first.dtype == again.dtype
        # the same values in an unaligned buffer (numba types it apart, and so does the plan's key), twice (the
        # second call through its own plan's runner)
        raw = bytearray(x.nbytes + 1)
        xu = np.ndarray(x.shape, x.dtype, buffer=raw, offset=1)
        xu[...] = x
        if xu.flags.aligned:  # (a 1-byte offset always misaligns a 2-byte or wider dtype)
            pytest.fail("expected an unaligned array")
        for _ in range(2):
            assert np.array_equal(fn(xu, *a[1:], backend="numba")[0], first, equal_nan=True)
        ro = x.copy()
        ro.flags.writeable = False
        assert np.array_equal(fn(ro, *a[1:], backend="numba")[0], first, equal_nan=True)
        assert np.array_equal(fn(ro, *a[1:], backend="numba")[0], first, equal_nan=True)
        assert len(_dispatch._PLANS) == 3  # (aligned, unaligned, read-only)
        # and the full path gives the same bits
        _dispatch._PLANS.clear()
        assert np.array_equal(fn(*a, backend="numba")[0], first, equal_nan=True)


@pytest.mark.parametrize(
    ("op", "variants"),
    [
        ("layer_norm", [{}, {"eps": 0.5}, {"eps_mode": "std"}, {"correction": 1}, {"weight_offset": 1.0}]),
        ("rms_norm", [{}, {"eps": 0.25}, {"weight_offset": 1.0}]),
        ("add_layer_norm", [{}, {"alpha": 2.0}, {"eps": 0.5}]),
        ("power_norm", [{}, {"p": 0.3}]),  # (each p class compiles kernels of its own: test_backends)
        ("group_norm", [{"num_groups": 2}, {"num_groups": 4}, {"num_groups": 2, "eps": 0.5}]),  # (the table source)
    ],
)
def test_numba_backward_setup_is_kept_per_ctx_options_and_dtypes(op: str, variants: list[dict[str, Any]]) -> None:
    # StatsOp._backward_setup (and ElementwiseOp's, ChannelOp's) keeps what a backward reads of the ctx's options and
    # dtypes (and ChannelOp's, the shape), and _setup what a forward reads of its options and dtypes: a
    # ctx whose options or dtypes differ must never run with another's (each backward equals the one with an empty
    # memo)
    pytest.importorskip("numba")
    from pynorm import _registry

    impl = _registry.op_module("numba", op)
    impl = getattr(impl, "impl", impl)
    fwd, bwd = getattr(pynorm, f"{op}_forward"), getattr(pynorm, f"{op}_backward")
    rng = np.random.default_rng(11)
    for dtype in (np.float32, np.float64, np.float16):
        x = rng.standard_normal((5, 8)).astype(dtype)
        w = rng.standard_normal(8).astype(dtype)
        dy = rng.standard_normal((5, 8)).astype(dtype)
        extra = (x[::-1].copy(),) if op == "add_layer_norm" else ()
        ctxs = [fwd(x, *extra, w, backend="numba", **v)[1] for v in variants]
        ys = []
        for v in variants:  # (and the forward's setup, kept per options and dtypes likewise where it is kept)
            getattr(impl, "_setups", {}).clear()
            ys.append(fwd(x, *extra, w, backend="numba", **v)[0])
        for v, want_y in zip(variants, ys, strict=True):
            got_y = fwd(x, *extra, w, backend="numba", **v)[0]
            for g, e in zip(got_y if extra else (got_y,), want_y if extra else (want_y,), strict=True):
                assert g.dtype == e.dtype and np.array_equal(g, e, equal_nan=True), v
        fresh = []
        for c in ctxs:
            impl._backward_setups.clear()
            fresh.append(bwd(dy, c))
        for _ in range(2):  # (every ctx after the others, with the memo they filled)
            for c, want in zip(ctxs, fresh, strict=True):
                got = bwd(dy, c)
                for g, e in zip(got, want, strict=True):
                    assert (g is None) == (e is None)
                    if g is not None:
                        assert g.dtype == e.dtype and np.array_equal(g, e, equal_nan=True)
        assert 0 < len(impl._backward_setups) <= len(variants) * 3
        # and the options did change the gradients (the check above could not pass by all being equal; in float16
        # eps_mode="std" with eps=1e-5 rounds to the same bits)
        for other in fresh[1:] if dtype != np.float16 else ():
            assert any(
                g is not None and not np.array_equal(g, e, equal_nan=True) for g, e in zip(other, fresh[0], strict=True)
            )


def test_numba_channel_setup_keeps_the_row_ids_of_small_batches_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # ChannelOp keeps the table source's row ids (and a backward's partials layout) in its setup for up to
    # stats._KEPT_IDS rows, and makes them per call above: both give the same bits
    pytest.importorskip("numba")
    from pynorm import _registry
    from pynorm.backends.numba import stats

    impl = _registry.op_module("numba", "group_norm")
    impl = getattr(impl, "impl", impl)
    rng = np.random.default_rng(5)
    x, dy = (rng.standard_normal((6, 16, 3)).astype(np.float32) for _ in range(2))
    w, b = (rng.standard_normal(16).astype(np.float32) for _ in range(2))

    def run() -> tuple[Any, ...]:
        impl._setups.clear()
        impl._backward_setups.clear()
        _dispatch._PLANS.clear()  # (a plan keeps the setup its first call found: ChannelOp.forward_for)
        y, ctx = pynorm.group_norm_forward(x, w, b, num_groups=4, backend="numba")
        st = next(iter(impl._setups.values()))
        return (y, *pynorm.group_norm_backward(dy, ctx)), st

    kept, st = run()
    assert st.table and st.ids is not None
    monkeypatch.setattr(stats, "_KEPT_IDS", 0)
    fresh, st = run()
    assert st.table and st.ids is None
    for a, e in zip(kept, fresh, strict=True):
        assert a.dtype == e.dtype and np.array_equal(a, e)
    want = pynorm.group_norm_forward(x, w, b, num_groups=4, backend="numpy")[0]
    np.testing.assert_allclose(kept[0], want, rtol=1e-5, atol=1e-5)
    # the setups kept keep no array of a call alive (a backward's is made from its ctx)
    import weakref

    impl._setups.clear()
    impl._backward_setups.clear()
    _dispatch._PLANS.clear()
    x2, w2, dy2 = (a.copy() for a in (x, w, dy))
    y2, ctx2 = pynorm.group_norm_forward(x2, w2, b, num_groups=4, backend="numba")
    grads2 = pynorm.group_norm_backward(dy2, ctx2)
    assert impl._setups and impl._backward_setups
    refs = [weakref.ref(a) for a in (x2, w2, dy2)]
    del x2, w2, dy2, y2, ctx2, grads2
    assert all(r() is None for r in refs)


@pytest.mark.parametrize(
    ("op", "opts"),
    [
        ("group_norm", {"num_groups": 2}),
        ("group_norm", {"num_groups": 4, "channel_axis": -1}),
        ("instance_norm", {}),
        ("batch_norm", {"training": True}),
        ("batch_norm", {"training": False, "channel_axis": -1}),
    ],
)
def test_a_channels_op_reuses_its_plan_with_the_full_paths_results(op: str, opts: dict[str, Any], backend: Any) -> None:
    # the "channels" layout keeps plans too (_ChannelPlan): the planned call's outputs, running statistics and
    # Context are the full path's; the running statistics' finiteness and out='s overlap are checked every call
    from pynorm import _registry

    served = _registry.get_backend(backend.name)
    if (served.array_module, served.array_type) != ("numpy", "ndarray"):
        pytest.skip(f"plans are kept for numpy.ndarray calls only; {backend.name}'s arrays take the full path")
    rng = np.random.default_rng(8)
    x = rng.standard_normal((3, 4, 5, 4)).astype(np.float32)
    c = x.shape[opts.get("channel_axis", 1)]
    w, b = rng.standard_normal(c).astype(np.float32), rng.standard_normal(c).astype(np.float32)
    run = {}
    if op == "batch_norm" or op == "instance_norm":
        run = {"running_mean": rng.standard_normal(c).astype(np.float32), "running_var": np.ones(c, np.float32)}
    fwd, bwd = getattr(pynorm, f"{op}_forward"), getattr(pynorm, f"{op}_backward")
    _dispatch._PLANS.clear()
    full = fwd(x, w, b, backend=backend.name, **run, **opts)
    assert len(_dispatch._PLANS) == 1
    for _ in range(2):
        planned = fwd(x, w, b, backend=backend.name, **run, **opts)
        assert len(_dispatch._PLANS) == 1
        (y1, c1), (y2, c2) = planned, full
        for a, e in zip(y1 if isinstance(y1, tuple) else (y1,), y2 if isinstance(y2, tuple) else (y2,), strict=True):
            assert a.dtype == e.dtype and np.array_equal(a, e)
        outer1, outer2 = _fields(c1), _fields(c2)
        inner1, inner2 = _fields(outer1.pop("inner")), _fields(outer2.pop("inner"))
        for k in outer1:
            assert _same(outer1[k], outer2[k]), k
        for k in inner1:
            assert _same(inner1[k], inner2[k]), (k, inner1[k], inner2[k])
        dy = rng.standard_normal(x.shape).astype(np.float32)
        for g1, g2 in zip(bwd(dy, c1), bwd(dy, c2), strict=True):
            assert np.array_equal(g1, g2)
    if run:  # a NaN running statistic in the planned call's arrays is still rejected
        bad = dict(run, running_mean=np.where(np.arange(c) == 1, np.nan, run["running_mean"]).astype(np.float32))
        with pytest.raises(ArgumentError, match="running_mean"):
            fwd(x, w, b, backend=backend.name, **bad, **opts)
    out = np.empty_like(x)  # out= through the plan of its own call shape, then an out= overlapping x
    y3 = fwd(x, w, b, backend=backend.name, out=out, **run, **opts)[0]
    y3 = y3[0] if isinstance(y3, tuple) else y3
    assert y3 is out and np.array_equal(out, full[0][0] if isinstance(full[0], tuple) else full[0])
    fwd(x, w, b, backend=backend.name, out=out, **run, **opts)
    with pytest.raises(ArgumentError, match="out"):
        fwd(x, w, b, backend=backend.name, out=x, **run, **opts)
    # the result alone (pynorm.<op>: on numba, GroupNorm's forward building no ctx) is the full path's, with out=
    call, want = getattr(pynorm, op), full[0]
    for _ in range(2):
        got = call(x, w, b, backend=backend.name, **run, **opts)
        for a, e in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,),
                        strict=True):  # fmt: skip
            assert a.dtype == e.dtype and np.array_equal(a, e)
        out2 = np.empty_like(x)
        got = call(x, w, b, backend=backend.name, out=out2, **run, **opts)
        assert (got[0] if isinstance(got, tuple) else got) is out2
        assert np.array_equal(out2, want[0] if isinstance(want, tuple) else want)
        with pytest.raises(ArgumentError, match="out"):
            call(x, w, b, backend=backend.name, out=x, **run, **opts)


# ---------------------------------------------------------------------------
# pynorm.plan: bound calls


def _outputs(r: Any) -> tuple[Any, ...]:
    if isinstance(r, pynorm.Quantized):  # (a named tuple)
        return tuple(np.asarray(a) for a in (r.codes, r.scales, r.global_scale, r.y) if a is not None)
    if isinstance(r, tuple):
        return tuple(a for o in r for a in _outputs(o))
    return (r,)


def _assert_same_result(got: Any, want: Any, what: str) -> None:
    g, w = _outputs(got), _outputs(want)
    assert len(g) == len(w), what
    for a, e in zip(g, w, strict=True):
        assert a.dtype == e.dtype and a.shape == e.shape and np.array_equal(a, e, equal_nan=True), what


def _grads_equal(g1: Any, g2: Any, what: str) -> None:
    assert type(g1) is type(g2), what
    for a, e in zip(g1, g2, strict=True):
        assert (a is None) == (e is None), what
        if a is not None:
            assert a.dtype == e.dtype and a.shape == e.shape and np.array_equal(a, e, equal_nan=True), what


@pytest.mark.parametrize("op", sorted(pynorm.list_ops()))
@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
def test_a_bound_plan_gives_the_ops_own_results(op: str, dt: str, backend: Any) -> None:
    """Every op: ``p(...)``, ``p.forward(...)`` and ``p.backward(...)`` are bitwise ``pynorm.<op>``'s, on three
    calls with new values each (a plan reads the values at each call), for two input shapes."""
    from pynorm import _registry

    from .helpers import CHANNEL_OPS, OPS, make_args
    from .helpers import dtype as dtype_of

    served = _registry.get_backend(backend.name)
    if (served.array_module, served.array_type) != ("numpy", "ndarray"):
        pytest.skip(f"pynorm.plan takes numpy.ndarray arrays; {backend.name} serves other arrays")
    if op not in _registry.backend_ops(backend.name):
        pytest.skip(f"{backend.name} does not serve {op}")
    spec = OPS.get(op) or CHANNEL_OPS[op]
    if dt not in spec.spec.x_dtypes:
        pytest.skip(f"{op} takes no {dt} x")
    rng = np.random.default_rng(11)
    fn, fwd, bwd = (getattr(pynorm, f"{op}{s}") for s in ("", "_forward", "_backward"))
    opts: dict[str, Any] = {"group_norm": {"num_groups": 2}, "batch_norm": {"training": True}}.get(op, {})
    for shape in ((3, 4, 16), (1, 8)) if spec.spec.layout == "rows" else ((2, 4, 3), (1, 4, 5, 2)):
        arrays = make_args(spec, shape, -1 if spec.spec.layout == "rows" else 1, dtype_of(dt), rng)
        names = (*spec.spec.input_names, *spec.spec.param_names)
        keyword = {i.name for i in spec.spec.inputs if i.keyword}
        args = [a for n, a in zip(names, arrays, strict=True) if n not in keyword]
        opts.update({n: a for n, a in zip(names, arrays, strict=True) if n in keyword})
        xdt = dtype_of(dt)
        x = (rng.standard_normal(shape) * 3).astype(xdt)
        p = pynorm.plan(op, x, *args, backend=backend.name, **opts)
        kw = {n: opts[n] for n in keyword}
        assert p.op == op and p.backend == backend.name
        for step in range(3):
            if step:  # new values, same kinds
                x = (rng.standard_normal(shape) * (step + 2)).astype(xdt)
                for a in (*args, *kw.values()):
                    if a is not None and a.dtype.kind == "f" and not a.flags.writeable:
                        continue
                    if a is not None and a.dtype.kind == "f":
                        a[...] = (rng.standard_normal(a.shape) + 1).astype(a.dtype)
            what = f"{op} {dt} {shape} step {step}"
            _assert_same_result(p(x, *args, **kw), fn(x, *args, backend=backend.name, **opts), what)
            got, ctx = p.forward(x, *args, **kw)
            want, wctx = fwd(x, *args, backend=backend.name, **opts)
            _assert_same_result(got, want, what)
            y = _outputs(want)[0]
            if op == "quant_layer_norm" or not np.issubdtype(y.dtype, np.floating):
                continue
            dy = rng.standard_normal(y.shape).astype(y.dtype)
            # (the ctx without its plan: the general path's gradients, against a plan's and the op's short one)
            general = bwd(dy, dataclasses.replace(wctx, plan=None))
            _grads_equal(p.backward(dy, ctx), general, what)
            _grads_equal(bwd(dy, wctx), general, what)


@pytest.mark.parametrize("shape", [(1, 4096), (4, 8), (2, 3, 64)])
def test_a_bound_plans_short_path_is_the_full_paths_bits(
    shape: tuple[int, ...], backend: Any, monkeypatch: pytest.MonkeyPatch
) -> None:  # fmt: skip
    """The plan's shortest call (numba: the serial row kernel called directly), also what a repeated
    ``pynorm.layer_norm`` call takes, gives the bits of the full path (``layer_norm_forward``'s, with its ctx) on
    ordinary rows, rows the slow path finishes (huge and tiny values), ``out=``, a parameter updated in place
    between calls, a 16-bit x."""
    if backend.name != "numba":
        pytest.skip("the short path is the numba backend's")
    from pynorm.backends.numba import _threads

    monkeypatch.setattr(_threads, "SERIAL_THRESHOLD", _threads.DEFAULT_SERIAL_THRESHOLD)  # (the tests' default: 0)
    rng = np.random.default_rng(12)
    for dt in (np.float32, np.float16):
        x = rng.standard_normal(shape).astype(dt)
        w = rng.standard_normal(shape[-1]).astype(dt)
        b = rng.standard_normal(shape[-1]).astype(dt)
        p = pynorm.plan("layer_norm", x, w, b, eps=1e-5)
        for step in range(4):
            x[...] = rng.standard_normal(shape).astype(dt)
            if step == 2:
                x[0] *= 3e3 if dt == np.float16 else 3e37  # a row the fast sums cannot hold: the slow path
                x.reshape(-1, shape[-1])[-1] *= 1e-7 if dt == np.float16 else 1e-40
            w *= dt(1.5)  # in place: the plan reads the values at each call
            want = pynorm.layer_norm_forward(x, w, b, eps=1e-5)[0]
            _assert_same_result(p(x, w, b), want, f"{dt} step {step}")
            _assert_same_result(pynorm.layer_norm(x, w, b, eps=1e-5), want, f"{dt} step {step} pynorm.layer_norm")
            out = np.empty_like(x)
            assert p(x, w, b, out=out) is out
            _assert_same_result(out, want, f"{dt} step {step} out")
            out2 = np.empty_like(x)
            assert pynorm.layer_norm(x, w, b, eps=1e-5, out=out2) is out2
            _assert_same_result(out2, want, f"{dt} step {step} pynorm.layer_norm out")
        assert p._calls is not None and p._calls.fast is not None  # (the short path was taken)
        assert bool(p._direct) == (len(shape) == 2)  # (by the plan's direct call where nothing needs reshaping)
        options = {**{o.name: o.default for o in SPECS["layer_norm"].options}, "eps": 1e-5}
        kept = _dispatch._PLANS[_dispatch._plan_key(SPECS["layer_norm"], x, (), (w, b), -1, None, None, options)]
        assert any(c.fast is not None for c in kept.calls.values())  # (and by pynorm.layer_norm's)
        assert any(c.direct for c in kept.calls.values()) == (len(shape) == 2)  # (with the arrays as they come)
    r = pynorm.plan("rms_norm", x, w)
    for _ in range(2):
        _assert_same_result(r(x, w), pynorm.rms_norm_forward(x, w)[0], "rms_norm")
        _assert_same_result(pynorm.rms_norm(x, w), pynorm.rms_norm_forward(x, w)[0], "rms_norm")
    for dt in (np.float32, np.float16):  # (an element-wise op: its own shortest call, a number for its scalars)
        x = rng.standard_normal(shape).astype(dt)
        w, b = (rng.standard_normal(shape[-1]).astype(dt) for _ in range(2))
        _dispatch._PLANS.clear()
        for step in range(4):
            x[...] = rng.standard_normal(shape).astype(dt)
            alpha = 0.5 + step  # (a new value each call: read at each call)
            for op, scalars in (("dyt", (alpha,)), ("derf", (alpha, 0.25 * step))):
                want = getattr(pynorm, f"{op}_forward")(x, *scalars, w, b)[0]
                _assert_same_result(getattr(pynorm, op)(x, *scalars, w, b), want, f"{op} {dt} step {step}")
                out = np.empty_like(x)
                assert getattr(pynorm, op)(x, *scalars, w, b, out=out) is out
                _assert_same_result(out, want, f"{op} {dt} step {step} out")
        # (each op with and without out=: a call shape each, each taking its shortest call)
        assert sum(c.fast is not None for pl in _dispatch._PLANS.values() for c in pl.calls.values()) == 4
    for dt in (np.float32, np.float16):  # (the residual prologue: y and h by the shortest call too)
        x, res = (rng.standard_normal(shape).astype(dt) for _ in range(2))
        w, b = (rng.standard_normal(shape[-1]).astype(dt) for _ in range(2))
        _dispatch._PLANS.clear()
        for step in range(4):
            x[...] = rng.standard_normal(shape).astype(dt)
            if step == 2:  # (a row the slow path finishes)
                x[0] *= 3e3 if dt == np.float16 else 3e37
            for op, params in (("add_rms_norm", (w,)), ("add_layer_norm", (w, b))):
                fwd, call = getattr(pynorm, f"{op}_forward"), getattr(pynorm, op)
                want = fwd(x, res, *params, alpha=0.5)[0]
                got = call(x, res, *params, alpha=0.5)
                assert isinstance(got, tuple) and len(got) == 2
                for g, v, name in zip(got, want, ("y", "h"), strict=True):
                    _assert_same_result(g, v, f"{op} {dt} step {step} {name}")
                out = np.empty_like(x)
                got = call(x, res, *params, alpha=0.5, out=out)
                assert got[0] is out
                _assert_same_result(out, want[0], f"{op} {dt} step {step} out")
                _assert_same_result(got[1], want[1], f"{op} {dt} step {step} out h")
        assert sum(c.fast is not None for pl in _dispatch._PLANS.values() for c in pl.calls.values()) == 4


def test_a_bound_plans_direct_call_checks_what_the_general_path_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Once a plan calls the backend's shortest call directly (numba), an array of another kind still gets the
    general path's error naming it, a value check still runs (DyT's finite ``alpha``; LayerNorm's rows that the
    slow path finishes give the full path's bits), and calls from several threads at once -- which share the
    plan's per-row scratch -- each get their own rows' result."""
    pytest.importorskip("numba")
    import threading

    from pynorm.backends.numba import _threads

    monkeypatch.setattr(_threads, "SERIAL_THRESHOLD", _threads.DEFAULT_SERIAL_THRESHOLD)
    rng = np.random.default_rng(15)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    w, b = (rng.standard_normal(64).astype(np.float32) for _ in range(2))
    p = pynorm.plan("layer_norm", x, w, b, backend="numba")
    for _ in range(2):
        p(x, w, b)
    assert p._direct
    with pytest.raises(pynorm.DTypeError, match="x: this layer_norm plan was made for a float32 array"):
        p(x.astype(np.float64), w, b)
    with pytest.raises(ShapeError, match=r"weight: .* got absent \(None\)"):
        p(x, None, b)
    with pytest.raises(ShapeError, match="read-only"):
        ro = x.copy()
        ro.flags.writeable = False
        p(ro, w, b)
    a = np.array([0.5], np.float32)
    d = pynorm.plan("dyt", x, a, backend="numba")
    for _ in range(2):
        d(x, a)
    assert d._direct
    with pytest.raises(ArgumentError, match="alpha must be finite"):
        d(x, np.array([np.inf], np.float32))
    xs = [rng.standard_normal((4, 64)).astype(np.float32) for _ in range(8)]
    xs[3][1] *= 3e37  # (a row the slow path finishes, reading the per-row scratch the kernel wrote)
    want = [pynorm.layer_norm_forward(v, w, b, backend="numba")[0] for v in xs]
    got: dict[int, list[Any]] = {}
    start = threading.Barrier(len(xs))

    def work(i: int) -> None:
        start.wait()
        got[i] = [p(xs[i], w, b) for _ in range(200)]

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(xs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, results in got.items():
        for r in results:
            _assert_same_result(r, want[i], f"thread {i}")
    assert len(got) == len(xs)


@pytest.mark.parametrize("op", ["layer_norm", "add_rms_norm"])
def test_the_short_backward_checks_what_the_general_path_checks(op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The backward of a ``dy`` of its ctx's own call shape goes straight to the backend's backward (the general
    path's checks are never entered), through a plan or the op's own function, with the general path's gradients
    (also for a ctx of another call of the plan's shape with other options); anything else -- ``dy`` of another
    shape or dtype, a ctx of another op, ``dx_out``, an upstream gradient -- takes the general path, whose errors
    name it."""
    pytest.importorskip("numba")
    rng = np.random.default_rng(21)
    shape = (2, 3, 64)
    x = rng.standard_normal(shape).astype(np.float32)
    w, b = (rng.standard_normal(64).astype(np.float32) for _ in range(2))
    res = rng.standard_normal(shape).astype(np.float32)
    args = (w, b) if op == "layer_norm" else (res, w)
    fwd, bwd = getattr(pynorm, f"{op}_forward"), getattr(pynorm, f"{op}_backward")
    p = pynorm.plan(op, x, *args, backend="numba")
    _, ctx = p.forward(x, *args)
    dy = rng.standard_normal(shape).astype(np.float32)
    want = bwd(dy, dataclasses.replace(ctx, plan=None))  # (a ctx without its plan: the general path)
    general = _dispatch.as_array  # (what the general path's checks call first)
    calls: list[Any] = []
    monkeypatch.setattr(_dispatch, "as_array", lambda *a: calls.append(a) or general(*a))
    _grads_equal(p.backward(dy, ctx), want, "short path, plan")
    _grads_equal(bwd(dy, ctx), want, "short path, op")
    assert callable(ctx.plan.backs["numba"]) and not calls
    _, other = fwd(x, *args, eps=1e-2, backend="numba")  # the plan's shape, another eps
    want_other = bwd(dy, dataclasses.replace(other, plan=None))
    calls.clear()
    _grads_equal(p.backward(dy, other), want_other, "another call's ctx")
    assert not calls
    dx = np.empty_like(x)
    _grads_equal(p.backward(dy, ctx, dx_out=dx), want, "dx_out")
    assert np.array_equal(dx, want[0]) and len(calls) == 1
    if op == "add_rms_norm":
        dh = rng.standard_normal(shape).astype(np.float32)
        _grads_equal(p.backward(dy, ctx, dh=dh), bwd(dy, ctx, dh=dh), "upstream dh")
    with pytest.raises(ShapeError, match=r"dy has shape \(6, 64\)"):
        p.backward(dy.reshape(6, 64), ctx)
    with pytest.raises(pynorm.DTypeError, match="dy has dtype float64"):
        p.backward(dy.astype(np.float64), ctx)
    _, small = fwd(x[:1], *((w, b) if op == "layer_norm" else (res[:1], w)), backend="numba")
    _grads_equal(p.backward(dy[:1], small), bwd(dy[:1], small), "another shape's ctx")
    _, rms = pynorm.rms_norm_forward(x, w, backend="numba")
    with pytest.raises(pynorm.ContextError, match=f"produced by rms_norm_forward and cannot be used by {op}_backward"):
        p.backward(dy, rms)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "add_rms_norm", "add_layer_norm"])
def test_numbas_kept_backward_is_the_general_backwards_bits(op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """numba's backward for a plan's ctxs (``StatsOp.backward_for``: the setup kept, outputs below the pool made
    directly, the fused kernel's entry point kept per layout of ``dy``) gives the general backward's bits, call
    after call: rows the slow path finishes among fast ones, ``dy`` contiguous, strided and read-only (each its own
    entry point), outputs from the pool (a larger call); the backend's general backward never runs."""
    pytest.importorskip("numba")
    from pynorm.backends.numba import _threads, stats

    monkeypatch.setattr(_threads, "SERIAL_THRESHOLD", _threads.DEFAULT_SERIAL_THRESHOLD)  # (the tests lower it)
    rng = np.random.default_rng(23)
    fwd, bwd = getattr(pynorm, f"{op}_forward"), getattr(pynorm, f"{op}_backward")
    for shape in ((2, 3, 64), (64, 512)):  # (the second's dx is above the pool's least size)
        h = shape[-1]
        x = rng.standard_normal(shape).astype(np.float32)
        x.reshape(-1, h)[1] *= np.float32(3e37)  # (a row the backward's slow path finishes)
        w, b = (rng.standard_normal(h).astype(np.float32) for _ in range(2))
        res = rng.standard_normal(shape).astype(np.float32)
        args = {"layer_norm": (w, b), "rms_norm": (w,), "add_rms_norm": (res, w), "add_layer_norm": (res, w, b)}[op]
        _, ctx = fwd(x, *args, backend="numba")
        wide = rng.standard_normal((*shape[:-1], 2 * h)).astype(np.float32)
        ro = rng.standard_normal(shape).astype(np.float32)
        ro.flags.writeable = False
        dys = [rng.standard_normal(shape).astype(np.float32), wide[..., ::2], ro]
        wants = [bwd(dy, dataclasses.replace(ctx, plan=None)) for dy in dys]
        general = stats.StatsOp.backward
        calls: list[Any] = []

        def spy(*a: Any, general: Any = general, calls: list[Any] = calls, **k: Any) -> Any:
            calls.append(a)
            return general(*a, **k)

        monkeypatch.setattr(stats.StatsOp, "backward", spy)
        for _ in range(3):
            for dy, want in zip(dys, wants, strict=True):
                _grads_equal(bwd(dy, ctx), want, f"{op} {shape} dy strides {dy.strides}")
        assert not calls, f"{op} {shape}: the general backward ran"
        monkeypatch.setattr(stats.StatsOp, "backward", general)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "add_rms_norm", "scale_norm", "dyt", "power_norm"])
def test_the_short_forward_with_a_ctx_is_the_general_paths(op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A forward with its ctx of a kept call shape (numba: the op's ``fast_forward(..., ctx=True)``, made by the
    plan's first call) gives the general path's result and ctx -- every field equal, the per-row statistics new
    arrays at each call -- and the same gradients, through a plan and the op's own function, call after call (a row
    the slow path finishes among them)."""
    pytest.importorskip("numba")
    from pynorm.backends.numba import _paths, _threads

    from .helpers import OPS, make_args

    monkeypatch.setattr(_threads, "SERIAL_THRESHOLD", _threads.DEFAULT_SERIAL_THRESHOLD)  # (the tests lower it)
    spec = OPS[op]
    rng = np.random.default_rng(31)
    shape = (2, 3, 64)
    arrays = make_args(spec, shape, -1, np.dtype(np.float32), rng)
    names = (*spec.spec.input_names, *spec.spec.param_names)
    keyword = {i.name for i in spec.spec.inputs if i.keyword}
    args = [a for n, a in zip(names, arrays, strict=True) if n not in keyword]
    kw = {n: a for n, a in zip(names, arrays, strict=True) if n in keyword}
    fwd, bwd = getattr(pynorm, f"{op}_forward"), getattr(pynorm, f"{op}_backward")
    x = rng.standard_normal(shape).astype(np.float32)
    p = pynorm.plan(op, x, *args, backend="numba", **kw)
    seen: list[Any] = []
    for step in range(4):
        x[...] = rng.standard_normal(shape).astype(np.float32) * (step + 1)
        if step == 2:
            x[0, 1] *= np.float32(3e37)
        with _paths.recording():  # (a recording sends every call down the general path)
            want, wctx = fwd(x, *args, backend="numba", **kw)
        dy = rng.standard_normal(_outputs(want)[0].shape).astype(np.float32)
        with _paths.recording():
            wgrads = bwd(dy, wctx)
        for how, (got, ctx) in (("plan", p.forward(x, *args, **kw)), ("op", fwd(x, *args, backend="numba", **kw))):
            what = f"{op} step {step} {how}"
            _assert_same_result(got, want, what)
            for f in dataclasses.fields(wctx.inner):
                a, e = getattr(ctx.inner, f.name), getattr(wctx.inner, f.name)
                if isinstance(e, np.ndarray):
                    assert isinstance(a, np.ndarray) and a.dtype == e.dtype and a.shape == e.shape, (what, f.name)
                    assert np.array_equal(a, e, equal_nan=True), (what, f.name)
                    if f.name in ("rstd", "mean"):  # (the ctx's own statistics, never another call's)
                        assert all(a is not b for b in seen), (what, f.name)
                        seen.append(a)
                else:
                    assert a == e or (a != a and e != e), (what, f.name)
            _grads_equal(bwd(dy, ctx), wgrads, what)
    assert any(getattr(t, "_short", None) for t in p._p.targets.values()), f"{op}: the short path was never made"


#: (op, shape, options, dtype, whether numba's lean table path serves it): GroupNorm of an (N, C) input (one
#: position per channel), of a few positions (the table source, S < 8), of many (the channel kernels), with the
#: channel axis last; InstanceNorm with running statistics, normalizing by the input's and by the running ones
_CHANNEL_CASES = [
    ("group_norm", (1, 1024), {"num_groups": 32}, "float32", True),
    ("group_norm", (4, 64, 3), {"num_groups": 8}, "bfloat16", True),
    ("group_norm", (2, 32, 4, 4), {"num_groups": 8}, "float32", False),
    ("group_norm", (2, 6, 16), {"num_groups": 4, "channel_axis": -1}, "float16", True),
    ("group_norm", (3, 64), {"num_groups": 8}, "float64", True),
    ("instance_norm", (2, 8, 3), {}, "float32", True),
    ("instance_norm", (2, 8, 3), {"use_input_stats": False}, "float32", False),
]


@pytest.mark.parametrize("case", _CHANNEL_CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[3]}-{sorted(c[2])}")
def test_the_channel_ops_short_backward_is_the_general_paths(case: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The backward of a channel op's ctx from a kept call shape (``_dispatch._short_backward_channels``; numba's
    ``ChannelOp.backward_for``: the setup and entry points kept, the table source's serial path past the
    decisions the shape answers) gives the general path's gradients bit for bit, call after call, through the op
    and a plan: ``dy`` contiguous, strided and read-only, a row the slow path finishes among fast ones (float32);
    the dispatcher's checks are never entered, numba's general backward never runs, and the lean path is taken
    where it serves the shape. A ``dx_out`` or a ``dy`` of another dtype takes the general path (its errors)."""
    pytest.importorskip("numba")
    from pynorm.backends.numba import _threads, stats

    from .helpers import dtype as dtype_of

    op, shape, opts, dt, lean = case
    monkeypatch.setattr(_threads, "SERIAL_THRESHOLD", _threads.DEFAULT_SERIAL_THRESHOLD)  # (the tests lower it)
    rng = np.random.default_rng(43)
    xdt = dtype_of(dt)
    ax = opts.get("channel_axis", 1) % len(shape)
    c = shape[ax]
    fwd, bwd = getattr(pynorm, f"{op}_forward"), getattr(pynorm, f"{op}_backward")
    x = rng.standard_normal(shape).astype(xdt)
    if xdt == np.float32:
        np.moveaxis(x, ax, 1)[0, :2] *= np.float32(3e37)  # (sample 0's first group: the backward's slow path)
    w, b = (rng.standard_normal(c).astype(xdt) for _ in range(2))
    run = {"running_mean": np.zeros(c, xdt), "running_var": np.ones(c, xdt)} if op == "instance_norm" else {}
    _, ctx = fwd(x, w, b, backend="numba", **run, **opts)
    p = pynorm.plan(op, x, w, b, backend="numba", **run, **opts)
    _, pctx = p.forward(x, w, b, **run)
    assert ctx.plan is not None and pctx.plan is not None
    wide = rng.standard_normal((*shape[:-1], 2 * shape[-1])).astype(xdt)
    ro = rng.standard_normal(shape).astype(xdt)
    ro.flags.writeable = False
    dys = [rng.standard_normal(shape).astype(xdt), wide[..., ::2], ro]
    wants = [bwd(dy, dataclasses.replace(ctx, plan=None)) for dy in dys]
    general, checks, fused = stats.ChannelOp.backward, _dispatch.as_array, stats.fused_serial
    calls: dict[str, int] = {"general": 0, "checks": 0, "lean": 0}

    def spy(name: str, f: Any) -> Any:
        def run(*a: Any, **k: Any) -> Any:
            calls[name] += 1
            return f(*a, **k)

        return run

    monkeypatch.setattr(stats.ChannelOp, "backward", spy("general", general))
    monkeypatch.setattr(_dispatch, "as_array", spy("checks", checks))
    monkeypatch.setattr(stats, "fused_serial", spy("lean", fused))
    for _ in range(3):
        for dy, want in zip(dys, wants, strict=True):
            what = f"{case} dy strides {dy.strides}"
            _grads_equal(bwd(dy, ctx), want, what)
            _grads_equal(p.backward(dy, pctx), want, what)
    assert calls["general"] == 0 and calls["checks"] == 0, calls
    assert (calls["lean"] > 0) == lean, calls
    monkeypatch.setattr(stats.ChannelOp, "backward", general)
    monkeypatch.setattr(_dispatch, "as_array", checks)
    out = np.full(shape, np.nan, xdt)
    got = bwd(dys[0], ctx, dx_out=out)
    assert got.dx is out
    _grads_equal(got, wants[0], f"{case} dx_out")
    other = np.float64 if xdt != np.float64 else np.float32
    with pytest.raises(pynorm.errors.DTypeError, match="dy has dtype"):
        bwd(dys[0].astype(other), ctx)


def test_a_ctx_pickles_and_copies_without_its_plan(backend: Any) -> None:
    """A ctx crosses processes (a Dask task's result is pickled) and ``copy.deepcopy``: the dispatcher's plan it
    carries (this process's runners and compiled kernels) stays behind, and the copy's backward -- the general
    path -- gives the same gradients."""
    import copy
    import pickle

    rng = np.random.default_rng(41)
    x = backend.asarray(rng.standard_normal((2, 3, 16)).astype(np.float32))
    w, b = (backend.asarray(rng.standard_normal(16).astype(np.float32)) for _ in range(2))
    dy = backend.asarray(rng.standard_normal((2, 3, 16)).astype(np.float32))
    _, ctx = pynorm.layer_norm_forward(x, w, b, backend=backend.name)
    want = pynorm.layer_norm_backward(dy, ctx)
    for other in (pickle.loads(pickle.dumps(ctx)), copy.deepcopy(ctx)):
        assert other.plan is None and other.x_shape == ctx.x_shape and other.op == "layer_norm"
        for a, e in zip(pynorm.layer_norm_backward(dy, other), want, strict=True):
            assert np.array_equal(backend.to_numpy(a), backend.to_numpy(e))


def test_a_bound_plan_takes_the_paths_forced_on_it() -> None:
    """A test switch of the numba paths (``_paths.forced``) sends a plan's calls down the general path, which
    takes the forced path: the switch reaches plans too."""
    pytest.importorskip("numba")
    from pynorm.backends.numba import _paths

    x = np.random.default_rng(13).standard_normal((4, 256)).astype(np.float32)
    p = pynorm.plan("layer_norm", x, backend="numba")
    want = p(x)
    p(x)
    with _paths.forced("split"), _paths.recording() as taken:
        got = p(x)
    assert "split" in taken and np.array_equal(got, want)
    with _paths.forced("slow"), _paths.recording() as taken:
        p(x)
    assert "slow" in taken


def test_a_bound_plan_rejects_arrays_of_another_kind() -> None:
    x = np.ones((4, 8), np.float32)
    w = np.ones(8, np.float32)
    p = pynorm.plan("layer_norm", x, w, backend="numpy")
    with pytest.raises(pynorm.DTypeError, match=r"x: this layer_norm plan was made for a float32 array of shape"):
        p(x.astype(np.float64), w)
    with pytest.raises(ShapeError, match=r"x: .* got a float32 array of shape \(3, 8\)"):
        p(x[:3], w)
    with pytest.raises(ShapeError, match=r"x: .*C-contiguous, got .*strides"):
        p(np.ones((8, 8), np.float32)[::2], w)
    with pytest.raises(ShapeError, match=r"weight: .* got absent \(None\)"):
        p(x)
    with pytest.raises(ShapeError, match=r"bias: this layer_norm plan was made for absent \(None\)"):
        p(x, w, w)
    with pytest.raises(pynorm.ArrayTypeError, match=r"x: .* got a builtins.list"):
        p(x.tolist(), w)
    ro = x.copy()
    ro.flags.writeable = False
    with pytest.raises(ShapeError, match="read-only"):
        p(ro, w)
    with pytest.raises(pynorm.ArrayTypeError, match="pynorm.plan takes numpy.ndarray arguments"):
        pynorm.plan("layer_norm", x.tolist())
    with pytest.raises(pynorm.ArrayTypeError, match="native byte order"):
        pynorm.plan("layer_norm", x.astype(">f4"))
    with pytest.raises(TypeError, match="takes no out="):
        pynorm.plan("layer_norm", x, out=x)
    with pytest.raises(TypeError, match="unexpected keyword argument 'epsilon'"):
        pynorm.plan("layer_norm", x, epsilon=1e-5)
    with pytest.raises(pynorm.UnknownOpError, match="unknown op 'layer_nrom'"):
        pynorm.plan("layer_nrom", x)
    with pytest.raises(ArgumentError, match="eps"):
        pynorm.plan("layer_norm", x, eps=-1.0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'gamma'"):
        p(x, gamma=w)


def test_a_bound_plan_checks_values_and_out_on_every_call() -> None:
    rng = np.random.default_rng(14)
    x = rng.standard_normal((6, 4)).astype(np.float32)
    w = np.ones((3, 4), np.float32)
    ids = np.array([0, 1, 2, 0, 1, 2])
    p = pynorm.plan("modality_layer_norm", x, ids, w)
    p(x, ids, w)
    p(x, modality_ids=ids, weight=w)  # by keyword, as the op's forward takes them
    bad = ids.copy()
    bad[3] = 7
    with pytest.raises(ArgumentError, match=r"modality_ids must hold values in \[0, 3\)"):
        p(x, bad, w)
    with pytest.raises(ArgumentError, match="out must not overlap"):
        p(x, ids, w, out=x)
    with pytest.raises(ShapeError, match="out"):
        p(x, ids, w, out=np.empty((6, 5), np.float32))
    a = np.array([0.5], np.float32)
    d = pynorm.plan("dyt", x, a)
    with pytest.raises(ArgumentError, match="alpha must be finite"):
        d(x, np.array([np.inf], np.float32))


def test_a_bound_plans_direct_call_takes_out_and_leaves_a_bad_one_to_the_checks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """A plan's direct call (numba's shortest, made by its first calls) takes ``out=`` too -- the same bits --
    and leaves every ``out`` it does not take to the general path, whose errors name it."""
    pytest.importorskip("numba")
    from pynorm.backends.numba import _threads

    monkeypatch.setattr(_threads, "SERIAL_THRESHOLD", _threads.DEFAULT_SERIAL_THRESHOLD)  # (the tests lower it)
    rng = np.random.default_rng(15)
    x = rng.standard_normal((6, 4)).astype(np.float32)
    w, b = rng.standard_normal(4).astype(np.float32), rng.standard_normal(4).astype(np.float32)
    ln = pynorm.plan("layer_norm", x, w, b, backend="numba")
    want = ln(x, w, b)
    ln(x, w, b)
    assert ln._direct
    good = np.empty_like(x)
    for _ in range(2):
        assert ln(x, w, b, out=good) is good and np.array_equal(good, want)
    raw = np.empty(x.nbytes + 1, np.uint8)
    unaligned = raw[1:].view(np.float32).reshape(x.shape)  # (not the direct call's: the general path's)
    assert not unaligned.flags.aligned
    assert ln(x, w, b, out=unaligned) is unaligned and np.array_equal(unaligned, want)
    ro = np.empty_like(x)
    ro.flags.writeable = False
    wide = np.empty((6, 8), np.float32)
    whole = np.empty((7, 4), np.float32)
    for bad, error, what in (
        (x, ArgumentError, "out must not overlap"),
        (whole[1:], ArgumentError, None),  # (overlaps no argument: taken)
        (np.empty((6, 5), np.float32), ShapeError, "out must have shape"),
        (np.empty((6, 4), np.float64), ShapeError, "out must have shape"),
        (ro, ArgumentError, "out must be writable"),
        (wide[:, ::2], ArgumentError, "out must be C-contiguous"),
    ):
        if what is None:
            assert ln(x, w, b, out=bad) is bad and np.array_equal(bad, want)
            continue
        with pytest.raises(error, match=what):
            ln(x, w, b, out=bad)
    xw = np.concatenate([x, np.zeros((1, 4), np.float32)])  # (out overlapping a parameter's memory)
    wv = xw[-1]
    wv[...] = w
    lw = pynorm.plan("layer_norm", x, wv, b, backend="numba")
    lw(x, wv, b)
    lw(x, wv, b)
    with pytest.raises(ArgumentError, match="out must not overlap"):
        lw(x, wv, b, out=xw[1:])


def test_an_unaligned_out_never_reaches_a_kept_entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    """numba's kept runners call the compiled entry point their plan's first call found, typed for an aligned
    output: an unaligned ``out`` (a view of a byte buffer at an odd offset) is left to the general path, through a
    plan (its call and its forward) and the op's own call, for the statistics, element-wise and channel ops -- the
    same bits as an aligned ``out``."""
    pytest.importorskip("numba")
    from pynorm.backends.numba import _common, _threads, elementwise, stats

    monkeypatch.setattr(_threads, "SERIAL_THRESHOLD", _threads.DEFAULT_SERIAL_THRESHOLD)  # (the tests lower it)
    rng = np.random.default_rng(17)
    x = rng.standard_normal((6, 8)).astype(np.float32)
    w, b = rng.standard_normal(8).astype(np.float32), rng.standard_normal(8).astype(np.float32)
    kept: list[bool] = []
    for cls in (stats.StatsOp, elementwise.ElementwiseOp):
        setup = cls.forward_setup

        def spy(self: Any, x: Any, args: Any, out: Any, sink: Any, options: Any, _f: Any = setup) -> Any:
            if out is not None and not out.flags.aligned:
                kept.append(isinstance(options, _common.PlanForward))
            return _f(self, x, args, out, sink, options)

        monkeypatch.setattr(cls, "forward_setup", spy)
    channel_forward = stats.ChannelOp._forward

    def channel_spy(self: Any, x: Any, args: Any, out: Any, options: Any, with_ctx: Any, held: Any = None) -> Any:
        if out is not None and not out.flags.aligned:
            kept.append(held is not None)
        return channel_forward(self, x, args, out, options, with_ctx, held)

    monkeypatch.setattr(stats.ChannelOp, "_forward", channel_spy)
    raw = np.empty(x.nbytes + 1, np.uint8)
    unaligned = raw[1:].view(np.float32).reshape(x.shape)
    assert not unaligned.flags.aligned
    for op, args, opts in (
        ("layer_norm", (w, b), {}),
        ("dyt", (np.array([0.5], np.float32), w, b), {}),
        ("group_norm", (w, b), {"num_groups": 2}),
    ):
        p = pynorm.plan(op, x, *args, backend="numba", **opts)
        want = p(x, *args)
        for _ in range(2):  # (the runners keep what their first calls find)
            p(x, *args), p.forward(x, *args), getattr(pynorm, op)(x, *args, backend="numba", **opts)
        for how in ("plan", "plan.forward", "op"):
            unaligned[...] = np.nan
            if how == "plan":
                got = p(x, *args, out=unaligned)
            elif how == "plan.forward":
                got = p.forward(x, *args, out=unaligned)[0]
            else:
                got = getattr(pynorm, op)(x, *args, backend="numba", out=unaligned, **opts)
            assert got is unaligned and np.array_equal(unaligned, want), (op, how)
    assert kept and not any(kept), kept


def test_a_bound_plan_keeps_its_backend_and_options() -> None:
    x = np.ones((2, 8), np.float32)
    with pynorm.use_backend("numpy"):
        p = pynorm.plan("rms_norm", x, eps=1e-3)
    assert p.backend == "numpy" and p.options["eps"] == 1e-3
    assert "rms_norm on numpy" in repr(p)
    assert np.array_equal(p(x), pynorm.rms_norm(x, eps=1e-3, backend="numpy"))


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "mxfp4", "nvfp4"])
def test_a_bound_plan_quantizes_as_the_op_does(fmt: str, backend: Any) -> None:
    """``quantize=`` bound in a plan: the op's own codes and scales (fused in the norm's output pass on numba, the
    second pass elsewhere), and the ctx says which."""
    from pynorm import _registry

    served = _registry.get_backend(backend.name)
    if (served.array_module, served.array_type) != ("numpy", "ndarray"):
        pytest.skip(f"pynorm.plan takes numpy.ndarray arrays; {backend.name} serves other arrays")
    rng = np.random.default_rng(15)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(64)).astype(np.float32)
    p = pynorm.plan("rms_norm", x, w, quantize=fmt, backend=backend.name)
    for _ in range(2):
        x[...] = rng.standard_normal((5, 64)).astype(np.float32)
        _assert_same_result(p(x, w), pynorm.rms_norm(x, w, quantize=fmt, backend=backend.name), fmt)
        q, ctx = p.forward(x, w)
        _assert_same_result(q, pynorm.rms_norm(x, w, quantize=fmt, backend=backend.name), fmt)
        assert ctx.served == (("quantize",) if backend.name == "numba" else ())


@pytest.mark.parametrize("shape", [(1, 1024), (4, 64, 3), (2, 32, 5, 5)])
def test_a_channel_ops_kept_runner_is_the_full_paths_bits(shape: tuple[int, ...], backend: Any) -> None:
    """GroupNorm's calls for the result alone through a kept plan's runner (numba: its setup and the row
    kernel's entry point kept, ``ChannelOp.lean_for``), by ``pynorm.group_norm`` and by a ``pynorm.plan``, give
    the full path's bits call after call: few positions per channel (the table source) and many, rows the slow
    path finishes, a read-only and a strided ``x`` (call shapes of their own), a parameter updated in place."""
    _numpy_arrays_only(backend)
    rng = np.random.default_rng(19)
    c = shape[1]
    x = rng.standard_normal(shape).astype(np.float32)
    w, b = rng.standard_normal(c).astype(np.float32), rng.standard_normal(c).astype(np.float32)
    strided = np.zeros((*shape[:-1], 2 * shape[-1]), np.float32)[..., ::2]
    p = pynorm.plan("group_norm", x, w, b, num_groups=8, backend=backend.name)
    for step in range(4):
        x[...] = rng.standard_normal(shape).astype(np.float32)
        if step == 2:
            x[0] *= 3e37  # (a sample whose groups the fast sums cannot hold: the slow path)
        w *= np.float32(1.25)
        want = pynorm.group_norm_forward(x, w, b, num_groups=8, backend=backend.name)[0]
        _assert_same_result(pynorm.group_norm(x, w, b, num_groups=8, backend=backend.name), want, f"step {step}")
        _assert_same_result(p(x, w, b), want, f"plan step {step}")
        ro = x.copy()
        ro.flags.writeable = False
        strided[...] = x
        for what, other in (("read-only", ro), ("strided", strided)):
            got = pynorm.group_norm(other, w, b, num_groups=8, backend=backend.name)
            _assert_same_result(got, want, f"step {step} {what}")
