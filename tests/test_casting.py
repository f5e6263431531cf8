"""The ``casting=`` policies of layer_norm and rms_norm (``pynorm/reference/casting.py``).

* the reference against an independent NumPy restatement of each policy's rounding sequence, written
  from the frameworks' code (float64 where they compute in float32 or wider, each cast an explicit
  ``astype``; ``"none"`` in NumPy's own float16/bfloat16 arithmetic), bitwise, forward and backward;
* the reference against the frameworks' code run literally in float32 (HF Llama/Gemma/T5, Apex): it
  agrees wherever float32 and float64 intermediate values round alike (>= 99% of the elements, the
  rest one ulp apart);
* every policy changes the result (so these tests fail if ``casting`` is ignored);
* each fast backend against the reference: the forward bitwise on >= 99% of the elements, and
  following the policy's rounding (closer to it than to ``"fp32"``), the gradients within the
  cross-backend tolerance;
* float64 gradient checks, bad values, and ``"none"`` refused by the fast backends.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import pynorm
from pynorm.errors import ArgumentError
from pynorm.testing import check_grads

from .helpers import BACKEND_RTOL, assert_close_scaled, dtype, term_scales

POLICIES = ("fp32", "gemma", "llama", "t5", "apex", "none")
F64 = np.float64


def _data(dt: str, rows: int = 24, h: int = 200, seed: int = 0, wdt: str | None = None) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    d, wd = dtype(dt), dtype(wdt or dt)
    return {
        "x": (1.5 * rng.standard_normal((rows, h)) + 0.5).astype(d),
        "w": (1 + 0.5 * rng.standard_normal(h)).astype(wd),
        "b": (0.5 * rng.standard_normal(h)).astype(wd),
        "dy": rng.standard_normal((rows, h)).astype(d),
    }


def _frac_equal(a: Any, b: Any) -> float:
    return float(np.mean(np.asarray(a, F64) == np.asarray(b, F64)))


# ---------------------------------------------------------------------------
# the restatements (no pynorm code): float64 math, explicit casts


def _stats64(x: np.ndarray, op: str, eps: float) -> tuple[np.ndarray, np.ndarray]:
    """``(xhat, r)`` in float64: two-pass mean and variance (LayerNorm) or mean square (RMSNorm)."""
    xf = x.astype(F64)
    if op == "layer_norm":
        d = xf - xf.mean(axis=1, keepdims=True)
        r = 1 / np.sqrt((d * d).mean(axis=1, keepdims=True) + eps)
        return d * r, r
    r = 1 / np.sqrt((xf * xf).mean(axis=1, keepdims=True) + eps)
    return xf * r, r


def _dx64(g: np.ndarray, xhat: np.ndarray, r: np.ndarray, op: str) -> np.ndarray:
    """The norm's input gradient in float64 for the gradient ``g`` at its normalized output."""
    c = (g * xhat).mean(axis=1, keepdims=True)
    if op == "layer_norm":
        return r * (g - g.mean(axis=1, keepdims=True) - xhat * c)
    return r * (g - xhat * c)


def restated(policy: str, op: str, x: Any, w: Any, b: Any, dy: Any, eps: float, offset: float) -> dict[str, Any]:
    """``y, dx, dweight, dbias`` of ``policy`` (b None for rms_norm), as the frameworks write it."""
    t, wt = x.dtype, w.dtype
    half_w = wt.itemsize == 2
    if policy == "none":
        return _restated_none(op, x, w, b, dy, eps, offset)
    xhat, r = _stats64(x, op, eps)
    dyf = dy.astype(F64)
    bf = 0.0 if b is None else b.astype(F64)
    if policy == "gemma":  # (1 + w.float()) in float32
        we = (w.astype(np.float32) + np.float32(offset)).astype(F64)
    elif policy in ("llama", "apex") or (policy == "t5" and half_w):  # (offset + W) in W's dtype
        we = (w.astype(F64) + offset).astype(wt).astype(F64)
    else:
        we = w.astype(F64) + offset
    qt = {"llama": t, "apex": t, "t5": wt if half_w else None}.get(policy)
    if qt is None:  # one rounding; the op's own backward
        y = (xhat * we + bf).astype(t)
        dx = _dx64(dyf * we, xhat, r, op).astype(t)
        dw = (dyf * xhat).sum(axis=0).astype(wt)
    else:
        q = xhat.astype(qt).astype(F64)
        y = (q * we + bf).astype(qt).astype(t)
        if policy == "t5":
            dyf = dyf.astype(qt).astype(F64)  # T5's output, hence its gradient, is in the weight's dtype
        if policy == "apex":  # Apex's backward recomputes xhat in float32: the op's own backward
            dx = _dx64(dyf * we, xhat, r, op).astype(t)
            dw = (dyf * xhat).sum(axis=0).astype(wt)
        else:  # autograd of w * q: the gradient at q is dy * w in q's dtype
            g = (dyf * we).astype(qt).astype(F64)
            dx = _dx64(g, xhat, r, op).astype(t)
            dw = (dyf * q).sum(axis=0).astype(wt)
    return {"y": y, "dx": dx, "dweight": dw, "dbias": None if b is None else dyf.sum(axis=0).astype(b.dtype)}


def _restated_none(op: str, x: Any, w: Any, b: Any, dy: Any, eps: float, offset: float) -> dict[str, Any]:
    """``casting="none"`` in NumPy's own arithmetic of x's dtype (each operation rounds to it); sums in
    float64, rounded once; ``1/sqrt`` as one operation (``torch.rsqrt``)."""
    t = x.dtype
    h = x.shape[1]

    def mean(a: np.ndarray, n: int) -> np.ndarray:
        return (a.astype(F64).sum(axis=1, keepdims=True) / n).astype(t)

    def rsqrt(a: np.ndarray) -> np.ndarray:
        return (1 / np.sqrt(a.astype(F64))).astype(t)

    we = (w.astype(F64) + offset).astype(t)
    e = np.asarray(eps).astype(t) if eps else np.zeros((), t)
    if op == "layer_norm":
        d = x - mean(x, h)
        r = rsqrt(mean(d * d, h) + e)
        xhat = d * r
        y = xhat * we + b.astype(t)
    else:
        r = rsqrt(mean(x * x, h) + e)
        xhat = x * r
        y = xhat * we
    g = dy * we
    c = mean(g * xhat, h)
    dx = r * (g - mean(g, h) - xhat * c) if op == "layer_norm" else r * (g - xhat * c)
    dw = (dy * xhat).astype(F64).sum(axis=0).astype(w.dtype)
    db = None if b is None else dy.astype(F64).sum(axis=0).astype(b.dtype)
    return {"y": y, "dx": dx, "dweight": dw, "dbias": db}


def _run(backend: str, policy: str, op: str, data: dict[str, Any], eps: float, offset: float) -> dict[str, Any]:
    params = (data["w"], data["b"]) if op == "layer_norm" else (data["w"],)
    fwd = getattr(pynorm, f"{op}_forward")
    y, ctx = fwd(data["x"], *params, eps=eps, weight_offset=offset, casting=policy, backend=backend)
    grads = getattr(pynorm, f"{op}_backward")(data["dy"], ctx)
    return {"y": y, "dx": grads.dx, "dweight": grads.dweight, "dbias": getattr(grads, "dbias", None)}


OPS = ("layer_norm", "rms_norm")


def _offset(policy: str) -> float:
    return 1.0 if policy == "gemma" else 0.0


# ---------------------------------------------------------------------------
# the reference


@pytest.mark.parametrize("dt", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("policy", POLICIES)
def test_reference_is_the_restated_sequence(policy: str, op: str, dt: str) -> None:
    data = _data(dt, wdt="float32" if policy == "gemma" else None)
    b = data["b"] if op == "layer_norm" else None
    eps, off = (1e-5 if op == "layer_norm" else 1e-6), _offset(policy)
    want = restated(policy, op, data["x"], data["w"], b, data["dy"], eps, off)
    got = _run("numpy", policy, op, data, eps, off)
    for name in ("y", "dx", "dweight", "dbias"):
        if want[name] is None:
            assert got[name] is None
            continue
        assert got[name].dtype == want[name].dtype, name
        # float64 statistics computed two ways round alike; "none" is exact arithmetic of x's dtype
        assert _frac_equal(got[name], want[name]) == 1.0, f"{policy} {op} {dt}: {name} differs"


@pytest.mark.parametrize("wdt", ["bfloat16", "float32"])
def test_t5_rounds_to_the_weights_dtype(wdt: str) -> None:
    """float32 activations: a bfloat16 weight rounds the normalized value (and y) to bfloat16; a float32
    weight does not round at all (T5 then equals "fp32")."""
    data = _data("float32", wdt=wdt)
    want = restated("t5", "rms_norm", data["x"], data["w"], None, data["dy"], 1e-6, 0.0)
    got = _run("numpy", "t5", "rms_norm", data, 1e-6, 0.0)
    for name in ("y", "dx", "dweight"):
        assert _frac_equal(got[name], want[name]) == 1.0, name
    fp32 = _run("numpy", "fp32", "rms_norm", data, 1e-6, 0.0)
    if wdt == "float32":
        assert _frac_equal(got["y"], fp32["y"]) == 1.0
    else:  # y carries bfloat16 precision only
        assert np.array_equal(got["y"].astype(dtype("bfloat16")).astype(np.float32), got["y"])
        assert _frac_equal(got["y"], fp32["y"]) < 0.1


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "fp32"])
def test_every_policy_changes_the_result(policy: str, op: str) -> None:
    dt = "float32" if policy == "gemma" else "float16"  # (1 + w) of a float16 weight is exact in float32
    data = _data(dt)
    got = _run("numpy", policy, op, data, 1e-5, _offset(policy))
    fp32 = _run("numpy", "fp32", op, data, 1e-5, _offset(policy))
    assert _frac_equal(got["y"], fp32["y"]) < 0.9
    if policy in ("llama", "t5", "none"):  # the backward follows the rounded q
        assert _frac_equal(got["dweight"], fp32["dweight"]) < 0.9


def _ulps(a: Any, b: Any, dt: np.dtype[Any], scale: Any = None) -> np.ndarray:
    from pynorm.testing import ulp_error

    return ulp_error(np.asarray(a), np.asarray(b, F64), dt, scale=scale)


@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
def test_reference_matches_hugging_face_in_float32(dt: str) -> None:
    """HF's modules run literally in float32 NumPy: LlamaRMSNorm, GemmaRMSNorm, T5LayerNorm (16-bit
    weight), and Apex's forward (q, then one fused multiply-add)."""
    data = _data(dt, rows=64, h=256)
    d = dtype(dt)
    x, w, b = data["x"], data["w"], data["b"]
    f32 = np.float32
    xf = x.astype(f32)
    r = 1 / np.sqrt((xf * xf).mean(axis=1, keepdims=True, dtype=f32) + f32(1e-6))
    hs = xf * r
    hf = {
        "llama": w * hs.astype(d),  # weight * hidden_states.to(input_dtype)
        "gemma": (hs * (f32(1) + w.astype(f32))).astype(d),  # (x * (1 + w.float())).type_as(x)
        "t5": w * hs.astype(w.dtype),  # weight * hidden_states.to(weight.dtype)
    }
    for policy, want in hf.items():
        got = pynorm.rms_norm(x, w, eps=1e-6, casting=policy, weight_offset=_offset(policy), backend="numpy")
        assert _frac_equal(got, want) >= 0.99, policy
        assert _ulps(got, want, d).max() <= 1, policy
    mu = xf.mean(axis=1, keepdims=True, dtype=f32)
    dev = xf - mu
    ra = 1 / np.sqrt((dev * dev).mean(axis=1, keepdims=True, dtype=f32) + f32(1e-5))
    q = (dev * ra).astype(d).astype(f32)
    apex = (w.astype(F64) * q + b.astype(F64)).astype(f32).astype(d)
    got = pynorm.layer_norm(x, w, b, casting="apex", backend="numpy")
    assert _frac_equal(got, apex) >= 0.99
    assert _ulps(got, apex, d, scale=np.abs(w.astype(F64) * q) + np.abs(b.astype(F64))).max() <= 1  # at the terms


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("policy", POLICIES)
def test_float64_gradients(policy: str, op: str, backend: Any) -> None:
    rng = np.random.default_rng(3)
    x = rng.standard_normal((3, 7)) + 0.3
    params = [1 + 0.3 * rng.standard_normal(7)] + ([0.2 * rng.standard_normal(7)] if op == "layer_norm" else [])
    names = ["x", "weight", *(["bias"] if op == "layer_norm" else [])]
    f = backend.forward(getattr(pynorm, f"{op}_forward"), casting=policy, weight_offset=_offset(policy))
    b = backend.backward(getattr(pynorm, f"{op}_backward"))
    if policy == "gemma":  # (1 + w) is rounded to float32: a step function of w, checked at x only
        check_grads(lambda x_: f(x_, *params), lambda dy, c: b(dy, c)[:1], [x], names=["x"], raise_on_failure=True)
        return
    check_grads(f, b, [x, *params], names=names, raise_on_failure=True)


# ---------------------------------------------------------------------------
# the fast backends


# "fp32" is the generic cross-backend tests' subject; "gemma" runs the "fp32" kernels unchanged where their
# math is float32 (its float64 path: test_backend_gemma_float64)
@pytest.mark.parametrize("dt", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("policy", ["llama", "t5", "apex", "none"])
def test_backend_follows_the_policy(policy: str, op: str, dt: str, backend: Any) -> None:
    if backend.name == "numpy":
        pytest.skip("the numpy backend is the reference")
    data = _data(dt, rows=16, h=160, seed=1)
    eps, off = 1e-5, _offset(policy)
    ref = _run("numpy", policy, op, data, eps, off)
    dev = {k: backend.asarray(v) for k, v in data.items()}
    got = _run(backend.name, policy, op, dev, eps, off)
    got = {k: None if v is None else backend.to_numpy(v) for k, v in got.items()}
    params = {"weight": data["w"], **({"bias": data["b"]} if op == "layer_norm" else {})}
    sc = term_scales(op, data["x"].reshape(16, 160), params, data["dy"], {"eps": eps, "weight_offset": off})
    rtol = BACKEND_RTOL[dt]
    for name in ("y", "dx", "dweight", "dbias"):
        if ref[name] is None:
            continue
        assert got[name].dtype == ref[name].dtype, name
        assert_close_scaled(got[name], ref[name], sc[name], rtol, f"{backend.name} {policy} {op} {dt} {name}")
    if dt != "float32":  # one-rounding results: bitwise but for values at a rounding boundary
        assert _frac_equal(got["y"], ref["y"]) >= 0.99
        if policy in ("llama", "t5", "apex", "none"):
            fp32 = _run("numpy", "fp32", op, data, eps, off)
            assert _frac_equal(got["y"], ref["y"]) > _frac_equal(got["y"], fp32["y"]) + 0.1
    if policy == "none":  # the same operations in the same order: bitwise but where float64 sums round apart
        for name in ("y", "dx", "dweight", "dbias"):
            if ref[name] is not None:
                assert _frac_equal(got[name], ref[name]) >= 0.99, name
    if dt != "float32":
        if policy in ("llama", "t5", "none"):  # dweight = sum dy q, not sum dy xhat
            fp32 = _run("numpy", "fp32", op, data, eps, off)
            assert _frac_equal(got["dweight"], ref["dweight"]) > _frac_equal(got["dweight"], fp32["dweight"])


@pytest.mark.parametrize("op", OPS)
def test_backend_gemma_float64(op: str, backend: Any) -> None:
    """float64 math: the fast backends run "gemma" with the weight rounded as rnd_f32(rnd_f32(w) + 1)."""
    data = _data("float64", rows=8, h=64, wdt="float32")
    ref = _run("numpy", "gemma", op, data, 1e-5, 1.0)
    dev = {k: backend.asarray(v) for k, v in data.items()}
    got = _run(backend.name, "gemma", op, dev, 1e-5, 1.0)
    fp32 = _run("numpy", "fp32", op, data, 1e-5, 1.0)
    y = backend.to_numpy(got["y"])
    assert_close_scaled(y, ref["y"], np.abs(ref["y"]) + 1, 1e-12, f"{backend.name} gemma {op} y")
    assert np.abs(y - fp32["y"]).max() > 1e-9  # (1 + w) rounded to float32 shows in float64
    for name in ("dx", "dweight", "dbias"):
        if ref[name] is not None:
            assert got[name].dtype == ref[name].dtype, name
            assert_close_scaled(backend.to_numpy(got[name]), ref[name], np.abs(ref[name]) + 1, 1e-10, name)


def test_backend_t5_with_a_narrower_weight(backend: Any) -> None:
    """float32 x, bfloat16 weight: q, y and dy pass through bfloat16 on the backend too; ``out=`` is honoured."""
    data = _data("float32", rows=8, h=96, wdt="bfloat16")
    ref = _run("numpy", "t5", "rms_norm", data, 1e-6, 0.0)
    dev = {k: backend.asarray(v) for k, v in data.items()}
    got = _run(backend.name, "t5", "rms_norm", dev, 1e-6, 0.0)
    assert _frac_equal(backend.to_numpy(got["y"]), ref["y"]) >= 0.99
    assert_close_scaled(backend.to_numpy(got["dweight"]), ref["dweight"], np.abs(ref["dweight"]) + 1, 2.0**-7)
    out = backend.asarray(np.zeros((8, 96), np.float32))
    y = pynorm.rms_norm(dev["x"], dev["w"], casting="t5", out=out, backend=backend.name)
    assert y is out
    assert np.array_equal(backend.to_numpy(out), backend.to_numpy(got["y"]))


@pytest.mark.parametrize("op", OPS)
def test_none_overflows_like_a_float16_model(op: str, backend: Any) -> None:
    """float16 squares overflow beyond 256: "none" normalizes such rows to 0 (rstd = 0), as a model run
    without upcasts does, on every backend; "fp32" does not."""
    x = np.full((2, 8), 300.0, np.float16)
    x[:, ::2] = -300.0
    x[1] = np.linspace(-1, 1, 8).astype(np.float16)
    f = getattr(pynorm, op)
    y = backend.to_numpy(f(backend.asarray(x), casting="none", backend=backend.name))
    assert np.all(y[0] == 0)
    assert np.array_equal(y, f(x, casting="none", backend="numpy"))
    assert np.all(np.abs(f(x, backend="numpy")[0]) > 0.5)


@pytest.mark.parametrize("wdt", [None, "float32"])
@pytest.mark.parametrize("dt", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("policy", ["llama", "apex"])
def test_numba_rounded_affine_in_one_pass_is_the_two_kernels_bitwise(policy: str, dt: str, wdt: Any) -> None:
    """ "llama"/"apex" on numba run q = rnd(xhat) and y = w q + b in the norm's own pass (no q in memory): bitwise
    the backend's own two kernels -- the norm without affine, then PowerNorm with p = 1 on the stored q -- on
    ordinary and hard rows, with and without a weight offset, with and without ``out=``."""
    pytest.importorskip("numba")
    data = _data(dt, rows=40, h=300, seed=7, wdt=wdt)
    x = data["x"].copy()
    x[1] = 1e4 if dt != "float16" else 300.0  # a constant row
    x[2] *= 1e-30 if dt != "float16" else 1e-3
    x[3, 5] = np.nan
    x[4] += 2e4 if dt == "float32" else 100.0
    for off in (0.0, 1.0):
        for op, params in (("layer_norm", (data["w"], data["b"])), ("rms_norm", (data["w"],)), ("layer_norm", ())):
            f = getattr(pynorm, op)
            with np.errstate(all="ignore"):
                got = f(x, *params, casting=policy, weight_offset=off if params else 0.0, backend="numba")
                q = f(x, backend="numba")
                w_e = None
                if params:
                    w_e = (params[0].astype(np.float64) + off).astype(params[0].dtype)
                want = pynorm.power_norm(q, w_e, *params[1:], p=1.0, backend="numba")
                out = np.empty_like(x)
                again = f(x, *params, casting=policy, weight_offset=off if params else 0.0, backend="numba", out=out)
            assert again is out
            for a in (got, out):
                assert a.dtype == x.dtype
                assert np.array_equal(a.view(np.uint8), want.view(np.uint8)), (op, off, len(params))


def _rounds_to_x(policy: str, dt: str, wdt: str | None) -> bool:
    from pynorm.reference.casting import quantized_dtype

    return quantized_dtype(policy, dtype(dt), dtype(wdt or dt)) == np.dtype(dtype(dt))


@pytest.mark.parametrize(
    ("policy", "dt", "wdt"),
    [
        (p, d, w)
        for p in ("llama", "t5")
        for d in ("float16", "bfloat16", "float32")
        for w in (None, "float32")
        if _rounds_to_x(p, d, w)  # (t5 rounds only to a 16-bit weight's dtype)
    ],
)
def test_numba_rounded_affine_backward_in_one_pass_is_the_three_kernels_bitwise(policy: str, dt: str, wdt: Any) -> None:
    """ "llama"/"t5" backward on numba runs in one pass over the rows (q recomputed, g = rnd(dy w) and dx of the
    norm without affine, no q or g in memory): bitwise the backend's own three kernels -- the norm's forward
    without affine (q), PowerNorm's backward with p = 1 at q (g, dweight, dbias), the norm's backward without
    affine with upstream g -- on ordinary and hard rows (slow-path rows of both passes among them), on both
    sides of the fused backward's row-block boundary, with and without a weight offset."""
    pytest.importorskip("numba")
    for rows in (40, 200):
        data = _data(dt, rows=rows, h=300, seed=11, wdt=wdt)
        x, dy = data["x"].copy(), data["dy"]
        big = {"float16": 6e4, "bfloat16": 3e38, "float32": 3e38}[dt]
        x[1] = 1e4 if dt != "float16" else 300.0  # a constant row
        x[2] *= 1e-30 if dt != "float16" else 1e-3
        x[3, 5] = np.nan
        x[4] += 2e4 if dt == "float32" else 100.0
        x[5, ::2], x[5, 1::2] = big, -big  # its sums overflow: the slow path of both passes
        x[6] *= 1e-38 if dt != "float16" else 1e-7  # subnormal
        for off in (0.0, 1.0):
            for op, params in (("layer_norm", (data["w"], data["b"])), ("rms_norm", (data["w"],))):
                fwd, bwd = getattr(pynorm, f"{op}_forward"), getattr(pynorm, f"{op}_backward")
                with np.errstate(all="ignore"):
                    got = bwd(dy, fwd(x, *params, casting=policy, weight_offset=off, backend="numba")[1])
                    q, ctx = fwd(x, backend="numba")
                    w_e = (params[0].astype(np.float64) + off).astype(params[0].dtype)
                    ident = pynorm.power_norm_backward(
                        dy, pynorm.power_norm_forward(q, w_e, *params[1:], p=1.0, backend="numba")[1]
                    )
                    dx = bwd(ident.dx, ctx).dx
                want = [dx, ident.dweight, *([ident.dbias] if len(params) == 2 else [])]
                assert len(got) == len(want)
                for name, a, b in zip(got._fields, got, want, strict=True):
                    assert a.dtype == b.dtype, name
                    assert np.array_equal(a.view(np.uint8), b.view(np.uint8)), (rows, op, off, name)


def _ordered_sum(t: np.ndarray) -> float:
    s = 0.0
    for v in t.tolist():
        s += v
    return s


@pytest.mark.parametrize("dt", ["float16", "bfloat16", "float32"])
def test_numba_none_sums_in_any_order_only_where_that_is_exact(dt: str) -> None:
    """The numba "none" kernels add a row's terms in any order (vectorized) only where the float64 sum is exact;
    their sum is the row-order sum bitwise, for terms of every spread of exponents, and for a row where another
    order rounds differently."""
    pytest.importorskip("numba")
    from pynorm.backends.numba._intype_kernels import precision_of, sum_terms

    rng = np.random.default_rng(3)
    p = precision_of(dtype(dt))
    math_types = (np.float64, np.float32) if dt != "float32" else (np.float64,)  # (16-bit terms: float32 scratch)
    for spread in (0, 8, 20, 40, 80):
        t = rng.standard_normal(4099) * 2.0 ** rng.integers(-spread, 1, 4099)
        t = t.astype(dtype(dt)).astype(np.float64)
        for mt in math_types:
            assert sum_terms(t.astype(mt), p) == _ordered_sum(t), (spread, mt)
    t = np.array([2.0**60, 1.0, -(2.0**60), 1.0] * 64)  # row order: 1.0; exactly: 128.0
    assert _ordered_sum(t) == 1.0
    assert sum_terms(t, p) == 1.0
    if dt == "bfloat16":  # float32 terms whose smallest is subnormal there: its exponent is not that of a zero
        t = np.array([2.0**60, 2.0**-130, -(2.0**60), 2.0**-130] * 64)  # row order: 2^-130; exactly: 2^-123
        assert _ordered_sum(t) == 2.0**-130
        assert sum_terms(t.astype(np.float32), p) == 2.0**-130
    t = np.array([np.inf, 1.0, -np.inf, 2.0, np.nan, 0.0])
    assert np.isnan(sum_terms(t, p))
    assert sum_terms(np.zeros(5), p) == 0.0


def test_numba_none_bfloat16_operations_round_once_in_float32() -> None:
    """The numba "none" kernels evaluate a bfloat16 sum, difference or product in float32 and round it to
    bfloat16 (the kernels' own rounding, ``rt``): the exact result correctly rounded (the reference's ``round_to``
    of the float64 result, exact for these operands), for products across float32's subnormal range (where float32
    rounds them), bfloat16 subnormal operands, and sums at every exponent difference up to 39."""
    pytest.importorskip("numba")
    from numba import njit

    from pynorm._dtypes import round_to
    from pynorm.backends.numba._intype_kernels import lm, rt

    bf16 = dtype("bfloat16")

    @njit
    def ops(a, b, prod, add, sub):  # type: ignore[no-untyped-def]
        for j in range(a.shape[0]):
            u, v = lm(a, j), lm(b, j)
            prod[j], add[j], sub[j] = rt(a, u * v), rt(a, u + v), rt(a, u - v)

    mant = np.arange(128, 256, dtype=np.float64)
    m1, m2 = (m.ravel() for m in np.meshgrid(mant, mant))
    sub = np.arange(1, 128, dtype=np.uint16).view(bf16).astype(np.float64)  # bfloat16's subnormals
    pairs = [(np.ldexp(m1, e1), np.ldexp(m2, e2)) for e1 in range(-140, -100, 3) for e2 in (-70, -66, -60, -10)]
    pairs += [(np.ldexp(m1, e1), -np.ldexp(m2, e1 - d)) for e1 in (-135, -120, -7, 110) for d in range(0, 40, 3)]
    pairs += [(np.repeat(sub, 128), np.tile(np.ldexp(mant, e), 127)) for e in (-10, -7, 0, 9)]
    n_sub = 0
    for a, b in pairs:
        a16, b16 = round_to(a, bf16), round_to(b, bf16)  # (the values are bfloat16's: exact)
        a64, b64 = a16.astype(np.float64), b16.astype(np.float64)
        got = [np.empty(a.size, np.float32) for _ in range(3)]
        ops(a16.view(np.uint16), b16.view(np.uint16), *got)
        for g, exact in zip(got, (a64 * b64, a64 + b64, a64 - b64), strict=True):
            want = round_to(exact, bf16).astype(np.float32)
            assert np.array_equal(g.view(np.uint32), want.view(np.uint32))
        n_sub += int(np.sum((np.abs(a64 * b64) < 2.0**-126) & (a64 * b64 != 0)))
    assert n_sub > 100_000  # (products that float32 holds as subnormals were among them)


@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
@pytest.mark.parametrize("op", OPS)
def test_numba_none_non_finite_values_stay_where_the_reference_has_them(op: str, dt: str) -> None:
    """NaN and inf in x, in the weight and from overflow go through the numba "none" kernels' roundings as NaN and
    inf (the bfloat16 rounding keeps a NaN's bits): outputs and gradients NaN and infinite where the reference's
    are, and bitwise equal to it elsewhere on the rows without non-finite values."""
    pytest.importorskip("numba")
    data = _data(dt, rows=8, h=64, seed=5)
    x, w, dy = data["x"].copy(), data["w"].copy(), data["dy"].copy()
    big = 6e4 if dt == "float16" else 3e38
    x[1, 3] = np.nan
    x[2, 7] = np.inf
    x[3, ::2], x[3, 1::2] = big, -big  # squares and sums overflow
    x[4, 5] = -np.inf
    w[9] = np.nan  # every row's column 9
    dy[5, 2] = np.nan
    params = (w, data["b"]) if op == "layer_norm" else (w,)
    fwd, bwd = getattr(pynorm, f"{op}_forward"), getattr(pynorm, f"{op}_backward")
    with np.errstate(all="ignore"):
        res = {}
        for be in ("numba", "numpy"):
            y, ctx = fwd(x, *params, casting="none", backend=be)
            res[be] = (y, *bwd(dy, ctx))
    fine = np.ones(8, bool)
    fine[[1, 2, 3, 4, 5]] = False
    for k, (got, want) in enumerate(zip(res["numba"], res["numpy"], strict=True)):
        g, r = np.asarray(got, F64), np.asarray(want, F64)
        assert np.array_equal(np.isnan(g), np.isnan(r)), k
        assert np.array_equal(np.isinf(g), np.isinf(r)), k
        assert np.any(np.isnan(g))
    y, y_ref = (np.asarray(res[be][0], F64)[fine][:, np.arange(64) != 9] for be in ("numba", "numpy"))
    assert np.all(np.isfinite(y))  # (dx is NaN everywhere: the weight's NaN reaches every row's sums)
    assert _frac_equal(y, y_ref) >= 0.99  # bitwise but where float64 sums round apart


@pytest.mark.parametrize("h", [8192, 8193])
def test_numba_none_float16_rows_at_the_exact_sum_limit(h: int) -> None:
    """float16 rows of up to 8192 elements sum in any order (their float64 sums are exact), longer ones as other
    dtypes; rows of the largest float16 values are the worst case of that bound: bitwise the reference."""
    pytest.importorskip("numba")
    x = np.full((3, h), 65504.0, np.float16)
    x[1, ::2] = -65504.0
    x[2] = np.random.default_rng(4).standard_normal(h).astype(np.float16)
    w = np.linspace(0.5, 1.5, h).astype(np.float16)
    dy = np.random.default_rng(5).standard_normal((3, h)).astype(np.float16)
    for op in OPS:
        f, b = getattr(pynorm.functional, op + "_forward"), getattr(pynorm.functional, op + "_backward")
        with np.errstate(all="ignore"):
            got, ref = (b(dy, f(x, w, casting="none", backend=be)[1]) for be in ("numba", "numpy"))
            y_got, y_ref = (f(x, w, casting="none", backend=be)[0] for be in ("numba", "numpy"))
        assert np.array_equal(y_got, y_ref, equal_nan=True), op
        assert np.array_equal(got.dx, ref.dx, equal_nan=True), op


# ---------------------------------------------------------------------------
# bad input


def test_bad_casting_values() -> None:
    x = np.ones((2, 4), np.float32)
    with pytest.raises(ArgumentError, match="casting"):
        pynorm.layer_norm(x, casting="bf16")
    with pytest.raises(ArgumentError, match="casting"):
        pynorm.rms_norm(x, casting=None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="casting"):
        pynorm.scale_norm_forward(x, casting="llama")  # type: ignore[call-arg]


def test_casting_is_kept_in_ctx_and_inputs_are_not_mutated() -> None:
    data = _data("float16", rows=4, h=16)
    copies = {k: v.copy() for k, v in data.items()}
    _, ctx = pynorm.layer_norm_forward(data["x"], data["w"], data["b"], casting="llama", backend="numpy")
    assert ctx.inner.casting == "llama"
    pynorm.layer_norm_backward(data["dy"], ctx)
    for k, v in data.items():
        assert np.array_equal(v, copies[k]), k


@pytest.mark.parametrize("dt", ["float16", "bfloat16"])
def test_matches_hugging_face_modules_in_torch(dt: str) -> None:
    """The HF modules' forward code run in PyTorch (CPU; an optional test dependency): each policy matches
    its module on >= 99.9% of the elements (the rest: float32 vs float64 statistics put q one ulp apart,
    at most two ulps of y after the weight), where ``"fp32"`` matches Llama's and T5's on about 74% only."""
    torch = pytest.importorskip("torch")
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dt]
    g = torch.Generator().manual_seed(0)
    x = (1.5 * torch.randn(128, 512, generator=g) + 0.5).to(tdt)
    w = (1 + 0.5 * torch.randn(512, generator=g)).to(tdt)

    def llama(x: Any, w: Any, eps: float = 1e-6) -> Any:  # LlamaRMSNorm.forward
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return w * h.to(x.dtype)

    def gemma(x: Any, w: Any, eps: float = 1e-6) -> Any:  # GemmaRMSNorm.forward
        h = x.float()
        return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())).type_as(x)

    def t5(x: Any, w: Any, eps: float = 1e-6) -> Any:  # T5LayerNorm.forward
        h = x * torch.rsqrt(x.to(torch.float32).pow(2).mean(-1, keepdim=True) + eps)
        return w * h.to(w.dtype)

    d = dtype(dt)
    xn, wn = x.view(torch.int16).numpy().view(d), w.view(torch.int16).numpy().view(d)
    for policy, module in (("llama", llama), ("gemma", gemma), ("t5", t5)):
        want = module(x, w).view(torch.int16).numpy().view(d)
        got = pynorm.rms_norm(xn, wn, casting=policy, weight_offset=_offset(policy), backend="numpy")
        assert _frac_equal(got, want) >= 0.999, policy
        assert _ulps(got, want, d).max() <= 2, policy
        if policy != "gemma":
            assert _frac_equal(pynorm.rms_norm(xn, wn, backend="numpy"), want) < 0.8, policy


@pytest.mark.parametrize("policy", ["llama", "t5", "apex"])  # (the policies whose forward or backward is one pass)
def test_numba_casting_policies_give_the_same_bits_on_every_launch_path(policy: str) -> None:
    """A casting policy's forward and backward on numba, each launch path forced (``_paths.forced``: the split
    kernels, whose rows take no sink, run the policy's two kernels -- the norm's ``q`` stored, then the identity's
    affine -- and the row-then-column-tile backward its three), bitwise the unforced call's: the one-pass forward and
    backward (``Casting._fused``, ``_fused_backward``) and the kernels it fuses give the same bits on every path
    (``dweight``/``dbias``: the row-tile backward adds the rows in another order, to rounding)."""
    pytest.importorskip("numba")
    from pynorm import _registry
    from pynorm.backends.numba import _paths

    for dt in ("float32", "bfloat16"):
        data = _data(dt, rows=37, h=300, seed=3)
        x, dy = data["x"], data["dy"]
        for op, params in (("layer_norm", (data["w"], data["b"])), ("rms_norm", (data["w"],))):
            fwd, bwd = getattr(pynorm, f"{op}_forward"), getattr(pynorm, f"{op}_backward")
            casting = _registry.op_module("numba", op).policies
            y0, ctx0 = fwd(x, *params, casting=policy, weight_offset=1.0, backend="numba")
            g0 = bwd(dy, ctx0)
            # (16-bit rows: the two paths that change the kernels; streaming stores are for float32 outputs)
            chosen_sets = [("split",), ("rows",)]
            if dt == "float32":
                chosen_sets += [("split", "rows"), ("pool", "fused"), ("stream", "fused"), ("stream", "rows")]
            for chosen in chosen_sets:
                with _paths.forced(*chosen):
                    if "split" in chosen:
                        assert not casting._fused(x), "a split forward must take the two kernels"
                    if "rows" in chosen:
                        assert not casting._fused_backward(x), "a row-tile backward must take the three kernels"
                    y, ctx = fwd(x, *params, casting=policy, weight_offset=1.0, backend="numba")
                    g = bwd(dy, ctx)
                what = f"{op} {dt} casting={policy}, path {'+'.join(chosen)}"
                assert np.array_equal(y.view(np.uint8), y0.view(np.uint8)), f"{what}: y"
                assert np.array_equal(g.dx.view(np.uint8), g0.dx.view(np.uint8)), f"{what}: dx"
                for name, a, b in zip(g._fields[1:], g[1:], g0[1:], strict=True):  # (the rows added in another order)
                    scale = np.max(np.abs(np.asarray(b, F64))) + 1e-30
                    assert_close_scaled(a, b, scale, BACKEND_RTOL[dt], what=f"{what}: {name}")
