"""The benchmark page's tables and charts, from one committed ``python -m pynorm bench --all`` run.

``python bench/chart.py`` reads ``bench/published/`` (``bench_results.json``, ``op_table.json``,
``small_calls.json``: the files ``python -m pynorm bench --all --out DIR`` writes; copy them there to refresh
it), writes the benchmark's charts to ``docs/figures/`` (``bench.png``, ``bench_ops.png``, ``bench_small.png``)
and prints the Markdown that ``docs/benchmarks.md`` shows: the machine, its load, the three tables and the
PyTorch baselines.
``--dir`` and ``--figures`` choose other directories; ``--table-only`` skips the charts (no matplotlib needed).
``tests/test_docs.py`` checks that the page holds this script's output, so the page cannot drift from the
committed results.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from pynorm.bench import report  # noqa: E402

DEFAULT_DIR = ROOT / "bench" / "published"
DEFAULT_FIGURES = ROOT / "docs" / "figures"
#: the run's files, and the chart each one's section shows
FILES = {"shapes": "bench_results.json", "ops": "op_table.json", "small": "small_calls.json"}
CHARTS = {"shapes": "bench.png", "ops": "bench_ops.png", "small": "bench_small.png"}


def load(directory: Path = DEFAULT_DIR) -> dict[str, dict[str, Any]]:
    """The committed results by section (``shapes``, ``ops``, ``small``)."""
    return {k: json.loads((directory / f).read_text()) for k, f in FILES.items()}


def markdown_table(report_: dict[str, Any]) -> str:
    """The default run's table (``bench_results.json``)."""
    return report.markdown_shapes(report_)


def ops_table(report_: dict[str, Any]) -> str:
    """The ``--ops`` table (``op_table.json``)."""
    return report.markdown_ops(report_)


def small_table(report_: dict[str, Any]) -> str:
    """The ``--small`` table (``small_calls.json``)."""
    return report.markdown_small(report_)


def torch_table(report_: dict[str, Any]) -> str:
    """The PyTorch baselines of the run (``op_table.json``)."""
    return report.markdown_torch(report_)


def machine_line(report_: dict[str, Any]) -> str:
    """The machine and library versions of a result file."""
    return report.machine_line(report_["meta"])


def load_line(report_: dict[str, Any]) -> str:
    """The load averages at the start and end of a result file's part of the run."""
    return report.load_line(report_["meta"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="the result files (default bench/published)")
    parser.add_argument("--figures", type=Path, default=DEFAULT_FIGURES, help="where the charts go")
    parser.add_argument("--table-only", action="store_true", help="print the tables; write no chart")
    args = parser.parse_args(argv)
    runs = load(args.dir)
    print(f"Machine: {machine_line(runs['shapes'])}\n")
    for key, make in (("shapes", markdown_table), ("ops", ops_table), ("small", small_table)):
        print(f"Load: {load_line(runs[key])}\n")
        print(make(runs[key]) + "\n")
    print(torch_table(runs["ops"]) + "\n")
    if not args.table_only:
        args.figures.mkdir(parents=True, exist_ok=True)
        ok = (
            report.chart_shapes(runs["shapes"]["results"], args.figures / CHARTS["shapes"])
            and report.chart_ops(runs["ops"]["rows"], args.figures / CHARTS["ops"])
            and report.chart_small(runs["small"], args.figures / CHARTS["small"])
        )
        if not ok:
            print("matplotlib is not installed: no chart", file=sys.stderr)
            return 1
        print("wrote " + ", ".join(str(args.figures / c) for c in CHARTS.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
