"""A benchmark worker: one library timed in its own process (``python -m pynorm.bench.worker LIB THREADS``).

``LIB`` is ``pynorm`` (the numba backend, and the same-size copy on its thread pool), ``numpy`` (the reference
backend: the NumPy baseline) or ``torch`` (PyTorch CPU). The runner (:mod:`pynorm.bench.runner`) starts one
worker per library and sends it one JSON command per line on stdin; the worker answers each with one JSON line
(on the stdout it had at start: anything the libraries print goes to stderr):

* ``{"cmd": "hello"}``: ``{"lib", "versions"}``, or ``{"unavailable": reason}`` when the library does not
  import;
* ``{"cmd": "prepare", "shape", "ops", "seed", "phases", "buffers", "sample_s", "torch_threads"}``: build the cases
  (:func:`pynorm.bench.cases.make_case`) and their calls (PyTorch on ``torch_threads``, default ``THREADS``), run
  each twice (compiling on the first), and, when
  ``sample_s`` > 0 (small calls), count how many calls of each phase fill ``sample_s``; answers ``{"warm_s",
  "calls_per_sample", "bytes", "errors"}`` (an op the library cannot run is in ``errors``, not timed);
* ``{"cmd": "time", "keys"}``: one sample of each key (``"op:phase"``, or ``"copy"``/``"copyto"``), seconds
  per call: ``{key: seconds}`` (a call shorter than :data:`LEAD_S` is called once untimed first; a small call's
  sample is the median of the calls that fill ``sample_s``, each timed alone);
* ``{"cmd": "release"}``: drop the cases.

A command that fails answers ``{"error": traceback}``; the process ends at the end of its stdin.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

__all__ = ["LIBS", "main"]

#: the libraries a worker can time
LIBS = ("pynorm", "numpy", "torch")
#: a call shorter than this (seconds, at warm-up) is called once untimed before each sample: the first call
#: after the process waited for the others wakes its library's threads and refills the caches, which a loop of
#: calls (training) does not pay at every call
LEAD_S = 0.005


def _copy_kernel() -> Callable[[np.ndarray, np.ndarray], None]:
    """``copy(a, b)``: a row copy into a preallocated buffer, run as the numba backend runs its kernels (a serial
    ``nogil`` function over row spans on :func:`pynorm.backends.numba._threads.launch`'s threads, the same number
    of them). Not numba's ``prange``: its OpenMP threads keep spinning after each copy, taking a core from the
    kernels timed next to it on a small machine."""
    from numba import njit

    from pynorm.backends.numba._threads import launch

    @njit(cache=False, nogil=True)
    def span_copy(a, b, lo, hi):  # type: ignore[no-untyped-def]
        for i in range(lo, hi):
            ar = a[i]
            br = b[i]
            for j in range(ar.shape[0]):
                br[j] = ar[j]

    def copy(a: np.ndarray, b: np.ndarray) -> None:
        launch(span_copy, a.size, a.shape[0], a, b)

    return copy


class Worker:
    """The state of one worker process: its library, its thread count, the prepared calls."""

    def __init__(self, lib: str, threads: int) -> None:
        if lib not in LIBS:
            raise ValueError(f"unknown library {lib!r} (one of {', '.join(LIBS)})")
        self.lib = lib
        self.threads = threads
        self.calls: dict[str, Callable[[], Any]] = {}
        self.per_sample: dict[str, int] = {}
        self.lead: set[str] = set()
        self.big = False
        self._copy: Callable[[np.ndarray, np.ndarray], None] | None = None

    def hello(self) -> dict[str, Any]:
        versions: dict[str, Any] = {"numpy": np.__version__}
        try:
            if self.lib == "torch":
                import torch

                torch.set_num_threads(self.threads)
                versions["torch"] = torch.__version__
            elif self.lib == "pynorm":
                import numba

                from pynorm.backends.numba import _threads

                _threads.set_num_threads(self.threads)
                versions["numba"] = numba.__version__
                versions["numba_threads_effective"] = _threads.get_num_threads()
                versions["serial_threshold_elements"] = _threads.SERIAL_THRESHOLD
        except ImportError as e:
            return {"unavailable": str(e)}
        return {"lib": self.lib, "versions": versions}

    def _lib_calls(self, op: str, shape: tuple[int, int], seed: int, buffers: bool) -> tuple[Any, dict[str, Any]]:
        from .cases import make_case, pynorm_calls, torch_calls

        case = make_case(op, shape, seed)
        if self.lib == "torch":
            return case, torch_calls(case)
        return case, pynorm_calls(case, "numba" if self.lib == "pynorm" else "numpy", buffers)

    def prepare(self, cmd: dict[str, Any]) -> dict[str, Any]:
        from .cases import op_bytes

        self.release()
        if self.lib == "torch":
            import torch

            torch.set_num_threads(int(cmd.get("torch_threads") or self.threads))
        shape = (int(cmd["shape"][0]), int(cmd["shape"][1]))
        self.big = shape[0] * shape[1] >= 1 << 22  # 16 MiB of float32 per array: collect at release
        phases: list[str] = cmd["phases"]
        calls: dict[str, Callable[[], Any]] = {}
        errors: dict[str, str] = {}
        nbytes: dict[str, dict[str, int]] = {}
        for op in cmd["ops"]:
            try:
                case, lib_calls = self._lib_calls(op, shape, int(cmd.get("seed", 0)), bool(cmd.get("buffers")))
            except KeyError:
                errors[op] = f"{self.lib} has no baseline for {op}"
                continue
            except Exception as e:  # the library cannot run the op: reported, not timed
                errors[op] = f"{type(e).__name__}: {e}"
                continue
            nbytes[op] = op_bytes(case)
            for ph in phases:
                if ph in lib_calls:
                    calls[f"{op}:{ph}"] = lib_calls[ph]
        if self.lib == "pynorm" and cmd.get("copies"):
            from .cases import DTYPE

            src = (np.random.default_rng(1).standard_normal(shape) + 3).astype(DTYPE)
            dst = np.empty_like(src)
            if "copy" in cmd["copies"]:
                if self._copy is None:
                    self._copy = _copy_kernel()
                pool_copy = self._copy
                calls["copy"] = lambda: pool_copy(src, dst)
            if "copyto" in cmd["copies"]:
                calls["copyto"] = lambda: np.copyto(dst, src)
        warm: dict[str, float] = {}
        for key, fn in calls.items():
            fn()  # compiles (numba), allocates (the output pool), builds the autograd graph once
            t = time.perf_counter()
            fn()
            warm[key] = time.perf_counter() - t
        sample_s = float(cmd.get("sample_s", 0.0))
        self.per_sample = {k: max(1, int(sample_s / max(t, 1e-7))) if sample_s > 0 else 1 for k, t in warm.items()}
        self.lead = {k for k, t in warm.items() if t < LEAD_S}
        self.calls = calls
        return {"warm_s": warm, "calls_per_sample": self.per_sample, "bytes": nbytes, "errors": errors}

    def time(self, keys: list[str]) -> dict[str, float]:
        """One sample per key: the time of one call, or, for keys calibrated to several calls per sample (small
        calls), the median of that many calls each timed alone (a call the scheduler interrupts on a shared
        machine is an outlier, not a share of an average)."""
        out = {}
        clock = time.perf_counter
        for key in keys:
            fn, n = self.calls[key], self.per_sample[key]
            if key in self.lead:
                fn()
            if n == 1:
                t = clock()
                fn()
                out[key] = clock() - t
                continue
            ts = []
            for _ in range(n):
                t = clock()
                fn()
                ts.append(clock() - t)
            out[key] = statistics.median(ts)
        return out

    def release(self) -> dict[str, Any]:
        self.calls = {}
        self.per_sample = {}
        self.lead = set()
        if self.big:  # the arrays go with their last reference; a collection frees what cycles hold at once
            gc.collect()
        self.big = False
        return {}

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        what = cmd.get("cmd")
        if what == "hello":
            return self.hello()
        if what == "prepare":
            return self.prepare(cmd)
        if what == "time":
            return self.time(list(cmd["keys"]))
        if what == "release":
            return self.release()
        raise ValueError(f"unknown command {what!r}")


def main(argv: list[str] | None = None) -> int:
    """Serve commands from stdin until it closes (the module's docstring has the protocol)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2 or args[0] not in LIBS or not args[1].isdigit():
        print(f"usage: python -m pynorm.bench.worker {{{','.join(LIBS)}}} THREADS", file=sys.stderr)
        return 2
    proto = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # the libraries' prints go to stderr, not the protocol
    worker = Worker(args[0], int(args[1]))
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            reply = worker.handle(json.loads(line))
        except Exception:
            reply = {"error": traceback.format_exc()}
        proto.write(json.dumps(reply) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
