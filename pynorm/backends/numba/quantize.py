"""The quantize family on the ``numba`` backend: the quantization-friendly LayerNorm (``quant_layer_norm``).

* int8 input: :func:`._quant_kernels.quant_rows` on the int8 source -- exact integer row sums, the fixed
  float64 sequence of :mod:`pynorm.reference.quant_norm`, and the epilogue (float32 ``y``, or int8 ``q``
  with per-row / per-tensor / given scales) in one parallel pass per row (two for a per-tensor scale:
  the rows' ``amax``, then ``q``);
* float input: the statistics family's LayerNorm (:mod:`.stats`, so ``y`` is bitwise ``layer_norm``'s); when
  quantizing, its forward kernel with the quantize epilogue as its sink (:mod:`._io`: each row normalized into a
  scratch row and quantized from it, no ``y`` in memory; a per-tensor scale in two passes, the rows' ``amax``
  then ``q``), or -- for few wide rows, which take the split kernels -- ``y`` stored and then
  :func:`._quant_kernels.quant_rows` on it. Either way, the same bits;
* backward: straight-through (:func:`._quant_kernels.masked` where a given ``out_scale`` clipped), then the
  statistics family's LayerNorm backward at the real input (:func:`._quant_kernels.dequantize` for int8:
  ``float32(x * x_scale)``) with the forward's per-row statistics.

The per-tensor ``amax`` is the maximum of the rows' (exact and order-free), so every result here is
bitwise independent of the thread count, and for an int8 input bitwise equal to the reference's.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ...ops import Served
from ...ops.families import R_OUTSIDE, kernel_args
from ...ops.layer_norm import LayerNormCtx
from ...ops.quant_norm import QuantLayerNormCtx, QuantLayerNormGrads, quantizing
from ...reference.quant_norm import output_scale
from .._quant import QuantOpBase
from . import _common as common
from . import _quant_kernels as kernels
from ._threads import launch
from .stats import split_rows

__all__ = ["OP_IMPLS", "QuantOp"]

# the outputs an epilogue does not write (empty: one kernel signature per source type)
_Y0 = np.empty((0, 0), np.float32)
_Q0 = np.empty((0, 0), np.int8)
_S0 = np.empty(0, np.float32)
_A0 = np.empty(0)
_K0 = np.empty((0, 0), np.bool_)


class QuantOp(QuantOpBase):
    """``quant_layer_norm`` on this backend (see the module doc); the norm of a float input and every backward
    are the statistics family's op of the spec's statistic."""

    stats_module = "pynorm.backends.numba.stats"

    def forward(
        self, x: np.ndarray, x_scale: Any, weight: Any, bias: Any, *, out: Any = None, quantize: str | None = None,
        out_scale: float | None = None, **conventions: Any,
    ) -> tuple[Any, QuantLayerNormCtx]:  # fmt: skip
        """``y`` (or ``q``) and the ctx; ``conventions``: the statistic's options (read by :func:`kernel_args`)."""
        rows, h = x.shape
        kargs = kernel_args(self.spec, conventions)
        quant = quantizing(quantize, out_scale)
        xs = None
        result: Any
        scale: np.ndarray | None = None
        keep: np.ndarray | None = None
        if x_scale is None and quant and not split_rows(rows, common.storage(x)):
            # the norm's forward kernel with the quantize epilogue as its sink: no y in memory
            proto = np.empty(0, common.storage(x).dtype)
            stats: list[Any] = []

            def amax_pass(amax: np.ndarray) -> None:
                self.norm.forward(x, weight, bias, sink=(kernels.AMAX, 0.0, _Q0, _S0, amax, _K0, proto), **conventions)

            def codes_pass(mode: int, s_given: float, q: np.ndarray, srow: np.ndarray, keep: np.ndarray) -> None:
                _, lctx = self.norm.forward(x, weight, bias, sink=(mode, s_given, q, srow, _A0, keep, proto),
                                            **conventions)  # fmt: skip
                stats.extend((lctx.mean, lctx.rstd))

            result, scale, keep = self._quantize(rows, h, out, quantize, out_scale, amax_pass, codes_pass)
            mean, rstd = stats
        else:
            if x_scale is None:
                y, lctx = self.norm.forward(x, weight, bias, out=None if quant else out, **conventions)
                mean, rstd = lctx.mean, lctx.rstd
                src: Any = common.storage(y)
            else:
                xs = np.ascontiguousarray(x_scale, dtype=np.float64)
                mean, rstd = np.empty(rows), np.empty(rows)
                weff = _A0 if weight is None else weight.astype(np.float64) + np.float64(kargs.weight_offset)
                b64 = _A0 if bias is None else bias.astype(np.float64)
                src = (
                    np.ascontiguousarray(x), xs, weff, b64, weight is not None, bias is not None, kargs.eps,
                    kargs.correction, kargs.mode == R_OUTSIDE,
                )  # fmt: skip
            row_stats = (mean, rstd) if x_scale is not None else (_A0, _A0)
            work = rows * h

            def rows_pass(mode: int, s_given: float, y: Any, q: Any, srow: Any, amax: Any, keep: Any) -> None:
                launch(kernels.quant_rows, work, rows, src, mode, s_given, y, q, srow, amax, keep, *row_stats)

            if not quant and x_scale is None:
                result = y
            elif not quant:
                result = common.output(out, (rows, h), np.float32)
                rows_pass(kernels.FLOAT, 0.0, result, _Q0, _S0, _A0, _K0)
            else:
                result, scale, keep = self._quantize(
                    rows, h, out, quantize, out_scale, lambda amax: rows_pass(kernels.AMAX, 0.0, _Y0, _Q0, _S0, amax,
                                                                              _K0),
                    lambda mode, s_given, q, srow, kp: rows_pass(mode, s_given, _Y0, q, srow, _A0, kp),
                )  # fmt: skip
        arrays = dict(x=x, x_scale=xs, weight=weight, bias=bias, mean=mean, rstd=rstd, scale=scale, keep=keep)
        return result, self._ctx(conventions, kargs, arrays, quantize=quantize, out_scale=out_scale)

    @staticmethod
    def _quantize(
        rows: int, h: int, out: Any, quantize: str | None, out_scale: float | None, amax_pass: Any, codes_pass: Any
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """The int8 epilogue's passes over the rows, by output mode: ``(q, scale, keep)``. ``amax_pass(amax)``
        writes the rows' ``max |y|``; ``codes_pass(mode, s_given, q, srow, keep)`` the codes (:data:`ROW`: and the
        rows' scales; :data:`GIVEN`: with ``s_given``, and ``keep`` where it has rows)."""
        q = common.output(out, (rows, h), np.int8)
        keep = None
        if out_scale is not None or quantize == "tensor":
            if out_scale is not None:
                scale = np.asarray([out_scale], np.float32)
                keep = np.empty((rows, h), np.bool_)
            else:
                amax = np.zeros(rows)
                amax_pass(amax)
                scale = output_scale(np.asarray([amax.max() if rows else 0.0]))
            codes_pass(kernels.GIVEN, float(scale[0]), q, _S0, _K0 if keep is None else keep)
        else:
            scale = np.empty(rows, np.float32)
            codes_pass(kernels.ROW, 0.0, q, scale, _K0)
        return q, scale, keep

    def backward(self, dy: np.ndarray, ctx: QuantLayerNormCtx, dx_out: Any = None) -> QuantLayerNormGrads:
        rows, h = dy.shape
        g = dy
        if ctx.keep is not None:
            g = common.output(None, dy.shape, dy.dtype)
            launch(kernels.masked, rows * h, rows, common.storage(dy), ctx.keep, common.storage(g))
        xr, mean = ctx.x, ctx.mean
        wide = False
        if ctx.x_scale is not None:
            # the real input x * x_scale in float32, with the row means rounded the same way (a constant row's
            # dequantized values then equal its mean exactly: x_hat = 0, as in the reference); real inputs
            # float32 cannot hold (scales beyond [2^-60, 2^60]) are dequantized exactly, in float64
            xs = ctx.x_scale
            wide = bool(xs.size) and not bool(((xs >= _SAFE_SCALE[0]) & (xs <= _SAFE_SCALE[1])).all())
            xdt = np.float64 if wide else np.float32
            xr = common.output(None, (rows, h), xdt)
            launch(kernels.dequantize, rows * h, rows, np.ascontiguousarray(ctx.x), xs, xr)
            mean = mean if wide else mean.astype(np.float32).astype(np.float64)
        lctx = LayerNormCtx(
            xr, ctx.weight, ctx.bias, mean, ctx.rstd, ctx.eps, ctx.correction, ctx.eps_mode, ctx.weight_offset
        )
        if wide:
            grads = self.norm.backward(g.astype(np.float64), lctx)
            dx = common.output(dx_out, (rows, h), np.float32)
            np.copyto(dx, grads.dx, casting="same_kind")
            return QuantLayerNormGrads(dx, grads.dweight, grads.dbias)
        grads = self.norm.backward(g, lctx, dx_out=dx_out)
        return QuantLayerNormGrads(grads.dx, grads.dweight, grads.dbias)


#: the per-row input scales whose real int8 input float32 holds with room for its statistics (2^-60 to 2^60)
_SAFE_SCALE = (2.0**-60, 2.0**60)

#: op name -> its implementation (read by :func:`pynorm._registry.op_module`)
OP_IMPLS: Served[QuantOp] = Served(lambda spec: spec.family == "quantize", lambda spec: QuantOp(spec.name))
