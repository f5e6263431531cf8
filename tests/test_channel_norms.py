"""GroupNorm, InstanceNorm and BatchNorm: the ops of the ``"channels"`` layout (``x`` of ``(N, C, *spatial)``).

Gradients against float64 finite differences for every input and parameter (both BatchNorm modes, 1 to 3 spatial
dims, channels last), exactness on hard inputs against mpmath, the running statistics, the layers, bad input,
and PyTorch's ``F.group_norm`` / ``F.instance_norm`` / ``F.batch_norm`` where PyTorch is installed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import pynorm
import pynorm.layers as L
from pynorm.errors import ArgumentError, ShapeError
from pynorm.testing import check_grads

from .helpers import CHANNEL_OPS

#: (op, options, uses running statistics)
CASES = [
    ("group_norm", {"num_groups": 2}, False),
    ("group_norm", {"num_groups": 1, "eps": 0.1}, False),
    ("group_norm", {"num_groups": 4}, False),
    ("instance_norm", {}, False),
    ("instance_norm", {}, True),
    ("instance_norm", {"use_input_stats": False}, True),
    ("batch_norm", {"training": True}, False),
    ("batch_norm", {"training": True}, True),
    ("batch_norm", {"training": False}, True),
    ("batch_norm", {"training": True, "momentum": None, "num_batches_tracked": 2}, True),
]


def _skip_unless(backend: Any, op: str) -> None:
    if op not in backend.ops:
        pytest.skip(f"backend {backend.name!r} does not implement {op!r} (no fast kernels for it yet)")


def _running(c: int, dt: Any = np.float64) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {"running_mean": (0.3 * rng.standard_normal(c)).astype(dt), "running_var": (0.5 + rng.random(c)).astype(dt)}


def test_the_channel_ops_are_the_specs_of_that_layout() -> None:
    assert set(CHANNEL_OPS) == {"group_norm", "instance_norm", "batch_norm"}
    assert {n for n, b in pynorm.list_ops().items() if n in CHANNEL_OPS} == set(CHANNEL_OPS)


@pytest.mark.parametrize("op, options, running", CASES)
@pytest.mark.parametrize("shape", [(3, 4, 5), (2, 4, 3, 2), (2, 4, 2, 2, 2)], ids=["1d", "2d", "3d"])
def test_grads_match_finite_differences(backend: Any, op: str, options: dict, running: bool, shape: tuple) -> None:
    _skip_unless(backend, op)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape) * 2 + 0.5
    w, b = 1 + 0.5 * rng.standard_normal(4), 0.5 * rng.standard_normal(4)
    extra = _running(4) if running else {}
    fwd_f = getattr(pynorm, f"{op}_forward")
    bwd_f = getattr(pynorm, f"{op}_backward")

    def fwd(x_: Any, w_: Any, b_: Any) -> Any:
        run = {k: backend.asarray(v) for k, v in extra.items()}
        res, ctx = fwd_f(backend.asarray(x_), backend.asarray(w_), backend.asarray(b_), **run, backend=backend.name,
                         **options)  # fmt: skip
        return backend.to_numpy(res[0] if isinstance(res, tuple) else res), ctx

    def bwd(dy: Any, ctx: Any) -> list[Any]:
        return [backend.to_numpy(g) for g in bwd_f(backend.asarray(dy), ctx)]

    report = check_grads(fwd, bwd, [x, w, b], names=["x", "weight", "bias"], full_jacobian=True)
    assert report.passed, str(report)


@pytest.mark.parametrize("op, options", [("group_norm", {"num_groups": 2}), ("batch_norm", {"training": True}),
                                         ("instance_norm", {})])  # fmt: skip
def test_channels_last_is_the_same_numbers(backend: Any, op: str, options: dict) -> None:
    _skip_unless(backend, op)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((2, 4, 3, 5)).astype(np.float32)
    w, b = rng.standard_normal(4).astype(np.float32), rng.standard_normal(4).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    f, g = getattr(pynorm, f"{op}_forward"), getattr(pynorm, f"{op}_backward")
    y1, c1 = f(backend.asarray(x), backend.asarray(w), backend.asarray(b), backend=backend.name, **options)
    last = np.ascontiguousarray(np.moveaxis(x, 1, -1))
    y2, c2 = f(backend.asarray(last), backend.asarray(w), backend.asarray(b), channel_axis=-1, backend=backend.name,
               **options)  # fmt: skip
    np.testing.assert_array_equal(np.moveaxis(backend.to_numpy(y2), -1, 1), backend.to_numpy(y1))
    g1 = g(backend.asarray(dy), c1)
    g2 = g(backend.asarray(np.ascontiguousarray(np.moveaxis(dy, 1, -1))), c2)
    np.testing.assert_array_equal(np.moveaxis(backend.to_numpy(g2.dx), -1, 1), backend.to_numpy(g1.dx))
    np.testing.assert_array_equal(backend.to_numpy(g2.dweight), backend.to_numpy(g1.dweight))


@pytest.mark.parametrize(
    "op, options, shape",
    [
        ("group_norm", {"num_groups": 2}, (0, 4)),
        ("group_norm", {"num_groups": 2}, (0, 4, 3, 2)),
        ("group_norm", {"num_groups": 2, "channel_axis": -1}, (0, 3, 4)),
        ("instance_norm", {}, (0, 4, 3)),
        ("batch_norm", {"training": False}, (0, 4, 3)),
    ],
)
def test_an_empty_batch_gives_empty_results_and_zero_parameter_gradients(
    backend: Any, op: str, options: dict, shape: tuple
) -> None:  # fmt: skip
    """``N = 0``: an empty ``y`` and ``dx`` of ``x``'s shape, parameter gradients of zeros (an empty sum), on every
    backend and through the kept call shape (a second call)."""
    _skip_unless(backend, op)
    x = np.zeros(shape, np.float32)
    w, b = np.ones(4, np.float32), np.zeros(4, np.float32)
    extra = {k: backend.asarray(v) for k, v in _running(4, np.float32).items()} if op == "batch_norm" else {}
    f, g = getattr(pynorm, f"{op}_forward"), getattr(pynorm, f"{op}_backward")
    for _ in range(2):
        y, ctx = f(backend.asarray(x), backend.asarray(w), backend.asarray(b), backend=backend.name, **extra, **options)
        y = y[0] if isinstance(y, tuple) else y
        assert tuple(y.shape) == shape
        grads = g(backend.asarray(np.zeros(shape, np.float32)), ctx)
        assert tuple(grads.dx.shape) == shape
        for d in (grads.dweight, grads.dbias):
            assert np.array_equal(backend.to_numpy(d), np.zeros(4, np.float32))
        y2 = getattr(pynorm, op)(backend.asarray(x), backend.asarray(w), backend.asarray(b), backend=backend.name,
                                 **extra, **options)  # fmt: skip
        assert tuple((y2[0] if isinstance(y2, tuple) else y2).shape) == shape


def _exact_group_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, groups: int, eps: float) -> np.ndarray:
    import mpmath as mp

    mp.mp.dps = 50
    n, c = x.shape[:2]
    x3 = x.reshape(n, c, -1)
    y = np.empty(x3.shape)
    cg = c // groups
    for i in range(n):
        for g in range(groups):
            vals = [mp.mpf(float(v)) for v in x3[i, g * cg : (g + 1) * cg].ravel()]
            m = mp.fsum(vals) / len(vals)
            r = 1 / mp.sqrt(mp.fsum((v - m) ** 2 for v in vals) / len(vals) + mp.mpf(eps))
            for ch in range(g * cg, (g + 1) * cg):
                for s in range(x3.shape[2]):
                    y[i, ch, s] = float(
                        (mp.mpf(float(x3[i, ch, s])) - m) * r * mp.mpf(float(w[ch])) + mp.mpf(float(b[ch]))
                    )
    return y.reshape(x.shape)


@pytest.mark.parametrize("kind", ["offset", "constant", "one_element", "huge", "tiny"])
def test_the_reference_is_exact_to_one_rounding_on_hard_inputs(kind: str) -> None:
    rng = np.random.default_rng(2)
    shape = (2, 4, 3) if kind != "one_element" else (2, 4, 1)
    x = rng.standard_normal(shape)
    if kind == "offset":
        x = 1e4 + x
    elif kind == "constant":
        x = np.full(shape, 3.25)
    elif kind == "huge":
        x = x * 1e37
    elif kind == "tiny":
        x = x * 1e-30
    x = x.astype(np.float32)
    w, b = (1 + rng.standard_normal(4)).astype(np.float32), rng.standard_normal(4).astype(np.float32)
    groups = 4 if kind == "one_element" else 2
    y = pynorm.group_norm(x, w, b, num_groups=groups, backend="numpy")
    exact = _exact_group_norm(x, w, b, groups, 1e-5)
    np.testing.assert_array_equal(y, exact.astype(np.float32))  # one correct rounding of the exact value


def test_running_statistics_follow_pytorchs_rules() -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 3, 4, 4)) * 2 + 1
    run = _running(3)
    (_, rm, rv), _ = pynorm.batch_norm_forward(x, **run, training=True, momentum=0.25)
    vals = np.moveaxis(x, 1, 0).reshape(3, -1)
    np.testing.assert_allclose(rm, 0.75 * run["running_mean"] + 0.25 * vals.mean(axis=1), rtol=1e-14)
    np.testing.assert_allclose(rv, 0.75 * run["running_var"] + 0.25 * vals.var(axis=1, ddof=1), rtol=1e-14)
    # momentum=None: the cumulative average over num_batches_tracked + 1 batches
    (_, rm0, _), _ = pynorm.batch_norm_forward(x, **run, training=True, momentum=None, num_batches_tracked=3)
    np.testing.assert_allclose(rm0, (3 * run["running_mean"] + vals.mean(axis=1)) / 4, rtol=1e-14)
    # InstanceNorm: the batch means of each instance's mean and unbiased variance
    (_, im, iv), _ = pynorm.instance_norm_forward(x, **run, momentum=0.5)
    inst = x.reshape(5, 3, -1)
    np.testing.assert_allclose(im, 0.5 * run["running_mean"] + 0.5 * inst.mean(axis=2).mean(axis=0), rtol=1e-14)
    np.testing.assert_allclose(iv, 0.5 * run["running_var"] + 0.5 * inst.var(axis=2, ddof=1).mean(axis=0), rtol=1e-14)
    # evaluation: the running statistics, element-wise
    y_eval, ctx = pynorm.batch_norm_forward(x, **run, training=False)
    want = (x - run["running_mean"][:, None, None]) / np.sqrt(run["running_var"][:, None, None] + 1e-5)
    np.testing.assert_allclose(y_eval, want, rtol=1e-13, atol=1e-13)
    g = pynorm.batch_norm_backward(np.ones_like(x), ctx)
    np.testing.assert_allclose(g.dx, np.broadcast_to(1 / np.sqrt(run["running_var"][:, None, None] + 1e-5), x.shape))


def test_inputs_are_never_written() -> None:
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 3, 5)).astype(np.float32)
    run = _running(3, np.float32)
    before = {k: v.copy() for k, v in run.items()}
    xc = x.copy()
    pynorm.batch_norm_forward(x, **run, training=True)
    pynorm.instance_norm_forward(x, **run)
    assert all(np.array_equal(run[k], before[k]) for k in run) and np.array_equal(x, xc)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda x: pynorm.group_norm(x, num_groups=5), ShapeError, "num_groups=5 must divide the 6 channels"),
        (lambda x: pynorm.group_norm(x, np.ones(5), num_groups=3), ShapeError, r"weight has shape \(5,\)"),
        (lambda x: pynorm.group_norm(x), TypeError, "num_groups"),
        (lambda x: pynorm.group_norm(x, num_groups=0), ArgumentError, "num_groups must be a positive int"),
        (lambda x: pynorm.group_norm(x, num_groups=2, channel_axis=2), ArgumentError, "channel_axis must be 1"),
        (lambda x: pynorm.batch_norm(x[:1, :, :1], training=True), ShapeError, "more than 1 value per channel"),
        (lambda x: pynorm.batch_norm(x, training=True, momentum=1.5), ArgumentError, r"momentum must be .* \[0, 1\]"),
        (lambda x: pynorm.batch_norm(x, training=False), ArgumentError, "training=False normalizes with running"),
        (lambda x: pynorm.batch_norm(x, running_mean=np.zeros(6), training=True), ArgumentError, "go together"),
        (
            lambda x: pynorm.batch_norm(x, running_mean=np.full(6, np.nan), running_var=np.ones(6), training=False),
            ArgumentError,
            "running_mean must be finite",
        ),
        (
            lambda x: pynorm.batch_norm(x, running_mean=np.zeros(5), running_var=np.ones(5), training=False),
            ShapeError,
            r"running_mean has shape \(5,\)",
        ),
        (lambda x: pynorm.instance_norm(x, use_input_stats=False), ArgumentError, "use_input_stats=False"),
        (lambda x: pynorm.batch_norm(x.ravel(), training=True), ShapeError, "at least 2 dimensions"),
        (
            lambda x: pynorm.instance_norm(x[:0], running_mean=np.zeros(6), running_var=np.ones(6)),
            ShapeError,
            "needs at least one instance",
        ),
    ],
)
def test_bad_input_is_a_clear_error(call: Any, error: type, match: str) -> None:
    x = np.random.default_rng(5).standard_normal((3, 6, 4))
    with pytest.raises(error, match=match):
        call(x)


def test_batch_norm_layer_trains_and_evaluates() -> None:
    rng = np.random.default_rng(6)
    bn = L.BatchNorm(3, momentum=0.5)
    batches = [rng.standard_normal((8, 3, 4)) * (i + 1) + i for i in range(3)]
    for xb in batches:
        y, ctx = bn.forward(xb.astype(np.float32))
        bn.backward(np.ones_like(y), ctx)
    assert bn.num_batches_tracked == 3 and bn.grads["weight"].shape == (3,)
    expect = np.zeros(3)
    for xb in batches:
        expect = 0.5 * expect + 0.5 * np.moveaxis(xb, 1, 0).reshape(3, -1).mean(axis=1)
    np.testing.assert_allclose(bn.state["running_mean"], expect, rtol=1e-5)
    bn.eval()
    y, _ = bn.forward(batches[0].astype(np.float32))
    rm, rv = bn.state["running_mean"], bn.state["running_var"]
    want = (batches[0] - rm[:, None]) / np.sqrt(rv[:, None] + 1e-5)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
    assert bn.num_batches_tracked == 3  # evaluation leaves the statistics alone
    state = bn.state_dict()
    assert set(state) == {"weight", "bias", "running_mean", "running_var"}
    other = L.BatchNorm(3)
    other.load_state_dict(state)
    assert np.array_equal(other.state["running_var"], rv)
    cumulative = L.BatchNorm(3, momentum=None)
    for xb in batches:
        cumulative.forward(xb.astype(np.float32))
    means = [np.moveaxis(xb, 1, 0).reshape(3, -1).mean(axis=1) for xb in batches]
    np.testing.assert_allclose(cumulative.state["running_mean"], np.mean(means, axis=0), rtol=1e-5, atol=1e-6)


def test_instance_and_group_norm_layers() -> None:
    rng = np.random.default_rng(8)
    x = rng.standard_normal((2, 4, 6)).astype(np.float32)
    gn = L.GroupNorm(4, num_groups=2)
    y, ctx = gn(x)
    assert np.allclose(y.reshape(2, 2, -1).mean(axis=2), 0, atol=1e-6) and gn.backward(y, ctx).shape == x.shape
    inorm = L.InstanceNorm(4)
    assert inorm.params == {} and inorm.state == {}
    tracked = L.InstanceNorm(4, track_running_stats=True)
    tracked(x)
    assert not np.array_equal(tracked.state["running_mean"], np.zeros(4))
    tracked.eval()
    y_eval, _ = tracked(x)
    want = (x - tracked.state["running_mean"][:, None]) / np.sqrt(tracked.state["running_var"][:, None] + 1e-5)
    np.testing.assert_allclose(y_eval, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dt, tol", [(np.float64, 1e-12), (np.float32, 2e-6)])
@pytest.mark.parametrize("op", ["group_norm", "instance_norm", "batch_norm_train", "batch_norm_eval"])
def test_against_pytorch(op: str, dt: Any, tol: float) -> None:
    torch = pytest.importorskip("torch", reason="PyTorch is an optional test dependency (pip install torch==2.13.0)")
    tf = torch.nn.functional

    rng = np.random.default_rng(9)
    x = (rng.standard_normal((3, 6, 4, 5)) * 2 + 1).astype(dt)
    w, b = rng.standard_normal(6).astype(dt), rng.standard_normal(6).astype(dt)
    dy = rng.standard_normal(x.shape).astype(dt)
    run = _running(6, dt)
    xt, wt, bt = (torch.tensor(a, requires_grad=True) for a in (x, w, b))
    rmt, rvt = torch.tensor(run["running_mean"].copy()), torch.tensor(run["running_var"].copy())
    if op == "group_norm":
        yt = tf.group_norm(xt, 3, wt, bt, 1e-5)
        res, ctx = pynorm.group_norm_forward(x, w, b, num_groups=3)
    elif op == "instance_norm":
        yt = tf.instance_norm(xt, rmt, rvt, wt, bt, use_input_stats=True, momentum=0.1, eps=1e-5)
        res, ctx = pynorm.instance_norm_forward(x, w, b, **run)
    else:
        training = op.endswith("train")
        yt = tf.batch_norm(xt, rmt, rvt, wt, bt, training=training, momentum=0.1, eps=1e-5)
        res, ctx = pynorm.batch_norm_forward(x, w, b, **run, training=training)
    yt.backward(torch.tensor(dy))
    grads = getattr(pynorm, f"{ctx.op}_backward")(dy, ctx)
    y = res[0] if isinstance(res, tuple) else res
    for mine, theirs in ((y, yt), (grads.dx, xt.grad), (grads.dweight, wt.grad), (grads.dbias, bt.grad)):
        ref = theirs.detach().numpy()
        assert np.max(np.abs(mine - ref)) <= tol * max(1.0, float(np.max(np.abs(ref)))), op
    if isinstance(res, tuple):
        np.testing.assert_allclose(res[1], rmt.numpy(), rtol=tol, atol=tol)
        np.testing.assert_allclose(res[2], rvt.numpy(), rtol=tol, atol=tol)
