"""The reference backend: pure NumPy, the definition of every op and pynorm's oracle.

Registered as the ``numpy`` backend. One module per norm, each with
``forward(x2d, *params, **conventions) -> (y, ctx)`` and ``backward(dy, ctx) -> grads``
on ``(rows, hidden)`` arrays; :mod:`pynorm.functional` does validation and reshaping.
"""

#: op name -> submodule implementing ``forward``/``backward`` (read by the registry).
OPS = {
    "layer_norm": "layer_norm",
    "rms_norm": "rms_norm",
}
