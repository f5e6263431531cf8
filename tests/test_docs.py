"""The documentation's examples run, and its generated parts are current.

* Every ```` ```python ```` block of ``docs/**/*.md`` and ``README.md`` is executed; the blocks of one
  page run in order in one namespace (a later block may use an earlier block's names), each page in
  its own Python process (``python tests/test_docs.py PAGE``), so that a page registering a backend or
  starting a cluster cannot affect another. Every ```` ```pycon ```` block (``>>>`` sessions) is run as a
  doctest in the same namespace, its printed output compared (``ELLIPSIS`` and
  ``NORMALIZE_WHITESPACE``). Blocks of any other language (``text``, ``bash``, ``toml``...) are not
  run: signatures and formulas are ``text``.
* A block that must not run here (it needs a GPU or a cluster, or it is an excerpt of a module
  that does not exist) is preceded by the line ``<!-- no-run: the reason -->``; the reason is
  required, and every such page is listed in ``docs/getting_started.md`` ("Examples in these pages").
* A block preceded by ``<!-- requires: mod1, mod2 -->`` runs only where those modules import (e.g.
  ``torch``), and is skipped, with a message, elsewhere.
* The examples run with ``pynorm.use_backend("numpy")`` (the reference; no JIT compilation), so
  NumPy inputs never reach the numba backend.
* ``docs/figures.py`` runs (into a temporary directory; skipped without matplotlib) and every figure
  the pages show exists; the tables in ``docs/benchmarks.md`` are ``bench/chart.py``'s output for the
  committed results; every page is in the ``mkdocs.yml`` nav.
"""

from __future__ import annotations

import doctest
import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

import pynorm

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [*sorted(DOCS.rglob("*.md")), ROOT / "README.md"]
FENCE = re.compile(r"^(?P<indent>[ ]*)(?P<ticks>`{3,})(?P<lang>[\w+-]*).*$")
NO_RUN = re.compile(r"^\s*<!--\s*no-run:(?P<reason>.*?)-->\s*$")
REQUIRES = re.compile(r"^\s*<!--\s*requires:(?P<mods>.*?)-->\s*$")
RUN_LANGS = ("python", "pycon")


@dataclass
class Block:
    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    code: str
    skip: str | None  # the no-run reason, or None
    requires: tuple[str, ...] = ()  # modules the block needs (skipped where one is missing)

    @property
    def where(self) -> str:
        path = self.path.relative_to(ROOT) if self.path.is_relative_to(ROOT) else self.path
        return f"{path}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The fenced code blocks of a Markdown file (any indentation, any fence length)."""
    lines = path.read_text(encoding="utf-8").split("\n")
    out: list[Block] = []
    i = 0
    prev = ""
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            if lines[i].strip():
                prev = lines[i]
            i += 1
            continue
        indent, ticks, lang = len(m["indent"]), m["ticks"], m["lang"]
        start = i
        body = []
        i += 1
        while i < len(lines) and not re.match(rf"^[ ]*{ticks}\s*$", lines[i]):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i])
            i += 1
        i += 1
        nr, rq = NO_RUN.match(prev), REQUIRES.match(prev)
        requires = tuple(m.strip() for m in rq["mods"].split(",") if m.strip()) if rq else ()
        code = textwrap.dedent("\n".join(body))
        out.append(Block(path, start + 1, lang, code, nr["reason"].strip() if nr else None, requires))
        prev = ""
    return out


ALL = {p: blocks(p) for p in PAGES}
RUNNABLE = {p: [b for b in bs if b.lang in RUN_LANGS] for p, bs in ALL.items()}
PAGES_WITH_EXAMPLES = [p for p, bs in RUNNABLE.items() if bs]


def _run_pycon(block: Block, ns: dict[str, object]) -> None:
    test = doctest.DocTestParser().get_doctest(block.code, ns, block.where, str(block.path), block.line)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    runner.run(test, out=report.append, clear_globs=False)
    assert runner.failures == 0, f"{block.where}: doctest failed\n" + "".join(report)


def run_page(page: Path) -> list[str]:
    """Run a page's examples in this process; returns the messages of the blocks skipped for a missing module."""
    ns: dict[str, object] = {"__name__": f"docs_example_{page.stem}"}
    skipped = []
    with pynorm.use_backend("numpy"):
        for block in blocks(page):
            if block.lang not in RUN_LANGS or block.skip is not None:
                continue
            missing = [m for m in block.requires if importlib.util.find_spec(m) is None]
            if missing:
                skipped.append(f"{block.where}: needs {', '.join(missing)}")
                continue
            if block.lang == "pycon":
                _run_pycon(block, ns)
                continue
            try:
                exec(compile(block.code, block.where, "exec"), ns)
            except Exception as exc:
                raise AssertionError(f"the example at {block.where} raised {type(exc).__name__}: {exc}") from exc
    return skipped


_BACKENDS_UNDER_TEST = [b.strip() for b in os.environ.get("PYNORM_TEST_BACKENDS", "numpy").split(",") if b.strip()]


@pytest.mark.skipif(
    "numpy" not in _BACKENDS_UNDER_TEST,
    reason="the examples run on the numpy backend; this environment tests another (tox -e docs and numpy run them)",
)
@pytest.mark.parametrize("page", PAGES_WITH_EXAMPLES, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_examples_run(page: Path, tmp_path: Path) -> None:
    # the modules this process sees, and the repository (examples import tests.oracle_targets); the examples run in
    # a temporary directory, so that the files they write (the oracle's r.json...) do not land in the checkout
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *(p for p in sys.path if p)])}
    proc = subprocess.run(
        [sys.executable, __file__, str(page)], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path
    )
    assert proc.returncode == 0, f"{page.relative_to(ROOT)}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    skipped = [line for line in proc.stdout.splitlines() if line.startswith("SKIPPED ")]
    if skipped and not any(b.skip is None and not b.requires for b in RUNNABLE[page]):
        pytest.skip("; ".join(skipped))


def test_the_runner_finds_the_examples() -> None:
    """Guards the parser itself: it must see the norm pages' examples (one per norm page at least)."""
    norm_pages = sorted((DOCS / "norms").glob("*.md"))
    assert len(norm_pages) >= 11
    for p in norm_pages:
        assert any(b.skip is None for b in RUNNABLE[p]), f"{p.name} has no runnable example"
    n = sum(1 for bs in RUNNABLE.values() for b in bs if b.skip is None)
    assert n >= 20, n


def test_no_run_markers_have_reasons_and_are_listed() -> None:
    listed = (DOCS / "getting_started.md").read_text(encoding="utf-8")
    for p, bs in ALL.items():
        for b in bs:
            if b.skip is None:
                continue
            assert b.skip, f"{b.where}: a no-run marker needs a reason"
            assert b.lang in RUN_LANGS, f"{b.where}: no-run on a {b.lang or 'plain'} block, which never runs"
            assert str(p.relative_to(ROOT)) in listed or p.name in listed, (
                f"{b.where}: not listed under 'Examples in these pages' in docs/getting_started.md"
            )


def test_marker_on_a_python_block_is_honoured(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "text\n\n<!-- no-run: needs a GPU -->\n```python\nimport cupy\n```\n\n  ```pycon\n  >>> 1 + 1\n  2\n  ```\n"
    )
    bs = blocks(page)
    assert [(b.lang, b.skip, b.code.strip()) for b in bs] == [
        ("python", "needs a GPU", "import cupy"),
        ("pycon", None, ">>> 1 + 1\n2"),
    ]


def test_a_failing_doctest_fails(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("```pycon\n>>> 1 + 1\n3\n```\n")
    with pytest.raises(AssertionError, match="doctest failed"):
        _run_pycon(blocks(page)[0], {})


def test_every_figure_shown_exists() -> None:
    shown = {m for p in PAGES for m in re.findall(r"figures/([\w-]+\.png)", p.read_text(encoding="utf-8"))}
    assert shown, "no figures found"
    missing = sorted(f for f in shown if not (DOCS / "figures" / f).is_file())
    assert not missing, missing


def test_figures_script_writes_every_figure(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from .helpers import load_example  # (not at the top: this file also runs as a script)

    figures = load_example(DOCS / "figures.py", "pynorm_docs_figures")
    assert figures.main([str(tmp_path)]) == 0  # type: ignore[attr-defined]
    for name in figures.FIGURES:  # type: ignore[attr-defined]
        assert (tmp_path / f"{name}.png").stat().st_size > 5000, name
        assert (DOCS / "figures" / f"{name}.png").is_file(), f"{name}.png is not committed"


def test_benchmark_page_is_the_chart_scripts_output() -> None:
    """docs/benchmarks.md holds bench/chart.py's output for the committed run: machine, loads, every table."""
    from .helpers import load_example  # (not at the top: this file also runs as a script)

    chart = load_example(ROOT / "bench" / "chart.py", "pynorm_bench_chart")
    runs = chart.load()  # type: ignore[attr-defined]
    page = (DOCS / "benchmarks.md").read_text(encoding="utf-8")
    assert chart.machine_line(runs["shapes"]) in page  # type: ignore[attr-defined]
    assert chart.markdown_table(runs["shapes"]) in page  # type: ignore[attr-defined]
    assert chart.ops_table(runs["ops"]) in page  # type: ignore[attr-defined]
    assert chart.small_table(runs["small"]) in page  # type: ignore[attr-defined]
    assert chart.torch_table(runs["ops"]) in page  # type: ignore[attr-defined]
    for run in runs.values():
        assert chart.load_line(run) in page  # type: ignore[attr-defined]


def test_every_page_is_in_the_nav() -> None:
    nav = set(re.findall(r":\s*([\w/.-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), flags=re.M))
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert not pages - nav, sorted(pages - nav)


def test_the_readme_command_is_what_ci_runs() -> None:
    """README's second command is ``.ci/run``'s, and every tox environment in it exists (``docs`` among them)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8").split("\n")
    ci = [line for line in (ROOT / ".ci" / "run").read_text().split("\n") if line.startswith("pip install tox")]
    assert readme[4] == ci[0], (readme[4], ci)
    envs = ci[0].split("tox -e ", 1)[1].split(",")
    tox = (ROOT / "tox.ini").read_text()
    assert "docs" in envs
    for env in envs:
        assert f"[testenv:{env}]" in tox, env


def test_the_griffe_extension_converts_rest() -> None:
    """docs/griffe_rst.py turns the docstrings' reST into Markdown the site renders (math, roles, examples)."""
    pytest.importorskip("griffe")
    from .helpers import load_example  # (not at the top: this file also runs as a script)

    ext = load_example(DOCS / "griffe_rst.py", "pynorm_docs_griffe_rst")
    text = "A :func:`~pynorm.layer_norm` and :math:`x^2`.\n\n.. math::\n\n    a = 1\n\n    b = 2\n\n>>> 1 + 1\n2\n"
    assert ext.convert(text).split("\n") == [  # type: ignore[attr-defined]
        "A `layer_norm` and $x^2$.",
        "",
        "$$",
        "a = 1",
        "$$",
        "",
        "$$",
        "b = 2",
        "$$",
        "",
        "```pycon",
        ">>> 1 + 1",
        "2",
        "```",
        "",
    ]


if __name__ == "__main__":  # python tests/test_docs.py PAGE: run one page's examples (what the test does)
    for message in run_page(Path(sys.argv[1]).resolve()):
        print("SKIPPED " + message)
