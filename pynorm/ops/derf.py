"""The Derf op (Dynamic erf): its spec (math in :mod:`pynorm.reference.derf`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ._spec import ElementwiseVariant, OpSpec, Param


@dataclass(frozen=True, eq=False)
class DerfCtx:
    """What :func:`backward` needs: ``x`` and the parameters (``alpha``, ``shift`` ``(1,)`` arrays)."""

    x: Any
    alpha: Any
    shift: Any
    weight: Any
    bias: Any


class DerfGrads(NamedTuple):
    """Gradients of Derf; ``dweight``/``dbias`` are None when there was no weight/bias."""

    dx: Any
    dalpha: Any
    dshift: Any
    dweight: Any
    dbias: Any


#: terms of the series below ``_SERIES_CUT`` and levels of the continued fraction above it (the reference's erf
#: reaches 5e-19 relative in extended precision: measured against mpmath on [0, 6], ``tests/test_derf.py``)
_SERIES_TERMS = 90
_CF_LEVELS = 60
_SERIES_CUT = 2.5


def erf(z: np.ndarray) -> np.ndarray:
    """``erf(z)`` in ``z``'s (floating) dtype, element-wise, with NumPy alone (NumPy has no erf).

    ``|z| <= 2.5``: ``(2/sqrt(pi)) e^{-z^2} sum_n 2^n z^{2n+1} / (2n+1)!!`` (Abramowitz & Stegun 7.1.6: positive
    terms, no cancellation); above: ``1 - e^{-z^2} / (sqrt(pi) K(z))`` with ``K`` the continued fraction
    ``z + (1/2)/(z + 1/(z + (3/2)/(z + ...)))`` (A&S 7.1.14), evaluated from the bottom. Odd; ``erf(+-inf) = +-1``,
    NaN gives NaN.
    """
    z = np.asarray(z)
    dt = z.dtype.type
    t = np.abs(z)
    with np.errstate(over="ignore", under="ignore", invalid="ignore", divide="ignore"):
        ts = np.minimum(t, dt(_SERIES_CUT))
        t2 = ts * ts
        term = ts.copy()
        acc = ts.copy()
        for n in range(1, _SERIES_TERMS):
            term = term * (2 * t2) / dt(2 * n + 1)
            acc = acc + term
        series = two_over_sqrt_pi(dt) * np.exp(-t2) * acc
        tl = np.maximum(t, dt(_SERIES_CUT))
        k = tl.copy()
        for level in range(_CF_LEVELS, 0, -1):
            k = tl + dt(level / 2) / k
        tail = 1 - np.exp(-tl * tl) * (two_over_sqrt_pi(dt) / 2) / k
        r = np.where(t <= dt(_SERIES_CUT), series, tail)
    return np.copysign(r, z)  # type: ignore[no-any-return]


def two_over_sqrt_pi(dt: Any) -> Any:
    """``2 / sqrt(pi)`` in the scalar type ``dt`` (to extended precision where ``dt`` has it)."""
    return dt("1.128379167095512573896158903121545172")


def erf_prime(z: np.ndarray) -> np.ndarray:
    """``d erf / dz = (2/sqrt(pi)) e^{-z^2}`` (0 where ``z^2`` overflows)."""
    with np.errstate(over="ignore", under="ignore"):
        return two_over_sqrt_pi(z.dtype.type) * np.exp(-(z * z))  # type: ignore[no-any-return]


def _scalar(arrays: Mapping[str, Any], name: str, wide: Any) -> Any:
    return wide(float(np.asarray(arrays[name], np.float64).reshape(-1)[0]))


def term_scales(x2: np.ndarray, arrays: Mapping[str, Any], dy2: np.ndarray, options: Mapping[str, Any]) -> dict:
    """With ``z = alpha x + s``, ``e = erf'(z)``, ``G = w dy``: ``y``: ``|w| (|erf z| + e (|alpha x| + |s|)) + |b|``
    (the argument's two terms, at erf's slope); ``dx``: ``|alpha| e |G|``; ``dalpha``: ``sum |x e G|``;
    ``dshift``: ``sum |e G|``; ``dweight``: ``sum |dy erf z|``; ``dbias``: ``sum |dy|``."""
    wide = np.longdouble
    x = x2.astype(wide)
    dy = dy2.astype(wide)
    alpha, shift = _scalar(arrays, "alpha", wide), _scalar(arrays, "shift", wide)
    w, b = arrays.get("weight"), arrays.get("bias")
    wv = np.ones(x2.shape[1], wide) if w is None else np.abs(np.asarray(w, np.float64)).astype(wide)
    bv = 0 if b is None else np.abs(np.asarray(b, np.float64)).astype(wide)
    z = alpha * x + shift
    e = erf_prime(z)
    f = np.abs(erf(z))
    ge = np.abs(dy) * wv * e
    out = {
        "y": wv * (f + e * (np.abs(alpha * x) + abs(shift))) + bv,
        "dx": abs(alpha) * ge,
        "dalpha": (ge * np.abs(x)).sum().reshape(1),
        "dshift": ge.sum().reshape(1),
        "dweight": (np.abs(dy) * f).sum(axis=0),
        "dbias": np.abs(dy).sum(axis=0),
    }
    return {k: np.asarray(v, dtype=np.float64) for k, v in out.items()}


_DERF_DOC = r"""Derf ("Stronger Normalization-Free Transformers", Chen, Lu, Zhu, Sun & Liu 2025, arXiv 2512.10938):
``y = w * erf(alpha * x + shift) + b``, element-wise.

``alpha`` and ``shift`` are learnable scalars (0-d or ``(1,)`` arrays, finite; a layer starts them at 0.5 and 0);
``weight``/``bias`` per-feature (shape ``x.shape[axis:]``). Returns ``(y, ctx)`` for :func:`derf_backward`.
"""

_DERF_BACKWARD_DOC = r"""Derf backward: ``DerfGrads(dx, dalpha, dshift, dweight, dbias)``.

With :math:`z = \alpha x + s`, :math:`e = \mathrm{erf}'(z) = \tfrac{2}{\sqrt\pi} e^{-z^2}`, :math:`G = w\,dy`:
:math:`dx = \alpha\,e\,G`, :math:`d\alpha = \sum x\,e\,G`, :math:`ds = \sum e\,G`,
:math:`dw = \sum_{rows} dy\,\mathrm{erf}(z)`, :math:`db = \sum_{rows} dy`.
"""

SPEC = OpSpec(
    name="derf",
    doc=_DERF_DOC,
    backward_doc=_DERF_BACKWARD_DOC,
    params=(
        Param("alpha", "scalar", 0.5, "learnable scale inside the erf (a layer starts it at 0.5)", True, True),
        Param("shift", "scalar", 0.0, "learnable shift inside the erf (a layer starts it at 0)", True, True),
        Param("weight", "feature", 1.0, "per-feature scale"),
        Param("bias", "feature", 0.0, "per-feature shift"),
    ),
    options=(),
    grads=DerfGrads,
    ctx=DerfCtx,
    variant=ElementwiseVariant("erf"),
    term_scales=term_scales,
    summary="y = w * erf(alpha * x + shift) + b",
)
