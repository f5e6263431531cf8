"""Accuracy of the CuPy backend's kernels against the reference, executed on the CPU execution harness.

``python bench/cuda_cpu_accuracy.py`` (needs a C++ compiler and ``pip install "pynorm[kernels]"``):
runs :func:`pynorm.testing.check_conformance` -- every dtype x the hard input kinds x hidden sizes
1, 3, 64, 257, 4097 and 65536 (the fused and the split backward, registers and shared memory) --
on the ``cupy`` backend with the kernels executed by ``tests/cuda_cpu`` and prints, per op,
convention set and dtype, the largest error of each output in ulps of the dtype at the magnitude
of the terms it is computed from. On a GPU the same script measures the GPU (``--gpu``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
CONVENTIONS = {
    "layer_norm": [{}, {"correction": 1}, {"eps_mode": "std"}, {"weight_offset": 1.0, "eps": 0.1}],
    "rms_norm": [{}, {"weight_offset": 1.0}],
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--gpu", action="store_true", help="use the real CuPy (a CUDA device) instead of the harness")
    ap.add_argument("--hidden", type=int, nargs="*", default=[1, 3, 64, 257, 4097, 65536])
    ap.add_argument("--rows", type=int, default=3)
    args = ap.parse_args(argv)
    if not args.gpu:
        sys.path.insert(0, str(ROOT))
        from tests import cuda_cpu

        why = cuda_cpu.unavailable_reason()
        if why is not None:
            print(f"the CPU execution harness cannot run here: {why}", file=sys.stderr)
            return 2
        cuda_cpu.install()
    import cupy

    import pynorm
    from pynorm.testing import check_conformance

    def fwd_of(op: str) -> Any:
        f = getattr(pynorm, f"{op}_forward")

        def fwd(x: np.ndarray, *params: np.ndarray, **conv: Any) -> np.ndarray:
            y, _ = f(cupy.asarray(x), *(cupy.asarray(p) for p in params), backend="cupy", **conv)
            return cupy.asnumpy(y)

        return fwd

    def bwd_of(op: str) -> Any:
        f = getattr(pynorm, f"{op}_forward")
        b = getattr(pynorm, f"{op}_backward")

        def bwd(dy: np.ndarray, x: np.ndarray, *params: np.ndarray, **conv: Any) -> list[np.ndarray]:
            _, ctx = f(cupy.asarray(x), *(cupy.asarray(p) for p in params), backend="cupy", **conv)
            return [cupy.asnumpy(g) for g in b(cupy.asarray(dy), ctx)]

        return bwd

    where = "GPU" if args.gpu else "CPU execution harness"
    print(f"cupy backend on the {where} vs the numpy reference: max error in ulps at the terms' magnitude")
    print(f"(dtypes x kinds normal/offset/huge/tiny/constant x H = {args.hidden}, {args.rows} rows each)\n")
    print(f"{'op':11s} {'conventions':34s} {'dtype':9s} {'y':>7s} {'dx':>7s} {'dweight':>8s} {'dbias':>7s}")
    worst: dict[str, float] = {}
    for op, convs in CONVENTIONS.items():
        for conv in convs:
            report = check_conformance(
                op, fwd_of(op), bwd_of(op), hidden_sizes=tuple(args.hidden), rows=args.rows, conventions=conv
            )
            for dt in ("float16", "bfloat16", "float32", "float64"):
                m = report.max_ulps(dt)
                cells = " ".join(f"{m.get(k, float('nan')):{w}.2f}" for k, w in (("y", 7), ("dx", 7), ("dweight", 8)))
                db = f"{m['dbias']:7.2f}" if "dbias" in m else f"{'-':>7s}"
                print(f"{op:11s} {conv or '{}'!s:34s} {dt:9s} {cells} {db}")
                for k, v in m.items():
                    key = f"{op} {dt} {k}"
                    worst[key] = max(worst.get(key, 0.0), v)
    print("\nworst per op / dtype / output over all conventions:")
    for key, v in worst.items():
        print(f"  {key:28s} {v:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
