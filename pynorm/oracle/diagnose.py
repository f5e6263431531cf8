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

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._measure import ulp_error
from ..ops import OpSpec
from ._dtypes import dtype_name, dtype_of, round_to
from .evaluate import Budgets, CellResult, Evaluated, scale_like
from .models import Emulation, Model, reference_with

__all__ = ["Advice", "Diagnosis", "JointDiagnosis", "render_advice", "run_diagnoses"]


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


@dataclass
class JointDiagnosis:
    """The simplest joint explanation of one dtype's failing cells.

    Attributes
    ----------
    dtype : the cells' dtype.
    causes : the codes of the causes, conventions first (``["unbiased_variance", "eps_on_std", "float32_math"]``).
    words : each cause in a few words (``"unbiased variance"``).
    explained : failing cells of the dtype whose every failing output the combination reproduces.
    failing : failing cells of the dtype.
    max_distance_ulps : the largest distance of your outputs to the combination's on those cells (ulps of the
        combination's precision at the terms' magnitude).
    unexplained : labels of the failing cells it does not explain.
    without : per cause (in words), the failing cells explained without it -- fewer than ``explained``, or the
        cause would not be named.
    options : the reference options of its conventions (``{"correction": 1, "eps_mode": "std"}``): what the advice
        checks against.
    conventions : the codes of its conventions.
    """

    dtype: str
    causes: list[str]
    words: list[str]
    explained: int
    failing: int
    max_distance_ulps: float
    unexplained: list[str] = field(default_factory=list)
    without: dict[str, int] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    conventions: list[str] = field(default_factory=list)

    def render(self) -> str:
        """``float32: unbiased variance + eps on the std reproduce 30 of 32 failing float32 cells to 1 ulp
        (without unbiased variance: 0; ...); unexplained: 2 (float32 4x1 normal eps=1e-05, ...)``"""
        if not self.causes:
            text = f"{self.dtype}: no combination of the models reproduces the {self.failing} failing cells"
        else:
            text = (
                f"{self.dtype}: {' + '.join(self.words)} reproduce{'s' if len(self.words) == 1 else ''} "
                f"{self.explained} of {self.failing} failing {self.dtype} cells to {self.max_distance_ulps:.2g} ulps"
            )
            if len(self.without) > 1:
                text += " (without " + "; without ".join(f"{k}: {v}" for k, v in self.without.items()) + ")"
        if self.unexplained:
            first = ", ".join(self.unexplained[:3]) + (", ..." if len(self.unexplained) > 3 else "")
            text += f"; unexplained: {len(self.unexplained)} ({first})"
        return text

    def to_json(self) -> dict[str, Any]:
        return _jsonable(dataclasses.asdict(self))


@dataclass
class Advice:
    """Options for the reference that the checker ran before advising them: the failing cells' conventions.

    Attributes
    ----------
    reference : the reference-only options to add (``{"correction": 1, "eps_mode": "std"}``).
    dtypes : the dtypes it applies to (None: every dtype checked).
    causes : the convention codes it follows.
    tiers : the cells per tier when the check is run again with them (same grid, same dtypes).
    failing_before : the failing cells without them.
    command : the command line it was given as (``python -m pynorm check ...``; set by the CLI), else "".
    """

    reference: dict[str, Any]
    dtypes: list[str] | None
    causes: list[str]
    tiers: dict[str, int]
    failing_before: int
    command: str = ""

    @property
    def failing_after(self) -> int:
        return self.tiers.get("fail", 0) + self.tiers.get("error", 0)

    def outcome(self) -> str:
        t = self.tiers
        parts = [f"{t.get('exact', 0)} exact", f"{t.get('stable', 0)} stable", f"{t.get('fail', 0)} FAIL"]
        if t.get("error"):
            parts.append(f"{t['error']} raised")
        if t.get("skip"):
            parts.append(f"{t['skip']} skipped")
        return f"{', '.join(parts)} (without them: {self.failing_before} FAIL)"

    def render(self, cli: bool = False) -> str:
        """The flags (``--reference correction=1 --reference eps_mode=std``; the whole command when known) or the
        keyword arguments (``reference={...}``), and what the run with them gave."""
        if cli:
            flags = render_advice({"reference": self.reference}, True)
            if self.dtypes:
                flags += f" --dtypes {','.join(self.dtypes)}"
            what = f"{self.command} {flags}" if self.command else flags
        else:
            what = f"reference={self.reference!r}" + (f", dtypes={self.dtypes!r}" if self.dtypes else "")
        return f"{' + '.join(self.causes)} as your convention: checked with {what}: {self.outcome()}"

    def to_json(self) -> dict[str, Any]:
        return {
            "reference": self.reference,
            "dtypes": self.dtypes,
            "causes": self.causes,
            "tiers": self.tiers,
            "failing_before": self.failing_before,
            "command": self.command,
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
    # representability is evidence only where the exact values are not representable themselves (0, b at H = 1...),
    # and where yours are not 0 (a 0, an underflow or an overflow's x / inf, is representable in every precision)
    telling = fin & (user != 0) & np.isfinite(ref) & (round_to(ref, precision).astype(np.float64) != ref)
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


_Key = tuple[tuple[str, ...], str, int]


class _Runner:
    """Emulates models (a model under a set of conventions) on the cells, with a cache, and matches them."""

    def __init__(self, spec: OpSpec, evaluated: Sequence[Evaluated], budgets: Budgets, models: Sequence[Model]):
        self.spec, self.evaluated, self.budgets, self.models = spec, list(evaluated), budgets, list(models)
        self.cache: dict[_Key, Emulation | list[Emulation] | None] = {}

    def emulate(self, model: Model | None, i: int, convs: Sequence[Model] = ()) -> Emulation | list[Emulation] | None:
        """``model`` on cell ``i`` where the conventions ``convs`` hold (their options changed); ``model`` None:
        the conventions alone (None where they change nothing in the cell)."""
        key = (tuple(c.key for c in convs), "" if model is None else model.key, i)
        if key not in self.cache:
            ev = self.evaluated[i]
            change: dict[str, Any] = {}
            for c in convs:
                if c.options is not None:
                    change.update(c.options(ev))
            with np.errstate(all="ignore"):
                if model is None:
                    self.cache[key] = reference_with(self.spec, ev, change)
                elif model.options is not None:  # a convention model: one of the conventions
                    self.cache[key] = self.emulate(None, i, (*convs, model))
                else:
                    at = dataclasses.replace(ev, call={**ev.call, **change}) if change else ev
                    self.cache[key] = model.emulate(self.spec, at)
        return self.cache[key]

    def match(
        self, model: Model | None, i: int, names: Sequence[str], convs: Sequence[Model] = ()
    ) -> tuple[dict[str, float], dict[str, float]]:
        """The outputs of ``names`` that ``model`` (under ``convs``) explains in cell ``i`` (best variant) and its
        evidence."""
        emus = self.emulate(model, i, convs)
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

    def closeness(self, i: int, names: Sequence[str], convs: Sequence[Model]) -> float:
        """How far your outputs of cell ``i`` are from the reference under ``convs`` alone: the sum over ``names`` of
        ``log2(1 + ulps)`` (the reference itself where the conventions change nothing)."""
        emu = self.emulate(None, i, convs)
        ev = self.evaluated[i]
        total = 0.0
        for n in names:
            u = ev.user.get(n)
            m = ev.ref.get(n) if emu is None or isinstance(emu, list) else emu.outputs.get(n)
            if u is None or m is None or np.size(m) != u.size:
                continue
            m = np.asarray(m, np.float64).reshape(u.shape)
            d = _errs(u, m, ev.dtypes[n], scale_like(ev.scales.get(n), u.shape))
            total += math.log2(1 + min(float(d.max()) if d.size else 0.0, 1e300))
        return total

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
            if ev.dtype != dtype or ((), a.key, i) not in self.cache:
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
    strict: bool = False,
) -> tuple[list[Diagnosis], list[JointDiagnosis]]:
    """The diagnoses of a check (module docstring): one per cause, and the joint explanation per dtype; marks each
    failing output's ``explained_by`` (the codes of the causes that reproduce it, joined by ``" + "``) and each
    failing cell's ``explained``. The failing cells are those of tier ``fail`` (with ``strict``, ``stable`` too).

    Parameters
    ----------
    spec : the op.
    evaluated : every measured cell (passing and failing) with its arrays.
    budgets : the budgets of the check.
    models : the models to try (:func:`pynorm.oracle.models.models_for`), in order of preference.
    errors : the cells where the user's code raised (reported as one ``raised`` diagnosis).
    rerun : ``rerun(ev)`` -> the cell re-run with a contiguous copy of ``x`` (for the ``strides`` diagnosis).
    strict : whether the cells of tier ``stable`` fail too.
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
    failing = [i for i, ev in enumerate(evaluated) if ev.result.fails(strict)]
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

    # the models, per dtype: the simplest joint explanation of the failing outputs left
    models = [m for m in models if m.key != "strides"]
    by_key = {m.key: m for m in models}
    halves = {ev.dtype for ev in evaluated if ev.dtype in ("float16", "bfloat16")}
    dtypes = sorted({evaluated[i].dtype for i, _ in left} | halves)
    named: dict[str, dict[str, dict[str, Any]]] = {}  # cause key -> dtype -> info
    assigned: dict[str, dict[tuple[int, str], float]] = {}
    evidence: dict[str, list[dict[str, float]]] = {}
    joints: list[JointDiagnosis] = []
    for dt in dtypes:
        idx = [i for i in failing if evaluated[i].dtype == dt]
        pairs = {p for p in left if evaluated[p[0]].dtype == dt}
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
        if pairs:
            search = _JointSearch(runner, dt, idx, pairs, models)
            best = search.run()
            joints.append(search.describe(best))
            for (i, n), (by, dist) in best.pairs.items():
                codes, keys = search.causes_of(best.convs, by, i)
                explain(i, n, " + ".join(codes))
                for k in keys:
                    assigned.setdefault(k, {})[(i, n)] = dist
            for key, ev_list in best.evidence.items():
                evidence.setdefault(key, []).extend(ev_list)
            for k, info in search.per_cause(best).items():
                if k in agree:
                    info["agreement"] = agree.pop(k)
                named.setdefault(k, {})[dt] = info
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
    return out, joints


#: the most conventions the joint search combines per dtype (those that bring your outputs closest to the
#: reference's on the failing cells); 2 ** MAX_CONVENTIONS subsets at most
MAX_CONVENTIONS = 4
#: the convention subsets under which every other model is tried besides the empty one (the closest)
CANDIDATE_SUBSETS = 1

_Pair = tuple[int, str]


@dataclass
class _Joint:
    """One combination: conventions and other models, the failing outputs it explains (by which model: None for
    the conventions alone) and the evidence of its models."""

    convs: tuple[Model, ...]
    models: tuple[Model, ...]
    pairs: dict[_Pair, tuple[Model | None, float]]
    evidence: dict[str, list[dict[str, float]]] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return len(self.convs) + len(self.models)


class _JointSearch:
    """The simplest joint explanation of one dtype's failing outputs (module docstring of
    :func:`run_diagnoses`)."""

    def __init__(
        self, runner: _Runner, dt: str, idx: Sequence[int], pairs: set[_Pair], models: Sequence[Model]
    ) -> None:
        self.runner, self.dt, self.idx = runner, dt, list(idx)
        self.pairs = pairs
        self.names = {i: [n for (j, n) in sorted(pairs) if j == i] for i in idx}
        self.cells = [i for i in idx if self.names[i]]
        self.convs = [m for m in models if m.options is not None]
        self.by_key = {m.key: m for m in models}
        # the other models that may explain in this dtype, and the baselines they are compared with
        self.others = [
            m for m in models
            if m.options is None and (m.named_in is None or dt in m.named_in or _is_baseline(m, models))
        ]  # fmt: skip
        self.cache: dict[_Key, tuple[dict[str, float], dict[str, float]]] = {}

    # --- coverage

    def coverage(
        self, convs: Sequence[Model], model: Model | None, cells: Sequence[int] | None = None
    ) -> tuple[dict[_Pair, float], list[dict[str, float]]]:
        """What ``model`` under ``convs`` explains on ``cells`` (default: every failing cell), and its evidence."""
        got: dict[_Pair, float] = {}
        evid: list[dict[str, float]] = []
        if model is None and not convs:
            return got, evid
        ck = tuple(c.key for c in convs)
        for i in self.cells if cells is None else cells:
            key = (ck, "" if model is None else model.key, i)
            if key not in self.cache:
                self.cache[key] = self.runner.match(model, i, self.names[i], convs)
            found, e = self.cache[key]
            got.update({(i, n): d for n, d in found.items()})
            if found and e:
                evid.append(e)
        return got, evid

    def covered(self, convs: Sequence[Model], model: Model, cells: Sequence[int] | None = None) -> dict[_Pair, float]:
        """What ``model`` explains under ``convs`` and its baseline does not."""
        got = self.coverage(convs, model, cells)[0]
        base = self.by_key.get(model.baseline or "")
        if base is None:
            return got
        taken = self.coverage(convs, base, cells)[0]
        return {p: d for p, d in got.items() if p not in taken}

    def closeness(self, convs: Sequence[Model]) -> float:
        return sum(self.runner.closeness(i, self.names[i], convs) for i in self.cells)

    def cover(self, convs: tuple[Model, ...], candidates: Sequence[Model] | None = None) -> _Joint:
        """The conventions ``convs`` and, greedily, the models of ``candidates`` (default: every other model that
        may be named here) that explain the most failing outputs the rest do not."""
        pool = [m for m in (self.others if candidates is None else candidates) if self._namable(m)]
        explained: dict[_Pair, tuple[Model | None, float]] = {}
        if convs:
            explained.update({p: (None, d) for p, d in self.coverage(convs, None)[0].items()})
        # the other models are run where the conventions leave something to explain; the fitted statistics models
        # (costly, with unknowns) only where the models without unknowns leave something too
        open_cells = self.open_cells(explained)
        per = {m.key: self.covered(convs, m, open_cells) for m in pool if not m.fitted}
        reach = set(explained).union(*per.values())
        still = self.open_cells(dict.fromkeys(reach))
        per.update({m.key: self.covered(convs, m, still) for m in pool if m.fitted})
        pool = [m for m in pool if m.key in per]
        chosen: list[Model] = []
        while True:
            gains = [(sum(p not in explained for p in per[m.key]), -j, m) for j, m in enumerate(pool)]
            gains = [g for g in gains if g[0] > 0 and g[2] not in chosen]
            if not gains:
                break
            _, _, m = max(gains, key=lambda t: (t[0], t[1]))
            chosen.append(m)
            explained.update({p: (m, d) for p, d in per[m.key].items() if p not in explained})
        evid = {m.key: self.coverage(convs, m, still if m.fitted else open_cells)[1] for m in chosen}
        return _Joint(convs, tuple(chosen), explained, evid)

    def open_cells(self, explained: Mapping[_Pair, Any]) -> list[int]:
        return [i for i in self.cells if any((i, n) not in explained for n in self.names[i])]

    def strong_coverage(self, convs: tuple[Model, ...]) -> set[_Pair]:
        """The outputs ``convs`` reproduce alone or with a model without unknowns, where yours are not all NaN."""
        got = set(self.coverage(convs, None)[0])
        open_cells = self.open_cells(dict.fromkeys(got))
        for m in self.others:
            if not m.fitted and self._namable(m):
                got |= set(self.covered(convs, m, open_cells))
        return {(i, n) for i, n in got if np.isfinite(self.runner.evaluated[i].user.get(n, np.nan)).any()}

    def _namable(self, m: Model) -> bool:
        return m.named_in is None or self.dt in m.named_in

    # --- the search

    def run(self) -> _Joint:
        """The combination explaining the most failing outputs, the fewest causes on a tie; each cause named only
        when dropping it explains fewer."""
        base = self.closeness(())
        singles = []
        for j, c in enumerate(self.convs):
            cov = self.coverage((c,), None)[0]
            close = self.closeness((c,))
            if cov or close < base:
                singles.append((-len(cov), close, j, c))
        kept = [t[3] for t in sorted(singles, key=lambda t: t[:3])[:MAX_CONVENTIONS]]
        kept.sort(key=self.convs.index)
        subsets: list[tuple[Model, ...]] = [()]
        for c in kept:
            subsets += [(*s, c) for s in subsets if all(o.axis != c.axis for o in s)]
        ranked = sorted(subsets[1:], key=lambda s: (-len(self.coverage(s, None)[0]), self.closeness(s), len(s)))
        best: _Joint | None = None
        for sub in [(), *ranked[:CANDIDATE_SUBSETS]]:
            joint = self.cover(sub)
            if best is None or (len(joint.pairs), -joint.size) > (len(best.pairs), -best.size):
                best = joint
        assert best is not None
        return self.prune(best)

    def prune(self, joint: _Joint) -> _Joint:
        """Drop each cause whose removal explains as many failing outputs (a convention that changes nothing the
        rest does not explain)."""
        changed = True
        while changed:
            changed = False
            for cause in reversed((*joint.convs, *joint.models)):
                smaller = self._drop(joint, cause)
                if len(smaller.pairs) >= len(joint.pairs) or (cause in joint.convs and not self._shows(joint, cause)):
                    joint, changed = smaller, True
                    break
        return joint

    def _shows(self, joint: _Joint, conv: Model) -> bool:
        """Whether a convention reproduces outputs that the rest does not, by itself or with a model without
        unknowns, and with numbers: a fitted statistics model has room enough to absorb a convention, and NaN
        everywhere is what many causes give."""
        rest = tuple(c for c in joint.convs if c is not conv)
        return bool(self.strong_coverage(joint.convs) - self.strong_coverage(rest))

    def _drop(self, joint: _Joint, cause: Model) -> _Joint:
        """The joint without ``cause`` (its other causes, re-covered)."""
        convs = tuple(c for c in joint.convs if c is not cause)
        return self.cover(convs, [m for m in joint.models if m is not cause])

    def without(self, joint: _Joint, cause: Model) -> int:
        """Failing cells the joint explains without ``cause``."""
        return len(self.cells_of(self._drop(joint, cause).pairs))

    def cells_of(self, pairs: Mapping[_Pair, Any]) -> list[int]:
        return [i for i in self.cells if all((i, n) in pairs for n in self.names[i])]

    # --- naming

    def causes_of(self, convs: Sequence[Model], model: Model | None, i: int) -> tuple[list[str], list[str]]:
        """The codes and the model keys of the causes that explain an output of cell ``i`` (the conventions that
        change something there, float32 math where a float64 cell's model computes in float32, the model)."""
        ev = self.runner.evaluated[i]
        used = [c for c in convs if c.options is not None and c.options(ev)]
        codes, keys = [c.code for c in used], [c.key for c in used]
        if model is not None:
            if self.dt == "float64" and model.key.endswith("/float32") and model.code != "float32_math":
                codes.append("float32_math")
                keys.append("float32_math")
            codes.append(model.code)
            keys.append(model.key)
        return codes, keys

    def _causes(self, joint: _Joint) -> list[Model]:
        out: list[Model] = list(joint.convs)
        for m in joint.models:
            if self.dt == "float64" and m.key.endswith("/float32") and m.code != "float32_math":
                f32 = self.by_key.get("float32_math")
                if f32 is not None and f32 not in out:
                    out.append(f32)
            out.append(m)
        return out

    def describe(self, joint: _Joint) -> JointDiagnosis:
        cells = self.cells_of(joint.pairs)
        dist = max((d for _, d in joint.pairs.values()), default=0.0)
        needed = {c.words: self.without(joint, c) for c in (*joint.convs, *joint.models)}
        options: dict[str, Any] = {}
        for i in cells:
            for c in joint.convs:
                if c.options is not None:
                    options.update(c.options(self.runner.evaluated[i]))
        labels = [self.runner.evaluated[i].result.cell.label for i in self.idx if i not in cells]
        causes = self._causes(joint)
        return JointDiagnosis(
            self.dt,
            [c.code for c in causes],
            [c.words for c in causes],
            len(cells),
            len(self.idx),
            float(dist),
            labels,
            needed,
            options,
            [c.code for c in joint.convs],
        )

    def per_cause(self, joint: _Joint) -> dict[str, dict[str, Any]]:
        """Per cause key, its info in this dtype (for the per-cause diagnoses)."""
        causes = self._causes(joint)
        out: dict[str, dict[str, Any]] = {}
        for cause in causes:
            cells: set[int] = set()
            dists: list[float] = []
            for (i, _), (model, d) in joint.pairs.items():
                if cause.key in self.causes_of(joint.convs, model, i)[1]:
                    cells.add(i)
                    dists.append(d)
            if not cells:
                continue
            alts = self._alternatives(joint, cause) if cause.reference else []
            out[cause.key] = {
                "explained": len(cells),
                "failing": len(self.idx),
                "max_distance_ulps": max(dists),
                "equally": alts,
                "with": [c.words for c in causes if c is not cause],
            }
        return out

    def _alternatives(self, joint: _Joint, cause: Model) -> list[str]:
        """The other policies of a convention's axis that explain the same outputs in its place (t5 and apex give
        Llama's RMSNorm forward)."""
        mine = {p for p, (m, _) in joint.pairs.items() if m is None}
        out = []
        for c in self.convs:
            if c is cause or c.axis != cause.axis:
                continue
            sub = tuple(c if o is cause else o for o in joint.convs)
            if set(self.coverage(sub, None)[0]) == mine:
                out.append(c.key)
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
            together = f" (with {' + '.join(info['with'])})" if info.get("with") else ""
            parts.append(
                f"matches it to {info['max_distance_ulps']:.2g} ulps on {info['explained']} of {info['failing']} "
                f"failing {dt} cells{together}"
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
    elif model.options is not None:
        change: dict[str, Any] = {}
        for i in sorted({i for i, _ in pairs}):
            change.update(model.options(evaluated[i]))
        advice = {"reference": change} if change else None
    lead = {
        "rounding_order": "to check against that order, run with",
        "low_precision_math": "to check against it, run with",
        "eps_float32": "to check your implementation at the eps it uses, run with",
        "eps_on_std": "if std + eps is your convention, check with",
        "unbiased_variance": "if H - 1 is your convention, check with",
    }.get(model.code, "to check against it, run with")
    base = f"{model.says} [{'; '.join(parts)}{extra}]: {model.fix}"

    def with_advice(cli: bool) -> str:  # the advice itself is printed once verified (report.advice)
        return f"{base}; {lead} {render_advice(advice, cli)} (advice below)" if advice else base

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
