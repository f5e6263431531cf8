"""Batch invariance: a row's outputs must not depend on the batch it is computed in.

A kernel that picks its reduction (a block size, a split of the row, a column-tile pass) from the number of rows
gives a row other bits in a batch of 3 than in a batch of 32: vLLM's batch-invariant mode broke silently that way
when an RMSNorm kernel's block size depended on the number of tokens, and deterministic rollouts depend on it.
:func:`check_batch_invariance` calls the user's forward (and backward) on a batch of :data:`BATCH` rows and on
slices of it of other sizes and row offsets (:data:`CALLS`), and reports every row whose outputs (``y``, ``dx``,
every per-row output or gradient; not the parameters' gradients, sums over the batch) differ by a bit.

The rows are N(0, 1), every other one with a large common offset (1e4; 100 for 16-bit dtypes), where a change
of the summation order shows in the last bits. The ops of the rows layout are checked on rows of
:data:`HIDDEN` elements; ``group_norm`` and ``instance_norm`` on samples (``N`` is the batch); ``batch_norm``,
whose statistics are over the batch, is not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..ops import OpSpec
from ._dtypes import dtype_of
from .evaluate import as_numpy, call_backward, call_forward
from .grid import Case, Cell, make_case

__all__ = ["BATCH", "CALLS", "HIDDEN", "BatchDifference", "BatchInvariance", "check_batch_invariance"]

#: rows of the whole batch
BATCH = 32
#: the other calls, as (rows, first row): single rows at the start, the middle and the end, and batches of 3, 8
#: and 17 at offsets that cross the halves
CALLS = ((1, 0), (1, 13), (1, 31), (3, 5), (8, 0), (8, 24), (17, 15))
#: the row sizes (modest: the check runs by default on the quick grid)
HIDDEN = (64, 1000)


@dataclass
class BatchDifference:
    """A row whose output differs between the whole batch and another call.

    Attributes
    ----------
    dtype, hidden : the cells' dtype and row size.
    output : the output or gradient that differs (``y``, ``dx``...).
    rows : the rows (indices in the whole batch) whose values differ.
    batch : the size of the other call, and ``offset`` its first row.
    max_abs : the largest difference of a value.
    """

    dtype: str
    hidden: int
    output: str
    rows: list[int]
    batch: int
    offset: int
    max_abs: float

    def render(self) -> str:
        rows = ", ".join(map(str, self.rows[:6])) + (", ..." if len(self.rows) > 6 else "")
        return (
            f"{self.output} of {self.dtype} rows of {self.hidden} elements differs between a batch of {BATCH} rows "
            f"and a batch of {self.batch} (rows {self.offset}-{self.offset + self.batch - 1}): rows {rows}, by up "
            f"to {self.max_abs:.3g}"
        )


@dataclass
class BatchInvariance:
    """The outcome of :func:`check_batch_invariance`: the calls made, the differences, what could not run."""

    calls: int = 0
    differences: list[BatchDifference] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.differences

    def summary(self) -> str:
        if self.differences:
            outs = sorted({d.output for d in self.differences})
            return f"batch-dependent rows ({', '.join(outs)}; {len(self.differences)} calls differ)"
        if not self.calls:
            return "batch invariance not checked"
        return f"batch-invariant rows ({self.calls} calls)"

    def lines(self) -> list[str]:
        return [f"batch invariance: {d.render()}" for d in self.differences] + [
            f"batch invariance: {n}" for n in self.notes
        ]

    def to_json(self) -> dict[str, Any]:
        return {
            "passed": self.passed,
            "calls": self.calls,
            "batch": BATCH,
            "differences": [dataclasses.asdict(d) for d in self.differences],
            "notes": self.notes,
        }


def _cell(spec: OpSpec, dtype: str, hidden: int, conventions: dict[str, Any]) -> Cell | None:
    value = conventions.get("eps", spec.defaults().get("eps"))
    eps = float(value) if value is not None and "eps" in {o.name for o in spec.options} else None
    if spec.layout == "rows":
        return Cell(dtype, (hidden,), (BATCH,), "normal", eps)
    if spec.name == "group_norm":
        g = int(conventions.get("num_groups", 2))
        return Cell(dtype, (2 * g, hidden // 8), (BATCH,), "normal", eps, (("num_groups", g),), layout="channels")
    if spec.name == "instance_norm":
        return Cell(dtype, (3, hidden // 8), (BATCH,), "normal", eps, layout="channels")
    return None  # batch_norm: its statistics are over the batch


def _case(spec: OpSpec, cell: Cell, conventions: dict[str, Any], seed: int) -> Case:
    """The cell's arrays, every other row (sample) offset by 1e4 (100 for 16-bit dtypes)."""
    case = make_case(spec, cell, conventions, seed)
    dt = dtype_of(cell.dtype)
    x = np.asarray(case.x, np.float64).copy()
    x[1::2] += 100.0 if dt.itemsize <= 2 else 1e4
    return dataclasses.replace(case, x=x.astype(dt))


def _take(case: Case, start: int, rows: int) -> Case:
    """The rows ``start .. start + rows - 1`` of a case (``x``, ``dy`` and every per-row input)."""

    def cut(a: Any) -> Any:
        if isinstance(a, np.ndarray) and a.ndim and a.shape[0] == BATCH:
            return np.ascontiguousarray(a[start : start + rows])
        return a

    return dataclasses.replace(case, x=cut(case.x), dy=cut(case.dy), args=[cut(a) for a in case.args])


def _outputs(spec: OpSpec, res: Any, grads: Any) -> dict[str, np.ndarray]:
    """The outputs and gradients of a call by name, as NumPy arrays."""
    out: dict[str, np.ndarray] = {}
    fwd = list(res) if isinstance(res, (tuple, list)) else [res]
    names = [*spec.outputs, *(f"out{i}" for i in range(len(spec.outputs), len(fwd)))]
    out.update(zip(names, (as_numpy(a) for a in fwd), strict=False))
    if grads is not None:
        gs = list(grads) if isinstance(grads, (tuple, list)) else [grads]
        out.update((n, as_numpy(g)) for n, g in zip(spec.grad_names, gs, strict=False) if g is not None)
    return out


def _run(
    spec: OpSpec,
    forward: Callable[..., Any],
    backward: Callable[..., Any] | None,
    case: Case,
    call: dict[str, Any],
) -> dict[str, np.ndarray]:
    with np.errstate(all="ignore"):
        res = call_forward(spec, forward, case, call, contiguous=True)
        grads = None if backward is None else call_backward(spec, backward, case, call, contiguous=True)
    return _outputs(spec, res, grads)


def check_batch_invariance(
    spec: OpSpec,
    forward: Callable[..., Any],
    backward: Callable[..., Any] | None,
    conventions: dict[str, Any],
    dtypes: Sequence[str],
    seed: int = 0,
    hidden: Sequence[int] = HIDDEN,
) -> BatchInvariance:
    """Call ``forward`` (and ``backward``) on a batch of :data:`BATCH` rows and on the slices :data:`CALLS` of
    it, per dtype and row size, and compare each row's outputs bit for bit (module docstring).

    A call that raises is noted, not counted as a difference (the conformance cells report the exception).
    """
    out = BatchInvariance()
    grad_rows = {n for n in spec.grad_names if n == "dx" or n in {i.name for i in spec.inputs}}
    for dt in dtypes:
        for h in hidden:
            cell = _cell(spec, dt, h, conventions)
            if cell is None:
                return out
            case = _case(spec, cell, conventions, seed)
            call = {**conventions, **dict(cell.options)}
            if cell.eps is not None:
                call["eps"] = cell.eps

            try:
                whole = _run(spec, forward, backward, case, call)
                out.calls += 1
                for rows, start in CALLS:
                    part = _run(spec, forward, backward, _take(case, start, rows), call)
                    out.calls += 1
                    for name, a in part.items():
                        if name not in whole or (name not in spec.outputs and name not in grad_rows):
                            continue
                        b = whole[name][start : start + rows]
                        if a.shape != b.shape:
                            continue  # not a per-row output
                        differ = [
                            start + k for k in range(rows) if a.dtype != b.dtype or a[k].tobytes() != b[k].tobytes()
                        ]
                        if differ:
                            with np.errstate(all="ignore"):
                                d = np.abs(a.astype(np.float64) - b.astype(np.float64))
                            big = float(np.nanmax(d)) if np.isfinite(d).any() else float("nan")
                            out.differences.append(BatchDifference(dt, h, name, differ, rows, start, big))
            except Exception as e:  # the user's code failed: noted (its cells report it)
                out.notes.append(f"{dt} rows of {h}: not checked, the call raised {type(e).__name__}: {e}"[:200])
    return out
