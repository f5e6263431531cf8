"""The LayerNorm op: its spec (math in :mod:`pynorm.reference.layer_norm`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ..errors import ArgumentError
from ._spec import OpSpec, Option, Param, StatsVariant, check_eps, check_offset, one_of
from .fp_quant import QUANTIZE, QUANTIZE_RESULT_DOC, quantize_result

#: the casting policies, the default first
CASTINGS = ("fp32", "gemma", "llama", "t5", "apex", "none")


@dataclass(frozen=True, eq=False)
class CenteredStats:
    """The fields that follow the normalized row in the ctx of every LayerNorm (:class:`CenteredCtx`'s after
    ``x``, the fused add + LayerNorm's after ``h``).

    A ctx lists this class first among its bases and the class of its row second: dataclass fields come in
    reverse MRO order, so the row is the ctx's first field and these follow it.

    Attributes
    ----------
    weight, bias : the parameters as given, or None.
    mean, rstd : (R,) arrays, per-row mean and ``r``.
    eps, correction, eps_mode, weight_offset : the LayerNorm conventions used.
    """

    weight: Any
    bias: Any
    mean: Any
    rstd: Any
    eps: float
    correction: int
    eps_mode: str
    weight_offset: float


@dataclass(frozen=True, eq=False)
class _Input:
    x: Any


@dataclass(frozen=True, eq=False)
class CenteredCtx(CenteredStats, _Input):
    """The fields of the ctx of every LayerNorm of ``x`` (this op's, the modality and the quantizing ones'),
    in this order, before those of the op's own.

    Attributes
    ----------
    x : (R, H) array, the input as given to forward (not copied).
    weight, bias, mean, rstd, eps, correction, eps_mode, weight_offset : :class:`CenteredStats`.
    """


@dataclass(frozen=True, eq=False)
class LayerNormCtx(CenteredCtx):
    """What :func:`backward` needs. Every backend fills the same fields.

    Attributes
    ----------
    x : (R, H) array, the input as given to forward (not copied).
    weight, bias : (H,) arrays or None.
    mean, rstd : (R,) arrays, per-row mean and ``r`` (see module doc); float32 or
        wider (the reference keeps its working precision).
    eps, correction, eps_mode, weight_offset, casting : the conventions used.
    """

    casting: str = "fp32"


class LayerNormGrads(NamedTuple):
    """Gradients of LayerNorm; ``dweight``/``dbias`` are None when there was no weight/bias."""

    dx: Any
    dweight: Any
    dbias: Any


def _check(options: Mapping[str, Any], hidden: int) -> None:
    if options["correction"] == 1 and hidden == 1:
        raise ArgumentError("correction=1 needs more than one normalized element per row (got H = 1)")


def widened(
    x2: np.ndarray, params: Mapping[str, Any], dy2: np.ndarray, options: Mapping[str, Any]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Where the term scales of LayerNorm and RMSNorm start: ``x`` and ``dy`` in extended precision (float64
    squares of huge float64 inputs would overflow), the float64 effective weight ``w + o`` (ones without a
    weight) and ``g = |dy (w + o)|``."""
    wide = np.longdouble
    x = x2.astype(wide)
    dy = dy2.astype(wide)
    h = x.shape[1]
    w = params.get("weight")
    weff = np.ones(h) if w is None else np.asarray(w, np.float64).reshape(h) + options.get("weight_offset", 0.0)
    return x, dy, weff, np.abs(dy * weff.astype(wide))


def term_scales(x2: np.ndarray, params: Mapping[str, Any], dy2: np.ndarray, options: Mapping[str, Any]) -> dict:
    """Magnitude of the terms each LayerNorm output is computed from (float64 ``(R, H)`` / ``(H,)`` arrays).

    With ``x̂ = (x - mean) r``, ``g = dy (w + o)``, ``n = H - correction`` and ``s`` the row's
    standard deviation:

    * ``y``: ``(|x̂| + s r) |w + o| + |b|`` -- the deviations at the row's own unit (``s r <= 1``),
      not at the offset ``|mean|``: a common offset of ``1e4`` must not loosen the yardstick; float32
      math centres with an error of a float32 ulp of the deviations, all a one-rounding result can promise;
    * ``dx``: ``r (|g| + mean|g| + |x̂| sum|g x̂| k / n)`` (``k = 1/(s r)`` in ``eps_mode="std"``);
    * ``dweight``: ``sum_rows |dy| (|x̂| + s r)`` -- each term ``dy x̂`` carries ``x̂``'s error, which is at
      the row's own unit like ``y``'s (a column whose ``x̂`` is near 0 in every row would otherwise be
      judged on the rounding of a cancelled difference);
    * ``dbias``: ``sum_rows |dy|``.
    """
    x, dy, weff, g = widened(x2, params, dy2, options)
    h = x.shape[1]
    eps = options.get("eps", 1e-5)
    n = h - options.get("correction", 0)
    d = x - x.mean(axis=1, keepdims=True)
    s = np.sqrt((d * d).sum(axis=1, keepdims=True) / n)
    std_mode = options.get("eps_mode", "var") == "std"
    with np.errstate(divide="ignore", invalid="ignore"):
        r = 1 / (s + eps) if std_mode else 1 / np.sqrt(s * s + eps)
        k = np.where(s > 0, 1 / (s * r), 0.0) if std_mode else 1.0
    xhat = np.abs(d * r)
    b = params.get("bias")
    bias = 0 if b is None else np.abs(np.asarray(b, dtype=np.float64).reshape(h))
    out = {
        "y": (xhat + s * r) * np.abs(weff) + bias,
        "dx": r * (g + g.mean(axis=1, keepdims=True) + xhat * (g * xhat).sum(axis=1, keepdims=True) * k / n),
        "dweight": (np.abs(dy) * (xhat + s * r)).sum(axis=0),
        "dbias": np.abs(dy).sum(axis=0),
    }
    return {key: np.asarray(v, dtype=np.float64) for key, v in out.items()}


OPTIONS = (
    Option("eps", 1e-5, check_eps, "added to the variance inside the root (>= 0)"),
    Option("correction", 0, one_of(0, 1, doc="0: biased variance, 1: unbiased"), "variance divisor H - c"),
    Option("eps_mode", "var", one_of("var", "std", doc="sqrt(var + eps) or std + eps"), "where eps goes"),
    Option("weight_offset", 0.0, check_offset, "o in (w + o): 1.0 for Gemma / TE zero-centred gamma"),
    Option("casting", "fp32", one_of(*CASTINGS, doc="the rounding sequence"), "where values are rounded"),
)
#: the conventions the ops built on this one share (``casting`` is this op's own)
CONVENTIONS = OPTIONS[:-1]


_LAYER_NORM_DOC = r"""LayerNorm forward; returns ``(y, ctx)`` for :func:`layer_norm_backward`.

.. math::

    \mu = \mathrm{mean}(x), \quad v = \frac{\sum (x - \mu)^2}{H - c}, \quad
    y = \frac{x - \mu}{\sqrt{v + \epsilon}}\,(w + o) + b

over the normalized dims ``x.shape[axis:]`` (``H`` elements per row).

Notes
-----
The reference backend computes in float64 (extended precision for float64
input) and rounds once; see ``docs/numerics.md`` for the accuracy promise.
"""

_LAYER_NORM_BACKWARD_DOC = r"""LayerNorm backward: ``LayerNormGrads(dx, dweight, dbias)`` for upstream gradient ``dy``.

With :math:`\hat x = (x - \mu) r`, :math:`g = dy\,(w + o)` and :math:`n = H - c`:

.. math::

    dx = r\,\big(g - \bar g - \hat x\, \textstyle\sum g \hat x / n\big), \quad
    dw = \textstyle\sum_{rows} dy\, \hat x, \quad db = \textstyle\sum_{rows} dy

(``eps_mode="std"`` divides the last term of ``dx`` by :math:`s r` instead;
see :mod:`pynorm.reference.layer_norm`). ``dweight``/``dbias`` are None where
forward had no weight/bias; they have the parameters' shapes and dtypes.
``dy`` must have ``x``'s shape and dtype. ``dx_out`` optionally receives ``dx``.
"""

SPEC = OpSpec(
    name="layer_norm",
    doc=_LAYER_NORM_DOC,
    backward_doc=_LAYER_NORM_BACKWARD_DOC,
    params=(
        Param("weight", "feature", 1.0, "per-feature scale (effective scale w + weight_offset)"),
        Param("bias", "feature", 0.0, "per-feature shift"),
    ),
    options=(*OPTIONS, QUANTIZE),
    result=quantize_result,
    result_doc=QUANTIZE_RESULT_DOC,
    grads=LayerNormGrads,
    ctx=LayerNormCtx,
    variant=StatsVariant("centered"),
    term_scales=term_scales,
    check=_check,
    cases=(
        {},
        {"correction": 1},
        {"eps_mode": "std"},
        {"eps_mode": "std", "correction": 1, "weight_offset": 1.0},
        {"weight_offset": 1.0, "eps": 0.1},
    ),
    summary="y = (x - mean) / sqrt(var + eps) * (w + o) + b",
)
