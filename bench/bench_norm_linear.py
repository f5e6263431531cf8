"""Fused LayerNorm + Linear against the unfused composition (``layer_norm`` then ``@``), on the CPU.

For each backend given (``--backend``, default ``numba`` and the composite bound to ``numpy``'s
kernels), at ``rows x hidden -> out`` float32:

* **ctx memory**: bytes allocated by forward that are still held after it returns, minus the output
  (``tracemalloc``; NumPy and the numba backend allocate through it). Fused: the ctx holds ``x`` (the
  caller's), the per-row statistics and the parameters. Unfused: the LayerNorm ctx plus ``n``, which the
  product's backward (``dW = dy^T n``) needs. The numba backend's output pool is turned off so that
  freed buffers are not counted.
* **time**: median of ``--repeat`` forward + backward runs (after one warm-up), each.

Run: ``python bench/bench_norm_linear.py [--rows 4096 --hidden 4096 --out 4096] [--repeat 3]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pynorm, not an installed one

import pynorm
from pynorm.composite import norm_linear as composite


def _fused(backend: str) -> tuple[Any, Any]:
    if backend == "numpy-kernels":  # the composite over the numpy backend's layer_norm (the registry offers
        op = composite.bind("layer_norm_linear", "numpy")  # the reference there: float64 products)

        def fwd(x: Any, w: Any, b: Any, W: Any, c: Any) -> Any:
            (y, _), ctx = op.forward(x, w, b, W, c, eps=1e-5, correction=0, eps_mode="var", weight_offset=0.0)
            return y, ctx

        return fwd, lambda dy, ctx: op.backward(dy, ctx)

    def fwd2(x: Any, w: Any, b: Any, W: Any, c: Any) -> Any:
        return pynorm.layer_norm_linear_forward(x, w, b, W, c, backend=backend)

    return fwd2, pynorm.layer_norm_linear_backward


def _unfused(backend: str) -> tuple[Any, Any]:
    be = "numpy" if backend == "numpy-kernels" else backend

    def fwd(x: Any, w: Any, b: Any, W: Any, c: Any) -> Any:
        n, ctx = pynorm.layer_norm_forward(x, w, b, backend=be)
        y = n @ W.T
        y += c
        return y, (ctx, n, W)

    def bwd(dy: Any, saved: Any) -> Any:
        ctx, n, W = saved
        dn = dy @ W
        dW = dy.T @ n
        dc = dy.sum(axis=0)
        g = pynorm.layer_norm_backward(dn, ctx)
        return g.dx, g.dweight, g.dbias, dW, dc

    return fwd, bwd


def _held(fwd: Any, args: tuple[Any, ...]) -> tuple[int, int]:
    """(bytes held after forward minus the output, peak bytes during forward)."""
    gc.collect()
    tracemalloc.start()
    tracemalloc.reset_peak()
    y, saved = fwd(*args)
    cur, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    held = cur - y.nbytes
    del y, saved
    return held, peak


def _time(fwd: Any, bwd: Any, args: tuple[Any, ...], dy: Any, repeat: int) -> float:
    y, s = fwd(*args)
    bwd(dy, s)
    del y, s
    ts = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        y, s = fwd(*args)
        bwd(dy, s)
        ts.append(time.perf_counter() - t0)
        del y, s
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--out", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--backend", action="append", help="numba, numpy-kernels (default: both)")
    ap.add_argument("--json", help="write the results here")
    a = ap.parse_args()
    try:
        from pynorm.backends.numba import _common

        _common.POOL.max_bytes = 0
    except Exception:  # numba backend absent: only numpy-kernels can run
        pass
    rng = np.random.default_rng(0)
    r, h, n = a.rows, a.hidden, a.out
    x = rng.standard_normal((r, h), dtype=np.float32)
    w = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
    b = (0.1 * rng.standard_normal(h)).astype(np.float32)
    W = (rng.standard_normal((n, h), dtype=np.float32) / np.float32(np.sqrt(h))).astype(np.float32)
    c = (0.1 * rng.standard_normal(n)).astype(np.float32)
    dy = rng.standard_normal((r, n), dtype=np.float32)
    args = (x, w, b, W, c)
    results = []
    print(f"{r} x {h} -> {n} float32; x = {x.nbytes / 2**20:.1f} MiB; median of {a.repeat} fwd+bwd")
    print(f"{'backend':14s} {'path':8s} {'ctx MiB':>8s} {'fwd peak MiB':>12s} {'fwd+bwd s':>10s}")
    for be in a.backend or ["numba", "numpy-kernels"]:
        row: dict[str, Any] = {"backend": be}
        for path, make in (("fused", _fused), ("unfused", _unfused)):
            fwd, bwd = make(be)
            t = _time(fwd, bwd, args, dy, a.repeat)  # first: its warm-up compiles numba's kernels
            held, peak = _held(fwd, args)
            row[path] = {"ctx_bytes": held, "fwd_peak_bytes": peak, "seconds": t}
            print(f"{be:14s} {path:8s} {held / 2**20:8.2f} {peak / 2**20:12.2f} {t:10.3f}")
        ratio = row["fused"]["seconds"] / row["unfused"]["seconds"]
        print(f"{be:14s} fused/unfused time {ratio:.3f}, ctx memory saved "
              f"{(row['unfused']['ctx_bytes'] - row['fused']['ctx_bytes']) / 2**20:.2f} MiB")  # fmt: skip
        results.append(row)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"rows": r, "hidden": h, "out": n, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
