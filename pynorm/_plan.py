"""Bound calls: :func:`plan` validates a call shape once and returns a :class:`Plan` whose calls do only the
per-call work.

A repeated call of ``pynorm.<op>`` already reuses what its first call established (:mod:`pynorm._dispatch` keeps a
plan per call shape, and a call for the result alone runs what a :class:`Plan`'s call runs), but it still builds and
looks up that shape's key and resolves the backend on every call: 8.2 us of a decode step's 1 x 4096 LayerNorm
(numba, Intel Xeon with AVX-512), where a :class:`Plan`'s call takes 5.0 and the row kernel's entry point 1.4. A
:class:`Plan` holds all of it -- the validated options, the flattening, the backend chosen when it was made and the
compiled kernel's entry point -- and each call checks only that its arrays are of the plan's kind (type, dtype,
shape, strides and flags, compared as one tuple) and what depends on the values (a parameter that must be finite,
``out`` overlapping an input).
"""

from __future__ import annotations

import inspect
from typing import Any

import numpy as np

from . import _dispatch, _registry
from ._validate import as_array, check_out
from .errors import ArrayTypeError, DTypeError, ShapeError, UnknownOpError
from .ops import SPECS, OpSpec

__all__ = ["Plan", "plan"]


def _kind(a: Any) -> Any:
    """What a plan fixes of an argument: None (absent), or an exact ``numpy.ndarray``'s dtype, shape, strides and
    flags (:attr:`numpy.ndarray.flags` ``.num``: contiguity, writability and alignment among them)."""
    if a is None:
        return None
    if type(a) is not np.ndarray:
        return type(a)
    return (a.dtype, a.shape, a.strides, a.flags.num)


def _describe(k: Any) -> str:
    if k is None:
        return "absent (None)"
    if not isinstance(k, tuple):
        return f"a {k.__module__}.{k.__qualname__}"
    dtype, shape, strides, flags = k
    layout = "C-contiguous" if flags & 1 else f"strides {strides}"
    return f"a {dtype} array of shape {shape}, {layout}{'' if flags & 0x400 else ', read-only'}"


class Plan:
    """One op's call shape, validated once (:func:`pynorm.plan`); calling it runs the op on arrays of that shape.

    ``p(x, *args, out=None)`` is ``pynorm.<op>(x, *args, <the plan's options>, out=out)``;
    ``p.forward(x, *args, out=None)`` is ``pynorm.<op>_forward`` (the result and its ctx); ``p.backward(dy, ctx,
    ...)`` is ``pynorm.<op>_backward``. ``args`` are the op's inputs and parameters in the order its forward takes
    them by position (keyword-only inputs by keyword), each present exactly where the plan's were. Results are
    bitwise those of the op's own functions.

    Each call checks that every array is of the plan's kind -- a ``numpy.ndarray`` of the same dtype, shape,
    strides and flags -- and raises :class:`~pynorm.errors.ShapeError` / :class:`~pynorm.errors.DTypeError` /
    :class:`~pynorm.errors.ArrayTypeError` naming the argument otherwise; values that must hold (a finite
    parameter, ``out`` overlapping no input) are checked on every call, as the op's own functions do. The backend
    is the one resolved when the plan was made (a later :func:`pynorm.use_backend` does not move it).

    Attributes
    ----------
    op : the op's name.
    backend : the backend the plan runs on.
    options : the op's options, validated (defaults filled in).
    """

    __slots__ = (
        "_by_position", "_calls", "_direct", "_kinds", "_lean", "_n_in", "_names", "_p", "_run", "_served", "_spec",
        "backend", "op", "options",
    )  # fmt: skip

    def __init__(self, spec: OpSpec, args: tuple[Any, ...], kw: dict[str, Any]) -> None:
        fwd = getattr(_public(), f"{spec.name}_forward")
        if "out" in kw:
            raise TypeError("pynorm.plan() takes no out=: pass it to each call of the plan")
        try:
            bound = inspect.signature(fwd).bind(*args, **kw)
        except TypeError as e:
            raise TypeError(f"pynorm.plan({spec.name!r}, ...): {e}") from None
        bound.apply_defaults()
        a = bound.arguments
        x = a["x"]
        inputs = tuple(a[i.name] for i in spec.inputs)
        params = tuple(a[p.name] for p in spec.params)
        options = {o.name: a[o.name] for o in spec.options}
        names = ("x", *spec.input_names, *spec.param_names)
        for name, arr in zip(names, (x, *inputs, *params), strict=True):
            if arr is not None and (type(arr) is not np.ndarray or not arr.dtype.isnative):
                raise ArrayTypeError(
                    f"pynorm.plan takes numpy.ndarray arguments of native byte order, got {name} of type "
                    f"{type(arr).__module__}.{type(arr).__qualname__}"
                    + (f" and dtype {arr.dtype}" if type(arr) is np.ndarray else "")
                    + f": call pynorm.{spec.name} on it directly"
                )  # fmt: skip
        self._spec, self.op, self._names = spec, spec.name, names
        self._n_in = len(spec.inputs)
        self._kinds = tuple(_kind(v) for v in (x, *inputs, *params))
        backend = a["backend"]
        make = _dispatch.new_channel_plan if spec.layout == "channels" else _dispatch.new_plan
        self._p, x, inputs, params, _ = make(spec, x, params, a.get("axis"), backend, None, options, inputs, True)
        self.options = dict(self._p.options)
        self.backend, mod = _registry.resolve_family(spec.name, ("numpy", "ndarray"), self._p.present_names, backend)
        self._run = (
            _dispatch._served_target(spec, mod, self._p)
            if spec.layout == "rows"
            else _dispatch._target(mod, self._p.to_backend)
        )
        self._served = self._p.served.get(mod, ()) if spec.layout == "rows" else ()
        # the outputs alone, without a ctx, where the result is the outputs or their quantized form: what a call of
        # pynorm.<op> with a kept plan runs (_dispatch.call)
        plain = spec.layout == "rows" and _dispatch.without_ctx(spec, self.options)
        self._calls = _dispatch.Calls(self._run, self.options.get("quantize"), self._served) if plain else None
        # (an op of the channels layout whose result is its outputs: the backend's runner without a ctx, if any)
        lean = spec.layout == "channels" and spec.result is None
        self._lean = _dispatch.channel_lean(self._p, mod) if lean else None
        # the plan's order (inputs, then parameters) is the forward's positional order unless an input is keyword-only
        self._by_position = not any(i.keyword for i in spec.inputs)
        #: the backend's shortest call, once a first call has made it (:meth:`_make_direct`)
        self._direct: Any = None

    def _arrays(
        self, x: Any, args: tuple[Any, ...], kw: dict[str, Any]
    ) -> tuple[Any, tuple[Any, ...], tuple[Any, ...]]:  # fmt: skip
        """``(x, inputs, params)`` of a call, checked against the plan's kinds."""
        spec = self._spec
        if kw or not self._by_position or len(args) != len(self._kinds) - 1:
            args = self._by_name(args, kw)
        given = (x, *args)
        kinds = self._kinds
        if tuple(map(_kind, given)) != kinds:
            self._mismatch(given)
        n = self._n_in
        ins, ps = tuple(args[:n]), tuple(args[n:])
        p = self._p
        _dispatch._recheck(spec, p, x, ins, ps, None, ())
        return x, ins, ps

    def _by_name(self, args: tuple[Any, ...], kw: dict[str, Any]) -> tuple[Any, ...]:
        """The call's inputs and parameters in the plan's order, from its positional and keyword arguments (the
        op's forward's rules: positional ones first, in order; optional ones may be left out, as None)."""
        names = self._names[1:]
        positional = [i.name for i in self._spec.inputs if not i.keyword] + list(self._spec.param_names)
        if len(args) > len(positional):
            raise TypeError(
                f"{self.op} plan takes at most {len(positional) + 1} positional arguments, got {len(args) + 1}"
            )
        got = dict(zip(positional, args, strict=False))
        for k, v in kw.items():
            if k not in names:
                raise TypeError(f"{self.op} plan got an unexpected keyword argument {k!r}")
            if k in got:
                raise TypeError(f"{self.op} plan got multiple values for argument {k!r}")
            got[k] = v
        return tuple(got.get(n) for n in names)

    def _mismatch(self, given: tuple[Any, ...]) -> None:
        for name, a, want in zip(self._names, given, self._kinds, strict=True):
            have = _kind(a)
            if have == want:
                continue
            what = f"{name}: this {self.op} plan was made for {_describe(want)}, got {_describe(have)}"
            hint = f"; make a plan for it (pynorm.plan({self.op!r}, ...)) or call pynorm.{self.op}"
            if a is not None and type(a) is not np.ndarray:
                raise ArrayTypeError(what + hint)
            if isinstance(have, tuple) and isinstance(want, tuple) and have[0] != want[0]:
                raise DTypeError(what + hint)
            raise ShapeError(what + hint)

    def _out(self, out: Any, x: Any, ins: tuple[Any, ...], ps: tuple[Any, ...]) -> Any:
        if out is None:
            return None
        p = self._p
        y_shape = p.x_shape if self._spec.layout == "channels" else p.y_shape
        out = as_array(out, "out")
        dt = self._spec.dtypes_of_outputs(x.dtype, p.options)[0]
        return check_out(out, "out", x, tuple(a for a in (x, *ins, *ps) if a is not None), y_shape, dt)

    def __call__(self, x: Any, *args: Any, out: Any = None, **kw: Any) -> Any:
        """``pynorm.<op>(x, *args, out=out)`` with the plan's options: the op's result, no ctx."""
        direct = self._direct
        if direct and not kw:
            y = direct(x, args, out)
            if y is not None:
                return y
        x, ins, ps = self._arrays(x, args, kw)
        out = self._out(out, x, ins, ps)
        calls = self._calls
        if calls is None:
            if self._lean is not None:
                return _dispatch.lean_channels(self._p, self._lean, x, ins, ps, out)
            return self._forward(x, ins, ps, out)[0]
        y = _dispatch.result_only(self._spec, self._p, self.backend, calls, x, ins, ps, out)
        if direct is None and calls.fast is not None:
            self._direct = self._make_direct(calls.fast)
        return y

    def _make_direct(self, fast: Any) -> Any:
        """``direct(x, args, out)``: a call by position through the backend's shortest call ``fast``
        (:attr:`pynorm._dispatch.Calls.fast`) with nothing in between, where it takes the arrays as they come
        (:attr:`~pynorm._dispatch.Calls.direct`: ``x`` and ``y`` of the plan's ``(R, H)``, the plan's inputs and
        parameters in its order); it returns None for a call it leaves to the general path (arrays not of the
        plan's kinds, which that path names; an ``out`` that is not an aligned, C-contiguous, writable numpy array
        of the result's shape and dtype overlapping no argument, whose errors that path names too; ``fast``
        declining). False where the plan has no such call. What it skips is the general path's argument
        handling (with the short forward's reused scratch, a 1 x 4096 LayerNorm's plan call 6.9 -> 5.0 us; a
        1 x 1024 one with ``out`` 8.6 -> 6.3 us)."""
        p, spec, kinds, n_in = self._p, self._spec, self._kinds, self._n_in
        if not (self._by_position and self._calls is not None and self._calls.direct):
            return False
        n_args, checks = len(kinds) - 1, p.value_checks
        y_shape = (p.rows, p.h)  # (the direct call's y: Calls.direct)
        y_dtype = spec.dtypes_of_outputs(self._kinds[0][0], p.options)[0]
        share = np.may_share_memory

        def direct(x: Any, args: tuple[Any, ...], out: Any = None) -> Any:
            if len(args) != n_args or tuple(map(_kind, (x, *args))) != kinds:
                return None
            if out is not None and not (
                type(out) is np.ndarray and out.shape == y_shape and out.dtype == y_dtype
                and out.flags.c_contiguous and out.flags.writeable and out.flags.aligned
                and not any(a is not None and share(out, a) for a in (x, *args))
            ):  # fmt: skip
                return None
            if checks:
                _dispatch._recheck(spec, p, x, args[:n_in], args[n_in:], None, ())
            return fast(x, *args) if out is None else fast(x, *args, out=out)

        return direct

    def forward(self, x: Any, *args: Any, out: Any = None, **kw: Any) -> tuple[Any, Any]:
        """``pynorm.<op>_forward(x, *args, out=out)`` with the plan's options: ``(result, ctx)``."""
        x, ins, ps = self._arrays(x, args, kw)
        return self._forward(x, ins, ps, self._out(out, x, ins, ps))

    def _forward(self, x: Any, ins: tuple[Any, ...], ps: tuple[Any, ...], out: Any) -> tuple[Any, Any]:
        if self._spec.layout == "channels":
            return _dispatch.execute_channels(self._spec, self._p, self.backend, self._run, x, ins, ps, out)
        return _dispatch.execute(self._spec, self._p, self.backend, self._run, x, ins, ps, out, self._served)

    def backward(self, dy: Any, ctx: Any, *, dx_out: Any = None, **upstream: Any) -> Any:
        """``pynorm.<op>_backward(dy, ctx, ..., dx_out=dx_out)``: the gradients (the op's own backward)."""
        return _dispatch.backward(self._spec, dy, ctx, dx_out, upstream)

    def __repr__(self) -> str:
        arrays = ", ".join(f"{n}={_describe(k)}" for n, k in zip(self._names, self._kinds, strict=True) if k)
        return f"<pynorm.Plan {self.op} on {self.backend}: {arrays}; options {self.options}>"


def _public() -> Any:
    from . import functional

    return functional


def plan(op: str, x: Any, *args: Any, **kwargs: Any) -> Plan:
    """A bound call of ``op``: validated once for arrays like ``x`` and ``args``, then called per step.

    ``pynorm.plan("layer_norm", x, weight, bias, eps=1e-5)`` takes what ``pynorm.layer_norm_forward`` takes
    (the arrays, the options, ``axis`` and ``backend``; no ``out``) and returns a :class:`Plan`. Its calls --
    ``p(x, weight, bias)`` for the result, ``p.forward(...)`` for the result and the ctx, ``p.backward(dy, ctx)``
    -- give the op's own results, bitwise, for arrays of the same dtype, shape, strides and flags as the plan's
    (:class:`Plan` says what is checked per call), and skip what a call of ``pynorm.<op>`` redoes every time: the
    call shape's key and lookup, the backend's resolution and, for ``p(...)``, the ctx. The arrays' values are read
    at each call, never kept: a parameter updated in place between calls is used as it then is.

    Parameters
    ----------
    op : an op's name (:func:`pynorm.list_ops`).
    x, *args, **kwargs : the arguments of ``pynorm.<op>_forward`` (numpy.ndarray arrays; no ``out``).

    Returns
    -------
    Plan

    Examples
    --------
    >>> import numpy as np, pynorm
    >>> x = np.ones((1, 4096), np.float32); w = np.ones(4096, np.float32); b = np.zeros(4096, np.float32)
    >>> ln = pynorm.plan("layer_norm", x, w, b, eps=1e-5)
    >>> y = ln(x, w, b)                       # each decode step
    >>> bool(np.array_equal(y, pynorm.layer_norm(x, w, b, eps=1e-5)))
    True
    """
    spec = SPECS.get(op) if isinstance(op, str) else None
    if spec is None:
        raise UnknownOpError(f"unknown op {op!r}; known ops: {', '.join(sorted(SPECS))}")
    return Plan(spec, (x, *args), kwargs)
