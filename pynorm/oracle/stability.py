r"""What a backward-stable algorithm may lose: the condition of LayerNorm and RMSNorm, per element.

pynorm's contract is stricter than backward stability: the reference is within a few ulps of the *exact* result,
and so must your implementation be to pass a cell. Some cells are hard for every algorithm that is merely
backward stable -- a row ``1e4 + N(0, 1)`` in float32, whose deviations are a ten-thousandth of the values; a
constant row, whose exact ``x̂`` is 0 while ``r = 1/sqrt(eps)`` is large. This module says, per element, how
far a backward-stable algorithm may land from the exact result there, so that the report can tell "a bug" from
"the exact oracle is strict".

A backward-stable algorithm here is one whose result is the exact result for inputs ``x``, ``dy`` and
parameters each perturbed by a relative amount of at most

.. math::

    \gamma = \frac{k u}{1 - k u}, \qquad k = \lceil \log_2 H \rceil + 2,

with ``u`` the unit roundoff of the working precision (float32 for float16, bfloat16 and float32 cells,
float64 for float64 cells): the perturbation of a pairwise (tree) sum of ``H`` terms and of the few
operations around it. The allowance of an element is the first-order bound of the change such perturbations
cause (the problem's componentwise condition number times ``γ``), taken term by term with the triangle
inequality. For LayerNorm, with ``d = x - mean``, ``P = γ |x|``:

.. math::

    \delta\mathrm{mean} \le \overline{P}, \quad
    \delta v \le \tfrac{2}{n} \textstyle\sum_j |d_j| (P_j + \overline{P}), \quad
    \tfrac{\delta r}{r} \le \tfrac{\delta v}{2 (v + \epsilon)}, \quad
    \delta\hat x_i \le r (P_i + \overline{P}) + |\hat x_i| \tfrac{\delta r}{r},

``δy_i <= |w_i| δx̂_i + γ (|x̂_i w_i| + |b_i|)``, and the gradients propagate ``δx̂``, ``δr`` and ``γ |dy w|``
through their formulas the same way. RMSNorm: the same with ``d = x`` and the mean square in place of ``v``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from ..ops import OpSpec
from ._dtypes import unit_roundoff, working_precision
from .grid import Case

__all__ = ["allowances", "perturbation"]


def perturbation(dtype: str, hidden: int) -> float:
    """``γ`` of the module docstring for cells of ``dtype`` with ``hidden`` normalized elements."""
    u = unit_roundoff(working_precision(dtype))
    k = math.ceil(math.log2(max(hidden, 1))) + 2
    return k * u / (1 - k * u)


def _rows(spec: OpSpec, case: Case) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None, int]:
    wide = np.longdouble
    x = np.ascontiguousarray(case.x)
    ax = case.axis % x.ndim
    rows = int(np.prod(x.shape[:ax]))
    x2 = x.reshape(rows, -1).astype(wide)
    h = x2.shape[1]
    named = dict(zip((*spec.input_names, *spec.param_names), case.args, strict=True))
    w = named.get("weight")
    offset = float(case.options.get("weight_offset", 0.0))
    we = (np.ones(h, wide) if w is None else np.asarray(w).reshape(-1).astype(wide)) + offset
    b = named.get("bias")
    bias = None if b is None else np.asarray(b).reshape(-1).astype(wide)
    return x2, case.dy.reshape(rows, -1).astype(wide), we, bias, h


def allowances(spec: OpSpec, case: Case, dtype: str, wanted: Mapping[str, Any]) -> dict[str, np.ndarray] | None:
    """Per output of ``wanted`` (names to shapes), the absolute change a backward-stable algorithm may cause in
    each element (float64 arrays of those shapes); None for an op other than ``layer_norm`` and ``rms_norm``."""
    if spec.name not in ("layer_norm", "rms_norm"):
        return None
    x, dy, we, b, h = _rows(spec, case)
    gam = perturbation(dtype, h)
    opts = case.options
    eps = float(opts.get("eps", 0.0))
    P = gam * np.abs(x)
    with np.errstate(all="ignore"):
        if spec.name == "layer_norm":
            n = h - int(opts.get("correction", 0))
            mean = x.mean(axis=1, keepdims=True)
            d = x - mean
            d = d - d.mean(axis=1, keepdims=True)
            var = (d * d).sum(axis=1, keepdims=True) / n
            s = np.sqrt(var)
            std = opts.get("eps_mode", "var") == "std"
            r = 1 / (s + eps) if std else 1 / np.sqrt(var + eps)
            pbar = P.mean(axis=1, keepdims=True)
            dd = P + pbar
            dvar = 2 * (np.abs(d) * dd).sum(axis=1, keepdims=True) / n
            rel_r = np.where(s > 0, dvar / (2 * s * (s + eps)), np.inf) if std else dvar / (2 * (var + eps))
            if std:
                rel_r = np.where(np.isfinite(rel_r), rel_r, 0.0)
        else:
            n = h
            d = x
            ms = (x * x).mean(axis=1, keepdims=True)
            r = 1 / np.sqrt(ms + eps)
            dd = P
            rel_r = (np.abs(x) * P).mean(axis=1, keepdims=True) * 2 / (2 * (ms + eps))
        xh = d * r
        dxh = r * dd + np.abs(xh) * rel_r
        out: dict[str, Any] = {}
        out["y"] = np.abs(we) * dxh + gam * (np.abs(xh * we) + (0 if b is None else np.abs(b)))
        g = dy * we
        dg = 2 * gam * np.abs(g)
        if spec.name == "layer_norm":
            c = (g * xh).sum(axis=1, keepdims=True) / n
            dc = (dg * np.abs(xh) + np.abs(g) * dxh).sum(axis=1, keepdims=True) / n
            dx = r * (g - g.mean(axis=1, keepdims=True) - xh * c)
            ddx = rel_r * np.abs(dx) + r * (dg + dg.mean(axis=1, keepdims=True) + dxh * np.abs(c) + np.abs(xh) * dc)
        else:
            c = (g * xh).mean(axis=1, keepdims=True)
            dc = (dg * np.abs(xh) + np.abs(g) * dxh).mean(axis=1, keepdims=True)
            dx = r * (g - xh * c)
            ddx = rel_r * np.abs(dx) + r * (dg + dxh * np.abs(c) + np.abs(xh) * dc)
        out["dx"] = ddx
        out["dweight"] = (gam * np.abs(dy * xh) + np.abs(dy) * dxh).sum(axis=0)
        out["dbias"] = gam * np.abs(dy).sum(axis=0)
    result: dict[str, np.ndarray] = {}
    for name, shape in wanted.items():
        if name in out:
            a = np.asarray(out[name], dtype=np.float64)
            a = np.where(np.isnan(a), np.inf, a)
            if a.size == int(np.prod(shape)):
                result[name] = a.reshape(shape)
    return result
