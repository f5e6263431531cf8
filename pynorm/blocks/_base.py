"""Shared machinery of the blocks: a parameter container, array-module helpers, initialisers.

A :class:`Module` holds ``params`` and ``grads`` dicts (as :mod:`pynorm.layers` does) and named
children (modules or pynorm layers); ``forward(...) -> (y, ctx)`` and ``backward(dy, ctx) -> dx``
keep nothing about a call in ``self``, so a module may appear several times in one graph.
Parameter gradients are *added* into ``grads`` in the parameter's dtype.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import numpy as np

from .._registry import get_backend
from ..errors import ArgumentError, DTypeError
from ..ops import check_positive_int as positive_int

__all__ = ["Module", "RngLike", "as_rng", "compute_dtype", "positive_int", "resolve_xp", "to_dtype", "xavier_normal"]

#: What every ``rng=`` argument of the blocks accepts (NumPy's ``rng`` convention, Scientific Python SPEC 7):
#: None (fresh OS entropy), an int seed >= 0, a ``SeedSequence`` or a ``numpy.random.Generator`` (used as
#: is, so modules built from one generator draw consecutive parts of its stream).
RngLike = int | np.integer | np.random.Generator | np.random.SeedSequence | None


def as_rng(rng: Any, name: str = "rng") -> np.random.Generator:
    """``numpy.random.default_rng(rng)`` for an :data:`RngLike` ``rng``, else ArgumentError naming ``name``."""
    seed = isinstance(rng, (int, np.integer)) and not isinstance(rng, bool) and bool(rng >= 0)
    if not (seed or rng is None or isinstance(rng, (np.random.Generator, np.random.SeedSequence))):
        raise ArgumentError(
            f"{name} must be None, an int seed >= 0, a numpy.random.SeedSequence or a numpy.random.Generator; "
            f"got {rng!r}"
        )
    return np.random.default_rng(rng)


def choice(v: Any, name: str, allowed: tuple[Any, ...]) -> Any:
    """``v`` if it is one of ``allowed``, else ArgumentError naming ``name``."""
    if not isinstance(v, (str, type(None))) or v not in allowed:
        raise ArgumentError(f"{name} must be one of {', '.join(map(repr, allowed))}; got {v!r}")
    return v


def to_dtype(dtype: Any, name: str = "dtype") -> np.dtype[Any]:
    """A float dtype (``"bfloat16"`` through ml_dtypes), else DTypeError naming ``name``."""
    if isinstance(dtype, str) and dtype == "bfloat16":
        import ml_dtypes

        dtype = ml_dtypes.bfloat16
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise DTypeError(f"{name} must be a float dtype, got {dtype!r}") from e
    if dt.name not in ("float16", "bfloat16", "float32", "float64"):
        raise DTypeError(f"{name} must be float16, bfloat16, float32 or float64, got {dt}")
    return dt


def compute_dtype(*dtypes: Any) -> np.dtype[Any]:
    """float64 when any of ``dtypes`` is float64, else float32: the precision products and element-wise
    math run in (16-bit activations are widened, never computed in)."""
    return np.dtype(np.float64) if any(np.dtype(d) == np.float64 for d in dtypes) else np.dtype(np.float32)


def resolve_xp(backend: str | None, xp: Any = None) -> Any:
    """The array module for ``backend`` (``cupy`` for a backend serving CuPy arrays), or ``xp`` if given."""
    if xp is not None:
        return xp
    if backend is not None and get_backend(backend).array_module == "cupy":
        import cupy

        return cupy
    return np


def xavier_normal(rng: np.random.Generator, fan_out: int, fan_in: int, gain: float = 1.0) -> np.ndarray:
    r"""Glorot/Xavier normal ``(fan_out, fan_in)`` matrix:
    :math:`\mathcal N(0, \mathrm{gain}^2 \cdot 2/(f_{in}+f_{out}))` (``torch.nn.init.xavier_normal_``;
    DeepNet's initialisation with ``gain = beta``)."""
    std = gain * math.sqrt(2.0 / (fan_in + fan_out))
    return np.asarray(rng.standard_normal((fan_out, fan_in)) * std)


def _has_params(obj: Any) -> bool:
    return isinstance(getattr(obj, "params", None), dict) and isinstance(getattr(obj, "grads", None), dict)


class Module:
    """Parameters (``params``), their accumulated gradients (``grads``) and named children."""

    def __init__(self, dtype: Any = np.float32, xp: Any = None, backend: str | None = None) -> None:
        self.dtype = to_dtype(dtype)
        self.backend = backend
        self.xp = resolve_xp(backend, xp)
        self.params: dict[str, Any] = {}
        self.grads: dict[str, Any] = {}
        self.children: dict[str, Any] = {}
        self._named: list[tuple[str, Any, str]] | None = None

    # -- parameters ---------------------------------------------------------------
    def add_param(self, name: str, value: Any) -> None:
        """Register parameter ``name`` (converted to this module's dtype and array module)."""
        self.params[name] = self.xp.asarray(np.asarray(value).astype(self.dtype))
        self.grads[name] = self.xp.zeros_like(self.params[name])
        self._named = None

    def accumulate(self, name: str, g: Any) -> None:
        """Add ``g`` into ``grads[name]`` (in the parameter's dtype)."""
        self.grads[name] += g.astype(self.grads[name].dtype, copy=False).reshape(self.grads[name].shape)

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Any, str]]:
        """``(dotted name, owner, key)`` of every parameter: ``owner.params[key]`` / ``owner.grads[key]``.

        The list is built once (the optimizer walks it every step); call :meth:`refresh` after adding
        children or parameters to a module some other way than :meth:`add_param`.
        """
        if self._named is None:
            self._named = list(_named(self, ""))
        for name, owner, key in self._named:
            yield f"{prefix}{name}", owner, key

    def refresh(self) -> None:
        """Forget the cached parameter list (after changing ``children`` or ``params`` by hand)."""
        self._named = None
        for child in self.children.values():
            if isinstance(child, Module):
                child.refresh()

    def zero_grad(self) -> None:
        """Reset every accumulated gradient (this module's and its children's) to zero."""
        for _, owner, key in self.named_parameters():
            owner.grads[key] = owner.xp.zeros_like(owner.grads[key])

    def num_parameters(self) -> int:
        return sum(int(o.params[k].size) for _, o, k in self.named_parameters())

    def __call__(self, *args: Any, **kw: Any) -> Any:
        return self.forward(*args, **kw)  # type: ignore[attr-defined]


def _named(obj: Any, prefix: str) -> Iterator[tuple[str, Any, str]]:
    if _has_params(obj):
        for k in obj.params:
            yield f"{prefix}{k}", obj, k
    for name, child in getattr(obj, "children", {}).items():
        if child is not None:
            yield from _named(child, f"{prefix}{name}.")
