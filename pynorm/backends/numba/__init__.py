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
* :mod:`._common`, :mod:`._threads` -- host glue (storage views, output pool), thread control.

Importing this package does not import numba: the kernels compile lazily on first use and are
cached on disk.
"""

from __future__ import annotations

from ...ops import SPECS

#: the variants of each kernel family this backend has kernels for (axis -> choices)
VARIANTS: dict[str, dict[str, tuple[str, ...]]] = {
    "stats": {
        "statistic": ("centered", "mean_square", "l2"),
        "prologue": ("plain", "residual"),
        "affine": ("vector", "scalar", "table"),
        "epilogue": ("plain", "prenorm"),
    },
    "elementwise": {"function": ("signed_power", "tanh")},
    "quantize": {"statistic": ("centered",)},
}


def _has_kernels(spec: object) -> bool:
    family = getattr(spec, "family", None)
    v = getattr(spec, "variant", None)
    return family in VARIANTS and all(getattr(v, axis, None) in ch for axis, ch in VARIANTS[family].items())


#: op name -> submodule implementing it (read by the registry; ``OP_IMPLS`` of that module): the family's module
OPS: dict[str, str] = {name: spec.family for name, spec in SPECS.items() if _has_kernels(spec)}
