"""Griffe extension for the docs site: render pynorm's reST-flavoured docstrings as Markdown.

pynorm's docstrings are NumPy style with a few reStructuredText constructs (``.. math::`` blocks,
``:math:`` / ``:func:`` / ``:class:`` ... roles, ``.. code-block::``, bare ``>>>`` examples). mkdocstrings
renders docstrings as Markdown, so this extension rewrites those constructs when griffe loads an object:

* ``.. math::`` + indented block -> ``$$ ... $$`` blocks, one per equation (pymdownx.arithmatex renders them);
* ``:math:`e``` -> ``$e$``;
* ``:func:`~a.b```, ``:class:``, ``:mod:``, ``:meth:``, ``:attr:``, ``:data:``, ``:exc:``, ``:obj:`` -> ```b``` (code);
* ``.. code-block:: lang`` + indented block, and runs of ``>>>`` lines -> fenced code blocks.

The source docstrings are not changed. Loaded by mkdocs.yml (``extensions: - docs/griffe_rst.py``).

The ops' functions (``pynorm.functional``) are made at import time from the op specs; griffe reads their
signatures from ``pynorm/functional.pyi`` and this extension takes their docstrings from the imported functions.
A function whose runtime signature is set at import (``__signature__``: the blocks' constructors, whose keyword
options ``pynorm.blocks._base.keyword_options`` declares once) gets the parameters of that signature, which is
what ``inspect.signature`` and users see, instead of the ``**kw`` of its source.
"""

from __future__ import annotations

import importlib
import inspect
import re
from typing import Any

from griffe import Docstring, Extension, Function, Object, Parameter, ParameterKind, Parameters

_MATH_ROLE = re.compile(r":math:`([^`]+)`")
_XREF_ROLE = re.compile(r":(?:py:)?(?:func|class|mod|meth|attr|data|exc|obj):`(~?)([^`]+)`")


def _xref(m: re.Match[str]) -> str:
    target = m.group(2).strip()
    if m.group(1) == "~":
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _directive_block(lines: list[str], i: int) -> tuple[list[str], int]:
    """The indented body of the directive on line ``i`` (dedented) and the index after it."""
    base = _indent(lines[i])
    j = i + 1
    body: list[str] = []
    while j < len(lines) and (not lines[j].strip() or _indent(lines[j]) > base):
        body.append(lines[j])
        j += 1
    while body and not body[-1].strip():
        body.pop()
        j -= 1
    while body and not body[0].strip():
        body.pop(0)
    cut = min((_indent(b) for b in body if b.strip()), default=0)
    return [b[cut:] for b in body], j


def convert(text: str) -> str:
    """Rewrite the reST constructs of one docstring as Markdown."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    in_fence = False
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        pad = line[: _indent(line)]
        if stripped.startswith("```"):
            in_fence = not in_fence
            out.append(line)
            i += 1
            continue
        if in_fence:
            out.append(line)
            i += 1
            continue
        if stripped == ".. math::":
            body, i = _directive_block(lines, i)
            # reST separates equations by blank lines; a Markdown $$ block must not contain one
            groups: list[list[str]] = [[]]
            for b in body:
                if b.strip():
                    groups[-1].append(b)
                elif groups[-1]:
                    groups.append([])
            for k, eq in enumerate(g for g in groups if g):
                out += ([""] if k else []) + [pad + "$$", *(pad + e for e in eq), pad + "$$"]
            continue
        if stripped.startswith(".. code-block::"):
            lang = stripped[len(".. code-block::") :].strip()
            body, i = _directive_block(lines, i)
            out += [pad + "```" + lang, *(pad + b for b in body), pad + "```"]
            continue
        if stripped.startswith(">>>"):
            block = []
            while i < len(lines) and lines[i].strip():
                block.append(lines[i][len(pad) :] if lines[i].startswith(pad) else lines[i].lstrip())
                i += 1
            if out and out[-1].strip():
                out.append("")
            out += [pad + "```pycon", *(pad + b for b in block), pad + "```"]
            continue
        line = _MATH_ROLE.sub(lambda m: "$" + m.group(1).strip() + "$", line)
        out.append(_XREF_ROLE.sub(_xref, line))
        i += 1
    return "\n".join(out)


def _runtime(path: str) -> Any:
    """The imported object of a dotted ``path`` (None if it cannot be found)."""
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name, None)
        return obj
    return None


def _expression(value: Any) -> str:
    """A default value as source text (a class by its dotted name: ``numpy.float32``)."""
    if isinstance(value, type):
        return f"{value.__module__.partition('.')[0]}.{value.__qualname__}"
    return repr(value)


def _parameters(sig: inspect.Signature) -> Parameters:
    """griffe's parameters of a runtime signature."""
    empty = inspect.Parameter.empty
    return Parameters(
        *(
            Parameter(
                p.name,
                annotation=None if p.annotation is empty else str(p.annotation),
                kind=ParameterKind(p.kind.description),
                default=None if p.default is empty else _expression(p.default),
            )
            for p in sig.parameters.values()
        )
    )


class RstToMarkdown(Extension):
    """Convert each loaded object's docstring (see the module docstring)."""

    def on_function_instance(self, *, func: Function, **kwargs: Any) -> None:
        if not func.path.startswith("pynorm.blocks."):
            return
        sig = getattr(_runtime(func.path), "__signature__", None)
        if isinstance(sig, inspect.Signature):
            func.parameters = _parameters(sig)

    def on_instance(self, *, obj: Object, **kwargs: Any) -> None:
        if obj.docstring is None and obj.path.startswith("pynorm.functional.") and obj.is_function:
            import pynorm.functional

            doc = getattr(getattr(pynorm.functional, obj.name, None), "__doc__", None)
            if doc:
                obj.docstring = Docstring(doc, parent=obj)
        if obj.docstring is not None:
            obj.docstring.value = convert(obj.docstring.value)
