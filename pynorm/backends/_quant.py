"""What the numba and cupy hosts of ``quant_layer_norm`` share: the op's records and its ctx."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from ..ops import SPECS
from ..ops.families import base_norm
from ..ops.quant_norm import QuantLayerNormCtx

__all__ = ["QuantOpBase"]


class QuantOpBase:
    """``quant_layer_norm`` on a backend: its spec, and the statistics family's op of the spec's statistic
    (:attr:`norm`: the norm of a float input and every backward) from the backend's :meth:`_stats_ops`."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.spec = SPECS[name]
        self.norm_name = base_norm(self.spec, SPECS)

    def _stats_ops(self) -> Any:
        """The backend's statistics family (its ``stats.OP_IMPLS``; imported on first use)."""
        raise NotImplementedError

    @property
    def norm(self) -> Any:
        """The statistics family's op of the spec's statistic (:func:`pynorm.ops.families.base_norm`)."""
        return self._stats_ops()[self.norm_name]

    def _ctx(self, conventions: Any, kargs: Any, arrays: dict[str, Any], **epilogue: Any) -> QuantLayerNormCtx:
        """The op's ctx: the conventions as given (those :func:`kernel_args` read, as it read them), the
        epilogue's options and the arrays, by field name."""
        values = {**self.spec.defaults(), **conventions, **dict(zip(kargs._fields, kargs)), **arrays, **epilogue}
        return QuantLayerNormCtx(**{f.name: values[f.name] for f in fields(QuantLayerNormCtx)})
