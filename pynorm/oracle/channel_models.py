r"""Models of GroupNorm, InstanceNorm and BatchNorm implementations (the ops of the channels layout).

Each model restates the op with one classic mistake, in extended precision, on the cell's ``(N, C, S)`` view
(:mod:`pynorm.oracle.models` for the machinery; the diagnoses name a model where its outputs reproduce yours):

* ``unbiased_variance`` -- the normalization divides by ``L - 1`` (``torch.var``'s default); PyTorch normalizes
  with the biased variance and updates ``running_var`` with the unbiased one;
* ``running_var_biased`` -- ``running_var`` updated with the biased variance;
* ``eps_on_std`` -- ``(x - mean) / (std + eps)``;
* ``momentum_convention`` -- ``new = m old + (1 - m) batch`` (Keras' and Flax's ``momentum``, the weight of the old
  value), where PyTorch's ``momentum`` is the weight of the batch;
* ``group_stats_per_channel`` -- GroupNorm's statistics per channel (InstanceNorm's) instead of per group;
* ``one_pass`` -- the variance as ``E[x^2] - E[x]^2`` in the working precision ``p`` (float32 for 16- and 32-bit
  input, float64 for float64), and ``low_precision_math`` -- the statistics computed in the 16-bit input dtype:
  statistics models with bounded unknowns. The order of a sum is not knowable from outside, so each reads your
  statistics back from ``y`` (a least-squares fit of ``(y - b) / w`` against ``x``, per statistic), keeps them
  where the worst-case error bounds of its formula in its precision allow and a correct two-pass computation's
  do not (``γ_n = n u / (1 - n u)``), and computes ``y`` from them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..ops import OpSpec
from ..reference.batch_norm import momentum_factor
from ._dtypes import dtype_of, unit_roundoff
from .evaluate import Evaluated, from_ncs, to_ncs
from .model_types import Emulation, Model

__all__ = ["channel_models"]

_WIDE = np.longdouble


class _View:
    """A cell of a channel op as ``(N, C, S)``: its statistics' groups, parameters and running statistics."""

    def __init__(self, spec: OpSpec, ev: Evaluated, per_channel: bool = False) -> None:
        case, opts = ev.case, ev.call
        self.ev, self.spec, self.opts = ev, spec, opts
        self.x3 = to_ncs(case.x, case.axis).astype(_WIDE)
        self.n, self.c, self.s = self.x3.shape
        named = dict(zip((*spec.input_names, *spec.param_names), case.args, strict=True))
        self.w = self._per_c(named.get("weight"), 1.0)
        self.b = self._per_c(named.get("bias"), 0.0)
        self.rm, self.rv = named.get("running_mean"), named.get("running_var")
        self.eps = float(opts.get("eps", 1e-5))
        if spec.name == "group_norm":
            self.batch = True
            g = self.c if per_channel else int(opts["num_groups"])
            self.rows = self.x3.reshape(self.n * g, -1)  # (statistics, L)
            self.back: Callable[[np.ndarray], np.ndarray] = lambda a: a.reshape(self.n, self.c, self.s)
        elif spec.name == "instance_norm":
            self.batch = bool(opts.get("use_input_stats", True))
            self.rows = self.x3.reshape(self.n * self.c, -1)
            self.back = lambda a: a.reshape(self.n, self.c, self.s)
        else:
            self.batch = bool(opts["training"])
            self.rows = self.x3.transpose(1, 0, 2).reshape(self.c, -1)
            self.back = lambda a: a.reshape(self.c, self.n, self.s).transpose(1, 0, 2)
        self.m = momentum_factor(opts.get("momentum"), int(opts.get("num_batches_tracked", 0)))

    def _per_c(self, a: Any, default: float) -> np.ndarray:
        v = np.full(self.c, default, _WIDE) if a is None else np.asarray(a).astype(_WIDE)
        return v[None, :, None]

    def per_row(self, a: np.ndarray) -> np.ndarray:
        """A ``(1, C, 1)`` array broadcast to the ``(statistics, L)`` rows."""
        return self.to_rows(np.broadcast_to(a, self.x3.shape))

    def to_rows(self, a3: np.ndarray) -> np.ndarray:
        if self.spec.name == "batch_norm":
            return np.asarray(a3).transpose(1, 0, 2).reshape(self.c, -1)
        return np.asarray(a3).reshape(self.rows.shape)

    def y(self, mean: np.ndarray, rstd: np.ndarray) -> np.ndarray:
        """``y`` of ``x``'s layout from per-statistic ``mean`` and ``rstd`` (float64)."""
        xhat = self.back((self.rows - mean[:, None]) * rstd[:, None])
        y3 = xhat * self.w + self.b
        return from_ncs(y3.astype(np.float64), np.shape(self.ev.case.x), self.ev.case.axis)

    def running(self, *, unbiased: bool = True, flipped: bool = False) -> dict[str, np.ndarray]:
        """The updated running statistics (where the cell returns them), with the variance biased or not and the
        momentum the batch's weight or (``flipped``) the old value's."""
        if self.rm is None or "running_mean" not in self.ev.ref:
            return {}
        x3 = self.x3
        if self.spec.name == "instance_norm":
            mean_i = x3.mean(axis=2)
            var_i = ((x3 - mean_i[..., None]) ** 2).sum(axis=2) / (self.s - 1 if unbiased else self.s)
            bm, bv = mean_i.mean(axis=0), var_i.mean(axis=0)
        else:
            cols = self.rows
            bm = cols.mean(axis=1)
            k = cols.shape[1]
            bv = ((cols - bm[:, None]) ** 2).sum(axis=1) / (k - 1 if unbiased else k)
        m = 1 - self.m if flipped else self.m
        rm = (1 - m) * np.asarray(self.rm).astype(_WIDE) + m * bm
        rv = (1 - m) * np.asarray(self.rv).astype(_WIDE) + m * bv
        return {"running_mean": rm.astype(np.float64), "running_var": rv.astype(np.float64)}

    def stats(self, *, unbiased: bool = False) -> tuple[np.ndarray, np.ndarray]:
        mean = self.rows.mean(axis=1)
        k = self.rows.shape[1]
        var = ((self.rows - mean[:, None]) ** 2).sum(axis=1) / (k - 1 if unbiased else k)
        return mean, var


def _rstd(var: np.ndarray, eps: float, on_std: bool = False) -> np.ndarray:
    with np.errstate(all="ignore"):
        return 1 / (np.sqrt(var) + eps) if on_std else 1 / np.sqrt(var + eps)


def _restated(bug: str) -> Callable[[OpSpec, Evaluated], Emulation | None]:
    def emulate(spec: OpSpec, ev: Evaluated) -> Emulation | None:
        v = _View(spec, ev, per_channel=bug == "per_channel")
        out: dict[str, np.ndarray] = {}
        if bug in ("biased_running", "momentum"):
            if not v.running() or (bug == "momentum" and v.m == 0.5):
                return None
            out.update(v.running(unbiased=bug != "biased_running", flipped=bug == "momentum"))
            return Emulation(out)
        if not v.batch:
            return None  # normalized with the running statistics: the batch's are not used
        k = v.rows.shape[1]
        if bug == "unbiased" and k < 2:
            return None
        if bug == "per_channel" and int(ev.call["num_groups"]) == v.c:
            return None
        mean, var = v.stats(unbiased=bug == "unbiased")
        out["y"] = v.y(mean, _rstd(var, v.eps, on_std=bug == "eps_on_std"))
        out.update(v.running())
        return Emulation(out)

    return emulate


def _gamma(n: int, u: float) -> float:
    return n * u / (1 - n * u) if n * u < 1 else np.inf


def _fitted(kind: str, p: np.dtype[Any]) -> Callable[[OpSpec, Evaluated], Emulation | None]:
    """The statistics models: ``one_pass`` (``E[x^2] - E[x]^2`` in ``p``) and ``low`` (a two-pass computation in
    the 16-bit dtype ``p``), each reading the statistics back from the user's ``y``."""

    def emulate(spec: OpSpec, ev: Evaluated) -> Emulation | None:
        u_y = ev.user.get("y")
        if u_y is None:
            return None
        if kind == "low" and ev.dtype != p.name:
            return None
        if kind == "one_pass" and p.name != ("float64" if ev.dtype == "float64" else "float32"):
            return None  # E[x^2] - E[x]^2 in the cell's working precision
        v = _View(spec, ev)
        if not v.batch or v.rows.shape[1] < 2:
            return None
        rows = v.rows.astype(np.float64)
        r, k = rows.shape
        mean, var = (a.astype(np.float64) for a in v.stats())
        w, b = v.per_row(v.w).astype(np.float64), v.per_row(v.b).astype(np.float64)
        z = (v.to_rows(to_ncs(u_y, ev.case.axis)) - b) / w
        uround = unit_roundoff(p.name)
        gam = _gamma(k + 2, uround)
        absmean = np.abs(rows).mean(axis=1)
        ex2 = (rows * rows).mean(axis=1)
        if kind == "one_pass":
            var_tol = 2 * gam * ex2 + 2 * gam * absmean**2
        else:
            var_tol = 2 * gam * (np.abs(rows - mean[:, None]) * (np.abs(rows) + absmean[:, None])).mean(axis=1)
        mean_tol = gam * absmean
        # what a correct two-pass algorithm in the working precision may be off by
        ok_tol = (
            2
            * _gamma(k + 2, unit_roundoff("float64" if ev.dtype == "float64" else "float32"))
            * (var + absmean * np.abs(rows - mean[:, None]).mean(axis=1))
        )
        fm, fr = np.empty(r), np.empty(r)
        beyond = False
        for i in range(r):
            zi, xi = z[i], rows[i]
            fin = np.isfinite(zi)
            if not fin.all():
                # non-finite: a variance computed <= 0 at eps = 0, admissible where the bound reaches 0
                if var[i] + v.eps > var_tol[i]:
                    return None
                fm[i], fr[i] = mean[i], np.inf
                beyond = True
                continue
            xc = xi - xi.mean()
            den = float((xc * xc).sum())
            if den == 0:
                fm[i], fr[i] = mean[i], _rstd(var[i], v.eps)
                continue
            a = float((xc * (zi - zi.mean())).sum()) / den
            c0 = float(zi.mean()) - a * float(xi.mean())
            if not a > 0:
                return None
            m_u, var_u = -c0 / a, 1 / (a * a) - v.eps
            if abs(m_u - mean[i]) > mean_tol[i] + 1e-3 * np.sqrt(max(var[i], 0.0)) or abs(var_u - var[i]) > var_tol[
                i
            ] + 1e-6 * (var[i] + v.eps):
                return None
            if abs(var_u - var[i]) > ok_tol[i] + 1e-6 * (var[i] + v.eps):
                beyond = True
            fm[i], fr[i] = m_u, a
        if not beyond:
            return None  # within what a correct computation may be off by: not this model's to name
        with np.errstate(all="ignore"):
            y = v.y(fm.astype(_WIDE), fr.astype(_WIDE))
        fin = np.isfinite(y)
        y = np.where(fin, y, np.asarray(u_y).reshape(y.shape))
        return Emulation({"y": y}, evidence=_offset(fr, v.eps, var))

    return emulate


def _offset(rstd: np.ndarray, eps: float, var: np.ndarray) -> dict[str, float]:
    """The largest offset of the read-back variances from the exact ones (over the rows with a finite rstd)."""
    fin = np.isfinite(rstd) & (rstd > 0)
    if not fin.any():
        return {}
    return {"var_offset": float(np.max(np.abs(1 / rstd[fin] ** 2 - eps - var[fin])))}


def _var_evidence(e: dict[str, float]) -> str:
    return f"its variance is off by up to {e['var_offset']:.3g}"  # KeyError: no finite offset, no evidence


def channel_models(spec: OpSpec, conventions: dict[str, Any]) -> list[Model]:
    """The models of :mod:`pynorm.oracle.channel_models` that apply to ``spec``, in order of preference."""
    out = [
        Model(
            "unbiased_variance",
            "unbiased_variance",
            "the normalization uses the unbiased variance (divided by L - 1, torch.var's default)",
            "normalize with the biased variance (divided by L); PyTorch uses the unbiased one only to update "
            "running_var",
            _restated("unbiased"),
        ),
        Model(
            "eps_on_std",
            "eps_on_std",
            "eps is added to the std, not the variance: (x - mean) / (std + eps)",
            "add it inside the root, sqrt(var + eps), as PyTorch does",
            _restated("eps_on_std"),
        ),
    ]
    if spec.name == "group_norm":
        out.append(
            Model(
                "group_stats_per_channel",
                "group_stats_per_channel",
                "the statistics are per channel (InstanceNorm's), not over each group's C / num_groups channels",
                "reduce over the group's channels and every spatial position together",
                _restated("per_channel"),
            )
        )
    if spec.inputs:
        out.append(
            Model(
                "running_var_biased",
                "running_var_biased",
                "running_var is updated with the biased variance (divided by L)",
                "update it with the unbiased variance, L / (L - 1) times the biased one, as PyTorch does",
                _restated("biased_running"),
            )
        )
        out.append(
            Model(
                "momentum_convention",
                "momentum_convention",
                "momentum is taken as the weight of the old value, new = m old + (1 - m) batch (Keras' and Flax's "
                "convention)",
                "PyTorch's momentum is the batch's weight: new = (1 - m) old + m batch (Flax's momentum=0.99 is "
                "PyTorch's 0.01)",
                _restated("momentum"),
            )
        )
    wps: tuple[np.dtype[Any], ...] = (np.dtype(np.float32), np.dtype(np.float64))
    for p in wps:
        out.append(
            Model(
                f"one_pass/{p.name}",
                "one_pass",
                f"the variance is computed in one pass, E[x^2] - E[x]^2 ({p.name}), which loses everything on "
                f"statistics with a large mean",
                "compute it from the centred values (two passes) or by Welford/Chan",
                _fitted("one_pass", p),
                evidence=_var_evidence,
                fitted=True,
            )
        )
    halves: tuple[np.dtype[Any], ...] = (np.dtype(np.float16), dtype_of("bfloat16"))
    for p in halves:
        out.append(
            Model(
                f"low_precision_math/{p.name}",
                "low_precision_math",
                f"the statistics are computed in {p.name} (the input's dtype), not float32",
                "accumulate the mean and the variance in float32 (as PyTorch does for 16-bit input)",
                _fitted("low", p),
                evidence=_var_evidence,
                fitted=True,
            )
        )
    return out
