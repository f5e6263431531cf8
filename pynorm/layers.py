"""Stateful layers around the functional ops, with torch-like names.

A layer holds ``params`` and ``grads`` dicts of arrays. ``forward(x)`` returns
``(y, ctx)``; ``backward(dy, ctx)`` *adds* the parameter gradients into
``grads`` and returns ``dx``. Nothing about a call is kept in ``self``, so one
layer can be applied several times in one graph (each call's ``ctx`` is
independent) and its gradients accumulate as in a framework.

>>> import numpy as np, pynorm.layers as L
>>> ln = L.LayerNorm(8)
>>> y, ctx = ln.forward(np.random.randn(4, 8).astype(np.float32))
>>> dx = ln.backward(np.ones_like(y), ctx)
>>> sorted(ln.grads)
['bias', 'weight']
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from . import functional as F
from .errors import ArgumentError, DTypeError, ShapeError

__all__ = ["LayerNorm", "RMSNorm"]


def _shape(normalized_shape: Any) -> tuple[int, ...]:
    shape = (normalized_shape,) if isinstance(normalized_shape, (int, np.integer)) else tuple(normalized_shape)
    if not shape or any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1 for d in shape):
        raise ArgumentError(f"normalized_shape must be a positive int or a tuple of them, got {normalized_shape!r}")
    return tuple(int(d) for d in shape)


def _dtype(dtype: Any) -> np.dtype[Any]:
    if isinstance(dtype, str) and dtype == "bfloat16":
        import ml_dtypes

        dtype = ml_dtypes.bfloat16
    dt = np.dtype(dtype)
    if dt.name not in F.FLOAT_DTYPES:
        raise DTypeError(f"dtype must be float16, bfloat16, float32 or float64, got {dt}")
    return dt


class _Norm:
    """Shared machinery: parameter storage, gradient accumulation, (de)serialisation."""

    op: str

    def __init__(self, normalized_shape: Any, eps: float, dtype: Any, xp: Any, backend: str | None) -> None:
        self.normalized_shape = _shape(normalized_shape)
        self.eps = F.check_eps(eps)
        self.dtype = _dtype(dtype)
        self.xp = np if xp is None else xp
        self.backend = backend
        self.params: dict[str, Any] = {}
        self.grads: dict[str, Any] = {}

    def _add_param(self, name: str, value: float) -> None:
        self.params[name] = self.xp.full(self.normalized_shape, value, dtype=self.dtype)
        self.grads[name] = self.xp.zeros(self.normalized_shape, dtype=self.dtype)

    def _axis(self, x: Any) -> int:
        k = len(self.normalized_shape)
        if getattr(x, "ndim", 0) < k or tuple(x.shape[x.ndim - k :]) != self.normalized_shape:
            raise ShapeError(
                f"x has shape {tuple(getattr(x, 'shape', ()))}, expected trailing dims {self.normalized_shape}"
            )
        return int(x.ndim - k)

    def _accumulate(self, names: tuple[str, ...], grads: tuple[Any, ...]) -> None:
        for n, g in zip(names, grads, strict=True):
            if n in self.params and g is not None:
                acc = self.grads[n].astype(np.float64) + g.astype(np.float64)
                self.grads[n] = acc.astype(self.dtype)

    def __call__(self, x: Any) -> tuple[Any, F.Context]:
        return self.forward(x)  # type: ignore[attr-defined, no-any-return]

    def zero_grad(self) -> None:
        """Reset every accumulated gradient to zero."""
        for n in self.grads:
            self.grads[n] = self.xp.zeros_like(self.grads[n])

    def state_dict(self) -> dict[str, Any]:
        """Copies of the parameters, by name."""
        return {n: p.copy() for n, p in self.params.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the parameters; names and shapes must match exactly (values are cast to the layer dtype)."""
        missing = set(self.params) - set(state)
        unexpected = set(state) - set(self.params)
        if missing or unexpected:
            raise ArgumentError(
                f"state dict does not match the layer: missing {sorted(missing)}, unexpected {sorted(unexpected)}"
            )
        new = {}
        for n, v in state.items():
            if tuple(v.shape) != self.normalized_shape:
                raise ShapeError(f"state[{n!r}] has shape {tuple(v.shape)}, expected {self.normalized_shape}")
            new[n] = self.xp.asarray(v).astype(self.dtype, copy=True)
        self.params.update(new)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the parameters to an ``.npz`` file (bfloat16 stored as its raw 16-bit pattern)."""
        arrays: dict[str, Any] = {"__dtype__": np.array(self.dtype.name)}
        for n, p in self.params.items():
            a = p.get() if hasattr(p, "get") else np.asarray(p)  # cupy -> numpy
            arrays[n] = a.view(np.uint16) if a.dtype.name == "bfloat16" else a
        np.savez(path, **arrays)

    def load(self, path: str | os.PathLike[str]) -> None:
        """Read parameters written by :meth:`save`."""
        with np.load(path) as f:
            dtype_name = str(f["__dtype__"]) if "__dtype__" in f else None
            state = {}
            for n in f.files:
                if n == "__dtype__":
                    continue
                a = f[n]
                if dtype_name == "bfloat16" and a.dtype == np.uint16:
                    a = a.view(_dtype("bfloat16"))
                state[n] = a
        self.load_state_dict(state)

    def __repr__(self) -> str:
        extra = ", ".join(f"{k}={v!r}" for k, v in self._conventions().items())
        return (
            f"{type(self).__name__}({self.normalized_shape}, eps={self.eps}, params={sorted(self.params)}, "
            f"dtype={self.dtype.name}{', ' + extra if extra else ''})"
        )

    def _conventions(self) -> dict[str, Any]:
        return {}

    @property
    def num_features(self) -> int:
        return math.prod(self.normalized_shape)


class LayerNorm(_Norm):
    """LayerNorm over the trailing ``normalized_shape`` dims (see :func:`pynorm.layer_norm_forward`).

    Parameters
    ----------
    normalized_shape : int or tuple, the trailing dims normalized together.
    eps : inside the root (default 1e-5, as PyTorch).
    elementwise_affine : create ``weight`` (and ``bias``) parameters.
    bias : create the ``bias`` parameter (when ``elementwise_affine``).
    dtype : parameter dtype (float32 by default).
    correction, eps_mode, weight_offset : the conventions of :func:`pynorm.layer_norm_forward`.
    backend : force a backend by name; ``xp`` : array module for the parameters
        (``numpy`` by default, ``cupy`` for GPU layers).

    ``weight`` starts at ones (zeros when ``weight_offset=1``, so the effective
    scale ``w + 1`` starts at one) and ``bias`` at zeros — not the ones of the
    first source document's code.
    """

    op = "layer_norm"

    def __init__(
        self,
        normalized_shape: Any,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        dtype: Any = np.float32,
        *,
        correction: int = 0,
        eps_mode: str = "var",
        weight_offset: float = 0.0,
        backend: str | None = None,
        xp: Any = None,
    ) -> None:
        super().__init__(normalized_shape, eps, dtype, xp, backend)
        conv = F.LAYER_NORM.validate(
            {"eps": eps, "correction": correction, "eps_mode": eps_mode, "weight_offset": weight_offset}
        )
        self.correction, self.eps_mode, self.weight_offset = conv["correction"], conv["eps_mode"], conv["weight_offset"]
        if elementwise_affine:
            self._add_param("weight", 1.0 - self.weight_offset)
            if bias:
                self._add_param("bias", 0.0)

    def _conventions(self) -> dict[str, Any]:
        c: dict[str, Any] = {}
        if self.correction:
            c["correction"] = self.correction
        if self.eps_mode != "var":
            c["eps_mode"] = self.eps_mode
        if self.weight_offset:
            c["weight_offset"] = self.weight_offset
        return c

    def forward(self, x: Any, *, out: Any = None) -> tuple[Any, F.Context]:
        """``(y, ctx)`` for input ``x`` whose trailing dims are ``normalized_shape``."""
        return F.layer_norm_forward(
            x,
            self.params.get("weight"),
            self.params.get("bias"),
            axis=self._axis(x),
            eps=self.eps,
            backend=self.backend,
            correction=self.correction,
            eps_mode=self.eps_mode,
            weight_offset=self.weight_offset,
            out=out,
        )

    def backward(self, dy: Any, ctx: F.Context) -> Any:
        """Add ``dweight``/``dbias`` into ``grads`` and return ``dx``."""
        g = F.layer_norm_backward(dy, ctx)
        self._accumulate(("weight", "bias"), (g.dweight, g.dbias))
        return g.dx


class RMSNorm(_Norm):
    """RMSNorm over the trailing ``normalized_shape`` dims (see :func:`pynorm.rms_norm_forward`).

    Parameters
    ----------
    normalized_shape : int or tuple.
    eps : inside the root (default 1e-6, as Hugging Face Llama).
    elementwise_affine : create the ``weight`` parameter.
    dtype : parameter dtype (float32 by default).
    weight_offset : 1.0 for Gemma's ``(1 + w)``; the weight then starts at zeros.
    backend, xp : as for :class:`LayerNorm`.
    """

    op = "rms_norm"

    def __init__(
        self,
        normalized_shape: Any,
        eps: float = 1e-6,
        elementwise_affine: bool = True,
        dtype: Any = np.float32,
        *,
        weight_offset: float = 0.0,
        backend: str | None = None,
        xp: Any = None,
    ) -> None:
        super().__init__(normalized_shape, eps, dtype, xp, backend)
        self.weight_offset = F.check_real(weight_offset, "weight_offset")
        if elementwise_affine:
            self._add_param("weight", 1.0 - self.weight_offset)

    def _conventions(self) -> dict[str, Any]:
        return {"weight_offset": self.weight_offset} if self.weight_offset else {}

    def forward(self, x: Any, *, out: Any = None) -> tuple[Any, F.Context]:
        """``(y, ctx)`` for input ``x`` whose trailing dims are ``normalized_shape``."""
        return F.rms_norm_forward(
            x,
            self.params.get("weight"),
            axis=self._axis(x),
            eps=self.eps,
            backend=self.backend,
            weight_offset=self.weight_offset,
            out=out,
        )

    def backward(self, dy: Any, ctx: F.Context) -> Any:
        """Add ``dweight`` into ``grads`` and return ``dx``."""
        g = F.rms_norm_backward(dy, ctx)
        self._accumulate(("weight",), (g.dweight,))
        return g.dx
