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

__all__ = [
    "AddNorm",
    "ConditionalLayerNorm",
    "ConditionalRMSNorm",
    "DyT",
    "LayerNorm",
    "LayerNormLinear",
    "ModalityNorm",
    "PowerNorm",
    "QuantLayerNorm",
    "RMSNorm",
    "RMSNormLinear",
    "ScaleNorm",
]


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
            expected = tuple(self.params[n].shape)
            if tuple(v.shape) != expected:
                raise ShapeError(f"state[{n!r}] has shape {tuple(v.shape)}, expected {expected}")
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
    correction, eps_mode, weight_offset, casting : the conventions of :func:`pynorm.layer_norm_forward`.
    backend : force a backend by name; ``xp`` : array module for the parameters
        (``numpy`` by default, ``cupy`` for GPU layers).

    Notes
    -----
    ``weight`` starts at ones (zeros when ``weight_offset=1``, so the effective
    scale ``w + 1`` starts at one) and ``bias`` at zeros — not the ones of the
    tutorial LayerNorms that circulate with that bug.
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
        casting: str = "fp32",
        backend: str | None = None,
        xp: Any = None,
    ) -> None:
        super().__init__(normalized_shape, eps, dtype, xp, backend)
        conv = F.LAYER_NORM.validate(
            {"eps": eps, "correction": correction, "eps_mode": eps_mode, "weight_offset": weight_offset,
             "casting": casting}
        )  # fmt: skip
        self.correction, self.eps_mode, self.weight_offset = conv["correction"], conv["eps_mode"], conv["weight_offset"]
        self.casting = conv["casting"]
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
        if self.casting != "fp32":
            c["casting"] = self.casting
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
            casting=self.casting,
            out=out,
        )

    def backward(self, dy: Any, ctx: F.Context) -> Any:
        """Add ``dweight``/``dbias`` into ``grads`` and return ``dx``."""
        g = F.layer_norm_backward(dy, ctx)
        self._accumulate(("weight", "bias"), (g.dweight, g.dbias))
        return g.dx


class QuantLayerNorm(LayerNorm):
    """The quantization-friendly LayerNorm (:func:`pynorm.quant_layer_norm_forward`) as a layer: int8 or float
    input, float or int8 output, the LayerNorm parameters and conventions.

    Parameters
    ----------
    normalized_shape, eps, elementwise_affine, bias, dtype, correction, eps_mode, weight_offset, backend, xp :
        as :class:`LayerNorm`.
    quantize : None (float output), ``"tensor"`` or ``"row"`` (int8 output, ``(q, s)``).
    out_scale : a given output scale (a calibrated static scale) instead of ``amax / 127``.

    Notes
    -----
    ``forward(x, x_scale=None)`` takes the scale of an int8 ``x`` per call (activations' scales change from
    batch to batch); ``backward(dy, ctx)`` takes the gradient w.r.t. the dequantized output
    (straight-through) and returns ``dx`` w.r.t. the real input.
    """

    op = "quant_layer_norm"

    def __init__(
        self,
        normalized_shape: Any,
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        dtype: Any = np.float32,
        *,
        quantize: str | None = None,
        out_scale: float | None = None,
        correction: int = 0,
        eps_mode: str = "var",
        weight_offset: float = 0.0,
        backend: str | None = None,
        xp: Any = None,
    ) -> None:
        super().__init__(
            normalized_shape, eps, elementwise_affine, bias, dtype, correction=correction, eps_mode=eps_mode,
            weight_offset=weight_offset, backend=backend, xp=xp,
        )  # fmt: skip
        conv = F.QUANT_LAYER_NORM.validate({"eps": eps, "quantize": quantize, "out_scale": out_scale}, 2)
        self.quantize, self.out_scale = conv["quantize"], conv["out_scale"]

    def _conventions(self) -> dict[str, Any]:
        c = super()._conventions()
        if self.quantize is not None:
            c["quantize"] = self.quantize
        if self.out_scale is not None:
            c["out_scale"] = self.out_scale
        return c

    def forward(self, x: Any, *, x_scale: Any = None, out: Any = None) -> tuple[Any, F.Context]:  # type: ignore[override]
        """``(y, ctx)``, or ``((q, s), ctx)`` when quantizing, for ``x`` (int8 with ``x_scale``, or float)."""
        return F.quant_layer_norm_forward(  # type: ignore[no-any-return]
            x, self.params.get("weight"), self.params.get("bias"), x_scale=x_scale, quantize=self.quantize,
            out_scale=self.out_scale, axis=self._axis(x), eps=self.eps, backend=self.backend,
            correction=self.correction, eps_mode=self.eps_mode, weight_offset=self.weight_offset, out=out,
        )  # fmt: skip

    def backward(self, dy: Any, ctx: F.Context) -> Any:
        """Add ``dweight``/``dbias`` into ``grads`` and return ``dx`` (w.r.t. the real input)."""
        g = F.quant_layer_norm_backward(dy, ctx)
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
    casting : the rounding sequence of :func:`pynorm.rms_norm_forward` (``"llama"``, ``"gemma"``...).
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
        casting: str = "fp32",
        backend: str | None = None,
        xp: Any = None,
    ) -> None:
        super().__init__(normalized_shape, eps, dtype, xp, backend)
        conv = F.RMS_NORM.validate({"eps": eps, "weight_offset": weight_offset, "casting": casting})
        self.weight_offset, self.casting = conv["weight_offset"], conv["casting"]
        if elementwise_affine:
            self._add_param("weight", 1.0 - self.weight_offset)

    def _conventions(self) -> dict[str, Any]:
        c: dict[str, Any] = {"weight_offset": self.weight_offset} if self.weight_offset else {}
        if self.casting != "fp32":
            c["casting"] = self.casting
        return c

    def forward(self, x: Any, *, out: Any = None) -> tuple[Any, F.Context]:
        """``(y, ctx)`` for input ``x`` whose trailing dims are ``normalized_shape``."""
        return F.rms_norm_forward(
            x,
            self.params.get("weight"),
            axis=self._axis(x),
            eps=self.eps,
            backend=self.backend,
            weight_offset=self.weight_offset,
            casting=self.casting,
            out=out,
        )

    def backward(self, dy: Any, ctx: F.Context) -> Any:
        """Add ``dweight`` into ``grads`` and return ``dx``."""
        g = F.rms_norm_backward(dy, ctx)
        self._accumulate(("weight",), (g.dweight,))
        return g.dx


class ScaleNorm(_Norm):
    """ScaleNorm over the trailing ``normalized_shape`` dims (see :func:`pynorm.scale_norm_forward`).

    Parameters
    ----------
    normalized_shape : int or tuple, the trailing dims normalized together (``d`` elements).
    g_init : the initial value of the learnable scalar ``g``; None (default) gives ``sqrt(d)``, the
        paper's choice; ``1.0`` is fairseq's and GPT-NeoX's.
    eps, eps_mode : see :func:`pynorm.scale_norm_forward` (default ``1e-5``, ``"floor"``).
    dtype, backend, xp : as for :class:`LayerNorm`.
    """

    op = "scale_norm"

    def __init__(
        self,
        normalized_shape: Any,
        g_init: float | None = None,
        eps: float = 1e-5,
        eps_mode: str = "floor",
        dtype: Any = np.float32,
        *,
        backend: str | None = None,
        xp: Any = None,
    ) -> None:
        super().__init__(normalized_shape, eps, dtype, xp, backend)
        self.eps_mode = F.SCALE_NORM.validate({"eps": eps, "eps_mode": eps_mode})["eps_mode"]
        g0 = math.sqrt(self.num_features) if g_init is None else F.check_real(g_init, "g_init")
        self.params["g"] = self.xp.full((1,), g0, dtype=self.dtype)
        self.grads["g"] = self.xp.zeros((1,), dtype=self.dtype)

    def _conventions(self) -> dict[str, Any]:
        return {"eps_mode": self.eps_mode} if self.eps_mode != "floor" else {}

    def forward(self, x: Any, *, out: Any = None) -> tuple[Any, F.Context]:
        """``(y, ctx)`` for input ``x`` whose trailing dims are ``normalized_shape``."""
        return F.scale_norm_forward(
            x, self.params["g"], axis=self._axis(x), eps=self.eps, eps_mode=self.eps_mode, backend=self.backend, out=out
        )

    def backward(self, dy: Any, ctx: F.Context) -> Any:
        """Add ``dg`` into ``grads`` and return ``dx``."""
        g = F.scale_norm_backward(dy, ctx)
        self._accumulate(("g",), (g.dg,))
        return g.dx


class PowerNorm(_Norm):
    """The signed-power "PowerNorm" of normalization tutorials ``w * sign(x) * |x|**p + b`` (see
    :func:`pynorm.power_norm_forward`; not Shen et al.'s batch PowerNorm).

    Parameters
    ----------
    normalized_shape : int or tuple, the shape of ``w`` and ``b`` (the trailing dims of ``x``).
    p : the exponent, > 0 (default 0.5).
    elementwise_affine, bias : create ``weight`` (ones) and ``bias`` (zeros).
    dtype, backend, xp : as for :class:`LayerNorm`.
    """

    op = "power_norm"

    def __init__(
        self,
        normalized_shape: Any,
        p: float = 0.5,
        elementwise_affine: bool = True,
        bias: bool = True,
        dtype: Any = np.float32,
        *,
        backend: str | None = None,
        xp: Any = None,
    ) -> None:
        super().__init__(normalized_shape, 0.0, dtype, xp, backend)
        self.p = F.POWER_NORM.validate({"p": p})["p"]
        if elementwise_affine:
            self._add_param("weight", 1.0)
            if bias:
                self._add_param("bias", 0.0)

    def _conventions(self) -> dict[str, Any]:
        return {"p": self.p}

    def forward(self, x: Any, *, out: Any = None) -> tuple[Any, F.Context]:
        """``(y, ctx)`` for input ``x`` whose trailing dims are ``normalized_shape``."""
        return F.power_norm_forward(
            x, self.params.get("weight"), self.params.get("bias"), p=self.p, axis=self._axis(x), backend=self.backend,
            out=out,
        )  # fmt: skip

    def backward(self, dy: Any, ctx: F.Context) -> Any:
        """Add ``dweight``/``dbias`` into ``grads`` and return ``dx``."""
        g = F.power_norm_backward(dy, ctx)
        self._accumulate(("weight", "bias"), (g.dweight, g.dbias))
        return g.dx


class DyT(_Norm):
    """DyT ``w * tanh(alpha * x) + b`` over the trailing ``normalized_shape`` dims (see :func:`pynorm.dyt_forward`).

    Parameters
    ----------
    normalized_shape : int or tuple, the shape of ``w`` and ``b``.
    alpha_init : the initial value of the learnable scalar ``alpha`` (0.5, the paper's default for
        most layers; the LLaMA variant of the paper uses other values per position).
    elementwise_affine, bias : create ``weight`` (ones) and ``bias`` (zeros).
    dtype, backend, xp : as for :class:`LayerNorm`.
    """

    op = "dyt"

    def __init__(
        self,
        normalized_shape: Any,
        alpha_init: float = 0.5,
        elementwise_affine: bool = True,
        bias: bool = True,
        dtype: Any = np.float32,
        *,
        backend: str | None = None,
        xp: Any = None,
    ) -> None:
        super().__init__(normalized_shape, 0.0, dtype, xp, backend)
        self.params["alpha"] = self.xp.full((1,), F.check_real(alpha_init, "alpha_init"), dtype=self.dtype)
        self.grads["alpha"] = self.xp.zeros((1,), dtype=self.dtype)
        if elementwise_affine:
            self._add_param("weight", 1.0)
            if bias:
                self._add_param("bias", 0.0)

    def forward(self, x: Any, *, out: Any = None) -> tuple[Any, F.Context]:
        """``(y, ctx)`` for input ``x`` whose trailing dims are ``normalized_shape``."""
        return F.dyt_forward(
            x, self.params["alpha"], self.params.get("weight"), self.params.get("bias"), axis=self._axis(x),
            backend=self.backend, out=out,
        )  # fmt: skip

    def backward(self, dy: Any, ctx: F.Context) -> Any:
        """Add ``dalpha``/``dweight``/``dbias`` into ``grads`` and return ``dx``."""
        g = F.dyt_backward(dy, ctx)
        self._accumulate(("alpha", "weight", "bias"), (g.dalpha, g.dweight, g.dbias))
        return g.dx


class AddNorm(_Norm):
    """The fused residual add + norm: ``h = x + alpha * residual``, ``y = norm(h)`` (see
    :func:`pynorm.add_layer_norm_forward`); the Pre-LN / Post-LN / DeepNorm building block.

    Parameters
    ----------
    normalized_shape : int or tuple.
    kind : ``"layer"`` (LayerNorm, default) or ``"rms"``.
    alpha : the residual scale (1.0; DeepNorm's alpha for its up-weighted skip).
    residual_dtype : dtype of the residual stream ``h`` (None: ``x``'s; ``"float32"`` for half activations).
    eps : default 1e-5 (LayerNorm) / 1e-6 (RMSNorm).
    elementwise_affine, bias : create ``weight`` (and, for LayerNorm, ``bias``).
    dtype, backend, xp, correction, eps_mode, weight_offset : as for :class:`LayerNorm` (the conventions of
        ``kind="layer"``; ``kind="rms"`` uses only ``weight_offset``).

    Notes
    -----
    ``forward(x, residual) -> ((y, h), ctx)``; ``backward(dy, ctx, dh=None) -> (dx, dresidual)``.
    """

    def __init__(
        self,
        normalized_shape: Any,
        kind: str = "layer",
        alpha: float = 1.0,
        residual_dtype: Any = None,
        eps: float | None = None,
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
        if kind not in ("layer", "rms"):
            raise ArgumentError(f"kind must be 'layer' or 'rms', got {kind!r}")
        self.kind = kind
        spec = F.ADD_LAYER_NORM if kind == "layer" else F.ADD_RMS_NORM
        self.op = spec.name
        super().__init__(
            normalized_shape, (1e-5 if kind == "layer" else 1e-6) if eps is None else eps, dtype, xp, backend
        )
        opts = {"eps": self.eps, "weight_offset": weight_offset, "alpha": alpha, "residual_dtype": residual_dtype}
        if kind == "layer":
            opts |= {"correction": correction, "eps_mode": eps_mode}
        self.options = spec.validate(opts)
        self.weight_offset = self.options["weight_offset"]
        if elementwise_affine:
            self._add_param("weight", 1.0 - self.weight_offset)
            if bias and kind == "layer":
                self._add_param("bias", 0.0)

    def _conventions(self) -> dict[str, Any]:
        return {"kind": self.kind, **{k: v for k, v in self.options.items() if k != "eps"}}

    def forward(self, x: Any, residual: Any, *, out: Any = None) -> tuple[tuple[Any, Any], F.Context]:
        """``((y, h), ctx)`` for input ``x`` and the residual stream ``residual`` (x's shape)."""
        if self.kind == "layer":
            return F.add_layer_norm_forward(
                x, residual, self.params.get("weight"), self.params.get("bias"), axis=self._axis(x),
                backend=self.backend, out=out, **self.options,
            )  # fmt: skip
        return F.add_rms_norm_forward(
            x, residual, self.params.get("weight"), axis=self._axis(x), backend=self.backend, out=out, **self.options
        )

    def backward(self, dy: Any, ctx: F.Context, dh: Any = None) -> tuple[Any, Any]:
        """Add the parameter gradients into ``grads``; return ``(dx, dresidual)`` (``dh``: the gradient at ``h``)."""
        if self.kind == "layer":
            gl = F.add_layer_norm_backward(dy, ctx, dh)
            self._accumulate(("weight", "bias"), (gl.dweight, gl.dbias))
            return gl.dx, gl.dresidual
        gr = F.add_rms_norm_backward(dy, ctx, dh)
        self._accumulate(("weight",), (gr.dweight,))
        return gr.dx, gr.dresidual


class ModalityNorm(_Norm):
    """LayerNorm or RMSNorm with per-modality parameters (modality-specific normalization of multimodal Transformers).

    Parameters
    ----------
    normalized_shape : int or tuple.
    n_modalities : ``M``, the number of modalities (text, image, audio...).
    kind : ``"layer"`` (default) or ``"rms"``.
    mode : ``"specific"`` (default): one parameter set per modality, ``(M, *normalized_shape)``
        tables, row ``ids[i]`` serving row ``i`` (:func:`pynorm.modality_layer_norm_forward`);
        ``"shared"``: one parameter set for every modality (a plain norm; the ids are checked and
        otherwise ignored) -- the hybrid stacks use specific norms in low layers, shared above.
    eps, elementwise_affine, bias, dtype, backend, xp, correction, eps_mode, weight_offset : as for
        :class:`LayerNorm` (eps defaults to 1e-5 for LayerNorm, 1e-6 for RMSNorm).

    Notes
    -----
    ``forward(x, modality_ids) -> (y, ctx)``; ``backward(dy, ctx) -> dx``.
    """

    def __init__(
        self,
        normalized_shape: Any,
        n_modalities: int,
        kind: str = "layer",
        mode: str = "specific",
        eps: float | None = None,
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
        if kind not in ("layer", "rms"):
            raise ArgumentError(f"kind must be 'layer' or 'rms', got {kind!r}")
        if mode not in ("specific", "shared"):
            raise ArgumentError(f"mode must be 'specific' or 'shared', got {mode!r}")
        if isinstance(n_modalities, bool) or not isinstance(n_modalities, (int, np.integer)) or n_modalities < 1:
            raise ArgumentError(f"n_modalities must be a positive int, got {n_modalities!r}")
        self.kind, self.mode, self.n_modalities = kind, mode, int(n_modalities)
        super().__init__(
            normalized_shape, (1e-5 if kind == "layer" else 1e-6) if eps is None else eps, dtype, xp, backend
        )
        opts: dict[str, Any] = {"eps": self.eps, "weight_offset": weight_offset}
        if kind == "layer":
            opts |= {"correction": correction, "eps_mode": eps_mode}
        base = F.LAYER_NORM if kind == "layer" else F.RMS_NORM
        # the conventions only: validate() also fills in layer_norm's / rms_norm's own casting option, which the
        # modality ops do not take (this layer always computes with the default rounding)
        self.options = {k: v for k, v in base.validate(opts).items() if k != "casting"}
        self.weight_offset = self.options["weight_offset"]
        shape = (self.n_modalities, *self.normalized_shape) if mode == "specific" else self.normalized_shape
        if elementwise_affine or mode == "specific":  # the tables are what makes a norm modality-specific
            self._add_param_shaped("weight", shape, 1.0 - self.weight_offset)
            if bias and kind == "layer":
                self._add_param_shaped("bias", shape, 0.0)

    def _add_param_shaped(self, name: str, shape: tuple[int, ...], value: float) -> None:
        self.params[name] = self.xp.full(shape, value, dtype=self.dtype)
        self.grads[name] = self.xp.zeros(shape, dtype=self.dtype)

    def _conventions(self) -> dict[str, Any]:
        return {"n_modalities": self.n_modalities, "kind": self.kind, "mode": self.mode}

    def forward(self, x: Any, modality_ids: Any, *, out: Any = None) -> tuple[Any, F.Context]:
        """``(y, ctx)`` for input ``x`` and one modality id per row (shape ``x.shape[:-len(normalized_shape)]``)."""
        ax = self._axis(x)
        w, b = self.params.get("weight"), self.params.get("bias")
        if self.mode == "specific":
            if self.kind == "layer":
                return F.modality_layer_norm_forward(
                    x, modality_ids, w, b, axis=ax, backend=self.backend, out=out, **self.options
                )
            return F.modality_rms_norm_forward(
                x, modality_ids, w, axis=ax, backend=self.backend, out=out, **self.options
            )
        ids = np.asarray(modality_ids) if isinstance(modality_ids, (list, tuple)) else modality_ids
        if tuple(getattr(ids, "shape", ())) != tuple(x.shape[:ax]) or getattr(ids.dtype, "kind", "") not in "iu":
            raise ShapeError(f"modality_ids must be an integer array of shape {tuple(x.shape[:ax])}")
        if self.kind == "layer":
            return F.layer_norm_forward(x, w, b, axis=ax, backend=self.backend, out=out, **self.options)
        return F.rms_norm_forward(x, w, axis=ax, backend=self.backend, out=out, **self.options)

    def backward(self, dy: Any, ctx: F.Context) -> Any:
        """Add the parameter gradients into ``grads`` and return ``dx``."""
        names = ("weight", "bias") if self.kind == "layer" else ("weight",)
        g = pynorm_backward(ctx.op)(dy, ctx)
        self._accumulate(names, tuple(g[1:]))
        return g.dx


def _positive(v: Any, name: str) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
        raise ArgumentError(f"{name} must be a positive int, got {v!r}")
    return int(v)


class _Conditional(_Norm):
    """Shared parts of the conditional norms: ``W`` of ``(kH, C)`` zeros, ``c`` of ``(kH,)`` (adaLN-Zero)."""

    options: dict[str, Any]

    def _init_projection(self, cond_dim: Any, k: int, zero_centered: bool) -> None:
        self.cond_dim = _positive(cond_dim, "cond_dim")
        h = self.num_features
        self.params["W"] = self.xp.zeros((k * h, self.cond_dim), dtype=self.dtype)
        self.grads["W"] = self.xp.zeros((k * h, self.cond_dim), dtype=self.dtype)
        c = np.zeros(k * h)
        if not zero_centered:
            c[:h] = 1.0  # gamma = 1: the layer starts as the plain norm
        self.params["c"] = self.xp.asarray(c.astype(self.dtype))
        self.grads["c"] = self.xp.zeros((k * h,), dtype=self.dtype)

    def _conventions(self) -> dict[str, Any]:
        return {"cond_dim": self.cond_dim, **{k: v for k, v in self.options.items() if k != "eps"}}


class ConditionalLayerNorm(_Conditional):
    """Conditional LayerNorm / adaLN (see :func:`pynorm.conditional_layer_norm_forward`).

    ``gamma, beta = split(cond @ W.T + c)``, ``y = layer_norm(x) * gamma + beta`` (``(1 + gamma)`` with
    ``zero_centered=True``). **adaLN-Zero initialisation**: ``W`` starts at zeros and ``c`` at
    ``(ones, zeros)`` -- all zeros with ``zero_centered`` -- so the layer starts as a plain LayerNorm
    without affine, whatever ``cond`` is, and ``W`` still receives gradients.

    Parameters
    ----------
    normalized_shape : int or tuple (``H`` features). cond_dim : ``C``, the conditioning features.
    eps, zero_centered, correction, eps_mode : the op's options. dtype, backend, xp : as for :class:`LayerNorm`.

    Notes
    -----
    ``forward(x, cond) -> (y, ctx)`` (``cond``: ``(..., C)`` per row, or per sample as the op's broadcast
    rule says); ``backward(dy, ctx) -> (dx, dcond)``, adding ``dW``/``dc`` into ``grads``.
    """

    op = "conditional_layer_norm"

    def __init__(
        self,
        normalized_shape: Any,
        cond_dim: int,
        eps: float = 1e-5,
        zero_centered: bool = False,
        dtype: Any = np.float32,
        *,
        correction: int = 0,
        eps_mode: str = "var",
        backend: str | None = None,
        xp: Any = None,
    ) -> None:
        super().__init__(normalized_shape, eps, dtype, xp, backend)
        self.options = F.CONDITIONAL_LAYER_NORM.validate(
            {"eps": eps, "zero_centered": zero_centered, "correction": correction, "eps_mode": eps_mode}
        )
        self._init_projection(cond_dim, 2, self.options["zero_centered"])

    def forward(self, x: Any, cond: Any, *, out: Any = None) -> tuple[Any, F.Context]:
        """``(y, ctx)`` for input ``x`` (trailing dims ``normalized_shape``) and its conditioning ``cond``."""
        return F.conditional_layer_norm_forward(
            x, cond, self.params["W"], self.params["c"], axis=self._axis(x), backend=self.backend, out=out,
            **self.options,
        )  # fmt: skip

    def backward(self, dy: Any, ctx: F.Context) -> tuple[Any, Any]:
        """Add ``dW``/``dc`` into ``grads``; return ``(dx, dcond)``."""
        g = F.conditional_layer_norm_backward(dy, ctx)
        self._accumulate(("W", "c"), (g.dW, g.dc))
        return g.dx, g.dcond


class ConditionalRMSNorm(_Conditional):
    """Conditional RMSNorm (see :func:`pynorm.conditional_rms_norm_forward`); ``shift=False``: a scale only
    (``W`` of ``(H, C)``). Initialised adaLN-Zero style as :class:`ConditionalLayerNorm` (``W`` zeros, ``c``
    ones for the scale -- zeros with ``zero_centered`` -- and zeros for the shift): it starts as a plain
    RMSNorm without weight. ``forward(x, cond)``; ``backward(dy, ctx) -> (dx, dcond)``."""

    op = "conditional_rms_norm"

    def __init__(
        self,
        normalized_shape: Any,
        cond_dim: int,
        eps: float = 1e-6,
        shift: bool = True,
        zero_centered: bool = False,
        dtype: Any = np.float32,
        *,
        backend: str | None = None,
        xp: Any = None,
    ) -> None:
        super().__init__(normalized_shape, eps, dtype, xp, backend)
        self.options = F.CONDITIONAL_RMS_NORM.validate({"eps": eps, "shift": shift, "zero_centered": zero_centered})
        self._init_projection(cond_dim, 2 if self.options["shift"] else 1, self.options["zero_centered"])

    def forward(self, x: Any, cond: Any, *, out: Any = None) -> tuple[Any, F.Context]:
        """``(y, ctx)`` for input ``x`` and its conditioning ``cond``."""
        return F.conditional_rms_norm_forward(
            x, cond, self.params["W"], self.params["c"], axis=self._axis(x), backend=self.backend, out=out,
            **self.options,
        )  # fmt: skip

    def backward(self, dy: Any, ctx: F.Context) -> tuple[Any, Any]:
        """Add ``dW``/``dc`` into ``grads``; return ``(dx, dcond)``."""
        g = F.conditional_rms_norm_backward(dy, ctx)
        self._accumulate(("W", "c"), (g.dW, g.dc))
        return g.dx, g.dcond


class _NormLinear(_Norm):
    """A norm then a Linear(H, N), fused (:func:`pynorm.layer_norm_linear_forward`): the ctx holds no
    normalized activations. ``W`` starts as torch's ``Linear`` does, ``U(-1/sqrt(H), 1/sqrt(H))`` (``seed``
    picks the draw), ``c`` likewise; the norm's parameters as for the plain norm layer."""

    options: dict[str, Any]

    def _init_linear(self, out_features: Any, bias: bool, seed: int | None) -> None:
        n = _positive(out_features, "out_features")
        h = self.num_features
        bound = 1.0 / math.sqrt(h)
        rng = np.random.default_rng(seed)
        self.params["W"] = self.xp.asarray(rng.uniform(-bound, bound, (n, h)).astype(self.dtype))
        self.grads["W"] = self.xp.zeros((n, h), dtype=self.dtype)
        if bias:
            self.params["c"] = self.xp.asarray(rng.uniform(-bound, bound, n).astype(self.dtype))
            self.grads["c"] = self.xp.zeros((n,), dtype=self.dtype)
        self.out_features = n

    def _conventions(self) -> dict[str, Any]:
        return {"out_features": self.out_features, **{k: v for k, v in self.options.items() if k != "eps"}}


class LayerNormLinear(_NormLinear):
    """LayerNorm over the trailing ``normalized_shape`` dims, then ``@ W.T + c`` (``W`` of
    ``(out_features, H)``). ``forward(x, return_norm=False) -> (out, ctx)`` (``((out, n), ctx)``);
    ``backward(dy, ctx, dn=None) -> dx``, adding the parameter gradients into ``grads``."""

    op = "layer_norm_linear"

    def __init__(
        self,
        normalized_shape: Any,
        out_features: int,
        eps: float = 1e-5,
        bias: bool = True,
        linear_bias: bool = True,
        dtype: Any = np.float32,
        *,
        correction: int = 0,
        eps_mode: str = "var",
        weight_offset: float = 0.0,
        seed: int | None = None,
        backend: str | None = None,
        xp: Any = None,
    ) -> None:
        super().__init__(normalized_shape, eps, dtype, xp, backend)
        self.options = F.LAYER_NORM_LINEAR.validate(
            {"eps": eps, "correction": correction, "eps_mode": eps_mode, "weight_offset": weight_offset}
        )
        self._add_param("weight", 1.0 - self.options["weight_offset"])
        if bias:
            self._add_param("bias", 0.0)
        self._init_linear(out_features, linear_bias, seed)

    def forward(self, x: Any, *, return_norm: bool = False, out: Any = None) -> tuple[Any, F.Context]:
        """``(out, ctx)``, or ``((out, n), ctx)`` with ``return_norm``."""
        return F.layer_norm_linear_forward(
            x, self.params["weight"], self.params.get("bias"), self.params["W"], self.params.get("c"),
            return_norm=return_norm, axis=self._axis(x), backend=self.backend, out=out, **self.options,
        )  # fmt: skip

    def backward(self, dy: Any, ctx: F.Context, dn: Any = None) -> Any:
        """Add the parameter gradients into ``grads``; return ``dx``."""
        g = F.layer_norm_linear_backward(dy, ctx, dn)
        self._accumulate(("weight", "bias", "W", "c"), (g.dweight, g.dbias, g.dW, g.dc))
        return g.dx


class RMSNormLinear(_NormLinear):
    """RMSNorm, then ``@ W.T + c``; as :class:`LayerNormLinear`."""

    op = "rms_norm_linear"

    def __init__(
        self,
        normalized_shape: Any,
        out_features: int,
        eps: float = 1e-6,
        linear_bias: bool = True,
        dtype: Any = np.float32,
        *,
        weight_offset: float = 0.0,
        seed: int | None = None,
        backend: str | None = None,
        xp: Any = None,
    ) -> None:
        super().__init__(normalized_shape, eps, dtype, xp, backend)
        self.options = F.RMS_NORM_LINEAR.validate({"eps": eps, "weight_offset": weight_offset})
        self._add_param("weight", 1.0 - self.options["weight_offset"])
        self._init_linear(out_features, linear_bias, seed)

    def forward(self, x: Any, *, return_norm: bool = False, out: Any = None) -> tuple[Any, F.Context]:
        """``(out, ctx)``, or ``((out, n), ctx)`` with ``return_norm``."""
        return F.rms_norm_linear_forward(
            x, self.params["weight"], self.params["W"], self.params.get("c"), return_norm=return_norm,
            axis=self._axis(x), backend=self.backend, out=out, **self.options,
        )  # fmt: skip

    def backward(self, dy: Any, ctx: F.Context, dn: Any = None) -> Any:
        """Add the parameter gradients into ``grads``; return ``dx``."""
        g = F.rms_norm_linear_backward(dy, ctx, dn)
        self._accumulate(("weight", "W", "c"), (g.dweight, g.dW, g.dc))
        return g.dx


def pynorm_backward(op: str) -> Any:
    """The public ``<op>_backward`` function."""
    return getattr(F, f"{op}_backward")
