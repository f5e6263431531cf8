"""Thread control of the ``numba`` backend.

The kernels are serial, ``nogil`` jitted functions over a span of *tasks* (rows, row blocks or column tiles,
as each kernel documents): ``kernel(*args, lo, hi)`` does tasks ``lo <= t < hi``. :func:`launch` cuts the
tasks into one contiguous span per thread and runs the spans on a pool of Python threads (the calling
thread takes the first), which run in parallel because the kernels release the GIL.

Why not numba's ``parallel=True``: lowering a ``prange`` loop costs about 1.5 s of compile time per kernel and
signature whatever its body (most of the cold first call of an op); numba's ``workqueue`` threading layer
aborts the process when two Python threads run parallel kernels at once, and GNU OpenMP is not fork-safe.
Here a kernel compiles as plain serial code, and concurrent calls from several Python threads share the pool.
The price: a hand-off to a sleeping pool thread costs 10-20 us on a virtual machine (OpenMP's threads spin
between parallel loops), hence :data:`SERIAL_THRESHOLD`.

The number of threads a call uses is the smallest of

* numba's own setting for the calling thread (``NUMBA_NUM_THREADS`` /
  :func:`numba.set_num_threads`, which numba keeps per thread),
* the process-wide cap set by :func:`set_num_threads` (``pynorm.set_num_threads``),
* the number of tasks,
* 1 when the call is small (fewer than :data:`SERIAL_THRESHOLD` elements): waking
  a second thread costs more than it saves there.

Results never depend on the thread count: tasks write disjoint outputs, and every reduction across rows
uses fixed row blocks summed in a fixed order (see :mod:`._stats_kernels`).
"""

from __future__ import annotations

import _thread
import os
import threading
from collections.abc import Callable
from typing import Any

from . import _paths

__all__ = ["SERIAL_THRESHOLD", "EntryMemo", "get_num_threads", "launch", "set_num_threads", "spans", "threads_for"]

#: calls on fewer elements (rows * hidden) than this run on one thread. A hand-off to a pool thread costs a wake-up of
#: a sleeping thread and its wait for the GIL before its span starts, and the caller's wake-up after it: 60-150 us a
#: launch on a virtual machine (a bare lock round trip 15-35 us), and a backward makes two or three launches. Measured
#: on 2 cores (AMD EPYC, AVX-512; LayerNorm float32, medians of 200 calls, one thread against two): forward 32 x 4096
#: 59 vs 105 us, 128 x 4096 127 vs 146, 256 x 4096 237 vs 255, 512 x 4096 698 vs 305; backward 128 x 4096 250 vs 377,
#: 256 x 4096 495 vs 496, 512 x 4096 1747 vs 1006. So two threads from 1M elements (4 MiB of float32), where they
#: are never slower; the old threshold (128K) made calls of 128K-1M elements up to 1.8x slower on two threads.
SERIAL_THRESHOLD = 1 << 20
#: the value the library starts with (tests that change :data:`SERIAL_THRESHOLD` put it back from here)
DEFAULT_SERIAL_THRESHOLD = SERIAL_THRESHOLD

_cap: int | None = None
_lock = threading.Lock()


def _numba() -> Any:
    import numba

    return numba


def set_num_threads(n: int | None) -> None:
    """Cap the threads every call of the numba backend uses (all Python threads).

    ``n`` must be between 1 and ``numba.config.NUMBA_NUM_THREADS``; ``None``
    removes the cap (numba's own per-thread setting applies again).
    """
    global _cap
    if n is None:
        with _lock:
            _cap = None
        return
    if isinstance(n, bool) or not hasattr(n, "__index__"):
        raise TypeError(f"set_num_threads expects an int, got {type(n).__name__}")
    n = int(n)
    limit = int(_numba().config.NUMBA_NUM_THREADS)
    if not 1 <= n <= limit:
        raise ValueError(f"the number of threads must be between 1 and {limit} (NUMBA_NUM_THREADS), got {n}")
    with _lock:
        _cap = n


_get: Callable[[], int] | None = None


def _numba_threads() -> int:
    """numba's thread count for the calling thread: the threading layer's own getter once the layer is up
    (``numba.get_num_threads`` adds a few microseconds of checks to every call of a small op), else the public
    one."""
    global _get
    if _get is None:
        numba = _numba()
        get: Any = numba.get_num_threads
        try:
            from numba.np.ufunc import parallel

            par: Any = parallel
            par._launch_threads()
            if callable(par._get_num_threads) and int(par._get_num_threads()) == int(numba.get_num_threads()):
                get = par._get_num_threads
        except Exception:  # private API: keep the public function
            pass
        _get = get
    return int(_get())


def get_num_threads() -> int:
    """Threads a large call made from this Python thread would use."""
    n = _numba_threads()
    return n if _cap is None else min(n, _cap)


class _Worker:
    """A pool thread: runs one span per hand-off. The hand-off is two bare locks (``go`` released by the caller,
    ``done`` by the worker): a third of the latency of a ``concurrent.futures`` submit and wait (about 20 us
    against 60 us here). Polling instead of blocking does not help: the woken thread still waits for the GIL,
    and a thread waiting for the GIL sleeps.

    ``finished`` is the truth of a hand-off (``done`` only wakes the caller), so a caller interrupted in its wait
    (Ctrl-C) can wait again: see :func:`_finish`. The worker drops its job's arguments as soon as the span is
    done, so an idle worker keeps no array of its last call alive."""

    def __init__(self) -> None:
        self.go = _thread.allocate_lock()
        self.go.acquire()
        self.done = _thread.allocate_lock()
        self.done.acquire()
        self.job: tuple[Callable[..., Any], tuple[Any, ...]] | None = None
        self.finished = True
        self.result: Any = None
        self.error: BaseException | None = None
        threading.Thread(target=self._run, name=f"pynorm-numba-{len(_workers)}", daemon=True).start()

    def _run(self) -> None:
        while True:
            self.go.acquire()
            job, self.job = self.job, None
            try:
                if job is not None:
                    self.result = job[0](*job[1])
            except BaseException as exc:  # re-raised by the caller
                self.error = exc
            job = None  # the arguments of the span: not kept alive while idle
            self.finished = True
            try:
                self.done.release()
            except RuntimeError:  # left released by a hand-off whose caller stopped waiting (see _finish)
                pass

    def start(self, kernel: Callable[..., Any], args: tuple[Any, ...]) -> None:
        self.result, self.error = None, None
        self.finished = False
        self.job = (kernel, args)
        self.go.release()

    def wait(self) -> None:
        """Until the span is done. A job whose ``go`` was never released (the caller interrupted between
        :meth:`start`'s lines) is taken back: a worker clears ``job`` within microseconds of its ``go``."""
        unsent = 0
        while not self.finished:
            if self.done.acquire(timeout=0.05):
                continue
            unsent = unsent + 1 if (self.job is not None and self.go.locked()) else 0
            if unsent >= 2:
                self.job, self.finished = None, True


#: every worker started in this process, and those not serving a call now
_workers: list[_Worker] = []
_idle: list[_Worker] = []


def _take(n: int) -> list[_Worker]:
    """Up to ``n`` idle workers (new ones while fewer than ``NUMBA_NUM_THREADS - 1`` exist); fewer when other
    Python threads' calls hold the rest."""
    with _lock:
        got = [_idle.pop() for _ in range(min(n, len(_idle)))]
        limit = max(0, int(_numba().config.NUMBA_NUM_THREADS) - 1)
        while len(got) < n and len(_workers) < limit:
            w = _Worker()
            _workers.append(w)
            got.append(w)
    return got


def _give_back(workers: list[_Worker]) -> None:
    with _lock:
        _idle.extend(workers)


def _forget_workers() -> None:  # a forked child has none of the parent's threads
    global _lock
    _lock = threading.Lock()
    _workers.clear()
    _idle.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_workers)


def serial_threshold() -> int:
    """:data:`SERIAL_THRESHOLD`, or the test switch's value while :func:`._paths.forced` holds one."""
    o = _paths.SERIAL_OVERRIDE
    return SERIAL_THRESHOLD if o is None else o


def threads_for(work: int) -> int:
    """Threads a call on ``work`` elements made from this Python thread may use (before the task count)."""
    return 1 if work < serial_threshold() else get_num_threads()


def spans(tasks: int, n: int) -> list[tuple[int, int]]:
    """``tasks`` cut into ``n`` contiguous spans, as even as possible (the first ones take the remainder)."""
    return [(tasks * i // n, tasks * (i + 1) // n) for i in range(n)]


class EntryMemo:
    """The compiled entry point for the argument types of one call site's first serial call, called directly
    afterwards: numba's dispatcher types every argument of every call, about 0.9 us of a small call's 11 us.

    Only for a site whose arguments' numba types its owner's key fixes: a plan's
    (:meth:`pynorm.backends.numba.stats.StatsOp.forward_for`: the dtypes, shapes, strides and writability of
    the arrays; the caller checks the one thing the key does not hold, that every array is aligned). A first call
    whose exact types have no compiled overload of their own (numba converted an argument) keeps nothing."""

    __slots__ = ("entry",)

    def __init__(self) -> None:
        self.entry: Callable[..., Any] | None = None

    def call(self, kernel: Any, args: tuple[Any, ...]) -> Any:
        entry = self.entry
        if entry is not None:
            return entry(*args)
        result = kernel(*args)
        overloads = getattr(kernel, "overloads", None)
        if overloads is not None:
            from numba.core.typing.typeof import Purpose, typeof

            compiled = overloads.get(tuple(typeof(a, Purpose.argument) for a in args))
            if compiled is not None:
                self.entry = compiled.entry_point
        return result


def launch(kernel: Callable[..., Any], work: int, tasks: int, *args: Any, memo: EntryMemo | None = None) -> Any:
    """``kernel(*args, lo, hi)`` over ``tasks`` tasks, in one span per thread (see the module doc).

    ``work``: elements the call touches (for :data:`SERIAL_THRESHOLD`). Returns the sum of the spans' results
    (the kernels that count rows left for a slow path), or None for kernels that return nothing. An exception
    in any span is raised once every span has finished. When other Python threads' calls hold the pool's
    workers, the call runs on fewer threads (results do not depend on it). ``memo``: a serial call runs
    through it (:class:`EntryMemo`).
    """
    n = min(threads_for(work), tasks)
    workers = _take(n - 1) if n > 1 else []
    if _paths._record is not None:
        _paths.note("pool" if workers else "serial")
    if not workers:
        if memo is not None:
            return memo.call(kernel, (*args, 0, tasks))
        return kernel(*args, 0, tasks)
    parts = spans(tasks, len(workers) + 1)
    try:
        for w, (lo, hi) in zip(workers, parts[1:], strict=True):
            w.start(kernel, (*args, lo, hi))
        first = kernel(*args, *parts[0])
    finally:
        rest, error = _finish(workers)
    if error is not None:
        raise error
    return None if first is None else first + sum(rest)


def _finish(workers: list[_Worker]) -> tuple[list[Any], BaseException | None]:
    """Wait for every worker's span, give the workers back and return their results and the first exception
    (a span's, or a ``KeyboardInterrupt`` that landed in the wait: the wait resumes, so no worker is lost and
    no span still runs when the call returns). Each worker's result and error are cleared (an exception's
    traceback holds the span's arguments)."""
    interrupt: BaseException | None = None
    for w in workers:
        while not w.finished:
            try:
                w.wait()
            except BaseException as exc:  # KeyboardInterrupt (or another signal handler's exception)
                interrupt = interrupt or exc
    rest = [w.result for w in workers]
    errors = [w.error for w in workers if w.error is not None]
    for w in workers:
        w.result, w.error = None, None
    _give_back(workers)
    return rest, interrupt if interrupt is not None else (errors[0] if errors else None)
