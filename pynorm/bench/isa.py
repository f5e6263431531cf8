"""The numba backend on both instruction sets: AVX-512 and AVX2.

numba compiles for the CPU it runs on; ``NUMBA_CPU_NAME`` and ``NUMBA_CPU_FEATURES`` (both: the name alone keeps
the host's features, AVX-512 included) make it compile for another one this CPU can run. This module runs one
worker process per instruction set and reports, for the element-wise ops whose math is
:mod:`pynorm.backends.numba._vmath` (DyT's tanh, PowerNorm's signed power) and for LayerNorm and a copy as
yardsticks:

* the widest float vector of each kernel's loops (``<N x float>`` in numba's LLVM IR: 16 lanes on AVX-512, 8 on
  AVX2; 1 would mean a scalar loop, a libm call in it);
* the time per element of a forward and a forward + backward, one thread, ``--rows x --hidden`` float32 (median of
  ``--repeat`` calls), and its ratio to the same-run copy.

Run: ``python -m pynorm.bench.isa [--rows 2048 --hidden 4096 --repeat 9]`` (``--widths``: the vector widths alone,
no timing). An AVX2-only machine can measure its own
ISA only (a worker for AVX-512 there fails to start and is reported as such).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

#: the features of an AVX2 CPU without AVX-512 (Haswell's), for NUMBA_CPU_FEATURES
AVX2_FEATURES = (
    "+64bit,+sse,+sse2,+sse3,+ssse3,+sse4.1,+sse4.2,+avx,+avx2,+fma,+f16c,+popcnt,+bmi,+bmi2,+lzcnt,+movbe,"
    "+cx16,+fxsr,+xsave,+xsaveopt,+pclmul,+aes,+rdrnd,+fsgsbase,+sahf,+cmov,+mmx,+x87,+crc32"
)

#: the environment of a process whose numba compiles for AVX2 without AVX-512, by instruction set
ISAS = {"host": {}, "avx2": {"NUMBA_CPU_NAME": "haswell", "NUMBA_CPU_FEATURES": AVX2_FEATURES}}


def vector_widths() -> dict[str, int]:
    """The widest ``<N x float>`` vector in the LLVM IR of each of :mod:`pynorm.backends.numba._vmath`'s array
    forms (compiled here, for this process's CPU settings); 1: no float vector, a scalar loop."""
    import numpy as np

    from pynorm.backends.numba import _vmath as vm

    z = np.linspace(-3.0, 3.0, 64, dtype=np.float32)
    zlo = np.zeros_like(z)
    vm.tanh_f32_array(z, zlo), vm.tanh_sech2_array(z, zlo), vm.exp2_f32_array(z), vm.log2_f32_array(np.abs(z))
    vm.spow_f32_array(z, 0.5)
    forms = {
        "_vmath.tanh_f32": vm.tanh_f32_array,
        "_vmath.tanh_sech2": vm.tanh_sech2_array,
        "_vmath.exp2_f32": vm.exp2_f32_array,
        "_vmath.log2_f32": vm.log2_f32_array,
        "_vmath.spow_f32": vm.spow_f32_array,
    }
    return {k: _width(d) for k, d in forms.items()}


def _width(disp: object) -> int:
    import re

    best = 1
    for sig in disp.signatures:  # type: ignore[attr-defined]
        for n in re.findall(r"<(\d+) x float>", disp.inspect_llvm(sig)):  # type: ignore[attr-defined]
            best = max(best, int(n))
    return best


def _worker(rows: int, hidden: int, repeat: int) -> dict[str, object]:
    import time

    import numpy as np

    import pynorm
    from pynorm.backends.numba import _ew_kernels, _stats_kernels

    rng = np.random.default_rng(0)
    x = rng.standard_normal((rows, hidden)).astype(np.float32)
    w = rng.standard_normal(hidden).astype(np.float32)
    b = rng.standard_normal(hidden).astype(np.float32)
    alpha = np.array([0.7], np.float32)
    dy = rng.standard_normal((rows, hidden)).astype(np.float32)
    y = np.empty_like(x)

    def med(f: object) -> float:
        f()  # type: ignore[operator]
        ts = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            f()  # type: ignore[operator]
            ts.append(time.perf_counter() - t0)
        return sorted(ts)[len(ts) // 2] * 1e9 / x.size

    cases = {
        "copy": (lambda: np.copyto(y, x), None),
        "layer_norm": (lambda: pynorm.layer_norm(x, w, b), lambda: pynorm.layer_norm_forward(x, w, b)),
        "dyt": (lambda: pynorm.dyt(x, alpha, w, b), lambda: pynorm.dyt_forward(x, alpha, w, b)),
        "power_norm": (lambda: pynorm.power_norm(x, w, b, p=0.5), lambda: pynorm.power_norm_forward(x, w, b, p=0.5)),
    }
    times: dict[str, list[float]] = {}
    for name, (fwd, with_ctx) in cases.items():
        times[name] = [med(fwd)]
        if with_ctx is not None:
            bwd = getattr(pynorm, f"{name}_backward")

            def step(with_ctx=with_ctx, bwd=bwd):  # type: ignore[no-untyped-def]
                _, ctx = with_ctx()
                bwd(dy, ctx)

            times[name].append(med(step))

    kernels = {
        "element-wise forward (dyt, power_norm)": _ew_kernels._ew_fwd_span,
        "element-wise backward (dyt, power_norm)": _ew_kernels._ew_bwd_span,
        "layer_norm forward": _stats_kernels._fwd_span,
    }
    import numba

    return {
        "cpu": getattr(numba.config, "CPU_NAME", None) or "host",
        "times": times,
        "widths": {**vector_widths(), **{k: _width(d) for k, d in kernels.items()}},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--widths", action="store_true", help="print this process's vector widths as JSON (no timing)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.widths:
        print(json.dumps(vector_widths()))
        return 0
    if args.worker:
        print(json.dumps(_worker(args.rows, args.hidden, args.repeat)))
        return 0
    import tempfile

    results = {}
    for isa, env in ISAS.items():
        with tempfile.TemporaryDirectory() as cache:  # (a kernel compiled for one ISA is not the other's)
            e = {**os.environ, **env, "NUMBA_NUM_THREADS": "1", "NUMBA_CACHE_DIR": cache}
            cmd = [sys.executable, "-m", "pynorm.bench.isa", "--worker", f"--rows={args.rows}"]
            cmd += [f"--hidden={args.hidden}", f"--repeat={args.repeat}"]
            run = subprocess.run(cmd, env=e, capture_output=True, text=True)
            if run.returncode:
                print(f"{isa}: the worker failed: {run.stderr.strip().splitlines()[-1:]}")
                continue
            results[isa] = json.loads(run.stdout.strip().splitlines()[-1])
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    host = "AVX-512" if "avx512f" in flags else ("AVX2" if "avx2" in flags else "no AVX2")
    print(f"host CPU: {host}; {args.rows} x {args.hidden} float32, one thread, median of {args.repeat}")
    print("\nns per element (ratio to the same run's copy)")
    print("| op | " + " | ".join(f"{i} fwd | {i} fwd+bwd" for i in results) + " |")
    print("|---|" + "---|---|" * len(results))
    names = next(iter(results.values()))["times"] if results else {}
    for name in names:
        cells = []
        for r in results.values():
            t = r["times"][name]
            copy = r["times"]["copy"][0]
            cells += [f"{v:.2f} ({v / copy:.1f}x)" for v in t] + ([""] if len(t) == 1 else [])
        print(f"| {name} | " + " | ".join(cells) + " |")
    print("\nwidest float vector of the loops (lanes)")
    print("| kernel | " + " | ".join(results) + " |")
    print("|---|" + "---|" * len(results))
    for k in next(iter(results.values()))["widths"] if results else {}:
        print(f"| {k} | " + " | ".join(str(r["widths"][k]) for r in results.values()) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
