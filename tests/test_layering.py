"""pynorm's modules form layers, and every import runs down them: no circles, nothing reaching up.

The layers, bottom to top (a module may import modules of its own layer or below -- at module level or inside a
function -- and no two packages of one layer import each other):

==  ==============================================================================================
0   ``errors``, ``_dtypes``: names, rounding, working precision
1   ``ops``: the specs, their ctx and gradient types, the dtype rules they state
2   ``reference``: the math (the ``numpy`` backend and the oracle); ``_measure``: ulps, hard inputs, term scales
3   ``_registry``: backend records, resolution (backend packages are loaded by their import path)
4   ``_validate``: argument checks shared by the in-memory and the Dask entry points
5   ``_dispatch``: validate, resolve, flatten, call a backend, reduce gradients
6   ``backends``: the fast backends' kernels and host code
7   ``composite``: ops over other ops (casting policies, conditional norms, fused Linear)
8   ``_api``, ``functional``: the public functions made from the specs; ``fpquant``: FP8/FP4 ``quantize`` and
    ``dequantize``; ``_plan``: bound calls (``pynorm.plan``)
9   ``pynorm`` (the package), ``layers``, ``deepnorm``, ``optim``
10  ``blocks``, ``dask``, ``jax``, ``oracle``, ``_stub``, ``testing`` (it runs the oracle: ``assert_matches_reference``)
11  ``demo``, ``benchmark``, ``warmup``, ``__main__``
==  ==============================================================================================

The import graph is read from the sources (``ast``): every ``import`` and ``from ... import`` of a pynorm module,
wherever it stands.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pynorm

ROOT = Path(pynorm.__file__).resolve().parent

LAYERS: dict[str, int] = {
    "errors": 0, "_dtypes": 0, "ops": 1, "reference": 2, "_measure": 2, "_registry": 3, "_validate": 4, "_dispatch": 5,
    "backends": 6, "composite": 7, "_api": 8, "functional": 8, "fpquant": 8, "_plan": 8, "": 9, "layers": 9,
    "testing": 10, "blocks": 10, "deepnorm": 9, "dask": 10, "oracle": 10, "_stub": 10, "demo": 11, "benchmark": 11,
    "bench": 11, "__main__": 11, "optim": 9, "jax": 10, "warmup": 11,
}  # fmt: skip


def _modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        parts = p.relative_to(ROOT).with_suffix("").parts
        name = ".".join(("pynorm", *parts))
        out[name.removesuffix(".__init__")] = p
    return out


MODULES = _modules()


def _group(module: str) -> str:
    """The top-level part of pynorm a module belongs to (``""`` for the package itself)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(module: str) -> set[str]:
    """The pynorm modules ``module`` imports (a ``from pkg import name`` of a non-module name counts as ``pkg``)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in MODULES:
                t = t.rpartition(".")[0]
            if t and t != module:
                found.add(t)
    return found


GRAPH = {m: _imports(m) for m in MODULES}

#: imports known to run up (none: the casting policies are composed by the registry above the backends); an entry
#: here must stay true, and the tests fail on any other
KNOWN_UP: set[tuple[str, str]] = set()


def test_every_module_has_a_layer() -> None:
    assert not sorted(m for m in MODULES if _group(m) not in LAYERS)


def test_imports_run_down_the_layers() -> None:
    up = [
        f"{m} (layer {LAYERS[_group(m)]}) imports {d} (layer {LAYERS[_group(d)]})"
        for m, deps in GRAPH.items()
        for d in deps
        if LAYERS[_group(d)] > LAYERS[_group(m)] and (m, d) not in KNOWN_UP
    ]
    assert not up, "\n".join(sorted(up))
    assert all(d in GRAPH[m] for m, d in KNOWN_UP), "a known upward import is gone: remove it from KNOWN_UP"


def test_no_backend_imports_composite_ops() -> None:
    bad = {(m, d) for m, deps in GRAPH.items() if _group(m) == "backends" for d in deps if _group(d) == "composite"}
    assert bad <= KNOWN_UP


def test_no_circles_between_packages() -> None:
    edges = {
        (_group(m), _group(d))
        for m, deps in GRAPH.items()
        for d in deps
        if _group(m) != _group(d) and (m, d) not in KNOWN_UP
    }
    circles = sorted((a, b) for a, b in edges if (b, a) in edges and a < b)
    assert not circles


def test_no_circles_between_modules() -> None:
    """No module reaches itself through the imports (a strongly connected component of one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in GRAPH:
        if v not in index:
            visit(v)
    assert not found


def test_the_reader_finds_real_imports() -> None:
    """The reader sees what it must (so the tests above cannot pass by seeing nothing)."""
    assert "pynorm._dispatch" in GRAPH["pynorm._api"]
    assert "pynorm._dtypes" in GRAPH["pynorm.reference._common"]
    assert "pynorm.ops.layer_norm" in GRAPH["pynorm.reference.layer_norm"]
    assert any(d.startswith("pynorm.backends.numba") for d in GRAPH["pynorm.backends.numba.stats"])
