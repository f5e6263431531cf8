"""Accelerated backends of pynorm: one subpackage per backend (``numba``, ``cupy``).

Each subpackage is imported lazily by :mod:`pynorm._registry`, defines ``OPS``
(op name -> submodule with ``forward``/``backward``) and must stay cheap to
import: the heavy library (numba, cupy) is imported by the op modules only.
"""
