"""Cost of the ``casting=`` policies of layer_norm / rms_norm on one backend, relative to ``"fp32"``.

Every policy is timed in the same run, interleaved (round-robin, median of ``--repeat`` rounds), so
the ratios hold on a noisy shared machine even where the absolute times do not. ``"fp32"`` is the
fused statistics kernel; ``"gemma"`` the same kernel (its ``(1 + w)`` prepared once); ``"llama"``,
``"t5"``, ``"apex"`` the norm without affine plus the element-wise identity (one more pass each way);
``"none"`` the in-dtype kernels.

    python bench/bench_casting.py [--backend numba] [--rows 8192] [--hidden 4096] [--dtype float16]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pynorm, not an installed one

import pynorm

POLICIES = ("fp32", "gemma", "llama", "t5", "apex", "none")


def _dtype(name: str) -> Any:
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--backend", default="numba")
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--ops", default="layer_norm,rms_norm")
    args = ap.parse_args(argv)
    dt = _dtype(args.dtype)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.rows, args.hidden), dtype=np.float32).astype(dt)
    dy = rng.standard_normal((args.rows, args.hidden), dtype=np.float32).astype(dt)
    w = (1 + 0.1 * rng.standard_normal(args.hidden)).astype(dt)
    b = (0.1 * rng.standard_normal(args.hidden)).astype(dt)
    mib = x.nbytes / 2**20
    print(f"backend {args.backend}, x {args.rows}x{args.hidden} {dt.name} ({mib:.0f} MiB), median of {args.repeat}")
    for op in args.ops.split(","):
        params = (w, b) if op == "layer_norm" else (w,)
        fwd = getattr(pynorm, f"{op}_forward")
        bwd = getattr(pynorm, f"{op}_backward")
        times: dict[str, dict[str, list[float]]] = {p: {"fwd": [], "bwd": []} for p in POLICIES}
        copies: list[float] = []
        dst = np.empty_like(x)
        for p in POLICIES:  # warm-up: compile every kernel first
            kw = {"weight_offset": 1.0} if p == "gemma" else {}
            _, ctx = fwd(x, *params, casting=p, backend=args.backend, **kw)
            bwd(dy, ctx)
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            np.copyto(dst, x)
            copies.append(time.perf_counter() - t0)
            for p in POLICIES:
                kw = {"weight_offset": 1.0} if p == "gemma" else {}
                t0 = time.perf_counter()
                _, ctx = fwd(x, *params, casting=p, backend=args.backend, **kw)
                t1 = time.perf_counter()
                bwd(dy, ctx)
                t2 = time.perf_counter()
                times[p]["fwd"].append(t1 - t0)
                times[p]["bwd"].append(t2 - t1)
        med = {p: {k: statistics.median(v) for k, v in d.items()} for p, d in times.items()}
        base = med["fp32"]
        copy = statistics.median(copies)
        gb = 2 * x.nbytes / copy / 1e9
        print(f"\n{op} (the same-size copy, timed in the same rounds: {1e3 * copy:.2f} ms, {gb:.1f} GB/s)")
        print(f"{'':{len(op) + 2}}policy    fwd ms   bwd ms   fwd / fp32   bwd / fp32   fwd GB/s")
        for p in POLICIES:
            m = med[p]
            gbs = 2 * x.nbytes / m["fwd"] / 1e9
            print(
                f"{'':{len(op) + 2}}{p:8s} {1e3 * m['fwd']:8.2f} {1e3 * m['bwd']:8.2f} "
                f"{m['fwd'] / base['fwd']:12.2f} {m['bwd'] / base['bwd']:12.2f} {gbs:10.2f}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
