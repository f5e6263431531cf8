"""pynorm's ops as JAX functions: every op of :func:`pynorm.list_ops`, usable under ``jax.jit``, ``jax.grad`` /
``jax.vjp`` / ``jax.value_and_grad`` and ``jax.vmap`` (``pip install 'pynorm[jax]'``).

Each function is made from the op's spec, like the NumPy API (:mod:`pynorm._api`): ``pynorm.jax.<name>`` has the
signature and parameters of ``pynorm.<name>`` but for ``out`` (JAX arrays are immutable) and returns JAX arrays.
Inside, the forward and the backward run pynorm's kernels on the host through ``jax.pure_callback``, and
``jax.custom_vjp`` tells JAX the derivative:

* the forward callback returns the outputs **and the forward's per-row statistics** (the arrays of the op's ctx
  that are not its inputs: ``mean`` and ``rstd`` for LayerNorm, ``rstd`` for RMSNorm...); JAX keeps them as the
  residuals of the VJP, and the backward callback rebuilds the ctx from them and the inputs and runs the op's
  backward -- the forward is never recomputed;
* the options, ``axis`` and ``backend`` are static (Python values fixed at trace time); every array argument is
  traced, and each differentiable one (``x``, a residual stream, a conditioning input, the parameters) gets its
  gradient in its own shape and dtype. Integer inputs (row indices), row scales and running statistics get none;
* the shapes and dtypes of what the callbacks return are found once per call signature (shapes, dtypes,
  options, backend) by running the op on stand-in values of those shapes when it is first traced, which also
  validates the call: a bad shape, dtype or option raises the usual :mod:`pynorm.errors` exception at trace time,
  naming the argument. The checks that depend on values (a row index out of range) run in the callback;
* ``vmap`` runs the callbacks once per batch element (``vmap_method="sequential"``): per-example gradients of
  the parameters (``vmap(grad(...))``) are then exact. A norm over the trailing axes needs no ``vmap`` for a
  batch: give it the batched ``x`` (a leading axis only adds rows), one callback for the whole batch.

The backend is resolved when the function is traced (``backend=``, :func:`pynorm.use_backend`,
``PYNORM_BACKEND``, else the best available one for NumPy arrays: ``numba`` where installed) and fixed in the
traced computation. The callbacks run on the host: on an accelerator JAX copies the arrays there and back.
``docs/jax.md`` has examples and measured step times against pure JAX.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

try:
    import jax
    import jax.numpy as jnp
except ImportError as exc:  # pragma: no cover - exercised where JAX is missing
    raise ImportError("pynorm.jax needs JAX: pip install 'pynorm[jax]' (or pip install jax)") from exc

from . import _api, _dispatch
from ._dtypes import FLOAT_DTYPES, dtype_name
from .errors import ArgumentError, ArrayTypeError
from .ops import SPECS, OpSpec

__all__ = sorted(SPECS)


# ---------------------------------------------------------------------------
# what a call signature's forward returns: found once, from a run on stand-in values


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where one array of the backend's ctx comes from in the backward: ``arg`` >= 0, the call's array argument
    of that index (reshaped to ``shape``); ``arg`` < 0, the forward's residual ``~arg``."""

    arg: int
    shape: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class _Layout:
    """One call signature's traced shape: what the forward callback returns and how the backward rebuilds the
    ctx (:func:`_layout`)."""

    #: the result's leaves, as ``jax.ShapeDtypeStruct``
    leaves: tuple[Any, ...]
    #: whether the result is a tuple (else one array)
    is_tuple: bool
    #: per leaf: the index of the op's output it is (its cotangent is that output's upstream gradient), or -1
    leaf_output: tuple[int, ...]
    #: the residual statistics, as ``jax.ShapeDtypeStruct`` (a 64-bit one as its ``uint32`` pairs where JAX runs
    #: without x64: :func:`_to_residual`), and each one's own dtype
    stats: tuple[Any, ...]
    stat_dtypes: tuple[Any, ...]
    #: the stand-in run's ctx without its arrays (its other fields are every call's), and the slot of each array of
    #: its inner ctx, by path
    ctx: Any
    slots: dict[tuple[Any, ...], _Slot]
    #: the resolved backend's name
    backend: str


def _standin(role: str, kind: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """A valid value for an argument of ``shape`` and ``dtype``: ``x`` varies along its rows (a constant row
    would make ``eps=0`` divide by zero), row indices are 0, row scales 1, everything else 0.5."""
    dt = np.dtype(dtype)
    n = math.prod(shape)
    if role == "x":
        v = (np.arange(n) % 7 - 3).astype(np.float64)
        return (v if dt.kind in "iu" else v / 3).astype(dt).reshape(shape)
    if kind == "row_index" or dt.kind in "iu":
        return np.zeros(shape, dt)
    if kind == "row_scale":
        return np.ones(shape, dt)
    return np.full(shape, 0.5, dt)


def _walk(obj: Any, path: tuple[Any, ...], found: dict[tuple[Any, ...], np.ndarray]) -> None:
    """Every array of a ctx (a dataclass, possibly holding the ctx of another op) by its path of field names."""
    if isinstance(obj, np.ndarray):
        found[path] = obj
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _walk(getattr(obj, f.name), (*path, f.name), found)
    elif isinstance(obj, tuple):
        for i, v in enumerate(obj):
            _walk(v, (*path, i), found)


def _at(obj: Any, path: tuple[Any, ...]) -> Any:
    """The value at ``path`` (field names and tuple indices, :func:`_walk`'s) in ``obj``."""
    for k in path:
        obj = obj[k] if isinstance(k, int) else getattr(obj, k)
    return obj


def _same_buffer(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``a`` is ``b`` reshaped (both C-contiguous over the same memory, same dtype and size)."""
    return (
        a.dtype == b.dtype
        and a.size == b.size
        and a.flags.c_contiguous
        and b.flags.c_contiguous
        and (a.size == 0 or a.ctypes.data == b.ctypes.data)
    )


def _leaves(result: Any) -> tuple[tuple[Any, ...], bool]:
    return (tuple(result), True) if isinstance(result, tuple) else ((result,), False)


def _layout(spec: OpSpec, roles: tuple[tuple[str, str], ...], avals: tuple[Any, ...], options: dict[str, Any],
            axis: int | None, backend: str | None) -> _Layout:  # fmt: skip
    arrays = tuple(_standin(role, kind, shape, dt) for (role, kind), (shape, dt) in zip(roles, avals, strict=True))
    result, ctx = _run_forward(spec, roles, arrays, options, axis, backend)
    leaves, is_tuple = _leaves(result)
    found: dict[tuple[Any, ...], np.ndarray] = {}
    _walk(ctx.inner, (), found)
    slots: dict[tuple[Any, ...], _Slot] = {}
    stats: list[np.ndarray] = []
    for path, a in found.items():
        k = next((i for i, b in enumerate(arrays) if _same_buffer(a, b)), None)
        if k is None:
            slots[path] = _Slot(~len(stats), tuple(a.shape))
            stats.append(a)
        else:
            slots[path] = _Slot(k, tuple(a.shape))
    n_out = len(spec.outputs)
    leaf_output = tuple(
        k if k < n_out and dtype_name(np.asarray(v).dtype) in FLOAT_DTYPES else -1 for k, v in enumerate(leaves)
    )
    structs = tuple(jax.ShapeDtypeStruct(np.shape(v), np.asarray(v).dtype) for v in leaves)
    saved = tuple(_to_residual(a) for a in stats)
    template = _rebuilt(ctx, slots, lambda s: None)  # (the stand-ins' arrays are not kept with the layout)
    return _Layout(
        structs, is_tuple, leaf_output, tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in saved),
        tuple(a.dtype for a in stats), template, slots, ctx.backend,
    )  # fmt: skip


def _to_residual(a: np.ndarray) -> np.ndarray:
    """A statistic as JAX keeps it: as it is, or as its ``uint32`` words (shape ``(*shape, itemsize // 4)``) where
    JAX has no such dtype -- a 64-bit one without ``jax_enable_x64``, the reference's extended-precision
    (``longdouble``) statistics of float64 input; :func:`_from_residual` undoes it, bit for bit."""
    if (a.dtype.itemsize == 8 and not jax.config.read("jax_enable_x64")) or a.dtype.itemsize > 8:
        return np.ascontiguousarray(a).view(np.uint32).reshape(*a.shape, a.dtype.itemsize // 4)
    return a


def _from_residual(a: np.ndarray, dtype: Any) -> np.ndarray:
    if a.dtype != dtype:
        return np.ascontiguousarray(a).view(dtype).reshape(a.shape[:-1])
    return a


def _run_forward(spec: OpSpec, roles: tuple[tuple[str, str], ...], arrays: tuple[Any, ...],
                 options: dict[str, Any], axis: int | None, backend: str | None) -> tuple[Any, Any]:  # fmt: skip
    """``pynorm.<op>_forward`` on host arrays given in :func:`_roles` order."""
    by_role = dict(zip((r for r, _ in roles), arrays, strict=True))
    inputs = tuple(by_role.get(i.name) for i in spec.inputs)
    params = tuple(by_role.get(p.name) for p in spec.params)
    return _dispatch.forward(
        spec, by_role["x"], params, axis=axis, backend=backend, out=None, options=options, inputs=inputs
    )


# ---------------------------------------------------------------------------
# the callbacks


class _Alias:
    """Holds the array interface of a writable alias of a read-only host buffer, and the buffer (kept alive as
    long as the alias is)."""

    __slots__ = ("__array_interface__", "buffer")

    def __init__(self, a: np.ndarray) -> None:
        iface = dict(a.__array_interface__)
        iface["data"] = (iface["data"][0], False)
        self.__array_interface__, self.buffer = iface, a


def _host(a: Any) -> np.ndarray:
    """A callback's argument as the kernels take it. JAX hands a callback its buffers read-only, and numba compiles
    a read-only array's kernels apart from a writable one's: every op's kernels compiled twice, once for NumPy's
    arrays and once for JAX's (a LayerNorm forward + backward under ``jit``: 6.1 s cold after NumPy's calls had
    compiled them). pynorm never writes an input (its tests check it for every op), so a read-only buffer is
    handed on as a writable alias of the same memory (no copy), which the NumPy calls' kernels serve."""
    a = np.asarray(a)
    if a.flags.writeable or a.size == 0:
        return a
    alias = np.asarray(_Alias(a))
    return alias if alias.dtype == a.dtype else alias.view(a.dtype)  # (bfloat16's interface says "|V2")


def _rebuilt(ctx: Any, slots: dict[tuple[Any, ...], _Slot], value: Callable[[_Slot], Any]) -> Any:
    """The dispatcher's Context ``ctx`` with each array of its inner ctx replaced by ``value(its slot)``."""

    def rebuild(obj: Any, path: tuple[Any, ...]) -> Any:
        slot = slots.get(path)
        if slot is not None:
            return value(slot)
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            values = {f.name: rebuild(getattr(obj, f.name), (*path, f.name)) for f in dataclasses.fields(obj)}
            new = object.__new__(type(obj))
            new.__dict__.update(values)  # (a ctx type has no __post_init__: tests/test_plans.py)
            return new
        if isinstance(obj, tuple):
            return tuple(rebuild(v, (*path, i)) for i, v in enumerate(obj))
        return obj

    # (plan None: a ctx with other arrays than its forward's takes the general backward, which checks them)
    return dataclasses.replace(ctx, inner=rebuild(ctx.inner, ()), plan=None)


def _ctx_of(layout: _Layout, arrays: tuple[np.ndarray, ...], stats: tuple[np.ndarray, ...]) -> Any:
    """The Context of a call: the layout's, its inner ctx's arrays the call's arguments and statistics."""
    return _rebuilt(
        layout.ctx, layout.slots, lambda s: (arrays[s.arg] if s.arg >= 0 else stats[~s.arg]).reshape(s.shape)
    )


class _Op:
    """One call signature of one op: the custom-VJP function over its array arguments."""

    def __init__(self, spec: OpSpec, roles: tuple[tuple[str, str], ...], options: dict[str, Any],
                 axis: int | None, layout: _Layout) -> None:  # fmt: skip
        self.spec, self.roles, self.options, self.axis, self.layout = spec, roles, options, axis, layout
        self.diff = tuple(role == "x" or kind in ("like_x", "cond") or kind in _PARAM_KINDS for role, kind in roles)
        #: the path of each residual statistic in the backend's ctx, in residual order
        self.stat_paths = tuple(p for p, _ in sorted(((p, ~s.arg) for p, s in layout.slots.items() if s.arg < 0),
                                                     key=lambda ps: ps[1]))  # fmt: skip
        self.fn = jax.custom_vjp(self._primal)
        self.fn.defvjp(self._fwd, self._bwd)

    # host side -------------------------------------------------------------

    def _host_forward(self, *arrays: Any, stats: bool) -> tuple[np.ndarray, ...]:
        host = tuple(_host(a) for a in arrays)
        result, ctx = _run_forward(self.spec, self.roles, host, self.options, self.axis, self.layout.backend)
        leaves, _ = _leaves(result)
        out = tuple(np.asarray(v) for v in leaves)
        if not stats:
            return out
        return (*out, *(_to_residual(np.asarray(_at(ctx.inner, path))) for path in self.stat_paths))

    def _host_backward(self, *flat: Any) -> tuple[np.ndarray, ...]:
        n_arr, n_st = len(self.roles), len(self.layout.stats)
        host = tuple(_host(a) for a in flat)
        arrays, cts = host[:n_arr], host[n_arr + n_st :]
        stats = tuple(_from_residual(a, dt) for a, dt in zip(host[n_arr : n_arr + n_st], self.layout.stat_dtypes))
        ctx = _ctx_of(self.layout, arrays, stats)
        upstream: dict[str, Any] = {}
        dy = None
        for ct, k in zip(cts, (k for k in self.layout.leaf_output if k >= 0), strict=True):
            if k == 0:
                dy = ct
            else:
                upstream[f"d{self.spec.outputs[k]}"] = ct
        if dy is None:  # (an op whose first output is not differentiable here: an int8 q)
            return tuple(np.zeros(a.shape, a.dtype) for a, d in zip(arrays, self.diff, strict=True) if d)
        grads = _dispatch.backward(self.spec, dy, ctx, None, upstream)
        by_name = dict(zip(self.spec.grad_names, grads, strict=True))
        out = []
        for (role, _), a, d in zip(self.roles, arrays, self.diff, strict=True):
            if d:
                g = by_name[f"d{role}"]
                out.append(np.zeros(a.shape, a.dtype) if g is None else np.asarray(g, dtype=a.dtype).reshape(a.shape))
        return tuple(out)

    # traced side -----------------------------------------------------------

    def _call_forward(self, arrays: tuple[Any, ...], stats: bool) -> tuple[Any, ...]:
        shapes = self.layout.leaves + (self.layout.stats if stats else ())

        def cb(*a: Any) -> tuple[np.ndarray, ...]:
            return self._host_forward(*a, stats=stats)

        return tuple(jax.pure_callback(cb, shapes, *arrays, vmap_method="sequential"))

    def _primal(self, *arrays: Any) -> Any:
        return self._call_forward(arrays, stats=False)

    def _fwd(self, *arrays: Any) -> tuple[Any, Any]:
        out = self._call_forward(arrays, stats=True)
        n = len(self.layout.leaves)
        return out[:n], (arrays, out[n:])

    def _bwd(self, res: Any, cts: Any) -> tuple[Any, ...]:
        arrays, stats = res
        cts_used = tuple(c for c, k in zip(cts, self.layout.leaf_output, strict=True) if k >= 0)
        shapes = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a, d in zip(arrays, self.diff, strict=True) if d)
        grads = iter(jax.pure_callback(self._host_backward, shapes, *arrays, *stats, *cts_used,
                                       vmap_method="sequential"))  # fmt: skip
        return tuple(next(grads) if d else None for d in self.diff)

    def __call__(self, *arrays: Any) -> Any:
        out = self.fn(*arrays)
        return tuple(out) if self.layout.is_tuple else out[0]


_PARAM_KINDS = ("feature", "scalar", "table", "matrix", "vector", "channel")

#: call signature -> its :class:`_Op` (the functions JAX traces are kept: a jitted caller retraces nothing)
_OPS: dict[tuple[Any, ...], _Op] = {}
_LOCK = threading.Lock()
_MAX_OPS = 1024


def _tracer_name(a: Any) -> str:
    return f"{type(a).__module__}.{type(a).__name__}"


def _as_jax(a: Any, name: str) -> Any:
    if isinstance(a, jax.Array):
        return a
    if hasattr(a, "__jax_array__") or isinstance(a, (np.ndarray, np.generic, int, float, list, tuple)):
        return jnp.asarray(a)
    if hasattr(a, "__dlpack__"):
        return jnp.from_dlpack(a)
    raise ArrayTypeError(f"{name} must be a JAX array or array-like, got {_tracer_name(a)}")


def _call(spec: OpSpec, x: Any, inputs: tuple[Any, ...], params: tuple[Any, ...], options: dict[str, Any],
          axis: int | None, backend: str | None) -> Any:  # fmt: skip
    """The body of every generated function: the present arrays as JAX arrays, the call signature's
    :class:`_Op` (made and kept on first use), called on them."""
    if axis is not None and (isinstance(axis, bool) or not isinstance(axis, int)):
        raise ArgumentError(f"axis must be an int (static under jit), got {axis!r}")
    roles: list[tuple[str, str]] = [("x", "x")]
    arrays = [_as_jax(x, "x")]
    for si, a in zip(spec.inputs, inputs, strict=True):
        if a is not None:
            roles.append((si.name, si.kind))
            arrays.append(_as_jax(a, si.name))
    for sp, p in zip(spec.params, params, strict=True):
        if p is not None:
            roles.append((sp.name, sp.kind))
            arrays.append(_as_jax(p, sp.name))
    avals = tuple((tuple(a.shape), np.dtype(a.dtype)) for a in arrays)
    key: tuple[Any, ...] | None = (spec.name, tuple(roles), avals, axis, backend, _backend_env(),
                                   tuple(sorted(options.items())))  # fmt: skip
    try:
        op = _OPS.get(key)  # type: ignore[arg-type]
    except TypeError:  # an unhashable option value: no cache
        key, op = None, None
    if op is None:
        layout = _layout(spec, tuple(roles), avals, options, axis, backend)
        op = _Op(spec, tuple(roles), dict(options), axis, layout)
        if key is not None:
            with _LOCK:
                if len(_OPS) >= _MAX_OPS:
                    _OPS.pop(next(iter(_OPS)))
                _OPS[key] = op
    return op(*arrays)


def _backend_env() -> str | None:
    """The backend :func:`pynorm.use_backend` / ``PYNORM_BACKEND`` names now (part of a call signature's key)."""
    import os

    from . import _registry

    return _registry._current.get() or os.environ.get(_registry.ENV_VAR) or None


# ---------------------------------------------------------------------------
# the functions, made from the specs


def _source(spec: OpSpec) -> str:
    params = _api._params_text(spec, False, "call").replace(", out=_d_out", "")
    inputs = "".join(f"{i.name}, " for i in spec.inputs)
    ps = "".join(f"{p.name}, " for p in spec.params)
    opts = ", ".join(f"'{o.name}': {o.name}" for o in spec.options)
    axis = "axis" if spec.layout == "rows" else "None"
    return f"def {spec.name}({params}):\n    return _call(_SPEC, x, ({inputs}), ({ps}), {{{opts}}}, {axis}, backend)\n"


def _docstring(spec: OpSpec) -> str:
    """The NumPy forward's docstring, for JAX: no ``out``, the result without a ctx."""
    text = _api.docstring(spec, "forward")
    head, _, rest = text.partition("\n\nParameters\n----------\n")
    params, _, tail = rest.partition("\n\nReturns\n-------\n")
    lines = params.split("\n")
    kept: list[str] = []
    skip = False
    for line in lines:
        if not line.startswith(" "):
            skip = line.startswith("out :")
        if not skip:
            kept.append(line)
    notes = tail.partition("\n\nNotes\n-----\n")[2]
    result = spec.result_doc or (
        "``y``, x's shape and dtype" if len(spec.outputs) == 1 else "``(" + ", ".join(spec.outputs) + ")``"
    )
    first = head.split("\n", 1)
    intro = (
        f"``pynorm.{spec.name}`` for JAX arrays, differentiable and traceable (``jit``, ``grad``, ``vjp``, "
        f"``vmap``): pynorm's kernels run on the host through ``jax.pure_callback``; the backward reuses the "
        f"forward's statistics. The options, ``axis`` and ``backend`` are static.\n\n"
        + (first[1].strip("\n") if len(first) > 1 else "")
    )
    text = (
        f"{intro}\n\nParameters\n----------\n" + "\n".join(kept)
        + f"\n\nReturns\n-------\nresult\n    {result}, as JAX arrays."
    )  # fmt: skip
    return text + (f"\n\nNotes\n-----\n{notes}" if notes else "")


def _build(spec: OpSpec) -> Callable[..., Any]:
    import linecache

    src = _source(spec)
    ns: dict[str, Any] = {"_SPEC": spec, "_call": _call}
    for name, default, _ in _api._keywords(spec):
        ns[f"_d_{name}"] = default
    fname = f"<pynorm.jax generated: {spec.name}>"
    linecache.cache[fname] = (len(src), None, src.splitlines(keepends=True), fname)
    exec(compile(src, fname, "exec"), ns)
    fn: Callable[..., Any] = ns[spec.name]
    fn.__module__ = __name__
    fn.__qualname__ = spec.name
    fn.__doc__ = _docstring(spec)
    ann = {k: v for k, v in _api._annotations(spec, "call").items() if k != "out"}
    fn.__annotations__ = {**ann, "return": "Any"}
    return fn


def _install(specs: Mapping[str, OpSpec]) -> None:
    module = sys.modules[__name__]
    for name, spec in specs.items():
        setattr(module, name, _build(spec))


_install(SPECS)


def __getattr__(name: str) -> Any:
    # an op added at run time (pynorm.add_op): made on first use
    spec = SPECS.get(name)
    if spec is None:
        raise AttributeError(f"module 'pynorm.jax' has no attribute {name!r}")
    fn = _build(spec)
    setattr(sys.modules[__name__], name, fn)
    return fn
