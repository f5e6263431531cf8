"""``check_quantizer``: a user's FP8 / FP4 quantizer compared code for code and scale for scale with the reference.

The user's function takes a float32 ``(R, H)`` array ``y`` and returns ``(codes, scales)`` or ``(codes, scales,
global_scale)`` in the layout its :class:`~pynorm.ops.fp_quant.QuantSpec` states (those of
:func:`pynorm.quantize`). It runs over a grid of cases -- ordinary rows and the hard ones: zeros, one huge value
among tiny ones, exact rounding ties, values at the format's max and beyond, subnormal codes, NaN and infinity,
a width that leaves a partial block -- each case a tensor of its own (NVFP4's global scale is per tensor).

On a mismatch the check emulates what other implementations do and names the one that reproduces the user's
output on *every* case: a convention (the scale rule floor vs ceil, saturation vs NaN, the nibble order, the
scale layout) or a mistake (truncation instead of round-to-nearest-even, ``amax`` over the wrong part of a block
or the whole row, NVFP4's global scale missing, ``y`` rounded to 16 bits before quantizing), alone or two
together. A convention's advice is verified before it is printed: the check runs again with that convention in
the spec and must pass.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..errors import ArgumentError, ArgumentTypeError
from ..ops.fp_quant import QuantSpec, check_quant_spec
from ..reference import fp_quant as ref

__all__ = ["QuantCheckReport", "QuantModel", "check_quantizer", "quant_cases"]


def quant_cases(spec: QuantSpec, seed: int = 0) -> list[tuple[str, np.ndarray]]:
    """The grid: ``(name, y)`` float32 ``(R, H)`` tensors, ordinary and hard (see the module doc)."""
    rng = np.random.default_rng(seed)
    el = spec.fmt.element
    fmax = np.float32(el.fmax)
    h = 64
    cases = [("normal", (rng.standard_normal((4, h)) * 3).astype(np.float32))]
    cases.append(("zeros", np.zeros((2, h), np.float32)))
    tiny = np.full((2, h), 1e-3, np.float32)
    tiny[0, 5], tiny[1, 40] = 3e4, -2e3
    cases.append(("huge_among_tiny", tiny))
    # scale 1 everywhere (amax = fmax; NVFP4: the tensor's amax 2688 gives g = 1, each block's 6 gives sb = 1):
    # the elements hit the format's values and the midpoints between them (ties) exactly
    vals = ref.decode(np.arange(el.max_code + 1, dtype=np.uint8), el).astype(np.float64)
    mids = ((vals[:-1] + vals[1:]) / 2).astype(np.float32)
    ties = np.zeros((2, h), np.float32)
    ties[:, 0] = fmax
    ties[0, 1 : 1 + min(h - 1, len(mids))] = mids[: h - 1]
    ties[1, 1 : 1 + min(h - 1, len(mids))] = -mids[-(h - 1) :][::-1][: h - 1]
    if spec.fmt.block:
        ties[:, :: spec.fmt.block] = fmax  # every block's amax is fmax
    if spec.fmt.kind == "nvfp4":
        ties[0, 0] = np.float32(ref.NVFP4_GLOBAL)
    cases.append(("ties", ties))
    above = np.zeros((1, h), np.float32)
    above[0, :8] = fmax * np.array([1.0, 1.0625, 1.1, 1.125, 1.2, -1.07, -1.14, 0.5], np.float32)
    cases.append(("at_and_above_max", above))
    sub = np.zeros((1, h), np.float32)
    sub[0, 0] = fmax
    step = np.ldexp(1.0, el.emin - el.mbits)  # the least subnormal
    sub[0, 1:8] = np.array([step, 2 * step, 3 * step, 0.5 * step, 1.5 * step, -step, 0.25 * step], np.float32)
    cases.append(("subnormal", sub))
    nf = (rng.standard_normal((2, h))).astype(np.float32)
    nf[0, 3], nf[1, 7], nf[1, 9] = np.nan, np.inf, -np.nan
    cases.append(("nonfinite", nf))
    cases.append(("odd_width", (rng.standard_normal((3, 41)) * 5).astype(np.float32)))
    return cases


@dataclass(frozen=True)
class QuantModel:
    """A way another implementation quantizes: ``option`` (a convention of :class:`QuantSpec`: the spec field and
    the value it sets) or ``emulate`` (a mistake, :func:`pynorm.reference.fp_quant.quantize_rows`'s), or ``y16``
    (``y`` rounded to a 16-bit dtype first)."""

    code: str
    text: str
    option: tuple[str, Any] | None = None
    emulate: tuple[tuple[str, Any], ...] = ()
    y16: str | None = None

    def applies(self, spec: QuantSpec) -> bool:
        """Whether the model means something for ``spec`` (and differs from it)."""
        fmt = spec.fmt
        if self.option is not None:
            name, value = self.option
            if getattr(spec, name) == value:
                return False
            if name == "scale_rule":
                return fmt.kind == "mx"
            if name == "overflow":
                return fmt.element.over_code is not None
            if name == "nibble_order":
                return fmt.packed
            if name in ("scale_layout", "scale_dtype"):
                return fmt.kind != "scaled"
        em = dict(self.emulate)
        if "no_global" in em:
            return fmt.kind == "nvfp4" and spec.global_scale is None
        if "amax_block" in em:
            return fmt.kind != "scaled" or spec.scaling == "group"
        return True

    def spec_for(self, spec: QuantSpec) -> QuantSpec:
        return spec if self.option is None else replace(spec, **{self.option[0]: self.option[1]})

    def run(self, y: np.ndarray, spec: QuantSpec) -> tuple[np.ndarray, np.ndarray, Any]:
        """This model's ``(codes, scales, global_scale)`` of ``y`` in ``spec``'s layout."""
        s = self.spec_for(spec)
        if self.y16 is not None:
            import ml_dtypes

            dt = ml_dtypes.bfloat16 if self.y16 == "bfloat16" else np.float16
            with np.errstate(all="ignore"):
                y = y.astype(dt).astype(np.float32)
        em = dict(self.emulate)
        if "amax_block" in em and em["amax_block"] == "half":
            em["amax_block"] = max(s.block_size(y.shape[1]) // 2, 1)
        codes, scales, g = ref.layout(*ref.quantize_rows(y, s, em), s)
        if s.fmt.kind == "scaled" and (s.scale is not None or s.scaling == "tensor"):
            scales = scales.reshape(())
        return codes, scales, g


def _models() -> list[QuantModel]:
    # fmt: off
    return [
        QuantModel("scale_rule_ceil", "the E8M0 exponent rounded up (the 'ceil' rule)", option=("scale_rule", "ceil")),
        QuantModel(
            "scale_rule_floor", "the E8M0 exponent by the OCP spec's floor rule", option=("scale_rule", "floor")
        ),
        QuantModel("overflow_nan", "no saturation: values beyond the max become NaN/inf", option=("overflow", "nan")),
        QuantModel("overflow_saturate", "saturation at the format's max", option=("overflow", "saturate")),
        QuantModel("nibble_high_first", "the even element in the high nibble", option=("nibble_order", "high_first")),
        QuantModel("nibble_low_first", "the even element in the low nibble", option=("nibble_order", "low_first")),
        QuantModel("swizzled", "block scales in the 128 x 4 swizzled layout", option=("scale_layout", "swizzled")),
        QuantModel("row_major", "block scales row-major", option=("scale_layout", "row_major")),
        QuantModel(
            "truncation",
            "elements truncated toward zero instead of rounded to nearest even",
            emulate=(("rounding", "trunc"),),
        ),
        QuantModel(
            "amax_half_block",
            "each block's amax over its first half only (a reduction over too few lanes)",
            emulate=(("amax_block", "half"),),
        ),
        QuantModel("amax_row", "each block's amax over the whole row", emulate=(("amax_block", "row"),)),
        QuantModel(
            "global_scale_missing",
            "NVFP4's global scale ignored (block scales of amax / 6 alone)",
            emulate=(("no_global", True),),
        ),
        QuantModel(
            "y_bfloat16", "y rounded to bfloat16 before quantizing (statistics or output in 16 bits)", y16="bfloat16"
        ),
        QuantModel(
            "y_float16", "y rounded to float16 before quantizing (statistics or output in 16 bits)", y16="float16"
        ),
    ]


def _combined(a: QuantModel, b: QuantModel) -> QuantModel | None:
    if (a.option and b.option and a.option[0] == b.option[0]) or (a.y16 and b.y16):
        return None
    if a.option and b.option:
        return None  # two conventions: a spec with both is tried as such below
    opt = a.option or b.option
    return QuantModel(
        f"{a.code}+{b.code}", f"{a.text}; and {b.text}", option=opt, emulate=a.emulate + b.emulate,
        y16=a.y16 or b.y16,
    )  # fmt: skip


def _same(a: Any, b: Any) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    if a.shape != b.shape:
        return False
    if a.dtype.kind == "f" or b.dtype.kind == "f":
        a32, b32 = a.astype(np.float32), b.astype(np.float32)
        return bool(np.all((a32.view(np.uint32) == b32.view(np.uint32)) | (np.isnan(a32) & np.isnan(b32))))
    return bool(np.array_equal(a, b))


def _outputs(res: Any) -> tuple[Any, Any, Any]:
    if not isinstance(res, (tuple, list)) or len(res) not in (2, 3):
        raise ArgumentTypeError("the quantizer must return (codes, scales) or (codes, scales, global_scale)")
    return res[0], res[1], res[2] if len(res) == 3 else None


@dataclass
class QuantCaseResult:
    """One case: whether codes, scales and the global scale equal the reference's, and how many codes differ."""

    name: str
    codes_ok: bool
    scales_ok: bool
    global_ok: bool
    codes_differing: int
    error: str = ""

    @property
    def passed(self) -> bool:
        return self.codes_ok and self.scales_ok and self.global_ok and not self.error


@dataclass
class QuantCheckReport:
    """What :func:`check_quantizer` found: per case, the named cause and the verified advice."""

    spec: QuantSpec
    cases: list[QuantCaseResult]
    diagnosis: list[QuantModel] = field(default_factory=list)
    advice: str = ""

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.cases)

    @property
    def codes(self) -> list[str]:
        """The codes of the named causes (``["scale_rule_ceil"]``; a pair as ``"a+b"``)."""
        return [m.code for m in self.diagnosis]

    def __str__(self) -> str:
        lines = [f"quantizer check, {self.spec}"]
        for c in self.cases:
            what = "ok" if c.passed else (
                c.error or ", ".join(
                    n for n, ok in (("codes", c.codes_ok), ("scales", c.scales_ok), ("global scale", c.global_ok))
                    if not ok
                ) + f" differ ({c.codes_differing} codes)"
            )  # fmt: skip
            lines.append(f"  {c.name:18s} {what}")
        if self.passed:
            lines.append("PASS: every code and scale equals the reference's")
            return "\n".join(lines)
        if self.diagnosis:
            for m in self.diagnosis:
                lines.append(f"diagnosis [{m.code}]: {m.text} -- reproduces every case")
        else:
            lines.append("diagnosis: none of the models reproduces every case")
        if self.advice:
            lines.append(self.advice)
        lines.append(f"FAIL: {sum(not c.passed for c in self.cases)} of {len(self.cases)} cases differ")
        return "\n".join(lines)


def _compare(fn: Callable[..., Any], spec: QuantSpec, cases: list[tuple[str, np.ndarray]]) -> list[Any]:
    """Per case: ``(result, (codes, scales, g))`` -- the user's outputs (None where it raised)."""
    out: list[Any] = []
    for name, y in cases:
        want = QuantModel("reference", "").run(y, spec)
        try:
            raw = _outputs(fn(y.copy()))
            got: Any = tuple(None if a is None else np.asarray(a) for a in raw)
        except Exception as e:  # the user's function failing on a case is a result of the check
            out.append((QuantCaseResult(name, False, False, False, -1, f"raised {type(e).__name__}: {e}"), None))
            continue
        codes_ok = _same(got[0], want[0])
        differing = int(np.count_nonzero(np.asarray(got[0]) != want[0])) if got[0].shape == want[0].shape else -1
        g_ok = want[2] is None or (got[2] is not None and _same(got[2], want[2]))
        out.append((QuantCaseResult(name, codes_ok, _same(got[1], want[1]), g_ok, differing), got))
    return out


def _reproduces(model: QuantModel, spec: QuantSpec, cases: list[tuple[str, np.ndarray]], got: list[Any]) -> bool:
    for (_, y), g in zip(cases, got, strict=True):
        if g is None:
            return False
        m = model.run(y, spec)
        if not (_same(g[0], m[0]) and _same(g[1], m[1]) and (m[2] is None or (g[2] is not None and _same(g[2], m[2])))):
            return False
    return True


def check_quantizer(
    fn: Callable[..., Any], spec: QuantSpec | str, *, seed: int = 0, diagnose: bool = True
) -> QuantCheckReport:  # fmt: skip
    """Check the quantizer ``fn(y) -> (codes, scales[, global_scale])`` against the reference for ``spec``.

    Parameters
    ----------
    fn : the quantizer under test, on float32 ``(R, H)`` NumPy arrays, returning outputs in ``spec``'s layout.
    spec : a :class:`~pynorm.ops.fp_quant.QuantSpec` (or a format name).
    seed : the random cases' seed.
    diagnose : name the cause of a mismatch (see the module doc).

    Returns
    -------
    QuantCheckReport
        ``passed``, the per-case results, ``diagnosis`` (the models reproducing every case) and ``advice``.
    """
    qs = check_quant_spec(spec, "spec")
    if qs is None:
        raise ArgumentError("spec must be a pynorm.QuantSpec or a format name, got None")
    if not callable(fn):
        raise ArgumentTypeError(f"the quantizer must be callable, got {type(fn).__name__}")
    cases = quant_cases(qs, seed)
    results = _compare(fn, qs, cases)
    report = QuantCheckReport(qs, [r for r, _ in results])
    if report.passed or not diagnose:
        return report
    got = [g for _, g in results]
    singles = [m for m in _models() if m.applies(qs)]
    found = [m for m in singles if _reproduces(m, qs, cases, got)]
    if not found:
        for a, b in itertools.combinations(singles, 2):
            m = _combined(a, b)
            if m is not None and m.applies(qs) and _reproduces(m, qs, cases, got):
                found.append(m)
                break
    report.diagnosis = found[:1]
    if found:
        report.advice = _advice(fn, qs, found[0], seed)
    return report


def _advice(fn: Callable[..., Any], spec: QuantSpec, model: QuantModel, seed: int) -> str:
    """The advice for ``model``: a convention verified by checking again with it; a mistake to fix otherwise."""
    if model.option is not None and not model.emulate and model.y16 is None:
        again = check_quantizer(fn, model.spec_for(spec), seed=seed, diagnose=False)
        if again.passed:
            name, value = model.option
            return (
                f"advice (verified: the check passes with it): your quantizer follows {name}={value!r}; "
                f"check it with QuantSpec({spec.format!r}, ..., {name}={value!r}) "
                f"(python -m pynorm check ... --quant {spec.format} --quant-option {name}={value})"
            )
        return ""
    if model.option is not None:
        return f"advice: {model.text.split('; and ')[-1]} is a mistake to fix, and the convention {model.option} too"
    return f"advice: a mistake to fix in your quantizer: {model.text}"
