"""FP8 / FP4 quantization on the GPU: host launchers of ``quant_fp_rows`` and ``quant_fp_amax`` (``quantize.cu``).

``quant_fp_rows<T>`` reads ``y`` in its own dtype and writes the unpacked codes and the per-block scales; a per-tensor
scale and NVFP4's global scale take a first launch of ``quant_fp_amax`` (each row's largest magnitude, whose maximum
the host takes: exact in any order) and the reference's scalar formulas. Packing FP4 codes and swizzling scales
are the reference's integer layout code on CuPy arrays. Codes and scales are bitwise the reference's
(:mod:`pynorm.reference.fp_quant`); :func:`dequantize` is the reference's, on the host.
"""

from __future__ import annotations

from typing import Any

import cupy
import numpy as np

from ...ops.fp_quant import Quantized, QuantSpec
from ...reference import fp_quant as ref
from . import _host, _launch
from ._args import FpqAmaxArgs, FpqRowsArgs
from ._loader import FAMILY_FILES, get_kernel

__all__ = ["dequantize", "quantize"]

_FILE = FAMILY_FILES["quantize"]
_KINDS = {"scaled": 0, "mx": 1, "nvfp4": 2}
#: rows in flight per launch (one block per row, grid-stride beyond)
_MAX_GRID = 1 << 16


def _launch_rows(kernel: str, t: str, rows: int, hidden: int, args: Any) -> None:
    k = get_kernel(_FILE, kernel, (t,))
    _host.launch(k, min(rows, _MAX_GRID), _launch.row_block(hidden), args.pack())


def _tensor_amax(y2: Any, t: str) -> float:
    rows, h = (int(d) for d in y2.shape)
    if not rows:
        return 0.0
    amax = cupy.empty(rows, dtype=cupy.float32)
    _launch_rows("quant_fp_amax", t, rows, h, FpqAmaxArgs(y2, amax, rows, h))
    return float(amax.max())


def quantize(y: Any, spec: QuantSpec, axis: int = -1) -> Quantized:
    """``y`` quantized by ``spec`` (bitwise :func:`pynorm.reference.fp_quant.quantize`'s codes and scales)."""
    lead, r, h = ref.rows_of(tuple(y.shape), axis)
    y2 = _host.contiguous(y.reshape(r, h))
    t = _launch.cuda_type(y2.dtype)
    fmt = spec.fmt
    el = fmt.element
    tensor = fmt.kind == "scaled" and spec.scaling == "tensor"
    block = max(h, 1) if tensor else spec.block_size(h)
    nb = -(-h // block)
    s_tensor = 0.0
    g = 1.0
    if tensor:
        s_tensor = float(ref.tensor_scale(_tensor_amax(y2, t) if spec.scale is None else 0.0, spec)[0])
    if fmt.kind == "nvfp4":
        g = float(ref.nvfp4_global(_tensor_amax(y2, t) if spec.global_scale is None else 0.0, spec.global_scale))
    codes = cupy.empty((r, h), dtype=cupy.uint8)
    sf: Any = cupy.empty((r, nb), dtype=cupy.float32) if fmt.kind == "scaled" else None
    sc = cupy.empty((r, nb), dtype=cupy.uint8) if fmt.kind != "scaled" else None
    if r:
        sat = el.over_code is None or spec.overflow == "saturate"
        over = el.max_code if sat or el.over_code is None else el.over_code
        mt = (el.max_code & ((1 << el.mbits) - 1)) << (23 - el.mbits)
        args = FpqRowsArgs(
            y2, codes, sf, sc, r, h, _KINDS[fmt.kind], el.mbits, el.emin, el.max_code, el.nbits - 1, over,
            el.nan_code or 0, el.emax, mt, block, s_tensor, int(spec.scale_rule == "ceil"), g,
        )  # fmt: skip
        _launch_rows("quant_fp_rows", t, r, h, args)
    scales: Any
    if fmt.kind != "scaled":
        scales = sc
    elif tensor:
        scales = cupy.full(1, s_tensor, dtype=cupy.float32)
    else:
        scales = sf.reshape(r) if spec.scaling == "row" else sf
    codes2, scales2, g2 = ref.layout(codes, scales, np.float32(g) if fmt.kind == "nvfp4" else None, spec)
    return ref.quantized(codes2, scales2, g2, y, spec, tuple(y.shape), lead, xp=cupy)


def dequantize(q: Quantized) -> Any:
    """The float32 values of ``q``: the reference's, computed on the host, as a CuPy array."""
    host = q._replace(
        codes=cupy.asnumpy(q.codes), scales=cupy.asnumpy(q.scales),
        global_scale=None if q.global_scale is None else cupy.asnumpy(q.global_scale), y=None,
    )  # fmt: skip
    return cupy.asarray(ref.dequantize(host))
