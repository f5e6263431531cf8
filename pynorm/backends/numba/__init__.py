"""The ``numba`` backend: JIT-compiled, parallel CPU kernels for ``numpy.ndarray`` inputs.

Every op of a kernel family this backend has is served by that family's module: ``OPS`` maps
each op name to it (``"stats"`` for the statistics family: LayerNorm, RMSNorm, ScaleNorm, the fused
residual add + norm, the modality norms; ``"elementwise"`` for PowerNorm and DyT), and the module's
``OP_IMPLS`` maps the op to an object with ``forward``/``backward`` of the reference module's
contract (:mod:`pynorm._registry`). Both are derived from :data:`pynorm.ops.SPECS`: a new spec
of a family, in a variant the family's kernels have, needs no new module here.

Layout of the package (kernels split by piece; :mod:`._cache` keeps numba's disk cache
consistent across the files):

* :mod:`._cache` -- the ``jit`` decorator and the cache locator keyed on all the sources;
* :mod:`._args` -- the named argument bundles of the statistics family's kernels (numba-free);
* :mod:`._layout` -- chunk/block/tile sizes and the path rules (numba-free);
* :mod:`._variant` -- variant tags (statistic, store mode) chosen at compile time;
* :mod:`._storage` -- storage and rounding (float16/bfloat16 bits, one rounding);
* :mod:`._rowstats` -- row statistics: shared helpers and each statistic's pieces;
* :mod:`._stream` -- streaming (non-temporal) stores;
* :mod:`._stats_kernels` -- the statistics family's kernels (one skeleton for every variant);
* :mod:`._reduce` -- reductions of the per-block partial sums;
* :mod:`._io` -- the statistics family's prologue, affine-source and epilogue pieces;
* :mod:`.stats` -- the statistics family's host code and ``OP_IMPLS``;
* :mod:`._ew_kernels`, :mod:`.elementwise` -- the element-wise family (kernels; host code and ``OP_IMPLS``);
* :mod:`._quant_kernels`, :mod:`.quantize` -- the quantize family (int8 input and output: quant_layer_norm);
* :mod:`._column_kernels`, :mod:`.column` -- the column-statistics family (per-channel statistics: BatchNorm);
* :mod:`._common`, :mod:`._threads` -- host glue (storage views, output pool), thread control.

Importing this package does not import numba: the kernels compile lazily on first use and are
cached on disk.

The kernels' contract with the rest of pynorm is the families' records (:mod:`pynorm.ops.families`): each
statistic's names its pieces here (``_rowstats.CENTERED``, ...), and the hosts read every option and ctx field
through them (:func:`pynorm.ops.families.kernel_args`). The casting policies are composed above the backend
(:data:`COMPOSED`): no module here imports :mod:`pynorm.composite`.

Names used throughout the kernels (the argument bundles of :mod:`._args` spell out the first group):

=============  ==========================================================================================
``stat``       the statistic's tag (:mod:`._variant`): a compile-time choice, its pieces in :mod:`._rowstats`
``pro``        the prologue: None, or ``(residual, alpha, h)`` -- ``h = x + alpha * residual`` computed first
``tab``        the affine source's table: None, or ``(ids, M)`` -- row ``i`` uses row ``ids[i]`` of ``(M, H)``
``aux``        the statistic's per-row value besides ``r``: the mean, or ScaleNorm's floor flag (ctx ``mean`` /
               ``floor``)
``ep``         the backward's epilogue: None, or ``(dh, alpha, dresidual)``
``pw``, ``pb`` the per-row-block partial sums of the weight's / the bias's gradient
``conv``       the statistic's conventions ``(eps, correction, mode)``; ``mode``: the r rule
``k``, ``c``   a row's centring ``(x - k) - c``: the shift ``k`` (math type) and the residual ``c``; ``cs``:
               the rows' ``c``, ``shifts``: the rows' ``k`` (split kernels)
``r``          the row's factor (ctx ``rstd``); ``r_s = r * 2**e`` on the slow path (rows scaled by ``2**-e``)
``mdt``        the math type (float32, float64 for float64 data); ``pdt``: the partials' dtype
``xr``, ``yr``  row ``i`` of ``x``, ``y`` (``dyr``, ``dxr``, ``er``: of ``dy``, ``dx``, the epilogue)
``ld``, ``st``  load an element in the math type / store one rounded once (:mod:`._storage`); ``tcast``:
               convert to an array's math type
``stream``     None, or True for streaming stores (:mod:`._stream`)
=============  ==========================================================================================
"""

from __future__ import annotations

from typing import Any

from ...ops import Served, families


class _Named:
    """The choices of a record axis whose records name numba pieces, read at each test (live: a statistic or
    function registered later -- ``families.STATISTICS[name] = record`` -- is served from then on)."""

    def __init__(self, records: dict[str, object]) -> None:
        self._records = records

    def __contains__(self, name: object) -> bool:
        r = self._records.get(name) if isinstance(name, str) else None
        return bool(getattr(r, "numba", ""))

    def __iter__(self):  # type: ignore[no-untyped-def]
        return iter(tuple(n for n, r in self._records.items() if getattr(r, "numba", "")))

    def __repr__(self) -> str:
        return repr(tuple(self))


#: the variants of each kernel family this backend has kernels for (axis -> choices): the statistics and
#: functions whose records name numba pieces (live), the prologues, affine sources and epilogues of :mod:`._io`, and
#: the quantize family's statistics (:mod:`._quant_kernels`)
VARIANTS: dict[str, dict[str, Any]] = {
    "stats": {
        "statistic": _Named(families.STATISTICS),  # type: ignore[arg-type]
        "prologue": ("plain", "residual"),
        "affine": ("vector", "scalar", "table", "channel"),
        "epilogue": ("plain", "prenorm"),
    },
    "elementwise": {"function": _Named(families.FUNCTIONS)},  # type: ignore[arg-type]
    "quantize": {"statistic": families.QUANTIZE_STATISTICS},
    "column": {"statistic": _Named(families.COLUMN_STATISTICS)},  # type: ignore[arg-type]
}

#: options composed above this backend (:data:`pynorm.ops.families.COMPOSED`) -> the submodule holding the
#: backend's pieces the composite runs on (``casting``: :mod:`.intype`, the in-dtype kernels and the array casts)
COMPOSED = {families.CASTING: "intype"}


def _has_kernels(spec: object) -> bool:
    family = getattr(spec, "family", None)
    v = getattr(spec, "variant", None)
    return family in VARIANTS and all(getattr(v, axis, None) in ch for axis, ch in VARIANTS[family].items())


#: op name -> submodule implementing it (read by the registry; ``OP_IMPLS`` of that module): the family's module
OPS: Served[str] = Served(_has_kernels, lambda spec: spec.family)
