"""Every op on a fast backend against the reference: the largest error of each output in ulps.

``python bench/ulp_table.py --backend numba`` (or ``--backend cupy --harness`` for the CuPy
kernels on the CPU execution harness of ``tests/cuda_cpu``; ``--backend cupy`` alone on a GPU).
For every op of :data:`pynorm.ops.SPECS` the backend implements with its own kernels (not the
composite ops), every dtype, the input kinds
``normal`` (N(0, 1)) and the hard ones (``offset`` 1e4 + N(0, 1), ``huge`` near the dtype's max,
``tiny`` near its smallest normal, ``constant`` rows) and hidden sizes 1, 3, 64, 1000 and 20000,
it runs forward and backward with parameters from :meth:`pynorm.ops.OpSpec.example_args` and prints
per (op, dtype, ordinary/hard) the largest error of ``y``, ``dx`` and the other gradients, in ulps
of the output dtype at the magnitude of the terms each is computed from (the op's spec's term
scales, :func:`pynorm.testing.term_scales`) -- the yardstick the tests use.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
KINDS = ("normal", "offset", "huge", "tiny", "constant")
DTYPES = ("float16", "bfloat16", "float32", "float64")


def _flat(spec: Any, x_shape: tuple[int, ...], args: list[Any]) -> dict[str, Any]:
    rows, h = int(np.prod(x_shape[:-1])), x_shape[-1]
    out: dict[str, Any] = {}
    for i, a in zip(spec.inputs, args, strict=False):
        out[i.name] = (
            None if a is None else np.asarray(a).reshape(rows, h) if i.kind == "like_x" else np.asarray(a).reshape(rows)
        )
    for p, a in zip(spec.params, args[len(spec.inputs) :], strict=True):
        if p.kind == "table":
            out[p.name] = np.asarray(a).reshape(a.shape[0], h)
        elif p.kind == "scalar":
            out[p.name] = np.asarray(a).reshape(1)
        else:
            out[p.name] = np.asarray(a).reshape(h)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    ap.add_argument("--backend", default="numba")
    ap.add_argument("--harness", action="store_true", help="cupy: run the kernels on the CPU execution harness")
    ap.add_argument("--hidden", type=int, nargs="*", default=[1, 3, 64, 1000, 20000])
    ap.add_argument("--rows", type=int, default=3)
    ap.add_argument("--ops", nargs="*", default=None)
    args = ap.parse_args(argv)
    if args.harness:
        sys.path.insert(0, str(ROOT))
        from tests import cuda_cpu

        why = cuda_cpu.unavailable_reason()
        if why is not None:
            print(f"the CPU execution harness cannot run here: {why}", file=sys.stderr)
            return 2
        cuda_cpu.install()

    import pynorm
    from pynorm.ops import SPECS
    from pynorm.testing import make_input, max_ulp_error, term_scales

    info = next((b for b in pynorm.list_backends() if b.name == args.backend), None)
    if info is None:
        print(f"no backend {args.backend!r}", file=sys.stderr)
        return 2
    if not info.available:
        print(f"backend {args.backend} unavailable: {info.reason}", file=sys.stderr)
        return 2
    if args.backend == "cupy":
        import cupy

        to_dev, to_host = cupy.asarray, cupy.asnumpy
    else:
        to_dev, to_host = np.asarray, np.asarray
    where = " on the CPU execution harness" if args.harness else ""
    print(f"{args.backend}{where} vs the numpy reference: max error in ulps at the terms' magnitude")
    print(f"(kinds: ordinary = normal; hard = {', '.join(KINDS[1:])}; H = {args.hidden}, {args.rows} rows)\n")
    print(f"{'op':20s} {'dtype':9s} {'inputs':8s} {'y':>8s} {'dx':>8s} {'grads':>8s}  worst gradient")
    rng = np.random.default_rng(0)
    for op, spec in SPECS.items():
        if op not in info.ops or (args.ops and op not in args.ops) or spec.family == "composite":
            continue  # composite ops (Python over these ops and a matrix product) have their own tests
        fwd, bwd = spec.generic_forward(), getattr(pynorm, f"{op}_backward")
        multi = len(spec.outputs) > 1
        for dt_name in DTYPES:
            dt = pynorm._dtypes.dtype_of(dt_name)
            for group in ("ordinary", "hard"):
                worst = {"y": 0.0, "dx": 0.0, "grads": 0.0}
                worst_g = ""
                for kind in ("normal",) if group == "ordinary" else KINDS[1:]:
                    for h in args.hidden:
                        x = make_input(kind, (args.rows, h), dt, rng)
                        a = spec.example_args(x.shape, -1, dt, rng)
                        dy = rng.standard_normal(x.shape).astype(dt)
                        y_r, c_r = fwd(x, *a, backend="numpy")
                        g_r = bwd(dy, c_r)
                        y, c = fwd(to_dev(x), *map(to_dev, a), backend=args.backend)
                        g = bwd(to_dev(dy), c)
                        if multi:
                            y, y_r = y[0], y_r[0]
                        sc = term_scales(op, x.astype(np.float64), _flat(spec, x.shape, a), dy.astype(np.float64), {})
                        worst["y"] = max(worst["y"], max_ulp_error(to_host(y), y_r, scale=sc["y"]))
                        worst["dx"] = max(worst["dx"], max_ulp_error(to_host(g[0]), g_r[0], scale=sc["dx"]))
                        for name, ga, gr in zip(spec.grad_names[1:], g[1:], g_r[1:], strict=True):
                            if gr is None:
                                continue
                            s = np.asarray(sc[name]).reshape(np.shape(gr)) if name in sc else None
                            e = max_ulp_error(to_host(ga), gr, scale=s)
                            if e > worst["grads"]:
                                worst["grads"], worst_g = e, f"{name} ({kind}, H={h})"
                print(
                    f"{op:20s} {dt_name:9s} {group:8s} {worst['y']:8.2f} {worst['dx']:8.2f} {worst['grads']:8.2f}"
                    f"  {worst_g}"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
