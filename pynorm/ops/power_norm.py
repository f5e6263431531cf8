"""The signed-power PowerNorm op: its spec (math in :mod:`pynorm.reference.power_norm`)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ..errors import ArgumentError
from ._spec import ElementwiseVariant, OpSpec, Option, Param, check_real


@dataclass(frozen=True, eq=False)
class PowerNormCtx:
    """What :func:`backward` needs: ``x``, the parameters and ``p``."""

    x: Any
    weight: Any
    bias: Any
    p: float


class PowerNormGrads(NamedTuple):
    """Gradients of PowerNorm; ``dweight``/``dbias`` are None when there was no weight/bias."""

    dx: Any
    dweight: Any
    dbias: Any


def check_p(v: Any, name: str) -> float:
    """A finite exponent > 0."""
    p = check_real(v, name)
    if not p > 0:
        raise ArgumentError(f"{name} must be > 0 (a finite exponent), got {v!r}")
    return p


def term_scales(x2: np.ndarray, arrays: Mapping[str, Any], dy2: np.ndarray, options: Mapping[str, Any]) -> dict:
    """``y``: ``|w| |x|^p + |b|``; ``dx``: ``|w p |x|^(p-1) dy|`` (saturated like ``dx``); ``dweight``:
    ``sum |dy| |x|^p``; ``dbias``: ``sum |dy|``."""
    wide = np.longdouble
    p = wide(options.get("p", 0.5))
    a = np.abs(x2.astype(wide))
    dy = np.abs(dy2.astype(wide))
    w, b = arrays.get("weight"), arrays.get("bias")
    wv = np.ones(x2.shape[1], wide) if w is None else np.abs(np.asarray(w, np.float64)).astype(wide)
    bv = 0 if b is None else np.abs(np.asarray(b, np.float64)).astype(wide)
    with np.errstate(divide="ignore", over="ignore"):
        deriv = np.where(a == 0, wide(1.0 if p == 1 else 0.0), p * a ** (p - 1))
        big = float(np.finfo(np.float64).max)
        out = {
            "y": wv * a**p + bv,
            "dx": np.minimum(wv * deriv * dy, big),
            "dweight": (dy * a**p).sum(axis=0),
            "dbias": dy.sum(axis=0),
        }
    return {k: np.asarray(v, dtype=np.float64) for k, v in out.items()}


_POWER_NORM_DOC = r"""The signed-power "PowerNorm" of normalization tutorials: ``y = w * sign(x) * |x|**p + b``,
element-wise.

``axis`` only fixes the parameters' shape (``x.shape[axis:]``); ``p > 0`` is a finite
hyperparameter (default 0.5). This is **not** Shen et al.'s 2020 PowerNorm (a batch norm with
running quadratic means, see ``docs/norms/power_norm.md``): no library implements this signed-power form.

Returns ``(y, ctx)`` for :func:`power_norm_backward`.
"""

_POWER_NORM_BACKWARD_DOC = r"""PowerNorm backward: ``PowerNormGrads(dx, dweight, dbias)``.

:math:`dx = w\,p\,\lvert x\rvert^{p-1} dy` for :math:`x \ne 0`; at :math:`x = 0` the value 0 is
used for :math:`p < 1` (the derivative is infinite there: a subgradient choice), ``w dy`` for
:math:`p = 1`, 0 for :math:`p > 1`; where the exact ``dx`` exceeds ``x``'s dtype it saturates at
the largest finite value. :math:`dw = \sum_{rows} dy\,\mathrm{sign}(x)\lvert x\rvert^p`,
:math:`db = \sum_{rows} dy`.
"""

SPEC = OpSpec(
    name="power_norm",
    doc=_POWER_NORM_DOC,
    backward_doc=_POWER_NORM_BACKWARD_DOC,
    params=(Param("weight", "feature", 1.0, "per-feature scale"), Param("bias", "feature", 0.0, "per-feature shift")),
    options=(Option("p", 0.5, check_p, "the exponent, a finite p > 0 (a hyperparameter, no gradient)"),),
    grads=PowerNormGrads,
    ctx=PowerNormCtx,
    variant=ElementwiseVariant("signed_power"),
    term_scales=term_scales,
    cases=({}, {"p": 1.0}, {"p": 2.0}, {"p": 0.25}, {"p": math.pi / 4}),
    summary="y = w * sign(x) * |x|^p + b",
)
