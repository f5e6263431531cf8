"""The CPU execution harness: pynorm's CUDA kernels, run on the CPU with the backend's real host code.

Test-only code (see ``docs/cuda_cpu.md``):

* ``include/`` -- the stand-in for CUDA's built-ins the ``.cu`` sources compile against,
  unchanged, with the host C++ compiler (qualifiers, thread indices, barriers, shuffles,
  shared memory, storage-only ``__half``/``__nv_bfloat16`` with correctly rounded conversions);
* ``runtime.cpp`` -- every CUDA thread a fiber; real barriers and warp meetings; two thread
  schedules; NaN-poisoned, fenced device memory and shared memory; faults become errors;
* ``build.py`` -- compiles the runtime and each kernel module (cached on disk);
* ``fakecupy.py`` -- the parts of CuPy the backend uses, launching on the harness with the
  driver's checks.

:func:`install` puts the stand-in in ``sys.modules["cupy"]``; ``tests/conftest.py`` calls it
when ``PYNORM_CUDA_CPU=1`` (the ``cuda_cpu`` tox environment), so that
``tests/test_cupy_backend.py`` and the backend-parametrized suite run on it.
"""

from __future__ import annotations

import os
import sys

ENV_VAR = "PYNORM_CUDA_CPU"


def requested() -> bool:
    """Whether this test session runs the CuPy backend on the harness (``PYNORM_CUDA_CPU=1``)."""
    return os.environ.get(ENV_VAR) == "1"


def unavailable_reason() -> str | None:
    """None when the harness can run here (a C++ compiler and NVRTC), else why not."""
    from . import build

    why = build.compiler_unavailable_reason()
    if why is not None:
        return why
    if sys.platform != "linux":
        return f"the harness needs Linux (fibers, memfd, dlinfo); this is {sys.platform}"
    from pynorm.backends.cupy import compile_check

    why = compile_check.nvrtc_unavailable_reason()
    if why is not None:
        return f"NVRTC is needed for the kernels' register and shared-memory figures: {why}"
    return None


def install() -> None:
    """Make ``import cupy`` give the harness's stand-in (idempotent; refuses to shadow a real CuPy)."""
    current = sys.modules.get("cupy")
    if current is not None:
        if getattr(current, "_harness", None) is not None:
            return
        raise RuntimeError("a real cupy module is already imported; the harness will not replace it")
    from . import fakecupy

    fakecupy.ALL_GROUPS_HOOK = _pynorm_kernel_groups
    fakecupy.FILE_HOOK = _pynorm_kernel_file
    sys.modules["cupy"] = fakecupy.module()
    sys.modules["cupy.cuda"] = fakecupy.cuda
    sys.modules["cupy.cuda.runtime"] = fakecupy.runtime_mod
    sys.modules["cupy.cuda.driver"] = fakecupy.driver_mod
    sys.modules["cupy.cuda.compiler"] = fakecupy.compiler_mod


_groups_by_source: dict[str, list[list[str]]] = {}
_file_by_source: dict[str, str] = {}


def _pynorm_kernel_groups(code: str) -> list[list[str]] | None:
    """Every instantiation of one of pynorm's kernel files, given its assembled source (else None), in the
    groups that compile independently (one per op variant, :func:`pynorm.backends.cupy._loader.instantiation_groups`):
    their NVRTC compilations then yield the register figures of all the file's modules."""
    if not _groups_by_source:
        from pynorm.backends.cupy import _loader

        for f in _loader.KERNELS:
            src = _loader.assemble(f)
            _groups_by_source[src] = _loader.instantiation_groups(f)
            _file_by_source[src] = f
    return _groups_by_source.get(code)


def _pynorm_kernel_file(code: str) -> str | None:
    """The name of the pynorm kernel file whose assembled source is ``code`` (else None)."""
    _pynorm_kernel_groups(code)
    return _file_by_source.get(code)
