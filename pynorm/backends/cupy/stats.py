"""The statistics family on the GPU: host launchers of ``kernels/stats.cu`` for every op of the family.

:data:`OP_IMPLS` maps each op of :data:`pynorm.ops.SPECS` whose family is ``"stats"`` to a
:class:`StatsOp`: ``forward(x2d, *params, out=None, **options) -> (y, ctx)`` and
``backward(dy2d, ctx, dx_out=None) -> grads``, with the ctx dataclass and gradient tuple of the op's
spec (the reference's) holding CuPy arrays. The op's variant (statistic, affine) picks the kernels'
policy template arguments (:func:`._loader.variant_args`); nothing here is specific to one op.

The kernels' parameter lists are mirrored by the dataclasses of :mod:`._args`; launches pass their
fields positionally. Differences from the reference, by design:

* statistics are accumulated in float32 (float64 when x or a parameter is float64), with exact
  power-of-two row scaling; ``ctx.mean``/``ctx.rstd`` have that accumulation dtype;
* ``ctx.x`` is the C-contiguous input the kernels read (``x`` itself when it already was);
* parameter gradients are summed per block, then across blocks in a fixed order: results are
  bitwise reproducible run to run on the same device and launch configuration.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import cupy
import numpy as np

from ...errors import ContextError
from ...ops import SPECS, OpSpec
from . import _host, _launch
from ._args import BwdApplyArgs, BwdArgs, BwdStatsArgs, FwdArgs
from ._loader import FAMILY_FILES, get_kernel, supports, variant_args

__all__ = ["OP_IMPLS", "StatsOp"]

_FILE = FAMILY_FILES["stats"]

# ---------------------------------------------------------------------------
# one op of the family


def _dtype(a: Any) -> Any:
    return None if a is None else a.dtype


class StatsOp:
    """Forward and backward of one op of the statistics family (see the module docstring)."""

    def __init__(self, spec: OpSpec) -> None:
        self.spec = spec
        self.variant = variant_args(spec)
        self.has_bias = "bias" in spec.param_names
        self.centered = getattr(spec.variant, "statistic", None) == "centered"
        self.ctx_fields = {f.name for f in fields(spec.ctx)}

    def _params(self, params: tuple[Any, ...]) -> tuple[Any, Any]:
        named = dict(zip(self.spec.param_names, params, strict=True))
        return named.get("weight"), named.get("bias")

    def forward(self, x: cupy.ndarray, *params: Any, out: cupy.ndarray | None = None, **options: Any) -> Any:
        """Forward of the ``(R, H)`` array ``x``; returns ``(y, ctx)`` (see the reference module)."""
        rows, hidden = _launch.check_input(x)
        weight, bias = self._params(params)
        options = {**self.spec.defaults(), **options}
        plan = _launch.type_plan(x.dtype, _dtype(weight), _dtype(bias))
        x = _host.contiguous(x)
        w = _host.prepare_param(weight, plan.acc if plan.cast_weight else None)
        b = _host.prepare_param(bias, plan.acc if plan.cast_bias else None)
        y = out if out is not None else _host.empty((rows, hidden), x.dtype)
        mean = cupy.empty(rows, dtype=plan.acc_dtype) if self.centered else None
        rstd = cupy.empty(rows, dtype=plan.acc_dtype)
        if rows:
            k = get_kernel(_FILE, "stats_fwd", (plan.T, plan.W, *self.variant))
            itemsize = x.dtype.itemsize
            cfg = _launch.forward_config(
                rows,
                hidden,
                itemsize,
                plan.acc_itemsize,
                _launch.can_vectorize(hidden, itemsize, (x.data.ptr, y.data.ptr)),
                _host.device_limits(),
                k.num_regs,
                k.shared_size_bytes,
                _host.forced("OVERFLOW"),
            )
            args = FwdArgs(
                x, w, b, y, mean, rstd, rows, hidden,
                options["eps"], options.get("correction", 0), options.get("eps_mode", "var") == "std",
                options.get("weight_offset", 0.0), cfg.log2g, cfg.vec, cfg.over_smem > 0,
            )  # fmt: skip
            _host.launch(k, cfg.grid, cfg.block, args.pack(), cfg.over_smem)
        values = {"x": x, "weight": weight, "bias": bias, "mean": mean, "rstd": rstd, **options}
        return y, self.spec.ctx(**{n: values[n] for n in self.ctx_fields})

    def backward(self, dy: cupy.ndarray, ctx: Any, *, dx_out: cupy.ndarray | None = None) -> Any:
        """Backward: gradients of a scalar loss given ``dy = dL/dy`` (see the reference module)."""
        if not issubclass(type(ctx), self.spec.ctx):  # (no isinstance: mypy would narrow ctx to object)
            raise ContextError(
                f"ctx must be the {self.spec.ctx.__name__} returned by forward, got {type(ctx).__name__}"
            )
        x, weight = ctx.x, ctx.weight
        bias = getattr(ctx, "bias", None)
        mean = getattr(ctx, "mean", None)
        plan = _launch.type_plan(x.dtype, _dtype(weight), _dtype(bias))
        if ctx.rstd.dtype != np.dtype(plan.acc_dtype):
            raise ContextError(f"ctx was not produced by the cupy backend's {self.spec.name} forward")
        x = _host.contiguous(x)
        dy = _host.contiguous(dy)
        rows, hidden = (int(d) for d in x.shape)
        correction = getattr(ctx, "correction", 0)
        std_mode = getattr(ctx, "eps_mode", "var") == "std"
        w = _host.prepare_param(weight, plan.acc if plan.cast_weight else None)
        dx = dx_out if dx_out is not None else _host.empty((rows, hidden), x.dtype)
        itemsize = x.dtype.itemsize
        vec = _launch.can_vectorize(hidden, itemsize, (x.data.ptr, dy.data.ptr, dx.data.ptr))
        limits = _host.device_limits()
        partials = 0
        part_w = part_b = None
        if rows:
            kind = _launch.backward_kind(hidden, itemsize, plan.acc_itemsize, _host.forced("BACKWARD"))
            types = (plan.T, plan.W, *self.variant)

            def make_partials(n: int) -> tuple[Any, Any]:
                def make(p: Any) -> Any:
                    return cupy.empty((n, hidden), dtype=plan.acc_dtype) if p is not None else None

                return make(weight), make(bias)

            if kind == "fused":
                k = get_kernel(_FILE, "stats_bwd", types)
                cfg = _launch.backward_config(
                    rows, hidden, itemsize, plan.acc_itemsize, vec, limits, kind, k.num_regs, k.shared_size_bytes
                )
                partials = cfg.partials
                part_w, part_b = make_partials(partials)
                rc = cfg.rows
                args = BwdArgs(
                    dy, x, w, mean, ctx.rstd, dx, part_w, part_b, rows, hidden, correction, std_mode,
                    ctx.weight_offset, rc.log2g, rc.vec,
                )  # fmt: skip
                _host.launch(k, rc.grid, rc.block, args.pack())
            else:
                ks = get_kernel(_FILE, "stats_bwd_stats", types)
                ka = get_kernel(_FILE, "stats_bwd_apply", types)
                cfg = _launch.backward_config(
                    rows, hidden, itemsize, plan.acc_itemsize, vec, limits, kind, ks.num_regs, ks.shared_size_bytes
                )
                coefs = cupy.empty((rows, 3), dtype=plan.acc_dtype)
                rc = cfg.rows
                sargs = BwdStatsArgs(
                    dy, x, w, mean, ctx.rstd, coefs, rows, hidden, correction, std_mode, ctx.weight_offset,
                    rc.log2g, rc.vec,
                )  # fmt: skip
                _host.launch(ks, rc.grid, rc.block, sargs.pack())
                partials = cfg.partials
                part_w, part_b = make_partials(partials)
                aargs = BwdApplyArgs(
                    dy, x, w, mean, ctx.rstd, coefs, dx, part_w, part_b, rows, hidden, cfg.rows_per_chunk,
                    ctx.weight_offset, rc.vec,
                )  # fmt: skip
                _host.launch(ka, (cfg.chunks, cfg.tiles), cfg.apply_block, aargs.pack())
        grads = {}
        for name, part, p in (("weight", part_w, weight), ("bias", part_b, bias)):
            if name in self.spec.param_names:
                grads[name] = (
                    _host.reduce_partials(part, partials, hidden, p.dtype, plan.acc) if p is not None else None
                )
        return self.spec.grads(dx, *(grads[n] for n in self.spec.param_names))


#: op name -> its implementation, for every op of the statistics family
OP_IMPLS: dict[str, StatsOp] = {name: StatsOp(spec) for name, spec in SPECS.items() if supports(spec)}
