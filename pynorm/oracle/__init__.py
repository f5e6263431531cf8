"""The oracle toolkit: check your own implementation of an op against pynorm's reference, and golden vectors.

* :func:`check` (``python -m pynorm check MODULE:FUNCTION --op OP``) runs your forward (and backward)
  over the conformance grid (:mod:`pynorm.oracle.grid`; rows of ``(*lead, *normalized_shape)``, or for
  ``group_norm``/``instance_norm``/``batch_norm`` ``(N, C, *spatial)`` with running statistics and channels
  last), measures each output's error in ulps of its dtype at the magnitude of its terms and as an absolute
  error, judges each cell against per-output budgets, says
  per failing cell whether the error is within what a backward-stable algorithm may lose
  (:mod:`pynorm.oracle.stability`), and names the causes it can reproduce: each cause is a model of an
  implementation (:mod:`pynorm.oracle.models`), named per dtype where its outputs match yours on the failing
  cells (:mod:`pynorm.oracle.diagnose`).
* :func:`write_vectors` / :func:`read_vectors` / :func:`verify_vectors` (``python -m pynorm vectors``) write
  and read versioned golden vectors (inputs, outputs, gradients, statistics, conventions, tolerances and the
  constants of the ulp rule) in JSON or NPZ, described by the JSON Schema ``pynorm/oracle/vectors.schema.json``
  (:func:`schema`).

Module layout (no module imports one that imports it): ``_dtypes`` and ``grid`` at the bottom, then
``evaluate`` (budgets, the reference, the yardsticks), ``stability``, ``model_types``, ``channel_models`` (the
models of GroupNorm, InstanceNorm and BatchNorm), ``models``, ``diagnose``, ``report``,
``runner`` (:func:`check`), ``quant_check`` (:func:`check_quantizer`: FP8 / FP4 quantizers, code for code),
``vectors`` and ``cli``.

Documented in ``docs/oracle.md``.
"""

from __future__ import annotations

from .diagnose import Diagnosis
from .evaluate import DEFAULT_BUDGETS, Budgets, CellResult, OutputCheck, parse_budget
from .grid import KINDS, Cell, default_grid, make_case, quick_grid
from .models import Model, models_for
from .quant_check import QuantCheckReport, check_quantizer
from .report import CheckReport
from .runner import check
from .vectors import SCHEMA_VERSION, read_vectors, schema, verify_vectors, write_vectors

__all__ = [
    "DEFAULT_BUDGETS",
    "KINDS",
    "SCHEMA_VERSION",
    "Budgets",
    "Cell",
    "CellResult",
    "CheckReport",
    "Diagnosis",
    "Model",
    "OutputCheck",
    "QuantCheckReport",
    "check",
    "check_quantizer",
    "default_grid",
    "make_case",
    "models_for",
    "parse_budget",
    "quick_grid",
    "read_vectors",
    "schema",
    "verify_vectors",
    "write_vectors",
]
