"""Host-side glue of the ``numba`` backend (mirrors :mod:`pynorm.reference._common`).

The kernels see every array in its *storage* form: C-contiguous, with
bfloat16 viewed as ``uint16`` and float16 as ``int16`` bits (numba computes on
neither type; :mod:`._storage` converts element by element, so a half input is
never copied to a full-size float32 array). Parameters are converted once per
call to the *math type* (float32, or float64 for float64 inputs) -- ``(H,)``
vectors, negligible next to the ``(R, H)`` work.
"""

from __future__ import annotations

import math
import operator
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import fields
from typing import Any

import numpy as np

from ..._dtypes import dtype_name
from ._layout import blocks, tiles
from ._reduce import exact_sum, sum_blocks
from ._threads import EntryMemo, launch

__all__ = [
    "POOL",
    "block_partials",
    "column_total",
    "effective_weight",
    "math_dtype",
    "output",
    "param",
    "reduce_blocks",
    "scratch",
    "stats",
    "storage",
]


def math_dtype(dtype: Any) -> np.dtype[Any]:
    """The dtype the kernels compute element-wise in for inputs of ``dtype``."""
    return np.dtype(np.float64) if np.dtype(dtype) == np.float64 else np.dtype(np.float32)


_F32, _F64 = np.dtype(np.float32), np.dtype(np.float64)


def storage(a: np.ndarray) -> np.ndarray:
    """``a`` as the kernels read or write it: C-contiguous, half types as their bits (a view when possible)."""
    a = np.ascontiguousarray(a)
    t = a.dtype
    if t is _F32 or t is _F64:  # (the common case first: a dtype comparison costs more than identity)
        return a
    if t == np.float16:
        return a.view(np.int16)
    if dtype_name(a.dtype) == "bfloat16":
        return a.view(np.uint16)
    return a


def effective_weight(weight: np.ndarray | None, offset: float, mdt: np.dtype[Any]) -> np.ndarray | None:
    """``weight + offset`` in the math type, rounded once (None stays None, the offset then unused)."""
    if weight is None:
        return None
    if offset == 0.0:
        return np.ascontiguousarray(weight, dtype=mdt)
    return np.ascontiguousarray(weight.astype(np.float64) + np.float64(offset), dtype=mdt)


def param(p: np.ndarray | None, mdt: np.dtype[Any]) -> np.ndarray | None:
    """A ``(H,)`` parameter in the math type (None stays None)."""
    return None if p is None else np.ascontiguousarray(p, dtype=mdt)


def cached(cache: dict[Any, Any], key: Any, compute: Callable[[], Any], size: int = 64) -> Any:
    """``cache[key]``, else ``compute()`` kept there (the cache emptied when it holds ``size``): what an op reads of
    its options and dtypes alone, by those. A key holding an unhashable option value computes every time."""
    try:
        hit = cache.get(key)
    except TypeError:
        return compute()
    if hit is not None:
        return hit
    value = compute()
    if len(cache) >= size:
        cache.clear()
    cache[key] = value
    return value


def ctx_options(spec: Any) -> Callable[[Any], Any]:
    """The values of ``spec``'s options a ctx holds, as one hashable value (the key of a backward's setup: the
    ctx's class is part of it, so that it is a tuple, or the class alone for a spec without such options)."""
    held = {f.name for f in fields(spec.ctx)}
    return operator.attrgetter(*(o.name for o in spec.options if o.name in held), "__class__")


class PlanForward:
    """The forward of one plan of the dispatcher (an op's ``forward_for(options)``, :func:`pynorm._dispatch._target`):
    ``run(x, *args, out=None)`` is ``op.forward(x, *args, out=out, **options)`` for the plan's options, through
    ``op.forward_setup(x, args, out, None, run)``, which keeps what the plan's first call finds for the next:
    :attr:`setup` (what the op reads of the options and dtypes) and :attr:`entry`, the row kernel's compiled entry
    point (:class:`._threads.EntryMemo`). The plan's key fixes the options and every array's dtype, shape, strides,
    writability and alignment (:func:`pynorm._dispatch._plan_key`), so both hold for every call it serves.

    :attr:`ctx` False (a :class:`pynorm.Plan`'s call for the outputs alone): the op builds no ctx (None in its
    place) -- the microsecond of an inference call that no backward follows."""

    __slots__ = ("_short", "ctx", "entry", "op", "options", "setup", "sinks")

    def __init__(self, op: Any, options: dict[str, Any], ctx: bool = True) -> None:
        self.op = op
        self.options = options
        self.setup: Any = None
        self.entry = EntryMemo()
        #: the row kernel's entry points for a quantize sink (``quantize=``: the plan's options fix its spec), the
        #: first pass of a tensor's ``amax`` and the codes' pass (their sinks' types differ), made on first use
        self.sinks: tuple[EntryMemo, EntryMemo] | None = None
        self.ctx = ctx
        #: the op's shortest forward with a ctx for the plan's shape (its ``fast_forward(..., ctx=True)``), made
        #: after a first call found the setup and entry point; False where it has none
        self._short: Any = None

    def __call__(self, x: np.ndarray, *args: Any, out: np.ndarray | None = None) -> tuple[Any, Any]:
        if out is not None and not out.flags.aligned:  # (the kept entry point was found for an aligned output)
            return self.op.forward_setup(x, args, out, None, self.options)  # type: ignore[no-any-return]
        short = self._short
        if short and out is None:
            result = short(x, *args)
            if result is not None:
                return result  # type: ignore[no-any-return]
        result = self.op.forward_setup(x, args, out, None, self)
        if short is None and self.ctx and self.setup is not None and self.entry.entry is not None:
            make = getattr(self.op, "fast_forward", None)
            self._short = (None if make is None else make(self, x.shape, ctx=True)) or False
        return result  # type: ignore[no-any-return]

    def fast(self, shape: tuple[int, int]) -> Any:
        """The op's shortest forward for this plan's calls on ``(R, H)`` arrays of ``shape`` (its
        ``fast_forward``: ``run(x, *args, out=None)`` -> the outputs, or None for a call it leaves to the general
        path), once a first call has found the setup and entry point; None where the op has none."""
        make = getattr(self.op, "fast_forward", None)
        return None if make is None or self.setup is None else make(self, shape)

    def without_ctx(self) -> PlanForward:
        """This runner building no ctx (:attr:`ctx` False), sharing its setup and entry point."""
        lean = PlanForward(self.op, self.options, ctx=False)
        lean.setup, lean.entry, lean.sinks = self.setup, self.entry, self.sinks
        return lean

    def sink_entry(self, amax_pass: bool) -> EntryMemo:
        """The :attr:`sinks` memo of the pass of a quantize sink: ``amax_pass`` the first pass of a tensor's
        ``amax``, else the codes' pass."""
        if self.sinks is None:
            self.sinks = (EntryMemo(), EntryMemo())
        return self.sinks[1 if amax_pass else 0]


def size_class(nbytes: int) -> int:
    """The buffer size a request of ``nbytes`` is served from: the smallest ``m * 2**k`` (``m`` in 4..7) at
    least ``nbytes`` -- at most 25% more than asked, so that calls of nearby sizes (a batch one row shorter, the
    last microbatch) share buffers."""
    if nbytes <= 4:
        return 4
    k = max(nbytes - 1, 1).bit_length() - 3
    return -(-nbytes >> k) << k


class _BufferPool:
    """Recycles the memory of outputs and scratch the caller has dropped, so that a steady stream of calls
    touches no fresh page.

    A fresh ``numpy.empty`` of more than glibc's mmap threshold (128 KiB to 32 MiB, moving with the
    process's history) is page-faulted in, 4 KiB at a time, by the kernel that first writes it: a 128 x 4096
    float32 LayerNorm forward + backward took ~990 minor faults and 2.2-2.9 ms a call with fresh outputs,
    0.47 ms with reused ones. Outputs of at least :attr:`min_bytes` (and kernel scratch of at least
    :attr:`scratch_bytes`) are therefore views of pool-owned byte buffers of a size class
    (:func:`size_class`); a buffer is handed out again only when the pool holds the *last* reference to it (every
    array or view made from an output keeps a reference to its buffer), so a live result is never overwritten
    -- a layer stack that keeps every block's output alive until its backward gets a buffer per output, and
    the same buffers again at the next step.

    Idle buffers are kept up to :attr:`max_bytes` in all (the least recently used are released first), and a
    buffer idle for :attr:`idle_seconds` is released at the pool's next miss or :meth:`trim`. ``max_bytes =
    0`` disables the pool; :meth:`trim` releases every idle buffer now.
    """

    def __init__(
        self, min_bytes: int = 1 << 16, max_bytes: int = 1 << 28, scratch_bytes: int = 1 << 16,
        idle_seconds: float = 30.0,
    ) -> None:  # fmt: skip
        self.min_bytes = min_bytes
        self.max_bytes = max_bytes
        self.scratch_bytes = scratch_bytes
        self.idle_seconds = idle_seconds
        self._bufs: dict[int, list[np.ndarray]] = {}  # size class -> buffers, most recently handed out last
        self._used: dict[int, float] = {}  # id(buffer) -> when it was last handed out
        #: (shape, dtype) of a request -> (numpy.dtype, bytes, size class)
        self._kinds: dict[tuple[Any, Any], tuple[np.dtype[Any], int, int]] = {}
        self._lock = threading.Lock()

    @staticmethod
    def _free(bufs: list[np.ndarray], i: int) -> bool:
        # references: the list slot and getrefcount's own argument
        return sys.getrefcount(bufs[i]) <= 2

    def empty(self, shape: tuple[int, ...], dtype: Any, scratch: bool = False) -> np.ndarray:
        """An uninitialized C-contiguous array, pooled from :attr:`min_bytes` (``scratch``: from
        :attr:`scratch_bytes`)."""
        n = math.prod(shape)
        least = self.scratch_bytes if scratch else self.min_bytes
        if 8 * n < least:  # (no dtype here is wider than 8 bytes: a small array, without np.dtype's cost)
            return np.empty(shape, dtype)
        key: tuple[Any, Any] | None = (shape, dtype)
        try:  # (the dtype, bytes and size class of a request seen before: a microsecond less)
            kind = self._kinds.get((shape, dtype))
        except TypeError:  # (a shape given as a list)
            key, kind = None, None
        if kind is None:
            dt = np.dtype(dtype)
            nbytes = dt.itemsize * n
            kind = (dt, nbytes, size_class(nbytes))
            if key is not None:
                if len(self._kinds) >= 256:
                    self._kinds.clear()
                self._kinds[key] = kind
        dt, nbytes, cls = kind
        if nbytes < least or self.max_bytes <= 0:
            return np.empty(shape, dt)
        now = time.monotonic()
        with self._lock:
            bufs = self._bufs.setdefault(cls, [])
            last = len(bufs) - 1
            for i in range(last, -1, -1):
                if sys.getrefcount(bufs[i]) <= 2:  # (:meth:`_free`, inline)
                    buf = bufs[i]
                    if i != last:  # (the most recently handed out last)
                        bufs.append(bufs.pop(i))
                    self._used[id(buf)] = now
                    return np.ndarray(shape, dt, buf)  # (its base is the buffer, as a view's would be)
            self._release(now, cls)
            buf = np.empty(cls, np.uint8)
            bufs.append(buf)
            self._used[id(buf)] = now
            return np.ndarray(shape, dt, buf)

    def _release(self, now: float, incoming: int) -> None:
        """Drop idle buffers: those idle for :attr:`idle_seconds`, then the least recently used until the idle
        ones and ``incoming`` more bytes fit :attr:`max_bytes` (under the lock)."""
        idle = []
        for bufs in self._bufs.values():
            for i in range(len(bufs)):  # (by index: a loop variable would hold a reference while checking)
                if self._free(bufs, i):
                    idle.append((self._used[id(bufs[i])], bufs[i], bufs))
        total = sum(b.nbytes for _, b, _ in idle) + incoming
        drop = []
        for t, b, bufs in sorted(idle, key=lambda e: e[0]):
            if now - t >= self.idle_seconds or total > self.max_bytes:
                drop.append((b, bufs))
                total -= b.nbytes
        for b, bufs in drop:
            for i in range(len(bufs)):
                if bufs[i] is b:
                    del bufs[i]
                    break
            del self._used[id(b)]
        del idle, drop

    def trim(self) -> int:
        """Release every idle buffer now; returns the bytes released (the buffers still referenced stay)."""
        with self._lock:
            before = self.held_bytes()
            self._release(math.inf, 1 << 62)
            return before - self.held_bytes()

    def held_bytes(self) -> int:
        """Bytes of every buffer the pool holds, idle or referenced by a live result."""
        return sum(b.nbytes for bufs in self._bufs.values() for b in bufs)


#: the pool behind every output this backend allocates (``POOL.max_bytes = 0`` turns it off).
POOL = _BufferPool()


def _after_fork_in_child() -> None:
    # a thread of the parent may have held the lock at the fork: the child has no such thread, so a held lock
    # would never be released there (the buffers themselves are the child's copies, free or not as before)
    POOL._lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def output(out: np.ndarray | None, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """``out`` (a C-contiguous array of the right shape and dtype) or a new array (see :class:`_BufferPool`)."""
    return POOL.empty(shape, dtype) if out is None else out


def stats(a: Any) -> np.ndarray:
    """Per-row statistics from a ctx as contiguous float64 (a no-op for this backend's own ctx)."""
    return np.ascontiguousarray(a, dtype=np.float64)


def scratch(shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """An uninitialized kernel scratch array that the call drops before it returns (the backward's block partials):
    pooled from :attr:`_BufferPool.scratch_bytes`, so a repeated call reuses its memory."""
    return POOL.empty(shape, dtype, scratch=True)


def block_partials(rows: int, h: int, mdt: np.dtype[Any], needed: bool) -> np.ndarray | None:
    """Scratch (:func:`scratch`) for per-row-block partial sums of a parameter gradient (None when not needed)."""
    return scratch((blocks(rows), h), mdt) if needed else None


def reduce_blocks(partials: np.ndarray, dtype: Any) -> np.ndarray:
    """Sum the block partials (float64, fixed order) into a new ``(H,)`` array of ``dtype`` (with one block of
    ``dtype``: that block's row, a view of ``partials``)."""
    nb, h = partials.shape
    if nb == 1 and partials.dtype == dtype:
        # one block (a few rows): its partials are the sums. sum_blocks would add them to 0.0 in float64 and round
        # back (exact; -0.0 would become +0.0), but no partial is ever -0.0: every kernel zeroes its partials and
        # adds to them, and a sum started from +0.0 is never -0.0. So the block's row is the result, not a copy
        # (a single 16M-element row: 2 x 11 ms of its 53 ms LayerNorm backward were these copies).
        return partials[0]
    result = output(None, (h,), dtype)
    if nb == 0:
        result[...] = 0
        return result
    launch(sum_blocks, nb * h // 4, tiles(h), partials, storage(result))  # one add per element: work / 4
    return result


def column_total(cols: np.ndarray) -> float:
    """The sum of the float64 column sums ``cols`` (a scalar parameter's gradient), correctly rounded
    (:func:`math.fsum`) where that sum is finite; where a term is infinite or NaN, or the exact sum overflows,
    fsum raises: the IEEE sum in column order then gives the reference's inf or NaN."""
    cols = np.ascontiguousarray(cols, dtype=np.float64)
    if np.isfinite(cols).all():
        ok, total = exact_sum(cols)  # fsum's algorithm, jitted: fsum over a 16M-column list took about 1 s
        if ok:
            return float(total)
    terms = cols.tolist()
    try:
        return math.fsum(terms)
    except (ValueError, OverflowError):
        total = 0.0
        for t in terms:
            total += t
        return total
