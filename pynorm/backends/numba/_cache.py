"""The ``jit`` decorator of the ``numba`` backend, and a disk cache that stays correct across its files.

numba's on-disk cache (``cache=True``) revalidates a compiled function against the source of
the file that *defines* it only (numba/numba#8359): a kernel in one file whose helper in another
file changed would load stale machine code. The kernels here are split by piece over several
files, so :class:`SourceTreeLocator` -- inserted at the front of numba's cache locators -- stamps
every function of this package with one hash of all the package's source files, the numba
version and the llvmlite version: editing any file invalidates every cached kernel of the backend.
The cache directory is the one numba would pick (``NUMBA_CACHE_DIR`` when set, else ``__pycache__``
beside the sources, else the user-wide cache).

The locator must be in place when a kernel is decorated (numba picks the locator then), so every
kernel module imports :func:`jit` from here. It relies on numba's private ``numba.core.caching``
API; when that is missing, or when ``NUMBA_CACHE_LOCATOR_CLASSES`` overrides the locators, the
kernels are compiled with ``cache=False`` (and one warning says so).

The cache never fails a call (:class:`GuardedCache`, numba's ``FunctionCache`` with its loads and
saves guarded):

* a cache file that cannot be read (truncated, overwritten, from another machine...) is a miss: the
  kernel is recompiled and its entry written anew, with one :class:`CacheWarning` per process;
* with no writable cache directory (a read-only install, ``NUMBA_CACHE_DIR`` and ``HOME`` not
  writable) the kernels still load from a warm cache there, read-only, and what is compiled in the
  process is not saved (one :class:`CacheWarning`);
* processes compiling into one cache at once keep every entry, each naming its own machine code
  (:class:`_CheckedCacheFile`: numba's own save has no lock).
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import logging
import os
import pickle
import re
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import llvmlite
import numba
from numba import njit
from numba.core.caching import FunctionCache, IndexDataCacheFile

from ...errors import PynormWarning


class CacheWarning(PynormWarning):
    """numba's disk cache of pynorm's kernels could not be read or written: the kernels are compiled instead."""


_warned: set[str] = set()


def _warn_once(kind: str, message: str) -> None:
    if kind not in _warned:
        _warned.add(kind)
        warnings.warn(message, CacheWarning, stacklevel=4)


__all__ = [
    "CACHING", "FM_SUM", "INLINED", "INLINED_VIEW", "LOG", "SOURCE_STAMP", "VIEW", "CacheWarning", "GuardedCache",
    "jit",
]  # fmt: skip

#: where the first compilation of a kernel is announced (one WARNING line per op, direction and dtype, printed
#: on stderr by Python's last-resort handler where logging is not configured): silence it with
#: ``logging.getLogger("pynorm.compile").setLevel(logging.ERROR)``
LOG = logging.getLogger("pynorm.compile")
_announced: set[str] = set()


def _announce() -> None:
    """Log, once per process and per op, direction and dtype, that kernels are being compiled (a cache miss: the
    next seconds are numba's). The op is read from the dispatcher's frame on the stack (only on a miss)."""
    what = "numba"
    f: Any = sys._getframe(2)
    while f is not None:
        loc = f.f_locals
        if f.f_code.co_filename.endswith("_dispatch.py") and "spec" in loc:
            ctx: Any = loc.get("ctx")
            x: Any = loc.get("x")
            if hasattr(ctx, "x_dtype"):
                what = f"{loc['spec'].name} backward {ctx.x_dtype}"
            elif hasattr(x, "dtype"):
                what = f"{loc['spec'].name} forward {x.dtype}"
            break
        f = f.f_back
    if what not in _announced:
        _announced.add(what)
        LOG.warning("pynorm: compiling %s kernels for this CPU (first use; cached for later runs)", what)


#: the fastmath flags of the kernels' arithmetic (row sums reassociate and vectorize, products contract):
#: never ``nnan``/``ninf``, so NaN and Inf keep their IEEE meaning. Helpers whose rounding matters are
#: compiled with ``fastmath=False`` and keep it where they are inlined.
FM_SUM = {"reassoc", "contract"}

#: the ``jit_options`` of an ``@overload`` piece that kernels call in their loops (what ``jit(FM_SUM,
#: forceinline=True)`` gives a plain function): compiled once per signature and inlined by LLVM, so that the
#: loop is one body to vectorize, with the kernels' fastmath flags. numba-IR inlining (``inline="always"``)
#: types the piece again at every call site: it multiplied the first-call compile time (DyT float32 forward +
#: backward 15.4 -> 3.4 s, LayerNorm's 9.3-10.3 -> 5.5-6.3 s). A piece whose rounding depends on being typed
#: inside its caller keeps IR inlining: ``_rowstats``, ``_storage``, ``_stream``, and ``_stats_kernels``'
#: ``padd`` and dx writers (``write_dx``, ``_dx_range``, ``write_dx_out``).
INLINED: Any = {
    "fastmath": FM_SUM, "error_model": "numpy", "forceinline": True, "no_cpython_wrapper": True,
    "no_cfunc_wrapper": True,
}  # fmt: skip

#: the ``jit_options`` of an ``@overload`` piece that returns a view of its arguments (a row, a segment): compiled
#: with reference counting whatever its caller's flags, as numba returns no view without it -- a body compiled
#: without (``jit(..., borrowed=True)``) inherits that otherwise; its reference on a borrowed view is a null check
VIEW: Any = {"_nrt": True}
#: :data:`INLINED` for a piece returning a view (:data:`VIEW`)
INLINED_VIEW: Any = {**INLINED, **VIEW}

_DIR = Path(__file__).resolve().parent


def _source_stamp() -> str:
    h = hashlib.sha256(f"numba {numba.__version__} llvmlite {llvmlite.__version__}".encode())
    for path in sorted(_DIR.glob("*.py")):
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


#: hash of every source file of this package and of the numba/llvmlite versions (the cache's stamp).
SOURCE_STAMP = _source_stamp()


def _install() -> str | None:
    """Put :class:`SourceTreeLocator` first in numba's locator list; None, or why it cannot be done."""
    if os.environ.get("NUMBA_CACHE_LOCATOR_CLASSES"):
        return "NUMBA_CACHE_LOCATOR_CLASSES is set, which replaces the locator that keeps the cache consistent"
    try:
        from numba.core import caching

        base = caching._CacheLocator
        impl = getattr(caching, "CacheImpl", None) or caching._CacheImpl  # type: ignore[attr-defined]  # renamed in 0.61
        classes = impl._locator_classes
        if not isinstance(classes, list) or not all(isinstance(c, type) for c in classes):
            raise TypeError("CacheImpl._locator_classes is not a list of classes")
    except Exception as exc:
        return f"numba's cache locator API (numba.core.caching) is not as expected: {exc!r}"

    fallbacks = [c for c in classes if not getattr(c, "_pynorm_locator", False)]

    class SourceTreeLocator(base):  # type: ignore[misc, valid-type]
        """numba's own locator for a function of this package, with the package's source hash as its stamp."""

        _pynorm_locator = True

        def __init__(self, inner: Any, read_only: bool = False) -> None:
            self._inner = inner
            self.read_only = read_only
            self._py_file = getattr(inner, "_py_file", "")  # read by numba's cachability warnings

        def ensure_cache_path(self) -> None:
            if self.read_only:
                raise OSError(f"no writable cache directory (read-only: {self.get_cache_path()})")
            self._inner.ensure_cache_path()

        def get_cache_path(self) -> str:
            return str(self._inner.get_cache_path())

        def get_source_stamp(self) -> str:
            return SOURCE_STAMP

        def get_disambiguator(self) -> str:
            return str(self._inner.get_disambiguator())

        @classmethod
        def from_function(cls, py_func: Any, py_file: str) -> Any:
            try:
                if Path(py_file).resolve().parent != _DIR:
                    return None
            except OSError:
                return None
            for loc in fallbacks:
                inner = loc.from_function(py_func, py_file)
                if inner is not None:
                    return cls(inner)
            # nowhere writable: the first of numba's places that exists, read-only (a warm cache is used;
            # GuardedCache skips the saves), else the first place at all (every load a miss)
            places = []
            for loc in fallbacks:
                try:
                    places.append(loc(py_func, py_file))
                except Exception:  # a locator of another kind (IPython, zip): not a place for this file
                    continue
            places = [p for p in places if _path_of(p)]
            for p in places:
                if os.path.isdir(_path_of(p)):
                    return cls(p, read_only=True)
            return cls(places[0], read_only=True) if places else None

    SourceTreeLocator.__qualname__ = SourceTreeLocator.__name__
    classes.insert(0, SourceTreeLocator)
    return None


def _path_of(locator: Any) -> str:
    try:
        return str(locator.get_cache_path() or "")
    except Exception:
        return ""


_why_not = _install()
#: whether kernels are cached on disk (False, with one warning, where the locator cannot be installed).
CACHING = _why_not is None
if not CACHING:
    warnings.warn(
        f"pynorm's numba kernels are compiled without a disk cache (cache=False): {_why_not}",
        stacklevel=2,
    )


def jit(fastmath: Any = False, inline: Any = "never", forceinline: bool = False, borrowed: bool = False) -> Any:
    """``njit`` with disk caching (see the module doc), no GIL, IEEE division (``error_model="numpy"``:
    1/0 is inf, not an exception) and an *explicit* fastmath setting.

    numba lets a callee without an explicit ``fastmath`` inherit its first caller's flags; every
    function of the backend states its own so the code is the same whichever kernel compiles it first.

    Compile time: no function gets a C-callable wrapper (``no_cfunc_wrapper``: none is passed as a first-class
    function), and the private helpers (names starting with ``_``, and every ``inline="always"`` piece), which
    only jitted code calls, get no Python wrapper either (``no_cpython_wrapper``): numba builds both for every
    signature of every function otherwise.

    ``borrowed``: a span body (:mod:`._borrow`) compiled without numba's reference counting (``_nrt=False``): every
    array it sees is borrowed (no memory-info), so each view it made cost a call to ``NRT_incref``/``NRT_decref``
    (a null check, behind a call numba keeps out of line) and nothing else -- about 16 calls a row, two thirds of
    a short row's time (RMSNorm 8192 x 32 forward: 537 us with them, 182 without, docs/numba.md). Such a body
    allocates nothing (numba refuses to compile an allocation without reference counting: its caller, the kernel,
    makes its scratch and borrows it in) and returns no array. The pieces it calls compile with its flags where
    they do not set their own (numba's inheritance): a piece returning a view of its arguments sets ``_nrt``
    (:data:`VIEW`; numba will not return a view without it), and its reference on the borrowed view is again a
    null check.
    """

    def decorate(fn: Any) -> Any:
        helper = inline == "always" or forceinline or fn.__name__.startswith("_")
        options: dict[str, Any] = {"no_cfunc_wrapper": True, "no_cpython_wrapper": helper}
        if forceinline:
            options["forceinline"] = True
        if borrowed:
            options["_nrt"] = False
        disp = njit(
            cache=False, nogil=True, fastmath=fastmath, inline=inline, error_model="numpy",
            **options,
        )(fn)  # fmt: skip
        if CACHING:
            disp._cache = GuardedCache(disp.py_func)  # what njit(cache=True) does, with numba's own class
        return disp

    return decorate


@contextlib.contextmanager
def _dir_lock(path: str) -> Iterator[None]:
    """An exclusive advisory lock (``flock``) on ``path``'s lock file, held by one process at a time; no lock where
    the platform has no ``fcntl`` (Windows) or the file system refuses one."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    try:
        fd = os.open(os.path.join(path, ".pynorm-cache.lock"), os.O_RDWR | os.O_CREAT, 0o666)
    except OSError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            pass
        yield
    finally:
        os.close(fd)  # releases the lock


class _CheckedCacheFile(IndexDataCacheFile):  # type: ignore[misc]
    """numba's index + data files, safe for processes that compile into one cache at once, and checked on load.

    numba's own ``save`` reads the index, picks the first free data file name, writes the index, then the data:
    two processes saving signatures of one function at once (pytest-xdist workers, dask workers, a pool) read the
    same index, so the last index written drops the other's entry, and both write the same data file name, so an
    entry may point at the *other* signature's machine code. Here a save holds a lock on the cache directory from
    reading the index to writing it, and writes the data before the index names it; a load needs no lock (both
    files are replaced by a rename). Each data file is led by the SHA-256 of its key and of its payload: a file
    that is not the entry's (a cache shared where ``flock`` does not hold, another writer) or is corrupted is an
    error on load (then a miss), never machine code loaded for another signature or from flipped bytes."""

    def save(self, key: Any, data: Any) -> None:
        payload = self._dump(data)
        with _dir_lock(self._cache_path):
            overloads = self._load_index()
            name = overloads.get(key)
            if name is None:
                taken = set(overloads.values())
                name = next(n for n in map(self._data_name, itertools.count(1)) if n not in taken)
            with self._open_for_write(self._data_path(name)) as f:
                f.write(_key_digest(key) + hashlib.sha256(payload).digest() + payload)
            if overloads.get(key) != name:
                overloads[key] = name
                self._save_index(overloads)

    def load(self, key: Any) -> Any:
        name = self._load_index().get(key)
        if name is None:
            return None
        try:
            with open(self._data_path(name), "rb") as f:
                blob = f.read()
        except OSError:  # removed since the index named it
            return None
        kd, digest, payload = blob[:32], blob[32:64], blob[64:]
        if len(blob) < 64 or hashlib.sha256(payload).digest() != digest:
            raise ValueError(f"checksum mismatch in {self._data_path(name)}")
        if kd != _key_digest(key):
            raise ValueError(f"{self._data_path(name)} holds another signature's entry than its index says")
        return pickle.loads(payload)


def _key_digest(key: Any) -> bytes:
    """SHA-256 of a cache key's text (its signature, the CPU's name and features, the code's hashes), with any
    object address left out (the same key in every process)."""
    return hashlib.sha256(re.sub(r" at 0x[0-9a-fA-F]+", "", repr(key)).encode()).digest()


class GuardedCache(FunctionCache):  # type: ignore[misc]
    """numba's per-function disk cache whose loads and saves never fail the call, with checksummed data files
    (see the module doc)."""

    def __init__(self, py_func: Any) -> None:
        super().__init__(py_func)
        self._cache_file = _CheckedCacheFile(
            self._cache_path, self._impl.filename_base, self._impl.locator.get_source_stamp()
        )

    def load_overload(self, sig: Any, target_context: Any) -> Any:
        try:
            found = super().load_overload(sig, target_context)
            if found is None:
                _announce()
            return found
        except Exception as exc:  # a corrupt index or data file: a miss, and the index rewritten by the save
            _warn_once(
                "corrupt",
                f"pynorm: numba's cache of {self._py_func.__name__} in {self._cache_path} could not be read "
                f"({type(exc).__name__}: {exc}); the kernels are recompiled and their cache entries rewritten",
            )
            try:
                os.unlink(self._cache_file._index_path)
            except OSError:
                pass
            return None

    def save_overload(self, sig: Any, data: Any) -> None:
        if getattr(self._impl.locator, "read_only", False):
            _warn_once(
                "read-only",
                f"pynorm: no writable directory for numba's cache (tried NUMBA_CACHE_DIR, beside the sources, the "
                f"user cache); kernels load from {self._cache_path} if it holds them, and what this process "
                f"compiles is not saved: set NUMBA_CACHE_DIR to a writable directory",
            )
            return
        try:
            super().save_overload(sig, data)
        except Exception as exc:
            _warn_once(
                "save",
                f"pynorm: a kernel could not be saved to numba's cache in {self._cache_path} "
                f"({type(exc).__name__}: {exc}); it stays compiled for this process",
            )
