"""The named argument bundles of the statistics family's kernels (numba-free).

A kernel of :mod:`._stats_kernels` / :mod:`._split_kernels` takes its arguments in a few bundles, each a
:class:`~typing.NamedTuple` whose fields say what they are, instead of a dozen positional names:

=====================  =================================================================================
:class:`Rows`          the rows the forward normalizes: ``x`` and its prologue
:class:`Affine`        the output's scale and shift: weight, bias and the table selecting their rows
:class:`Conventions`   the statistic's run-time conventions: ``eps``, ``correction``, the r rule
:class:`RowStats`      the per-row values the forward writes and the backward reads (aux value, ``r``)
:class:`Grad`          where the backward's gradient goes: ``dx`` and the epilogue
:class:`Partials`      the parameter gradients' per-row-block partial sums
=====================  =================================================================================

The host builds them by name (``Affine(weight=..., bias=None, table=None)``); :func:`plain` hands them to a
kernel as plain tuples -- numba's dispatcher types a plain tuple argument on its fast path, a NamedTuple
costs about 5 us more per call -- and the kernel unpacks them by position (``weight, bias, table = affine``)
before passing the fields to its body one by one: numba prunes a ``None`` field's branches only for a
function's own arguments (see :mod:`._stats_kernels`). A field that is None is an absent choice (no bias, no
prologue, ...), compiled out.

Fields that are themselves small tuples (:mod:`._io`): a prologue ``(residual, alpha, h)``, a table
``(ids, M)``, an epilogue ``(dh or None, alpha, dresidual)``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

__all__ = ["Affine", "Conventions", "Grad", "Partials", "RowStats", "Rows", "plain"]


class Rows(NamedTuple):
    """The rows a forward kernel normalizes."""

    #: ``(R, H)`` storage array (:func:`._common.storage`): the input
    x: Any
    #: None (the rows are ``x``'s), or ``(residual, alpha, h)``: ``h = x + alpha * residual`` is computed, stored
    #: into ``h`` and normalized (:func:`._io.src_row`)
    prologue: Any = None


class Affine(NamedTuple):
    """The output's scale and shift (the affine source of :class:`pynorm.ops.StatsVariant`)."""

    #: the effective weight ``w + offset`` in the math type, ``(H,)`` or ``(M, H)`` with a table; None: no weight
    weight: Any
    #: the bias in the math type (same shapes); None: no bias (always None in a backward)
    bias: Any = None
    #: None (every row uses the vectors), or ``(ids, M)``: row ``i`` uses row ``ids[i]`` of the ``(M, H)`` tables
    table: Any = None


class Conventions(NamedTuple):
    """The statistic's run-time conventions (from :func:`pynorm.ops.families.kernel_args`, :meth:`of`)."""

    eps: float
    correction: int
    #: the r rule (:data:`pynorm.ops.families.R_INSIDE`, ...)
    mode: int

    @classmethod
    def of(cls, args: Any) -> Conventions:
        """The conventions of a :class:`pynorm.ops.families.StatsArgs` (what ``kernel_args`` read of a spec's
        options or ctx)."""
        return cls(args.eps, args.correction, args.mode)


class RowStats(NamedTuple):
    """Per-row float64 values the forward writes and the backward reads."""

    #: the statistic's per-row *aux* value besides ``r``: the mean (centred statistics), the floor flag (1.0
    #: where ScaleNorm's ``r`` took the floor); None for a statistic with neither
    aux: Any
    #: ``r`` (ctx's ``rstd``); the forward marks rows left for the slow path with -1
    rstd: Any


class Grad(NamedTuple):
    """Where a backward kernel writes its gradient."""

    #: ``(R, H)`` storage array of ``dx``
    dx: Any
    #: None, or ``(dh or None, alpha, dresidual)``: the gradient at ``h`` plus ``dh``, stored as ``dx`` and as
    #: ``dresidual = alpha * (g + dh)`` (:func:`._io.put`)
    epilogue: Any = None


class Partials(NamedTuple):
    """Per-row-block partial sums of the parameter gradients (``(blocks, H)``; with a table, a row per block and
    table row it uses, :mod:`._io`), in
    the math type -- float64 for a statistic that does not normalize (:attr:`pynorm.ops.families.Statistic.
    normalizes`); None where the parameter is absent."""

    #: partials of ``dy * xhat`` (the weight's gradient)
    weight: Any = None
    #: partials of ``dy`` (the bias's)
    bias: Any = None


def plain(bundle: tuple[Any, ...]) -> tuple[Any, ...]:
    """``bundle`` as the plain tuple a kernel takes (see the module doc)."""
    return tuple(bundle)
