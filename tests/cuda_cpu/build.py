"""Compiling CUDA kernel sources for the CPU execution harness (test-only code).

:func:`runtime` builds ``runtime.cpp`` (fibers, scheduler, fenced device memory) once
per set of harness sources and loads it with ``RTLD_GLOBAL``. :func:`build_module`
turns the source text a :class:`cupy.RawModule` receives, unchanged, into a shared
object: the generated translation unit includes ``include/cuda_cpu.h`` (CUDA's
built-ins), then the source, then registration code for each name expression (its
parameter list, read from the instantiated function's type, and the
``__launch_bounds__`` read from the source). Objects are cached on disk by a hash of
everything that goes into them (``PYNORM_CUDA_CPU_CACHE``, default a directory under
the system's temporary directory), so a test session compiles each module once.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
INCLUDE = HERE / "include"
#: the largest dynamic shared memory a block may opt into on the devices modelled (sm_90: 227 KiB)
MAX_DYNAMIC_SMEM = 232448

CXX = os.environ.get("CXX", "g++")
#: undefined behaviour that is also a bug on a GPU, trapped (SIGILL) and reported by the launch
SANITIZE = (
    "-fsanitize=alignment,null,bounds,vla-bound,shift,signed-integer-overflow,integer-divide-by-zero,"
    "float-cast-overflow",
    "-fsanitize-undefined-trap-on-error",
)
CXXFLAGS = (
    "-std=c++17",
    "-O2",
    "-fPIC",
    "-ffp-contract=off",  # no FMA contraction: the GPU's contractions are not modelled (docs/cuda_cpu.md)
    "-fno-fast-math",
    "-fno-strict-aliasing",
    # shared memory is thread_local: without these GCC may fold a __shared__ array the translation
    # unit never writes to its initial zeros (a NaN-poisoned read on the harness, garbage on a GPU)
    "-fno-ipa-reference",
    "-fno-ipa-reference-addressable",
    "-fvisibility=hidden",
    "-Wall",
    "-Wextra",
    "-Wno-unknown-pragmas",  # #pragma unroll
    "-Wno-unused-parameter",
    "-Wno-unused-function",
    "-Werror",
)


class BuildError(RuntimeError):
    """The host compiler rejected a kernel source (the message holds its diagnostics)."""


def compiler_unavailable_reason() -> str | None:
    """None when a C++17 compiler is here, else why the harness cannot run."""
    path = shutil.which(CXX)
    if path is None:
        return f"no C++ compiler ({CXX!r} not found on PATH; set CXX)"
    return None


def cache_dir() -> Path:
    d = Path(os.environ.get("PYNORM_CUDA_CPU_CACHE") or Path(tempfile.gettempdir()) / "pynorm-cuda-cpu")
    d.mkdir(parents=True, exist_ok=True)
    return d


def _compiler_id() -> str:
    try:
        out = subprocess.run([CXX, "--version"], capture_output=True, text=True, timeout=60).stdout
    except OSError:
        out = CXX
    return out.splitlines()[0] if out else CXX


def _harness_hash() -> str:
    h = hashlib.sha256()
    for p in sorted([*INCLUDE.glob("*.h"), HERE / "runtime.cpp", Path(__file__)]):
        h.update(p.name.encode())
        h.update(p.read_bytes())
    h.update(_compiler_id().encode())
    return h.hexdigest()[:16]


def _compile(source: str, out: Path, extra: tuple[str, ...] = ()) -> None:
    """Compile ``source`` into the shared object ``out`` (atomically: concurrent builds are safe)."""
    fd, tmp_src = tempfile.mkstemp(suffix=".cpp", dir=out.parent)
    with os.fdopen(fd, "w") as f:
        f.write(source)
    tmp_out = f"{out}.{os.getpid()}.{threading.get_ident()}.tmp"
    cmd = [CXX, *CXXFLAGS, f"-I{INCLUDE}", "-shared", "-o", tmp_out, tmp_src, *extra]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise BuildError(f"host compilation failed ({' '.join(cmd)}):\n{proc.stderr[-20000:]}")
        os.replace(tmp_out, out)
    finally:
        os.unlink(tmp_src)
        if os.path.exists(tmp_out):
            os.unlink(tmp_out)


_runtime_lock = threading.Lock()
_runtime: ctypes.CDLL | None = None


def runtime() -> ctypes.CDLL:
    """The harness runtime (built and loaded once per process)."""
    global _runtime
    with _runtime_lock:
        if _runtime is not None:
            return _runtime
        out = cache_dir() / f"libpnc_runtime-{_harness_hash()}.so"
        if not out.exists():
            _compile((HERE / "runtime.cpp").read_text(), out, ("-fvisibility=default", "-ldl", f"-I{HERE}"))
        lib = ctypes.CDLL(str(out), mode=ctypes.RTLD_GLOBAL)
        c = ctypes
        lib.pnc_launch.argtypes = [
            c.c_void_p, c.c_void_p, c.c_int, c.POINTER(c.c_uint), c.POINTER(c.c_uint), c.c_size_t,
            c.POINTER(c.c_void_p), c.c_int, c.c_double, c.c_char_p, c.c_size_t,
        ]  # fmt: skip
        lib.pnc_launch.restype = c.c_int
        lib.pnc_alloc.argtypes = [c.c_size_t]
        lib.pnc_alloc.restype = c.c_void_p
        lib.pnc_free.argtypes = [c.c_void_p]
        lib.pnc_free.restype = None
        lib.pnc_find_alloc.argtypes = [c.c_void_p, c.POINTER(c.c_void_p)]
        lib.pnc_find_alloc.restype = c.c_size_t
        lib.pnc_check_canaries.argtypes = [c.c_char_p, c.c_size_t]
        lib.pnc_check_canaries.restype = c.c_int
        lib.pnc_live_allocations.argtypes = []
        lib.pnc_live_allocations.restype = c.c_size_t
        for name, a, b in (
            ("pnc_f32_to_f16", c.c_float, c.c_uint16),
            ("pnc_f16_to_f32", c.c_uint16, c.c_float),
            ("pnc_f32_to_bf16", c.c_float, c.c_uint16),
            ("pnc_bf16_to_f32", c.c_uint16, c.c_float),
            ("pnc_f64_to_f16", c.c_double, c.c_uint16),
            ("pnc_f64_to_bf16", c.c_double, c.c_uint16),
        ):
            fn = getattr(lib, name)
            fn.argtypes = [c.POINTER(a), c.POINTER(b), c.c_size_t]
            fn.restype = None
        _runtime = lib
        return lib


# ---------------------------------------------------------------------------
# reading the source (never changing it)

_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.DOTALL)
_STRINGS = re.compile(r'"(?:\\.|[^"\\\n])*"')


def _strip(code: str) -> str:
    """``code`` without comments and with string literals blanked (offsets of other text kept)."""

    def blank(m: re.Match[str]) -> str:
        return re.sub(r"[^\n]", " ", m.group(0))

    code = _COMMENTS.sub(blank, code)
    return _STRINGS.sub(blank, code)


def _balanced(text: str, start: int) -> int:
    """Index just past the parenthesis matching the one at ``text[start]``."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i + 1
    raise BuildError("unbalanced parentheses in a __launch_bounds__ attribute")


def _split_top(args: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in args:
        if ch in "(<":
            depth += 1
        elif ch in ")>":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


_TEMPLATE = re.compile(r"template\s*<([^<>]*(?:<[^<>]*>[^<>]*)*)>\s*__global__\s+void\s*$")


def launch_bounds(code: str) -> dict[str, tuple[str, str, tuple[str, ...]]]:
    """Kernel base name -> (max threads, min blocks) expressions of its ``__launch_bounds__``, and the
    names of the kernel template's parameters (the expressions may depend on them, e.g.
    ``Pro::kBwdThreads``)."""
    text = _strip(code)
    out: dict[str, tuple[str, str, tuple[str, ...]]] = {}
    for m in re.finditer(r"__launch_bounds__\s*\(", text):
        end = _balanced(text, m.end() - 1)
        args = _split_top(text[m.end() : end - 1])
        name = re.match(r"\s*(\w+)\s*\(", text[end:])
        if name is None or not args:
            raise BuildError(f"cannot read the kernel name after __launch_bounds__({text[m.end() : end - 1]})")
        tm = _TEMPLATE.search(text[max(0, m.start() - 400) : m.start()])
        params = tuple(p.split()[-1] for p in _split_top(tm.group(1))) if tm else ()
        out[name.group(1)] = (args[0], args[1] if len(args) > 1 else "0", params)
    return out


def _bind(expr: str, params: tuple[str, ...], args: list[str]) -> str:
    """``expr`` with each template parameter ``P`` in ``P::member`` replaced by its argument."""
    for p, a in zip(params, args):
        expr = re.sub(r"\b" + re.escape(p) + r"::", f"{a}::", expr)
    return expr


_SCOPES = re.compile(r"\bnamespace\s+(\w+)\s*\{|(\bextern\s+__shared__\b[^;{}]*?\b(\w+)\s*\[\s*\]\s*;)|[{}]")


def dynamic_shared(code: str) -> list[tuple[str, str]]:
    """``(namespace, name)`` of every ``extern __shared__ T name[];`` declaration: the namespace its
    entity belongs to (a block-scope declaration names a member of the enclosing namespace)."""
    stack: list[str] = []  # one entry per open brace: the namespace's name, or "" for any other brace
    found: list[tuple[str, str]] = []
    for m in _SCOPES.finditer(_strip(code)):
        if m.group(1):
            stack.append(m.group(1))
        elif m.group(2):
            entry = ("::".join(n for n in stack if n), m.group(3))
            if entry not in found:
                found.append(entry)
        elif m.group(0) == "{":
            stack.append("")
        elif stack:
            stack.pop()
    return found


def _defines(options: tuple[str, ...]) -> list[str]:
    """The ``-D`` options of an NVRTC option list (everything else is NVRTC's own business)."""
    out = []
    it = iter(options)
    for o in it:
        if o == "-D":
            out.append(f"-D{next(it, '')}")
        elif o.startswith(("-D", "--define-macro=")):
            out.append("-D" + o.split("=", 1)[1] if o.startswith("--define-macro=") else o)
    return out


def generated_source(code: str, names: tuple[str, ...], code_file: str) -> str:
    """The translation unit compiled for one module: harness header, the code (the file
    ``code_file`` holds it), registration."""
    bounds = launch_bounds(code)
    dyn = dynamic_shared(code)
    # the code is #included (not pasted) so that its headers' `#pragma once` stays in an included file
    lines = ['#include "cuda_cpu.h"', f'#include "{code_file}"', '#include "cuda_cpu_register.h"', "", "// generated"]
    for ns, name in dyn:
        open_ns = f"namespace {ns.replace('::', ' { namespace ')} {{ " if ns else ""
        close_ns = " }" * (ns.count("::") + 1) if ns else ""
        lines.append(f"{open_ns}alignas(64) thread_local unsigned char {name}[{MAX_DYNAMIC_SMEM}];{close_ns}")
    entries = []
    for n in names:
        base = n.split("<", 1)[0].rsplit("::", 1)[-1].strip()
        mx, mn, params = bounds.get(base, ("1024", "0", ()))
        if params and "<" in n:
            targs = _split_top(n.split("<", 1)[1].rsplit(">", 1)[0])
            mx, mn = _bind(mx, params, targs), _bind(mn, params, targs)
        entries.append(f"  PNC_KERNEL(({mx}), ({mn}), {n}),")
    lines.append("static const pnc_kernel pnc_kernels[] = {")
    lines.extend(entries)
    lines.append("};")
    lines.append("static thread_local unsigned char pnc_tls_anchor_byte;")
    lines.append("static void* pnc_tls_anchor() { return &pnc_tls_anchor_byte; }")
    lines.append("static void pnc_module_dynamic_smem(pnc_dynamic_smem* out) {")
    for i, (ns, name) in enumerate(dyn):
        q = f"{ns}::{name}" if ns else f"::{name}"
        lines.append(f"  out[{i}] = pnc_dynamic_smem{{{q}, sizeof({q})}};")
    lines.append("  (void)out;")
    lines.append("}")
    lines.append(
        'extern "C" __attribute__((visibility("default"))) const pnc_module pnc_module_info = '
        f"{{{len(names)}, pnc_kernels, {len(dyn)}, &pnc_module_dynamic_smem, &pnc_tls_anchor}};"
    )
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Built:
    """A compiled module: where its shared object is, and the source it came from."""

    path: Path
    source: str


_build_locks: dict[str, threading.Lock] = {}
_build_locks_lock = threading.Lock()


def build_module(code: str, names: tuple[str, ...], options: tuple[str, ...] = (), arch: int = 900) -> Built:
    """Compile (or find in the cache) the module of ``code`` instantiating ``names``."""
    rt = runtime()
    code_key = hashlib.sha256(code.encode()).hexdigest()[:24]
    code_path = cache_dir() / f"source-{code_key}.cu"
    if not code_path.exists():
        tmp = code_path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(code)
        os.replace(tmp, code_path)
    src = generated_source(code, names, str(code_path))
    defs = [
        *_defines(options),
        "-D__CUDACC__",
        "-D__CUDACC_RTC__",
        f"-D__CUDA_ARCH__={arch}",
    ]
    key = hashlib.sha256("\0".join([_harness_hash(), src, *defs, *SANITIZE]).encode()).hexdigest()[:24]
    out = cache_dir() / f"module-{key}.so"
    with _build_locks_lock:
        lock = _build_locks.setdefault(key, threading.Lock())
    with lock, _across_processes(out):
        if not out.exists():
            rt_path = Path(rt._name)
            _compile(
                src,
                out,
                (*defs, *SANITIZE, str(rt_path), f"-Wl,-rpath,{rt_path.parent}", "-Wl,--no-undefined", "-ldl"),
            )
    return Built(out, src)


@contextlib.contextmanager
def _across_processes(out: Path) -> Iterator[None]:
    """Hold the lock file of ``out`` (``fcntl.flock``): a module two pytest-xdist workers need at once is
    compiled by one while the other waits, instead of by both (released when its holder exits, too)."""
    import fcntl

    fd = os.open(f"{out}.lock", os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
