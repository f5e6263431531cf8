"""The reference backend: pure NumPy, the definition of every op and pynorm's oracle.

Registered as the ``numpy`` backend. One module per norm (or per pair
of related norms), each op with ``forward(x2d, *inputs, *params, **options) -> (y, ctx)`` and
``backward(dy, ctx, **upstream) -> grads`` on ``(rows, hidden)`` arrays; :mod:`pynorm._dispatch`
does validation and reshaping.
"""

#: op name -> submodule implementing ``forward``/``backward`` (read by the registry); a submodule
#: serving several ops maps them to their functions in ``OP_IMPLS``.
OPS = {
    "layer_norm": "layer_norm",
    "rms_norm": "rms_norm",
    "scale_norm": "scale_norm",
    "power_norm": "power_norm",
    "dyt": "dyt",
    "add_layer_norm": "add_norm",
    "add_rms_norm": "add_norm",
    "modality_layer_norm": "modality_norm",
    "modality_rms_norm": "modality_norm",
    "conditional_layer_norm": "conditional_norm",
    "conditional_rms_norm": "conditional_norm",
    "quant_layer_norm": "quant_norm",
    "layer_norm_linear": "norm_linear",
    "rms_norm_linear": "norm_linear",
    "group_norm": "group_norm",
    "instance_norm": "group_norm",
    "batch_norm": "batch_norm",
}
