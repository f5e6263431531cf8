"""Benchmark pynorm's CuPy kernels on a GPU against copy bandwidth, PyTorch and (if present) Liger.

For LayerNorm and RMSNorm (with weight, and bias for LayerNorm), float32 and bfloat16, at
4096x4096, 16384x8192, 65536x1024 and 1024x65536 (``--shapes`` to change), times
forward, backward and forward+backward with CUDA events (median of ``--iters`` runs after
warm-up, rotating among several input sets so that no run is served from L2), and reports

* the effective bandwidth: the fewest bytes each pass must move (forward: read x, write y;
  backward: read x and dy, write dx; parameters and per-row statistics neglected) over
  the time, and that as a fraction of the device-to-device copy bandwidth measured in the
  same run (bytes read + bytes written);
* the time of ``torch.nn.functional.layer_norm`` / ``rms_norm`` (eager, autograd) and of
  Liger-Kernel's Triton kernels where ``liger_kernel`` imports, and pynorm's speed-up.

It also checks pynorm's outputs against PyTorch's on each benchmark shape (max abs
difference, reported). Prints a short table last; ``--json PATH`` (default
``$OUT/bench_gpu.json`` when ``OUT`` is set) writes every number. Needs cupy; torch and
liger_kernel are optional.

    python bench/bench_gpu.py [--iters 20] [--shapes 4096x4096,1024x65536] [--dtypes float32]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy
import ml_dtypes
import numpy as np

from pynorm import ops
from pynorm.backends.cupy import _loader, stats

try:
    import torch
    import torch.nn.functional as F

    HAVE_TORCH = torch.cuda.is_available()
except Exception:  # torch missing or without CUDA
    torch = None  # type: ignore[assignment]
    HAVE_TORCH = False

try:
    from liger_kernel.ops.layer_norm import LigerLayerNormFunction
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    HAVE_LIGER = HAVE_TORCH
except Exception:
    HAVE_LIGER = False

SHAPES = [(4096, 4096), (16384, 8192), (65536, 1024), (1024, 65536)]
DTYPES = ["float32", "bfloat16"]
L2_BYTES = 60 << 20


def np_dtype(name: str) -> np.dtype:
    return np.dtype(ml_dtypes.bfloat16) if name == "bfloat16" else np.dtype(name)


def cupy_random(shape: tuple[int, ...], dt: str, scale: float = 1.0, offset: float = 0.0) -> cupy.ndarray:
    """Random data of ``dt`` made without CuPy bfloat16 arithmetic (bf16 by truncating float32 bits)."""
    f = cupy.random.standard_normal(shape, dtype=cupy.float32) * scale + offset
    if dt == "bfloat16":
        return (f.view(cupy.uint32) >> 16).astype(cupy.uint16).view(np_dtype(dt))
    return f.astype(dt)


def to_torch(a: cupy.ndarray) -> Any:
    """Zero-copy view of a CuPy array as a torch tensor (bfloat16 through an int16 view)."""
    if a.dtype == np_dtype("bfloat16"):
        return torch.from_dlpack(a.view(cupy.int16)).view(torch.bfloat16)
    return torch.from_dlpack(a)


def time_cupy(fn, sets: int, iters: int, warmup: int = 3) -> float:
    """Median milliseconds of ``fn(i)`` (i rotates over input sets), timed with CUDA events on CuPy's stream."""
    for i in range(warmup):
        fn(i % sets)
    cupy.cuda.get_current_stream().synchronize()
    times = []
    start, stop = cupy.cuda.Event(), cupy.cuda.Event()
    for i in range(iters):
        start.record()
        fn(i % sets)
        stop.record()
        stop.synchronize()
        times.append(cupy.cuda.get_elapsed_time(start, stop))
    return statistics.median(times)


def time_torch(fn, sets: int, iters: int, warmup: int = 3) -> float:
    for i in range(warmup):
        fn(i % sets)
    torch.cuda.synchronize()
    times = []
    for i in range(iters):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i % sets)
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 2 << 30, iters: int = 20) -> float:
    """Device-to-device copy bandwidth in GB/s, counting bytes read plus bytes written."""
    src = cupy.empty(nbytes, dtype=cupy.uint8)
    src.fill(1)
    dst = cupy.empty_like(src)
    stream = cupy.cuda.get_current_stream()

    def copy(_: int) -> None:
        cupy.cuda.runtime.memcpyAsync(
            dst.data.ptr, src.data.ptr, nbytes, cupy.cuda.runtime.memcpyDeviceToDevice, stream.ptr
        )

    ms = time_cupy(copy, 1, iters)
    return 2 * nbytes / ms / 1e6


def bench_case(op: str, shape: tuple[int, int], dt: str, iters: int) -> dict[str, Any]:
    rows, h = shape
    itemsize = np_dtype(dt).itemsize
    tensor_bytes = rows * h * itemsize
    sets = max(2, min(8, -(-4 * L2_BYTES // tensor_bytes)))
    xs = [cupy_random(shape, dt) for _ in range(sets)]
    dys = [cupy_random(shape, dt) for _ in range(sets)]
    mod = stats.OP_IMPLS[op]
    spec = ops.SPECS[op]
    eps = 1e-5
    params = tuple(cupy_random((h,), dt, 0.1, p.init) for p in spec.params)  # weights near 1, biases near 0
    w, b = params[0], (params[1] if len(params) > 1 else None)
    ctxs = [mod.forward(xs[i], *params, eps=eps)[1] for i in range(sets)]
    res: dict[str, Any] = {"op": op, "shape": f"{rows}x{h}", "dtype": dt}

    def fwd(i: int) -> None:
        mod.forward(xs[i], *params, eps=eps)

    def bwd(i: int) -> None:
        mod.backward(dys[i], ctxs[i])

    def fwdbwd(i: int) -> None:
        _, ctx = mod.forward(xs[i], *params, eps=eps)
        mod.backward(dys[i], ctx)

    res["pynorm_ms"] = {
        "fwd": time_cupy(fwd, sets, iters),
        "bwd": time_cupy(bwd, sets, iters),
        "fwd+bwd": time_cupy(fwdbwd, sets, iters),
    }
    moved = {"fwd": 2 * tensor_bytes, "bwd": 3 * tensor_bytes, "fwd+bwd": 5 * tensor_bytes}
    res["pynorm_GBps"] = {k: moved[k] / v / 1e6 for k, v in res["pynorm_ms"].items()}

    if HAVE_TORCH:
        tx = [to_torch(x).requires_grad_(True) for x in xs]
        tdy = [to_torch(d) for d in dys]
        tw = to_torch(w).requires_grad_(True)
        tb = to_torch(b).requires_grad_(True) if b is not None else None

        def tf(i: int) -> Any:
            if op == "layer_norm":
                return F.layer_norm(tx[i], (h,), tw, tb, eps)
            return F.rms_norm(tx[i], (h,), tw, eps)

        inputs = [p for p in (tw, tb) if p is not None]
        touts = [tf(i) for i in range(sets)]

        def t_bwd(i: int) -> None:
            torch.autograd.grad(touts[i], [tx[i], *inputs], tdy[i], retain_graph=True)

        def t_fwdbwd(i: int) -> None:
            torch.autograd.grad(tf(i), [tx[i], *inputs], tdy[i])

        with torch.no_grad():
            fwd_ms = time_torch(lambda i: tf(i), sets, iters)
        res["torch_ms"] = {
            "fwd": fwd_ms,
            "bwd": time_torch(t_bwd, sets, iters),
            "fwd+bwd": time_torch(t_fwdbwd, sets, iters),
        }
        # agreement with torch on this shape
        y, ctx = mod.forward(xs[0], *params, eps=eps)
        g = mod.backward(dys[0], ctx)
        ty = tf(0)
        tg = torch.autograd.grad(ty, [tx[0], *inputs], tdy[0])
        res["max_abs_diff_vs_torch"] = {
            "y": float((to_torch(y).float() - ty.detach().float()).abs().max()),
            "dx": float((to_torch(g[0]).float() - tg[0].float()).abs().max()),
            "dweight": float((to_torch(g[1]).float() - tg[1].float()).abs().max()),
        }
        del touts
        if HAVE_LIGER:
            try:
                res["liger_ms"] = bench_liger(op, tx, tdy, tw, tb, eps, sets, iters)
            except Exception as exc:  # an API change in liger_kernel must not stop the run
                res["liger_error"] = repr(exc)
    return res


def bench_liger(op, tx, tdy, tw, tb, eps, sets, iters) -> dict[str, float]:
    def lf(i: int) -> Any:
        if op == "layer_norm":
            return LigerLayerNormFunction.apply(tx[i], tw, tb, eps)
        return LigerRMSNormFunction.apply(tx[i], tw, eps)

    inputs = [p for p in (tw, tb) if p is not None]
    outs = [lf(i) for i in range(sets)]
    with torch.no_grad():
        f = time_torch(lf, sets, iters)
    b = time_torch(lambda i: torch.autograd.grad(outs[i], [tx[i], *inputs], tdy[i], retain_graph=True), sets, iters)
    fb = time_torch(lambda i: torch.autograd.grad(lf(i), [tx[i], *inputs], tdy[i]), sets, iters)
    return {"fwd": f, "bwd": b, "fwd+bwd": fb}


def table(results: list[dict[str, Any]], copy_gbps: float) -> str:
    head = (
        f"{'op':10s} {'dtype':8s} {'shape':11s} {'pass':7s} {'ms':>7s} {'GB/s':>6s} {'%copy':>5s} "
        f"{'torch ms':>8s} {'x torch':>7s} {'liger ms':>8s}"
    )
    lines = [f"device-to-device copy: {copy_gbps:.0f} GB/s (read + write)", head, "-" * len(head)]
    for r in results:
        for p in ("fwd", "bwd", "fwd+bwd"):
            ms = r["pynorm_ms"][p]
            gbps = r["pynorm_GBps"][p]
            t = r.get("torch_ms", {}).get(p)
            lg = r.get("liger_ms", {}).get(p)
            lines.append(
                f"{r['op']:10s} {r['dtype']:8s} {r['shape']:11s} {p:7s} {ms:7.3f} {gbps:6.0f} {gbps / copy_gbps:5.0%} "
                f"{(f'{t:8.3f}' if t else '       -')} {(f'{t / ms:7.2f}' if t else '      -')} "
                f"{(f'{lg:8.3f}' if lg else '       -')}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--shapes", default=",".join(f"{r}x{h}" for r, h in SHAPES))
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--ops", default="layer_norm,rms_norm")
    out_dir = os.environ.get("OUT")
    ap.add_argument("--json", default=os.path.join(out_dir, "bench_gpu.json") if out_dir else None)
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    dev = cupy.cuda.runtime.getDeviceProperties(cupy.cuda.runtime.getDevice())
    name = dev["name"].decode() if isinstance(dev["name"], bytes) else str(dev["name"])
    print(
        f"device: {name}, {dev['multiProcessorCount']} SMs; cupy {cupy.__version__}; "
        f"torch {torch.__version__ if HAVE_TORCH else 'absent'}; liger {'present' if HAVE_LIGER else 'absent'}"
    )
    n = _loader.warm_up()
    print(f"compiled / loaded {n} kernel modules in {time.perf_counter() - t0:.1f}s")
    copy_gbps = copy_bandwidth()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    results = []
    for op in args.ops.split(","):
        for dt in args.dtypes.split(","):
            for shape in shapes:
                r = bench_case(op, shape, dt, args.iters)  # type: ignore[arg-type]
                results.append(r)
                print(json.dumps(r), flush=True)
                cupy.get_default_memory_pool().free_all_blocks()
                if HAVE_TORCH:
                    torch.cuda.empty_cache()
    copy_after = copy_bandwidth()
    report = {
        "device": name,
        "copy_GBps": copy_gbps,
        "copy_GBps_after": copy_after,
        "results": results,
        "seconds": time.perf_counter() - t0,
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=1))
    print(f"\ncopy bandwidth before/after: {copy_gbps:.0f}/{copy_after:.0f} GB/s; total {report['seconds']:.0f}s")
    print(table(results, copy_gbps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
