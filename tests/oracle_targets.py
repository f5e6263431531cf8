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
