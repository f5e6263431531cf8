"""``python -m pynorm warmup``: compile the numba backend's kernels ahead of time, with progress.

The numba kernels compile on the first call of each op, direction and dtype (seconds each; cached on disk for
later processes: ``docs/numba.md``). ``warmup`` runs each chosen op's forward and backward once, on a small input
of each chosen dtype, so that a pipeline's first real call loads them from the cache instead; ``--jobs`` runs the
ops in that many processes (the compiler holds a lock per process: processes are what runs compilations side
by side), ``--read-only`` also compiles the signatures of read-only NumPy arrays (a memory-mapped file's, an
array whose ``writeable`` flag is off; :mod:`pynorm.jax`'s callbacks need none: they hand JAX's read-only buffers
on as writable aliases, served by the ordinary signatures), and ``--quantize`` the fused FP8/FP4 quantize epilogue
of the ops that offer ``quantize=`` (``docs/norms/quantized_outputs.md``: one compilation per op and dtype serves
every format and scaling). The options are each op's defaults (its first test case for an op with a required
option): another ``casting`` or ``eps_mode`` compiles its own kernels on first use.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any

import numpy as np

__all__ = ["main", "quantizes", "run_one", "warmup"]

#: the shapes each op of the "rows" layout runs on: the launch paths the numba kernels choose by shape (small
#: calls, the backward's row path under 128 rows of 2^20 elements or more, streaming stores of large float32 outputs,
#: rows split across threads), so that a first call of any shape finds its kernels compiled
SHAPES = ((4, 64), (64, 1 << 14), (4096, 1024), (2, 1 << 19))

#: the dtypes by default (every float dtype an op takes; int8 is quant_layer_norm's only)
DTYPES = ("float16", "bfloat16", "float32", "float64")


def _dtype(name: str) -> Any:
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


#: the format a ``--quantize`` warmup runs: the fused epilogue's kernels take the format and the scaling at run time
#: (one compilation serves FP8, MXFP8, MXFP4, NVFP4 and every scaling), so any one covers them
QUANTIZE_FORMAT = "nvfp4"


def quantizes(op: str) -> bool:
    """Whether ``op`` offers the fused quantize epilogue (``quantize=``, :data:`pynorm.ops.fp_quant` formats)."""
    from pynorm.ops import SPECS

    return any(o.name == "quantize" and o.offered for o in SPECS[op].options)


def run_one(op: str, dtype: str, read_only: bool = False, quantize: bool = False) -> float:
    """Run op ``op``'s forward and backward on the numba backend on ``dtype`` inputs of each of :data:`SHAPES`
    (read-only arrays too with ``read_only``; with ``quantize``, for an op that :func:`quantizes`, its forward
    with a quantized output too); the seconds it took (its compilations, or the cache's loads)."""
    import pynorm
    from pynorm.ops import SPECS

    logging.getLogger("pynorm.compile").setLevel(logging.ERROR)  # (the progress line says it)
    spec = SPECS[op]
    rng = np.random.default_rng(0)
    dt = _dtype(dtype)
    channels = spec.layout == "channels"
    opts = dict(spec.cases[0]) if channels else {}
    fwd, bwd = spec.generic_forward(), getattr(pynorm, f"{op}_backward")
    t0 = time.perf_counter()
    for shape in ((2, 4, 8),) if channels else SHAPES:
        ax = 1 if channels else -1
        x = (rng.standard_normal(shape) * 3).astype(dt) if dtype != "int8" else rng.integers(-9, 9, shape, np.int8)
        args = spec.example_args(shape, ax, np.float32 if dtype == "int8" else dt, rng, options=opts)
        names = (*spec.input_names, *spec.param_names)
        y_shape = spec.output_shape(shape, ax, dict(zip(names, args, strict=True)))
        dy = rng.standard_normal(y_shape).astype(spec.grad_dtype(x.dtype))
        for frozen in (False, True) if read_only else (False,):
            arrays = [x, *args, dy]
            if frozen:
                arrays = [None if a is None else a.copy() for a in arrays]
                for a in arrays:
                    if a is not None:
                        a.setflags(write=False)
            *given, d = arrays
            _, ctx = fwd(given[0], *given[1:], backend="numba", **opts)
            bwd(d, ctx)
            if quantize and quantizes(op):
                fwd(given[0], *given[1:], backend="numba", quantize=QUANTIZE_FORMAT, **opts)
    return time.perf_counter() - t0


def warmup(ops: tuple[str, ...], dtypes: tuple[str, ...], jobs: int = 1, read_only: bool = False,
           out: Any = None, quantize: bool = False) -> int:  # fmt: skip
    """Compile ``ops`` x ``dtypes`` (the pairs an op takes) in ``jobs`` processes, one progress line per pair on
    ``out`` (default stdout); ``read_only``, ``quantize``: as :func:`run_one`. Returns 0, or 1 if a pair failed
    (its error printed)."""
    from pynorm.ops import SPECS

    out = out or sys.stdout
    tasks = [(op, dt) for op in ops for dt in dtypes if dt in SPECS[op].x_dtypes]
    n = len(tasks)
    print(f"pynorm warmup: {n} op/dtype pairs (forward + backward) on the numba backend, {jobs} process(es); "
          f"cache: {_cache_dir()}", file=out, flush=True)  # fmt: skip
    t0 = time.perf_counter()
    failed = 0

    def line(k: int, op: str, dt: str, what: str) -> None:
        done = int(20 * k / max(n, 1))
        print(f"[{'#' * done}{'.' * (20 - done)}] {k:>3d}/{n}  {op} {dt}: {what}", file=out, flush=True)

    if jobs <= 1:
        for k, (op, dt) in enumerate(tasks, 1):
            try:
                line(k, op, dt, f"{run_one(op, dt, read_only, quantize):.1f} s")
            except Exception as exc:  # reported, the others still compile
                failed += 1
                line(k, op, dt, f"FAILED: {type(exc).__name__}: {exc}")
    else:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx) as pool:
            futures = {pool.submit(run_one, op, dt, read_only, quantize): (op, dt) for op, dt in tasks}
            for k, fut in enumerate(as_completed(futures), 1):
                op, dt = futures[fut]
                try:
                    line(k, op, dt, f"{fut.result():.1f} s")
                except Exception as exc:
                    failed += 1
                    line(k, op, dt, f"FAILED: {type(exc).__name__}: {exc}")
    print(f"done in {time.perf_counter() - t0:.1f} s" + (f", {failed} failed" if failed else ""), file=out)
    return 1 if failed else 0


def _cache_dir() -> str:
    return os.environ.get("NUMBA_CACHE_DIR") or "numba's default (beside the package, else the user cache)"


def _names(s: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in s.split(",") if v.strip())


def main(argv: list[str] | None = None) -> int:
    from pynorm import _registry
    from pynorm.ops import SPECS

    p = argparse.ArgumentParser(
        prog="python -m pynorm warmup",
        description="compile the numba backend's kernels ahead of time (each op's forward and backward, per "
        "dtype, into numba's disk cache), with progress",
    )
    p.add_argument("--ops", default="layer_norm,rms_norm", help="comma-separated ops, or 'all' "
                   "(default: layer_norm,rms_norm)")  # fmt: skip
    p.add_argument("--dtypes", default="float32", help=f"comma-separated, of {', '.join(DTYPES)}, int8 "
                   "(default: float32)")  # fmt: skip
    p.add_argument("--jobs", type=int, default=1, help="processes compiling side by side (default 1)")
    p.add_argument("--read-only", action="store_true", help="also the signatures of read-only NumPy inputs "
                   "(memory-mapped arrays; pynorm.jax needs none)")  # fmt: skip
    p.add_argument("--quantize", action="store_true", help="also the fused FP8/FP4 quantize epilogue of the "
                   "ops that offer quantize= (one compilation per op and dtype serves every format)")  # fmt: skip
    a = p.parse_args(argv)
    reason = _registry.unavailable_reason("numba")
    if reason is not None:
        p.exit(2, f"warmup needs the numba backend: {reason}\n")
    ops = tuple(SPECS) if a.ops.strip() == "all" else _names(a.ops)
    bad = sorted(set(ops) - set(SPECS))
    if bad or not ops:
        p.error(f"unknown op(s) {', '.join(bad) or '(none)'} (ops: {', '.join(SPECS)})")
    dtypes = _names(a.dtypes)
    bad = sorted(set(dtypes) - {*DTYPES, "int8"})
    if bad or not dtypes:
        p.error(f"--dtypes must name some of {', '.join(DTYPES)}, int8; got {a.dtypes!r}")
    if a.jobs < 1:
        p.error("--jobs must be at least 1")
    if a.quantize and not any(quantizes(op) for op in ops):
        p.error(f"--quantize: none of {', '.join(ops)} offers quantize= (those that do: "
                f"{', '.join(op for op in SPECS if quantizes(op))})")  # fmt: skip
    return warmup(ops, dtypes, a.jobs, a.read_only, quantize=a.quantize)
