"""Exact LayerNorm and RMSNorm (forward and backward) in multiple precision, with mpmath.

The slow, obviously-correct definitions the reference is tested against (and
that you can test your own kernels against): every input is read as the exact
binary value it holds, all arithmetic runs at ``dps`` decimal digits, and the
results are rounded once to float64. Use small inputs: a few thousand elements
take about a second. Needs ``mpmath`` (``pip install mpmath``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["layer_norm", "rms_norm"]


def _mp(dps: int) -> Any:
    import mpmath

    mpmath.mp.dps = dps
    return mpmath.mp


def _f(a: np.ndarray) -> np.ndarray:
    return np.vectorize(float, otypes=[np.float64])(a)


def _setup(x: np.ndarray, w: np.ndarray | None, eps: float, offset: float, dps: int) -> tuple[Any, ...]:
    """``(mp, eps, we, y, dx, dw)``: the mpmath context at ``dps`` digits, ``eps`` in it, the effective weight
    ``w + offset`` (ones without ``w``), the ``(R, H)`` object arrays of ``y`` and ``dx`` to fill and the ``H`` zero
    sums of ``dweight``."""
    mp = _mp(dps)
    h = x.shape[1]
    offset = mp.mpf(float(offset))
    we = [mp.mpf(float(v)) + offset for v in w] if w is not None else [mp.mpf(1)] * h
    return mp, mp.mpf(float(eps)), we, np.empty(x.shape, dtype=object), np.empty(x.shape, dtype=object), [mp.mpf(0)] * h


def layer_norm(
    x: np.ndarray,
    w: np.ndarray | None,
    b: np.ndarray | None,
    dy: np.ndarray,
    eps: float,
    correction: int = 0,
    eps_mode: str = "var",
    offset: float = 0.0,
    dps: int = 50,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Exact LayerNorm ``(y, dx, dweight, dbias)`` of ``(R, H)`` inputs, rounded to float64 at the end."""
    mp, eps, we, y, dx, dw = _setup(x, w, eps, offset, dps)
    rows, h = x.shape
    db = [mp.mpf(0)] * h
    for i in range(rows):
        xs = [mp.mpf(float(v)) for v in x[i]]
        gs = [mp.mpf(float(v)) for v in dy[i]]
        m = mp.fsum(xs) / h
        d = [v - m for v in xs]
        n = h - correction
        var = mp.fsum(t * t for t in d) / n
        s = mp.sqrt(var)
        r = 1 / mp.sqrt(var + eps) if eps_mode == "var" else 1 / (s + eps)
        xh = [t * r for t in d]
        bb = [mp.mpf(float(v)) for v in b] if b is not None else [mp.mpf(0)] * h
        g = [gs[j] * we[j] for j in range(h)]
        gbar = mp.fsum(g) / h
        gx = mp.fsum(g[j] * xh[j] for j in range(h))
        if eps_mode == "var":
            coef = gx / n
        else:
            coef = gx / (n * s * r) if s > 0 else mp.mpf(0)
        for j in range(h):
            y[i, j] = xh[j] * we[j] + bb[j]
            dx[i, j] = r * (g[j] - gbar - xh[j] * coef)
            dw[j] += gs[j] * xh[j]
            db[j] += gs[j]
    return _f(y), _f(dx), _f(np.array(dw, dtype=object)), _f(np.array(db, dtype=object))


def rms_norm(
    x: np.ndarray, w: np.ndarray | None, dy: np.ndarray, eps: float, offset: float = 0.0, dps: int = 50
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Exact RMSNorm ``(y, dx, dweight)`` of ``(R, H)`` inputs, rounded to float64 at the end."""
    mp, eps, we, y, dx, dw = _setup(x, w, eps, offset, dps)
    rows, h = x.shape
    for i in range(rows):
        xs = [mp.mpf(float(v)) for v in x[i]]
        gs = [mp.mpf(float(v)) for v in dy[i]]
        r = 1 / mp.sqrt(mp.fsum(t * t for t in xs) / h + eps)
        xh = [t * r for t in xs]
        g = [gs[j] * we[j] for j in range(h)]
        c = mp.fsum(g[j] * xh[j] for j in range(h)) / h
        for j in range(h):
            y[i, j] = xh[j] * we[j]
            dx[i, j] = r * (g[j] - xh[j] * c)
            dw[j] += gs[j] * xh[j]
    return _f(y), _f(dx), _f(np.array(dw, dtype=object))
