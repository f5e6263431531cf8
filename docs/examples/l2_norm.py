r"""A new op in one file, added at run time: ``l2_norm``, ScaleNorm's statistic with a per-feature weight.

.. math::

    y = w\,\frac{x}{\max(\lVert x\rVert_2, \epsilon)} \quad (\texttt{eps\_mode="floor"}), \qquad
    y = w\,\frac{x}{\sqrt{\lVert x\rVert_2^2 + \epsilon}} \quad (\texttt{"root"})

Its variant, ``StatsVariant("l2", affine="vector")``, is a combination of choices the statistics family has
already (ScaleNorm's ``"l2"`` statistic, LayerNorm's ``"vector"`` affine source): the fast backends serve it with
no code of their own (numba specialises its kernels on the variant; cupy compiles
``<T, W, pynorm::SumSquare, pynorm::Vector<false>, pynorm::Plain>`` on first use). What is the op's own: the spec
(below) and the math, once (:func:`forward`, :func:`backward`). ``docs/adding_an_op.md`` walks through it;
``tests/test_worked_example.py`` runs pynorm's generic test suites on it, on every backend.

Run it: ``python docs/examples/l2_norm.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from pynorm.ops import OpSpec, Option, Param, StatsVariant, check_eps, one_of
from pynorm.reference._common import _ieee, finite_rows, round_to, working_dtype, write_result


@dataclass(frozen=True, eq=False)
class L2NormCtx:
    """What the backward needs; the fields the ``"l2"`` statistic fills (``rstd``, ``floor``) and the options."""

    x: Any
    weight: Any
    rstd: Any
    floor: Any
    eps: float
    eps_mode: str


class L2NormGrads(NamedTuple):
    dx: Any
    dweight: Any


def term_scales(x2: np.ndarray, arrays: Mapping[str, Any], dy2: np.ndarray, options: Mapping[str, Any]) -> dict:
    """The magnitudes the tests measure errors against: ``|x̂| |w|`` for ``y``; ``r (|G| + |x̂| sum|G x̂|)``
    with ``G = |dy w|`` for ``dx``; ``sum_rows |dy x̂|`` for ``dweight``."""
    x, dy = x2.astype(np.longdouble), dy2.astype(np.longdouble)
    w = arrays.get("weight")
    w = np.ones(x.shape[1], np.longdouble) if w is None else np.abs(np.asarray(w, np.longdouble).reshape(-1))
    s2 = (x * x).sum(axis=1, keepdims=True)
    eps = options.get("eps", 1e-5)
    with np.errstate(divide="ignore"):
        r = 1 / np.maximum(np.sqrt(s2), eps) if options.get("eps_mode", "floor") == "floor" else 1 / np.sqrt(s2 + eps)
    xhat = np.abs(x * r)
    g = np.abs(dy) * w
    out = {"y": xhat * w, "dx": r * (g + xhat * (g * xhat).sum(axis=1, keepdims=True)), "dweight": np.abs(dy * xhat)}
    out["dweight"] = out["dweight"].sum(axis=0)
    return {k: np.asarray(v, dtype=np.float64) for k, v in out.items()}


SPEC = OpSpec(
    name="l2_norm",
    params=(Param("weight", "feature", 1.0, "per-feature scale"),),
    options=(
        Option("eps", 1e-5, check_eps, "floor of the norm (eps_mode='floor') or added to its square ('root')"),
        Option("eps_mode", "floor", one_of("floor", "root"), "eps placement"),
    ),
    grads=L2NormGrads,
    ctx=L2NormCtx,
    reference=__name__,  # this module: forward and backward below
    family="stats",
    variant=StatsVariant("l2", affine="vector"),
    term_scales=term_scales,
    cases=({}, {"eps_mode": "root"}, {"eps": 3.0}),
    summary="y = w * x / max(||x||_2, eps)",
)


@_ieee
def forward(
    x: np.ndarray, weight: np.ndarray | None, *, eps: float, eps_mode: str = "floor", out: np.ndarray | None = None
) -> tuple[np.ndarray, L2NormCtx]:
    """The definition, on ``(R, H)`` rows, in the working precision (float64; extended for float64 input)."""
    wp = working_dtype(x.dtype, getattr(weight, "dtype", None))
    xw = x.astype(wp)
    s2 = np.sum(xw * xw, axis=1)
    e = wp.type(eps)
    if eps_mode == "floor":
        n = np.sqrt(s2)
        floor = n < e
        rstd = 1 / np.where(floor, e, n)
    else:
        floor = np.zeros(x.shape[0], dtype=bool)
        rstd = 1 / np.sqrt(s2 + e)
    rstd = finite_rows(rstd, s2)
    y = xw * rstd[:, None]
    if weight is not None:
        y = y * weight.astype(wp)
    return write_result(y, x.dtype, out), L2NormCtx(x, weight, rstd, floor, float(eps), eps_mode)


@_ieee
def backward(dy: np.ndarray, ctx: L2NormCtx, *, dx_out: np.ndarray | None = None) -> L2NormGrads:
    """``dx = r (G - x̂ sum G x̂)`` with ``G = w dy`` (``dx = r G`` on the floor branch); ``dw = sum_rows dy x̂``."""
    x, weight = ctx.x, ctx.weight
    wp = np.result_type(ctx.rstd.dtype, working_dtype(x.dtype, getattr(weight, "dtype", None)))
    rstd = ctx.rstd.astype(wp)
    xhat = x.astype(wp) * rstd[:, None]
    dyw = dy.astype(wp)
    g = dyw * weight.astype(wp) if weight is not None else dyw
    gx = np.sum(g * xhat, axis=1)
    coef = finite_rows(np.where(ctx.floor, wp.type(0), gx), gx)
    dx = rstd[:, None] * (g - xhat * coef[:, None])
    dweight = round_to(np.sum(dyw * xhat, axis=0), weight.dtype) if weight is not None else None
    return L2NormGrads(write_result(dx, x.dtype, dx_out), dweight)


if __name__ == "__main__":
    import pynorm

    pynorm.add_op(SPEC)
    x = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
    w = np.linspace(0.5, 1.5, 16, dtype=np.float32)
    serving = [b.name for b in pynorm.list_backends() if b.available and "l2_norm" in b.ops]
    for backend in serving:
        y, ctx = pynorm.l2_norm_forward(x, w, backend=backend)  # type: ignore[attr-defined]
        g = pynorm.l2_norm_backward(np.ones_like(y), ctx)  # type: ignore[attr-defined]
        print(backend, "row norms of y/w:", np.linalg.norm(y / w, axis=1).round(6), "|dweight|:", abs(g.dweight).max())
