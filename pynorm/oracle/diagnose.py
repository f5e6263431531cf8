"""Diagnoses: name the cause behind the failing cells of a check, by emulation, per dtype, with the evidence.

For every failing cell and every model of :mod:`pynorm.oracle.models` that applies, the model's outputs are
computed. A model **explains** a failing output of a cell when

* the model itself fails there against the reference (it reproduces a failure, not a pass),
* your output is within the cell's budget of the model's (in ulps of the model's precision at the terms'
  magnitude: float32 ulps for a float32 model of a float64 cell), and, for a model computing in a narrower
  precision than the output's, your values carry that precision's signature,
* and the model's baseline (the model it refines) does not explain it too.

Per dtype, the models are then chosen greedily -- the one explaining most of the failing outputs not yet
explained first, ties to the earlier model of the list -- and each is named with what it explains ("matches it
to 0.5 ulps on 12 of 12 failing float32 cells"). Facts come first and need no model: an output of the wrong
dtype or shape, and a strided cell that passes when re-run on a contiguous copy of the same values (the
``strides`` diagnosis; the C-order model says whether the buffer was read ignoring the strides). The rounding
orders (``casting`` policies) are also judged by bit agreement over every 16-bit cell of a dtype, passing or
not: a second rounding usually stays within one ulp, so they are named even where nothing fails.

A failing cell is *explained* when every failing output of it is; the report counts the explained and the
unexplained failing cells.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..ops import OpSpec
from ..testing import ulp_error
from ._dtypes import dtype_name, dtype_of, round_to
from .evaluate import Budgets, CellResult, Evaluated, scale_like
from .models import Emulation, Model

__all__ = ["Diagnosis", "render_advice", "run_diagnoses"]


def render_advice(advice: dict[str, dict[str, Any]] | None, cli: bool) -> str:
    """``{"reference": {"casting": "llama"}}`` as the user types it: ``--reference casting=llama`` on the command
    line, ``reference={'casting': 'llama'}`` in Python."""
    if not advice:
        return ""
    parts = []
    for kind, opts in advice.items():
        if cli:
            flag = "--reference" if kind == "reference" else "--convention"
            parts.append(
                " ".join(f"{flag} {k}={v!r}" if not isinstance(v, str) else f"{flag} {k}={v}" for k, v in opts.items())
            )
        else:
            parts.append(f"{'reference' if kind == 'reference' else 'conventions'}={opts!r}")
    return " ".join(parts)


@dataclass
class Diagnosis:
    """One diagnosis: a stable ``code`` (for tests and tools), the message, the cells it explains.

    Attributes
    ----------
    code : ``one_pass``, ``mean_in_precision``, ``rounding_order``, ``strides``... (``docs/oracle.md``).
    message : the sentence printed (Python flavour; :meth:`render` gives the command line's).
    cells : labels of the failing cells it explains.
    explained : how many failing cells it explains (each cell is explained by one diagnosis per failing output).
    relevant : the failing cells of the dtypes it is named in.
    dtypes : per dtype: ``explained``, ``failing``, ``max_distance_ulps`` and, for the rounding orders, the bit
        agreement.
    advice : the options that make the reference follow this cause (``{"reference": {...}}`` or
        ``{"convention": {...}}``), rendered by :meth:`render`.
    """

    code: str
    message: str
    cells: list[str] = field(default_factory=list)
    explained: int = 0
    relevant: int = 0
    dtypes: dict[str, dict[str, Any]] = field(default_factory=dict)
    advice: dict[str, dict[str, Any]] | None = None
    key: str = ""
    cli_message: str = ""

    def render(self, cli: bool = False) -> str:
        """The message for the command line (``--reference casting=llama``) or for Python (``reference={...}``)."""
        return self.cli_message if cli and self.cli_message else self.message

    def to_json(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "model": self.key,
            "message": self.message,
            "cells": self.cells,
            "explained": self.explained,
            "relevant": self.relevant,
            "dtypes": self.dtypes,
            "advice": self.advice,
        }


# ---------------------------------------------------------------------------
# matching one emulation against one cell


def _errs(actual: np.ndarray, expected: np.ndarray, dtype: Any, scale: Any) -> np.ndarray:
    if dtype_of(dtype).kind in "iu":
        with np.errstate(invalid="ignore"):
            d = np.abs(actual - expected)
        return np.where(np.isnan(d), np.inf, d)
    return ulp_error(actual, expected, dtype, scale=scale)


def _signature(user: np.ndarray, ref: np.ndarray, precision: str, scale: Any) -> bool:
    """Your values look computed in ``precision``: representable in it (nearly all), or off from the exact result by
    a fraction of its ulp typically (a wider computation is off by far less)."""
    fin = np.isfinite(user)
    if not fin.any():
        return False  # NaN and inf say nothing about the precision they were computed in
    # representability is evidence only where the exact values are not representable themselves (0, b at H = 1...)
    telling = fin & np.isfinite(ref) & (round_to(ref, precision).astype(np.float64) != ref)
    if not telling.any():
        return False
    u = user[telling]
    rep = np.mean(round_to(u, precision).astype(np.float64) == u)
    if rep >= 0.99:
        return True
    err = ulp_error(user, ref, precision, scale=scale)[telling]
    return bool(err.size) and float(np.median(err)) >= 0.05


def _distance(emu: Emulation, ev: Evaluated, name: str, budgets: Budgets, need_fail: bool = True) -> float | None:
    """The distance (ulps of the model's measure) at which ``emu`` explains failing output ``name``, or None
    (``need_fail=False``: whether it agrees with the user's output at all, the model failing or not)."""
    m = emu.outputs.get(name)
    u = ev.user.get(name)
    if m is None or u is None or np.size(m) != u.size:
        return None
    m = np.asarray(m, np.float64).reshape(u.shape)
    r = np.asarray(ev.ref[name], np.float64).reshape(u.shape)
    undefined = np.isnan(r)
    if undefined.any():
        m = np.where(undefined, r, m)
        u = np.where(undefined, r, u)
    out_dt = ev.dtypes[name]
    meas = emu.measure.get(name, out_dt)
    scale = scale_like(ev.scales.get(name), u.shape)
    cell_dt = ev.dtype
    model_err = _errs(m, r, out_dt, scale)
    if need_fail and not (model_err.size and float(model_err.max()) > budgets.get(cell_dt, name)):
        return None  # the model passes there: it does not reproduce the failure
    dist = _errs(u, m, meas, scale)
    d = float(dist.max()) if dist.size else 0.0
    if not d <= budgets.get(dtype_name(dtype_of(meas)), name):
        return None
    if emu.precision is not None and not _signature(u, r, emu.precision, scale):
        return None
    return d


# ---------------------------------------------------------------------------
# the diagnoses


@dataclass
class _Found:
    """What one model explains in one dtype: (cell index, output) -> distance, and the evidence of those cells."""

    pairs: dict[tuple[int, str], float] = field(default_factory=dict)
    evidence: list[dict[str, float]] = field(default_factory=list)


def _pct(v: float) -> str:
    return f"{100 * v:.1f}%"


class _Runner:
    def __init__(self, spec: OpSpec, evaluated: Sequence[Evaluated], budgets: Budgets, models: Sequence[Model]):
        self.spec, self.evaluated, self.budgets, self.models = spec, list(evaluated), budgets, list(models)
        self.cache: dict[tuple[str, int], Emulation | list[Emulation] | None] = {}

    def emulate(self, model: Model, i: int) -> Emulation | list[Emulation] | None:
        key = (model.key, i)
        if key not in self.cache:
            with np.errstate(all="ignore"):
                self.cache[key] = model.emulate(self.spec, self.evaluated[i])
        return self.cache[key]

    def match(self, model: Model, i: int, names: Sequence[str]) -> tuple[dict[str, float], dict[str, float]]:
        """The outputs of ``names`` that ``model`` explains in cell ``i`` (best variant) and its evidence."""
        emus = self.emulate(model, i)
        if emus is None:
            return {}, {}
        best: tuple[dict[str, float], dict[str, float]] = ({}, {})
        best_d = np.inf
        ev = self.evaluated[i]
        for emu in emus if isinstance(emus, list) else [emus]:
            got = {}
            # a gradient is explained only by a model that agrees with the forward outputs the user got right
            contradicted = any(
                n in emu.outputs and n in ev.user and not ev.result.outputs[n].failed
                and _distance(emu, ev, n, self.budgets, need_fail=False) is None
                for n in self.spec.outputs
            )  # fmt: skip
            for n in names:
                if contradicted and n not in self.spec.outputs:
                    continue
                d = _distance(emu, self.evaluated[i], n, self.budgets)
                if d is not None:
                    got[n] = d
            dmax = max(got.values(), default=np.inf)
            if len(got) > len(best[0]) or (len(got) == len(best[0]) and got and dmax < best_d):
                best, best_d = (got, emu.evidence), dmax
        return best

    def agreement(self, model: Model, dtype: str) -> dict[str, Any] | None:
        """Bit agreement of the user's forward outputs with ``model`` and with the reference over the cells of
        ``dtype`` (passing or not, H <= 4096, at most 200 cells)."""
        same_ref = same_model = differ = total = 0
        n = 0
        for i, ev in enumerate(self.evaluated):
            if ev.dtype != dtype or ev.result.cell.hidden > 4096 or n >= 200:
                continue
            n += 1
            emus = self.emulate(model, i)
            if emus is None or isinstance(emus, list):
                continue
            for name in self.spec.outputs:
                m = emus.outputs.get(name)
                if name not in ev.user or m is None or np.size(m) != ev.user[name].size:
                    continue
                u = ev.user[name].ravel()
                mm = np.asarray(m, np.float64).ravel()
                rr = np.asarray(ev.ref[name], np.float64).ravel()
                fin = np.isfinite(rr)
                total += int(fin.sum())
                same_ref += int((u == rr)[fin].sum())
                same_model += int((u == mm)[fin].sum())
                differ += int((mm != rr)[fin].sum())
        if total == 0 or differ < max(1, 0.01 * total):
            return None
        a_model, a_ref = same_model / total, same_ref / total
        if a_model >= 0.99 and a_ref <= 0.97 and a_model > a_ref:
            return {"elements": total, "same_as_model": a_model, "same_as_reference": a_ref}
        return None

    def identical(self, a: Model, b: Model, dtype: str) -> bool:
        """Whether two models give the same forward outputs on every cell of ``dtype`` they were run on."""
        seen = False
        for i, ev in enumerate(self.evaluated):
            if ev.dtype != dtype or (a.key, i) not in self.cache:
                continue
            ea, eb = self.emulate(a, i), self.emulate(b, i)
            if isinstance(ea, list) or isinstance(eb, list) or (ea is None) != (eb is None):
                return False
            if ea is None or eb is None:
                continue
            for name in self.spec.outputs:
                ma, mb = ea.outputs.get(name), eb.outputs.get(name)
                if (ma is None) != (mb is None):
                    return False
                if ma is not None and mb is not None and not np.array_equal(ma, mb, equal_nan=True):
                    return False
                seen = True
        return seen


def _fact(code: str, message: str, results: list[CellResult]) -> Diagnosis:
    return Diagnosis(code, message, [r.cell.label for r in results], len(results), len(results), key=code)


def run_diagnoses(
    spec: OpSpec,
    evaluated: Sequence[Evaluated],
    budgets: Budgets,
    models: Sequence[Model],
    errors: Sequence[CellResult] = (),
    rerun: Callable[[Evaluated], CellResult | None] | None = None,
) -> list[Diagnosis]:
    """The diagnoses of a check (module docstring); marks each failing output's ``explained_by`` and each failing
    cell's ``explained``.

    Parameters
    ----------
    spec : the op.
    evaluated : every measured cell (passing and failing) with its arrays.
    budgets : the budgets of the check.
    models : the models to try (:func:`pynorm.oracle.models.models_for`), in order of preference.
    errors : the cells where the user's code raised (reported as one ``raised`` diagnosis).
    rerun : ``rerun(ev)`` -> the cell re-run with a contiguous copy of ``x`` (for the ``strides`` diagnosis).
    """
    out: list[Diagnosis] = []
    if errors:
        first = errors[0]
        out.append(
            _fact(
                "raised",
                f"your implementation raised or returned the wrong number of results in {len(errors)} cells "
                f"(first: {first.cell.label}: {first.note})",
                list(errors),
            )
        )
    evaluated = list(evaluated)
    runner = _Runner(spec, evaluated, budgets, models)
    failing = [i for i, ev in enumerate(evaluated) if ev.result.verdict == "fail"]
    left: dict[tuple[int, str], bool] = {}
    for i in failing:
        for name in evaluated[i].result.failed_outputs:
            left[(i, name)] = True

    def explain(i: int, name: str, code: str) -> None:
        evaluated[i].result.outputs[name].explained_by = code
        left.pop((i, name), None)

    # facts: the wrong dtype or shape
    for code, attr in (("wrong_dtype", "dtype"), ("wrong_shape", "shape")):
        hit: list[tuple[int, str, Any]] = []
        for i in failing:
            for name, o in evaluated[i].result.outputs.items():
                if getattr(o, attr) is not None:
                    hit.append((i, name, getattr(o, attr)))
        if not hit:
            continue
        for i, name, _ in hit:  # the fact explains the output when its values are right; else a model must too
            o = evaluated[i].result.outputs[name]
            if math.isfinite(o.ulps) and o.ulps <= o.budget:
                explain(i, name, code)
        i0, name0, got = hit[0]
        ev0 = evaluated[i0]
        want = dtype_name(ev0.dtypes[name0]) if attr == "dtype" else tuple(ev0.ref[name0].shape)
        what = "dtype" if attr == "dtype" else "shape"
        cells = sorted({i for i, _, _ in hit})
        msg = (
            f"returns {name0} with {what} {got} where the op promises {want} (first: {ev0.result.cell.label}; "
            f"{len(hit)} outputs of {len(cells)} cells): "
            + (
                "y and dx have x's dtype, each parameter's gradient its parameter's"
                if attr == "dtype"
                else "each output has the shape of its input (x's for y and dx, each parameter's for its gradient)"
            )
        )
        out.append(_fact(code, msg, [evaluated[i].result for i in cells]))

    # strides: a failing strided cell that passes when re-run contiguous
    if rerun is not None:
        strided = [i for i in failing if not evaluated[i].case.x.flags.c_contiguous]
        fixed: list[int] = []
        c_order: list[float] = []
        cmodel = next((m for m in models if m.key == "strides"), None)
        for i in strided:
            again = rerun(evaluated[i])
            if again is None or again.verdict != "pass":
                continue
            names = evaluated[i].result.failed_outputs
            fixed.append(i)
            if cmodel is not None:
                got, _ = runner.match(cmodel, i, names)
                if got and len(got) == len([n for n in names if (i, n) in left]):
                    c_order.append(max(got.values()))
            for name in names:
                if (i, name) in left:
                    explain(i, name, "strides")
        if fixed:
            per: dict[str, list[int]] = {}
            for i in fixed:
                per.setdefault(evaluated[i].dtype, []).append(i)
            parts = [
                f"{len(v)} of {sum(1 for j in strided if evaluated[j].dtype == dt)} failing strided {dt} cells"
                for dt, v in per.items()
            ]
            how = (
                f"; reading the buffer in C order, ignoring the strides, reproduces {len(c_order)} of them to "
                f"{max(c_order):.2g} ulps"
                if c_order
                else "; it does not read the buffer in C order (that model does not reproduce it)"
            )
            msg = (
                f"fails on a strided (non-contiguous) x and passes on a contiguous copy of the same values in "
                f"{', '.join(parts)}{how}: honour the strides, or copy with np.ascontiguousarray first"
            )
            fact = _fact("strides", msg, [evaluated[i].result for i in fixed])
            fact.dtypes = {dt: {"explained": len(v)} for dt, v in per.items()}
            out.append(fact)

    # the models, per dtype
    models = [m for m in models if m.key != "strides"]
    by_key = {m.key: m for m in models}
    halves = {ev.dtype for ev in evaluated if ev.dtype in ("float16", "bfloat16")}
    dtypes = sorted({evaluated[i].dtype for i, _ in left} | halves)
    named: dict[str, dict[str, dict[str, Any]]] = {}  # model key -> dtype -> info
    assigned: dict[str, dict[tuple[int, str], float]] = {}
    evidence: dict[str, list[dict[str, float]]] = {}
    for dt in dtypes:
        idx = [i for i in failing if evaluated[i].dtype == dt]
        found: dict[str, _Found] = {}
        for model in models:
            if model.named_in is not None and dt not in model.named_in and not _is_baseline(model, models):
                continue
            f = _Found()
            for i in idx:
                names = [n for n in evaluated[i].result.failed_outputs if (i, n) in left]
                if not names:
                    continue
                got, evid = runner.match(model, i, names)
                for n, dist in got.items():
                    f.pairs[(i, n)] = dist
                if got and evid:
                    f.evidence.append(evid)
            found[model.key] = f
        covered: dict[str, dict[tuple[int, str], float]] = {}
        for k, f in found.items():
            base = by_key[k].baseline
            taken = found[base].pairs if base is not None and base in found else {}
            covered[k] = {p: d for p, d in f.pairs.items() if p not in taken}
        agree: dict[str, dict[str, Any]] = {}
        if dt in ("float16", "bfloat16"):
            for model in models:
                if model.agreement:
                    a = runner.agreement(model, dt)
                    if a is not None:
                        agree[model.key] = a
        same_as: dict[str, list[str]] = {}
        for key in list(agree):
            if key not in agree:
                continue
            for other in list(agree):
                if other != key and runner.identical(by_key[key], by_key[other], dt):
                    same_as.setdefault(key, []).append(other)
                    agree.pop(other)
        remaining = {p for p in left if evaluated[p[0]].dtype == dt}
        order = [m for m in models if m.named_in is None or dt in m.named_in]
        while remaining:
            gains = [(len(set(covered.get(m.key, {})) & remaining), -j, m) for j, m in enumerate(order)]
            gain, _, best = max(gains, key=lambda t: (t[0], t[1]))
            if gain == 0:
                break
            mine = {p: covered[best.key][p] for p in covered[best.key] if p in remaining}
            remaining -= set(mine)
            assigned.setdefault(best.key, {}).update(mine)
            evidence.setdefault(best.key, []).extend(found[best.key].evidence)
            alts = [  # the rounding orders that coincide here (t5 and apex give Llama's RMSNorm forward)
                m.key
                for m in order
                if m is not best and m.reference and best.reference and set(covered.get(m.key, {})) == set(mine)
            ]
            info = {
                "explained": len({i for i, _ in mine}),
                "failing": len(idx),
                "max_distance_ulps": max(mine.values()),
                "equally": alts,
            }
            if best.key in agree:
                info["agreement"] = agree.pop(best.key)
            named.setdefault(best.key, {})[dt] = info
            for i, n in mine:
                explain(i, n, best.code)
        for key, a in agree.items():
            named.setdefault(key, {})[dt] = {"explained": 0, "failing": len(idx), "agreement": a, "equally": []}
        for key, others in same_as.items():
            if key in named and dt in named[key]:
                eq = named[key][dt].setdefault("equally", [])
                eq.extend(o for o in others if o not in eq)

    for key in [m.key for m in models if m.key in named]:
        model = by_key[key]
        out.append(_describe(model, named[key], assigned.get(key, {}), evidence.get(key, []), evaluated, by_key))

    for i in failing:
        res = evaluated[i].result
        res.explained = all(res.outputs[n].explained_by is not None for n in res.failed_outputs)
    return out


def _is_baseline(model: Model, models: Sequence[Model]) -> bool:
    return any(m.baseline == model.key for m in models)


def _describe(
    model: Model,
    per_dtype: dict[str, dict[str, Any]],
    pairs: dict[tuple[int, str], float],
    evidence: list[dict[str, float]],
    evaluated: Sequence[Evaluated],
    by_key: dict[str, Model],
) -> Diagnosis:
    parts = []
    for dt, info in per_dtype.items():
        if info.get("explained"):
            parts.append(
                f"matches it to {info['max_distance_ulps']:.2g} ulps on {info['explained']} of {info['failing']} "
                f"failing {dt} cells"
            )
        a = info.get("agreement")
        if a:
            parts.append(
                f"bit-identical to it in {_pct(a['same_as_model'])} of {a['elements']:,} {dt} elements "
                f"(to the reference in {_pct(a['same_as_reference'])})"
            )
        alts = [by_key[k] for k in info.get("equally", []) if k in by_key]
        if alts:
            parts.append("equally: " + ", ".join(_short(m) for m in alts))
    extra = ""
    if model.evidence is not None and evidence:
        worst: dict[str, float] = {}
        for e in evidence:
            for k, v in e.items():
                if np.isfinite(v) and (k not in worst or v > worst[k]):
                    worst[k] = v
        try:
            extra = "; " + model.evidence(worst)
        except KeyError:
            extra = ""
    advice: dict[str, dict[str, Any]] | None = None
    if model.reference:
        advice = {"reference": dict(model.reference)}
    elif model.convention:
        advice = {"convention": dict(model.convention)}
    lead = {
        "rounding_order": "to check against that order, run with",
        "low_precision_math": "to check against it, run with",
        "eps_float32": "to check your implementation at the eps it uses, run with",
        "eps_on_std": "if std + eps is your convention, check with",
        "unbiased_variance": "if H - 1 is your convention, check with",
    }.get(model.code, "to check against it, run with")
    base = f"{model.says} [{'; '.join(parts)}{extra}]: {model.fix}"

    def with_advice(cli: bool) -> str:
        return f"{base}; {lead} {render_advice(advice, cli)}" if advice else base

    cells = sorted({evaluated[i].result.cell.label for i, _ in pairs})
    relevant = sum(info.get("failing", 0) for info in per_dtype.values())
    return Diagnosis(
        model.code,
        with_advice(False),
        cells,
        len(cells),
        relevant,
        {dt: _jsonable(info) for dt, info in per_dtype.items()},
        advice,
        model.key,
        with_advice(True),
    )


def _short(model: Model) -> str:
    if model.reference:
        return ", ".join(f"{k}={v!r}" for k, v in model.reference.items())
    return model.key


def _jsonable(info: dict[str, Any]) -> dict[str, Any]:
    return {k: (float(v) if isinstance(v, (np.floating, float)) else v) for k, v in info.items()}
