"""The RMSNorm op: its spec (math in :mod:`pynorm.reference.rms_norm`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ._spec import OpSpec, Option, Param, StatsVariant, check_eps, check_offset, one_of
from .fp_quant import QUANTIZE, QUANTIZE_RESULT_DOC, quantize_result
from .layer_norm import CASTINGS, widened


@dataclass(frozen=True, eq=False)
class RMSNormCtx:
    """What :func:`backward` needs. Every backend fills the same fields.

    Attributes
    ----------
    x : (R, H) array, the input as given to forward (not copied).
    weight : (H,) array or None.
    rstd : (R,) array, per-row ``r``; float32 or wider.
    eps, weight_offset, casting : the conventions used.
    """

    x: Any
    weight: Any
    rstd: Any
    eps: float
    weight_offset: float
    casting: str = "fp32"


class RMSNormGrads(NamedTuple):
    """Gradients of RMSNorm; ``dweight`` is None when there was no weight."""

    dx: Any
    dweight: Any


def term_scales(x2: np.ndarray, params: Mapping[str, Any], dy2: np.ndarray, options: Mapping[str, Any]) -> dict:
    """Magnitude of the terms each RMSNorm output is computed from.

    With ``x̂ = x r`` and ``g = dy (w + o)``: ``y``: ``|x̂| |w + o|``; ``dx``:
    ``r (|g| + |x̂| mean|g x̂|)``; ``dweight``: ``sum_rows |dy x̂|`` (``x̂`` has no cancellation).
    """
    x, dy, weff, g = widened(x2, params, dy2, options)
    r = 1 / np.sqrt((x * x).mean(axis=1, keepdims=True) + options.get("eps", 1e-6))
    xhat = np.abs(x * r)
    out = {
        "y": xhat * np.abs(weff),
        "dx": r * (g + xhat * (g * xhat).mean(axis=1, keepdims=True)),
        "dweight": np.abs(dy * xhat).sum(axis=0),
    }
    return {key: np.asarray(v, dtype=np.float64) for key, v in out.items()}


OPTIONS = (
    Option("eps", 1e-6, check_eps, "added to the mean square inside the root (>= 0)"),
    Option("weight_offset", 0.0, check_offset, "o in (w + o): 1.0 for Gemma's (1 + w)"),
    Option("casting", "fp32", one_of(*CASTINGS, doc="the rounding sequence"), "where values are rounded"),
)
#: the conventions the ops built on this one share (``casting`` is this op's own)
CONVENTIONS = OPTIONS[:-1]


_RMS_NORM_DOC = r"""RMSNorm forward; returns ``(y, ctx)`` for :func:`rms_norm_backward`.

.. math::

    r = \Big(\frac{1}{H}\sum x^2 + \epsilon\Big)^{-1/2}, \qquad y = x\, r\, (w + o)

over the normalized dims ``x.shape[axis:]``.
"""

_RMS_NORM_BACKWARD_DOC = r"""RMSNorm backward: ``RMSNormGrads(dx, dweight)``.

With :math:`\hat x = x r` and :math:`g = dy\,(w + o)`:

.. math::

    dx = r\,\big(g - \hat x\, \tfrac{1}{H}\textstyle\sum g \hat x\big), \qquad
    dw = \textstyle\sum_{rows} dy\, \hat x
"""

SPEC = OpSpec(
    name="rms_norm",
    doc=_RMS_NORM_DOC,
    backward_doc=_RMS_NORM_BACKWARD_DOC,
    params=(Param("weight", "feature", 1.0, "per-feature scale (effective scale w + weight_offset)"),),
    options=(*OPTIONS, QUANTIZE),
    result=quantize_result,
    result_doc=QUANTIZE_RESULT_DOC,
    grads=RMSNormGrads,
    ctx=RMSNormCtx,
    variant=StatsVariant("mean_square"),
    term_scales=term_scales,
    cases=({}, {"weight_offset": 1.0}, {"eps": 0.1}),
    summary="y = x / sqrt(mean(x^2) + eps) * (w + o)",
)
