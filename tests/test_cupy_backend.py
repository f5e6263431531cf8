"""The CuPy backend's kernels against the NumPy reference, on a CUDA device.

Calls the backend's op implementations directly on ``(R, H)`` arrays, for the statistics-family ops
with per-feature parameters and mean/rstd statistics (LayerNorm, RMSNorm: :data:`MATRIX_OPS`; every
other op runs on this backend through the backend-parametrized suite -- ``tests/test_backends.py``
with its long rows on each backward path, ``tests/test_gradients.py`` and ``tests/test_<op>.py``),
so every launch path is reached on purpose: hidden sizes 1, 3, odd
sizes, 65,536 and 262,144; one thread / a sub-warp / a warp / a block per row; the fused
and the split backward; forward items in registers, shared memory or re-read from L2;
vectorized and scalar (misaligned or odd-sized) rows; every dtype, mixed parameter dtypes
and every convention. Output buffers and CuPy's memory pool are filled with NaN before
each launch, so an element a kernel forgets to write shows up. Determinism: two runs
are bitwise equal.

Skipped as a whole (with the reason) when CuPy is missing or sees no device. With
``PYNORM_CUPY_TEST_SELFCHECK=1`` the module runs on the CPU with NumPy and the reference
in place of CuPy and the kernels: a check of this file's own logic, not of the backend.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import numpy as np
import pytest

from pynorm import ops

from .helpers import BACKEND_RTOL, DTYPES, assert_close_scaled, make_rows, term_scales
from .helpers import dtype as dtype_of

SELF_CHECK = os.environ.get("PYNORM_CUPY_TEST_SELFCHECK") == "1"
#: the ops this matrix models: per-feature parameters only, no extra inputs, saved rstd
MATRIX_OPS = tuple(
    name
    for name, spec in ops.SPECS.items()
    if spec.family == "stats" and not spec.inputs and all(p.kind == "feature" for p in spec.params)
)
REF = {name: importlib.import_module(ops.SPECS[name].reference) for name in MATRIX_OPS}

if SELF_CHECK:
    xp: Any = np
    IMPLS: Any = REF
else:
    try:
        import cupy
    except ImportError:
        pytest.skip("cupy is not installed (pip install 'pynorm[cupy]')", allow_module_level=True)
    try:
        _available = cupy.is_available()
    except Exception as exc:  # broken driver installs
        pytest.skip(f"cupy.is_available() raised {exc!r}", allow_module_level=True)
    if not _available:
        pytest.skip("cupy imports but sees no CUDA device (cupy.is_available() is False)", allow_module_level=True)
    xp = cupy
    from pynorm import _registry

    IMPLS = {name: _registry.op_module("cupy", name) for name in MATRIX_OPS}

pytestmark = pytest.mark.gpu

_UINT = {2: np.uint16, 4: np.uint32, 8: np.uint64}
#: op -> (its cupy implementation, its reference module)
_MODS = {name: (IMPLS[name], REF[name]) for name in MATRIX_OPS}
_PARAMS = {name: ops.SPECS[name].param_names for name in MATRIX_OPS}
#: every op's test cases (its spec's), with each option spelled out
#: each op's conventions as its backend modules take them (the options that reach a backend: not ``quantize``)
CONVENTIONS = {
    name: [
        {k: v for k, v in {**ops.SPECS[name].defaults(), **case}.items() if k in ops.SPECS[name].backend_options}
        for case in ops.SPECS[name].cases
    ]
    for name in MATRIX_OPS
}


# ---------------------------------------------------------------------------
# device helpers (bfloat16 travels through same-size integer views)


def to_dev(a: np.ndarray | None) -> Any:
    if a is None:
        return None
    a = np.ascontiguousarray(a)
    if SELF_CHECK:
        return a.copy()
    return xp.asarray(a.view(_UINT[a.itemsize])).view(a.dtype)


def to_host(a: Any) -> np.ndarray:
    if SELF_CHECK:
        return np.array(a)
    ints = xp.ascontiguousarray(a.view(_UINT[a.dtype.itemsize]))
    return xp.asnumpy(ints).view(a.dtype)


def nan_like(shape: tuple[int, ...], dt: Any) -> Any:
    """A C-contiguous device array of all-ones bits: NaN in every float dtype."""
    dt = np.dtype(dt)
    ints = xp.full(shape, np.iinfo(_UINT[dt.itemsize]).max, dtype=_UINT[dt.itemsize])
    return ints.view(dt)


@pytest.fixture(scope="module", autouse=True)
def compiled_kernels():
    """Compile every kernel module once, in parallel, before the first test (minutes saved on a GPU box). Not on
    the CPU execution harness: there each module is a host C++ build, and only those the tests use are needed
    (building every instantiation took 300 s of a CI run; NVRTC compiles them all in the kernels env)."""
    if not SELF_CHECK and getattr(xp, "_harness", None) is None:
        from pynorm.backends.cupy import _loader

        _loader.warm_up()


@pytest.fixture(autouse=True)
def poisoned_pool():
    """Fill freed memory of CuPy's pool with NaN bits, so allocations the kernels must fill start as NaN."""
    if not SELF_CHECK:
        pool = xp.get_default_memory_pool()
        pool.free_all_blocks()
        blocks = [xp.full(n, 0xFF, dtype=xp.uint8) for n in (1 << 20, 8 << 20, 64 << 20, 256 << 20)]
        xp.cuda.runtime.deviceSynchronize()
        del blocks
    yield
    if not SELF_CHECK:
        xp.cuda.runtime.deviceSynchronize()


@pytest.fixture
def path(monkeypatch):
    """Force a launch path: ``path("BACKWARD", "split")``, ``path("OVERFLOW", "global")``."""

    def set_(name: str, value: str | None) -> None:
        if value is None:
            monkeypatch.delenv(f"PYNORM_CUPY_{name}", raising=False)
        else:
            monkeypatch.setenv(f"PYNORM_CUPY_{name}", value)

    return set_


# ---------------------------------------------------------------------------
# running one case


def make_case(op, shape, dt, rng, kind="normal", param_dtypes=None, with_params=True):
    h = shape[1]
    x = make_rows(kind, shape, dt, rng)
    dy = rng.standard_normal(shape).astype(dtype_of(dt))
    params = {}
    for name in _PARAMS[op]:
        pdt = dtype_of((param_dtypes or {}).get(name, dt))
        base = 1.0 if name == "weight" else 0.0
        params[name] = (base + 0.5 * rng.standard_normal(h)).astype(pdt) if with_params else None
    return x, dy, params


def rtol_for(dt: str, h: int) -> float:
    r = BACKEND_RTOL[dt]
    if dt == "float32":  # float32 accumulation over long rows (the reference sums in float64)
        r = max(r, 2e-5 if h >= 16384 else 8e-6)
    return r


def run_backend(op, x, dy, params, conv, *, x_dev=None, dy_dev=None, poison=True):
    mod = _MODS[op][0]
    dev = {k: to_dev(v) for k, v in params.items()}
    xd = to_dev(x) if x_dev is None else x_dev
    out = nan_like(x.shape, x.dtype) if poison and not SELF_CHECK else None
    y, ctx = mod.forward(xd, *dev.values(), out=out, **conv)
    if out is not None:
        assert y is out
    dyd = to_dev(dy) if dy_dev is None else dy_dev
    dx_out = nan_like(x.shape, x.dtype) if poison and not SELF_CHECK else None
    grads = mod.backward(dyd, ctx, dx_out=dx_out)
    if dx_out is not None:
        assert grads[0] is dx_out
    return y, ctx, grads


def check_against_reference(op, x, dy, params, conv, got, *, rtol=None, what=""):
    y, ctx, grads = got
    ref_mod = _MODS[op][1]
    y_ref, ctx_ref = ref_mod.forward(x, *params.values(), **conv)
    g_ref = ref_mod.backward(dy, ctx_ref)
    dt = x.dtype.name
    h = x.shape[1]
    rt = rtol if rtol is not None else rtol_for(dt, h)
    present = {k: v for k, v in params.items() if v is not None}
    sc = term_scales(op, x, present, dy, conv)
    y_h = to_host(y)
    assert y_h.dtype == x.dtype and y_h.shape == x.shape
    assert_close(y_h, y_ref, sc["y"], rt, f"{what} {op} y")
    # saved statistics, in the accumulation dtype
    acc = np.float64 if any(a.dtype.itemsize == 8 for a in (x, *present.values())) else np.float32
    rstd = to_host(ctx.rstd)
    assert rstd.shape == (x.shape[0],)
    assert SELF_CHECK or rstd.dtype == acc
    acc_rtol = 1e-12 if acc == np.float64 else 4e-6
    finite = np.isfinite(ctx_ref.rstd.astype(np.float64))
    rr = ctx_ref.rstd.astype(np.float64)[finite]
    assert_close_scaled(rstd.astype(np.float64)[finite], rr, np.abs(rr), acc_rtol * 4, f"{what} rstd")
    if op == "layer_norm":
        mean = to_host(ctx.mean)
        assert SELF_CHECK or mean.dtype == acc
        xs = np.abs(x.astype(np.float64)).max(axis=1) if h else 0
        assert_close_scaled(mean, ctx_ref.mean.astype(np.float64), xs, acc_rtol, f"{what} mean")
    dx = to_host(grads[0])
    assert dx.dtype == x.dtype
    assert_close(dx, g_ref[0], sc["dx"], rt, f"{what} {op} dx")
    for name, ga, gr in zip(_PARAMS[op], grads[1:], g_ref[1:], strict=True):
        if params[name] is None:
            assert ga is None and gr is None
            continue
        g = to_host(ga)
        assert g.dtype == params[name].dtype and g.shape == (h,)
        r2 = max(rt, BACKEND_RTOL[params[name].dtype.name])
        assert_close(g, gr, sc["d" + name], r2 * 4, f"{what} d{name}")
    # finite where the reference is finite (the contract: finite input and eps > 0 give finite results)
    if np.isfinite(x.astype(np.float64)).all() and conv.get("eps", 1e-5) > 0:
        for name, a, e in (("y", y_h, y_ref), ("dx", dx, g_ref[0]), *zip(_PARAMS[op], grads[1:], g_ref[1:])):
            if a is None:
                continue
            a = to_host(a) if not isinstance(a, np.ndarray) else a
            ok = np.isfinite(a.astype(np.float64)) | ~np.isfinite(e.astype(np.float64))
            assert ok.all(), f"{what}: {name} is not finite where the reference is"


def assert_close(actual, expected, scale, rtol, what):
    """:func:`assert_close_scaled` on the elements the reference gets finite; elsewhere (e.g. a
    float16 gradient beyond 65504) the backend must overflow too, or land at the dtype's edge."""
    a = np.asarray(actual).astype(np.float64)
    e = np.asarray(expected).astype(np.float64)
    s = np.broadcast_to(np.asarray(scale, dtype=np.float64), e.shape)
    fin = np.isfinite(e)
    assert_close_scaled(a[fin], e[fin], s[fin], rtol, what, dtype=np.asarray(actual).dtype)
    if not fin.all():
        big = float(np.finfo(np.float16).max) / 2 if np.asarray(actual).dtype == np.float16 else 1e300
        nan_ok = np.isnan(e) & np.isnan(a)
        inf_ok = np.isinf(e) & ((a == e) | (np.abs(a) >= big))
        bad = ~fin & ~(nan_ok | inf_ok)
        assert not bad.any(), f"{what}: {int(bad.sum())} non-finite reference elements not matched: {a[bad][:5]}"


def _skip_invalid(op, shape, conv):
    if op == "layer_norm" and conv.get("correction", 0) == 1 and shape[1] == 1:
        pytest.skip("correction=1 needs H >= 2")


# ---------------------------------------------------------------------------
# the matrix: ops x dtypes x conventions x shapes

SMALL_SHAPES = [(3, 1), (5, 3), (17, 31), (9, 64), (8, 127), (33, 768), (6, 4097), (4, 8192)]
LARGE_SHAPES = [(3, 65536), (2, 262144), (2048, 64), (20000, 5), (1500, 1024)]


OP_CONVS = [(op, i) for op in sorted(CONVENTIONS) for i in range(len(CONVENTIONS[op]))]


@pytest.mark.parametrize("shape", SMALL_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize(("op", "conv_i"), OP_CONVS, ids=[f"{o}-{i}" for o, i in OP_CONVS])
def test_matches_reference_small(op, conv_i, dt, shape):
    conv = CONVENTIONS[op][conv_i]
    _skip_invalid(op, shape, conv)
    rng = np.random.default_rng(1000 + conv_i)
    x, dy, params = make_case(op, shape, dt, rng)
    check_against_reference(op, x, dy, params, conv, run_backend(op, x, dy, params, conv))


@pytest.mark.parametrize("shape", LARGE_SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("op", sorted(_MODS))
def test_matches_reference_large(op, dt, shape):
    conv = CONVENTIONS[op][0]
    rng = np.random.default_rng(7)
    x, dy, params = make_case(op, shape, dt, rng)
    check_against_reference(op, x, dy, params, conv, run_backend(op, x, dy, params, conv))


@pytest.mark.parametrize("kind", ["normal", "offset", "huge", "tiny", "constant"])
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("op", sorted(_MODS))
def test_hard_inputs(op, dt, kind):
    """Large common offsets, magnitudes near the dtype's max, tiny values, constant rows."""
    rng = np.random.default_rng(11)
    for shape in ((4, 1), (6, 3), (5, 257), (3, 4096), (2, 65536)):
        x, dy, params = make_case(op, shape, dt, rng, kind=kind)
        for conv in CONVENTIONS[op][:3]:
            if kind == "constant" and conv.get("eps_mode") == "std":
                continue  # std mode is not differentiable at s = 0: the reference picks one limit
            if op == "layer_norm" and conv.get("correction", 0) == 1 and shape[1] == 1:
                continue
            got = run_backend(op, x, dy, params, conv)
            check_against_reference(op, x, dy, params, conv, got, what=f"{kind} {shape} {conv}")


# ---------------------------------------------------------------------------
# launch paths


@pytest.mark.parametrize("shape", [(7, 3), (40, 100), (257, 1024), (65, 4096), (9, 8192)], ids=str)
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("op", sorted(_MODS))
def test_fused_and_split_backward_agree_with_reference(op, dt, shape, path):
    rng = np.random.default_rng(3)
    x, dy, params = make_case(op, shape, dt, rng)
    conv = CONVENTIONS[op][1]
    if not SELF_CHECK:
        from pynorm.backends.cupy import _launch

        acc = 8 if dt == "float64" else 4
        if _launch.backward_kind(shape[1], x.itemsize, acc) != "fused":
            pytest.skip("no fused backward for this size")
    results = {}
    for kind in ("fused", "split"):
        path("BACKWARD", kind)
        got = run_backend(op, x, dy, params, conv)
        check_against_reference(op, x, dy, params, conv, got, what=kind)
        results[kind] = got
    path("BACKWARD", None)


@pytest.mark.parametrize(("dt", "h"), [("bfloat16", 65536), ("float32", 65536), ("float16", 100000)])
@pytest.mark.parametrize("op", sorted(_MODS))
def test_forward_overflow_in_smem_or_global_is_bitwise_equal(op, dt, h, path):
    rng = np.random.default_rng(5)
    x, dy, params = make_case(op, (3, h), dt, rng)
    conv = CONVENTIONS[op][0]
    if not SELF_CHECK:
        from pynorm.backends.cupy import _host, _launch

        try:
            _launch.forward_config(3, h, x.itemsize, 4, False, _host.device_limits(), 64, 256, overflow="smem")
        except ValueError:
            pytest.skip("these row items do not fit this device's shared memory")
    ys = {}
    for where in ("smem", "global"):
        path("OVERFLOW", where)
        got = run_backend(op, x, dy, params, conv)
        check_against_reference(op, x, dy, params, conv, got, what=where)
        ys[where] = to_host(got[0]).view(_UINT[x.itemsize])
    path("OVERFLOW", None)
    np.testing.assert_array_equal(ys["smem"], ys["global"])


# (x dtype, parameter dtype, H): forward launches whose overflow buffer is exactly 48 KiB of dynamic
# shared memory (FWD_THREADS threads x 16-byte items), so static + dynamic is just over 48 KiB
EXACTLY_48K = [("float32", "float32", 20000), ("float32", "float16", 20000), ("float32", "float64", 16000),
               ("float16", "float16", 30000), ("float64", "float64", 10000)]  # fmt: skip


@pytest.mark.parametrize(("dt", "pdt", "h"), EXACTLY_48K, ids=lambda v: str(v))
@pytest.mark.parametrize("op", sorted(_MODS))
def test_forward_with_exactly_48_KiB_of_dynamic_shared_memory(op, dt, pdt, h, path):
    """Bug: the launcher opted into more than 48 KiB only when the *dynamic* size exceeded it, but the
    driver counts static plus dynamic shared memory. Fresh modules, so no earlier launch raised the
    kernel's limit (whether it failed used to depend on launch history)."""
    rng = np.random.default_rng(19)
    x, dy, params = make_case(op, (3, h), dt, rng, param_dtypes={"weight": pdt, "bias": pdt})
    conv = CONVENTIONS[op][0]
    if not SELF_CHECK:
        from pynorm.backends.cupy import _host, _launch, _loader

        acc = 8 if "float64" in (dt, pdt) else 4
        cfg = _launch.forward_config(3, h, x.itemsize, acc, True, _host.device_limits(), 64, 256)
        assert cfg.over_smem == 48 * 1024, cfg
        _loader.forget()
    path("OVERFLOW", "smem")
    check_against_reference(op, x, dy, params, conv, run_backend(op, x, dy, params, conv), what="48 KiB")


@pytest.mark.parametrize("eps_mode", ["var", "std"])
@pytest.mark.parametrize("h", [1, 2, 300])
@pytest.mark.parametrize("op", sorted(_MODS))
def test_zero_variance_rows_at_extreme_float64_magnitudes(op, h, eps_mode):
    """Bugs: for rows of zero variance (constant rows; every row when H = 1) the scaled rstd was formed
    from eps * s (std mode: 1 / (eps * s) overflowed for |x| above ~1.4e303, giving inf and NaN) or
    eps * s^2 (var mode: subnormal for |x| ~ 1e153..1e159, losing up to 19% of rstd). With zero
    variance rstd is 1/sqrt(eps) (std mode: 1/eps) exactly, at every magnitude."""
    if op == "rms_norm" and (eps_mode == "std" or h > 1):
        pytest.skip("RMSNorm has one eps mode; its zero-variance rows are rows of zeros (not extreme)")
    mags = [1e150, 1e153, 1e155, 1e158, 1e159, 1e200, 1.4e303, 1e305, 1.7e308, 1e-300, 1e-310]
    signs = np.where(np.arange(len(mags)) % 2 == 0, 1.0, -1.0)
    x = np.repeat((signs * np.array(mags))[:, None], h, axis=1)
    rng = np.random.default_rng(20)
    dy = rng.standard_normal(x.shape)
    params = {name: (1.0 if name == "weight" else 0.0) + 0.5 * rng.standard_normal(h) for name in _PARAMS[op]}
    conv = {"eps": 1e-5, "eps_mode": eps_mode} if op == "layer_norm" else {"eps": 1e-6}
    got = run_backend(op, x, dy, params, conv)
    exact = 1 / np.sqrt(conv["eps"]) if eps_mode == "var" else 1 / conv["eps"]
    if op == "layer_norm":  # rms_norm: x^2 / H is not 0 there; the general comparison covers it
        np.testing.assert_allclose(to_host(got[1].rstd), np.full(len(mags), exact), rtol=1e-15)
    check_against_reference(op, x, dy, params, conv, got, what=f"zero variance, {eps_mode}")


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("op", sorted(_MODS))
def test_non_contiguous_and_misaligned_inputs(op, dt):
    rng = np.random.default_rng(9)
    conv = CONVENTIONS[op][0]
    rows, h = 12, 256
    x, dy, params = make_case(op, (rows, h), dt, rng)
    xw = np.zeros((rows, 2 * h), dtype=x.dtype)
    xw[:, ::2] = x
    dyw = np.zeros((rows, 2 * h), dtype=x.dtype)
    dyw[:, ::2] = dy
    cases = {
        "strided": (to_dev(xw)[:, ::2], to_dev(dyw)[:, ::2]),
        "transposed": (to_dev(np.ascontiguousarray(x.T)).T, to_dev(np.ascontiguousarray(dy.T)).T),
    }
    # C-contiguous but one element off a 16-byte boundary: the scalar path
    flat = np.zeros(rows * h + 1, dtype=x.dtype)
    flat[1:] = x.ravel()
    flat_dy = np.zeros(rows * h + 1, dtype=x.dtype)
    flat_dy[1:] = dy.ravel()
    cases["misaligned"] = (to_dev(flat)[1:].reshape(rows, h), to_dev(flat_dy)[1:].reshape(rows, h))
    for name, (xd, dyd) in cases.items():
        before = to_host(xd).copy()
        got = run_backend(op, x, dy, params, conv, x_dev=xd, dy_dev=dyd)
        check_against_reference(op, x, dy, params, conv, got, what=name)
        np.testing.assert_array_equal(to_host(xd).view(_UINT[x.itemsize]), before.view(_UINT[x.itemsize]))


@pytest.mark.parametrize("op", sorted(_MODS))
def test_non_contiguous_and_broadcast_parameters(op):
    rng = np.random.default_rng(10)
    conv = CONVENTIONS[op][0]
    x, dy, params = make_case(op, (10, 96), "float32", rng)
    mod = _MODS[op][0]
    wide = {k: np.repeat(v, 2) for k, v in params.items()}  # every other element is the parameter
    dev = [to_dev(v)[::2] for v in wide.values()]
    y, ctx = mod.forward(to_dev(x), *dev, **conv)
    got = (y, ctx, mod.backward(to_dev(dy), ctx))
    check_against_reference(op, x, dy, params, conv, got, what="strided params")
    # a stride-0 weight (what the functional layer passes for a broadcast parameter)
    w = np.full(96, 1.25, np.float32)
    dev = [xp.broadcast_to(to_dev(np.array([1.25], np.float32)), (96,))] + [None] * (len(params) - 1)
    y, ctx = mod.forward(to_dev(x), *dev, **conv)
    p2 = {k: (w if k == "weight" else None) for k in params}
    check_against_reference(op, x, dy, p2, conv, (y, ctx, mod.backward(to_dev(dy), ctx)), what="broadcast")


MIXED = [
    ("bfloat16", {"weight": "float32", "bias": "float32"}),  # bf16 activations, fp32 parameters
    ("float16", {"weight": "float32", "bias": "float32"}),
    ("float16", {"weight": "float64", "bias": "float64"}),  # float64 accumulation: split backward only
    ("float32", {"weight": "float32", "bias": "float64"}),  # different parameter dtypes: cast first
    ("bfloat16", {"weight": "bfloat16", "bias": "float16"}),
    ("float64", {"weight": "bfloat16", "bias": "float32"}),
    ("float32", {"weight": "float16", "bias": "float16"}),
]


@pytest.mark.parametrize(("dt", "pdt"), MIXED, ids=lambda v: str(v))
@pytest.mark.parametrize("op", sorted(_MODS))
def test_mixed_parameter_dtypes(op, dt, pdt):
    rng = np.random.default_rng(12)
    for shape in ((5, 3), (30, 1000), (4, 20000)):
        x, dy, params = make_case(op, shape, dt, rng, param_dtypes=pdt)
        conv = CONVENTIONS[op][-1]
        check_against_reference(op, x, dy, params, conv, run_backend(op, x, dy, params, conv), what=str(shape))


@pytest.mark.parametrize("present", ["none", "weight", "bias"])
@pytest.mark.parametrize("dt", ["bfloat16", "float32"])
def test_layer_norm_without_some_parameters(dt, present):
    rng = np.random.default_rng(13)
    for shape in ((6, 5), (64, 512), (3, 20000)):
        x, dy, params = make_case("layer_norm", shape, dt, rng)
        params = {k: (v if k == present else None) for k, v in params.items()}
        conv = CONVENTIONS["layer_norm"][0]
        got = run_backend("layer_norm", x, dy, params, conv)
        check_against_reference("layer_norm", x, dy, params, conv, got, what=present)


def test_rms_norm_without_weight():
    rng = np.random.default_rng(14)
    for shape in ((6, 5), (64, 512), (3, 20000)):
        x, dy, params = make_case("rms_norm", shape, "float16", rng, with_params=False)
        conv = CONVENTIONS["rms_norm"][0]
        check_against_reference("rms_norm", x, dy, params, conv, run_backend("rms_norm", x, dy, params, conv))


@pytest.mark.parametrize("op", sorted(_MODS))
def test_zero_rows(op):
    rng = np.random.default_rng(15)
    x, dy, params = make_case(op, (0, 48), "bfloat16", rng)
    y, _, grads = run_backend(op, x, dy, params, CONVENTIONS[op][0], poison=False)
    assert y.shape == (0, 48) and grads[0].shape == (0, 48)
    for g in grads[1:]:
        assert g.shape == (48,) and not to_host(g).astype(np.float64).any()  # sums over no rows are 0


# ---------------------------------------------------------------------------
# determinism and input safety


@pytest.mark.parametrize("shape", [(4096, 96), (300, 4096), (64, 65536)], ids=str)
@pytest.mark.parametrize("dt", ["bfloat16", "float32", "float64"])
@pytest.mark.parametrize("op", sorted(_MODS))
def test_two_runs_are_bitwise_equal(op, dt, shape):
    rng = np.random.default_rng(16)
    x, dy, params = make_case(op, shape, dt, rng)
    conv = CONVENTIONS[op][0]

    def bits(got):
        y, ctx, grads = got
        arrays = [y, ctx.rstd, *(g for g in grads if g is not None)]
        if op == "layer_norm":
            arrays.append(ctx.mean)
        hosts = [to_host(a) for a in arrays]
        return [h.view(_UINT[h.itemsize]) if h.itemsize in _UINT else h for h in hosts]  # longdouble: values

    first = bits(run_backend(op, x, dy, params, conv))
    second = bits(run_backend(op, x, dy, params, conv))
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("op", sorted(_MODS))
def test_inputs_are_not_mutated_and_outputs_do_not_alias(op):
    rng = np.random.default_rng(17)
    x, dy, params = make_case(op, (33, 1000), "bfloat16", rng)
    xd, dyd = to_dev(x), to_dev(dy)
    pd = {k: to_dev(v) for k, v in params.items()}
    mod = _MODS[op][0]
    y, ctx = mod.forward(xd, *pd.values(), **CONVENTIONS[op][0])
    grads = mod.backward(dyd, ctx)
    np.testing.assert_array_equal(to_host(xd).view(np.uint16), x.view(np.uint16))
    np.testing.assert_array_equal(to_host(dyd).view(np.uint16), dy.view(np.uint16))
    for k, v in pd.items():
        np.testing.assert_array_equal(to_host(v).view(np.uint16), params[k].view(np.uint16))
    for out in (y, *grads):
        if out is None:
            continue
        for inp in (xd, dyd, *pd.values()):
            assert not xp.may_share_memory(out, inp)


# ---------------------------------------------------------------------------
# through the public API


@pytest.mark.skipif(SELF_CHECK, reason="needs the registry to pick the cupy backend")
def test_functional_api_dispatches_to_cupy():
    import pynorm

    rng = np.random.default_rng(18)
    x = rng.standard_normal((4, 5, 96)).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(96)).astype(np.float32)
    b = (0.1 * rng.standard_normal(96)).astype(np.float32)
    y, ctx = pynorm.layer_norm_forward(xp.asarray(x), xp.asarray(w), xp.asarray(b))
    assert ctx.backend == "cupy" and isinstance(y, xp.ndarray)
    y_ref = pynorm.layer_norm(x, w, b, backend="numpy")
    np.testing.assert_allclose(xp.asnumpy(y), y_ref, rtol=1e-5, atol=1e-5)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    g = pynorm.layer_norm_backward(xp.asarray(dy), ctx)
    g_ref = pynorm.layer_norm_backward(dy, pynorm.layer_norm_forward(x, w, b, backend="numpy")[1])
    for a, e in zip(g, g_ref, strict=True):
        np.testing.assert_allclose(xp.asnumpy(a), e, rtol=1e-4, atol=1e-4)
    y2, _ = pynorm.rms_norm_forward(xp.asarray(x), xp.asarray(w))
    np.testing.assert_allclose(xp.asnumpy(y2), pynorm.rms_norm(x, w, backend="numpy"), rtol=1e-5, atol=1e-5)
