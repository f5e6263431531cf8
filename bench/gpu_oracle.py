"""``pynorm check`` of the ``cupy`` backend: every op's CuPy kernels against the reference over the oracle's grid.

    python bench/gpu_oracle.py [--grid default|quick] [--ops layer_norm,...] [--backend cupy]

The oracle (``docs/oracle.md``) checks a user's implementation; here the user is pynorm's own ``cupy`` backend
behind the documented calling convention (NumPy in, NumPy out: each array is copied to the device, the op runs
there, the results come back). Every cell of the grid -- the ``huge``, ``tiny``, ``offset`` and ``constant``
inputs of every dtype included -- is compared in ulps at the terms' magnitude. Prints one line per op and the
table of any failing cells; exit status 1 when a cell fails. (On the CPU execution harness, ``--backend cupy``
after ``tests.cuda_cpu.install()``, it checks this script.)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

import pynorm
from pynorm.ops import SPECS
from pynorm.oracle import check

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def to_dev(a: Any) -> Any:
    import cupy

    if not isinstance(a, np.ndarray):
        return a
    a = np.ascontiguousarray(a)
    if a.dtype.kind == "f" or a.dtype.name == "bfloat16":  # (bfloat16 through an integer view)
        return cupy.asarray(a.view(_UINT[a.itemsize])).view(a.dtype)
    return cupy.asarray(a)


def to_host(a: Any) -> Any:
    import cupy

    if isinstance(a, tuple):
        return tuple(to_host(v) for v in a)
    if a is None or not isinstance(a, cupy.ndarray):
        return a
    if a.dtype.kind == "f" or a.dtype.name == "bfloat16":
        return cupy.asnumpy(cupy.ascontiguousarray(a.view(_UINT[a.dtype.itemsize]))).view(a.dtype)
    return cupy.asnumpy(a)


def as_user(op: str, backend: str) -> tuple[Any, Any]:
    spec = SPECS[op]
    public, fwd, bwd = (getattr(pynorm, n) for n in (op, f"{op}_forward", f"{op}_backward"))
    kinds = [*(i.kind for i in spec.inputs), *(p.kind for p in spec.params)]

    def where(args: tuple[Any, ...]) -> dict[str, Any]:
        """The normalized trailing axes, as the oracle's calling convention says: after a row index's dims (or a
        condition's leading ones), else a feature parameter's dims (a table's but its first)."""
        if spec.layout != "rows":
            return {}
        arrays = [(k, a) for k, a in zip(kinds, args, strict=False) if isinstance(a, np.ndarray)]
        for k, a in arrays:
            if k == "row_index":
                return {"axis": a.ndim}
            if k == "cond":
                return {"axis": a.ndim - 1}
        for k, a in arrays:
            if k == "feature":
                return {"axis": -a.ndim}
            if k == "table":
                return {"axis": -(a.ndim - 1)}
        return {}

    def forward(x: Any, *args: Any, **kw: Any) -> Any:
        kw = {k: to_dev(v) for k, v in kw.items()}
        return to_host(public(to_dev(x), *(to_dev(a) for a in args), backend=backend, **where(args), **kw))

    def backward(dy: Any, x: Any, *args: Any, **kw: Any) -> Any:
        kw = {k: to_dev(v) for k, v in kw.items()}
        _, ctx = fwd(to_dev(x), *(to_dev(a) for a in args), backend=backend, **where(args), **kw)
        return tuple(to_host(g) for g in bwd(to_dev(dy), ctx))

    return forward, backward


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--grid", default="default", choices=("default", "quick"))
    ap.add_argument("--ops", default="")
    ap.add_argument("--backend", default="cupy")
    a = ap.parse_args()
    ops = [o for o in SPECS if not a.ops or o in a.ops.split(",")]
    failed = 0
    for op in ops:
        t0 = time.perf_counter()
        fwd, bwd = as_user(op, a.backend)
        try:
            report = check(op, fwd, bwd, grid=a.grid)
        except Exception as exc:  # one op's error must not hide the others'
            failed += 1
            print(f"{op:24s} ERROR {exc!r}", flush=True)
            continue
        cells = len(report.results)
        verdict = "passed" if report.passed else "FAILED"
        print(f"{op:24s} {verdict}: {cells} cells, {time.perf_counter() - t0:.1f} s", flush=True)
        if not report.passed:
            failed += 1
            print(str(report), flush=True)
    print(f"done: {failed} of {len(ops)} ops failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
