r"""A stack of :class:`~pynorm.blocks.Block` s: one forward and one backward through all of it,
per-layer gradient norms and update sizes, the multimodal hybrid configuration, and gradient
checkpointing.

**Checkpointing** (``checkpoint=True``): forward keeps only each block's *input* (one
``(B, T, d_model)`` array per block) and drops the block's ``ctx``; backward recomputes each block's
forward from its saved input, just before that block's backward. The recomputation runs the same
operations on the same inputs, so the gradients are bitwise equal to those without checkpointing;
the peak activation memory drops from all blocks' contexts to the inputs plus one block's context,
at the price of a second forward (``bench/bench_checkpoint.py`` measures it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import ArgumentError, ShapeError
from ..ops import check_real
from ._base import Module, as_rng, choice, keyword_options, options_for, positive_int
from .block import STACK_PLACEMENTS, Block, LayerKw
from .sublayers import Norm

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["Stack", "StackCtx", "StackKw"]


class StackKw(LayerKw, total=False):
    """:class:`Stack`'s keyword options: each block's (:class:`~pynorm.blocks.block.LayerKw`) and the stack's own."""

    hybrid_layers: int
    final_norm: bool | None
    input_norm: bool | None
    mix_alpha: float
    checkpoint: bool
    record: bool


@dataclass
class StackCtx:
    """What :meth:`Stack.backward` needs: each block's ctx, or (checkpointed) each block's input."""

    checkpointed: bool
    saved: list[Any]
    final: Any
    padding_mask: Any
    modality_ids: Any
    initial: Any = None  # the input norm's ctx


class Stack(Module):
    r"""``n_layers`` blocks, then an optional final norm.

    Parameters
    ----------
    n_layers, d_model, n_heads, d_ff : sizes (``d_ff`` default ``4 * d_model``).
    placement : every block's placement (:class:`~pynorm.blocks.Block`: ``"pre"``, ``"post"``, ``"sandwich"``,
        ``"peri"``, ``"deepnorm"``, ``"layer_norm_scaling"``, ``"hybrid"``), or ``"mix"`` (Mix-LN: the lowest
        ``floor(mix_alpha * n_layers)`` blocks ``"post"``, the others ``"pre"``). DeepNorm's
        ``alpha``/``beta`` default to :func:`pynorm.deepnorm_constants` with ``N = n_layers``
        (``"decoder"`` with ``M = n_layers`` when ``causal``); LayerNorm Scaling's block ``i`` (from 0) has depth
        ``i + 1``.
    norm : the norm kind of every block and of the final norm (``"layer"``, ``"rms"``, ``"scale"``,
        ``"dyt"``, ``"derf"``, ``"modality"``); ``"dyt"`` / ``"derf"`` make a norm-free stack (every norm slot
        an element-wise function).
    mix_alpha : Mix-LN's fraction of Post-LN blocks (default 0.25, the paper's; ``placement="mix"`` only).
    input_norm : a norm of the stack's input (the embedding output, ``input_norm.norm.<...>``) before the first
        block (None, the default: True for ``"peri"``, else False).
    modality_kind : the tables' kind (``"layer"`` or ``"rms"``) when ``norm="modality"`` (a hybrid
        stack's tables are of kind ``norm``).
    hybrid_layers : ``k`` -- the multimodal *hybrid* configuration: the lowest ``k`` blocks use
        modality-specific norms (parameter tables of kind ``norm``, ``n_modalities`` rows; needs
        ``norm`` in ``"layer"``, ``"rms"``), the blocks above share one norm across modalities.
    n_modalities : number of modalities (for ``norm="modality"`` or ``hybrid_layers``).
    final_norm : a norm after the last block (None, the default: True where the last block's output is not
        normalized -- ``pre``, ``sandwich``, ``peri``, ``layer_norm_scaling``, ``mix`` with a Pre-LN block on top
        --, False for ``post``, ``deepnorm``, ``hybrid`` and an all-Post-LN ``mix``).
    qk_norm, io_norms, io_norm_kind, causal, learnable_alpha, eps : passed to each block
        (:class:`~pynorm.blocks.Block`; ``io_norm_kind=None`` follows ``norm``).
    checkpoint : gradient checkpointing by default (``forward(checkpoint=...)`` overrides it).
    record : append per-layer gradient norms to ``history["grad_norm"]`` after each backward.
    rng : the initialisation's randomness (None, an int seed, a ``SeedSequence`` or a Generator), as for
        every block; the blocks draw from it in order, bottom first.
    dtype, backend, xp : parameter dtype and array module.

    Notes
    -----
    ``forward(x, padding_mask=None, modality_ids=None, checkpoint=None) -> (y, StackCtx)``;
    ``backward(dy, ctx) -> dx``. Parameter names are ``layers.<i>.<Block's names>`` and
    ``final_norm.norm.<...>`` (the table: ``docs/blocks.md``, "Parameter names").
    """

    @keyword_options(StackKw)
    def __init__(
        self, n_layers: int, d_model: int, n_heads: int, d_ff: int | None = None, **kw: Unpack[StackKw]
    ) -> None:
        super().__init__(kw["dtype"], kw["xp"], kw["backend"])
        placement, norm, hybrid_layers = kw["placement"], kw["norm"], kw["hybrid_layers"]
        self.n_layers = positive_int(n_layers, "n_layers")
        self.placement = choice(placement, "placement", STACK_PLACEMENTS)
        mix_alpha = check_real(kw["mix_alpha"], "mix_alpha")
        if not 0.0 <= mix_alpha <= 1.0:
            raise ArgumentError(f"mix_alpha must be in [0, 1], got {mix_alpha}")
        if placement != "mix" and mix_alpha != 0.25:
            raise ArgumentError(f"mix_alpha is Mix-LN's; placement is {placement!r}")
        #: Mix-LN's number of Post-LN blocks (the lowest ones)
        self.n_post = int(np.floor(mix_alpha * self.n_layers + 1e-9)) if placement == "mix" else 0
        if isinstance(hybrid_layers, bool) or not isinstance(hybrid_layers, (int, np.integer)):
            raise ArgumentError(f"hybrid_layers must be an int in [0, n_layers], got {hybrid_layers!r}")
        if not 0 <= hybrid_layers <= self.n_layers:
            raise ArgumentError(f"hybrid_layers must be in [0, {self.n_layers}], got {hybrid_layers}")
        if hybrid_layers and norm not in ("layer", "rms"):
            raise ArgumentError(f"hybrid_layers needs norm='layer' or 'rms' (the modality tables' kind), got {norm!r}")
        self.hybrid_layers = int(hybrid_layers)
        self.checkpoint = bool(kw["checkpoint"])
        self.record = bool(kw["record"])
        sub = {"rng": as_rng(kw["rng"]), "xp": self.xp, "n_layers": self.n_layers if placement == "deepnorm" else None}
        self.input_norm = None
        input_norm = kw["input_norm"]
        if input_norm if input_norm is not None else placement == "peri":
            # before the blocks, so that it draws nothing from rng ahead of them (a norm draws nothing anyway)
            self.input_norm = Norm(d_model, norm, **options_for(Norm, kw, xp=self.xp))
        self.blocks: list[Block] = []
        for i in range(self.n_layers):
            hybrid = i < self.hybrid_layers  # a modality norm whose tables are of kind `norm`
            kinds = {"norm": "modality", "modality_kind": norm} if hybrid else {}
            pl = ("post" if i < self.n_post else "pre") if placement == "mix" else placement
            opts = options_for(Block, kw, **sub, **kinds, placement=pl, depth=i + 1)
            self.blocks.append(Block(d_model, n_heads, d_ff, **opts))
        self.children = {f"layers.{i}": b for i, b in enumerate(self.blocks)}
        if self.input_norm is not None:
            self.children["input_norm"] = self.input_norm
        final_norm = kw["final_norm"]
        if final_norm is None:
            final_norm = self.blocks[-1].placement in ("pre", "sandwich", "peri", "layer_norm_scaling")
        self.final_norm = None
        if final_norm:
            self.final_norm = Norm(d_model, norm, **options_for(Norm, kw, xp=self.xp))
            self.children["final_norm"] = self.final_norm
        self.history: dict[str, list[list[float]]] = {"grad_norm": [], "update_norm": []}

    @property
    def needs_ids(self) -> bool:
        return any(b.needs_ids for b in self.blocks) or (self.final_norm is not None and self.final_norm.needs_ids)

    def forward(
        self, x: Any, padding_mask: Any = None, modality_ids: Any = None, checkpoint: bool | None = None
    ) -> tuple[Any, StackCtx]:
        if x.ndim != 3:
            raise ShapeError(f"x must have shape (B, T, d_model), got {tuple(x.shape)}")
        if self.needs_ids and modality_ids is None:
            raise ArgumentError("this stack has modality-specific norms: pass modality_ids of shape (B, T)")
        ck = self.checkpoint if checkpoint is None else bool(checkpoint)
        saved: list[Any] = []
        h, ci = x, None
        if self.input_norm is not None:
            h, ci = self.input_norm.forward(h, modality_ids)
        for blk in self.blocks:
            if ck:
                saved.append(h)
                h, _ = blk.forward(h, padding_mask, modality_ids)
            else:
                h, c = blk.forward(h, padding_mask, modality_ids)
                saved.append(c)
        cf = None
        if self.final_norm is not None:
            h, cf = self.final_norm.forward(h, modality_ids)
        return h, StackCtx(ck, saved, cf, padding_mask, modality_ids, ci)

    def backward(self, dy: Any, ctx: StackCtx) -> Any:
        if self.final_norm is not None:
            dy = self.final_norm.backward(dy, ctx.final)
        for i in reversed(range(self.n_layers)):
            blk = self.blocks[i]
            if ctx.checkpointed:
                _, c = blk.forward(ctx.saved[i], ctx.padding_mask, ctx.modality_ids)  # recompute
            else:
                c = ctx.saved[i]
            dy = blk.backward(dy, c)
            del c
        if self.input_norm is not None:
            dy = self.input_norm.backward(dy, ctx.initial)
        if self.record:
            self.history["grad_norm"].append(self.layer_grad_norms())
        return dy

    # -- per-layer measurements -----------------------------------------------------------------
    def _per_layer(self, values: dict[str, float]) -> list[float]:
        sq = [0.0] * self.n_layers
        for name, v in values.items():
            if name.startswith("layers."):
                sq[int(name.split(".")[1])] += float(v) ** 2
        return [float(np.sqrt(s)) for s in sq]

    def layer_grad_norms(self) -> list[float]:
        """The L2 norm of each block's accumulated parameter gradients (all its parameters together)."""
        vals = {}
        for name, owner, key in self.named_parameters():
            g = owner.grads[key]
            vals[name] = float(owner.xp.sqrt((g.astype(np.float64) ** 2).sum()))
        return self._per_layer(vals)

    def record_updates(self, update_norms: dict[str, float]) -> list[float]:
        """Aggregate an optimizer's per-parameter update norms (``{name: ||delta||}``, names as
        :meth:`named_parameters` gives them, with or without a prefix ending in ``layers.``) per block;
        appended to ``history["update_norm"]`` and returned."""
        strip = {n[n.index("layers.") :]: v for n, v in update_norms.items() if "layers." in n}
        out = self._per_layer(strip)
        self.history["update_norm"].append(out)
        return out
