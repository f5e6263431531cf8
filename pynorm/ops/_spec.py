"""The declarative description of an op (:class:`OpSpec`) and the option validators specs use.

An :class:`OpSpec` is everything pynorm needs to know about an op outside its math: its
parameters by kind, its options with defaults and validators, its gradient tuple, how to
measure its errors (term scales), the kernel family and variant implementing it in the fast
backends, and the convention sets tests and benchmarks exercise. Validation, flattening,
broadcasting and gradient reduction are done once, from the spec, by :mod:`pynorm._dispatch`;
the math is the reference module's (``spec.reference``).
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

from ..errors import ArgumentError

__all__ = [
    "REQUIRED",
    "ColumnVariant",
    "Composite",
    "ElementwiseVariant",
    "Input",
    "OpSpec",
    "Option",
    "Param",
    "QuantizeVariant",
    "StatsVariant",
    "check_bool",
    "check_eps",
    "check_offset",
    "check_positive_int",
    "check_real",
    "check_scale",
    "filled",
    "one_of",
]

#: kinds of parameter the dispatcher knows:
#:
#: * ``"feature"``: a per-feature array of shape ``x.shape[axis:]`` or any shape that broadcasts to it
#:   from the right; backends see it as an ``(H,)`` vector and its gradient is reduced back to its shape;
#: * ``"scalar"``: one value for every feature (a 0-d or ``(1,)`` array), seen by backends as a
#:   ``(1,)`` array; its gradient is the sum over all elements, returned in the parameter's shape;
#: * ``"table"``: ``M`` per-feature rows, shape ``(M, *x.shape[axis:])``, row ``ids[i]`` serving row
#:   ``i`` of ``x`` (``Param.index`` names the ``"row_index"`` input holding ``ids``); backends see an
#:   ``(M, H)`` array and return an ``(M, H)`` gradient;
#: * ``"matrix"``: a 2-D weight of a matrix product (a torch ``Linear``'s ``(out, in)``), ``"vector"``: the
#:   1-D bias of one; their exact shapes are the op's rule (``OpSpec.check_arrays``, ``OpSpec.example_shapes``);
#:   backends see them as given and return gradients of their shapes;
#: * ``"channel"``: one value per channel, shape ``(C,)``, of an op of the ``"channels"`` layout (GroupNorm's
#:   weight); backends see it as given and return a ``(C,)`` gradient.
ParamKind = Literal["feature", "scalar", "table", "matrix", "vector", "channel"]
PARAM_KINDS: tuple[str, ...] = ("feature", "scalar", "table", "matrix", "vector", "channel")

#: kinds of extra array input (after ``x``): ``"like_x"``, a float array of ``x``'s shape (a residual
#: stream), differentiable; ``"row_index"``, an integer array of ``x.shape[:axis]`` (one index per row);
#: ``"cond"``, a float array of per-row conditioning vectors, differentiable: shape ``x.shape[:axis] + (C,)``
#: (one per row of ``x``) or ``x.shape[:k] + (C,)`` for ``k < axis`` (one per leading index, shared by the
#: rows of ``x.shape[k:axis]``: ``(B, C)`` for ``x`` of ``(B, T, H)``; trailing size-1 dims before ``C``
#: broadcast too); backends see it as a ``(G, C)`` array, cond row ``g`` serving the ``R / G`` consecutive
#: rows ``g R/G ... (g+1) R/G - 1`` of ``x``, and return a ``(G, C)`` gradient (summed over those rows).
#: ``"row_scale"``, a positive finite float scale per row: a scalar (0-d or ``(1,)``) or an array of
#: ``x.shape[:axis]``, not differentiable; backends see it as a ``(rows,)`` float64 array (or None when it is
#: optional and absent).
#: ``"running"``: a running statistic of a ``"channels"``-layout op (BatchNorm's ``running_mean``): a finite float
#: array of shape ``(C,)``, not differentiable, never written (the op returns its update).
InputKind = Literal["like_x", "row_index", "cond", "row_scale", "running"]
INPUT_KINDS: tuple[str, ...] = ("like_x", "row_index", "cond", "row_scale", "running")


@dataclass(frozen=True)
class Input:
    """An array input of an op besides ``x`` (in call order after ``x``, before the parameters)."""

    name: str
    kind: InputKind
    doc: str = ""
    required: bool = True  # False: None means "absent" (an int8 input's scale)
    keyword: bool = False  # the public functions take it by keyword, after the parameters

    def __post_init__(self) -> None:
        if self.kind not in INPUT_KINDS:
            raise ValueError(f"input {self.name!r}: kind {self.kind!r} is not one of {INPUT_KINDS}")

    @property
    def differentiable(self) -> bool:
        return self.kind in ("like_x", "cond")


@dataclass(frozen=True)
class Param:
    """One parameter of an op.

    ``init`` is the value a layer starts it at (before any offset convention: a layer with
    ``weight_offset = o`` starts ``weight`` at ``init - o`` so that ``w + o`` starts at ``init``).
    ``required``: the op needs it (else None means "absent": no weight, no bias). ``finite``: its
    values are checked to be finite before dispatch. ``index``: for a ``"table"``, the name of the
    ``"row_index"`` input selecting its rows.
    """

    name: str
    kind: ParamKind = "feature"
    init: float = 1.0
    doc: str = ""
    required: bool = False
    finite: bool = False
    index: str = ""

    def __post_init__(self) -> None:
        if self.kind not in PARAM_KINDS:
            raise ValueError(f"parameter {self.name!r}: kind {self.kind!r} is not one of {PARAM_KINDS}")
        if (self.kind == "table") != bool(self.index):
            raise ValueError(f"parameter {self.name!r}: a table names its index input, other kinds none")


#: the default of an option a caller must give (``num_groups``, ``training``): the signatures show no default
REQUIRED: Any = type("Required", (), {"__repr__": lambda self: "REQUIRED"})()


@dataclass(frozen=True)
class Option:
    """A keyword option: its default and a validator returning the normalized value (or raising).

    ``to_backend``: False for an option of the public functions only, which shapes what they return
    (``return_norm``) or how the dispatcher reads ``x`` (``channel_axis``) and never reaches a backend.
    ``offered``: such an option that a backend's op may serve itself (``quantize``: codes made in the norm's
    output pass, not by a second pass over ``y``): the dispatcher asks the op (``serves_option(name, options)``),
    passes the option to the ops that say yes and names it in the call's ``Context.served``; the op's
    :attr:`OpSpec.result` hook applies the options not served to the outputs.
    ``annotation``: its type in the signatures (default: the default's type). A ``default`` of
    :data:`REQUIRED`: the caller must give it.
    """

    name: str
    default: Any
    check: Callable[[Any, str], Any]
    doc: str = ""
    to_backend: bool = True
    annotation: str = ""
    offered: bool = False


@dataclass(frozen=True)
class StatsVariant:
    """A variant of the statistics kernel family (one choice per axis).

    * ``statistic``: ``"centered"`` (mean and variance: LayerNorm), ``"mean_square"`` (RMSNorm),
      ``"l2"`` (the row's L2 norm);
    * ``prologue``: ``"plain"`` input, or ``"residual"`` (``h = x + alpha * residual`` first);
    * ``affine``: ``"vector"`` (per-feature weight with an offset, optional bias), ``"scalar"``,
      ``"table"`` (a row of a parameter table selected per row);
    * ``epilogue``: ``"plain"``, ``"prenorm"`` (also store the pre-norm sum), ``"quantize"``.
    """

    family: ClassVar[str] = "stats"  #: the kernel family of variants of this kind (``OpSpec.family``)
    statistic: Literal["centered", "mean_square", "l2"]
    prologue: Literal["plain", "residual"] = "plain"
    affine: Literal["vector", "scalar", "table", "channel"] = "vector"
    epilogue: Literal["plain", "prenorm", "quantize"] = "plain"


@dataclass(frozen=True)
class ColumnVariant:
    """A variant of the column-statistics family: statistics per channel over the ``N x S`` values of
    ``(N, C, S)`` input (BatchNorm), then an element-wise pass; ``statistic`` as :class:`StatsVariant`'s."""

    family: ClassVar[str] = "column"
    statistic: Literal["centered"]


@dataclass(frozen=True)
class ElementwiseVariant:
    """A variant of the element-wise kernel family: the function applied to each element
    (``"signed_power"``: ``sign(x) |x|^p``; ``"tanh"``: ``tanh(alpha x)``; ``"erf"``: ``erf(alpha x + shift)``), then
    the per-feature affine."""

    family: ClassVar[str] = "elementwise"
    function: Literal["signed_power", "tanh", "erf"]


@dataclass(frozen=True)
class QuantizeVariant:
    """A variant of the quantize kernel family: a row norm (``statistic``: ``"centered"``, LayerNorm) whose input
    may be int8 (exact integer row sums, then a fixed float64 sequence) and whose output may be int8 (the
    quantize epilogue: per-row or per-tensor ``amax``, then ``clip(rint(y / s))``). A float input is normalized
    by the statistics family's op of the same statistic, and every backward is that op's."""

    family: ClassVar[str] = "quantize"
    statistic: Literal["centered"]


@dataclass(frozen=True)
class Composite:
    """A composite op: Python over other ops (``builds_on``) and matrix products in the backend's array
    library, implemented once, in ``impl`` (a module with ``bind(op, backend) -> (forward, backward)``).

    Every backend that implements all of ``builds_on`` offers the op (:func:`pynorm.list_ops`), running
    those ops on itself; a backend may also implement the op directly (the ``numpy`` reference does)."""

    family: ClassVar[str] = "composite"
    builds_on: tuple[str, ...]
    impl: str


@dataclass(frozen=True)
class OpSpec:
    """Everything about an op but its math (which lives in ``reference``).

    Attributes
    ----------
    name : the op's name (``pynorm.<name>``, ``<name>_forward``, ``<name>_backward``).
    params : its parameters, in call order (after ``x``).
    options : its keyword options, validated before dispatch.
    grads : the NamedTuple its backward returns: ``dx`` first, then one gradient per parameter.
    ctx : the dataclass every backend's forward returns as its ctx (the reference's; fields named
        after ``x``, the parameters, the per-row statistics and the options).
    reference : import path of the reference module (``forward``/``backward`` on ``(R, H)`` arrays); default, for
        a spec whose ``ctx`` is defined in ``pynorm.ops.<module>``: ``"pynorm.reference.<module>"``.
    family, variant : the kernel family of the fast backends and the variant implementing the op;
        ``"composite"`` with a :class:`Composite` for an op built from other ops. ``family`` defaults to the
        variant's (``StatsVariant.family``: ``"stats"``, and so on). The spec is checked against
        the family's records when it is made (:func:`pynorm.ops.families.check_spec`: the options, ctx
        fields, parameters and inputs the variant's choices need).
    term_scales : ``term_scales(x2, arrays, dy2, options) -> {output: scale}``, float64 arrays of the
        magnitude of the terms each output and gradient is computed from
        (:func:`pynorm.testing.term_scales`); ``arrays`` maps the names of the extra inputs, the
        parameters (flattened as backends see them) and the extra upstream gradients (``d<output>``)
        to arrays, None where absent.
    check : cross-argument validation ``check(options, hidden)`` beyond each option's own.
    cases : option sets the tests, the demo and the benchmarks run (each a dict of non-defaults).
    summary : the formula in one line, for tables and help texts.
    inputs : array inputs besides ``x`` (a residual stream, per-row indices), in call order.
    outputs : names of what forward returns: ``("y",)``, or e.g. ``("y", "h")`` (the pre-norm sum);
        backward takes the upstream gradient of the first as ``dy`` and of the others as keywords
        ``d<name>`` (None: no gradient arrives there).
    output_dtypes : ``(x_dtype, options) -> dtype of each output`` (default: every output in x's dtype).
    out_shape : ``(x_shape, axis, arrays) -> shape of the first output`` (default: x's shape; ``arrays``
        maps the names of the inputs and parameters to the arrays as given); the others have x's shape.
    check_arrays : ``check_arrays(x_shape, axis, arrays, options)``: the shape rules between arrays that
        their kinds alone do not give (a ``"matrix"`` against the features and ``cond``), raising errors
        from :mod:`pynorm.errors` that name the argument.
    example_shapes : ``(norm_shape, options) -> {name: shape}`` for ``"matrix"``/``"vector"`` parameters
        and ``{cond_name: (C,)}`` for a ``"cond"`` input (the trailing dim), for the example arguments.
    x_dtypes : the dtypes ``x`` may have (default the four float dtypes; ``"int8"`` too for an op with
        a quantized input).
    dy_dtype : ``x_dtype -> dtype`` of ``dy`` and ``dx`` (default: ``x``'s dtype).
    layout : how the dispatcher reads ``x``: ``"rows"`` (the normalized dims ``x.shape[axis:]``, the backends see
        ``(rows, H)``) or ``"channels"`` (``x`` of ``(N, C, *spatial)``, the channel axis an option
        ``channel_axis``; the backends see a C-contiguous ``(N, C, S)`` array, parameters of kind ``"channel"``
        and inputs of kind ``"running"`` as ``(C,)`` arrays).
    result : ``(outputs, ctx, options) -> result`` of the public ``<name>_forward`` (the backend's outputs, the
        dispatcher's :class:`~pynorm._dispatch.Context`, the validated options): by default the first output
        alone, or the tuple of every output; an op whose public result differs declares it here
        (``quant_layer_norm``'s ``(q, s)``, a fused Linear's ``return_norm``).
    result_doc, result_type : what that result is, for the docstring and the signatures (default: derived).
    doc : the forward's description for its docstring: the formula (reST math), then what the parameters
        section does not say. ``backward_doc``: the backward's formula and conventions.
    """

    name: str
    params: tuple[Param, ...]
    options: tuple[Option, ...]
    grads: type
    ctx: type
    variant: StatsVariant | ElementwiseVariant | QuantizeVariant | Composite | ColumnVariant
    term_scales: Callable[..., dict[str, Any]]
    reference: str = field(default="", kw_only=True)
    family: Literal["stats", "elementwise", "quantize", "composite", "column", ""] = field(default="", kw_only=True)
    check: Callable[[Mapping[str, Any], int], None] | None = None
    cases: tuple[dict[str, Any], ...] = field(default=({},))
    summary: str = ""
    inputs: tuple[Input, ...] = ()
    outputs: tuple[str, ...] = ("y",)
    output_dtypes: Callable[[Any, Mapping[str, Any]], tuple[Any, ...]] | None = None
    out_shape: Callable[[tuple[int, ...], int, Mapping[str, Any]], tuple[int, ...]] | None = None
    check_arrays: Callable[[tuple[int, ...], int, Mapping[str, Any], Mapping[str, Any]], None] | None = None
    example_shapes: Callable[[tuple[int, ...], Mapping[str, Any]], dict[str, tuple[int, ...]]] | None = None
    x_dtypes: tuple[str, ...] = ("float16", "bfloat16", "float32", "float64")
    dy_dtype: Callable[[Any], Any] | None = None
    layout: Literal["rows", "channels"] = "rows"
    result: Callable[[Any, Any, Mapping[str, Any]], Any] | None = None
    result_doc: str = ""
    result_type: str = ""
    doc: str = ""
    backward_doc: str = ""

    def __post_init__(self) -> None:
        from .families import check_spec

        if not self.family:
            object.__setattr__(self, "family", type(self.variant).family)
        if not self.reference and self.ctx.__module__.startswith(_BUILT_IN):
            object.__setattr__(self, "reference", "pynorm.reference." + self.ctx.__module__[len(_BUILT_IN) :])
        check_spec(self)  # the spec against its kernel family's contract (FamilyError)

    @functools.cached_property
    def param_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    @functools.cached_property
    def scalar_params(self) -> bool:
        """Whether a parameter is of the ``"scalar"`` kind (DyT's ``alpha``: often given as a Python number, which
        the dispatcher reads as its array before it makes the call's key)."""
        return any(p.kind == "scalar" for p in self.params)

    @functools.cached_property
    def input_names(self) -> tuple[str, ...]:
        return tuple(i.name for i in self.inputs)

    @property
    def grad_names(self) -> tuple[str, ...]:
        """``dx``, then one gradient per differentiable input, then one per parameter."""
        return ("dx", *(f"d{i.name}" for i in self.inputs if i.differentiable), *(f"d{p.name}" for p in self.params))

    def _shapes(self, norm_shape: tuple[int, ...], options: Mapping[str, Any] | None) -> dict[str, tuple[int, ...]]:
        if self.example_shapes is None:
            return {}
        return self.example_shapes(tuple(norm_shape), {**self.defaults(), **(options or {})})

    def example_inputs(
        self, x_shape: tuple[int, ...], axis: int, dtype: Any, rng: Any, modalities: int = 3,
        options: Mapping[str, Any] | None = None,
    ) -> list:  # fmt: skip
        """Random extra inputs for ``x`` of ``x_shape`` normalized from ``axis`` (the demo, benchmarks and
        tests use them): a ``like_x`` input N(0, 1) of x's shape in ``dtype``; a ``row_index`` input of
        ``x.shape[:axis]`` holding ids in ``[0, modalities)``, every id used where there are enough rows;
        a ``cond`` input N(0, 1) of ``x.shape[:axis] + (C,)`` (one per row, ``C`` from ``example_shapes``)."""
        import numpy as np

        ax = axis % len(x_shape)
        shapes = self._shapes(tuple(x_shape[ax:]), options)
        out: list[Any] = []
        for i in self.inputs:
            if i.kind == "like_x":
                out.append(rng.standard_normal(x_shape).astype(dtype))
            elif i.kind == "cond":
                out.append(rng.standard_normal((*x_shape[:ax], *shapes[i.name])).astype(dtype))
            elif i.kind in ("row_scale", "running"):
                out.append(None)  # optional: only an int8 x has a scale; running statistics are for their tests
            else:
                n = int(np.prod(x_shape[:ax]))
                out.append(rng.permutation(np.arange(n) % modalities).reshape(x_shape[:ax]).astype(np.int64))
        return out

    def example_params(
        self, shape: tuple[int, ...], dtype: Any, rng: Any, modalities: int = 3,
        options: Mapping[str, Any] | None = None,
    ) -> list:  # fmt: skip
        """Random parameters for normalized dims ``shape``: ``init + 0.5 * N(0, 1)`` (weights near 1, biases
        near 0), feature parameters of ``shape``, scalars of ``(1,)``, tables of ``(modalities, *shape)``,
        matrices and vectors of the shapes ``example_shapes`` gives for ``options``."""
        shapes = self._shapes(tuple(shape), options)
        out = []
        for p in self.params:
            if p.kind in ("matrix", "vector"):
                pshape = shapes[p.name]
            else:
                kinds = {"feature": shape, "scalar": (1,), "table": (modalities, *shape), "channel": tuple(shape[:1])}
                pshape = kinds[p.kind]
            out.append((p.init + 0.5 * rng.standard_normal(pshape)).astype(dtype))
        return out

    def example_args(
        self, x_shape: tuple[int, ...], axis: int, dtype: Any, rng: Any, modalities: int = 3,
        options: Mapping[str, Any] | None = None,
    ) -> list:  # fmt: skip
        """:meth:`example_inputs` then :meth:`example_params`: the arguments after ``x`` of ``<op>(x, ...)``."""
        ax = axis % len(x_shape)
        return [
            *self.example_inputs(x_shape, ax, dtype, rng, modalities, options),
            *self.example_params(tuple(x_shape[ax:]), dtype, rng, modalities, options),
        ]

    def output_shape(self, x_shape: tuple[int, ...], axis: int, arrays: Mapping[str, Any]) -> tuple[int, ...]:
        """Shape of the first output for ``x`` of ``x_shape`` (``arrays``: the inputs and parameters by name)."""
        if self.out_shape is None:
            return tuple(x_shape)
        return tuple(self.out_shape(tuple(x_shape), axis % len(x_shape), arrays))

    def generic_forward(self) -> Callable[..., Any]:
        """``pynorm.<name>_forward`` called as the generic tools (demo, benchmarks, tests) call every op:
        ``f(x, *inputs, *params, **kw)``; inputs the public signature takes by keyword (``Input.keyword``)
        are passed by keyword. (The module of the public functions registers itself in :data:`PUBLIC` when
        :mod:`pynorm` builds them; the function is looked up there now, so a patched ``pynorm.<name>_forward``
        is the one called.)"""
        f = getattr(PUBLIC["module"], f"{self.name}_forward")
        by_kw = [i for i, inp in enumerate(self.inputs) if inp.keyword]
        if not by_kw:
            return f
        n = len(self.inputs)

        def call(x: Any, *args: Any, **kw: Any) -> Any:
            pos = [a for i, a in enumerate(args[:n]) if i not in by_kw]
            return f(x, *pos, *args[n:], **{self.inputs[i].name: args[i] for i in by_kw}, **kw)

        return call

    def grad_dtype(self, x_dtype: Any) -> Any:
        """The dtype of ``dy`` and ``dx`` for ``x`` of ``x_dtype``."""
        return x_dtype if self.dy_dtype is None else self.dy_dtype(x_dtype)

    def dtypes_of_outputs(self, x_dtype: Any, options: Mapping[str, Any]) -> tuple[Any, ...]:
        if self.output_dtypes is None:
            return (x_dtype,) * len(self.outputs)
        return tuple(self.output_dtypes(x_dtype, options))

    def defaults(self) -> dict[str, Any]:
        return {o.name: o.default for o in self.options}

    @functools.cached_property
    def backend_options(self) -> tuple[str, ...]:
        """The names of the options a backend receives (every option but the public-only ones)."""
        return tuple(o.name for o in self.options if o.to_backend)

    @functools.cached_property
    def _known_options(self) -> dict[str, Any]:
        return {o.name: o for o in self.options}

    def validate(self, options: Mapping[str, Any], hidden: int | None = None) -> dict[str, Any]:
        """Every option validated and normalized (unknown names are a TypeError, as for a function)."""
        known = self._known_options
        unknown = options.keys() - known.keys() if options else ()
        if unknown:
            raise TypeError(f"{self.name}() got unexpected keyword argument(s) {sorted(unknown)}")
        missing = [n for n, o in known.items() if o.default is REQUIRED and n not in (options or {})]
        if missing:
            raise TypeError(f"{self.name}() missing required keyword argument(s) {missing}")
        out = {n: o.check(options.get(n, o.default), n) for n, o in known.items()}
        if self.check is not None and hidden is not None:
            self.check(out, hidden)
        return out


#: the package of the built-in specs: the reference of a spec there is the module of the same name in
#: :mod:`pynorm.reference` (``pynorm.ops.layer_norm`` -> ``pynorm.reference.layer_norm``)
_BUILT_IN = "pynorm.ops."


#: ``{"module": pynorm}``, the package holding every op's public functions: set by :mod:`pynorm._api` when it
#: makes them (the specs sit below the API and import nothing of it)
PUBLIC: dict[str, Any] = {}


# ---------------------------------------------------------------------------
# validators


def check_eps(eps: Any, name: str = "eps") -> float:
    """A finite eps >= 0 as a Python float."""
    if type(eps) is float and 0.0 <= eps < math.inf:  # the common case, first
        return eps
    if isinstance(eps, bool) or not isinstance(eps, numbers.Real):
        raise ArgumentError(f"{name} must be a real number >= 0, got {eps!r}")
    e = float(eps)
    if math.isnan(e) or math.isinf(e) or e < 0:
        raise ArgumentError(f"{name} must be a finite number >= 0, got {eps!r}")
    return e


def check_bool(v: Any, name: str) -> bool:
    """A Python or NumPy bool."""
    if isinstance(v, bool):
        return v
    if type(v).__name__ == "bool_" and type(v).__module__ == "numpy":
        return bool(v)
    raise ArgumentError(f"{name} must be True or False, got {v!r}")


def check_positive_int(v: Any, name: str) -> int:
    """``v`` as an int >= 1 (NumPy integers too, bools never)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
        raise ArgumentError(f"{name} must be a positive int, got {v!r}")
    return int(v)


def check_real(v: Any, name: str) -> float:
    """A finite real scalar option as a Python float."""
    if type(v) is float and math.isfinite(v):  # the common case, first
        return v
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(float(v)):
        raise ArgumentError(f"{name} must be a finite real number, got {v!r}")
    return float(v)


#: the largest |weight_offset| accepted: offsets in use are 0 and 1 (Gemma, TE's zero-centred gamma); beyond
#: 2^16 the effective weight ``w + o`` of a float16 model is no longer a weight near ``o``, and far beyond it
#: overflows the fast backends' float32 math (the reference computes it in float64)
MAX_WEIGHT_OFFSET = 65536.0


def check_offset(v: Any, name: str) -> float:
    """A finite real ``weight_offset`` with ``|v| <= MAX_WEIGHT_OFFSET`` as a Python float."""
    o = check_real(v, name)
    if abs(o) > MAX_WEIGHT_OFFSET:
        raise ArgumentError(
            f"{name} must be between -{MAX_WEIGHT_OFFSET:g} and {MAX_WEIGHT_OFFSET:g} (1.0 for Gemma's (1 + w)), "
            f"got {v!r}"
        )
    return o


def check_scale(v: Any, name: str) -> float | None:
    """None, or a positive finite real whose float32 rounding is a positive finite float32 (returned as that)."""
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise ArgumentError(f"{name} must be None or a positive finite real number, got {v!r}")
    import numpy as np

    with np.errstate(all="ignore"):
        s = float(np.float32(v))
    if not (math.isfinite(float(v)) and s > 0 and math.isfinite(s)):
        raise ArgumentError(f"{name} must be a positive finite number (as a float32), got {v!r}")
    return s


def one_of(*choices: Any, doc: str = "") -> Callable[[Any, str], Any]:
    """A validator accepting exactly ``choices``: strings by value, integers by value (NumPy
    integers too, bools never); returns the matching choice itself."""

    plain = {(type(c), c) for c in choices if type(c) in (int, str)}

    def check(v: Any, name: str) -> Any:
        if type(v) in (int, str) and (type(v), v) in plain:  # the common case, first (True is not 1 here)
            return v
        if v is None and None in choices:
            return None
        if not isinstance(v, (bool, float)):
            for c in choices:
                if isinstance(c, str) and isinstance(v, str) and v == c:
                    return c
                if isinstance(c, int) and isinstance(v, numbers.Integral) and int(v) == c:
                    return c
        shown = " or ".join(repr(c) for c in choices)
        raise ArgumentError(f"{name} must be {shown}{f' ({doc})' if doc else ''}, got {v!r}")

    check.choices = choices  # type: ignore[attr-defined]  # read by the family check (pynorm.ops.families)
    return check


def filled(cls: type[Any], values: dict[str, Any]) -> Any:
    """An instance of the frozen dataclass ``cls`` holding ``values`` (one per field, by name), made without the
    dataclass's ``__init__``: a frozen one sets each field through ``object.__setattr__``, about 0.1 us a field,
    which made the ctx the largest fixed cost of a small call. ``cls`` must have no ``__post_init__`` and no
    field outside ``values`` (a ctx type; ``tests/test_plans.py`` checks every spec's ctx against its
    ``__init__``)."""
    obj = object.__new__(cls)
    obj.__dict__.update(values)
    return obj
