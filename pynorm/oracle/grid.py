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

from .._measure import make_input
from ..ops import OpSpec
from ._dtypes import DTYPE_NAMES, dtype_of

__all__ = [
    "DTYPES",
    "HIDDEN_SIZES",
    "KINDS",
    "Case",
    "Cell",
    "channel_grid",
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
    options: tuple[tuple[str, Any], ...] = ()
    running: bool = False
    layout: str = "rows"

    @property
    def hidden(self) -> int:
        """``H = prod(norm_shape)``; for a cell of the channels layout, ``C`` (what the op's shape check sees)."""
        if self.layout == "channels":
            return self.norm_shape[0]
        return math.prod(self.norm_shape)

    @property
    def channel_axis(self) -> int:
        return int(dict(self.options).get("channel_axis", 1))

    @property
    def shape(self) -> tuple[int, ...]:
        """The shape of ``x`` as the user's function receives it (channels last: ``(N, *spatial, C)``)."""
        if self.layout == "channels" and self.channel_axis == -1:
            return (*self.lead, *self.norm_shape[1:], self.norm_shape[0])
        return (*self.lead, *self.norm_shape)

    @property
    def setting(self) -> str:
        """The cell's options in words (channels layout: ``num_groups=2 channels_last running``), or ""."""
        extra = [f"{k}={v}" for k, v in self.options if k != "channel_axis"]
        if self.layout == "channels" and self.channel_axis == -1:
            extra.append("channels_last")
        if self.running:
            extra.append("running")
        return " ".join(extra)

    @property
    def label(self) -> str:
        shape = "x".join(map(str, self.shape))
        eps = "-" if self.eps is None else f"{self.eps:g}"
        extra = f" {self.setting}" if self.setting else ""
        return f"{self.dtype} {shape} {self.kind} eps={eps}{extra}"

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "dtype": self.dtype,
            "shape": list(self.shape),
            "normalized_shape": list(self.norm_shape),
            "kind": self.kind,
            "eps": self.eps,
        }
        if self.layout == "channels":
            out.update(layout="channels", options=dict(self.options), running=self.running)
        return out


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
    """The full grid for ``spec`` (channels layout: :func:`channel_grid`): every dtype x kind x hidden size x
    eps (the op's default or the
    ``eps`` of ``conventions``, and 0), plus multi-dim cells (normal and offset rows, normalized shapes
    ``(4, 16)`` and ``(2, 3, 5)``) and H = 65536 cells (normal and offset rows in float16 and float32).

    eps = 0 is left out where the exact result is 0/0 (constant rows, H = 1).
    """
    conv = dict(conventions or {})
    if spec.layout == "channels":
        return channel_grid(spec, conv, dtypes=dtypes, kinds=kinds, eps_zero=eps_zero, large=large)
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
    eps default and 0, one multi-dim shape, no H = 65536 (channels layout: :func:`channel_grid` with ``quick``)."""
    if spec.layout == "channels":
        return channel_grid(spec, dict(conventions or {}), dtypes=dtypes, quick=True)
    cells = default_grid(spec, conventions, dtypes=dtypes, hidden_sizes=(1, 7, 64), large=False, multi_dim=False)
    if _multi_dim_ok(spec):
        eps = _eps_values(spec, dict(conventions or {}), False)[0]
        cells += [Cell(dt, MULTI_SHAPES[1], (2, 2), "normal", eps) for dt in dtypes]
    return cells


# ---------------------------------------------------------------------------
# the channels layout: GroupNorm, InstanceNorm, BatchNorm

ALL = KINDS
#: the kinds of the cells with running statistics (the running variance of huge values overflows)
RUNNING_KINDS = ("normal", "offset", "constant", "half_constant")

# (N, C, spatial, options, running, kinds, quick): the configurations of each channel op's grid. Each is crossed
# with the dtypes, its kinds and the eps values (eps = 0 is left out where a statistic has no spread).
_Config = tuple[tuple[int, int, tuple[int, ...]], dict[str, Any], bool, tuple[str, ...], bool]
_Large = tuple[tuple[int, int, tuple[int, ...]], dict[str, Any]]
_GN: tuple[tuple[tuple[int, int, tuple[int, ...]], dict[str, Any], tuple[str, ...], bool], ...] = (
    ((2, 4, (7,)), {"num_groups": 2}, ALL, True),
    ((2, 6, (3, 5)), {"num_groups": 3}, ALL, False),
    ((2, 4, (1,)), {"num_groups": 4}, ("normal", "huge", "tiny"), True),  # one value per statistic: x̂ = 0
    ((1, 8, (16,)), {"num_groups": 1}, ("normal", "offset"), False),
    ((2, 6, (9,)), {"num_groups": 6}, ("normal", "offset", "constant"), False),
    ((2, 4, (4, 5)), {"num_groups": 2, "channel_axis": -1}, ("normal", "offset", "noncontig"), True),
)
_GN_LARGE: _Large = ((4, 32, (32, 32)), {"num_groups": 8})
_IN: tuple[_Config, ...] = (
    ((2, 3, (7,)), {}, False, ALL, True),
    ((2, 4, (3, 5)), {}, False, ALL, False),
    ((3, 2, (1,)), {}, False, ("normal", "huge", "tiny"), True),  # one value per statistic
    ((3, 3, (8,)), {}, True, RUNNING_KINDS, True),  # the running statistics updated
    ((3, 3, (8,)), {"momentum": 0.3}, True, ("normal", "offset"), False),
    ((3, 3, (8,)), {"use_input_stats": False}, True, RUNNING_KINDS, True),  # normalized with them
    ((2, 3, (4, 5)), {"channel_axis": -1}, False, ("normal", "offset", "noncontig"), True),
    ((2, 3, (4, 5)), {"channel_axis": -1}, True, ("normal", "offset"), False),
)
_IN_LARGE: _Large = ((4, 8, (64, 64)), {})
_BN: tuple[_Config, ...] = (
    ((4, 3, (5,)), {"training": True}, False, ALL, True),
    ((2, 4, (3, 3)), {"training": True}, False, ALL, False),
    ((6, 3, ()), {"training": True}, False, ("normal", "offset", "huge", "tiny", "constant"), True),  # (N, C)
    ((1, 3, (2,)), {"training": True}, False, ("normal", "half_constant"), False),  # N S = 2, the least
    ((4, 3, (5,)), {"training": True}, True, RUNNING_KINDS, True),
    ((4, 3, (5,)), {"training": True, "momentum": 0.3}, True, ("normal", "offset"), False),
    ((4, 3, (5,)), {"training": True, "momentum": None, "num_batches_tracked": 3}, True, ("normal", "offset"), True),
    ((4, 3, (5,)), {"training": False}, True, RUNNING_KINDS, True),
    ((2, 4, (3, 5)), {"training": True, "channel_axis": -1}, False, ("normal", "offset", "noncontig"), True),
    ((2, 4, (3, 5)), {"training": True, "channel_axis": -1}, True, ("normal", "offset"), False),
    ((2, 4, (3, 5)), {"training": False, "channel_axis": -1}, True, ("normal", "offset"), False),
)
_BN_LARGE: _Large = ((16, 8, (32, 32)), {"training": True})


def statistic_size(spec: OpSpec, n: int, c: int, s: int, options: dict[str, Any]) -> int:
    """How many values each statistic of a channel op is over (0: it normalizes with the running statistics)."""
    if spec.name == "group_norm":
        return (c // int(options["num_groups"])) * s
    if spec.name == "instance_norm":
        return s if options.get("use_input_stats", True) else 0
    return n * s if options.get("training", True) else 0


def channel_grid(
    spec: OpSpec,
    conventions: dict[str, Any] | None = None,
    *,
    dtypes: Sequence[str] = DTYPES,
    kinds: Sequence[str] = KINDS,
    eps_zero: bool = True,
    large: bool = True,
    quick: bool = False,
) -> list[Cell]:
    """The grid of an op of the channels layout (``group_norm``, ``instance_norm``, ``batch_norm``): shapes
    ``(N, C, *spatial)`` with 0, 1 and 2 spatial dims, every dtype and input kind, eps (the op's default or the
    convention's, and 0), the options that change the math (``num_groups`` 1, C/G = 1 and C; BatchNorm's two
    modes; running statistics updated with ``momentum`` 0.1, 0.3 and None; InstanceNorm's ``use_input_stats``;
    ``channel_axis=-1``), one value per statistic where it is legal, and a large cell (normal and offset) in
    float16 and float32.

    An option given in ``conventions`` fixes it: cells that set it otherwise are left out (``num_groups=G``
    re-groups each GroupNorm cell with ``C/G`` channels per group unchanged).
    """
    conv = dict(conventions or {})
    eps_values = _eps_values(spec, conv, eps_zero)
    configs: list[_Config]
    big: _Large
    if spec.name == "group_norm":
        configs = [(sh, o, False, k, q) for sh, o, k, q in _GN]
        big = _GN_LARGE
    elif spec.name == "instance_norm":
        configs = list(_IN)
        big = _IN_LARGE
    else:
        configs = list(_BN)
        big = _BN_LARGE
    if quick:
        configs = [c for c in configs if c[4]]
    elif large:
        configs.append((big[0], big[1], False, ("normal", "offset"), False))
    cells: list[Cell] = []
    seen: set[Cell] = set()
    for (n, c, sp), opts, running, ks, _ in configs:
        opts = dict(opts)
        if spec.name == "group_norm" and "num_groups" in conv:
            g = int(conv["num_groups"])
            c, opts["num_groups"] = (c // opts["num_groups"]) * g, g
        if any(k in conv and conv[k] != v for k, v in opts.items()):
            continue
        if not running and (
            (spec.name == "batch_norm" and not opts.get("training", conv.get("training", True)))
            or (spec.name == "instance_norm" and not opts.get("use_input_stats", True))
        ):
            continue  # fmt: skip
        large_cell = n * c * math.prod(sp) > 20000
        for dt in dtypes:
            if large_cell and dt not in ("float16", "float32"):
                continue
            for kind in ks:
                if kind not in kinds:
                    continue
                for eps in eps_values if not large_cell else eps_values[:1]:
                    size = statistic_size(spec, n, c, math.prod(sp), {**conv, **opts})
                    if eps == 0.0 and size and (kind == "constant" or size < 2):
                        continue  # 0/0: no spread at eps = 0
                    cell = Cell(dt, (c, *sp), (n,), kind, eps, tuple(sorted(opts.items())), running, "channels")
                    if cell not in seen:
                        seen.add(cell)
                        cells.append(cell)
    return cells


def _make_channel_case(spec: OpSpec, cell: Cell, conventions: dict[str, Any], seed: int) -> Case:
    """The arrays of a channels cell: ``x`` made statistic by statistic (a constant cell is constant per group,
    instance or channel), weights near 1 and biases near 0 of ``(C,)``, running statistics where the cell has
    them (in ``x``'s dtype; for normalizing with them, near the data's own), ``dy`` N(0, 1)."""
    rng = np.random.default_rng(_seed(seed, cell, spec.name))
    dt = dtype_of(cell.dtype)
    n, c, sp = cell.lead[0], cell.norm_shape[0], cell.norm_shape[1:]
    s = math.prod(sp)
    options = {**conventions, **dict(cell.options)}
    if cell.eps is not None:
        options["eps"] = cell.eps
    if spec.name == "group_norm":
        g = int(options["num_groups"])
        x3 = make_oracle_input(cell.kind, n * g, (c // g) * s, dt, rng).reshape(n, c, s)
    elif spec.name == "instance_norm":
        x3 = make_oracle_input(cell.kind, n * c, s, dt, rng).reshape(n, c, s)
    else:
        x3 = np.ascontiguousarray(make_oracle_input(cell.kind, c, n * s, dt, rng).reshape(c, n, s).transpose(1, 0, 2))
    x = x3.reshape(n, c, *sp)
    if cell.channel_axis == -1:
        x = np.ascontiguousarray(np.moveaxis(x, 1, -1))
    if cell.kind == "noncontig":
        wide = np.zeros((*x.shape[:-1], 2 * x.shape[-1]), dtype=dt)
        wide[..., ::2] = x
        x = wide[..., ::2]
    weight = (1.0 + 0.5 * rng.standard_normal(c)).astype(dt)
    bias = (0.5 * rng.standard_normal(c)).astype(dt)
    args: list[Any] = [weight, bias]
    if spec.inputs:
        rm = rv = None
        if cell.running:
            x64 = x3.astype(np.float64)
            if spec.name == "instance_norm":
                mean, sd = x64.mean(axis=2).mean(axis=0), np.sqrt(x64.var(axis=2).mean(axis=0))
            else:
                mean, sd = x64.mean(axis=(0, 2)), x64.std(axis=(0, 2))
            sd = np.where(sd > 0, sd, 1.0)
            rm = (mean + 0.25 * sd * rng.standard_normal(c)).astype(dt)
            rv = ((sd * (0.7 + 0.6 * rng.random(c))) ** 2).astype(dt)
        args = [rm, rv, *args]
    dy = rng.standard_normal(x.shape).astype(dtype_of(spec.grad_dtype(dt)))
    return Case(x=x, args=args, dy=dy, axis=cell.channel_axis, options=options)


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
    axis: int  # the first normalized axis; for an op of the channels layout, the channel axis (1 or -1)
    options: dict[str, Any] = field(default_factory=dict)


def _seed(seed: int, cell: Cell, op: str) -> int:
    return zlib.crc32(f"{seed}|{op}|{cell.label}".encode())


def make_case(spec: OpSpec, cell: Cell, conventions: dict[str, Any] | None = None, seed: int = 0) -> Case:
    """The arrays of ``cell`` for ``spec`` (deterministic in ``seed``, the op and the cell).

    Parameters are ``spec.example_params`` (weights near 1, biases near 0) in ``x``'s dtype; ``dy`` is
    N(0, 1) in the op's gradient dtype, of the first output's shape.
    """
    if spec.layout == "channels":
        return _make_channel_case(spec, cell, dict(conventions or {}), seed)
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
