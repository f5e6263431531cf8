"""The reference backend: pure NumPy, the definition of every op and pynorm's oracle.

Registered as the ``numpy`` backend. One module per norm (or per pair
of related norms), each op with ``forward(x2d, *inputs, *params, **options) -> (y, ctx)`` and
``backward(dy, ctx, **upstream) -> grads`` on ``(rows, hidden)`` arrays; :mod:`pynorm._dispatch`
does validation and reshaping.
"""

from ..ops import Served as _Served

#: op name -> the module implementing ``forward``/``backward`` (read by the registry): the spec's ``reference``
#: (a module serving several ops maps them to their functions in ``OP_IMPLS``); live, so an op registered at run
#: time (:func:`pynorm.ops.register`) is served by the module its spec names
OPS: _Served[str] = _Served(lambda spec: True, lambda spec: spec.reference)
