"""pynorm: framework-free normalization layers with hand-written forward and backward.

Functional ops (``op``, ``op_forward``, ``op_backward`` for every op of :func:`list_ops`, made from the op specs
in :mod:`pynorm.ops`) for NumPy and CuPy arrays, stateful layers in :mod:`pynorm.layers`, Transformer blocks in
:mod:`pynorm.blocks`, a backend registry (``numpy`` reference, ``numba`` CPU, ``cupy`` GPU) and gradient-checking
tools in :mod:`pynorm.testing`. See ``docs/`` for the formulas and conventions.
"""

from __future__ import annotations

from typing import Any

from . import errors, functional
from ._api import add_op, remove_op
from ._plan import Plan, plan
from ._registry import (
    Backend,
    BackendInfo,
    get_num_threads,
    list_backends,
    list_ops,
    register_backend,
    set_num_threads,
    use_backend,
)
from .errors import *  # noqa: F403  (every error and warning class)
from .fpquant import Quantized, QuantSpec, dequantize, quantize
from .functional import *  # noqa: F403  (every op's three functions and gradient tuple, and Context)

__version__ = "0.1.0"

__all__ = [
    *functional.__all__,
    *errors.__all__,
    "Backend",
    "BackendInfo",
    "Plan",
    "QuantSpec",
    "Quantized",
    "__version__",
    "add_op",
    "deepnorm_constants",  # noqa: F405  (lazy: pynorm.deepnorm)
    "dequantize",
    "get_num_threads",
    "list_backends",
    "list_ops",
    "plan",
    "quantize",
    "register_backend",
    "remove_op",
    "set_num_threads",
    "use_backend",
]


def __getattr__(name: str) -> Any:
    # lazy submodules and names: keep ``import pynorm`` cheap
    if name in ("layers", "testing", "blocks", "dask", "jax"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    if name == "deepnorm_constants":
        from .deepnorm import deepnorm_constants

        return deepnorm_constants
    raise AttributeError(f"module 'pynorm' has no attribute {name!r}")
