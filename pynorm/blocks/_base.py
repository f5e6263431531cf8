"""Shared machinery of the blocks: a parameter container, array-module helpers, initialisers.

A :class:`Module` holds ``params`` and ``grads`` dicts (as :mod:`pynorm.layers` does) and named
children (modules or pynorm layers); ``forward(...) -> (y, ctx)`` and ``backward(dy, ctx) -> dx``
keep nothing about a call in ``self``, so a module may appear several times in one graph.
Parameter gradients are *added* into ``grads`` in the parameter's dtype.

The keyword options of the constructors are declared once: their types in ``TypedDict`` s
(:class:`ArrayKw`, :class:`InitKw` here, the attention's, block's and stack's next to those classes),
their defaults and order in :data:`OPTION_DEFAULTS`; :func:`keyword_options` turns an
``__init__(..., **kw: Unpack[SomeKw])`` into the plain keyword-only signature users see.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable, Iterator
from typing import Any, ForwardRef, TypedDict, TypeVar

import numpy as np

from .._registry import get_backend
from ..errors import ArgumentError, DTypeError
from ..ops import check_positive_int as positive_int

__all__ = [
    "OPTION_DEFAULTS",
    "ArrayKw",
    "InitKw",
    "Module",
    "RngLike",
    "as_rng",
    "compute_dtype",
    "keyword_options",
    "options_for",
    "positive_int",
    "resolve_xp",
    "to_dtype",
    "xavier_normal",
]

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


# ---------------------------------------------------------------------------------------------
# keyword options: types once (TypedDicts), defaults and order once (OPTION_DEFAULTS)


class ArrayKw(TypedDict, total=False):
    """Every module's last keywords: parameter ``dtype`` and array module (``backend``, ``xp``), as :class:`Module`."""

    dtype: Any
    backend: str | None
    xp: Any


class InitKw(ArrayKw, total=False):
    """:class:`ArrayKw` and ``rng``: the keywords of a module that initialises parameters."""

    rng: RngLike


#: The default of every keyword option taken through ``**kw: Unpack[...]`` by a blocks constructor, in the
#: order the signatures list them (a signature lists the options it has in this order).
OPTION_DEFAULTS: dict[str, Any] = {
    "placement": "pre",
    "norm": "layer",
    "modality_kind": "layer",
    "hybrid_layers": 0,
    "n_modalities": None,
    "final_norm": None,
    "input_norm": None,
    "mix_alpha": 0.25,
    "depth": 1,
    "qk_norm": None,
    "v_norm": False,
    "io_norms": False,
    "io_norm_kind": None,
    "causal": False,
    "qk_gain": 1.0,
    "v_gain": 1.0,
    "o_gain": 1.0,
    "alpha": None,
    "beta": None,
    "n_layers": None,
    "learnable_alpha": False,
    "eps": None,
    "checkpoint": False,
    "record": True,
    "rng": None,
    "dtype": np.float32,
    "backend": None,
    "xp": None,
}

_Init = TypeVar("_Init", bound=Callable[..., None])


def _annotation(tp: Any) -> Any:
    """A TypedDict item's annotation as the source spells it (a string, as ``from __future__ import annotations``
    leaves every other annotation)."""
    return tp.__forward_arg__ if isinstance(tp, ForwardRef) else tp


def keyword_options(options: Any, rest: str | None = None) -> Callable[[_Init], _Init]:
    """Decorate an ``__init__(self, ..., **kw: Unpack[options])`` so that callers see plain keywords.

    Parameters
    ----------
    options : the ``TypedDict`` of the keyword options (type checkers read it from the annotation).
    rest : the name of a ``**`` parameter that takes any other keyword (its items stay in ``kw``).

    Returns
    -------
    A decorator. The decorated ``__init__``'s ``__signature__`` (what :func:`inspect.signature` reports) has the
    function's own parameters, then each key of ``options`` as a keyword-only parameter with its default from
    :data:`OPTION_DEFAULTS` and its annotation from ``options``, in that table's order, then ``**rest``. A call
    is bound to that signature (an unknown keyword is a TypeError, as with a written-out signature) and the
    function receives ``kw`` with every option present, defaults filled in.
    """

    def decorate(init: _Init) -> _Init:
        written = inspect.signature(init)
        own = [p for p in written.parameters.values() if p.kind is not p.VAR_KEYWORD]
        names = [n for n in OPTION_DEFAULTS if n in options.__annotations__]
        missing = set(options.__annotations__) - set(names)
        if missing:
            raise TypeError(f"{init.__qualname__}: no default in OPTION_DEFAULTS for {sorted(missing)}")
        kw_only = inspect.Parameter.KEYWORD_ONLY
        params = own + [
            inspect.Parameter(
                n, kw_only, default=OPTION_DEFAULTS[n], annotation=_annotation(options.__annotations__[n])
            )
            for n in names
        ]
        if rest is not None:
            params.append(inspect.Parameter(rest, inspect.Parameter.VAR_KEYWORD, annotation="Any"))
        sig = written.replace(parameters=params)
        defaults = {n: OPTION_DEFAULTS[n] for n in names}

        @functools.wraps(init)
        def wrapper(*args: Any, **kw: Any) -> None:
            sig.bind(*args, **kw)
            init(*args, **{**defaults, **kw})

        wrapper.__signature__ = sig  # type: ignore[attr-defined]
        return wrapper  # type: ignore[return-value]

    return decorate


def options_for(target: Any, kw: Any, **override: Any) -> dict[str, Any]:
    """The items of ``kw`` that ``target`` (a class or function) takes as keyword-only parameters, updated by
    ``override``: how a module passes its options on to a child that shares some of them."""
    names = [p.name for p in inspect.signature(target).parameters.values() if p.kind is p.KEYWORD_ONLY]
    return {**{n: kw[n] for n in names if n in kw}, **override}


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
