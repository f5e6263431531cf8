"""The functional API: ``<op>(...) -> y``, ``<op>_forward(...) -> (y, ctx)`` and ``<op>_backward(dy, ctx) -> grads``
for every op of :data:`pynorm.ops.SPECS`, and each op's gradient tuple.

The functions are made from the specs by :mod:`pynorm._api` (their signatures, defaults and docstrings are the
spec's; ``functional.pyi`` has them for type checkers and editors). Each is one call of :mod:`pynorm._dispatch`,
which validates the arguments against the spec once, before dispatch, picks a backend through
:mod:`pynorm._registry`, flattens ``x`` to ``(rows, hidden)``, calls that backend and reduces the parameter
gradients back to the parameters' shapes. ``ctx`` is a :class:`Context`; ``backward`` runs on the backend that
ran ``forward``.

Shapes follow ONNX's ``axis`` rule: dims ``axis .. ndim-1`` of ``x`` are normalized together (``axis`` may be
negative); parameters have shape ``x.shape[axis:]`` or any shape that broadcasts to it from the right (e.g.
``(H,)`` for a ``(..., 1, H)`` normalized block). Gradients come back in each parameter's own shape and dtype.
"""

from __future__ import annotations

from ._api import functions
from ._dispatch import Context
from .ops import SPECS

_grads = {s.grads.__name__: s.grads for s in SPECS.values()}
_functions = functions(__name__)
globals().update(_grads)
globals().update(_functions)

__all__ = ["Context", *sorted(_grads), *_functions]
