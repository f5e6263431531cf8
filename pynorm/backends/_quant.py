"""What the numba and cupy hosts of ``quant_layer_norm`` share: the op's records and its ctx."""

from __future__ import annotations

import importlib
from dataclasses import fields
from typing import Any, ClassVar

from ..ops import SPECS
from ..ops._spec import filled
from ..ops.families import base_norm
from ..ops.quant_norm import QuantLayerNormCtx

__all__ = ["QuantOpBase"]

_FIELDS = tuple(f.name for f in fields(QuantLayerNormCtx))


class QuantOpBase:
    """``quant_layer_norm`` on a backend: its spec, and the statistics family's op of the spec's statistic
    (:attr:`norm`: the norm of a float input and every backward) from the backend's statistics module
    (:attr:`stats_module`, whose ``OP_IMPLS`` it reads on first use)."""

    #: the backend's statistics module (``pynorm.backends.<backend>.stats``), set by each backend's subclass
    stats_module: ClassVar[str]

    def __init__(self, name: str) -> None:
        self.name = name
        self.spec = SPECS[name]
        self.norm_name = base_norm(self.spec, SPECS)
        self._norm: Any = None
        self._defaults = self.spec.defaults()

    @property
    def norm(self) -> Any:
        """The statistics family's op of the spec's statistic (:func:`pynorm.ops.families.base_norm`)."""
        if self._norm is None:
            self._norm = importlib.import_module(self.stats_module).OP_IMPLS[self.norm_name]
        return self._norm

    def _ctx(self, conventions: Any, kargs: Any, arrays: dict[str, Any], **epilogue: Any) -> QuantLayerNormCtx:
        """The op's ctx: the conventions as given (those :func:`kernel_args` read, as it read them), the
        epilogue's options and the arrays, by field name."""
        values = {**self._defaults, **conventions, **dict(zip(kargs._fields, kargs)), **arrays, **epilogue}
        return filled(QuantLayerNormCtx, {f: values[f] for f in _FIELDS})
