"""Compile every CUDA kernel instantiation with NVRTC from pip, for sm_80 and sm_90, on any machine.

Run as ``python -m pynorm.backends.cupy.compile_check``. It needs only ``cuda-bindings``
(``cuda.bindings.nvrtc``), ``nvidia-cuda-nvrtc`` and the ``cuda_fp16.h``/``cuda_bf16.h``
headers of ``nvidia-cuda-runtime`` -- no GPU, no CUDA toolkit, no CuPy. For each source
file and architecture it compiles all template instantiations to a cubin with
``--ptxas-options=-v -Xptxas --warn-on-spills -Xptxas --warn-on-local-memory-usage``,
reads ptxas' report from the NVRTC log and fails (exit status 1) on

* any compile error or warning,
* any register spill or other use of local memory (stack frame > 0),

then prints one line per kernel: registers, static shared memory, and the occupancy
its ``__launch_bounds__`` block allows on that architecture (by the model of
:func:`pynorm.backends.cupy._launch.occupancy`), so a change that costs occupancy shows
in review. Exit status 2: NVRTC is not available here.

The same entry points serve the tests: :func:`check_file`, :func:`compile_source`,
:func:`run_check`, :func:`format_table`, :func:`main`.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
import re
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from . import _launch, _loader

__all__ = [
    "ARCHS",
    "CompileResult",
    "KernelReport",
    "check_file",
    "compile_source",
    "format_table",
    "main",
    "nvrtc_unavailable_reason",
    "run_check",
]

ARCHS = ("sm_80", "sm_90")
PTXAS_FLAGS = ("--ptxas-options=-v", "-Xptxas", "--warn-on-spills", "-Xptxas", "--warn-on-local-memory-usage")


@dataclass
class KernelReport:
    """ptxas' figures for one kernel instantiation, and the occupancy they allow."""

    name: str
    arch: str
    lowered: str
    registers: int = -1
    smem: int = 0
    stack: int = 0
    spill_stores: int = 0
    spill_loads: int = 0
    block: int = 0
    occupancy: _launch.Occupancy | None = None

    @property
    def clean(self) -> bool:
        return self.registers >= 0 and self.spill_stores == 0 and self.spill_loads == 0 and self.stack == 0


@dataclass
class CompileResult:
    """The outcome of compiling one source for one architecture."""

    file: str
    arch: str
    kernels: list[KernelReport] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    log: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.errors


def nvrtc_unavailable_reason() -> str | None:
    """None when NVRTC from cuda-bindings can compile here, else why not."""
    try:
        from cuda.bindings import nvrtc
    except Exception as exc:
        return f"cuda.bindings.nvrtc cannot be imported ({exc!r}); pip install cuda-bindings nvidia-cuda-nvrtc"
    try:
        err = nvrtc.nvrtcVersion()[0]
    except Exception as exc:  # libnvrtc.so missing
        return f"NVRTC library not loadable ({exc!r}); pip install nvidia-cuda-nvrtc"
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        return f"nvrtcVersion failed: {err!r}"
    if _loader.cuda_include_dir() is None:
        return "cuda_fp16.h not found; pip install nvidia-cuda-runtime (or set CUDA_PATH)"
    return None


def _check(result: tuple, what: str) -> tuple:
    from cuda.bindings import nvrtc

    if result[0] != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise RuntimeError(f"{what} failed: {result[0]!r}")
    return result[1:]


_ENTRY = re.compile(r"Compiling entry function '([^']+)' for '(sm_\d+a?)'")
_PROPS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_ptxas(log: str) -> dict[str, dict[str, int]]:
    """Per lowered kernel name: registers, smem, stack, spill_stores, spill_loads from a ``-v`` log."""
    out: dict[str, dict[str, int]] = {}
    current: dict[str, int] | None = None
    for line in log.splitlines():
        m = _ENTRY.search(line)
        if m:
            current = out.setdefault(
                m.group(1), {"registers": -1, "smem": 0, "stack": 0, "spill_stores": 0, "spill_loads": 0}
            )
            continue
        if current is None:
            continue
        m = _PROPS.search(line)
        if m:
            current["stack"], current["spill_stores"], current["spill_loads"] = (int(g) for g in m.groups())
            continue
        m = _USED.search(line)
        if m:
            current["registers"] = int(m.group(1))
            current["smem"] = int(m.group(2) or 0)
    return out


#: a directory where :func:`compile_source` keeps each successful compilation's outcome (NVRTC's log and lowered
#: names), keyed by everything the compilation reads -- NVRTC's version, the file name, the source, the name
#: expressions, the architecture and the options -- so that a second process asking for the same compilation
#: reads it instead (the CI's kernels env compiles every instantiation for sm_80 and sm_90; the CPU harness's
#: env then needs the sm_90 ones' register counts again). The two directories an environment's install decides --
#: the kernels directory (the sources' ``#line`` directives) and the CUDA headers' (the ``-I`` option) -- are keyed
#: and kept as tokens (:func:`_tokens`; the headers' with a fingerprint of their contents): two environments that
#: install the package and the headers in different places (CI's kernels and cuda_cpu venvs) share one
#: compilation, and a log read from the cache names the reader's directories. Unset: no cache.
CACHE_ENV = "PYNORM_NVRTC_CACHE_DIR"


@functools.lru_cache(maxsize=8)
def _headers_fingerprint(d: str) -> str:
    h = hashlib.sha256()
    for name in ("cuda_fp16.h", "cuda_fp16.hpp", "cuda_bf16.h", "cuda_bf16.hpp", "cuda_fp8.h", "cuda_fp4.h"):
        p = Path(d) / name
        h.update(p.read_bytes() if p.exists() else b"-")
    return h.hexdigest()[:16]


def _tokens() -> list[tuple[str, str]]:
    """``(directory, token)`` pairs: the installed kernels directory and the CUDA headers' directory."""
    out = []
    k = _loader.kernel_dir()
    if isinstance(k, Path):
        out.append((f"{k.as_posix()}/", "<pynorm-kernels>/"))
    inc = _loader.cuda_include_dir()
    if inc:
        out.append((inc, f"<cuda-include {_headers_fingerprint(inc)}>"))
    return out


def _tokenized(text: str) -> str:
    for d, token in _tokens():
        text = text.replace(d, token)
    return text


def _untokenized(text: str) -> str:
    for d, token in _tokens():
        text = text.replace(token, d)
    return text


def _nvrtc_version() -> str:
    from cuda.bindings import nvrtc

    return ".".join(str(v) for v in _check(nvrtc.nvrtcVersion(), "nvrtcVersion"))


def _cache_path(filename: str, source: str, names: Sequence[str], opts: Sequence[str]) -> str | None:
    d = os.environ.get(CACHE_ENV)
    if not d:
        return None
    parts = [_nvrtc_version(), filename, _tokenized(source), *names, "\1", *(_tokenized(o) for o in opts)]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]
    return os.path.join(d, f"nvrtc-{key}.json")


def _nvrtc_compile(
    source: str, names: Sequence[str], opts: Sequence[str], filename: str
) -> tuple[bool, str, str, list[str]]:
    """``(ok, status name, log, lowered names)`` of one NVRTC compilation (from :data:`CACHE_ENV`'s directory when
    it holds it; only successful ones are kept)."""
    path = _cache_path(filename, source, names, opts)
    if path is not None and os.path.exists(path):
        with open(path) as f:
            c = json.load(f)
        return c["ok"], c["status"], _untokenized(c["log"]), c["lowered"]
    from cuda.bindings import nvrtc

    (prog,) = _check(nvrtc.nvrtcCreateProgram(source.encode(), filename.encode(), 0, [], []), "nvrtcCreateProgram")
    try:
        for n in names:
            _check(nvrtc.nvrtcAddNameExpression(prog, n.encode()), f"nvrtcAddNameExpression({n})")
        (status,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
        (size,) = _check(nvrtc.nvrtcGetProgramLogSize(prog), "nvrtcGetProgramLogSize")
        buf = b" " * size
        _check(nvrtc.nvrtcGetProgramLog(prog, buf), "nvrtcGetProgramLog")
        log = buf.rstrip(b"\x00 ").decode(errors="replace")
        ok = status == nvrtc.nvrtcResult.NVRTC_SUCCESS
        lowered = []
        if ok:
            for n in names:
                (low,) = _check(nvrtc.nvrtcGetLoweredName(prog, n.encode()), f"nvrtcGetLoweredName({n})")
                lowered.append(low.decode())
    finally:
        nvrtc.nvrtcDestroyProgram(prog)
    if path is not None and ok:  # written whole, then renamed: a reader never sees half a file
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        with open(tmp, "w") as f:
            json.dump({"ok": ok, "status": status.name, "log": _tokenized(log), "lowered": lowered}, f)
        os.replace(tmp, path)
    return ok, status.name, log, lowered


def compile_source(
    source: str,
    name_expressions: Sequence[str],
    arch: str,
    filename: str = "kernel.cu",
    options: Iterable[str] = (),
) -> CompileResult:
    """Compile ``source`` to a cubin for ``arch`` instantiating ``name_expressions``; collect ptxas' report."""
    result = CompileResult(filename, arch)
    t0 = time.perf_counter()
    try:
        opts = [*_loader.compile_options(), *options, f"--gpu-architecture={arch}", *PTXAS_FLAGS]
        ok, status, result.log, lowered_names = _nvrtc_compile(source, name_expressions, opts, filename)
        if not ok:
            result.errors.append(f"{filename} [{arch}]: compilation failed ({status}):\n{result.log}")
            return result
        for line in result.log.splitlines():
            if "warning" in line.lower():
                result.errors.append(f"{filename} [{arch}]: {line.strip()}")
        stats = parse_ptxas(result.log)
        for n, lowered in zip(name_expressions, lowered_names, strict=True):
            rep = KernelReport(n, arch, lowered)
            for field_name, value in stats.get(lowered, {}).items():
                setattr(rep, field_name, value)
            try:
                rep.block = _launch.launch_bound(n)
            except KeyError:
                rep.block = 0
            limits = _launch.ARCH_LIMITS.get(arch)
            if rep.block and limits is not None and rep.registers >= 0:
                rep.occupancy = _launch.occupancy(rep.registers, rep.smem, rep.block, limits)
            if rep.registers < 0:
                result.errors.append(f"{filename} [{arch}]: no ptxas report for {n} ({lowered})")
            elif not rep.clean:
                result.errors.append(
                    f"{filename} [{arch}]: {n} uses local memory: {rep.stack} bytes stack frame, "
                    f"{rep.spill_stores} bytes spill stores, {rep.spill_loads} bytes spill loads"
                )
            result.kernels.append(rep)
    finally:
        result.seconds = time.perf_counter() - t0
    return result


def check_file(
    file: str,
    arch: str,
    directory: str | os.PathLike[str] | None = None,
    names: Sequence[str] | None = None,
) -> CompileResult:
    """Compile kernel file ``file`` (from the package, or from ``directory``) for ``arch``."""
    src = _loader.assemble(file, directory)
    return compile_source(src, names if names is not None else _loader.instantiations(file), arch, filename=file)


def run_check(
    archs: Sequence[str] = ARCHS,
    files: Sequence[str] | None = None,
    directory: str | os.PathLike[str] | None = None,
    jobs: int | None = None,
) -> list[CompileResult]:
    """Compile every file for every arch (NVRTC releases the GIL: threads run in parallel)."""
    files = list(files or _loader.KERNELS)
    tasks = [(f, a, names) for a in archs for f in files for names in _loader.instantiation_groups(f)]
    jobs = jobs or min(len(tasks), os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as ex:
        return list(ex.map(lambda t: check_file(t[0], t[1], directory, t[2]), tasks))


def format_table(results: Sequence[CompileResult]) -> str:
    """One line per kernel instantiation and arch: registers, smem, local memory, occupancy."""
    head = (
        f"{'kernel':58s} {'arch':5s} {'regs':>4s} {'smem':>6s} {'local':>5s} {'block':>5s} "
        f"{'blk/SM':>6s} {'occ':>5s}  limiter"
    )
    lines = [head, "-" * len(head)]
    for res in results:
        for k in res.kernels:
            occ = k.occupancy
            local = k.stack + k.spill_stores + k.spill_loads
            lines.append(
                f"{k.name.removeprefix('pynorm::'):58s} {k.arch:5s} {k.registers:4d} {k.smem:6d} {local:5d} "
                f"{k.block:5d} {occ.blocks_per_sm if occ else 0:6d} "
                f"{(occ.fraction if occ else 0.0):5.0%}  {occ.limiter if occ else '?'}"
            )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m pynorm.backends.cupy.compile_check", description=(__doc__ or "").split("\n")[0]
    )
    ap.add_argument("--arch", action="append", help="sm_XX to compile for (repeatable; default sm_80 and sm_90)")
    ap.add_argument("--file", action="append", help=f"kernel file(s) to check (default: {', '.join(_loader.KERNELS)})")
    ap.add_argument("--kernels-dir", help="check the .cu files of this directory instead of the installed ones")
    ap.add_argument("--jobs", type=int, default=None, help="parallel compilations (default: CPU count)")
    ap.add_argument("--quiet", action="store_true", help="print only failures and the summary line")
    args = ap.parse_args(argv)

    reason = nvrtc_unavailable_reason()
    if reason is not None:
        print(f"compile_check: NVRTC unavailable: {reason}", file=sys.stderr)
        return 2
    from cuda.bindings import nvrtc

    t0 = time.perf_counter()
    results = run_check(tuple(args.arch or ARCHS), args.file, args.kernels_dir, args.jobs)
    n_kernels = sum(len(r.kernels) for r in results)
    if not args.quiet:
        print(format_table(results))
    errors = [e for r in results for e in r.errors]
    for e in errors:
        print(f"ERROR: {e}", file=sys.stderr)
    _, major, minor = nvrtc.nvrtcVersion()
    print(
        f"compile_check: {n_kernels} kernel instantiations, {len(results)} compilations "
        f"({', '.join(args.arch or ARCHS)}) with NVRTC {major}.{minor} in {time.perf_counter() - t0:.1f}s: "
        f"{'FAILED, ' + str(len(errors)) + ' error(s)' if errors else 'OK, no spills'}"
    )
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
