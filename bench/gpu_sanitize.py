"""Every op's CuPy forward and backward once per dtype and shape, for ``compute-sanitizer`` to watch.

    compute-sanitizer --tool memcheck --error-exitcode 9 python bench/gpu_sanitize.py [--quick]

Runs each op of :data:`pynorm.ops.SPECS` (its first test case and its default options) on the ``cupy``
backend: forward, then backward with a random ``dy``, for float32, bfloat16, float16 and float64 ``x`` at a
few shapes that reach different launch paths (a hidden size of 1, an odd one, a warp's, a block's, a wide
row). The sanitizer reports out-of-bounds and misaligned accesses, uninitialized reads (``initcheck``) and
races (``racecheck``); this script only makes the launches and compares nothing but finiteness (the test
suites compare with the reference). Prints one line per op with the launches made and any exception.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy
import ml_dtypes
import numpy as np
from gpu_oracle import to_dev  # (bench/, beside this script)

import pynorm
from pynorm import ops


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="float32 and bfloat16 only, fewer shapes")
    ap.add_argument("--ops", default="", help="comma-separated op names (default: all)")
    a = ap.parse_args()

    dtypes = ("float32", "bfloat16") if a.quick else ("float32", "bfloat16", "float16", "float64")
    rows_shapes = [(3, 1), (5, 33), (4, 1024), (2, 5000)]
    if not a.quick:
        rows_shapes += [(7, 257), (1, 70000)]
    chan_shapes = [(2, 4, 3), (3, 8, 5, 7)] if a.quick else [(2, 4, 3), (3, 8, 5, 7), (2, 4, 1000)]
    names = [n for n in ops.SPECS if not a.ops or n in a.ops.split(",")]
    failures = 0
    for name in names:
        spec = ops.SPECS[name]
        fwd = spec.generic_forward()
        bwd = getattr(pynorm, f"{name}_backward")
        conv = dict(spec.cases[0]) if spec.cases else {}
        launches = 0
        err = None
        for dt_name in dtypes:
            dt = np.dtype(ml_dtypes.bfloat16) if dt_name == "bfloat16" else np.dtype(dt_name)
            shapes = chan_shapes if spec.layout == "channels" else rows_shapes
            for shape in shapes:
                rng = np.random.default_rng(0)
                axis = 1 if spec.layout == "channels" else -1
                try:
                    x = rng.standard_normal(shape).astype(dt)
                    args = spec.example_args(shape, axis % len(shape), dt, rng, 3, conv)
                    kw = {"backend": "cupy", **conv}
                    if spec.layout == "rows":
                        kw["axis"] = -1
                    out, ctx = fwd(to_dev(x), *[to_dev(v) for v in args], **kw)
                    y = out[0] if isinstance(out, tuple) else out
                    dy = to_dev(rng.standard_normal(tuple(y.shape)).astype(np.dtype(y.dtype)))
                    grads = bwd(dy, ctx)
                    cupy.cuda.runtime.deviceSynchronize()
                    for g in (y, *grads):
                        if g is not None and g.size and not bool(cupy.isfinite(g.astype(cupy.float32)).any()):
                            raise AssertionError(f"no finite value in an output of shape {tuple(g.shape)}")
                    launches += 1
                except Exception:  # report and go on: one op's failure must not hide the others'
                    failures += 1
                    err = f"{dt_name} {shape}: " + traceback.format_exc(limit=3).strip().splitlines()[-1]
                    print(f"   {name} {err}", flush=True)
        print(f"{name:28s} {launches} forward+backward calls{'' if err is None else '  (FAILED some)'}", flush=True)
    print(f"done: {failures} failed calls")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
