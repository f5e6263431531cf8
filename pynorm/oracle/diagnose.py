"""Diagnoses: name the bug behind the failing cells of a :class:`~pynorm.oracle.runner.CheckReport`.

Two kinds of evidence:

* **hypothesis implementations** -- pynorm's reference with one convention changed (``eps_mode="std"``,
  ``correction=1``, a ``casting`` policy) or a small restatement of a classic mistake (``dx`` without
  its variance or mean term; Llama's rounding order while ``casting`` is not an option of the op). A
  hypothesis is reported when the user's results are within budget of it in most of the failing cells
  it applies to, where they are over budget against the reference;
* **patterns** over the failing cells the hypotheses leave unexplained: failures only on offset rows
  (cancellation), only near the dtype's max (overflow of the squares), only at tiny magnitudes
  (underflow), only on a strided input, only with several normalized dims, only at H = 1, only at
  eps = 0, only in the 16-bit dtypes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..errors import PynormError
from ..ops import OpSpec
from ..reference.casting import CASTINGS
from .runner import Budgets, CellResult, CheckReport, Evaluated, error_ulps, reference

__all__ = ["CASTING_POLICIES", "Diagnosis", "Hypothesis", "hypotheses", "run_diagnoses"]

#: the casting policies the ``casting=`` option of layer_norm / rms_norm offers (once it exists)
CASTING_POLICIES = CASTINGS  # each rounding order is a hypothesis where the op has the option

_CASTING_DOC = {
    "llama": "HF LlamaRMSNorm / Liger casting_mode='llama': the normalized value is rounded to the input dtype "
    "before the weight multiply",
    "gemma": "HF GemmaRMSNorm: (1 + w) and everything else in fp32, one rounding",
    "t5": "HF T5LayerNorm: the normalized value cast to the weight's dtype, then multiplied",
    "apex": "Apex: the normalized value rounded to the output dtype, then gamma * . + beta (two roundings)",
    "none": "all math in the input dtype",
    "fp32": "all math in fp32, one rounding",
}


@dataclass
class Diagnosis:
    """One diagnosis line: a ``code`` (stable, for tests and tools), the ``message``, the cells it explains."""

    code: str
    message: str
    cells: list[str] = field(default_factory=list)
    explained: int = 0
    relevant: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "code": self.code,
            "message": self.message,
            "cells": self.cells,
            "explained": self.explained,
            "relevant": self.relevant,
        }


@dataclass
class Hypothesis:
    """A model of a mistake: ``model(spec, ev) -> {output: values}`` for the outputs it covers (None: not
    applicable to this cell).

    ``agreement``: a rounding-order model, judged by how many elements the user's results share bit for bit
    with it and with the reference over the 16-bit cells (passing or not): two correct one-rounding results
    agree almost everywhere; a second rounding changes a good fraction of elements by an ulp, within budget.
    """

    code: str
    message: str
    model: Callable[[OpSpec, Evaluated], dict[str, np.ndarray] | None]
    agreement: bool = False


def _with_options(**change: Any) -> Callable[[OpSpec, Evaluated], dict[str, np.ndarray] | None]:
    def model(spec: OpSpec, ev: Evaluated) -> dict[str, np.ndarray] | None:
        case = replace(ev.case, options={**ev.case.options, **change})
        try:
            with np.errstate(all="ignore"):
                out, grads = reference(spec, case)
        except PynormError:
            return None
        return {**out, **grads}

    return model


def _forward_only(
    inner: Callable[[OpSpec, Evaluated], dict[str, np.ndarray] | None],
) -> Callable[[OpSpec, Evaluated], dict[str, np.ndarray] | None]:
    def model(spec: OpSpec, ev: Evaluated) -> dict[str, np.ndarray] | None:
        res = inner(spec, ev)
        return None if res is None else {k: v for k, v in res.items() if k in spec.outputs}

    return model


def _rows(ev: Evaluated) -> tuple[np.ndarray, np.ndarray, int]:
    x = np.ascontiguousarray(ev.case.x)
    ax = ev.case.axis % x.ndim
    rows = int(np.prod(x.shape[:ax]))
    return x.reshape(rows, -1), ev.case.dy.reshape(rows, -1), ax


def _weight(spec: OpSpec, ev: Evaluated, h: int) -> np.ndarray:
    w = dict(zip((*spec.input_names, *spec.param_names), ev.case.args, strict=True)).get("weight")
    o = float(ev.case.options.get("weight_offset", 0.0))
    return (np.ones(h) if w is None else np.broadcast_to(np.asarray(w, np.float64).reshape(-1), (h,))) + o


def _dx_model(which: str) -> Callable[[OpSpec, Evaluated], dict[str, np.ndarray] | None]:
    """dx of layer_norm / rms_norm with one term dropped, in extended precision, rounded once."""

    def model(spec: OpSpec, ev: Evaluated) -> dict[str, np.ndarray] | None:
        if "dx" not in ev.user:
            return None
        x2, dy2, _ = _rows(ev)
        wide = np.longdouble
        x, dy = x2.astype(wide), dy2.astype(wide)
        h = x.shape[1]
        g = dy * _weight(spec, ev, h).astype(wide)
        opts = ev.case.options
        eps = float(opts.get("eps", spec.defaults().get("eps", 0.0)))
        with np.errstate(all="ignore"):
            if spec.name == "rms_norm":
                if which != "var":
                    return None
                r = 1 / np.sqrt((x * x).mean(axis=1, keepdims=True) + eps)
                dx = r * g
            else:
                n = h - int(opts.get("correction", 0))
                d = x - x.mean(axis=1, keepdims=True)
                s = np.sqrt((d * d).sum(axis=1, keepdims=True) / n)
                std = opts.get("eps_mode", "var") == "std"
                r = 1 / (s + eps) if std else 1 / np.sqrt(s * s + eps)
                k = np.where(s > 0, 1 / (s * r), 0.0) if std else 1.0
                xh = d * r
                var_term = xh * k * (g * xh).sum(axis=1, keepdims=True) / n
                mean_term = g.mean(axis=1, keepdims=True)
                dx = r * (g - mean_term) if which == "var" else r * (g - var_term)
        dt = ev.dtypes["dx"]
        return {"dx": np.asarray(dx.astype(np.float64).astype(dt)).reshape(ev.ref["dx"].shape)}

    return model


def hypotheses(spec: OpSpec, conventions: dict[str, Any]) -> list[Hypothesis]:
    """The hypothesis implementations that apply to ``spec`` under the user's ``conventions``."""
    names = {o.name for o in spec.options}
    out: list[Hypothesis] = []
    if "eps_mode" in names and conventions.get("eps_mode", "var") != "std":
        out.append(
            Hypothesis(
                "eps_on_std",
                "eps is added to the std, not the variance (matches eps_mode='std': (x - mean) / (std + eps)); "
                "PyTorch, ONNX, Apex and TransformerEngine add it to the variance: sqrt(var + eps)",
                _with_options(eps_mode="std"),
            )
        )
    if "correction" in names and conventions.get("correction", 0) != 1:
        out.append(
            Hypothesis(
                "unbiased_variance",
                "the variance is the unbiased estimator, divided by H - 1 (matches correction=1, the default of "
                "torch.Tensor.var/std); LayerNorm divides by H (biased)",
                _with_options(correction=1),
            )
        )
    if spec.name in ("layer_norm", "rms_norm"):
        if spec.name == "layer_norm":
            out.append(
                Hypothesis(
                    "dx_missing_variance_term",
                    "dx is missing the variance term: it matches r * (g - mean(g)) without - x̂ * mean(g * x̂) "
                    "(g = dy * w; the dependence of rstd on x is dropped)",
                    _dx_model("var"),
                )
            )
            out.append(
                Hypothesis(
                    "dx_missing_mean_term",
                    "dx is missing the mean term: it matches r * (g - x̂ * mean(g * x̂)) without - mean(g) "
                    "(g = dy * w; the dependence of the mean on x is dropped)",
                    _dx_model("mean"),
                )
            )
        else:
            out.append(
                Hypothesis(
                    "dx_missing_variance_term",
                    "dx is missing the rstd term: it matches r * g without - r * x̂ * mean(g * x̂) "
                    "(g = dy * w; the dependence of rstd on x is dropped)",
                    _dx_model("var"),
                )
            )
    if "casting" in names:
        current = conventions.get("casting", spec.defaults().get("casting"))
        for policy in CASTING_POLICIES:
            if policy != current:
                out.append(
                    Hypothesis(
                        "rounding_order" if policy != "none" else "low_precision_math",
                        f"the forward rounds like casting='{policy}' ({_CASTING_DOC[policy]}); pass "
                        f"casting='{policy}' to pynorm to match it",
                        _forward_only(_with_options(casting=policy)),
                        agreement=True,
                    )
                )
    return out


def _model_errors(model: dict[str, np.ndarray], ev: Evaluated) -> dict[str, float]:
    errs = {}
    for name, m in model.items():
        if name not in ev.user:
            continue
        sc = ev.scales.get(name)
        s = None
        if sc is not None:
            s = np.asarray(sc, np.float64)
            s = s.reshape(ev.user[name].shape) if s.size == ev.user[name].size else None
        mm = np.asarray(m)
        if mm.size != ev.user[name].size:
            continue
        errs[name] = error_ulps(
            ev.user[name], mm.astype(np.float64).reshape(ev.user[name].shape), ev.dtypes[name], scale=s
        )
    return errs


def _agreement(spec: OpSpec, hyp: Hypothesis, half: list[tuple[CellResult, Evaluated]]) -> Diagnosis | None:
    same_ref = same_model = differ = total = 0
    cells: list[str] = []
    for res, ev in half:
        model = hyp.model(spec, ev)
        if model is None:
            continue
        for name, m in model.items():
            if name not in ev.user or np.size(m) != ev.user[name].size:
                continue
            u = ev.user[name].ravel()
            mm = np.asarray(m).astype(np.float64).ravel()
            rr = ev.ref[name].astype(np.float64).ravel()
            fin = np.isfinite(rr)
            total += int(fin.sum())
            same_ref += int((u == rr)[fin].sum())
            same_model += int((u == mm)[fin].sum())
            differ += int((mm != rr)[fin].sum())
            cells.append(res.cell.label)
    if total == 0 or differ < max(1, 0.01 * total):
        return None
    a_model, a_ref = same_model / total, same_ref / total
    if a_model >= 0.99 and a_ref <= 0.97 and a_model > a_ref:
        return Diagnosis(
            hyp.code,
            f"{hyp.message} [bit-identical to it in {100 * a_model:.1f}% of {total} elements of the 16-bit cells, "
            f"to the reference in {100 * a_ref:.1f}%]",
            sorted(set(cells)),
            len(set(cells)),
            len(set(cells)),
        )
    return None


def run_diagnoses(
    spec: OpSpec,
    report: CheckReport,
    kept: list[tuple[CellResult, Evaluated]],
    budgets: Budgets,
    half: list[tuple[CellResult, Evaluated]] | None = None,
) -> list[Diagnosis]:
    """The diagnoses of ``report`` (``kept``: the failing cells with their arrays; ``half``: a sample of the
    16-bit cells, passing or not, for the rounding-order models)."""
    found: list[Diagnosis] = []
    explained_cells: set[int] = set()
    for hyp in hypotheses(spec, report.conventions):
        if hyp.agreement:
            d = _agreement(spec, hyp, half or [])
            if d is not None:
                found.append(d)
                explained_cells.update(id(r) for r, _ in (half or []) if r.cell.label in set(d.cells))
            continue
        relevant = 0
        hits: list[CellResult] = []
        inapplicable: list[CellResult] = []
        for res, ev in kept:
            model = hyp.model(spec, ev)
            if model is None:
                inapplicable.append(res)
                continue
            if not (set(model) & set(res.failed_outputs)):
                continue
            relevant += 1
            errs = _model_errors(model, ev)
            if errs and all(v <= res.budgets[k] for k, v in errs.items()):
                hits.append(res)
        if hits and len(hits) >= 0.75 * relevant:
            found.append(Diagnosis(hyp.code, hyp.message, [r.cell.label for r in hits], len(hits), relevant))
            explained_cells.update(id(r) for r in hits)
            if len(hits) >= 0.5 * len(kept):  # the main explanation: the cells it cannot model are not evidence
                explained_cells.update(id(r) for r in inapplicable)
    found.extend(_patterns(spec, report, explained_cells))
    return found


def report_outputs(r: CellResult) -> list[str]:
    """The forward outputs among a cell's errors (``y``, ``h``...: not the gradients)."""
    return [k for k in r.errors if not k.startswith("d")]


def _patterns(spec: OpSpec, report: CheckReport, explained: set[int]) -> list[Diagnosis]:
    res = report.results
    fails = [r for r in res if r.verdict == "fail" and id(r) not in explained]
    out: list[Diagnosis] = []
    errors = [r for r in res if r.verdict == "error"]
    if errors:
        out.append(
            Diagnosis(
                "raised",
                f"the implementation raised or returned the wrong results in {len(errors)} cells "
                f"(first: {errors[0].cell.label}: {errors[0].note})",
                [r.cell.label for r in errors],
                len(errors),
                len(errors),
            )
        )
    if not fails:
        return out

    centered = getattr(spec.variant, "statistic", "") == "centered"

    def no_spread(r: CellResult) -> bool:
        return centered and (r.cell.kind == "constant" or r.cell.hidden == 1)

    def ordinary_ok(dtypes: set[str]) -> bool:
        base = [
            r
            for r in res
            if r.cell.kind == "normal" and len(r.cell.norm_shape) == 1 and r.cell.dtype in dtypes and not no_spread(r)
        ]
        bad = [r for r in base if r.verdict != "pass"]
        return bool(base) and len(bad) <= 0.1 * len(base)

    def add(code: str, cells: list[CellResult], message: str) -> None:
        total = sum(1 for r in res if r.verdict == "fail")
        out.append(Diagnosis(code, message, [r.cell.label for r in cells], len(cells), total))

    flat = [r for r in fails if no_spread(r)]
    if flat:
        add(
            "zero_spread",
            flat,
            "fails where a row has no spread (constant rows, H = 1: the exact x̂ and dweight are 0): rounding noise "
            "is left there -- typically x̂ computed as x * rstd - mean * rstd (cancelling terms of size |x| rstd) "
            "instead of (x - mean) * rstd, or a mean that is not exact for equal values",
        )
        fails = [r for r in fails if r not in flat]
    if not fails:
        return out
    offset = [r for r in fails if r.cell.kind == "offset"]
    worst_offset = max((v for r in offset for k, v in r.errors.items() if k in report_outputs(r)), default=0.0)
    kinds = {
        "offset": (
            "cancellation",
            "fails on rows with a large common offset (1e4 + N(0,1); 100 + N(0,1) in 16-bit dtypes) while ordinary "
            "rows pass: "
            + (
                "catastrophic cancellation -- the variance computed as E[x^2] - E[x]^2 loses everything there; "
                "compute it from the centred values (two passes) or by Welford/Chan"
                if worst_offset > 1e5
                else "the mean (the centring x - mean) is computed in the input precision, with an error of an ulp "
                "of the offset (~1e4 ulps of the deviations); centre with a corrected two-pass mean or accumulate "
                "in a wider type (as E[x^2] - E[x]^2 would, far worse)"
            ),
        ),
        "huge": (
            "overflow",
            "fails at magnitudes near the dtype's max while ordinary rows pass{nf}: overflow in the sum of squares -- "
            "scale the row (e.g. by max|x|) before squaring, or accumulate in a wider type",
        ),
        "tiny": (
            "underflow",
            "fails at tiny magnitudes (1e-30; 1e-4 in float16) while ordinary rows pass{nf}: the squares underflow "
            "(to 0, then 0/0 or a lost variance when eps is 0 or small) -- scale the row before squaring",
        ),
        "noncontig": (
            "strides",
            "fails only on a non-contiguous (strided) x: the implementation reads the buffer as if it were "
            "C-contiguous -- honour strides or copy with np.ascontiguousarray first",
        ),
        "half_constant": (
            "two_valued_rows",
            "fails on two-valued rows (half the row c, half c + 1, where x̂ = ±1 exactly)",
        ),
    }
    for kind, (code, msg) in kinds.items():
        cells = [r for r in fails if r.cell.kind == kind]
        if kind == "half_constant" and offset and ordinary_ok({r.cell.dtype for r in offset}):
            continue  # two-valued rows c, c + 1 with |c| > 1 are offset rows too: the cancellation line covers them
        if cells and ordinary_ok({r.cell.dtype for r in cells}):
            nf = sum(sum(r.nonfinite.values()) for r in cells)
            add(code, cells, msg.format(nf=f" ({nf} non-finite values where the exact result is finite)" if nf else ""))
    multi = [r for r in fails if len(r.cell.norm_shape) > 1]
    if multi and len(multi) == len(fails):
        add(
            "normalized_dims",
            multi,
            "fails only with several normalized dims: all trailing len(normalized_shape) axes (the weight's shape) "
            "must be normalized together, not only the last one",
        )
    if all(r.cell.hidden == 1 for r in fails):
        add("hidden_1", fails, "fails only at H = 1 (one normalized element per row: x - mean = 0 exactly)")
    if all(r.cell.eps == 0.0 for r in fails):
        add("eps_zero", fails, "fails only at eps = 0: the implementation does not use the given eps, or adds its own")
    if all(r.cell.dtype in ("float16", "bfloat16") for r in fails) and ordinary_ok({"float32", "float64"}):
        add(
            "low_precision",
            fails,
            "fails only in float16/bfloat16: arithmetic or rounding in the 16-bit dtype -- compute in float32 and "
            "round once at the end (or name the rounding order you follow)",
        )
    return out
