"""The ScaleNorm op: its spec (math in :mod:`pynorm.reference.scale_norm`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from ._spec import OpSpec, Option, Param, StatsVariant, check_eps, one_of


@dataclass(frozen=True, eq=False)
class ScaleNormCtx:
    """What :func:`backward` needs. Every backend fills the same fields.

    Attributes
    ----------
    x : (R, H) array, the input as given to forward.
    g : (1,) array or None.
    rstd : (R,) array, per-row ``r``; float32 or wider.
    floor : (R,) bool array, True where the floor branch (``norm < eps``) was taken.
    eps, eps_mode : the conventions used.
    """

    x: Any
    g: Any
    rstd: Any
    floor: Any
    eps: float
    eps_mode: str


class ScaleNormGrads(NamedTuple):
    """Gradients of ScaleNorm; ``dg`` is None when there was no ``g``."""

    dx: Any
    dg: Any


def term_scales(x2: np.ndarray, arrays: Mapping[str, Any], dy2: np.ndarray, options: Mapping[str, Any]) -> dict:
    """``y``: ``|x̂| |g|`` (``x̂ = x r``: no cancellation); ``dx``: ``r (|G| + |x̂| sum|G x̂|)`` with
    ``G = g dy``; ``dg``: ``sum |dy x̂|``."""
    wide = np.longdouble
    x = x2.astype(wide)
    dy = dy2.astype(wide)
    g = arrays.get("g")
    gv = wide(1.0) if g is None else wide(abs(float(np.asarray(g, np.float64).reshape(-1)[0])))
    s2 = (x * x).sum(axis=1, keepdims=True)
    eps = options.get("eps", 1e-5)
    with np.errstate(divide="ignore"):
        r = 1 / np.maximum(np.sqrt(s2), eps) if options.get("eps_mode", "floor") == "floor" else 1 / np.sqrt(s2 + eps)
    xhat = np.abs(x * r)
    big_g = np.abs(dy) * gv
    out = {
        "y": xhat * gv,
        "dx": r * (big_g + xhat * (big_g * xhat).sum(axis=1, keepdims=True)),
        "dg": np.abs(dy * xhat).sum().reshape(1),
    }
    return {k: np.asarray(v, dtype=np.float64) for k, v in out.items()}


_SCALE_NORM_DOC = r"""ScaleNorm forward (Nguyen & Salazar 2019); returns ``(y, ctx)`` for :func:`scale_norm_backward`.

.. math::

    y = g\,\frac{x}{\max(\lVert x\rVert_2, \epsilon)} \quad (\texttt{eps\_mode="floor"}), \qquad
    y = g\,\frac{x}{\sqrt{\lVert x\rVert_2^2 + \epsilon}} \quad (\texttt{"root"})

over the normalized dims ``x.shape[axis:]``.

Notes
-----
The norm is computed without overflow for magnitudes up to the dtype's max. Gradient: see
:func:`scale_norm_backward`; below the floor ``y = g x / eps`` is linear in ``x``.
"""

_SCALE_NORM_BACKWARD_DOC = r"""ScaleNorm backward: ``ScaleNormGrads(dx, dg)``.

With :math:`r` the row's factor, :math:`\hat x = x r`, :math:`G = g\,dy`: where the norm is active
(``"root"``, or ``"floor"`` with :math:`\lVert x\rVert \ge \epsilon`)
:math:`dx = r\,(G - \hat x \sum G \hat x)`; on the floor branch (:math:`\lVert x\rVert < \epsilon`)
:math:`dx = r\,G`; :math:`dg = \sum dy\,\hat x`. At :math:`\lVert x\rVert = \epsilon` exactly the
norm branch's gradient is used (the one-sided derivative from above).
"""

SPEC = OpSpec(
    name="scale_norm",
    doc=_SCALE_NORM_DOC,
    backward_doc=_SCALE_NORM_BACKWARD_DOC,
    params=(Param("g", "scalar", 1.0, "learnable scalar scale (None means 1; the layer starts it at sqrt(d))"),),
    options=(
        Option("eps", 1e-5, check_eps, "floor of the norm (eps_mode='floor') or added to its square ('root')"),
        Option(
            "eps_mode", "floor", one_of("floor", "root", doc="max(||x||, eps) or sqrt(||x||^2 + eps)"), "eps placement"
        ),
    ),
    grads=ScaleNormGrads,
    ctx=ScaleNormCtx,
    variant=StatsVariant("l2", affine="scalar"),
    term_scales=term_scales,
    cases=({}, {"eps_mode": "root"}, {"eps": 0.5}),
    summary="y = g * x / max(||x||_2, eps)",
)
