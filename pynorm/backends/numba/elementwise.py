"""The element-wise family on the ``numba`` backend: every op of :data:`pynorm.ops.SPECS` whose family is
``"elementwise"`` (the signed-power PowerNorm, DyT, Derf).

:data:`OP_IMPLS` maps each such op to an :class:`ElementwiseOp`: ``forward(x2d, *params, out=None, **options)
-> (y, ctx)`` and ``backward(dy2d, ctx, dx_out=None) -> grads``, with the reference module's contract
(``spec.ctx``, ``spec.grads``). The spec's variant names the function (:mod:`._ew_kernels`); its scalar
is the option ``p`` or the ``"scalar"`` parameter ``alpha`` (with Derf's ``shift``, the pair), and the per-feature
``weight``/``bias`` are the affine after it. Nothing here is specific to one op.

Forward: ``y = w * f(x) + b`` in one parallel pass (:func:`._ew_kernels.ew_fwd`). Backward: ``dx`` and
per-block partial sums of ``dy f(x)``, ``dy`` and the scalar's terms in one pass
(:func:`._ew_kernels.ew_bwd`), summed over blocks in float64 in a fixed order (the scalar's over
every column too, correctly rounded: :func:`._common.column_total`), each gradient rounded once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import fields
from typing import Any, NamedTuple

import numpy as np

from ..._dtypes import finfo, round_to
from ...ops import OpSpec, Served
from ...ops._spec import filled
from ...ops.families import function_of, kernel_args
from .._spec import EW_SLOTS as _SLOTS
from .._spec import check_ew_slots
from . import _common as common
from . import _ew_kernels as kernels
from . import _paths, _threads
from ._layout import EW_TILE, blocks, tiles
from ._threads import launch
from ._variant import function

__all__ = ["OP_IMPLS", "ElementwiseOp"]


def _fast(dtype: Any) -> bool:
    """Whether inputs of ``dtype`` take the vectorizable float32 math (float32, float16, bfloat16)."""
    return np.dtype(dtype).itemsize <= 4


def _row_param(p: Any, pdt: np.dtype[Any]) -> Any:
    """A parameter as :func:`._ew_kernels.ew_row` reads it: a 16-bit one in its storage form (read exactly; half the
    bytes in cache beside the rows of a fused kernel), else in ``pdt``."""
    if p is not None and np.dtype(p.dtype).itemsize == 2:
        return common.storage(p)
    return common.param(p, pdt)


def _fmath(dtype: Any) -> np.dtype[Any]:
    """The function math type for inputs of ``dtype`` (see :mod:`._ew_kernels`)."""
    return np.dtype(np.float32) if np.dtype(dtype).itemsize == 2 else np.dtype(np.float64)


class _Setup(NamedTuple):
    """What one forward of an :class:`ElementwiseOp` reads of its options and ``x``'s dtype alone."""

    fmath: np.dtype[Any]  # the function's math type (:func:`_fmath`)
    param_dtype: np.dtype[Any]  # the affine's parameters' type
    tag: Any  # the function's tag (:meth:`ElementwiseOp._tag`)
    constant: float | None  # the function's constant where it is an option (None: a scalar parameter's value)
    ctx_static: dict[str, Any]  # the ctx fields of the options


class ElementwiseOp:
    """One op of the element-wise family on this backend (see the module doc)."""

    def __init__(self, spec: OpSpec) -> None:
        check_ew_slots(spec)
        self.spec = spec
        self.name = spec.name
        self.function = function_of(spec)  # the function's record (pynorm.ops.families)
        self.kind = self.function.numba
        self.fn = function(self.kind)
        self._fields = tuple(f.name for f in fields(spec.ctx))
        self._options = spec.defaults()
        self._backward_setups: dict[Any, tuple[_Setup, float]] = {}  # by the ctx's options and x's dtype
        self._ctx_options = common.ctx_options(spec)  # (:meth:`_backward_setup`'s key)

    def __repr__(self) -> str:
        return f"<numba element-wise op {self.name!r} (function {self.fn.choice!r})>"

    def _tag(self, p: float, dtype: Any) -> Any:
        """The function's tag: flag ``fast`` for float32 and half storage (the vectorizable math of
        :mod:`._vmath`; float64 keeps libm); a function whose constant is an option (the signed power's ``p``)
        has the ``exponent`` flag, which specializes p = 1/2, 1, 2."""
        fast = _fast(dtype)
        if not self.function.option:
            return function(self.kind, fast=fast)
        return function(self.kind, exponent={0.5: "half", 1.0: "one", 2.0: "two"}.get(p, "any"), fast=fast)

    def _scalar(self, named: dict[str, Any], source: Any) -> Any:
        """The function's constant: its scalar parameter's value (a pair for a function with two, Derf's ``(alpha,
        shift)``), or its option's (:func:`kernel_args`)."""
        if self.function.scalar:
            v = tuple(float(np.asarray(named[n], dtype=np.float64).reshape(-1)[0]) for n in self.function.scalars)
            return v if len(v) > 1 else v[0]
        return float(kernel_args(self.spec, source).constant)

    def _setup(self, o: dict[str, Any], dtype: Any) -> _Setup:
        """What a forward reads of its options (all of them, the defaults filled in) and ``x``'s dtype alone."""
        fast = _fast(dtype)
        fdt = _fmath(dtype)
        static = {f: o[f] for f in self._fields if f in o}
        a = None
        if self.function.option:
            a = float(kernel_args(self.spec, o).constant)
            static[self.function.option] = a
        return _Setup(fdt, np.dtype(np.float32) if fast else fdt, self._tag(0.0 if a is None else a, dtype), a, static)

    def _backward_setup(self, ctx: Any, dtype: Any) -> tuple[_Setup, float]:
        """The :meth:`_setup` of a ctx's options and ``x``'s dtype, and the dtype's largest finite value, kept for
        the next ctx with the same ones (``numpy.finfo`` and the options' reading cost microseconds a call)."""

        def compute() -> tuple[_Setup, float]:
            o = {**self._options, **{k: getattr(ctx, k) for k in self._options if hasattr(ctx, k)}}
            return self._setup(o, dtype), float(finfo(dtype).max)

        return common.cached(self._backward_setups, (self._ctx_options(ctx), dtype), compute)  # type: ignore[no-any-return]

    def forward_for(self, options: Any) -> common.PlanForward:
        """The forward a plan runs its calls through (:func:`pynorm._dispatch._target`): a
        :class:`._common.PlanForward` of its own (the setup, and the kernel's entry point)."""
        return common.PlanForward(self, options)

    def forward(self, x: np.ndarray, *params: Any, out: np.ndarray | None = None, **options: Any) -> tuple[Any, Any]:
        """Forward of the ``(R, H)`` array ``x``; returns ``(y, ctx)`` (``y`` is ``out`` if given)."""
        return self.forward_setup(x, params, out, None, options)

    def forward_setup(
        self, x: np.ndarray, params: tuple[Any, ...], out: np.ndarray | None, sink: None,
        options: dict[str, Any] | common.PlanForward,
    ) -> tuple[Any, Any]:  # fmt: skip
        """:meth:`forward` for ``options``, or a plan's calls (``options`` its :class:`._common.PlanForward`, which
        keeps the setup and the kernel's entry point)."""
        if isinstance(options, common.PlanForward):
            plan, given, st = options, options.options, options.setup
        else:
            plan, given, st = None, options, None
        if st is None:
            if len(params) != len(self.spec.params):
                raise TypeError(f"{self.name} forward() takes x and {len(self.spec.params)} parameter(s)")
            unknown = set(given) - set(self._options)
            if unknown:
                raise TypeError(f"{self.name} forward() got unexpected keyword argument(s) {sorted(unknown)}")
            st = self._setup({**self._options, **given}, x.dtype)
            if plan is not None:
                plan.setup = st
        named = dict(zip(self.spec.param_names, params, strict=True))
        rows, h = x.shape
        y = common.output(out, x.shape, x.dtype)
        if rows:
            pdt = st.param_dtype
            w, b = _row_param(named.get("weight"), pdt), _row_param(named.get("bias"), pdt)
            a = st.constant if st.constant is not None else self._scalar(named, None)
            launch(
                kernels.ew_fwd, rows * h, rows * tiles(h, EW_TILE), st.tag, common.storage(x), a, w, b,
                common.storage(y), memo=None if plan is None else plan.entry,
            )  # fmt: skip
        if plan is not None and not plan.ctx:
            return y, None
        return y, self._ctx(st, named, x)

    def _ctx(self, st: _Setup, named: Any, x: np.ndarray) -> Any:
        """The ctx of a forward with setup ``st``: its static fields, the parameters (``named``: pairs of name and
        array) and ``x``."""
        values = st.ctx_static.copy()
        values.update(named)
        values["x"] = x
        return filled(self.spec.ctx, {f: values[f] for f in self._fields})

    def fast_forward(self, plan: common.PlanForward, shape: tuple[int, int], ctx: bool = False) -> Any:
        """A plan's shortest call for ``(R, H)`` arrays of ``shape`` (:meth:`.stats.StatsOp.fast_forward`'s
        counterpart): ``run(x, *params, out=None)`` -> ``y`` (with ``ctx``: :meth:`forward`'s ``(y, ctx)``), the
        kernel's entry point called directly with
        :meth:`forward_setup`'s arguments (the same bits), or None where the plan's calls take the pool or a test
        switch of :mod:`._paths` is on (then ``run`` returns None too, for the general path)."""
        rows, h = shape
        st, memo = plan.setup, plan.entry
        if st is None or memo.entry is None or not rows or rows * h >= _threads.serial_threshold() or _paths.switched():
            return None
        entry, tag, pdt, const, names = memo.entry, st.tag, st.param_dtype, st.constant, self.spec.param_names
        iw, ib = (names.index(n) if n in names else None for n in ("weight", "bias"))
        tasks, scalar, output, storage = rows * tiles(h, EW_TILE), self._scalar, common.output, common.storage

        def run(x: np.ndarray, *params: Any, out: np.ndarray | None = None) -> Any:
            if _paths.switched() or (out is not None and not out.flags.aligned):  # (see PlanForward)
                return None
            y = output(out, shape, x.dtype)
            w = _row_param(None if iw is None else params[iw], pdt)
            b = _row_param(None if ib is None else params[ib], pdt)
            a = const if const is not None else scalar(dict(zip(names, params, strict=True)), None)
            entry(tag, storage(x), a, w, b, storage(y), 0, tasks)
            if ctx:
                return y, self._ctx(st, zip(names, params, strict=True), x)
            return y

        return run

    def sink(
        self, shape: tuple[int, int], dtype: Any, weight: Any, bias: Any, *, out: np.ndarray | None = None,
        **options: Any,
    ) -> tuple[tuple[Any, ...], np.ndarray]:  # fmt: skip
        """``(sink, y)``: this op's forward as the statistics kernels' epilogue (:mod:`._io`'s element-wise sink) --
        each normalized row ``q`` (of ``dtype``) becomes ``y = w f(q) + b``, written into ``y`` (``out`` if given),
        with the forward's arithmetic (:func:`._ew_kernels.ew_row`). For a function whose constant is an option
        (its scalar parameters are not taken here); the casting policies' identity is ``p = 1``."""
        o = {**self._options, **options}
        a = float(kernel_args(self.spec, o).constant)
        pdt = np.dtype(np.float32) if _fast(dtype) else _fmath(dtype)
        y = common.output(out, shape, dtype)
        w, b = _row_param(weight, pdt), _row_param(bias, pdt)
        return (self._tag(a, dtype), a, w, b, common.storage(y)), y

    def source(
        self, x_dtype: Any, shape: tuple[int, int], weight: Any, bias: Any, **options: Any
    ) -> tuple[tuple[Any, ...], tuple[Any, Any], Callable[[], tuple[Any, Any]]]:
        """``(source, partials, grads)``: this op's backward as the upstream of a statistics kernel's backward
        (:func:`._stats_kernels.bwd_cast`) -- of each row ``q`` (of ``x_dtype``, the norm's forward row) it writes
        ``g = w f'(q) dy`` and adds ``dy f(q)``, ``dy`` to the block partials ``partials`` (:meth:`backward`'s
        arithmetic and layout: :func:`._ew_kernels.ew_bwd_row`); ``grads()`` then gives ``(dweight, dbias)`` (None
        where the parameter is None). For a function whose constant is an option (the casting policies' identity
        is ``p = 1``)."""
        o = {**self._options, **options}
        a = float(kernel_args(self.spec, o).constant)
        fdt = _fmath(x_dtype)
        pdt = np.dtype(np.float32) if _fast(x_dtype) else fdt  # G = w dy of float32 math in float32
        nb, h = blocks(shape[0]), shape[1]
        pw = common.scratch((nb, h), fdt) if weight is not None else None
        pb = common.scratch((nb, h), fdt) if bias is not None else None
        src = (self._tag(a, x_dtype), a, common.param(weight, pdt), float(finfo(x_dtype).max))

        def grads() -> tuple[Any, Any]:
            return tuple(  # type: ignore[return-value]
                None if p is None or part is None else common.reduce_blocks(part, p.dtype)
                for p, part in ((weight, pw), (bias, pb))
            )

        return src, (pw, pb), grads

    def backward(self, dy: np.ndarray, ctx: Any, dx_out: np.ndarray | None = None) -> Any:
        """Backward: gradients of a scalar loss given ``dy = dL/dy`` (shape ``(R, H)``)."""
        x = ctx.x
        named = {n: getattr(ctx, n) for n in self.spec.param_names}
        rows, h = x.shape
        st, fmax = self._backward_setup(ctx, x.dtype)
        fdt = st.fmath
        nb = blocks(rows)
        parts = {n: (common.scratch((nb, h), fdt) if named.get(n) is not None else None) for n in _SLOTS}
        pair = None  # the two scalars' terms in one partial of two rows per block (Derf)
        if len(self.function.scalars) == 2:
            parts["alpha"] = pair = common.scratch((nb, 2, h), fdt)
        dx = common.output(dx_out, x.shape, x.dtype)
        if rows:
            a = st.constant if st.constant is not None else self._scalar(named, None)
            pdt = st.param_dtype  # G = w dy of float32 math in float32
            launch(
                kernels.ew_bwd, rows * h, nb * tiles(h, EW_TILE), st.tag, common.storage(x),
                common.storage(dy), a, common.param(named.get("weight"), pdt), fmax, common.storage(dx),
                parts["weight"], parts["bias"], parts["alpha"],
            )  # fmt: skip
        if pair is not None:
            parts["alpha"], parts["shift"] = (np.ascontiguousarray(pair[:, k]) for k in (0, 1))
        grads: list[Any] = []
        for n in self.spec.param_names:
            p, part = named[n], parts[n]
            if p is None or part is None:
                grads.append(None)
            elif n in self.function.scalars:
                total = common.column_total(common.reduce_blocks(part, np.float64))
                grads.append(round_to(np.asarray([total]), p.dtype).reshape(p.shape))
            else:
                grads.append(common.reduce_blocks(part, p.dtype))
        return self.spec.grads(dx, *grads)


def _serves(spec: OpSpec) -> bool:
    from . import OPS

    return OPS.get(spec.name) == __name__.rpartition(".")[2]


#: op name -> its implementation (read by :func:`pynorm._registry.op_module`)
OP_IMPLS: Served[ElementwiseOp] = Served(_serves, ElementwiseOp)
