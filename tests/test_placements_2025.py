"""The placements of the 2024-25 depth studies (LayerNorm Scaling, Mix-LN, Peri-LN, HybridNorm) and the norm-free
blocks (DyT, Derf): each forward against its formula, every parameter's gradient against finite differences
(float64), and bitwise equality with the existing placement where the papers' definitions reduce to it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from pynorm.blocks import Block, Stack
from pynorm.errors import ArgumentError

from .test_blocks import B_, D_, T_, _layer_norm_np, _np, _x, grad_check


def _block(backend: Any, **kw: Any) -> Block:
    return Block(D_, 2, 12, rng=9, dtype=np.float64, backend=backend.name, xp=backend.xp, **kw)


def _stack(backend: Any, n: int, **kw: Any) -> Stack:
    return Stack(n, D_, 2, 12, rng=3, dtype=np.float64, backend=backend.name, xp=backend.xp, **kw)


def _perturb(backend: Any, module: Any, rng: np.random.Generator) -> None:
    """Non-trivial norm parameters (weights near 1, biases near 0)."""
    for _, o, k in module.named_parameters():
        if k in ("weight", "bias"):
            shape = _np(backend, o.params[k]).shape
            o.params[k] = backend.asarray(rng.standard_normal(shape) * 0.3 + (1.0 if k == "weight" else 0.0))


def _same(backend: Any, a: Any, b: Any) -> None:
    assert np.array_equal(_np(backend, a), _np(backend, b))


def _run(backend: Any, module: Any, x: np.ndarray, dy: np.ndarray) -> tuple[Any, Any, list[Any]]:
    y, ctx = module.forward(backend.asarray(x))
    module.zero_grad()
    dx = module.backward(backend.asarray(dy), ctx)
    return y, dx, [_np(backend, o.grads[k]) for _, o, k in module.named_parameters()]


@pytest.mark.parametrize("depth", [1, 4])
def test_layer_norm_scaling_formula(backend, depth):
    """x + f(n(x) / sqrt(depth)) for each sublayer (LayerNorm restated in NumPy)."""
    rng = np.random.default_rng(1)
    blk = _block(backend, placement="layer_norm_scaling", depth=depth)
    _perturb(backend, blk, rng)
    x = _x(rng)
    y, _ = blk.forward(backend.asarray(x))

    def norm(name: str, v: np.ndarray) -> np.ndarray:
        p = blk.norms[name].inner.params
        return _layer_norm_np(v, _np(backend, p["weight"]), _np(backend, p["bias"])) / np.sqrt(depth)

    h = x + _np(backend, blk.attn.forward(backend.asarray(norm("norm1", x)))[0])
    expected = h + _np(backend, blk.ffn.forward(backend.asarray(norm("norm2", h)))[0])
    np.testing.assert_allclose(_np(backend, y), expected, rtol=1e-10, atol=1e-10)


def test_hybrid_formula(backend):
    """HybridNorm: h = x + attn(x) with q, k and v normalized per head; y = n(h + ffn(h))."""
    rng = np.random.default_rng(2)
    blk = _block(backend, placement="hybrid")
    assert blk.attn.qk_norm == "layer" and blk.attn.v_norm is not None and list(blk.norms) == ["norm2"]
    _perturb(backend, blk, rng)
    x = _x(rng)
    y, _ = blk.forward(backend.asarray(x))
    a = blk.attn
    q, k, v = (_np(backend, lin.forward(backend.asarray(x))[0]) for lin in (a.q, a.k, a.v))

    def heads(m: np.ndarray, norm: Any) -> np.ndarray:
        p = norm.inner.params
        mh = m.reshape(B_, T_, 2, D_ // 2).transpose(0, 2, 1, 3)
        return _layer_norm_np(mh, _np(backend, p["weight"]), _np(backend, p["bias"]))

    qh, kh, vh = heads(q, a.q_norm), heads(k, a.k_norm), heads(v, a.v_norm)
    s = qh @ kh.transpose(0, 1, 3, 2) / np.sqrt(D_ // 2)
    p = np.exp(s - s.max(-1, keepdims=True))
    o = ((p / p.sum(-1, keepdims=True)) @ vh).transpose(0, 2, 1, 3).reshape(B_, T_, D_)
    h = x + _np(backend, a.o.forward(backend.asarray(o))[0])
    n2 = blk.norms["norm2"].inner.params
    expected = _layer_norm_np(h + _np(backend, blk.ffn.forward(backend.asarray(h))[0]), _np(backend, n2["weight"]),
                              _np(backend, n2["bias"]))  # fmt: skip
    np.testing.assert_allclose(_np(backend, y), expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    ("placement", "norm", "extra"),
    [
        ("layer_norm_scaling", "layer", {"depth": 3}),
        ("layer_norm_scaling", "derf", {"depth": 2}),
        ("hybrid", "rms", {}),
        ("hybrid", "dyt", {"qk_norm": "layer"}),
        ("peri", "derf", {}),
        ("pre", "derf", {"qk_norm": "rms", "io_norms": True}),  # every norm slot: ln_q/ln_kv/ln_out follow norm
    ],
)
def test_block_grads(backend, placement, norm, extra):
    rng = np.random.default_rng(4)
    blk = _block(backend, placement=placement, norm=norm, causal=True, **extra)
    _perturb(backend, blk, rng)
    pm = backend.asarray(np.array([[True, True, False], [True, True, True]]))
    grad_check(backend, blk, _x(rng), lambda a: blk.forward(a, pm), directions=2)


@pytest.mark.parametrize(("placement", "extra"), [("mix", {"mix_alpha": 0.5}), ("peri", {}), ("mix", {})])
def test_stack_grads(backend, placement, extra):
    """Mix-LN (a Post-LN block under a Pre-LN one; with the default 0.25 of 2 blocks: none) and Peri-LN with its
    input norm: every parameter, the input norm's and the final norm's included."""
    rng = np.random.default_rng(5)
    st = _stack(backend, 2, placement=placement, **extra)
    _perturb(backend, st, rng)
    grad_check(backend, st, _x(rng), st.forward, directions=2)


def test_mix_placements_and_defaults():
    st = Stack(8, D_, 2, placement="mix")
    assert [b.placement for b in st.blocks] == ["post"] * 2 + ["pre"] * 6 and st.final_norm is not None
    assert [b.placement for b in Stack(3, D_, 2, placement="mix", mix_alpha=0.7).blocks] == ["post", "post", "pre"]
    assert Stack(3, D_, 2, placement="mix", mix_alpha=1.0).final_norm is None
    with pytest.raises(ArgumentError, match="mix_alpha must be in"):
        Stack(3, D_, 2, placement="mix", mix_alpha=1.5)
    with pytest.raises(ArgumentError, match="mix_alpha is Mix-LN's"):
        Stack(3, D_, 2, placement="pre", mix_alpha=0.5)
    with pytest.raises(ArgumentError, match="placement must be one of"):
        Block(D_, 2, placement="mix")  # a stack's placement, not a block's
    assert [b.depth for b in Stack(3, D_, 2, placement="layer_norm_scaling").blocks] == [1, 2, 3]
    with pytest.raises(ArgumentError, match="v_norm=True needs qk_norm"):
        Block(D_, 2, v_norm=True)


@pytest.mark.parametrize(("alpha", "same_as"), [(0.0, "pre"), (1.0, "post")])
def test_mix_at_the_ends_is_pre_or_post_bitwise(backend, alpha, same_as):
    """Mix-LN with mix_alpha = 0 is Pre-LN and with 1 is Post-LN: outputs, dx and every gradient bitwise."""
    rng = np.random.default_rng(6)
    x, dy = _x(rng), _x(rng)
    a = _run(backend, _stack(backend, 3, placement="mix", mix_alpha=alpha), x, dy)
    b = _run(backend, _stack(backend, 3, placement=same_as), x, dy)
    _same(backend, a[0], b[0])
    _same(backend, a[1], b[1])
    assert len(a[2]) == len(b[2]) and all(np.array_equal(u, v) for u, v in zip(a[2], b[2]))


def test_layer_norm_scaling_at_depth_1_is_pre_bitwise(backend):
    """LayerNorm Scaling's first block (depth 1: factor 1) is a Pre-LN block, bitwise; a one-block stack too."""
    rng = np.random.default_rng(7)
    x, dy = _x(rng), _x(rng)
    for make in (lambda pl: _block(backend, placement=pl), lambda pl: _stack(backend, 1, placement=pl)):
        a, b = _run(backend, make("layer_norm_scaling"), x, dy), _run(backend, make("pre"), x, dy)
        _same(backend, a[0], b[0])
        _same(backend, a[1], b[1])
        assert all(np.array_equal(u, v) for u, v in zip(a[2], b[2]))


def test_peri_without_input_norm_is_sandwich_bitwise(backend):
    """Placement "peri" is the sandwich block; the stack adds a norm of its input (input_norm=False: sandwich)."""
    rng = np.random.default_rng(8)
    x, dy = _x(rng), _x(rng)
    peri = _stack(backend, 2, placement="peri")
    assert peri.input_norm is not None and "input_norm.norm.weight" in dict(
        (n, 0) for n, _, _ in peri.named_parameters()
    )
    a = _run(backend, _stack(backend, 2, placement="peri", input_norm=False), x, dy)
    b = _run(backend, _stack(backend, 2, placement="sandwich"), x, dy)
    _same(backend, a[0], b[0])
    _same(backend, a[1], b[1])
    assert all(np.array_equal(u, v) for u, v in zip(a[2], b[2]))
