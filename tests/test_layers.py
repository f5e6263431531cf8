"""Stateful layers: initialisation, gradient accumulation, reuse, (de)serialisation."""

from __future__ import annotations

import numpy as np
import pytest

import pynorm
from pynorm.errors import ArgumentError, DTypeError, ShapeError
from pynorm.layers import LayerNorm, RMSNorm


def test_initialisation():
    ln = LayerNorm((2, 3))
    assert np.all(ln.params["weight"] == 1) and np.all(ln.params["bias"] == 0)
    assert ln.params["weight"].dtype == np.float32 and ln.params["weight"].shape == (2, 3)
    assert set(LayerNorm(4, bias=False).params) == {"weight"}
    assert LayerNorm(4, elementwise_affine=False).params == {}
    assert np.all(LayerNorm(4, weight_offset=1.0).params["weight"] == 0)
    assert np.all(RMSNorm(4).params["weight"] == 1) and np.all(RMSNorm(4, weight_offset=1.0).params["weight"] == 0)
    assert "eps_mode='std'" in repr(LayerNorm(4, eps_mode="std"))


def test_bad_construction():
    with pytest.raises(ArgumentError, match="normalized_shape"):
        LayerNorm(0)
    with pytest.raises(ArgumentError, match="eps"):
        RMSNorm(4, eps=-1)
    with pytest.raises(DTypeError, match="dtype"):
        LayerNorm(4, dtype=np.int32)
    with pytest.raises(ArgumentError, match="eps_mode"):
        LayerNorm(4, eps_mode="x")


def test_layer_matches_functional_and_accumulates(backend):
    rng = np.random.default_rng(0)
    ln = LayerNorm(6, dtype=np.float64, backend=backend.name, xp=backend.xp)
    ln.params["weight"] = backend.asarray(rng.standard_normal(6))
    x1, x2 = rng.standard_normal((3, 6)), rng.standard_normal((2, 6))
    dy1, dy2 = rng.standard_normal((3, 6)), rng.standard_normal((2, 6))
    # reuse the same layer twice in one graph: each ctx is independent
    _, c1 = ln.forward(backend.asarray(x1))
    _, c2 = ln.forward(backend.asarray(x2))
    dx2 = ln.backward(backend.asarray(dy2), c2)
    dx1 = ln.backward(backend.asarray(dy1), c1)
    w = backend.to_numpy(ln.params["weight"])
    r1 = pynorm.layer_norm_backward(dy1, pynorm.layer_norm_forward(x1, w, np.zeros(6), backend="numpy")[1])
    r2 = pynorm.layer_norm_backward(dy2, pynorm.layer_norm_forward(x2, w, np.zeros(6), backend="numpy")[1])
    np.testing.assert_allclose(backend.to_numpy(dx1), r1.dx, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(backend.to_numpy(dx2), r2.dx, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(backend.to_numpy(ln.grads["weight"]), r1.dweight + r2.dweight, rtol=1e-10)
    np.testing.assert_allclose(backend.to_numpy(ln.grads["bias"]), r1.dbias + r2.dbias, rtol=1e-10)
    ln.zero_grad()
    assert np.all(backend.to_numpy(ln.grads["weight"]) == 0)


def test_rms_layer(backend):
    rng = np.random.default_rng(1)
    layer = RMSNorm((2, 4), dtype=np.float64, backend=backend.name, xp=backend.xp)
    x = rng.standard_normal((5, 2, 4))
    y, ctx = layer(backend.asarray(x))
    np.testing.assert_allclose(
        backend.to_numpy(y), pynorm.rms_norm(x, np.ones((2, 4)), axis=1, backend="numpy"), rtol=1e-12
    )
    dx = layer.backward(backend.asarray(np.ones_like(x)), ctx)
    assert dx.shape == x.shape and layer.grads["weight"].shape == (2, 4)
    with pytest.raises(ShapeError, match="trailing dims"):
        layer.forward(backend.asarray(np.ones((5, 4, 2))))


def test_state_dict_roundtrip_and_save_load(tmp_path):
    import ml_dtypes

    for dt in (np.float32, ml_dtypes.bfloat16):
        ln = LayerNorm(5, dtype=dt)
        ln.params["weight"] = np.arange(5).astype(dt)
        sd = ln.state_dict()
        sd["weight"][0] = 42  # a copy: the layer is unchanged
        assert ln.params["weight"][0] == 0
        path = tmp_path / "ln.npz"
        ln.save(path)
        other = LayerNorm(5, dtype=dt)
        other.load(path)
        np.testing.assert_array_equal(other.params["weight"], ln.params["weight"])
        assert other.params["weight"].dtype == np.dtype(dt)
    with pytest.raises(ArgumentError, match="missing"):
        LayerNorm(5).load_state_dict({"weight": np.ones(5)})
    with pytest.raises(ShapeError, match="state"):
        LayerNorm(5).load_state_dict({"weight": np.ones(4), "bias": np.ones(5)})


def _shown(name: str) -> str:
    """A layer's constructor as the docs write it."""
    import inspect

    import pynorm.layers as L

    parts, star = [], False
    for p in inspect.signature(getattr(L, name)).parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            parts.append("*")
            star = True
        if p.default is p.empty:
            parts.append(p.name)
        else:
            d = "np.float32" if p.default is np.float32 else repr(p.default).replace("'", '"')
            parts.append(f"{p.name}={d}")
    return f"{name}(" + ", ".join(parts) + ")"


def test_the_docs_show_every_layers_real_constructor() -> None:
    import re
    from pathlib import Path

    import pynorm.layers as L

    docs = Path(__file__).resolve().parents[1] / "docs"
    seen: set[str] = set()
    for path in docs.rglob("*.md"):
        text = path.read_text()
        for name in L.__all__:
            for m in re.finditer(r"(?:pynorm\.layers\.|\| `)(" + name + r"\([^`]*\))`", text):
                assert m.group(1) == _shown(name), (path.name, m.group(1), _shown(name))
                seen.add(name)
    missing = set(L.__all__) - {"Layer"} - seen
    assert not missing, (
        f"no page of docs/ shows the constructor of {sorted(missing)}: add it to the op's page in docs/norms/ "
        f"(a table row | `{_shown(sorted(missing)[0])}` | or `pynorm.layers.{_shown(sorted(missing)[0])}`)"
    )


def test_every_layer_takes_what_its_signature_says() -> None:
    import inspect

    import pynorm.layers as L

    sizes = {"n_modalities": 3, "cond_dim": 5, "out_features": 6}
    for name in L.__all__:
        if name == "Layer":
            continue
        cls = getattr(L, name)
        params = inspect.signature(cls).parameters
        args = [4] + [sizes[n] for n in cls.sizes]
        kw = {n: p.default for n, p in params.items() if p.kind is p.KEYWORD_ONLY and p.default is not p.empty}
        kw |= {n: 2 for n, p in params.items() if p.kind is p.KEYWORD_ONLY and p.default is p.empty}  # num_groups
        layer = cls(*args, **kw)
        shape = (3, 4) if layer.spec.layout == "rows" else (3, 4, 5)
        x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
        spec = layer.spec
        extra = spec.example_inputs(x.shape, -1, np.float32, np.random.default_rng(1), 3, {"shift": True})
        extra = [a for a, i in zip(extra, spec.inputs, strict=True) if not i.keyword]
        if name == "ConditionalRMSNorm" or name == "ConditionalLayerNorm":
            extra = [np.ones((3, 5), np.float32)]
        y, ctx = layer.forward(x, *extra)
        assert layer.backward(np.ones_like(y[0] if isinstance(y, tuple) else y), ctx) is not None
        with pytest.raises(TypeError):
            cls(*args, epsilon=1e-5)
