r"""DeepNorm's constants (Wang et al. 2022, "DeepNet: Scaling Transformers to 1,000 Layers")."""

from __future__ import annotations

from typing import Any

from .errors import ArgumentError
from .ops import check_positive_int as positive_int

__all__ = ["deepnorm_constants"]


def deepnorm_constants(arch: str, N: int | None = None, M: int | None = None) -> Any:
    r"""DeepNorm's residual scale ``alpha`` and initialisation gain ``beta``, exactly as the paper gives them.

    A DeepNorm sublayer computes :math:`x \leftarrow \mathrm{LN}(\alpha x + G(x))` (Post-LN with an
    up-weighted skip) and its feed-forward, value and output projections start as Xavier-normal
    matrices with gain :math:`\beta` (queries and keys: gain 1).

    ===================  ======================================  ======================================
    ``arch``             :math:`\alpha`                           :math:`\beta`
    ===================  ======================================  ======================================
    ``"encoder"``        :math:`(2N)^{1/4}`                       :math:`(8N)^{-1/4}`
    ``"decoder"``        :math:`(2M)^{1/4}`                       :math:`(8M)^{-1/4}`
    ``"encoder-decoder"`` encoder :math:`0.81 (N^4 M)^{1/16}`,     encoder :math:`0.87 (N^4 M)^{-1/16}`,
                         decoder :math:`(3M)^{1/4}`               decoder :math:`(12M)^{-1/4}`
    ===================  ======================================  ======================================

    Parameters
    ----------
    arch : ``"encoder"`` (encoder-only, ``N`` layers), ``"decoder"`` (decoder-only, ``M`` layers) or
        ``"encoder-decoder"`` (``N`` encoder and ``M`` decoder layers). A "layer" is one block of an
        attention and a feed-forward sublayer.
    N, M : the layer counts, positive ints; exactly those ``arch`` uses must be given.

    Returns
    -------
    ``(alpha, beta)`` for ``"encoder"`` and ``"decoder"``; ``((alpha_enc, beta_enc), (alpha_dec, beta_dec))``
    for ``"encoder-decoder"``.

    Raises
    ------
    pynorm.errors.ArgumentError : an unknown ``arch``, or ``N``/``M`` missing, not a positive int, or
        given where ``arch`` does not use it.

    Notes
    -----
    Other constants in use, which this function does **not** return:

    * microsoft/torchscale divides the encoder's weights of an encoder-decoder by
      :math:`(N^4 M)^{1/16} / 1.15`, i.e. an encoder ``beta`` of :math:`1.15 (N^4 M)^{-1/16}` instead of
      the paper's 0.87 factor;
    * GLM-130B used :math:`\alpha = (2N)^{1/2}` and :math:`\beta = (2N)^{-1/2}`.

    Some write-ups describe ``alpha`` and ``beta`` as *learnable* scalars weighting
    ``alpha * x + beta * f(x)``; the paper fixes both (``beta`` is an initialisation gain, not a
    multiplier). :class:`pynorm.blocks.Block` follows the paper by default; ``learnable_alpha=True``
    makes ``alpha`` a trainable scalar starting at the paper's value.

    >>> deepnorm_constants("encoder", N=6)  # doctest: +ELLIPSIS
    (1.86..., 0.37...)
    """
    if not isinstance(arch, str) or arch not in ("encoder", "decoder", "encoder-decoder"):
        raise ArgumentError(f"arch must be 'encoder', 'decoder' or 'encoder-decoder', got {arch!r}")
    uses = {"encoder": ("N",), "decoder": ("M",), "encoder-decoder": ("N", "M")}[arch]
    given = {"N": N, "M": M}
    for name, v in given.items():
        if name not in uses and v is not None:
            raise ArgumentError(f"arch={arch!r} does not use {name}; got {name}={v!r}")
    for name, v in given.items():
        if name in uses and v is None:
            what = "encoder" if name == "N" else "decoder"
            raise ArgumentError(f"arch={arch!r} needs {name} (the number of {what} layers)")
    if arch == "encoder":
        n = positive_int(N, "N")
        return (2.0 * n) ** 0.25, (8.0 * n) ** -0.25
    if arch == "decoder":
        m = positive_int(M, "M")
        return (2.0 * m) ** 0.25, (8.0 * m) ** -0.25
    n, m = positive_int(N, "N"), positive_int(M, "M")
    k = float(n**4 * m) ** (1.0 / 16.0)
    return (0.81 * k, 0.87 / k), ((3.0 * m) ** 0.25, (12.0 * m) ** -0.25)
