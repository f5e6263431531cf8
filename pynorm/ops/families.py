"""The kernel families' contract: one record per choice of each family axis, and the one reading of a spec's
options as kernel arguments.

A fast backend implements *kernel families* (:class:`~pynorm.ops.StatsVariant`,
:class:`~pynorm.ops.ElementwiseVariant`, :class:`~pynorm.ops.QuantizeVariant`): an op is one choice per axis.
This module says, for every choice, everything the backends' host code and the tests need to know about it --
which ctx fields it fills, which options it takes, how ``r`` is formed (its *r rules*), whether it normalizes
the row, and which kernels implement it on each fast backend -- so no host compares a statistic's or an option's
name anywhere else:

* :data:`STATISTICS` -- the statistic axis (:class:`Statistic`): ``"centered"`` (LayerNorm), ``"mean_square"``
  (RMSNorm), ``"l2"`` (ScaleNorm);
* :data:`PROLOGUES`, :data:`AFFINES`, :data:`EPILOGUES` -- the other axes of the statistics family
  (:class:`Prologue`, :class:`Affine`, :class:`Epilogue`);
* :data:`FUNCTIONS` -- the element-wise family's function axis (:class:`Function`);
* :data:`COMPOSED` -- options whose non-default values are composed *above* the backends (``casting``: the
  registry binds :mod:`pynorm.composite.casting` around a backend that declares it, :mod:`pynorm._registry`).

:func:`kernel_args` reads a spec's options (or a ctx's fields) as the kernels' run-time arguments
(:class:`StatsArgs`, :class:`ElementwiseArgs`): both fast hosts and the tests call it. :func:`check_spec` checks a
spec against its family when the spec is made (:class:`~pynorm.ops.OpSpec` calls it): the options its variant
needs, the options nothing in the family takes, the ctx fields the variant fills, the parameters and inputs its
axes expect -- a missing ``rstd`` field or ``eps`` option is an error at import, naming the spec, not a
``KeyError`` in a host.

A new choice on an axis is one record here (plus its kernels: the pieces its ``numba`` field names, the policy
its ``cuda`` field names); a new op of existing choices needs nothing here.

r rules. ``r`` (``ctx.rstd``) is the per-row factor of the centred values, formed from the statistic's
variance-like ``v`` by one of the rules :data:`R_INSIDE` (``1 / sqrt(v + eps)``), :data:`R_OUTSIDE`
(``1 / (sqrt(v) + eps)``), :data:`R_FLOOR` (``1 / max(sqrt(v), eps)``); the codes are the kernels' ``eps_mode``
argument (``EpsMode`` in ``kernels/common.cuh``, the numba pieces' ``mode``). A statistic maps each value of its
``eps_mode`` option to a rule (:attr:`Statistic.rules`); the statistic's own pieces form ``r`` from it.

This module sits with the specs, below the reference and the backends: it imports nothing of them (the kernels
are named by strings the backends resolve).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, NamedTuple

#: an :class:`~pynorm.ops.OpSpec` (whose module imports this one to check every spec made: named, not imported)
OpSpec = Any

__all__ = [
    "AFFINES",
    "CASTING",
    "COLUMN_STATISTICS",
    "COMPOSED",
    "EPILOGUES",
    "FUNCTIONS",
    "PROLOGUES",
    "R_FLOOR",
    "R_INSIDE",
    "R_OUTSIDE",
    "R_RULES",
    "STATISTICS",
    "Affine",
    "ColumnArgs",
    "ColumnStatistic",
    "ElementwiseArgs",
    "Epilogue",
    "FamilyError",
    "Function",
    "Prologue",
    "Statistic",
    "StatsArgs",
    "affine_of",
    "base_norm",
    "check_spec",
    "column_args",
    "column_statistic_of",
    "composed_options",
    "function_of",
    "kernel_args",
    "prologue_of",
    "statistic_of",
]

#: r rules (see the module doc): the kernels' ``eps_mode`` codes
R_INSIDE, R_OUTSIDE, R_FLOOR = 0, 1, 2

#: the r rules by name, for the docs and error messages
R_RULES = {R_INSIDE: "1 / sqrt(v + eps)", R_OUTSIDE: "1 / (sqrt(v) + eps)", R_FLOOR: "1 / max(sqrt(v), eps)"}


class FamilyError(ValueError):
    """A spec that does not fit its kernel family's contract (raised when the spec is made)."""


# ---------------------------------------------------------------------------
# the statistics family's axes


@dataclass(frozen=True)
class Statistic:
    """A choice of the statistic axis (``StatsVariant.statistic``, ``QuantizeVariant.statistic``).

    Attributes
    ----------
    name : the axis value.
    summary : ``v`` and the centring, in one line.
    rules : ``eps_mode`` option value -> r rule; one key ``None`` (the rule) for a statistic without an
        ``eps_mode`` option. A rule is a code the statistic's pieces implement (the three of the module doc are
        the kernels' shared ones; a statistic with its own ``r`` -- none at all, ``r = 1`` -- has its own code).
    mean : the statistic centres the row on its mean and fills ``ctx.mean`` (float, per row); the kernels keep
        it as the row's *aux* value.
    floor : fills ``ctx.floor`` (bool, per row: ``r`` took the floor of :data:`R_FLOOR`); the kernels keep it as
        the row's aux value (1.0 where taken).
    correction : takes the ``correction`` option (``v`` over ``H - correction`` degrees of freedom).
    eps : takes the ``eps`` option (its r rules use it; then every spec of the statistic declares it).
    normalizes : ``r`` brings the row to unit magnitude (``xhat = O(1)``): the kernels may keep sums of
        ``xhat`` terms (the parameter-gradient partials, the backward's ``sum(u)``) in the math type. False: the
        centred values keep the input's magnitude; the numba kernels then keep those sums in float64, the cupy
        kernels (whose sums are in the accumulation type) do not offer the statistic.
    cuda : the statistic's policy type in ``kernels/stats.cu`` ("" where the cupy backend has none).
    numba : ``"module:attribute"`` of its pieces for the numba kernels (a mapping from each piece of
        :mod:`pynorm.backends.numba._rowstats` to its implementation; "" where the numba backend has none).
        numba's disk cache is stamped with the backend's own sources only: pieces kept elsewhere should give
        their statistic a name that changes with them.
    rows_path : its numba backward may take the rows path (few rows of many elements: ``dx`` by rows, then the
        parameter partials by column tiles), whose row loop is compiled without the partials' stores. The
        compiler may vectorize that loop's sums in another order than the fused path's loop (which stores them),
        so a statistic claims the path only where ``tests/test_paths.py`` holds both bitwise on every forced path
        (the built-in statistics, on AVX2 and AVX-512). False (a new statistic's default): every row count takes
        the fused path (its row loop one compiled loop at every batch size): batch-invariant rows by
        construction, at the rows path's speed on few rows of 2^20 elements or more.
    """

    name: str
    summary: str
    rules: Mapping[str | None, int]
    mean: bool = False
    floor: bool = False
    correction: bool = False
    eps: bool = True
    normalizes: bool = True
    cuda: str = ""
    numba: str = ""
    rows_path: bool = False

    #: every statistic fills ``ctx.rstd`` (``r``; 1 for a statistic without one)
    rstd = True

    @property
    def has_eps_mode(self) -> bool:
        """Whether the statistic takes an ``eps_mode`` option (else its one rule is fixed)."""
        return None not in self.rules

    @property
    def options(self) -> tuple[str, ...]:
        """The options the statistic takes (``eps`` first: the one every spec of the statistic must declare)."""
        return (
            *(("eps",) if self.eps else ()),
            *(("correction",) if self.correction else ()),
            *(("eps_mode",) if self.has_eps_mode else ()),
        )

    @property
    def required_options(self) -> tuple[str, ...]:
        """The options every spec of the statistic must declare."""
        return ("eps",) if self.eps else ()

    @property
    def fills(self) -> tuple[str, ...]:
        """The ctx fields of per-row values the statistic's kernels fill."""
        return (*(("mean",) if self.mean else ()), "rstd", *(("floor",) if self.floor else ()))

    @property
    def aux(self) -> bool:
        """Whether the kernels keep a per-row aux value besides ``r`` (the mean or the floor flag)."""
        return self.mean or self.floor

    @property
    def aux_field(self) -> str | None:
        """The ctx field of the kernels' per-row aux value (``mean`` or ``floor``), or None."""
        return "mean" if self.mean else "floor" if self.floor else None

    def ctx_values(self, rstd: Any, mean: Any = None, floor: Any = None) -> dict[str, Any]:
        """The ctx fields the statistic fills (:attr:`fills`), by name."""
        out = {"rstd": rstd}
        if self.mean:
            out["mean"] = mean
        if self.floor:
            out["floor"] = floor
        return out

    def rule(self, eps_mode: Any) -> int:
        """The r rule of an ``eps_mode`` value (None: the spec has no such option; then the statistic's first rule,
        or its one fixed rule)."""
        if eps_mode is None or not self.has_eps_mode:
            return next(iter(self.rules.values()))
        try:
            return self.rules[eps_mode]
        except KeyError:
            shown = ", ".join(repr(k) for k in self.rules)
            raise FamilyError(
                f"statistic {self.name!r}: eps_mode {eps_mode!r} has no r rule (it has {shown})"
            ) from None


#: the statistic axis: every statistic the families have, by name
STATISTICS: dict[str, Statistic] = {
    s.name: s
    for s in (
        Statistic(
            "centered",
            "v = var(x) over H - correction; the row centred on its mean (LayerNorm)",
            rules={"var": R_INSIDE, "std": R_OUTSIDE},
            mean=True,
            correction=True,
            cuda="pynorm::Centered",
            numba="pynorm.backends.numba._rowstats:CENTERED",
            rows_path=True,
        ),
        Statistic(
            "mean_square",
            "v = mean(x^2); the row not centred (RMSNorm)",
            rules={None: R_INSIDE},
            cuda="pynorm::MeanSquare",
            numba="pynorm.backends.numba._rowstats:MEAN_SQUARE",
            rows_path=True,
        ),
        Statistic(
            "l2",
            "v = sum(x^2), the squared L2 norm; the row not centred (ScaleNorm)",
            rules={"floor": R_FLOOR, "root": R_INSIDE},
            floor=True,
            cuda="pynorm::SumSquare",
            numba="pynorm.backends.numba._rowstats:L2",
            rows_path=True,
        ),
    )
}


@dataclass(frozen=True)
class Prologue:
    """A choice of the prologue axis (``StatsVariant.prologue``): what the normalized row is.

    ``input_kind``: the kind of the spec input it reads ("" for none); ``options``: the options it takes;
    ``fills``: the ctx fields it fills besides the row (``row``: the ctx field of the normalized row: ``x``, or
    ``h`` the pre-norm sum); ``cuda``: its policy in ``kernels/stats.cu`` (``{h}``, ``{r}``: the types of ``h``
    and of the residual read).
    """

    name: str
    input_kind: str
    options: tuple[str, ...]
    fills: tuple[str, ...]
    row: str
    epilogue: str
    cuda: str

    def cuda_policy(self, h: str | None = None, r: str | None = None) -> str:
        """The policy type, with the CUDA types of ``h`` and of the residual read for the residual prologue."""
        if self.residual and (h is None or r is None):
            raise ValueError(f"a residual prologue needs its (Hd, Rs) types (the {self.name!r} prologue's policy)")
        return self.cuda.format(h=h, r=r)

    @property
    def residual(self) -> bool:
        """Whether the row is a sum computed first (``h = x + alpha * residual``), stored as a second output."""
        return bool(self.input_kind)

    def h_dtype(self, x_dtype: Any, options: Mapping[str, Any]) -> Any:
        """The dtype of the stored row ``h`` (None for the plain prologue): ``residual_dtype`` or x's
        (:func:`pynorm.ops.add_norm.h_dtype`)."""
        if not self.residual:
            return None
        import numpy as np

        from .._dtypes import dtype_of

        rd = options.get("residual_dtype")
        return np.dtype(x_dtype) if rd is None else dtype_of(rd)

    def ctx_values(self, x_dtype: Any, residual_in_dtype: Any) -> dict[str, Any]:
        """The ctx fields the prologue fills besides the row (:attr:`fills`), by name."""
        if not self.residual:
            return {}
        return {"x_dtype": x_dtype, "residual_in_dtype": residual_in_dtype}


PROLOGUES: dict[str, Prologue] = {
    p.name: p
    for p in (
        Prologue("plain", "", (), (), "x", "plain", "pynorm::Plain"),
        Prologue(
            "residual",
            "like_x",
            ("alpha", "residual_dtype"),
            ("x_dtype", "residual_in_dtype"),
            "h",
            "prenorm",
            "pynorm::Residual<{h}, {r}>",
        ),
    )
}


@dataclass(frozen=True)
class Affine:
    """A choice of the affine-source axis (``StatsVariant.affine``): where the output's scale and shift come from.

    ``param_kind``: the kind of its parameters (:class:`~pynorm.ops.Param`): the scale first, then the shift when
    ``bias`` allows one; ``options``: the options it takes (``weight_offset``: the scale is ``w + o``); ``index``:
    rows select a table row through the spec's ``row_index`` input (which the ctx keeps); ``cuda``: its policy
    (``{bias}``: ``true`` or ``false``); ``inputs``: the kinds of the optional inputs it may read besides
    (``"running"``: InstanceNorm's running statistics, read when they replace the row's own).
    """

    name: str
    param_kind: str
    bias: bool
    options: tuple[str, ...]
    index: bool
    cuda: str
    inputs: tuple[str, ...] = ()

    @property
    def broadcast(self) -> bool:
        """One scale for every feature (a ``"scalar"`` parameter): its gradient is the sum over every column."""
        return self.param_kind == "scalar"

    def cuda_policy(self, has_bias: bool) -> str:
        """The policy type of a spec with (or without) its shift parameter."""
        return self.cuda.format(bias="true" if has_bias else "false")


AFFINES: dict[str, Affine] = {
    a.name: a
    for a in (
        Affine("vector", "feature", True, ("weight_offset",), False, "pynorm::Vector<{bias}>"),
        Affine("scalar", "scalar", False, (), False, "pynorm::Scalar"),
        Affine("table", "table", True, ("weight_offset",), True, "pynorm::Table<{bias}>"),
        # GroupNorm/InstanceNorm (the channels layout, x as (N, C, S)): a (sample, group) row of C/G channels by
        # S positions, its scale and shift per channel; the layout's options and InstanceNorm's running statistics
        Affine(
            "channel",
            "channel",
            True,
            ("num_groups", "channel_axis", "use_input_stats", "momentum"),
            False,
            "pynorm::Channel<{bias}>",
            ("running",),
        ),
    )
}


@dataclass(frozen=True)
class Epilogue:
    """A choice of the epilogue axis (``StatsVariant.epilogue``): ``outputs``, what forward returns."""

    name: str
    outputs: tuple[str, ...]


EPILOGUES: dict[str, Epilogue] = {
    e.name: e for e in (Epilogue("plain", ("y",)), Epilogue("prenorm", ("y", "h")), Epilogue("quantize", ("y",)))
}


# ---------------------------------------------------------------------------
# the element-wise family's axis


@dataclass(frozen=True)
class Function:
    """A choice of the element-wise family's function axis (``ElementwiseVariant.function``).

    ``option``: the option giving the function's constant ("" for none); ``scalar``: the ``"scalar"`` parameter
    giving it, learnable ("" for none); ``cuda``: its policy in ``kernels/elementwise.cu``; ``numba``: its tag's
    choice in :mod:`pynorm.backends.numba._ew_kernels` ("" where the backend has no kernels); ``shift``: a second
    learnable ``"scalar"`` parameter added to the function's argument (Derf's ``s`` in ``erf(alpha x + s)``; ""
    for none).
    """

    name: str
    summary: str
    option: str
    scalar: str
    cuda: str
    numba: str
    shift: str = ""

    @property
    def scalars(self) -> tuple[str, ...]:
        """The function's learnable scalar parameters, in order."""
        return tuple(n for n in (self.scalar, self.shift) if n)

    @property
    def options(self) -> tuple[str, ...]:
        return (self.option,) if self.option else ()


FUNCTIONS: dict[str, Function] = {
    f.name: f
    for f in (
        Function("signed_power", "sign(x) |x|^p", "p", "", "pynorm::SignedPower", "signed_power"),
        Function("tanh", "tanh(alpha x)", "", "alpha", "pynorm::Tanh", "tanh"),
        Function("erf", "erf(alpha x + shift)", "", "alpha", "pynorm::Erf", "erf", shift="shift"),
    )
}


@dataclass(frozen=True)
class ColumnStatistic:
    """A choice of the column-statistics family's statistic axis (``ColumnVariant.statistic``, BatchNorm): per
    channel over the ``N x S`` values of ``(N, C, S)`` input, then the element-wise affine.

    ``fills``: the ctx fields its kernels fill (``(C,)`` float64); ``options``: the options it takes; ``inputs``:
    the kinds of the optional inputs it reads; ``cuda``: the kernels' file of the cupy backend ("" for none);
    ``numba``: its choice in :mod:`pynorm.backends.numba._column_kernels` ("" for none).
    """

    name: str
    summary: str
    fills: tuple[str, ...]
    options: tuple[str, ...]
    inputs: tuple[str, ...]
    cuda: str
    numba: str


COLUMN_STATISTICS: dict[str, ColumnStatistic] = {
    "centered": ColumnStatistic(
        "centered",
        "mean and biased variance per channel (training), or the running ones",
        ("mean", "rstd"),
        ("training", "momentum", "num_batches_tracked", "eps"),
        ("running",),
        "column.cu",
        "centered",
    )
}


#: the per-feature parameters every element-wise function may have after it (``w * f(x) + b``)
ELEMENTWISE_PARAMS = ("weight", "bias")

#: the statistics of the quantize family's kernels (their int8 path is the exact integer sequence of LayerNorm's,
#: :mod:`pynorm.reference.quant_norm`)
QUANTIZE_STATISTICS: tuple[str, ...] = ("centered",)
#: the quantize family's output options (the quantize epilogue) and the ctx fields it fills besides the statistic's
QUANTIZE_OPTIONS = ("quantize", "out_scale")
QUANTIZE_FILLS = ("scale", "keep")

#: options whose non-default values are composed above the backends: option -> (its default, the composite
#: module that runs the other values from a backend's own ops, ``bind(op, backend, impl, pieces)``). The registry
#: binds it around every backend whose package lists the option in ``COMPOSED`` (:mod:`pynorm._registry`).
CASTING = "casting"
COMPOSED: dict[str, tuple[Any, str]] = {CASTING: ("fp32", "pynorm.composite.casting")}


def composed_options(spec: OpSpec) -> tuple[str, ...]:
    """The options of ``spec`` composed above the backends (:data:`COMPOSED`)."""
    return tuple(o.name for o in spec.options if o.name in COMPOSED)


# ---------------------------------------------------------------------------
# a spec's records


def statistic_of(spec: OpSpec) -> Statistic:
    """The :class:`Statistic` of a spec of the stats or quantize family."""
    return STATISTICS[spec.variant.statistic]  # type: ignore[union-attr]


def prologue_of(spec: OpSpec) -> Prologue:
    return PROLOGUES[spec.variant.prologue]  # type: ignore[union-attr]


def affine_of(spec: OpSpec) -> Affine:
    """The :class:`Affine` of a spec of the stats family (the quantize family's is ``"vector"``)."""
    return AFFINES[getattr(spec.variant, "affine", "vector")]


def function_of(spec: OpSpec) -> Function:
    return FUNCTIONS[spec.variant.function]  # type: ignore[union-attr]


def column_statistic_of(spec: OpSpec) -> ColumnStatistic:
    """The :class:`ColumnStatistic` of a spec of the column family."""
    return COLUMN_STATISTICS[spec.variant.statistic]  # type: ignore[union-attr]


class ColumnArgs(NamedTuple):
    """The run-time arguments of the column family's kernels, in the order of the statistic's ``options``."""

    training: bool
    momentum: float | None
    num_batches_tracked: int
    eps: float


def column_args(spec: OpSpec, source: Any) -> ColumnArgs:
    """The column family's arguments of ``spec`` from a mapping of options or a ctx (what it lacks: defaults)."""
    d = spec.defaults()
    if isinstance(source, Mapping):
        return ColumnArgs(*(source.get(n, d.get(n)) for n in column_statistic_of(spec).options))
    return ColumnArgs(*(getattr(source, n, d.get(n)) for n in column_statistic_of(spec).options))


def base_norm(spec: OpSpec, specs: Mapping[str, OpSpec]) -> str:
    """The stats-family op a quantize-family op normalizes a float input with (and runs every backward on): the
    op of the spec's statistic with the plain prologue and a vector affine source (one of ``specs``, by name:
    :data:`pynorm.ops.SPECS`, which this module, imported by the specs, does not import)."""
    for name, s in specs.items():
        v = s.variant
        if s.family == "stats" and (v.statistic, v.prologue, v.affine, v.epilogue) == (  # type: ignore[union-attr]
            spec.variant.statistic,  # type: ignore[union-attr]
            "plain",
            "vector",
            "plain",
        ):
            return name
    st = spec.variant.statistic  # type: ignore[union-attr]
    raise FamilyError(f"{spec.name}: no stats-family op has the statistic {st!r} (plain prologue, vector affine)")


# ---------------------------------------------------------------------------
# kernel arguments


class StatsArgs(NamedTuple):
    """The run-time arguments of the statistics family's kernels (and the quantize family's): the statistic's
    conventions, the affine source's offset, the prologue's ``alpha``."""

    eps: float
    correction: int
    #: the r rule (:data:`R_INSIDE`, ...): the kernels' ``eps_mode``
    mode: int
    weight_offset: float
    alpha: float


class ElementwiseArgs(NamedTuple):
    """The run-time argument of the element-wise family's kernels: the function's constant from its option (0.0
    where the function takes it from a parameter, or has none)."""

    constant: float


class _Reader:
    """How :func:`kernel_args` reads one spec's options: which it has, their defaults (made once per spec)."""

    def __init__(self, spec: OpSpec) -> None:
        self.spec = spec
        self.defaults = spec.defaults()
        self.elementwise = spec.family == "elementwise"
        if self.elementwise:
            self.constant = function_of(spec).option
            return
        if spec.family not in ("stats", "quantize"):
            raise FamilyError(f"{spec.name}: the {spec.family} family has no kernels")
        self.statistic = statistic_of(spec)
        aff = affine_of(spec)
        pro = PROLOGUES["plain"] if spec.family == "quantize" else prologue_of(spec)
        have = self.defaults.keys()
        self.eps = self.statistic.eps
        self.correction = self.statistic.correction and "correction" in have
        self.eps_mode = self.statistic.has_eps_mode and "eps_mode" in have
        self.offset = "weight_offset" in aff.options and "weight_offset" in have
        self.alpha = "alpha" in pro.options and "alpha" in have

    def __call__(self, source: Any) -> StatsArgs | ElementwiseArgs:
        d = self.defaults
        if type(source) is dict or (not hasattr(source, "__dataclass_fields__") and isinstance(source, Mapping)):
            get: Any = source.get  # (a ctx is a dataclass: no ABC check for it, which costs a microsecond)
        else:
            get = lambda name, default: getattr(source, name, default)  # noqa: E731  (a ctx)

        if self.elementwise:
            n = self.constant
            return ElementwiseArgs(float(get(n, d[n])) if n else 0.0)
        return StatsArgs(
            float(get("eps", d["eps"])) if self.eps else 0.0,
            int(get("correction", d["correction"])) if self.correction else 0,
            self.statistic.rule(get("eps_mode", d["eps_mode"]) if self.eps_mode else None),
            float(get("weight_offset", d["weight_offset"])) if self.offset else 0.0,
            float(get("alpha", d["alpha"])) if self.alpha else 1.0,
        )


_readers: dict[int, _Reader] = {}


def kernel_args(spec: OpSpec, source: Any) -> Any:
    """The kernels' run-time arguments of ``spec`` from ``source``: its options (a mapping: the options a backend's
    forward receives; missing ones take the spec's defaults) or its ctx (the forward kept them there):
    :class:`StatsArgs` for the stats and quantize families, :class:`ElementwiseArgs` for the element-wise one.

    Only the options the spec's variant takes are read (:func:`check_spec` made sure the spec declares the ones it
    needs); the others take the family's neutral values (no correction, no offset, ``alpha = 1``, the statistic's
    first r rule)."""
    r = _readers.get(id(spec))
    if r is None or r.spec is not spec:
        r = _readers[id(spec)] = _Reader(spec)
    return r(source)


# ---------------------------------------------------------------------------
# the check of a spec against its family


def _fail(spec: OpSpec, what: str) -> None:
    raise FamilyError(f"op {spec.name!r} ({spec.family} family, {spec.variant}): {what}")


def _choice(spec: OpSpec, table: Mapping[str, Any], axis: str) -> Any:
    value = str(getattr(spec.variant, axis, None))
    if value not in table:
        _fail(spec, f"{axis} {value!r} is not a choice of the family (choices: {', '.join(table)})")
    return table[value]


def _check_options(spec: OpSpec, taken: tuple[str, ...], required: tuple[str, ...]) -> None:
    names = {o.name for o in spec.options if o.to_backend}
    for n in required:
        if n not in names:
            _fail(spec, f"its kernels need the option {n!r}, which the spec does not declare")
    for n in sorted(names - set(taken) - set(COMPOSED)):
        _fail(spec, f"option {n!r} is taken by nothing of its variant (it takes {', '.join(taken) or 'none'})")


def _check_eps_modes(spec: OpSpec, st: Statistic) -> None:
    opt = next((o for o in spec.options if o.name == "eps_mode"), None)
    if opt is None:
        return  # the statistic's first (or one) rule applies (an eps_mode it does not take: _check_options)
    for v in (opt.default, *getattr(opt.check, "choices", ())):
        if v not in st.rules:
            _fail(
                spec,
                f"eps_mode {v!r} has no r rule of the {st.name!r} statistic (it has {', '.join(map(str, st.rules))})",
            )


def _check_ctx(spec: OpSpec, required: tuple[str, ...], allowed: set[str]) -> None:
    have = {f.name for f in fields(spec.ctx)}
    for n in required:
        if n not in have:
            _fail(spec, f"its kernels fill ctx.{n}, but {spec.ctx.__name__} has no field {n!r}")
    for n in sorted(have - allowed - set(required)):
        _fail(spec, f"{spec.ctx.__name__}.{n} is filled by nothing of its family")


def _check_params(spec: OpSpec, kind: str, most: int) -> None:
    if not spec.params or len(spec.params) > most:
        _fail(spec, f"its affine source takes 1{' or 2' if most == 2 else ''} parameter(s), got {len(spec.params)}")
    for p in spec.params:
        if p.kind != kind:
            _fail(spec, f"parameter {p.name!r} is a {p.kind!r} parameter; its affine source takes {kind!r} ones")


def _check_stats(spec: OpSpec) -> None:
    st = _choice(spec, STATISTICS, "statistic")
    pro = _choice(spec, PROLOGUES, "prologue")
    aff = _choice(spec, AFFINES, "affine")
    ep = _choice(spec, EPILOGUES, "epilogue")
    if ep.name != pro.epilogue:
        _fail(spec, f"the {pro.name!r} prologue goes with the {pro.epilogue!r} epilogue, not {ep.name!r}")
    if tuple(spec.outputs) != ep.outputs:
        _fail(spec, f"its epilogue returns {ep.outputs}, the spec declares outputs {tuple(spec.outputs)}")
    _check_options(spec, (*st.options, *pro.options, *aff.options), st.required_options)
    _check_eps_modes(spec, st)
    _check_params(spec, aff.param_kind, 2 if aff.bias else 1)
    kinds = [i.kind for i in spec.inputs]
    want = [*([pro.input_kind] if pro.input_kind else []), *(["row_index"] if aff.index else [])]
    if sorted(k for k in kinds if k not in aff.inputs) != sorted(want):
        _fail(spec, f"its variant reads inputs of kinds {want or 'none'}, the spec declares {kinds or 'none'}")
    if aff.index and any(p.index not in spec.input_names for p in spec.params):
        _fail(spec, "a table parameter names an index input the spec does not declare")
    index = tuple(i.name for i in spec.inputs if i.kind == "row_index")
    required = (pro.row, *spec.param_names, *index, *st.fills, *pro.fills)
    _check_ctx(spec, required, {*required, *(o.name for o in spec.options)})


def _check_quantize(spec: OpSpec) -> None:
    st = _choice(spec, {n: STATISTICS[n] for n in QUANTIZE_STATISTICS}, "statistic")
    aff = AFFINES["vector"]
    _check_options(spec, (*st.options, *aff.options, *QUANTIZE_OPTIONS), st.required_options)
    _check_eps_modes(spec, st)
    _check_params(spec, aff.param_kind, 2)
    if [i.kind for i in spec.inputs] != ["row_scale"]:
        _fail(spec, "the quantize family reads one 'row_scale' input (an int8 x's scale)")
    required = ("x", *spec.input_names, *spec.param_names, *st.fills, *QUANTIZE_FILLS)
    _check_ctx(spec, required, {*required, *(o.name for o in spec.options)})


def _check_elementwise(spec: OpSpec) -> None:
    fn = _choice(spec, FUNCTIONS, "function")
    _check_options(spec, fn.options, fn.options)
    names = spec.param_names
    want = (*fn.scalars, *ELEMENTWISE_PARAMS)
    if tuple(n for n in want if n in names) != names:
        _fail(spec, f"the {fn.name!r} function takes the parameters {want} (in that order, each optional)")
    for sc in fn.scalars:
        if sc not in names or next(p for p in spec.params if p.name == sc).kind != "scalar":
            _fail(spec, f"the {fn.name!r} function takes its constant from a 'scalar' parameter {sc!r}")
    if spec.inputs:
        _fail(spec, "the element-wise family reads no inputs besides x")
    required = ("x", *names)
    _check_ctx(spec, required, {*required, *(o.name for o in spec.options)})


def _check_column(spec: OpSpec) -> None:
    st = _choice(spec, COLUMN_STATISTICS, "statistic")
    _check_options(spec, st.options, st.options)
    _check_params(spec, "channel", 2)
    if any(i.kind not in st.inputs for i in spec.inputs):
        _fail(spec, f"the {st.name!r} column statistic reads inputs of kinds {st.inputs}")
    required = ("x", *spec.param_names, *st.fills)
    _check_ctx(spec, required, {*required, *(o.name for o in spec.options)})


def check_spec(spec: OpSpec) -> None:
    """Check ``spec`` against its kernel family's records (every family but ``"composite"``, whose ops run other
    ops): the variant's choices exist, the spec declares the options they need and no option nothing takes (but
    those composed above the backends, :data:`COMPOSED`), its parameters and inputs are of the kinds the axes
    read, and its ctx has every field the kernels fill and no field nothing fills. Raises :class:`FamilyError`."""
    check = {
        "stats": _check_stats, "quantize": _check_quantize, "elementwise": _check_elementwise, "column": _check_column,
    }.get(spec.family)  # fmt: skip
    if check is not None:
        check(spec)
