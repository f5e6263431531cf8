"""Where a test run's numba compilation goes: each kernel signature's compile seconds, charged to the tests that
need it.

Run: ``PYNORM_TEST_BACKENDS=numba python bench/compile_cost.py [--out DIR] [--top N] -- <pytest arguments>``
(for example ``-- -n 2 tests/test_backends.py``; what tox's numba env runs, for the whole env).

Two pytest runs of the same arguments, each in its own processes:

1. **cold**: an empty ``NUMBA_CACHE_DIR`` under ``DIR``; every numba compilation is recorded with numba's own
   events (``numba.core.event``, ``"numba:compile"``): the dispatcher, the signature, the seconds, the nesting
   depth (a kernel's callees compile inside it), the test that ran it;
2. **warm**: the same cache, now full; every kernel call through pynorm's launch helpers
   (``pynorm.backends.numba._threads.launch`` and ``EntryMemo.call``) records the test and the kernel's argument
   types -- the signatures each test *needs*, whichever test compiled them first.

The report: compile seconds of the top-level kernels against the workers' wall time, the kernels by compile
seconds, and each test function's **unique** cost -- the compile seconds of the signatures no other test function
needs, what narrowing that test would save (a signature two tests need costs nothing to remove from one).
Kernels called other than through the launch helpers are compiled and counted, but charged to no test.

The cold run's wall time is mostly compilation: on the 2-core CI machine the numba env compiles ~900 signatures
(``docs/testing.md``, "Where CI's minutes go").
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

#: set in the pytest processes: the directory the plugin writes to, and what it records ("compile" or "need")
DIR_ENV, MODE_ENV = "PYNORM_COMPILE_COST_DIR", "PYNORM_COMPILE_COST_MODE"


# ---------------------------------------------------------------------------
# the pytest plugin (loaded with -p compile_cost in the runs this script starts)

_current: dict[str, str | None] = {"test": None}


def _worker() -> str:
    return os.environ.get("PYTEST_XDIST_WORKER", "main")


def pytest_configure(config: Any) -> None:
    out_dir, mode = os.environ.get(DIR_ENV), os.environ.get(MODE_ENV)
    if not out_dir or mode not in ("compile", "need"):
        return
    if mode == "compile":
        _record_compilations(Path(out_dir) / f"compile-{_worker()}.jsonl")
    else:
        _record_needs(config)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item: Any, nextitem: Any) -> None:
    _current["test"] = item.nodeid


def _record_compilations(path: Path) -> None:
    from numba.core import event

    out = path.open("a")
    stack: list[float] = []

    class Listener(event.Listener):  # type: ignore[misc]
        def on_start(self, ev: Any) -> None:
            stack.append(time.perf_counter())

        def on_end(self, ev: Any) -> None:
            seconds = time.perf_counter() - stack.pop()
            data = ev.data or {}
            fn = getattr(data.get("dispatcher"), "py_func", None)
            name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"
            rec = {"kernel": name, "sig": str(data.get("args")), "s": seconds, "depth": len(stack),
                   "test": _current["test"]}  # fmt: skip
            out.write(json.dumps(rec) + "\n")
            out.flush()

    event.register("numba:compile", Listener())


def _record_needs(config: Any) -> None:
    from numba.core.typing.typeof import Purpose, typeof

    from pynorm.backends.numba import _threads

    needs: dict[str, set[tuple[str, str]]] = collections.defaultdict(set)

    def note(kernel: Any, args: tuple[Any, ...]) -> None:
        fn = getattr(kernel, "py_func", None)
        if fn is not None and _current["test"]:
            sig = str(tuple(typeof(a, Purpose.argument) for a in args))
            needs[_current["test"]].add((f"{fn.__module__}.{fn.__qualname__}", sig))

    launch, memo_call = _threads.launch, _threads.EntryMemo.call

    def traced_launch(kernel: Any, work: int, tasks: int, *args: Any, memo: Any = None) -> Any:
        note(kernel, (*args, 0, tasks))
        return launch(kernel, work, tasks, *args, memo=memo)

    def traced_call(self: Any, kernel: Any, args: tuple[Any, ...]) -> Any:
        note(kernel, args)
        return memo_call(self, kernel, args)

    _threads.launch = traced_launch  # type: ignore[assignment]
    _threads.EntryMemo.call = traced_call  # type: ignore[method-assign]
    for mod in list(sys.modules.values()):  # the modules that imported launch by name
        if getattr(mod, "__name__", "").startswith("pynorm.backends.numba") and getattr(mod, "launch", None) is launch:
            mod.launch = traced_launch

    def dump() -> None:
        path = Path(os.environ[DIR_ENV]) / f"need-{_worker()}.json"
        path.write_text(json.dumps({t: sorted(v) for t, v in needs.items()}))

    config.add_cleanup(dump)


# ---------------------------------------------------------------------------
# the two runs and the report


def _run(out: Path, mode: str, pytest_args: list[str]) -> float:
    env = {**os.environ, DIR_ENV: str(out), MODE_ENV: mode, "NUMBA_CACHE_DIR": str(out / "numba_cache")}
    here = str(Path(__file__).resolve().parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "compile_cost", "-q", "-p", "no:cacheprovider",
                           *pytest_args], env=env)  # fmt: skip
    if proc.returncode not in (0, 1):  # (1: some test failed; the costs are still measured)
        raise SystemExit(f"pytest exited with {proc.returncode} in the {mode} run")
    return time.perf_counter() - t0


def report(out: Path, top: int = 20, cold_s: float | None = None, warm_s: float | None = None) -> str:
    """The report of the records in ``out`` (see the module doc)."""
    cost: dict[tuple[str, str], float] = {}
    n_events = 0
    for f in sorted(out.glob("compile-*.jsonl")):
        for line in f.read_text().splitlines():
            rec = json.loads(line)
            n_events += 1
            if rec["depth"] == 0:
                key = (rec["kernel"], rec["sig"])
                cost[key] = max(cost.get(key, 0.0), rec["s"])
    needs: dict[str, list[tuple[str, str]]] = {}
    for f in sorted(out.glob("need-*.json")):
        needs.update({t: [tuple(k) for k in v] for t, v in json.loads(f.read_text()).items()})  # type: ignore[misc]
    users: dict[tuple[str, str], set[str]] = collections.defaultdict(set)
    for test, keys in needs.items():
        for k in keys:
            users[k].add(test.split("[")[0])
    total = sum(cost.values())
    charged = sum(c for k, c in cost.items() if k in users)
    lines = [f"{len(cost)} top-level signatures compiled ({n_events} compilations with their callees): "
             f"{total:.0f} s; {charged:.0f} s of it in signatures the launch helpers' calls name"]  # fmt: skip
    if cold_s is not None and warm_s is not None:
        lines.append(f"cold run {cold_s:.0f} s, warm run {warm_s:.0f} s (wall)")
    by_kernel: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for (kernel, _), c in cost.items():
        by_kernel[kernel][0] += 1
        by_kernel[kernel][1] += c
    lines += ["", f"{'seconds':>8s} {'sigs':>5s}  kernel"]
    for kernel, (n, c) in sorted(by_kernel.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"{c:8.1f} {int(n):5d}  {kernel}")
    unique: dict[str, float] = collections.defaultdict(float)
    for k, c in cost.items():
        if len(users.get(k, ())) == 1:
            unique[next(iter(users[k]))] += c
    lines += ["", f"{'seconds':>8s}  test function (its unique compile cost)"]
    for test, c in sorted(unique.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"{c:8.1f}  {test}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(prog="python bench/compile_cost.py", description=(__doc__ or "").split("\n")[0])
    p.add_argument("--out", default="compile-cost", help="directory of the records and the cache (emptied first)")
    p.add_argument("--top", type=int, default=20, help="rows of each table (default 20)")
    a = p.parse_args(argv[:split])
    out = Path(a.out)
    if out.exists():
        for f in [*out.glob("compile-*.jsonl"), *out.glob("need-*.json")]:
            f.unlink()
        cache = out / "numba_cache"
        if cache.exists():
            import shutil

            shutil.rmtree(cache)
    out.mkdir(parents=True, exist_ok=True)
    cold = _run(out, "compile", argv[split + 1 :])
    warm = _run(out, "need", argv[split + 1 :])
    print(report(out, a.top, cold, warm))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
