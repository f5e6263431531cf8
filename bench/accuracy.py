"""Measure the reference backend's accuracy against exact (mpmath) LayerNorm and RMSNorm.

For each dtype and input kind, runs ``--cases`` random small problems and reports
the largest error in ulps of the dtype for y, dx, dweight and dbias, each measured
at the magnitude of the terms it is computed from (as the tests do).

    python bench/accuracy.py [--cases 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pynorm
from pynorm.reference import exact
from pynorm.testing import finfo, max_ulp_error
from tests.helpers import DTYPES, dtype, make_rows, term_scales

KINDS = ("normal", "offset", "huge", "tiny", "constant")


def _ulps(actual, ex, dt, scale):
    big = float(finfo(dtype(dt)).max)
    ex = np.where(np.abs(ex) > big, np.copysign(np.inf, ex), ex)
    return max_ulp_error(actual, ex, dt, scale=np.where(np.isinf(ex), 0.0, scale))


def measure(cases: int) -> dict:
    rows = {}
    for op in ("layer_norm", "rms_norm"):
        for dt in DTYPES:
            for kind in KINDS:
                worst = {}
                for seed in range(cases):
                    rng = np.random.default_rng(seed)
                    h = int(rng.integers(1, 24))
                    x = make_rows(kind, (3, h), dt, rng)
                    w = (1 + 0.5 * rng.standard_normal(h)).astype(dtype(dt))
                    b = (0.5 * rng.standard_normal(h)).astype(dtype(dt))
                    dy = rng.standard_normal((3, h)).astype(dtype(dt))
                    if op == "layer_norm":
                        y, c = pynorm.layer_norm_forward(x, w, b, backend="numpy")
                        got = (y, *pynorm.layer_norm_backward(dy, c))
                        ex = exact.layer_norm(x, w, b, dy, 1e-5)
                        sc = term_scales(op, x, {"weight": w, "bias": b}, dy, {"eps": 1e-5})
                        names = ("y", "dx", "dweight", "dbias")
                    else:
                        y, c = pynorm.rms_norm_forward(x, w, backend="numpy")
                        got = (y, *pynorm.rms_norm_backward(dy, c))
                        ex = exact.rms_norm(x, w, dy, 1e-6)
                        sc = term_scales(op, x, {"weight": w}, dy, {"eps": 1e-6})
                        names = ("y", "dx", "dweight")
                    for n, a, e in zip(names, got, ex, strict=True):
                        worst[n] = max(worst.get(n, 0.0), _ulps(a, e, dt, sc[n]))
                rows[f"{op}/{dt}/{kind}"] = worst
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cases", type=int, default=20)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    rows = measure(args.cases)
    print(
        f"{'op/dtype/kind':32s} {'y':>6s} {'dx':>6s} {'dweight':>8s} {'dbias':>6s}   (max ulps over {args.cases} cases)"
    )
    for k, v in rows.items():
        cells = " ".join(
            f"{v.get(n, float('nan')):{w}.2f}" for n, w in (("y", 6), ("dx", 6), ("dweight", 8), ("dbias", 6))
        )
        print(f"{k:32s} {cells}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
