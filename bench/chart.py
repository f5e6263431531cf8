"""The benchmark page's chart and table, from a committed ``python -m pynorm bench`` result.

``python bench/chart.py`` reads ``bench/published/cpu_quick.json`` (written by
``python -m pynorm bench --quick --out DIR``; copy DIR/bench_results.json there to refresh it),
writes ``docs/figures/bench.png`` (the benchmark's own two-panel chart) and prints the Markdown table
that ``docs/benchmarks.md`` shows. ``--json``, ``--png`` choose other files; ``--table-only`` skips the
chart (no matplotlib needed). ``tests/test_docs.py`` checks that the page's table is this script's output.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_JSON = ROOT / "bench" / "published" / "cpu_quick.json"
DEFAULT_PNG = ROOT / "docs" / "figures" / "bench.png"
OPS = ("layer_norm", "rms_norm")


def markdown_table(report: dict[str, Any]) -> str:
    """One row per shape and op: numba GB/s and % of copy per phase, and the fwd+bwd speed-ups."""
    head = (
        "| shape | op | copy GB/s | fwd GB/s (% copy) | bwd GB/s (% copy) | fwd+bwd GB/s (% copy) "
        "| x naive NumPy | x reference | x PyTorch |"
    )
    lines = [head, "|" + "---|" * 9]
    for r in report["results"]:
        shape = f"{r['shape'][0]}x{r['shape'][1]}"
        for op in OPS:
            nb = r["numba"][op]
            cells = [f"{nb[ph]['gbs']:.1f} ({100 * nb[ph]['frac_copy']:.0f}%)" for ph in ("fwd", "bwd", "fwd+bwd")]
            ratios = []
            for kind in ("naive_numpy", "reference", "torch"):
                rat = r["ratios"].get(kind)
                ratios.append(f"{rat[op]['fwd+bwd']:.1f}" if rat and "fwd+bwd" in rat[op] else "-")
            lines.append(f"| {shape} | `{op}` | {r['limits']['copy_gbs']:.1f} | " + " | ".join(cells + ratios) + " |")
    return "\n".join(lines)


def machine_line(report: dict[str, Any]) -> str:
    m = report["meta"]
    return (
        f"{m['cpu']}, {m['cpu_count']} cores, {m['threads']} threads; Python {m['python']}, NumPy {m['numpy']}, "
        f"Numba {m['numba']}, PyTorch {m.get('torch') or 'not installed'}; {m['date']}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, default=DEFAULT_JSON)
    parser.add_argument("--png", type=Path, default=DEFAULT_PNG)
    parser.add_argument("--table-only", action="store_true", help="print the table; write no chart")
    args = parser.parse_args(argv)
    report = json.loads(args.json.read_text())
    print(f"Machine: {machine_line(report)}\n")
    print(markdown_table(report))
    if not args.table_only:
        from pynorm.benchmark import _chart

        args.png.parent.mkdir(parents=True, exist_ok=True)
        if not _chart(report["results"], args.png):
            print("matplotlib is not installed: no chart", file=sys.stderr)
            return 1
        print(f"\nwrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
