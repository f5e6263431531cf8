"""FP8 / FP4 quantized outputs: the formats on every code point, hard rows with hand-derived codes, the layouts,
the backends' quantizers bitwise against the reference, and the norms' ``quantize=`` output mode."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import pytest

import pynorm
from pynorm.errors import ArgumentError, ArgumentTypeError, ArrayTypeError, UnknownBackendError
from pynorm.ops.fp_quant import ELEMENTS, FORMATS, QuantSpec
from pynorm.reference import fp_quant as ref

_ML = {"e4m3": ml_dtypes.float8_e4m3fn, "e5m2": ml_dtypes.float8_e5m2, "e2m1": ml_dtypes.float4_e2m1fn}


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Bitwise equal float32 arrays (NaN equal to NaN whatever its payload)."""
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return bool(np.all((a.view(np.uint32) == b.view(np.uint32)) | (np.isnan(a) & np.isnan(b))))


# ---------------------------------------------------------------------------- the formats, every code point


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e2m1"])
def test_every_code_decodes_as_ml_dtypes(name: str) -> None:
    el = ELEMENTS[name]
    codes = np.arange(1 << el.nbits, dtype=np.uint8)
    assert _same(ref.decode(codes, el), codes.view(_ML[name]).astype(np.float32))


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e2m1"])
def test_every_code_round_trips(name: str) -> None:
    el = ELEMENTS[name]
    codes = np.arange(1 << el.nbits, dtype=np.uint8)
    vals = ref.decode(codes, el)
    finite = np.isfinite(vals)
    assert np.array_equal(ref.encode(vals[finite], el), codes[finite])  # -0 included
    if el.nan_code is not None:
        assert set(ref.encode(vals[np.isnan(vals)], el).tolist()) == {el.nan_code}


def test_format_constants() -> None:
    got = {n: (e.fmax, e.emax, e.emin) for n, e in ELEMENTS.items()}
    assert got == {"e4m3": (448.0, 8, -6), "e5m2": (57344.0, 15, -14), "e2m1": (6.0, 2, 0)}


def _probes(el: Any) -> np.ndarray:
    """Every positive value, the midpoints between neighbours (ties), the float32s on either side of each, and
    values beyond the largest, with both signs."""
    v = ref.decode(np.arange(el.max_code + 1, dtype=np.uint8), el).astype(np.float64)
    mids = (v[:-1] + v[1:]) / 2
    top = np.array([el.fmax * 1.0625, el.fmax * 1.125, el.fmax * 1.2, el.fmax * 4, 1e30, np.inf])
    base = np.concatenate([v, mids, top]).astype(np.float32)
    near = np.concatenate([base, np.nextafter(base, np.float32(np.inf)), np.nextafter(base, np.float32(0))])
    return np.concatenate([near, -near]).astype(np.float32)


@pytest.mark.parametrize("name", ["e4m3", "e5m2", "e2m1"])
def test_encoder_rounds_as_ml_dtypes(name: str) -> None:
    """Round to nearest even, overflow per format (e4m3 NaN, e5m2 inf, e2m1 saturates): ml_dtypes' conversion."""
    el = ELEMENTS[name]
    rng = np.random.default_rng(0)
    rand = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    v = np.concatenate([_probes(el), rand, (rng.standard_normal(5000) * el.fmax).astype(np.float32)])
    v = v[~np.isnan(v)]
    mode = "saturate" if el.over_code is None else "nan"
    assert np.array_equal(ref.encode(v, el, mode), v.astype(_ML[name]).view(np.uint8) & ((1 << el.nbits) - 1))


@pytest.mark.parametrize("name", ["e4m3", "e5m2"])
def test_saturation(name: str) -> None:
    el = ELEMENTS[name]
    v = _probes(el)
    v = v[~np.isnan(v)]
    plain = v.astype(_ML[name]).astype(np.float32)
    want = np.where(np.isfinite(plain), plain, np.sign(v) * np.float32(el.fmax)).astype(np.float32)
    assert _same(ref.decode(ref.encode(v, el, "saturate"), el), want)


def test_e8m0_scales_decode_as_ml_dtypes() -> None:
    codes = np.arange(256, dtype=np.uint8)
    assert _same(ref.decode_e8m0(codes), codes.view(ml_dtypes.float8_e8m0fnu).astype(np.float32))


def test_nan_codes() -> None:
    v = np.array([np.nan, -np.nan], np.float32)
    assert ref.encode(v, ELEMENTS["e4m3"]).tolist() == [0x7F, 0x7F]
    assert ref.encode(v, ELEMENTS["e5m2"]).tolist() == [0x7E, 0x7E]
    assert ref.encode(v, ELEMENTS["e2m1"]).tolist() == [0, 0]


# ---------------------------------------------------------------------------- hard rows, codes derived by hand


def test_fp8_row_scale_hand_codes() -> None:
    # amax 2 -> s = 2/448, y / s = 224 y: 224 = 1.75 * 2^7 -> 0x76, -448 -> 0xFE, 112 -> 0x6E, 2^-9 -> 0x01
    s = np.float32(2) / np.float32(448)
    y = np.array([[1.0, -2.0, 0.5, 0.0, -0.0, float(np.float32(2.0**-9) * s)]], np.float32)
    q = pynorm.quantize(y, QuantSpec("fp8_e4m3", scaling="row"), backend="numpy")
    assert q.codes.tolist() == [[0x76, 0xFE, 0x6E, 0x00, 0x80, 0x01]]
    assert q.scales.dtype == np.float32 and q.scales.tolist() == [float(s)]


def test_all_zero_rows() -> None:
    y = np.zeros((2, 64), np.float32)
    for fmt in FORMATS:
        q = pynorm.quantize(y, fmt, backend="numpy")
        assert not q.codes.any(), fmt
        if fmt.startswith("fp8"):
            assert q.scales.tolist() == [1.0, 1.0]  # s = 1 where amax / fmax is not positive
        elif fmt == "nvfp4":
            assert not q.scales.any() and float(q.global_scale) == 1.0
        else:
            assert not q.scales.any()  # E8M0 code 0: 2^-127
        assert not pynorm.dequantize(q).any()


def test_mx_floor_and_ceil_rules() -> None:
    # block amax 7: floor(log2 7) - 2 = 0 -> 7 saturates to 6; ceil: 7 > 6 * 2^0 -> e = 1, 7 / 2 = 3.5, a tie
    # between 3 (code 5) and 4 (code 6, even) -> 4
    y = np.zeros((1, 32), np.float32)
    y[0, :3] = [7.0, 5.0, -0.75]
    fl = ref.quantize(y, QuantSpec("mxfp4"))
    ce = ref.quantize(y, QuantSpec("mxfp4", scale_rule="ceil"))
    assert fl.scales.tolist() == [[127]] and ce.scales.tolist() == [[128]]
    # floor: 7 -> 6 (code 7), 5 -> 4 (tie, even: code 6), -0.75 -> -1 (tie, even: code 0x8 | 2), 0
    assert fl.codes[0, :2].tolist() == [0x7 | (0x6 << 4), 0xA]
    # ceil: 3.5 -> 4 (code 6), 2.5 -> 2 (tie, even: code 4), -0.375 -> -0.5 (code 0x8 | 1), 0
    assert ce.codes[0, :2].tolist() == [0x6 | (0x4 << 4), 0x9]


def test_mx_e4m3_floor_saturates_and_nan_mode() -> None:
    y = np.zeros((1, 32), np.float32)
    y[0, 0] = 500.0  # floor(log2 500) - 8 = 0: 500 > 448
    assert ref.quantize(y, QuantSpec("mxfp8_e4m3")).codes[0, 0] == 0x7E
    assert ref.quantize(y, QuantSpec("mxfp8_e4m3", overflow="nan")).codes[0, 0] == 0x7F
    assert ref.quantize(y, QuantSpec("mxfp8_e4m3", scale_rule="ceil")).scales.tolist() == [[128]]


def test_one_huge_value_among_tiny() -> None:
    y = np.full((1, 32), 1e-3, np.float32)
    y[0, 5] = 3e4
    q = ref.quantize(y, QuantSpec("mxfp8_e4m3"))
    assert q.scales.tolist() == [[127 + 14 - 8]]  # floor(log2 3e4) = 14
    assert np.count_nonzero(q.codes) == 1  # 1e-3 / 64 is below half the least subnormal 2^-9


def test_non_finite_values() -> None:
    y = np.ones((1, 32), np.float32)
    y[0, 1], y[0, 2] = np.nan, -np.inf
    q8 = ref.quantize(y, QuantSpec("fp8_e4m3"))
    assert q8.scales.tolist() == [1.0] and q8.codes[0, :3].tolist() == [0x38, 0x7F, 0xFE]  # amax inf: s = 1
    mx = ref.quantize(y, QuantSpec("mxfp8_e4m3"))
    assert mx.scales.tolist() == [[0xFF]] and not mx.codes.any()
    assert np.isnan(ref.dequantize(mx)).all()  # a NaN scale: the block decodes to NaN
    y2 = np.ones((1, 16), np.float32)
    y2[0, 3] = np.nan
    nv = ref.quantize(y2, QuantSpec("nvfp4", global_scale=1.0))
    # amax 1 (NaN ignored): 1/6 rounds in e4m3 to 11 * 2^-6 = 0.171875 = 1.375 * 2^-3 -> code (4 << 3) | 3;
    # 1 / 0.171875 = 5.82 -> 6 (code 7); NaN -> 0
    assert nv.scales.tolist() == [[0x23]]
    assert nv.codes[0, :2].tolist() == [0x77, 0x07]


def test_nvfp4_global_scale() -> None:
    y = np.zeros((2, 16), np.float32)
    y[0, 0], y[1, 0] = 2688.0, 6.0  # global 2688 / 2688 = 1; block maxima / 6 = 448 and 1 -> codes 0x7E, 0x38
    q = ref.quantize(y, QuantSpec("nvfp4"))
    assert float(q.global_scale) == 1.0
    assert q.scales.tolist() == [[0x7E], [0x38]]
    assert q.codes[:, 0].tolist() == [0x07, 0x07]
    assert ref.dequantize(q)[:, 0].tolist() == [2688.0, 6.0]


# ---------------------------------------------------------------------------- layouts


def test_fp4_nibble_order() -> None:
    c = np.array([[1, 2, 3]], np.uint8)
    assert ref.pack_fp4(c, "low_first").tolist() == [[0x21, 0x03]]
    assert ref.pack_fp4(c, "high_first").tolist() == [[0x12, 0x30]]
    for order in ("low_first", "high_first"):
        assert np.array_equal(ref.unpack_fp4(ref.pack_fp4(c, order), 3, order), c)


@pytest.mark.parametrize("shape", [(1, 1), (130, 5), (256, 8)])
def test_swizzle_is_the_cublas_tile_layout(shape: tuple[int, int]) -> None:
    """Against the layout written as a reshape: pad to (128 Mt, 4 Kt), view as (Mt, 4, 32, Kt, 4), order the axes
    (Mt, Kt, 32, 4, 4)."""
    r, c = shape
    s = np.arange(1, r * c + 1, dtype=np.int64).reshape(r, c)
    mt, kt = -(-r // 128), -(-c // 4)
    pad = np.zeros((128 * mt, 4 * kt), np.int64)
    pad[:r, :c] = s
    want = pad.reshape(mt, 4, 32, kt, 4).transpose(0, 3, 2, 1, 4).reshape(-1)
    assert np.array_equal(ref.swizzle(s), want)
    assert np.array_equal(ref.unswizzle(want, r, c), s)


def test_scale_dtypes_and_layouts_dequantize_alike() -> None:
    rng = np.random.default_rng(3)
    y = rng.standard_normal((3, 2, 48)).astype(np.float32)
    for fmt in ("mxfp8_e5m2", "mxfp4", "nvfp4"):
        base = ref.dequantize(ref.quantize(y, QuantSpec(fmt)))
        for kw in ({"scale_layout": "swizzled"}, {"scale_dtype": "float32"}, {"nibble_order": "high_first"}):
            q = ref.quantize(y, QuantSpec(fmt, **kw))
            assert _same(ref.dequantize(q), base), (fmt, kw)
    q = ref.quantize(y, QuantSpec("mxfp4", scale_layout="swizzled"))
    assert q.codes.shape == (3, 2, 24) and q.scales.shape == (128 * 4,)


# ---------------------------------------------------------------------------- values and shapes


_SPECS = [
    QuantSpec("fp8_e4m3"),
    QuantSpec("fp8_e4m3", scaling="tensor"),
    QuantSpec("fp8_e5m2", scaling="group", group_size=32),
    QuantSpec("fp8_e4m3", scaling="tensor", scale=0.01, overflow="nan"),
    QuantSpec("mxfp8_e4m3"),
    QuantSpec("mxfp8_e5m2", scale_rule="ceil"),
    QuantSpec("mxfp4", scale_layout="swizzled"),
    QuantSpec("nvfp4"),
    QuantSpec("nvfp4", global_scale=0.5, scale_dtype="float32", nibble_order="high_first"),
]


def _hard(rng: np.random.Generator) -> np.ndarray:
    y = (rng.standard_normal((6, 80)) * 3).astype(np.float32)
    y[1, 5] = 1e4
    y[2] = 0
    y[3, 7], y[3, 9], y[3, 11] = np.nan, np.inf, -np.inf
    y[4, ::3] = 1e-40
    y[5, :32] = np.float32(448.0) * np.float32(1.0625)  # just above e4m3's max after the row scale
    y[0, 3] = -0.0
    return y


def test_dequantized_within_half_a_step() -> None:
    rng = np.random.default_rng(4)
    y = rng.standard_normal((4, 96)).astype(np.float32)
    for spec in _SPECS[:3] + _SPECS[4:6]:
        q = ref.quantize(y, spec)
        d = ref.dequantize(q)
        el = spec.fmt.element
        scale = np.max(np.abs(y)) / el.fmax * (2 if spec.fmt.kind == "mx" else 1)
        # the largest step of the format is 2^(emax - mbits) at its scale
        assert np.max(np.abs(d - y)) <= 2.0 ** (el.emax - el.mbits) * scale, spec


def test_quantize_validates() -> None:
    with pytest.raises(ArgumentError, match="format"):
        QuantSpec("fp6")
    with pytest.raises(ArgumentError, match="scale_rule"):
        QuantSpec("mxfp4", scale_rule="round")
    with pytest.raises(ArgumentError, match="overflow"):
        QuantSpec("nvfp4", overflow="nan")
    with pytest.raises(ArgumentError, match="scale"):
        QuantSpec("mxfp4", scale=1.0)
    with pytest.raises(ArgumentError, match="scaling='tensor'"):
        QuantSpec("fp8_e4m3", scale=1.0)
    with pytest.raises(ArgumentError, match="global_scale"):
        QuantSpec("fp8_e4m3", global_scale=1.0)
    with pytest.raises(ArgumentError, match="group_size"):
        QuantSpec("fp8_e4m3", scaling="group", group_size=0)
    with pytest.raises(ArgumentTypeError, match="quantize"):
        pynorm.rms_norm(np.ones((2, 4), np.float32), quantize=3)
    with pytest.raises(ArgumentError, match="y must be a float array"):
        pynorm.quantize(np.ones(4, np.int32), "mxfp4")
    with pytest.raises(ArrayTypeError, match="backend 'cupy' serves cupy.ndarray, but y is numpy.ndarray"):
        pynorm.quantize(np.ones(4, np.float32), "mxfp4", backend="cupy")
    with pytest.raises(UnknownBackendError, match="nunba"):
        pynorm.quantize(np.ones(4, np.float32), "mxfp4", backend="nunba")


# ---------------------------------------------------------------------------- backends: bitwise the reference


def test_backend_quantizer_is_bitwise_the_reference(backend: Any) -> None:
    y = _hard(np.random.default_rng(5))
    for spec in _SPECS:
        want = ref.quantize(y, spec)
        got = pynorm.quantize(backend.asarray(y), spec, backend=backend.name)
        assert np.array_equal(backend.to_numpy(got.codes), want.codes), spec
        gs = np.asarray(backend.to_numpy(got.scales))
        assert gs.shape == want.scales.shape and gs.dtype == want.scales.dtype, spec
        assert np.array_equal(gs.reshape(-1).view(np.uint8), want.scales.reshape(-1).view(np.uint8)), spec
        if want.global_scale is not None:
            assert float(got.global_scale) == float(want.global_scale)
        assert _same(backend.to_numpy(pynorm.dequantize(got)), ref.dequantize(want))


def test_backend_quantizer_reads_every_float_dtype(backend: Any) -> None:
    """16-bit ``y`` exactly, float64 ``y`` rounded once to float32 first."""
    rng = np.random.default_rng(7)
    y = rng.standard_normal((3, 64)) * 100
    for dt in ("float16", "bfloat16", "float64"):
        yd = y.astype(ml_dtypes.bfloat16 if dt == "bfloat16" else dt)
        for spec in (QuantSpec("fp8_e5m2"), QuantSpec("mxfp4"), QuantSpec("nvfp4")):
            want = ref.quantize(yd, spec)
            assert np.array_equal(want.codes, ref.quantize(yd.astype(np.float32), spec).codes)
            got = pynorm.quantize(backend.asarray(yd), spec, backend=backend.name)
            assert np.array_equal(backend.to_numpy(got.codes), want.codes), (dt, spec)
            assert np.array_equal(backend.to_numpy(got.scales), want.scales), (dt, spec)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm", "add_layer_norm", "add_rms_norm"])
def test_norm_quantized_output(backend: Any, op: str) -> None:
    """``quantize=``: the norm's own ``y`` quantized (on its backend); the backward is the float op's
    (straight-through)."""
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 3, 40)).astype(np.float32)
    w = (1 + 0.5 * rng.standard_normal(40)).astype(np.float32)
    args = [backend.asarray(x)]
    if op.startswith("add_"):
        args.append(backend.asarray(rng.standard_normal(x.shape).astype(np.float32)))
    args += [backend.asarray(w)] * (2 if "layer" in op else 1)
    fwd, bwd = getattr(pynorm, f"{op}_forward"), getattr(pynorm, f"{op}_backward")
    plain, pctx = fwd(*args, backend=backend.name)
    for spec in (QuantSpec("fp8_e4m3", scaling="group", group_size=16, keep_y=True), QuantSpec("nvfp4")):
        res, ctx = fwd(*args, quantize=spec, backend=backend.name)
        q = res[0] if op.startswith("add_") else res
        y = plain[0] if op.startswith("add_") else plain
        want = ref.quantize(backend.to_numpy(y), spec)
        assert isinstance(q, pynorm.Quantized) and q.shape == x.shape
        assert np.array_equal(backend.to_numpy(q.codes), want.codes)
        assert np.array_equal(backend.to_numpy(q.scales), want.scales)
        if spec.keep_y:
            assert np.array_equal(backend.to_numpy(q.y), backend.to_numpy(y))
        if op.startswith("add_"):
            assert np.array_equal(backend.to_numpy(res[1]), backend.to_numpy(plain[1]))
        dy = backend.asarray(rng.standard_normal(x.shape).astype(np.float32))
        for a, b in zip(bwd(dy, ctx), bwd(dy, pctx), strict=True):
            assert np.array_equal(backend.to_numpy(a), backend.to_numpy(b))


def test_bench_case_of_a_quantized_output() -> None:
    from pynorm.bench.cases import make_case, op_bytes, pynorm_calls, quantized_names

    assert "rms_norm:nvfp4" in quantized_names() and "add_layer_norm:fp8_e5m2" in quantized_names()
    case = make_case("rms_norm:nvfp4", (8, 64))
    assert case.required["quantize"] == QuantSpec("nvfp4")
    plain = op_bytes(make_case("rms_norm", (8, 64)))["fwd"]
    # y (8 x 64 float32) replaced by 8 x 32 packed codes, 8 x 4 E4M3 scales and the float32 global scale
    assert op_bytes(case)["fwd"] == plain - 8 * 64 * 4 + 8 * 32 + 8 * 4 + 4
    with pytest.raises(KeyError):
        make_case("dyt:mxfp4", (8, 64))
    assert make_case("rms_norm:fp8_e5m2:group", (8, 64)).required["quantize"] == QuantSpec("fp8_e5m2", scaling="group")
    static = make_case("add_rms_norm:fp8_e4m3:tensor", (8, 64)).required["quantize"]
    assert static.scaling == "tensor" and static.scale is not None
    with pytest.raises(KeyError):
        make_case("rms_norm:fp8_e4m3:column", (8, 64))
    # the timed forward of a quantized case writes the codes only: out= would keep y as well (bytes not counted)
    case.y[...] = np.nan
    res = pynorm_calls(case, "numpy", buffers=True)["fwd"]()[0]
    assert isinstance(res, pynorm.Quantized) and res.y is None and np.isnan(case.y).all()


def test_layer_forward_takes_quantize_per_call() -> None:
    from pynorm.layers import RMSNorm

    layer = RMSNorm(48, backend="numpy")
    x = np.random.default_rng(8).standard_normal((3, 48)).astype(np.float32)
    q, ctx = layer.forward(x, quantize=QuantSpec("mxfp8_e5m2", keep_y=True))
    assert isinstance(q, pynorm.Quantized) and q.scales.shape == (3, 2)
    assert np.array_equal(q.codes, ref.quantize(q.y, QuantSpec("mxfp8_e5m2")).codes)
    _, ctx2 = layer.forward(x)
    assert np.array_equal(layer.backward(np.ones_like(x), ctx), layer.backward(np.ones_like(x), ctx2))


# ---------------------------------------------------------------------------- the fused epilogue (numba)

#: every format and scaling of the fused path (its sink computes each row's scales itself, or -- a per-tensor scale,
#: NVFP4's computed global scale -- after a first pass of the rows' amax)
_FUSED_SPECS = [
    *_SPECS,
    QuantSpec("fp8_e5m2", overflow="nan", keep_y=True),
    QuantSpec("fp8_e4m3", scaling="group", group_size=24, keep_y=True),
    QuantSpec("fp8_e5m2", scaling="tensor", scale=3.0),
    QuantSpec("mxfp8_e4m3", scale_rule="ceil", overflow="nan", scale_dtype="float32"),
    QuantSpec("mxfp4", nibble_order="high_first", scale_rule="ceil"),
    QuantSpec("nvfp4", scale_layout="swizzled", keep_y=True),
    QuantSpec("nvfp4", global_scale=1e-30),
]


def _norm_args(op: str, x: np.ndarray, rng: np.random.Generator) -> list[Any]:
    h = x.shape[-1]
    w = (1 + 0.5 * rng.standard_normal(h)).astype(x.dtype)
    args: list[Any] = [x]
    if op.startswith("add_"):
        args.append((rng.standard_normal(x.shape) * 0.5).astype(x.dtype))
    return args + [w] * (2 if "layer" in op else 1)


def _hard_x(dt: Any, rng: np.random.Generator, shape: tuple[int, int] = (7, 72)) -> np.ndarray:
    """Rows of a norm's input whose ``y`` holds the quantizer's hard cases: ordinary, constant (y = 0 or the bias),
    a huge value among tiny ones, an infinity (a NaN row), a large common offset, tiny magnitudes."""
    x = rng.standard_normal((max(shape[0], 7), shape[1])) * 2
    x[1] = 3.0
    x[2] = 1e-3
    x[2, 5] = 60.0
    x[3, 4] = np.inf
    x[4] += 1e3
    x[5] *= 1e-30 if dt == np.float64 else 1e-3
    return x[: shape[0]].astype(dt)


def _assert_same_quantized(got: Any, want: Any, spec: QuantSpec) -> None:
    assert np.array_equal(got.codes, want.codes), spec
    gs, ws = np.asarray(got.scales), np.asarray(want.scales)
    assert gs.shape == ws.shape and gs.dtype == ws.dtype, spec
    assert np.array_equal(gs.reshape(-1).view(np.uint8), ws.reshape(-1).view(np.uint8)), spec
    assert (got.global_scale is None) == (want.global_scale is None), spec
    if want.global_scale is not None:
        assert np.float32(got.global_scale).view(np.uint32) == np.float32(want.global_scale).view(np.uint32), spec


#: ``(op, dtype)`` of the fused epilogue's test: every op, each dtype through an op with and one without the residual
#: prologue (float64 through one), each case compiling the norm's forward kernels with the quantize sink (~10 s of CI
#: apiece)
FUSED_CASES = [
    ("layer_norm", "float32"), ("add_rms_norm", "float32"), ("layer_norm", "bfloat16"), ("add_rms_norm", "bfloat16"),
    ("rms_norm", "float16"), ("add_layer_norm", "float16"), ("add_layer_norm", "float64"),
]  # fmt: skip


@pytest.mark.parametrize(("op", "dt"), FUSED_CASES)
def test_fused_epilogue_is_bitwise_the_second_pass(op: str, dt: str) -> None:
    """numba's ``quantize=`` quantizes each row in the norm's output pass (``ctx.served``, path ``"quantize"``): codes
    and scales bitwise the reference quantizer's and numba's second pass on the norm's own ``y`` (every format and
    scaling, every dtype, hard rows), a kept ``y`` bitwise the norm's, the residual sum and the backward unchanged."""
    pytest.importorskip("numba")
    from pynorm.backends.numba import _paths
    from pynorm.backends.numba import fp_quant as nq

    rng = np.random.default_rng(11)
    dtype = ml_dtypes.bfloat16 if dt == "bfloat16" else np.dtype(dt)
    x = _hard_x(dtype, rng).reshape(7, 2, 36)
    args = _norm_args(op, x, rng)
    fwd, bwd = getattr(pynorm, f"{op}_forward"), getattr(pynorm, f"{op}_backward")
    plain, pctx = fwd(*args, backend="numba", axis=1)
    y = plain[0] if op.startswith("add_") else plain
    for spec in _FUSED_SPECS:
        with _paths.recording() as taken:
            res, ctx = fwd(*args, quantize=spec, backend="numba", axis=1)
        assert ctx.served == ("quantize",) and "quantize" in taken and "quantize_after" not in taken
        q = res[0] if op.startswith("add_") else res
        assert isinstance(q, pynorm.Quantized) and q.shape == x.shape
        want = ref.quantize(y, spec, axis=1)
        _assert_same_quantized(q, want, spec)
        _assert_same_quantized(q, nq.quantize(y, spec, axis=1), spec)
        if spec.keep_y:
            assert q.y.dtype == y.dtype and np.array_equal(q.y.view(np.uint8), y.view(np.uint8)), spec
        else:
            assert q.y is None
        if op.startswith("add_"):
            assert np.array_equal(res[1].view(np.uint8), plain[1].view(np.uint8))
    dy = rng.standard_normal(x.shape).astype(dtype)
    for a, b in zip(bwd(dy, ctx), bwd(dy, pctx), strict=True):
        assert np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


@pytest.mark.parametrize("op", ["rms_norm", "add_layer_norm"])
def test_fused_epilogue_split_path_quantizes_after(op: str) -> None:
    """Few wide rows take the split kernels, which cut rows across threads: there ``y`` is stored and quantized by
    numba's second pass (path ``"quantize_after"``), the same bits; ``out=`` receives ``y`` (the norm's)."""
    pytest.importorskip("numba")
    from pynorm.backends.numba import _paths

    rng = np.random.default_rng(12)
    x = _hard_x(np.float32, rng, (3, 2 * 4096 + 40))
    args = _norm_args(op, x, rng)
    fwd = getattr(pynorm, f"{op}_forward")
    plain, _ = fwd(*args, backend="numba")
    y = plain[0] if op.startswith("add_") else plain
    for spec in (QuantSpec("nvfp4"), QuantSpec("fp8_e4m3", scaling="group", group_size=100), QuantSpec("mxfp4")):
        want = ref.quantize(y, spec)
        with _paths.forced("split"), _paths.recording() as taken:
            res, ctx = fwd(*args, quantize=spec, backend="numba")
        assert {"split", "quantize_after"} <= taken and "quantize" not in taken and ctx.served == ("quantize",)
        _assert_same_quantized(res[0] if op.startswith("add_") else res, want, spec)
        with _paths.recording() as taken:
            out = np.empty_like(y)
            res, _ = fwd(*args, quantize=spec, backend="numba", out=out)
        assert "quantize" in taken and np.array_equal(out, y, equal_nan=True)
        _assert_same_quantized(res[0] if op.startswith("add_") else res, want, spec)


def test_unserved_quantize_is_a_second_pass() -> None:
    """Where the backend's op does not serve ``quantize=`` -- the reference backend, a casting policy on numba -- the
    dispatcher quantizes the returned ``y`` (``ctx.served`` empty), by the same rules."""
    rng = np.random.default_rng(13)
    x = rng.standard_normal((5, 64)).astype(np.float32)
    w = rng.standard_normal(64).astype(np.float32)
    spec = QuantSpec("mxfp8_e4m3")
    q, ctx = pynorm.rms_norm_forward(x, w, quantize=spec, backend="numpy")
    assert ctx.served == () and np.array_equal(q.codes, ref.quantize(pynorm.rms_norm(x, w), spec).codes)
    pytest.importorskip("numba")
    for casting, served in (("llama", ()), ("fp32", ("quantize",))):
        q, ctx = pynorm.rms_norm_forward(x, w, quantize=spec, backend="numba", casting=casting)
        y = pynorm.rms_norm(x, w, backend="numba", casting=casting)
        assert ctx.served == served and np.array_equal(q.codes, ref.quantize(y, spec).codes)


def test_numba_encoder_on_random_bits() -> None:
    """numba's element encoder (one float32 addition rounds to the format) against the reference on random float32
    bit patterns, divided by exact and inexact scales (the reciprocal path and the division), every FP8 overflow
    rule; the block formats on the same bits."""
    pytest.importorskip("numba")
    from pynorm.backends.numba import fp_quant as nq

    rng = np.random.default_rng(14)
    y = rng.integers(0, 2**32, (64, 1024), dtype=np.uint64).astype(np.uint32).view(np.float32)
    for fmt in ("fp8_e4m3", "fp8_e5m2"):
        for overflow in ("saturate", "nan"):
            for s in (1.0, 0.37, 2.0**-100, 2.0**100, 3e-39):
                spec = QuantSpec(fmt, scaling="tensor", scale=s, overflow=overflow)
                assert np.array_equal(nq.quantize(y, spec).codes, ref.quantize(y, spec).codes), spec
    finite = np.where(np.isfinite(y), y, np.float32(1.0))
    for spec in (QuantSpec("fp8_e4m3"), QuantSpec("mxfp4"), QuantSpec("mxfp8_e5m2", scale_rule="ceil"),
                 QuantSpec("nvfp4"), QuantSpec("nvfp4", global_scale=1e-3)):  # fmt: skip
        for a in (y, finite):
            _assert_same_quantized(nq.quantize(a, spec), ref.quantize(a, spec), spec)


#: ``(op, x shape, axis, spec)`` of the quantized calls without a ctx: rows as given (2-D, the last axis), rows the
#: dispatcher shapes (3-D; a 2-D x along axis 0), the amax pass first (a per-tensor scale, NVFP4's computed global
#: scale), a kept y, a swizzled layout, the residual prologue's two outputs
_CTXLESS_CASES = [
    ("rms_norm", (3, 64), -1, QuantSpec("fp8_e4m3")),
    ("rms_norm", (3, 64), -1, QuantSpec("fp8_e4m3", scaling="tensor")),
    ("rms_norm", (3, 64), -1, QuantSpec("nvfp4", keep_y=True)),
    ("layer_norm", (2, 3, 64), -1, QuantSpec("mxfp4", scale_layout="swizzled")),
    ("layer_norm", (4, 48), 0, QuantSpec("fp8_e5m2", scaling="group", group_size=32)),
    ("add_rms_norm", (3, 64), -1, QuantSpec("mxfp8_e4m3", scale_dtype="float32")),
]


@pytest.mark.parametrize(("op", "shape", "axis", "spec"), _CTXLESS_CASES)
def test_a_repeated_quantized_call_builds_no_ctx_and_gives_the_forwards_bits(
    backend: Any, op: str, shape: tuple[int, ...], axis: int, spec: QuantSpec, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``pynorm.<op>(..., quantize=)`` of a call shape seen before, and a :class:`pynorm.Plan`'s call (NumPy arrays:
    the calls with a kept plan), run the backend's runner without a ctx (``_dispatch._quantized_only``), and give
    the codes, scales, kept ``y`` and residual sum of the forward with a ctx and of the reference quantizer on the
    norm's ``y``, call after call. On numba the small calls take the row kernel's kept entry points of the quantize
    sink (its first pass of the tensor's ``amax`` too) through the op's shortest call, and no ctx is built."""
    from pynorm import _dispatch

    _dispatch._PLANS.clear()
    rng = np.random.default_rng(21)
    x = rng.standard_normal(shape).astype(np.float32)
    n = int(np.prod(shape[axis % len(shape) :]))
    norm = shape[axis % len(shape) :]
    args = [backend.asarray(x)]
    if op.startswith("add_"):
        args.append(backend.asarray(rng.standard_normal(shape).astype(np.float32)))
    args += [backend.asarray((1 + 0.3 * rng.standard_normal(n)).astype(np.float32).reshape(norm))] * (
        2 if "layer" in op else 1
    )
    fn, fwd = getattr(pynorm, op), getattr(pynorm, f"{op}_forward")
    kw = {"backend": backend.name, "axis": axis}
    plain = fn(*args, **kw)
    y = backend.to_numpy(plain[0] if op.startswith("add_") else plain)
    want = ref.quantize(y, spec, axis=axis)
    with_ctx, _ = fwd(*args, quantize=spec, **kw)

    def same(res: Any) -> None:
        q = res[0] if op.startswith("add_") else res
        for got in (q, with_ctx[0] if op.startswith("add_") else with_ctx):
            assert isinstance(got, pynorm.Quantized) and got.shape == shape
            for f in ("codes", "scales", "global_scale"):
                a, b = getattr(got, f), getattr(want, f)
                assert (a is None) == (b is None), f
                if a is not None:
                    a = backend.to_numpy(a)
                    assert a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a, b), (f, spec)
        assert (q.y is None) != spec.keep_y
        if spec.keep_y:
            assert np.array_equal(backend.to_numpy(q.y), y)
        if op.startswith("add_"):
            assert np.array_equal(backend.to_numpy(res[1]), backend.to_numpy(plain[1]))

    numpy_arrays = backend.name != "cupy"  # (CuPy arrays make no plan: their calls take the full path)
    if numpy_arrays:  # (the first call of the out= call shape, which makes its plan, with a ctx)
        fn(*args, quantize=spec, out=np.empty(shape, np.float32), **kw)
    taken: list[Any] = []
    real = _dispatch._quantized_only
    monkeypatch.setattr(_dispatch, "_quantized_only", lambda *a: taken.append(1) or real(*a))
    built: list[Any] = []
    if backend.name == "numba":
        from pynorm.backends.numba import _threads, stats

        monkeypatch.setattr(_threads, "SERIAL_THRESHOLD", _threads.DEFAULT_SERIAL_THRESHOLD)  # (the tests lower it)
        real_ctx = stats.StatsOp._ctx
        monkeypatch.setattr(stats.StatsOp, "_ctx", lambda self, *a: built.append(1) or real_ctx(self, *a))
    plan = pynorm.plan(op, *args, quantize=spec, **kw) if numpy_arrays else None
    for _ in range(3):
        same(fn(*args, quantize=spec, **kw))
        if plan is not None:
            same(plan(*args))
            o = np.full(shape, np.nan, np.float32)  # (out= receives the norm's y; a call shape of its own)
            same(fn(*args, quantize=spec, out=o, **kw))
            assert np.array_equal(o, y)
    if numpy_arrays:  # (every call after the first of each call shape of pynorm.<op>, every call of the plan)
        assert len(taken) >= 9
    if backend.name == "numba":  # (the plans' calls: the lean runner's kept entry points, then the shortest call)
        assert not built
        calls = [c for p in _dispatch._PLANS.values() if hasattr(p, "calls") for c in p.calls.values()]
        calls = [c for c in calls if getattr(c, "quantize", None) is spec]
        assert calls and all(c.fast is not None for c in calls)
        assert all(m.entry is not None for c in calls for m in c.lean.sinks[: 2 if _needs_amax(spec) else 1])


def _needs_amax(spec: QuantSpec) -> bool:
    """Whether ``spec``'s scales need the tensor's ``amax`` first (a pass of its own)."""
    tensor = spec.fmt.kind == "scaled" and spec.scaling == "tensor" and spec.scale is None
    return tensor or (spec.fmt.kind == "nvfp4" and spec.global_scale is None)


def test_quantize_without_a_backend_resolves_as_the_norms_do(monkeypatch: pytest.MonkeyPatch) -> None:
    """``pynorm.quantize(y, spec)`` (``backend=None``) runs the quantizer of the backend the norms' ``backend=None``
    picks for ``y``'s array type -- numba for NumPy arrays where it is installed, else the reference; inside
    ``pynorm.use_backend`` that block's, with ``PYNORM_BACKEND`` set that one's -- and every one gives the
    reference's codes and scales."""
    import importlib

    from pynorm import _registry

    rng = np.random.default_rng(23)
    y = rng.standard_normal((3, 64)).astype(np.float32)
    spec = QuantSpec("mxfp4")
    want = ref.quantize(y, spec)
    ran: list[str] = []
    for name in ("numpy", "numba"):
        if _registry.unavailable_reason(name) is not None:
            continue
        mod = importlib.import_module(f"pynorm.{'reference' if name == 'numpy' else 'backends.numba'}.fp_quant")
        real = mod.quantize
        monkeypatch.setattr(mod, "quantize", lambda *a, _n=name, _f=real: ran.append(_n) or _f(*a))
    fastest = "numba" if _registry.unavailable_reason("numba") is None else "numpy"
    for context, expect in ((None, fastest), ("numpy", "numpy"), ("env", "numpy")):
        ran.clear()
        if context == "env":
            monkeypatch.setenv("PYNORM_BACKEND", "numpy")
            q = pynorm.quantize(y, spec)
            monkeypatch.delenv("PYNORM_BACKEND")
        elif context is not None:
            with pynorm.use_backend(context):
                q = pynorm.quantize(y, spec)
        else:
            q = pynorm.quantize(y, spec)
        assert ran == [expect], (context, ran)
        assert np.array_equal(q.codes, want.codes) and np.array_equal(q.scales, want.scales)
