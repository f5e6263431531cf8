"""``pynorm.jax``: every op as a JAX function under ``jit``, ``vjp``/``grad``, ``value_and_grad`` and ``vmap``.

Every op's forward and gradients against the NumPy API on the same values and backend (the same kernels: equal),
a small model trained under ``jit(value_and_grad)`` against a pure-JAX twin (float32 to 1e-5 relative, bfloat16 at
its rounding), the backward fed by the forward's statistics (one forward per step, never a second), per-example
gradients under ``vmap``, the dtypes, and the errors. JAX is optional: the module skips where it is missing."""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np
import pytest

jax = pytest.importorskip("jax", reason="JAX is optional: pip install 'pynorm[jax]'")
jnp = pytest.importorskip("jax.numpy")

import pynorm  # noqa: E402
import pynorm.jax as pj  # noqa: E402
from pynorm import _dispatch  # noqa: E402
from pynorm.errors import ArrayTypeError, ShapeError  # noqa: E402
from pynorm.ops import SPECS  # noqa: E402

bf16 = pytest.importorskip("ml_dtypes").bfloat16


def _args(name: str, dt: Any, rng: np.random.Generator) -> tuple[np.ndarray, list[Any], dict[str, Any]]:
    """``x``, the positional arguments after it and the keyword ones (keyword inputs, the first case's options)
    of op ``name``, as NumPy arrays."""
    spec = SPECS[name]
    opts = dict(spec.cases[0])
    if spec.layout == "channels":
        x_shape, axis = (2, 4, 3, 3), 1
        extra = spec.example_inputs(x_shape, axis, dt, rng, options=opts)
        extra += spec.example_params((4,), dt, rng, options=opts)
    else:
        x_shape, axis = (3, 5, 16), 2
        extra = spec.example_args(x_shape, axis, dt, rng, options=opts)
    x = rng.standard_normal(x_shape).astype(dt)
    names = [*spec.input_names, *spec.param_names]
    keyword = {i.name for i in spec.inputs if i.keyword}
    pos = [a for n, a in zip(names, extra, strict=True) if n not in keyword]
    kw = {n: a for n, a in zip(names, extra, strict=True) if n in keyword and a is not None}
    return x, pos, {**kw, **opts}


def _floats(tree: Any) -> list[Any]:
    leaves = tree if isinstance(tree, tuple) else (tree,)
    return [v for v in leaves if jnp.issubdtype(np.asarray(v).dtype, jnp.floating)]


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_op_matches_the_numpy_api_under_jit_and_vjp(name: str) -> None:
    rng = np.random.default_rng(0)
    x, pos, kw = _args(name, np.float32, rng)
    spec = SPECS[name]
    result, ctx = getattr(pynorm, f"{name}_forward")(x, *pos, **kw)
    got = jax.jit(lambda *a: getattr(pj, name)(*a, **kw))(x, *pos)
    for g, e in zip(_floats(got), _floats(result), strict=True):
        assert isinstance(g, jax.Array)
        np.testing.assert_array_equal(np.asarray(g), e)
    # gradients: a random cotangent on each differentiable output
    outs = result if isinstance(result, tuple) else (result,)
    cts = [rng.standard_normal(np.shape(o)).astype(np.asarray(o).dtype) for o in outs]
    upstream = {f"d{n}": c for n, c in zip(spec.outputs[1:], cts[1 : len(spec.outputs)], strict=False)}
    expected = getattr(pynorm, f"{name}_backward")(cts[0], ctx, **upstream)
    arrays = [x, *pos]
    diff = [i for i, a in enumerate(arrays) if a is not None and jnp.issubdtype(a.dtype, jnp.floating)]

    def f(*d: Any) -> Any:
        full = list(arrays)
        for i, v in zip(diff, d, strict=True):
            full[i] = v
        return getattr(pj, name)(*full, **kw)

    out, vjp = jax.vjp(f, *(arrays[i] for i in diff))
    ct = tuple(jnp.asarray(c) for c in cts) if isinstance(out, tuple) else jnp.asarray(cts[0])
    if isinstance(out, tuple):  # (the non-float leaves take float0 cotangents)
        ct = tuple(
            c if jnp.issubdtype(np.asarray(o).dtype, jnp.floating) else np.zeros(np.shape(o), jax.dtypes.float0)
            for c, o in zip(ct, out, strict=True)
        )
    grads = vjp(ct)
    names = ["x", *(n for n in [*spec.input_names, *spec.param_names] if n not in {i.name for i in spec.inputs
                                                                                 if i.keyword})]  # fmt: skip
    by_name = dict(zip(spec.grad_names, expected, strict=True))
    for i, g in zip(diff, grads, strict=True):
        e = by_name.get(f"d{names[i]}")
        if e is None:  # a row scale, a running statistic: no gradient
            assert not np.any(np.asarray(g))
        else:
            assert g.shape == e.shape and g.dtype == e.dtype
            np.testing.assert_array_equal(np.asarray(g), e)


# ---------------------------------------------------------------------------
# a small model and its pure-JAX twin


def _ln(x: Any, w: Any, b: Any, eps: float = 1e-5) -> Any:
    x32 = x.astype(jnp.float32)
    m = x32.mean(-1, keepdims=True)
    v = jnp.square(x32 - m).mean(-1, keepdims=True)
    return ((x32 - m) * jax.lax.rsqrt(v + eps) * w.astype(jnp.float32) + b.astype(jnp.float32)).astype(x.dtype)


def _rms(x: Any, w: Any, eps: float = 1e-6) -> Any:
    x32 = x.astype(jnp.float32)
    ms = jnp.square(x32).mean(-1, keepdims=True)
    return (x32 * jax.lax.rsqrt(ms + eps) * w.astype(jnp.float32)).astype(x.dtype)


def _model(norms: tuple[Any, Any]) -> Any:
    layer_norm, rms_norm = norms

    def loss(p: dict[str, Any], x: Any, t: Any) -> Any:
        h = jnp.tanh(x @ p["W1"])
        h = layer_norm(h, p["g1"], p["b1"])
        h = jnp.tanh(h @ p["W2"])
        h = rms_norm(h, p["g2"])
        out = (h @ p["W3"]).astype(jnp.float32)
        return jnp.mean(jnp.square(out - t))

    return loss


PYNORM = (lambda x, w, b: pj.layer_norm(x, w, b), lambda x, w: pj.rms_norm(x, w, eps=1e-6))
TWIN = (_ln, _rms)


def _init(dt: Any, d: int = 32, seed: int = 0) -> tuple[dict[str, Any], Any, Any]:
    k = jax.random.split(jax.random.key(seed), 8)
    p = {
        "W1": jax.random.normal(k[0], (16, d)) / 4, "W2": jax.random.normal(k[1], (d, d)) / 6,
        "W3": jax.random.normal(k[2], (d, 4)) / 6, "g1": 1 + 0.1 * jax.random.normal(k[3], (d,)),
        "b1": 0.1 * jax.random.normal(k[4], (d,)), "g2": 1 + 0.1 * jax.random.normal(k[5], (d,)),
    }  # fmt: skip
    x = jax.random.normal(k[6], (24, 16))
    t = jax.random.normal(k[7], (24, 4))
    return {n: v.astype(dt) for n, v in p.items()}, x.astype(dt), t


def _rel(a: Any, b: Any) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def test_training_matches_a_pure_jax_twin_float32() -> None:
    """30 SGD steps of the model with pynorm's ops under jit(value_and_grad); at every step the gradients of the
    same parameters match the pure-JAX twin's to 1e-5 relative (the loss decreases: it trains)."""
    p, x, t = _init(jnp.float32)
    step = jax.jit(jax.value_and_grad(_model(PYNORM)))
    twin = jax.jit(jax.value_and_grad(_model(TWIN)))
    losses = []
    for _ in range(30):
        (loss, g), (loss_t, g_t) = step(p, x, t), twin(p, x, t)
        assert abs(float(loss) - float(loss_t)) <= 1e-5 * abs(float(loss_t))
        for n in p:
            assert _rel(g[n], g_t[n]) <= 1e-5, n
        losses.append(float(loss))
        p = {n: p[n] - 0.1 * g[n] for n in p}
    assert losses[-1] < 0.7 * losses[0]


def test_training_matches_a_pure_jax_twin_bfloat16() -> None:
    """bfloat16 parameters and activations: the gradients agree with the twin's at bfloat16's rounding (a few
    units of 2**-8 of the largest gradient: the twin rounds its norms' outputs to bfloat16 as pynorm does)."""
    p, x, t = _init(jnp.bfloat16)
    g = jax.jit(jax.grad(_model(PYNORM)))(p, x, t)
    g_t = jax.jit(jax.grad(_model(TWIN)))(p, x, t)
    for n in p:
        assert g[n].dtype == jnp.bfloat16
        assert _rel(g[n], g_t[n]) <= 4 * 2.0**-8, n


def test_backward_reuses_the_forward_statistics(monkeypatch: pytest.MonkeyPatch) -> None:
    """A jitted value_and_grad step runs each op's forward once and its backward once: the backward is fed the
    forward's saved statistics, not a recomputed forward."""
    calls = {"forward": 0, "backward": 0}

    def counted(name: str, fn: Any) -> Any:
        def run(*a: Any, **k: Any) -> Any:
            calls[name] += 1
            return fn(*a, **k)

        return run

    for name in calls:
        monkeypatch.setattr(_dispatch, name, counted(name, getattr(_dispatch, name)))
    p, x, t = _init(jnp.float32, seed=1)
    step = jax.jit(jax.value_and_grad(_model(PYNORM)))
    jax.block_until_ready(step(p, x, t))  # traces (its stand-in runs are counted too)
    calls.update(forward=0, backward=0)
    jax.block_until_ready(step(p, x, t))
    assert calls == {"forward": 2, "backward": 2}


def _numba_signatures() -> int:
    """How many compiled signatures the numba backend's kernel modules hold (every dispatcher's overloads)."""
    import importlib
    import pkgutil

    import pynorm.backends.numba as nb

    n = 0
    for info in pkgutil.iter_modules(nb.__path__):
        mod = importlib.import_module(f"pynorm.backends.numba.{info.name}")
        n += sum(len(v.overloads) for v in vars(mod).values() if hasattr(v, "overloads") and hasattr(v, "py_func"))
    return n


@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
def test_a_jax_call_runs_the_kernels_numpy_calls_compiled(dt: str) -> None:
    """JAX hands a callback read-only buffers, and numba compiles a read-only array's kernels apart: the
    callbacks hand them on as writable aliases of the same memory (no copy), so a jitted forward + backward
    after the same NumPy calls compiles no new kernel signature (a JAX user's second compile wall: 6.1 s for
    LayerNorm's) -- and the inputs are not written."""
    pytest.importorskip("numba")
    from pynorm.jax import _host

    dtype = np.dtype(bf16) if dt == "bfloat16" else np.dtype(dt)
    ro = np.arange(6.0).astype(dtype)
    ro.flags.writeable = False
    alias = _host(ro)
    assert alias.flags.writeable and alias.dtype == dtype
    assert alias.__array_interface__["data"][0] == ro.__array_interface__["data"][0]
    rng = np.random.default_rng(8)
    x, w, b, dy = (rng.standard_normal(s).astype(dtype) for s in ((5, 48), (48,), (48,), (5, 48)))
    y, ctx = pynorm.layer_norm_forward(x, w, b, backend="numba")
    pynorm.layer_norm_backward(dy, ctx)
    before = _numba_signatures()
    xj, wj, bj, dyj = (jnp.asarray(a) for a in (x, w, b, dy))
    copies = [np.array(a) for a in (xj, wj, bj, dyj)]
    yj, vjp = jax.vjp(jax.jit(lambda *a: pj.layer_norm(*a, backend="numba")), xj, wj, bj)
    grads = vjp(dyj)
    jax.block_until_ready(grads)
    assert _numba_signatures() == before
    np.testing.assert_array_equal(np.asarray(yj), y)
    for a, c in zip((xj, wj, bj, dyj), copies, strict=True):
        np.testing.assert_array_equal(np.asarray(a), c)


def test_vmap_gives_per_example_gradients() -> None:
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((4, 6, 32)), jnp.float32)
    w = jnp.asarray(1 + 0.1 * rng.standard_normal(32), jnp.float32)
    c = jnp.asarray(rng.standard_normal((6, 32)), jnp.float32)

    def f(w: Any, xi: Any) -> Any:
        return jnp.sum(pj.rms_norm(xi, w) * c)

    per = jax.jit(jax.vmap(jax.grad(f), in_axes=(None, 0)))(w, x)
    one_by_one = np.stack([np.asarray(jax.grad(f)(w, x[i])) for i in range(4)])
    np.testing.assert_array_equal(np.asarray(per), one_by_one)
    y = jax.vmap(lambda xi: pj.layer_norm(xi, w))(x)
    np.testing.assert_array_equal(np.asarray(y), pynorm.layer_norm(np.asarray(x), np.asarray(w)))


@pytest.mark.parametrize("dt", ["float16", "bfloat16", "float32"])
def test_dtypes(dt: str) -> None:
    rng = np.random.default_rng(4)
    x = rng.standard_normal((5, 24)).astype(bf16 if dt == "bfloat16" else dt)
    w = (1 + 0.1 * rng.standard_normal(24)).astype(x.dtype)
    y = pj.layer_norm(jnp.asarray(x), jnp.asarray(w))
    assert y.dtype == jnp.dtype(x.dtype)
    np.testing.assert_array_equal(np.asarray(y), pynorm.layer_norm(x, w))
    dx, dw = jax.grad(lambda a, b: jnp.sum(pj.layer_norm(a, b).astype(jnp.float32) ** 2), argnums=(0, 1))(x, w)
    assert dx.dtype == jnp.dtype(x.dtype) and dw.dtype == jnp.dtype(x.dtype)
    y, ctx = pynorm.layer_norm_forward(x, w)
    e = pynorm.layer_norm_backward((2 * y.astype(np.float32)).astype(x.dtype), ctx)
    np.testing.assert_array_equal(np.asarray(dx), e.dx)
    np.testing.assert_array_equal(np.asarray(dw), e.dweight)
    assert np.any(e.dx != 0)


def test_float64_with_x64() -> None:
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 40))
    w = 1 + 0.1 * rng.standard_normal(40)
    x64 = getattr(jax, "enable_x64", None)
    if x64 is None:  # (older JAX: the experimental context manager)
        from jax.experimental import enable_x64 as x64
    with x64(True):
        g = jax.grad(lambda a, b: jnp.sum(pj.rms_norm(a, b) ** 3), argnums=(0, 1))(jnp.asarray(x), jnp.asarray(w))
        assert g[0].dtype == jnp.float64
    _, ctx = pynorm.rms_norm_forward(x, w)
    e = pynorm.rms_norm_backward(3 * pynorm.rms_norm(x, w) ** 2, ctx)
    np.testing.assert_allclose(np.asarray(g[0]), e.dx, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(np.asarray(g[1]), e.dweight, rtol=1e-13)


def test_options_are_static_and_reach_the_kernels() -> None:
    x = jnp.asarray(np.random.default_rng(6).standard_normal((2, 8)), jnp.float32)
    f = jax.jit(lambda a: pj.layer_norm(a, eps=0.5))
    np.testing.assert_array_equal(np.asarray(f(x)), pynorm.layer_norm(np.asarray(x), eps=0.5))
    assert not np.array_equal(np.asarray(f(x)), np.asarray(pj.layer_norm(x)))


def test_errors_name_the_argument_and_pynorm_jax() -> None:
    x = jnp.ones((2, 8))
    with pytest.raises(ShapeError, match="weight"):
        jax.jit(lambda a: pj.layer_norm(a, jnp.ones(7)))(x)
    with pytest.raises(ArrayTypeError, match=r"pynorm\.jax"):
        jax.jit(pynorm.rms_norm)(x)
    with pytest.raises(ArrayTypeError, match=r"pynorm\.jax"):
        jax.grad(lambda a: pynorm.layer_norm(a).sum())(x)
    with pytest.raises(pynorm.ArgumentError, match="axis"):
        pj.layer_norm(x, axis=1.0)


def test_signatures_and_docstrings_follow_the_numpy_api() -> None:
    for name in SPECS:
        fn = getattr(pj, name)
        want = [p for n, p in inspect.signature(getattr(pynorm, name)).parameters.items() if n != "out"]
        assert list(inspect.signature(fn).parameters.values()) == want, name
        assert fn.__doc__ and "Parameters" in fn.__doc__ and "\nout :" not in fn.__doc__
    assert sorted(pj.__all__) == sorted(pynorm.list_ops())


def test_jax_arrays_given_to_the_numpy_api_come_back_as_jax_arrays() -> None:
    """Eager JAX arrays read through DLPack: the outputs and the gradients are JAX arrays, equal to NumPy's."""
    rng = np.random.default_rng(7)
    x, w = rng.standard_normal((4, 16)).astype(np.float32), np.ones(16, np.float32)
    y, ctx = pynorm.layer_norm_forward(jnp.asarray(x), jnp.asarray(w))
    assert isinstance(y, jax.Array)
    np.testing.assert_array_equal(np.asarray(y), pynorm.layer_norm(x, w))
    g = pynorm.layer_norm_backward(jnp.asarray(x), ctx)
    assert isinstance(g.dx, jax.Array) and isinstance(g.dweight, jax.Array) and g.dbias is None
    _, ctx_np = pynorm.layer_norm_forward(x, w)
    np.testing.assert_array_equal(np.asarray(g.dweight), pynorm.layer_norm_backward(x, ctx_np).dweight)
