"""The conformance check: run a user's implementation of an op over the grid, against pynorm's reference.

:func:`check` is the Python API of ``python -m pynorm check``. The calling convention of the user's
functions (``docs/oracle.md``):

* ``forward(x, *inputs, *params, **keyword_inputs, **conventions) -> y`` -- called like pynorm's own
  ``pynorm.<op>(x, ...)``: ``x`` a NumPy array whose trailing ``len(normalized_shape)`` axes are
  normalized together; feature parameters have the normalized shape (PyTorch's ``normalized_shape``),
  scalars ``(1,)``, tables ``(M, *normalized_shape)``; ``conventions`` holds ``eps`` (for ops that have
  one: the grid varies it) and every ``--convention`` given. An op with several outputs (``add_layer_norm``:
  ``(y, h)``) returns a tuple of them. The result may be any array-like.
* ``backward(dy, x, *inputs, *params, **keyword_inputs, **conventions) -> (dx, *dinputs, *dparams)``:
  one gradient per name of ``pynorm.ops.SPECS[op].grad_names`` (``dx``, the differentiable inputs, the
  parameters), given the upstream gradient ``dy`` of the first output.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ArgumentError, PynormError
from ..ops import OpSpec, get
from ..testing import _dtype, flat_arrays, max_ulp_error, term_scales
from .grid import Case, Cell, default_grid, make_case, quick_grid

__all__ = [
    "DEFAULT_BUDGETS",
    "Budgets",
    "CellResult",
    "CheckReport",
    "call_backward",
    "call_forward",
    "check",
    "parse_budget",
]

#: default budgets in ulps of each output's dtype at the terms' magnitude: ``y`` (and the other forward
#: outputs), ``dx``, and ``dparam`` for every other gradient. Half dtypes: what one rounding of a float32
#: computation gives (a second rounding -- Llama's order -- exceeds it); float32: a float32 computation;
#: float64: a float64 one.
DEFAULT_BUDGETS: dict[str, dict[str, float]] = {
    "float16": {"y": 1.0, "dx": 2.0, "dparam": 2.0},
    "bfloat16": {"y": 1.0, "dx": 2.0, "dparam": 2.0},
    "float32": {"y": 8.0, "dx": 32.0, "dparam": 64.0},
    "float64": {"y": 8.0, "dx": 32.0, "dparam": 64.0},
}


@dataclass
class Budgets:
    """Ulp budgets per dtype and output: defaults, overridden by ``overrides[(dtype or None, name)]``.

    ``name`` is an output (``y``, ``h``...), ``dx``, a gradient name (``dweight``) or ``dparam`` (every
    gradient but ``dx``); a ``None`` dtype applies to every dtype.
    """

    overrides: dict[tuple[str | None, str], float] = field(default_factory=dict)

    def get(self, dtype: str, name: str) -> float:
        table = DEFAULT_BUDGETS.get(dtype, DEFAULT_BUDGETS["float64"])
        group = name if name in ("y", "dx") else ("dparam" if name.startswith("d") else "y")
        for key in ((dtype, name), (None, name), (dtype, group), (None, group)):
            if key in self.overrides:
                return self.overrides[key]
        return table[group]

    def to_json(self) -> dict[str, Any]:
        return {
            "defaults": DEFAULT_BUDGETS,
            "overrides": {f"{d}:{n}" if d else n: v for (d, n), v in self.overrides.items()},
        }


def parse_budget(text: str | Mapping[str, float] | None) -> Budgets:
    """``"y=4,dx=16"`` or ``"float16:y=2,dweight=8"`` (or a dict of the same keys) as :class:`Budgets`.

    Raises :class:`pynorm.errors.ArgumentError` naming ``budget`` for bad syntax or a negative value.
    """
    out: dict[tuple[str | None, str], float] = {}
    if text is None:
        return Budgets(out)
    items: list[tuple[str, Any]]
    if isinstance(text, Mapping):
        items = list(text.items())
    else:
        items = []
        for part in filter(None, (p.strip() for p in text.split(","))):
            if "=" not in part:
                raise ArgumentError(f"budget: expected name=ulps (e.g. y=4,dx=16), got {part!r}")
            k, v = part.split("=", 1)
            items.append((k.strip(), v.strip()))
    for k, v in items:
        dt, _, name = k.rpartition(":")
        if dt and dt not in DEFAULT_BUDGETS:
            raise ArgumentError(f"budget: unknown dtype {dt!r} in {k!r} (dtypes: {', '.join(DEFAULT_BUDGETS)})")
        if not name.isidentifier():
            raise ArgumentError(f"budget: {k!r} is not an output name (y, dx, dweight, dparam...)")
        try:
            ulps = float(v)
        except (TypeError, ValueError):
            raise ArgumentError(f"budget: {k}={v!r} is not a number of ulps") from None
        if not ulps >= 0:
            raise ArgumentError(f"budget: {k}={v!r} must be >= 0 ulps")
        out[(dt or None, name)] = ulps
    return Budgets(out)


@dataclass
class CellResult:
    """The outcome of one cell.

    Attributes
    ----------
    cell : the :class:`~pynorm.oracle.grid.Cell`.
    errors : largest error in ulps per output and gradient (``inf`` where the user's value is non-finite
        and the reference's is not, or the shapes differ).
    budgets : the budget each error was judged against.
    verdict : ``"pass"``, ``"fail"`` (some error above its budget), ``"error"`` (the user's function
        raised or returned the wrong number of results) or ``"skip"`` (the reference rejects the cell).
    nonfinite : per output, how many elements are non-finite where the reference's are finite.
    note : the exception or mismatch, for ``"error"``/``"skip"`` cells and dtype or shape notes.
    """

    cell: Cell
    errors: dict[str, float] = field(default_factory=dict)
    budgets: dict[str, float] = field(default_factory=dict)
    verdict: str = "pass"
    nonfinite: dict[str, int] = field(default_factory=dict)
    note: str = ""

    @property
    def failed_outputs(self) -> list[str]:
        return [k for k, v in self.errors.items() if not v <= self.budgets[k]]

    def to_json(self) -> dict[str, Any]:
        return {
            **self.cell.to_json(),
            "verdict": self.verdict,
            "errors_ulps": {k: _num(v) for k, v in self.errors.items()},
            "budgets_ulps": self.budgets,
            "nonfinite": self.nonfinite,
            "note": self.note,
        }


def _num(v: float) -> float | str:
    return v if math.isfinite(v) else ("inf" if v > 0 else "nan" if math.isnan(v) else "-inf")


@dataclass
class Evaluated:
    """What the diagnoses need of a failing cell: its arrays, the user's and the reference's results."""

    case: Case
    user: dict[str, np.ndarray]
    ref: dict[str, np.ndarray]
    scales: dict[str, Any]
    dtypes: dict[str, Any]


@dataclass
class CheckReport:
    """The result of :func:`check`: one :class:`CellResult` per cell, the diagnoses, the budgets.

    ``str(report)`` is the table, the diagnoses and the summary line; :meth:`to_json` has every number.
    """

    op: str
    target: str
    conventions: dict[str, Any]
    budgets: Budgets
    results: list[CellResult] = field(default_factory=list)
    diagnoses: list[Any] = field(default_factory=list)
    seconds: float = 0.0
    backward_checked: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        """True when no cell failed or raised (skipped cells do not count)."""
        return all(r.verdict in ("pass", "skip") for r in self.results)

    def count(self, verdict: str) -> int:
        return sum(r.verdict == verdict for r in self.results)

    def worst(self) -> tuple[CellResult, str, float] | None:
        """The cell and output with the largest error relative to its budget (None if nothing was measured)."""
        best: tuple[float, CellResult, str, float] | None = None
        for r in self.results:
            for k, v in r.errors.items():
                rel = v / max(r.budgets[k], 1e-300) if math.isfinite(v) else math.inf
                if best is None or rel > best[0]:
                    best = (rel, r, k, v)
        return None if best is None else best[1:]

    def output_names(self) -> list[str]:
        names: list[str] = []
        for r in self.results:
            for k in r.errors:
                if k not in names:
                    names.append(k)
        return names

    def table(self, only_failures: bool = False) -> str:
        names = self.output_names()
        head = f"{'dtype':9s} {'shape':>12s} {'kind':13s} {'eps':>7s} " + " ".join(f"{n:>10s}" for n in names)
        lines = [
            f"{self.op} vs pynorm's reference: max error in ulps of the output dtype at the terms' magnitude "
            f"(* = over budget)",
            head + "  verdict",
            "-" * (len(head) + 9),
        ]
        for r in self.results:
            if only_failures and r.verdict in ("pass", "skip"):
                continue
            c = r.cell
            cells = []
            for n in names:
                if n not in r.errors:
                    cells.append(f"{'-':>10s}")
                    continue
                v = r.errors[n]
                s = _fmt(v) + ("*" if not v <= r.budgets[n] else " ")
                cells.append(f"{s:>10s}")
            eps = "-" if c.eps is None else f"{c.eps:g}"
            shape = "x".join(map(str, c.shape))
            verdict = r.verdict.upper() + (f" ({r.note})" if r.note and r.verdict in ("error", "skip") else "")
            lines.append(f"{c.dtype:9s} {shape:>12s} {c.kind:13s} {eps:>7s} " + " ".join(cells) + "  " + verdict)
        return "\n".join(lines)

    def summary(self) -> str:
        n = len(self.results)
        parts = [f"{self.count('pass')} passed", f"{self.count('fail')} failed"]
        if self.count("error"):
            parts.append(f"{self.count('error')} raised")
        if self.count("skip"):
            parts.append(f"{self.count('skip')} skipped")
        w = self.worst()
        worst = ""
        if w is not None:
            r, k, v = w
            worst = f"; worst {k} {_fmt(v)} ulps (budget {r.budgets[k]:g}) at {r.cell.label}"
        verdict = "PASSED" if self.passed else "FAILED"
        grads = "forward + backward" if self.backward_checked else "forward only"
        counts = ", ".join(parts)
        notes = "".join(f" ({note})" for note in self.notes)
        return (
            f"{verdict}: {self.op} ({self.target}, {grads}): {n} cells, {counts}{worst} [{self.seconds:.1f} s]{notes}"
        )

    def __str__(self) -> str:
        out = [self.table()]
        if self.diagnoses:
            out.append("")
            out.extend(f"diagnosis: {d.message}" for d in self.diagnoses)
        out.append("")
        out.append(self.summary())
        return "\n".join(out)

    def to_json(self) -> dict[str, Any]:
        from .. import __version__

        return {
            "pynorm_version": __version__,
            "op": self.op,
            "target": self.target,
            "conventions": self.conventions,
            "budgets": self.budgets.to_json(),
            "passed": self.passed,
            "summary": self.summary(),
            "diagnoses": [d.to_json() for d in self.diagnoses],
            "cells": [r.to_json() for r in self.results],
            "seconds": self.seconds,
        }

    def write_json(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, indent=1)
            f.write("\n")


def _fmt(v: float) -> str:
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "inf"
    return f"{v:.2f}" if v < 1000 else f"{v:.2e}"


def _split_args(spec: OpSpec, args: Sequence[Any]) -> tuple[list[Any], dict[str, Any]]:
    n = len(spec.inputs)
    pos: list[Any] = []
    kw: dict[str, Any] = {}
    for inp, a in zip(spec.inputs, args[:n], strict=True):
        if inp.keyword:
            if a is not None:
                kw[inp.name] = a
        else:
            pos.append(a)
    return [*pos, *args[n:]], kw


def _fresh_x(x: np.ndarray) -> np.ndarray:
    """A copy of ``x`` with the same layout: C-contiguous, or every other element of a wider buffer."""
    if x.flags.c_contiguous:
        return x.copy()
    wide = np.zeros((*x.shape[:-1], 2 * x.shape[-1]), dtype=x.dtype)
    wide[..., ::2] = x
    return wide[..., ::2]


def call_forward(spec: OpSpec, forward: Callable[..., Any], case: Case, conventions: Mapping[str, Any]) -> Any:
    """Call a user's ``forward`` on ``case`` by the documented convention (copies of every array)."""
    pos, kw = _split_args(spec, [None if a is None else a.copy() for a in case.args])
    return forward(_fresh_x(case.x), *pos, **kw, **conventions)


def call_backward(spec: OpSpec, backward: Callable[..., Any], case: Case, conventions: Mapping[str, Any]) -> Any:
    """Call a user's ``backward`` on ``case``: ``backward(dy, x, *inputs, *params, **kw, **conventions)``."""
    pos, kw = _split_args(spec, [None if a is None else a.copy() for a in case.args])
    return backward(case.dy.copy(), _fresh_x(case.x), *pos, **kw, **conventions)


def have_bfloat16() -> bool:
    """Whether ``ml_dtypes`` (bfloat16) is installed; without it the bfloat16 cells are left out."""
    try:
        import ml_dtypes  # noqa: F401
    except ImportError:
        return False
    return True


def reference(spec: OpSpec, case: Case) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """pynorm's reference outputs and gradients for ``case``, by name."""
    import pynorm

    fwd = spec.generic_forward()
    bwd = getattr(pynorm, f"{spec.name}_backward")
    res, ctx = fwd(np.ascontiguousarray(case.x), *case.args, axis=case.axis, backend="numpy", **case.options)
    outs = res if isinstance(res, tuple) else (res,)
    grads = bwd(case.dy, ctx)
    # outputs beyond the spec's names (quant_layer_norm's (q, s) when quantizing) are named by position
    names = [*spec.outputs, *(f"out{i}" for i in range(len(spec.outputs), len(outs)))]
    return (
        dict(zip(names, outs, strict=False)),
        {k: g for k, g in zip(grads._fields, grads, strict=True) if g is not None},
    )


def scales_of(spec: OpSpec, case: Case, ref_out: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """The term scales of every output of ``case`` (:func:`pynorm.testing.term_scales`)."""
    x = np.ascontiguousarray(case.x)
    ax = case.axis % x.ndim
    rows = int(np.prod(x.shape[:ax]))
    arrays = flat_arrays(spec, x.shape, ax, case.args)
    if "h" in ref_out:
        arrays["h"] = np.asarray(ref_out["h"]).astype(np.float64).reshape(rows, -1)
    x2 = x.reshape(rows, -1).astype(np.float64)
    dy2 = case.dy.reshape(rows, -1).astype(np.float64)
    return term_scales(spec.name, x2, arrays, dy2, case.options)


def _as_numpy(a: Any) -> np.ndarray:
    if hasattr(a, "detach") and hasattr(a, "numpy"):  # a torch tensor
        a = a.detach().cpu().numpy()
    return np.asarray(a)


def error_ulps(actual: np.ndarray, expected: np.ndarray, dtype: Any, scale: Any = None) -> float:
    """The largest error in ulps of ``dtype`` at ``max(|expected|, scale)``; for an integer dtype (an int8
    output), the largest difference in levels."""
    if np.dtype(_dtype(dtype)).kind in "iu":
        with np.errstate(invalid="ignore"):
            d = np.abs(np.asarray(actual, np.float64) - np.asarray(expected, np.float64))
        return float(np.max(np.where(np.isnan(d), np.inf, d), initial=0.0))
    return max_ulp_error(actual, expected, dtype, scale=scale)


def compare(
    name: str, user: Any, ref: np.ndarray, dtype: Any, scale: Any, budget: float, result: CellResult
) -> np.ndarray | None:
    """Record the largest ulp error of ``user`` against ``ref`` in ``result``; the user's array as float64."""
    u = _as_numpy(user)
    result.budgets[name] = budget
    if u.shape != ref.shape:
        if u.size != ref.size:
            result.errors[name] = math.inf
            result.note = (result.note + "; " if result.note else "") + f"{name} shape {u.shape} != {ref.shape}"
            return None
        u = u.reshape(ref.shape)
    with np.errstate(all="ignore"):
        u64 = u.astype(np.float64)
    r64 = np.asarray(ref).astype(np.float64)
    sc = None
    if scale is not None:
        s = np.asarray(scale, dtype=np.float64)
        sc = s.reshape(ref.shape) if s.size == ref.size else s if s.size == 1 else None
    # the grid's inputs are finite: a NaN in the reference is 0/0 (eps = 0 on a row without spread, e.g. a
    # "huge" row clipped to one value), where the exact result is undefined and any value is accepted
    undefined = np.isnan(r64)
    if undefined.any():
        u64 = np.where(undefined, r64, u64)
    result.errors[name] = error_ulps(u64, r64, dtype, sc)
    bad = int(np.sum(~np.isfinite(u64) & np.isfinite(r64)))
    if bad:
        result.nonfinite[name] = bad
    return u64


class _Progress:
    """tqdm when it is installed, else a counter on stderr; silent when disabled."""

    def __init__(self, total: int, enabled: bool, desc: str) -> None:
        self.total, self.enabled, self.n, self.desc = total, enabled, 0, desc
        self.bar: Any = None
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, desc=desc, unit="cell", file=sys.stderr, leave=False)
            except ImportError:
                self.bar = None

    def update(self) -> None:
        self.n += 1
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(1)
        elif self.n == self.total or self.n % max(1, self.total // 20) == 0:
            print(f"\r{self.desc}: {self.n}/{self.total} cells", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            print(file=sys.stderr)


def check(
    op: str,
    forward: Callable[..., Any],
    backward: Callable[..., Any] | None = None,
    *,
    conventions: Mapping[str, Any] | None = None,
    budget: str | Mapping[str, float] | Budgets | None = None,
    grid: str | Sequence[Cell] = "default",
    dtypes: Sequence[str] | None = None,
    seed: int = 0,
    progress: bool = False,
    diagnose: bool = True,
    target: str = "",
) -> CheckReport:
    """Check a user's implementation of ``op`` against pynorm's reference over the conformance grid.

    Parameters
    ----------
    op : an op of :data:`pynorm.ops.SPECS` (:class:`pynorm.errors.UnknownOpError` otherwise).
    forward, backward : the user's functions, called as the module docstring says.
    conventions : the op's options (``{"eps": 1e-6, "correction": 1}``), passed to the user's functions
        and to the reference; ``eps`` sets the grid's non-zero eps.
    budget : ``"y=4,dx=16"``, a dict, or :class:`Budgets` (default :data:`DEFAULT_BUDGETS`).
    grid : ``"default"``, ``"quick"`` or a list of cells (:mod:`pynorm.oracle.grid`).
    dtypes : restrict the grid to these dtype names.
    seed : seed of the inputs (each cell's arrays depend on the seed, the op and the cell only).
    progress : show a progress bar on stderr (tqdm if installed).
    diagnose : run the diagnoses on failing cells (:mod:`pynorm.oracle.diagnose`).
    target : a label for the report (the CLI passes ``MODULE:FUNCTION``).

    Returns
    -------
    CheckReport
    """
    from .diagnose import run_diagnoses

    spec = get(op)
    conv = spec.validate(dict(conventions or {}))  # raises for unknown or bad options
    user_conv = dict(conventions or {})
    budgets = budget if isinstance(budget, Budgets) else parse_budget(budget)
    if isinstance(grid, str):
        if grid not in ("default", "quick"):
            raise ArgumentError(f"grid must be 'default', 'quick' or a list of cells, got {grid!r}")
        cells = (default_grid if grid == "default" else quick_grid)(spec, user_conv)
    else:
        cells = list(grid)
    notes: list[str] = []
    if not have_bfloat16() and any(c.dtype == "bfloat16" for c in cells):
        cells = [c for c in cells if c.dtype != "bfloat16"]
        notes.append("bfloat16 cells left out: pip install ml_dtypes")
    if dtypes is not None:
        names = {str(d) if str(d) == "bfloat16" else np.dtype(d).name for d in dtypes}
        cells = [c for c in cells if c.dtype in names]
    report = CheckReport(op, target or getattr(forward, "__name__", "forward"), user_conv, budgets)
    report.backward_checked = backward is not None
    report.notes = notes
    kept: list[tuple[CellResult, Evaluated]] = []
    half: list[tuple[CellResult, Evaluated]] = []
    bar = _Progress(len(cells), progress, f"check {op}")
    t0 = time.perf_counter()
    try:
        for cell in cells:
            result, ev = _run_cell(spec, cell, forward, backward, user_conv, conv, budgets, seed)
            report.results.append(result)
            if ev is not None and result.verdict == "fail" and len(kept) < 400:
                kept.append((result, ev))
            if ev is not None and cell.dtype in ("float16", "bfloat16") and cell.hidden <= 4096 and len(half) < 200:
                half.append((result, ev))
            bar.update()
    finally:
        bar.close()
    if diagnose:
        report.diagnoses = run_diagnoses(spec, report, kept, budgets, half)
    report.seconds = time.perf_counter() - t0
    return report


def _run_cell(
    spec: OpSpec,
    cell: Cell,
    forward: Callable[..., Any],
    backward: Callable[..., Any] | None,
    user_conv: dict[str, Any],
    conv: dict[str, Any],
    budgets: Budgets,
    seed: int,
) -> tuple[CellResult, Evaluated | None]:
    result = CellResult(cell)
    case = make_case(spec, cell, user_conv, seed)
    call_conv = dict(user_conv)
    if cell.eps is not None:
        call_conv["eps"] = cell.eps
    try:
        with np.errstate(all="ignore"):
            ref_out, ref_grads = reference(spec, case)
            scales = scales_of(spec, case, ref_out)
    except PynormError as e:  # the reference rejects this cell for these conventions (correction=1 at H = 1)
        result.verdict, result.note = "skip", str(e)
        return result, None
    dt = _dtype(cell.dtype)
    out_dtypes = dict(zip(spec.outputs, spec.dtypes_of_outputs(dt, {**conv, **case.options}), strict=False))
    user: dict[str, np.ndarray] = {}
    dtypes: dict[str, Any] = {}
    try:
        with np.errstate(all="ignore"):
            res = call_forward(spec, forward, case, call_conv)
        outs = list(res) if isinstance(res, (tuple, list)) and len(ref_out) > 1 else [res]
        if len(outs) > len(ref_out):
            raise TypeError(f"forward returned {len(outs)} outputs, {spec.name} has {len(ref_out)}")
        if len(outs) < len(ref_out):
            missing = ", ".join(list(ref_out)[len(outs) :])
            result.note = (result.note + "; " if result.note else "") + f"not returned, not checked: {missing}"
        for name, u in zip(ref_out, outs, strict=False):
            dtypes[name] = out_dtypes.get(name, ref_out[name].dtype)
            got = compare(name, u, ref_out[name], dtypes[name], scales.get(name), budgets.get(cell.dtype, name), result)
            if got is not None:
                user[name] = got
            ud = getattr(u, "dtype", None)
            if ud is not None and str(ud).replace("torch.", "") != np.dtype(dtypes[name]).name:
                result.note = (result.note + "; " if result.note else "") + f"{name} dtype {ud}"
        if backward is not None:
            with np.errstate(all="ignore"):
                grads = list(call_backward(spec, backward, case, call_conv))
            want = [g for g in spec.grad_names if g in ref_grads]
            present = [g for g in grads if g is not None]
            if len(grads) != len(spec.grad_names) and len(present) != len(want):
                raise TypeError(f"backward returned {len(grads)} gradients, expected {', '.join(spec.grad_names)}")
            pairs = (
                zip(spec.grad_names, grads, strict=True)
                if len(grads) == len(spec.grad_names)
                else zip(want, present, strict=True)
            )
            for name, g in pairs:
                if name not in ref_grads or g is None:
                    continue
                r = ref_grads[name]
                dtypes[name] = r.dtype
                got = compare(name, g, r, r.dtype, scales.get(name), budgets.get(cell.dtype, name), result)
                if got is not None:
                    user[name] = got
    except Exception as e:  # the user's code failed on this cell: recorded, not raised
        result.verdict, result.note = "error", f"{type(e).__name__}: {e}"[:200]
        return result, None
    result.verdict = "fail" if result.failed_outputs else "pass"
    ref = {**ref_out, **ref_grads}
    return result, Evaluated(case, user, {k: np.asarray(v) for k, v in ref.items()}, scales, dtypes)
