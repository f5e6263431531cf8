"""The kernel families' contract (:mod:`pynorm.ops.families`): the records, the check of a spec against its
family, :func:`~pynorm.ops.families.kernel_args`, the backends' use of them (no statistic or option name compared
anywhere else, no backend importing :mod:`pynorm.composite`) and the casting policies composed above the backends.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import pynorm
from pynorm import _registry, ops
from pynorm.ops import SPECS, families
from pynorm.ops.families import FamilyError, kernel_args

ROOT = Path(pynorm.__file__).resolve().parent
KERNELS = ROOT / "backends" / "cupy" / "kernels"


def _kernel_specs() -> list[str]:
    return [n for n, s in SPECS.items() if s.family in ("stats", "quantize", "elementwise")]


# ---------------------------------------------------------------------------
# the records


def test_every_spec_fits_its_family() -> None:
    for spec in SPECS.values():
        families.check_spec(spec)  # (also run when the spec was made)


def test_the_r_rules_are_the_cuda_kernels_eps_modes() -> None:
    text = (KERNELS / "common.cuh").read_text()
    codes = {m[0]: int(m[1]) for m in re.findall(r"\b(kEps\w+)\s*=\s*(\d+)", text)}
    assert codes == {"kEpsVar": families.R_INSIDE, "kEpsStd": families.R_OUTSIDE, "kEpsFloor": families.R_FLOOR}


def test_every_cuda_policy_a_record_names_is_in_the_kernels() -> None:
    stats_cu = (KERNELS / "stats.cu").read_text()
    ew_cu = (KERNELS / "elementwise.cu").read_text()

    def declared(policy: str, text: str) -> bool:
        name = re.sub(r"<.*", "", policy).removeprefix("pynorm::")
        return re.search(rf"(struct|using)\s+{name}\b", text) is not None

    for st in families.STATISTICS.values():
        assert not st.cuda or declared(st.cuda, stats_cu), st
    for rec in (*families.PROLOGUES.values(), *families.AFFINES.values()):
        assert declared(rec.cuda, stats_cu), rec
    for fn in families.FUNCTIONS.values():
        assert not fn.cuda or declared(fn.cuda, ew_cu), fn


def test_every_statistic_with_numba_pieces_implements_every_piece() -> None:
    pytest.importorskip("numba")
    from pynorm.backends.numba import _rowstats

    for st in families.STATISTICS.values():
        if st.numba:
            module, _, name = st.numba.partition(":")
            pieces = getattr(importlib.import_module(module), name)
            assert set(pieces) == set(_rowstats.STUBS), st.name


def test_statistic_records() -> None:
    c, ms, l2 = (families.STATISTICS[n] for n in ("centered", "mean_square", "l2"))
    assert c.fills == ("mean", "rstd") and ms.fills == ("rstd",) and l2.fills == ("rstd", "floor")
    assert c.options == ("eps", "correction", "eps_mode") and ms.options == ("eps",)
    assert (c.rule("std"), c.rule("var"), c.rule(None)) == (families.R_OUTSIDE, families.R_INSIDE, families.R_INSIDE)
    assert (l2.rule("floor"), l2.rule("root"), ms.rule("whatever")) == (families.R_FLOOR, families.R_INSIDE, 0)
    with pytest.raises(FamilyError, match="no r rule"):
        c.rule("floor")
    assert (c.aux_field, ms.aux_field, l2.aux_field) == ("mean", None, "floor")


# ---------------------------------------------------------------------------
# the check at import


def _variant(spec: Any, **changes: Any) -> Any:
    """``spec`` remade with ``changes`` (the check runs when it is made)."""
    return dataclasses.replace(spec, **changes)


@dataclasses.dataclass(frozen=True)
class _NoRstdCtx:
    x: Any
    weight: Any
    eps: float
    weight_offset: float
    casting: str = "fp32"


@dataclasses.dataclass(frozen=True)
class _ExtraCtx:
    x: Any
    weight: Any
    rstd: Any
    eps: float
    weight_offset: float
    casting: str
    cache: Any


def test_a_ctx_without_the_fields_the_kernels_fill_is_an_error_naming_them() -> None:
    with pytest.raises(FamilyError, match=r"rms_norm.*fill ctx\.rstd.*_NoRstdCtx has no field 'rstd'"):
        _variant(ops.RMS_NORM, ctx=_NoRstdCtx)
    with pytest.raises(FamilyError, match=r"_ExtraCtx\.cache is filled by nothing"):
        _variant(ops.RMS_NORM, ctx=_ExtraCtx)
    with pytest.raises(FamilyError, match=r"fill ctx\.mean"):  # a centred statistic fills the mean
        _variant(ops.RMS_NORM, variant=ops.StatsVariant("centered"))


def test_the_options_a_variant_needs_and_takes_are_checked() -> None:
    no_eps = tuple(o for o in ops.RMS_NORM.options if o.name != "eps")
    with pytest.raises(FamilyError, match=r"need the option 'eps'"):
        _variant(ops.RMS_NORM, options=no_eps)
    extra = (*ops.RMS_NORM.options, ops.Option("momentum", 0.1, ops.check_real))
    with pytest.raises(FamilyError, match=r"option 'momentum' is taken by nothing"):
        _variant(ops.RMS_NORM, options=extra)
    # a public-only option never reaches a backend, and casting is composed above them
    public = (*ops.RMS_NORM.options, ops.Option("return_extra", False, lambda v, n: v, to_backend=False))
    _variant(ops.RMS_NORM, options=public)
    floor = tuple(o for o in ops.LAYER_NORM.options if o.name != "eps_mode")
    floor += (ops.Option("eps_mode", "var", ops.one_of("var", "floor")),)
    with pytest.raises(FamilyError, match=r"eps_mode 'floor' has no r rule of the 'centered' statistic"):
        _variant(ops.LAYER_NORM, options=floor)
    with pytest.raises(FamilyError, match=r"option 'eps_mode' is taken by nothing of its variant \(it takes eps, "):
        _variant(ops.RMS_NORM, options=(*ops.RMS_NORM.options, ops.Option("eps_mode", "var", ops.one_of("var"))))


def test_the_axes_choices_parameters_and_inputs_are_checked() -> None:
    with pytest.raises(FamilyError, match=r"statistic 'variance' is not a choice"):
        _variant(ops.RMS_NORM, variant=ops.StatsVariant("variance"))  # type: ignore[arg-type]
    with pytest.raises(FamilyError, match=r"'residual' prologue goes with the 'prenorm' epilogue"):
        _variant(ops.ADD_RMS_NORM, variant=ops.StatsVariant("mean_square", prologue="residual"))
    with pytest.raises(FamilyError, match=r"parameter 'g' is a 'scalar' parameter; its affine source takes 'feature'"):
        _variant(ops.SCALE_NORM, variant=ops.StatsVariant("l2"))
    with pytest.raises(FamilyError, match=r"reads inputs of kinds \['like_x'\]"):
        _variant(ops.ADD_RMS_NORM, inputs=())
    with pytest.raises(FamilyError, match=r"function takes the parameters"):
        _variant(ops.POWER_NORM, params=tuple(reversed(ops.POWER_NORM.params)))


# ---------------------------------------------------------------------------
# kernel_args


@pytest.mark.parametrize("op", _kernel_specs())
def test_kernel_args_read_the_options_and_the_ctx_alike(op: str) -> None:
    spec = SPECS[op]
    for conv in spec.cases:
        options = spec.validate(conv, 8)
        ka = kernel_args(spec, options)
        if spec.family == "elementwise":
            fn = families.function_of(spec)
            assert ka.constant == (options[fn.option] if fn.option else 0.0)
            continue
        st = families.statistic_of(spec)
        assert ka.eps == options["eps"] and type(ka.eps) is float
        assert ka.correction == options.get("correction", 0)
        assert ka.mode == st.rule(options.get("eps_mode"))
        assert ka.weight_offset == options.get("weight_offset", 0.0)
        assert ka.alpha == options.get("alpha", 1.0)
        # the ctx of a forward keeps the options: the backward reads the same arguments from it
        x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
        args = spec.example_args(x.shape, 1, np.float32, np.random.default_rng(1), options=conv)
        _, ctx = spec.generic_forward()(x, *args, backend="numpy", **conv)
        assert kernel_args(spec, ctx.inner) == ka
    # a partial mapping takes the spec's defaults
    assert kernel_args(spec, {}) == kernel_args(spec, spec.defaults())


def test_kernel_args_of_a_composite_are_an_error() -> None:
    with pytest.raises(FamilyError, match="composite family has no kernels"):
        kernel_args(ops.LAYER_NORM_LINEAR, {})


# ---------------------------------------------------------------------------
# the backends use the records


#: names of statistics, eps modes and the options the records own: no backend compares them as strings
_RECORD_NAMES = {
    *families.STATISTICS,
    *(k for s in families.STATISTICS.values() for k in s.rules if k),
    "eps",
    "eps_mode",
    "correction",
    "weight_offset",
    "residual_dtype",
    "casting",
    "p",
}


def _code_strings(path: Path) -> list[tuple[int, str]]:
    """String constants of a module's code (docstrings left out)."""
    tree = ast.parse(path.read_text())
    docs = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (n.lineno, n.value)
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
    ]


def _backend_modules() -> list[Path]:
    return sorted((ROOT / "backends").rglob("*.py"))


def test_no_backend_names_a_statistic_or_an_option_the_records_own() -> None:
    found = [
        f"{p.relative_to(ROOT)}:{line}: {s!r}"
        for p in _backend_modules()
        for line, s in _code_strings(p)
        if s in _RECORD_NAMES
    ]
    assert not found, "compare the records (pynorm.ops.families) instead:\n" + "\n".join(found)


def test_no_backend_imports_the_composites() -> None:
    bad = []
    for p in _backend_modules():
        for node in ast.walk(ast.parse(p.read_text())):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom):
                names = [("." * node.level) + (node.module or "")] + [a.name for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            if any("composite" in n for n in names):
                bad.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    assert not bad, bad


def test_the_casting_policies_are_composed_above_the_fast_backends() -> None:
    pytest.importorskip("numba")
    from pynorm.backends.numba import stats
    from pynorm.composite.casting import Composed

    for op in ("layer_norm", "rms_norm"):
        impl = _registry.op_module("numba", op)
        assert isinstance(impl, Composed) and impl.impl is stats.OP_IMPLS[op]
        assert not isinstance(_registry.op_module("numpy", op), Composed)  # the reference runs them itself
    assert not isinstance(_registry.op_module("numba", "scale_norm"), Composed)  # no casting option
    x = np.random.default_rng(3).standard_normal((6, 16)).astype(np.float16)
    w = np.linspace(0.5, 1.5, 16).astype(np.float16)
    for casting in ("fp32", "gemma", "llama", "none"):
        y, ctx = pynorm.layer_norm_forward(x, w, backend="numba", casting=casting)
        y_ref, _ = pynorm.layer_norm_forward(x, w, backend="numpy", casting=casting)
        assert ctx.inner.casting == casting
        np.testing.assert_allclose(y.astype(np.float64), y_ref.astype(np.float64), atol=4e-3)
