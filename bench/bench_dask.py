"""Scaling benchmark of :mod:`pynorm.dask`: ``python bench/bench_dask.py [--quick] [--gib G] [--json PATH]``.

In one run, for float32 LayerNorm (weight and bias) over ``hidden`` features:

* **in-process**: ``pynorm.layer_norm_forward(..., backend="numba", out=...)`` and the backward (``dx_out=``) on
  the largest array that fits comfortably here (``--inproc-gib``, default 0.5 GiB for ``x``: forward + backward
  holds x, y, dy, dx, 2 GiB in all), numba on every core;
* **dask**: the same op through ``pynorm.dask`` on a ``--gib`` GiB array (default 4) that is **generated lazily**,
  block by block on the workers (rows gathered from a small random table, at copy speed; never materialised
  whole), on a ``LocalCluster`` of 1 and then 2 worker processes (one thread each, ``NUMBA_NUM_THREADS=1``:
  one core per worker). Forward computes ``y``; forward + backward computes ``y`` and the gradients (``dy``
  generated too) together. Only small reductions come back (``y[:, 0].sum()``, ``dweight``, ``dbias``);
* **dask, generation only**: the same graph without the op (``x[:, 0].sum()``), the floor set by generating
  the data.

GB/s uses the byte model of ``pynorm.bench``: forward moves ``2N`` elements (read x, write y), forward +
backward ``5N`` (+ read dy, x again, write dx), ``N = rows * hidden``, 4 bytes each, divided by the wall time of
the whole ``compute`` (generation, scheduling and the Dask path's recomputed forward in the backward included).
Each time is the median of ``--repeat`` runs after a warm-up on a small array. The machine is not assumed idle:
the load average is printed with the table.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pynorm

HIDDEN = 4096
TABLE_ROWS = 61  # rows of the table the lazy array gathers from (prime: rows do not repeat in step with blocks)
SEED = 2024


@functools.lru_cache(maxsize=4)
def _table(hidden: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((TABLE_ROWS, hidden)).astype(np.float32)
    return base * rng.uniform(0.5, 2.0, (TABLE_ROWS, 1)).astype(np.float32) + rng.normal(0, 3, (TABLE_ROWS, 1)).astype(
        np.float32
    )


def _gen_block(block_info: Any = None, hidden: int = HIDDEN, seed: int = SEED) -> np.ndarray:
    """One block of the lazy array: row ``i`` is row ``(7 i) mod 61`` of a random table made once per process."""
    (r0, r1), _ = block_info[None]["array-location"]
    idx = (np.arange(r0, r1) * 7) % TABLE_ROWS
    return _table(hidden, seed).take(idx, axis=0)


def lazy_array(rows: int, hidden: int, block_rows: int, seed: int) -> Any:
    """A ``(rows, hidden)`` float32 Dask array generated block by block (nothing held until computed)."""
    import dask.array as da

    chunks = (tuple(min(block_rows, rows - i) for i in range(0, rows, block_rows)), (hidden,))
    return da.map_blocks(
        _gen_block, dtype=np.float32, chunks=chunks, hidden=hidden, seed=seed, meta=np.empty((0, 0), np.float32)
    )


def _median_time(f: Any, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def bench_inprocess(rows: int, hidden: int, repeat: int) -> dict[str, float]:
    """Seconds per forward and per forward + backward of the numba backend, preallocated outputs."""
    x = np.ascontiguousarray(_table(hidden, SEED).take((np.arange(rows) * 7) % TABLE_ROWS, axis=0))
    dy = np.ascontiguousarray(_table(hidden, SEED + 1).take((np.arange(rows) * 7) % TABLE_ROWS, axis=0))
    w = np.random.default_rng(1).uniform(0.5, 1.5, hidden).astype(np.float32)
    b = np.random.default_rng(2).normal(0, 0.1, hidden).astype(np.float32)
    y, dx = np.empty_like(x), np.empty_like(x)

    def fwd() -> None:
        pynorm.layer_norm_forward(x, w, b, backend="numba", out=y)

    def fwdbwd() -> None:
        _, ctx = pynorm.layer_norm_forward(x, w, b, backend="numba", out=y)
        pynorm.layer_norm_backward(dy, ctx, dx_out=dx)

    fwd()
    fwdbwd()  # compile / warm up
    return {"fwd": _median_time(fwd, repeat), "fwd+bwd": _median_time(fwdbwd, repeat)}


def bench_dask(client: Any, rows: int, hidden: int, block_rows: int, repeat: int) -> dict[str, float]:
    """Seconds per generation-only, forward and forward + backward compute on the cluster of ``client``."""
    import pynorm.dask as pdask

    w = np.random.default_rng(1).uniform(0.5, 1.5, hidden).astype(np.float32)
    b = np.random.default_rng(2).normal(0, 0.1, hidden).astype(np.float32)

    def graphs(n: int) -> dict[str, list[Any]]:
        x = lazy_array(n, hidden, block_rows, SEED)
        dy = lazy_array(n, hidden, block_rows, SEED + 1)
        y, ctx = pdask.layer_norm_forward(x, w, b, backend="numba")
        g = pdask.layer_norm_backward(dy, ctx)
        return {
            "gen": [x[:, 0].sum()],
            "fwd": [y[:, 0].sum()],
            "fwd+bwd": [y[:, 0].sum(), g.dx[:, 0].sum(), g.dweight, g.dbias],
        }

    # warm-up on 4 blocks: each worker imports pynorm and loads the numba kernels (from the cache)
    client.gather(client.compute(graphs(min(rows, 4 * block_rows))["fwd+bwd"]))
    out = {}
    for key in ("gen", "fwd", "fwd+bwd"):
        out[key] = _median_time(lambda key=key: client.gather(client.compute(graphs(rows)[key])), repeat)
    return out


def gbs(seconds: float, rows: int, hidden: int, phase: str) -> float:
    n = rows * hidden * 4
    return {"gen": 1, "fwd": 2, "fwd+bwd": 5}[phase] * n / seconds / 1e9


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a 0.5 GiB lazy array, 64 MiB in process, 1 repeat")
    ap.add_argument("--gib", type=float, default=4.0, help="size of the lazy Dask array x (GiB)")
    ap.add_argument("--inproc-gib", type=float, default=0.5, help="size of x in the in-process run (GiB)")
    ap.add_argument("--hidden", type=int, default=HIDDEN)
    ap.add_argument("--block-mib", type=float, default=32.0, help="Dask block size of x (MiB)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--workers", default="1,2", help="worker counts to run, comma-separated")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args(argv)
    if args.quick:
        args.gib, args.inproc_gib, args.repeat = 0.5, 1 / 16, 1
    from distributed import Client, LocalCluster

    h = args.hidden
    rows = int(args.gib * 2**30) // (4 * h)
    rows_in = int(args.inproc_gib * 2**30) // (4 * h)
    block_rows = max(1, int(args.block_mib * 2**20) // (4 * h))
    print(f"# x: {rows} x {h} float32 ({rows * h * 4 / 2**30:.2f} GiB, lazy, blocks of {block_rows} rows); "
          f"in process: {rows_in} x {h} ({rows_in * h * 4 / 2**30:.2f} GiB)", file=sys.stderr)  # fmt: skip
    results: dict[str, Any] = {"rows": rows, "rows_inprocess": rows_in, "hidden": h, "block_rows": block_rows}
    print("# in process (numba, all cores)...", file=sys.stderr)
    inproc = bench_inprocess(rows_in, h, args.repeat)
    results["inprocess"] = inproc
    results["dask"] = {}
    for n in [int(v) for v in args.workers.split(",")]:
        print(f"# LocalCluster, {n} worker(s)...", file=sys.stderr)
        with (
            LocalCluster(
                processes=True, n_workers=n, threads_per_worker=1, memory_limit="6GiB", dashboard_address=None,
                silence_logs=logging.ERROR, env={"NUMBA_NUM_THREADS": "1"},
            ) as cluster,
            Client(cluster) as client,
        ):  # fmt: skip
            results["dask"][n] = bench_dask(client, rows, h, block_rows, args.repeat)
    load = os.getloadavg()
    lines = [
        f"LayerNorm float32, hidden {h}; lazy Dask x {rows * h * 4 / 2**30:.2f} GiB ({rows} rows, blocks of "
        f"{block_rows}); in-process x {rows_in * h * 4 / 2**30:.2f} GiB; {os.cpu_count()} cores; "
        f"load average {load[0]:.1f}",
        "",
        "| path | workers | fwd GB/s | fwd+bwd GB/s | fwd vs in-process | fwd+bwd vs in-process "
        "| generation only GB/s |",
        "|---|---|---|---|---|---|---|",
    ]
    ref = {p: gbs(inproc[p], rows_in, h, p) for p in ("fwd", "fwd+bwd")}
    lines.append(f"| in-process numba | - | {ref['fwd']:.2f} | {ref['fwd+bwd']:.2f} | 1.00 | 1.00 | - |")
    for n, r in results["dask"].items():
        f, fb, g = (gbs(r[p], rows, h, p) for p in ("fwd", "fwd+bwd", "gen"))
        lines.append(f"| pynorm.dask | {n} | {f:.2f} | {fb:.2f} | {f / ref['fwd']:.2f} | {fb / ref['fwd+bwd']:.2f} | "
                     f"{g:.2f} |")  # fmt: skip
    print("\n".join(lines))
    if args.json is not None:
        args.json.write_text(json.dumps({**results, "load_average": load, "table": lines}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
