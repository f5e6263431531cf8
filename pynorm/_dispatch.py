"""Validation, dispatch, flattening and gradient reduction, done once for every op from its spec.

:func:`forward` and :func:`backward` are what every public ``<op>_forward`` / ``<op>_backward``
calls: they validate the arguments against the op's :class:`~pynorm.ops.OpSpec` (so every backend
rejects bad input the same way, with the same message), pick a backend through
:mod:`pynorm._registry`, flatten ``x`` to ``(rows, hidden)`` and the parameters to ``(hidden,)``,
call the backend's ``forward(x2, *params, out=..., **options)`` / ``backward(dy2, ctx, dx_out=...)``
and reduce each parameter's gradient back to the parameter's own shape.

Shapes follow ONNX's ``axis`` rule: dims ``axis .. ndim-1`` of ``x`` are normalized together
(``axis`` may be negative); ``"feature"`` parameters have shape ``x.shape[axis:]`` or any shape
that broadcasts to it from the right (``(H,)`` for a ``(..., 1, H)`` block, say) and reach the
backend as ``(H,)`` vectors; ``"scalar"`` ones as ``(1,)`` arrays; ``"table"`` ones as ``(M, H)``.
Extra inputs reach it as ``(rows, H)`` (``"like_x"``) or ``(rows,)`` (``"row_index"``) arrays.
Gradients come back in each parameter's own shape and dtype.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import _registry
from ._dtypes import FLOAT_DTYPES, round_to
from ._validate import (
    as_array,
    check_axis,
    check_float_dtype,
    check_input,
    check_input_values,
    check_out,
    check_param,
    check_param_values,
    check_tables,
    ctx_arrays,
    returner,
    xp_of,
)
from .errors import ArrayTypeError, ContextError, DTypeError, ShapeError
from .ops import OpSpec
from .ops._spec import filled
from .ops.fp_quant import quantize_outputs, quantize_result

__all__ = ["FLOAT_DTYPES", "Context", "backward", "check_axis", "forward"]

Array = Any  # numpy.ndarray, cupy.ndarray, or another backend's array type


@dataclass(frozen=True, eq=False)
class Context:
    """What a ``*_forward`` call hands to the matching ``*_backward``.

    Attributes
    ----------
    op : name of the op that made it.
    backend : name of the backend that ran forward (backward runs there too).
    x_shape, x_dtype : shape and dtype of the forward input.
    axis : first normalized axis (non-negative).
    param_shapes : shape of each parameter as given (None where absent).
    inner : the backend's ctx (e.g. :class:`pynorm.ops.layer_norm.LayerNormCtx`):
        the flattened input, parameters and per-row statistics.
    input_dtypes : dtype of each differentiable extra input (a residual's), in order.
    output_dtypes : dtype of each output after the first (the upstream gradients' dtypes).
    array_family : ``(module, class)`` of the arrays forward ran on (``("numpy", "ndarray")``).
    y_shape : shape of the first output (None: ``x_shape``; a fused norm + Linear's ``(..., N)``).
    input_shapes : shape of each differentiable extra input, in order (a ``cond``'s gradient has its shape).
    served : the public-only options the backend's op served itself (:attr:`pynorm.ops.Option.offered`;
        ``("quantize",)``: ``y`` quantized in the norm's output pass), the others applied after it.
    returners : None, or for arguments read through DLPack (a PyTorch tensor, a JAX array), one function per
        gradient of the backward (``dx``, the differentiable inputs', the parameters') giving it back as its
        argument's own array type (None where that argument was a NumPy or CuPy array):
        :func:`pynorm._validate.returner`.
    plan : internal: the dispatcher's record of the call shape that made the ctx (None for a ctx made otherwise),
        whose backward of a ``dy`` of that shape skips the checks the shape answers (:func:`_short_backward`,
        :func:`_short_backward_channels`).
    """

    op: str
    backend: str
    x_shape: tuple[int, ...]
    x_dtype: Any
    axis: int
    param_shapes: tuple[tuple[int, ...] | None, ...]
    inner: Any
    input_dtypes: tuple[Any, ...] = ()
    output_dtypes: tuple[Any, ...] = ()
    array_family: tuple[str, str] = ("numpy", "ndarray")
    y_shape: tuple[int, ...] | None = None
    input_shapes: tuple[tuple[int, ...], ...] = ()
    returners: tuple[Any, ...] | None = None
    served: tuple[str, ...] = ()
    plan: Any = field(default=None, repr=False)

    def __getstate__(self) -> dict[str, Any]:
        # a pickled or copied ctx (a Dask task's result, a deepcopy) leaves :attr:`plan` behind: the dispatcher's
        # record of its call shape holds this process's runners and compiled kernels (the copy's backward takes the
        # general path, with the same bits)
        state = dict(self.__dict__)
        state.pop("plan", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    @property
    def rows(self) -> int:
        return math.prod(self.x_shape[: self.axis])

    @property
    def hidden(self) -> int:
        return math.prod(self.x_shape[self.axis :])


# ---------------------------------------------------------------------------
# validation


def _flat_feature(p: Array | None, norm_shape: tuple[int, ...]) -> Array | None:
    if p is None:
        return None
    h = math.prod(norm_shape)
    if tuple(p.shape) == norm_shape:
        return p.reshape(h)
    return xp_of(p).broadcast_to(p, norm_shape).reshape(h)


def _flat_input(kind: str, a: Array | None, rows: int, h: int) -> Array | None:
    """An extra input as backends see it: ``(rows, H)`` (like_x), ``(rows,)`` (row_index), ``(G, C)`` (cond),
    a contiguous ``(rows,)`` float64 array (row_scale); None stays None (an absent optional input)."""
    if a is None:
        return None
    if kind == "row_scale":
        xp = xp_of(a)
        return xp.ascontiguousarray(xp.broadcast_to(a.astype(xp.float64).reshape(-1), (rows,)))
    if kind == "like_x":
        return a.reshape(rows, h)
    if kind == "cond":
        return a.reshape(math.prod(a.shape[:-1]), a.shape[-1])
    return a.reshape(rows)


def _flat_param(kind: str, p: Array | None, norm_shape: tuple[int, ...]) -> Array | None:
    """A parameter as backends see it: ``(H,)`` (feature), ``(1,)`` (scalar), ``(M, H)`` (table)."""
    if p is None:
        return None
    if kind == "scalar":
        return p.reshape(1)
    if kind == "table":
        return p.reshape(p.shape[0], math.prod(norm_shape))
    if kind in ("matrix", "vector"):
        return p
    return _flat_feature(p, norm_shape)


def _unflat_feature_grad(
    g: Array | None, shape: tuple[int, ...] | None, norm_shape: tuple[int, ...], xp: Any
) -> Array | None:
    """Reduce a ``(H,)`` gradient to a parameter of ``shape`` that was broadcast to ``norm_shape``."""
    if g is None or shape is None:
        return None
    if tuple(shape) == norm_shape:
        return g.reshape(shape)
    full = g.reshape(norm_shape)
    lead = len(norm_shape) - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, d in enumerate(shape) if d == 1 and norm_shape[lead + i] != 1)
    summed = full.astype(xp.float64).sum(axis=axes).reshape(shape)
    if xp is np:
        return round_to(summed, g.dtype)
    return summed.astype(g.dtype)


# ---------------------------------------------------------------------------
# dispatch


def forward(
    spec: OpSpec,
    x: Any,
    params: tuple[Any, ...],
    *,
    axis: Any,
    backend: str | None,
    out: Any,
    options: Mapping[str, Any],
    inputs: tuple[Any, ...] = (),
) -> tuple[Any, Context]:
    """Validate, dispatch and run ``spec``'s forward; ``(y, ctx)`` (``((y, h, ...), ctx)`` for an op of
    several outputs), in ``x``'s shape, or ``(spec.result(outputs, ctx, options), ctx)``. An op of the
    ``"channels"`` layout takes ``x`` of ``(N, C, *spatial)`` (or channels last; the backends see ``(N, C, S)``)."""
    channels = spec.layout == "channels"
    # (the channel axis is an option: the key's axis is a constant for the channel ops)
    key, plan, params, inputs = _keyed(spec, x, inputs, params, 0 if channels else axis, backend, out, options)
    run = _run_channels if channels else _run
    if plan is not None:  # the same call shape as before: only what depends on the values is checked again
        _recheck(spec, plan, x, inputs, params, out, plan.x_shape if channels else plan.y_shape)
        return run(spec, plan, x, tuple(inputs), tuple(params), out, backend)  # type: ignore[operator]
    given, out_given = (x, *inputs, *params), out
    make = new_channel_plan if channels else new_plan
    plan, x, ins, ps, out = make(spec, x, params, axis, backend, out, options, inputs, key is not None)
    _keep(key, plan, given)
    if plan.family is not None:
        return run(spec, plan, x, ins, ps, out, backend)  # type: ignore[operator]
    return _returned(spec, run(spec, plan, x, ins, ps, out, backend), given, out_given)  # type: ignore[operator]


def call(spec: OpSpec, x: Any, params: tuple[Any, ...], *, axis: Any, backend: str | None, out: Any,
         options: Mapping[str, Any], inputs: tuple[Any, ...] = ()) -> Any:  # fmt: skip
    """``pynorm.<op>``: :func:`forward`'s result without its ctx. A call shape seen before, on ``numpy.ndarray``
    arguments, of an op whose result is its outputs, runs the backend's runner that builds no ctx
    (:func:`result_only`): what a :class:`pynorm.Plan`'s call runs, the same bits as :func:`forward`'s. An op of
    the ``"channels"`` layout without a result function (GroupNorm) runs the backend's ``forward_lean`` where it
    has one (:func:`channel_lean`, :func:`lean_channels`), else its plan's full path."""
    if without_ctx(spec, options):
        channels = spec.layout == "channels"
        _, plan, params, inputs = _keyed(spec, x, inputs, params, 0 if channels else axis, backend, out, options)
        if plan is not None and plan.family is not None:
            _recheck(spec, plan, x, inputs, params, out, plan.x_shape if channels else plan.y_shape)
            name, mod = _registry.resolve_family(spec.name, plan.family, plan.present_names, backend)
            if channels:
                lean = channel_lean(plan, mod)
                if lean is None:
                    return _run_channels(spec, plan, x, tuple(inputs), tuple(params), out, backend)[0]
                return lean_channels(plan, lean, x, inputs, params, out)
            calls = plan.calls.get(mod)
            if calls is None:
                run = plan.targets.get(mod)
                run = run if run is not None else _served_target(spec, mod, plan)
                calls = plan.calls[mod] = Calls(run, plan.options.get("quantize"), plan.served.get(mod, ()))
            return result_only(spec, plan, name, calls, x, inputs, params, out)
    return forward(spec, x, params, axis=axis, backend=backend, out=out, options=options, inputs=inputs)[0]


def _keyed(
    spec: OpSpec, x: Any, inputs: tuple[Any, ...], params: tuple[Any, ...], axis: Any, backend: str | None, out: Any,
    options: Mapping[str, Any],
) -> tuple[tuple[Any, ...] | None, Any, tuple[Any, ...], tuple[Any, ...]]:  # fmt: skip
    """``(key, the plan kept under it or None, params, inputs)`` of a call (:func:`_plan_key`, :func:`_lookup`),
    with a number given for a parameter or input read as its array first (:func:`_as_arrays`), so that the call
    shape has a plan: before the key for an op with a scalar parameter (DyT's ``alpha=0.5``), after a first
    attempt that found no key for the others."""
    if spec.scalar_params and _scalars(x, params, ()):
        params = _as_arrays(params)
    key, plan = _lookup(_plan_key(spec, x, inputs, params, axis, backend, out, options))
    if key is None and _scalars(x, params, inputs):
        params, inputs = _as_arrays(params), _as_arrays(inputs)
        key, plan = _lookup(_plan_key(spec, x, inputs, params, axis, backend, out, options))
    return key, plan, params, inputs


def _number(a: Any) -> bool:
    """Whether ``a`` is a Python or NumPy scalar that validation reads as an array (not a bool)."""
    t = type(a)
    if t is float or t is int:  # (the common case first: isinstance against an ABC costs 0.3 us)
        return True
    return t is not np.ndarray and isinstance(a, (numbers.Number, np.generic)) and t is not bool


def _scalars(x: Any, params: tuple[Any, ...], inputs: tuple[Any, ...]) -> bool:
    """Whether ``x`` is a ``numpy.ndarray`` and a parameter or input a Python or NumPy scalar (a call made with
    ``alpha=0.5``: a NumPy array of it is what validation makes; beside another library's ``x`` it makes one of
    that library's, so those calls are left to it)."""
    return type(x) is np.ndarray and any(a is not None and _number(a) for a in (*params, *inputs))


def _as_arrays(arrays: tuple[Any, ...]) -> tuple[Any, ...]:
    """``arrays`` with each Python or NumPy scalar as the NumPy array validation reads it as
    (:func:`pynorm._validate.as_array`: ``numpy.asarray``, so that the call has a key and a plan: a DyT call with
    ``alpha=0.5``, 1 x 4096, took 100 us on the full path every time, 21 us with its plan)."""
    return tuple(np.asarray(a) if a is not None and _number(a) else a for a in arrays)


def outputs_alone(spec: OpSpec, options: Mapping[str, Any]) -> bool:
    """Whether a call of ``spec`` with ``options`` returns its outputs as the backend gives them: no result
    function, or the norms' ``quantize=`` result without a ``quantize=`` option (then none is served either)."""
    return spec.result is None or (spec.result is quantize_result and options.get("quantize") is None)


def without_ctx(spec: OpSpec, options: Mapping[str, Any]) -> bool:
    """Whether a call of ``spec`` with ``options`` that returns no ctx may run without one (:func:`result_only`):
    :func:`outputs_alone`, or the norms' ``quantize=`` result, which needs only what the plan holds."""
    return spec.result is None or spec.result is quantize_result


class Calls:
    """How a plan's calls for the result alone run on one op module: :attr:`run`, the plan's runner there
    (:func:`_served_target`); :attr:`lean`, the same building no ctx (its ``without_ctx()``: numba's
    :class:`pynorm.backends.numba._common.PlanForward`; None where the backend has none, then the call is
    :func:`execute`'s with a ctx, dropped); :attr:`fast`, the backend's shortest call for the plan's shape (its
    ``fast(shape)``, looked for after a first call of :attr:`lean` found the setup and entry point; it may return
    None for a call it leaves to :attr:`lean`), and :attr:`direct`, whether it takes the arrays as they come.
    For a result that is the outputs: no ``spec.result`` to apply, no served option (the norms' ``quantize=``
    None)."""

    __slots__ = ("direct", "fast", "lean", "quantize", "run", "served")

    def __init__(self, run: Any, quantize: Any = None, served: tuple[str, ...] = ()) -> None:
        make = getattr(run, "without_ctx", None)
        self.run, self.lean, self.fast = run, (None if make is None else make()), None
        #: the ``quantize=`` option of the plan's calls (a :class:`pynorm.QuantSpec`; None: the result is the
        #: outputs) and the options the module serves itself (:attr:`_Plan.served`): a quantized call's result is
        #: shaped or quantized by :func:`~pynorm.ops.fp_quant.quantize_outputs`, and has no :attr:`fast`
        self.quantize, self.served = quantize, served
        #: :attr:`fast` takes the plan's calls without ``out`` as they come: the inputs and parameters in their flat
        #: shapes, ``x`` and ``y`` of ``(R, H)`` (the plan's key fixes every shape), so nothing is reshaped
        self.direct = False


def result_only(
    spec: OpSpec, plan: _Plan, name: str, calls: Calls, x: Array, ins: tuple[Any, ...], ps: tuple[Any, ...],
    out: Any,
) -> Any:  # fmt: skip
    """The result of a call that ``plan`` holds for (on the backend ``name``) through ``calls``, without a ctx:
    ``calls.fast`` where it takes the call, else ``calls.lean`` through :func:`execute` (its first call makes
    ``calls.fast``). ``calls.fast`` returns an op's outputs as the backend's runner does: ``y``, or a tuple of
    several (the residual prologue's ``(y, h)``), shaped here as :func:`execute` shapes them."""
    if calls.quantize is not None:
        return _quantized_only(spec, plan, name, calls, x, ins, ps, out)
    fast = calls.fast
    if fast is not None:
        if calls.direct and out is None:  # (the arrays as they are, and y as the backend returns it)
            y = fast(x, *ins, *ps)
            if y is not None:
                return y
        shape = (plan.rows, plan.h)
        args = (*ins, *ps) if plan.flat else _flat_arrays(spec, plan, ins, ps)
        y = fast(x if x.shape == shape else x.reshape(shape), *args, out=None if out is None else out.reshape(shape))
        if y is not None:
            if isinstance(y, tuple):  # (an op of several outputs: the first shaped as y, the others as x)
                x_shape = x.shape
                return tuple(
                    (out if out is not None else o.reshape(plan.y_shape)) if i == 0 else o.reshape(x_shape)
                    for i, o in enumerate(y)
                )
            return out if out is not None else (y if y.shape == plan.y_shape else y.reshape(plan.y_shape))
    lean = calls.lean
    if lean is None:
        return execute(spec, plan, name, calls.run, x, ins, ps, out)[0]
    result = execute(spec, plan, name, lean, x, ins, ps, out, with_ctx=False)[0]
    if fast is None:
        make = getattr(lean, "fast", None)
        calls.fast = None if make is None else make((plan.rows, plan.h))
        shape = (plan.rows, plan.h)
        calls.direct = plan.flat and x.shape == shape and plan.y_shape == shape
    return result


def _quantized_only(
    spec: OpSpec, plan: _Plan, name: str, calls: Calls, x: Array, ins: tuple[Any, ...], ps: tuple[Any, ...],
    out: Any,
) -> Any:  # fmt: skip
    """:func:`result_only` of a call with ``quantize=``: the outputs of ``calls.fast`` (the backend's shortest call,
    where it served the option and takes the call) or of ``calls.lean`` (no ctx), the first quantized as
    :func:`~pynorm.ops.fp_quant.quantize_result` does it with a ctx -- the same bits."""
    shape = (plan.rows, plan.h)
    fast, res = calls.fast, None
    if fast is not None and out is None:  # (the quantized rows, and the residual sum shaped below as execute does)
        args = (*ins, *ps) if plan.flat else _flat_arrays(spec, plan, ins, ps)
        same = x.shape == shape
        res = fast(x if same else x.reshape(shape), *args)
        if res is not None and len(spec.outputs) > 1 and not same:
            res = (res[0], *(o.reshape(x.shape) for o in res[1:]))
    if res is None:
        lean = calls.lean
        if lean is None:
            return execute(spec, plan, name, calls.run, x, ins, ps, out)[0]
        res = execute(spec, plan, name, lean, x, ins, ps, out, calls.served, with_ctx=False)[0]
        if fast is None and "quantize" in calls.served:
            make = getattr(lean, "fast", None)
            calls.fast = None if make is None else make(shape)
    outs = res if len(spec.outputs) > 1 else (res,)
    outs = quantize_outputs(outs, calls.quantize, "quantize" in calls.served, tuple(x.shape), plan.axis, name)
    return outs if len(outs) > 1 else outs[0]


def new_plan(
    spec: OpSpec, x: Any, params: tuple[Any, ...], axis: Any, backend: str | None, out: Any,
    options: Mapping[str, Any], inputs: tuple[Any, ...], keyed: bool,
) -> tuple[Any, Any, tuple[Any, ...], tuple[Any, ...], Any]:  # fmt: skip
    """Validate a call of ``spec`` (an op of the ``"rows"`` layout) and make its :class:`_Plan`: ``(plan, x, inputs,
    params, out)``, the arrays as validated. ``keyed``: every array an exact ``numpy.ndarray`` (the plan's
    :attr:`_Plan.family` is then numpy's). ``backend`` is resolved when the plan runs."""
    x = as_array(x, "x")
    check_float_dtype(x, "x", spec.x_dtypes)
    if x.ndim < 1:
        raise ShapeError("x must have at least 1 dimension, got a 0-d array")
    ax = check_axis(axis, x.ndim)
    norm_shape = tuple(x.shape[ax:])
    h = math.prod(norm_shape)
    if h == 0:
        raise ShapeError(f"the normalized dims x.shape[{ax}:] = {norm_shape} must not be empty")
    opts = spec.validate(options, h)
    ins = tuple(check_input(si, a, x, ax) for si, a in zip(spec.inputs, inputs, strict=True))
    by_name = dict(zip(spec.input_names, ins, strict=True))
    ps = tuple(check_param(sp, p, x, ax, by_name) for sp, p in zip(spec.params, params, strict=True))
    check_tables(spec, ps)
    names = (*spec.input_names, *spec.param_names)
    arrays = dict(zip(names, (*ins, *ps), strict=True))
    if spec.check_arrays is not None:
        spec.check_arrays(tuple(x.shape), ax, {"x": x, **arrays}, opts)
    y_shape = spec.output_shape(tuple(x.shape), ax, arrays)
    present = tuple(a for a in (x, *ins, *ps) if a is not None)
    out = check_out(out, "out", x, present, y_shape, spec.dtypes_of_outputs(x.dtype, opts)[0])
    to_backend = opts if len(spec.backend_options) == len(opts) else {k: opts[k] for k in spec.backend_options}
    lead = x.shape[:ax]
    input_flat = tuple(_flat_shape(si.kind, a, lead, norm_shape) for si, a in zip(spec.inputs, ins, strict=True))
    param_flat = tuple(_flat_shape(sp.kind, p, lead, norm_shape) for sp, p in zip(spec.params, ps, strict=True))
    plan = _Plan(
        ax, math.prod(x.shape[:ax]), h, norm_shape, y_shape, math.prod(y_shape[ax:]), opts, to_backend,
        tuple(n for n, a in zip(("x", *names), (x, *ins, *ps), strict=True) if a is not None),
        input_flat, param_flat,
        tuple(None if p is None else tuple(p.shape) for p in ps),
        all(
            a is raw and (a is None or (f is not None and tuple(a.shape) == f))
            for a, raw, f in zip((*ins, *ps), (*inputs, *params), (*input_flat, *param_flat), strict=True)
        ),
        tuple(a.dtype for si, a in zip(spec.inputs, ins, strict=True) if si.differentiable),
        tuple(tuple(a.shape) for si, a in zip(spec.inputs, ins, strict=True) if si.differentiable),
        _value_checks(spec), ("numpy", "ndarray") if keyed else None,
    )  # fmt: skip
    return plan, x, ins, ps, out


def _returned(
    spec: OpSpec, done: tuple[Any, Context], given: tuple[Any, ...], out_given: Any
) -> tuple[Any, Context]:  # fmt: skip
    """A forward's ``(result, ctx)`` for arguments of which some came through DLPack: each array of the result
    back as ``x``'s own type (``out`` as the object given), and the ctx's :attr:`Context.returners` for the
    backward's gradients. Unchanged for NumPy and CuPy arguments."""
    back = tuple(returner(a) for a in given)
    if not any(back):
        return done
    result, ctx = done
    n_in = len(spec.inputs)
    diff_inputs = tuple(b for si, b in zip(spec.inputs, back[1 : 1 + n_in], strict=True) if si.differentiable)
    object.__setattr__(ctx, "returners", (back[0], *diff_inputs, *back[1 + n_in :]))
    first = back[0]
    if first is None:
        return result, ctx

    def one(i: int, r: Any) -> Any:
        return out_given if (i == 0 and out_given is not None) else first(r)

    if isinstance(result, tuple):
        return tuple(one(i, r) for i, r in enumerate(result)), ctx
    return one(0, result), ctx


def _lookup(key: tuple[Any, ...] | None) -> tuple[tuple[Any, ...] | None, Any]:
    """``(key, the plan kept under it or None)``; the key None when it holds an unhashable option value (no plan)."""
    if key is None:
        return None, None
    try:  # (the lookup is the key's hash test: a tuple's hash is not kept, and a small call's key costs 0.2 us)
        return key, _PLANS.get(key)
    except TypeError:
        return None, None


def _recheck(
    spec: OpSpec, plan: Any, x: Any, inputs: tuple[Any, ...], params: tuple[Any, ...], out: Any,
    y_shape: tuple[int, ...],
) -> None:  # fmt: skip
    """The checks of a call served by ``plan`` that depend on the values (:attr:`_Plan.value_checks`), and ``out``'s
    overlap with the arrays (its shape and dtype the plan's key fixed)."""
    if plan.value_checks:
        by_name = dict(zip(spec.input_names, inputs, strict=True))
        for i, sp in plan.value_checks:
            if i < 0:
                check_input_values(spec.inputs[~i], inputs[~i])
            elif params[i] is not None:
                check_param_values(sp, params[i], by_name)
    if out is not None:
        check_out(out, "out", x, tuple(a for a in (x, *inputs, *params) if a is not None), y_shape, out.dtype)


def _value_checks(spec: OpSpec) -> tuple[tuple[int, Any], ...]:
    """The checks of ``spec``'s arguments that depend on their values (:attr:`_Plan.value_checks`)."""
    return (
        *((~i, si) for i, si in enumerate(spec.inputs) if si.kind in ("row_scale", "running")),
        *((i, sp) for i, sp in enumerate(spec.params) if sp.kind == "table" or sp.finite),
    )


def _keep(key: tuple[Any, ...] | None, plan: Any, given: tuple[Any, ...]) -> None:
    """Keep ``plan`` under ``key`` (the oldest plan dropped beyond :data:`_MAX_PLANS`): not without a key, nor for
    an array ``given`` of a non-native byte order (the checks read it as a native copy: see :func:`_plan_key`)."""
    if key is None or not all(a is None or a.dtype.isnative for a in given):
        return
    if len(_PLANS) >= _MAX_PLANS:
        _PLANS.pop(next(iter(_PLANS)))
    _PLANS[key] = plan


@dataclass(frozen=True)
class _Plan:
    """What the checks of one call shape established (:func:`_plan_key`): the flattening, the validated options,
    the names of the arrays present (for the backend's resolution), and what the call's :class:`Context` reads of
    the shapes and dtypes alone."""

    axis: int
    rows: int
    h: int
    norm_shape: tuple[int, ...]
    y_shape: tuple[int, ...]
    y_h: int
    options: dict[str, Any]
    to_backend: dict[str, Any]
    present_names: tuple[str, ...]
    #: each input's and parameter's shape as the backend sees it (:func:`_flat_shape`; None: absent, or
    #: flattened by :func:`_flat_input` / :func:`_flat_param` on every call)
    input_flat: tuple[tuple[int, ...] | None, ...]
    param_flat: tuple[tuple[int, ...] | None, ...]
    param_shapes: tuple[tuple[int, ...] | None, ...]
    #: whether every input and parameter present is already in its flat shape (then passed as it is)
    flat: bool
    input_dtypes: tuple[Any, ...]  # of the differentiable inputs
    input_shapes: tuple[tuple[int, ...], ...]  # of the differentiable inputs
    #: the checks that depend on the values, run on every call: ``(i, spec_param)`` for parameter ``i``,
    #: ``(~i, spec_input)`` for input ``i``
    value_checks: tuple[tuple[int, Any], ...]
    #: ``("numpy", "ndarray")`` when the plan is kept (every array of its key an exact numpy.ndarray), else None
    family: tuple[str, str] | None
    #: per op module the plan ran on, the forward that runs its options there (:func:`_target`)
    targets: dict[Any, Any] = field(default_factory=dict)
    #: per op module, the offered public-only options it serves (:func:`_served_target`; absent: none)
    served: dict[Any, tuple[str, ...]] = field(default_factory=dict)
    #: per op module, the runners of its calls for the result alone (:func:`call`)
    calls: dict[Any, Calls] = field(default_factory=dict)
    #: the :class:`Context` fields its key fixes (every field but the backend's name, its ctx and the later
    #: outputs' dtypes), filled by the plan's first call
    ctx_base: dict[str, Any] = field(default_factory=dict)
    #: per backend, the short backward of its ctxs (:func:`_short_backward`; False: none)
    backs: dict[str, Any] = field(default_factory=dict)


def _flat_shape(kind: str, a: Array | None, lead: tuple[int, ...], norm_shape: tuple[int, ...]) -> Any:
    """The shape an input or parameter of ``kind`` reaches the backend in when a plain reshape gives it (None:
    absent, or one that :func:`_flat_input` / :func:`_flat_param` must build on every call: a broadcast feature
    parameter, a row scale's float64 copy, a matrix or vector passed as it is)."""
    if a is None:
        return None
    rows, h = math.prod(lead), math.prod(norm_shape)
    if kind == "feature":
        return (h,) if tuple(a.shape) == norm_shape else None
    flat = {
        "scalar": (1,),
        "table": (a.shape[0], h) if a.ndim else None,
        "like_x": (rows, h),
        "row_index": (rows,),
        "cond": (math.prod(a.shape[:-1]), a.shape[-1]) if a.ndim else None,
    }
    return flat.get(kind)


#: the plans of recent call shapes (at most :data:`_MAX_PLANS`, the oldest dropped first)
_PLANS: dict[tuple[Any, ...], Any] = {}  # (a _Plan, or a _ChannelPlan for an op of the "channels" layout)
_MAX_PLANS = 512


def _plan_key(
    spec: OpSpec, x: Any, inputs: tuple[Any, ...], params: tuple[Any, ...], axis: Any, backend: str | None, out: Any,
    options: Mapping[str, Any],
) -> tuple[Any, ...] | None:  # fmt: skip
    """The key of a call's plan, one flat tuple: the op, ``axis``, ``backend``, the options (their number, names,
    values, and the values' types), then for each array argument in order None (absent) or an exact ``numpy.ndarray``'s
    dtype, shape, strides and flags (:attr:`numpy.ndarray.flags` ``.num``: writability and alignment among them).
    None -- no plan -- for anything else (a list, a DLPack exporter, a Python number, a CuPy array: the full path
    every time); an unhashable option value makes a key whose lookup raises TypeError (the caller then takes the
    full path).

    The option values' types are part of it (``True == 1`` and ``hash(True) == hash(1)``, but True is no eps);
    writability and alignment are, because numba types a read-only or an unaligned array apart (a plan's runner
    calls the compiled kernel its first call found, :class:`pynorm.backends.numba._common.PlanForward`). The dtype
    holds the byte order (a plan is never made for a non-native one: validation reads it as a native copy). A
    present array adds four items that begin with a dtype, an absent one a single None, so the positions never
    run into each other."""
    if type(axis) is not int:
        return None
    values = options.values()
    key: list[Any] = [spec.name, axis, backend, len(options), *options, *values, *map(type, values)]
    for a in (x, *inputs, *params, out):
        if a is None:
            key.append(None)
        elif type(a) is np.ndarray:
            key += (a.dtype, a.shape, a.strides, a.flags.num)
        else:
            return None
    return tuple(key)


def _run(
    spec: OpSpec, plan: _Plan, x: Array, ins: tuple[Any, ...], ps: tuple[Any, ...], out: Any, backend: str | None
) -> tuple[Any, Context]:
    """Resolve the backend, flatten, call it and wrap its ctx, for arguments ``plan`` holds for."""
    if plan.family is not None:  # (every array an exact numpy.ndarray: the plan's key says so)
        name, mod = _registry.resolve_family(spec.name, plan.family, plan.present_names, backend)
    else:
        present = tuple(a for a in (x, *ins, *ps) if a is not None)
        name, mod = _registry.resolve(spec.name, present, plan.present_names, backend)
    run = plan.targets.get(mod)
    if run is None:  # what runs the plan's options on mod (:func:`_target`), kept for the plan's next call
        run = _served_target(spec, mod, plan)
    return execute(spec, plan, name, run, x, ins, ps, out, plan.served.get(mod, ()))


def execute(
    spec: OpSpec, plan: _Plan, name: str, run: Any, x: Array, ins: tuple[Any, ...], ps: tuple[Any, ...], out: Any,
    served: tuple[str, ...] = (), with_ctx: bool = True,
) -> tuple[Any, Context]:  # fmt: skip
    """Flatten, call the backend ``name``'s runner ``run`` (:func:`_served_target`: ``served``, the offered options
    it serves) and wrap its ctx, for arguments ``plan`` holds for. ``with_ctx`` False (a runner that builds none,
    for an op whose result needs none: a :class:`pynorm.Plan`'s call): ``(result, None)``."""
    rows, h = plan.rows, plan.h
    # (every input and parameter present reaching the backend as it is: a small call's microseconds)
    flat: Any = (*ins, *ps) if plan.flat else _flat_arrays(spec, plan, ins, ps)
    res, inner = run(
        x if x.shape == (rows, h) else x.reshape(rows, h), *flat,
        out=None if out is None else out.reshape(rows, plan.y_h),
    )  # fmt: skip
    x_shape = tuple(x.shape)
    if len(spec.outputs) > 1:
        shaped = tuple(
            o if (i == 0 and served) else
            out if (i == 0 and out is not None) else o.reshape(plan.y_shape if i == 0 else x_shape)
            for i, o in enumerate(res)
        )  # fmt: skip
        first, more = shaped[0], tuple(o.dtype for o in shaped[1:])
    else:
        if served:  # (the result of the served options, shaped by the result hook)
            first = res
        else:
            first = out if out is not None else (res if res.shape == plan.y_shape else res.reshape(plan.y_shape))
        more = ()
        shaped = (first,)
    if not with_ctx:
        return (shaped if len(spec.outputs) > 1 else first), None  # type: ignore[return-value]
    base = plan.ctx_base
    if not base:  # (the fields the plan's key fixes, made once)
        base.update({
            "op": spec.name, "x_shape": x_shape, "x_dtype": x.dtype, "axis": plan.axis,
            "param_shapes": plan.param_shapes, "input_dtypes": plan.input_dtypes,
            "array_family": plan.family or _registry.array_family(x),
            "y_shape": None if plan.y_shape == x_shape else plan.y_shape, "input_shapes": plan.input_shapes,
            "plan": plan,
        })  # fmt: skip
    values = base.copy()
    values["backend"], values["inner"], values["output_dtypes"] = name, inner, more
    if served:
        values["served"] = served
    ctx = filled(Context, values)
    if spec.result is not None:
        return spec.result(shaped, ctx, plan.options), ctx
    return (shaped if len(spec.outputs) > 1 else first), ctx


def _flat_arrays(spec: OpSpec, plan: _Plan, ins: tuple[Any, ...], ps: tuple[Any, ...]) -> list[Any]:
    """The inputs and parameters of a call ``plan`` holds for as the backend takes them (:attr:`_Plan.input_flat`,
    :attr:`_Plan.param_flat`)."""
    rows, h, norm = plan.rows, plan.h, plan.norm_shape
    flat = [
        a if a is None or a.shape == f else (a.reshape(f) if f is not None else _flat_input(si.kind, a, rows, h))
        for si, a, f in zip(spec.inputs, ins, plan.input_flat, strict=True)
    ]
    flat += [
        p if p is None or p.shape == f else (p.reshape(f) if f is not None else _flat_param(sp.kind, p, norm))
        for sp, p, f in zip(spec.params, ps, plan.param_flat, strict=True)
    ]
    return flat


def _served_target(spec: OpSpec, mod: Any, plan: _Plan) -> Any:
    """The runner of ``plan`` on the op module ``mod``, kept in :attr:`_Plan.targets`: the public-only options
    offered to backends (:attr:`pynorm.ops.Option.offered`) that ``mod`` serves itself (its
    ``serves_option(name, options)``, the plan's options; none for an op without it) join the options it binds
    (:func:`_target`) and are kept in :attr:`_Plan.served`."""
    ask = getattr(mod, "serves_option", None)
    served = tuple(
        o.name for o in spec.options
        if o.offered and ask is not None and plan.options.get(o.name) is not None and ask(o.name, plan.options)
    )  # fmt: skip
    if served:
        plan.served[mod] = served
    options = {**plan.to_backend, **{n: plan.options[n] for n in served}} if served else plan.to_backend
    run = plan.targets[mod] = _target(mod, options, plan.family is not None)
    return run


def _target(mod: Any, options: Mapping[str, Any], kept: bool = True) -> Any:
    """What runs ``options`` on the op module ``mod``, a callable ``run(x, *inputs_and_params, out=None)`` with
    the options bound: ``mod.forward_for(options)`` where the module has one (an implementation with policies
    composed around it names the one its options take, :class:`pynorm.composite.casting.Composed`; numba's
    statistics and element-wise ops a runner that keeps what the plan's first call found,
    :class:`pynorm.backends.numba._common.PlanForward`), else ``mod.forward`` with the options bound. It may
    depend on the options only: a plan keeps it for its module, and its key fixes everything else a runner may
    keep (dtypes, shapes, strides, writability, alignment).

    ``kept`` False (a plan made for one call: its arguments have no key, :func:`_plan_key`): ``mod.forward`` with
    the options bound, always. A runner that keeps what its first call finds makes that call dearer (numba's
    entry point is found by typing every argument once more: a DyT call, 1 x 4096, with a list for ``alpha``
    took 101 us with it, 56 without)."""
    pick = getattr(mod, "forward_for", None) if kept else None
    return functools.partial(mod.forward, **options) if pick is None else pick(options)


def _to_channels(a: Array, axis: int) -> Array:
    """``a`` as a C-contiguous ``(N, C, S)`` array, the channel axis ``axis`` moved to 1 (a copy only where needed)."""
    if axis == 1 and type(a) is np.ndarray and a.flags.c_contiguous:  # (a reshape: a small call's microsecond)
        return a.reshape(_three(a.shape, 1))
    xp = xp_of(a)
    if axis != 1:
        a = xp.moveaxis(a, axis, 1)
    a = xp.ascontiguousarray(a)
    return a.reshape(_three(a.shape, 1))


def _three(shape: tuple[int, ...], axis: int) -> tuple[int, int, int]:
    """``(N, C, S)`` of an array of ``shape`` whose channel axis is ``axis`` (S counted, not inferred: an empty
    batch has one too)."""
    return shape[0], shape[axis], math.prod(d for i, d in enumerate(shape) if i not in (0, axis))


def _from_channels(a3: Array, shape: tuple[int, ...], axis: int) -> Array:
    """The inverse of :func:`_to_channels` for an array of ``shape``."""
    if axis == 1:
        return a3.reshape(shape)
    first = (shape[0], shape[axis], *(d for i, d in enumerate(shape) if i not in (0, axis)))
    a = a3.reshape(first)
    return xp_of(a).moveaxis(a, 1, axis)


def new_channel_plan(
    spec: OpSpec, x: Any, params: tuple[Any, ...], axis: Any, backend: str | None, out: Any,
    options: Mapping[str, Any], inputs: tuple[Any, ...], keyed: bool,
) -> tuple[Any, Any, tuple[Any, ...], tuple[Any, ...], Any]:  # fmt: skip
    """:func:`new_plan` for an op of the ``"channels"`` layout (``axis`` unused: its channel axis is an option):
    its :class:`_ChannelPlan`."""
    x = as_array(x, "x")
    check_float_dtype(x, "x", spec.x_dtypes)
    if x.ndim < 2:
        raise ShapeError(f"x must have at least 2 dimensions, (N, C, *spatial), got shape {tuple(x.shape)}")
    opts = spec.validate(options)
    ax = opts["channel_axis"] % x.ndim
    c = int(x.shape[ax])
    if c == 0:
        raise ShapeError(f"x has no channels (shape {tuple(x.shape)}, channel axis {opts['channel_axis']})")
    if spec.check is not None:
        spec.check(opts, c)
    ins = tuple(check_input(si, a, x, ax) for si, a in zip(spec.inputs, inputs, strict=True))
    ps = tuple(check_param(sp, p, x, ax, {}) for sp, p in zip(spec.params, params, strict=True))
    first = (x.shape[0], c, *(d for i, d in enumerate(x.shape) if i not in (0, ax)))
    arrays = dict(zip((*spec.input_names, *spec.param_names), (*ins, *ps), strict=True))
    if spec.check_arrays is not None:
        spec.check_arrays(first, 1, {"x": x, **arrays}, opts)
    present = tuple(a for a in (x, *ins, *ps) if a is not None)
    out = check_out(out, "out", x, present, tuple(x.shape), x.dtype)
    plan = _ChannelPlan(
        tuple(x.shape), ax, c, opts, {k: opts[k] for k in spec.backend_options},
        tuple(n for n, a in zip(("x", *arrays), (x, *ins, *ps), strict=True) if a is not None),
        tuple(None if p is None else tuple(p.shape) for p in ps),
        _value_checks(spec), ("numpy", "ndarray") if keyed else None,
    )  # fmt: skip
    return plan, x, ins, ps, out


@dataclass(frozen=True)
class _ChannelPlan:
    """:class:`_Plan` for an op of the ``"channels"`` layout: what the checks of one call shape established."""

    x_shape: tuple[int, ...]
    axis: int  # the channel axis (non-negative)
    channels: int
    options: dict[str, Any]
    to_backend: dict[str, Any]
    present_names: tuple[str, ...]
    param_shapes: tuple[tuple[int, ...] | None, ...]
    value_checks: tuple[tuple[int, Any], ...]  # as :attr:`_Plan.value_checks`
    family: tuple[str, str] | None  # as :attr:`_Plan.family`
    targets: dict[Any, Any] = field(default_factory=dict)  # as :attr:`_Plan.targets`
    #: per op module, the runner of its calls for the outputs alone (:func:`channel_lean`; None: it has none)
    calls: dict[Any, Any] = field(default_factory=dict)
    ctx_base: dict[str, Any] = field(default_factory=dict)  # as :attr:`_Plan.ctx_base`
    backs: dict[str, Any] = field(default_factory=dict)  # as :attr:`_Plan.backs` (:func:`_short_backward_channels`)


def _run_channels(
    spec: OpSpec, plan: _ChannelPlan, x: Array, ins: tuple[Any, ...], ps: tuple[Any, ...], out: Any,
    backend: str | None,
) -> tuple[Any, Context]:  # fmt: skip
    """:func:`_run` for an op of the ``"channels"`` layout."""
    if plan.family is not None:
        name, mod = _registry.resolve_family(spec.name, plan.family, plan.present_names, backend)
    else:
        present = tuple(a for a in (x, *ins, *ps) if a is not None)
        name, mod = _registry.resolve(spec.name, present, plan.present_names, backend)
    run = plan.targets.get(mod)
    if run is None:
        run = plan.targets[mod] = _target(mod, plan.to_backend, plan.family is not None)
    return execute_channels(spec, plan, name, run, x, ins, ps, out)


def execute_channels(
    spec: OpSpec, plan: _ChannelPlan, name: str, run: Any, x: Array, ins: tuple[Any, ...], ps: tuple[Any, ...],
    out: Any,
) -> tuple[Any, Context]:  # fmt: skip
    """:func:`execute` for an op of the ``"channels"`` layout."""
    ax, x_shape = plan.axis, plan.x_shape
    direct = out is not None and ax == 1
    res, inner = run(_to_channels(x, ax), *ins, *ps, out=out.reshape(_three(x_shape, ax)) if direct else None)
    outs = res if isinstance(res, tuple) else (res,)
    y = out if direct else _from_channels(outs[0], x_shape, ax)
    if out is not None and not direct:
        out[...] = y
        y = out
    base = plan.ctx_base
    if not base:  # (the fields the plan's key fixes, made once)
        base.update({
            "op": spec.name, "x_shape": x_shape, "x_dtype": x.dtype, "axis": ax, "param_shapes": plan.param_shapes,
            "input_dtypes": (), "output_dtypes": (), "array_family": plan.family or _registry.array_family(x),
            "y_shape": None, "input_shapes": (), "plan": plan,
        })  # fmt: skip
    values = base.copy()
    values["backend"], values["inner"] = name, inner
    ctx = filled(Context, values)
    shaped = (y, *outs[1:])
    if spec.result is not None:
        return spec.result(shaped, ctx, plan.options), ctx
    return shaped[0], ctx


def channel_lean(plan: _ChannelPlan, mod: Any) -> Any:
    """The runner of ``plan``'s calls for the outputs alone on the op module ``mod`` (an op of the ``"channels"``
    layout without a result function), kept in the plan: ``run(x, *inputs_and_params, out=None)`` -> the
    outputs, no ctx -- the module's ``lean_for(options)`` (numba's :meth:`ChannelOp.lean_for
    <pynorm.backends.numba.stats.ChannelOp.lean_for>`: it keeps what the plan's first call finds), else its
    ``forward_lean`` with the options bound; None where it has neither (then the full path)."""
    try:
        return plan.calls[mod]
    except KeyError:
        pass
    make, lean = getattr(mod, "lean_for", None), getattr(mod, "forward_lean", None)
    run = make(plan.to_backend) if make is not None else None
    if run is None and lean is not None:
        run = functools.partial(lean, **plan.to_backend)
    plan.calls[mod] = run
    return run


def lean_channels(
    plan: _ChannelPlan, lean: Any, x: Array, ins: tuple[Any, ...], ps: tuple[Any, ...], out: Any
) -> Any:  # fmt: skip
    """The result of an op of the ``"channels"`` layout without a result function, through its runner ``lean``
    (:func:`channel_lean`; :func:`execute_channels`' outputs, no ctx): a :func:`call` with a kept plan, a
    :class:`pynorm.Plan`'s call."""
    ax, x_shape = plan.axis, plan.x_shape
    direct = out is not None and ax == 1
    res = lean(_to_channels(x, ax), *ins, *ps, out=out.reshape(_three(x_shape, ax)) if direct else None)
    first = res[0] if isinstance(res, tuple) else res
    y = out if direct else _from_channels(first, x_shape, ax)
    if out is not None and not direct:
        out[...] = y
        y = out
    return (y, *res[1:]) if isinstance(res, tuple) else y


def _backward_channels(spec: OpSpec, dy: Array, ctx: Context, dx_out: Any) -> Any:
    """:func:`backward` for an op of the ``"channels"`` layout (``dy`` checked already)."""
    if dx_out is not None:  # (it must overlap no array the ctx holds: walking them costs microseconds)
        dx_out = check_out(dx_out, "dx_out", dy, (dy, *ctx_arrays(ctx.inner)), ctx.x_shape)
    direct = dx_out is not None and ctx.axis == 1
    mod = _registry.op_module(ctx.backend, spec.name)
    three = _three(ctx.x_shape, ctx.axis)
    grads = mod.backward(_to_channels(dy, ctx.axis), ctx.inner, dx_out=dx_out.reshape(three) if direct else None)
    dx = dx_out if direct else _from_channels(grads[0], ctx.x_shape, ctx.axis)
    if dx_out is not None and not direct:
        dx_out[...] = dx
        dx = dx_out
    return spec.grads(dx, *grads[1:])


def backward(spec: OpSpec, dy: Any, ctx: Any, dx_out: Any, upstream: Mapping[str, Any] | None = None) -> Any:
    """Validate and run ``spec``'s backward on the forward's backend; ``spec.grads(dx, d<input>..., d<param>...)``.

    ``upstream`` maps ``d<output>`` for each output after the first to its gradient (or None). Where the forward
    read arguments through DLPack, each gradient comes back as its argument's own type
    (:attr:`Context.returners`; ``dx_out`` as the object given).
    """
    grads = _backward(spec, dy, ctx, dx_out, upstream)
    back = ctx.returners
    if back is None:
        return grads
    return spec.grads(*(
        dx_out if (i == 0 and dx_out is not None) else (g if b is None else b(g))
        for i, (g, b) in enumerate(zip(grads, back, strict=True))
    ))  # fmt: skip


#: the array family of NumPy arrays (:attr:`Context.array_family`)
_NUMPY = ("numpy", "ndarray")


def _short_backward(spec: OpSpec, plan: _Plan, backend: str) -> Any:
    """``back(dy, ctx)``: the backward of a ctx that ``plan``'s call shape made on ``backend`` (:attr:`Context.plan`)
    and a ``dy`` of that shape as a numpy array, with no DLPack argument, upstream gradient or ``dx_out``: straight
    to the backend's backward, without the checks and reshaping of :func:`_backward` that the plan's shapes answer
    -- the same call with the same arrays, so the same bits. It returns None for a ``dy`` it leaves to
    :func:`_backward` (whose checks name what is wrong); False where the plan has none (an output of another shape
    than ``x``, or parameter gradients that need reshaping to their parameters' shapes).

    What it skips (LayerNorm 1 x 1024 float32 on numba, one process, alternating rounds): 26.5 -> 14.0 us a
    backward with the backend's general backward (12.3 of them, its kernel 2.6); with numba's kept backward
    (``StatsOp.backward_for``) 24.4 -> 8.4 us against the previous stop (docs/backends.md)."""
    base = plan.ctx_base
    if base.get("y_shape") is not None or any(
        s is not None and s != f for s, f in zip(plan.param_shapes, plan.param_flat, strict=True)
    ):  # fmt: skip
        return False
    x_shape = base["x_shape"]
    dt = spec.grad_dtype(base["x_dtype"])
    rows_h = (plan.rows, plan.h)
    mod = _registry.op_module(backend, spec.name)
    pick = getattr(mod, "backward_for", None)  # (a backward that keeps what the plan's calls fix, where one exists)
    run, grads_of = (mod.backward if pick is None else pick(plan.to_backend)), spec.grads
    none = {f"d{o}": None for o in spec.outputs[1:]}  # (no upstream gradient: None for each, as _backward passes)
    in_shapes = plan.input_shapes
    n_in = len(in_shapes)

    def back(dy: Any, ctx: Any) -> Any:
        if dy.shape != x_shape or dy.dtype != dt or ctx.returners is not None:
            return None
        flat = dy.shape == rows_h
        g = run(dy if flat else dy.reshape(rows_h), ctx.inner, **none)
        if flat and not n_in and type(g) is grads_of:
            return g
        return grads_of(
            g[0] if flat else g[0].reshape(x_shape),
            *(d.reshape(s) for d, s in zip(g[1 : 1 + n_in], in_shapes, strict=True)),
            *g[1 + n_in :],
        )  # fmt: skip

    return back


def _short_backward_channels(spec: OpSpec, plan: _ChannelPlan, backend: str) -> Any:
    """:func:`_short_backward` for an op of the ``"channels"`` layout: ``back(dy, ctx)`` runs the backend's backward
    (its ``backward_for(options)`` where it has one) on ``dy`` in the ``(N, C, S)`` layout, as
    :func:`_backward_channels` does without ``dx_out``, past the checks the plan's shape answers; None for a ``dy``
    it leaves to :func:`_backward`."""
    x_shape, ax = plan.x_shape, plan.axis
    dt = spec.grad_dtype(plan.ctx_base["x_dtype"])
    mod = _registry.op_module(backend, spec.name)
    pick = getattr(mod, "backward_for", None)
    run, grads_of = (mod.backward if pick is None else pick(plan.to_backend)), spec.grads
    three = _three(x_shape, ax)

    def back(dy: Any, ctx: Any) -> Any:
        if dy.shape != x_shape or dy.dtype != dt or ctx.returners is not None:
            return None
        plain = ax == 1 and dy.flags.c_contiguous  # (then the layout is a reshape)
        g = run(dy.reshape(three) if plain else _to_channels(dy, ax), ctx.inner)
        dx = g[0].reshape(x_shape) if ax == 1 else _from_channels(g[0], x_shape, ax)
        return grads_of(dx, *g[1:])

    return back


def _backward(spec: OpSpec, dy: Any, ctx: Any, dx_out: Any, upstream: Mapping[str, Any] | None) -> Any:
    op = spec.name
    if not isinstance(ctx, Context):
        raise ContextError(f"ctx must be the Context returned by {op}_forward, got {type(ctx).__name__}")
    if ctx.op != op:
        raise ContextError(f"ctx was produced by {ctx.op}_forward and cannot be used by {op}_backward")
    plan = ctx.plan
    if (
        plan is not None
        and dx_out is None
        and type(dy) is np.ndarray
        and ctx.array_family == _NUMPY  # (a CuPy forward's dy of another type: the general path names the mix)
        and not (upstream and any(g is not None for g in upstream.values()))
    ):
        back = plan.backs.get(ctx.backend)
        if back is None:
            make = _short_backward_channels if spec.layout == "channels" else _short_backward
            back = plan.backs[ctx.backend] = make(spec, plan, ctx.backend)
        if back:
            grads = back(dy, ctx)
            if grads is not None:
                return grads
    dy = as_array(dy, "dy")
    if _registry.array_family(dy) != ctx.array_family:
        fam = _registry.array_family(dy)
        raise ArrayTypeError(
            f"arrays of different types cannot be mixed: x is {ctx.array_family[0]}.{ctx.array_family[1]} "
            f"but dy is {fam[0]}.{fam[1]}"
        )
    if ctx.y_shape is None and tuple(dy.shape) != ctx.x_shape:
        raise ShapeError(f"dy has shape {tuple(dy.shape)}, expected the shape of x, {ctx.x_shape}")
    if ctx.y_shape is not None and tuple(dy.shape) != ctx.y_shape:
        raise ShapeError(f"dy has shape {tuple(dy.shape)}, expected the shape of the output, {ctx.y_shape}")
    want_dt = spec.grad_dtype(ctx.x_dtype)
    if dy.dtype != want_dt:
        what = "the dtype of x, " if want_dt == ctx.x_dtype else ""
        more = "" if want_dt == ctx.x_dtype else f" (for x of dtype {ctx.x_dtype})"
        raise DTypeError(f"dy has dtype {dy.dtype}, expected {what}{want_dt}{more}")
    if spec.layout == "channels":
        return _backward_channels(spec, dy, ctx, dx_out)
    rows, h = ctx.rows, ctx.hidden
    y_shape = ctx.x_shape if ctx.y_shape is None else ctx.y_shape
    y_h = math.prod(y_shape[ctx.axis :])
    extra: dict[str, Any] = {}
    for oname, odt in zip(spec.outputs[1:], ctx.output_dtypes, strict=True):
        g = (upstream or {}).get(f"d{oname}")
        if g is not None:
            g = as_array(g, f"d{oname}")
            _registry.family_of((dy, g), ("dy", f"d{oname}"))
            if tuple(g.shape) != ctx.x_shape or g.dtype != odt:
                raise ShapeError(
                    f"d{oname} must have the shape {ctx.x_shape} and dtype {odt} of {oname}, "
                    f"got shape {tuple(g.shape)} and dtype {g.dtype}"
                )
            g = g.reshape(rows, h)
        extra[f"d{oname}"] = g
    if dx_out is not None:  # (it must overlap no array the ctx holds: walking them costs microseconds)
        dx_out = check_out(
            dx_out, "dx_out", dy, (dy, *ctx_arrays(ctx.inner), *(g for g in extra.values() if g is not None)),
            ctx.x_shape,
        )  # fmt: skip
    mod = _registry.op_module(ctx.backend, op)
    grads = mod.backward(
        dy.reshape(rows, y_h), ctx.inner, dx_out=None if dx_out is None else dx_out.reshape(rows, h), **extra
    )
    dx = dx_out if dx_out is not None else grads[0].reshape(ctx.x_shape)
    n_in = len(ctx.input_shapes)  # (the differentiable inputs')
    d_inputs = [g.reshape(s) for g, s in zip(grads[1 : 1 + n_in], ctx.input_shapes, strict=True)]
    norm_shape = ctx.x_shape[ctx.axis :]
    d_params = [
        g
        if g is None or g.shape == s  # (a gradient already in its parameter's shape: a small call's microseconds)
        else (_unflat_feature_grad(g, s, norm_shape, xp_of(dy)) if sp.kind == "feature" else g.reshape(s))
        for sp, g, s in zip(spec.params, grads[1 + n_in :], ctx.param_shapes, strict=True)
    ]
    return spec.grads(dx, *d_inputs, *d_params)
