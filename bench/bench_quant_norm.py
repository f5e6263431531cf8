"""The quantization-friendly LayerNorm on the CPU: each input/output mode against baselines from the same run.

For ``rows x hidden`` on the chosen backend (default ``numba``), median of ``--repeat`` timed runs after a
warm-up, of the forward in each mode:

* ``int8 -> int8 (row)``, ``int8 -> int8 (tensor)``, ``int8 -> float32``, ``float32 -> int8 (row)``,
  ``float32 -> float32`` (= ``layer_norm``);
* baselines: ``layer_norm`` on the float32 copy of the same data, and ``numpy.copyto`` of the bytes a mode
  must move at least (its input read + its output written), so each mode is reported as a fraction of copy
  bandwidth and as a ratio to ``layer_norm``;
* the backward (straight-through + LayerNorm's) of ``int8 -> int8 (row)`` against ``layer_norm_backward``.

Run: ``python bench/bench_quant_norm.py [--rows 4096 --hidden 4096] [--repeat 5] [--backend numba] [--json F]``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pynorm, not an installed one

import pynorm


def _median(fn: Callable[[], Any], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _copy_time(nbytes_in: int, nbytes_out: int, repeat: int) -> float:
    """``numpy.copyto`` moving ``max(in, out)`` bytes each way: a floor for a pass that reads ``in`` and writes
    ``out`` (a copy reads and writes the same amount; the larger side is the bound)."""
    n = max(nbytes_in, nbytes_out)
    src, dst = np.ones(n, np.uint8), np.empty(n, np.uint8)
    return _median(lambda: np.copyto(dst, src), repeat)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--backend", default="numba")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    r, h, be = a.rows, a.hidden, a.backend
    x8 = rng.integers(-128, 128, (r, h)).astype(np.int8)
    xs = rng.uniform(0.01, 0.05, r).astype(np.float32)
    xf = (x8 * xs[:, None]).astype(np.float32)
    w = (1 + 0.1 * rng.standard_normal(h)).astype(np.float32)
    b = (0.1 * rng.standard_normal(h)).astype(np.float32)
    n = r * h
    modes: dict[str, tuple[Callable[[], Any], int, int]] = {
        "int8 -> int8 (row)": (
            lambda: pynorm.quant_layer_norm(x8, w, b, x_scale=xs, quantize="row", backend=be), n, n),
        "int8 -> int8 (tensor)": (
            lambda: pynorm.quant_layer_norm(x8, w, b, x_scale=xs, quantize="tensor", backend=be), n, n),
        "int8 -> float32": (lambda: pynorm.quant_layer_norm(x8, w, b, x_scale=xs, backend=be), n, 4 * n),
        "float32 -> int8 (row)": (lambda: pynorm.quant_layer_norm(xf, w, b, quantize="row", backend=be), 4 * n, n),
        "float32 -> float32": (lambda: pynorm.quant_layer_norm(xf, w, b, backend=be), 4 * n, 4 * n),
    }  # fmt: skip
    t_ln = _median(lambda: pynorm.layer_norm(xf, w, b, backend=be), a.repeat)
    results: dict[str, Any] = {"rows": r, "hidden": h, "backend": be, "layer_norm_s": t_ln, "modes": {}}
    print(f"quant_layer_norm on {be}, {r} x {h}; median of {a.repeat}; layer_norm float32: {t_ln * 1e3:.2f} ms")
    print(f"{'mode':24s} {'ms':>8s} {'x layer_norm':>13s} {'% of copy':>10s}")
    for name, (fn, nin, nout) in modes.items():
        t = _median(fn, a.repeat)
        tc = _copy_time(nin, nout, a.repeat)
        results["modes"][name] = {"s": t, "copy_s": tc, "vs_layer_norm": t / t_ln, "of_copy": tc / t}
        print(f"{name:24s} {t * 1e3:8.2f} {t / t_ln:13.2f} {100 * tc / t:9.0f}%")
    (_, _), ctx = pynorm.quant_layer_norm_forward(x8, w, b, x_scale=xs, quantize="row", backend=be)
    _, lctx = pynorm.layer_norm_forward(xf, w, b, backend=be)
    dy = rng.standard_normal((r, h)).astype(np.float32)
    t_qb = _median(lambda: pynorm.quant_layer_norm_backward(dy, ctx), a.repeat)
    t_lb = _median(lambda: pynorm.layer_norm_backward(dy, lctx), a.repeat)
    results["backward"] = {"quant_s": t_qb, "layer_norm_s": t_lb, "ratio": t_qb / t_lb}
    print(f"backward int8 (row): {t_qb * 1e3:.2f} ms = {t_qb / t_lb:.2f} x layer_norm_backward ({t_lb * 1e3:.2f} ms)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
