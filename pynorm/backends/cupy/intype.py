"""The ``cupy`` backend's pieces of the casting policies (``COMPOSED["casting"]`` of the package): what
:mod:`pynorm.composite.casting` -- composed above the backend by the registry -- runs besides the backend's ops.

* :class:`InType`: ``casting="none"`` of LayerNorm and RMSNorm, every operation in ``x``'s dtype: launches
  ``kernels/intype.cu``, ``forward(...) -> (y, mean, rstd)`` and ``backward(...) -> (dx, dweight, dbias)`` on
  ``(R, H)`` arrays, the sequences of :mod:`pynorm.reference.casting` (the composite builds the op's ctx). The
  weight ``rnd(w + o)`` and bias ``rnd(b)`` are prepared on the device (``cast.cu``); the parameter gradients are
  summed in double and rounded once;
* :func:`cast`, :func:`copy_into`: the array conversions the policies need, on the device.
"""

from __future__ import annotations

from typing import Any

import cupy
import numpy as np

from ...ops.families import R_OUTSIDE, kernel_args, statistic_of
from . import _host, _launch
from ._args import InTypeBwdArgs, InTypeFwdArgs, InTypeParamsArgs
from ._loader import get_kernel

__all__ = ["InType", "cast", "copy_into"]


def cast(a: Any, dtype: Any) -> Any:
    """A copy of ``a`` rounded once to ``dtype`` on the device (``cast.cu``)."""
    return _host.cast(a, np.dtype(dtype))


def copy_into(dst: Any, src: Any) -> None:
    """``dst[...] = src`` for arrays of one dtype."""
    dst[...] = src


_FILE = "intype.cu"
_MAX_GRID = 1 << 16


def _in_dtype(p: Any, dtype: Any, offset: float = 0.0) -> Any:
    """``rnd(p + offset)`` in ``dtype``, as float64 values on the device (None stays None)."""
    if p is None:
        return None
    wide = _host.cast(p, np.dtype(np.float64))
    if offset != 0.0:
        wide = wide + offset
    return _host.cast(_host.cast(wide, np.dtype(dtype)), np.dtype(np.float64))


class InType:
    """The in-dtype kernels of ``spec``'s op (LayerNorm or RMSNorm: whether its statistic centres the row, and its
    conventions read by :func:`pynorm.ops.families.kernel_args`)."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        self.centered = statistic_of(spec).mean

    def _t(self, x: Any) -> str:
        return _launch.cuda_type(x.dtype)

    def forward(self, x: cupy.ndarray, weight: Any, bias: Any, *, out: Any = None, **conventions: Any) -> Any:
        """``(y, mean, rstd)`` of ``x`` with the op's ``conventions`` (its options but ``casting``)."""
        kargs = kernel_args(self.spec, conventions)
        rows, hidden = _launch.check_input(x)
        x = _host.contiguous(x)
        y = out if out is not None else _host.empty((rows, hidden), x.dtype)
        mean = cupy.zeros(rows, dtype=np.float64)
        rstd = cupy.empty(rows, dtype=np.float64)
        if rows:
            args = InTypeFwdArgs(
                x, _in_dtype(weight, x.dtype, kargs.weight_offset), _in_dtype(bias, x.dtype), y, mean, rstd, rows,
                hidden, kargs.eps, int(self.centered), kargs.correction, int(kargs.mode == R_OUTSIDE),
            )  # fmt: skip
            grid, block = min(rows, _MAX_GRID), _launch.row_block(hidden)
            _host.launch(get_kernel(_FILE, "intype_fwd", (self._t(x),)), grid, block, args.pack())
        return y, mean, rstd

    def backward(
        self, dy: cupy.ndarray, x: cupy.ndarray, weight: Any, bias: Any, mean: Any, rstd: Any, *, dx_out: Any = None,
        **conventions: Any,
    ) -> tuple[Any, Any, Any]:  # fmt: skip
        """``(dx, dweight, dbias)`` from the forward's ``mean``/``rstd`` and ``conventions``."""
        kargs = kernel_args(self.spec, conventions)
        rows, hidden = (int(d) for d in x.shape)
        x = _host.contiguous(x)
        dy = _host.contiguous(dy)
        t = self._t(x)
        dx = dx_out if dx_out is not None else _host.empty((rows, hidden), x.dtype)
        pw = cupy.zeros(hidden, dtype=np.float64) if weight is not None else None
        pb = cupy.zeros(hidden, dtype=np.float64) if bias is not None else None
        if rows:
            args = InTypeBwdArgs(
                dy, x, _in_dtype(weight, x.dtype, kargs.weight_offset), dx, rows, hidden, kargs.eps, int(self.centered),
                kargs.correction, int(kargs.mode == R_OUTSIDE),
            )  # fmt: skip
            grid, block = min(rows, _MAX_GRID), _launch.row_block(hidden)
            _host.launch(get_kernel(_FILE, "intype_bwd", (t,)), grid, block, args.pack())
            if pw is not None or pb is not None:
                m = _host.cast(mean, np.dtype(np.float64)) if mean is not None else cupy.zeros(rows, dtype=np.float64)
                pargs = InTypeParamsArgs(dy, x, m, _host.cast(rstd, np.dtype(np.float64)), pw, pb, rows, hidden,
                                         int(self.centered))  # fmt: skip
                _host.launch(get_kernel(_FILE, "intype_params", (t,)), -(-hidden // 128), 128, pargs.pack())
        dweight = None if pw is None else _host.cast(pw, np.dtype(weight.dtype))
        dbias = None if pb is None else _host.cast(pb, np.dtype(bias.dtype))
        return dx, dweight, dbias
