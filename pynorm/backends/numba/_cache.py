"""The ``jit`` decorator of the ``numba`` backend, and a disk cache that stays correct across its files.

numba's on-disk cache (``cache=True``) revalidates a compiled function against the source of
the file that *defines* it only (numba/numba#8359): a kernel in one file whose helper in another
file changed would load stale machine code. The kernels here are split by piece over several
files, so :class:`SourceTreeLocator` -- inserted at the front of numba's cache locators -- stamps
every function of this package with one hash of all the package's source files, the numba
version and the llvmlite version: editing any file invalidates every cached kernel of the backend.
The cache directory is the one numba would pick (``NUMBA_CACHE_DIR`` when set, else ``__pycache__``
beside the sources, else the user-wide cache).

The locator must be in place when ``njit(cache=True)`` decorates (numba picks the locator then),
so every kernel module imports :func:`jit` from here. It relies on numba's private
``numba.core.caching`` API; when that is missing, or when ``NUMBA_CACHE_LOCATOR_CLASSES``
overrides the locators, the kernels are compiled with ``cache=False`` (and one warning says so).
"""

from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path
from typing import Any

import llvmlite
import numba
from numba import njit

__all__ = ["CACHING", "FM_SUM", "SOURCE_STAMP", "jit"]

#: the fastmath flags of the kernels' arithmetic (row sums reassociate and vectorize, products contract):
#: never ``nnan``/``ninf``, so NaN and Inf keep their IEEE meaning. Helpers whose rounding matters are
#: compiled with ``fastmath=False`` and keep it where they are inlined.
FM_SUM = {"reassoc", "contract"}

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

        def __init__(self, inner: Any) -> None:
            self._inner = inner
            self._py_file = getattr(inner, "_py_file", "")  # read by numba's cachability warnings

        def ensure_cache_path(self) -> None:
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
            return None

    SourceTreeLocator.__qualname__ = SourceTreeLocator.__name__
    classes.insert(0, SourceTreeLocator)
    return None


_why_not = _install()
#: whether kernels are cached on disk (False, with one warning, where the locator cannot be installed).
CACHING = _why_not is None
if not CACHING:
    warnings.warn(
        f"pynorm's numba kernels are compiled without a disk cache (cache=False): {_why_not}",
        stacklevel=2,
    )


def jit(fastmath: Any = False, inline: Any = "never") -> Any:
    """``njit`` with disk caching (see the module doc), no GIL, IEEE division (``error_model="numpy"``:
    1/0 is inf, not an exception) and an *explicit* fastmath setting.

    numba lets a callee without an explicit ``fastmath`` inherit its first caller's flags; every
    function of the backend states its own so the code is the same whichever kernel compiles it first.

    Compile time: no function gets a C-callable wrapper (``no_cfunc_wrapper``: none is passed as a first-class
    function), and the private helpers (names starting with ``_``, and every ``inline="always"`` piece), which
    only jitted code calls, get no Python wrapper either (``no_cpython_wrapper``): numba builds both for every
    signature of every function otherwise.
    """

    def decorate(fn: Any) -> Any:
        helper = inline == "always" or fn.__name__.startswith("_")
        options: dict[str, Any] = {"no_cfunc_wrapper": True, "no_cpython_wrapper": helper}
        return njit(
            cache=CACHING, nogil=True, fastmath=fastmath, inline=inline, error_model="numpy",
            **options,
        )(fn)  # fmt: skip

    return decorate
