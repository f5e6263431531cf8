"""The report of a check: the table, the diagnoses, the summary line, the JSON."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from .batch import BatchInvariance
from .diagnose import Advice, Diagnosis, JointDiagnosis
from .evaluate import TIERS, Budgets, CellResult, OutputCheck

__all__ = ["REPORT_SCHEMA_VERSION", "CheckReport"]

#: the version of ``--json``'s record (``"schema": "pynorm-check-report"``): 2 added the tiers (``tier`` per cell,
#: ``tiers``, ``strict``), the joint diagnoses, the verified advice and the batch invariance; it changes when a
#: field changes meaning
REPORT_SCHEMA_VERSION = 2


def _fmt(v: float) -> str:
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf"
    return f"{v:.2f}" if v < 1000 else f"{v:.2e}"


def _ulps_text(o: OutputCheck) -> str:
    """The ulps column of one output: a number, ``shape`` (not comparable), ``N nonfin`` (non-finite where the
    reference is finite) or ``at 0`` (the exact value and the terms' magnitude are 0), ``*`` over budget."""
    star = "*" if o.failed else " "
    if o.shape is not None and not math.isfinite(o.ulps):
        return "shape" + star
    if o.nonfinite:
        return f"{o.nonfinite} nonfin" + star
    if o.at_zero:
        return "at 0" + star
    return _fmt(o.ulps) + star


def _abs_text(o: OutputCheck) -> str:
    if math.isnan(o.abs_error):
        return "-"
    return "0" if o.abs_error == 0 else f"{o.abs_error:.1e}"


@dataclass
class CheckReport:
    """The result of :func:`pynorm.oracle.check`: one :class:`~pynorm.oracle.evaluate.CellResult` per cell, the
    diagnoses (joint per dtype, and per cause), the verified advice, the batch invariance, the budgets.

    ``str(report)`` is the table, the diagnoses, the advice and the summary line; :meth:`to_json` has every number
    (schema ``pynorm-check-report``, version :data:`REPORT_SCHEMA_VERSION`).
    """

    op: str
    target: str
    conventions: dict[str, Any]
    budgets: Budgets
    results: list[CellResult] = field(default_factory=list)
    diagnoses: list[Diagnosis] = field(default_factory=list)
    seconds: float = 0.0
    backward_checked: bool = False
    notes: list[str] = field(default_factory=list)
    reference: dict[str, Any] = field(default_factory=dict)
    strict: bool = False
    joint: list[JointDiagnosis] = field(default_factory=list)
    advice: list[Advice] = field(default_factory=list)
    batch: BatchInvariance | None = None

    @property
    def passed(self) -> bool:
        """True when no cell fails (tier ``fail``; with ``strict``, ``stable`` too) or raises, and the rows are
        batch-invariant where that was checked (skipped cells do not count)."""
        ok = not any(r.fails(self.strict) or r.verdict == "error" for r in self.results)
        return ok and (self.batch is None or self.batch.passed)

    def count(self, verdict: str) -> int:
        """Cells of a verdict (``pass``, ``fail``, ``error``, ``skip``: the exact contract)."""
        return sum(r.verdict == verdict for r in self.results)

    def tiers(self) -> dict[str, int]:
        """Cells per tier (:data:`~pynorm.oracle.evaluate.TIERS`)."""
        return {t: sum(r.tier == t for r in self.results) for t in TIERS}

    @property
    def failing(self) -> list[CellResult]:
        """The cells that fail the check (tier ``fail``; with ``strict``, ``stable`` too): what the diagnoses
        explain."""
        return [r for r in self.results if r.fails(self.strict)]

    @property
    def explained(self) -> int:
        """Failing cells whose every failing output a diagnosis explains."""
        return sum(bool(r.explained) for r in self.failing)

    @property
    def unexplained(self) -> int:
        """Failing cells with a failing output no diagnosis explains."""
        return sum(not r.explained for r in self.failing)

    @property
    def stable_failures(self) -> int:
        """Cells beyond the exact budget whose errors are all within what a backward-stable algorithm may lose
        (tier ``stable``)."""
        return sum(r.tier == "stable" for r in self.results)

    def worst(self) -> tuple[CellResult, str, float] | None:
        """The cell and output with the largest error relative to its budget (None if nothing was measured)."""
        best: tuple[float, CellResult, str, float] | None = None
        for r in self.results:
            for k, o in r.outputs.items():
                rel = o.ulps / max(o.budget, 1e-300) if math.isfinite(o.ulps) else math.inf
                if best is None or rel > best[0]:
                    best = (rel, r, k, o.ulps)
        return None if best is None else best[1:]

    def output_names(self) -> list[str]:
        names: list[str] = []
        for r in self.results:
            for k in r.outputs:
                if k not in names:
                    names.append(k)
        return names

    def table(self, only_failures: bool = False) -> str:
        """One row per cell: per output the largest error in ulps (``*`` over budget) and the largest absolute
        error, and the verdict in tiers (``exact``, ``stable``, ``FAIL`` with the diagnosis that explains it)."""
        names = self.output_names()
        head = f"{'dtype':9s} {'shape':>12s} {'kind':13s} {'eps':>22s} "
        head += " ".join(f"{n + ' ulps':>11s} {n + ' abs':>10s}" for n in names)
        head += "  verdict"
        lines = [
            f"{self.op} vs pynorm's reference: per output, the largest error in ulps of its dtype at the terms' "
            f"magnitude (* = over budget) and the largest absolute error; verdict: exact (within budget), stable "
            f"(within what a backward-stable algorithm may lose{', fails with --strict' if self.strict else ''}), "
            f"FAIL",
            head,
            "-" * len(head),
        ]
        for r in self.results:
            if only_failures and r.tier in ("exact", "skip"):
                continue
            c = r.cell
            cols = []
            for n in names:
                o = r.outputs.get(n)
                if o is None:
                    cols.append(f"{'-':>11s} {'-':>10s}")
                else:
                    cols.append(f"{_ulps_text(o):>11s} {_abs_text(o):>10s}")
            eps = "-" if r.eps is None else repr(float(r.eps))
            shape = "x".join(map(str, c.shape))
            lines.append(
                f"{c.dtype:9s} {shape:>12s} {c.kind:13s} {eps:>22s} " + " ".join(cols) + "  "
                + self._verdict(r) + (f"  {c.setting}" if c.setting else "")
            )  # fmt: skip
        return "\n".join(lines)

    def _verdict(self, r: CellResult) -> str:
        tier = r.tier
        text = {"exact": "exact", "stable": "FAIL (stable)" if self.strict else "stable"}.get(tier, tier.upper())
        if r.fails(self.strict):
            codes = [o.explained_by for o in r.outputs.values() if o.failed and o.explained_by]
            codes = sorted(set(codes))
            text += f" [{', '.join(codes)}]" if r.explained else " [unexplained]" if r.explained is not None else ""
        if r.verdict == "error" and r.forward_verdict is not None:
            text += f" (forward {r.forward_verdict.upper()})"
        if r.note and r.verdict != "pass":
            text += f" ({r.note})"
        return text

    def summary(self) -> str:
        """``PASSED``/``FAILED``, the cells per tier (the failing ones explained and unexplained), the batch
        invariance, the worst error."""
        n = len(self.results)
        t = self.tiers()
        parts = [f"{t['exact']} exact", f"{t['stable']} stable"]
        fail = len(self.failing)
        fail_text = f"{fail} FAIL" + (" (stable cells fail: --strict)" if self.strict and t["stable"] else "")
        if fail and any(r.explained is not None for r in self.failing):
            fail_text += f" ({self.explained} explained, {self.unexplained} unexplained)"
        parts.append(fail_text)
        if t["error"]:
            parts.append(f"{t['error']} raised")
        if t["skip"]:
            parts.append(f"{t['skip']} skipped")
        if self.batch is not None:
            parts.append(self.batch.summary())
        w = self.worst()
        worst = ""
        if w is not None:
            r, k, v = w
            worst = f"; worst {k} {_fmt(v)} ulps (budget {r.outputs[k].budget:g}) at {r.cell.label}"
        verdict = "PASSED" if self.passed else "FAILED"
        grads = "forward + backward" if self.backward_checked else "forward only"
        counts = ", ".join(parts)
        notes = "".join(f" ({note})" for note in self.notes)
        head = f"{verdict}: {self.op} ({self.target}, {grads}): {n} cells"
        return f"{head}: {counts}{worst} [{self.seconds:.1f} s]{notes}"

    def lines(self, cli: bool = False, only_failures: bool = False) -> list[str]:
        """The table, the joint diagnoses per dtype, a line per cause (in the command line's words with ``cli``),
        the verified advice, the batch invariance, the summary."""
        out = [self.table(only_failures)]
        if self.joint or self.diagnoses:
            out.append("")
            out.extend(f"explanation: {j.render()}" for j in self.joint)
            out.extend(f"diagnosis: {d.render(cli)}" for d in self.diagnoses)
        if self.advice:
            out.append("")
            out.extend(f"advice: {a.render(cli)}" for a in self.advice)
        if self.stable_failures and not self.strict:
            out.append(
                f"note: {self.stable_failures} cells are stable: beyond the exact budget, within what a "
                f"backward-stable algorithm in the working precision may lose (docs/oracle.md); --strict fails them"
            )
        if self.batch is not None and self.batch.differences:
            out.append("")
            out.extend(self.batch.lines())
        out.append("")
        out.append(self.summary())
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def to_json(self) -> dict[str, Any]:
        from .. import __version__

        return {
            "schema": "pynorm-check-report",
            "schema_version": REPORT_SCHEMA_VERSION,
            "pynorm_version": __version__,
            "op": self.op,
            "target": self.target,
            "conventions": self.conventions,
            "reference_conventions": self.reference,
            "budgets": self.budgets.to_json(),
            "strict": self.strict,
            "passed": self.passed,
            "summary": self.summary(),
            "tiers": self.tiers(),
            "failing_cells": {
                "total": len(self.failing),
                "explained": self.explained,
                "unexplained": self.unexplained,
                "within_backward_stable_error": self.stable_failures,
            },
            "joint_diagnoses": [j.to_json() for j in self.joint],
            "diagnoses": [d.to_json() for d in self.diagnoses],
            "advice": [a.to_json() for a in self.advice],
            "batch_invariance": None if self.batch is None else self.batch.to_json(),
            "cells": [r.to_json() for r in self.results],
            "seconds": self.seconds,
            "notes": self.notes,
        }

    def write_json(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, indent=1)
            f.write("\n")
