"""CPU benchmark of the ``numba`` backend (``python -m pynorm bench``, ``python bench/bench_cpu.py``).

For float32 inputs of shapes 8192x1024, 4096x4096, 2048x8192, 65536x128 and
16x65536 (``--quick``: the same hidden sizes with 1/8 of the rows), in one run:

* the numba backend's LayerNorm and RMSNorm forward, backward and forward +
  backward (output buffers passed as ``out=``/``dx_out=``; the allocating
  forward is timed too), through the public functional API;
* the same-size copy bandwidth with the same number of threads (a row copy
  into a preallocated buffer, on the backend's own thread pool), timed
  *interleaved* with the numba kernels, as the physical limit; ``numpy.copyto`` (one thread) for reference;
* baselines: a naive float32 NumPy implementation (written below), the
  ``numpy`` reference backend, and PyTorch CPU (``torch.nn.functional.layer_norm``
  / ``rms_norm`` with autograd) when torch is importable;
* the first call of each op in a fresh Python process with a warm numba cache
  (and, unless ``--no-cold``, with an empty one), and ``import pynorm`` alone.

Every time is the median of ``--repeat`` calls after a warm-up call.

Byte model (what GB/s counts; ``N = rows * hidden`` elements of 4 bytes; the
``(H,)`` parameters and ``(R,)`` statistics are added too but are negligible):

* copy: read x, write y -> ``2N``;
* forward: read x, write y -> ``2N``;
* backward: read x and dy, write dx -> ``3N`` (LayerNorm's per-row mean and
  rstd, ``dweight``/``dbias`` counted as ``(R + H)``-sized);
* forward + backward: ``5N``.

Write-allocate traffic (a store first reads its cache line) is not counted, for
the copy nor the kernels, so "fraction of copy" compares like with like.
Baselines with calls longer than 50 ms are timed with fewer repeats, and their
forward + backward is the sum of the forward and backward medians (PyTorch:
forward and forward + backward are timed, backward is their difference).

Results go to ``--out`` (``bench_results.json``, ``bench_results.png`` if
matplotlib is installed) and a table on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["SHAPES", "main", "naive_layer_norm", "naive_rms_norm"]

SHAPES: list[tuple[int, int]] = [(8192, 1024), (4096, 4096), (2048, 8192), (65536, 128), (16, 65536)]
OPS = ("layer_norm", "rms_norm")
PHASES = ("fwd", "bwd", "fwd+bwd")
ELEMENT_PASSES = {"copy": 2, "fwd": 2, "bwd": 3, "fwd+bwd": 5}
LN_EPS = 1e-5
RMS_EPS = 1e-6
TARGETS = {"fwd_frac_copy": 0.8, "fwdbwd_frac_copy": 0.7, "vs_naive": 10.0, "ln_vs_torch": 3.0, "rms_vs_torch": 10.0}

_T0 = time.perf_counter()


def _log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# naive NumPy baselines (float32 throughout, the textbook formulas)


def naive_layer_norm(
    x: np.ndarray, w: np.ndarray, b: np.ndarray, eps: float = LN_EPS
) -> tuple[np.ndarray, tuple[Any, ...]]:
    """LayerNorm forward in plain NumPy; returns ``(y, cache)``."""
    mean = x.mean(axis=1, keepdims=True)
    xc = x - mean
    rstd = 1.0 / np.sqrt((xc * xc).mean(axis=1, keepdims=True) + np.float32(eps))
    return xc * rstd * w + b, (x, mean, rstd, w)


def naive_layer_norm_backward(dy: np.ndarray, cache: tuple[Any, ...]) -> tuple[np.ndarray, ...]:
    x, mean, rstd, w = cache
    xhat = (x - mean) * rstd
    g = dy * w
    dx = rstd * (g - g.mean(axis=1, keepdims=True) - xhat * (g * xhat).mean(axis=1, keepdims=True))
    return dx, (dy * xhat).sum(axis=0), dy.sum(axis=0)


def naive_rms_norm(x: np.ndarray, w: np.ndarray, eps: float = RMS_EPS) -> tuple[np.ndarray, tuple[Any, ...]]:
    """RMSNorm forward in plain NumPy; returns ``(y, cache)``."""
    rstd = 1.0 / np.sqrt((x * x).mean(axis=1, keepdims=True) + np.float32(eps))
    return x * rstd * w, (x, rstd, w)


def naive_rms_norm_backward(dy: np.ndarray, cache: tuple[Any, ...]) -> tuple[np.ndarray, ...]:
    x, rstd, w = cache
    xhat = x * rstd
    g = dy * w
    dx = rstd * (g - xhat * (g * xhat).mean(axis=1, keepdims=True))
    return dx, (dy * xhat).sum(axis=0)


# ---------------------------------------------------------------------------
# timing helpers


def _time(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def _median_time(fn: Callable[[], Any], repeat: int, budget_s: float = 1e9) -> tuple[float, int]:
    """Median of up to ``repeat`` timed calls after one warm-up call (fewer if over ``budget_s``)."""
    first = _time(fn)
    n = repeat if first * repeat <= budget_s else max(2, int(budget_s / max(first, 1e-9)))
    ts = [_time(fn) for _ in range(min(n, repeat))]
    return statistics.median(ts), len(ts)


def _copy_kernel() -> Callable[..., Any]:
    """``copy(a, b)``: a row copy into a preallocated buffer, run as the numba backend runs its kernels (a serial
    ``nogil`` function over row spans on :func:`pynorm.backends.numba._threads.launch`'s threads, the same number
    of them). Not numba's ``prange``: its OpenMP threads keep spinning after each copy, taking a core from the
    kernels timed next to it on a small machine."""
    from numba import njit

    from pynorm.backends.numba._threads import launch

    @njit(cache=False, nogil=True)
    def span_copy(a, b, lo, hi):  # type: ignore[no-untyped-def]
        for i in range(lo, hi):
            ar = a[i]
            br = b[i]
            for j in range(ar.shape[0]):
                br[j] = ar[j]

    def copy(a: np.ndarray, b: np.ndarray) -> None:
        launch(span_copy, a.size, a.shape[0], a, b)

    return copy


def _nbytes(phase: str, rows: int, h: int, op: str) -> int:
    n = rows * h * 4
    extra = 4 * h * (2 if op == "layer_norm" else 1)
    if phase in ("bwd", "fwd+bwd"):
        extra += 8 * rows * (2 if op == "layer_norm" else 1) + 4 * h * (2 if op == "layer_norm" else 1)
    return ELEMENT_PASSES[phase] * n + extra


# ---------------------------------------------------------------------------
# one shape


def _bench_numba(
    shape: tuple[int, int], data: dict[str, Any], repeat: int, copy: Callable[..., Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    import pynorm

    x, dy, w, b = data["x"], data["dy"], data["w"], data["b"]
    y = np.empty_like(x)
    dx = np.empty_like(x)
    buf = np.empty_like(x)
    _, ctx_ln = pynorm.layer_norm_forward(x, w, b, eps=LN_EPS, backend="numba", out=y)
    _, ctx_rms = pynorm.rms_norm_forward(x, w, eps=RMS_EPS, backend="numba", out=y)

    def ln_fwdbwd() -> None:
        _, c = pynorm.layer_norm_forward(x, w, b, eps=LN_EPS, backend="numba", out=y)
        pynorm.layer_norm_backward(dy, c, dx_out=dx)

    def rms_fwdbwd() -> None:
        _, c = pynorm.rms_norm_forward(x, w, eps=RMS_EPS, backend="numba", out=y)
        pynorm.rms_norm_backward(dy, c, dx_out=dx)

    calls: dict[tuple[str, str], Callable[[], Any]] = {
        ("layer_norm", "fwd"): lambda: pynorm.layer_norm_forward(x, w, b, eps=LN_EPS, backend="numba", out=y),
        ("layer_norm", "fwd_alloc"): lambda: pynorm.layer_norm_forward(x, w, b, eps=LN_EPS, backend="numba"),
        ("layer_norm", "bwd"): lambda: pynorm.layer_norm_backward(dy, ctx_ln, dx_out=dx),
        ("layer_norm", "fwd+bwd"): ln_fwdbwd,
        ("rms_norm", "fwd"): lambda: pynorm.rms_norm_forward(x, w, eps=RMS_EPS, backend="numba", out=y),
        ("rms_norm", "fwd_alloc"): lambda: pynorm.rms_norm_forward(x, w, eps=RMS_EPS, backend="numba"),
        ("rms_norm", "bwd"): lambda: pynorm.rms_norm_backward(dy, ctx_rms, dx_out=dx),
        ("rms_norm", "fwd+bwd"): rms_fwdbwd,
    }
    copy(x, buf)
    for fn in calls.values():
        fn()
    times: dict[Any, list[float]] = {k: [] for k in calls}
    times["copy"] = []
    for _ in range(repeat):  # interleaved: copy and kernels see the same machine state
        times["copy"].append(_time(lambda: copy(x, buf)))
        for k, fn in calls.items():
            times[k].append(_time(fn))
    copyto_t, _ = _median_time(lambda: np.copyto(buf, x), max(3, repeat // 3))
    rows, h = shape
    n2 = 2 * x.nbytes
    copy_t = statistics.median(times["copy"])
    limits = {
        "copy_s": copy_t,
        "copy_gbs": n2 / copy_t / 1e9,
        "copy_best_gbs": n2 / min(times["copy"]) / 1e9,
        "numpy_copyto_gbs": n2 / copyto_t / 1e9,
    }
    out: dict[str, Any] = {op: {} for op in OPS}
    for (op, phase), ts in ((k, v) for k, v in times.items() if k != "copy"):
        med = statistics.median(ts)
        entry: dict[str, Any] = {"median_s": med, "min_s": min(ts), "repeats": len(ts)}
        nb = _nbytes("fwd" if phase == "fwd_alloc" else phase, rows, h, op)
        entry["gbs"] = nb / med / 1e9
        entry["frac_copy"] = entry["gbs"] / limits["copy_gbs"]
        out[op][phase] = entry
    for op in OPS:
        out[op]["alloc_over_out"] = out[op]["fwd_alloc"]["median_s"] / out[op]["fwd"]["median_s"]
    return out, limits


def _bench_naive(data: dict[str, Any], repeat: int, budget: float) -> dict[str, Any]:
    x, dy, w, b = data["x"], data["dy"], data["w"], data["b"]
    _, c_ln = naive_layer_norm(x, w, b)
    _, c_rms = naive_rms_norm(x, w)
    res: dict[str, Any] = {}
    for op, fwd, bwd in (
        ("layer_norm", lambda: naive_layer_norm(x, w, b), lambda: naive_layer_norm_backward(dy, c_ln)),
        ("rms_norm", lambda: naive_rms_norm(x, w), lambda: naive_rms_norm_backward(dy, c_rms)),
    ):
        tf, nf = _median_time(fwd, repeat, budget)
        tb, nb = _median_time(bwd, repeat, budget)
        res[op] = {"fwd": tf, "bwd": tb, "fwd+bwd": tf + tb, "repeats": min(nf, nb)}
    return res


def _bench_reference(data: dict[str, Any], repeat: int, budget: float) -> dict[str, Any]:
    import pynorm

    x, dy, w, b = data["x"], data["dy"], data["w"], data["b"]
    _, c_ln = pynorm.layer_norm_forward(x, w, b, eps=LN_EPS, backend="numpy")
    _, c_rms = pynorm.rms_norm_forward(x, w, eps=RMS_EPS, backend="numpy")
    res: dict[str, Any] = {}
    for op, fwd, bwd in (
        (
            "layer_norm",
            lambda: pynorm.layer_norm_forward(x, w, b, eps=LN_EPS, backend="numpy"),
            lambda: pynorm.layer_norm_backward(dy, c_ln),
        ),
        (
            "rms_norm",
            lambda: pynorm.rms_norm_forward(x, w, eps=RMS_EPS, backend="numpy"),
            lambda: pynorm.rms_norm_backward(dy, c_rms),
        ),
    ):
        tf, nf = _median_time(fwd, repeat, budget)
        tb, nb = _median_time(bwd, repeat, budget)
        res[op] = {"fwd": tf, "bwd": tb, "fwd+bwd": tf + tb, "repeats": min(nf, nb)}
    return res


def _bench_torch(data: dict[str, Any], repeat: int, budget: float) -> dict[str, Any] | None:
    try:
        import torch
        import torch.nn.functional as F
    except Exception:
        return None
    x = torch.from_numpy(data["x"]).requires_grad_(True)
    w = torch.from_numpy(data["w"]).requires_grad_(True)
    b = torch.from_numpy(data["b"]).requires_grad_(True)
    dy = torch.from_numpy(data["dy"])
    h = x.shape[1]

    def clear() -> None:
        x.grad = w.grad = b.grad = None

    def ln_fwd() -> Any:
        return F.layer_norm(x, (h,), w, b, LN_EPS)

    def rms_fwd() -> Any:
        return F.rms_norm(x, (h,), w, RMS_EPS)

    res: dict[str, Any] = {}
    for op, fwd in (("layer_norm", ln_fwd), ("rms_norm", rms_fwd)):

        def both(fwd: Callable[[], Any] = fwd) -> None:
            clear()
            fwd().backward(dy)

        tf, nf = _median_time(fwd, repeat, budget)
        tfb, nb = _median_time(both, repeat, budget)
        res[op] = {"fwd": tf, "bwd": max(tfb - tf, 0.0), "fwd+bwd": tfb, "repeats": min(nf, nb)}
    clear()
    return res


# ---------------------------------------------------------------------------
# first calls in fresh processes

_FIRST_CALL = r"""
import json, sys, time
t0 = time.perf_counter()
import pynorm
t_import = time.perf_counter() - t0
res = {"import_pynorm_s": t_import, "import_pulls_numba": "numba" in sys.modules, "calls": []}
import numpy as np
for op, dt in json.loads(sys.argv[1]):
    spec = pynorm.ops.get(op)
    dtype = np.dtype(__import__("ml_dtypes").bfloat16 if dt == "bfloat16" else dt)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((256, 512)).astype(dtype)
    args = [*spec.example_inputs(x.shape, 1, dtype, rng), *spec.example_params((512,), dtype, rng)]
    t = time.perf_counter()
    y, ctx = spec.generic_forward()(x, *args, backend="numba")
    t1 = time.perf_counter()
    y0 = y[0] if isinstance(y, tuple) else y
    dy = rng.standard_normal(y0.shape).astype(spec.grad_dtype(x.dtype))
    t2 = time.perf_counter()
    getattr(pynorm, op + "_backward")(dy, ctx)
    t3 = time.perf_counter()
    fb = {"fwd_s": t1 - t, "bwd_s": t3 - t2, "first_call_s": (t1 - t) + (t3 - t2)}
    res["calls"].append({"op": op, "dtype": dt, **fb})
print("RESULT " + json.dumps(res))
"""


def _fresh_process(calls: list[tuple[str, str]], env_extra: dict[str, str] | None = None) -> dict[str, Any]:
    """Run the first forward+backward of each ``(op, dtype)`` of ``calls`` in a fresh Python process."""
    import pynorm

    env = dict(os.environ)
    root = str(Path(pynorm.__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(env_extra or {})
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-c", _FIRST_CALL, json.dumps(calls)],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
        cwd=root,
    )
    wall = time.perf_counter() - t
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr or proc.stdout)[-2000:]}
    res: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    res["process_wall_s"] = wall
    for c in res["calls"]:
        res.setdefault(c["op"], c)  # the first call of each op, by name
    return res


def _first_calls(cold: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    calls = [(op, "float32") for op in OPS]
    warm = [_fresh_process(calls) for _ in range(3)]
    ok = [r for r in warm if "error" not in r]
    if ok:
        best = sorted(ok, key=lambda r: r["layer_norm"]["first_call_s"])[len(ok) // 2]
        out["warm"] = best
        out["warm_import_pynorm_s_all"] = [r["import_pynorm_s"] for r in ok]
    else:
        out["warm"] = warm[0]
    if cold:
        with tempfile.TemporaryDirectory(prefix="pynorm-numba-cache-") as d:
            out["cold"] = _fresh_process(calls, {"NUMBA_CACHE_DIR": d})
            out["warm_after_cold_same_cache"] = _fresh_process(calls, {"NUMBA_CACHE_DIR": d})
    return out


COMPILE_DTYPES = ("float16", "bfloat16", "float32", "float64")


def compile_times(ops: tuple[str, ...] | None = None, dtypes: tuple[str, ...] = COMPILE_DTYPES) -> list[dict[str, Any]]:
    """First forward+backward of each op (default: every op the numba backend serves) and dtype (256x512, every
    parameter and input of the spec's examples), each in a fresh process: with an empty numba cache (everything
    the call needs compiles), then again with the cache it filled."""
    if ops is None:
        import pynorm

        ops = tuple(pynorm._registry.backend_ops("numba"))
    rows = []
    for op in ops:
        for dt in dtypes:
            with tempfile.TemporaryDirectory(prefix="pynorm-numba-cache-") as d:
                _log(f"compile times: {op} {dt} (empty cache, then warm)")
                cold = _fresh_process([(op, dt)], {"NUMBA_CACHE_DIR": d})
                warm = _fresh_process([(op, dt)], {"NUMBA_CACHE_DIR": d})
            row: dict[str, Any] = {"op": op, "dtype": dt}
            for kind, res in (("cold", cold), ("warm", warm)):
                if "error" in res:
                    row[f"{kind}_error"] = res["error"]
                    continue
                c = res["calls"][0]
                row.update({f"{kind}_fwd_s": c["fwd_s"], f"{kind}_bwd_s": c["bwd_s"], f"{kind}_s": c["first_call_s"]})
                row[f"{kind}_import_pynorm_s"] = res["import_pynorm_s"]
                row[f"{kind}_process_s"] = res["process_wall_s"]
            rows.append(row)
    return rows


def _compile_table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'op':22s} {'dtype':9s} | {'cold fwd':>8s} {'cold bwd':>8s} {'cold f+b':>8s} | {'warm f+b':>8s}"
        f" | {'import':>6s} | {'process (cold/warm)':>19s}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        if "cold_s" not in r or "warm_s" not in r:
            lines.append(f"{r['op']:22s} {r['dtype']:9s} | failed: {r.get('cold_error') or r.get('warm_error')}")
            continue
        lines.append(
            f"{r['op']:22s} {r['dtype']:9s} | {r['cold_fwd_s']:7.2f}s {r['cold_bwd_s']:7.2f}s {r['cold_s']:7.2f}s |"
            f" {r['warm_s']:7.3f}s | {r['warm_import_pynorm_s']:5.3f}s | {r['cold_process_s']:8.1f}s /"
            f" {r['warm_process_s']:6.2f}s"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# every op of the specs against numpy.copyto


def _op_arrays(spec: Any, shape: tuple[int, int], rng: np.random.Generator) -> tuple[list[Any], Any, Any]:
    """Extra inputs then parameters of ``spec`` for float32 ``x`` of ``shape`` (the spec's example arguments:
    tables of 3 modalities, a fused Linear's matrix, conditioning vectors), an output buffer and ``dy`` of the
    first output's shape and dtype."""
    args = spec.example_args(shape, -1, np.float32, rng)
    yshape = spec.output_shape(shape, -1, dict(zip((*spec.input_names, *spec.param_names), args, strict=True)))
    ydt = spec.dtypes_of_outputs(np.dtype(np.float32), spec.defaults())[0]
    return args, np.empty(yshape, ydt), rng.standard_normal(yshape, dtype=np.float32).astype(spec.grad_dtype(ydt))


def op_bytes(spec: Any, shape: tuple[int, int]) -> dict[str, int]:
    """Bytes a float32 call of ``spec`` moves through ``(R, H)`` arrays (parameters, ids, statistics negligible):
    forward reads x and the ``like_x`` inputs and writes every output; backward reads dy and x (``h``) and writes
    dx and one gradient per ``like_x`` input."""
    n = shape[0] * shape[1] * 4
    like_x = sum(1 for i in spec.inputs if i.kind == "like_x")
    fwd = (1 + like_x + len(spec.outputs)) * n
    bwd = (2 + 1 + like_x) * n
    return {"fwd": fwd, "fwd+bwd": fwd + bwd}


def op_table(shape: tuple[int, int] = (4096, 4096), repeat: int = 11) -> list[dict[str, Any]]:
    """Forward and forward + backward of every op the numba backend serves on float32 ``x`` of ``shape``
    (default options, every parameter, output buffers passed), as a fraction of ``numpy.copyto``'s bandwidth
    (``2 * x.nbytes`` per copy) timed interleaved with them in the same run (:func:`op_bytes`)."""
    import pynorm
    from pynorm.ops import SPECS

    rows = []
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape, dtype=np.float32) + 3).astype(np.float32)
    buf = np.empty_like(x)
    dx = np.empty_like(x)
    for op in pynorm._registry.backend_ops("numba"):
        spec = SPECS[op]
        args, y, dy = _op_arrays(spec, shape, rng)
        fwd_fn = spec.generic_forward()
        bwd_fn = getattr(pynorm, f"{op}_backward")

        def fwd(fwd_fn: Any = fwd_fn, args: list[Any] = args, y: Any = y) -> Any:
            return fwd_fn(x, *args, backend="numba", out=y)

        def fwdbwd(
            fwd_fn: Any = fwd_fn, bwd_fn: Any = bwd_fn, args: list[Any] = args, y: Any = y, dy: Any = dy
        ) -> None:
            _, c = fwd_fn(x, *args, backend="numba", out=y)
            bwd_fn(dy, c, dx_out=dx)

        _log(f"{op}: compile and warm up")
        fwdbwd()
        fwd()
        times: dict[str, list[float]] = {"copy": [], "fwd": [], "fwd+bwd": []}
        for _ in range(repeat):
            times["copy"].append(_time(lambda: np.copyto(buf, x)))
            times["fwd"].append(_time(fwd))
            times["fwd+bwd"].append(_time(fwdbwd))
        copy_gbs = 2 * x.nbytes / statistics.median(times["copy"]) / 1e9
        row: dict[str, Any] = {"op": op, "shape": list(shape), "copyto_gbs": copy_gbs, "copy_s": times["copy"]}
        for phase, nb in op_bytes(spec, shape).items():
            t = statistics.median(times[phase])
            row[f"{phase}_s"] = t
            row[f"{phase}_gbs"] = nb / t / 1e9
            row[f"{phase}_frac_copy"] = nb / t / 1e9 / copy_gbs
        rows.append(row)
    # the run's copy bandwidth: the median of every interleaved copy (steadier than each op's own)
    run_gbs = 2 * x.nbytes / statistics.median([t for r in rows for t in r.pop("copy_s")]) / 1e9
    for r in rows:
        r["run_copyto_gbs"] = run_gbs
        for phase in ("fwd", "fwd+bwd"):
            r[f"{phase}_frac_run_copy"] = r[f"{phase}_gbs"] / run_gbs
    return rows


def _op_table_text(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'op':22s} | {'copyto GB/s':>11s} | {'fwd ms':>7s} {'GB/s':>6s} {'%copy':>6s} {'%run':>5s} | "
        f"{'f+b ms':>7s} {'GB/s':>6s} {'%copy':>6s} {'%run':>5s}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['op']:22s} | {r['copyto_gbs']:11.1f} | {r['fwd_s'] * 1e3:7.1f} {r['fwd_gbs']:6.1f} "
            f"{100 * r['fwd_frac_copy']:5.0f}% {100 * r['fwd_frac_run_copy']:4.0f}% | {r['fwd+bwd_s'] * 1e3:7.1f} "
            f"{r['fwd+bwd_gbs']:6.1f} {100 * r['fwd+bwd_frac_copy']:5.0f}% {100 * r['fwd+bwd_frac_run_copy']:4.0f}%"
        )
    if rows:
        lines.append(
            f"(%copy: against the copies interleaved with that op; %run: against the run's median copy, "
            f"{rows[0]['run_copyto_gbs']:.1f} GB/s)"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# report


def _ratios(numba_res: dict[str, Any], base: dict[str, Any] | None) -> dict[str, Any] | None:
    if base is None:
        return None
    return {op: {ph: base[op][ph] / numba_res[op][ph]["median_s"] for ph in PHASES if base[op].get(ph)} for op in OPS}


def _table(results: list[dict[str, Any]]) -> str:
    lines = []
    head = (
        f"{'shape':>11s} {'op':10s} {'copy GB/s':>9s} {'copyto':>6s} | {'fwd GB/s':>8s} {'%copy':>5s}"
        f" | {'bwd GB/s':>8s} {'%copy':>5s}"
        f" | {'f+b GB/s':>8s} {'%copy':>5s} | {'alloc/out':>9s} | {'x naive':>7s} {'x ref':>6s} {'x torch':>7s}"
        f" (fwd+bwd; fwd: {'naive':>5s} {'torch':>5s})"
    )
    lines.append(head)
    lines.append("-" * len(head))
    for r in results:
        shape = f"{r['shape'][0]}x{r['shape'][1]}"
        for op in OPS:
            nb = r["numba"][op]

            def ratio(kind: str, phase: str, op: str = op, r: dict[str, Any] = r) -> str:
                rat = r["ratios"].get(kind)
                return f"{rat[op][phase]:.1f}" if rat and phase in rat[op] else "-"

            lines.append(
                f"{shape:>11s} {op:10s} {r['limits']['copy_gbs']:9.1f} {r['limits']['numpy_copyto_gbs']:6.1f} | "
                f"{nb['fwd']['gbs']:8.1f} {100 * nb['fwd']['frac_copy']:4.0f}% | "
                f"{nb['bwd']['gbs']:8.1f} {100 * nb['bwd']['frac_copy']:4.0f}% | "
                f"{nb['fwd+bwd']['gbs']:8.1f} {100 * nb['fwd+bwd']['frac_copy']:4.0f}% | "
                f"{nb['alloc_over_out']:9.2f} | "
                f"{ratio('naive_numpy', 'fwd+bwd'):>7s} {ratio('reference', 'fwd+bwd'):>6s} "
                f"{ratio('torch', 'fwd+bwd'):>7s} (fwd: {ratio('naive_numpy', 'fwd'):>5s} {ratio('torch', 'fwd'):>5s})"
            )
    return "\n".join(lines)


def _chart(results: list[dict[str, Any]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return False
    labels = [f"{r['shape'][0]}x{r['shape'][1]}" for r in results]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5))
    series = [(op, ph) for op in OPS for ph in PHASES]
    width = 0.8 / len(series)
    for k, (op, ph) in enumerate(series):
        vals = [100 * r["numba"][op][ph]["frac_copy"] for r in results]
        ax1.bar([i + k * width for i in range(len(results))], vals, width, label=f"{op} {ph}")
    ax1.axhline(80, color="k", ls="--", lw=0.8)
    ax1.axhline(70, color="gray", ls=":", lw=0.8)
    ax1.set_xticks([i + 0.4 - width / 2 for i in range(len(results))], labels)
    ax1.set_ylabel("% of same-size copy bandwidth (interleaved)")
    ax1.set_title("numba backend, float32 (targets: fwd 80%, fwd+bwd 70%)")
    ax1.legend(fontsize=7, loc="upper left", framealpha=0.8)
    kinds = [k for k in ("naive_numpy", "reference", "torch") if results[0]["ratios"].get(k)]
    series2 = [(op, k) for op in OPS for k in kinds]
    width2 = 0.8 / max(1, len(series2))
    for k, (op, kind) in enumerate(series2):
        vals = [r["ratios"][kind][op]["fwd+bwd"] for r in results]
        ax2.bar([i + k * width2 for i in range(len(results))], vals, width2, label=f"{op} vs {kind}")
    ax2.set_yscale("log")
    ax2.set_xticks([i + 0.4 - width2 / 2 for i in range(len(results))], labels)
    ax2.set_ylabel("speedup of numba fwd+bwd (x)")
    ax2.set_title("numba vs baselines (fwd+bwd)")
    ax2.legend(fontsize=7, loc="lower left", framealpha=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def _meta(threads: int) -> dict[str, Any]:
    import numba

    from pynorm.backends.numba import _threads

    meta: dict[str, Any] = {
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "numba": numba.__version__,
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "numba_threads_effective": _threads.get_num_threads(),
        "serial_threshold_elements": _threads.SERIAL_THRESHOLD,
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    meta["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import torch

        meta["torch"] = torch.__version__
    except Exception:
        meta["torch"] = None
    if hasattr(os, "getloadavg"):
        meta["loadavg_start"] = os.getloadavg()
    return meta


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pynorm bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench-results", help="output directory (default: ./bench-results)")
    parser.add_argument("--quick", action="store_true", help="1/8 of the rows, fewer repeats, no cold start")
    parser.add_argument("--repeat", type=int, default=None, help="timed calls per numba measurement (default 21)")
    parser.add_argument("--threads", type=int, default=2, help="threads for numba (and torch), default 2")
    parser.add_argument("--no-torch", action="store_true", help="skip the PyTorch baseline")
    parser.add_argument("--no-reference", action="store_true", help="skip the reference-backend baseline")
    parser.add_argument("--no-cold", action="store_true", help="skip the cold-cache first-call measurement")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="only the compile times: the first forward+backward of every op and dtype in a fresh process, "
        "with an empty numba cache and then with the cache it filled (no throughput benchmark)",
    )
    parser.add_argument(
        "--compile-ops", default="", help="with --compile: comma-separated ops (default: every op of the numba backend)"
    )
    parser.add_argument(
        "--compile-dtypes",
        default=",".join(COMPILE_DTYPES),
        help=f"with --compile: comma-separated dtypes (default: {','.join(COMPILE_DTYPES)})",
    )
    parser.add_argument(
        "--ops",
        action="store_true",
        help="only the op table: forward and forward+backward of every op the numba backend serves on a float32 "
        "input (--ops-shape), as a fraction of numpy.copyto's bandwidth in the same run",
    )
    parser.add_argument(
        "--ops-shape", default="4096x4096", help="with --ops: the input's ROWSxHIDDEN (default 4096x4096)"
    )
    args = parser.parse_args(argv)
    try:
        ops_shape = tuple(int(v) for v in args.ops_shape.lower().split("x"))
        if len(ops_shape) != 2 or min(ops_shape) < 1:
            raise ValueError
    except ValueError:
        parser.error(f"--ops-shape must be ROWSxHIDDEN with positive sizes (4096x4096), got {args.ops_shape!r}")

    try:
        import numba  # noqa: F401
    except ImportError:
        print("the benchmark needs numba (pip install 'pynorm[numba]')", file=sys.stderr)
        return 2
    import pynorm
    from pynorm.backends.numba import _threads

    if args.ops:
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        _threads.set_num_threads(args.threads)
        op_rows = op_table((ops_shape[0], ops_shape[1]), repeat=args.repeat or 11)
        (out_dir / "op_table.json").write_text(json.dumps({"meta": _meta(args.threads), "rows": op_rows}, indent=1))
        print(f"{ops_shape[0]}x{ops_shape[1]} float32, {args.threads} threads; fraction of numpy.copyto bandwidth "
              f"(same run)")  # fmt: skip
        print(_op_table_text(op_rows))
        print(f"\nwrote {out_dir / 'op_table.json'}")
        return 0

    if args.compile:
        out_dir = Path(args.out)
        out_dir.mkdir(parents=True, exist_ok=True)
        rows = compile_times(
            tuple(o for o in args.compile_ops.split(",") if o) or None,
            tuple(d for d in args.compile_dtypes.split(",") if d),
        )
        (out_dir / "compile_times.json").write_text(json.dumps({"meta": _meta(args.threads), "rows": rows}, indent=1))
        print("first forward+backward (256x512, all parameters) in a fresh process; cold: empty numba cache")
        print(_compile_table(rows))
        print(f"\nwrote {out_dir / 'compile_times.json'}")
        return 0

    repeat = args.repeat or (7 if args.quick else 21)
    base_repeat = 3 if args.quick else 5
    budget = 1.5 if args.quick else 4.0
    shapes = [(max(1, r // 8) if args.quick and r > 16 else r, h) for r, h in SHAPES]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    _threads.set_num_threads(args.threads)
    try:
        import torch

        torch.set_num_threads(args.threads)
    except Exception:
        pass
    meta = _meta(args.threads)
    _log(f"pynorm {pynorm.__version__} numba benchmark: {len(shapes)} shapes, {args.threads} threads, out={out_dir}")
    copy = _copy_kernel()
    results = []
    rng = np.random.default_rng(0)
    for k, shape in enumerate(shapes, 1):
        tag = f"[{k}/{len(shapes)}] {shape[0]}x{shape[1]}"
        data = {
            "x": (rng.standard_normal(shape, dtype=np.float32) + 3).astype(np.float32),
            "dy": rng.standard_normal(shape, dtype=np.float32),
            "w": (1 + 0.1 * rng.standard_normal(shape[1])).astype(np.float32),
            "b": (0.1 * rng.standard_normal(shape[1])).astype(np.float32),
        }
        _log(f"{tag} numba kernels + copy, {repeat} interleaved repeats")
        numba_res, limits = _bench_numba(shape, data, repeat, copy)
        _log(f"{tag} copy {limits['copy_gbs']:.1f} GB/s; naive NumPy baseline")
        baselines: dict[str, Any] = {"naive_numpy": _bench_naive(data, base_repeat, budget)}
        if not args.no_reference:
            _log(f"{tag} reference backend baseline")
            baselines["reference"] = _bench_reference(data, base_repeat, budget)
        if not args.no_torch:
            tr = _bench_torch(data, base_repeat, budget)
            if tr is not None:
                _log(f"{tag} torch baseline done")
                baselines["torch"] = tr
        results.append(
            {
                "shape": list(shape),
                "limits": limits,
                "numba": numba_res,
                "baselines": baselines,
                "ratios": {kind: _ratios(numba_res, b) for kind, b in baselines.items()},
            }
        )
    _log("first calls in fresh processes" + ("" if args.no_cold or args.quick else " (warm and cold cache)"))
    first = _first_calls(cold=not (args.no_cold or args.quick))
    if hasattr(os, "getloadavg"):
        meta["loadavg_end"] = os.getloadavg()
    report = {
        "meta": meta,
        "byte_model": {
            "element_bytes": 4,
            "passes_over_x_sized_arrays": ELEMENT_PASSES,
            "note": "GB/s = counted bytes / median time; write-allocate reads not counted (copy included)",
        },
        "targets": TARGETS,
        "results": results,
        "first_call": first,
    }
    json_path = out_dir / "bench_results.json"
    json_path.write_text(json.dumps(report, indent=1))
    table = _table(results)
    print(table)
    w = first.get("warm", {})
    if "error" not in w and w:
        print(
            f"\nfresh process, warm cache: import pynorm {w['import_pynorm_s']:.3f} s; first call (fwd+bwd) "
            + ", ".join(f"{op} {w[op]['first_call_s']:.3f} s" for op in OPS)
        )
    c = first.get("cold")
    if c and "error" not in c:
        print(
            "fresh process, empty cache (compiles): " + ", ".join(f"{op} {c[op]['first_call_s']:.1f} s" for op in OPS)
        )
    for kind in ("warm", "cold"):
        if first.get(kind, {}).get("error"):
            print(f"first-call measurement ({kind}) failed:\n{first[kind]['error']}", file=sys.stderr)
    png = out_dir / "bench_results.png"
    if _chart(results, png):
        print(f"\nwrote {json_path} and {png}")
    else:
        print(f"\nwrote {json_path} (matplotlib not installed: no chart)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
