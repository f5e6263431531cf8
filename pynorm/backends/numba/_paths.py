"""The launch paths of the ``numba`` backend's statistics family, which calls took them, and a switch that forces them.

A call of a statistics op (:mod:`.stats`) goes down one of several paths, chosen from its shape, dtype, size and
thread count (:mod:`._layout`, :func:`.stats.split_rows`), or from its values (the slow path). Every path computes
a row with the statistic's pieces (:mod:`._rowstats`), and every path but ``slow`` gives bitwise the bits of the
plain path for the same row (the slow path is the float64, exactly scaled and compensated arithmetic of rows
the fast sums cannot hold: within the reference's tolerance, not the fast path's bits):

================  =================================================================================================
``plain``         forward: whole rows per thread (:func:`._stats_kernels.fwd`)
``split``         few wide rows cut into segments across threads (:mod:`._split_kernels`), forward and backward
``stream``        float32 outputs of at least :data:`._layout.STREAM_MIN_BYTES` written by streaming stores
``slow``          rows the fast sums cannot hold (huge, tiny, non-finite): float64 after power-of-two scaling
``fused``         backward: ``dx`` and the parameter partials in one pass by row blocks (many rows)
``rows``          backward: ``dx`` by rows, then the partials by column tiles (few rows of many elements)
``serial``        one thread (calls below :data:`._threads.SERIAL_THRESHOLD` elements)
``pool``          the spans on the pool's threads
================  =================================================================================================

A forward with ``quantize=`` also records where its quantized output was made (:data:`EPILOGUES`): ``quantize``,
each row quantized in the forward's output pass (:mod:`._io`'s FP quantize sink), or ``quantize_after``, few wide
rows (the split kernels) whose ``y`` is stored and then quantized.

:func:`recording` collects the paths calls take (``note`` is one ``is None`` test when nothing records);
:func:`forced` lowers each chosen path's threshold so that a small call takes it -- a test switch, for the generic
suites (``tests/test_paths.py``) to reach every path of every op at small sizes. Neither is meant for production
calls: forcing changes only which path runs, never what a path computes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from . import _layout

__all__ = [
    "EPILOGUES", "FORCE_SLOW", "FORCE_SPLIT", "PATHS", "SERIAL_OVERRIDE", "forced", "note", "recording", "switched",
]  # fmt: skip

#: every path, with a line of what it is
PATHS = {
    "plain": "forward by whole rows per thread",
    "split": "few wide rows cut into segments across threads",
    "stream": "large float32 outputs written by streaming stores",
    "slow": "rows the fast sums cannot hold: float64 after power-of-two scaling",
    "fused": "backward: dx and the parameter partials in one pass by row blocks",
    "rows": "backward: dx by rows, then the partials by column tiles",
    "serial": "the call on one thread",
    "pool": "the call's spans on the pool's threads",
}

#: where a forward's ``quantize=`` output is made (recorded as the paths are; chosen by the option, not forced)
EPILOGUES = {
    "quantize": "quantize=: each row quantized in the forward's output pass (the FP quantize sink)",
    "quantize_after": "quantize= on few wide rows (split kernels): y stored, then quantized by a second pass",
}

#: test switches (:func:`forced`): every row of every call finished by the slow path; every call that can take the
#: split kernels taking them; the one-thread threshold in place of :data:`._threads.SERIAL_THRESHOLD` (None: that)
FORCE_SLOW = False
FORCE_SPLIT = False
SERIAL_OVERRIDE: int | None = None

_record: set[str] | None = None


def switched() -> bool:
    """Whether a switch of this module is on or a :func:`recording` is active: then a call must take the general
    path, which honours them (the plans' direct kernel calls, ``fast_forward``, step aside)."""
    return FORCE_SLOW or FORCE_SPLIT or SERIAL_OVERRIDE is not None or _record is not None


def note(path: str) -> None:
    """Record that a call took ``path`` (a key of :data:`PATHS` or :data:`EPILOGUES`; nothing unless
    :func:`recording` is active)."""
    if _record is not None:
        _record.add(path)


@contextmanager
def recording() -> Iterator[set[str]]:
    """``with recording() as taken:``: the paths the calls in the block took (a set of :data:`PATHS` and
    :data:`EPILOGUES` keys)."""
    global _record
    outer, _record = _record, set()
    try:
        yield _record
    finally:
        taken, _record = _record, outer
        if outer is not None:
            outer |= taken


@contextmanager
def forced(*paths: str) -> Iterator[None]:
    """Make small calls take ``paths`` (keys of :data:`PATHS`; ``plain`` and ``serial`` are what small calls take
    anyway, ``fused`` and ``rows`` exclude each other): the thresholds of :mod:`._layout`, :mod:`._threads` and
    :mod:`.stats` lowered (or raised) for the block, and put back after it. Not thread-safe: for tests."""
    unknown = set(paths) - set(PATHS)
    if unknown:
        raise ValueError(f"unknown path(s) {sorted(unknown)}: expected some of {sorted(PATHS)}")
    if "fused" in paths and "rows" in paths:
        raise ValueError("the backward takes one of 'fused' and 'rows', not both")
    global FORCE_SLOW, FORCE_SPLIT, SERIAL_OVERRIDE
    saved = (
        _layout.STREAM_MIN_BYTES, _layout.STREAM_MIN_ROW, _layout.FUSED_MIN_ROWS, _layout.FUSED_MAX_SMALL,
        SERIAL_OVERRIDE, FORCE_SPLIT, FORCE_SLOW,
    )  # fmt: skip
    try:
        if "stream" in paths:
            _layout.STREAM_MIN_BYTES, _layout.STREAM_MIN_ROW = 0, 1
        if "fused" in paths:
            _layout.FUSED_MIN_ROWS = 0
        if "rows" in paths:
            _layout.FUSED_MIN_ROWS, _layout.FUSED_MAX_SMALL = 1 << 62, 0
        if "pool" in paths or "split" in paths:
            SERIAL_OVERRIDE = 0
        if "serial" in paths:
            SERIAL_OVERRIDE = 1 << 62
        if "split" in paths:
            FORCE_SPLIT = True
        if "slow" in paths:
            FORCE_SLOW = True
        yield
    finally:
        (
            _layout.STREAM_MIN_BYTES, _layout.STREAM_MIN_ROW, _layout.FUSED_MIN_ROWS, _layout.FUSED_MAX_SMALL,
            SERIAL_OVERRIDE, FORCE_SPLIT, FORCE_SLOW,
        ) = saved  # fmt: skip
