"""The benchmark's measurements: one worker process per library, their calls interleaved.

:class:`Workers` starts a worker (:mod:`pynorm.bench.worker`) for pynorm's numba backend and one per baseline
library (the reference backend, PyTorch); :func:`interleave` prepares a case in every worker, then runs
``repeat`` rounds, each timing pynorm's calls and the same-size copy in the pynorm worker, then each baseline in
its own worker, one process at a time (the others wait on their pipe), with a pause of :data:`SETTLE_S` between
processes so that threads a library leaves spinning (OpenMP, BLAS) are asleep before the next one is timed.
Every figure of a round is therefore taken under the same machine state as the copy it is compared with.

On top of it: :func:`shapes_table` (the default run), :func:`op_table` (``--ops``), :func:`small_calls`
(``--small``), and :func:`first_calls` / :func:`compile_times`, which time first calls in fresh processes.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import IO, Any

__all__ = [
    "SETTLE_S",
    "SHAPES",
    "CpuMeter",
    "Workers",
    "compile_times",
    "first_calls",
    "interleave",
    "op_table",
    "shapes_table",
    "small_calls",
]

#: the default run's shapes; ``--quick`` keeps the hidden sizes with 1/8 of the rows
SHAPES: list[tuple[int, int]] = [(8192, 1024), (4096, 4096), (2048, 8192), (65536, 128), (16, 65536)]
#: the baselines, each timed in its own process, in this order after pynorm in each round
BASELINES = ("numpy", "torch")
#: seconds of idle time between two processes' samples (a spinning OpenMP or BLAS thread goes to sleep)
SETTLE_S = 0.02
#: the phases each library times in the bandwidth tables (a baseline's missing phase is derived:
#: the reference's forward + backward is the sum of its medians, PyTorch's backward the difference)
LIB_PHASES = {"pynorm": ("fwd", "bwd", "fwd+bwd"), "numpy": ("fwd", "bwd"), "torch": ("fwd", "fwd+bwd")}
#: the phases of the small-call table
SMALL_PHASES = {"pynorm": ("fwd", "bwd", "fwd+bwd"), "numpy": ("fwd", "bwd", "fwd+bwd"), "torch": ("fwd", "fwd+bwd")}

_T0 = time.perf_counter()


def log(msg: str) -> None:
    """Progress on stderr, with the seconds since the benchmark started."""
    print(f"[{time.perf_counter() - _T0:6.1f}s] {msg}", file=sys.stderr, flush=True)


def _root() -> str:
    """The directory holding the ``pynorm`` this process imported: child processes run in it (``-m`` and ``-c``
    put the working directory first on ``sys.path``) and find it first on ``PYTHONPATH``."""
    import pynorm

    return str(Path(pynorm.__file__).resolve().parents[1])


def _env() -> dict[str, str]:
    """The environment of a child process: this pynorm first on ``PYTHONPATH`` (a source checkout runs itself)."""
    env = dict(os.environ)
    root = _root()
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


class WorkerError(RuntimeError):
    """A worker process failed a command or died."""


class _Proc:
    """One worker process and its pipes."""

    def __init__(self, lib: str, threads: int) -> None:
        self.lib = lib
        self._err: IO[str] = tempfile.TemporaryFile("w+")
        self.p = subprocess.Popen(
            [sys.executable, "-m", "pynorm.bench.worker", lib, str(threads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._err,
            text=True,
            env=_env(),
            cwd=_root(),
            bufsize=1,
        )

    def send(self, cmd: dict[str, Any]) -> None:
        assert self.p.stdin is not None
        try:
            self.p.stdin.write(json.dumps(cmd) + "\n")
            self.p.stdin.flush()
        except BrokenPipeError:
            raise WorkerError(f"the {self.lib} worker died:\n{self.stderr_tail()}") from None

    def recv(self) -> dict[str, Any]:
        assert self.p.stdout is not None
        line = self.p.stdout.readline()
        if not line:
            raise WorkerError(f"the {self.lib} worker died:\n{self.stderr_tail()}")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise WorkerError(f"the {self.lib} worker failed:\n{reply['error']}")
        return reply

    def ask(self, cmd: dict[str, Any]) -> dict[str, Any]:
        self.send(cmd)
        return self.recv()

    def stderr_tail(self, n: int = 3000) -> str:
        self._err.seek(0)
        return self._err.read()[-n:]

    def close(self) -> None:
        if self.p.stdin is not None and not self.p.stdin.closed:
            try:
                self.p.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self.p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        if self.p.stdout is not None:
            self.p.stdout.close()
        self._err.close()


class Workers:
    """The worker processes of a run: ``pynorm`` always, and each of ``baselines`` whose library imports.

    Parameters
    ----------
    threads : threads of the numba backend and of PyTorch.
    baselines : the baseline libraries wanted (of :data:`BASELINES`).

    Attributes
    ----------
    procs : the running workers by library, pynorm first.
    versions : each worker's library versions.
    unavailable : the wanted baselines that did not start, with the reason.
    """

    def __init__(self, threads: int, baselines: Iterable[str]) -> None:
        self.procs: dict[str, _Proc] = {}
        self.versions: dict[str, dict[str, Any]] = {}
        self.unavailable: dict[str, str] = {}
        try:
            for lib in ("pynorm", *baselines):
                proc = _Proc(lib, threads)
                self.procs[lib] = proc
                proc.send({"cmd": "hello"})
            for lib, proc in list(self.procs.items()):
                reply = self.guard(lib, proc.recv)
                if reply is None:
                    continue
                if "unavailable" in reply:
                    if lib == "pynorm":
                        raise WorkerError(f"the numba backend does not import: {reply['unavailable']}")
                    self.unavailable[lib] = reply["unavailable"]
                    proc.close()
                    del self.procs[lib]
                else:
                    self.versions[lib] = reply["versions"]
        except BaseException:
            self.close()
            raise

    def guard(self, lib: str, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` (a command to worker ``lib``); a baseline worker that fails is closed and dropped from
        the run (its reason in :attr:`unavailable`; None returned), pynorm's failure is raised."""
        try:
            return fn(*args)
        except WorkerError as e:
            if lib == "pynorm":
                raise
            log(f"dropping the {lib} baseline for the rest of the run: {e}")
            self.unavailable[lib] = f"failed during the run: {str(e)[-500:]}"
            proc = self.procs.pop(lib, None)
            if proc is not None:
                proc.close()
            return None

    def close(self) -> None:
        for proc in self.procs.values():
            proc.close()
        self.procs = {}

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _rounds(repeat: int, n: int) -> set[int]:
    """``n`` of the rounds ``0 .. repeat - 1``, evenly spread (all of them when ``n >= repeat``)."""
    if n >= repeat:
        return set(range(repeat))
    if n <= 1:
        return {repeat // 2}
    return {round(i * (repeat - 1) / (n - 1)) for i in range(n)}


def interleave(
    workers: Workers,
    shape: tuple[int, int],
    ops: list[str],
    phases: dict[str, tuple[str, ...]],
    repeat: int,
    base_repeat: int,
    budget_s: float,
    copies: tuple[str, ...] = (),
    buffers: bool = True,
    sample_s: float = 0.0,
    seed: int = 0,
    torch_threads: int | None = None,
) -> dict[str, Any]:
    """Time ``ops`` on ``shape`` in every worker, interleaved round by round.

    Parameters
    ----------
    workers : the run's workers.
    shape : ``(rows, hidden)`` of ``x``.
    ops : the ops of this case (timed in every round, in this order).
    phases : the phases each library times (``{"pynorm": ("fwd", ...), "numpy": ..., "torch": ...}``).
    repeat : rounds; pynorm's calls and the copies are timed in every round.
    base_repeat : rounds in which each baseline is timed (spread over the ``repeat``), fewer where the
        baseline's warm-up calls take longer than ``budget_s`` in all.
    budget_s : the seconds one baseline's samples may take in all, about (its warm-up call times the rounds).
    copies : same-size copies timed in the pynorm worker: ``"copy"`` (the backend's thread pool), ``"copyto"``
        (``numpy.copyto``, one thread).
    buffers : pynorm's forward and backward get output buffers (``fwd_alloc``: the allocating forward).
    sample_s : > 0: a sample is the median of as many calls as fill about ``sample_s`` seconds, each timed
        alone (small calls).
    seed : the seed of every worker's arrays.
    torch_threads : PyTorch's threads for this case (default: the run's).

    Returns
    -------
    dict
        ``times``: ``{lib: {key: [seconds per call, one per sample]}}`` (keys ``"op:phase"``, ``"copy"``,
        ``"copyto"``); ``bytes``: :func:`pynorm.bench.cases.op_bytes` per op; ``errors``: ``{lib: {op:
        reason}}`` for what a library could not run; ``rounds``: how many samples each library took;
        ``calls_per_sample``.
    """
    cmd_base = {"cmd": "prepare", "shape": list(shape), "ops": ops, "seed": seed, "buffers": buffers}
    cmd_base.update(sample_s=sample_s, torch_threads=torch_threads)
    replies: dict[str, dict[str, Any]] = {}
    for lib, proc in list(workers.procs.items()):  # the workers compile and warm up at once (nothing is timed)
        copies_here = list(copies) if lib == "pynorm" else []
        workers.guard(lib, proc.send, {**cmd_base, "phases": list(phases.get(lib, ())), "copies": copies_here})
    for lib, proc in list(workers.procs.items()):
        reply = workers.guard(lib, proc.recv)
        if reply is not None:
            replies[lib] = reply
    if replies["pynorm"]["errors"]:
        raise WorkerError(f"the numba backend failed: {replies['pynorm']['errors']}")
    keys = {lib: list(r["warm_s"]) for lib, r in replies.items()}
    when: dict[str, set[int]] = {"pynorm": set(range(repeat))}
    for lib in replies:
        if lib != "pynorm":
            warm = sum(replies[lib]["warm_s"].values()) if sample_s <= 0 else 0.0
            n = base_repeat if warm * base_repeat <= budget_s else max(2, int(budget_s / max(warm, 1e-9)))
            when[lib] = _rounds(repeat, min(n, base_repeat))
    times: dict[str, dict[str, list[float]]] = {lib: {k: [] for k in keys[lib]} for lib in replies}
    for r in range(repeat):
        for lib, proc in list(workers.procs.items()):
            if lib not in replies or r not in when[lib] or not keys[lib]:
                continue
            sample = workers.guard(lib, proc.ask, {"cmd": "time", "keys": keys[lib]})
            for k, t in (sample or {}).items():
                times[lib][k].append(t)
            if len(workers.procs) > 1:
                time.sleep(SETTLE_S)
    for lib, proc in list(workers.procs.items()):
        workers.guard(lib, proc.send, {"cmd": "release"})
    for lib, proc in list(workers.procs.items()):
        workers.guard(lib, proc.recv)
    return {
        "times": times,
        "bytes": replies["pynorm"]["bytes"],
        "errors": {lib: r["errors"] for lib, r in replies.items() if r["errors"]},
        "rounds": {lib: len(when[lib]) for lib in replies},
        "calls_per_sample": {lib: r["calls_per_sample"] for lib, r in replies.items()},
    }


def _median(ts: list[float]) -> float | None:
    return statistics.median(ts) if ts else None


def _baseline(times: dict[str, list[float]], op: str, lib: str) -> dict[str, Any] | None:
    """A baseline's medians per phase (the missing phase derived), or None if it timed nothing for ``op``."""
    med = {ph: _median(times.get(f"{op}:{ph}", [])) for ph in ("fwd", "bwd", "fwd+bwd")}
    if med["fwd"] is None:
        return None
    if med["fwd+bwd"] is None and med["bwd"] is not None:
        med["fwd+bwd"] = med["fwd"] + med["bwd"]
    if med["bwd"] is None and med["fwd+bwd"] is not None and med["fwd+bwd"] > med["fwd"]:
        med["bwd"] = med["fwd+bwd"] - med["fwd"]  # (none where noise made the forward's median the larger)
    return {**med, "repeats": len(times[f"{op}:fwd"])}


def _load() -> list[float] | None:
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


class CpuMeter:
    """How busy the machine's other processes kept its cores while a table was measured (Linux).

    The load average counts the benchmark's own threads; this takes the CPU time of every process from
    ``/proc/stat`` and subtracts the benchmark's (this process, its finished children, the running workers):
    :meth:`read` gives the cores the others kept busy on average since :meth:`start`, and the cores the
    hypervisor took (steal).
    """

    def __init__(self, workers: Workers | None = None) -> None:
        self.workers = workers
        self._t0: dict[str, float] | None = None

    def _sample(self) -> dict[str, float] | None:
        try:
            import resource

            hz = os.sysconf("SC_CLK_TCK")
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:9]]
            ours = 0
            for proc in self.workers.procs.values() if self.workers else ():
                with open(f"/proc/{proc.p.pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                ours += int(fields[11]) + int(fields[12])  # utime, stime
        except (OSError, ValueError, IndexError, ImportError):
            return None
        ru = [resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
        return {
            "t": time.perf_counter(),
            "busy": (v[0] + v[1] + v[2] + v[5] + v[6]) / hz,  # user, nice, system, irq, softirq
            "steal": v[7] / hz,
            "ours": ours / hz + sum(r.ru_utime + r.ru_stime for r in ru),
        }

    def start(self) -> None:
        self._t0 = self._sample()

    def read(self) -> dict[str, float] | None:
        """``{"ours_cores", "others_cores", "steal_cores", "seconds"}`` since :meth:`start` (None where not
        measurable)."""
        t1 = self._sample()
        if self._t0 is None or t1 is None or t1["t"] <= self._t0["t"]:
            return None
        dt = t1["t"] - self._t0["t"]
        others = (t1["busy"] - self._t0["busy"]) - (t1["ours"] - self._t0["ours"])
        return {
            "ours_cores": (t1["ours"] - self._t0["ours"]) / dt,
            "others_cores": max(others, 0.0) / dt,
            "steal_cores": (t1["steal"] - self._t0["steal"]) / dt,
            "seconds": dt,
        }


# ---------------------------------------------------------------------------
# the default run: shapes


def shapes_table(
    workers: Workers, shapes: list[tuple[int, int]], ops: list[str], repeat: int, base_repeat: int, budget_s: float
) -> list[dict[str, Any]]:
    """pynorm's forward, backward, forward + backward and allocating forward of ``ops`` on each shape, all timed
    in every round with the same-size copies; the baselines in their processes in ``base_repeat`` of the rounds
    (fewer where that would take more than ``budget_s`` per op).

    Returns
    -------
    list
        One dict per shape: ``shape``, ``limits`` (``copy_s``, ``copy_gbs``, ``copy_best_gbs``,
        ``numpy_copyto_gbs``), ``numba`` (``{op: {phase: {median_s, min_s, repeats, bytes, gbs, frac_copy}},
        alloc_over_out}``), ``baselines`` (``{lib: {op: {fwd, bwd, fwd+bwd, repeats}}}``), ``ratios``
        (``{lib: {op: {phase: baseline time / numba time}}}``), ``errors``, ``loadavg``.
    """
    results = []
    pynorm_phases = (*LIB_PHASES["pynorm"], "fwd_alloc")
    phases = {"pynorm": pynorm_phases, **{b: LIB_PHASES[b] for b in BASELINES}}
    for k, shape in enumerate(shapes, 1):
        log(f"[{k}/{len(shapes)}] {shape[0]}x{shape[1]}: {', '.join(ops)}; {repeat} rounds, in "
            f"{len(workers.procs)} processes ({', '.join(workers.procs)})")  # fmt: skip
        load = _load()
        res = interleave(
            workers, shape, ops, phases, repeat, base_repeat, budget_s * len(ops), copies=("copy", "copyto")
        )
        t = res["times"]["pynorm"]
        n2 = 2 * shape[0] * shape[1] * 4
        copy_t = statistics.median(t["copy"])
        limits = {
            "copy_s": copy_t,
            "copy_gbs": n2 / copy_t / 1e9,
            "copy_best_gbs": n2 / min(t["copy"]) / 1e9,
            "numpy_copyto_gbs": n2 / statistics.median(t["copyto"]) / 1e9,
        }
        numba: dict[str, Any] = {}
        for op in ops:
            entry: dict[str, Any] = {}
            for ph in pynorm_phases:
                ts = t[f"{op}:{ph}"]
                nb = res["bytes"][op]["fwd" if ph == "fwd_alloc" else ph]
                med = statistics.median(ts)
                entry[ph] = {"median_s": med, "min_s": min(ts), "repeats": len(ts), "bytes": nb, "gbs": nb / med / 1e9}
                entry[ph]["frac_copy"] = entry[ph]["gbs"] / limits["copy_gbs"]
            entry["alloc_over_out"] = entry["fwd_alloc"]["median_s"] / entry["fwd"]["median_s"]
            numba[op] = entry
        baselines: dict[str, Any] = {}
        ratios: dict[str, Any] = {}
        for lib in workers.procs:
            if lib == "pynorm":
                continue
            per_op = {op: b for op in ops if (b := _baseline(res["times"][lib], op, lib)) is not None}
            if per_op:
                baselines[lib] = per_op
                ratios[lib] = {
                    op: {ph: b[ph] / numba[op][ph]["median_s"] for ph in LIB_PHASES["pynorm"] if b.get(ph)}
                    for op, b in per_op.items()
                }
        results.append({"shape": list(shape), "limits": limits, "numba": numba, "baselines": baselines,
                        "ratios": ratios, "errors": res["errors"], "rounds": res["rounds"],
                        "loadavg": load})  # fmt: skip
    return results


# ---------------------------------------------------------------------------
# --ops: every op on one shape


def op_table(
    workers: Workers, shape: tuple[int, int], ops: list[str], repeat: int, base_repeat: int, budget_s: float
) -> list[dict[str, Any]]:
    """Forward and forward + backward of each op (default options, every parameter, output buffers passed) on
    float32 ``x`` of ``shape``, as a fraction of the same-size copy on the backend's threads timed in the same
    rounds, and the baselines' times (timed in their processes in ``base_repeat`` of the rounds).

    Returns
    -------
    list
        One row per op: ``op``, ``shape``, ``fwd_s``, ``fwd+bwd_s`` (medians), ``*_gbs``, ``*_frac_copy``
        (against the copies of that op's rounds), ``*_frac_run_copy`` (against the run's median copy),
        ``copy_gbs``, ``run_copy_gbs``, ``bytes``, ``baselines`` (``{lib: {fwd, bwd, fwd+bwd, repeats}}``),
        ``speedup`` (``{lib: {phase: baseline time / pynorm time}}``), ``errors``, ``loadavg``.
    """
    phases = {"pynorm": ("fwd", "fwd+bwd"), **{b: LIB_PHASES[b] for b in BASELINES}}
    rows = []
    all_copies: list[float] = []
    n2 = 2 * shape[0] * shape[1] * 4
    for k, op in enumerate(ops, 1):
        log(f"[{k}/{len(ops)}] {op} {shape[0]}x{shape[1]}: compile, warm up, {repeat} rounds")
        load = _load()
        res = interleave(workers, shape, [op], phases, repeat, base_repeat, budget_s, copies=("copy",))
        t = res["times"]["pynorm"]
        all_copies += t["copy"]
        copy_gbs = n2 / statistics.median(t["copy"]) / 1e9
        row: dict[str, Any] = {"op": op, "shape": list(shape), "copy_gbs": copy_gbs, "bytes": res["bytes"][op]}
        for ph in ("fwd", "fwd+bwd"):
            med = statistics.median(t[f"{op}:{ph}"])
            row[f"{ph}_s"] = med
            row[f"{ph}_gbs"] = res["bytes"][op][ph] / med / 1e9
            row[f"{ph}_frac_copy"] = row[f"{ph}_gbs"] / copy_gbs
        row["baselines"], row["speedup"] = {}, {}
        for lib in workers.procs:
            if lib != "pynorm" and (b := _baseline(res["times"][lib], op, lib)) is not None:
                row["baselines"][lib] = b
                row["speedup"][lib] = {ph: b[ph] / row[f"{ph}_s"] for ph in ("fwd", "fwd+bwd")}
        row["errors"] = {lib: e[op] for lib, e in res["errors"].items() if op in e}
        row["loadavg"] = load
        rows.append(row)
    run_gbs = n2 / statistics.median(all_copies) / 1e9 if all_copies else float("nan")
    for row in rows:
        row["run_copy_gbs"] = run_gbs
        for ph in ("fwd", "fwd+bwd"):
            row[f"{ph}_frac_run_copy"] = row[f"{ph}_gbs"] / run_gbs
    return rows


# ---------------------------------------------------------------------------
# --small: fixed costs


def small_calls(
    workers: Workers, shape: tuple[int, int], ops: list[str], repeat: int, sample_s: float = 0.005
) -> dict[str, Any]:
    """Microseconds per call of small calls: each op's allocating forward, backward and forward + backward on
    ``shape`` (default 4x8) on the numba backend, the reference backend and PyTorch, each in its process, and
    ``numpy.copyto`` of ``x`` (the cost of the smallest NumPy call, in the pynorm process) in the same rounds.

    PyTorch runs on one thread here, as the numba backend runs calls this small (below its serial threshold):
    on more, its LayerNorm kernel forks its threads even for 4 rows, and on a shared machine waits for a busy
    core (milliseconds a call), which measures the machine's load rather than a fixed cost.

    A sample is as many calls as fill about ``sample_s`` seconds, each timed alone, and their median (a call
    the scheduler interrupted does not move it); the figure is the median of the ``repeat`` rounds' samples.

    Returns
    -------
    dict
        ``shape``, ``copyto_us``, ``rows`` (one per op: ``op``, ``{lib: {phase: microseconds}}``, ``ratio``
        ``{lib: {phase: lib's time / numba's}}``), ``errors``, ``loadavg``.
    """
    log(f"small calls {shape[0]}x{shape[1]}: {len(ops)} ops, {repeat} rounds in {', '.join(workers.procs)}")
    load = _load()
    res = interleave(workers, shape, ops, SMALL_PHASES, repeat, repeat, float("inf"), copies=("copyto",),
                     buffers=False, sample_s=sample_s, torch_threads=1)  # fmt: skip
    rows = []
    for op in ops:
        row: dict[str, Any] = {"op": op}
        for lib in workers.procs:
            if (b := _baseline(res["times"][lib], op, lib)) is not None:
                row[lib] = {ph: None if b[ph] is None else 1e6 * b[ph] for ph in ("fwd", "bwd", "fwd+bwd")}
        row["ratio"] = {
            lib: {ph: row[lib][ph] / row["pynorm"][ph] for ph in ("fwd", "bwd", "fwd+bwd") if row[lib][ph] is not None}
            for lib in workers.procs
            if lib != "pynorm" and lib in row
        }
        rows.append(row)
    return {
        "shape": list(shape),
        "torch_threads": 1,
        "copyto_us": 1e6 * statistics.median(res["times"]["pynorm"]["copyto"]),
        "rows": rows,
        "errors": res["errors"],
        "rounds": res["rounds"],
        "calls_per_sample": res["calls_per_sample"],
        "loadavg": load,
    }


# ---------------------------------------------------------------------------
# first calls in fresh processes

_FIRST_CALL = r"""
import json, sys, time
t0 = time.perf_counter()
import pynorm
t_import = time.perf_counter() - t0
res = {"import_pynorm_s": t_import, "import_pulls_numba": "numba" in sys.modules, "calls": []}
import numpy as np
from pynorm.bench.cases import call_args, make_case
for op, dt in json.loads(sys.argv[1]):
    dtype = np.dtype(__import__("ml_dtypes").bfloat16 if dt == "bfloat16" else dt)
    case = make_case(op, (256, 512), 0, dtype)
    pos, kw = call_args(case.spec, case.args)
    x, dy, kw = case.x, case.dy, {**kw, **case.required}
    t = time.perf_counter()
    y, ctx = getattr(pynorm, op + "_forward")(x, *pos, **kw, backend="numba")
    t1 = time.perf_counter()
    getattr(pynorm, op + "_backward")(dy, ctx)
    t2 = time.perf_counter()
    res["calls"].append({"op": op, "dtype": dt, "fwd_s": t1 - t, "bwd_s": t2 - t1, "first_call_s": t2 - t})
print("RESULT " + json.dumps(res))
"""


def _fresh_process(calls: list[tuple[str, str]], env_extra: dict[str, str] | None = None) -> dict[str, Any]:
    """The first forward + backward of each ``(op, dtype)`` of ``calls`` (256x512: :func:`.cases.make_case`)
    in a fresh Python process; ``{"error": ...}`` if it fails."""
    env = {**_env(), **(env_extra or {})}
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _FIRST_CALL, json.dumps(calls)], capture_output=True, text=True,
                          env=env, timeout=900, cwd=_root())  # fmt: skip
    wall = time.perf_counter() - t
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"error": (proc.stderr or proc.stdout)[-2000:]}
    res: dict[str, Any] = json.loads(lines[-1][len("RESULT ") :])
    res["process_wall_s"] = wall
    for c in res["calls"]:
        res.setdefault(c["op"], c)  # the first call of each op, by name
    return res


def first_calls(ops: list[str], cold: bool) -> dict[str, Any]:
    """The first float32 forward + backward of each of ``ops`` in a fresh process: three times with the numba
    cache as it is (the median by the first op's time is kept), and with ``cold`` once with an empty cache and
    once more with the cache that filled."""
    out: dict[str, Any] = {}
    calls = [(op, "float32") for op in ops]
    warm = [_fresh_process(calls) for _ in range(3)]
    ok = [r for r in warm if "error" not in r]
    if ok:
        out["warm"] = sorted(ok, key=lambda r: r[ops[0]]["first_call_s"])[len(ok) // 2]
        out["warm_import_pynorm_s_all"] = [r["import_pynorm_s"] for r in ok]
    else:
        out["warm"] = warm[0]
    if cold:
        with tempfile.TemporaryDirectory(prefix="pynorm-numba-cache-") as d:
            out["cold"] = _fresh_process(calls, {"NUMBA_CACHE_DIR": d})
            out["warm_after_cold_same_cache"] = _fresh_process(calls, {"NUMBA_CACHE_DIR": d})
    return out


#: the dtypes ``--compile`` covers by default
COMPILE_DTYPES = ("float16", "bfloat16", "float32", "float64")


def compile_times(ops: list[str], dtypes: list[str]) -> list[dict[str, Any]]:
    """The first forward + backward of each op and dtype (256x512, every parameter and input of the spec's
    examples), each in a fresh process: with an empty numba cache (everything the call needs compiles), then
    again with the cache it filled.

    Returns
    -------
    list
        One row per op and dtype: ``cold_fwd_s``, ``cold_bwd_s``, ``cold_s``, the same for ``warm``,
        ``*_import_pynorm_s``, ``*_process_s`` (the process's wall time), or ``*_error``.
    """
    rows = []
    for op in ops:
        for dt in dtypes:
            with tempfile.TemporaryDirectory(prefix="pynorm-numba-cache-") as d:
                log(f"compile times: {op} {dt} (empty cache, then warm)")
                cold = _fresh_process([(op, dt)], {"NUMBA_CACHE_DIR": d})
                warm = _fresh_process([(op, dt)], {"NUMBA_CACHE_DIR": d})
            row: dict[str, Any] = {"op": op, "dtype": dt}
            for kind, res in (("cold", cold), ("warm", warm)):
                if "error" in res:
                    row[f"{kind}_error"] = res["error"]
                    continue
                c = res["calls"][0]
                row.update({f"{kind}_fwd_s": c["fwd_s"], f"{kind}_bwd_s": c["bwd_s"], f"{kind}_s": c["first_call_s"]})
                row[f"{kind}_import_pynorm_s"] = res["import_pynorm_s"]
                row[f"{kind}_process_s"] = res["process_wall_s"]
            rows.append(row)
    return rows
