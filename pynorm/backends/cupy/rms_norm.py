"""RMSNorm on the GPU: host launchers of ``kernels/rms_norm.cu``, mirroring
:mod:`pynorm.reference.rms_norm` function by function.

Same signatures, :class:`~pynorm.reference.rms_norm.RMSNormCtx` and
:class:`~pynorm.reference.rms_norm.RMSNormGrads` (holding CuPy arrays), same math. As in
:mod:`.layer_norm`: float32 accumulation (float64 with a float64 operand) with exact
power-of-two row scaling, ``ctx.rstd`` in that dtype, ``ctx.x`` the C-contiguous input,
and dweight reduced in a fixed order (bitwise reproducible).
"""

from __future__ import annotations

from typing import Any

import cupy
import numpy as np

from ...errors import ContextError
from ...reference.rms_norm import RMSNormCtx, RMSNormGrads
from . import _host, _launch
from ._loader import get_kernel

__all__ = ["RMSNormCtx", "RMSNormGrads", "backward", "forward"]

_FILE = "rms_norm.cu"


def forward(
    x: cupy.ndarray,
    weight: cupy.ndarray | None,
    *,
    eps: float,
    weight_offset: float = 0.0,
    out: cupy.ndarray | None = None,
) -> tuple[cupy.ndarray, RMSNormCtx]:
    """RMSNorm forward of the ``(R, H)`` array ``x``; returns ``(y, ctx)`` (see the reference)."""
    _launch.check_forward_args(x, {"weight": weight}, eps=eps, weight_offset=weight_offset, out=out)
    plan = _launch.type_plan(x.dtype, _dtype(weight))
    x = _host.contiguous(x)
    rows, hidden = (int(d) for d in x.shape)
    w = _host.prepare_param(weight, None)
    y = out if out is not None else _host.empty((rows, hidden), x.dtype)
    rstd = cupy.empty(rows, dtype=plan.acc_dtype)
    if rows:
        k = get_kernel(_FILE, "rms_norm_fwd", (plan.T, plan.W))
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
            y,
            rstd,
            np.int64(rows),
            np.int32(hidden),
            np.float64(eps),
            np.float64(weight_offset),
            np.int32(cfg.log2g),
            np.int32(cfg.vec),
            np.int32(cfg.over_smem > 0),
        )
        _host.launch(k, cfg.grid, cfg.block, args, cfg.over_smem)
    return y, RMSNormCtx(x, weight, rstd, float(eps), float(weight_offset))


def backward(dy: cupy.ndarray, ctx: RMSNormCtx, *, dx_out: cupy.ndarray | None = None) -> RMSNormGrads:
    """RMSNorm backward: gradients of a scalar loss given ``dy = dL/dy`` (see the reference)."""
    _launch.check_backward_args(dy, ctx, RMSNormCtx, dx_out=dx_out)
    x, weight = ctx.x, ctx.weight
    plan = _launch.type_plan(x.dtype, _dtype(weight))
    if ctx.rstd.dtype != np.dtype(plan.acc_dtype):
        raise ContextError("ctx was not produced by the cupy backend's rms_norm forward")
    x = _host.contiguous(x)
    dy = _host.contiguous(dy)
    rows, hidden = (int(d) for d in x.shape)
    w = _host.prepare_param(weight, None)
    dx = dx_out if dx_out is not None else _host.empty((rows, hidden), x.dtype)
    itemsize = x.dtype.itemsize
    vec = _launch.can_vectorize(hidden, itemsize, (x.data.ptr, dy.data.ptr, dx.data.ptr))
    limits = _host.device_limits()
    partials = 0
    part_w = None
    if rows:
        kind = _launch.backward_kind(hidden, itemsize, plan.acc_itemsize, _host.forced("BACKWARD"))
        types = (plan.T, plan.W)
        if kind == "fused":
            k = get_kernel(_FILE, "rms_norm_bwd", types)
            cfg = _launch.backward_config(
                rows, hidden, itemsize, plan.acc_itemsize, vec, limits, kind, k.num_regs, k.shared_size_bytes
            )
            partials = cfg.partials
            part_w = cupy.empty((partials, hidden), dtype=plan.acc_dtype) if weight is not None else None
            rc = cfg.rows
            _host.launch(
                k,
                rc.grid,
                rc.block,
                (
                    dy,
                    x,
                    _host.ptr_or_null(w),
                    ctx.rstd,
                    dx,
                    _host.ptr_or_null(part_w),
                    np.int64(rows),
                    np.int32(hidden),
                    np.float64(ctx.weight_offset),
                    np.int32(rc.log2g),
                    np.int32(rc.vec),
                ),
            )
        else:
            ks = get_kernel(_FILE, "rms_norm_bwd_stats", types)
            ka = get_kernel(_FILE, "rms_norm_bwd_apply", types)
            cfg = _launch.backward_config(
                rows, hidden, itemsize, plan.acc_itemsize, vec, limits, kind, ks.num_regs, ks.shared_size_bytes
            )
            coefs = cupy.empty(rows, dtype=plan.acc_dtype)
            rc = cfg.rows
            _host.launch(
                ks,
                rc.grid,
                rc.block,
                (
                    dy,
                    x,
                    _host.ptr_or_null(w),
                    ctx.rstd,
                    coefs,
                    np.int64(rows),
                    np.int32(hidden),
                    np.float64(ctx.weight_offset),
                    np.int32(rc.log2g),
                    np.int32(rc.vec),
                ),
            )
            partials = cfg.partials
            part_w = cupy.empty((partials, hidden), dtype=plan.acc_dtype) if weight is not None else None
            _host.launch(
                ka,
                (cfg.chunks, cfg.tiles),
                cfg.apply_block,
                (
                    dy,
                    x,
                    _host.ptr_or_null(w),
                    ctx.rstd,
                    coefs,
                    dx,
                    _host.ptr_or_null(part_w),
                    np.int64(rows),
                    np.int32(hidden),
                    np.int64(cfg.rows_per_chunk),
                    np.float64(ctx.weight_offset),
                    np.int32(rc.vec),
                ),
            )
    dweight = _host.reduce_partials(part_w, partials, hidden, weight.dtype, plan.acc) if weight is not None else None
    return RMSNormGrads(dx, dweight)


def _dtype(a: Any) -> Any:
    return None if a is None else a.dtype
