"""pynorm.blocks: sublayers, placements, stacks, checkpointing, mixed precision, DeepNorm's constants.

Gradients are checked in float64 against central finite differences (``pynorm.testing.check_grads``) on
every backend of ``PYNORM_TEST_BACKENDS``; expected forward values are restated here in plain NumPy.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

import pynorm
from pynorm.blocks import (
    Adam,
    Block,
    Embedding,
    FeedForward,
    Linear,
    LossScaler,
    MultiHeadAttention,
    Norm,
    SequenceModel,
    Stack,
    cross_entropy,
    gelu_tanh,
    gelu_tanh_grad,
    masked_softmax,
    sort_task,
    train_step,
)
from pynorm.errors import ArgumentError, ShapeError
from pynorm.testing import check_grads

B_, T_, D_ = 2, 3, 8


def _np(backend: Any, a: Any) -> np.ndarray:
    return np.asarray(backend.to_numpy(a))


def grad_check(backend: Any, module: Any, x: np.ndarray, call: Any, *, directions: int = 3) -> None:
    """Check ``module.backward`` (dx and every parameter gradient) against finite differences of ``call``."""
    named = list(module.named_parameters())
    start = [_np(backend, o.params[k]).copy() for _, o, k in named]

    def f(x_: Any, *ps: Any) -> Any:
        for (_, o, k), p in zip(named, ps):
            o.params[k] = backend.asarray(p)
        y, ctx = call(backend.asarray(x_))
        return _np(backend, y), ctx

    def b(dy: Any, ctx: Any) -> list[Any]:
        module.zero_grad()
        dx = module.backward(backend.asarray(dy), ctx)
        return [None if dx is None else _np(backend, dx)] + [_np(backend, o.grads[k]) for _, o, k in named]

    try:
        rep = check_grads(f, b, [x, *start], names=["x", *(n for n, _, _ in named)], n_directions=directions,
                          full_jacobian=False)  # fmt: skip
    finally:
        for (_, o, k), p in zip(named, start):
            o.params[k] = backend.asarray(p)
    assert rep.passed, str(rep)


def _x(rng: np.random.Generator, shape: tuple[int, ...] = (B_, T_, D_)) -> np.ndarray:
    return rng.standard_normal(shape)


# ---------------------------------------------------------------------------------------------
# sublayers


def test_linear_forward_and_grads(backend):
    rng = np.random.default_rng(0)
    lin = Linear(D_, 5, rng=1, dtype=np.float64, backend=backend.name, xp=backend.xp)
    lin.params["b"] = backend.asarray(rng.standard_normal(5))
    x = _x(rng)
    y, _ = lin.forward(backend.asarray(x))
    w, bias = _np(backend, lin.params["W"]), _np(backend, lin.params["b"])
    expected = np.einsum("btd,od->bto", x, w) + bias
    np.testing.assert_allclose(_np(backend, y), expected, rtol=1e-12, atol=1e-12)
    grad_check(backend, lin, x, lin.forward)


def test_linear_xavier_gain():
    lin = Linear(256, 128, gain=0.5, rng=0)
    std = float(np.std(lin.params["W"]))
    assert abs(std / (0.5 * math.sqrt(2.0 / 384)) - 1) < 0.03
    assert np.all(lin.params["b"] == 0) and lin.params["W"].dtype == np.float32


def test_gelu_tanh_formula_and_derivative():
    u = np.linspace(-6, 6, 41)
    expected = np.array([0.5 * v * (1 + math.tanh(math.sqrt(2 / math.pi) * (v + 0.044715 * v**3))) for v in u])
    np.testing.assert_allclose(gelu_tanh(u), expected, rtol=1e-14, atol=1e-15)
    h = 1e-5
    fd = (gelu_tanh(u + h) - gelu_tanh(u - h)) / (2 * h)
    np.testing.assert_allclose(gelu_tanh_grad(u), fd, rtol=1e-8, atol=1e-9)
    # saturation: gelu(u) -> u for large u, -> 0 for very negative u
    assert gelu_tanh(np.array([30.0]))[0] == 30.0 and abs(gelu_tanh(np.array([-30.0]))[0]) < 1e-300


def test_feedforward_grads(backend):
    rng = np.random.default_rng(1)
    ff = FeedForward(D_, 12, rng=2, dtype=np.float64, backend=backend.name, xp=backend.xp)
    x = _x(rng) * 2
    y, _ = ff.forward(backend.asarray(x))
    w1, b1 = _np(backend, ff.fc1.params["W"]), _np(backend, ff.fc1.params["b"])
    w2, b2 = _np(backend, ff.fc2.params["W"]), _np(backend, ff.fc2.params["b"])
    u = x @ w1.T + b1
    a = 0.5 * u * (1 + np.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u**3)))
    np.testing.assert_allclose(_np(backend, y), a @ w2.T + b2, rtol=1e-12, atol=1e-12)
    grad_check(backend, ff, x, ff.forward)


def test_masked_softmax_stable_and_empty_rows():
    s = np.array([[1e4, 1e4 - 1.0, -1e4], [0.0, 1.0, 2.0], [5.0, 6.0, 7.0]])
    mask = np.array([[True, True, True], [True, False, True], [False, False, False]])
    p = masked_softmax(s, mask)
    assert np.all(np.isfinite(p))
    e = math.exp(-1.0)
    np.testing.assert_allclose(p[0], [1 / (1 + e), e / (1 + e), 0.0], rtol=1e-14, atol=1e-300)
    np.testing.assert_allclose(p[1], [1 / (1 + math.exp(2)), 0.0, math.exp(2) / (1 + math.exp(2))], rtol=1e-14)
    assert np.all(p[2] == 0)


def _naive_attention(x, mha, backend, padding_mask=None):
    """Loops over batch, head, query: the textbook formula, independent of the implementation."""
    p = {n: _np(backend, o.params[k]) for n, o, k in mha.named_parameters()}
    b, t, d = x.shape
    h, dk = mha.n_heads, mha.d_k

    def ln(v, w, bb):
        mu = v.mean(-1, keepdims=True)
        return (v - mu) / np.sqrt(((v - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * w + bb

    def rms(v, w):
        return v / np.sqrt((v**2).mean(-1, keepdims=True) + 1e-6) * w

    q = x @ p["q.W"].T + p["q.b"]
    k = x @ p["k.W"].T + p["k.b"]
    v = x @ p["v.W"].T + p["v.b"]
    out = np.zeros((b, t, d))
    for bi in range(b):
        for hi in range(h):
            sl = slice(hi * dk, (hi + 1) * dk)
            qh, kh, vh = q[bi, :, sl], k[bi, :, sl], v[bi, :, sl]
            if mha.qk_norm == "layer":
                qh = ln(qh, p["q_norm.norm.weight"], p["q_norm.norm.bias"])
                kh = ln(kh, p["k_norm.norm.weight"], p["k_norm.norm.bias"])
            elif mha.qk_norm == "rms":
                qh, kh = rms(qh, p["q_norm.norm.weight"]), rms(kh, p["k_norm.norm.weight"])
            for i in range(t):
                allowed = [j for j in range(t) if (not mha.causal or j <= i)
                           and (padding_mask is None or padding_mask[bi, j])]  # fmt: skip
                if not allowed:
                    continue
                sc = np.array([qh[i] @ kh[j] / math.sqrt(dk) for j in allowed])
                w = np.exp(sc - sc.max())
                w /= w.sum()
                out[bi, i, sl] = sum(wj * vh[j] for wj, j in zip(w, allowed))
    return out @ p["o.W"].T + p["o.b"]


@pytest.mark.parametrize("qk_norm", [None, "layer", "rms"])
def test_attention_matches_naive_formula(backend, qk_norm):
    rng = np.random.default_rng(2)
    mha = MultiHeadAttention(D_, 2, qk_norm=qk_norm, causal=True, rng=3, dtype=np.float64, backend=backend.name,
                             xp=backend.xp)  # fmt: skip
    for o in (mha.q, mha.k, mha.v, mha.o):
        o.params["b"] = backend.asarray(rng.standard_normal(D_) * 0.1)
    x = _x(rng)
    pm = np.array([[True, True, False], [True, True, True]])
    y, _ = mha.forward(backend.asarray(x), backend.asarray(pm))
    np.testing.assert_allclose(_np(backend, y), _naive_attention(x, mha, backend, pm), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(
    ("qk_norm", "io_norms", "causal"), [(None, False, False), ("layer", False, True), ("rms", True, True)]
)
def test_attention_grads(backend, qk_norm, io_norms, causal):
    rng = np.random.default_rng(3)
    mha = MultiHeadAttention(D_, 2, qk_norm=qk_norm, io_norms=io_norms, causal=causal, rng=4, dtype=np.float64,
                             backend=backend.name, xp=backend.xp)  # fmt: skip
    pm = backend.asarray(np.array([[True, False, True], [True, True, True]]))
    x = _x(rng)
    grad_check(backend, mha, x, lambda a: mha.forward(a, pm))
    if io_norms:
        assert {"ln_q.norm.weight", "ln_kv.norm.weight", "ln_out.norm.weight"} <= {
            n for n, _, _ in mha.named_parameters()
        }


def test_fully_masked_rows_give_zeros_and_zero_gradients(backend):
    rng = np.random.default_rng(4)
    mha = MultiHeadAttention(D_, 2, qk_norm="layer", causal=True, rng=5, dtype=np.float64, backend=backend.name,
                             xp=backend.xp)  # fmt: skip
    bo = rng.standard_normal(D_)
    mha.o.params["b"] = backend.asarray(bo)
    # sequence 0 is all padding (every query fully masked); in sequence 1 the first key is padding, so
    # the causal query 0 sees no key at all
    pm = np.array([[False, False, False], [False, True, True]])
    x = _x(rng)
    y, ctx = mha.forward(backend.asarray(x), backend.asarray(pm))
    y = _np(backend, y)
    assert np.all(np.isfinite(y))
    np.testing.assert_array_equal(y[0], np.broadcast_to(bo, (T_, D_)))  # zero context: y = b_o exactly
    np.testing.assert_array_equal(y[1, 0], bo)
    mha.zero_grad()
    dx = _np(backend, mha.backward(backend.asarray(rng.standard_normal(y.shape)), ctx))
    assert np.all(np.isfinite(dx))
    np.testing.assert_array_equal(dx[0], 0.0)  # nothing of sequence 0 reaches any output
    for _, o, k in mha.named_parameters():
        assert np.all(np.isfinite(_np(backend, o.grads[k])))


def test_attention_bad_arguments():
    with pytest.raises(ArgumentError, match="n_heads"):
        MultiHeadAttention(8, 3)
    with pytest.raises(ArgumentError, match="qk_norm"):
        MultiHeadAttention(8, 2, qk_norm="batch")
    mha = MultiHeadAttention(8, 2)
    with pytest.raises(ShapeError, match="padding_mask"):
        mha.forward(np.zeros((2, 3, 8), np.float32), np.ones((2, 4), bool))
    with pytest.raises(ShapeError):
        mha.forward(np.zeros((2, 3, 6), np.float32))


def test_embedding_grads(backend):
    rng = np.random.default_rng(5)
    emb = Embedding(5, D_, 4, rng=0, dtype=np.float64, backend=backend.name, xp=backend.xp)
    tok = rng.integers(0, 5, (B_, T_))
    y, ctx = emb.forward(backend.asarray(tok))
    e, p = _np(backend, emb.params["E"]), _np(backend, emb.params["P"])
    np.testing.assert_array_equal(_np(backend, y), e[tok] + p[None, :T_])
    dy = rng.standard_normal((B_, T_, D_))
    emb.backward(backend.asarray(dy), ctx)
    de = np.zeros_like(e)
    for bi in range(B_):
        for t in range(T_):
            de[tok[bi, t]] += dy[bi, t]
    np.testing.assert_allclose(_np(backend, emb.grads["E"]), de, rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(_np(backend, emb.grads["P"])[:T_], dy.sum(0), rtol=1e-13, atol=1e-13)


def test_cross_entropy_value_and_gradient():
    rng = np.random.default_rng(6)
    z = rng.standard_normal((4, 5)) * 3
    t = np.array([0, 4, 2, 2])
    loss, dz = cross_entropy(z, t)
    expected = -np.mean([z[i, t[i]] - math.log(sum(math.exp(v) for v in z[i])) for i in range(4)])
    assert abs(loss - expected) < 1e-13
    h = 1e-6
    for i, j in [(0, 0), (1, 3), (3, 2)]:
        zp, zm = z.copy(), z.copy()
        zp[i, j] += h
        zm[i, j] -= h
        fd = (cross_entropy(zp, t)[0] - cross_entropy(zm, t)[0]) / (2 * h)
        assert abs(fd - dz[i, j]) < 1e-8


# ---------------------------------------------------------------------------------------------
# norms, placements, DeepNorm


@pytest.mark.parametrize("kind", ["layer", "rms", "scale", "dyt", "modality"])
def test_norm_kinds_and_fused_add(backend, kind):
    rng = np.random.default_rng(7)
    n = Norm(D_, kind, n_modalities=2, dtype=np.float64, backend=backend.name, xp=backend.xp)
    ids = backend.asarray(rng.integers(0, 2, (B_, T_)))
    x, f = _x(rng), _x(rng)
    # forward_add == forward of the sum, for the fused (layer, rms) and the split kinds alike
    y1, _ = n.forward_add(backend.asarray(f), backend.asarray(x), 1.7, ids)
    y2, _ = n.forward(backend.asarray(f + 1.7 * x), ids)
    np.testing.assert_allclose(_np(backend, y1), _np(backend, y2), rtol=1e-12, atol=1e-12)
    grad_check(backend, n, x, lambda a: n.forward(a, ids))


def _layer_norm_np(v: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    mu = v.mean(-1, keepdims=True)
    return (v - mu) / np.sqrt(((v - mu) ** 2).mean(-1, keepdims=True) + 1e-5) * w + b


@pytest.mark.parametrize("placement", ["pre", "post", "sandwich", "deepnorm"])
def test_placement_formulas(backend, placement):
    """Each placement composes the sublayers as its formula says (norms restated in NumPy)."""
    rng = np.random.default_rng(8)
    kw = {"alpha": 1.9, "beta": 0.6} if placement == "deepnorm" else {}
    blk = Block(D_, 2, 12, placement=placement, rng=9, dtype=np.float64, backend=backend.name, xp=backend.xp, **kw)
    for _, o, k in blk.named_parameters():  # non-trivial norm parameters
        if k in ("weight", "bias"):
            o.params[k] = backend.asarray(rng.standard_normal(D_) * 0.3 + (1.0 if k == "weight" else 0.0))
    x = _x(rng)
    y, _ = blk.forward(backend.asarray(x))

    def norm(name: str, v: np.ndarray) -> np.ndarray:
        p = blk.norms[name].inner.params
        return _layer_norm_np(v, _np(backend, p["weight"]), _np(backend, p["bias"]))

    def attn(v: np.ndarray) -> np.ndarray:
        return _np(backend, blk.attn.forward(backend.asarray(v))[0])

    def ffn(v: np.ndarray) -> np.ndarray:
        return _np(backend, blk.ffn.forward(backend.asarray(v))[0])

    if placement == "pre":
        h = x + attn(norm("norm1", x))
        expected = h + ffn(norm("norm2", h))
    elif placement == "post":
        h = norm("norm1", x + attn(x))
        expected = norm("norm2", h + ffn(h))
    elif placement == "sandwich":
        h = x + norm("norm1_out", attn(norm("norm1_in", x)))
        expected = h + norm("norm2_out", ffn(norm("norm2_in", h)))
    else:
        h = norm("norm1", 1.9 * x + attn(x))
        expected = norm("norm2", 1.9 * h + ffn(h))
    np.testing.assert_allclose(_np(backend, y), expected, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(
    ("placement", "norm", "extra"),
    [
        ("pre", "layer", {}),
        ("post", "rms", {}),
        ("sandwich", "scale", {}),
        ("deepnorm", "layer", {"learnable_alpha": True}),
        ("deepnorm", "rms", {}),
        ("deepnorm", "dyt", {"learnable_alpha": True}),
        ("pre", "dyt", {"qk_norm": "rms", "io_norms": True}),  # ln_q/ln_kv/ln_out follow norm: DyT
        ("post", "modality", {"io_norms": True}),
    ],
)
def test_block_grads(backend, placement, norm, extra):
    rng = np.random.default_rng(9)
    blk = Block(D_, 2, 12, placement=placement, norm=norm, n_modalities=2, causal=True,
                n_layers=3 if placement == "deepnorm" else None, rng=10, dtype=np.float64, backend=backend.name,
                xp=backend.xp, **extra)  # fmt: skip
    pm = backend.asarray(np.array([[True, True, False], [True, True, True]]))
    ids = backend.asarray(rng.integers(0, 2, (B_, T_)))
    grad_check(backend, blk, _x(rng), lambda a: blk.forward(a, pm, ids))
    if extra.get("learnable_alpha"):
        assert "alpha" in blk.params and float(_np(backend, blk.grads["alpha"])[0]) != 0.0


def test_deepnorm_initialisation():
    n = 12
    alpha, beta = (2 * n) ** 0.25, (8 * n) ** -0.25
    blk = Block(64, 4, 256, placement="deepnorm", n_layers=n, rng=0)
    assert blk.alpha == pytest.approx(alpha, rel=1e-15) and blk.beta == pytest.approx(beta, rel=1e-15)

    def gain(lin: Linear) -> float:
        fo, fi = lin.params["W"].shape
        return float(np.std(lin.params["W"])) / math.sqrt(2.0 / (fi + fo))

    for lin in (blk.attn.v, blk.attn.o, blk.ffn.fc1, blk.ffn.fc2):
        assert abs(gain(lin) / beta - 1) < 0.05
    for lin in (blk.attn.q, blk.attn.k):
        assert abs(gain(lin) - 1) < 0.05
    dec = Block(8, 2, placement="deepnorm", n_layers=n, causal=True)  # decoder-only: M = n
    assert dec.alpha == pytest.approx((2 * n) ** 0.25) and dec.beta == pytest.approx((8 * n) ** -0.25)


def test_deepnorm_constants_are_the_papers():
    assert pynorm.deepnorm_constants("encoder", N=6) == pytest.approx((12**0.25, 48**-0.25), rel=1e-15)
    assert pynorm.deepnorm_constants("decoder", M=100) == pytest.approx((200**0.25, 800**-0.25), rel=1e-15)
    (ae, be), (ad, bd) = pynorm.deepnorm_constants("encoder-decoder", N=18, M=6)
    k = (18**4 * 6) ** (1 / 16)
    assert (ae, be) == pytest.approx((0.81 * k, 0.87 / k), rel=1e-14)
    assert (ad, bd) == pytest.approx((18**0.25, 72**-0.25), rel=1e-15)
    # 1000 layers: the paper's headline configuration
    assert pynorm.deepnorm_constants("decoder", M=1000)[0] == pytest.approx(2000**0.25)


@pytest.mark.parametrize(
    ("args", "kw", "word"),
    [
        (("decoderr",), {"M": 2}, "arch"),
        ((None,), {"N": 2}, "arch"),
        (("encoder",), {}, "N"),
        (("encoder",), {"M": 3}, "M"),
        (("decoder",), {"N": 3}, "N"),
        (("encoder-decoder",), {"N": 3}, "M"),
        (("encoder",), {"N": 0}, "N"),
        (("encoder",), {"N": True}, "N"),
        (("encoder",), {"N": 2.5}, "N"),
    ],
)
def test_deepnorm_constants_errors(args, kw, word):
    with pytest.raises(ArgumentError, match=rf"\b{word}\b"):
        pynorm.deepnorm_constants(*args, **kw)


def test_block_bad_arguments():
    with pytest.raises(ArgumentError, match="placement"):
        Block(8, 2, placement="middle")
    with pytest.raises(ArgumentError, match="norm"):
        Block(8, 2, norm="batch")
    with pytest.raises(ArgumentError, match="n_layers"):
        Block(8, 2, placement="deepnorm")
    with pytest.raises(ArgumentError, match="alpha"):
        Block(8, 2, placement="pre", alpha=2.0)
    with pytest.raises(ArgumentError, match="n_modalities"):
        Block(8, 2, norm="modality")
    with pytest.raises(ArgumentError, match="modality_ids"):
        Block(8, 2, norm="modality", n_modalities=2).forward(np.zeros((1, 2, 8), np.float32))


# ---------------------------------------------------------------------------------------------
# stack, hybrid, checkpointing


def test_stack_grads_and_records(backend):
    rng = np.random.default_rng(10)
    st = Stack(2, D_, 2, 12, placement="pre", causal=True, rng=1, dtype=np.float64, backend=backend.name,
               xp=backend.xp)  # fmt: skip
    assert st.final_norm is not None and Stack(2, D_, 2, placement="post").final_norm is None
    grad_check(backend, st, _x(rng), st.forward)
    st.zero_grad()
    y, ctx = st.forward(backend.asarray(_x(rng)))
    st.backward(backend.asarray(rng.standard_normal(y.shape)), ctx)
    g = st.history["grad_norm"][-1]
    expected = [
        math.sqrt(sum(float(np.sum(_np(backend, o.grads[k]) ** 2)) for n, o, k in st.named_parameters()
                      if n.startswith(f"layers.{i}.")))
        for i in range(2)
    ]  # fmt: skip
    assert g == pytest.approx(expected, rel=1e-12)


def test_hybrid_stack(backend):
    rng = np.random.default_rng(11)
    st = Stack(3, D_, 2, 12, placement="pre", norm="rms", hybrid_layers=2, n_modalities=3, rng=2,
               dtype=np.float64, backend=backend.name, xp=backend.xp)  # fmt: skip
    shapes = {n: tuple(o.params[k].shape) for n, o, k in st.named_parameters()}
    assert shapes["layers.0.norm1.norm.weight"] == (3, D_) and shapes["layers.1.norm2.norm.weight"] == (3, D_)
    assert shapes["layers.2.norm1.norm.weight"] == (D_,) and shapes["final_norm.norm.weight"] == (D_,)
    ids = rng.integers(0, 3, (B_, T_))
    grad_check(backend, st, _x(rng), lambda a: st.forward(a, None, backend.asarray(ids)), directions=2)
    # a modality's table row only gets gradient from that modality's rows
    ids1 = np.zeros((B_, T_), dtype=np.int64)
    st.zero_grad()
    y, ctx = st.forward(backend.asarray(_x(rng)), None, backend.asarray(ids1))
    st.backward(backend.asarray(rng.standard_normal(y.shape)), ctx)
    g = _np(backend, st.blocks[0].norms["norm1"].inner.grads["weight"])
    assert np.all(g[1:] == 0) and np.any(g[0] != 0)
    with pytest.raises(ArgumentError, match="hybrid_layers"):
        Stack(2, D_, 2, norm="dyt", hybrid_layers=1, n_modalities=2)
    with pytest.raises(ArgumentError, match="modality_ids"):
        st.forward(backend.asarray(_x(rng)))


@pytest.mark.parametrize("placement", ["post", "sandwich", "deepnorm"])
def test_checkpointing_is_bitwise_equal(backend, placement):
    rng = np.random.default_rng(12)
    st = Stack(3, D_, 2, 12, placement=placement, qk_norm="layer", causal=True, rng=3, backend=backend.name,
               xp=backend.xp)  # fmt: skip
    x = backend.asarray(_x(rng).astype(np.float32))
    dy = backend.asarray(rng.standard_normal((B_, T_, D_)).astype(np.float32))
    pm = backend.asarray(np.array([[True, True, False], [True, True, True]]))
    results = []
    for ck in (False, True):
        st.zero_grad()
        y, ctx = st.forward(x, pm, checkpoint=ck)
        assert ctx.checkpointed is ck
        if ck:  # only the blocks' inputs are kept
            assert all(isinstance(s, type(x)) for s in ctx.saved)
        dx = st.backward(dy, ctx)
        results.append(
            (_np(backend, y), _np(backend, dx), {n: _np(backend, o.grads[k]) for n, o, k in st.named_parameters()})
        )
    (y0, dx0, g0), (y1, dx1, g1) = results
    np.testing.assert_array_equal(y0, y1)
    np.testing.assert_array_equal(dx0, dx1)
    for n in g0:
        np.testing.assert_array_equal(g0[n], g1[n], err_msg=n)


# ---------------------------------------------------------------------------------------------
# training: Adam, loss scaling, mixed precision


def test_adam_matches_its_formula():
    lin = Linear(2, 1, bias=False, rng=0, dtype=np.float64)
    w0 = lin.params["W"].copy()
    g1, g2 = np.array([[0.5, -2.0]]), np.array([[0.1, 1.0]])
    opt = Adam(0.01, betas=(0.8, 0.9), eps=1e-8)
    lin.grads["W"] = g1 * 4.0
    opt.step(lin, grad_scale=4.0)  # the scale divides out
    lin.grads["W"] = g2.copy()
    upd = opt.step(lin)
    m = 0.8 * (0.2 * g1) + 0.2 * g2
    v = 0.9 * (0.1 * g1**2) + 0.1 * g2**2
    w1 = w0 - 0.01 * (0.2 * g1 / 0.2) / (np.sqrt(0.1 * g1**2 / 0.1) + 1e-8)
    w2 = w1 - 0.01 * (m / (1 - 0.8**2)) / (np.sqrt(v / (1 - 0.9**2)) + 1e-8)
    np.testing.assert_allclose(lin.params["W"], w2, rtol=1e-12)
    assert upd["W"] == pytest.approx(float(np.linalg.norm(w2 - w1)), rel=1e-9)


def test_loss_scaler_rules():
    s = LossScaler(init_scale=1024.0, growth_interval=3)
    s.update(found_inf=True)
    assert s.scale == 512.0 and s.skipped == 1
    for _ in range(2):
        s.update(found_inf=False)
    assert s.scale == 512.0
    s.update(found_inf=False)
    assert s.scale == 1024.0 and s.good_steps == 0
    s.update(found_inf=False)
    s.update(found_inf=True)  # an overflow resets the run of good steps
    assert s.scale == 512.0 and s.good_steps == 0
    with pytest.raises(ArgumentError, match="backoff_factor"):
        LossScaler(backoff_factor=1.5)


@pytest.mark.parametrize("act", ["float16", "bfloat16"])
def test_mixed_precision_overflow_skips_and_halves(backend, act):
    if act == "bfloat16":
        pytest.importorskip("ml_dtypes")
    rng = np.random.default_rng(13)
    model = SequenceModel(8, 4, 2, 16, 2, 32, placement="pre", rng=0, backend=backend.name, xp=backend.xp)
    tok, tgt = sort_task(rng, 4, 4, 8)
    before = {n: _np(backend, o.params[k]).copy() for n, o, k in model.named_parameters()}
    # a scale beyond the activation dtype's range: the scaled gradient overflows to inf
    big = 2.0**200 if act == "bfloat16" else 2.0**40
    scaler = LossScaler(init_scale=big, growth_interval=2)
    opt = Adam(1e-3)
    r = train_step(model, backend.asarray(tok), tgt, opt, scaler, act_dtype=act)
    assert r.skipped and scaler.scale == big / 2 and scaler.skipped == 1 and opt.t == 0
    for n, o, k in model.named_parameters():  # the step was skipped: parameters untouched
        np.testing.assert_array_equal(_np(backend, o.params[k]), before[n])
    # halving until the gradients fit, then training steps; two good steps double the scale
    scaler = LossScaler(init_scale=2.0**14 if act == "float16" else 2.0**100, growth_interval=2)
    results = [train_step(model, backend.asarray(tok), tgt, opt, scaler, act_dtype=act) for _ in range(8)]
    good = [r for r in results if not r.skipped]
    assert good, [r.scale for r in results]
    assert all(np.isfinite(r.loss) for r in results)
    for n, o, k in model.named_parameters():  # fp32 masters and fp32 gradients
        assert o.params[k].dtype == np.float32 and o.grads[k].dtype == np.float32, n
    i = next(j for j, r in enumerate(results) if not r.skipped)
    if i + 2 < len(results) and not results[i + 1].skipped:
        assert results[i + 2].scale == 2 * results[i].scale


def test_mixed_precision_matches_fp32(backend):
    rng = np.random.default_rng(14)
    tok, tgt = sort_task(rng, 4, 6, 8)
    losses = {}
    for act in (None, "float16"):
        model = SequenceModel(8, 6, 2, 16, 2, 32, placement="post", rng=5, backend=backend.name, xp=backend.xp)
        logits, ctx = model.forward(backend.asarray(tok), act)
        assert logits.dtype == (np.float32 if act is None else np.float16)
        assert ctx[1].saved[0][0][2].dtype == logits.dtype  # the first block's saved input: 16-bit
        losses[act] = cross_entropy(logits, backend.asarray(tgt), model.xp)[0]
    assert abs(losses["float16"] - losses[None]) < 2e-2 * losses[None]


def test_training_reduces_the_loss(backend):
    rng = np.random.default_rng(15)
    model = SequenceModel(6, 4, 2, 16, 2, 32, placement="pre", rng=1, backend=backend.name, xp=backend.xp)
    opt = Adam(3e-3)
    tok, tgt = sort_task(rng, 16, 4, 6)
    losses = [train_step(model, backend.asarray(tok), tgt, opt).loss for _ in range(40)]
    assert losses[-1] < 0.7 * losses[0]
    assert len(model.stack.history["update_norm"]) == 40 and len(model.stack.history["update_norm"][0]) == 2


def test_sequence_model_grads(backend):
    """Embedding + stack + head, end to end: every parameter's gradient against finite differences."""
    rng = np.random.default_rng(16)
    model = SequenceModel(5, 3, 2, D_, 2, 12, placement="sandwich", rng=2, dtype=np.float64, backend=backend.name,
                          xp=backend.xp)  # fmt: skip
    tok = backend.asarray(rng.integers(0, 5, (B_, T_)))
    named = list(model.named_parameters())
    start = [_np(backend, o.params[k]).copy() for _, o, k in named]

    def f(*ps: Any) -> Any:
        for (_, o, k), p in zip(named, ps):
            o.params[k] = backend.asarray(p)
        y, ctx = model.forward(tok)
        return _np(backend, y), ctx

    def b(dy: Any, ctx: Any) -> list[Any]:
        model.zero_grad()
        model.backward(backend.asarray(dy), ctx)
        return [_np(backend, o.grads[k]) for _, o, k in named]

    try:
        rep = check_grads(f, b, start, names=[n for n, _, _ in named], n_directions=3, full_jacobian=False)
    finally:
        for (_, o, k), p in zip(named, start):
            o.params[k] = backend.asarray(p)
    assert rep.passed, str(rep)
