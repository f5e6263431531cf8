"""The records of the models of implementations: :class:`Emulation` (what a model computes for a cell) and
:class:`Model` (a cause, its message and its emulator); :mod:`pynorm.oracle.models` and
:mod:`pynorm.oracle.channel_models` define the models."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..ops import OpSpec
from .evaluate import Evaluated

__all__ = ["Emulation", "Emulator", "Model"]


@dataclass
class Emulation:
    """What a model computes for one cell.

    Attributes
    ----------
    outputs : float64 values per output / gradient name, in the reference's shapes.
    measure : per output, the dtype whose ulps measure the distance to yours (default: the output's dtype); a
        model computing in a narrower precision than the output's (float32 for float64 input) is measured in it.
    evidence : numbers for the diagnosis message (the largest mean offset, variance offset...).
    precision : the precision the model computes in, where narrower than the output's: your values must then
        carry its signature (be representable in it, or be off from the exact result by a fraction of its ulp).
    """

    outputs: dict[str, np.ndarray]
    measure: dict[str, Any] = field(default_factory=dict)
    evidence: dict[str, float] = field(default_factory=dict)
    precision: str | None = None


Emulator = Callable[[OpSpec, Evaluated], "Emulation | list[Emulation] | None"]


@dataclass(frozen=True)
class Model:
    """A model of an implementation.

    Attributes
    ----------
    key : unique name of this model instance (``"one_pass/float32"``, ``"casting/llama"``, ``"eps_ignored/1e-05"``).
    code : the diagnosis code it reports under (several instances may share one: each casting policy is a
        ``rounding_order``).
    says : what such an implementation does, in one sentence.
    fix : what to do about it.
    emulate : ``emulate(spec, ev)`` -> an :class:`Emulation`, a list of variants (the closest one counts), or None
        where the model does not apply to the cell.
    baseline : the key of the model this one refines (None: the reference).
    agreement : a rounding-order model, also judged by bit agreement over every 16-bit cell of a dtype.
    reference, convention : the options that make pynorm's reference follow this model: reference-only
        (``--reference``) or for both sides (``--convention``), for the advice.
    evidence : formats the model's evidence numbers for the message.
    named_in : the cell dtypes where the model may be named (None: every dtype; empty: a baseline only).
    """

    key: str
    code: str
    says: str
    fix: str
    emulate: Emulator
    baseline: str | None = None
    agreement: bool = False
    reference: dict[str, Any] | None = None
    convention: dict[str, Any] | None = None
    evidence: Callable[[dict[str, float]], str] | None = None
    named_in: tuple[str, ...] | None = None
