"""Where a CuPy-backend call's time goes on a GPU: host (Python) time, each kernel's device time, launches.

    python bench/gpu_profile.py [--ops layer_norm,rms_norm] [--shapes 4096x4096,16384x8192] [--dtypes float32]

For each op, shape and dtype, on the backend's own ``forward``/``backward`` (as ``bench/bench_gpu.py`` times them):

* **host us/call**: wall time of 50 calls issued back to back without synchronizing, per call (what the Python
  side costs while the GPU queue fills) and with the final synchronization (``total``): where ``total`` is about
  ``host``, the call is host-bound and its CUDA-event time measures Python, not the kernels;
* **launches**: every kernel launched by one call, its grid, block and dynamic shared memory;
* **device us**: each kernel's device time from the CUDA profiler (CUPTI through ``torch.profiler``; every kernel
  of the process, CuPy's included), averaged over 10 calls, and the device-to-device copy of the same bytes;
* a cProfile of 200 small calls (4 x 8) and of 50 large ones: the host functions that take the time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cupy
import numpy as np

from pynorm.backends.cupy import _host, stats

try:
    import torch
    from torch.profiler import ProfilerActivity, profile

    HAVE_TORCH = torch.cuda.is_available()
except Exception:
    HAVE_TORCH = False


def random(shape, dt):
    if hasattr(cupy, "random"):
        f = cupy.random.standard_normal(shape, dtype=cupy.float32)
    else:  # the CPU execution harness (a check of this script)
        f = cupy.asarray(np.random.default_rng(0).standard_normal(shape, dtype=np.float32))
    if dt == "bfloat16":
        import ml_dtypes

        return (f.view(cupy.uint32) >> 16).astype(cupy.uint16).view(np.dtype(ml_dtypes.bfloat16))
    return f.astype(dt)


def host_time(fn, n=50):
    fn()
    cupy.cuda.runtime.deviceSynchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    cupy.cuda.runtime.deviceSynchronize()
    t2 = time.perf_counter()
    return (t1 - t0) / n * 1e6, (t2 - t0) / n * 1e6


def launches(fn):
    seen = []
    real = _host.launch

    def spy(kernel, grid, block, args, shared_mem=0):
        seen.append((getattr(kernel, "name", "?"), grid, block, shared_mem))
        return real(kernel, grid, block, args, shared_mem)

    _host.launch = spy
    try:
        fn()
    finally:
        _host.launch = real
    return seen


def device_times(fns, n=10):
    """{kernel name: (count, mean us)} of every CUDA kernel that ``fns`` launch (n calls each)."""
    if not HAVE_TORCH:
        return {}
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            for f in fns:
                f()
        cupy.cuda.runtime.deviceSynchronize()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        dev = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if dev and e.count:
            out[e.key] = (e.count, dev / e.count)
    return out


def short(name):
    name = name.replace("pynorm::", "")
    return name if len(name) < 110 else name[:107] + "..."


def profile_case(mod, op, dt, rows, h):
    """Host time, launches and device times of one op's forward and backward at ``rows x h``."""
    x, dy = random((rows, h), dt), random((rows, h), dt)
    params = [random((h,), dt) for _ in mod.spec.params]
    _, ctx = mod.forward(x, *params)

    def fwd():
        mod.forward(x, *params)

    def bwd():
        mod.backward(dy, ctx)

    nbytes = x.nbytes
    src, dst = cupy.empty(2 * nbytes, cupy.uint8), cupy.empty(2 * nbytes, cupy.uint8)

    def copy2():  # the bytes a forward moves: read x, write y
        cupy.cuda.runtime.memcpyAsync(dst.data.ptr, src.data.ptr, nbytes, 3, 0)

    print(f"\n=== {op} {dt} {rows}x{h}")
    for what, f in (("fwd", fwd), ("bwd", bwd)):
        hu, tu = host_time(f)
        print(f"{what}: host {hu:8.1f} us/call, with sync {tu:8.1f} us/call")
        for k in launches(f):
            print(f"   launch {short(k[0])} grid={k[1]} block={k[2]} smem={k[3]}")
    for name, (cnt, us) in sorted(device_times([fwd, bwd, copy2]).items(), key=lambda kv: -kv[1][1]):
        print(f"   device {us:9.1f} us x{cnt:3d}  {short(name)}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", default="layer_norm,rms_norm")
    ap.add_argument("--shapes", default="4096x4096,16384x8192,65536x1024,1024x65536")
    ap.add_argument("--dtypes", default="float32")
    a = ap.parse_args()
    print(f"device: {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}; cupy {cupy.__version__}")
    for op in a.ops.split(","):
        for dt in a.dtypes.split(","):
            for s in a.shapes.split(","):
                rows, h = (int(v) for v in s.split("x"))
                profile_case(stats.OP_IMPLS[op], op, dt, rows, h)
    # host profile of small and large calls
    mod = stats.OP_IMPLS["layer_norm"]
    for rows, h, n in ((4, 8, 200), (4096, 4096, 50)):
        x = random((rows, h), "float32")
        w, b = random((h,), "float32"), random((h,), "float32")
        dy = random((rows, h), "float32")
        _, ctx = mod.forward(x, w, b)
        mod.backward(dy, ctx)
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(n):
            _, ctx = mod.forward(x, w, b)
            mod.backward(dy, ctx)
        pr.disable()
        cupy.cuda.runtime.deviceSynchronize()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(18)
        print(f"\n=== cProfile layer_norm fwd+bwd {rows}x{h}, {n} calls")
        print("\n".join(s.getvalue().splitlines()[:45]))


if __name__ == "__main__":
    main()
