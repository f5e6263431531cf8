"""The ``cupy`` backend: CUDA C kernels (``kernels/*.cu``) launched on :class:`cupy.ndarray` inputs.

One module per norm, mirroring :mod:`pynorm.reference` function by function (same
``forward``/``backward`` signatures, the same ctx dataclasses and gradient tuples, holding
CuPy arrays):

* :mod:`.layer_norm`, :mod:`.rms_norm` -- host launchers;
* :mod:`._loader` -- reads the ``.cu`` files (``#line`` directives keep compiler messages
  pointing at them) and instantiates templates through NVRTC name expressions, one
  :class:`cupy.RawModule` per file and type combination, cached per device;
* :mod:`._launch` -- launch configuration and occupancy model (pure Python);
* :mod:`.compile_check` -- ``python -m pynorm.backends.cupy.compile_check`` compiles every
  instantiation for sm_80 and sm_90 with NVRTC from pip and fails on errors or spills.

bfloat16 arrays are ``cupy.ndarray`` objects whose dtype is ``ml_dtypes.bfloat16``
(CuPy >= 14). The kernels do every conversion themselves; the host code only allocates,
reinterprets (``view``) and copies such arrays through same-size integer views, so it
relies on no bfloat16 arithmetic in CuPy.

Importing this package imports neither CuPy nor the submodules.
"""

#: op name -> submodule implementing ``forward``/``backward`` (read by the registry).
OPS = {
    "layer_norm": "layer_norm",
    "rms_norm": "rms_norm",
}
