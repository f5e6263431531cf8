r"""Optimizers over anything with ``named_parameters()``: a :class:`pynorm.blocks.Module` (a model, a block) or a
:mod:`pynorm.layers` layer.

Every optimizer walks ``model.named_parameters()`` -- ``(dotted name, owner, key)`` triples, the parameter being
``owner.params[key]`` and its accumulated gradient ``owner.grads[key]`` -- and updates each parameter by
**replacing** it (``owner.params[key] = p + delta``), never writing into the array: a ctx of an earlier forward
keeps the values its forward used (and a layer's ctx holds its own copy of its parameters anyway,
:meth:`pynorm.layers.Layer.forward`). Its state (moments, momentum buffers) is keyed by the dotted names.

* :class:`Adam`, :class:`AdamW` (decoupled weight decay, Loshchilov & Hutter), :class:`SGD` (momentum, optional
  Nesterov, optional L2 weight decay);
* the learning rate of step ``t`` (1, 2, ...) is ``lr * warmup(t) * schedule(t)``: ``warmup`` a linear ramp over
  the first ``warmup`` steps (0: none), ``schedule`` any callable ``t -> factor`` (:func:`cosine_schedule`, or your
  own), the hook;
* ``clip``: the whole gradient rescaled to at most this global L2 norm first; ``grad_scale`` (a loss scale,
  :class:`pynorm.blocks.LossScaler`) divides the gradients;
* ``decay``: which parameters weight decay applies to, ``decay(name, param) -> bool`` (default every one, as
  PyTorch's; ``lambda name, p: p.ndim >= 2`` spares the norms' weights and the biases).

``step(model, grad_scale=1.0)`` returns ``{name: ||delta||_2}``, each parameter's update size.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from .errors import ArgumentError

__all__ = ["SGD", "Adam", "AdamW", "Optimizer", "cosine_schedule"]


def _positive_real(v: Any, name: str, zero: bool = False) -> float:
    ok = isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) and math.isfinite(v)
    if not ok or v < 0 or (v == 0 and not zero):
        raise ArgumentError(f"{name} must be a finite number {'>= 0' if zero else '> 0'}, got {v!r}")
    return float(v)


def _fraction(v: Any, name: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not 0.0 <= v < 1.0:
        raise ArgumentError(f"{name} must be a number in [0, 1), got {v!r}")
    return float(v)


def cosine_schedule(total: int, final: float = 0.0) -> Callable[[int], float]:
    """A cosine decay of the learning rate's factor from 1 at step 1 to ``final`` at step ``total`` (then
    ``final``): pass it as ``schedule=``."""
    if isinstance(total, bool) or not isinstance(total, int) or total < 1:
        raise ArgumentError(f"total must be an int >= 1, got {total!r}")
    final = _positive_real(final, "final", zero=True)

    def factor(t: int) -> float:
        done = min(max(t - 1, 0) / max(total - 1, 1), 1.0)
        return final + (1.0 - final) * 0.5 * (1.0 + math.cos(math.pi * done))

    return factor


class Optimizer(abc.ABC):
    """What every optimizer shares: the learning rate of each step (``lr``, ``warmup``, the ``schedule`` hook),
    gradient clipping, the loss scale, and the walk over ``model.named_parameters()``; a subclass defines
    :meth:`update`."""

    def __init__(
        self, lr: float, *, warmup: int = 0, clip: float | None = None,
        schedule: Callable[[int], float] | None = None,
    ) -> None:  # fmt: skip
        self.lr = _positive_real(lr, "lr")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ArgumentError(f"warmup must be an int >= 0, got {warmup!r}")
        self.warmup = warmup
        self.clip = None if clip is None else _positive_real(clip, "clip")
        if schedule is not None and not callable(schedule):
            raise ArgumentError(f"schedule must be a callable step -> factor, or None, got {schedule!r}")
        self.schedule = schedule
        self.t = 0

    def lr_at(self, t: int) -> float:
        """The learning rate of step ``t`` (1-based): ``lr * min(1, t / warmup) * schedule(t)``."""
        lr = self.lr * (min(1.0, t / self.warmup) if self.warmup else 1.0)
        if self.schedule is not None:
            f = self.schedule(t)
            if not (isinstance(f, (int, float, np.integer, np.floating)) and math.isfinite(f) and f >= 0):
                raise ArgumentError(f"schedule({t}) must return a finite number >= 0, got {f!r}")
            lr *= float(f)
        return lr

    def step(self, model: Any, grad_scale: float = 1.0) -> dict[str, float]:
        """One update of every parameter of ``model`` (a :class:`pynorm.blocks.Module` or a
        :mod:`pynorm.layers` layer) from its accumulated gradients divided by ``grad_scale``; returns
        ``{name: ||delta||_2}``."""
        named = getattr(model, "named_parameters", None)
        if named is None:
            raise ArgumentError(
                f"model must have named_parameters() (a pynorm.blocks.Module or a pynorm.layers layer), "
                f"got {type(model).__name__}"
            )
        params = list(named())
        self.t += 1
        lr = self.lr_at(self.t)
        inv = 1.0 / _positive_real(grad_scale, "grad_scale")
        if self.clip is not None:
            total = math.sqrt(sum(float((o.grads[k].astype(np.float64) ** 2).sum()) for _, o, k in params)) * inv
            if total > self.clip:
                inv *= self.clip / total
        out = {}
        for name, owner, key in params:
            p = owner.params[key]
            g = owner.grads[key] * inv
            delta = self.update(name, p, g, lr, owner.xp).astype(p.dtype, copy=False)
            owner.params[key] = p + delta
            out[name] = math.sqrt(float((delta * delta).sum()))
        return out

    @abc.abstractmethod
    def update(self, name: str, p: Any, g: Any, lr: float, xp: Any) -> Any:
        """The change of parameter ``name`` (value ``p``, gradient ``g``) at learning rate ``lr`` (each optimizer's
        own rule: :class:`Adam`, :class:`AdamW`, :class:`SGD`)."""


class Adam(Optimizer):
    r"""Adam (Kingma & Ba) over a model's parameters, in each parameter's dtype (fp32 masters).

    .. math::

        g = \nabla / S,\quad m \leftarrow \beta_1 m + (1-\beta_1) g,\quad v \leftarrow \beta_2 v + (1-\beta_2) g^2,\quad
        \theta \leftarrow \theta - \eta_t\, \frac{m / (1-\beta_1^t)}{\sqrt{v / (1-\beta_2^t)} + \epsilon}

    with :math:`S` the loss scale passed to :meth:`step` and :math:`\eta_t` the learning rate of step ``t``
    (:meth:`Optimizer.lr_at`: ``lr``, the linear ``warmup``, the ``schedule`` hook). ``clip``: rescale the whole
    gradient to at most this global L2 norm first (None: no clipping).
    """

    def __init__(
        self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, *, warmup: int = 0,
        clip: float | None = None, schedule: Callable[[int], float] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(lr, warmup=warmup, clip=clip, schedule=schedule)
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ArgumentError(f"betas must be two numbers in [0, 1), got {betas!r}")
        self.betas = (_fraction(betas[0], "betas[0]"), _fraction(betas[1], "betas[1]"))
        self.eps = _positive_real(eps, "eps")
        self.m: dict[str, Any] = {}
        self.v: dict[str, Any] = {}

    def update(self, name: str, p: Any, g: Any, lr: float, xp: Any) -> Any:
        b1, b2 = self.betas
        if name not in self.m:
            self.m[name], self.v[name] = xp.zeros_like(p), xp.zeros_like(p)
        m, v = self.m[name], self.v[name]
        m *= b1
        m += (1 - b1) * g
        v *= b2
        v += (1 - b2) * (g * g)
        c1, c2 = 1.0 - b1**self.t, 1.0 - b2**self.t
        step, rc2 = -lr / c1, 1.0 / math.sqrt(c2)
        return step * m / (xp.sqrt(v) * rc2 + self.eps)


class AdamW(Adam):
    r"""Adam with decoupled weight decay (Loshchilov & Hutter, "Decoupled Weight Decay Regularization"; PyTorch's
    ``AdamW``): each step first shrinks a decayed parameter by :math:`\eta_t \lambda \theta`, then adds Adam's
    update of the (undecayed) gradient -- the decay never enters the moments.

    ``weight_decay`` is :math:`\lambda` (default 0.01, PyTorch's); ``decay(name, param) -> bool`` picks the
    parameters it applies to (default: all; ``lambda n, p: p.ndim >= 2`` spares norm weights and biases).
    """

    def __init__(
        self, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, *,
        weight_decay: float = 0.01, decay: Callable[[str, Any], bool] | None = None, warmup: int = 0,
        clip: float | None = None, schedule: Callable[[int], float] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(lr, betas, eps, warmup=warmup, clip=clip, schedule=schedule)
        self.weight_decay = _positive_real(weight_decay, "weight_decay", zero=True)
        self.decay = decay

    def update(self, name: str, p: Any, g: Any, lr: float, xp: Any) -> Any:
        delta = super().update(name, p, g, lr, xp)
        if self.weight_decay and (self.decay is None or self.decay(name, p)):
            delta = delta - lr * self.weight_decay * p
        return delta


class SGD(Optimizer):
    r"""Stochastic gradient descent with momentum (PyTorch's ``SGD`` convention):

    .. math::

        g \leftarrow \nabla / S + \lambda \theta,\quad b \leftarrow \mu b + g,\quad
        \theta \leftarrow \theta - \eta_t\, (g + \mu b \text{ if nesterov else } b)

    ``momentum`` :math:`\mu` (0: plain SGD), ``weight_decay`` :math:`\lambda` (L2, coupled: it enters the momentum;
    ``decay`` picks the parameters as :class:`AdamW`'s), ``nesterov``.
    """

    def __init__(
        self, lr: float = 1e-2, momentum: float = 0.0, *, nesterov: bool = False, weight_decay: float = 0.0,
        decay: Callable[[str, Any], bool] | None = None, warmup: int = 0, clip: float | None = None,
        schedule: Callable[[int], float] | None = None,
    ) -> None:  # fmt: skip
        super().__init__(lr, warmup=warmup, clip=clip, schedule=schedule)
        self.momentum = _fraction(momentum, "momentum")
        if nesterov and not self.momentum:
            raise ArgumentError("nesterov=True needs momentum > 0")
        self.nesterov = bool(nesterov)
        self.weight_decay = _positive_real(weight_decay, "weight_decay", zero=True)
        self.decay = decay
        self.buffers: dict[str, Any] = {}

    def update(self, name: str, p: Any, g: Any, lr: float, xp: Any) -> Any:
        if self.weight_decay and (self.decay is None or self.decay(name, p)):
            g = g + self.weight_decay * p
        if self.momentum:
            b = self.buffers.get(name)
            if b is None:
                b = self.buffers[name] = xp.array(g, copy=True)
            else:
                b *= self.momentum
                b += g
            g = g + self.momentum * b if self.nesterov else b
        return -lr * g
