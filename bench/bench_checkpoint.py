"""Peak activation memory of a 24-layer stack with and without gradient checkpointing (tracemalloc).

    python bench/bench_checkpoint.py [--layers 24] [--batch 8] [--seq 64] [--width 64] [--backend numba]

Measures, for one forward + backward of :class:`pynorm.blocks.Stack`, the peak of the memory NumPy
allocates above what is held before the forward (parameters, gradients, the input): i.e. the
activations kept for backward plus the backward's temporaries. Checkpointing keeps each block's
input only and recomputes the block's forward in backward; the gradients must be bitwise equal.
Exits non-zero if the peak does not drop at least 3x or the gradients differ.
"""

from __future__ import annotations

import argparse
import sys
import time
import tracemalloc
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pynorm, not an installed one

from pynorm.blocks import Stack


def measure(stack: Stack, x: np.ndarray, dy: np.ndarray, checkpoint: bool) -> tuple[int, float, dict[str, np.ndarray]]:
    stack.zero_grad()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    tracemalloc.reset_peak()
    t0 = time.perf_counter()
    y, ctx = stack.forward(x, checkpoint=checkpoint)
    dx = stack.backward(dy, ctx)
    seconds = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    grads = {n: o.grads[k].copy() for n, o, k in stack.named_parameters()}
    grads["dx"] = dx
    del y, ctx
    return peak, seconds, grads


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--placement", default="pre")
    ap.add_argument("--backend", default=None, help="numpy or numba (default: the automatic choice)")
    args = ap.parse_args(argv)
    stack = Stack(args.layers, args.width, 4, 4 * args.width, placement=args.placement, qk_norm="layer",
                  causal=True, rng=0, backend=args.backend, record=False)  # fmt: skip
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch, args.seq, args.width)).astype(np.float32)
    dy = rng.standard_normal(x.shape).astype(np.float32)
    measure(stack, x, dy, False)  # warm-up: JIT compilation and first-call allocations stay out of the numbers
    full, t_full, g_full = measure(stack, x, dy, False)
    ck, t_ck, g_ck = measure(stack, x, dy, True)
    same = all(np.array_equal(g_full[n], g_ck[n]) for n in g_full)
    ratio = full / ck
    be = args.backend or "automatic choice"
    print(f"{args.layers}-layer {args.placement} stack, x {args.batch}x{args.seq}x{args.width} float32 "
          f"({x.nbytes / 2**20:.2f} MiB per block input), backend {be}")  # fmt: skip
    print(f"{'':16s} {'peak MiB':>9s} {'seconds':>8s}")
    print(f"{'no checkpoint':16s} {full / 2**20:9.2f} {t_full:8.3f}")
    print(f"{'checkpoint':16s} {ck / 2**20:9.2f} {t_ck:8.3f}")
    print(f"peak activation memory ratio (no checkpoint / checkpoint): {ratio:.2f}x; "
          f"time ratio {t_ck / t_full:.2f}x; gradients bitwise equal: {same}")  # fmt: skip
    ok = same and ratio >= 3.0
    if not ok:
        print("FAILED: " + ("gradients differ" if not same else f"ratio {ratio:.2f} < 3"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
