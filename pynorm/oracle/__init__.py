"""The oracle toolkit: check your own implementation of an op against pynorm's reference, and golden vectors.

* :func:`check` (``python -m pynorm check MODULE:FUNCTION --op OP``) runs your forward (and backward)
  over the conformance grid (:mod:`pynorm.oracle.grid`), measures each output's error in ulps of its dtype
  at the magnitude of its terms, judges each cell against per-output budgets, and names the classic bugs
  it recognizes (:mod:`pynorm.oracle.diagnose`).
* :func:`write_vectors` / :func:`read_vectors` / :func:`verify_vectors` (``python -m pynorm vectors``) write
  and read versioned golden vectors (inputs, outputs, gradients, conventions, tolerances) in JSON or NPZ,
  described by the JSON Schema ``pynorm/oracle/vectors.schema.json`` (:func:`schema`).

Documented in ``docs/oracle.md``.
"""

from __future__ import annotations

from .diagnose import Diagnosis
from .grid import KINDS, Cell, default_grid, make_case, quick_grid
from .runner import DEFAULT_BUDGETS, Budgets, CellResult, CheckReport, check, parse_budget
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
    "check",
    "default_grid",
    "make_case",
    "parse_budget",
    "quick_grid",
    "read_vectors",
    "schema",
    "verify_vectors",
    "write_vectors",
]
