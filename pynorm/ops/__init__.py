"""Declarative op specs: one :class:`OpSpec` per op (``pynorm/ops/<op>.py``).

The functional API, the layers, :mod:`pynorm.testing`, the demo, the benchmarks and the tests
read these specs instead of keeping their own per-op tables; the fast backends read the
kernel family and variant from them. Adding an op: ``docs/adding_an_op.md``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

from . import _spec
from ._spec import *  # noqa: F403  (the specs' vocabulary, re-exported: the names of _spec.__all__)
from ._spec import OpSpec
from .add_norm import ADD_LAYER_NORM, ADD_RMS_NORM
from .batch_norm import SPEC as BATCH_NORM
from .conditional_norm import CONDITIONAL_LAYER_NORM, CONDITIONAL_RMS_NORM
from .derf import SPEC as DERF
from .dyt import SPEC as DYT
from .group_norm import GROUP_NORM, INSTANCE_NORM
from .layer_norm import SPEC as LAYER_NORM
from .modality_norm import MODALITY_LAYER_NORM, MODALITY_RMS_NORM
from .norm_linear import LAYER_NORM_LINEAR, RMS_NORM_LINEAR
from .power_norm import SPEC as POWER_NORM
from .quant_norm import SPEC as QUANT_LAYER_NORM
from .rms_norm import SPEC as RMS_NORM
from .scale_norm import SPEC as SCALE_NORM

__all__ = [
    "ADD_LAYER_NORM",
    "ADD_RMS_NORM",
    "BATCH_NORM",
    "CONDITIONAL_LAYER_NORM",
    "CONDITIONAL_RMS_NORM",
    "DERF",
    "DYT",
    "GROUP_NORM",
    "INSTANCE_NORM",
    "LAYER_NORM",
    "LAYER_NORM_LINEAR",
    "MODALITY_LAYER_NORM",
    "MODALITY_RMS_NORM",
    "POWER_NORM",
    "QUANT_LAYER_NORM",
    "RMS_NORM",
    "RMS_NORM_LINEAR",
    "SCALE_NORM",
    "SPECS",
    "Served",
    "get",
    "on_change",
    "register",
    "unregister",
]
__all__ += _spec.__all__

#: every op, by name, in the order of the docs
SPECS: dict[str, OpSpec] = {
    s.name: s
    for s in (
        LAYER_NORM,
        RMS_NORM,
        SCALE_NORM,
        POWER_NORM,
        DYT,
        DERF,
        ADD_LAYER_NORM,
        ADD_RMS_NORM,
        MODALITY_LAYER_NORM,
        MODALITY_RMS_NORM,
        CONDITIONAL_LAYER_NORM,
        CONDITIONAL_RMS_NORM,
        QUANT_LAYER_NORM,
        LAYER_NORM_LINEAR,
        RMS_NORM_LINEAR,
        GROUP_NORM,
        INSTANCE_NORM,
        BATCH_NORM,
    )
}


def get(name: str) -> OpSpec:
    """The spec of op ``name`` (:class:`pynorm.errors.UnknownOpError` if there is none)."""
    from ..errors import UnknownOpError

    try:
        return SPECS[name]
    except (KeyError, TypeError):
        raise UnknownOpError(f"no op named {name!r} (ops: {', '.join(SPECS)})") from None


# ---------------------------------------------------------------------------
# ops made at run time

_version = [0]
_listeners: list[Callable[[], None]] = []
_BUILT_IN = frozenset(SPECS)


def on_change(listener: Callable[[], None]) -> None:
    """Call ``listener()`` after every :func:`register` / :func:`unregister` (the layers above keep caches of the
    ops: the registry's answers, the public functions)."""
    _listeners.append(listener)


def _changed() -> None:
    _version[0] += 1
    for f in _listeners:
        f()


def register(spec: OpSpec) -> OpSpec:
    """Add ``spec`` to :data:`SPECS` at run time: every table made from the specs (:class:`Served`: the backends'
    op tables, their families' implementations) serves it from then on, on each backend whose kernels implement its
    family and variant (the spec was checked against its family when it was made,
    :func:`pynorm.ops.families.check_spec`). :func:`pynorm.add_op` also makes its public functions.

    Raises ValueError if an op of that name exists (:func:`unregister` it first: built-in ops cannot be)."""
    if not isinstance(spec, OpSpec):
        raise TypeError(f"spec must be an OpSpec, got {type(spec).__name__}")
    if spec.name in SPECS:
        raise ValueError(f"an op named {spec.name!r} exists already")
    SPECS[spec.name] = spec
    _changed()
    return spec


def unregister(name: str) -> None:
    """Remove an op added by :func:`register` (built-in ops stay)."""
    if name in _BUILT_IN:
        raise ValueError(f"{name!r} is a built-in op: it cannot be unregistered")
    if name not in SPECS:
        raise ValueError(f"no op named {name!r} was registered")
    del SPECS[name]
    _changed()


_V = TypeVar("_V")


class Served(Mapping[str, _V], Generic[_V]):
    """op name -> ``make(spec)`` for every spec of :data:`SPECS` that ``serves(spec)``, live: an op registered
    later (:func:`register`) is in it. The backends' ``OPS`` tables and their families' ``OP_IMPLS`` are these
    (a value is made once per spec)."""

    def __init__(self, serves: Callable[[OpSpec], bool], make: Callable[[OpSpec], _V]) -> None:
        self._serves, self._make = serves, make
        self._table: dict[str, tuple[OpSpec, _V]] = {}
        self._seen = -1

    def _current(self) -> dict[str, tuple[OpSpec, _V]]:
        if self._seen != _version[0]:
            old: dict[str, tuple[OpSpec, _V]] = self._table
            table: dict[str, tuple[OpSpec, _V]] = {}
            self._seen = _version[0]  # first: a serves() that reads this table meets the entries made so far
            self._table = table
            for name, spec in SPECS.items():
                hit = old.get(name)
                if hit is not None and hit[0] is spec:
                    table[name] = hit
                elif self._serves(spec):
                    table[name] = (spec, self._make(spec))
        return self._table

    def __getitem__(self, name: str) -> _V:
        return self._current()[name][1]

    def __iter__(self) -> Iterator[str]:
        return iter(self._current())

    def __len__(self) -> int:
        return len(self._current())

    def __contains__(self, name: object) -> bool:
        return name in self._current()

    def __repr__(self) -> str:
        return f"Served({ {k: v for k, (_, v) in self._current().items()} })"
