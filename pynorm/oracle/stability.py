r"""What a backward-stable algorithm may lose: the condition of LayerNorm, RMSNorm, GroupNorm, InstanceNorm and
BatchNorm, per element.

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
GroupNorm, InstanceNorm and BatchNorm: LayerNorm's on the values of each statistic (a sample's group, a sample's
channel, a channel over the batch), with each element's channel's weight and bias, the parameters' gradients
summed per channel; normalized with the running statistics (BatchNorm in evaluation mode), ``x - mean_run`` and
``var_run`` perturbed like ``x``. The running statistics a channel op returns have no allowance (their budget is
the exact one).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..ops import OpSpec
from ._dtypes import unit_roundoff, working_precision
from .evaluate import from_ncs, to_ncs
from .grid import Case

__all__ = ["STABILITY_OPS", "allowances", "perturbation"]


def perturbation(dtype: str, hidden: int) -> float:
    """``γ`` of the module docstring for cells of ``dtype`` with ``hidden`` normalized elements."""
    u = unit_roundoff(working_precision(dtype))
    k = math.ceil(math.log2(max(hidden, 1))) + 2
    return k * u / (1 - k * u)


@dataclass
class _View:
    """A cell as rows of one statistic each, in extended precision: ``x``, ``dy``, the effective weight and the
    bias per element (or per feature), and how per-element arrays go back to the outputs' shapes."""

    x: np.ndarray
    dy: np.ndarray
    we: np.ndarray
    b: np.ndarray | None
    n: int  # the variance's divisor
    eps: float
    std: bool  # eps added to the std
    rms: bool  # RMSNorm: no mean
    back: Callable[[np.ndarray], np.ndarray]  # (R, H) -> the layout of x
    params: Callable[[np.ndarray], np.ndarray]  # (R, H) per-element terms -> a parameter's shape (summed)
    running: tuple[np.ndarray, np.ndarray] | None = None  # normalized with (mean, var) of the running statistics


def _row_view(spec: OpSpec, case: Case) -> _View:
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
    opts = case.options
    rms = spec.name == "rms_norm"
    n = h if rms else h - int(opts.get("correction", 0))
    std = opts.get("eps_mode", "var") == "std"
    dy2 = case.dy.reshape(rows, -1).astype(wide)
    return _View(x2, dy2, we, bias, n, float(opts.get("eps", 0.0)), std, rms, lambda a: a, lambda a: a.sum(axis=0))


def _channel_view(spec: OpSpec, case: Case) -> _View:
    """GroupNorm's statistics over ``(C / G) S`` values per sample and group, InstanceNorm's over ``S`` per sample
    and channel, BatchNorm's over ``N S`` per channel (in evaluation mode, or InstanceNorm without input
    statistics: the running ones)."""
    wide = np.longdouble
    opts = case.options
    shape, axis = np.shape(case.x), case.axis
    x3 = to_ncs(case.x, axis).astype(wide)
    n_, c, s_ = x3.shape
    named = dict(zip((*spec.input_names, *spec.param_names), case.args, strict=True))

    def per_c(a: Any, default: float) -> np.ndarray:
        v = np.full(c, default, wide) if a is None else np.asarray(a).reshape(-1).astype(wide)
        return np.broadcast_to(v[None, :, None], x3.shape)

    if spec.name == "batch_norm":

        def to_rows(a3: np.ndarray) -> np.ndarray:
            return np.asarray(a3).transpose(1, 0, 2).reshape(c, -1)

        def to3(a: np.ndarray) -> np.ndarray:
            return a.reshape(c, n_, s_).transpose(1, 0, 2)
    else:
        g = int(opts["num_groups"]) if spec.name == "group_norm" else c

        def to_rows(a3: np.ndarray) -> np.ndarray:
            return np.asarray(a3).reshape(n_ * g, -1)

        def to3(a: np.ndarray) -> np.ndarray:
            return a.reshape(n_, c, s_)

    running = None
    if (spec.name == "batch_norm" and not opts.get("training", True)) or (
        spec.name == "instance_norm" and not opts.get("use_input_stats", True)
    ):
        running = (to_rows(per_c(named["running_mean"], 0.0)), to_rows(per_c(named["running_var"], 1.0)))
    xr = to_rows(x3)
    return _View(
        xr,
        to_rows(to_ncs(case.dy, axis).astype(wide)),
        to_rows(per_c(named.get("weight"), 1.0)),
        to_rows(per_c(named.get("bias"), 0.0)),
        xr.shape[1],
        float(opts.get("eps", 0.0)),
        False,
        False,
        lambda a: from_ncs(to3(a), shape, axis),
        lambda a: to3(a).sum(axis=(0, 2)),
        running,
    )


#: the ops with a model of what a backward-stable algorithm may lose
STABILITY_OPS = ("layer_norm", "rms_norm", "group_norm", "instance_norm", "batch_norm")


def allowances(spec: OpSpec, case: Case, dtype: str, wanted: Mapping[str, Any]) -> dict[str, np.ndarray] | None:
    """Per output of ``wanted`` (names to shapes), the absolute change a backward-stable algorithm may cause in
    each element (float64 arrays of those shapes); None for an op without a model (:data:`STABILITY_OPS`)."""
    if spec.name not in STABILITY_OPS:
        return None
    v = _channel_view(spec, case) if spec.layout == "channels" else _row_view(spec, case)
    x, dy, we, b, n, eps, std = v.x, v.dy, v.we, v.b, v.n, v.eps, v.std
    gam = perturbation(dtype, x.shape[1])
    P = gam * np.abs(x)
    with np.errstate(all="ignore"):
        if v.running is not None:  # normalized with the running statistics, perturbed like x
            rm, rv = v.running
            r = 1 / np.sqrt(rv + eps)
            d = x - rm
            dd = P + gam * np.abs(rm)
            rel_r = gam * np.abs(rv) / (2 * (rv + eps))
        elif not v.rms:
            mean = x.mean(axis=1, keepdims=True)
            d = x - mean
            d = d - d.mean(axis=1, keepdims=True)
            var = (d * d).sum(axis=1, keepdims=True) / n
            sd = np.sqrt(var)
            r = 1 / (sd + eps) if std else 1 / np.sqrt(var + eps)
            pbar = P.mean(axis=1, keepdims=True)
            dd = P + pbar
            dvar = 2 * (np.abs(d) * dd).sum(axis=1, keepdims=True) / n
            rel_r = np.where(sd > 0, dvar / (2 * sd * (sd + eps)), np.inf) if std else dvar / (2 * (var + eps))
            if std:
                rel_r = np.where(np.isfinite(rel_r), rel_r, 0.0)
        else:
            d = x
            ms = (x * x).mean(axis=1, keepdims=True)
            r = 1 / np.sqrt(ms + eps)
            dd = P
            dvar = (np.abs(x) * P).mean(axis=1, keepdims=True) * 2
            rel_r = dvar / (2 * (ms + eps))
        xh = d * r
        dxh = r * dd + np.abs(xh) * rel_r
        out: dict[str, Any] = {}
        out["y"] = v.back(np.abs(we) * dxh + gam * (np.abs(xh * we) + (0 if b is None else np.abs(b))))
        g = dy * we
        dg = 2 * gam * np.abs(g)
        if v.running is not None:
            ddx = np.abs(g) * r * (2 * gam + rel_r)
        else:
            c = (g * xh).sum(axis=1, keepdims=True) / n
            dc = (dg * np.abs(xh) + np.abs(g) * dxh).sum(axis=1, keepdims=True) / n
            centred = not v.rms
            gm = g.mean(axis=1, keepdims=True) if centred else 0.0
            dgm = dg.mean(axis=1, keepdims=True) if centred else 0.0
            dx = r * (g - gm - xh * c)
            ddx = rel_r * np.abs(dx) + r * (dg + dgm + dxh * np.abs(c) + np.abs(xh) * dc)
        out["dx"] = v.back(ddx)
        out["dweight"] = v.params(gam * np.abs(dy * xh) + np.abs(dy) * dxh)
        out["dbias"] = v.params(gam * np.abs(dy) + 0 * x)
    result: dict[str, np.ndarray] = {}
    for name, shape in wanted.items():
        if name in out:
            a = np.asarray(out[name], dtype=np.float64)
            a = np.where(np.isnan(a), np.inf, a)
            if a.size == int(np.prod(shape)):
                result[name] = a.reshape(shape)
    return result
