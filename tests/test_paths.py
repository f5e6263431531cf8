"""Batch-invariant rows and every launch path, for every rows-layout op on every backend under test.

The contract (``docs/numerics.md``, "Batch-invariant rows"): a row's outputs -- ``y`` and every other x-shaped
output, the ctx's per-row statistics, ``dx`` and the gradients of x-shaped inputs -- are bitwise the same whether
the row is computed alone, in a batch of any size, or at any position in it. On the ``numba`` backend the rows of
a batch are also recomputed under every launch path (:mod:`pynorm.backends.numba._paths`, forced at small sizes):
whichever path a batch size selects, the bits are the plain path's (the slow path, float64 arithmetic for rows the
fast sums cannot hold, is checked against the reference instead); and a path that no call of an op takes is a
failure naming the op and the path. On the CUDA backend each launch choice (the backward fused or split, a row's
overflow in shared or global memory) is forced in turn and the batch-invariance check repeated under it.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import numpy as np
import pytest

from tests.helpers import BACKEND_RTOL, OPS, assert_bitwise, assert_close_scaled, dtype, make_args

#: (rows, hidden) of the batches, per backend: narrow rows, a ragged row block (more than the fused backward's row
#: blocks), and rows of several chunks; the CUDA harness runs every thread of a block on the CPU, hence fewer
SHAPES = {
    "numpy": [(37, 24), (5, 2100)],
    "numba": [(37, 24), (133, 40), (5, 2100)],
    "cupy": [(37, 24), (5, 1100)],
}
#: (offset, rows) of the sub-batches recomputed: a row alone at the start and in the middle, three rows, a ragged
#: part; ``None`` rows: to the end
SUBSETS = [(0, 1), (4, 1), (2, 3), (3, None)]

#: ops whose rows are batch-invariant only to rounding, not bitwise, and why (a known gap of the contract, stated in
#: docs/numerics.md): the fused norm + Linear's product ``n @ W.T`` (and its backward's ``dy @ W``) runs on the array
#: module's matmul (BLAS), whose per-row sums are blocked by the batch's shape (float32: 1-4 ulps measured); the
#: norm itself is batch-invariant (``layer_norm``/``rms_norm`` above)
BLAS_PRODUCT = {"layer_norm_linear", "rms_norm_linear"}


def _split(spec: Any, rows: int, args: list[Any]) -> tuple[list[Any], list[bool]]:
    """The call's arguments after ``x``, and for each whether it is per row (sliced with ``x``)."""
    per_row = [i.kind in ("like_x", "row_index", "cond", "row_scale") for i in spec.spec.inputs]
    per_row += [False] * len(spec.spec.params)
    return args, [
        pr and a is not None and np.ndim(a) >= 1 and np.shape(a)[0] == rows for a, pr in zip(args, per_row, strict=True)
    ]


def _per_row(spec: Any, backend: Any, x: Any, args: list[Any], dy: Any, ups: dict[str, Any]) -> dict[str, Any]:
    """Every per-row result of a forward and backward of ``x`` (numpy arrays by name)."""
    fwd = spec.spec.generic_forward()
    outs, ctx = fwd(backend.asarray(x), *[None if a is None else backend.asarray(a) for a in args],
                    backend=backend.name)  # fmt: skip
    outs = outs if isinstance(outs, tuple) else (outs,)
    got = {name: backend.to_numpy(o) for name, o in zip(spec.spec.outputs, outs, strict=False)}
    params = set(spec.spec.param_names)
    for f in dataclasses.fields(ctx):
        v = getattr(ctx, f.name)
        if f.name not in params and hasattr(v, "shape") and len(v.shape) >= 1 and v.shape[0] == x.shape[0]:
            got[f"ctx.{f.name}"] = backend.to_numpy(v)
    grads = spec.backward(backend.asarray(dy), ctx, **{k: backend.asarray(v) for k, v in ups.items()})
    n_in = 1 + sum(1 for i in spec.spec.inputs if i.kind == "like_x")
    like_x = ["x", *(i.name for i in spec.spec.inputs if i.kind == "like_x")]
    for name, g in zip(like_x, list(grads)[:n_in], strict=True):
        got[f"d{name}"] = backend.to_numpy(g)
    return got


def _data(spec: Any, shape: tuple[int, int], dt: Any, seed: int) -> tuple[Any, list[Any], Any, dict[str, Any]]:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 2 + 0.5).astype(dt)
    x[min(2, shape[0] - 1)] = x[min(2, shape[0] - 1), 0]  # a constant row
    args = make_args(spec, shape, -1, dt, rng)
    out_shape = shape if spec.name not in ("layer_norm_linear", "rms_norm_linear") else None
    if out_shape is None:
        y, _ = spec.spec.generic_forward()(x, *args, backend="numpy")
        out_shape = np.shape(y[0] if isinstance(y, tuple) else y)
    dy = rng.standard_normal(out_shape).astype(dt)
    ups = {f"d{o}": rng.standard_normal(shape).astype(dt) for o in spec.spec.outputs[1:] if o == "h"}
    if spec.name in ("layer_norm_linear", "rms_norm_linear"):
        ups = {}
    return x, args, dy, ups


def _rows(d: dict[str, Any], lo: int, hi: int) -> dict[str, Any]:
    return {k: v[lo:hi] for k, v in d.items()}


def _assert_same(got: dict[str, Any], want: dict[str, Any], what: str, op: str = "") -> None:
    assert set(got) == set(want), f"{what}: outputs {sorted(got)} vs {sorted(want)}"
    for k in want:
        if op in BLAS_PRODUCT and k in ("y", "dx"):
            w = np.asarray(want[k])
            scale = np.max(np.abs(w.astype(np.float64)), axis=-1, keepdims=True)
            assert_close_scaled(got[k], w, scale, BACKEND_RTOL[dtype_name(w.dtype)],
                                what=f"{what}, {k} (BLAS product: to rounding)")  # fmt: skip
        else:
            assert_bitwise(got[k], want[k], f"{what}, {k}")


def dtype_name(dt: Any) -> str:
    return "bfloat16" if np.dtype(dt).name == "bfloat16" else np.dtype(dt).name


def _subset_args(args: list[Any], per_row: list[bool], lo: int, hi: int) -> list[Any]:
    return [a[lo:hi] if pr else a for a, pr in zip(args, per_row, strict=True)]


ROW_OPS = sorted(OPS)


@pytest.mark.parametrize("dt", ["float32", "float16"])
@pytest.mark.parametrize("op", ROW_OPS)
def test_rows_do_not_depend_on_the_batch(backend: Any, op: str, dt: str) -> None:
    if backend.name == "cupy" and dt != "float32" and os.environ.get("PYNORM_CUDA_CPU") == "1":
        pytest.skip("the CUDA execution harness checks float32 rows only (CI time); float16 rows run on a GPU")
    spec = OPS[op]
    for shape in SHAPES.get(backend.name, SHAPES["numpy"]):
        _assert_rows_alone_are_the_batchs(spec, backend, shape, dtype(dt), shape[1], f"{op} on {backend.name}, {dt}")


def _assert_rows_alone_are_the_batchs(
    spec: Any, backend: Any, shape: tuple[int, int], dt: Any, seed: int, what: str
) -> None:
    """Every sub-batch of :data:`SUBSETS` gives bitwise the rows the whole batch gives."""
    x, args, dy, ups = _data(spec, shape, dt, seed=seed)
    args, per_row = _split(spec, shape[0], args)
    whole = _per_row(spec, backend, x, args, dy, ups)
    for lo, n in SUBSETS:
        hi = shape[0] if n is None else lo + n
        sub = _per_row(spec, backend, x[lo:hi], _subset_args(args, per_row, lo, hi), dy[lo:hi], _rows(ups, lo, hi))
        _assert_same(sub, _rows(whole, lo, hi), f"{what} {shape}: rows {lo}:{hi} alone", spec.name)


# ---------------------------------------------------------------------------
# the numba backend's launch paths


def _numba_paths() -> Any:
    pytest.importorskip("numba")
    from pynorm.backends.numba import _paths

    return _paths


def _numba_stats_ops() -> list[str]:
    from pynorm import _registry

    try:
        served = set(_registry.backend_ops("numba"))
    except Exception:  # pragma: no cover - numba's package absent
        served = set()
    # the statistics family's own ops: the composites (conditional norms, norm + Linear) run these ops' kernels and
    # paths, and their rows' batch invariance is tested above on every backend
    return [op for op in ROW_OPS if op in served and OPS[op].spec.family == "stats"]


#: the path sets a batch is recomputed under: each path of the statistics family alone, and the pairs that
#: combine (a split or row-tile backward writing streamed outputs, the slow path on either backward)
PATH_SETS = [
    ("serial",),
    ("pool", "fused"),
    ("pool", "rows"),
    ("split",),
    ("split", "rows"),
    ("stream", "fused"),
    ("stream", "rows"),
    ("split", "stream"),
    ("slow", "fused"),
    ("slow", "rows"),
]


def _make_backend(name: str) -> Any:
    """The test adapter of backend ``name`` (skipped, saying why, where it is unavailable)."""
    from pynorm import _registry
    from tests.conftest import _make

    if _registry.unavailable_reason(name):
        pytest.skip(f"backend {name!r} unavailable: {_registry.unavailable_reason(name)}")
    return _make(name)


@pytest.fixture
def numba_backend() -> Any:
    pytest.importorskip("numba")
    return _make_backend("numba")


@pytest.mark.parametrize("op", _numba_stats_ops())
def test_every_launch_path_gives_the_plain_bits(numba_backend: Any, op: str) -> None:
    """Each path forced at small sizes: bitwise the plain path's rows (the slow path: the reference's values), and
    every path of the family taken by some call of the op -- but the ones its statistic's record declines
    (:func:`_declined`), which no call may take."""
    paths = _numba_paths()
    from pynorm.backends.numba import _threads

    one_thread = _threads.get_num_threads() < 2
    spec = OPS[op]
    declined = _declined(op)
    taken: set[str] = set()
    # 16-bit rows: the split and slow paths; not for the modality ops, whose rows are layer_norm's and rms_norm's
    # statistics with a parameter table (their 16-bit paths are those ops'; each dtype compiles every path's kernels)
    dts = ["float32"] if op.startswith("modality_") else ["float32", "float16"]
    for dt in dts:
        for shape in [(37, 24), (5, 2100)]:
            x, args, dy, ups = _data(spec, shape, dtype(dt), seed=7 + shape[1])
            args, per_row = _split(spec, shape[0], args)
            with paths.forced("serial"):
                plain = _per_row(spec, numba_backend, x, args, dy, ups)
            ref = _per_row(spec, _reference(), x, args, dy, ups)
            for chosen in PATH_SETS:
                if dt == "float16" and "slow" not in chosen and "split" not in chosen:
                    continue  # (16-bit rows: the split and the slow path differ from the plain one; the rest does not)
                with paths.forced(*chosen), paths.recording() as seen:
                    lo, hi = 1, shape[0]  # a sub-batch: its rows at other positions than in the whole batch
                    got = _per_row(spec, numba_backend, x[lo:hi], _subset_args(args, per_row, lo, hi), dy[lo:hi],
                                   _rows(ups, lo, hi))  # fmt: skip
                taken |= seen
                what = f"{op} on numba, path {'+'.join(chosen)}, {dt} {shape}, rows {lo}:{hi}"
                missing = set(chosen) - seen - declined - ({"stream"} if dt != "float32" else set())  # (float32 out)
                if one_thread:
                    missing.discard("pool")  # (numba has one thread here: nothing to hand off)
                if spec.spec.family == "stats":
                    assert not missing, f"{what}: forced path(s) {sorted(missing)} not taken (took {sorted(seen)})"
                    assert not seen & declined, f"{what}: took {sorted(seen & declined)}, which its statistic declines"
                if "slow" in chosen:
                    _assert_reference(spec, got, _rows(ref, lo, hi), dt, x[lo:hi], what)
                else:
                    _assert_same(got, _rows(plain, lo, hi), what, op)
    if spec.spec.family == "stats":
        missing = set(paths.PATHS) - taken - declined - ({"pool"} if one_thread else set())
        assert not missing, f"{op}: no call took the numba path(s) {sorted(missing)} ({paths.PATHS})"


#: ops with a ``quantize=`` output (the FP quantize sink in the forward's body)
QUANTIZING = {"layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"}


def _assert_no_leak(what: str, calls: Any) -> None:
    """numba's allocation counts balance over two rounds of ``calls()`` (after one that compiles and warms)."""
    from numba.core.runtime import _nrt_python, rtsys

    was = _nrt_python.memsys_stats_enabled()
    _nrt_python.memsys_enable_stats()
    try:
        calls()
        before = rtsys.get_allocation_stats()
        calls()
        calls()
        after = rtsys.get_allocation_stats()
    finally:
        if not was:
            _nrt_python.memsys_disable_stats()
    held = (after.alloc - after.free) - (before.alloc - before.free)
    held_mi = (after.mi_alloc - after.mi_free) - (before.mi_alloc - before.mi_free)
    assert (held, held_mi) == (0, 0), f"{what} on numba: {held} buffers and {held_mi} memory-infos leaked in two rounds"


#: ops with a ``quantize=`` output (the FP quantize sink in the forward's body)
QUANTIZING = {"layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"}


@pytest.mark.parametrize("op", [op for op in ROW_OPS if op not in BLAS_PRODUCT])
def test_span_bodies_leak_nothing(numba_backend: Any, op: str) -> None:
    """The span bodies compiled without reference counting (``borrowed``: :func:`pynorm.backends.numba._cache.jit`)
    allocate nothing and keep no reference: numba's allocation counts balance over repeated calls of every op of
    the rows layout down every path (and through the quantize sink where the op has one) -- a body handed an array
    its callee allocated would leak it on every call."""
    import pynorm

    if op not in pynorm.list_ops() or "numba" not in pynorm.list_ops()[op]:
        pytest.skip(f"numba does not serve {op}")
    paths = _numba_paths()
    spec = OPS[op]
    cases = [((37, 24), ("serial",)), ((37, 24), ("pool", "fused"))]
    if spec.spec.family == "stats":
        cases += [((37, 24), ("pool", "rows")), ((5, 2100), ("split",)), ((37, 24), ("slow", "fused"))]

    def calls() -> None:
        for shape, chosen in cases:
            x, args, dy, ups = _data(spec, shape, np.float32, seed=5)
            with paths.forced(*chosen):
                _per_row(spec, numba_backend, x, args, dy, ups)
        if op in QUANTIZING:
            x, args, _, _ = _data(spec, (37, 64), np.float32, seed=6)
            for fmt in ("fp8_e4m3", "mxfp4"):
                getattr(pynorm, op)(x, *args, quantize=fmt, backend="numba")

    _assert_no_leak(op, calls)


def test_span_bodies_of_the_casting_policies_and_the_channel_ops_leak_nothing(numba_backend: Any) -> None:
    """As :func:`test_span_bodies_leak_nothing` for the casting policies' one-pass backward and the channel ops (the
    table and the channel source, and the given statistics of an InstanceNorm with ``use_input_stats=False``)."""
    import pynorm

    rng = np.random.default_rng(9)
    x = rng.standard_normal((37, 24)).astype(np.float32)
    w, b = (1 + 0.1 * rng.standard_normal(24)).astype(np.float32), rng.standard_normal(24).astype(np.float32)

    def calls() -> None:
        for policy in ("llama", "t5", "apex"):
            for op, args in (("layer_norm", (w, b)), ("rms_norm", (w,))):
                _, ctx = getattr(pynorm, f"{op}_forward")(x, *args, casting=policy, backend="numba")
                getattr(pynorm, f"{op}_backward")(x, ctx)
        for shape in ((3, 4, 5), (2, 4, 16)):
            xc = rng.standard_normal(shape).astype(np.float32)
            wc, bc = np.ones(4, np.float32), np.zeros(4, np.float32)
            _, ctx = pynorm.group_norm_forward(xc, wc, bc, num_groups=2, backend="numba")
            pynorm.group_norm_backward(xc, ctx)
            run = {"running_mean": np.zeros(4, np.float32), "running_var": np.ones(4, np.float32)}
            _, ctx = pynorm.instance_norm_forward(xc, wc, bc, **run, use_input_stats=False, backend="numba")
            pynorm.instance_norm_backward(xc, ctx)

    _assert_no_leak("casting policies and channel ops", calls)


def _declined(op: str) -> set[str]:
    """The numba paths the op's statistic declines: ``rows`` where its record does not claim the rows path
    (:attr:`pynorm.ops.families.Statistic.rows_path`: the fused path at every row count instead)."""
    from pynorm.ops.families import statistic_of

    spec = OPS[op].spec
    if spec.family != "stats":
        return set()
    return set() if statistic_of(spec).rows_path else {"rows"}


#: the channel ops' numba paths (GroupNorm, InstanceNorm: the statistics kernels with the channel source, or the table
#: source below ``TABLE_BELOW_S`` positions per channel): every path but ``split`` (a row is one sample's group,
#: never cut across threads); the channel source's backward is always the fused one (its partials per row and
#: channel), the table source's both
CHANNEL_PATH_SETS = [c for c in PATH_SETS if "split" not in c]


@pytest.mark.parametrize("op", ["group_norm", "instance_norm"])
def test_every_launch_path_of_the_channel_ops_gives_the_plain_bits(numba_backend: Any, op: str) -> None:
    """Each path forced on a sub-batch (samples 1 to N): per sample, ``y``, ``dx`` and the ctx's statistics bitwise
    the plain path's rows of the whole batch (the slow path: within the reference's tolerance), on both channel
    sources; and every path of :data:`CHANNEL_PATH_SETS` taken by some call."""
    import pynorm
    from pynorm.backends.numba import _threads
    from pynorm.backends.numba.stats import TABLE_BELOW_S

    paths = _numba_paths()
    fwd, bwd = getattr(pynorm, f"{op}_forward"), getattr(pynorm, f"{op}_backward")
    kw = {"num_groups": 4} if op == "group_norm" else {}
    rng = np.random.default_rng(17)
    taken: set[str] = set()

    def run(backend: str, x: Any, dy: Any, w: Any, b: Any) -> dict[str, Any]:
        y, ctx = fwd(x, w, b, backend=backend, **kw)
        dx = bwd(dy, ctx)[0]
        return {"y": y, "dx": dx, "mean": ctx.inner.mean, "rstd": ctx.inner.rstd}

    for s in (16, 2):  # (the channel source; the table source)
        assert (s < TABLE_BELOW_S) == (s == 2)
        x = (rng.standard_normal((6, 8, s)) * 2 + 0.5).astype(np.float32)
        x[3, :2] = 1.5  # (a constant group)
        dy = rng.standard_normal(x.shape).astype(np.float32)
        w, b = (rng.standard_normal(8).astype(np.float32) for _ in range(2))
        with paths.forced("serial"):
            plain = run("numba", x, dy, w, b)
        ref = run("numpy", x, dy, w, b)
        groups = len(plain["mean"]) // x.shape[0]
        for chosen in CHANNEL_PATH_SETS:
            with paths.forced(*chosen), paths.recording() as seen:
                got = run("numba", x[1:], dy[1:], w, b)
            taken |= seen
            what = f"{op} on numba, path {'+'.join(chosen)}, S = {s}, samples 1:"
            missing = set(chosen) - seen - ({"rows"} if s >= TABLE_BELOW_S else set())
            if _threads.get_num_threads() < 2:
                missing.discard("pool")
            assert not missing, f"{what}: forced path(s) {sorted(missing)} not taken (took {sorted(seen)})"
            for k in got:
                lo = groups if k in ("mean", "rstd") else 1  # (the statistics: one per sample's group)
                if "slow" in chosen:
                    want = np.asarray(ref[k][lo:], np.float64)
                    scale = np.max(np.abs(want).reshape(len(want), -1), axis=1).reshape(-1, *[1] * (want.ndim - 1))
                    assert_close_scaled(got[k], want, scale + 1e-30, BACKEND_RTOL["float32"] * 8, what=f"{what}, {k}")
                else:
                    assert_bitwise(got[k], plain[k][lo:], f"{what}, {k}")
    missing = set(paths.PATHS) - {"split"} - taken - ({"pool"} if _threads.get_num_threads() < 2 else set())
    assert not missing, f"{op}: no call took the numba path(s) {sorted(missing)}"


def _reference() -> Any:
    return _make_backend("numpy")


def _assert_reference(spec: Any, got: dict[str, Any], want: dict[str, Any], dt: str, x: Any, what: str) -> None:
    """``got`` within the fast backends' tolerance of the reference's ``want`` (relative to each row's scale)."""
    rtol = BACKEND_RTOL[dt]
    for k in want:
        w = np.asarray(want[k], np.float64)
        scale = np.max(np.abs(np.where(np.isfinite(w), w, 0)), axis=tuple(range(1, w.ndim)), keepdims=True) + 1e-30
        assert_close_scaled(got[k], want[k], scale, rtol * 8, what=f"{what}, {k} against the reference")


#: the CUDA backend's launch choices (``PYNORM_CUPY_<NAME>``, :func:`pynorm.backends.cupy._host.forced`) and their
#: values: the backward fused in registers or split across blocks, a forward row's overflow in shared or global memory
CUDA_PATHS = {"BACKWARD": ("fused", "split"), "OVERFLOW": ("smem", "global")}
_BOTH, _FORWARD = ("BACKWARD", "OVERFLOW"), ("OVERFLOW",)
#: the choices each op's calls make, for every op of the rows layout the CUDA backend serves: the statistics ops (and
#: the composites on them) both; those with a parameter table or a conditioning projection only the forward's
#: (their backward always splits across blocks); the element-wise ops none (one launch shape, no choice). What an
#: op's calls read is checked against this table (a new op needs its line here, a changed launch a changed line).
CUDA_CHOICES = {
    **dict.fromkeys(["add_layer_norm", "add_rms_norm", "layer_norm", "layer_norm_linear", "quant_layer_norm",
                     "rms_norm", "rms_norm_linear", "scale_norm"], _BOTH),
    **dict.fromkeys(["conditional_layer_norm", "conditional_rms_norm", "modality_layer_norm", "modality_rms_norm"],
                    _FORWARD),
    **dict.fromkeys(["derf", "dyt", "power_norm"], ()),
}  # fmt: skip
#: every (op, choice, value) cell: each forced, each op's rows recomputed under it
CUDA_CELLS = [(op, n, v) for op, names in sorted(CUDA_CHOICES.items()) for n in names for v in CUDA_PATHS[n]]


def _cuda_host(backend: Any) -> Any:
    if backend.name != "cupy":
        pytest.skip("the CUDA backend's launch paths")
    from pynorm.backends.cupy import _host

    return _host


@pytest.mark.parametrize(("op", "name", "value"), CUDA_CELLS, ids=lambda v: str(v))
def test_cuda_rows_do_not_depend_on_the_batch_on_each_forced_path(
    backend: Any, op: str, name: str, value: str, monkeypatch: pytest.MonkeyPatch
) -> None:  # fmt: skip
    """On each forced CUDA launch path of each op, a row's outputs are bitwise the same alone, in a sub-batch and in
    the whole batch (no reduction order may follow a grid shape chosen from the batch's rows), and the whole batch's
    within the fast backends' tolerance of the reference."""
    host = _cuda_host(backend)
    monkeypatch.setenv(f"PYNORM_CUPY_{name}", value)
    asked: list[Any] = []  # (the launches read the switch: the path is the forced one)
    real = host.forced
    monkeypatch.setattr(host, "forced", lambda n: asked.append((n, real(n))) or real(n))
    spec, shape, what = OPS[op], (37, 24), f"{op} on cupy, {name}={value}"
    _assert_rows_alone_are_the_batchs(spec, backend, shape, np.float32, 5, what)
    assert (name, value) in asked, f"{op}: no launch read PYNORM_CUPY_{name} (asked: {sorted(set(asked))})"
    x, args, dy, ups = _data(spec, shape, np.float32, seed=5)
    got, ref = _per_row(spec, backend, x, args, dy, ups), _per_row(spec, _reference(), x, args, dy, ups)
    keys = [k for k in ref if not k.startswith("ctx.")]  # (outputs and gradients; the ctx's fields are the backend's)
    _assert_reference(spec, {k: got[k] for k in keys}, {k: ref[k] for k in keys}, "float32", x, what)


def test_every_cuda_op_makes_the_launch_choices_of_the_table(backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each op of the rows layout the CUDA backend serves reads exactly the launch choices :data:`CUDA_CHOICES` gives
    it (so every (op, choice, value) cell is forced by the test above, and none is left out unseen)."""
    host = _cuda_host(backend)
    from pynorm import _registry

    served = sorted(op for op in _registry.backend_ops("cupy") if op in OPS)
    assert sorted(CUDA_CHOICES) == served, "CUDA_CHOICES in tests/test_paths.py must name every op cupy serves"
    real = host.forced
    for op in served:
        asked: set[str] = set()
        monkeypatch.setattr(host, "forced", lambda n, asked=asked: asked.add(n) or real(n))
        x, args, dy, ups = _data(OPS[op], (5, 24), np.float32, seed=1)
        _per_row(OPS[op], backend, x, args, dy, ups)
        assert asked == set(CUDA_CHOICES[op]), (
            f"{op}: its CUDA launches read the choices {sorted(asked)}, CUDA_CHOICES in tests/test_paths.py says "
            f"{sorted(CUDA_CHOICES[op])}"
        )


def test_forced_rejects_unknown_paths() -> None:
    paths = _numba_paths()
    with pytest.raises(ValueError, match="unknown path"), paths.forced("nope"):
        pass
    with pytest.raises(ValueError, match="not both"), paths.forced("fused", "rows"):
        pass


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
def test_wide_rows_at_the_real_thresholds(numba_backend: Any, op: str, real_thresholds: None) -> None:
    """No forcing: 64 rows of 65536 float32 elements (16 MiB: streaming stores, the pool) against 1, 3 and 32 of
    them (plain stores) -- the case a batch-dependent store path once broke; and 4 rows of 2^20 elements (the
    plain kernels on two threads) against 1 of them (fewer rows than threads: the split kernels, whose chunk sums
    are added in the plain kernels' order -- 1024 chunks a row)."""
    paths = _numba_paths()
    spec = OPS[op]
    for shape, subsets in [((64, 65536), [(0, 1), (63, 64), (5, 8), (32, 64)]), ((4, 1 << 20), [(2, 3)])]:
        x, args, dy, ups = _data(spec, shape, np.float32, seed=3)
        whole = _per_row(spec, numba_backend, x, args, dy, ups)
        for lo, hi in subsets:
            with paths.recording() as seen:
                sub = _per_row(spec, numba_backend, x[lo:hi], args, dy[lo:hi], ups)
            _assert_same(sub, _rows(whole, lo, hi), f"{op}, {shape} float32, rows {lo}:{hi} alone")
            if shape[1] == 1 << 20:
                assert "split" in seen, f"a row of 2^20 elements alone took {sorted(seen)}, not the split kernels"


def test_backward_path_by_shape(numba_backend: Any) -> None:
    """The backward's path at the real thresholds: inputs below the serial threshold (a call on one thread) take the
    fused path at every row count -- it measured 10-23 % faster than the rows path there -- and the rows path is
    left to fewer than :data:`~pynorm.backends.numba._layout.FUSED_MIN_ROWS` rows of more elements (a call the pool
    shares by rows)."""
    import pynorm
    from pynorm.backends.numba import _layout, _threads

    assert _layout.FUSED_MAX_SMALL == _threads.DEFAULT_SERIAL_THRESHOLD
    paths = _numba_paths()
    rng = np.random.default_rng(0)
    for shape, path in [((4, 4096), "fused"), ((100, 4096), "fused"), ((127, 8192), "fused"), ((96, 16384), "rows")]:
        x = rng.standard_normal(shape).astype(np.float32)
        _, ctx = pynorm.layer_norm_forward(x, np.ones(shape[1], np.float32), backend="numba")
        with paths.recording() as seen:
            pynorm.layer_norm_backward(x, ctx)
        assert path in seen, f"a {shape} backward took {sorted(seen)}, not the {path} path"
