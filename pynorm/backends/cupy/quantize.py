"""The quantize family on the GPU: host launchers of ``kernels/quantize.cu`` (``quant_layer_norm``).

* int8 input: ``quant_int8`` -- exact integer row sums, the reference's fixed float64 sequence and the
  epilogue (float32 ``y``, or int8 ``q`` with per-row / per-tensor / given scales) in one launch (two for a
  per-tensor scale: the rows' ``amax``, whose maximum the host takes, then ``q``); bitwise the reference's;
* float input: the statistics family's LayerNorm (:mod:`.stats`; ``y`` is bitwise ``layer_norm``'s), then,
  when quantizing, ``quant_float`` on its ``y``;
* backward: ``quant_mask`` (straight-through, 0 where a given ``out_scale`` clipped), ``quant_dequant``
  (``float32(x * x_scale)`` of an int8 input), then the statistics family's LayerNorm backward with the
  forward's per-row statistics (in its accumulation dtype).
"""

from __future__ import annotations

from typing import Any

import cupy
import numpy as np

from ...ops import Served
from ...ops.families import kernel_args
from ...ops.layer_norm import LayerNormCtx
from ...ops.quant_norm import QuantLayerNormCtx, QuantLayerNormGrads, quantizing
from ...reference.quant_norm import output_scale
from .._quant import QuantOpBase
from . import _host, _launch
from ._args import QuantDequantArgs, QuantFloatArgs, QuantInt8Args, QuantMaskArgs
from ._loader import FAMILY_FILES, get_kernel, supports

__all__ = ["OP_IMPLS", "QuantOp"]

_FILE = FAMILY_FILES["quantize"]
#: epilogue modes of quantize.cu
FLOAT, AMAX, ROW, GIVEN = 0, 1, 2, 3
#: rows in flight per launch (one block per row, grid-stride beyond)
_MAX_GRID = 1 << 16


def _param_type(weight: Any, bias: Any) -> tuple[str, Any, Any]:
    """The ``W`` of ``quant_int8`` (an accumulation type: float, or double when a parameter is float64) and the
    parameters cast to it (exact: every parameter is converted to double in the kernel anyway)."""
    present = [p for p in (weight, bias) if p is not None]
    wt = "double" if any(p.dtype == np.float64 for p in present) else "float"
    return wt, _host.prepare_param(weight, wt), _host.prepare_param(bias, wt)


class QuantOp(QuantOpBase):
    """``quant_layer_norm`` on this backend (see the module doc)."""

    stats_module = "pynorm.backends.cupy.stats"

    def _quant(self, kernel: str, t: str, rows: int, hidden: int, args: Any) -> None:
        k = get_kernel(_FILE, kernel, (t,))
        _host.launch(k, min(rows, _MAX_GRID), _launch.row_block(hidden), args.pack())

    def forward(
        self, x: cupy.ndarray, x_scale: Any, weight: Any, bias: Any, *, out: Any = None, quantize: str | None = None,
        out_scale: float | None = None, **conventions: Any,
    ) -> tuple[Any, QuantLayerNormCtx]:  # fmt: skip
        """``y`` (or ``q``) and the ctx; ``conventions``: the statistic's options (read by :func:`kernel_args`)."""
        rows, hidden = _launch.check_input(x)
        kargs = kernel_args(self.spec, conventions)
        quant = quantizing(quantize, out_scale)
        x = _host.contiguous(x)
        xs = None
        if x_scale is None:
            y, lctx = self.norm.forward(x, weight, bias, out=None if quant else out, **conventions)
            mean, rstd = lctx.mean, lctx.rstd
        else:
            xs = cupy.ascontiguousarray(x_scale, dtype=cupy.float64)
            mean, rstd = cupy.empty(rows, dtype=cupy.float64), cupy.empty(rows, dtype=cupy.float64)
            wt, w, b = _param_type(weight, bias)
        scale = keep = None
        result: Any

        def run(mode: int, s: float, q: Any, yf: Any, srow: Any, amax: Any, kp: Any) -> None:
            if not rows:
                return
            if x_scale is None:
                args = QuantFloatArgs(y, q, srow, amax, kp, rows, hidden, mode, s)
                self._quant("quant_float", _launch.cuda_type(y.dtype), rows, hidden, args)
            else:
                args8 = QuantInt8Args(
                    x, xs, w, b, q, yf, srow, amax, kp, mean, rstd, rows, hidden, kargs.eps, kargs.correction,
                    kargs.mode, kargs.weight_offset, mode, s,
                )  # fmt: skip
                self._quant("quant_int8", wt, rows, hidden, args8)

        if not quant and x_scale is None:
            result = y
        elif not quant:
            result = out if out is not None else cupy.empty((rows, hidden), dtype=cupy.float32)
            run(FLOAT, 0.0, None, result, None, None, None)
        else:
            result = out if out is not None else cupy.empty((rows, hidden), dtype=cupy.int8)
            if out_scale is not None or quantize == "tensor":
                if out_scale is not None:
                    scale = cupy.asarray(np.asarray([out_scale], np.float32))
                    keep = cupy.empty((rows, hidden), dtype=bool)
                else:
                    amax = cupy.zeros(rows, dtype=cupy.float64)
                    run(AMAX, 0.0, None, None, None, amax, None)
                    top = float(amax.max()) if rows else 0.0
                    scale = cupy.asarray(output_scale(np.asarray([top])))
                run(GIVEN, float(np.float32(scale.get()[0]) if out_scale is None else out_scale), result, None, None,
                    None, keep)  # fmt: skip
            else:
                scale = cupy.empty(rows, dtype=cupy.float32)
                run(ROW, 0.0, result, None, scale, None, None)
        arrays = dict(x=x, x_scale=xs, weight=weight, bias=bias, mean=mean, rstd=rstd, scale=scale, keep=keep)
        return result, self._ctx(conventions, kargs, arrays, quantize=quantize, out_scale=out_scale)

    def backward(self, dy: cupy.ndarray, ctx: QuantLayerNormCtx, *, dx_out: Any = None) -> QuantLayerNormGrads:
        rows, hidden = (int(d) for d in dy.shape)
        dy = _host.contiguous(dy)
        t = _launch.cuda_type(dy.dtype)
        g = dy
        if ctx.keep is not None and rows:
            g = _host.empty((rows, hidden), dy.dtype)
            k = get_kernel(_FILE, "quant_mask", (t,))
            n = rows * hidden
            _host.launch(k, min(-(-n // 256), _MAX_GRID), 256, QuantMaskArgs(dy, ctx.keep, g, n).pack())
        xr, mean, rstd = ctx.x, ctx.mean, ctx.rstd
        wide = False
        if ctx.x_scale is not None:
            # the real input x * x_scale in float32, with the row means rounded the same way (a constant row's
            # values then equal its mean exactly: x_hat = 0, as in the reference); real inputs float32 cannot
            # hold (scales beyond [2^-60, 2^60]) are dequantized exactly, in float64, and the backward runs there
            xs = ctx.x_scale
            wide = bool(xs.size) and not bool(((xs >= _SAFE_SCALE[0]) & (xs <= _SAFE_SCALE[1])).all())
            xdt = np.dtype(np.float64 if wide else np.float32)
            xr = cupy.empty((rows, hidden), dtype=xdt)
            if rows:
                k = get_kernel(_FILE, "quant_dequant", (_launch.cuda_type(xdt),))
                n = rows * hidden
                args = QuantDequantArgs(ctx.x, xs, xr, rows, hidden)
                _host.launch(k, min(-(-n // 256), _MAX_GRID), 256, args.pack())
            acc = _launch.type_plan(xdt, *(None if p is None else p.dtype for p in (ctx.weight, ctx.bias)))
            if not wide:
                mean = mean.astype(cupy.float32)
            mean, rstd = mean.astype(acc.acc_dtype), rstd.astype(acc.acc_dtype)
        lctx = LayerNormCtx(xr, ctx.weight, ctx.bias, mean, rstd, ctx.eps, ctx.correction, ctx.eps_mode,
                            ctx.weight_offset)  # fmt: skip
        if wide:
            grads = self.norm.backward(g.astype(cupy.float64), lctx)
            dx = grads.dx.astype(cupy.float32) if dx_out is None else dx_out
            if dx_out is not None:
                dx_out[...] = grads.dx
            return QuantLayerNormGrads(dx, grads.dweight, grads.dbias)
        grads = self.norm.backward(g, lctx, dx_out=dx_out)
        return QuantLayerNormGrads(grads.dx, grads.dweight, grads.dbias)


#: the per-row input scales whose real int8 input float32 holds with room for its statistics (2^-60 to 2^60)
_SAFE_SCALE = (2.0**-60, 2.0**60)

#: op name -> its implementation, for every op of the quantize family
OP_IMPLS: Served[QuantOp] = Served(
    lambda spec: spec.family == "quantize" and supports(spec), lambda spec: QuantOp(spec.name)
)
