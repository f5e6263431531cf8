"""The report of a check: the table, the diagnoses, the summary line, the JSON."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from .diagnose import Diagnosis
from .evaluate import Budgets, CellResult, OutputCheck

__all__ = ["CheckReport"]


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
    diagnoses, the budgets.

    ``str(report)`` is the table, the diagnoses and the summary line; :meth:`to_json` has every number.
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

    @property
    def passed(self) -> bool:
        """True when no cell failed or raised (skipped cells do not count)."""
        return all(r.verdict in ("pass", "skip") for r in self.results)

    def count(self, verdict: str) -> int:
        return sum(r.verdict == verdict for r in self.results)

    @property
    def explained(self) -> int:
        """Failing cells whose every failing output a diagnosis explains."""
        return sum(r.verdict == "fail" and bool(r.explained) for r in self.results)

    @property
    def unexplained(self) -> int:
        """Failing cells with a failing output no diagnosis explains."""
        return sum(r.verdict == "fail" and not r.explained for r in self.results)

    @property
    def stable_failures(self) -> int:
        """Failing cells whose errors are all within what a backward-stable algorithm may lose."""
        return sum(r.verdict == "fail" and r.stable is True for r in self.results)

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
        error, whether a failing cell's errors are within backward-stable error, and the verdict."""
        names = self.output_names()
        head = f"{'dtype':9s} {'shape':>12s} {'kind':13s} {'eps':>22s} "
        head += " ".join(f"{n + ' ulps':>11s} {n + ' abs':>10s}" for n in names)
        head += f" {'stable':>6s}  verdict"
        lines = [
            f"{self.op} vs pynorm's reference: per output, the largest error in ulps of its dtype at the terms' "
            f"magnitude (* = over budget) and the largest absolute error; stable: a failing cell's errors are "
            f"within what a backward-stable algorithm may lose",
            head,
            "-" * len(head),
        ]
        for r in self.results:
            if only_failures and r.verdict in ("pass", "skip"):
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
            stable = "" if r.verdict != "fail" or r.stable is None else ("yes" if r.stable else "no")
            lines.append(
                f"{c.dtype:9s} {shape:>12s} {c.kind:13s} {eps:>22s} " + " ".join(cols) + f" {stable:>6s}  "
                + self._verdict(r) + (f"  {c.setting}" if c.setting else "")
            )  # fmt: skip
        return "\n".join(lines)

    @staticmethod
    def _verdict(r: CellResult) -> str:
        text = r.verdict.upper()
        if r.verdict == "fail":
            codes = sorted({o.explained_by for o in r.outputs.values() if o.failed and o.explained_by})
            text += f" [{', '.join(codes)}]" if r.explained else " [unexplained]" if r.explained is not None else ""
        if r.verdict == "error" and r.forward_verdict is not None:
            text += f" (forward {r.forward_verdict.upper()})"
        if r.note and (r.verdict != "pass"):
            text += f" ({r.note})"
        return text

    def summary(self) -> str:
        """``PASSED``/``FAILED``, the counts (failing cells explained and unexplained), the worst error."""
        n = len(self.results)
        failed = self.count("fail")
        parts = [f"{self.count('pass')} passed", f"{failed} failed"]
        if failed and any(r.explained is not None for r in self.results):
            extra = f"{self.explained} explained, {self.unexplained} unexplained"
            if self.stable_failures:
                extra += f"; {self.stable_failures} within backward-stable error"
            parts[-1] += f" ({extra})"
        if self.count("error"):
            parts.append(f"{self.count('error')} raised")
        if self.count("skip"):
            parts.append(f"{self.count('skip')} skipped")
        w = self.worst()
        worst = ""
        if w is not None:
            r, k, v = w
            worst = f"; worst {k} {_fmt(v)} ulps (budget {r.outputs[k].budget:g}) at {r.cell.label}"
        verdict = "PASSED" if self.passed else "FAILED"
        grads = "forward + backward" if self.backward_checked else "forward only"
        counts = ", ".join(parts)
        notes = "".join(f" ({note})" for note in self.notes)
        return (
            f"{verdict}: {self.op} ({self.target}, {grads}): {n} cells, {counts}{worst} [{self.seconds:.1f} s]{notes}"
        )

    def lines(self, cli: bool = False, only_failures: bool = False) -> list[str]:
        """The table, a line per diagnosis (in the command line's words with ``cli``), the summary."""
        out = [self.table(only_failures)]
        if self.diagnoses:
            out.append("")
            out.extend(f"diagnosis: {d.render(cli)}" for d in self.diagnoses)
        if self.stable_failures:
            out.append(
                f"note: {self.stable_failures} failing cells are within what a backward-stable algorithm may lose "
                f"(column 'stable'): the exact-oracle contract is stricter there (docs/oracle.md)"
            )
        out.append("")
        out.append(self.summary())
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def to_json(self) -> dict[str, Any]:
        from .. import __version__

        return {
            "pynorm_version": __version__,
            "op": self.op,
            "target": self.target,
            "conventions": self.conventions,
            "reference_conventions": self.reference,
            "budgets": self.budgets.to_json(),
            "passed": self.passed,
            "summary": self.summary(),
            "failing_cells": {
                "explained": self.explained,
                "unexplained": self.unexplained,
                "within_backward_stable_error": self.stable_failures,
            },
            "diagnoses": [d.to_json() for d in self.diagnoses],
            "cells": [r.to_json() for r in self.results],
            "seconds": self.seconds,
            "notes": self.notes,
        }

    def write_json(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, indent=1)
            f.write("\n")
