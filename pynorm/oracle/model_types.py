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

__all__ = ["SHORT", "Emulation", "Emulator", "Model"]

#: each diagnosis code's cause in a few words (the joint diagnoses: "unbiased variance + eps on the std + float32
#: math")
SHORT = {
    "eps_ignored": "a fixed eps of its own",
    "backward_stats_rounded": "the backward from rounded statistics",
    "overflow": "unscaled squares that overflow",
    "underflow": "unscaled squares that underflow",
    "float32_math": "float32 math",
    "strides": "the strides ignored",
    "normalized_dims": "only the last axis normalized",
    "dx_missing_variance_term": "dx without its variance term",
    "dx_missing_mean_term": "dx without its mean term",
    "saved_stats_16bit": "16-bit saved statistics",
    "correct_float64": "a correct float64 algorithm",
    "mean_in_precision": "an uncorrected mean",
    "one_pass": "one-pass variance",
    "xr_minus_mean_r": "x r - mean r",
    "low_precision_math": "the statistics in the input dtype",
    "unbiased_variance": "unbiased variance",
    "eps_on_std": "eps on the std",
    "group_stats_per_channel": "statistics per channel",
    "running_var_biased": "running_var updated biased",
    "momentum_convention": "momentum as the old value's weight",
}


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
    reference : the options that make pynorm's reference follow this model (``{"casting": "llama"}``), for the
        advice (``--reference``).
    evidence : formats the model's evidence numbers for the message.
    named_in : the cell dtypes where the model may be named (None: every dtype; empty: a baseline only).
    options : for a *convention* model (pynorm's reference with options changed): ``options(ev)`` -> the options
        that change in cell ``ev`` (``{}`` where the convention makes no difference, an eps of 0 rounded to
        float32). The joint diagnoses combine convention models with each other and with one other model each
        (:mod:`pynorm.oracle.diagnose`). None: a model of a precision or an algorithm.
    axis : the option a convention model sets (two models of one axis, two ``casting`` policies, never combine).
    short : the cause in a few words, for the joint diagnoses (default: ``code``).
    fitted : a statistics model with bounded unknowns read back from your output: weaker evidence, so that a
        convention is named only where it reproduces outputs without one (:mod:`pynorm.oracle.diagnose`).
    """

    key: str
    code: str
    says: str
    fix: str
    emulate: Emulator
    baseline: str | None = None
    agreement: bool = False
    reference: dict[str, Any] | None = None
    evidence: Callable[[dict[str, float]], str] | None = None
    named_in: tuple[str, ...] | None = None
    options: Callable[[Evaluated], dict[str, Any]] | None = None
    axis: str = ""
    short: str = ""
    fitted: bool = False

    @property
    def words(self) -> str:
        """The cause in a few words (``one-pass variance (float32)``)."""
        if self.short:
            return self.short
        _, _, variant = self.key.partition("/")
        return SHORT.get(self.code, self.code.replace("_", " ")) + (f" ({variant})" if variant else "")
