"""The CPU benchmark of the ``numba`` backend (``python -m pynorm bench``, ``python bench/bench_cpu.py``).

Everything it times comes from the op specs (:data:`pynorm.ops.SPECS`): the ops, their arguments
(:meth:`~pynorm.ops.OpSpec.example_args`, :meth:`~pynorm.ops.OpSpec.output_shape`,
:meth:`~pynorm.ops.OpSpec.dtypes_of_outputs`, :meth:`~pynorm.ops.OpSpec.grad_dtype`) and the bytes a call moves
(:func:`pynorm.bench.cases.op_bytes`). Its tables:

* the default run: float32 shapes 8192x1024, 4096x4096, 2048x8192, 65536x128 and 16x65536 (``--quick``: the
  same hidden sizes with 1/8 of the rows) of ``--only`` (default LayerNorm and RMSNorm): forward, backward,
  forward + backward (output buffers passed as ``out=``/``dx_out=``) and the allocating forward; then the first
  call of each op in a fresh process with a warm numba cache and, unless ``--no-cold``, an empty one;
* ``--ops``: every op on one shape (``--ops-shape``, default 4096x4096), forward and forward + backward;
  ``--only rms_norm:nvfp4,...`` adds the norms with a quantized output (bytes: the codes and scales written);
* ``--small``: the fixed costs, microseconds per small call (``--small-shape``, default 4x8) of every op;
* ``--compile``: the first forward + backward of every op and dtype in a fresh process, with an empty numba
  cache and then with the cache it filled;
* ``--all``: the default run, ``--ops`` and ``--small`` in one run.

How it times (:mod:`pynorm.bench.runner`): pynorm's calls and the baselines -- the ``numpy`` reference backend
(the op's math in NumPy) and PyTorch CPU with autograd (:data:`pynorm.bench.cases.TORCH_BASELINES`: its
function where it has the op, else the op's formula in PyTorch ops) -- each run in a process of their own
(threads one runtime leaves spinning slow the next one's calls in a shared process), in rounds: each round
times pynorm's calls and the same-size copy on the backend's threads (the physical limit) in the pynorm
process, then each baseline in its process. Every figure is a ratio to something timed in the same rounds:
``%copy`` (the bandwidth of the call over the copy's) and the speed-ups (a baseline's time over pynorm's).
Times are medians of ``--repeat`` rounds after warm-up calls; the baselines are timed in 5 (``--quick``: 3)
of the rounds, fewer when their calls are slow.

Byte model (what GB/s counts): every array of the call read or written once (:data:`report.BYTE_MODEL`); for a
LayerNorm of ``N`` float32 elements, forward ``2N``, backward ``3N``, forward + backward ``5N`` elements of 4
bytes plus the parameters; the copy ``2N``. Write-allocate traffic is not counted, for the copy nor the ops,
so a fraction of copy compares like with like.

Results go to ``--out``: ``bench_results.json``/``.png`` (default run), ``op_table.json``/``.png``
(``--ops``), ``small_calls.json``/``.png`` (``--small``), ``compile_times.json`` (``--compile``), with the
machine and its load average before and after; tables on stdout; progress on stderr. The PNG files need
matplotlib.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

__all__ = ["main"]


def _shape(text: str) -> tuple[int, int]:
    try:
        r, h = (int(v) for v in text.lower().split("x"))
        if r < 1 or h < 1:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be ROWSxHIDDEN with positive sizes (4096x4096), got {text!r}") from None
    return r, h


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = 0
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return v


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m pynorm bench", description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--out", default="bench-results", help="output directory (default: ./bench-results)")
    p.add_argument("--quick", action="store_true", help="1/8 of the rows, fewer repeats, no cold start")
    p.add_argument("--repeat", type=_positive, default=None, metavar="N",
                   help="rounds per measurement (default 21; --quick 7; --ops 11)")  # fmt: skip
    p.add_argument("--threads", type=_positive, default=2, metavar="N", help="threads for numba (and torch), default 2")
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch baseline")
    p.add_argument("--no-reference", action="store_true",
                   help="skip the NumPy baseline (the reference backend)")  # fmt: skip
    p.add_argument("--no-cold", action="store_true", help="skip the cold-cache first-call measurement")
    p.add_argument("--only", default="", metavar="OPS",
                   help="comma-separated ops (default: layer_norm,rms_norm for the default run; every op of the numba "
                   "backend for --ops, --small and --compile); op:format times a norm with a quantized output "
                   "(rms_norm:nvfp4; formats fp8_e4m3, fp8_e5m2, mxfp8_e4m3, mxfp8_e5m2, mxfp4, nvfp4; an FP8 "
                   "format per group of 128 or with a static per-tensor scale: rms_norm:fp8_e4m3:group, "
                   "rms_norm:fp8_e4m3:tensor)")  # fmt: skip
    p.add_argument(
        "--ops",
        action="store_true",
        help="the op table: forward and forward+backward of every op the numba backend serves on a float32 "
        "input (--ops-shape), as a fraction of the same-size copy timed in the same rounds",
    )
    p.add_argument("--ops-shape", type=_shape, default=(4096, 4096), metavar="RxH",
                   help="with --ops: the input's ROWSxHIDDEN (default 4096x4096)")  # fmt: skip
    p.add_argument("--small", action="store_true",
                   help="the small-call table: microseconds per call of every op on numba, the reference and "
                   "PyTorch (the fixed costs)")  # fmt: skip
    p.add_argument("--small-shape", type=_shape, default=(4, 8), metavar="RxH",
                   help="with --small: the input's ROWSxHIDDEN (default 4x8)")  # fmt: skip
    p.add_argument("--all", action="store_true", help="the default run, --ops and --small in one run")
    p.add_argument(
        "--sizes",
        action="store_true",
        help="the size sweep: rows 1-8192 x hidden 1024/4096/8192 (--quick: fewer), LayerNorm, RMSNorm, add + "
        "RMSNorm and GroupNorm, forward and forward + backward, against PyTorch eager, torch.compile, JAX jit and "
        "ONNX Runtime (forward), each library in its own process (pynorm.bench.sizes)",
    )
    p.add_argument("--peers", default=None, metavar="LIBS",
                   help="with --sizes: comma-separated peers (default: all of them; '' for none)")  # fmt: skip
    p.add_argument("--rows", default=None, metavar="N,N,...", help="with --sizes: the row counts")
    p.add_argument("--hidden", default=None, metavar="H,H,...", help="with --sizes: the hidden sizes")
    p.add_argument(
        "--compile",
        action="store_true",
        help="only the compile times: the first forward+backward of every op and dtype in a fresh process, "
        "with an empty numba cache and then with the cache it filled (no throughput benchmark)",
    )
    p.add_argument("--compile-ops", default="", metavar="OPS",
                   help="with --compile: comma-separated ops (default: --only, or every op of the numba "
                   "backend)")  # fmt: skip
    from .runner import COMPILE_DTYPES

    p.add_argument("--compile-dtypes", default=",".join(COMPILE_DTYPES), metavar="DTYPES",
                   help=f"with --compile: comma-separated dtypes (default: {','.join(COMPILE_DTYPES)})")  # fmt: skip
    return p


def _op_list(p: argparse.ArgumentParser, option: str, text: str, allowed: tuple[str, ...]) -> list[str] | None:
    from .cases import quantized_names

    names = [v.strip() for v in text.split(",") if v.strip()]
    bad = [n for n in names if n not in allowed and not (option == "--only" and n in quantized_names())]
    if bad:
        p.error(f"{option}: unknown op(s) {', '.join(bad)} (the numba backend's ops: {', '.join(allowed)})")
    return names or None


def _write(out_dir: Path, name: str, data: dict[str, Any]) -> Path:
    path = out_dir / name
    path.write_text(json.dumps(data, indent=1))
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m pynorm bench [options]`` (``--help``); returns the exit status (2: numba is missing)."""
    p = _parser()
    args = p.parse_args(argv)
    if args.sizes:
        if args.compile or args.ops or args.small or args.all:
            p.error("--sizes runs alone: it cannot be combined with --compile, --ops, --small or --all")
        return _sizes_mode(p, args)
    if args.compile and (args.ops or args.small or args.all):
        p.error("--compile runs alone: it cannot be combined with --ops, --small or --all")
    try:
        import numba
    except ImportError:
        print("the benchmark needs numba (pip install 'pynorm[numba]')", file=sys.stderr)
        return 2
    limit = int(numba.config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]
    if args.threads > limit:
        p.error(f"--threads: at most {limit} here (NUMBA_NUM_THREADS), got {args.threads}")
    import pynorm

    from . import report, runner

    served = tuple(pynorm._registry.backend_ops("numba"))
    only = _op_list(p, "--only", args.only, served)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    if args.compile:
        dtypes = [d.strip() for d in args.compile_dtypes.split(",") if d.strip()]
        bad = [d for d in dtypes if d not in runner.COMPILE_DTYPES]
        if bad or not dtypes:
            known = ", ".join(runner.COMPILE_DTYPES)
            p.error(f"--compile-dtypes: must name some of {known}, got {args.compile_dtypes!r}")
        ops = _op_list(p, "--compile-ops", args.compile_ops, served) or only or list(served)
        meta = report.meta(args.threads, {"pynorm": {"numba": numba.__version__}}, {})
        rows = runner.compile_times(ops, dtypes)
        path = _write(out_dir, "compile_times.json", {"meta": meta, "rows": rows})
        print("first forward+backward (256x512, all parameters) in a fresh process; cold: empty numba cache")
        print(report.compile_text(rows))
        print(f"\nwrote {path}")
        return 0

    modes = ["shapes", "ops", "small"] if args.all else [m for m in ("ops", "small") if getattr(args, m)]
    modes = modes or ["shapes"]
    baselines = [b for b, skip in (("numpy", args.no_reference), ("torch", args.no_torch)) if not skip]
    runner.log(f"pynorm {pynorm.__version__} benchmark ({', '.join(modes)}): {args.threads} threads, out={out_dir}")
    load_before = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    with runner.Workers(args.threads, baselines) as workers:
        for lib, why in workers.unavailable.items():
            print(f"no {report.LIB_NAMES[lib]} baseline: it does not import here ({why})")
        torch_note = {"torch_baselines": _torch_baselines() if "torch" in workers.procs else {}}
        wrote: list[Path] = []
        for mode in modes:
            meta = report.meta(args.threads, workers.versions, workers.unavailable)
            meta["loadavg_before_run"] = load_before
            meta["_meter"] = runner.CpuMeter(workers)
            meta["_meter"].start()
            if mode == "shapes":
                wrote += _shapes_mode(args, workers, meta, only, out_dir, torch_note)
            elif mode == "ops":
                wrote += _ops_mode(args, workers, meta, only or list(served), out_dir, torch_note)
            else:
                wrote += _small_mode(args, workers, meta, only or list(served), out_dir, torch_note)
    print(f"\nwrote {', '.join(str(w) for w in wrote)}")
    if not any(w.suffix == ".png" for w in wrote):
        print("(matplotlib is not installed: no charts)")
    return 0


def _ints(p: argparse.ArgumentParser, option: str, text: str | None) -> list[int] | None:
    if text is None:
        return None
    try:
        vals = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        p.error(f"{option}: expected comma-separated positive integers, got {text!r}")
    return vals


def _sizes_mode(p: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    from . import sizes

    peers = None
    if args.peers is not None:
        peers = [v.strip() for v in args.peers.split(",") if v.strip()]
        bad = [v for v in peers if v not in sizes.PEERS]
        if bad:
            p.error(f"--peers: unknown {', '.join(bad)} (one of {', '.join(sizes.PEERS)})")
    ops = None
    if args.only:
        ops = [v.strip() for v in args.only.split(",") if v.strip()]
        bad = [v for v in ops if v not in sizes.OPS]
        if bad:
            p.error(f"--only with --sizes: unknown {', '.join(bad)} (one of {', '.join(sizes.OPS)})")
    hidden = _ints(p, "--hidden", args.hidden)
    if hidden and any(h % sizes.GROUPS for h in hidden):
        p.error(f"--hidden: multiples of {sizes.GROUPS} (GroupNorm's groups), got {args.hidden!r}")
    sizes.run(Path(args.out), args.threads, args.quick, args.repeat, ops, peers, _ints(p, "--rows", args.rows), hidden)
    return 0


def _torch_baselines() -> dict[str, Any]:
    from .cases import TORCH_BASELINES

    return {op: {"expr": b.expr, "native": b.native, "why": b.why} for op, b in TORCH_BASELINES.items()}


def _finish(meta: dict[str, Any]) -> None:
    """The load at the end of a table, and the cores the machine's other processes kept busy during it."""
    if hasattr(os, "getloadavg"):
        meta["loadavg_end"] = list(os.getloadavg())
    meter = meta.pop("_meter", None)
    meta["cpu_others"] = meter.read() if meter is not None else None


def _emit(out_dir: Path, name: str, data: dict[str, Any], text: list[str], chart: Any, chart_data: Any) -> list[Path]:
    """Write ``name.json`` (``data``, its meta finished now), print ``text`` and the load line, draw
    ``chart(chart_data, name.png)``; the paths written."""
    from . import report

    _finish(data["meta"])
    wrote = [_write(out_dir, f"{name}.json", data)]
    print("\n".join(text))
    print(report.load_line(data["meta"]))
    png = out_dir / f"{name}.png"
    if chart(chart_data, png):
        wrote.append(png)
    return wrote


def _shapes_mode(
    args: argparse.Namespace, workers: Any, meta: dict[str, Any], only: list[str] | None, out_dir: Path,
    extra: dict[str, Any],
) -> list[Path]:  # fmt: skip
    from . import report, runner

    ops = only or ["layer_norm", "rms_norm"]
    repeat = args.repeat or (7 if args.quick else 21)
    shapes = [(max(1, r // 8) if args.quick and r > 16 else r, h) for r, h in runner.SHAPES]
    results = runner.shapes_table(workers, shapes, ops, repeat, 3 if args.quick else 5, 1.5 if args.quick else 4.0)
    cold = not (args.no_cold or args.quick)
    runner.log("first calls in fresh processes" + (" (warm and cold cache)" if cold else " (warm cache)"))
    first = runner.first_calls(ops, cold=cold)
    text = [report.shapes_text(results)]
    w = first.get("warm", {})
    if w and "error" not in w:
        calls = ", ".join(f"{op} {w[op]['first_call_s']:.3f} s" for op in ops)
        text.append(
            f"\nfresh process, warm cache: import pynorm {w['import_pynorm_s']:.3f} s; first call (fwd+bwd) {calls}"
        )
    c = first.get("cold")
    if c and "error" not in c:
        times = ", ".join(f"{op} {c[op]['first_call_s']:.1f} s" for op in ops)
        text.append(f"fresh process, empty cache (compiles): {times}")
    for kind in ("warm", "cold"):
        if first.get(kind, {}).get("error"):
            print(f"first-call measurement ({kind}) failed:\n{first[kind]['error']}", file=sys.stderr)
    data = {"meta": meta, "byte_model": report.BYTE_MODEL, "targets": report.TARGETS, **extra, "results": results,
            "first_call": first}  # fmt: skip
    return _emit(out_dir, "bench_results", data, text, report.chart_shapes, results)


def _ops_mode(
    args: argparse.Namespace, workers: Any, meta: dict[str, Any], ops: list[str], out_dir: Path,
    extra: dict[str, Any],
) -> list[Path]:  # fmt: skip
    from . import report, runner

    shape = args.ops_shape
    rows = runner.op_table(workers, shape, ops, args.repeat or 11, 3 if args.quick else 5, 1.5 if args.quick else 4.0)
    native = {op: b["native"] for op, b in extra["torch_baselines"].items()}
    text = [f"\n{shape[0]}x{shape[1]} float32, {args.threads} threads; fraction of the same-size copy on the "
            f"backend's threads, timed in the same rounds", report.ops_text(rows, native or None)]  # fmt: skip
    text += [f"  {r['op']}: no {report.LIB_NAMES[lib]} figure ({why.splitlines()[-1]})" for r in rows
             for lib, why in r["errors"].items()]  # fmt: skip
    data = {"meta": meta, "byte_model": report.BYTE_MODEL, **extra, "rows": rows}
    return _emit(out_dir, "op_table", data, text, report.chart_ops, rows)


def _small_mode(
    args: argparse.Namespace, workers: Any, meta: dict[str, Any], ops: list[str], out_dir: Path,
    extra: dict[str, Any],
) -> list[Path]:  # fmt: skip
    from . import report, runner

    res = runner.small_calls(workers, args.small_shape, ops, args.repeat or (7 if args.quick else 21))
    head = f"\nsmall calls, {args.small_shape[0]}x{args.small_shape[1]} float32, {args.threads} threads for numba"
    return _emit(out_dir, "small_calls", {"meta": meta, **extra, **res}, [head, report.small_text(res)],
                 report.chart_small, res)  # fmt: skip
