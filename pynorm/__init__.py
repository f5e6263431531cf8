"""pynorm: framework-free normalization layers with hand-written forward and backward.

Functional ops (``op``, ``op_forward``, ``op_backward``) for NumPy and CuPy
arrays, stateful layers in :mod:`pynorm.layers`, a backend registry
(``numpy`` reference, ``numba`` CPU, ``cupy`` GPU) and gradient-checking tools
in :mod:`pynorm.testing`. See ``docs/`` for the formulas and conventions.
"""

from __future__ import annotations

from typing import Any

from ._registry import Backend, BackendInfo, list_backends, list_ops, register_backend, use_backend
from .blocks.deepnorm import deepnorm_constants
from .errors import (
    ArgumentError,
    ArrayTypeError,
    BackendUnavailableError,
    ContextError,
    DTypeError,
    PynormError,
    ShapeError,
    UnknownBackendError,
    UnknownOpError,
)
from .functional import (
    AddLayerNormGrads,
    AddRMSNormGrads,
    Context,
    DyTGrads,
    LayerNormGrads,
    ModalityLayerNormGrads,
    ModalityRMSNormGrads,
    PowerNormGrads,
    QuantLayerNormGrads,
    RMSNormGrads,
    ScaleNormGrads,
    add_layer_norm,
    add_layer_norm_backward,
    add_layer_norm_forward,
    add_rms_norm,
    add_rms_norm_backward,
    add_rms_norm_forward,
    conditional_layer_norm,
    conditional_layer_norm_backward,
    conditional_layer_norm_forward,
    conditional_rms_norm,
    conditional_rms_norm_backward,
    conditional_rms_norm_forward,
    dyt,
    dyt_backward,
    dyt_forward,
    layer_norm,
    layer_norm_backward,
    layer_norm_forward,
    layer_norm_linear,
    layer_norm_linear_backward,
    layer_norm_linear_forward,
    modality_layer_norm,
    modality_layer_norm_backward,
    modality_layer_norm_forward,
    modality_rms_norm,
    modality_rms_norm_backward,
    modality_rms_norm_forward,
    power_norm,
    power_norm_backward,
    power_norm_forward,
    quant_layer_norm,
    quant_layer_norm_backward,
    quant_layer_norm_forward,
    rms_norm,
    rms_norm_backward,
    rms_norm_forward,
    rms_norm_linear,
    rms_norm_linear_backward,
    rms_norm_linear_forward,
    scale_norm,
    scale_norm_backward,
    scale_norm_forward,
)

__version__ = "0.1.0"

__all__ = [
    "AddLayerNormGrads",
    "AddRMSNormGrads",
    "ArgumentError",
    "ArrayTypeError",
    "Backend",
    "BackendInfo",
    "BackendUnavailableError",
    "Context",
    "ContextError",
    "DTypeError",
    "DyTGrads",
    "LayerNormGrads",
    "ModalityLayerNormGrads",
    "ModalityRMSNormGrads",
    "PowerNormGrads",
    "PynormError",
    "QuantLayerNormGrads",
    "RMSNormGrads",
    "ScaleNormGrads",
    "ShapeError",
    "UnknownBackendError",
    "UnknownOpError",
    "__version__",
    "add_layer_norm",
    "add_layer_norm_backward",
    "add_layer_norm_forward",
    "add_rms_norm",
    "add_rms_norm_backward",
    "add_rms_norm_forward",
    "conditional_layer_norm",
    "conditional_layer_norm_backward",
    "conditional_layer_norm_forward",
    "conditional_rms_norm",
    "conditional_rms_norm_backward",
    "conditional_rms_norm_forward",
    "deepnorm_constants",
    "dyt",
    "dyt_backward",
    "dyt_forward",
    "get_num_threads",
    "layer_norm",
    "layer_norm_backward",
    "layer_norm_forward",
    "layer_norm_linear",
    "layer_norm_linear_backward",
    "layer_norm_linear_forward",
    "list_backends",
    "list_ops",
    "modality_layer_norm",
    "modality_layer_norm_backward",
    "modality_layer_norm_forward",
    "modality_rms_norm",
    "modality_rms_norm_backward",
    "modality_rms_norm_forward",
    "power_norm",
    "power_norm_backward",
    "power_norm_forward",
    "quant_layer_norm",
    "quant_layer_norm_backward",
    "quant_layer_norm_forward",
    "register_backend",
    "rms_norm",
    "rms_norm_backward",
    "rms_norm_forward",
    "rms_norm_linear",
    "rms_norm_linear_backward",
    "rms_norm_linear_forward",
    "scale_norm",
    "scale_norm_backward",
    "scale_norm_forward",
    "set_num_threads",
    "use_backend",
]


def set_num_threads(n: int) -> None:
    """Set the number of threads the ``numba`` backend uses (imports numba on first use)."""
    from .backends.numba import _threads

    _threads.set_num_threads(n)


def get_num_threads() -> int:
    """The number of threads the ``numba`` backend uses."""
    from .backends.numba import _threads

    return int(_threads.get_num_threads())


def __getattr__(name: str) -> Any:
    # lazy submodules: keep ``import pynorm`` cheap
    if name in ("layers", "testing", "blocks"):
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'pynorm' has no attribute {name!r}")
