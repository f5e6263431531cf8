"""The conformance check: run a user's implementation of an op over the grid, against pynorm's reference.

:func:`check` is the Python API of ``python -m pynorm check``. The calling convention of the user's
functions (``docs/oracle.md``):

* ``forward(x, *inputs, *params, **keyword_inputs, **conventions) -> y`` -- called like pynorm's own
  ``pynorm.<op>(x, ...)``: ``x`` a NumPy array whose trailing ``len(normalized_shape)`` axes are
  normalized together; feature parameters have the normalized shape (PyTorch's ``normalized_shape``),
  scalars ``(1,)``, tables ``(M, *normalized_shape)``; ``conventions`` holds ``eps`` (for ops that have
  one: the grid varies it) and every convention given. An op with several outputs (``add_layer_norm``:
  ``(y, h)``) returns a tuple of them. The result may be any array-like (a torch tensor, a JAX array).
* ``backward(dy, x, *inputs, *params, **keyword_inputs, **conventions) -> (dx, *dinputs, *dparams)``:
  one gradient per name of ``pynorm.ops.SPECS[op].grad_names`` (``dx``, the differentiable inputs, the
  parameters), given the upstream gradient ``dy`` of the first output.

Reference-only conventions (``reference=``, ``--reference``) change the reference and not what the user's
functions receive: ``reference={"casting": "llama"}`` checks an implementation that rounds like HF's Llama.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .._measure import ulp
from ..errors import ArgumentError, ArgumentTypeError, PynormError
from ..ops import OpSpec, get
from ._dtypes import DTYPE_NAMES, dtype_name, dtype_of, have_bfloat16
from .batch import check_batch_invariance
from .diagnose import Advice, run_diagnoses
from .evaluate import (
    Budgets,
    CellResult,
    Evaluated,
    call_backward,
    call_forward,
    measure,
    parse_budget,
    run_reference,
    scales_of,
)
from .grid import Cell, default_grid, make_case, quick_grid
from .models import models_for
from .report import CheckReport
from .stability import allowances

__all__ = ["check", "validate_options"]


def validate_options(spec: OpSpec, options: Mapping[str, Any] | None, what: str) -> dict[str, Any]:
    """``options`` checked against ``spec``'s options: a :class:`pynorm.errors.ArgumentError` naming ``what``
    (``conventions`` or ``reference``) for an unknown name or a bad value; returns them as given."""
    opts = dict(options or {})
    known = [o.name for o in spec.options]
    unknown = sorted(set(opts) - set(known))
    if unknown:
        raise ArgumentError(
            f"{what}: {spec.name} has no option {', '.join(map(repr, unknown))} (its options: {', '.join(known)})"
        )
    try:
        spec.validate(with_required(spec, opts))
    except ArgumentError as e:
        raise ArgumentError(f"{what}: {e}") from None
    return opts


#: placeholders of the required options the grid sets per cell (GroupNorm's ``num_groups``, BatchNorm's
#: ``training``), for validating the conventions alone
_GRID_SETS = {"num_groups": 1, "training": True}


def with_required(spec: OpSpec, options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` with the required options the grid sets per cell filled in (for validating them alone)."""
    out = dict(options)
    for o in spec.options:
        if o.name in _GRID_SETS and o.name not in out and spec.layout == "channels":
            out[o.name] = _GRID_SETS[o.name]
    return out


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
    reference: Mapping[str, Any] | None = None,
    budget: str | Mapping[str, float] | Budgets | None = None,
    grid: str | Sequence[Cell] = "default",
    dtypes: Sequence[str] | None = None,
    seed: int = 0,
    progress: bool = False,
    diagnose: bool = True,
    target: str = "",
    strict: bool = False,
    batch_invariance: bool | None = None,
    advise: bool = True,
) -> CheckReport:
    """Check a user's implementation of ``op`` against pynorm's reference over the conformance grid.

    Parameters
    ----------
    op : an op of :data:`pynorm.ops.SPECS` (:class:`pynorm.errors.UnknownOpError` otherwise).
    forward, backward : the user's functions, called as the module docstring says.
    conventions : the op's options (``{"eps": 1e-6, "correction": 1}``), passed to the user's functions
        and to the reference; ``eps`` sets the grid's non-zero eps.
    reference : options for the reference only (``{"casting": "llama"}``): the user's functions do not receive
        them. A reference ``eps`` replaces the grid's non-zero eps on the reference's side.
    budget : ``"y=4,dx=16"``, a dict, or :class:`~pynorm.oracle.Budgets` (default
        :data:`~pynorm.oracle.DEFAULT_BUDGETS`).
    grid : ``"default"``, ``"quick"`` or a list of cells (:mod:`pynorm.oracle.grid`).
    dtypes : restrict the grid to these dtype names.
    seed : seed of the inputs (each cell's arrays depend on the seed, the op and the cell only).
    progress : show a progress bar on stderr (tqdm if installed).
    diagnose : run the diagnoses on failing cells (:mod:`pynorm.oracle.diagnose`).
    target : a label for the report (the CLI passes ``MODULE:FUNCTION``).
    strict : cells of tier ``stable`` (beyond the exact budget, within what a backward-stable algorithm may lose)
        fail the check too; by default only tier ``fail`` does.
    batch_invariance : check that each row's outputs are bitwise the same in calls of other batch sizes and row
        offsets (:mod:`pynorm.oracle.batch`); default: on for the named grids, off for a list of cells.
    advise : verify the advice: for the conventions of the joint diagnoses, run the check again with them as
        reference options and report the outcome (``report.advice``).

    Returns
    -------
    CheckReport

    Raises
    ------
    pynorm.errors.UnknownOpError
        ``op`` is not an op.
    pynorm.errors.ArgumentError
        an unknown or bad option in ``conventions`` or ``reference`` (the message names which), a bad ``grid``,
        ``dtypes`` or ``budget``.
    pynorm.errors.ArgumentTypeError
        ``forward`` or ``backward`` is not callable.
    """
    if not callable(forward):
        raise ArgumentTypeError(f"forward must be callable, got {type(forward).__name__}")
    if backward is not None and not callable(backward):
        raise ArgumentTypeError(f"backward must be callable or None, got {type(backward).__name__}")
    spec = get(op)
    user_conv = validate_options(spec, conventions, "conventions")
    ref_only = validate_options(spec, reference, "reference")
    validate_options(spec, {**user_conv, **ref_only}, "reference")
    budgets = budget if isinstance(budget, Budgets) else parse_budget(budget)
    named_grid = isinstance(grid, str)
    if isinstance(grid, str):
        if grid not in ("default", "quick"):
            raise ArgumentError(f"grid must be 'default', 'quick' or a list of cells, got {grid!r}")
        cells = (default_grid if grid == "default" else quick_grid)(spec, user_conv)
    else:
        cells = list(grid)
        bad = [c for c in cells if not isinstance(c, Cell)]
        if bad:
            raise ArgumentError(f"grid: expected pynorm.oracle.Cell items, got {type(bad[0]).__name__}")
    notes: list[str] = []
    if dtypes is not None:
        names = [dtype_name(d) for d in dtypes]
        unknown = [n for n in names if n not in DTYPE_NAMES]
        if unknown:
            raise ArgumentError(
                f"dtypes: unknown dtype(s) {', '.join(unknown)} (the grid has {', '.join(DTYPE_NAMES)})"
            )
        cells = [c for c in cells if c.dtype in names]
    if not have_bfloat16() and any(c.dtype == "bfloat16" for c in cells):
        cells = [c for c in cells if c.dtype != "bfloat16"]
        notes.append("bfloat16 cells left out: pip install ml_dtypes")
    report = CheckReport(
        op, target or getattr(forward, "__name__", "forward"), user_conv, budgets, reference=ref_only, strict=strict
    )
    report.backward_checked = backward is not None
    report.notes = notes
    evaluated: list[Evaluated] = []
    runner = _CellRunner(spec, forward, backward, user_conv, ref_only, budgets, seed)
    bar = _Progress(len(cells), progress, f"check {op}")
    t0 = time.perf_counter()
    try:
        for cell in cells:
            result, ev = runner.run(cell)
            report.results.append(result)
            if ev is not None:
                evaluated.append(ev)
            bar.update()
    finally:
        bar.close()
    for ev in evaluated:
        if ev.result.verdict == "fail":
            _mark_stability(spec, ev)
    if diagnose:
        models = models_for(spec, spec.validate(with_required(spec, {**user_conv, **ref_only})))
        errors = [r for r in report.results if r.verdict == "error"]
        with np.errstate(all="ignore"):  # the models' non-finite values are compared, not warned about
            report.diagnoses, report.joint = run_diagnoses(
                spec, evaluated, budgets, models, errors, runner.rerun, strict
            )
        if advise:
            report.advice = _verified_advice(report, cells, lambda ref, sub: check(
                op, forward, backward, conventions=user_conv, reference=ref, budget=budgets, grid=sub, seed=seed,
                diagnose=False, strict=strict, batch_invariance=False,
            ))  # fmt: skip
    if batch_invariance or (batch_invariance is None and named_grid):
        dts = sorted({c.dtype for c in cells}, key=DTYPE_NAMES.index)
        report.batch = check_batch_invariance(spec, forward, backward, user_conv, dts, seed)
    report.seconds = time.perf_counter() - t0
    return report


def _verified_advice(
    report: CheckReport, cells: Sequence[Cell], rerun: Callable[[dict[str, Any], list[Cell]], CheckReport]
) -> list[Advice]:
    """The reference options of the joint diagnoses' conventions, grouped by the dtypes they hold in, each checked
    by running the cells of those dtypes again with them (only advice that leaves fewer failing cells is kept)."""
    groups: dict[str, tuple[dict[str, Any], list[str], list[str]]] = {}
    for j in report.joint:
        if not j.options:
            continue
        key = repr(sorted(j.options.items()))
        opts, dts, causes = groups.setdefault(key, (dict(j.options), [], []))
        dts.append(j.dtype)
        causes.extend(c for c in j.conventions if c not in causes)
    out: list[Advice] = []
    checked = sorted({c.dtype for c in cells}, key=DTYPE_NAMES.index)
    for opts, dts, causes in groups.values():
        sub = [c for c in cells if c.dtype in dts]
        before = sum(r.fails(report.strict) or r.verdict == "error" for r in report.results if r.cell.dtype in dts)
        again = rerun({**report.reference, **opts}, sub)
        advice = Advice(opts, None if set(checked) <= set(dts) else dts, causes, again.tiers(), before)
        if advice.failing_after < before:
            out.append(advice)
    return out


def _mark_stability(spec: OpSpec, ev: Evaluated) -> None:
    failing = ev.result.failed_outputs
    allow = allowances(spec, ev.case, ev.dtype, {n: ev.ref[n].shape for n in failing if n in ev.ref})
    if allow is None:
        return
    for n in failing:
        o = ev.result.outputs[n]
        if n not in allow or n not in ev.user or o.shape is not None or o.dtype is not None:
            o.stable = False if n in allow else None
            continue
        u, r = ev.user[n], np.asarray(ev.ref[n], np.float64)
        sc = ev.scales.get(n)
        mag = np.abs(r)
        if sc is not None and np.size(sc) == r.size:
            mag = np.maximum(mag, np.abs(np.asarray(sc, np.float64).reshape(r.shape)))
        with np.errstate(invalid="ignore"):
            err = np.where(np.isnan(r), 0.0, np.abs(u - r))
            limit = allow[n] + o.budget * ulp(mag, ev.dtypes[n])
            ok = np.isfinite(u) | np.isnan(r)
        o.stable = bool(np.all(ok & (err <= limit)))


class _CellRunner:
    """Runs the user's functions and the reference on the cells of one check."""

    def __init__(
        self,
        spec: OpSpec,
        forward: Callable[..., Any],
        backward: Callable[..., Any] | None,
        user_conv: dict[str, Any],
        ref_only: dict[str, Any],
        budgets: Budgets,
        seed: int,
    ) -> None:
        self.spec, self.forward, self.backward = spec, forward, backward
        self.user_conv, self.ref_only, self.budgets, self.seed = user_conv, ref_only, budgets, seed

    def run(self, cell: Cell) -> tuple[CellResult, Evaluated | None]:
        spec = self.spec
        result = CellResult(cell)
        case = make_case(spec, cell, self.user_conv, self.seed)
        call = {**self.user_conv, **dict(cell.options)}
        ref_opts = {**self.user_conv, **self.ref_only, **dict(cell.options)}
        if cell.eps is not None:
            call["eps"] = cell.eps
            ref_opts["eps"] = float(self.ref_only.get("eps", cell.eps)) if cell.eps != 0.0 else 0.0
        result.eps = call.get("eps", spec.defaults().get("eps"))
        try:
            case.options = spec.validate(ref_opts, cell.hidden)
            with np.errstate(all="ignore"):
                run = run_reference(spec, case)
                scales = scales_of(spec, case, run.outputs)
        except PynormError as e:  # the reference rejects this cell for these conventions (correction=1 at H = 1)
            result.verdict, result.note = "skip", str(e)
            return result, None
        dt = dtype_of(cell.dtype)
        out_dtypes = dict(zip(spec.outputs, spec.dtypes_of_outputs(dt, case.options), strict=False))
        dtypes: dict[str, Any] = {n: dtype_of(out_dtypes.get(n, run.outputs[n].dtype)) for n in run.outputs}
        dtypes.update({n: g.dtype for n, g in run.grads.items()})
        ref = {**run.outputs, **run.grads}
        user: dict[str, np.ndarray] = {}
        # the models emulate the reference's conventions changed (the reference-only ones included)
        ev = Evaluated(case, dict(case.options), user, ref, scales, dtypes, result, run.ctx)
        self._measure(ev, call, result, user, contiguous=False)
        return result, ev if result.verdict != "skip" else None

    def _measure(
        self, ev: Evaluated, call: dict[str, Any], result: CellResult, user: dict[str, np.ndarray], *, contiguous: bool
    ) -> None:
        spec, case = self.spec, ev.case
        forward_names = [n for n in ev.ref if n not in self.spec.grad_names]
        try:
            with np.errstate(all="ignore"):
                res = call_forward(spec, self.forward, case, call, contiguous=contiguous)
            outs = list(res) if isinstance(res, (tuple, list)) and len(forward_names) > 1 else [res]
            if len(outs) > len(forward_names):
                raise TypeError(f"forward returned {len(outs)} outputs, {spec.name} has {len(forward_names)}")
            if len(outs) < len(forward_names):
                result.add_note(f"not returned, not checked: {', '.join(forward_names[len(outs) :])}")
            for name, u in zip(forward_names, outs, strict=False):
                self._one(ev, name, u, result, user)
        except Exception as e:  # the user's code failed on this cell: recorded, not raised
            result.verdict = "error"
            result.add_note(f"{type(e).__name__}: {e}"[:200])
            return
        result.forward_verdict = "fail" if result.failed_outputs else "pass"
        result.verdict = result.forward_verdict
        if self.backward is None:
            return
        grad_names = [g for g in spec.grad_names if g in ev.ref]
        try:
            with np.errstate(all="ignore"):
                grads = call_backward(spec, self.backward, case, call, contiguous=contiguous)
            grads = list(grads) if isinstance(grads, (tuple, list)) else [grads]
            present = [g for g in grads if g is not None]
            if len(grads) == len(spec.grad_names):
                pairs = list(zip(spec.grad_names, grads, strict=True))
            elif len(present) == len(grad_names):
                pairs = list(zip(grad_names, present, strict=True))
            else:
                raise TypeError(
                    f"backward returned {len(grads)} gradients, expected {len(spec.grad_names)} "
                    f"({', '.join(spec.grad_names)})"
                )
            for name, g in pairs:
                if name in ev.ref and g is not None:
                    self._one(ev, name, g, result, user)
        except Exception as e:  # the forward's result stands; the backward's failure is recorded beside it
            result.verdict = "error"
            result.add_note(f"backward: {type(e).__name__}: {e}"[:200])
            return
        result.verdict = "fail" if result.failed_outputs else "pass"

    def _one(self, ev: Evaluated, name: str, value: Any, result: CellResult, user: dict[str, np.ndarray]) -> None:
        budget = self.budgets.get(ev.dtype, name)
        with np.errstate(all="ignore"):  # inf where the reference is finite: counted, not warned about
            check, u64 = measure(value, ev.ref[name], ev.dtypes[name], ev.scales.get(name), budget)
        result.outputs[name] = check
        if check.dtype is not None:
            result.add_note(f"{name} is {check.dtype}, {dtype_name(ev.dtypes[name])} expected")
        if check.shape is not None:
            result.add_note(f"{name} has shape {check.shape}, {tuple(ev.ref[name].shape)} expected")
        if u64 is not None:
            user[name] = u64

    def rerun(self, ev: Evaluated) -> CellResult | None:
        """The cell re-run with a C-contiguous copy of ``x`` (the same values)."""
        result = CellResult(ev.result.cell, eps=ev.result.eps)
        call = {**self.user_conv, **dict(ev.result.cell.options)}
        if ev.result.cell.eps is not None:
            call["eps"] = ev.result.cell.eps
        self._measure(ev, call, result, {}, contiguous=True)
        return result
