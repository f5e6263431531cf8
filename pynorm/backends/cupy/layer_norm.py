"""LayerNorm on the GPU: host launchers of ``kernels/layer_norm.cu``, mirroring
:mod:`pynorm.reference.layer_norm` function by function.

Same signatures, same :class:`~pynorm.reference.layer_norm.LayerNormCtx` and
:class:`~pynorm.reference.layer_norm.LayerNormGrads` (holding CuPy arrays), same math (see
the reference module's docstring). Differences from the reference, by design:

* statistics are accumulated in float32 (float64 when x or a parameter is float64), with
  the corrected two-pass mean and exact power-of-two row scaling, instead of the
  reference's float64 / extended working precision; ``ctx.mean``/``ctx.rstd`` have that
  accumulation dtype;
* ``ctx.x`` is the C-contiguous input the kernels read (``x`` itself when it already was);
* dweight/dbias are summed per block, then across blocks in a fixed order: results are
  bitwise reproducible run to run on the same device and launch configuration.
"""

from __future__ import annotations

from typing import Any

import cupy
import numpy as np

from ...errors import ContextError
from ...reference.layer_norm import LayerNormCtx, LayerNormGrads
from . import _host, _launch
from ._loader import get_kernel

__all__ = ["LayerNormCtx", "LayerNormGrads", "backward", "forward"]

_FILE = "layer_norm.cu"


def forward(
    x: cupy.ndarray,
    weight: cupy.ndarray | None,
    bias: cupy.ndarray | None,
    *,
    eps: float,
    correction: int = 0,
    eps_mode: str = "var",
    weight_offset: float = 0.0,
    out: cupy.ndarray | None = None,
) -> tuple[cupy.ndarray, LayerNormCtx]:
    """LayerNorm forward of the ``(R, H)`` array ``x``; returns ``(y, ctx)`` (see the reference)."""
    _launch.check_forward_args(
        x,
        {"weight": weight, "bias": bias},
        eps=eps,
        correction=correction,
        eps_mode=eps_mode,
        weight_offset=weight_offset,
        out=out,
    )
    plan = _launch.type_plan(x.dtype, _dtype(weight), _dtype(bias))
    x = _host.contiguous(x)
    rows, hidden = (int(d) for d in x.shape)
    w = _host.prepare_param(weight, plan.acc if plan.cast_weight else None)
    b = _host.prepare_param(bias, plan.acc if plan.cast_bias else None)
    y = out if out is not None else _host.empty((rows, hidden), x.dtype)
    mean = cupy.empty(rows, dtype=plan.acc_dtype)
    rstd = cupy.empty(rows, dtype=plan.acc_dtype)
    if rows:
        k = get_kernel(_FILE, "layer_norm_fwd", (plan.T, plan.W))
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
        args = (
            x,
            _host.ptr_or_null(w),
            _host.ptr_or_null(b),
            y,
            mean,
            rstd,
            np.int64(rows),
            np.int32(hidden),
            np.float64(eps),
            np.int32(correction),
            np.int32(eps_mode == "std"),
            np.float64(weight_offset),
            np.int32(cfg.log2g),
            np.int32(cfg.vec),
            np.int32(cfg.over_smem > 0),
        )
        _host.launch(k, cfg.grid, cfg.block, args, cfg.over_smem)
    ctx = LayerNormCtx(x, weight, bias, mean, rstd, float(eps), int(correction), eps_mode, float(weight_offset))
    return y, ctx


def backward(dy: cupy.ndarray, ctx: LayerNormCtx, *, dx_out: cupy.ndarray | None = None) -> LayerNormGrads:
    """LayerNorm backward: gradients of a scalar loss given ``dy = dL/dy`` (see the reference)."""
    _launch.check_backward_args(dy, ctx, LayerNormCtx, dx_out=dx_out)
    x, weight, bias = ctx.x, ctx.weight, ctx.bias
    plan = _launch.type_plan(x.dtype, _dtype(weight), _dtype(bias))
    if ctx.mean.dtype != np.dtype(plan.acc_dtype):
        raise ContextError("ctx was not produced by the cupy backend's layer_norm forward")
    x = _host.contiguous(x)
    dy = _host.contiguous(dy)
    rows, hidden = (int(d) for d in x.shape)
    w = _host.prepare_param(weight, plan.acc if plan.cast_weight else None)
    dx = dx_out if dx_out is not None else _host.empty((rows, hidden), x.dtype)
    itemsize = x.dtype.itemsize
    vec = _launch.can_vectorize(hidden, itemsize, (x.data.ptr, dy.data.ptr, dx.data.ptr))
    limits = _host.device_limits()
    std_mode = np.int32(ctx.eps_mode == "std")
    partials = 0
    part_w = part_b = None
    if rows:
        kind = _launch.backward_kind(hidden, itemsize, plan.acc_itemsize, _host.forced("BACKWARD"))
        types = (plan.T, plan.W)
        if kind == "fused":
            k = get_kernel(_FILE, "layer_norm_bwd", types)
            cfg = _launch.backward_config(
                rows, hidden, itemsize, plan.acc_itemsize, vec, limits, kind, k.num_regs, k.shared_size_bytes
            )
            partials = cfg.partials
            part_w, part_b = _partials(weight, bias, partials, hidden, plan)
            rc = cfg.rows
            args = (
                dy,
                x,
                _host.ptr_or_null(w),
                ctx.mean,
                ctx.rstd,
                dx,
                _host.ptr_or_null(part_w),
                _host.ptr_or_null(part_b),
                np.int64(rows),
                np.int32(hidden),
                np.int32(ctx.correction),
                std_mode,
                np.float64(ctx.weight_offset),
                np.int32(rc.log2g),
                np.int32(rc.vec),
            )
            _host.launch(k, rc.grid, rc.block, args)
        else:
            ks = get_kernel(_FILE, "layer_norm_bwd_stats", types)
            ka = get_kernel(_FILE, "layer_norm_bwd_apply", types)
            cfg = _launch.backward_config(
                rows, hidden, itemsize, plan.acc_itemsize, vec, limits, kind, ks.num_regs, ks.shared_size_bytes
            )
            coefs = cupy.empty((rows, 3), dtype=plan.acc_dtype)
            rc = cfg.rows
            _host.launch(
                ks,
                rc.grid,
                rc.block,
                (
                    dy,
                    x,
                    _host.ptr_or_null(w),
                    ctx.mean,
                    ctx.rstd,
                    coefs,
                    np.int64(rows),
                    np.int32(hidden),
                    np.int32(ctx.correction),
                    std_mode,
                    np.float64(ctx.weight_offset),
                    np.int32(rc.log2g),
                    np.int32(rc.vec),
                ),
            )
            partials = cfg.partials
            part_w, part_b = _partials(weight, bias, partials, hidden, plan)
            _host.launch(
                ka,
                (cfg.chunks, cfg.tiles),
                cfg.apply_block,
                (
                    dy,
                    x,
                    _host.ptr_or_null(w),
                    ctx.mean,
                    ctx.rstd,
                    coefs,
                    dx,
                    _host.ptr_or_null(part_w),
                    _host.ptr_or_null(part_b),
                    np.int64(rows),
                    np.int32(hidden),
                    np.int64(cfg.rows_per_chunk),
                    np.float64(ctx.weight_offset),
                    np.int32(rc.vec),
                ),
            )
    dweight = _host.reduce_partials(part_w, partials, hidden, weight.dtype, plan.acc) if weight is not None else None
    dbias = _host.reduce_partials(part_b, partials, hidden, bias.dtype, plan.acc) if bias is not None else None
    return LayerNormGrads(dx, dweight, dbias)


def _dtype(a: Any) -> Any:
    return None if a is None else a.dtype


def _partials(
    weight: Any, bias: Any, partials: int, hidden: int, plan: _launch.TypePlan
) -> tuple[cupy.ndarray | None, cupy.ndarray | None]:
    def make(p: Any) -> cupy.ndarray | None:
        return cupy.empty((partials, hidden), dtype=plan.acc_dtype) if p is not None else None

    return make(weight), make(bias)
