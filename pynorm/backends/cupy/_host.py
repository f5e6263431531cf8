"""Host-side helpers shared by the CuPy launchers: arrays, parameters, device limits, launches.

Arrays of every supported dtype -- bfloat16 included -- are only allocated, viewed and
copied here, and copies go through an integer view of the same item size, so nothing
depends on CuPy implementing bfloat16 arithmetic. All conversions happen in the kernels.
"""

from __future__ import annotations

import os
import threading
from typing import Any

import cupy
import numpy as np

from . import _launch
from ._loader import get_kernel

_INT_OF_SIZE = {2: np.uint16, 4: np.uint32, 8: np.uint64}
NULL = np.uint64(0)  # a null pointer argument

_limits_lock = threading.Lock()
_limits: dict[int, _launch.Limits] = {}


def device_limits() -> _launch.Limits:
    """The occupancy-relevant limits of the current device (cached per device)."""
    dev = cupy.cuda.runtime.getDevice()
    with _limits_lock:
        lim = _limits.get(dev)
        if lim is None:
            p = cupy.cuda.runtime.getDeviceProperties(dev)
            d = _launch.Limits("default", 9, 0, 1)
            lim = _launch.Limits(
                name=p.get("name", b"").decode(errors="replace") if isinstance(p.get("name"), bytes) else "gpu",
                major=int(p.get("major", d.major)),
                minor=int(p.get("minor", d.minor)),
                sm_count=int(p["multiProcessorCount"]),
                max_threads_per_sm=int(p.get("maxThreadsPerMultiProcessor", d.max_threads_per_sm)),
                max_blocks_per_sm=int(p.get("maxBlocksPerMultiProcessor", d.max_blocks_per_sm)),
                regs_per_sm=int(p.get("regsPerMultiprocessor", d.regs_per_sm)),
                regs_per_block=int(p.get("regsPerBlock", d.regs_per_block)),
                smem_per_sm=int(p.get("sharedMemPerMultiprocessor", d.smem_per_sm)),
                smem_per_block_optin=int(p.get("sharedMemPerBlockOptin", p.get("sharedMemPerBlock", 49152))),
                reserved_smem_per_block=int(p.get("reservedSharedMemPerBlock", d.reserved_smem_per_block)),
                warp_size=int(p.get("warpSize", 32)),
            )
            _limits[dev] = lim
    return lim


def forced(name: str) -> Any:
    """Test/benchmark override of a launch choice: ``PYNORM_CUPY_<NAME>`` (empty or unset: automatic).

    ``PYNORM_CUPY_BACKWARD`` = ``fused`` | ``split``; ``PYNORM_CUPY_OVERFLOW`` = ``smem`` | ``global``.
    """
    return os.environ.get(f"PYNORM_CUPY_{name}") or None


def empty(shape: tuple[int, ...], dtype: Any) -> cupy.ndarray:
    """An uninitialised array of ``dtype`` (bfloat16 through a uint16 buffer if CuPy rejects it directly)."""
    try:
        return cupy.empty(shape, dtype=dtype)
    except (TypeError, ValueError):
        return cupy.empty(shape, dtype=_INT_OF_SIZE[np.dtype(dtype).itemsize]).view(dtype)


def contiguous(a: cupy.ndarray) -> cupy.ndarray:
    """``a`` itself when C-contiguous, else a C-contiguous bitwise copy (made through an integer view)."""
    if a.flags.c_contiguous:
        return a
    ints = a.view(_INT_OF_SIZE[a.dtype.itemsize])
    return cupy.ascontiguousarray(ints).view(a.dtype)


def ptr_or_null(a: cupy.ndarray | None) -> Any:
    return a if a is not None else NULL


def launch(
    kernel: Any, grid: tuple[int, ...] | int, block: tuple[int, ...] | int, args: tuple[Any, ...], shared_mem: int = 0
) -> None:
    """Launch ``kernel`` on the current stream, raising its dynamic shared memory limit when needed.

    The driver allows 48 KiB of shared memory per block, *static plus dynamic*, unless the
    kernel's ``max_dynamic_shared_size_bytes`` attribute was raised: so the attribute is raised
    whenever the two together exceed 48 KiB (an exactly-48-KiB dynamic buffer needs it too).
    """
    grid = grid if isinstance(grid, tuple) else (grid,)
    block = block if isinstance(block, tuple) else (block,)
    if shared_mem + kernel.shared_size_bytes > 48 * 1024 and kernel.max_dynamic_shared_size_bytes < shared_mem:
        kernel.max_dynamic_shared_size_bytes = shared_mem
    kernel(grid, block, args, shared_mem=shared_mem)


def cast(a: cupy.ndarray, dtype: Any) -> cupy.ndarray:
    """A C-contiguous copy of ``a`` converted to ``dtype`` on the device, each value rounded once
    (``a`` itself when it already has that dtype and layout)."""
    a = contiguous(a)
    if a.dtype == np.dtype(dtype):
        return a
    out = empty(tuple(a.shape), dtype)
    n = int(a.size)
    if n:
        k = get_kernel("cast.cu", "cast_values", (_launch.cuda_type(a.dtype), _launch.cuda_type(dtype)))
        block = _launch.DEFS["CAST_THREADS"]
        launch(k, min(-(-n // block), 65535), block, (a, out, np.int64(n)))
    return out


def prepare_param(p: cupy.ndarray | None, cast_to: str | None) -> cupy.ndarray | None:
    """A parameter ready for the kernels: C-contiguous, and cast to ``cast_to`` (``"float"``/``"double"``) if set."""
    if p is None:
        return None
    return cast(p, "float64" if cast_to == "double" else "float32") if cast_to is not None else contiguous(p)


def reduce_partials(
    part: cupy.ndarray | None,
    partials: int,
    hidden: int,
    out_dtype: Any,
    acc: str,
    segs: cupy.ndarray | None = None,
    segments: int = 1,
) -> cupy.ndarray:
    """Sum the ``(partials, hidden)`` accumulator rows in a fixed order, rounded once to ``out_dtype``: a
    ``(hidden,)`` array; with ``segs`` (``segments + 1`` int64 row offsets) a ``(segments, hidden)`` array,
    row ``m`` the sum of partial rows ``segs[m]:segs[m + 1]``."""
    out = empty((segments, hidden) if segs is not None else (hidden,), out_dtype)
    k = get_kernel("reduce.cu", "reduce_partials", (_launch.cuda_type(out_dtype), acc))
    grid, block = _launch.reduce_grid(hidden, segments)
    launch(k, grid, block, (ptr_or_null(part), out, ptr_or_null(segs), np.int64(partials), np.int32(hidden)))
    return out


def reduce_scalar(part: cupy.ndarray | None, partials: int, hidden: int, out_dtype: Any, acc: str) -> cupy.ndarray:
    """The ``(1,)`` sum of every element of the ``(partials, hidden)`` accumulator rows: per column first,
    then over the columns, each in a fixed order; rounded once to ``out_dtype``."""
    acc_dtype = "float64" if acc == "double" else "float32"
    cols = reduce_partials(part, partials, hidden, acc_dtype, acc)
    return reduce_partials(cols.reshape(hidden, 1), hidden, 1, out_dtype, acc)
