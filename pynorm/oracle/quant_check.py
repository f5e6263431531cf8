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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..errors import ArgumentError, ArgumentTypeError
from ..ops.fp_quant import QuantSpec, check_quant_spec
from ..reference import fp_quant as ref

__all__ = ["QuantCheckReport", "QuantModel", "check_quantizer", "op_cases", "quant_cases"]


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
    x16: bool = False

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
        if self.x16:
            return True  # (op mode only: _reproduces)
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
        QuantModel("stats_bfloat16", "the norm computed on x rounded to bfloat16 (statistics in 16 bits)", x16=True),
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


#: op mode: the largest fraction of a case's codes that may sit one code from the reference's (see _matches)
BOUNDARY_FRACTION = 0.01
#: op mode: how far (in float32 ulps) a float32 scale may be from the reference's (a norm's y is a few ulps off)
SCALE_ULPS = 16


def _adjacent(a: np.ndarray, b: np.ndarray, spec: QuantSpec) -> bool:
    """Whether the codes ``a`` and ``b`` (``spec``'s layout) differ only by neighbouring values (one code step)."""
    el = spec.fmt.element
    if spec.fmt.packed:
        a = np.concatenate([a & 0xF, a >> 4], axis=-1)
        b = np.concatenate([b & 0xF, b >> 4], axis=-1)
    va = ref.decode(a, el).astype(np.float64)
    vb = ref.decode(b, el).astype(np.float64)
    diff = va != vb
    if not diff.any():
        return True
    grid = np.sort(np.unique(ref.decode(np.arange(1 << el.nbits, dtype=np.uint8), el).astype(np.float64)))
    grid = grid[np.isfinite(grid)]
    ia, ib = np.searchsorted(grid, va[diff]), np.searchsorted(grid, vb[diff])
    return bool(np.all(np.isfinite(va[diff]) & np.isfinite(vb[diff])) and np.all(np.abs(ia - ib) == 1))


def _near(a: Any, b: Any, spec: QuantSpec, tolerant: bool) -> bool:
    """Scales (or a global scale) equal; ``tolerant``: float32 values within :data:`SCALE_ULPS` ulps, codes (E8M0,
    E4M3) one apart on at most :data:`BOUNDARY_FRACTION` of them (at least one)."""
    if _same(a, b):
        return True
    a, b = np.asarray(a), np.asarray(b)
    if not tolerant or a.shape != b.shape:
        return False
    if a.dtype.kind == "f":
        a32, b32 = a.astype(np.float32), b.astype(np.float32)
        steps = np.abs(a32.view(np.int32).astype(np.int64) - b32.view(np.int32).astype(np.int64))
        return bool(np.all(np.isfinite(a32) == np.isfinite(b32)) and np.all(steps <= SCALE_ULPS))
    d = np.abs(a.astype(np.int64) - b.astype(np.int64))
    return bool(np.all(d <= 1) and np.count_nonzero(d) <= max(1, BOUNDARY_FRACTION * d.size))


def _matches(got: Any, want: Any, spec: QuantSpec, tolerant: bool) -> tuple[bool, bool, bool, int]:
    """``(codes_ok, scales_ok, global_ok, codes differing)``; ``tolerant`` (op mode: the user's ``y`` may differ
    from the reference's by an ulp): scales as :func:`_near` says, and codes one step from the reference's on at
    most :data:`BOUNDARY_FRACTION` of the elements (at least one) count as equal."""
    g0, w0 = np.asarray(got[0]), np.asarray(want[0])
    scales_ok = _near(got[1], want[1], spec, tolerant)
    g_ok = want[2] is None or (got[2] is not None and _near(got[2], want[2], spec, tolerant))
    if g0.shape != w0.shape:
        return False, scales_ok, g_ok, -1
    n = int(np.count_nonzero(g0 != w0))
    limit = max(1.0, BOUNDARY_FRACTION * w0.size * (2 if spec.fmt.packed else 1))
    ok = n == 0 or (tolerant and n <= limit and _adjacent(g0, w0, spec))
    return ok, scales_ok, g_ok, n


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


def _compare(fn: Callable[..., Any], spec: QuantSpec, cases: list[Any], tolerant: bool) -> list[Any]:
    """Per case ``(name, y, call)``: ``(result, (codes, scales, g))`` -- the user's outputs of ``fn(*call)`` (None
    where it raised) against the reference's quantization of ``y``."""
    out: list[Any] = []
    for name, y, call in cases:
        want = QuantModel("reference", "").run(y, spec)
        try:
            raw = _outputs(fn(*(a.copy() if isinstance(a, np.ndarray) else a for a in call)))
            got: Any = tuple(None if a is None else np.asarray(a) for a in raw)
        except Exception as e:  # the user's function failing on a case is a result of the check
            out.append((QuantCaseResult(name, False, False, False, -1, f"raised {type(e).__name__}: {e}"), None))
            continue
        codes_ok, scales_ok, g_ok, n = _matches(got, want, spec, tolerant)
        out.append((QuantCaseResult(name, codes_ok, scales_ok, g_ok, n), got))
    return out


def _reproduces(
    model: QuantModel, spec: QuantSpec, cases: list[Any], got: list[Any], tolerant: bool, op: str | None,
    conv: Mapping[str, Any],
) -> bool:  # fmt: skip
    if model.x16 and op is None:
        return False
    for (_, y, call), g in zip(cases, got, strict=True):
        if model.x16:
            import ml_dtypes

            y = _op_y(op, call[0].astype(ml_dtypes.bfloat16).astype(np.float32), call[1:], conv)
        if g is None or not all(_matches(g, model.run(y, spec), model.spec_for(spec), tolerant)[:3]):
            return False
    return True


def _op_y(op: Any, x: np.ndarray, args: Any, conv: Mapping[str, Any]) -> np.ndarray:
    """The reference's (first) output of ``op`` on ``x`` and ``args``, float32."""
    import pynorm

    res = getattr(pynorm, op)(x, *args, backend="numpy", **conv)
    return np.asarray(res[0] if isinstance(res, tuple) else res, dtype=np.float32)


def op_cases(op: str, conventions: Mapping[str, Any], seed: int = 0) -> list[Any]:
    """Op mode's cases ``(name, y, call)``: ``x`` (float32) and the op's example arguments, ``y`` the reference's
    output of them (the first, for the fused add ops)."""

    from ..ops import SPECS

    if op not in ("layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"):
        raise ArgumentError(f"op must be layer_norm, rms_norm, add_layer_norm or add_rms_norm, got {op!r}")
    spec = SPECS[op]
    rng = np.random.default_rng(seed)
    out = []
    for name, shape, scale in (("normal", (4, 64), 1.0), ("wide_range", (3, 64), 1e3), ("odd_width", (3, 41), 1.0)):
        x = (rng.standard_normal(shape) * scale).astype(np.float32)
        if name == "wide_range":
            x[:, ::7] *= 1e-4
        args = spec.example_args(shape, -1, np.float32, rng)
        out.append((name, _op_y(op, x, args, conventions), (x, *args)))
    return out


def check_quantizer(
    fn: Callable[..., Any], spec: QuantSpec | str, *, op: str | None = None,
    conventions: Mapping[str, Any] | None = None, seed: int = 0, diagnose: bool = True,
) -> QuantCheckReport:  # fmt: skip
    """Check the quantizer ``fn(y) -> (codes, scales[, global_scale])`` against the reference for ``spec``.

    Parameters
    ----------
    fn : the quantizer under test, on float32 ``(R, H)`` NumPy arrays, returning outputs in ``spec``'s layout;
        with ``op``, a fused norm + quantize ``fn(x, *inputs, *params, **conventions)``.
    spec : a :class:`~pynorm.ops.fp_quant.QuantSpec` (or a format name).
    op : ``"layer_norm"``, ``"rms_norm"``, ``"add_layer_norm"``, ``"add_rms_norm"``: check a fused kernel on
        float32 ``x`` (and the op's example arguments) against the reference's ``y`` quantized. Its ``y`` may
        differ from the reference's by a few ulps, so float32 scales within 16 ulps, and codes or scale codes one
        step from the reference's on at most 1 % of a case's elements, pass.
    conventions : the op's options (``eps``...), passed to ``fn`` and to the reference.
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
    conv = dict(conventions or {})
    if op is None:
        cases: list[Any] = [(name, y, (y,)) for name, y in quant_cases(qs, seed)]
        call = fn
    else:
        cases = op_cases(op, conv, seed)

        def call(*a: Any) -> Any:
            return fn(*a, **conv)

    tolerant = op is not None
    results = _compare(call, qs, cases, tolerant)
    report = QuantCheckReport(qs, [r for r, _ in results])
    if report.passed or not diagnose:
        return report
    got = [g for _, g in results]
    singles = [m for m in _models() if m.applies(qs)]
    found = [m for m in singles if _reproduces(m, qs, cases, got, tolerant, op, conv)]
    if not found:
        for a, b in itertools.combinations([m for m in singles if not m.x16], 2):
            m = _combined(a, b)
            if m is not None and m.applies(qs) and _reproduces(m, qs, cases, got, tolerant, op, conv):
                found.append(m)
                break
    report.diagnosis = found[:1]
    if found:
        report.advice = _advice(fn, qs, found[0], seed, op, conv)
    return report


def _advice(
    fn: Callable[..., Any], spec: QuantSpec, model: QuantModel, seed: int, op: str | None, conv: dict[str, Any]
) -> str:  # fmt: skip
    """The advice for ``model``: a convention verified by checking again with it; a mistake to fix otherwise."""
    if model.option is not None and not model.emulate and model.y16 is None:
        again = check_quantizer(fn, model.spec_for(spec), op=op, conventions=conv, seed=seed, diagnose=False)
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
