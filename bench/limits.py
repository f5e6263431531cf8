"""What each op's time on the numba backend is made of: its arithmetic, its memory traffic, and how much of the two
overlap -- the microbenchmark behind "this op cannot reach X % of a copy on this machine".

For each op and phase (forward, backward) on float32 ``x`` of ``--shape`` (default 4096 x 4096), in one run:

* ``t``: the call's median time on the backend's threads (``T``), interleaved round by round with a same-size copy
  on the same threads (the copy of ``python -m pynorm bench``: :func:`pynorm.bench.worker._copy_kernel`);
* ``mem``: the bytes the call counts (:func:`pynorm.bench.cases.op_bytes`, the op table's byte model) at the copy's
  bandwidth of the same rounds -- the call's time if it were a copy of its bytes;
* ``c``: its arithmetic, in ns per element of ``x`` on **one** thread with every array in the cache (the same op
  on ``--cache-rows`` rows of the same width, called in a loop; the per-call fixed cost, a few microseconds, is
  included), and ``comp = c N / T``, the arithmetic of the whole call spread over the threads;
* ``ceiling = mem / max(mem, comp)``: the best fraction of a copy the call can reach on this machine with its
  arithmetic (arithmetic and memory traffic overlapped perfectly); ``serial = mem / (mem + comp)``: the
  fraction with no overlap at all; ``measured = mem / t``.

A call whose ``measured`` sits at its ``serial`` runs its arithmetic and its memory traffic one after the other;
one whose ``ceiling`` is below a target cannot reach it without less arithmetic per element. ``--bare`` adds
each op without its optional parameters (no ``dweight``/``dbias`` to accumulate): the difference is what the
parameter gradients cost.

    python bench/limits.py [--shape 4096x4096] [--cache-rows 128] [--ops layer_norm,dyt] [--bare]
                           [--repeat 7] [--json FILE]

The ops: the rows-layout ops of the kernel families (:data:`MODELED`), whose cache-resident call takes the kernels
of the full-size call (``--cache-rows`` at least :data:`pynorm.backends.numba._layout.FUSED_MIN_ROWS`, the
backward's fused path). Prints a table; ``--json`` writes the rows. Timings only: nothing here is a pass/fail
condition.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's pynorm, not an installed one

import pynorm
from pynorm.bench import cases
from pynorm.bench.worker import _copy_kernel
from pynorm.ops import SPECS

PHASES = ("fwd", "bwd")

#: the ops whose cache-resident call runs the full-size call's kernels: the rows-layout ops of the kernel families.
#: A channels-layout op reads ``--cache-rows`` rows as a few ``(n, c)`` slices, which its kernels take by another path
#: than the full size's; a composite's time is mostly its matrix product, whose speed depends on the size.
MODELED = tuple(n for n, s in SPECS.items() if s.layout == "rows" and s.family != "composite")


def bare_case(case: cases.Case) -> cases.Case | None:
    """``case`` without its optional parameters (None where the op allows it); None when it has none to drop."""
    n_in = len(case.spec.inputs)
    args = list(case.args)
    dropped = False
    for k, p in enumerate(case.spec.params):
        if not p.required and args[n_in + k] is not None:
            args[n_in + k] = None
            dropped = True
    return replace(case, args=args) if dropped else None


def _calls(case: cases.Case) -> dict[str, Callable[[], Any]]:
    calls = cases.pynorm_calls(case, "numba", buffers=True)
    return {ph: calls[ph] for ph in PHASES}


def _median_time(fn: Callable[[], Any], min_s: float = 0.02) -> float:
    """Seconds per call of ``fn``: calls in a loop of at least ``min_s``, the median of 5 such loops."""
    fn()
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-7)
    n = max(1, int(min_s / once))
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        samples.append((time.perf_counter() - t0) / n)
    return statistics.median(samples)


def in_cache(case: cases.Case) -> dict[str, float]:
    """ns per element of ``x`` of each phase of ``case`` (cache-resident) on one thread."""
    threads = pynorm.get_num_threads()
    pynorm.set_num_threads(1)
    try:
        calls = _calls(case)
        return {ph: _median_time(calls[ph]) / case.x.size * 1e9 for ph in PHASES}
    finally:
        pynorm.set_num_threads(threads)


def full_size(case: cases.Case, repeat: int) -> dict[str, Any]:
    """Median seconds of each phase of ``case`` and of the same-size copy, interleaved over ``repeat`` rounds on the
    backend's threads."""
    copy = _copy_kernel()
    a = case.x.reshape(case.x.shape[0], -1) if case.x.ndim != 2 else case.x
    b = np.empty_like(a)
    calls = _calls(case)
    times: dict[str, list[float]] = {"copy": [], **{ph: [] for ph in PHASES}}
    run = {"copy": lambda: copy(a, b), **calls}
    for fn in run.values():
        fn()
    for _ in range(repeat):
        for name, fn in run.items():
            fn()  # the first call after another kernel refills the caches (as in the op table's rounds)
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def measure(op: str, shape: tuple[int, int], cache_rows: int, repeat: int, bare: bool) -> list[dict[str, Any]]:
    """The rows of ``op`` (and of its bare variant with ``bare``): one per phase."""
    big = cases.make_case(op, shape)
    small = cases.make_case(op, (cache_rows, shape[1]))
    variants = [(op, big, small)]
    if bare and (bb := bare_case(big)) is not None and (bs := bare_case(small)) is not None:
        variants.append((f"{op} (no optional params)", bb, bs))
    rows = []
    threads = pynorm.get_num_threads()
    for name, case, cached in variants:
        nbytes = cases.op_bytes(case)
        c = in_cache(cached)
        t = full_size(case, repeat)
        copy_bw = 2 * case.x.nbytes / t["copy"]
        for ph in PHASES:
            mem = nbytes[ph] / copy_bw
            comp = c[ph] * 1e-9 * case.x.size / threads
            row = {"op": name, "phase": ph, "shape": list(case.x.shape), "threads": threads, "bytes": nbytes[ph]}
            row |= {"copy_gbs": copy_bw / 1e9, "t_s": t[ph], "mem_s": mem, "ns_per_elem_1thread": c[ph]}
            row |= {"comp_s": comp, "ceiling": mem / max(mem, comp), "serial": mem / (mem + comp)}
            rows.append(row | {"measured": mem / t[ph]})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'op':32s} {'phase':5s} | {'t ms':>6s} {'mem ms':>6s} {'c ns/el':>7s} {'comp ms':>7s} |"
        f" {'measured':>8s} {'serial':>6s} {'ceiling':>7s}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['op']:32s} {r['phase']:5s} | {r['t_s'] * 1e3:6.2f} {r['mem_s'] * 1e3:6.2f}"
            f" {r['ns_per_elem_1thread']:7.3f} {r['comp_s'] * 1e3:7.2f} |"
            f" {r['measured']:8.0%} {r['serial']:6.0%} {r['ceiling']:7.0%}"
        )
    return "\n".join(lines)


def _shape(text: str) -> tuple[int, int]:
    try:
        r, h = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ROWSxHIDDEN, got {text!r}") from None
    if r < 1 or h < 1:
        raise argparse.ArgumentTypeError(f"expected positive sizes, got {text!r}")
    return r, h


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=_shape, default=(4096, 4096), help="ROWSxHIDDEN of the full-size calls")
    ap.add_argument("--cache-rows", type=int, default=128, help="rows of the cache-resident calls (one thread)")
    ap.add_argument("--ops", default=",".join(MODELED), help="comma-separated ops (default: every op it models)")
    ap.add_argument("--bare", action="store_true", help="also each op without its optional parameters")
    ap.add_argument("--repeat", type=int, default=7, help="interleaved rounds of the full-size calls")
    ap.add_argument("--json", type=Path, help="write the rows to this file")
    args = ap.parse_args(argv)
    ops = [o for o in args.ops.split(",") if o]
    unknown = [o for o in ops if o not in MODELED]
    if unknown:
        ap.error(f"not modeled here: {', '.join(unknown)} (one of {', '.join(MODELED)}; see the module doc)")
    if args.cache_rows < 1 or args.repeat < 1:
        ap.error("--cache-rows and --repeat must be positive")
    rows: list[dict[str, Any]] = []
    r, h = args.shape
    print(f"numba backend, {pynorm.get_num_threads()} threads; x {r}x{h} float32 (in cache: {args.cache_rows}x{h}, one "
          f"thread)", flush=True)  # fmt: skip
    for op in ops:
        rows += measure(op, args.shape, args.cache_rows, args.repeat, args.bare)
        print(f"  {op} done", file=sys.stderr, flush=True)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
