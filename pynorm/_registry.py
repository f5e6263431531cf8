"""The backend registry: which implementation of an op runs for a given input.

A backend is a :class:`Backend` record: a name, the array type it serves (named
by module and class, so checking it never imports that library), a priority, the
import path of its package (imported lazily) and an availability probe. The
package defines ``OPS``, a mapping from op name to the submodule holding that
op's ``forward`` and ``backward``; importing the package itself must stay cheap.

Resolution order for one call:

1. the ``backend=`` argument;
2. the innermost :func:`use_backend` block (a :class:`contextvars.ContextVar`,
   so threads and asyncio tasks do not see each other's choices);
3. the ``PYNORM_BACKEND`` environment variable, for inputs of the array type
   that backend serves (other inputs ignore it);
4. the available backend of highest priority that serves the input's array
   type and implements the op.

1 and 2 (and 3, for its array type) are explicit: an unknown, unavailable or
unsuitable backend raises. 4 silently skips unavailable backends.
Third-party backends register with :func:`register_backend`, or through the
entry-point group ``pynorm.backends`` (each entry point loads a
:class:`Backend` or a zero-argument callable returning one).
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib
import importlib.util
import os
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from . import ops as _ops
from .errors import ArrayTypeError, BackendUnavailableError, UnknownBackendError, UnknownOpError

__all__ = [
    "Backend",
    "BackendInfo",
    "array_family",
    "family_of",
    "get_backend",
    "get_num_threads",
    "list_backends",
    "list_ops",
    "register_backend",
    "registered",
    "resolve",
    "set_num_threads",
    "use_backend",
]

ENV_VAR = "PYNORM_BACKEND"
ENTRY_POINT_GROUP = "pynorm.backends"


@dataclass(frozen=True)
class Backend:
    """A backend record.

    Parameters
    ----------
    name : registry name (``"numpy"``, ``"numba"``, ``"cupy"``...).
    array_module : top-level module of the array type served (``"numpy"``, ``"cupy"``).
    array_type : class name of that array type (``"ndarray"``).
    priority : automatic resolution prefers higher values.
    module : import path of the backend package (must define ``OPS``).
    probe : returns None when the backend can run here, else the reason it cannot.
        Called at most once (the answer is cached).
    threads : import path of the module controlling the backend's CPU threads (``set_num_threads(n)``,
        ``get_num_threads()``), for a backend that runs on a pool of threads; "" for none.
    """

    name: str
    array_module: str
    array_type: str
    priority: int
    module: str
    probe: Callable[[], str | None] = field(default=lambda: None, compare=False)
    threads: str = ""

    @property
    def array_type_name(self) -> str:
        return f"{self.array_module}.{self.array_type}"


@dataclass(frozen=True)
class BackendInfo:
    """What :func:`list_backends` reports about one backend."""

    name: str
    array_type: str
    priority: int
    available: bool
    reason: str | None
    ops: tuple[str, ...]


_lock = threading.RLock()
_backends: dict[str, Backend] = {}
_availability: dict[str, str | None] = {}
_modules: dict[str, ModuleType] = {}
_entry_points_loaded = False
_current: contextvars.ContextVar[str | None] = contextvars.ContextVar("pynorm_backend", default=None)


def register_backend(backend: Backend, *, replace: bool = False) -> None:
    """Add ``backend`` to the registry (``replace=True`` to overwrite a record of that name)."""
    if not isinstance(backend, Backend):
        raise TypeError(f"register_backend expects a pynorm.Backend record, got {type(backend).__name__}")
    with _lock:
        if backend.name in _backends and not replace:
            raise ValueError(f"a backend named {backend.name!r} is already registered (pass replace=True)")
        _backends[backend.name] = backend
        _memo.clear()
        _availability.pop(backend.name, None)
        _modules.pop(backend.name, None)
        for key in [k for k in _bound if k[0] == backend.name]:
            _bound.pop(key)


def _load_entry_points() -> None:
    global _entry_points_loaded
    if _entry_points_loaded:
        return
    with _lock:
        if _entry_points_loaded:
            return
        _entry_points_loaded = True
        from importlib.metadata import entry_points

        for ep in entry_points(group=ENTRY_POINT_GROUP):
            try:
                obj = ep.load()
                record = obj() if callable(obj) and not isinstance(obj, Backend) else obj
                if record.name not in _backends:
                    register_backend(record)
            except Exception as exc:  # a broken plug-in must not break pynorm
                import warnings

                warnings.warn(f"pynorm: entry point {ep.name!r} could not be loaded: {exc!r}", stacklevel=2)


def _all() -> dict[str, Backend]:
    _load_entry_points()
    return _backends


def get_backend(name: str) -> Backend:
    """The record registered as ``name``; :class:`UnknownBackendError` if there is none."""
    backends = _all()
    if not isinstance(name, str) or name not in backends:
        known = ", ".join(sorted(backends))
        raise UnknownBackendError(f"backend={name!r} is not a registered backend (registered: {known})")
    return backends[name]


def unavailable_reason(name: str) -> str | None:
    """None if backend ``name`` can run here, else why not (cached after the first probe)."""
    backend = get_backend(name)
    with _lock:
        if name not in _availability:
            try:
                reason = backend.probe()
            except Exception as exc:
                reason = f"availability probe failed: {exc!r}"
            _availability[name] = reason
        return _availability[name]


def backend_module(name: str) -> ModuleType:
    """Import (once) and return the package of backend ``name``."""
    with _lock:
        if name not in _modules:
            _modules[name] = importlib.import_module(get_backend(name).module)
        return _modules[name]


def _composites(name: str) -> dict[str, Any]:
    """The composite ops (:class:`pynorm.ops.Composite`) backend ``name`` offers without implementing them
    itself: those whose ``builds_on`` ops it all implements."""
    from .ops import SPECS

    try:
        own = set(backend_module(name).OPS)
    except (ImportError, AttributeError):
        return {}
    return {
        op: spec
        for op, spec in SPECS.items()
        if spec.family == "composite" and op not in own and set(getattr(spec.variant, "builds_on", ())) <= own
    }


def backend_ops(name: str) -> tuple[str, ...]:
    """Names of the ops backend ``name`` implements (imports its light package only): those its package
    lists in ``OPS``, then the composite ops built from them."""
    try:
        own = tuple(backend_module(name).OPS)
    except (ImportError, AttributeError):
        return ()
    return own + tuple(_composites(name))


_bound: dict[tuple[str, str], Any] = {}


def op_module(name: str, op: str) -> Any:
    """What implements ``op`` on backend ``name``: an object with ``forward``/``backward``.

    ``OPS[op]`` names a submodule of the backend package. That module is the implementation
    itself (``forward``/``backward`` functions), or -- for a module serving several ops, such as
    a kernel family -- it maps op names to implementations in ``OP_IMPLS``; options the backend leaves to a
    composite above it (``COMPOSED`` of its package: the casting policies) are bound around that implementation
    (:func:`_composed`). A composite op the package does not list is the composite's shared implementation bound
    to the backend (``<Composite.impl>.bind(op, name)``: it runs the ops it builds on, on this backend).
    """
    return _memoized(("op", name, op), lambda: (name, _op_module(name, op)))[1]


#: successful answers of :func:`resolve` and :func:`op_module` (a call of a small op spends most of its time in
#: Python, and the registry's checks and imports were a third of it): key -> (record, backend name, answer). An
#: entry holds while its backend's record is the registered one; :func:`register_backend` clears them all, and
#: the keys hold the registry's size, so removing a backend makes new keys.
_memo: dict[tuple[Any, ...], tuple[Backend, str, Any]] = {}


def _forget() -> None:
    """An op was registered or removed (:func:`pynorm.ops.register`): the remembered answers may name it."""
    with _lock:
        _memo.clear()
        _bound.clear()


_ops.on_change(_forget)


def _remembered(key: tuple[Any, ...]) -> tuple[str, Any] | None:
    """The ``(backend name, answer)`` remembered under ``key`` while it holds (see :data:`_memo`), else None."""
    hit = _memo.get((*key, len(_backends)))
    if hit is not None and _backends.get(hit[1]) is hit[0]:
        return hit[1], hit[2]
    return None


def _memoized(key: tuple[Any, ...], compute: Callable[[], tuple[str, Any]]) -> tuple[str, Any]:
    """``compute()`` (a ``(backend name, answer)`` pair), or its remembered value under ``key`` (see :data:`_memo`)."""
    hit = _remembered(key)
    if hit is not None:
        return hit
    name, answer = compute()
    full = (*key, len(_backends))
    _memo[full] = (_backends[name], name, answer)
    return name, answer


def _op_module(name: str, op: str) -> Any:
    pkg = backend_module(name)
    if op not in pkg.OPS:
        comp = _composites(name).get(op)
        if comp is None:
            raise UnknownOpError(
                f"backend {name!r} does not implement op {op!r} (it has: {', '.join(backend_ops(name))})"
            )
        with _lock:
            if (name, op) not in _bound:
                _bound[(name, op)] = importlib.import_module(comp.variant.impl).bind(op, name)
            return _bound[(name, op)]
    where = pkg.OPS[op]  # a submodule of the package if it has one of that name, else a module's import path
    inside = f"{pkg.__name__}.{where}"
    mod = importlib.import_module(inside if "." not in where and importlib.util.find_spec(inside) else where)
    impls = getattr(mod, "OP_IMPLS", None)
    return _composed(name, op, pkg, impls[op] if impls is not None else mod)


def _composed(name: str, op: str, pkg: ModuleType, impl: Any) -> Any:
    """``impl`` with the options composed above the backends bound around it: for each option of ``op``'s spec in
    :data:`pynorm.ops.families.COMPOSED` (``casting``) that the backend's package lists in its ``COMPOSED``
    (option -> the submodule of the backend's pieces for that composite), the composite's
    ``bind(op, name, impl, pieces)`` -- it runs the option's non-default values from the backend's own ops (the
    default goes straight to ``impl``). A backend implementing the option itself (the reference) lists nothing."""
    composed = getattr(pkg, "COMPOSED", None)
    if not composed:
        return impl
    from .ops import SPECS, families

    for option in families.composed_options(SPECS[op]):
        if option in composed:
            pieces = importlib.import_module(f"{pkg.__name__}.{composed[option]}")
            impl = importlib.import_module(families.COMPOSED[option][1]).bind(op, name, impl, pieces)
    return impl


def list_backends() -> list[BackendInfo]:
    """Every registered backend, highest priority first, with availability and reason."""
    out = []
    for b in sorted(_all().values(), key=lambda b: (-b.priority, b.name)):
        reason = unavailable_reason(b.name)
        out.append(BackendInfo(b.name, b.array_type_name, b.priority, reason is None, reason, backend_ops(b.name)))
    return out


def list_ops() -> dict[str, list[str]]:
    """Map every op name to the backends implementing it (available or not), by priority."""
    ops: dict[str, list[str]] = {}
    for b in sorted(_all().values(), key=lambda b: (-b.priority, b.name)):
        for op in backend_ops(b.name):
            ops.setdefault(op, []).append(b.name)
    return dict(sorted(ops.items()))


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[Backend]:
    """Run the enclosed calls on backend ``name`` (unless a call passes ``backend=``).

    Built on :mod:`contextvars`: the choice is local to the current thread or
    asyncio task. Raises :class:`UnknownBackendError` at once for unknown names and
    :class:`BackendUnavailableError` when the backend cannot run here.
    """
    backend = get_backend(name)
    reason = unavailable_reason(name)
    if reason is not None:
        raise BackendUnavailableError(f"backend {name!r} is unavailable: {reason}")
    token = _current.set(name)
    try:
        yield backend
    finally:
        _current.reset(token)


_FAMILIES: dict[type, tuple[str, str]] = {}


def array_family(a: Any) -> tuple[str, str]:
    """``(top-level module, class name)`` of an array's type, without importing anything (memoized per type:
    a call validates a dozen arrays)."""
    t = type(a)
    f = _FAMILIES.get(t)
    if f is None:
        f = _FAMILIES.setdefault(t, (t.__module__.partition(".")[0], t.__name__))
    return f


def registered() -> list[Backend]:
    """Every registered backend record (entry points included)."""
    return list(_all().values())


def family_of(arrays: tuple[Any, ...], names: tuple[str, ...]) -> tuple[str, str]:
    """The ``(module, class)`` of the arrays (None entries skipped); :class:`ArrayTypeError` naming two arguments
    of different types."""
    family: tuple[str, str] | None = None
    first = ""
    for a, n in zip(arrays, names, strict=True):
        if a is None:
            continue
        f = array_family(a)
        if family is None:
            family, first = f, n
        elif f != family:
            raise ArrayTypeError(
                f"arrays of different types cannot be mixed: {first} is {family[0]}.{family[1]} "
                f"but {n} is {f[0]}.{f[1]}"
            )
    assert family is not None
    return family


def resolve(
    op: str, arrays: tuple[Any, ...], names: tuple[str, ...], backend: str | None = None
) -> tuple[str, ModuleType]:
    """Pick the backend for ``op`` on ``arrays``; return ``(name, op module)``."""
    return resolve_family(op, family_of(arrays, names), names, backend)


#: ``os.environ``'s own store and :data:`ENV_VAR` as its key (CPython's ``os._Environ``: a dict of the encoded
#: names and values, which ``os.environ`` and ``putenv`` keep current), read by :func:`_env_backend`; None where
#: the platform's ``os.environ`` has none
_ENV_STORE: dict[Any, Any] | None = getattr(os.environ, "_data", None)
if type(_ENV_STORE) is not dict:
    _ENV_STORE = None
_ENV_KEY: Any = getattr(os.environ, "encodekey", lambda k: k)(ENV_VAR)


def _env_backend() -> str | None:
    """The backend :data:`ENV_VAR` names (None: unset or empty), as ``os.environ.get`` reads it at this call: a
    change made through ``os.environ`` holds at once. Its own store's entry is read first (``os.environ.get``
    encodes the name and decodes the value: 0.7 us of a 7 us call), the value decoded only when it is set."""
    if _ENV_STORE is not None and _ENV_KEY not in _ENV_STORE:
        return None
    return os.environ.get(ENV_VAR) or None


def resolve_family(
    op: str, family: tuple[str, str], names: tuple[str, ...], backend: str | None = None
) -> tuple[str, ModuleType]:
    """:func:`resolve` for arrays already known to be of one ``family`` (a ``(module, class)`` pair)."""
    explicit = backend if backend is not None else _current.get()
    env = None if explicit is not None else _env_backend()
    key = ("resolve", explicit, env, family, op)
    hit = _remembered(key)  # (before :func:`_memoized`: a repeated call makes no closure)
    if hit is not None:
        return hit
    return _memoized(key, lambda: _resolve(op, family, names, explicit, env))


def _resolve(op: str, family: tuple[str, str], names: tuple[str, ...], explicit: str | None, env: str | None) -> Any:
    if explicit is not None:
        _check_serves(explicit, family, op, names[0])
        return explicit, op_module(explicit, op)
    if env is not None:
        b = get_backend(env)
        if (b.array_module, b.array_type) == family:
            _check_serves(env, family, op, names[0])
            return env, op_module(env, op)
    for b in sorted(_all().values(), key=lambda b: (-b.priority, b.name)):
        if (b.array_module, b.array_type) != family:
            continue
        if unavailable_reason(b.name) is None and op in backend_ops(b.name):
            return b.name, op_module(b.name, op)
    raise ArrayTypeError(
        f"no available backend implements {op!r} for {names[0]} of type {family[0]}.{family[1]}; "
        f"pass a numpy.ndarray or install a backend for this array type"
    )


def preferred(family: tuple[str, str], among: frozenset[str]) -> str | None:
    """The backend that ``backend=None`` picks for arrays of ``family`` among the names ``among``, for a
    capability other than an op (``pynorm.quantize``'s quantizers), by rules 2-4 of the module doc: the innermost
    :func:`use_backend` block's backend, ``PYNORM_BACKEND``'s for arrays of its type (either as it is: the caller
    treats one outside ``among``), else the available one of ``among`` of highest priority that serves
    ``family``; None where none does."""
    explicit = _current.get()
    if explicit is not None:
        return explicit
    env = _env_backend()
    if env is not None:
        b = get_backend(env)
        if (b.array_module, b.array_type) == family:
            return env
    key = ("preferred", family, among)
    hit = _remembered(key)
    if hit is not None:
        return hit[0]
    found = [
        b.name for b in sorted(_all().values(), key=lambda b: (-b.priority, b.name))
        if (b.array_module, b.array_type) == family and b.name in among and unavailable_reason(b.name) is None
    ]  # fmt: skip
    return _memoized(key, lambda: (found[0], None))[0] if found else None


def check_family(name: str, family: tuple[str, str], argname: str) -> None:
    """That backend ``name`` is registered (else :class:`UnknownBackendError`) and serves arrays of ``family``,
    those of the argument ``argname`` (else :class:`ArrayTypeError`)."""
    b = get_backend(name)
    if (b.array_module, b.array_type) != family:
        raise ArrayTypeError(f"backend {name!r} serves {b.array_type_name}, but {argname} is {family[0]}.{family[1]}")


def _check_serves(name: str, family: tuple[str, str], op: str, argname: str) -> None:
    check_family(name, family, argname)
    reason = unavailable_reason(name)
    if reason is not None:
        raise BackendUnavailableError(f"backend {name!r} is unavailable: {reason}")
    if op not in backend_ops(name):
        raise UnknownOpError(f"backend {name!r} does not implement op {op!r}")


# ---------------------------------------------------------------------------
# built-in backends


def _probe_numba() -> str | None:
    if importlib.util.find_spec("numba") is None:
        return "numba is not installed (pip install 'pynorm[numba]')"
    try:
        import numba  # noqa: F401
    except Exception as exc:  # pragma: no cover - broken installs
        return f"numba failed to import: {exc!r}"
    return None


def _probe_cupy() -> str | None:
    if "cupy" not in sys.modules and importlib.util.find_spec("cupy") is None:
        return "cupy is not installed (pip install 'pynorm[cupy]')"
    try:
        import cupy
    except Exception as exc:
        return f"cupy failed to import: {exc!r}"
    try:
        if not cupy.is_available():
            return "cupy imports but sees no CUDA device (cupy.is_available() is False)"
    except Exception as exc:
        return f"cupy.is_available() raised {exc!r}"
    return None


def _thread_controls() -> list[Any]:
    """The thread-control modules of the registered backends that run here and have one."""
    return [
        importlib.import_module(b.threads)
        for b in sorted(_all().values(), key=lambda b: (-b.priority, b.name))
        if b.threads and unavailable_reason(b.name) is None
    ]


def set_num_threads(n: int | None) -> None:
    """Cap the CPU threads every call of a threaded backend (``numba``) uses, from any Python thread; ``None``
    removes the cap. ``n`` must be an int between 1 and the backend's limit (``NUMBA_NUM_THREADS``)."""
    for control in _thread_controls():
        control.set_num_threads(n)


def get_num_threads() -> int:
    """The threads a large call of the first threaded backend (``numba``) would use; 1 where none runs here."""
    controls = _thread_controls()
    return int(controls[0].get_num_threads()) if controls else 1


register_backend(Backend("numpy", "numpy", "ndarray", 0, "pynorm.reference"))
register_backend(
    Backend("numba", "numpy", "ndarray", 10, "pynorm.backends.numba", _probe_numba, "pynorm.backends.numba._threads")
)
register_backend(Backend("cupy", "cupy", "ndarray", 10, "pynorm.backends.cupy", _probe_cupy))
