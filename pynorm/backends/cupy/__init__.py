"""The ``cupy`` backend: CUDA C kernels (``kernels/*.cu``) launched on :class:`cupy.ndarray` inputs.

Each op is a variant of a kernel family (:mod:`pynorm.ops`: the spec names it), so one module
serves every op of a family, mirroring :mod:`pynorm.reference` op by op (same ``forward``/``backward``
contract, the same ctx dataclasses and gradient tuples, holding CuPy arrays):

* :mod:`.stats` -- host launchers of the statistics family (LayerNorm, RMSNorm, ScaleNorm, the fused
  residual add + norm, the modality norms), ``OP_IMPLS``;
* :mod:`.elementwise` -- host launchers of the element-wise family (PowerNorm, DyT), ``OP_IMPLS``;
* :mod:`.quantize` -- host launchers of the quantize family (the quantization-friendly LayerNorm), ``OP_IMPLS``;
* :mod:`._loader` -- reads the ``.cu`` files (``#line`` directives keep compiler messages
  pointing at them) and instantiates templates through NVRTC name expressions, one
  :class:`._loader.Module` per file, dtypes and variant (compiled without flush-to-zero, the binary cached on
  disk), loaded per device;
* :mod:`._launch` -- launch configuration and occupancy model (pure Python);
* :mod:`.compile_check` -- ``python -m pynorm.backends.cupy.compile_check`` compiles every
  instantiation the specs declare for sm_80 and sm_90 with NVRTC from pip and fails on errors or spills.

bfloat16 arrays are ``cupy.ndarray`` objects whose dtype is ``ml_dtypes.bfloat16``
(CuPy >= 14). The kernels do every conversion themselves; the host code only allocates,
reinterprets (``view``) and copies such arrays through same-size integer views, so it
relies on no bfloat16 arithmetic in CuPy.

Importing this package imports neither CuPy nor the submodules.
"""

from ...ops import Served as _Served
from ...ops.families import CASTING as _CASTING
from ._loader import supports as _supports

#: op name -> submodule implementing it (read by the registry): each family's module
OPS: _Served[str] = _Served(_supports, lambda spec: spec.family)

#: options composed above this backend (:data:`pynorm.ops.families.COMPOSED`) -> the submodule holding the
#: backend's pieces the composite runs on (``casting``: :mod:`.intype`, the in-dtype kernels and the array casts)
COMPOSED = {_CASTING: "intype"}
