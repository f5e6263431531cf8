"""Thread control of the ``numba`` backend.

Kernels run under numba's threading layer with ``prange`` over rows (or row
blocks). The number of threads a call uses is the smallest of

* numba's own setting for the calling thread (``NUMBA_NUM_THREADS`` /
  :func:`numba.set_num_threads`, which numba keeps per thread),
* the process-wide cap set by :func:`set_num_threads` (``pynorm.set_num_threads``),
* 1 when the call is small (fewer than :data:`SERIAL_THRESHOLD` elements): waking
  a second thread costs more than it saves there, and on a busy machine it can
  stall for a scheduler tick.

Results never depend on the thread count: every reduction across rows uses
fixed row blocks summed in a fixed order (see :mod:`._stats_kernels`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["SERIAL_THRESHOLD", "get_num_threads", "launch", "set_num_threads"]

#: calls on fewer elements (rows * hidden) than this run on one thread.
SERIAL_THRESHOLD = 1 << 15

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


def get_num_threads() -> int:
    """Threads a large call made from this Python thread would use."""
    n = int(_numba().get_num_threads())
    return n if _cap is None else min(n, _cap)


_calls: tuple[Callable[[], int], Callable[[int], None]] | None = None


def _thread_calls() -> tuple[Callable[[], int], Callable[[int], None]]:
    """``(get, set)`` of the calling thread's numba thread count: the threading layer's own two functions once the
    layer is up (``numba.get_num_threads``/``set_num_threads`` add a few microseconds of checks to every call of a
    small op, which :func:`launch` makes twice), else the public ones."""
    global _calls
    if _calls is None:
        numba = _numba()
        calls: Any = (numba.get_num_threads, numba.set_num_threads)
        try:
            from numba.np.ufunc import parallel

            par: Any = parallel

            par._launch_threads()
            get, put = par._get_num_threads, par._set_num_threads
            if callable(get) and callable(put) and int(get()) == int(numba.get_num_threads()):
                calls = (get, put)
        except Exception:  # private API: keep the public functions
            pass
        _calls = calls
    return _calls


def launch(kernel: Callable[..., Any], work: int, *args: Any) -> Any:
    """Call ``kernel(*args)`` with the thread count for ``work`` elements (see module doc)."""
    get, put = _thread_calls()
    current = get()
    n = 1 if work < SERIAL_THRESHOLD else (current if _cap is None else min(current, _cap))
    if n == current:
        return kernel(*args)
    put(n)
    try:
        return kernel(*args)
    finally:
        put(current)
