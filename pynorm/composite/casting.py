"""The casting policies of LayerNorm and RMSNorm on a fast backend, built from its own kernels, composed above it.

The rounding sequences are defined once, in :mod:`pynorm.reference.casting` (the ``numpy`` backend
computes them literally). A fast backend implements ``casting="fp32"`` only; the registry composes the other
policies around it (:func:`bind`, for every op with a ``casting`` option on a backend whose package lists
``"casting"`` in ``COMPOSED``: :data:`pynorm.ops.families.COMPOSED`), so no backend imports this module.
:class:`Casting` runs them from two kernel-family instances of that backend and its *pieces* module (the
package's ``COMPOSED["casting"]``: ``cast``, ``copy_into`` and ``InType``):

* ``"gemma"``: the ``"fp32"`` kernels with the effective weight ``rnd_f32(rnd_f32(w) + rnd_f32(o))``
  prepared once per call (an ``(H,)`` vector; where the kernels' math type is float32 they already
  evaluate ``w + o`` in float32 and run unchanged);
* ``"llama"``, ``"apex"``, ``"t5"`` (with a 16-bit weight): the norm **without** its affine -- its
  kernel rounds ``xhat`` once to ``x``'s dtype, which is ``q`` -- then the element-wise family's
  identity (PowerNorm with ``p = 1``): ``y = w_e q + b``, rounded once. Backward: the identity's
  backward gives ``g = rnd(dy w_e)`` (its ``dx``), ``dweight = sum dy q`` and ``dbias``; the norm's
  backward without affine takes ``g`` as its upstream gradient. ``q`` is recomputed by the forward
  kernel (bitwise the forward's), so ``ctx`` is the op's usual one; ``"apex"`` differentiates as
  ``"fp32"`` (its backward recomputes ``xhat`` unrounded). For ``"t5"`` with a weight dtype other than
  ``x``'s, ``q``, ``y`` and ``dy`` are converted on the device in between (``cast``).
  Where the backend offers it (the identity's ``sink`` and the norm's ``takes_sink``: the numba backend, for rows
  its kernels do not split), the forward with ``q`` in ``x``'s dtype is one pass: the norm writes each row's
  ``q`` into a scratch row and runs the identity's forward of that row into ``y`` (:mod:`pynorm.backends.numba._io`'s
  element-wise sink), bitwise the two kernels, with no ``q`` in memory. The backward likewise (the identity's
  ``source`` and the norm's ``backward_cast``: the numba backend's fused backward, row blocks not split): each
  row's ``q`` by the forward's row kernel, the identity's backward of it into a scratch ``g`` (and its partials),
  the norm's backward of ``g`` into ``dx`` (:func:`pynorm.backends.numba._stats_kernels.bwd_cast`), bitwise the
  three kernels, with no ``q`` or ``g`` in memory.

* ``"none"``: the backend's in-dtype kernels (``InType`` of its pieces module: every operation rounded to ``x``'s
  dtype; the numba backend's ``_intype_kernels``, the cupy backend's ``intype.cu``).

The cost, for ``"llama"``/``"t5"``, beside the ``"fp32"`` kernels: where not fused, more passes over the
activations (the forward writes and reads ``q``; the backward recomputes ``q``, writes and reads ``q`` and ``g``);
fused, the arithmetic of the identity and, in the backward, of the row's statistics again;
``"none"`` is a row-by-row kernel whose cost is its arithmetic (every operation rounded), not its memory
traffic.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from ..errors import ArgumentError
from ..ops.families import CASTING, COMPOSED
from ..reference.casting import quantized_dtype

__all__ = ["Casting", "Composed", "bind"]

#: the policy the backends implement themselves
DEFAULT = COMPOSED[CASTING][0]


def _fp32_math(x_dtype: Any, w_dtype: Any) -> bool:
    """True where a fast backend's statistics kernels compute in float32 (``w + o`` included)."""
    return np.dtype(x_dtype).itemsize < 8 and (w_dtype is None or np.dtype(w_dtype).itemsize < 8)


@dataclass(frozen=True)
class Casting:
    """The policies for one fast backend's statistics op ``norm`` (``layer_norm`` or ``rms_norm``).

    ``identity``: the backend's PowerNorm op; ``cast(a, dtype)``: a copy of array ``a`` rounded once to
    ``dtype`` on the backend's device; ``copy_into(dst, src)``: copy same-dtype arrays; ``intype``: the
    in-dtype kernels (``forward(x, weight, bias, **conventions, out) -> (y, mean, rstd)``,
    ``backward(dy, x, weight, bias, mean, rstd, **conventions, dx_out) -> (dx, dweight, dbias)``).
    """

    norm: Any
    identity: Any
    cast: Callable[[Any, Any], Any]
    copy_into: Callable[[Any, Any], None]
    intype: Any = None

    def _conventions(self, source: Any) -> dict[str, Any]:
        """The op's options but ``casting``."""
        o = self._options(source)
        del o["casting"]
        return o

    def _options(self, source: Any) -> dict[str, Any]:
        """The op's options that reach a backend (``casting`` set to ``"fp32"``) read from a ctx or a dict (an option
        of the public functions only, such as ``quantize``, is in neither)."""
        get = source.get if isinstance(source, dict) else lambda n: getattr(source, n)
        names = [o.name for o in self.norm.spec.options if o.to_backend and o.name != "casting"]
        return {n: get(n) for n in names} | {"casting": "fp32"}

    def _w_e(self, weight: Any, offset: float) -> Any:
        """``rnd_W(w + o)``: the weight itself for ``o = 0``."""
        if weight is None or offset == 0.0:
            return weight
        return self.cast(self.cast(weight, np.float64) + offset, weight.dtype)

    def _fused(self, x: Any) -> bool:
        """Whether the backend runs ``q = rnd(xhat)`` and the identity's affine in one pass (its norm takes the
        identity's ``sink``: the numba backend's statistics kernels, for rows they do not split)."""
        return hasattr(self.identity, "sink") and hasattr(self.norm, "takes_sink") and self.norm.takes_sink(x)

    def _fused_backward(self, x: Any) -> bool:
        """Whether the backend runs the backward of ``q = rnd(xhat)`` and the identity's affine in one pass (the
        identity offers its backward as a ``source`` and the norm's :meth:`backward_cast` takes it: the numba
        backend, for the row blocks of its fused backward)."""
        return hasattr(self.identity, "source") and hasattr(self.norm, "takes_source") and self.norm.takes_source(x)

    def _gemma_weight(self, weight: Any, offset: float) -> Any:
        """``rnd_f32(rnd_f32(w) + rnd_f32(o))`` as float64 values (exact), for kernels computing in float64."""
        return (self.cast(weight, np.float32) + np.float32(offset)).astype(np.float64)

    def forward(self, x: Any, params: dict[str, Any], out: Any, options: Mapping[str, Any]) -> tuple[Any, Any]:
        casting = options["casting"]
        names = self.norm.spec.param_names
        weight, bias = params.get("weight"), params.get("bias")
        offset = float(options.get("weight_offset", 0.0))
        o = self._options(options)
        if casting == "none":
            if self.intype is None:
                raise ArgumentError(
                    f"casting='none' (every operation in x's dtype) has no kernels on this backend; "
                    f"{self.norm.spec.name} here takes casting='fp32', 'gemma', 'llama', 't5' or 'apex'"
                )
            conv = self._conventions(options)
            y, mean, rstd = self.intype.forward(x, weight, bias, **conv, out=out)
            values = {"x": x, "weight": weight, "bias": bias, "mean": mean, "rstd": rstd, **conv, "casting": casting}
            return y, self.norm.spec.ctx(**{f.name: values[f.name] for f in fields(self.norm.spec.ctx)})
        final = {n: params.get(n) for n in names} | {"casting": casting, "weight_offset": offset}
        if casting == "gemma":
            if weight is None or _fp32_math(x.dtype, weight.dtype):
                y, ctx = self.norm.forward(x, *(params.get(n) for n in names), out=out, **o)
            else:
                w_e = self._gemma_weight(weight, offset)
                args = [w_e if n == "weight" else params.get(n) for n in names]
                y, ctx = self.norm.forward(x, *args, out=out, **(o | {"weight_offset": 0.0}))
            return y, replace(ctx, **final)
        qd = quantized_dtype(casting, x.dtype, getattr(weight, "dtype", None))
        if qd is None:  # "t5" without a 16-bit weight: HF's T5 does not round
            y, ctx = self.norm.forward(x, *(params.get(n) for n in names), out=out, **o)
            return y, replace(ctx, **final)
        same = qd == np.dtype(x.dtype)
        if same and self._fused(x):  # q is never stored: each row's q becomes y in the norm's own pass
            sink, y = self.identity.sink(x.shape, x.dtype, self._w_e(weight, offset), bias, out=out, p=1.0)
            _, ctx = self.norm.forward(x, *(None for _ in names), sink=sink, **o)
            return y, replace(ctx, **final)
        q, ctx = self.norm.forward(x, *(None for _ in names), **o)
        if not same:
            q = self.cast(q, qd)
        y, _ = self.identity.forward(q, self._w_e(weight, offset), bias, out=out if same else None, p=1.0)
        if not same:
            y = self.cast(y, x.dtype)
            if out is not None:
                self.copy_into(out, y)
                y = out
        return y, replace(ctx, **final)

    def backward(self, dy: Any, ctx: Any, dx_out: Any) -> Any:
        norm = self.norm
        names = norm.spec.param_names
        casting = ctx.casting
        weight, bias = ctx.weight, getattr(ctx, "bias", None)
        offset = float(ctx.weight_offset)
        plain = replace(ctx, casting="fp32")
        if casting == "none":
            dx, dw, db = self.intype.backward(
                dy, ctx.x, weight, bias, getattr(ctx, "mean", None), ctx.rstd, **self._conventions(ctx), dx_out=dx_out
            )
            return norm.spec.grads(dx, *({"weight": dw, "bias": db}[n] for n in names))
        if casting == "gemma":
            if weight is None or _fp32_math(ctx.x.dtype, weight.dtype):
                return norm.backward(dy, plain, dx_out=dx_out)
            grads = norm.backward(dy, replace(plain, weight=self._gemma_weight(weight, offset), weight_offset=0.0),
                                  dx_out=dx_out)  # fmt: skip
            return grads._replace(dweight=self.cast(grads.dweight, weight.dtype))
        qd = quantized_dtype(casting, ctx.x.dtype, getattr(weight, "dtype", None))
        if qd is None:
            return norm.backward(dy, plain, dx_out=dx_out)
        w_e = self._w_e(weight, offset)
        if casting == "apex":
            return norm.backward(dy, replace(plain, weight=w_e, weight_offset=0.0), dx_out=dx_out)
        bare = replace(plain, **{n: None for n in names})
        same = qd == np.dtype(ctx.x.dtype)
        if same and self._fused_backward(ctx.x):  # q and g never stored: one pass per row (see the module doc)
            src, parts, grads = self.identity.source(ctx.x.dtype, ctx.x.shape, w_e, bias, p=1.0)
            dx = norm.backward_cast(dy, bare, src, parts, dx_out=dx_out)
            rest = dict(zip(("weight", "bias"), grads(), strict=True))
            return norm.spec.grads(dx, *(rest[n] for n in names))
        q, _ = norm.forward(ctx.x, *(None for _ in names), **self._options(ctx))
        if not same:
            q, dy = self.cast(q, qd), self.cast(dy, qd)
        ident = self.identity.backward(dy, self.identity.spec.ctx(x=q, weight=w_e, bias=bias, p=1.0))
        g = ident.dx if same else self.cast(ident.dx, ctx.x.dtype)
        gn = norm.backward(g, bare, dx_out=dx_out)
        rest = {"weight": ident.dweight, "bias": ident.dbias}
        return norm.spec.grads(gn.dx, *(rest[n] for n in names))


class Composed:
    """An op's implementation on a fast backend (``impl``, ``casting="fp32"`` only) with the other casting
    policies composed around it: the same ``forward``/``backward`` contract, every non-default ``casting`` run by
    :class:`Casting` (made on first use by ``make``)."""

    def __init__(self, impl: Any, make: Callable[[], Casting]) -> None:
        self.impl = impl
        self.spec = impl.spec
        self._make = make
        self._policies: Casting | None = None
        self._n_inputs = len(self.spec.inputs)

    def __repr__(self) -> str:
        return f"<{self.impl!r} with its casting policies composed>"

    @property
    def policies(self) -> Casting:
        if self._policies is None:
            self._policies = self._make()
        return self._policies

    def forward(self, x: Any, *args: Any, out: Any = None, **options: Any) -> Any:
        if options.get(CASTING, DEFAULT) == DEFAULT:
            return self.impl.forward(x, *args, out=out, **options)
        params = dict(zip(self.spec.param_names, args[self._n_inputs :], strict=True))
        return self.policies.forward(x, params, out, {**self.spec.defaults(), **options})

    def forward_for(self, options: Any) -> Any:
        """What runs ``options`` (:func:`pynorm._dispatch._target`: ``run(x, *arrays, out=None)``, the options
        bound): the implementation's own for the default ``casting`` (a repeated call's dispatcher then calls it
        directly), else :meth:`forward`."""
        if options.get(CASTING, DEFAULT) != DEFAULT:
            return functools.partial(self.forward, **options)
        pick = getattr(self.impl, "forward_for", None)
        return functools.partial(self.impl.forward, **options) if pick is None else pick(options)

    def serves_option(self, name: str, options: Any) -> bool:
        """The implementation's :meth:`~pynorm.backends.numba.stats.StatsOp.serves_option` for the default
        ``casting`` (a policy's forward serves no public-only option: the dispatcher applies them after it)."""
        pick = getattr(self.impl, "serves_option", None)
        return options.get(CASTING, DEFAULT) == DEFAULT and pick is not None and bool(pick(name, options))

    def backward(self, dy: Any, ctx: Any, dx_out: Any = None, **upstream: Any) -> Any:
        if getattr(ctx, CASTING, DEFAULT) == DEFAULT:
            return self.impl.backward(dy, ctx, dx_out=dx_out, **upstream)
        return self.policies.backward(dy, ctx, dx_out)

    def backward_for(self, options: Any) -> Any:
        """The backward of the ctxs a call with ``options`` makes (:func:`pynorm._dispatch._short_backward`): the
        implementation's own for the default ``casting`` (its ``backward_for``, if it has one), else
        :meth:`backward`."""
        pick = getattr(self.impl, "backward_for", None)
        if options.get(CASTING, DEFAULT) != DEFAULT or pick is None:
            return self.backward
        return pick(options)


def bind(op: str, backend: str, impl: Any, pieces: Any) -> Composed:
    """``impl`` (op ``op`` on ``backend``) with the casting policies composed around it, run on the backend's
    own ops (its PowerNorm as the identity) and ``pieces`` (the backend's module of ``cast(a, dtype)``,
    ``copy_into(dst, src)`` and the in-dtype kernels ``InType(spec)``). Called by the registry."""
    from .. import _registry

    def make() -> Casting:
        identity = _registry.op_module(backend, "power_norm")
        return Casting(impl, identity, pieces.cast, pieces.copy_into, pieces.InType(impl.spec))

    return Composed(impl, make)
