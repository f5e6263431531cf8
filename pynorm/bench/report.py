"""The benchmark's report: the run's metadata, text tables for the terminal, Markdown tables for the docs, charts.

Every function here reads the results :mod:`pynorm.bench.runner` returns (or their JSON files) and measures
nothing. Speed is shown as ratios measured in the run itself: a fraction of the same-size copy timed in the
same rounds (``%copy``), and the speed-ups over the baselines (``x numpy``, ``x torch``: the baseline's time
over pynorm's, above 1 where pynorm is faster), since the machines it runs on are shared and their bandwidth
moves by 2x within minutes.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = [
    "BYTE_MODEL",
    "chart_ops",
    "chart_shapes",
    "chart_small",
    "compile_text",
    "load_line",
    "machine_line",
    "markdown_ops",
    "markdown_shapes",
    "markdown_small",
    "markdown_torch",
    "meta",
    "ops_text",
    "shapes_text",
    "small_text",
]

#: what the GB/s figures count (:func:`pynorm.bench.cases.op_bytes`)
BYTE_MODEL = {
    "copy": "read x, write y: 2 x.nbytes",
    "fwd": "x, every extra input and every parameter read once; every output written once",
    "bwd": "dy, the saved x (or h), the parameters and the non-residual inputs read once; dx and one gradient per "
    "differentiable input and parameter written once",
    "fwd+bwd": "fwd + bwd",
    "note": "GB/s = counted bytes / median time; per-row statistics and write-allocate reads are not counted, "
    "for the copy nor the ops",
}
#: the lines the shapes chart draws (fractions of copy)
TARGETS = {"fwd_frac_copy": 0.8, "fwdbwd_frac_copy": 0.7}
LIB_NAMES = {"pynorm": "pynorm (numba)", "numpy": "NumPy (reference backend)", "torch": "PyTorch"}


def meta(threads: int, versions: dict[str, dict[str, Any]], unavailable: dict[str, str]) -> dict[str, Any]:
    """The machine, the libraries (as each worker process reports them) and the load at the start of the run."""
    pn = versions.get("pynorm", {})
    out: dict[str, Any] = {
        "python": sys.version.split()[0],
        "numpy": pn.get("numpy"),
        "numba": pn.get("numba"),
        "torch": versions.get("torch", {}).get("torch"),
        "baselines_unavailable": unavailable,
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "numba_threads_effective": pn.get("numba_threads_effective"),
        "serial_threshold_elements": pn.get("serial_threshold_elements"),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": "python -m pynorm bench " + " ".join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    out["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    if hasattr(os, "getloadavg"):
        out["loadavg_start"] = list(os.getloadavg())
    return out


def machine_line(m: dict[str, Any]) -> str:
    """The machine and library versions in one line."""
    return (
        f"{m['cpu']}, {m['cpu_count']} cores, {m['threads']} threads; Python {m['python']}, NumPy {m['numpy']}, "
        f"Numba {m['numba']}, PyTorch {m.get('torch') or 'not installed'}; {m['date']}"
    )


def load_line(m: dict[str, Any]) -> str:
    """The machine's load while a table was measured: the cores the other processes kept busy (and the
    hypervisor's steal), and the load averages at its start and end (which count the benchmark's own threads)."""
    parts = []
    c = m.get("cpu_others")
    if c:
        parts.append(
            f"other processes kept {c['others_cores']:.2f} of the {m['cpu_count']} cores busy on average "
            f"(steal {c['steal_cores']:.2f}) over the {c['seconds']:.0f} s of this table"
        )
    if m.get("loadavg_start"):
        s = m["loadavg_start"]
        e = m.get("loadavg_end") or s
        parts.append(
            f"load average (1, 5, 15 min) {s[0]:.2f}, {s[1]:.2f}, {s[2]:.2f} at the start, {e[0]:.2f}, {e[1]:.2f}, "
            f"{e[2]:.2f} at the end (it counts the benchmark's own threads, up to {m['threads']} cores)"
        )
    return "; ".join(parts) if parts else "load: not measurable on this system"


def _r(v: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def _text(head: str, lines: list[str], note: str = "") -> str:
    """A terminal table: the header ``head``, its rule, the rows ``lines`` and the ``note`` below them (if any)."""
    return "\n".join([head, "-" * len(head), *lines, *([note] if note else [])])


def _markdown(head: str, rows: list[list[str]]) -> str:
    """A docs table: the header ``head`` (the column names, separated by ``" | "``), its rule, then one line per
    row of cells."""
    lines = [f"| {head} |", "|" + "---|" * len(head.split(" | "))]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# the default run: shapes


def _ratio(r: dict[str, Any], lib: str, op: str, phase: str) -> float | None:
    return r["ratios"].get(lib, {}).get(op, {}).get(phase)


def _numba_rows(results: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], str, str, dict[str, Any]]]:
    """``(result, "RxH", op, its numba timings)``: one table row per op of each shape's result."""
    for r in results:
        shape = f"{r['shape'][0]}x{r['shape'][1]}"
        for op, nb in r["numba"].items():
            yield r, shape, op, nb


def shapes_text(results: list[dict[str, Any]]) -> str:
    """The terminal table of :func:`pynorm.bench.runner.shapes_table`."""
    w = max([10, *(len(op) for r in results for op in r["numba"])])
    lines = [
        f"{shape:>11s} {op:{w}s} {r['limits']['copy_gbs']:9.1f} {r['limits']['numpy_copyto_gbs']:6.1f} | "
        f"{nb['fwd']['gbs']:8.1f} {100 * nb['fwd']['frac_copy']:4.0f}% | "
        f"{nb['bwd']['gbs']:8.1f} {100 * nb['bwd']['frac_copy']:4.0f}% | "
        f"{nb['fwd+bwd']['gbs']:8.1f} {100 * nb['fwd+bwd']['frac_copy']:4.0f}% | "
        f"{nb['alloc_over_out']:9.2f} | "
        f"{_r(_ratio(r, 'numpy', op, 'fwd+bwd')):>7s} {_r(_ratio(r, 'torch', op, 'fwd+bwd')):>7s} "
        f"(fwd: {_r(_ratio(r, 'numpy', op, 'fwd')):>5s} {_r(_ratio(r, 'torch', op, 'fwd')):>5s})"
        for r, shape, op, nb in _numba_rows(results)
    ]
    head = (
        f"{'shape':>11s} {'op':{w}s} {'copy GB/s':>9s} {'copyto':>6s} | {'fwd GB/s':>8s} {'%copy':>5s}"
        f" | {'bwd GB/s':>8s} {'%copy':>5s} | {'f+b GB/s':>8s} {'%copy':>5s} | {'alloc/out':>9s}"
        f" | {'x numpy':>7s} {'x torch':>7s} (fwd+bwd; fwd: {'numpy':>5s} {'torch':>5s})"
    )
    note = (
        "(copy: the same-size copy on the backend's threads, timed in the same rounds; copyto: numpy.copyto, one "
        "thread; x numpy / x torch: the baseline's time over pynorm's, each baseline timed in its own process)"
    )
    return _text(head, lines, note)


def markdown_shapes(report: dict[str, Any]) -> str:
    """The docs table of the default run (``bench_results.json``)."""
    rows = []
    for r, shape, op, nb in _numba_rows(report["results"]):
        cells = [shape, f"`{op}`", f"{r['limits']['copy_gbs']:.1f}"]
        cells += [f"{nb[ph]['gbs']:.1f} ({100 * nb[ph]['frac_copy']:.0f}%)" for ph in ("fwd", "bwd", "fwd+bwd")]
        for lib in ("numpy", "torch"):
            f, fb = _ratio(r, lib, op, "fwd"), _ratio(r, lib, op, "fwd+bwd")
            cells.append("-" if f is None else f"{f:.1f} / {_r(fb)}")
        rows.append(cells)
    return _markdown(
        "shape | op | copy GB/s | fwd GB/s (% copy) | bwd GB/s (% copy) | fwd+bwd GB/s (% copy) "
        "| x NumPy (fwd / fwd+bwd) | x PyTorch (fwd / fwd+bwd)",
        rows,
    )


def _plt() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return None
    return plt


def chart_shapes(results: list[dict[str, Any]], path: Path) -> bool:
    """Two panels: pynorm's fraction of copy per shape, op and phase; its forward + backward speed-up over each
    baseline (log scale). False (nothing written) without matplotlib."""
    plt = _plt()
    if plt is None:
        return False
    ops = list(results[0]["numba"]) if results else []
    labels = [f"{r['shape'][0]}x{r['shape'][1]}" for r in results]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5))
    series = [(op, ph) for op in ops for ph in ("fwd", "bwd", "fwd+bwd")]
    width = 0.8 / max(1, len(series))
    for k, (op, ph) in enumerate(series):
        vals = [100 * r["numba"][op][ph]["frac_copy"] for r in results]
        ax1.bar([i + k * width for i in range(len(results))], vals, width, label=f"{op} {ph}")
    ax1.axhline(100 * TARGETS["fwd_frac_copy"], color="k", ls="--", lw=0.8)
    ax1.axhline(100 * TARGETS["fwdbwd_frac_copy"], color="gray", ls=":", lw=0.8)
    ax1.set_xticks([i + 0.4 - width / 2 for i in range(len(results))], labels)
    ax1.set_ylabel("% of same-size copy bandwidth (same rounds)")
    ax1.set_title("numba backend, float32")
    ax1.legend(fontsize=7, loc="upper left", framealpha=0.8)
    libs = [lib for lib in ("numpy", "torch") if any(lib in r["ratios"] for r in results)]
    series2 = [(op, lib) for op in ops for lib in libs]
    width2 = 0.8 / max(1, len(series2))
    for k, (op, lib) in enumerate(series2):
        vals = [_ratio(r, lib, op, "fwd+bwd") or 0.0 for r in results]
        ax2.bar([i + k * width2 for i in range(len(results))], vals, width2, label=f"{op} vs {LIB_NAMES[lib]}")
    ax2.axhline(1, color="k", lw=0.6)
    ax2.set_yscale("log")
    ax2.set_xticks([i + 0.4 - width2 / 2 for i in range(len(results))], labels)
    ax2.set_ylabel("baseline time / pynorm time, fwd+bwd (x)")
    ax2.set_title("speed-up over the baselines (each in its own process)")
    if series2:
        ax2.legend(fontsize=7, loc="lower left", framealpha=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------
# --ops


def _speedup(row: dict[str, Any], lib: str, phase: str) -> float | None:
    return row.get("speedup", {}).get(lib, {}).get(phase)


def ops_text(rows: list[dict[str, Any]], torch_native: dict[str, bool] | None = None) -> str:
    """The terminal table of :func:`pynorm.bench.runner.op_table`; a ``*`` marks a PyTorch baseline that is the
    op's formula in PyTorch ops rather than one PyTorch function (``torch_native``: op -> native)."""
    lines: list[str] = []
    for r in rows:
        mark = "" if torch_native is None or torch_native.get(r["op"], True) else "*"
        tf, tfb = _speedup(r, "torch", "fwd"), _speedup(r, "torch", "fwd+bwd")
        lines.append(
            f"{r['op']:22s} | {r['copy_gbs']:9.1f} | {r['fwd_s'] * 1e3:7.1f} {r['fwd_gbs']:6.1f} "
            f"{100 * r['fwd_frac_copy']:4.0f}% {100 * r['fwd_frac_run_copy']:4.0f}% | {r['fwd+bwd_s'] * 1e3:7.1f} "
            f"{r['fwd+bwd_gbs']:6.1f} {100 * r['fwd+bwd_frac_copy']:4.0f}% {100 * r['fwd+bwd_frac_run_copy']:4.0f}% | "
            f"{_r(_speedup(r, 'numpy', 'fwd')):>11s} {_r(_speedup(r, 'numpy', 'fwd+bwd')):>5s} | "
            f"{_r(tf) + (mark if tf is not None else ''):>11s} {_r(tfb) + (mark if tfb is not None else ''):>6s}"
        )
    head = (
        f"{'op':22s} | {'copy GB/s':>9s} | {'fwd ms':>7s} {'GB/s':>6s} {'%copy':>5s} {'%run':>5s} | "
        f"{'f+b ms':>7s} {'GB/s':>6s} {'%copy':>5s} {'%run':>5s} | {'x numpy fwd':>11s} {'f+b':>5s} | "
        f"{'x torch fwd':>11s} {'f+b':>6s}"
    )
    if not rows:
        return _text(head, lines)
    note = (
        f"(%copy: against the copies timed in that op's rounds; %run: against the run's median copy, "
        f"{rows[0]['run_copy_gbs']:.1f} GB/s; x numpy / x torch: the baseline's time over pynorm's, each "
        f"baseline in its own process" + ("; *: the op's formula in PyTorch ops)" if torch_native else ")")
    )
    return _text(head, lines, note)


def markdown_ops(report: dict[str, Any]) -> str:
    """The docs table of ``--ops`` (``op_table.json``)."""
    native = {op: b["native"] for op, b in report.get("torch_baselines", {}).items()}
    rows = []
    for r in report["rows"]:
        cells = [
            f"`{r['op']}`",
            f"{r['fwd_s'] * 1e3:.1f}",
            f"{100 * r['fwd_frac_copy']:.0f}%",
            f"{r['fwd+bwd_s'] * 1e3:.1f}",
            f"{100 * r['fwd+bwd_frac_copy']:.0f}%",
        ]
        for lib in ("numpy", "torch"):
            f, fb = _speedup(r, lib, "fwd"), _speedup(r, lib, "fwd+bwd")
            cells.append("-" if f is None else f"{f:.1f} / {_r(fb)}")
        cells.append("-" if r["op"] not in native else ("function" if native[r["op"]] else "composition"))
        rows.append(cells)
    return _markdown(
        "op | fwd ms | fwd % copy | fwd+bwd ms | fwd+bwd % copy | x NumPy (fwd / fwd+bwd) "
        "| x PyTorch (fwd / fwd+bwd) | PyTorch baseline",
        rows,
    )


def markdown_torch(report: dict[str, Any]) -> str:
    """The PyTorch baselines of a run (``torch_baselines`` of ``op_table.json``): each op's PyTorch code."""
    rows = []
    for op, b in report.get("torch_baselines", {}).items():
        kind = "function" if b["native"] else "composition"
        rows.append([f"`{op}`", f"`{b['expr']}`", f"{kind}{': ' + b['why'] if b['why'] else ''}"])
    return _markdown("op | PyTorch (autograd, CPU) | kind", rows)


def chart_ops(rows: list[dict[str, Any]], path: Path) -> bool:
    """Two panels: each op's forward and forward + backward as % of copy; its speed-ups over the baselines (log
    scale). False (nothing written) without matplotlib."""
    plt = _plt()
    if plt is None:
        return False
    ops = [r["op"] for r in rows]
    ys = list(range(len(ops)))
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 0.42 * len(ops) + 1.8), sharey=True)
    for k, ph in enumerate(("fwd", "fwd+bwd")):
        ax1.barh([y + 0.4 * k for y in ys], [100 * r[f"{ph}_frac_copy"] for r in rows], 0.4, label=ph)
    ax1.axvline(100, color="k", lw=0.6)
    ax1.set_yticks([y + 0.2 for y in ys], ops)
    ax1.invert_yaxis()
    ax1.set_xlabel("% of same-size copy bandwidth (same rounds)")
    shape = f"{rows[0]['shape'][0]}x{rows[0]['shape'][1]}" if rows else ""
    ax1.set_title(f"numba backend, float32 {shape}")
    ax1.legend(fontsize=8, loc="lower right")
    series = [(lib, ph) for lib in ("numpy", "torch") for ph in ("fwd", "fwd+bwd") if any(_speedup(r, lib, ph)
              for r in rows)]  # fmt: skip
    h = 0.8 / max(1, len(series))
    for k, (lib, ph) in enumerate(series):
        ax2.barh([y + h * k for y in ys], [_speedup(r, lib, ph) or 0.0 for r in rows], h,
                 label=f"vs {LIB_NAMES[lib]}, {ph}")  # fmt: skip
    ax2.axvline(1, color="k", lw=0.6)
    ax2.set_xscale("log")
    ax2.set_xlabel("baseline time / pynorm time (x)")
    ax2.set_title("speed-up over the baselines (each in its own process)")
    if series:
        ax2.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------
# --small


def _us(row: dict[str, Any], lib: str, phase: str) -> float | None:
    return row.get(lib, {}).get(phase)


def small_text(res: dict[str, Any]) -> str:
    """The terminal table of :func:`pynorm.bench.runner.small_calls`."""
    lines: list[str] = []
    for r in res["rows"]:
        cells = []
        for lib, w in (("pynorm", 9), ("numpy", 7), ("torch", 9)):
            cells.append(
                f"{_r(_us(r, lib, 'fwd'), '{:.1f}'):>{w}s} {_r(_us(r, lib, 'bwd'), '{:.1f}'):>6s} "
                f"{_r(_us(r, lib, 'fwd+bwd'), '{:.1f}'):>6s}"
            )
        xr = r["ratio"].get("numpy", {}).get("fwd+bwd")
        xt = r["ratio"].get("torch", {}).get("fwd+bwd")
        lines.append(f"{r['op']:22s} | " + " | ".join(cells) + f" | {_r(xr, '{:.2f}'):>9s} {_r(xt, '{:.2f}'):>11s}")
    head = (
        f"{'op':22s} | {'numba fwd':>9s} {'bwd':>6s} {'f+b':>6s} | {'ref fwd':>7s} {'bwd':>6s} {'f+b':>6s} | "
        f"{'torch fwd':>9s} {'bwd':>6s} {'f+b':>6s} | {'x ref f+b':>9s} {'x torch f+b':>11s}"
    )
    note = (
        f"(microseconds per call, {res['shape'][0]}x{res['shape'][1]} float32, allocating calls; numpy.copyto of x: "
        f"{res['copyto_us']:.2f} us in the same rounds; x ref / x torch: that library's time over numba's; "
        f"PyTorch on {res.get('torch_threads', 1)} thread, its bwd is its fwd+bwd minus its fwd)"
    )
    return _text(head, lines, note)


def markdown_small(report: dict[str, Any]) -> str:
    """The docs table of ``--small`` (``small_calls.json``)."""
    rows = []
    for r in report["rows"]:
        cells = [f"`{r['op']}`"]
        fwd = _us(r, "pynorm", "fwd")
        for lib in ("pynorm", "numpy", "torch"):
            f, b = _us(r, lib, "fwd"), _us(r, lib, "bwd")
            cells.append("-" if f is None else f"{f:.1f} / {_r(b)}")
            if lib == "pynorm":
                cells.append("-" if fwd is None else f"{fwd / report['copyto_us']:.0f}x")
        for lib in ("numpy", "torch"):
            cells.append(_r(r["ratio"].get(lib, {}).get("fwd+bwd"), "{:.2f}"))
        rows.append(cells)
    return _markdown(
        "op | numba fwd / bwd µs | numba fwd / numpy.copyto | reference fwd / bwd µs | PyTorch fwd / bwd µs "
        "| x reference (fwd+bwd) | x PyTorch (fwd+bwd)",
        rows,
    )


def chart_small(res: dict[str, Any], path: Path) -> bool:
    """Microseconds per forward + backward of each op on each library (log scale). False without matplotlib."""
    plt = _plt()
    if plt is None:
        return False
    rows = res["rows"]
    libs = [lib for lib in ("pynorm", "numpy", "torch") if any(lib in r for r in rows)]
    ys = list(range(len(rows)))
    h = 0.8 / max(1, len(libs))
    fig, ax = plt.subplots(figsize=(9, 0.42 * len(rows) + 1.8))
    for k, lib in enumerate(libs):
        ax.barh([y + h * k for y in ys], [_us(r, lib, "fwd+bwd") or 0.0 for r in rows], h, label=LIB_NAMES[lib])
    ax.axvline(res["copyto_us"], color="k", ls=":", lw=0.8, label="numpy.copyto of x")
    ax.set_yticks([y + 0.4 - h / 2 for y in ys], [r["op"] for r in rows])
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("microseconds per forward + backward (allocating calls)")
    ax.set_title(f"small calls, {res['shape'][0]}x{res['shape'][1]} float32: fixed costs")
    ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ---------------------------------------------------------------------------
# --compile


def compile_text(rows: list[dict[str, Any]]) -> str:
    """The terminal table of :func:`pynorm.bench.runner.compile_times`."""
    head = (
        f"{'op':22s} {'dtype':9s} | {'cold fwd':>8s} {'cold bwd':>8s} {'cold f+b':>8s} | {'warm f+b':>8s}"
        f" | {'import':>6s} | {'process (cold/warm)':>19s}"
    )
    lines: list[str] = []
    for r in rows:
        if "cold_s" not in r or "warm_s" not in r:
            lines.append(f"{r['op']:22s} {r['dtype']:9s} | failed: {r.get('cold_error') or r.get('warm_error')}")
            continue
        lines.append(
            f"{r['op']:22s} {r['dtype']:9s} | {r['cold_fwd_s']:7.2f}s {r['cold_bwd_s']:7.2f}s {r['cold_s']:7.2f}s |"
            f" {r['warm_s']:7.3f}s | {r['warm_import_pynorm_s']:5.3f}s | {r['cold_process_s']:8.1f}s /"
            f" {r['warm_process_s']:6.2f}s"
        )
    return _text(head, lines)
