"""Loading the CUDA C sources of the CuPy backend, shared by the runtime and the compile check.

The kernels live in ``kernels/*.cu`` (package data, read with :mod:`importlib.resources`).
:func:`assemble` returns a file's text with its local ``#include "x.cuh"`` lines replaced by
the header's text, framed by ``#line`` directives so that compiler messages name the real
file and line. Templates are instantiated through NVRTC *name expressions*
(``pynorm::stats_fwd<__nv_bfloat16, float, pynorm::Centered, pynorm::Vector<true>, pynorm::Plain>``), never by
string substitution.

Importing this module is cheap and does not import CuPy; :func:`get_kernel` does, and
compiles (through NVRTC with :func:`compile_options`, cached on disk: :class:`Module`) one module per
source file and type combination on first use, cached per device.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterable
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

__all__ = [
    "CUDA_TYPES",
    "FP_OPTIONS",
    "KERNELS",
    "TYPE_NAMES",
    "Kernel",
    "Module",
    "assemble",
    "assemble_text",
    "cache_dir",
    "compile_options",
    "cuda_include_dir",
    "defines",
    "get_kernel",
    "instantiations",
    "kernel_dir",
    "name_expression",
    "warm_up",
]

KERNEL_PACKAGE = "pynorm.backends.cupy.kernels"

#: numpy dtype name -> CUDA C type the kernels are instantiated for.
TYPE_NAMES = {"float16": "__half", "bfloat16": "__nv_bfloat16", "float32": "float", "float64": "double"}
CUDA_TYPES = tuple(TYPE_NAMES.values())
#: accumulation types (the ``A`` of reduce.cu)
ACC_TYPES = ("float", "double")

#: kernel templates of each source file. The family kernels take <T, W, variant policies...>
#: (stats.cu: the statistic, affine and prologue policies of each op of the family; elementwise.cu:
#: the function policy); quantize.cu's take one type (quant_int8<W>: the parameters', quant_float<T>:
#: the normalized input's), intype.cu's <T> (casting="none" of LayerNorm/RMSNorm), reduce.cu's <O, A>,
#: cast.cu's <S, D>, column.cu's <T, A> (A: the element-wise math type; the reductions are in double).
KERNELS: dict[str, tuple[str, ...]] = {
    "stats.cu": ("stats_fwd", "stats_bwd", "stats_bwd_stats", "stats_bwd_apply"),
    "elementwise.cu": ("ew_fwd", "ew_bwd"),
    "quantize.cu": ("quant_int8", "quant_float", "quant_dequant", "quant_mask", "quant_fp_rows", "quant_fp_amax"),
    "column.cu": ("col_stats", "col_merge", "col_apply", "col_bwd_sums", "col_sum_chunks", "col_dx", "col_scale"),
    "intype.cu": ("intype_fwd", "intype_bwd", "intype_params"),
    "reduce.cu": ("reduce_partials",),
    "cast.cu": ("cast_values",),
}
#: kernel family -> the source file implementing it
FAMILY_FILES = {"stats": "stats.cu", "elementwise": "elementwise.cu", "quantize": "quantize.cu", "column": "column.cu"}

#: the C++ policies of each variant axis value are in their records (:mod:`pynorm.ops.families`: ``cuda``)


def supports(spec: Any) -> bool:
    """Whether the kernels implement ``spec``'s family and variant: every choice's record names a policy here (a
    statistic's also says it normalizes the row: the kernels keep the sums of ``xhat`` terms -- the backward's
    ``sum(u)``, the parameter-gradient partials -- in the accumulation type, which holds them only for ``xhat =
    O(1)``)."""
    from ...ops import families

    v = spec.variant
    if spec.family == "stats":
        st = families.STATISTICS.get(v.statistic)
        pro = families.PROLOGUES.get(v.prologue)
        aff = families.AFFINES.get(v.affine)
        return (
            st is not None and bool(st.cuda) and st.normalizes and pro is not None and aff is not None
            and bool(aff.cuda) and pro.epilogue == v.epilogue
        )  # fmt: skip
    if spec.family == "elementwise":
        fn = families.FUNCTIONS.get(v.function)
        return fn is not None and bool(fn.cuda)
    if spec.family == "quantize":
        return v.statistic in families.QUANTIZE_STATISTICS
    if spec.family == "column":
        col = families.COLUMN_STATISTICS.get(v.statistic)
        return col is not None and col.cuda == FAMILY_FILES["column"]
    return False


def acc_of(t: str, w: str) -> str:
    """The accumulation type ``acc_t<T, W>``."""
    return "double" if "double" in (t, w) else "float"


def param_types(t: str) -> tuple[str, ...]:
    """The parameter types ``W`` the kernels are instantiated for with ``T = t``: ``t`` itself and the
    accumulation types at least as wide (parameters of any other dtype are cast to the accumulation
    type first, exactly: every parameter is converted to it anyway)."""
    return tuple(dict.fromkeys(w for w in (t, "float", "double") if w != "float" or t != "double"))


def residual_types(t: str, w: str) -> tuple[tuple[str, str], ...]:
    """``(Hd, Rs)`` pairs of ``Residual<Hd, Rs>`` with ``T = t, W = w``: the pre-norm sum in x's type, the
    accumulation type A or float (an fp32 residual stream beside float64 parameters or x), the residual
    read (and its gradient written) in x's type, h's type or A."""
    a = acc_of(t, w)
    pairs = [(h, r) for h in (t, a, "float") for r in (t, h, a)]
    return tuple(dict.fromkeys(pairs))


def variant_args(spec: Any, h: str | None = None, r: str | None = None) -> tuple[str, ...]:
    """The template arguments after the dtypes that implement ``spec`` (an :class:`pynorm.ops.OpSpec`): its
    choices' policies (:attr:`pynorm.ops.families.Statistic.cuda`, ...); ``h``/``r``: the ``(Hd, Rs)`` types of
    an op with a residual prologue."""
    from ...ops import families

    if not supports(spec):
        raise ValueError(f"op {spec.name!r}: the cupy backend has no kernels for {spec.family} {spec.variant}")
    if spec.family == "elementwise":
        return (families.function_of(spec).cuda,)
    stat = families.statistic_of(spec).cuda
    affine = families.affine_of(spec).cuda_policy(has_bias=len(spec.params) > 1)
    return (stat, affine, families.prologue_of(spec).cuda_policy(h, r))


def spec_instantiations(spec: Any) -> list[tuple[str, ...]]:
    """Every template-argument tuple (dtypes, then policies) the runtime may request for ``spec``."""
    out: list[tuple[str, ...]] = []
    if spec.family == "quantize":  # one type per module: quant_int8<W> and quant_float<T> for each float type
        return [(t,) for t in CUDA_TYPES] if supports(spec) else []
    if spec.family == "column":  # <T, A>: A the element-wise math type, acc_t of x and the (C,) arrays
        pairs: list[tuple[str, ...]] = [(t, a) for t in CUDA_TYPES for a in ACC_TYPES if a == "double" or t != "double"]
        return pairs if supports(spec) else []
    for t in CUDA_TYPES:
        for w in param_types(t):
            if spec.family == "stats" and _residual(spec):
                out.extend((t, w, *variant_args(spec, h, r)) for h, r in residual_types(t, w))
            else:
                out.append((t, w, *variant_args(spec)))
    return out


def _residual(spec: Any) -> bool:
    from ...ops import families

    return families.prologue_of(spec).residual


def family_variants(file: str) -> list[tuple[str, ...]]:
    """Every variant (template arguments after the dtypes) the op specs declare for ``file``."""
    out: list[tuple[str, ...]] = []
    for types in (tt for group in _family_groups(file) for tt in group):
        if types[2:] not in out:
            out.append(types[2:])
    return out


def _family_groups(file: str) -> list[list[tuple[str, ...]]]:
    """The template-argument tuples of ``file``, one group per op spec (ops sharing a variant share it)."""
    from ...ops import SPECS

    groups: list[list[tuple[str, ...]]] = []
    seen: set[tuple[str, ...]] = set()
    for spec in SPECS.values():
        if FAMILY_FILES.get(spec.family) == file and supports(spec):
            group = [tt for tt in spec_instantiations(spec) if tt not in seen]
            seen.update(group)
            if group:
                groups.append(group)
    return groups


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')
_DEFINE = re.compile(r"^\s*#\s*define\s+(PYNORM_\w+)\s+(-?\d+)\b", re.MULTILINE)


def kernel_dir() -> Any:
    """The ``kernels`` package data directory (a Traversable; a real path in normal installs)."""
    return resources.files(__package__ or "pynorm.backends.cupy").joinpath("kernels")


def _read(name: str, directory: str | os.PathLike[str] | None) -> tuple[str, str]:
    if directory is not None:
        p = Path(directory) / name
        return p.read_text(encoding="utf-8"), p.resolve().as_posix()
    f = kernel_dir().joinpath(name)
    label = f.as_posix() if isinstance(f, Path) else f"{KERNEL_PACKAGE.replace('.', '/')}/{name}"
    return f.read_text(encoding="utf-8"), label


def _line(n: int, label: str) -> str:
    return f'#line {n} "{label.replace(chr(92), "/").replace(chr(34), "")}"'


def assemble(name: str, directory: str | os.PathLike[str] | None = None) -> str:
    """Source of kernel file ``name`` with local includes pasted in, framed by ``#line`` directives.

    ``directory`` replaces the package's ``kernels`` directory (the compile check uses it to
    check modified copies).
    """
    text, label = _read(name, directory)
    return assemble_text(text, label, directory)


def assemble_text(text: str, label: str, directory: str | os.PathLike[str] | None = None) -> str:
    """Like :func:`assemble` for source ``text`` (reported as ``label``), resolving its
    ``#include "x.cuh"`` lines against the kernels directory."""
    seen: set[str] = set()

    def expand(text: str, label: str) -> list[str]:
        out = [_line(1, label)]
        for lineno, line in enumerate(text.splitlines(), start=1):
            m = _INCLUDE.match(line)
            if m and m.group(1) not in seen:
                seen.add(m.group(1))
                out.extend(expand(*_read(m.group(1), directory)))
                out.append(_line(lineno + 1, label))
            elif m:
                out.append("")  # already pasted (the headers use #pragma once anyway)
            else:
                out.append(line)
        return out

    return "\n".join(expand(text, label)) + "\n"


def defines(directory: str | os.PathLike[str] | None = None) -> dict[str, int]:
    """The ``#define PYNORM_<NAME> <int>`` constants of ``common.cuh`` (block sizes, register caches)."""
    text, _ = _read("common.cuh", directory)
    return {k: int(v) for k, v in _DEFINE.findall(text)}


def name_expression(kernel: str, *types: str) -> str:
    """``pynorm::kernel<T1, T2>``: the name expression of one template instantiation."""
    return f"pynorm::{kernel}<{', '.join(types)}>"


#: kernels instantiated only for some first template arguments: ``quant_int8<W>`` reads its parameters in an
#: accumulation type (the host casts 16-bit ones to float32, exactly)
KERNEL_TYPES: dict[str, tuple[str, ...]] = {"quant_int8": ACC_TYPES}


def module_names(file: str, types: tuple[str, ...]) -> tuple[str, ...]:
    """Name expressions compiled together in one runtime module: every kernel of ``file`` for ``types``
    (the dtypes and, for a family file, the variant's policies; :data:`KERNEL_TYPES` restricts some)."""
    return tuple(name_expression(k, *types) for k in KERNELS[file] if types[0] in KERNEL_TYPES.get(k, (types[0],)))


def type_pairs(file: str) -> list[tuple[str, ...]]:
    """Every template-argument combination a file is instantiated for: (output, accumulator) pairs for
    reduce.cu, (source, destination) pairs for cast.cu; for a family file the (x, parameter) dtypes and
    policies of every op the specs declare."""
    if file == "reduce.cu":
        return [(o, a) for o in CUDA_TYPES for a in ACC_TYPES]
    if file == "cast.cu":
        return [(a, b) for a in CUDA_TYPES for b in CUDA_TYPES if a != b]
    if file == "intype.cu":
        return [(t,) for t in CUDA_TYPES]
    return [tt for group in _family_groups(file) for tt in group]


def instantiation_groups(file: str) -> list[list[str]]:
    """The name expressions of ``file`` in groups that compile independently (one per op variant), so the
    compile check can spread them over cores."""
    if file in ("reduce.cu", "cast.cu", "intype.cu"):
        return [instantiations(file)]
    return [[n for tt in group for n in module_names(file, tt)] for group in _family_groups(file)]


def instantiations(file: str) -> list[str]:
    """All name expressions of ``file``: what the compile check builds and the runtime may request."""
    return [n for pair in type_pairs(file) for n in module_names(file, pair)]


@cache
def cuda_include_dir() -> str | None:
    """Directory holding ``cuda_fp16.h`` / ``cuda_bf16.h``: pip's nvidia-cuda-runtime or a CUDA toolkit."""
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        d = find_nvidia_header_directory("cudart")
        if d and os.path.isfile(os.path.join(d, "cuda_fp16.h")):
            return str(d)
    except Exception:  # pathfinder missing or too old
        pass
    import importlib.util

    for pkg in ("nvidia.cu13", "nvidia.cuda_runtime", "nvidia.cu12"):
        try:
            spec = importlib.util.find_spec(pkg)
        except (ImportError, ValueError):
            continue
        for loc in (spec.submodule_search_locations or []) if spec else []:
            d = os.path.join(loc, "include")
            if os.path.isfile(os.path.join(d, "cuda_fp16.h")):
                return d
    for env in ("CUDA_PATH", "CUDA_HOME"):
        root = os.environ.get(env)
        if root and os.path.isfile(os.path.join(root, "include", "cuda_fp16.h")):
            return os.path.join(root, "include")
    return None


#: the floating-point model of every kernel, spelled out (NVRTC's defaults, but explicit: the numerical contract
#: depends on them): subnormal float32 values kept (a float32 rstd of a row of magnitude ~1e38 is subnormal; flushed
#: to zero it made y, dx and the weight's gradient wrong), IEEE-rounded division and square root, fma contraction
FP_OPTIONS = ("--ftz=false", "--prec-div=true", "--prec-sqrt=true", "--fmad=true")


def compile_options(include_dirs: Iterable[str] = ()) -> tuple[str, ...]:
    """NVRTC options shared by the runtime and the compile check (:data:`FP_OPTIONS`: no flush to zero, IEEE
    division and sqrt, no fast math)."""
    opts = ["--std=c++17", *FP_OPTIONS]
    inc = cuda_include_dir()
    for d in (*include_dirs, *([inc] if inc else [])):
        opts.append(f"-I{d}")
    return tuple(opts)


# ---------------------------------------------------------------------------
# runtime (CuPy)

_lock = threading.Lock()
_modules: dict[tuple[int, str, tuple[str, ...]], Module] = {}
#: (device, file, kernel, types) -> its kernel object, loaded
_kernels: dict[tuple[int, str, str, tuple[str, ...]], Any] = {}


class Module:
    """Kernels compiled from CUDA C source by NVRTC with :func:`compile_options`, loaded on the current device.

    Not :class:`cupy.RawModule(code=...) <cupy.RawModule>`: CuPy appends ``-ftz=true`` to every NVRTC compile it
    caches (``cupy/cuda/compiler.py``, ``_compile_with_cache_cuda``), and NVRTC takes the last of two ``-ftz``
    options, so float32 subnormals would be flushed to zero whatever :data:`FP_OPTIONS` say. This compiles with
    :func:`cupy.cuda.compiler.compile_using_nvrtc` (which adds only the architecture), caches the binary and the
    name expressions' lowered names in :func:`cache_dir`, and loads the binary with ``cupy.RawModule(path=...)``.
    Compiles on first use (:meth:`compile` or :meth:`get_function`); thread-safe.
    On the CPU execution harness (``cupy._harness``) the harness's own ``RawModule(code=...)`` is used.
    """

    def __init__(self, code: str, name_expressions: Iterable[str]) -> None:
        self.code = code
        self.names = tuple(name_expressions)
        self._raw: Any = None
        self._lowered: dict[str, str] = {}
        self._lock = threading.Lock()

    def compile(self) -> None:
        with self._lock:
            if self._raw is None:
                self._raw, self._lowered = _load(self.code, self.names)

    def get_function(self, name_expression: str) -> Any:
        """The :class:`cupy.RawKernel` of one of the module's name expressions."""
        self.compile()
        return self._raw.get_function(self._lowered.get(name_expression, name_expression))


def cache_dir() -> Path:
    """Where compiled kernels are kept: ``$PYNORM_CUDA_CACHE_DIR``, else ``$XDG_CACHE_HOME/pynorm/cuda``
    (``~/.cache/pynorm/cuda``)."""
    env = os.environ.get("PYNORM_CUDA_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pynorm" / "cuda"


def _load(code: str, names: tuple[str, ...]) -> tuple[Any, dict[str, str]]:
    """Compile (or find in the cache) and load ``code`` instantiating ``names``: (the module, lowered names)."""
    import hashlib
    import json

    import cupy

    if getattr(cupy, "_harness", None) is not None:
        return cupy.RawModule(code=code, options=compile_options(), name_expressions=names), {}
    from cupy.cuda import compiler

    options = compile_options()
    arch = cupy.cuda.Device().compute_capability
    key = "\0".join((code, *options, arch, repr(cupy.cuda.nvrtc.getVersion()), cupy.__version__, *sorted(names)))
    digest = hashlib.sha256(key.encode()).hexdigest()[:40]
    directory = cache_dir()
    binary, table = directory / f"{digest}.bin", directory / f"{digest}.json"
    try:
        lowered = json.loads(table.read_text())
        if binary.is_file() and set(lowered) == set(names):
            return cupy.RawModule(path=str(binary)), lowered
    except (OSError, ValueError):
        pass
    obj, mapping = compiler.compile_using_nvrtc(code, options, None, "pynorm.cu", list(names), None, True)
    lowered = {n: mapping[n] for n in names}
    data = obj if isinstance(obj, bytes) else obj.encode()
    try:  # write then rename: a concurrent reader sees a whole file or none
        directory.mkdir(parents=True, exist_ok=True)
        for path, content in ((binary, data), (table, json.dumps(lowered).encode())):
            tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_bytes(content)
            os.replace(tmp, path)
        return cupy.RawModule(path=str(binary)), lowered
    except OSError:  # no writable cache: load from a private temporary file, before it goes
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / f"{digest}.bin"
            path.write_bytes(data)
            mod = cupy.RawModule(path=str(path))
            for n in lowered.values():
                mod.get_function(n)  # loaded (and the kernel handles kept) while the file exists
            return mod, lowered


def _module(file: str, types: tuple[str, ...]) -> Module:
    """The (uncompiled until first use) :class:`Module` of ``file`` for ``types`` on the current device."""
    import cupy

    key = (cupy.cuda.runtime.getDevice(), file, module_names(file, types))
    with _lock:
        mod = _modules.get(key)
        if mod is None:
            mod = Module(assemble(file), key[2])
            _modules[key] = mod
    return mod


def forget() -> None:
    """Drop every module and kernel loaded so far (tests that swap the kernel sources; the disk cache, keyed by the
    source text, stays valid)."""
    with _lock:
        _modules.clear()
        _kernels.clear()


def get_kernel(file: str, kernel: str, types: tuple[str, ...]) -> Any:
    """The :class:`cupy.RawKernel` ``pynorm::kernel<types>`` of ``file`` on the current device.

    The first request for a (device, file, types) compiles that file's kernels for those types
    in one :class:`Module` (its binary cached on disk); later requests reuse it.
    """
    import cupy

    key = (cupy.cuda.runtime.getDevice(), file, kernel, types)
    k = _kernels.get(key)
    if k is None:  # (a RawKernel per request would cost ~10 us a launch)
        k = _kernels[key] = Kernel(_module(file, types).get_function(name_expression(kernel, *types)))
    return k


class Kernel:
    """A loaded kernel, its attributes read once: a launch needs no driver query and no lookup of the function.

    ``num_regs``, ``shared_size_bytes`` and ``max_dynamic_shared_size_bytes`` (settable: the driver's attribute is
    set, then read back) as :class:`cupy.RawKernel`'s; calling it launches ``fn`` (CuPy's driver function: a
    :class:`cupy.RawKernel` looks it up, through a memoized function of all its arguments, at every access)."""

    __slots__ = ("_max_dynamic", "fn", "name", "num_regs", "raw", "shared_size_bytes")

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.fn = getattr(raw, "kernel", raw)
        self.name = str(getattr(raw, "name", "?"))
        self.num_regs = int(raw.num_regs)
        self.shared_size_bytes = int(raw.shared_size_bytes)
        self._max_dynamic = int(raw.max_dynamic_shared_size_bytes)

    @property
    def max_dynamic_shared_size_bytes(self) -> int:
        return self._max_dynamic

    @max_dynamic_shared_size_bytes.setter
    def max_dynamic_shared_size_bytes(self, value: int) -> None:
        self.raw.max_dynamic_shared_size_bytes = value
        self._max_dynamic = int(self.raw.max_dynamic_shared_size_bytes)

    def __call__(
        self, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...], shared_mem: int = 0
    ) -> None:
        self.fn(grid, block, args, shared_mem=shared_mem)


def warm_up(requests: Iterable[tuple[str, tuple[str, ...]]] | None = None, jobs: int | None = None) -> int:
    """Compile runtime modules ahead of use, in parallel threads (NVRTC releases the GIL).

    ``requests``: ``(file, types)`` pairs; default every file and type combination. Returns
    how many modules are ready. Optional and best effort: a module that fails here is
    compiled again (and its error raised) by :func:`get_kernel` when first used.
    """
    import cupy

    reqs = list(requests) if requests is not None else [(f, p) for f in KERNELS for p in type_pairs(f)]
    dev = cupy.cuda.runtime.getDevice()

    def one(req: tuple[str, tuple[str, ...]]) -> bool:
        try:
            with cupy.cuda.Device(dev):
                _module(*req).compile()
            return True
        except Exception:
            with _lock:
                _modules.pop((dev, req[0], module_names(*req)), None)
            return False

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=max(1, jobs or os.cpu_count() or 1)) as ex:
        return sum(ex.map(one, reqs))
