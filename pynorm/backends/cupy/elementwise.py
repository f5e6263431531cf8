"""The element-wise family on the GPU: host launchers of ``kernels/elementwise.cu`` for every op of the family.

:data:`OP_IMPLS` maps each op of :data:`pynorm.ops.SPECS` whose family is ``"elementwise"`` (the
signed-power PowerNorm, DyT, Derf) to an :class:`ElementwiseOp`: ``forward(x2d, *params, out=None, **options)
-> (y, ctx)`` and ``backward(dy2d, ctx, dx_out=None) -> grads``, with the ctx dataclass and gradient
tuple of the op's spec (the reference's) holding CuPy arrays. The op's function is the kernels'
``Fn`` policy (:func:`._loader.variant_args`); its learnable scalars, if any, are the parameters
named ``alpha`` and ``shift``, and ``p`` the option of that name (0 otherwise).

Differences from the reference, by design: values are computed in float32 (float64 when x or a
parameter is float64; PowerNorm's ``pow`` in float64 for float32 data); parameter gradients are
summed per row chunk, then across chunks (and, for the scalar ``alpha``, across columns) in a fixed
order: bitwise reproducible.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import cupy

from ...errors import ContextError
from ...ops import OpSpec, Served
from ...ops.families import kernel_args
from .._spec import EW_SLOTS as _SLOTS
from .._spec import check_ew_slots
from . import _host, _launch
from ._args import EwBwdArgs, EwFwdArgs
from ._loader import FAMILY_FILES, get_kernel, supports, variant_args

__all__ = ["OP_IMPLS", "ElementwiseOp"]

_FILE = FAMILY_FILES["elementwise"]


class ElementwiseOp:
    """Forward and backward of one op of the element-wise family (see the module docstring)."""

    def __init__(self, spec: OpSpec) -> None:
        check_ew_slots(spec)
        self.spec = spec
        self.variant = variant_args(spec)
        self.ctx_fields = {f.name for f in fields(spec.ctx)}

    def _plan(self, x_dtype: Any, named: dict[str, Any]) -> _launch.TypePlan:
        return _launch.type_plan(x_dtype, *(None if named.get(n) is None else named[n].dtype for n in _SLOTS))

    def forward(self, x: cupy.ndarray, *params: Any, out: cupy.ndarray | None = None, **options: Any) -> Any:
        """Forward of the ``(R, H)`` array ``x``; returns ``(y, ctx)`` (see the reference module)."""
        rows, hidden = _launch.check_input(x)
        named = dict(zip(self.spec.param_names, params, strict=True))
        options = {**self.spec.defaults(), **options}
        plan = self._plan(x.dtype, named)
        x = _host.contiguous(x)
        a, sh, w, b = (
            _host.prepare_param(named.get(n), plan.acc if c else None) for n, c in zip(_SLOTS, plan.casts, strict=True)
        )
        y = out if out is not None else _host.empty((rows, hidden), x.dtype)
        if rows:
            k = get_kernel(_FILE, "ew_fwd", (plan.T, plan.W, *self.variant))
            chunks, tiles, rpc = _launch.chunk_grid(rows, hidden, x.dtype.itemsize, _host.device_limits())
            vec = _launch.can_vectorize(hidden, x.dtype.itemsize, (x.data.ptr, y.data.ptr))
            args = EwFwdArgs(x, a, sh, w, b, y, rows, hidden, rpc, kernel_args(self.spec, options).constant, vec)
            _host.launch(k, (chunks, tiles), _launch.DEFS["APPLY_THREADS"], args.pack())
        values = {"x": x, **named, **options}
        return y, self.spec.ctx(**{n: values[n] for n in self.ctx_fields})

    def backward(self, dy: cupy.ndarray, ctx: Any, *, dx_out: cupy.ndarray | None = None) -> Any:
        """Backward: gradients of a scalar loss given ``dy = dL/dy`` (see the reference module)."""
        if not issubclass(type(ctx), self.spec.ctx):  # (no isinstance: mypy would narrow ctx to object)
            raise ContextError(
                f"ctx must be the {self.spec.ctx.__name__} returned by forward, got {type(ctx).__name__}"
            )
        named = {n: getattr(ctx, n) for n in self.spec.param_names}
        plan = self._plan(ctx.x.dtype, named)
        x = _host.contiguous(ctx.x)
        dy = _host.contiguous(dy)
        rows, hidden = (int(d) for d in x.shape)
        a, sh, w, _ = (
            _host.prepare_param(named.get(n), plan.acc if c else None) for n, c in zip(_SLOTS, plan.casts, strict=True)
        )
        dx = dx_out if dx_out is not None else _host.empty((rows, hidden), x.dtype)

        def part(n: str) -> Any:
            return cupy.empty((chunks, hidden), dtype=plan.acc_dtype) if named.get(n) is not None else None

        chunks = 0
        parts: dict[str, Any] = {n: None for n in _SLOTS}
        if rows:
            k = get_kernel(_FILE, "ew_bwd", (plan.T, plan.W, *self.variant))
            chunks, tiles, rpc = _launch.chunk_grid(rows, hidden, x.dtype.itemsize, _host.device_limits())
            parts = {n: part(n) for n in _SLOTS}
            vec = _launch.can_vectorize(hidden, x.dtype.itemsize, (x.data.ptr, dy.data.ptr, dx.data.ptr))
            args = EwBwdArgs(
                dy, x, a, sh, w, dx, parts["weight"], parts["bias"], parts["alpha"], parts["shift"], rows, hidden, rpc,
                kernel_args(self.spec, ctx).constant, vec,
            )  # fmt: skip
            _host.launch(k, (chunks, tiles), _launch.DEFS["APPLY_THREADS"], args.pack())
        grads: dict[str, Any] = {}
        for n in self.spec.param_names:
            p = named[n]
            if p is None:
                grads[n] = None
            elif n in ("alpha", "shift"):
                grads[n] = _host.reduce_scalar(parts[n], chunks, hidden, p.dtype, plan.acc)
            else:
                grads[n] = _host.reduce_partials(parts[n], chunks, hidden, p.dtype, plan.acc)
        return self.spec.grads(dx, *(grads[n] for n in self.spec.param_names))


#: op name -> its implementation, for every op of the element-wise family
OP_IMPLS: Served[ElementwiseOp] = Served(lambda spec: spec.family == "elementwise" and supports(spec), ElementwiseOp)
