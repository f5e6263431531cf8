r"""A Transformer block (attention + feed-forward sublayers) in one of four residual placements.

With :math:`f` a sublayer (attention, then feed-forward) and :math:`n` a norm:

==============  =================================================  ==================================
placement       sublayer output                                     source
==============  =================================================  ==================================
``"pre"``       :math:`x + f(n(x))`                                 Pre-LN (GPT-2, Llama)
``"post"``      :math:`n(x + f(x))`                                 Post-LN (the original Transformer)
``"sandwich"``  :math:`x + n_{out}(f(n_{in}(x)))`                   Sandwich-LN (CogView), NormFormer-like
``"deepnorm"``  :math:`n(\alpha x + f(x))`, Xavier gain β on        DeepNet (Wang et al. 2022)
                ``fc1``, ``fc2``, ``v``, ``o`` (1 on ``q``, ``k``)
==============  =================================================  ==================================

Backward, per sublayer (``dy`` the gradient of its output):

* pre: :math:`dx = dy + n'^T\!\big(f'^T dy\big)`;
* post / deepnorm: :math:`dh = n'^T dy`, :math:`dx = \alpha\, dh + f'^T dh` (:math:`\alpha = 1` for post);
  with a learnable α, :math:`d\alpha = \sum dh \odot x`;
* sandwich: :math:`dx = dy + n_{in}'^T\big(f'^T (n_{out}'^T dy)\big)`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from ..deepnorm import deepnorm_constants
from ..errors import ArgumentError
from ..ops import check_real
from ._base import Module, as_rng, choice, compute_dtype, keyword_options, options_for, positive_int
from .sublayers import NORM_KINDS, AttentionKw, FeedForward, MultiHeadAttention, Norm, _cast

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["PLACEMENTS", "STACK_PLACEMENTS", "Block", "BlockKw", "LayerKw"]

PLACEMENTS = ("pre", "post", "sandwich", "deepnorm", "layer_norm_scaling", "peri", "hybrid")
#: the placements of a :class:`~pynorm.blocks.Stack`: every block's, and Mix-LN's (``"post"`` then ``"pre"`` blocks)
STACK_PLACEMENTS = (*PLACEMENTS, "mix")
#: the placements whose blocks wrap each sublayer in two norms (``norm<k>_in``, ``norm<k>_out``)
_TWO_NORMS = ("sandwich", "peri")


def _add(x: Any, f: Any) -> Any:
    cdt = compute_dtype(x.dtype)
    return _cast(x.astype(cdt, copy=False) + f.astype(cdt, copy=False), x.dtype)


def _scaled(z: Any, s: float) -> Any:
    """``s z`` in the compute dtype, rounded to ``z``'s (``z`` itself for ``s = 1``: Pre-LN's arithmetic unchanged)."""
    if s == 1.0:
        return z
    return _cast(z.astype(compute_dtype(z.dtype), copy=False) * s, z.dtype)


class LayerKw(AttentionKw, total=False):
    """The options a :class:`Block` and a :class:`~pynorm.blocks.Stack` share (a stack passes them to each block)."""

    placement: str
    norm: str
    modality_kind: str
    n_modalities: int | None
    learnable_alpha: bool


class BlockKw(LayerKw, total=False):
    """:class:`Block`'s keyword options: :class:`LayerKw`, the block's depth and DeepNorm's constants."""

    depth: int
    alpha: float | None
    beta: float | None
    n_layers: int | None


class Block(Module):
    r"""Attention then feed-forward, each wrapped in the residual ``placement`` (see the module docs).

    Parameters
    ----------
    d_model, n_heads : width and heads. d_ff : feed-forward width (default ``4 * d_model``).
    placement : ``"pre"``, ``"post"``, ``"sandwich"``, ``"peri"``, ``"deepnorm"``, ``"layer_norm_scaling"`` or
        ``"hybrid"`` (the module docs).
    norm : the norms' kind: ``"layer"``, ``"rms"``, ``"scale"``, ``"dyt"``, ``"derf"`` or ``"modality"``
        (per-modality parameter tables of kind ``modality_kind``, ``n_modalities`` of them; the
        forward then needs ``modality_ids``).
    qk_norm, io_norms, causal : the attention's options (:class:`~pynorm.blocks.MultiHeadAttention`).
    io_norm_kind : the kind of the attention's ``ln_q``/``ln_kv``/``ln_out`` (``io_norms=True`` only):
        ``"layer"``, ``"rms"``, ``"scale"``, ``"dyt"`` or ``"derf"``. None (default) follows ``norm`` -- a block asked
        for RMSNorm has RMSNorm everywhere -- and, for ``norm="modality"``, ``modality_kind`` (the
        attention sees no modality ids, so its io norms are shared by the modalities).
    alpha, beta : DeepNorm's constants; default :func:`pynorm.deepnorm_constants` for ``n_layers``
        blocks (``"decoder"`` when ``causal``, else ``"encoder"``). Only for ``placement="deepnorm"``.
    depth : the block's 1-based depth :math:`\ell` in its stack (a :class:`~pynorm.blocks.Stack` passes it): LayerNorm
        Scaling multiplies each norm's output by :math:`1/\sqrt{\ell}`; the other placements ignore it.
    qk_norm, v_norm : the attention's QK-norm and value norm; ``placement="hybrid"`` turns both on (QKV-norm), its
        ``qk_norm`` None meaning ``"rms"`` for ``norm="rms"`` and ``"layer"`` otherwise.
    learnable_alpha : make DeepNorm's ``alpha`` a trainable scalar (``params["alpha"]``) starting at the
        paper's value -- as some write-ups describe it; the paper keeps it fixed (default).
    eps : the norms' eps (None: each norm's own default).
    rng : the initialisation's randomness (None, an int seed, a ``SeedSequence`` or a Generator), as for
        every sublayer; the attention draws first, then the feed-forward.
    dtype, backend, xp : parameter dtype and array module (:class:`~pynorm.blocks.Linear`).

    Notes
    -----
    ``forward(x, padding_mask=None, modality_ids=None) -> (y, ctx)`` with ``x`` of shape
    ``(B, T, d_model)``; ``backward(dy, ctx) -> dx``. Parameter names (``attn.q.W``, ``norm1.norm.weight``,
    ...) by placement and option: ``docs/blocks.md``, "Parameter names".
    """

    @keyword_options(BlockKw)
    def __init__(self, d_model: int, n_heads: int, d_ff: int | None = None, **kw: Unpack[BlockKw]) -> None:
        super().__init__(kw["dtype"], kw["xp"], kw["backend"])
        placement, norm, causal = kw["placement"], kw["norm"], kw["causal"]
        alpha, beta, n_layers, learnable_alpha = kw["alpha"], kw["beta"], kw["n_layers"], kw["learnable_alpha"]
        self.placement = choice(placement, "placement", PLACEMENTS)
        self.norm_kind = choice(norm, "norm", NORM_KINDS)
        io_norm_kind = kw["io_norm_kind"]
        if io_norm_kind is None and kw["io_norms"]:
            io_norm_kind = (
                choice(kw["modality_kind"], "modality_kind", ("layer", "rms")) if norm == "modality" else norm
            )
        d_model = positive_int(d_model, "d_model")
        if placement == "deepnorm":
            if alpha is None or beta is None:
                if n_layers is None:
                    raise ArgumentError("placement='deepnorm' needs n_layers (or both alpha and beta)")
                arch = "decoder" if causal else "encoder"
                a0, b0 = deepnorm_constants(arch, **{"M" if causal else "N": positive_int(n_layers, "n_layers")})
                alpha = a0 if alpha is None else alpha
                beta = b0 if beta is None else beta
            self.alpha, self.beta = check_real(alpha, "alpha"), check_real(beta, "beta")
        else:
            if learnable_alpha or alpha is not None or beta is not None:
                raise ArgumentError(f"alpha, beta and learnable_alpha are DeepNorm's; placement is {placement!r}")
            self.alpha, self.beta = 1.0, 1.0
        self.depth = positive_int(kw["depth"], "depth")
        #: LayerNorm Scaling's factor 1/sqrt(depth) on each norm's output (1: none)
        self.scale = 1.0 / np.sqrt(self.depth) if placement == "layer_norm_scaling" else 1.0
        if placement == "hybrid":
            kw = {**kw, "v_norm": True, "qk_norm": kw["qk_norm"] or ("rms" if norm == "rms" else "layer")}
        self.learnable_alpha = bool(learnable_alpha)
        if self.learnable_alpha:
            self.add_param("alpha", np.full((1,), self.alpha))
        rng = as_rng(kw["rng"])
        g = self.beta
        sub = {"rng": rng, "xp": self.xp}
        self.attn = MultiHeadAttention(
            d_model,
            n_heads,
            **options_for(MultiHeadAttention, kw, io_norm_kind=io_norm_kind, v_gain=g, o_gain=g, **sub),
        )
        self.ffn = FeedForward(d_model, d_ff, **options_for(FeedForward, kw, gain=g, **sub))
        names: tuple[str, ...] = ("norm1", "norm2")
        if placement in _TWO_NORMS:
            names = ("norm1_in", "norm1_out", "norm2_in", "norm2_out")
        elif placement == "hybrid":
            names = ("norm2",)  # the attention's norms are its QKV norms
        self.norms = {n: Norm(d_model, norm, **options_for(Norm, kw, xp=self.xp)) for n in names}
        self.children = {"attn": self.attn, "ffn": self.ffn, **self.norms}

    @property
    def needs_ids(self) -> bool:
        return self.norm_kind == "modality"

    def _alpha(self) -> float:
        return float(self.params["alpha"][0]) if self.learnable_alpha else self.alpha

    def _sub(self, i: int, x: Any, pm: Any, ids: Any) -> tuple[Any, Any]:
        def f(z: Any) -> tuple[Any, Any]:
            return self.attn.forward(z, pm) if i == 0 else self.ffn.forward(z)

        k = str(i + 1)
        pl = self.placement
        if pl in ("pre", "layer_norm_scaling"):
            z, cn = self.norms[f"norm{k}"].forward(x, ids)
            fz, cf = f(_scaled(z, self.scale))
            return _add(x, fz), (cn, cf)
        if pl == "hybrid" and i == 0:
            fx, cf = f(x)
            return _add(x, fx), cf
        if pl in _TWO_NORMS:
            z, cin = self.norms[f"norm{k}_in"].forward(x, ids)
            fz, cf = f(z)
            o, cout = self.norms[f"norm{k}_out"].forward(fz, ids)
            return _add(x, o), (cin, cf, cout)
        fx, cf = f(x)
        y, cn = self.norms[f"norm{k}"].forward_add(fx, x, self._alpha() if pl == "deepnorm" else 1.0, ids)
        return y, (cf, cn, x)  # alpha is in cn

    def _sub_back(self, i: int, dy: Any, ctx: Any) -> Any:
        fb = self.attn.backward if i == 0 else self.ffn.backward
        k = str(i + 1)
        pl = self.placement
        if pl in ("pre", "layer_norm_scaling"):
            cn, cf = ctx
            return _add(dy, self.norms[f"norm{k}"].backward(_scaled(fb(dy, cf), self.scale), cn))
        if pl == "hybrid" and i == 0:
            return _add(dy, fb(dy, ctx))
        if pl in _TWO_NORMS:
            cin, cf, cout = ctx
            do = self.norms[f"norm{k}_out"].backward(dy, cout)
            return _add(dy, self.norms[f"norm{k}_in"].backward(fb(do, cf), cin))
        cf, cn, x = ctx
        dh, dres = self.norms[f"norm{k}"].backward_add(dy, cn)
        if self.learnable_alpha:
            cdt = compute_dtype(dh.dtype, self.dtype)
            self.accumulate("alpha", (dh.astype(cdt) * x.astype(cdt)).sum().reshape(1))
        return _add(dres, fb(dh, cf))

    def forward(self, x: Any, padding_mask: Any = None, modality_ids: Any = None) -> tuple[Any, Any]:
        if self.needs_ids and modality_ids is None:
            raise ArgumentError("norm='modality' needs modality_ids of shape (B, T)")
        h, c1 = self._sub(0, x, padding_mask, modality_ids)
        y, c2 = self._sub(1, h, padding_mask, modality_ids)
        return y, (c1, c2)

    def backward(self, dy: Any, ctx: Any) -> Any:
        c1, c2 = ctx
        return self._sub_back(0, self._sub_back(1, dy, c2), c1)
