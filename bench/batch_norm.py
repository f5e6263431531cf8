"""BatchNorm on the numba backend against a same-size copy and PyTorch: ``python bench/batch_norm.py [--shape N C H W]
[--repeats R] [--threads T] [--no-torch]``.

Times the training forward and forward + backward of ``pynorm.batch_norm`` (float32, weight and bias, running
statistics) interleaved with a same-size ``np.copyto`` (one thread: NumPy's copy) and, where requested, a copy split
over the same threads as the kernels, so every figure is compared with the copy measured next to it. Bytes moved: a
forward reads ``x`` and writes ``y`` (2 arrays), forward + backward also reads ``dy`` and ``x`` and writes ``dx``
(5 arrays); "% of copy" is the op's bandwidth over the copy's (2 arrays). PyTorch's ``F.batch_norm`` with autograd
runs in its own process (``torch.set_num_threads`` to the same count), medians over the same number of calls.
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _median(times: list[float]) -> float:
    return statistics.median(times)


def _torch_child(shape: tuple[int, ...], repeats: int, threads: int) -> None:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    x = torch.randn(*shape, dtype=torch.float32, requires_grad=True)
    w = torch.ones(shape[1], requires_grad=True)
    b = torch.zeros(shape[1], requires_grad=True)
    rm, rv = torch.zeros(shape[1]), torch.ones(shape[1])
    dy = torch.randn(*shape)
    fwd, both = [], []
    for _ in range(repeats + 2):
        t0 = time.perf_counter()
        with torch.no_grad():
            F.batch_norm(x, rm, rv, w, b, training=True, momentum=0.1, eps=1e-5)
        t1 = time.perf_counter()
        y = F.batch_norm(x, rm, rv, w, b, training=True, momentum=0.1, eps=1e-5)
        y.backward(dy)
        t2 = time.perf_counter()
        x.grad = w.grad = b.grad = None
        fwd.append(t1 - t0)
        both.append(t2 - t1)
    print(json.dumps({"fwd": _median(fwd[2:]), "fwd_bwd": _median(both[2:])}))


def _torch(shape: tuple[int, ...], repeats: int, threads: int) -> dict[str, float] | None:
    cmd = [sys.executable, __file__, "--torch-child", "--repeats", str(repeats), "--threads", str(threads),
           "--shape", *map(str, shape)]  # fmt: skip
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        print(f"PyTorch run failed: {exc}", file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


def run(shape: tuple[int, ...], repeats: int, threads: int | None) -> dict[str, Any]:
    import pynorm
    from pynorm.backends.numba._threads import launch

    if threads is not None:
        pynorm.set_num_threads(threads)
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape, dtype=np.float32)
    dy = rng.standard_normal(shape, dtype=np.float32)
    c = shape[1]
    w, b = np.ones(c, np.float32), np.zeros(c, np.float32)
    rm, rv = np.zeros(c, np.float32), np.ones(c, np.float32)
    dst = np.empty_like(x)
    flat_src, flat_dst = x.reshape(-1), dst.reshape(-1)

    def copy_split() -> None:  # the copy on the kernels' threads (the numba pool), contiguous spans
        n = flat_src.size
        parts = 64
        launch(_copy_span, n, parts, flat_src, flat_dst, n, parts)

    def fwd() -> Any:
        return pynorm.batch_norm_forward(x, w, b, running_mean=rm, running_var=rv, training=True, backend="numba")

    def fwd_bwd() -> None:
        _, ctx = fwd()
        pynorm.batch_norm_backward(dy, ctx)

    fwd_bwd()  # compile / warm the caches
    times: dict[str, list[float]] = {"copy": [], "copy_threads": [], "fwd": [], "fwd_bwd": []}
    for _ in range(repeats):
        for name, f in (("copy", lambda: np.copyto(dst, x)), ("copy_threads", copy_split), ("fwd", fwd),
                        ("fwd_bwd", fwd_bwd)):  # fmt: skip
            t0 = time.perf_counter()
            f()
            times[name].append(time.perf_counter() - t0)
    med = {k: _median(v) for k, v in times.items()}
    return {"shape": shape, "threads": pynorm.get_num_threads() if hasattr(pynorm, "get_num_threads") else threads,
            "median_s": med, "bytes": x.nbytes}  # fmt: skip


def _copy_span(src: Any, dst: Any, n: int, parts: int, lo: int, hi: int) -> None:
    a, z = n * lo // parts, n * hi // parts
    np.copyto(dst[a:z], src[a:z])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=int, nargs="+", default=[64, 256, 32, 32])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--torch-child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    shape = tuple(args.shape)
    if args.torch_child:
        _torch_child(shape, args.repeats, args.threads or os.cpu_count() or 1)
        return 0
    res = run(shape, args.repeats, args.threads)
    med, nbytes = res["median_s"], res["bytes"]
    threads = args.threads or (os.cpu_count() or 1)
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    print(f"BatchNorm training, float32 {shape}, {threads} thread(s), {args.repeats} interleaved calls each "
          f"(medians); load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}")  # fmt: skip
    copy_bw = 2 * nbytes / med["copy"]
    copy_t_bw = 2 * nbytes / med["copy_threads"]
    print(f"  np.copyto          {med['copy'] * 1e3:8.2f} ms  {copy_bw / 1e9:6.1f} GB/s")
    print(f"  copy on the pool   {med['copy_threads'] * 1e3:8.2f} ms  {copy_t_bw / 1e9:6.1f} GB/s")
    for name, arrays in (("fwd", 2), ("fwd_bwd", 5)):
        bw = arrays * nbytes / med[name]
        print(f"  {name:18s} {med[name] * 1e3:8.2f} ms  {bw / 1e9:6.1f} GB/s  {100 * bw / copy_bw:5.0f}% of np.copyto"
              f"  {100 * bw / copy_t_bw:5.0f}% of the pool's copy")  # fmt: skip
    if not args.no_torch:
        try:
            import importlib.util

            have = importlib.util.find_spec("torch") is not None
        except Exception:
            have = False
        tr = _torch(shape, args.repeats, threads) if have else None
        if tr is not None:
            for name in ("fwd", "fwd_bwd"):
                print(f"  torch {name:12s} {tr[name] * 1e3:8.2f} ms  (pynorm {tr[name] / med[name]:.2f}x faster)")
        else:
            print("  PyTorch: not installed (or failed)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
