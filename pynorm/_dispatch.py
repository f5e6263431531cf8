"""Validation, dispatch, flattening and gradient reduction, done once for every op from its spec.

:func:`forward` and :func:`backward` are what every public ``<op>_forward`` / ``<op>_backward``
calls: they validate the arguments against the op's :class:`~pynorm.ops.OpSpec` (so every backend
rejects bad input the same way, with the same message), pick a backend through
:mod:`pynorm._registry`, flatten ``x`` to ``(rows, hidden)`` and the parameters to ``(hidden,)``,
call the backend's ``forward(x2, *params, out=..., **options)`` / ``backward(dy2, ctx, dx_out=...)``
and reduce each parameter's gradient back to the parameter's own shape.

Shapes follow ONNX's ``axis`` rule: dims ``axis .. ndim-1`` of ``x`` are normalized together
(``axis`` may be negative); ``"feature"`` parameters have shape ``x.shape[axis:]`` or any shape
that broadcasts to it from the right (``(H,)`` for a ``(..., 1, H)`` block, say) and reach the
backend as ``(H,)`` vectors; ``"scalar"`` ones as ``(1,)`` arrays; ``"table"`` ones as ``(M, H)``.
Extra inputs reach it as ``(rows, H)`` (``"like_x"``) or ``(rows,)`` (``"row_index"``) arrays.
Gradients come back in each parameter's own shape and dtype.
"""

from __future__ import annotations

import math
import numbers
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from . import _registry
from ._dtypes import FLOAT_DTYPES, dtype_name, round_to
from .errors import ArgumentError, ArrayTypeError, ContextError, DTypeError, ShapeError
from .ops import OpSpec

__all__ = ["FLOAT_DTYPES", "Context", "backward", "check_axis", "forward"]

Array = Any  # numpy.ndarray, cupy.ndarray, or another backend's array type


@dataclass(frozen=True, eq=False)
class Context:
    """What a ``*_forward`` call hands to the matching ``*_backward``.

    Attributes
    ----------
    op : name of the op that made it.
    backend : name of the backend that ran forward (backward runs there too).
    x_shape, x_dtype : shape and dtype of the forward input.
    axis : first normalized axis (non-negative).
    param_shapes : shape of each parameter as given (None where absent).
    inner : the backend's ctx (e.g. :class:`pynorm.ops.layer_norm.LayerNormCtx`):
        the flattened input, parameters and per-row statistics.
    input_dtypes : dtype of each differentiable extra input (a residual's), in order.
    output_dtypes : dtype of each output after the first (the upstream gradients' dtypes).
    array_family : ``(module, class)`` of the arrays forward ran on (``("numpy", "ndarray")``).
    y_shape : shape of the first output (None: ``x_shape``; a fused norm + Linear's ``(..., N)``).
    input_shapes : shape of each differentiable extra input, in order (a ``cond``'s gradient has its shape).
    """

    op: str
    backend: str
    x_shape: tuple[int, ...]
    x_dtype: Any
    axis: int
    param_shapes: tuple[tuple[int, ...] | None, ...]
    inner: Any
    input_dtypes: tuple[Any, ...] = ()
    output_dtypes: tuple[Any, ...] = ()
    array_family: tuple[str, str] = ("numpy", "ndarray")
    y_shape: tuple[int, ...] | None = None
    input_shapes: tuple[tuple[int, ...], ...] = ()

    @property
    def rows(self) -> int:
        return math.prod(self.x_shape[: self.axis])

    @property
    def hidden(self) -> int:
        return math.prod(self.x_shape[self.axis :])


# ---------------------------------------------------------------------------
# validation


#: DLPack device types (``DLDeviceType``) pynorm reads: CPU memory as NumPy arrays, CUDA memory as CuPy arrays
_DLPACK_CPU = (1, 3)  # kDLCPU, kDLCUDAHost (pinned host memory)
_DLPACK_CUDA = (2, 13)  # kDLCUDA, kDLCUDAManaged
_DLPACK_NAMES = {4: "OpenCL", 7: "Vulkan", 8: "Metal", 9: "VPI", 10: "ROCm", 11: "ROCm host", 12: "ExtDev",
                 14: "oneAPI", 15: "WebGPU", 16: "Hexagon", 17: "MAIA"}  # fmt: skip


def _served(a: Any) -> bool:
    """Whether ``a``'s type is the array type of a registered backend (``numpy.ndarray``, ``cupy.ndarray``)."""
    fam = _registry.array_family(a)
    return any((b.array_module, b.array_type) == fam for b in _registry._backends.values())


def from_dlpack(a: Any, name: str) -> Array:
    """A zero-copy NumPy (CPU memory) or CuPy (CUDA memory) view of an object implementing ``__dlpack__`` and
    ``__dlpack_device__`` (a PyTorch tensor, a JAX array...), without importing its library. bfloat16, which
    NumPy's DLPack import does not take, is imported as its 16-bit pattern (a view through the exporter's own
    ``view(int16)``, the ``int16`` of its library or of its ``__array_namespace__()`` -- JAX's) and viewed as
    ``ml_dtypes.bfloat16``."""
    try:
        dev_type, _ = (int(v) for v in a.__dlpack_device__())
    except Exception as exc:
        raise ArrayTypeError(f"{name} has __dlpack__ but no usable __dlpack_device__(): {exc}") from exc
    if dev_type in _DLPACK_CPU:
        mod: Any = np
    elif dev_type in _DLPACK_CUDA:
        try:
            import cupy

            mod = cupy
        except ImportError as exc:
            raise ArrayTypeError(
                f"{name} is a CUDA array (DLPack device type {dev_type}); reading it needs CuPy: "
                f"pip install 'pynorm[cupy]'"
            ) from exc
    else:
        where = _DLPACK_NAMES.get(dev_type, "unknown")
        raise ArrayTypeError(
            f"{name} lives on DLPack device type {dev_type} ({where}); pynorm reads CPU memory (as NumPy arrays) "
            f"and CUDA memory (as CuPy arrays) only"
        )
    if str(getattr(a, "dtype", "")).rpartition(".")[2] == "bfloat16":
        lib = sys.modules.get(type(a).__module__.partition(".")[0])
        int16 = getattr(lib, "int16", None)
        if int16 is None and hasattr(a, "__array_namespace__"):  # JAX: the type lives in jaxlib, int16 in jax.numpy
            try:
                int16 = getattr(a.__array_namespace__(), "int16", None)
            except Exception:  # an exporter whose namespace cannot be had: the error below names the argument
                int16 = None
        if int16 is None or not hasattr(a, "view"):
            raise DTypeError(f"{name} is bfloat16, which DLPack importers cannot read, and offers no view(int16)")
        try:
            import ml_dtypes
        except ImportError as exc:
            raise DTypeError(f"{name} is bfloat16: reading it needs ml_dtypes (pip install ml_dtypes)") from exc
        return mod.from_dlpack(a.view(int16)).view(ml_dtypes.bfloat16)
    try:
        return mod.from_dlpack(a)
    except (BufferError, TypeError, ValueError, RuntimeError) as exc:
        raise ArrayTypeError(f"{name} ({type(a).__module__}.{type(a).__name__}) could not be imported "
                             f"through DLPack: {exc}") from exc  # fmt: skip


def as_array(a: Any, name: str) -> Array:
    """``a`` if it is an array (of any backend's library), NumPy's array of it if it is a list/scalar, a zero-copy
    view of any other DLPack exporter (:func:`from_dlpack`). A NumPy array of non-native byte order (``'>f4'`` on
    a little-endian machine: its dtype's name is still ``float32``) is read as a native-order copy: no kernel
    computes on swapped bytes."""
    if type(a) is np.ndarray and a.dtype.isnative:  # the common case, first
        return a
    if not getattr(getattr(a, "dtype", None), "isnative", True):
        return a.astype(a.dtype.newbyteorder("="))
    if isinstance(a, (list, tuple, numbers.Number, np.generic)) and not isinstance(a, bool):
        return np.asarray(a)
    if hasattr(a, "__dlpack__") and not _served(a):
        return from_dlpack(a, name)
    if not (hasattr(a, "dtype") and hasattr(a, "shape") and hasattr(a, "reshape")):
        raise ArrayTypeError(f"{name} must be an array (numpy.ndarray, cupy.ndarray...), got {type(a).__name__}")
    return a


def check_float_dtype(a: Array, name: str, allowed: tuple[str, ...] = FLOAT_DTYPES) -> None:
    dt = a.dtype
    if dtype_name(dt) not in allowed:
        shown = ", ".join(allowed[:-1]) + f" or {allowed[-1]}"
        raise DTypeError(f"{name} must have dtype {shown}, got {dt}")


def xp_of(a: Array) -> Any:
    """The array module (``numpy``, ``cupy``...) of ``a``."""
    return sys.modules[_registry.array_family(a)[0]]


def check_axis(axis: Any, ndim: int) -> int:
    """Validate ONNX-style ``axis`` for an ``ndim``-dim input; return it non-negative."""
    if isinstance(axis, bool) or not isinstance(axis, numbers.Integral):
        raise ArgumentError(f"axis must be an int, got {axis!r}")
    a = int(axis)
    if not -ndim <= a < ndim:
        raise ArgumentError(f"axis={a} is out of range for x with {ndim} dims (expected {-ndim} <= axis < {ndim})")
    return a % ndim


def _same_family(a: Array, name: str, x: Array) -> None:
    if _registry.array_family(a) != _registry.array_family(x):
        _registry._family_of((x, a), ("x", name))  # raises ArrayTypeError with both types


def _check_param(spec_param: Any, p: Any, x: Array, axis: int, inputs: dict[str, Array]) -> Array | None:
    name = spec_param.name
    if p is None:
        if spec_param.required:
            raise ArgumentError(f"{name} is required (got None)")
        return None
    p = as_array(p, name)
    _same_family(p, name, x)
    check_float_dtype(p, name)
    norm_shape = tuple(x.shape[axis:])
    kind = spec_param.kind
    if kind == "feature":
        ok = p.ndim <= len(norm_shape) and all(
            d == n or d == 1 for d, n in zip(p.shape[::-1], norm_shape[::-1], strict=False)
        )
        if not ok:
            raise ShapeError(
                f"{name} has shape {tuple(p.shape)}, expected x.shape[axis:] = {norm_shape} "
                f"(or a shape broadcastable to it from the right)"
            )
    elif kind == "scalar":
        if tuple(p.shape) not in ((), (1,)):
            raise ShapeError(f"{name} must be a scalar (a 0-d or (1,) array), got shape {tuple(p.shape)}")
    elif kind in ("matrix", "vector"):  # exact shapes: the spec's check_arrays
        nd = 2 if kind == "matrix" else 1
        if p.ndim != nd:
            raise ShapeError(f"{name} must be a {nd}-D array, got shape {tuple(p.shape)}")
    else:  # table
        if p.ndim != 1 + len(norm_shape) or tuple(p.shape[1:]) != norm_shape or p.shape[0] < 1:
            raise ShapeError(
                f"{name} must be a table of shape (M, *x.shape[axis:]) = (M, {', '.join(map(str, norm_shape))}) "
                f"with M >= 1, got shape {tuple(p.shape)}"
            )
        ids = inputs[spec_param.index]
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= p.shape[0]):
            raise ArgumentError(
                f"{spec_param.index} must hold values in [0, {p.shape[0]}) (the rows of {name}), "
                f"got values from {int(ids.min())} to {int(ids.max())}"
            )
    if spec_param.finite and p.size and not bool(xp_of(p).isfinite(p.astype(xp_of(p).float64)).all()):
        raise ArgumentError(f"{name} must be finite, got {p!r}")
    return p


def check_tables(spec: OpSpec, params: tuple[Array | None, ...] | list[Array | None]) -> None:
    """Tables selected by the same index input must have the same number of rows ``M`` (a weight table of 3
    modalities beside a bias table of 2 is an error naming the second, never a read past a table's end)."""
    first: dict[str, tuple[str, int]] = {}
    for sp, p in zip(spec.params, params, strict=True):
        if sp.kind != "table" or p is None:
            continue
        if sp.index not in first:
            first[sp.index] = (sp.name, int(p.shape[0]))
        elif int(p.shape[0]) != first[sp.index][1]:
            other, m = first[sp.index]
            raise ShapeError(
                f"{sp.name} has {p.shape[0]} rows (shape {tuple(p.shape)}) but {other} has {m}: the tables "
                f"selected by {sp.index} must have the same number of rows (one per modality)"
            )


def _check_input(spec_input: Any, a: Any, x: Array, axis: int) -> Array:
    name = spec_input.name
    if a is None:
        if not spec_input.required:
            return None
        raise ArgumentError(f"{name} is required (got None)")
    if spec_input.kind == "row_scale" and isinstance(a, numbers.Real) and not isinstance(a, bool):
        a = xp_of(x).asarray(float(a), dtype=xp_of(x).float64)  # a Python number: in x's array module
    a = as_array(a, name)
    _same_family(a, name, x)
    if spec_input.kind == "row_scale":
        check_float_dtype(a, name)
        if tuple(a.shape) not in ((), (1,), tuple(x.shape[:axis])):
            raise ShapeError(
                f"{name} must be a scalar (0-d or (1,)) or one scale per row, of x.shape[:axis] = "
                f"{tuple(x.shape[:axis])}, got shape {tuple(a.shape)}"
            )
        xp = xp_of(a)
        if a.size and not bool(((a.astype(xp.float64) > 0) & xp.isfinite(a.astype(xp.float64))).all()):
            raise ArgumentError(f"{name} must hold positive finite scales")
    elif spec_input.kind == "like_x":
        check_float_dtype(a, name)
        if tuple(a.shape) != tuple(x.shape):
            raise ShapeError(f"{name} has shape {tuple(a.shape)}, expected the shape of x, {tuple(x.shape)}")
    elif spec_input.kind == "cond":
        check_float_dtype(a, name)
        cond_groups(a, name, x, axis)
    else:  # row_index
        kind = getattr(a.dtype, "kind", "")
        if kind not in "iu" or not kind or a.dtype == bool:
            raise DTypeError(f"{name} must be an integer array, got dtype {a.dtype}")
        if tuple(a.shape) != tuple(x.shape[:axis]):
            raise ShapeError(f"{name} has shape {tuple(a.shape)}, expected x.shape[:axis] = {tuple(x.shape[:axis])}")
    return a


def cond_groups(a: Array, name: str, x: Array, axis: int) -> int:
    """The number ``G`` of conditioning rows of ``a`` for ``x`` normalized from ``axis`` (the ``"cond"`` rule:
    ``a.shape[:-1]`` is ``x.shape[:axis]``, or a leading part ``x.shape[:k]``, optionally followed by
    size-1 dims up to ``axis``); a :class:`ShapeError` naming ``name`` otherwise."""
    lead = tuple(a.shape[:-1])
    k = len(lead)
    while k > 0 and lead[k - 1] == 1:
        k -= 1
    if a.ndim < 1 or len(lead) > axis or lead[:k] != tuple(x.shape[:k]):
        want = tuple(x.shape[:axis])
        raise ShapeError(
            f"{name} has shape {tuple(a.shape)}, which broadcasts neither way over x of shape {tuple(x.shape)}: "
            f"expected x.shape[:axis] + (C,) = {(*want, 'C')} (one row per row of x) or a leading part of it, "
            f"x.shape[:k] + (C,) for k < axis (one row per sample, broadcast over the rest: "
            f"{(*want[:1], 'C')} for x of shape {tuple(x.shape)})".replace("'C'", "C")
        )
    return math.prod(lead)


def _flat_feature(p: Array | None, norm_shape: tuple[int, ...]) -> Array | None:
    if p is None:
        return None
    h = math.prod(norm_shape)
    if tuple(p.shape) == norm_shape:
        return p.reshape(h)
    return xp_of(p).broadcast_to(p, norm_shape).reshape(h)


def _flat_input(kind: str, a: Array | None, rows: int, h: int) -> Array | None:
    """An extra input as backends see it: ``(rows, H)`` (like_x), ``(rows,)`` (row_index), ``(G, C)`` (cond),
    a contiguous ``(rows,)`` float64 array (row_scale); None stays None (an absent optional input)."""
    if a is None:
        return None
    if kind == "row_scale":
        xp = xp_of(a)
        return xp.ascontiguousarray(xp.broadcast_to(a.astype(xp.float64).reshape(-1), (rows,)))
    if kind == "like_x":
        return a.reshape(rows, h)
    if kind == "cond":
        return a.reshape(math.prod(a.shape[:-1]), a.shape[-1])
    return a.reshape(rows)


def _flat_param(kind: str, p: Array | None, norm_shape: tuple[int, ...]) -> Array | None:
    """A parameter as backends see it: ``(H,)`` (feature), ``(1,)`` (scalar), ``(M, H)`` (table)."""
    if p is None:
        return None
    if kind == "scalar":
        return p.reshape(1)
    if kind == "table":
        return p.reshape(p.shape[0], math.prod(norm_shape))
    if kind in ("matrix", "vector"):
        return p
    return _flat_feature(p, norm_shape)


def _unflat_feature_grad(
    g: Array | None, shape: tuple[int, ...] | None, norm_shape: tuple[int, ...], xp: Any
) -> Array | None:
    """Reduce a ``(H,)`` gradient to a parameter of ``shape`` that was broadcast to ``norm_shape``."""
    if g is None or shape is None:
        return None
    if tuple(shape) == norm_shape:
        return g.reshape(shape)
    full = g.reshape(norm_shape)
    lead = len(norm_shape) - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, d in enumerate(shape) if d == 1 and norm_shape[lead + i] != 1)
    summed = full.astype(xp.float64).sum(axis=axes).reshape(shape)
    if xp is np:
        return round_to(summed, g.dtype)
    return summed.astype(g.dtype)


def check_out(
    out: Any,
    name: str,
    like: Array,
    inputs: tuple[Array | None, ...],
    shape: tuple[int, ...] | None = None,
    dtype: Any = None,
) -> Array | None:
    """``out`` validated as a C-contiguous buffer of ``like``'s dtype and shape (or ``dtype``, ``shape``)
    overlapping no input."""
    if out is None:
        return None
    if hasattr(out, "__dlpack__") and not _served(out):
        out = from_dlpack(out, name)
    if _registry.array_family(out) != _registry.array_family(like):
        _registry._family_of((like, out), ("x", name))
    if not out.dtype.isnative:
        raise DTypeError(
            f"{name} has non-native byte order (dtype {out.dtype.str}): outputs are written in the machine's "
            f"byte order; pass a buffer of dtype {out.dtype.newbyteorder('=').str}"
        )
    want = tuple(like.shape) if shape is None else tuple(shape)
    want_dt = like.dtype if dtype is None else np.dtype(dtype)
    if tuple(out.shape) != want or out.dtype != want_dt:
        raise ShapeError(
            f"{name} must have shape {want} and dtype {want_dt}, got shape {tuple(out.shape)} and dtype {out.dtype}"
        )
    if not out.flags.c_contiguous:
        raise ArgumentError(f"{name} must be C-contiguous")
    if not getattr(out.flags, "writeable", True):  # (CuPy arrays are always writable and have no such flag)
        raise ArgumentError(f"{name} must be writable (a read-only array was given)")
    xp = xp_of(out)
    for a in inputs:
        if a is not None and xp.may_share_memory(out, a):
            raise ArgumentError(f"{name} must not overlap an input array")
    return out


# ---------------------------------------------------------------------------
# dispatch


def forward(
    spec: OpSpec,
    x: Any,
    params: tuple[Any, ...],
    *,
    axis: Any,
    backend: str | None,
    out: Any,
    options: Mapping[str, Any],
    inputs: tuple[Any, ...] = (),
) -> tuple[Any, Context]:
    """Validate, dispatch and run ``spec``'s forward; ``(y, ctx)`` (``((y, h, ...), ctx)`` for an op of
    several outputs), in ``x``'s shape, or ``(spec.result(outputs, ctx, options), ctx)``."""
    x = as_array(x, "x")
    check_float_dtype(x, "x", spec.x_dtypes)
    if x.ndim < 1:
        raise ShapeError("x must have at least 1 dimension, got a 0-d array")
    ax = check_axis(axis, x.ndim)
    norm_shape = tuple(x.shape[ax:])
    h = math.prod(norm_shape)
    if h == 0:
        raise ShapeError(f"the normalized dims x.shape[{ax}:] = {norm_shape} must not be empty")
    opts = spec.validate(options, h)
    ins = tuple(_check_input(si, a, x, ax) for si, a in zip(spec.inputs, inputs, strict=True))
    by_name = dict(zip(spec.input_names, ins, strict=True))
    ps = tuple(_check_param(sp, p, x, ax, by_name) for sp, p in zip(spec.params, params, strict=True))
    check_tables(spec, ps)
    names = (*spec.input_names, *spec.param_names)
    arrays = dict(zip(names, (*ins, *ps), strict=True))
    if spec.check_arrays is not None:
        spec.check_arrays(tuple(x.shape), ax, {"x": x, **arrays}, opts)
    y_shape = spec.output_shape(tuple(x.shape), ax, arrays)
    present = tuple(a for a in (x, *ins, *ps) if a is not None)
    present_names = tuple(n for n, a in zip(("x", *names), (x, *ins, *ps), strict=True) if a is not None)
    name, mod = _registry.resolve(spec.name, present, present_names, backend)
    out = check_out(out, "out", x, present, y_shape, spec.dtypes_of_outputs(x.dtype, opts)[0])
    rows = math.prod(x.shape[:ax])
    y_h = math.prod(y_shape[ax:])
    flat_in = tuple(_flat_input(si.kind, a, rows, h) for si, a in zip(spec.inputs, ins))
    flat_p = tuple(_flat_param(sp.kind, p, norm_shape) for sp, p in zip(spec.params, ps, strict=True))
    to_backend = opts if len(spec.backend_options) == len(opts) else {k: opts[k] for k in spec.backend_options}
    res, inner = mod.forward(
        x.reshape(rows, h), *flat_in, *flat_p, out=None if out is None else out.reshape(rows, y_h), **to_backend
    )
    outs = res if len(spec.outputs) > 1 else (res,)
    shaped = tuple(
        out if (i == 0 and out is not None) else o.reshape(y_shape if i == 0 else x.shape) for i, o in enumerate(outs)
    )
    ctx = Context(
        spec.name,
        name,
        tuple(x.shape),
        x.dtype,
        ax,
        tuple(None if p is None else tuple(p.shape) for p in ps),
        inner,
        tuple(a.dtype for si, a in zip(spec.inputs, ins) if si.differentiable),
        tuple(o.dtype for o in shaped[1:]),
        _registry.array_family(x),
        None if y_shape == tuple(x.shape) else y_shape,
        tuple(tuple(a.shape) for si, a in zip(spec.inputs, ins) if si.differentiable),
    )
    if spec.result is not None:
        return spec.result(shaped, ctx, opts), ctx
    return (shaped if len(spec.outputs) > 1 else shaped[0]), ctx


def _ctx_arrays(inner: Any) -> tuple[Array, ...]:
    """Every array a backend's ctx holds, nested ctx objects included (a composite's ctx holds its ops'):
    ``dx_out`` must overlap none of them, whatever the backend keeps."""
    found: list[Array] = []
    todo = [inner]
    while todo:
        v = todo.pop()
        if hasattr(v, "shape") and hasattr(v, "dtype") and hasattr(v, "reshape"):
            found.append(v)
        elif isinstance(v, (tuple, list)):
            todo.extend(v)
        elif hasattr(v, "__dataclass_fields__"):
            todo.extend(vars(v).values())
    return tuple(found)


def backward(spec: OpSpec, dy: Any, ctx: Any, dx_out: Any, upstream: Mapping[str, Any] | None = None) -> Any:
    """Validate and run ``spec``'s backward on the forward's backend; ``spec.grads(dx, d<input>..., d<param>...)``.

    ``upstream`` maps ``d<output>`` for each output after the first to its gradient (or None).
    """
    op = spec.name
    if not isinstance(ctx, Context):
        raise ContextError(f"ctx must be the Context returned by {op}_forward, got {type(ctx).__name__}")
    if ctx.op != op:
        raise ContextError(f"ctx was produced by {ctx.op}_forward and cannot be used by {op}_backward")
    dy = as_array(dy, "dy")
    if _registry.array_family(dy) != ctx.array_family:
        fam = _registry.array_family(dy)
        raise ArrayTypeError(
            f"arrays of different types cannot be mixed: x is {ctx.array_family[0]}.{ctx.array_family[1]} "
            f"but dy is {fam[0]}.{fam[1]}"
        )
    if ctx.y_shape is None and tuple(dy.shape) != ctx.x_shape:
        raise ShapeError(f"dy has shape {tuple(dy.shape)}, expected the shape of x, {ctx.x_shape}")
    if ctx.y_shape is not None and tuple(dy.shape) != ctx.y_shape:
        raise ShapeError(f"dy has shape {tuple(dy.shape)}, expected the shape of the output, {ctx.y_shape}")
    want_dt = spec.grad_dtype(ctx.x_dtype)
    if dy.dtype != want_dt:
        what = "the dtype of x, " if want_dt == ctx.x_dtype else ""
        more = "" if want_dt == ctx.x_dtype else f" (for x of dtype {ctx.x_dtype})"
        raise DTypeError(f"dy has dtype {dy.dtype}, expected {what}{want_dt}{more}")
    rows, h = ctx.rows, ctx.hidden
    y_shape = ctx.x_shape if ctx.y_shape is None else ctx.y_shape
    y_h = math.prod(y_shape[ctx.axis :])
    extra: dict[str, Any] = {}
    for oname, odt in zip(spec.outputs[1:], ctx.output_dtypes, strict=True):
        g = (upstream or {}).get(f"d{oname}")
        if g is not None:
            g = as_array(g, f"d{oname}")
            _registry._family_of((dy, g), ("dy", f"d{oname}"))
            if tuple(g.shape) != ctx.x_shape or g.dtype != odt:
                raise ShapeError(
                    f"d{oname} must have the shape {ctx.x_shape} and dtype {odt} of {oname}, "
                    f"got shape {tuple(g.shape)} and dtype {g.dtype}"
                )
            g = g.reshape(rows, h)
        extra[f"d{oname}"] = g
    inner_arrays = _ctx_arrays(ctx.inner)
    dx_out = check_out(
        dx_out, "dx_out", dy, (dy, *inner_arrays, *(g for g in extra.values() if g is not None)), ctx.x_shape
    )
    mod = _registry.op_module(ctx.backend, op)
    grads = mod.backward(
        dy.reshape(rows, y_h), ctx.inner, dx_out=None if dx_out is None else dx_out.reshape(rows, h), **extra
    )
    dx = dx_out if dx_out is not None else grads[0].reshape(ctx.x_shape)
    n_in = sum(1 for si in spec.inputs if si.differentiable)
    d_inputs = tuple(g.reshape(s) for g, s in zip(grads[1 : 1 + n_in], ctx.input_shapes, strict=True))
    norm_shape = ctx.x_shape[ctx.axis :]
    xp = xp_of(dy)
    d_params = tuple(
        _unflat_feature_grad(g, s, norm_shape, xp) if sp.kind == "feature" else (None if g is None else g.reshape(s))
        for sp, g, s in zip(spec.params, grads[1 + n_in :], ctx.param_shapes, strict=True)
    )
    return spec.grads(dx, *d_inputs, *d_params)
