"""Variant tags: Python objects whose numba *type* names one choice on one axis of a kernel family.

A kernel takes a tag as an argument (``stat``, the statistic); the ``@overload``-ed pieces it calls
pick their implementation from the tag's type at compile time, so each variant compiles only its
own code. (Axes carried by data or by a yes/no choice -- a bias or not, streaming stores or not, a
residual input or not -- are optional arguments instead: ``None``-typed arguments whose branches
numba prunes.) Tags are cheap to pass (their numba type is
attached, ``_numba_type_``) and pickle with the cached kernels' signatures.
"""

from __future__ import annotations

from typing import Any

from numba import types
from numba.extending import NativeValue, models, register_model, unbox

from ...ops import families

__all__ = ["FUNCTIONS", "STATISTICS", "Tag", "TagType", "function", "record_of", "statistic"]


class TagType(types.Dummy):
    """The numba type of a :class:`Tag`: axis, choice and flags, all known at compile time."""

    def __init__(self, axis: str, choice: str, flags: tuple[tuple[str, Any], ...]) -> None:
        self.axis = axis
        self.choice = choice
        self.flags = dict(flags)
        shown = "".join(f",{k}={v}" for k, v in flags)
        super().__init__(f"{axis}[{choice}{shown}]")


register_model(TagType)(models.OpaqueModel)


@unbox(TagType)
def _unbox_tag(typ, obj, c):  # type: ignore[no-untyped-def]
    return NativeValue(c.context.get_dummy_value())


class Tag:
    """A choice on a variant axis, e.g. ``Tag("statistic", "centered")``."""

    __slots__ = ("_numba_type_", "axis", "choice", "flags")

    def __init__(self, axis: str, choice: str, **flags: Any) -> None:
        self.axis = axis
        self.choice = choice
        self.flags = flags
        self._numba_type_ = TagType(axis, choice, tuple(sorted(flags.items())))

    def __repr__(self) -> str:
        return f"Tag({self._numba_type_.name})"


_tags: dict[tuple[Any, ...], Tag] = {}


def _tag(axis: str, kind: str, choices: tuple[str, ...], **flags: Any) -> Tag:
    if kind not in choices:
        raise ValueError(f"the numba backend has no {axis} {kind!r} (it has {', '.join(choices)})")
    key = (axis, kind, *sorted(flags.items()))
    if key not in _tags:
        _tags[key] = Tag(axis, kind, **flags)
    return _tags[key]


#: statistics of the stats family (``OpSpec.variant.statistic``) with kernels here: those whose record names numba
#: pieces (:attr:`pynorm.ops.families.Statistic.numba`)
STATISTICS = tuple(n for n, s in families.STATISTICS.items() if s.numba)
#: functions of the element-wise family (``OpSpec.variant.function``) with kernels here
FUNCTIONS = tuple(n for n, f in families.FUNCTIONS.items() if f.numba)


def statistic(kind: str) -> Tag:
    """The tag of a statistic (a key of :data:`pynorm.ops.families.STATISTICS` with numba pieces)."""
    return _tag("statistic", kind, tuple(n for n, s in families.STATISTICS.items() if s.numba))


def record_of(stat: Any) -> families.Statistic:
    """The record of the statistic a tag (or its numba type) names."""
    return families.STATISTICS[stat.choice]


def function(kind: str, **flags: Any) -> Tag:
    """The tag of an element-wise function: ``"signed_power"`` (``sign(x) |x|^p``; flag ``exponent``: ``"half"``,
    ``"one"``, ``"two"`` or ``"any"``, the loops specialized at compile time) or ``"tanh"`` (``tanh(alpha x)``)."""
    return _tag("function", kind, FUNCTIONS, **flags)
