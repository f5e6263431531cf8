"""The conformance grid: which inputs ``python -m pynorm check`` runs, and how each cell's arguments are made.

A :class:`Cell` is one (dtype, normalized shape, input kind, eps) combination; :func:`default_grid` and
:func:`quick_grid` list the cells for an op; :func:`make_case` builds a cell's arrays (``x``, the extra
inputs, the parameters and the upstream gradient ``dy``) deterministically from a seed.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..ops import OpSpec
from ..testing import make_input
from ._dtypes import DTYPE_NAMES, dtype_of

__all__ = [
    "DTYPES",
    "HIDDEN_SIZES",
    "KINDS",
    "Case",
    "Cell",
    "default_grid",
    "make_case",
    "make_oracle_input",
    "quick_grid",
]

#: input kinds of the grid: :data:`pynorm.testing.HARD_CASES` plus two-valued rows and a strided input
KINDS = ("normal", "offset", "huge", "tiny", "constant", "half_constant", "noncontig")
#: hidden sizes (one normalized dim) of the default grid; 65536 runs in a few cells only
HIDDEN_SIZES = (1, 2, 3, 7, 64, 1000, 4096)
LARGE_HIDDEN = 65536
#: normalized shapes of the multi-dim cells (2 and 3 normalized dims)
MULTI_SHAPES = ((4, 16), (2, 3, 5))
DTYPES = DTYPE_NAMES
ROWS = 4


@dataclass(frozen=True)
class Cell:
    """One cell of the grid.

    Attributes
    ----------
    dtype : name of ``x``'s dtype (``"float16"``, ``"bfloat16"``, ``"float32"``, ``"float64"``).
    norm_shape : the normalized (trailing) shape of ``x``; ``H = prod(norm_shape)``.
    lead : the leading (row) shape of ``x``.
    kind : one of :data:`KINDS` (see :func:`make_oracle_input`).
    eps : the eps of this cell, or None for an op without an ``eps`` option.
    """

    dtype: str
    norm_shape: tuple[int, ...]
    lead: tuple[int, ...] = (ROWS,)
    kind: str = "normal"
    eps: float | None = None

    @property
    def hidden(self) -> int:
        return math.prod(self.norm_shape)

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.lead, *self.norm_shape)

    @property
    def label(self) -> str:
        shape = "x".join(map(str, self.shape))
        eps = "-" if self.eps is None else f"{self.eps:g}"
        return f"{self.dtype} {shape} {self.kind} eps={eps}"

    def to_json(self) -> dict[str, Any]:
        return {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "normalized_shape": list(self.norm_shape),
            "kind": self.kind,
            "eps": self.eps,
        }


def _has_eps(spec: OpSpec) -> bool:
    return "eps" in {o.name for o in spec.options}


def _eps_values(spec: OpSpec, conventions: dict[str, Any], with_zero: bool) -> list[float | None]:
    if not _has_eps(spec):
        return [None]
    default = float(conventions.get("eps", spec.defaults()["eps"]))
    return [default, 0.0] if with_zero and default != 0.0 else [default]


def _multi_dim_ok(spec: OpSpec) -> bool:
    """Several normalized dims need a parameter that says how many (its shape is the normalized shape)."""
    return any(p.kind in ("feature", "table") for p in spec.params)


def _degenerate(cell: Cell) -> bool:
    # eps = 0 on a row without spread is 0/0: the exact result is undefined, nothing to compare
    return cell.eps == 0.0 and (
        cell.kind == "constant" or cell.hidden == 1 or (cell.kind == "half_constant" and cell.hidden < 2)
    )


def default_grid(
    spec: OpSpec,
    conventions: dict[str, Any] | None = None,
    *,
    dtypes: Sequence[str] = DTYPES,
    kinds: Sequence[str] = KINDS,
    hidden_sizes: Sequence[int] = HIDDEN_SIZES,
    large: bool = True,
    multi_dim: bool = True,
    eps_zero: bool = True,
) -> list[Cell]:
    """The full grid for ``spec``: every dtype x kind x hidden size x eps (the op's default or the
    ``eps`` of ``conventions``, and 0), plus multi-dim cells (normal and offset rows, normalized shapes
    ``(4, 16)`` and ``(2, 3, 5)``) and H = 65536 cells (normal and offset rows in float16 and float32).

    eps = 0 is left out where the exact result is 0/0 (constant rows, H = 1).
    """
    conv = dict(conventions or {})
    cells: list[Cell] = []
    eps_values = _eps_values(spec, conv, eps_zero)
    for dt in dtypes:
        for kind in kinds:
            for h in hidden_sizes:
                for eps in eps_values:
                    cells.append(Cell(dt, (h,), (ROWS,), kind, eps))
        if multi_dim and _multi_dim_ok(spec):
            for ns in MULTI_SHAPES:
                for kind in ("normal", "offset"):
                    if kind in kinds:
                        cells.append(Cell(dt, ns, (2, 2), kind, eps_values[0]))
        if large and dt in ("float16", "float32"):
            for kind in ("normal", "offset"):
                if kind in kinds:
                    cells.append(Cell(dt, (LARGE_HIDDEN,), (2,), kind, eps_values[0]))
    return [c for c in cells if not _degenerate(c)]


def quick_grid(
    spec: OpSpec, conventions: dict[str, Any] | None = None, *, dtypes: Sequence[str] = DTYPES
) -> list[Cell]:
    """A small grid (a second or two for a NumPy function): hidden sizes 1, 7 and 64, every kind,
    eps default and 0, one multi-dim shape, no H = 65536."""
    cells = default_grid(spec, conventions, dtypes=dtypes, hidden_sizes=(1, 7, 64), large=False, multi_dim=False)
    if _multi_dim_ok(spec):
        eps = _eps_values(spec, dict(conventions or {}), False)[0]
        cells += [Cell(dt, MULTI_SHAPES[1], (2, 2), "normal", eps) for dt in dtypes]
    return cells


def make_oracle_input(kind: str, rows: int, hidden: int, dtype: Any, rng: np.random.Generator) -> np.ndarray:
    """An ``(rows, hidden)`` input of one of :data:`KINDS`.

    The kinds of :func:`pynorm.testing.make_input` (``normal``, ``offset``, ``huge``, ``tiny``,
    ``constant``) plus ``half_constant``: each row's first ``hidden // 2`` elements equal a constant
    ``c`` and the others ``c + 1`` (a two-valued row, ``x̂ = ±1`` exactly), and ``noncontig``: N(0, 1)
    values (the layout is made by :func:`make_case`).
    """
    dt = dtype_of(dtype)
    if kind == "half_constant":
        c = np.round(rng.standard_normal((rows, 1)) * 3, 2)
        return (c + (np.arange(hidden) >= hidden // 2)).astype(dt)
    if kind == "noncontig":
        return make_input("normal", (rows, hidden), dt, rng)
    return make_input(kind, (rows, hidden), dt, rng)


@dataclass
class Case:
    """The arrays of one cell, as the user's callable receives them (``x`` may be a strided view)."""

    x: np.ndarray
    args: list[Any]  # the extra inputs then the parameters, in the spec's order
    dy: np.ndarray
    axis: int
    options: dict[str, Any] = field(default_factory=dict)


def _seed(seed: int, cell: Cell, op: str) -> int:
    return zlib.crc32(f"{seed}|{op}|{cell.label}".encode())


def make_case(spec: OpSpec, cell: Cell, conventions: dict[str, Any] | None = None, seed: int = 0) -> Case:
    """The arrays of ``cell`` for ``spec`` (deterministic in ``seed``, the op and the cell).

    Parameters are ``spec.example_params`` (weights near 1, biases near 0) in ``x``'s dtype; ``dy`` is
    N(0, 1) in the op's gradient dtype, of the first output's shape.
    """
    rng = np.random.default_rng(_seed(seed, cell, spec.name))
    dt = dtype_of(cell.dtype)
    rows = math.prod(cell.lead)
    x2 = make_oracle_input(cell.kind, rows, cell.hidden, dt, rng)
    x = x2.reshape(cell.shape)
    if cell.kind == "noncontig":  # the same values, every other element of a wider buffer
        wide = np.zeros((*cell.shape[:-1], 2 * cell.shape[-1]), dtype=dt)
        wide[..., ::2] = x
        x = wide[..., ::2]
    axis = -len(cell.norm_shape)
    options = dict(conventions or {})
    if cell.eps is not None:
        options["eps"] = cell.eps
    args = spec.example_args(cell.shape, axis, dt, rng, options=options)
    arrays = dict(zip((*spec.input_names, *spec.param_names), args, strict=True))
    yshape = spec.output_shape(cell.shape, axis, arrays)
    dy = rng.standard_normal(yshape).astype(dtype_of(spec.grad_dtype(dt)))
    return Case(x=x, args=args, dy=dy, axis=axis, options=options)
