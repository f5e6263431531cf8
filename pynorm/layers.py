"""Stateful layers around the functional ops, with torch-like names: one generic :class:`Layer` made from an op's
spec, and one small class per op.

A layer holds ``params`` and ``grads`` dicts of arrays (and buffers in ``state``). ``forward(x, *inputs)`` returns
``(y, ctx)``; ``backward(dy, ctx)`` *adds* the parameter gradients into ``grads`` and returns ``dx`` (``(dx,
d<input>...)`` for an op with differentiable inputs). Nothing about a call is kept in ``self``: one layer can be
applied several times in one graph and its gradients accumulate as in a framework.

The constructor of every layer: ``Layer(normalized_shape, *sizes, eps, **options, dtype=np.float32,
backend=None, xp=None)`` -- ``sizes`` the op's own sizes (``n_modalities``, ``cond_dim``, ``out_features``),
``eps`` (where the op has one) the only other positional argument, every option of the op's spec by keyword with
the spec's default. Parameters start from the spec (:attr:`pynorm.ops.Param.init`; a weight with an offset
convention at ``init - weight_offset``, so ``w + o`` starts at ``init``); ``elementwise_affine=False`` leaves out
the optional per-feature parameters and ``<name>=False`` one of them (``bias=False``); a scalar parameter's start
is ``<name>_init``.

>>> import numpy as np, pynorm.layers as L
>>> ln = L.LayerNorm(8)
>>> y, ctx = ln.forward(np.random.randn(4, 8).astype(np.float32))
>>> dx = ln.backward(np.ones_like(y), ctx)
>>> sorted(ln.grads)
['bias', 'weight']
"""

from __future__ import annotations

import inspect
import math
import os
from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

import numpy as np

from . import functional as F
from ._dtypes import FLOAT_DTYPES, dtype_of
from .errors import ArgumentError, DTypeError, ShapeError
from .ops import REQUIRED, SPECS, OpSpec, check_positive_int, check_real
from .ops.fp_quant import QUANTIZE


def _shape(normalized_shape: Any) -> tuple[int, ...]:
    shape = (normalized_shape,) if isinstance(normalized_shape, (int, np.integer)) else tuple(normalized_shape)
    if not shape or any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 1 for d in shape):
        raise ArgumentError(f"normalized_shape must be a positive int or a tuple of them, got {normalized_shape!r}")
    return tuple(int(d) for d in shape)


def _choice(v: Any, name: str, choices: tuple[str, ...]) -> str:
    if v not in choices:
        raise ArgumentError(f"{name} must be {' or '.join(map(repr, choices))}, got {v!r}")
    return str(v)


class Layer:
    """The layer of one op (``spec``), as the module doc describes.

    ``sizes``: the op's own size arguments after ``normalized_shape``; ``flags``: constructor flags of the
    optional parameters other than ``elementwise_affine`` and ``<param>=``, by alias (``linear_bias`` -> ``c``).
    Subclasses with parameters the spec alone cannot start (a matrix) override :meth:`_start`.
    """

    spec: OpSpec
    sizes: ClassVar[tuple[str, ...]] = ()
    flags: ClassVar[dict[str, str]] = {}
    #: keyword arguments of a subclass's own ``__init__`` (before the generic ones), with their defaults
    own: ClassVar[dict[str, Any]] = {}
    #: options the layer sets itself on each call (BatchNorm's ``training``), not constructor arguments
    managed: ClassVar[tuple[str, ...]] = ()

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if hasattr(cls, "spec") or getattr(cls, "kinds", None):
            cls.__signature__ = cls.signature()  # type: ignore[attr-defined]

    @classmethod
    def signature(cls) -> inspect.Signature:
        """The constructor's parameters (the module doc's rule, from the spec)."""
        spec = cls.spec if hasattr(cls, "spec") else SPECS[next(iter(cls.kinds.values()))]  # type: ignore[attr-defined]
        P = inspect.Parameter
        params = [P("normalized_shape", P.POSITIONAL_OR_KEYWORD)]
        params += [P(n, P.POSITIONAL_OR_KEYWORD) for n in cls.sizes]
        defaults = spec.defaults()
        if "eps" in defaults:  # (None: the kind's own default, for a layer whose op is chosen by kind)
            eps = None if getattr(cls, "kinds", None) else defaults["eps"]
            params.append(P("eps", P.POSITIONAL_OR_KEYWORD, default=eps))
        skip = ("eps", "return_norm", *cls.managed)
        kw: dict[str, Any] = {o.name: o.default for o in spec.options if o.name not in skip and o is not QUANTIZE}
        if any(p.kind in ("feature", "table", "channel") and not p.required for p in spec.params):
            kw["elementwise_affine"] = True
        kw |= {p.name: True for p in spec.params if not p.required and p.name not in cls.flags.values()}
        kw |= dict.fromkeys(cls.flags, True)
        kw |= {f"{p.name}_init": p.init for p in spec.params if p.kind == "scalar" and f"{p.name}_init" not in kw}
        kw |= {"dtype": np.float32, "backend": None, "xp": None}
        kw = {**{k: v for k, v in cls.own.items() if k not in kw}, **{k: cls.own.get(k, v) for k, v in kw.items()}}
        return inspect.Signature(
            params + [P(n, P.KEYWORD_ONLY, **({} if d is REQUIRED else {"default": d})) for n, d in kw.items()]
        )

    def __init__(self, normalized_shape: Any, *args: Any, **kwargs: Any) -> None:
        spec = self.spec
        names = [*self.sizes, *(["eps"] if "eps" in spec.defaults() else [])]
        if len(args) > len(names):
            raise TypeError(f"{type(self).__name__}() takes {len(names) + 1} positional arguments at most")
        given = dict(zip(names, args, strict=False))
        if set(given) & set(kwargs):
            raise TypeError(f"{type(self).__name__}() got {sorted(set(given) & set(kwargs))} twice")
        kwargs |= given
        self.normalized_shape = _shape(normalized_shape)
        self.sizes_given = {n: check_positive_int(kwargs.pop(n), n) for n in self.sizes if n in kwargs}
        missing = [n for n in self.sizes if n not in self.sizes_given]
        if missing:
            raise TypeError(f"{type(self).__name__}() missing required argument(s) {missing}")
        dt = kwargs.pop("dtype", np.float32)
        self.dtype = dtype_of(dt)
        if self.dtype.name not in FLOAT_DTYPES:
            raise DTypeError(f"dtype must be float16, bfloat16, float32 or float64, got {self.dtype}")
        self.xp = kwargs.pop("xp", None) or np
        self.backend = kwargs.pop("backend", None)
        affine = kwargs.pop("elementwise_affine", self.own.get("elementwise_affine", True))
        create = {p.name: bool(kwargs.pop(p.name, True)) for p in spec.params if not p.required}
        for alias, param in self.flags.items():
            create[param] = bool(kwargs.pop(alias, True))
        starts = {f"{p.name}_init": kwargs.pop(f"{p.name}_init", p.init) for p in spec.params if p.kind == "scalar"}
        if "eps" in kwargs and kwargs["eps"] is None:  # the spec's (or the kind's) default
            del kwargs["eps"]
        self.options = spec.validate({k: v for k, v in kwargs.items() if k not in self.own})
        self.extra = {k: kwargs[k] for k in self.own if k in kwargs}
        self.eps = float(self.options.get("eps", 0.0))
        self.params: dict[str, Any] = {}
        self.grads: dict[str, Any] = {}
        self.state: dict[str, Any] = {}  # buffers that are not parameters (BatchNorm's running statistics)
        self.training = True
        self.wanted: set[str] = set()  # the matrix and vector parameters to create (by :meth:`_start`)
        offset = self.options.get("weight_offset", 0.0)
        for p in spec.params:
            feature_like = p.kind in ("feature", "table", "channel")
            if not p.required and (not create[p.name] or (feature_like and not affine)):
                continue
            if p.kind in ("matrix", "vector"):
                self.wanted.add(p.name)
            elif p.kind == "scalar":
                value = check_real(starts[f"{p.name}_init"], f"{p.name}_init")
                self._set(p.name, self.xp.full((1,), value, dtype=self.dtype))
            elif feature_like:
                shape = self.normalized_shape
                if p.kind == "table":
                    shape = (self.sizes_given["n_modalities"], *shape)
                self._set(p.name, self.xp.full(shape, p.init - (offset if p.name == "weight" else 0.0), self.dtype))
        self._start()

    def _start(self) -> None:
        """Start the parameters the spec cannot (matrices: the subclasses)."""

    def _set(self, name: str, value: Any) -> None:
        self.params[name] = value
        self.grads[name] = self.xp.zeros(value.shape, dtype=self.dtype)

    def _axis(self, x: Any) -> int:
        k = len(self.normalized_shape)
        if getattr(x, "ndim", 0) < k or tuple(x.shape[x.ndim - k :]) != self.normalized_shape:
            raise ShapeError(
                f"x has shape {tuple(getattr(x, 'shape', ()))}, expected trailing dims {self.normalized_shape}"
            )
        return int(x.ndim - k)

    def forward(self, x: Any, *inputs: Any, out: Any = None, **call: Any) -> tuple[Any, F.Context]:
        """``(y, ctx)`` for ``x`` whose trailing dims are ``normalized_shape`` and the op's extra inputs (a
        residual, ids, a conditioning vector); ``call``: keyword inputs (``x_scale``) and the public-only options
        (``return_norm``) of this call."""
        spec = self.spec
        kw = {i.name for i in spec.inputs if i.keyword} | {o.name for o in spec.options if not o.to_backend}
        kw |= set(self.managed)
        if set(call) - kw:
            raise TypeError(
                f"{type(self).__name__}.forward() got unexpected keyword argument(s) {sorted(set(call) - kw)}"
            )
        # the ctx gets its own copy of the (small) parameters: an update written into params[...] between this
        # forward and its backward (an optimizer's, a gradient check's) cannot change the backward's gradients
        params = [None if (v := self.params.get(p.name)) is None else v.copy() for p in spec.params]
        fwd = getattr(F, f"{spec.name}_forward")
        options = {**self.options, **call}
        if spec.layout == "rows":
            options["axis"] = self._axis(x)
        return fwd(x, *inputs, *params, backend=self.backend, out=out, **options)  # type: ignore[no-any-return]

    def train(self, mode: bool = True) -> Layer:
        """Training mode (``mode=True``) or evaluation mode; returns the layer. Only layers with running
        statistics behave differently (:class:`BatchNorm`, :class:`InstanceNorm`)."""
        self.training = bool(mode)
        return self

    def eval(self) -> Layer:
        """Evaluation mode: ``train(False)``."""
        return self.train(False)

    def backward(self, dy: Any, ctx: F.Context, *upstream: Any, **upstream_kw: Any) -> Any:
        """Add the parameter gradients into ``grads``; return ``dx``, or ``(dx, d<input>...)`` for an op with
        differentiable inputs. ``upstream``: the gradients arriving at the forward's other outputs (``dh``)."""
        g = getattr(F, f"{ctx.op}_backward")(dy, ctx, *upstream, **upstream_kw)
        self.accumulate(g)
        n_in = sum(1 for i in self.spec.inputs if i.differentiable)
        return g[0] if n_in == 0 else tuple(g[: 1 + n_in])

    def accumulate(self, grads: Any) -> None:
        """Add each ``d<param>`` of an op's gradient tuple (``grads``) into ``self.grads`` (in float64, rounded
        once to the layer's dtype)."""
        for name, value in zip(grads._fields, grads, strict=True):
            if name[1:] in self.params and value is not None:
                acc = self.grads[name[1:]].astype(np.float64) + value.astype(np.float64)
                self.grads[name[1:]] = acc.astype(self.dtype)

    def __call__(self, x: Any, *inputs: Any, **kw: Any) -> tuple[Any, F.Context]:
        return self.forward(x, *inputs, **kw)

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Any, str]]:
        """``(name, self, key)`` of every parameter (``self.params[key]``, its gradient ``self.grads[key]``), as
        :meth:`pynorm.blocks.Module.named_parameters` gives them: what the optimizers of :mod:`pynorm.optim` walk."""
        for key in self.params:
            yield f"{prefix}{key}", self, key

    def zero_grad(self) -> None:
        """Reset every accumulated gradient to zero."""
        for n in self.grads:
            self.grads[n] = self.xp.zeros_like(self.grads[n])

    def state_dict(self) -> dict[str, Any]:
        """Copies of the parameters and the buffers (:attr:`state`), by name."""
        return {n: p.copy() for n, p in {**self.params, **self.state}.items()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the parameters and buffers; names and shapes must match exactly (each value cast to the dtype
        of what it replaces)."""
        have = {**self.params, **self.state}
        missing, unexpected = set(have) - set(state), set(state) - set(have)
        if missing or unexpected:
            raise ArgumentError(
                f"state dict does not match the layer: missing {sorted(missing)}, unexpected {sorted(unexpected)}"
            )
        new = {}
        for n, v in state.items():
            if tuple(getattr(v, "shape", ())) != tuple(getattr(have[n], "shape", ())):
                raise ShapeError(f"state[{n!r}] has shape {tuple(v.shape)}, expected {tuple(have[n].shape)}")
            new[n] = self.xp.asarray(v).astype(have[n].dtype, copy=True)
        self.params.update({n: v for n, v in new.items() if n in self.params})
        self.state.update({n: v for n, v in new.items() if n in self.state})

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the parameters and buffers to an ``.npz`` file (bfloat16 stored as its raw 16-bit pattern)."""
        arrays: dict[str, Any] = {"__dtype__": np.array(self.dtype.name)}
        for n, p in {**self.params, **self.state}.items():
            a = p.get() if hasattr(p, "get") else np.asarray(p)  # cupy -> numpy
            arrays[n] = a.view(np.uint16) if a.dtype.name == "bfloat16" else a
        np.savez(path, **arrays)

    def load(self, path: str | os.PathLike[str]) -> None:
        """Read parameters written by :meth:`save`."""
        with np.load(path) as f:
            bf16 = "__dtype__" in f and str(f["__dtype__"]) == "bfloat16"
            state = {n: (f[n].view(dtype_of("bfloat16")) if bf16 and f[n].dtype == np.uint16 else f[n])
                     for n in f.files if n != "__dtype__"}  # fmt: skip
        self.load_state_dict(state)

    def __repr__(self) -> str:
        defaults = self.spec.defaults()
        conv = {k: v for k, v in self.options.items() if k != "eps" and v != defaults[k]}
        extra = ", ".join(f"{k}={v!r}" for k, v in {**self.sizes_given, **self._conventions(), **conv}.items())
        return (
            f"{type(self).__name__}({self.normalized_shape}, eps={self.eps}, params={sorted(self.params)}, "
            f"dtype={self.dtype.name}{', ' + extra if extra else ''})"
        )

    def _conventions(self) -> dict[str, Any]:
        return {}

    @property
    def num_features(self) -> int:
        return math.prod(self.normalized_shape)

    def __getattr__(self, name: str) -> Any:  # the options as attributes: ln.eps_mode, ln.weight_offset
        options = self.__dict__.get("options", {})
        if name in options:
            return options[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")


class LayerNorm(Layer):
    """LayerNorm over the trailing ``normalized_shape`` dims (:func:`pynorm.layer_norm_forward`): ``weight``
    starts at ones (zeros with ``weight_offset=1``), ``bias`` at zeros -- not the ones of tutorial LayerNorms
    that circulate with that bug."""

    spec = SPECS["layer_norm"]


class QuantLayerNorm(Layer):
    """The quantization-friendly LayerNorm (:func:`pynorm.quant_layer_norm_forward`): ``forward(x, x_scale=None)``
    takes an int8 ``x``'s scale per call; ``backward`` the gradient w.r.t. the dequantized output."""

    spec = SPECS["quant_layer_norm"]


class RMSNorm(Layer):
    """RMSNorm over the trailing ``normalized_shape`` dims (:func:`pynorm.rms_norm_forward`); ``weight_offset=1``
    for Gemma's ``(1 + w)`` (the weight then starts at zeros)."""

    spec = SPECS["rms_norm"]


class ScaleNorm(Layer):
    """ScaleNorm (:func:`pynorm.scale_norm_forward`): the scalar ``g`` starts at ``sqrt(d)`` (Nguyen & Salazar's
    choice, ``d`` the normalized features) or at ``g_init`` (1.0: fairseq, GPT-NeoX)."""

    spec = SPECS["scale_norm"]
    own: ClassVar[dict[str, Any]] = {"g_init": None}

    def __init__(self, normalized_shape: Any, *args: Any, g_init: float | None = None, **kwargs: Any) -> None:
        start = math.sqrt(math.prod(_shape(normalized_shape))) if g_init is None else g_init
        super().__init__(normalized_shape, *args, g_init=start, **kwargs)


class PowerNorm(Layer):
    """The signed-power "PowerNorm" ``w * sign(x) * |x|**p + b`` of normalization tutorials
    (:func:`pynorm.power_norm_forward`; not Shen et al.'s batch PowerNorm)."""

    spec = SPECS["power_norm"]


class DyT(Layer):
    """DyT, ``w * tanh(alpha x) + b`` (:func:`pynorm.dyt_forward`): ``alpha`` starts at ``alpha_init``."""

    spec = SPECS["dyt"]


class Derf(Layer):
    """Derf, ``w * erf(alpha x + shift) + b`` (:func:`pynorm.derf_forward`): ``alpha`` starts at ``alpha_init``,
    ``shift`` at ``shift_init``."""

    spec = SPECS["derf"]


class _Kinded(Layer):
    """A layer whose op is chosen by ``kind`` (``"layer"``: the LayerNorm variant, ``"rms"``: the RMSNorm one)."""

    kinds: ClassVar[dict[str, str]] = {}

    def __init__(self, normalized_shape: Any, *args: Any, kind: str = "layer", **kwargs: Any) -> None:
        self.kind = _choice(kind, "kind", tuple(self.kinds))
        self.spec = SPECS[self.kinds[self.kind]]
        super().__init__(normalized_shape, *args, **kwargs)

    def _conventions(self) -> dict[str, Any]:
        return {"kind": self.kind}


class AddNorm(_Kinded):
    """The fused residual add + norm (:func:`pynorm.add_layer_norm_forward`, ``kind="rms"``:
    :func:`pynorm.add_rms_norm_forward`): ``forward(x, residual) -> ((y, h), ctx)``,
    ``backward(dy, ctx, dh=None) -> (dx, dresidual)``; the Pre-LN / Post-LN / DeepNorm building block."""

    kinds: ClassVar[dict[str, str]] = {"layer": "add_layer_norm", "rms": "add_rms_norm"}
    own: ClassVar[dict[str, Any]] = {"kind": "layer"}


class ModalityNorm(_Kinded):
    """LayerNorm or RMSNorm with per-modality parameters (:func:`pynorm.modality_layer_norm_forward`):
    ``ModalityNorm(normalized_shape, n_modalities, kind="layer", mode="specific")``, ``forward(x, modality_ids)``.
    ``mode="shared"``: one parameter set for every modality (a plain norm; the ids are checked and otherwise
    ignored) -- the hybrid stacks use specific norms in low layers, shared above."""

    kinds: ClassVar[dict[str, str]] = {"layer": "modality_layer_norm", "rms": "modality_rms_norm"}
    own: ClassVar[dict[str, Any]] = {"kind": "layer", "mode": "specific"}
    sizes = ("n_modalities",)

    def __init__(self, normalized_shape: Any, *args: Any, mode: str = "specific", **kwargs: Any) -> None:
        self.mode = _choice(mode, "mode", ("specific", "shared"))
        if self.mode == "specific":
            kwargs.pop("elementwise_affine", None)  # the tables are what makes a norm modality-specific
        super().__init__(normalized_shape, *args, **kwargs)
        if self.mode == "shared":
            self.spec = SPECS[self.kind.replace("layer", "layer_norm").replace("rms", "rms_norm")]
            for n, p in list(self.params.items()):
                self._set(n, p[0].copy())

    def forward(self, x: Any, modality_ids: Any, *, out: Any = None) -> tuple[Any, F.Context]:  # type: ignore[override]
        """``(y, ctx)`` for ``x`` and one modality id per row (shape ``x.shape[:-len(normalized_shape)]``)."""
        if self.mode == "specific":
            return super().forward(x, modality_ids, out=out)
        ax = self._axis(x)
        ids = np.asarray(modality_ids) if isinstance(modality_ids, (list, tuple)) else modality_ids
        if tuple(getattr(ids, "shape", ())) != tuple(x.shape[:ax]) or getattr(ids.dtype, "kind", "") not in "iu":
            raise ShapeError(f"modality_ids must be an integer array of shape {tuple(x.shape[:ax])}")
        return super().forward(x, out=out)

    def _conventions(self) -> dict[str, Any]:
        return {"kind": self.kind, "mode": self.mode}


class _Conditional(Layer):
    """``gamma, beta = split(cond @ W.T + c)``; **adaLN-Zero initialisation**: ``W`` starts at zeros and ``c`` at
    ``(ones, zeros)`` -- all zeros with ``zero_centered`` -- so the layer starts as the plain norm without affine,
    whatever ``cond`` is, and ``W`` still receives gradients. ``forward(x, cond)``; ``backward(dy, ctx) ->
    (dx, dcond)``."""

    sizes = ("cond_dim",)

    def _start(self) -> None:
        h, k = self.num_features, 2 if self.options.get("shift", True) else 1
        self._set("W", self.xp.zeros((k * h, self.sizes_given["cond_dim"]), dtype=self.dtype))
        c = np.zeros(k * h)
        if not self.options["zero_centered"]:
            c[:h] = 1.0  # gamma = 1: the layer starts as the plain norm
        if "c" in self.wanted:
            self._set("c", self.xp.asarray(c.astype(self.dtype)))


class ConditionalLayerNorm(_Conditional):
    __doc__ = f"Conditional LayerNorm / adaLN (:func:`pynorm.conditional_layer_norm_forward`). {_Conditional.__doc__}"
    spec = SPECS["conditional_layer_norm"]


class ConditionalRMSNorm(_Conditional):
    __doc__ = (
        "Conditional RMSNorm (:func:`pynorm.conditional_rms_norm_forward`; ``shift=False``: a scale only). "
        f"{_Conditional.__doc__}"
    )
    spec = SPECS["conditional_rms_norm"]


class _NormLinear(Layer):
    """A norm then a Linear(H, N), fused: the ctx holds no normalized activations. ``W`` starts as torch's
    ``Linear`` does, ``U(-1/sqrt(H), 1/sqrt(H))`` (``seed`` picks the draw), ``c`` likewise (``linear_bias=False``:
    none). ``forward(x, return_norm=False) -> (out, ctx)`` (``((out, n), ctx)``); ``backward(dy, ctx, dn=None)``."""

    sizes = ("out_features",)
    flags: ClassVar[dict[str, str]] = {"linear_bias": "c"}
    own: ClassVar[dict[str, Any]] = {"seed": None}

    def _start(self) -> None:
        n, h = self.sizes_given["out_features"], self.num_features
        bound = 1.0 / math.sqrt(h)
        rng = np.random.default_rng(self.extra.get("seed"))
        self._set("W", self.xp.asarray(rng.uniform(-bound, bound, (n, h)).astype(self.dtype)))
        if "c" in self.wanted:
            self._set("c", self.xp.asarray(rng.uniform(-bound, bound, n).astype(self.dtype)))


class LayerNormLinear(_NormLinear):
    __doc__ = f"LayerNorm, then ``@ W.T + c`` (:func:`pynorm.layer_norm_linear_forward`). {_NormLinear.__doc__}"
    spec = SPECS["layer_norm_linear"]


class RMSNormLinear(_NormLinear):
    __doc__ = f"RMSNorm, then ``@ W.T + c`` (:func:`pynorm.rms_norm_linear_forward`). {_NormLinear.__doc__}"
    spec = SPECS["rms_norm_linear"]


class GroupNorm(Layer):
    """GroupNorm over ``x`` of ``(N, C, *spatial)`` (:func:`pynorm.group_norm_forward`):
    ``GroupNorm(num_channels, num_groups=G)``; ``weight`` ``(C,)`` starts at ones, ``bias`` at zeros."""

    spec = SPECS["group_norm"]


class _Running(Layer):
    """A norm with running statistics in :attr:`state` (``running_mean`` zeros, ``running_var`` ones, of the
    layer's dtype), used in evaluation mode (:meth:`eval`) and updated in training mode; ``forward(x)``."""

    def __init__(self, normalized_shape: Any, *args: Any, **kwargs: Any) -> None:
        track = kwargs.pop("track_running_stats", self.own["track_running_stats"])  # the subclass's default
        super().__init__(normalized_shape, *args, **kwargs)
        self.track_running_stats = bool(track)
        if self.track_running_stats:
            self.state["running_mean"] = self.xp.zeros(self.normalized_shape, dtype=self.dtype)
            self.state["running_var"] = self.xp.ones(self.normalized_shape, dtype=self.dtype)

    def _call(self, x: Any, out: Any, use_batch: bool, **kw: Any) -> tuple[Any, F.Context]:
        running = {k: self.state[k] for k in ("running_mean", "running_var")} if self.track_running_stats else {}
        res, ctx = super().forward(x, out=out, **running, **kw)
        if self.track_running_stats and use_batch:
            y, self.state["running_mean"], self.state["running_var"] = res
            return y, ctx
        return res, ctx

    def _conventions(self) -> dict[str, Any]:
        return {"track_running_stats": self.track_running_stats, "training": self.training}


class InstanceNorm(_Running):
    """InstanceNorm over ``x`` of ``(N, C, *spatial)`` (:func:`pynorm.instance_norm_forward`): PyTorch's
    ``InstanceNorm1d/2d/3d`` defaults, ``elementwise_affine=False`` and ``track_running_stats=False``; with running
    statistics, training mode updates them and evaluation mode normalizes with them."""

    spec = SPECS["instance_norm"]
    own: ClassVar[dict[str, Any]] = {"track_running_stats": False, "elementwise_affine": False}
    managed = ("use_input_stats",)

    def forward(self, x: Any, *, out: Any = None) -> tuple[Any, F.Context]:  # type: ignore[override]
        """``(y, ctx)``; see the class doc for the running statistics."""
        use_batch = self.training or not self.track_running_stats
        return self._call(x, out, use_batch, use_input_stats=use_batch)


class BatchNorm(_Running):
    """BatchNorm over ``x`` of ``(N, C, *spatial)`` (:func:`pynorm.batch_norm_forward`), PyTorch's
    ``BatchNorm1d/2d/3d``: training mode (the default; :meth:`train`) normalizes with the batch's statistics and
    updates the running ones in :attr:`state` (``num_batches_tracked`` counts the batches, for ``momentum=None``);
    evaluation mode (:meth:`eval`) normalizes with the running ones. ``track_running_stats=False``: always the
    batch's."""

    spec = SPECS["batch_norm"]
    own: ClassVar[dict[str, Any]] = {"track_running_stats": True}
    managed = ("training", "num_batches_tracked")

    def __init__(self, normalized_shape: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(normalized_shape, *args, training=True, **kwargs)
        self.num_batches_tracked = 0

    def forward(self, x: Any, *, out: Any = None) -> tuple[Any, F.Context]:  # type: ignore[override]
        """``(y, ctx)``; in training mode the running statistics are updated."""
        use_batch = self.training or not self.track_running_stats
        y, ctx = self._call(x, out, use_batch, training=use_batch, num_batches_tracked=self.num_batches_tracked)
        if self.track_running_stats and use_batch:
            self.num_batches_tracked += 1
        return y, ctx


#: every layer class (the generic one first)
__all__ = ["Layer", *sorted(n for n, v in dict(globals()).items() if isinstance(v, type) and issubclass(v, Layer)
                            and v is not Layer and not n.startswith("_"))]  # fmt: skip
