"""A stand-in for the parts of CuPy that pynorm's CuPy backend and its tests use (test-only).

Installed as ``sys.modules["cupy"]`` by :func:`tests.cuda_cpu.install`, it lets the
backend's real host code (``pynorm/backends/cupy/*.py``) run unchanged on a machine
without a GPU, with every kernel launch executed by the CPU execution harness
(``runtime.cpp``) on the kernels compiled for the host (``build.py``):

* **arrays** (:class:`ndarray`) live in fenced device memory: each buffer is its own
  mapping, NaN-poisoned (0xFF bytes) at allocation, with canaries and guard pages
  around it. Array operations (views, copies, casts, reductions, ufuncs) run with NumPy
  on that memory; converting one implicitly to NumPy raises, as in CuPy;
* **modules** (:class:`RawModule`): the source is compiled with the host C++ compiler
  for execution and with NVRTC for the register and shared-memory figures CuPy would
  report (``num_regs``, ``shared_size_bytes``);
* **launches** (:class:`RawKernel` calls) are checked the way the driver checks them --
  argument count and scalar widths against the kernel's signature, block size against
  ``__launch_bounds__`` and the registers, dynamic shared memory against the 48 KiB
  default (static plus dynamic) or the opt-in attribute -- then run twice, under the
  forward and the reverse thread schedule, and the outputs compared bit for bit;
  inputs passed through ``const`` pointers must come back unchanged and every
  buffer's canaries intact.

The device modelled is an sm_90 GPU with 132 SMs (H100/H200), or sm_80 (A100) with
``PYNORM_CUDA_CPU_ARCH=sm_80``. What the harness cannot see is listed in
``docs/cuda_cpu.md``.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import sys
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from . import build

__all__ = ["HarnessError", "RawKernel", "RawModule", "ndarray"]


class HarnessError(RuntimeError):
    """A kernel misbehaved: a race (the schedules disagree), deadlock, fault, out-of-bounds write..."""


class CUDADriverError(RuntimeError):
    """What CuPy raises when the driver refuses a call (``cupy.cuda.driver.CUDADriverError``)."""


class CompileException(RuntimeError):
    """A kernel source that NVRTC (or the host compiler) rejects (``cupy.cuda.compiler.CompileException``)."""


# ---------------------------------------------------------------------------
# the device

_PROPS = {
    "sm_90": {
        "name": b"NVIDIA H200 (CPU execution harness)",
        "major": 9,
        "minor": 0,
        "multiProcessorCount": 132,
        "sharedMemPerMultiprocessor": 233472,
        "sharedMemPerBlockOptin": 232448,
    },
    "sm_80": {
        "name": b"NVIDIA A100 (CPU execution harness)",
        "major": 8,
        "minor": 0,
        "multiProcessorCount": 108,
        "sharedMemPerMultiprocessor": 167936,
        "sharedMemPerBlockOptin": 166912,
    },
}
_COMMON = {
    "maxThreadsPerMultiProcessor": 2048,
    "maxBlocksPerMultiProcessor": 32,
    "regsPerMultiprocessor": 65536,
    "regsPerBlock": 65536,
    "sharedMemPerBlock": 49152,
    "reservedSharedMemPerBlock": 1024,
    "warpSize": 32,
    "maxThreadsPerBlock": 1024,
    "maxThreadsDim": (1024, 1024, 64),
    "maxGridSize": (2**31 - 1, 65535, 65535),
    "totalGlobalMem": 141 * 2**30,
}
ARCH = os.environ.get("PYNORM_CUDA_CPU_ARCH", "sm_90")
if ARCH not in _PROPS:
    raise ValueError(f"PYNORM_CUDA_CPU_ARCH must be one of {sorted(_PROPS)}, got {ARCH!r}")
PROPS: dict[str, Any] = {**_COMMON, **_PROPS[ARCH]}
#: a launch running longer than this (wall-clock seconds) is stopped and reported
LAUNCH_TIMEOUT = float(os.environ.get("PYNORM_CUDA_CPU_TIMEOUT", "600"))
#: "both" (default): every launch runs under the forward and the reverse schedule
SCHEDULES = {"both": (0, 1), "forward": (0,), "reverse": (1,)}[os.environ.get("PYNORM_CUDA_CPU_SCHEDULES", "both")]

#: launches run so far (tests use it to prove that a code path reached the harness)
stats = {"launches": 0, "modules": 0}


# ---------------------------------------------------------------------------
# device memory


class _Buffer:
    """Owner of one harness allocation; NumPy views of it keep it alive through ``.base``."""

    def __init__(self, nbytes: int) -> None:
        self.lib = build.runtime()
        ptr = self.lib.pnc_alloc(nbytes)
        if not ptr:
            raise MemoryError(f"cannot allocate {nbytes} bytes of (harness) device memory")
        self.ptr = int(ptr)
        self.nbytes = nbytes
        self.__array_interface__ = {
            "data": (self.ptr, False),
            "shape": (nbytes,),
            "typestr": "|u1",
            "version": 3,
        }

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.lib.pnc_free(self.ptr)


def _device_bytes(nbytes: int) -> np.ndarray:
    return np.asarray(_Buffer(max(int(nbytes), 0)))


def _device_empty(shape: Any, dtype: Any, order: str = "C") -> np.ndarray:
    dtype = np.dtype(dtype)
    shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(int(s) for s in shape)
    n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    raw = _device_bytes(n)
    a = raw[:n].view(dtype) if n else np.empty(0, dtype)
    if not n:  # keep empty arrays in device memory too (a zero-size allocation)
        a = np.ndarray((0,), dtype, buffer=raw, offset=0)
    return a.reshape(shape, order="F" if order == "F" else "C")


def _on_device(a: np.ndarray) -> bool:
    base = a
    while isinstance(base, np.ndarray) and base.base is not None:
        base = base.base
    return isinstance(base, _Buffer)


def _ftz(a: Any) -> Any:
    """``a`` with its float32 subnormals flushed to (signed) zero, as CuPy's own kernels do (CuPy compiles them with
    ``-ftz=true``: its ufuncs, ``astype`` and reductions; pynorm's kernels are compiled without it). Other dtypes, and
    non-arrays, unchanged. A new array when something is flushed."""
    if not isinstance(a, np.ndarray) or a.dtype != np.float32 or not a.size:
        return a
    mag = np.ascontiguousarray(a).view(np.uint32) & np.uint32(0x7FFFFFFF)
    sub = (mag - np.uint32(1)) < np.uint32(0x007FFFFF)  # 0 < |a| < 2^-126: a subnormal (0 wraps around)
    if not sub.any():
        return a
    out = np.array(a, copy=True)
    out[sub] = np.copysign(np.float32(0), a[sub])
    return out


def _to_device(a: np.ndarray) -> np.ndarray:
    """``a`` itself when it is device memory, else a C-contiguous device copy."""
    if _on_device(a):
        return a
    out = _device_empty(a.shape, a.dtype)
    np.copyto(out, a, casting="no")
    return out


# ---------------------------------------------------------------------------
# arrays


class _Flags:
    def __init__(self, a: np.ndarray) -> None:
        self.c_contiguous = bool(a.flags.c_contiguous)
        self.f_contiguous = bool(a.flags.f_contiguous)
        self.owndata = False

    def __getitem__(self, key: str) -> bool:
        return {"C_CONTIGUOUS": self.c_contiguous, "F_CONTIGUOUS": self.f_contiguous}[key]


class _MemoryPointer:
    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


def _unwrap(v: Any) -> Any:
    if isinstance(v, ndarray):
        return v._a
    if isinstance(v, np.ndarray) and v.ndim > 0:
        raise TypeError(
            "Unsupported type <class 'numpy.ndarray'>: a NumPy array cannot be an operand of a CuPy operation"
        )
    if isinstance(v, (tuple, list)):
        return type(v)(_unwrap(x) for x in v)
    return v


def _wrap(v: Any) -> Any:
    if isinstance(v, np.ndarray):
        return ndarray(_to_device(v))
    if isinstance(v, tuple):
        return tuple(_wrap(x) for x in v)
    if isinstance(v, np.generic):  # CuPy reductions return 0-d arrays, not NumPy scalars
        return ndarray(_to_device(np.asarray(v)))
    return v


class ndarray(np.lib.mixins.NDArrayOperatorsMixin):
    """A device array: a NumPy view of harness device memory (see the module docstring)."""

    __slots__ = ("_a",)

    def __init__(self, a: np.ndarray) -> None:
        if not _on_device(a):
            raise HarnessError("internal: an ndarray must view device memory")
        self._a = a

    # -- attributes
    shape = property(lambda self: tuple(self._a.shape))
    dtype = property(lambda self: self._a.dtype)
    ndim = property(lambda self: self._a.ndim)
    size = property(lambda self: int(self._a.size))
    itemsize = property(lambda self: self._a.itemsize)
    nbytes = property(lambda self: int(self._a.nbytes))
    strides = property(lambda self: tuple(self._a.strides))
    flags = property(lambda self: _Flags(self._a))
    data = property(lambda self: _MemoryPointer(int(self._a.__array_interface__["data"][0])))
    T = property(lambda self: ndarray(self._a.T))
    device = property(lambda self: cuda.Device(0))

    def __len__(self) -> int:
        return len(self._a)

    def __repr__(self) -> str:
        return f"array({np.array2string(self._a, separator=', ')}, dtype={self._a.dtype}) [cupy stand-in]"

    def __array__(self, *args: Any, **kwargs: Any) -> np.ndarray:
        raise TypeError(
            "Implicit conversion to a NumPy array is not allowed. Please use `.get()` to construct a NumPy array "
            "explicitly."
        )

    def __reduce__(self) -> tuple[Any, tuple[np.ndarray]]:  # (CuPy's: a pickle holds the array's host copy)
        return array, (self.get(),)

    def __deepcopy__(self, memo: Any) -> ndarray:  # (CuPy's: a device copy)
        return self.copy()

    def __bool__(self) -> bool:
        return bool(self._a)

    def __int__(self) -> int:
        return int(self._a)

    def __float__(self) -> float:
        return float(self._a)

    def __iter__(self) -> Iterator[Any]:
        for i in range(len(self)):
            yield self[i]

    # -- views and copies (device memory in, device memory out)
    def __getitem__(self, key: Any) -> ndarray:
        return _wrap(self._a[_unwrap(key)])

    def __setitem__(self, key: Any, value: Any) -> None:
        self._a[_unwrap(key)] = _unwrap(value)

    def view(self, dtype: Any = None) -> ndarray:
        return ndarray(self._a.view(dtype) if dtype is not None else self._a.view())

    def reshape(self, *shape: Any, order: str = "C") -> ndarray:
        return _wrap(self._a.reshape(*shape, order=order))

    def ravel(self, order: str = "C") -> ndarray:
        return _wrap(self._a.ravel(order))

    def transpose(self, *axes: Any) -> ndarray:
        return ndarray(self._a.transpose(*axes))

    def swapaxes(self, a: int, b: int) -> ndarray:
        return ndarray(self._a.swapaxes(a, b))

    def squeeze(self, axis: Any = None) -> ndarray:
        return ndarray(self._a.squeeze(axis))

    def copy(self, order: str = "C") -> ndarray:
        out = _device_empty(self._a.shape, self._a.dtype, order)
        np.copyto(out, self._a)
        return ndarray(out)

    def astype(self, dtype: Any, order: str = "K", casting: Any = None, subok: Any = None, copy: bool = True) -> Any:
        dtype = np.dtype(dtype)
        if not copy and dtype == self._a.dtype:
            return self
        out = _device_empty(self._a.shape, dtype)
        # (float32 <-> float64 and float32 -> float32 conversions flush; to and from 16-bit types they do not)
        wide = {self._a.dtype, dtype} <= {np.dtype(np.float32), np.dtype(np.float64)}
        np.copyto(out, _ftz(self._a) if wide else self._a, casting="unsafe")
        if wide and out.dtype == np.float32:
            np.copyto(out, _ftz(out))
        return ndarray(out)

    def fill(self, value: Any) -> None:
        self._a.fill(value)

    def get(self, stream: Any = None, order: str = "C", out: Any = None) -> np.ndarray:
        return np.array(self._a, order=order)

    def set(self, arr: np.ndarray, stream: Any = None) -> None:
        np.copyto(self._a, arr)

    def tolist(self) -> Any:
        return self._a.tolist()

    def item(self) -> Any:
        return self._a.item()

    # -- reductions
    def _reduce(self, name: str, *args: Any, **kwargs: Any) -> Any:
        kwargs = {k: _unwrap(v) for k, v in kwargs.items()}
        return _wrap(_ftz(np.asarray(getattr(_ftz(self._a), name)(*args, **kwargs))))

    def sum(self, *a: Any, **k: Any) -> Any:
        return self._reduce("sum", *a, **k)

    def mean(self, *a: Any, **k: Any) -> Any:
        return self._reduce("mean", *a, **k)

    def max(self, *a: Any, **k: Any) -> Any:
        return self._reduce("max", *a, **k)

    def min(self, *a: Any, **k: Any) -> Any:
        return self._reduce("min", *a, **k)

    def any(self, *a: Any, **k: Any) -> Any:
        return self._reduce("any", *a, **k)

    def all(self, *a: Any, **k: Any) -> Any:
        return self._reduce("all", *a, **k)

    # -- arithmetic: NumPy ufuncs on the device memory
    def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kwargs: Any) -> Any:
        out = kwargs.get("out")
        if out is not None:
            kwargs["out"] = tuple(_unwrap(o) for o in out)
        # CuPy's matmul is cuBLAS's, which keeps subnormals (the H200 runs: the fused norm + Linear passed there)
        flush = _ftz if ufunc is not np.matmul else (lambda v: v)
        res = getattr(ufunc, method)(*(flush(_unwrap(x)) for x in inputs), **kwargs)
        if out is not None:
            for o in out:
                if isinstance(o, ndarray) and o._a.dtype == np.float32:
                    np.copyto(o._a, flush(o._a))
            return out[0] if len(out) == 1 else out
        return _wrap(tuple(flush(r) for r in res) if isinstance(res, tuple) else flush(res))


ndarray.__module__ = "cupy"
ndarray.__qualname__ = "ndarray"


# ---------------------------------------------------------------------------
# array functions


def empty(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    return ndarray(_device_empty(shape, dtype, order))


def _all_ff(value: Any, dtype: np.dtype[Any]) -> bool:
    try:
        b = np.asarray(value, dtype=dtype).tobytes()
    except (TypeError, ValueError, OverflowError):
        return False
    return len(b) > 0 and set(b) == {0xFF}


def full(shape: Any, fill_value: Any, dtype: Any = None, order: str = "C") -> ndarray:
    dtype = np.dtype(dtype) if dtype is not None else np.asarray(fill_value).dtype
    a = _device_empty(shape, dtype, order)
    if not _all_ff(fill_value, dtype):  # new device memory already holds 0xFF bytes
        a.fill(fill_value)
    return ndarray(a)


def zeros(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    return full(shape, 0, dtype, order)


def ones(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
    return full(shape, 1, dtype, order)


def empty_like(a: ndarray, dtype: Any = None) -> ndarray:
    return empty(a.shape, dtype or a.dtype)


def zeros_like(a: ndarray, dtype: Any = None) -> ndarray:
    return zeros(a.shape, dtype or a.dtype)


def ones_like(a: ndarray, dtype: Any = None) -> ndarray:
    return ones(a.shape, dtype or a.dtype)


def full_like(a: ndarray, fill_value: Any, dtype: Any = None) -> ndarray:
    return full(a.shape, fill_value, dtype or a.dtype)


def array(obj: Any, dtype: Any = None, copy: bool = True, order: str = "K", ndmin: int = 0) -> ndarray:
    if isinstance(obj, ndarray):
        a = obj._a if dtype is None else obj._a.astype(dtype)
        return ndarray(_to_device(np.array(a, copy=True))) if copy else obj
    host = np.array(obj, dtype=dtype, ndmin=ndmin)
    out = _device_empty(host.shape, host.dtype)
    np.copyto(out, host)
    return ndarray(out)


def asarray(obj: Any, dtype: Any = None, order: Any = None) -> ndarray:
    if isinstance(obj, ndarray) and (dtype is None or np.dtype(dtype) == obj.dtype):
        return obj
    if isinstance(obj, ndarray):
        return obj.astype(dtype)
    return array(obj, dtype=dtype)


def ascontiguousarray(a: Any, dtype: Any = None) -> ndarray:
    a = asarray(a, dtype)
    if a.flags.c_contiguous:
        return a
    return a.copy()


def asnumpy(a: Any, stream: Any = None, order: str = "C", out: Any = None) -> np.ndarray:
    if isinstance(a, ndarray):
        return a.get(order=order)
    return np.asarray(a, order=order)


def arange(*args: Any, dtype: Any = None) -> ndarray:
    """``cupy.arange`` (the composite ops build row ids with it)."""
    return ndarray(_to_device(np.arange(*args, dtype=dtype)))


def isfinite(a: ndarray) -> ndarray:
    """``cupy.isfinite`` (the dispatcher checks parameters that must be finite with it)."""
    return ndarray(_to_device(np.isfinite(_unwrap(a))))


def broadcast_to(a: ndarray, shape: Any) -> ndarray:
    return ndarray(np.broadcast_to(a._a, shape))


def moveaxis(a: ndarray, source: Any, destination: Any) -> ndarray:
    """``cupy.moveaxis`` (a view; the dispatcher's channels-last layout)."""
    return ndarray(np.moveaxis(a._a, source, destination))


def where(condition: Any, x: Any, y: Any) -> ndarray:
    """``cupy.where`` (pynorm.blocks' masked softmax)."""
    return ndarray(_to_device(np.where(_unwrap(condition), _unwrap(x), _unwrap(y))))


def stack(arrays: Any, axis: int = 0) -> ndarray:
    """``cupy.stack`` (the BatchNorm host code's test of its statistics)."""
    return ndarray(_to_device(np.stack([_unwrap(a) for a in arrays], axis=axis)))


def flatnonzero(a: Any) -> ndarray:
    return ndarray(_to_device(np.flatnonzero(_unwrap(a))))


def tril(a: Any, k: int = 0) -> ndarray:
    """``cupy.tril`` (pynorm.blocks' causal mask)."""
    return ndarray(_to_device(np.tril(_unwrap(a), k)))


def may_share_memory(a: Any, b: Any, max_work: Any = None) -> bool:
    return bool(np.may_share_memory(_unwrap(a), _unwrap(b)))


def shares_memory(a: Any, b: Any, max_work: Any = None) -> bool:
    return bool(np.shares_memory(_unwrap(a), _unwrap(b)))


def is_available() -> bool:
    return True


class _MemoryPool:
    def free_all_blocks(self, stream: Any = None) -> None:
        pass

    def used_bytes(self) -> int:
        return 0

    def total_bytes(self) -> int:
        return 0


_POOL = _MemoryPool()


def get_default_memory_pool() -> _MemoryPool:
    return _POOL


def get_default_pinned_memory_pool() -> _MemoryPool:
    return _POOL


# ---------------------------------------------------------------------------
# compiled modules and kernels


class _Param(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int),
        ("size", ctypes.c_int),
        ("is_const", ctypes.c_int),
        ("pointee_kind", ctypes.c_int),
        ("pointee_size", ctypes.c_int),
        ("type", ctypes.c_char_p),
    ]


class _Kernel(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char_p),
        ("max_threads", ctypes.c_int),
        ("min_blocks", ctypes.c_int),
        ("nparams", ctypes.c_int),
        ("params", ctypes.POINTER(_Param)),
        ("invoke", ctypes.c_void_p),
    ]


class _Module(ctypes.Structure):
    _fields_ = [
        ("nkernels", ctypes.c_int),
        ("kernels", ctypes.POINTER(_Kernel)),
        ("ndynamic", ctypes.c_int),
        ("dynamic_smem", ctypes.c_void_p),
        ("tls_anchor", ctypes.c_void_p),
    ]


POINTER, SIGNED, UNSIGNED, FLOAT = 0, 1, 2, 3
#: C type names a pointer parameter accepts for each array dtype
_C_TYPES = {
    "float16": {"__half"},
    "bfloat16": {"__nv_bfloat16"},
    "float32": {"float"},
    "float64": {"double"},
    "int8": {"signed char", "char"},
    "int16": {"short"},
    "int32": {"int"},
    "int64": {"long", "long long"},
    "uint8": {"unsigned char", "char"},
    "uint16": {"unsigned short"},
    "uint32": {"unsigned int"},
    "uint64": {"unsigned long", "unsigned long long"},
    "bool": {"bool"},
}


#: ``hook(code) -> the name expressions of that source in groups that compile independently, or None``: lets
#: the NVRTC compilations of a source serve all its modules, spread over threads and over processes
#: (tests/cuda_cpu/__init__.py installs one for pynorm's kernel files)
ALL_GROUPS_HOOK: Any = None
_stats_lock = threading.Lock()
_code_locks: dict[str, threading.Lock] = {}


def _write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


#: the kernel file of a source (set with :data:`ALL_GROUPS_HOOK`: a pynorm kernel file's NVRTC compilation then
#: has the compile check's name and key, so its cached outcome serves both, ``compile_check.CACHE_ENV``)
FILE_HOOK: Any = None


def _compile_stats(code: str, names: list[str], extra: tuple[str, ...]) -> dict[str, dict[str, int]]:
    from pynorm.backends.cupy import compile_check as cc

    name = (FILE_HOOK(code) if FILE_HOOK is not None else None) or "module.cu"
    res = cc.compile_source(code, names, ARCH, filename=name, options=extra)
    if any("compilation failed" in e for e in res.errors) or not res.kernels:
        raise CompileException("\n".join(res.errors))
    return {k.name: {"regs": k.registers, "smem": k.smem, "local": k.stack} for k in res.kernels}


def _group_path(key: str, group: list[str]) -> Path:
    """The cache file of one group's stats (its lock file: the same name with ``.lock``)."""
    return build.cache_dir() / f"nvrtc-{key}-{hashlib.sha256(chr(0).join(group).encode()).hexdigest()[:16]}.json"


def _shared_group_stats(code: str, groups: list[list[str]], extra: tuple[str, ...], key: str) -> dict[str, Any]:
    """The stats of every group, each compiled once across threads *and* processes (pytest-xdist workers):
    a group's result is a cache file; a process compiles the groups whose lock it gets without waiting, in a
    thread pool, loads those others finished and waits only when every remaining group is another's."""
    import fcntl
    from concurrent.futures import ThreadPoolExecutor

    out: dict[str, Any] = {}
    pending = [g for g in groups if g]
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as ex:
        while pending:
            theirs, mine = [], []
            for g in pending:
                gpath = _group_path(key, g)
                if gpath.exists():
                    out.update(json.loads(gpath.read_text()))
                    continue
                fd = os.open(gpath.with_suffix(".lock"), os.O_CREAT | os.O_RDWR, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    os.close(fd)
                    theirs.append(g)
                    continue
                if gpath.exists():  # finished by another process between the check and the lock
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    os.close(fd)
                    out.update(json.loads(gpath.read_text()))
                    continue
                mine.append((gpath, fd, ex.submit(_compile_stats, code, g, extra)))
            for gpath, fd, fut in mine:
                try:
                    stats = fut.result()
                    _write_json(gpath, stats)
                    out.update(stats)
                finally:
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    os.close(fd)
            if theirs and not mine:  # all that is left is being compiled elsewhere: wait for one of them
                g = theirs[0]
                gp = _group_path(key, g)
                fd = os.open(gp.with_suffix(".lock"), os.O_CREAT | os.O_RDWR, 0o644)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)  # released when its holder finishes (or dies)
                finally:
                    fcntl.flock(fd, fcntl.LOCK_UN)
                    os.close(fd)
            pending = theirs
    return out


def _nvrtc_stats(code: str, names: tuple[str, ...], options: tuple[str, ...]) -> dict[str, dict[str, int]]:
    """Registers, static shared memory and stack of each kernel, from NVRTC/ptxas for the modelled arch
    (what CuPy reads with cuFuncGetAttribute), cached on disk per source."""
    from pynorm.backends.cupy import _loader

    base = set(_loader.compile_options())
    extra = tuple(o for o in options if o not in base and not o.startswith("-I"))
    key = hashlib.sha256("\0".join([code, *extra, ARCH]).encode()).hexdigest()[:24]
    path = build.cache_dir() / f"nvrtc-{key}.json"
    with _stats_lock:
        lock = _code_locks.setdefault(key, threading.Lock())
    with lock:
        known: dict[str, dict[str, int]] = json.loads(path.read_text()) if path.exists() else {}
        missing = [n for n in names if n not in known]
        if missing:
            groups = ALL_GROUPS_HOOK(code) if ALL_GROUPS_HOOK is not None else None
            if groups is not None and set(missing) <= {n for g in groups for n in g}:
                known.update(_shared_group_stats(code, [[n for n in g if n not in known] for g in groups], extra, key))
            else:
                known.update(_compile_stats(code, missing, extra))
            _write_json(path, known)
    return {n: known[n] for n in names}


class RawModule:
    """``cupy.RawModule(code=..., options=..., name_expressions=...)`` on the harness."""

    def __init__(
        self,
        *,
        code: str | None = None,
        path: str | None = None,
        options: tuple[str, ...] = (),
        backend: str = "nvrtc",
        translate_cucomplex: bool = False,
        enable_cooperative_groups: bool = False,
        name_expressions: Any = None,
        jitify: bool = False,
    ) -> None:
        if code is None or not name_expressions:
            raise HarnessError("the CPU execution harness runs RawModule(code=..., name_expressions=...) only")
        self.code = code
        self.options = tuple(options)
        self.name_expressions = tuple(name_expressions)
        self._lock = threading.Lock()
        self._lib: ctypes.CDLL | None = None
        self._info: _Module | None = None
        self._stats: dict[str, dict[str, int]] = {}
        # per kernel: cudaFuncAttributeMaxDynamicSharedMemorySize (lives with the module, as a CUfunction's does)
        self._max_dynamic: dict[str, int] = {}

    def compile(self, log_stream: Any = None) -> None:
        with self._lock:
            if self._lib is not None:
                return
            self._stats = _nvrtc_stats(self.code, self.name_expressions, self.options)
            try:
                built = build.build_module(self.code, self.name_expressions, self.options)
            except build.BuildError as exc:
                raise CompileException(str(exc)) from exc
            lib = ctypes.CDLL(str(built.path), mode=ctypes.RTLD_LOCAL)
            info = _Module.in_dll(lib, "pnc_module_info")
            if info.nkernels != len(self.name_expressions):
                raise HarnessError("internal: module kernel count mismatch")
            self._info = info
            self._lib = lib
            stats["modules"] += 1

    def get_function(self, name: str) -> RawKernel:
        if name not in self.name_expressions:
            raise CUDADriverError(
                f"CUDA_ERROR_NOT_FOUND: named symbol not found: {name!r} is not one of the module's name expressions"
            )
        self.compile()
        return RawKernel(self, self.name_expressions.index(name))


def _dim3(v: Any, what: str) -> tuple[int, int, int]:
    t = tuple(int(x) for x in v) if isinstance(v, (tuple, list)) else (int(v),)
    if not 1 <= len(t) <= 3:
        raise ValueError(f"{what} must have 1 to 3 dimensions, got {v!r}")
    return (*t, *(1,) * (3 - len(t)))  # type: ignore[return-value]


def _scalar(v: Any) -> np.generic:
    if isinstance(v, np.ndarray) and v.size == 1:  # CuPy passes size-one NumPy arrays by value
        return v.reshape(())[()]
    if isinstance(v, np.generic):
        return v
    if isinstance(v, bool):
        return np.bool_(v)
    if isinstance(v, int):
        return np.int64(v)
    if isinstance(v, float):
        return np.float64(v)
    raise TypeError(f"Unsupported type {type(v)}")


class RawKernel:
    """One kernel of a :class:`RawModule`; calling it launches it on the harness."""

    def __init__(self, module: RawModule, index: int) -> None:
        assert module._info is not None
        self.module = module
        self.index = index
        self.name = module.name_expressions[index]
        k = module._info.kernels[index]
        self._desc = k
        self._params = [k.params[i] for i in range(k.nparams)]
        st = module._stats.get(self.name, {"regs": 0, "smem": 0, "local": 0})
        self.num_regs = int(st["regs"])
        self.shared_size_bytes = int(st["smem"])
        self.local_size_bytes = int(st["local"])
        self.const_size_bytes = 0
        self.launch_bound = int(k.max_threads)

    @property
    def max_threads_per_block(self) -> int:
        by_regs = 1024
        if self.num_regs > 0:
            per_warp = -(-self.num_regs * 32 // 256) * 256
            by_regs = PROPS["regsPerBlock"] // per_warp * 32
        return min(self.launch_bound, by_regs, 1024)

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        default = PROPS["sharedMemPerBlock"] - self.shared_size_bytes
        return self.module._max_dynamic.get(self.name, default)

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value: int) -> None:
        limit = PROPS["sharedMemPerBlockOptin"] - self.shared_size_bytes
        if not 0 <= int(value) <= limit:
            raise CUDADriverError(
                f"CUDA_ERROR_INVALID_VALUE: invalid argument (cuFuncSetAttribute max dynamic shared memory {value} "
                f"for {self.name}: at most {limit} = sharedMemPerBlockOptin - {self.shared_size_bytes} static)"
            )
        self.module._max_dynamic[self.name] = int(value)

    # -- a launch
    def _check_geometry(self, grid: tuple[int, int, int], block: tuple[int, int, int], smem: int) -> None:
        threads = block[0] * block[1] * block[2]
        mx_dim, mx_grid = PROPS["maxThreadsDim"], PROPS["maxGridSize"]
        if min(*grid, *block) < 1 or any(b > m for b, m in zip(block, mx_dim)) or threads > 1024:
            raise CUDADriverError(f"CUDA_ERROR_INVALID_VALUE: invalid argument (block {block}, grid {grid})")
        if any(g > m for g, m in zip(grid, mx_grid)):
            raise CUDADriverError(f"CUDA_ERROR_INVALID_VALUE: invalid argument (grid {grid} exceeds {mx_grid})")
        if threads > self.max_threads_per_block:
            raise CUDADriverError(
                f"CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES: too many resources requested for launch ({threads} threads "
                f"per block; {self.name} allows {self.max_threads_per_block}: __launch_bounds__({self.launch_bound}), "
                f"{self.num_regs} registers)"
            )
        if smem < 0 or smem > self.max_dynamic_shared_size_bytes:
            raise CUDADriverError(
                f"CUDA_ERROR_INVALID_VALUE: invalid argument ({smem} bytes of dynamic shared memory for {self.name}, "
                f"whose limit is {self.max_dynamic_shared_size_bytes}: {self.shared_size_bytes} bytes are static and "
                f"static + dynamic beyond {PROPS['sharedMemPerBlock']} bytes needs the "
                "max_dynamic_shared_size_bytes attribute raised first)"
            )

    def _pack(self, args: tuple[Any, ...]) -> tuple[list[Any], dict[int, tuple[np.ndarray, bool]]]:
        """ctypes storage for each argument, and the device allocations they point into (-> writable?)."""
        lib = build.runtime()
        if len(args) != len(self._params):
            raise HarnessError(
                f"launch of {self.name} with {len(args)} arguments; its signature has {len(self._params)} parameters"
            )
        store: list[Any] = []
        allocs: dict[int, tuple[np.ndarray, bool]] = {}
        for i, (a, p) in enumerate(zip(args, self._params)):
            ptype = (p.type or b"?").decode()
            if p.kind == POINTER:
                addr = 0
                if isinstance(a, ndarray):
                    names = _C_TYPES.get(a.dtype.name, set())
                    if ptype not in ("void", "?") and ptype not in names:
                        raise HarnessError(
                            f"argument {i} of {self.name}: a {a.dtype} array passed for a "
                            f"{'const ' if p.is_const else ''}{ptype}* parameter"
                        )
                    addr = a.data.ptr
                elif a is None:
                    addr = 0
                elif isinstance(a, (np.integer, int)) and not isinstance(a, bool) and np.asarray(a).itemsize == 8:
                    addr = int(a) & (2**64 - 1)
                else:
                    raise HarnessError(f"argument {i} of {self.name}: a {type(a).__name__} for a pointer parameter")
                if addr:
                    data = ctypes.c_void_p()
                    size = lib.pnc_find_alloc(ctypes.c_void_p(addr), ctypes.byref(data))
                    if size == 0 and not (isinstance(a, ndarray) and a.size == 0):
                        raise HarnessError(f"argument {i} of {self.name}: address {addr:#x} is not device memory")
                    if data.value:
                        whole = np.ctypeslib.as_array((ctypes.c_uint8 * max(size, 1)).from_address(data.value))[:size]
                        w = allocs.get(data.value, (whole, False))[1]
                        allocs[data.value] = (whole, w or not p.is_const)
                store.append(ctypes.c_uint64(addr))
                continue
            if isinstance(a, ndarray) or a is None:
                raise HarnessError(f"argument {i} of {self.name}: {type(a).__name__} passed for a {ptype} parameter")
            s = _scalar(a)
            if s.dtype.itemsize != p.size:
                raise HarnessError(
                    f"argument {i} of {self.name}: a {s.dtype} scalar ({s.dtype.itemsize} bytes) passed for a "
                    f"{ptype} parameter ({p.size} bytes); CuPy would pass its bytes and shift every later parameter"
                )
            is_float = s.dtype.kind == "f"
            if is_float != (p.kind == FLOAT):
                raise HarnessError(f"argument {i} of {self.name}: a {s.dtype} scalar passed for a {ptype} parameter")
            buf = (ctypes.c_uint8 * p.size).from_buffer_copy(np.asarray(s).tobytes())
            store.append(buf)
        return store, allocs

    def __call__(
        self,
        grid: Any,
        block: Any,
        args: tuple[Any, ...],
        *,
        shared_mem: int = 0,
        stream: Any = None,
        enable_cooperative_groups: bool = False,
    ) -> None:
        g, b = _dim3(grid, "grid"), _dim3(block, "block")
        smem = int(shared_mem)
        self._check_geometry(g, b, smem)
        store, allocs = self._pack(tuple(args))
        lib = build.runtime()
        mod = self.module
        assert mod._lib is not None and mod._info is not None
        slots = (ctypes.c_void_p * max(len(store), 1))(*[ctypes.addressof(s) for s in store])
        grid_c = (ctypes.c_uint * 3)(*g)
        block_c = (ctypes.c_uint * 3)(*b)
        writable = {k: v[0] for k, v in allocs.items() if v[1]}
        readonly = {k: v[0] for k, v in allocs.items() if not v[1]}
        before_w = {k: v.copy() for k, v in writable.items()}
        before_r = {k: v.copy() for k, v in readonly.items()}
        err = ctypes.create_string_buffer(8192)
        results: dict[int, np.ndarray] = {}
        for n, sched in enumerate(SCHEDULES):
            if n:
                for k, v in writable.items():
                    v[...] = before_w[k]
            rc = lib.pnc_launch(
                ctypes.c_void_p(mod._lib._handle),
                ctypes.byref(mod._info),
                self.index,
                grid_c,
                block_c,
                smem,
                slots,
                sched,
                float(LAUNCH_TIMEOUT),
                err,
                len(err),
            )
            where = f"{self.name} grid {g} block {b} shared_mem {smem}, {('forward', 'reverse')[sched]} schedule"
            if rc != 0:
                raise HarnessError(f"{where}: {err.value.decode(errors='replace')}")
            if lib.pnc_check_canaries(err, len(err)) != 0:
                raise HarnessError(f"{where}: {err.value.decode(errors='replace')}")
            if n == 0 and len(SCHEDULES) > 1:
                results = {k: v.copy() for k, v in writable.items()}
        for k, v in writable.items():
            if k in results and not np.array_equal(results[k], v):
                diff = np.flatnonzero(results[k] != v)
                raise HarnessError(
                    f"race in {self.name} grid {g} block {b}: the forward and the reverse thread schedule write "
                    f"different bytes ({diff.size} bytes differ, first at offset {int(diff[0])} of a "
                    f"{v.size}-byte buffer): the result depends on the order of unsynchronized threads"
                )
        for k, v in readonly.items():
            if not np.array_equal(before_r[k], v):
                diff = np.flatnonzero(before_r[k] != v)
                raise HarnessError(
                    f"{self.name} changed a buffer it receives only through const pointers "
                    f"({diff.size} bytes, first at offset {int(diff[0])})"
                )
        stats["launches"] += 1


# ---------------------------------------------------------------------------
# cupy.cuda


class _Device:
    def __init__(self, device: int | None = 0) -> None:
        self.id = 0 if device is None else int(device)
        if self.id != 0:
            raise CUDADriverError("CUDA_ERROR_INVALID_DEVICE: the harness models one device")

    def __enter__(self) -> _Device:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def use(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    @property
    def compute_capability(self) -> str:
        return f"{PROPS['major']}{PROPS['minor']}"


def _get_device_properties(dev: int) -> dict[str, Any]:
    if int(dev) != 0:
        raise CUDADriverError("cudaErrorInvalidDevice: the harness models one device")
    return dict(PROPS)


runtime_mod = types.ModuleType("cupy.cuda.runtime")
runtime_mod.getDevice = lambda: 0  # type: ignore[attr-defined]
runtime_mod.setDevice = lambda d: None  # type: ignore[attr-defined]
runtime_mod.getDeviceCount = lambda: 1  # type: ignore[attr-defined]
runtime_mod.getDeviceProperties = _get_device_properties  # type: ignore[attr-defined]
runtime_mod.deviceSynchronize = lambda: None  # type: ignore[attr-defined]
runtime_mod.is_hip = False  # type: ignore[attr-defined]

driver_mod = types.ModuleType("cupy.cuda.driver")
driver_mod.CUDADriverError = CUDADriverError  # type: ignore[attr-defined]

compiler_mod = types.ModuleType("cupy.cuda.compiler")
compiler_mod.CompileException = CompileException  # type: ignore[attr-defined]

cuda = types.ModuleType("cupy.cuda")
cuda.runtime = runtime_mod  # type: ignore[attr-defined]
cuda.driver = driver_mod  # type: ignore[attr-defined]
cuda.compiler = compiler_mod  # type: ignore[attr-defined]
cuda.Device = _Device  # type: ignore[attr-defined]
cuda.is_available = is_available  # type: ignore[attr-defined]


def module() -> types.ModuleType:
    """A ``cupy`` module object exposing this stand-in (what :func:`tests.cuda_cpu.install` puts in sys.modules)."""
    m = types.ModuleType("cupy", "CuPy stand-in of pynorm's CPU execution harness (tests/cuda_cpu)")
    names = [
        "ndarray", "empty", "full", "zeros", "ones", "empty_like", "zeros_like", "ones_like", "full_like",
        "array", "asarray", "ascontiguousarray", "asnumpy", "arange", "isfinite", "broadcast_to", "may_share_memory",
        "shares_memory", "where", "tril", "moveaxis", "stack", "flatnonzero",
        "is_available", "get_default_memory_pool", "get_default_pinned_memory_pool", "RawModule", "RawKernel",
        "HarnessError",
    ]  # fmt: skip
    for n in names:
        setattr(m, n, globals()[n])
    for n in ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
              "uint64", "bool_", "dtype", "nan", "inf"):  # fmt: skip
        setattr(m, n, getattr(np, n))
    # NumPy's ufuncs act on the stand-in through __array_ufunc__
    for n in ("exp", "log", "sqrt", "tanh", "abs", "frexp", "ldexp"):
        setattr(m, n, getattr(np, n))
    m.cuda = cuda  # type: ignore[attr-defined]
    m.__version__ = "14.0.0+cuda-cpu-harness"  # type: ignore[attr-defined]
    m.__file__ = __file__
    m._harness = sys.modules[__name__]  # type: ignore[attr-defined]
    return m
