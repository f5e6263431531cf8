"""The ``numba`` backend: JIT-compiled, parallel CPU kernels for ``numpy.ndarray`` inputs.

Same functions and ctx fields as :mod:`pynorm.reference`, module by module
(``layer_norm.forward``/``backward``, ``rms_norm.forward``/``backward``). The
jitted kernels live in :mod:`._kernels` (compiled lazily on first use and cached
on disk, never at import); :mod:`._threads` controls the thread count.

Importing this package does not import numba.
"""

#: op name -> submodule implementing ``forward``/``backward`` (read by the registry).
OPS = {
    "layer_norm": "layer_norm",
    "rms_norm": "rms_norm",
}
