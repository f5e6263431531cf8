"""The DyT op (Dynamic Tanh): its spec (math in :mod:`pynorm.reference.dyt`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ._spec import ElementwiseVariant, OpSpec, Param


@dataclass(frozen=True, eq=False)
class DyTCtx:
    """What :func:`backward` needs: ``x`` and the parameters (``alpha`` a ``(1,)`` array)."""

    x: Any
    alpha: Any
    weight: Any
    bias: Any


class DyTGrads(NamedTuple):
    """Gradients of DyT; ``dweight``/``dbias`` are None when there was no weight/bias."""

    dx: Any
    dalpha: Any
    dweight: Any
    dbias: Any


def sech2(z: np.ndarray) -> np.ndarray:
    """``1 - tanh(z)^2`` to full relative accuracy at every ``z``: ``4 s / (1 + s)^2``, ``s = exp(-2|z|)``."""
    s = np.exp(-2 * np.abs(z))
    return 4 * s / ((1 + s) * (1 + s))  # type: ignore[no-any-return]


def term_scales(x2: np.ndarray, arrays: Mapping[str, Any], dy2: np.ndarray, options: Mapping[str, Any]) -> dict:
    """``y``: ``|w| |tanh z| + |b|`` (``z = alpha x``); ``dx``: ``|alpha sech^2(z) G|`` (``G = w dy``);
    ``dalpha``: ``sum |x sech^2(z) G|``; ``dweight``: ``sum |dy tanh z|``; ``dbias``: ``sum |dy|``."""
    wide = np.longdouble
    x = x2.astype(wide)
    dy = dy2.astype(wide)
    alpha = wide(float(np.asarray(arrays["alpha"], np.float64).reshape(-1)[0]))
    w, b = arrays.get("weight"), arrays.get("bias")
    wv = np.ones(x2.shape[1], wide) if w is None else np.abs(np.asarray(w, np.float64)).astype(wide)
    bv = 0 if b is None else np.abs(np.asarray(b, np.float64)).astype(wide)
    z = alpha * x
    t = np.abs(np.tanh(z))
    gs = np.abs(dy) * wv * sech2(z)
    out = {
        "y": wv * t + bv,
        "dx": abs(alpha) * gs,
        "dalpha": (gs * np.abs(x)).sum().reshape(1),
        "dweight": (np.abs(dy) * t).sum(axis=0),
        "dbias": np.abs(dy).sum(axis=0),
    }
    return {k: np.asarray(v, dtype=np.float64) for k, v in out.items()}


_DYT_DOC = r"""DyT ("Transformers without Normalization", 2025): ``y = w * tanh(alpha * x) + b``, element-wise.

``alpha`` is a learnable scalar (a 0-d or ``(1,)`` array, finite; the paper starts it at 0.5);
``weight``/``bias`` per-feature (shape ``x.shape[axis:]``). Returns ``(y, ctx)`` for
:func:`dyt_backward`.
"""

_DYT_BACKWARD_DOC = r"""DyT backward: ``DyTGrads(dx, dalpha, dweight, dbias)``.

With :math:`z = \alpha x`, :math:`G = w\,dy`: :math:`dx = \alpha\,\mathrm{sech}^2(z)\,G`,
:math:`d\alpha = \sum x\,\mathrm{sech}^2(z)\,G`, :math:`dw = \sum_{rows} dy\tanh z`,
:math:`db = \sum_{rows} dy`; :math:`\mathrm{sech}^2 z` is computed without cancellation
(:math:`4s/(1+s)^2`, :math:`s = e^{-2|z|}`), accurate where ``tanh`` saturates.
"""

SPEC = OpSpec(
    name="dyt",
    doc=_DYT_DOC,
    backward_doc=_DYT_BACKWARD_DOC,
    params=(
        Param("alpha", "scalar", 0.5, "learnable scalar inside the tanh (the paper starts it at 0.5)", True, True),
        Param("weight", "feature", 1.0, "per-feature scale"),
        Param("bias", "feature", 0.0, "per-feature shift"),
    ),
    options=(),
    grads=DyTGrads,
    ctx=DyTCtx,
    variant=ElementwiseVariant("tanh"),
    term_scales=term_scales,
    summary="y = w * tanh(alpha * x) + b",
)
