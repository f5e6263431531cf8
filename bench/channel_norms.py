"""GroupNorm on the numba backend against a same-size copy, and PyTorch's ``F.group_norm`` with autograd.

    python bench/channel_norms.py [--shape 8,256,64,64] [--groups 32] [--repeat 15] [--threads 2] [--no-torch]

Times, in interleaved rounds (each round: the copy, the forward, the forward + backward), the medians of
``pynorm.group_norm_forward`` (``out=`` given) and of the forward + ``group_norm_backward`` (``dx_out=`` given),
float32, and a same-size ``np.copyto`` (read x, write y). Byte model (as ``python -m pynorm bench``'s): forward
``2N`` elements (read x, write y), forward + backward ``5N`` (also read dy and x, write dx), the copy ``2N``;
``%copy`` is the call's bandwidth over the copy's. PyTorch (``F.group_norm`` forward, forward + backward with
autograd, same threads) runs in a process of its own. Prints the machine's load average before and after.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pynorm, not an installed one


def _median_rounds(calls: dict[str, Any], repeat: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in calls}
    for _ in range(repeat):
        for name, fn in calls.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {k: statistics.median(v) for k, v in times.items()}


def _data(shape: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    rng = np.random.default_rng(0)
    c = shape[1]
    x = rng.standard_normal(shape, dtype=np.float32)
    dy = rng.standard_normal(shape, dtype=np.float32)
    w, b = rng.standard_normal(c, dtype=np.float32), rng.standard_normal(c, dtype=np.float32)
    return x, dy, w, b


def run_pynorm(shape: tuple[int, ...], groups: int, repeat: int, threads: int) -> dict[str, float]:
    import pynorm

    pynorm.set_num_threads(threads)
    x, dy, w, b = _data(shape)
    y, dx, cp = np.empty_like(x), np.empty_like(x), np.empty_like(x)

    def fwd() -> None:
        pynorm.group_norm_forward(x, w, b, num_groups=groups, out=y, backend="numba")

    def fwdbwd() -> None:
        _, ctx = pynorm.group_norm_forward(x, w, b, num_groups=groups, out=y, backend="numba")
        pynorm.group_norm_backward(dy, ctx, dx_out=dx)

    def copy() -> None:
        np.copyto(cp, x)

    for _ in range(3):
        copy(), fwd(), fwdbwd()
    return _median_rounds({"copy": copy, "fwd": fwd, "fwd+bwd": fwdbwd}, repeat)


def run_torch(shape: tuple[int, ...], groups: int, repeat: int, threads: int) -> dict[str, float]:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    x, dy, w, b = (torch.from_numpy(a) for a in _data(shape))
    xg, wg, bg = (a.clone().requires_grad_(True) for a in (x, w, b))

    def fwd() -> None:
        with torch.no_grad():
            F.group_norm(x, groups, w, b, 1e-5)

    def fwdbwd() -> None:
        for a in (xg, wg, bg):
            a.grad = None
        F.group_norm(xg, groups, wg, bg, 1e-5).backward(dy)

    for _ in range(3):
        fwd(), fwdbwd()
    return _median_rounds({"fwd": fwd, "fwd+bwd": fwdbwd}, repeat)


def ulps(backend: str, dt: Any = np.float32) -> list[tuple[str, str, dict[str, float]]]:
    """The largest error of ``backend``'s GroupNorm / InstanceNorm outputs against the reference run in float64 on
    the same (rounded) inputs, in ulps of ``dt`` at the terms' magnitude (the spec's term scales), per input kind."""
    import pynorm
    from pynorm.ops import SPECS
    from pynorm.testing import make_input

    rows: list[tuple[str, str, dict[str, float]]] = []
    cases = [("group_norm", {"num_groups": 4}), ("instance_norm", {})]
    for op, opts in cases:
        spec = SPECS[op]
        for kind in ("normal", "offset", "huge", "tiny", "constant"):
            rng = np.random.default_rng(0)
            x = make_input(kind, (4, 8, 12, 12), dt, rng)
            w, b = (1 + 0.5 * rng.standard_normal(8)).astype(dt), rng.standard_normal(8).astype(dt)
            dy = rng.standard_normal(x.shape).astype(dt)
            f, g = getattr(pynorm, f"{op}_forward"), getattr(pynorm, f"{op}_backward")
            x64, w64, b64, dy64 = (a.astype(np.float64) for a in (x, w, b, dy))
            big = float(np.max(np.abs(x64)))
            m = 2.0 ** np.floor(np.log2(big)) if big > 1e30 else 1.0  # exact float64 reference of huge rows
            y_e, c_e = f(x64 / m, w64, b64, backend="numpy", **{**opts, "eps": 1e-5 / (m * m)})  # (same rows)
            ge = g(dy64, c_e)
            exact = {"y": y_e, "dx": ge.dx / m, "dweight": ge.dweight, "dbias": ge.dbias}
            dev, host = (np.asarray, np.asarray)
            if backend == "cupy":
                import cupy

                dev, host = cupy.asarray, cupy.asnumpy
            y, c = f(dev(x), dev(w), dev(b), backend=backend, **opts)
            gg = g(dev(dy), c)
            got = {k: host(v) for k, v in (("y", y), ("dx", gg.dx), ("dweight", gg.dweight), ("dbias", gg.dbias))}
            n, ch = x.shape[:2]
            sc = spec.term_scales((x64 / m).reshape(n, ch, -1), {"weight": w64, "bias": b64}, dy64.reshape(n, ch, -1),
                                  {**spec.defaults(), **opts})  # fmt: skip
            sc["dx"] = sc["dx"] / m
            out = {}
            for k, e in exact.items():
                a = np.asarray(got[k], np.float64).reshape(e.shape)
                unit = np.spacing(np.abs(np.asarray(sc[k], np.float64).reshape(e.shape)).astype(dt)).astype(np.float64)
                out[k] = float(np.max(np.abs(a - e) / unit))
            rows.append((op, kind, out))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="8,256,64,64")
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--repeat", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--torch-only", action="store_true", help=argparse.SUPPRESS)  # the PyTorch process
    p.add_argument("--ulps", metavar="BACKEND", help="instead: the largest errors against the reference, in ulps")
    a = p.parse_args(argv)
    if a.ulps:
        print(f"{a.ulps}: largest error, float32 ulps at the terms' magnitude, vs the float64 reference")
        for op, kind, e in ulps(a.ulps):
            print(f"  {op:14s} {kind:9s} " + "  ".join(f"{k} {v:6.2f}" for k, v in e.items()))
        return 0
    shape = tuple(int(s) for s in a.shape.split(","))
    if a.torch_only:
        print(json.dumps(run_torch(shape, a.groups, a.repeat, a.threads)))
        return 0
    load0 = os.getloadavg()
    t = run_pynorm(shape, a.groups, a.repeat, a.threads)
    n_bytes = int(np.prod(shape)) * 4
    gbs = {"copy": 2 * n_bytes / t["copy"] / 1e9, "fwd": 2 * n_bytes / t["fwd"] / 1e9,
           "fwd+bwd": 5 * n_bytes / t["fwd+bwd"] / 1e9}  # fmt: skip
    print(f"group_norm {shape} float32 G={a.groups}, numba, {a.threads} threads, median of {a.repeat} rounds")
    print(f"  np.copyto        {t['copy'] * 1e3:8.2f} ms  {gbs['copy']:6.1f} GB/s")
    for ph in ("fwd", "fwd+bwd"):
        print(f"  {ph:16s} {t[ph] * 1e3:8.2f} ms  {gbs[ph]:6.1f} GB/s  {100 * gbs[ph] / gbs['copy']:5.1f} % of copy")
    if not a.no_torch:
        cmd = [sys.executable, __file__, "--shape", a.shape, "--groups", str(a.groups), "--repeat", str(a.repeat),
               "--threads", str(a.threads), "--torch-only"]  # fmt: skip
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            print(f"  torch: not run ({r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode})")
        else:
            tt = json.loads(r.stdout.strip().splitlines()[-1])
            for ph in ("fwd", "fwd+bwd"):
                print(f"  torch {ph:10s} {tt[ph] * 1e3:8.2f} ms  (pynorm {tt[ph] / t[ph]:.2f}x faster)")
    print(f"  load average before {load0[0]:.2f}, after {os.getloadavg()[0]:.2f} ({os.cpu_count()} CPUs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
