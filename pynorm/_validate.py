"""Validation of an op's arguments against its spec, once, before dispatch: shared by :mod:`pynorm._dispatch` (the
in-memory ops) and :mod:`pynorm.dask` (the chunked ones), so every entry point rejects bad input the same way, with
the same message naming the argument (:mod:`pynorm.errors`).

* :func:`as_array` / :func:`from_dlpack`: what an argument is read as (NumPy or CuPy arrays, lists, any DLPack
  exporter; non-native byte order as a native copy);
* :func:`check_axis`, :func:`check_float_dtype`, :func:`check_input`, :func:`check_param`, :func:`check_tables`,
  :func:`cond_groups`: the rules of each kind of argument (:mod:`pynorm.ops._spec`);
* :func:`check_out`, :func:`ctx_arrays`: the output buffers (``out=``, ``dx_out=``).
"""

from __future__ import annotations

import math
import numbers
import sys
from typing import Any

import numpy as np

from . import _registry
from ._dtypes import FLOAT_DTYPES, dtype_name
from .errors import ArgumentError, ArrayTypeError, DTypeError, ShapeError
from .ops import OpSpec

__all__ = [
    "as_array",
    "check_axis",
    "check_float_dtype",
    "check_input",
    "check_input_values",
    "check_out",
    "check_param",
    "check_param_values",
    "check_tables",
    "cond_groups",
    "ctx_arrays",
    "from_dlpack",
    "returner",
    "same_family",
    "served",
    "xp_of",
]

Array = Any  # numpy.ndarray, cupy.ndarray, or another backend's array type


#: DLPack device types (``DLDeviceType``) pynorm reads: CPU memory as NumPy arrays, CUDA memory as CuPy arrays
_DLPACK_CPU = (1, 3)  # kDLCPU, kDLCUDAHost (pinned host memory)
_DLPACK_CUDA = (2, 13)  # kDLCUDA, kDLCUDAManaged
_DLPACK_NAMES = {4: "OpenCL", 7: "Vulkan", 8: "Metal", 9: "VPI", 10: "ROCm", 11: "ROCm host", 12: "ExtDev",
                 14: "oneAPI", 15: "WebGPU", 16: "Hexagon", 17: "MAIA"}  # fmt: skip


def served(a: Any) -> bool:
    """Whether ``a``'s type is the array type of a registered backend (``numpy.ndarray``, ``cupy.ndarray``)."""
    fam = _registry.array_family(a)
    return any((b.array_module, b.array_type) == fam for b in _registry.registered())


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


def returner(a: Any) -> Any:
    """For an argument that was read through DLPack (:func:`from_dlpack`): a function that gives a NumPy or CuPy
    result back as ``a``'s own array type -- through ``a.__array_namespace__().from_dlpack`` (the Array API's: JAX)
    or the ``from_dlpack`` of ``a``'s top-level module (PyTorch), zero-copy where that library allows; bfloat16 as
    its 16-bit pattern viewed back (``view(bfloat16)`` on the library's side). None for anything else (a NumPy or
    CuPy array, a list), or where ``a``'s library offers no ``from_dlpack`` (results then stay NumPy/CuPy)."""
    if type(a) is np.ndarray or not hasattr(a, "__dlpack__") or served(a):
        return None
    ns: Any = None
    if hasattr(a, "__array_namespace__"):
        try:
            ns = a.__array_namespace__()
        except Exception:  # an exporter whose namespace cannot be had: its module's from_dlpack, if any
            ns = None
    if getattr(ns, "from_dlpack", None) is None:
        ns = sys.modules.get(type(a).__module__.partition(".")[0])
    load = getattr(ns, "from_dlpack", None)
    if load is None:
        return None
    bf16 = getattr(ns, "bfloat16", None)

    def back(r: Any) -> Any:
        if r is None or not hasattr(r, "__dlpack__"):
            return r
        if bf16 is not None and dtype_name(r.dtype) == "bfloat16":
            return load(r.view("int16")).view(bf16)
        return load(r)

    return back


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
    if hasattr(a, "__dlpack__") and not served(a):
        if _is_jax_tracer(a):
            raise ArrayTypeError(
                f"{name} is a JAX tracer ({type(a).__name__}: inside jax.jit, grad or vmap), which holds no buffer to "
                f"read: use pynorm.jax.<op> there (the same ops for JAX, differentiable; docs/jax.md)"
            )
        return from_dlpack(a, name)
    if not (hasattr(a, "dtype") and hasattr(a, "shape") and hasattr(a, "reshape")):
        raise ArrayTypeError(f"{name} must be an array (numpy.ndarray, cupy.ndarray...), got {type(a).__name__}")
    return a


def _is_jax_tracer(a: Any) -> bool:
    """Whether ``a`` is a JAX tracer (an abstract value under ``jax.jit``/``grad``/``vmap``), without importing JAX."""
    core = sys.modules.get("jax.core")
    tracer = getattr(core, "Tracer", None)
    return tracer is not None and isinstance(a, tracer)


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


def same_family(a: Array, name: str, x: Array) -> None:
    if _registry.array_family(a) != _registry.array_family(x):
        _registry.family_of((x, a), ("x", name))  # raises ArrayTypeError with both types


def check_param(spec_param: Any, p: Any, x: Array, axis: int, inputs: dict[str, Array]) -> Array | None:
    name = spec_param.name
    if p is None:
        if spec_param.required:
            raise ArgumentError(f"{name} is required (got None)")
        return None
    p = as_array(p, name)
    same_family(p, name, x)
    check_float_dtype(p, name)
    norm_shape = tuple(x.shape[axis:])
    kind = spec_param.kind
    if kind == "channel":  # ``axis``: the channel axis
        if tuple(p.shape) != (x.shape[axis],):
            raise ShapeError(f"{name} has shape {tuple(p.shape)}, expected one value per channel, ({x.shape[axis]},)")
    elif kind == "feature":
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
    check_param_values(spec_param, p, inputs)
    return p


def check_param_values(spec_param: Any, p: Array, inputs: dict[str, Array]) -> None:
    """The checks of a parameter that depend on its values (and on its index input's): a table's ids in
    ``[0, M)``, finiteness where the spec asks. Run on every call, also when the shapes were checked before."""
    if spec_param.kind == "table":
        ids = inputs[spec_param.index]
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= p.shape[0]):
            raise ArgumentError(
                f"{spec_param.index} must hold values in [0, {p.shape[0]}) (the rows of {spec_param.name}), "
                f"got values from {int(ids.min())} to {int(ids.max())}"
            )
    if not spec_param.finite or not p.size:
        return
    if type(p) is np.ndarray and p.size == 1:  # (a scalar parameter, checked at every call: 0.2 us, not 1.4)
        finite = math.isfinite(float(p.reshape(-1)[0]))
    else:
        finite = bool(xp_of(p).isfinite(p.astype(xp_of(p).float64)).all())
    if not finite:
        raise ArgumentError(f"{spec_param.name} must be finite, got {p!r}")


def check_input_values(spec_input: Any, a: Array | None) -> None:
    """The checks of an input that depend on its values: a row scale positive and finite, a running statistic
    finite. Run on every call, also when the shapes were checked before."""
    if a is None or not a.size or spec_input.kind not in ("row_scale", "running"):
        return
    xp = xp_of(a)
    a64 = a.astype(xp.float64)
    if spec_input.kind == "row_scale" and not bool(((a64 > 0) & xp.isfinite(a64)).all()):
        raise ArgumentError(f"{spec_input.name} must hold positive finite scales")
    if spec_input.kind == "running" and not bool(xp.isfinite(a64).all()):
        raise ArgumentError(f"{spec_input.name} must be finite (a running statistic with NaN or inf)")


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


def check_input(spec_input: Any, a: Any, x: Array, axis: int) -> Array:
    name = spec_input.name
    if a is None:
        if not spec_input.required:
            return None
        raise ArgumentError(f"{name} is required (got None)")
    if spec_input.kind == "row_scale" and isinstance(a, numbers.Real) and not isinstance(a, bool):
        a = xp_of(x).asarray(float(a), dtype=xp_of(x).float64)  # a Python number: in x's array module
    a = as_array(a, name)
    same_family(a, name, x)
    if spec_input.kind == "row_scale":
        check_float_dtype(a, name)
        if tuple(a.shape) not in ((), (1,), tuple(x.shape[:axis])):
            raise ShapeError(
                f"{name} must be a scalar (0-d or (1,)) or one scale per row, of x.shape[:axis] = "
                f"{tuple(x.shape[:axis])}, got shape {tuple(a.shape)}"
            )
    elif spec_input.kind == "like_x":
        check_float_dtype(a, name)
        if tuple(a.shape) != tuple(x.shape):
            raise ShapeError(f"{name} has shape {tuple(a.shape)}, expected the shape of x, {tuple(x.shape)}")
    elif spec_input.kind == "cond":
        check_float_dtype(a, name)
        cond_groups(a, name, x, axis)
    elif spec_input.kind == "running":  # ``axis``: the channel axis
        check_float_dtype(a, name)
        if tuple(a.shape) != (x.shape[axis],):
            raise ShapeError(f"{name} has shape {tuple(a.shape)}, expected one value per channel, ({x.shape[axis]},)")
    else:  # row_index
        kind = getattr(a.dtype, "kind", "")
        if kind not in "iu" or not kind or a.dtype == bool:
            raise DTypeError(f"{name} must be an integer array, got dtype {a.dtype}")
        if tuple(a.shape) != tuple(x.shape[:axis]):
            raise ShapeError(f"{name} has shape {tuple(a.shape)}, expected x.shape[:axis] = {tuple(x.shape[:axis])}")
    check_input_values(spec_input, a)
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
    numpy_pair = type(out) is np.ndarray and type(like) is np.ndarray  # (one family: a small call's microseconds)
    if not numpy_pair:
        if hasattr(out, "__dlpack__") and not served(out):
            out = from_dlpack(out, name)
        if _registry.array_family(out) != _registry.array_family(like):
            _registry.family_of((like, out), ("x", name))
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
    xp = np if numpy_pair else xp_of(out)
    for a in inputs:
        if a is not None and xp.may_share_memory(out, a):
            raise ArgumentError(f"{name} must not overlap an input array")
    return out


_SCALARS = frozenset((bool, int, float, str))  # what a ctx holds besides arrays, skipped without attribute tests


def ctx_arrays(inner: Any) -> tuple[Array, ...]:
    """Every array a backend's ctx holds, nested ctx objects included (a composite's ctx holds its ops'):
    ``dx_out`` must overlap none of them, whatever the backend keeps."""
    found: list[Array] = []
    todo = [inner]
    while todo:
        v = todo.pop()
        if v is None or type(v) in _SCALARS:
            continue
        if type(v) is np.ndarray or (hasattr(v, "shape") and hasattr(v, "dtype") and hasattr(v, "reshape")):
            found.append(v)
        elif isinstance(v, (tuple, list)):
            todo.extend(v)
        elif hasattr(v, "__dataclass_fields__"):
            todo.extend(vars(v).values())
    return tuple(found)
