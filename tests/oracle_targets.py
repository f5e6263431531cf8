"""Implementations for ``python -m pynorm check`` (docs/oracle.md, tests/test_oracle.py): a correct float32
wrapper of PyTorch's ``F.layer_norm`` and deliberately broken NumPy LayerNorms / RMSNorms, each with one
classic mistake the checker must catch and name.

Calling convention (docs/oracle.md): ``forward(x, weight, bias, eps=...)`` normalizes the trailing
``weight.ndim`` axes of ``x``; ``backward(dy, x, weight, bias, eps=...) -> (dx, dweight, dbias)``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# --- PyTorch ---------------------------------------------------------------------------------------


def _torch_dtype(dt: np.dtype) -> Any:
    import torch

    return torch.float64 if dt == np.float64 else torch.float32


def _to_torch(a: np.ndarray, requires_grad: bool = False) -> Any:
    """float16/bfloat16/float32 as float32 tensors (float64 stays float64)."""
    import torch

    f = np.float64 if a.dtype == np.float64 else np.float32
    return torch.tensor(np.asarray(a).astype(f), requires_grad=requires_grad)


def torch_layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float = 1e-5) -> np.ndarray:
    """``F.layer_norm`` computing in float32 (float64 for float64 input), rounded once to ``x``'s dtype."""
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        y = F.layer_norm(_to_torch(x), tuple(weight.shape), _to_torch(weight), _to_torch(bias), eps)
    return y.numpy().astype(x.dtype)


def torch_layer_norm_backward(
    dy: np.ndarray, x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float = 1e-5
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The gradients of :func:`torch_layer_norm` by autograd (same precision), rounded to the inputs' dtypes."""
    import torch.nn.functional as F

    xt, wt, bt = _to_torch(x, True), _to_torch(weight, True), _to_torch(bias, True)
    y = F.layer_norm(xt, tuple(weight.shape), wt, bt, eps)
    y.backward(_to_torch(dy))
    return (
        xt.grad.numpy().astype(x.dtype),
        wt.grad.numpy().astype(weight.dtype),
        bt.grad.numpy().astype(bias.dtype),
    )


# --- NumPy LayerNorms: one correct, then one mistake each ----------------------------------------------


def _pow2_scale(a: np.ndarray, axis: Any) -> np.ndarray:
    """A power of two near max|a| per row (dividing by it is exact), 1 for zero rows."""
    with np.errstate(all="ignore"):
        m = np.max(np.abs(a), axis=axis, keepdims=True)
        e = np.frexp(np.where((m > 0) & np.isfinite(m), m, 1.0))[1]
    return np.ldexp(1.0, e)


def _finish(y: np.ndarray, shape: tuple[int, ...], dt: np.dtype) -> np.ndarray:
    return y.reshape(shape).astype(dt)


def layer_norm(x, weight, bias, eps=1e-5, *, _eps_std=False, _ddof=0):
    """A correct LayerNorm in float64, rounded once (the ``_`` keywords plant the mistakes below)."""
    with np.errstate(all="ignore"):
        s = _pow2_scale(np.asarray(x, np.float64), tuple(range(x.ndim - weight.ndim, x.ndim)))
        xs = (np.asarray(x, np.float64) / s).reshape(-1, weight.size)
        sr = s.reshape(-1, 1)
        d = xs - xs.mean(axis=1, keepdims=True)
        d = d - d.mean(axis=1, keepdims=True)  # the corrected two-pass mean: exact centring on offset rows
        var = (d * d).sum(axis=1, keepdims=True) / (weight.size - _ddof)
        if _eps_std:
            xh = d * sr / (np.sqrt(var) * sr + eps)
        else:
            xh = d / np.sqrt(var + eps / sr / sr)
        xh = np.where(d == 0, 0.0, xh)
    return _finish(xh * weight.reshape(-1).astype(np.float64) + bias.reshape(-1), x.shape, x.dtype)


def layer_norm_backward(dy, x, weight, bias, eps=1e-5, *, _drop=""):
    """A correct LayerNorm backward in float64 (``_drop="var"`` / ``"mean"`` plants a missing dx term)."""
    x2 = np.asarray(x, np.float64).reshape(-1, weight.size)
    dy2 = np.asarray(dy, np.float64).reshape(-1, weight.size)
    h = weight.size
    with np.errstate(all="ignore"):
        s = _pow2_scale(x2, 1)
        d = x2 / s - (x2 / s).mean(axis=1, keepdims=True)
        d = d - d.mean(axis=1, keepdims=True)
        # rstd of x / s in long double (eps / s^2 underflows in float64 for s near float64's max)
        r = 1 / np.sqrt((d * d).sum(axis=1, keepdims=True).astype(np.longdouble) / h + eps / np.longdouble(s) ** 2)
        xh = np.where(d == 0, 0.0, (d * r).astype(np.float64))
        r = (r / s).astype(np.float64)
    g = dy2 * weight.reshape(-1)
    mean_term = 0.0 if _drop == "mean" else g.mean(axis=1, keepdims=True)
    var_term = 0.0 if _drop == "var" else xh * (g * xh).mean(axis=1, keepdims=True)
    bracket = g - mean_term - var_term
    with np.errstate(all="ignore"):
        dx = np.where(bracket == 0, 0.0, r * bracket)  # H = 1 rows: 0 (r may overflow when eps / s^2 underflows)
    dw = (dy2 * xh).sum(axis=0).reshape(weight.shape)
    db = dy2.sum(axis=0).reshape(bias.shape)
    return dx.reshape(x.shape).astype(x.dtype), dw.astype(weight.dtype), db.astype(bias.dtype)


def layer_norm_conventions(x, weight, bias, eps=1e-5, eps_mode="var", correction=0):
    """A correct LayerNorm that honours the ``eps_mode`` and ``correction`` conventions."""
    return layer_norm(x, weight, bias, eps, _eps_std=eps_mode == "std", _ddof=correction)


def eps_on_std(x, weight, bias, eps=1e-5):
    """Mistake: ``(x - mean) / (std + eps)`` (common in tutorials)."""
    return layer_norm(x, weight, bias, eps, _eps_std=True)


def unbiased(x, weight, bias, eps=1e-5):
    """Mistake: the unbiased variance (``torch.Tensor.var()``'s default), divided by H - 1."""
    return layer_norm(x, weight, bias, eps, _ddof=1)


def one_pass(x, weight, bias, eps=1e-5):
    """Mistake: ``var = E[x^2] - E[x]^2`` in x's precision (float32 for 16-bit input; scaled by a power of two
    first, so that only the cancellation bites)."""
    f = np.float64 if x.dtype == np.float64 else np.float32
    ax = tuple(range(x.ndim - weight.ndim, x.ndim))
    xf = np.asarray(x, np.float64)
    with np.errstate(all="ignore"):
        s = _pow2_scale(xf, ax)
        xs = (xf / s).astype(f)
        m = xs.mean(axis=ax, keepdims=True, dtype=f)
        var = np.maximum((xs * xs).mean(axis=ax, keepdims=True, dtype=f) - m * m, 0)
        xh = (xs - m).astype(np.float64) / np.sqrt(var.astype(np.float64) + eps / s / s)
        xh = np.where(xs == m, 0.0, xh)
    return (xh * weight + bias).astype(x.dtype)


def squares_in_dtype(x, weight, bias, eps=1e-5):
    """Mistake: two-pass, but the sum of squares in x's dtype (float32 for 16-bit input) without scaling."""
    f = np.float32 if x.dtype.itemsize <= 4 else np.float64
    ax = tuple(range(x.ndim - weight.ndim, x.ndim))
    with np.errstate(all="ignore"):
        xf = np.asarray(x).astype(f)
        d = xf - xf.mean(axis=ax, keepdims=True, dtype=f)
        var = (d * d).mean(axis=ax, keepdims=True, dtype=f)
        xh = d.astype(np.float64) / np.sqrt(var.astype(np.float64) + eps)
    return (xh * weight + bias).astype(x.dtype)


def no_variance_term_backward(dy, x, weight, bias, eps=1e-5):
    """Mistake: LayerNorm dx without its variance term."""
    return layer_norm_backward(dy, x, weight, bias, eps, _drop="var")


def no_mean_term_backward(dy, x, weight, bias, eps=1e-5):
    """Mistake: LayerNorm dx without its mean term."""
    return layer_norm_backward(dy, x, weight, bias, eps, _drop="mean")


def strided(x, weight, bias, eps=1e-5):
    """Mistake: reads x's buffer as if it were C-contiguous."""
    base = x if x.flags.c_contiguous else np.lib.stride_tricks.as_strided(x, x.shape, _c_strides(x))
    return layer_norm(np.array(base), weight, bias, eps)


def last_axis_only(x, weight, bias, eps=1e-5):
    """Mistake: normalizes only the last axis, whatever ``weight.ndim`` says."""
    k = weight.ndim
    lead = x.shape[: x.ndim - k]
    x2 = x.reshape(-1, x.shape[-1])
    ones = np.ones(x.shape[-1], dtype=weight.dtype)
    y = layer_norm(x2, ones, np.zeros_like(ones), eps).astype(np.float64).reshape(*lead, *weight.shape)
    return (y * weight + bias).astype(x.dtype)


def _c_strides(x: np.ndarray) -> tuple[int, ...]:
    st, acc = [], x.itemsize
    for n in reversed(x.shape):
        st.append(acc)
        acc *= n
    return tuple(reversed(st))


# --- RMSNorm: Llama's rounding order -----------------------------------------------------------------


def rms_norm(x, weight, eps=1e-6):
    """A correct RMSNorm: float64 math on x scaled by a power of two, rounded once."""
    ax = tuple(range(x.ndim - weight.ndim, x.ndim))
    xf = np.asarray(x, np.float64)
    with np.errstate(all="ignore"):
        s = _pow2_scale(xf, ax)
        xs = xf / s
        y = xs / np.sqrt((xs * xs).mean(axis=ax, keepdims=True) + eps / s / s) * weight
    return y.astype(x.dtype)


def llama_rms_norm(x, weight, eps=1e-6):
    """HF LlamaRMSNorm's rounding order: ``w * (x.float() * rsqrt(mean(x^2) + eps)).to(x.dtype)`` (the
    normalized value rounded to x's dtype, then the weight multiply in x's dtype); the statistic itself is
    computed robustly (scaled, float64), float64 input stays float64."""
    ax = tuple(range(x.ndim - weight.ndim, x.ndim))
    xf = np.asarray(x, np.float64)
    f = np.float64 if x.dtype == np.float64 else np.float32
    with np.errstate(all="ignore"):
        s = _pow2_scale(xf, ax)
        xs = xf / s
        n = (xs / np.sqrt((xs * xs).mean(axis=ax, keepdims=True) + eps / s / s)).astype(f).astype(x.dtype)
    return (weight.astype(f) * n.astype(f)).astype(x.dtype)


# --- more stand-ins: the causes the diagnoses model, and correct-but-different implementations ---------------


def _axes(x, weight):
    return tuple(range(x.ndim - weight.ndim, x.ndim))


def _ln_f(x, weight, bias, eps, f, *, mean=None, var=None, xhat=None, eps_cast=None):
    """LayerNorm computed in the float dtype ``f`` with pluggable pieces (each a function of the ``f`` rows),
    the result rounded to x's dtype. ``mean(xf) -> m``, ``var(xf, m) -> v``, ``xhat(xf, m, r) -> x̂``."""
    ax = _axes(x, weight)
    with np.errstate(all="ignore"):
        xf = np.asarray(x).astype(f)
        m = xf.mean(axis=ax, keepdims=True, dtype=f) if mean is None else mean(xf, ax)
        d = (xf - m).astype(f)
        v = (d * d).mean(axis=ax, keepdims=True, dtype=f) if var is None else var(xf, m, ax)
        e = f(eps) if eps_cast is None else eps_cast(eps)
        r = (1 / np.sqrt((v + e).astype(f))).astype(f)
        xh = (d * r).astype(f) if xhat is None else xhat(xf, m, r)
        y = (xh * weight.astype(f)).astype(f) + bias.astype(f)
    return np.asarray(y).astype(x.dtype)


def _work(x):
    return np.float64 if x.dtype == np.float64 else np.float32


def _seq_mean(xf, ax):
    """A left-to-right sum in xf's dtype (a loop over the elements, as a naive kernel does), divided by H."""
    f = xf.dtype.type
    n = int(np.prod([xf.shape[a] for a in ax]))
    flat = xf.reshape(*xf.shape[: xf.ndim - len(ax)], n)
    return (
        (np.cumsum(flat, axis=-1, dtype=xf.dtype)[..., -1:] / f(n))
        .astype(xf.dtype)
        .reshape(*xf.shape[: xf.ndim - len(ax)], *([1] * len(ax)))
    )


def two_pass_f32_mean(x, weight, bias, eps=1e-5):
    """Correct but not exact (tinygrad-like): two passes in float32 (float64 for float64 input), the mean a
    sequential float32 sum without a correction. Not one-pass: its variance is from the centred values."""
    return _ln_f(x, weight, bias, eps, _work(x), mean=_seq_mean)


def welford_f32(x, weight, bias, eps=1e-5):
    """Correct but not exact: Welford's single-pass update of the mean and M2 in float32 (float64 for float64
    input) -- a stable one-pass algorithm, which must not be taken for E[x^2] - E[x]^2."""
    f = _work(x)
    ax = _axes(x, weight)
    h = int(np.prod([x.shape[a] for a in ax]))
    xf = np.asarray(x).astype(f).reshape(-1, h)
    m = np.zeros((xf.shape[0], 1), f)
    m2 = np.zeros((xf.shape[0], 1), f)
    with np.errstate(all="ignore"):
        for k in range(h):
            v = xf[:, k : k + 1]
            dlt = (v - m).astype(f)
            m = (m + dlt / f(k + 1)).astype(f)
            m2 = (m2 + dlt * (v - m)).astype(f)
        var = (m2 / f(h)).astype(f)
        r = (1 / np.sqrt(var + f(eps))).astype(f)
        xh = ((xf - m) * r).astype(f).reshape(x.shape)
        y = xh * weight.astype(f) + bias.astype(f)
    return y.astype(x.dtype)


def keras_one_pass(x, weight, bias, eps=1e-5):
    """Mistake (Keras' numpy backend): var = mean(x^2) - mean(x)^2 in float32 (float64 for float64 input), not
    clipped: negative on offset rows, so sqrt(var + eps) is NaN there."""
    return _ln_f(
        x, weight, bias, eps, _work(x),
        var=lambda xf, m, ax: ((xf * xf).mean(axis=ax, keepdims=True, dtype=xf.dtype) - m * m).astype(xf.dtype),
    )  # fmt: skip


def flax_one_pass(x, weight, bias, eps=1e-5):
    """Mistake (Flax's use_fast_variance): var = max(0, mean(x^2) - mean(x)^2) in float32 (float64 for float64)."""
    return _ln_f(
        x, weight, bias, eps, _work(x),
        var=lambda xf, m, ax: np.maximum(
            (xf * xf).mean(axis=ax, keepdims=True, dtype=xf.dtype) - m * m, xf.dtype.type(0)
        ).astype(xf.dtype),
    )  # fmt: skip


def xr_minus_mr(x, weight, bias, eps=1e-5):
    """Mistake: x̂ = x * rstd - mean * rstd in float32 (a fused 'scale and shift' form), the statistics correct."""
    f = _work(x)
    return _ln_f(
        x, weight, bias, eps, f,
        mean=lambda xf, ax: np.asarray(x, np.float64).mean(axis=ax, keepdims=True).astype(f),
        xhat=lambda xf, m, r: ((xf * r).astype(f) - (m * r).astype(f)).astype(f),
    )  # fmt: skip


def float32_for_float64(x, weight, bias, eps=1e-5):
    """Mistake (x.float(), JAX without x64): every dtype computed in float32 by a careful algorithm (scaled,
    corrected two-pass mean), the result cast back to x's dtype."""
    if x.dtype != np.float64:
        return layer_norm(x, weight, bias, eps)
    x32 = np.asarray(x).astype(np.float32)
    y = layer_norm(x32, weight.astype(np.float32), bias.astype(np.float32), float(np.float32(eps)))
    return y.astype(np.float64)


def float32_for_float64_returns_float32(x, weight, bias, eps=1e-5):
    """Mistake (a float32 dtype policy): float64 input computed in float32 and *returned* as float32."""
    y = float32_for_float64(x, weight, bias, eps)
    return y.astype(np.float32) if x.dtype == np.float64 else y


def eps_rounded_to_float32(x, weight, bias, eps=1e-5):
    """Mistake (ONNX's FLOAT epsilon attribute): eps rounded to float32 before use; otherwise correct."""
    return layer_norm(x, weight, bias, float(np.float32(eps)))


def eps_fixed(x, weight, bias, eps=1e-5):
    """Mistake: ignores the eps it is given and uses 1e-5."""
    return layer_norm(x, weight, bias, 1e-5)


def saved_stats_16bit_backward(dy, x, weight, bias, eps=1e-5):
    """Mistake (PyTorch's float16/bfloat16 CPU LayerNorm): the backward from mean and rstd stored in x's 16-bit
    dtype; the rest in float64."""
    x2 = np.asarray(x, np.float64).reshape(-1, weight.size)
    dy2 = np.asarray(dy, np.float64).reshape(-1, weight.size)
    m = x2.mean(axis=1, keepdims=True)
    m = m + (x2 - m).mean(axis=1, keepdims=True)
    r = 1 / np.sqrt(((x2 - m) ** 2).mean(axis=1, keepdims=True) + eps)
    if x.dtype.itemsize == 2:
        m = m.astype(x.dtype).astype(np.float64)
        r = r.astype(x.dtype).astype(np.float64)
    xh = (x2 - m) * r
    g = dy2 * weight.reshape(-1)
    dx = r * (g - g.mean(axis=1, keepdims=True) - xh * (g * xh).mean(axis=1, keepdims=True))
    dw = (dy2 * xh).sum(axis=0).reshape(weight.shape)
    db = dy2.sum(axis=0).reshape(bias.shape)
    return dx.reshape(x.shape).astype(x.dtype), dw.astype(weight.dtype), db.astype(bias.dtype)


def backward_two_of_three(dy, x, weight, bias, eps=1e-5):
    """Mistake: the backward returns (dx, dweight) and forgets dbias."""
    return layer_norm_backward(dy, x, weight, bias, eps)[:2]


def correct_but_float32_out(x, weight, bias, eps=1e-5):
    """Mistake: correct values, returned as float32 whatever x's dtype (for 16-bit x more precise, wrong dtype)."""
    y = layer_norm(x, weight, bias, eps)
    return np.asarray(y, np.float64).astype(np.float32) if x.dtype.itemsize == 2 else y


def flattened(x, weight, bias, eps=1e-5):
    """Mistake: returns y flattened to one dimension (the values right)."""
    return layer_norm(x, weight, bias, eps).reshape(-1)


def nearly_correct_float64(x, weight, bias, eps=1e-5):
    """Correct float64 math with a small error of its own (y * (1 + 1e-13) in float64): fails float64 cells by
    ~450 ulps, and is not float32 math."""
    y = layer_norm(x, weight, bias, eps)
    return (y.astype(np.float64) * (1 + 1e-13)).astype(x.dtype) if x.dtype == np.float64 else y


def strided_eps_on_std(x, weight, bias, eps=1e-5):
    """Mistake: eps on the std; a strided x is read correctly (its failures there are eps's, not strides')."""
    return eps_on_std(np.asarray(x), weight, bias, eps)


def mixed_causes(x, weight, bias, eps=1e-5):
    """Two causes in two dtypes: float64 input computed in float32; float32 input by Flax's one-pass variance;
    16-bit input correct."""
    if x.dtype == np.float64:
        return float32_for_float64(x, weight, bias, eps)
    if x.dtype == np.float32:
        return flax_one_pass(x, weight, bias, eps)
    return layer_norm(x, weight, bias, eps)


# --- RMSNorm stand-ins --------------------------------------------------------------------------------------


def llama_in_float16_only(x, weight, eps=1e-6):
    """Llama's rounding order for float16 input, one rounding for the other dtypes (per-dtype naming)."""
    return llama_rms_norm(x, weight, eps) if x.dtype == np.float16 else rms_norm(x, weight, eps)


def rms_float32_for_float64(x, weight, eps=1e-6):
    """Mistake (tinygrad's x.float()): RMSNorm of every dtype in float32, cast back to x's dtype."""
    x32 = np.asarray(x).astype(np.float32)
    ax = _axes(x, weight)
    with np.errstate(all="ignore"):
        ms = (x32 * x32).mean(axis=ax, keepdims=True, dtype=np.float32)
        y = x32 * (1 / np.sqrt(ms + np.float32(eps))).astype(np.float32) * weight.astype(np.float32)
    return y.astype(x.dtype)


def rms_all_in_dtype(x, weight, eps=1e-6):
    """Mistake for 16-bit input: every operation in x's dtype (sums accumulated in float32, rounded once), like
    casting='none'; float32/float64 input computed correctly."""
    if x.dtype.itemsize != 2:
        return rms_norm(x, weight, eps)
    t = x.dtype
    ax = _axes(x, weight)
    with np.errstate(all="ignore"):
        sq = (x * x).astype(t)
        ms = (sq.astype(np.float64).sum(axis=ax, keepdims=True) / np.prod([x.shape[a] for a in ax])).astype(t)
        r = (1 / np.sqrt((ms.astype(np.float64) + eps).astype(t).astype(np.float64))).astype(t)
        y = (x * r).astype(t)
        return (y * weight.astype(t)).astype(t)


# --- LayerNorms as people write them (issue 46): two causes in one kernel, correct float64 math -----------------


def tutorial_layer_norm(x, weight, bias, eps=1e-5):
    """The tutorial LayerNorm: ``w * (x - x.mean()) / (x.std() + eps) + b`` in float32 math (``x.float()``, float64
    input too), ``x.std()`` being torch's unbiased estimator (NumPy's two-pass ``std`` with ``ddof=1``)."""
    ax = _axes(x, weight)
    with np.errstate(all="ignore"):
        xf = np.asarray(x).astype(np.float32)
        m = xf.mean(axis=ax, keepdims=True, dtype=np.float32)
        s = xf.std(axis=ax, keepdims=True, ddof=1, dtype=np.float32)
        y = (xf - m) / (s + np.float32(eps)) * weight.astype(np.float32) + bias.astype(np.float32)
    return y.astype(x.dtype)


def float64_layer_norm(x, weight, bias, eps=1e-5):
    """Correct, the normal way: two passes in float64 (every dtype), the row scaled by a power of two first (so that
    its squares cannot overflow or underflow), ``(x - mean) * rstd * w + b``, rounded once to x's dtype. Not exact:
    the float64 mean is not corrected, so float64 rows with a large offset are off by more than the budget."""
    ax = _axes(x, weight)
    with np.errstate(all="ignore"):
        xf = np.asarray(x, np.float64)
        s = _pow2_scale(xf, ax)
        xs = xf / s
        d = xs - xs.mean(axis=ax, keepdims=True)
        r = 1 / np.sqrt((d * d).mean(axis=ax, keepdims=True) + eps / s / s)
        xh = np.where(d == 0, 0.0, d * r)  # a row without spread: x̂ = 0 (r overflows where eps / s^2 underflows)
        y = xh * weight.astype(np.float64) + bias.astype(np.float64)
    return y.astype(x.dtype)


def float64_layer_norm_backward(dy, x, weight, bias, eps=1e-5):
    """The backward of :func:`float64_layer_norm` in float64: ``dx = r (g - mean(g) - x̂ mean(g x̂))``, ``g = dy w``."""
    h = weight.size
    with np.errstate(all="ignore"):
        x2 = np.asarray(x, np.float64).reshape(-1, h)
        dy2 = np.asarray(dy, np.float64).reshape(-1, h)
        s = _pow2_scale(x2, 1)
        d = x2 / s - (x2 / s).mean(axis=1, keepdims=True)
        # rstd of the scaled row in long double: eps / s^2 underflows in float64 for s near float64's max
        rs = 1 / np.sqrt((d * d).mean(axis=1, keepdims=True).astype(np.longdouble) + eps / np.longdouble(s) ** 2)
        xh = np.where(d == 0, 0.0, (d * rs).astype(np.float64))
        r = (rs / s).astype(np.float64)
        g = dy2 * weight.reshape(-1).astype(np.float64)
        dx = r * (g - g.mean(axis=1, keepdims=True) - xh * (g * xh).mean(axis=1, keepdims=True))
    dw = (dy2 * xh).sum(axis=0).reshape(weight.shape)
    db = dy2.sum(axis=0).reshape(bias.shape)
    return dx.reshape(x.shape).astype(x.dtype), dw.astype(weight.dtype), db.astype(bias.dtype)


def np_var_layer_norm(x, weight, bias, eps=1e-5, *, _ddof=0):
    """Correct but not exact: ``np.var`` (two passes, NumPy's pairwise sums) in float32 (float64 for float64 input),
    the mean uncorrected."""
    f = _work(x)
    ax = _axes(x, weight)
    with np.errstate(all="ignore"):
        xf = np.asarray(x).astype(f)
        m = xf.mean(axis=ax, keepdims=True, dtype=f)
        v = xf.var(axis=ax, keepdims=True, dtype=f, ddof=_ddof)
        y = (xf - m) / np.sqrt(v + f(eps)) * weight.astype(f) + bias.astype(f)
    return y.astype(x.dtype)


def np_var_unbiased_layer_norm(x, weight, bias, eps=1e-5):
    """:func:`np_var_layer_norm` with ``ddof=1`` (H - 1): the same algorithm, checked with ``reference={"correction":
    1}``."""
    return np_var_layer_norm(x, weight, bias, eps, _ddof=1)


def batch_dependent_layer_norm(x, weight, bias, eps=1e-5):
    """Mistake (vLLM's batch-invariance bug): the row sums run in another order when the batch has more than 8 rows
    (a kernel choosing its reduction from the number of rows), so a row's bits depend on the batch it is in."""
    f = _work(x)
    h = weight.size
    xf = np.asarray(x).astype(f).reshape(-1, h)
    order = xf if xf.shape[0] <= 8 else xf[:, ::-1]
    with np.errstate(all="ignore"):
        m = (np.cumsum(order, axis=1, dtype=f)[:, -1:] / f(h)).astype(f)
        d = (xf - m).astype(f)
        v = (np.cumsum((d * d)[:, ::-1] if xf.shape[0] > 8 else d * d, axis=1, dtype=f)[:, -1:] / f(h)).astype(f)
        y = d / np.sqrt(v + f(eps)) * weight.reshape(-1).astype(f) + bias.reshape(-1).astype(f)
    return y.reshape(x.shape).astype(x.dtype)
