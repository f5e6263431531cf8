"""Conditional LayerNorm / RMSNorm on any backend that has the modality norms.

The per-row affine parameters ``[gamma, beta] = cond W^T + c`` are a parameter table of ``G`` rows (one
per cond row) and the row ids ``g(i) = i // (R / G)``: the modality LayerNorm / RMSNorm of the chosen
backend computes ``y`` (``zero_centered`` is its ``weight_offset = 1``) and, in backward, ``dx`` and the
per-cond-row sums ``dgamma_g = sum dy xhat``, ``dbeta_g = sum dy`` -- the reduction over the broadcast
axis is the table's scatter. ``dcond = dP W``, ``dW = dP^T cond``, ``dc = sum dP`` are products in the
arrays' module. The products are computed in float32 (float64 when an operand is float64).

The modality RMSNorm has no bias: ``conditional_rms_norm`` with ``shift=True`` adds ``beta`` after it;
for 16-bit ``x`` it then runs the norm on a float32 copy of ``x`` (kept in the ctx) so that ``y`` is
rounded once to ``x``'s dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from .. import _registry
from ..ops.conditional_norm import ConditionalLayerNormGrads, ConditionalRMSNormGrads
from . import compute_dtype, ieee, norm_backward, widened, xp_of

__all__ = ["ConditionalNormCtx", "bind"]


@dataclass(frozen=True, eq=False)
class ConditionalNormCtx:
    """The composite's ctx: the modality norm's ctx (``x``, the ids, the ``gamma``/``beta`` tables, the
    per-row statistics), ``cond``, ``W``, ``c``, the options. ``x_dtype``: the dtype of ``x`` and ``dy``."""

    norm: Any
    cond: Any
    W: Any
    c: Any
    shift: bool
    zero_centered: bool
    x_dtype: Any


class _Op(NamedTuple):
    forward: Any
    backward: Any


def _tables(cond: Any, W: Any, c: Any, h: int, k: int, cd: Any) -> tuple[Any, Any]:
    xp = xp_of(cond)
    g = cond.shape[0]
    if g == 0:  # no rows: a table needs a row; nothing reads it
        z = xp.zeros((1, h), dtype=cd)
        return z, (z.copy() if k == 2 else None)
    p = cond.astype(cd) @ W.astype(cd).T
    if c is not None:
        p = p + c.astype(cd)
    gamma = xp.ascontiguousarray(p[:, :h])
    beta = xp.ascontiguousarray(p[:, h:]) if k == 2 else None
    return gamma, beta


def _ids(xp: Any, rows: int, groups: int) -> Any:
    if groups == 0:
        return xp.zeros((0,), dtype=np.int64)
    return xp.arange(rows, dtype=np.int64) // (rows // groups)


def _param_grads(ctx: ConditionalNormCtx, dp: Any, cd: Any) -> tuple[Any, Any, Any]:
    xp = xp_of(dp)
    g = ctx.cond.shape[0]
    dp = dp[:g]
    dcond = (dp @ ctx.W.astype(cd)).astype(ctx.cond.dtype)
    dW = (dp.T @ ctx.cond.astype(cd)).astype(ctx.W.dtype) if g else xp.zeros(ctx.W.shape, dtype=ctx.W.dtype)
    dc = None
    if ctx.c is not None:
        dc = dp.sum(axis=0).astype(ctx.c.dtype) if g else xp.zeros(ctx.c.shape, dtype=ctx.c.dtype)
    return dcond, dW, dc


def _block_sums(a: Any, groups: int, cd: Any) -> Any:
    """Sums of ``a``'s rows over each cond row's block, ``(G, H)`` in ``cd``."""
    r, h = a.shape
    return a.astype(cd).reshape(groups, r // groups, h).sum(axis=1)


def _layer(backend: str) -> _Op:
    def forward(
        x: Any, cond: Any, W: Any, c: Any, *, eps: float, correction: int, eps_mode: str, zero_centered: bool,
        out: Any = None,
    ) -> tuple[Any, ConditionalNormCtx]:  # fmt: skip
        xp = xp_of(x)
        r, h = x.shape
        cd = compute_dtype(x, cond, W, c)
        gamma, beta = _tables(cond, W, c, h, 2, cd)
        ids = _ids(xp, r, cond.shape[0])
        impl = _registry.op_module(backend, "modality_layer_norm")
        y, norm = impl.forward(
            x, ids, gamma, beta, eps=eps, correction=correction, eps_mode=eps_mode,
            weight_offset=1.0 if zero_centered else 0.0, out=out,
        )  # fmt: skip
        return y, ConditionalNormCtx(norm, cond, W, c, True, bool(zero_centered), x.dtype)

    def backward(dy: Any, ctx: ConditionalNormCtx, *, dx_out: Any = None) -> ConditionalLayerNormGrads:
        impl = _registry.op_module(backend, "modality_layer_norm")
        g = impl.backward(dy, ctx.norm, dx_out=dx_out)
        cd = g.dweight.dtype
        xp = xp_of(dy)
        h = dy.shape[1]
        dp = xp.empty((g.dweight.shape[0], 2 * h), dtype=cd)
        dp[:, :h] = g.dweight
        dp[:, h:] = g.dbias
        return ConditionalLayerNormGrads(g.dx, *_param_grads(ctx, dp, cd))

    return _Op(ieee(forward), ieee(backward))


def _rms(backend: str) -> _Op:
    def forward(
        x: Any, cond: Any, W: Any, c: Any, *, eps: float, shift: bool, zero_centered: bool, out: Any = None
    ) -> tuple[Any, ConditionalNormCtx]:
        xp = xp_of(x)
        r, h = x.shape
        groups = cond.shape[0]
        cd = compute_dtype(x, cond, W, c)
        gamma, beta = _tables(cond, W, c, h, 2 if shift else 1, cd)
        ids = _ids(xp, r, groups)
        impl = _registry.op_module(backend, "modality_rms_norm")
        offset = 1.0 if zero_centered else 0.0
        if not shift:
            y, norm = impl.forward(x, ids, gamma, eps=eps, weight_offset=offset, out=out)
            return y, ConditionalNormCtx(norm, cond, W, c, False, bool(zero_centered), x.dtype)
        xin = widened(x)  # y' + beta rounded once to x's dtype
        y1, norm = impl.forward(xin, ids, gamma, eps=eps, weight_offset=offset)
        if groups:
            y1 = (y1.astype(cd).reshape(groups, r // groups, h) + beta[:, None, :]).reshape(r, h)
        y = y1 if y1.dtype == x.dtype else y1.astype(x.dtype)
        if out is not None:
            out[...] = y
            y = out
        return y, ConditionalNormCtx(norm, cond, W, c, True, bool(zero_centered), x.dtype)

    def backward(dy: Any, ctx: ConditionalNormCtx, *, dx_out: Any = None) -> ConditionalRMSNormGrads:
        impl = _registry.op_module(backend, "modality_rms_norm")
        xp = xp_of(dy)
        _r, h = dy.shape
        groups = ctx.cond.shape[0]
        g, dx = norm_backward(impl, dy, ctx.norm, ctx.norm.x.dtype, dy.dtype, dx_out)
        cd = g.dweight.dtype
        dp = xp.zeros((g.dweight.shape[0], (2 if ctx.shift else 1) * h), dtype=cd)
        dp[:, :h] = g.dweight
        if ctx.shift and groups:
            dp[:groups, h:] = _block_sums(dy, groups, cd)
        return ConditionalRMSNormGrads(dx, *_param_grads(ctx, dp, cd))

    return _Op(ieee(forward), ieee(backward))


def bind(op: str, backend: str) -> _Op:
    """``op``'s forward/backward running the modality norms of ``backend``."""
    return {"conditional_layer_norm": _layer, "conditional_rms_norm": _rms}[op](backend)
