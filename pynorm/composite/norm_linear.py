"""Fused LayerNorm / RMSNorm + Linear on any backend that has the plain norm.

Forward: ``n, norm_ctx = norm(x)`` on the chosen backend, ``out = n @ W.T + c`` in the arrays' module (in
float32, float64 when an operand is float64), rounded to ``x``'s dtype. The ctx is the norm's ctx (``x``,
its parameters, per-row statistics), ``W`` and ``c``: ``n`` is not kept. Backward recomputes ``n`` with the
norm's forward on the ctx's ``x`` (the kernels are deterministic: the same ``n``, bit for bit), then
``dn = dout @ W (+ dn)``, the norm's backward of ``dn`` on the kept ctx, ``dW = dout.T @ n``,
``dc = sum dout``.

For 16-bit ``x`` the norm runs on a float32 copy of ``x`` (kept in the ctx instead of ``x``), so that
``dn`` reaches the norm's backward without a rounding to 16 bits; ``n`` is rounded to ``x``'s dtype
before the product, as the definition says.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from .. import _registry
from ..ops.norm_linear import LayerNormLinearCtx, LayerNormLinearGrads, RMSNormLinearCtx, RMSNormLinearGrads
from . import compute_dtype, ieee, norm_backward, widened

__all__ = ["bind"]


class _Op(NamedTuple):
    forward: Any
    backward: Any


def _product(n: Any, W: Any, c: Any, out: Any) -> Any:
    cd = compute_dtype(n, W, c)
    y = n.astype(cd, copy=False) @ W.astype(cd, copy=False).T
    if c is not None:
        y += c.astype(cd, copy=False)
    if out is not None:
        out[...] = y
        return out
    return y if y.dtype == n.dtype else y.astype(n.dtype)


def _make(backend: str, norm_op: str, n_params: int, ctx_type: type, grads_type: type) -> _Op:
    def norm_impl() -> Any:
        return _registry.op_module(backend, norm_op)

    def forward(x: Any, *args: Any, out: Any = None, **options: Any) -> tuple[tuple[Any, Any], Any]:
        params, (W, c) = args[:n_params], args[n_params:]
        xin = widened(x)
        n, norm = norm_impl().forward(xin, *params, **options)
        if n.dtype != x.dtype:
            n = n.astype(x.dtype)
        return (_product(n, W, c, out), n), ctx_type(norm, W, c)

    def backward(dy: Any, ctx: Any, *, dx_out: Any = None, dn: Any = None) -> Any:
        impl = norm_impl()
        nc = ctx.norm
        x = nc.x
        params = tuple(getattr(nc, f) for f in (("weight", "bias") if n_params == 2 else ("weight",)))
        options = {f: getattr(nc, f) for f in ("eps", "correction", "eps_mode", "weight_offset") if hasattr(nc, f)}
        n, _ = impl.forward(x, *params, **options)  # recomputed: the ctx holds x and the statistics, not n
        if n.dtype != dy.dtype:
            n = n.astype(dy.dtype)
        W, c = ctx.W, ctx.c
        cd = compute_dtype(dy, W, c, x)
        dyc = dy.astype(cd, copy=False)
        dnt = dyc @ W.astype(cd, copy=False)
        if dn is not None:
            dnt += dn.astype(cd, copy=False)
        dW = (dyc.T @ n.astype(cd, copy=False)).astype(W.dtype, copy=False)
        dc = dyc.sum(axis=0).astype(c.dtype, copy=False) if c is not None else None
        del n, dyc
        g, dx = norm_backward(impl, dnt, nc, x.dtype, dy.dtype, dx_out)
        return grads_type(dx, *g[1:], dW, dc)

    return _Op(ieee(forward), ieee(backward))


def bind(op: str, backend: str) -> _Op:
    """``op``'s forward/backward running the plain norm of ``backend``."""
    if op == "layer_norm_linear":
        return _make(backend, "layer_norm", 2, LayerNormLinearCtx, LayerNormLinearGrads)
    if op == "rms_norm_linear":
        return _make(backend, "rms_norm", 1, RMSNormLinearCtx, RMSNormLinearGrads)
    raise KeyError(op)
