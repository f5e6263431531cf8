"""The public functional surface, made from the op specs: ``<name>``, ``<name>_forward`` and ``<name>_backward``
for every op of :data:`pynorm.ops.SPECS`.

Each function is real Python code (compiled from its source here, so calls cost what a hand-written function
costs): its parameters, their order, defaults and annotations come from the spec -- ``x``, the extra inputs and
the parameters by position (``None`` defaults from the last required one on), then by keyword the keyword-only
inputs, the options, ``axis``, ``backend`` and ``out`` -- and its docstring is assembled from the spec's texts
(:attr:`~pynorm.ops.OpSpec.doc`, each input's, parameter's and option's ``doc``, the result). Every body is one
call of :func:`pynorm._dispatch.forward` / :func:`~pynorm._dispatch.backward`, which validate, dispatch and
shape the result (:attr:`~pynorm.ops.OpSpec.result`).

:func:`stub` writes the same signatures as a typing stub (``pynorm/functional.pyi``), so that
mypy and editors see every op; ``tests/test_api.py`` regenerates it and compares (``python -m pynorm._stub``
rewrites it).
"""

from __future__ import annotations

import linecache
import sys
import textwrap
from collections.abc import Callable
from typing import Any

from . import _dispatch
from .ops import SPECS, OpSpec
from .ops._spec import PUBLIC, REQUIRED

__all__ = ["build", "functions", "stub"]

#: the parameters every forward takes by keyword after the op's options, with their defaults and docs
_COMMON = (
    ("axis", -1, "int", "first normalized axis (ONNX semantics: dims ``axis .. ndim-1`` of ``x`` are normalized "
     "together), may be negative"),
    ("backend", None, "str | None", "the backend to run on by name (:func:`pynorm.list_backends`); None: "
     ":func:`pynorm.use_backend`, ``PYNORM_BACKEND``, else the best available one for the arrays"),
    ("out", None, "Array | None", "a C-contiguous array to write the first output into (its shape and dtype)"),
)  # fmt: skip

_KIND_DOC = {
    "feature": "an array of shape ``x.shape[axis:]`` (or broadcastable to it from the right), any float dtype",
    "scalar": "a scalar parameter: a 0-d or ``(1,)`` array, any float dtype",
    "table": "a table of shape ``(M, *x.shape[axis:])``, any float dtype: row ``{index}[i]`` serves row ``i``",
    "matrix": "a 2-D array, any float dtype",
    "vector": "a 1-D array, any float dtype",
    "channel": "an array of shape ``(C,)``, one value per channel, any float dtype",
}
_INPUT_DOC = {
    "like_x": "a float array of ``x``'s shape, any float dtype",
    "row_index": "an integer array of shape ``x.shape[:axis]``",
    "cond": "a float array of conditioning vectors of ``C`` features: ``cond.shape[:-1]`` is ``x.shape[:axis]`` "
    "(one per row of ``x``) or a leading part ``x.shape[:k]``, ``k < axis``, optionally followed by size-1 dims "
    "(one per sample, shared by the rows of ``x.shape[k:axis]``)",
    "row_scale": "a positive finite scale: a Python number, a 0-d or ``(1,)`` array, or one per row "
    "(``x.shape[:axis]``)",
    "running": "a finite float array of shape ``(C,)``, never written (the update is returned)",
}


def _annotation(default: Any, given: str) -> str:
    if given:
        return given
    for t, name in ((bool, "bool"), (int, "int"), (float, "float"), (str, "str")):
        if type(default) is t:
            return name
    return "Any"


def _positional(spec: OpSpec) -> list[tuple[str, bool]]:
    """``(name, has default None)`` of the arguments after ``x``: the positional inputs, then the parameters;
    optional ones default to None from the last required one on."""
    args = [(i.name, i.required) for i in spec.inputs if not i.keyword] + [(p.name, p.required) for p in spec.params]
    last = max((k for k, (_, req) in enumerate(args) if req), default=-1)
    return [(name, k > last) for k, (name, _) in enumerate(args)]


def _keywords(spec: OpSpec) -> list[tuple[str, Any, str]]:
    """``(name, default, annotation)`` of the keyword-only arguments of the forward."""
    out: list[tuple[str, Any, str]] = [(i.name, None, "Any") for i in spec.inputs if i.keyword]
    out += [(o.name, o.default, _annotation(o.default, o.annotation)) for o in spec.options]
    out += [(n, d, a) for n, d, a, _ in _common(spec)]
    return out


def _common(spec: OpSpec) -> tuple[tuple[str, Any, str, str], ...]:
    """:data:`_COMMON` for ``spec``: no ``axis`` for an op of the ``"channels"`` layout (its ``channel_axis``
    option says where the channels are)."""
    return tuple(c for c in _COMMON if not (c[0] == "axis" and spec.layout == "channels"))


def _result_type(spec: OpSpec) -> str:
    if spec.result_type:
        return spec.result_type
    if spec.result is not None:
        return "Any"
    return "Array" if len(spec.outputs) == 1 else "tuple[" + ", ".join("Array" for _ in spec.outputs) + "]"


def _params_text(spec: OpSpec, typed: bool, kind: str) -> str:
    """The parameter list of a ``def``: with annotations and defaults (the stub), or with defaults bound to
    names of the namespace the source is compiled in (``_d_<name>``)."""

    def one(name: str, ann: str, default: str | None) -> str:
        a = f": {ann}" if typed else ""
        if default is None:
            return f"{name}{a}"
        return f"{name}{a} = {default}" if typed else f"{name}={default}"

    if kind == "backward":
        ups = [one(f"d{o}", "Array | None", "None") for o in spec.outputs[1:]]
        return ", ".join([one("dy", "Array", None), one("ctx", "Context", None), *ups, "*",
                          one("dx_out", "Array | None", "None")])  # fmt: skip
    parts = [one("x", "Array", None)]
    for name, opt in _positional(spec):
        parts.append(one(name, "Array | None" if opt else "Array", "None" if opt else None))
    parts.append("*")
    for name, default, ann in _keywords(spec):
        parts.append(one(name, ann, None if default is REQUIRED else repr(default) if typed else f"_d_{name}"))
    return ", ".join(parts)


def _annotations(spec: OpSpec, kind: str) -> dict[str, str]:
    if kind == "backward":
        return {"dy": "Array", "ctx": "Context", **{f"d{o}": "Array | None" for o in spec.outputs[1:]},
                "dx_out": "Array | None"}  # fmt: skip
    ann = {"x": "Array", **{n: "Array | None" if opt else "Array" for n, opt in _positional(spec)}}
    return {**ann, **{n: a for n, _, a in _keywords(spec)}}


def _returns(spec: OpSpec, kind: str) -> str:
    if kind == "backward":
        return spec.grads.__name__
    r = _result_type(spec)
    return r if kind == "call" else f"tuple[{r}, Context]"


# ---------------------------------------------------------------------------
# docstrings


def _option_doc(spec: OpSpec, name: str) -> str:
    for o in spec.options:
        if o.name == name:
            return o.doc
    return ""


def _entry(name: str, ann: str, text: str) -> str:
    body = textwrap.fill(text, 104, initial_indent="    ", subsequent_indent="    ") if text else "    (see above)"
    return f"{name} : {ann}\n{body}"


def docstring(spec: OpSpec, kind: str) -> str:
    """The docstring of ``spec``'s ``<name>`` (``kind="call"``), ``<name>_forward`` or ``<name>_backward``."""
    name = spec.name
    if kind == "backward":
        ups = "".join(
            f"\n\nd{o} : array or None, the gradient arriving at the output ``{o}`` of the forward (None: none)"
            for o in spec.outputs[1:]
        )
        fields = ", ".join(getattr(spec.grads, "_fields", ()))
        tail = (
            f"\n\nReturns\n-------\n{spec.grads.__name__}\n    ``({fields})``: each gradient in its argument's shape "
            f"and dtype, None where the forward had no such argument.\n\nThe ctx must be the one "
            f":func:`{name}_forward` returned; ``dy`` has the first output's shape and ``dy``'s dtype rule; "
            f"``dx_out`` optionally receives ``dx``."
        )
        return (spec.backward_doc or f"Backward of :func:`{name}_forward`.") + ups + tail
    if kind == "call":
        return (
            f"``{name}``: the result of :func:`{name}_forward` without its ctx; see it for the formula, the "
            f"parameters and the options.\n\n``{spec.summary}``"
        )
    doc, notes = spec.doc.strip(), ""
    if "\nNotes\n-----\n" in doc:
        doc, notes = doc.split("\nNotes\n-----\n", 1)
    what = "at least 1-D" if spec.layout == "rows" else "``(N, C, *spatial)`` (``channel_axis=-1``: channels last)"
    lines = [_entry("x", "array", f"the input, {what}, of dtype {' or '.join(spec.x_dtypes)}")]
    for i in spec.inputs:
        lines.append(_entry(i.name, "array" if i.required else "array or None",
                            f"{_INPUT_DOC[i.kind]}. {i.doc}".strip()))  # fmt: skip
    for p in spec.params:
        kind_doc = _KIND_DOC[p.kind].format(index=p.index)
        lines.append(_entry(p.name, "array" if p.required else "array or None", f"{p.doc}; {kind_doc}"))
    for o in spec.options:
        how = "required" if o.default is REQUIRED else f"default {o.default!r}"
        lines.append(_entry(o.name, f"{_annotation(o.default, o.annotation)}, {how}", o.doc))
    for n, d, a, text in _common(spec):
        lines.append(_entry(n, f"{a}, default {d!r}", text))
    result = spec.result_doc or (
        "``y``, x's shape and dtype" if len(spec.outputs) == 1 else "``(" + ", ".join(spec.outputs) + ")``"
    )
    returns = (
        f"result\n    {result}.\nctx : Context\n    what :func:`{name}_backward` needs (the input, the parameters and "
        f"the per-row statistics, never the normalized values)."
    )
    text = f"{doc}\n\nParameters\n----------\n" + "\n".join(lines) + f"\n\nReturns\n-------\n{returns}"
    return text + (f"\n\nNotes\n-----\n{notes}" if notes else "")


# ---------------------------------------------------------------------------
# the functions


#: the keyword arguments the ``pynorm.dask`` functions take instead of ``out`` (chunked outputs are lazy)
_DASK_KEYWORDS = (("rechunk_warn_bytes", None, "int | None"), ("split_every", None, "int | None"))


def _dask_source(spec: OpSpec, kind: str, name: str) -> str:
    """A ``pynorm.dask`` function: the in-memory signature (``out`` replaced by the Dask keywords; the backward
    takes ``recompute``), its body one call of :func:`pynorm.dask.forward` / :func:`~pynorm.dask.backward`."""
    if kind == "backward":
        params = _params_text(spec, False, kind).replace("dx_out=None", "recompute=False")
        ups = ", ".join(f"'d{o}': d{o}" for o in spec.outputs[1:])
        return f"def {name}({params}):\n    return _backward(_SPEC.name, dy, ctx, recompute, {{{ups}}})\n"
    params = _params_text(spec, False, kind).replace("out=_d_out", "rechunk_warn_bytes=None, split_every=None")
    args = "".join(f"{n}, " for n, _ in _positional(spec))
    kw = ", ".join(f"'{n}': {n}" for n, _, _ in _keywords(spec) if n not in ("axis", "backend", "out"))
    axis = "axis" if spec.layout == "rows" else "-1"
    call = (
        f"_forward(_SPEC.name, x, {args}axis={axis}, backend=backend, rechunk_warn_bytes=rechunk_warn_bytes, "
        f"split_every=split_every, **{{{kw}}})"
    )
    return f"def {name}({params}):\n    return {call}{'[0]' if kind == 'call' else ''}\n"


def _source(spec: OpSpec, kind: str, dask: bool = False) -> str:
    name = {"forward": f"{spec.name}_forward", "backward": f"{spec.name}_backward", "call": spec.name}[kind]
    if dask:
        return _dask_source(spec, kind, name)
    head = f"def {name}({_params_text(spec, False, kind)}):\n"
    if kind == "backward":
        ups = ", ".join(f"'d{o}': d{o}" for o in spec.outputs[1:])
        return head + f"    return _backward(_SPEC, dy, ctx, dx_out, {{{ups}}})\n"
    inputs = "".join(f"{i.name}, " for i in spec.inputs)
    params = "".join(f"{p.name}, " for p in spec.params)
    opts = ", ".join(f"'{o.name}': {o.name}" for o in spec.options)
    axis = "axis" if spec.layout == "rows" else "None"
    call = (
        f"_forward(_SPEC, x, ({params}), axis={axis}, backend=backend, out=out, options={{{opts}}}, inputs=({inputs}))"
    )
    return head + f"    return {call}\n"  # (the call's function: _dispatch.call, the result alone)


def _compile(
    spec: OpSpec, kind: str, module: str, impl: tuple[Callable[..., Any], Callable[..., Any]] | None = None
) -> Callable[..., Any]:
    src = _source(spec, kind, dask=impl is not None)
    fwd, bwd = impl or (_dispatch.call if kind == "call" else _dispatch.forward, _dispatch.backward)
    ns: dict[str, Any] = {"_SPEC": spec, "_forward": fwd, "_backward": bwd}
    for name, default, _ in _keywords(spec):
        ns[f"_d_{name}"] = default
    fname = f"<pynorm generated: {spec.name} {kind}>"
    linecache.cache[fname] = (len(src), None, src.splitlines(keepends=True), fname)  # readable tracebacks
    exec(compile(src, fname, "exec"), ns)
    fn: Callable[..., Any] = next(v for k, v in ns.items() if callable(v) and not k.startswith("_"))
    fn.__module__ = module
    fn.__qualname__ = fn.__name__
    fn.__doc__ = docstring(spec, kind)
    ann = {**_annotations(spec, kind), "return": _returns(spec, kind)}
    if impl is not None:  # pynorm.dask: lazy arrays, the Dask keywords, a DaskContext
        ann = {k: v for k, v in ann.items() if k not in ("out", "dx_out")}
        ann |= {n: a for n, _, a in _DASK_KEYWORDS} if kind != "backward" else {"recompute": "bool"}
        ann["return"] = "Any"
        if kind == "backward":
            ann["ctx"] = "DaskContext"
        fn.__doc__ = (
            f"``pynorm.{fn.__name__}`` on Dask arrays, lazily, chunk by chunk (:func:`pynorm.dask."
            f"{'backward' if kind == 'backward' else 'forward'}`): the same arguments, "
            + ("``recompute`` instead of ``dx_out``" if kind == "backward" else "``rechunk_warn_bytes`` and "
               "``split_every`` instead of ``out``")
            + f".\n\n{fn.__doc__}"
        )  # fmt: skip
    fn.__annotations__ = ann
    return fn


def build(
    spec: OpSpec, module: str = "pynorm.functional", impl: tuple[Callable[..., Any], Callable[..., Any]] | None = None
) -> tuple[Callable[..., Any], ...]:
    """``(<name>, <name>_forward, <name>_backward)`` of ``spec``; ``impl``: the ``(forward, backward)`` of
    :mod:`pynorm.dask` for its functions (else the dispatcher's)."""
    return tuple(_compile(spec, kind, module, impl) for kind in ("call", "forward", "backward"))


def functions(module: str = "pynorm.functional") -> dict[str, Callable[..., Any]]:
    """Every op's three functions by name (and :mod:`pynorm` registered for
    :meth:`pynorm.ops.OpSpec.generic_forward`)."""
    out: dict[str, Callable[..., Any]] = {}
    for spec in SPECS.values():
        call, fwd, bwd = build(spec, module)
        out[call.__name__], out[fwd.__name__], out[bwd.__name__] = call, fwd, bwd
    PUBLIC["module"] = sys.modules["pynorm"]
    return out


def add_op(spec: OpSpec) -> tuple[Callable[..., Any], ...]:
    """Add an op at run time: register ``spec`` (:func:`pynorm.ops.register`: every backend whose kernel families
    implement its variant serves it, the numpy backend through the module its ``reference`` names) and make its
    three public functions, ``pynorm.<name>``, ``<name>_forward``, ``<name>_backward`` (also in
    :mod:`pynorm.functional`). Returns them. ``docs/adding_an_op.md`` walks through an example;
    :func:`remove_op` undoes it."""
    from . import ops

    ops.register(spec)
    made = build(spec)
    for module in (sys.modules["pynorm.functional"], sys.modules["pynorm"]):
        for fn in made:
            setattr(module, fn.__name__, fn)
        setattr(module, spec.grads.__name__, getattr(module, spec.grads.__name__, spec.grads))
    return made


def remove_op(name: str) -> None:
    """Remove an op added by :func:`add_op` (its public functions and its spec)."""
    from . import ops

    ops.unregister(name)
    for module in (sys.modules["pynorm.functional"], sys.modules["pynorm"]):
        for fn in (name, f"{name}_forward", f"{name}_backward"):
            if hasattr(module, fn):
                delattr(module, fn)


# ---------------------------------------------------------------------------
# the stub


def _grads_imports() -> str:
    by_module: dict[str, set[str]] = {}
    for s in SPECS.values():
        by_module.setdefault(s.grads.__module__.replace("pynorm.", "."), set()).add(s.grads.__name__)
    return "\n".join(
        f"from {m} import {', '.join(f'{n} as {n}' for n in sorted(ns))}" for m, ns in sorted(by_module.items())
    )


def stub() -> str:
    """The text of ``pynorm/functional.pyi``: every generated function's signature (the docstrings are the
    functions' own: the API reference reads them by importing :mod:`pynorm.functional`)."""
    names = [f for s in SPECS.values() for f in (s.name, f"{s.name}_forward", f"{s.name}_backward")]
    grads = sorted({s.grads.__name__ for s in SPECS.values()})
    lines = [
        '"""Generated by ``python -m pynorm._stub`` from the op specs (pynorm/ops): do not edit."""',
        "",
        "from typing import Any",
        "",
        "from ._dispatch import Context as Context",
        _grads_imports(),
        "",
        "Array = Any",
        "",
        "__all__ = [",
        *(f'    "{n}",' for n in ["Context", *grads, *names]),
        "]",
    ]
    for spec in SPECS.values():
        lines.append("")
        for kind in ("call", "forward", "backward"):
            name = {"forward": f"{spec.name}_forward", "backward": f"{spec.name}_backward", "call": spec.name}[kind]
            lines.append(f"def {name}({_params_text(spec, True, kind)}) -> {_returns(spec, kind)}: ...")
    return "\n".join(lines) + "\n"
