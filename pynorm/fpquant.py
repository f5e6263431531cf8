"""FP8 / FP4 quantized outputs: :class:`QuantSpec`, :func:`quantize` and :func:`dequantize` on every backend.

A norm with ``quantize=QuantSpec(...)`` (``layer_norm``, ``rms_norm``, ``add_layer_norm``, ``add_rms_norm``)
is quantized where its backend's op serves the option (numba: each row in the norm's output pass,
``ctx.served == ("quantize",)``), else its float ``y`` is computed on its backend and that backend's quantizer
quantizes it (:func:`pynorm.ops.fp_quant.quantize_on`): the reference's (:mod:`pynorm.reference.fp_quant`, the
definition), numba's, or the CUDA kernels'; given the same ``y`` they return bitwise the same codes and scales.
See ``docs/norms/quantized_outputs.md``.
"""

from __future__ import annotations

from typing import Any

from . import _registry
from ._validate import as_array
from .errors import ArgumentError
from .ops.fp_quant import FORMATS, QUANTIZERS, Quantized, QuantSpec, check_quant_spec, quantize_on, quantizer_module

#: the backends with a quantizer of their own (:data:`pynorm.ops.fp_quant.QUANTIZERS`)
_QUANTIZING = frozenset(QUANTIZERS)

__all__ = ["FORMATS", "QuantSpec", "Quantized", "dequantize", "quantize", "quantize_on"]


def quantize(y: Any, spec: QuantSpec | str, *, axis: int = -1, backend: str | None = None) -> Quantized:
    """Quantize a float array ``y`` to FP8 / FP4 by ``spec`` (a :class:`QuantSpec` or a format name).

    Parameters
    ----------
    y : float array (NumPy or CuPy); its rows are ``y.shape[:axis]``, each of ``prod(y.shape[axis:])`` elements.
    spec : the format and its conventions (:class:`QuantSpec`).
    axis : the first dim of a row (default -1: rows along the last dim).
    backend : ``"numpy"`` (the reference), ``"numba"`` or ``"cupy"``; None: as the norms resolve it (a
        :func:`pynorm.use_backend` block's, ``PYNORM_BACKEND`` for arrays of its type, else the fastest available
        for the array type: numba for NumPy arrays where it is installed, the CUDA kernels for CuPy arrays). Every
        backend gives bitwise the reference's codes and scales; a backend without a quantizer of its own uses the
        reference's (NumPy arrays) or the CUDA kernels' (CuPy arrays). An unknown backend is a
        :class:`pynorm.errors.UnknownBackendError`, one serving other arrays than ``y``'s an
        :class:`pynorm.errors.ArrayTypeError`.

    Returns
    -------
    Quantized
        ``(codes, scales, global_scale, y, spec, shape)``; :func:`dequantize` gives back its float32 values.
    """
    qs = check_quant_spec(spec, "spec")
    if qs is None:
        raise ArgumentError("spec must be a pynorm.QuantSpec or a format name, got None")
    arr = as_array(y, "y")
    if arr.dtype.kind != "f" and str(arr.dtype) != "bfloat16":
        raise ArgumentError(f"y must be a float array, got dtype {arr.dtype}")
    if arr.ndim < 1:
        raise ArgumentError("y must have at least 1 dimension")
    if not -arr.ndim <= axis < arr.ndim:
        raise ArgumentError(f"axis {axis} is out of range for y of {arr.ndim} dimension(s)")
    family = _registry.array_family(arr)
    if backend is None:
        backend = _registry.preferred(family, _QUANTIZING)
    if backend is not None:  # (as the norms check a backend: an unknown name, or one serving other arrays, named)
        _registry.check_family(backend, family, "y")
    return quantize_on(backend, arr, qs, axis)


def dequantize(q: Quantized, *, backend: str | None = None) -> Any:
    """The float32 values a :class:`Quantized` stands for (``codes`` decoded times their scales), in its shape."""
    if not isinstance(q, Quantized):
        raise ArgumentError(f"q must be a pynorm.Quantized, got {type(q).__name__}")
    return quantizer_module(backend, q.codes).dequantize(q)
