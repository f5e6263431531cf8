"""Exception types raised by pynorm.

Every error raised for bad input is a subclass of :class:`ValueError` or
:class:`TypeError` (so ordinary ``except ValueError`` code keeps working) and of
:class:`PynormError` (so callers can catch everything pynorm raises on purpose).
Messages name the offending argument and what was expected.
"""

from __future__ import annotations

__all__ = [
    "ArgumentError",
    "ArgumentTypeError",
    "ArrayTypeError",
    "BackendUnavailableError",
    "ContextError",
    "DTypeError",
    "PynormError",
    "PynormWarning",
    "RechunkWarning",
    "ShapeError",
    "UnknownBackendError",
    "UnknownOpError",
]


class PynormError(Exception):
    """Base class of every exception pynorm raises on purpose."""


class ShapeError(PynormError, ValueError):
    """An array has a shape that does not fit the operation (weight shape, axis...)."""


class DTypeError(PynormError, TypeError):
    """An array has an unsupported dtype, or dtypes that must agree do not."""


class ArgumentError(PynormError, ValueError):
    """A scalar option is out of range or of the wrong kind (eps, correction, eps_mode...)."""


class ArgumentTypeError(PynormError, TypeError):
    """An argument of the wrong kind: a function where one is expected (the oracle's ``forward``), a flag..."""


class ArrayTypeError(PynormError, TypeError):
    """Arrays of different libraries were mixed, or an object is not an array at all."""


class ContextError(PynormError, TypeError):
    """A ``ctx`` passed to a backward function was not produced by the matching forward."""


class UnknownBackendError(PynormError, ValueError):
    """A backend name that is not registered."""


class UnknownOpError(PynormError, ValueError):
    """An op name that no backend implements."""


class BackendUnavailableError(PynormError, RuntimeError):
    """An explicitly requested backend cannot run here; the message says why."""


class PynormWarning(UserWarning):
    """Base class of every warning pynorm issues on purpose."""


class RechunkWarning(PynormWarning):
    """:mod:`pynorm.dask` had to rechunk a large array (the normalized dims must form one chunk)."""
