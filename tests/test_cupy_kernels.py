"""CPU-side checks of the CuPy backend: no GPU, no CuPy needed.

* every kernel instantiation compiles with NVRTC from pip for sm_80 and sm_90 without
  register spills or local memory (skipped, with the reason, when cuda-bindings/NVRTC or
  the CUDA headers are not installed);
* a deliberately broken kernel, and a kernel that spills, make the compile check fail;
* the host-side logic: launch configuration, vectorization, occupancy model, dtype
  dispatch, argument validation, and that the Python constants mirror the CUDA ones.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pynorm.backends.cupy import _launch, _loader
from pynorm.backends.cupy import compile_check as cc
from pynorm.errors import DTypeError, ShapeError

from .helpers import dtype as dtype_of

NVRTC_REASON = cc.nvrtc_unavailable_reason()
needs_nvrtc = pytest.mark.skipif(NVRTC_REASON is not None, reason=f"NVRTC unavailable: {NVRTC_REASON}")

SM90 = _launch.ARCH_LIMITS["sm_90"]
SM80 = _launch.ARCH_LIMITS["sm_80"]


# ---------------------------------------------------------------------------
# compile check


@pytest.fixture(scope="module")
def compiled() -> dict[tuple[str, str], cc.CompileResult]:
    """Every kernel file compiled for sm_80 and sm_90 (once per test module, in parallel)."""
    if NVRTC_REASON is not None:
        pytest.skip(f"NVRTC unavailable: {NVRTC_REASON}")
    results = cc.run_check(cc.ARCHS)
    print("\n" + cc.format_table(results))
    # a file is compiled in several groups (one per op variant): merge them per (file, arch)
    merged: dict[tuple[str, str], cc.CompileResult] = {}
    for r in results:
        m = merged.setdefault((r.file, r.arch), cc.CompileResult(r.file, r.arch))
        m.kernels.extend(r.kernels)
        m.errors.extend(r.errors)
        m.seconds += r.seconds
    return merged


@needs_nvrtc
@pytest.mark.parametrize("arch", cc.ARCHS)
@pytest.mark.parametrize("file", list(_loader.KERNELS))
def test_every_instantiation_compiles_without_spills(compiled, file, arch):
    res = compiled[(file, arch)]
    assert res.ok, "\n".join(res.errors)
    assert sorted(k.name for k in res.kernels) == sorted(_loader.instantiations(file))
    for k in res.kernels:
        assert k.registers > 0 and k.clean, k
        assert k.occupancy is not None and k.occupancy.blocks_per_sm >= 1, (k.name, k.occupancy)
        # register budgets the launch bounds promise (min blocks per SM)
        if k.name.startswith("pynorm::stats_fwd<"):  # the residual prologue asks for 1 block (<= 128 registers)
            want = 1 if "Residual<" in k.name else _launch.DEFS["FWD_MIN_BLOCKS"]
            assert k.occupancy.blocks_per_sm >= want, k
        if "_bwd<" in k.name:
            assert k.occupancy.blocks_per_sm >= _launch.DEFS["BWD_MIN_BLOCKS"], k


def _broken_copy(tmp_path: Path, file: str, old: str, new: str) -> Path:
    d = tmp_path / "kernels"
    shutil.copytree(Path(str(_loader.kernel_dir())), d)
    src = (d / file).read_text()
    assert old in src
    (d / file).write_text(src.replace(old, new, 1))
    return d


@needs_nvrtc
def test_broken_kernel_fails_the_check_and_names_the_real_file(tmp_path, capsys):
    d = _broken_copy(tmp_path, "reduce.cu", "out[col] = Conv<O>::from(tot);", "out[col] = Conv<O>::from(tot)")
    status = cc.main(["--kernels-dir", str(d), "--file", "reduce.cu", "--arch", "sm_80", "--quiet"])
    err = capsys.readouterr().err
    assert status == 1
    assert "compilation failed" in err
    # the #line directives make NVRTC report the file and line of the .cu source
    line = next(i for i, t in enumerate((d / "reduce.cu").read_text().splitlines(), 1) if "Conv<O>::from(tot)" in t)
    path = (d / "reduce.cu").resolve().as_posix()
    assert f"{path}({line}): error" in err or f"{path}({line + 1}): error" in err, err


@needs_nvrtc
def test_broken_header_error_points_into_the_header(tmp_path):
    d = _broken_copy(tmp_path, "common.cuh", "return a / b; }", "return a / b }")
    res = cc.check_file("reduce.cu", "sm_80", d)
    assert not res.ok
    assert "common.cuh" in res.errors[0]


@needs_nvrtc
def test_command_line_exit_status_on_broken_kernel(tmp_path):
    d = _broken_copy(tmp_path, "reduce.cu", "s += seg[p * H + col];", "s += seg[p * H + col] +;")
    proc = subprocess.run(
        [sys.executable, "-m", "pynorm.backends.cupy.compile_check", "--kernels-dir", str(d), "--file", "reduce.cu"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAILED" in proc.stdout


SPILLER = r"""
template <typename T>
__global__ void __launch_bounds__(1024) spill(const T* x, float* y, int n) {
  float a[96];
#pragma unroll
  for (int i = 0; i < 96; ++i) a[i] = (float)x[threadIdx.x + i * n];
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < 96; ++i) acc += a[i] * a[95 - i] * a[(i * 7) % 96];
  y[threadIdx.x] = acc;
}
"""


@needs_nvrtc
def test_register_spill_fails_the_check():
    res = cc.compile_source(SPILLER, ["spill<float>"], "sm_90", filename="spiller.cu")
    assert not res.ok
    assert any("spill" in e or "local memory" in e for e in res.errors), res.errors
    assert res.kernels and not res.kernels[0].clean


@needs_nvrtc
def test_clean_kernel_passes_and_reports_registers():
    src = "__global__ void ok(float* y) { y[threadIdx.x] = 2.f * y[threadIdx.x]; }"
    res = cc.compile_source(src, ["ok"], "sm_80")
    assert res.ok, res.errors
    (k,) = res.kernels
    assert k.registers > 0 and k.clean and k.spill_stores == 0


@needs_nvrtc
def test_nvrtc_cache_serves_the_same_compilation_only(tmp_path, monkeypatch):
    """With ``PYNORM_NVRTC_CACHE_DIR`` set, a compilation asked for again (same file name, source, names, arch,
    options) is read from the cache -- the same report, NVRTC not called -- and any difference is compiled;
    a failed compilation is not kept."""
    from cuda.bindings import nvrtc

    src = "template <typename T> __global__ void ok(T* y) { y[threadIdx.x] = T(2) * y[threadIdx.x]; }"
    monkeypatch.setenv(cc.CACHE_ENV, str(tmp_path))
    first = cc.compile_source(src, ["ok<float>"], "sm_90", filename="probe.cu")
    assert first.ok and len(list(tmp_path.glob("nvrtc-*.json"))) == 1
    real = nvrtc.nvrtcCompileProgram
    calls = []

    def counted(*a):  # type: ignore[no-untyped-def]
        calls.append(a)
        return real(*a)

    monkeypatch.setattr(nvrtc, "nvrtcCompileProgram", counted)
    again = cc.compile_source(src, ["ok<float>"], "sm_90", filename="probe.cu")
    assert not calls
    assert again.log == first.log and [(k.name, k.lowered, k.registers) for k in again.kernels] == [
        (k.name, k.lowered, k.registers) for k in first.kernels
    ]
    for other in (
        (src, ["ok<double>"], "sm_90", "probe.cu"),
        (src, ["ok<float>"], "sm_80", "probe.cu"),
        (src, ["ok<float>"], "sm_90", "other.cu"),
        (src + "\n", ["ok<float>"], "sm_90", "probe.cu"),
    ):
        assert cc.compile_source(other[0], other[1], other[2], filename=other[3]).ok
    assert len(calls) == 4 and len(list(tmp_path.glob("nvrtc-*.json"))) == 5
    bad = cc.compile_source(src + "\n#error broken\n", ["ok<float>"], "sm_90", filename="probe.cu")
    assert not bad.ok and len(list(tmp_path.glob("nvrtc-*.json"))) == 5


@needs_nvrtc
def test_nvrtc_cache_is_shared_by_installs_in_other_directories(tmp_path, monkeypatch):
    """Two environments with the package installed in different directories (CI's kernels and cuda_cpu envs) ask
    for the same kernel file: its ``#line`` directives and the headers' ``-I`` option name each one's own
    directory, yet the second reads the first's compilation -- NVRTC not called -- and its log (a warning here)
    names its own directory."""
    from cuda.bindings import nvrtc

    from pynorm.backends.cupy import _loader

    src = '#include "probe.cuh"\n#include <probe_lib.h>\n#warning probe\n__global__ void ok(float* y) { *y = TWO; }\n'
    roots = []
    for d in ("env_a", "env_b"):
        root = tmp_path / d
        (root / "pynorm" / "kernels").mkdir(parents=True)
        (root / "include").mkdir()
        (root / "pynorm" / "kernels" / "probe.cu").write_text(src)
        (root / "pynorm" / "kernels" / "probe.cuh").write_text("#pragma once\n")
        (root / "include" / "probe_lib.h").write_text("#define TWO 2.0f\n")
        roots.append(root)
    monkeypatch.setenv(cc.CACHE_ENV, str(tmp_path / "cache"))
    logs = []
    for i, root in enumerate(roots):
        monkeypatch.setattr(_loader, "cuda_include_dir", lambda root=root: (root / "include").as_posix())
        monkeypatch.setattr(_loader, "kernel_dir", lambda root=root: root / "pynorm" / "kernels")
        assembled = _loader.assemble("probe.cu")
        assert f'#line 1 "{root.as_posix()}/pynorm/kernels/probe.cu"' in assembled
        if i:
            monkeypatch.setattr(nvrtc, "nvrtcCompileProgram", lambda *a: pytest.fail("compiled again"))
        res = cc.compile_source(assembled, ["ok"], "sm_90", filename="probe.cu")
        assert res.kernels and res.kernels[0].registers >= 0
        logs.append(res.log)
    assert len(list((tmp_path / "cache").glob("nvrtc-*.json"))) == 1
    assert str(roots[0]) in logs[0] and str(roots[1]) in logs[1] and str(roots[0]) not in logs[1]


@needs_nvrtc
def test_python_mirrors_of_cuda_constants_agree():
    """FwdItems/BwdItems/acc_t in common.cuh vs their Python mirrors, checked by static_assert."""
    lines = ['#include "common.cuh"', "namespace pynorm {"]
    sizes = {"__half": 2, "__nv_bfloat16": 2, "float": 4, "double": 8}
    for t, ts in sizes.items():
        for w, ws in sizes.items():
            acc = _launch.acc_itemsize(ts, ws)
            a = "double" if acc == 8 else "float"
            lines.append(f'static_assert(sizeof(acc_t<{t}, {w}>) == {acc}, "acc {t} {w}");')
            lines.append(f'static_assert(FwdItems<{t}, {a}>::value == {_launch.fwd_items(ts, acc)}, "fwd {t}");')
            k = _launch.bwd_items(ts, acc)
            lines.append(f'static_assert(BwdItems<{t}, {a}>::fits == {"true" if k else "false"}, "fits {t}");')
            if k:
                lines.append(f'static_assert(BwdItems<{t}, {a}>::value == {k}, "bwd {t} {a}");')
        lines.append(f'static_assert(Vec<{t}>::N == {_launch.vector_width(ts)}, "V {t}");')
    lines.append("}")
    src = _loader.assemble_text("\n".join(lines), "mirror_check.cu")
    res = cc.compile_source(src, [], "sm_80", filename="mirror_check.cu")
    assert res.ok, res.errors


# ---------------------------------------------------------------------------
# loader


def test_assemble_inlines_headers_with_line_directives():
    src = _loader.assemble("stats.cu")
    assert not any(ln.startswith('#include "') for ln in src.splitlines())
    assert "#pragma once" in src  # the header's text is there
    lines = [ln for ln in src.splitlines() if ln.startswith("#line")]
    assert lines[0].startswith("#line 1 ") and lines[0].endswith('stats.cu"')
    assert any(ln.endswith('common.cuh"') for ln in lines)
    # after the header, numbering resumes on the line after the #include
    text = (Path(str(_loader.kernel_dir())) / "stats.cu").read_text().splitlines()
    inc = next(i for i, t in enumerate(text, 1) if t.startswith('#include "common.cuh"'))
    assert f"#line {inc + 1} " in src


def test_instantiations_are_what_the_specs_declare():
    """Every op of a kernel family gets its variant's kernels for every (T, W) the runtime may ask
    for: W in {T, float, double} no narrower than the accumulation type allows, and for the residual
    ops every (h, residual) type pair; ops sharing a variant share the kernels."""
    from pynorm import ops

    stats = _loader.instantiations("stats.cu")
    assert _loader.variant_args(ops.LAYER_NORM) == ("pynorm::Centered", "pynorm::Vector<true>", "pynorm::Plain")
    assert _loader.variant_args(ops.RMS_NORM) == ("pynorm::MeanSquare", "pynorm::Vector<false>", "pynorm::Plain")
    assert _loader.variant_args(ops.SCALE_NORM) == ("pynorm::SumSquare", "pynorm::Scalar", "pynorm::Plain")
    assert _loader.variant_args(ops.MODALITY_LAYER_NORM)[1] == "pynorm::Table<true>"
    assert _loader.variant_args(ops.GROUP_NORM)[1] == "pynorm::Channel<true>"  # (and InstanceNorm's)
    assert _loader.variant_args(ops.ADD_RMS_NORM, "float", "float")[2] == "pynorm::Residual<float, float>"
    with pytest.raises(ValueError, match="residual prologue"):
        _loader.variant_args(ops.ADD_LAYER_NORM)
    assert _loader.variant_args(ops.DYT) == ("pynorm::Tanh",)
    assert _loader.variant_args(ops.POWER_NORM) == ("pynorm::SignedPower",)
    # W in {T, float, double}, no float for double x: 3 + 3 + 2 + 1 (T, W) pairs; residual ops x (Hd, Rs) pairs
    assert len(_loader.spec_instantiations(ops.LAYER_NORM)) == 9
    assert len(_loader.spec_instantiations(ops.ADD_LAYER_NORM)) == sum(
        len(_loader.residual_types(t, w)) for t in _loader.CUDA_TYPES for w in _loader.param_types(t)
    )
    want = {
        tt
        for s in ops.SPECS.values()
        if s.family == "stats" and _loader.supports(s)
        for tt in _loader.spec_instantiations(s)
    }
    names = {f"pynorm::{k}<{', '.join(tt)}>" for k in _loader.KERNELS["stats.cu"] for tt in want}
    assert sorted(stats) == sorted(names)
    assert "pynorm::stats_fwd<__nv_bfloat16, float, pynorm::Centered, pynorm::Vector<true>, pynorm::Plain>" in stats
    assert "pynorm::stats_bwd_apply<double, double, pynorm::MeanSquare, pynorm::Vector<false>, pynorm::Plain>" in stats
    # no float64 x with float32 parameters: those are cast to double on the host
    assert not any(n.startswith("pynorm::stats_fwd<double, float,") for n in stats)
    groups = _loader.instantiation_groups("stats.cu")
    assert sorted(n for g in groups for n in g) == sorted(stats)
    ew = _loader.instantiations("elementwise.cu")
    assert len(ew) == 2 * 3 * 9 and "pynorm::ew_bwd<__half, float, pynorm::SignedPower>" in ew  # 3 functions
    assert "pynorm::ew_bwd<float, float, pynorm::Erf>" in ew
    quant = _loader.instantiations("quantize.cu")
    # quant_int8 reads its parameters in an accumulation type; the other five (the FP8/FP4 quantizer's
    # quant_fp_rows and quant_fp_amax among them) take every float type
    assert len(quant) == 2 + 5 * 4 and "pynorm::quant_int8<double>" in quant
    assert "pynorm::quant_fp_rows<__nv_bfloat16>" in quant
    assert "pynorm::quant_int8<__half>" not in quant and "pynorm::quant_float<__nv_bfloat16>" in quant
    assert _loader.spec_instantiations(ops.QUANT_LAYER_NORM) == [(t,) for t in _loader.CUDA_TYPES]
    intype = _loader.instantiations("intype.cu")
    assert len(intype) == 3 * 4 and "pynorm::intype_bwd<__nv_bfloat16>" in intype
    red = _loader.instantiations("reduce.cu")
    assert "pynorm::reduce_partials<__nv_bfloat16, float>" in red and len(red) == 8
    cast = _loader.instantiations("cast.cu")
    assert len(cast) == 12 and "pynorm::cast_values<__half, float>" in cast
    assert set(_loader.TYPE_NAMES) == {"float16", "bfloat16", "float32", "float64"}


_PARAM = re.compile(r"^\s*(const\s+)?([\w:<>, ]+?)\s*(\*)?\s*(?:__restrict__\s*)?(\w+)\s*$")


def _signature(src: str, kernel: str) -> list[tuple[str, str]]:
    """``(name, C type)`` of each parameter of ``__global__ ... kernel(...)`` in ``src``."""
    m = re.search(r"__global__\s+void\s+__launch_bounds__\([^)]*\)\s*" + kernel + r"\(", src)
    assert m, f"no __global__ {kernel}"
    depth, i = 1, m.end()
    while depth:
        depth += {"(": 1, ")": -1}.get(src[i], 0)
        i += 1
    params, depth, cur = [], 0, ""
    for ch in src[m.end() : i - 1]:
        depth += {"<": 1, ">": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            params.append(cur)
            cur = ""
        else:
            cur += ch
    params.append(cur)
    out = []
    for p in params:
        pm = _PARAM.match(" ".join(p.split()))
        assert pm, p
        const, base, star, name = pm.groups()
        out.append((name, f"{'const ' if const else ''}{base.strip()}{'*' if star else ''}"))
    return out


_FAMILY_FILES = ("stats.cu", "elementwise.cu", "quantize.cu", "intype.cu")


def test_the_kernels_offer_what_the_records_name(monkeypatch):
    """``_loader.supports`` and ``variant_args`` follow the families' records: a statistic is offered when its
    record names a policy and normalizes the row (the kernels keep sums of the centred values in A), its policy is
    the record's, and every statistic's r is its policy's ``rstd`` (no kernel forms r itself)."""
    import dataclasses

    from pynorm import ops
    from pynorm.ops import families

    src = (Path(str(_loader.kernel_dir())) / "stats.cu").read_text()
    assert src.count("Stat::rstd(") == 1 and "finalize_rstd(" not in src.replace("return finalize_rstd(", "")
    st = families.STATISTICS["mean_square"]
    for changes, offered in (({}, True), ({"normalizes": False}, False), ({"cuda": ""}, False)):
        monkeypatch.setitem(families.STATISTICS, "mean_square", dataclasses.replace(st, **changes))
        assert _loader.supports(ops.RMS_NORM) is offered, changes
    monkeypatch.setitem(families.STATISTICS, "mean_square", dataclasses.replace(st, cuda="pynorm::Other"))
    assert _loader.variant_args(ops.RMS_NORM)[0] == "pynorm::Other"


@pytest.mark.parametrize(("file", "kernel"), [(f, k) for f in _FAMILY_FILES for k in _loader.KERNELS[f]])
def test_argument_dataclasses_mirror_the_kernel_signatures(file, kernel):
    """The host passes each kernel's arguments from one dataclass; its fields must be the kernel's
    parameters in order, with the same names and C types."""
    from pynorm.backends.cupy import _args

    assert set(_args.KERNEL_ARGS) == {k for f in _FAMILY_FILES for k in _loader.KERNELS[f]}
    src = (Path(str(_loader.kernel_dir())) / file).read_text()
    assert list(_args.c_types(_args.KERNEL_ARGS[kernel]).items()) == _signature(src, kernel)


def test_defines_and_launch_bounds_agree():
    defs = _loader.defines()
    assert _launch.DEFS == {k.removeprefix("PYNORM_"): v for k, v in defs.items()}
    # each kernel's __launch_bounds__ macro is the one launch_bound() reports
    import re

    for file, kernels in _loader.KERNELS.items():
        src = (Path(str(_loader.kernel_dir())) / file).read_text()
        for k in kernels:
            m = re.search(r"__launch_bounds__\(((?:PYNORM|Pro::k)\w+)(?:[^)]*)\)\s*\n?\s*" + k + r"\(", src)
            assert m, f"{k} has no __launch_bounds__ in {file}"
            if m.group(1) == "Pro::kBwdThreads":  # set by the prologue policy
                for pro, macro in (("Plain", "PYNORM_BWD_THREADS"), ("Residual", "PYNORM_BWD_RESIDUAL_THREADS")):
                    body = re.search(r"struct " + pro + r" \{(.*?)\n\};", src, re.S)
                    assert body and f"kBwdThreads = {macro};" in body.group(1), pro
                    name = f"pynorm::{k}<float, float, pynorm::Centered, pynorm::Vector<true>, pynorm::{pro}"
                    assert _launch.launch_bound(name + ("<float, float>>" if pro == "Residual" else ">")) == defs[macro]
            else:
                assert _launch.launch_bound(k) == defs[m.group(1)], k


def test_cuda_include_dir_has_the_half_headers():
    d = _loader.cuda_include_dir()
    if d is None:
        pytest.skip("no cuda_fp16.h here (pip install nvidia-cuda-runtime)")
    assert (Path(d) / "cuda_fp16.h").is_file() and (Path(d) / "cuda_bf16.h").is_file()


def test_package_import_does_not_import_cupy():
    code = (
        "import sys, pynorm.backends.cupy as b; "
        "from pynorm import ops; "
        "from pynorm.backends.cupy._loader import supports; "
        "want = {n: s.family for n, s in ops.SPECS.items() if s.family != 'composite' and supports(s)}; "
        "assert b.OPS == want, b.OPS; "
        "import pynorm.backends.cupy._launch, pynorm.backends.cupy.compile_check; "
        "assert 'cupy' not in sys.modules, 'cupy imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@needs_nvrtc
def test_compile_options_keep_float32_subnormals():
    """The kernels' options compile float32 arithmetic and conversions without flush-to-zero (a row of magnitude
    ~1e38 has a subnormal float32 rstd: flushed, y, dx and the weight's gradient were wrong on a GPU)."""
    from cuda.bindings import nvrtc

    src = b'extern "C" __global__ void k(float* a, const double* b) { a[0] = (float)b[0] * a[1] + a[2] / a[3]; }'
    (prog,) = cc._check(nvrtc.nvrtcCreateProgram(src, b"k.cu", 0, [], []), "create")
    opts = [*_loader.compile_options(), "--gpu-architecture=compute_90"]
    (status,) = nvrtc.nvrtcCompileProgram(prog, len(opts), [o.encode() for o in opts])
    assert status == nvrtc.nvrtcResult.NVRTC_SUCCESS
    (size,) = cc._check(nvrtc.nvrtcGetPTXSize(prog), "size")
    buf = b" " * size
    cc._check(nvrtc.nvrtcGetPTX(prog, buf), "ptx")
    ptx = buf.decode(errors="replace")
    assert "cvt.rn.f32.f64" in ptx and "fma.rn.f32" in ptx, ptx
    assert ".ftz" not in ptx and ".approx" not in ptx, ptx


class _StandInCupy:
    """The few names of CuPy that :func:`pynorm.backends.cupy._loader._load` uses, recording what it asks for."""

    _harness = None

    def __init__(self) -> None:
        import types

        self.compiles: list[tuple] = []
        self.loaded: list[str] = []
        outer = self

        def compile_using_nvrtc(source, options, arch, filename, names, log, in_memory):
            outer.compiles.append(tuple(options))
            return b"CUBIN", {n: f"_Z{i}" for i, n in enumerate(names)}

        class RawModule:
            def __init__(self, *, path=None, code=None, **kw):
                assert code is None, "the runtime must not compile through RawModule(code=...): CuPy adds -ftz=true"
                outer.loaded.append(Path(path).read_bytes().decode())

            def get_function(self, name):
                return name

        self.RawModule = RawModule
        self.__version__ = "stand-in"
        self.cuda = types.SimpleNamespace(
            compiler=types.SimpleNamespace(compile_using_nvrtc=compile_using_nvrtc),
            nvrtc=types.SimpleNamespace(getVersion=lambda: (13, 0)),
            Device=lambda: types.SimpleNamespace(compute_capability="90"),
        )


def test_runtime_compiles_with_the_kernels_options_and_caches_the_binary(tmp_path, monkeypatch):
    """Not through CuPy's compile cache (which appends -ftz=true); the binary and lowered names reused from disk."""
    fake = _StandInCupy()
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setitem(sys.modules, "cupy.cuda", fake.cuda)
    monkeypatch.setitem(sys.modules, "cupy.cuda.compiler", fake.cuda.compiler)
    monkeypatch.setenv("PYNORM_CUDA_CACHE_DIR", str(tmp_path))
    names = ("pynorm::k<float>", "pynorm::k<double>")
    mod = _loader.Module("template <typename T> __global__ void k() {}", names)
    assert mod.get_function(names[1]) == "_Z1"
    assert fake.compiles == [_loader.compile_options()]
    ftz = [o for o in fake.compiles[0] if "ftz" in o]
    assert ftz == ["--ftz=false"]
    again = _loader.Module("template <typename T> __global__ void k() {}", names)
    assert again.get_function(names[0]) == "_Z0"
    assert len(fake.compiles) == 1 and fake.loaded == ["CUBIN", "CUBIN"]  # the second from the cache
    other = _loader.Module("template <typename T> __global__ void k() { }", names)
    other.compile()
    assert len(fake.compiles) == 2  # another source: compiled


# ---------------------------------------------------------------------------
# occupancy model (cuda_occupancy.h)


@pytest.mark.parametrize(
    ("regs", "smem", "block", "dyn", "blocks", "limiter"),
    [
        (32, 0, 256, 0, 8, "warps"),  # 64 warps of 32-register threads: full
        (64, 0, 512, 0, 2, "registers"),  # 64 regs -> 32 warps
        (64, 0, 1024, 0, 1, "registers"),
        (128, 0, 1024, 0, 0, "none"),  # 128 x 1024 > 64K registers per block: cannot launch
        (40, 0, 256, 0, 6, "registers"),  # 40 -> 1280 regs/warp -> 12 warps/sub-partition -> 48 warps
        (16, 0, 32, 0, 32, "blocks"),  # 32 blocks per SM at most
        (32, 0, 256, 100 * 1024, 2, "shared memory"),  # (100K + 1K) rounded -> 2 per 228K
        (32, 0, 256, 240 * 1024, 0, "none"),  # above the opt-in limit
    ],
)
def test_occupancy_model(regs, smem, block, dyn, blocks, limiter):
    occ = _launch.occupancy(regs, smem, block, SM90, dyn)
    assert occ.blocks_per_sm == blocks and occ.limiter == limiter
    if blocks:
        assert occ.warps_per_sm == blocks * (block // 32)
        assert occ.fraction == pytest.approx(occ.warps_per_sm / 64)


def test_occupancy_sm80_has_less_shared_memory():
    assert _launch.occupancy(32, 0, 256, SM80, 100 * 1024).blocks_per_sm == 1
    assert _launch.occupancy(32, 0, 256, SM80, 170 * 1024).blocks_per_sm == 0


# ---------------------------------------------------------------------------
# launch configuration

HIDDEN = [1, 2, 3, 7, 8, 31, 64, 127, 768, 1000, 1024, 4096, 4097, 8192, 12288, 16384, 65536, 65537, 262144, 1 << 20]
ITEMS = [(2, 4), (2, 8), (4, 4), (4, 8), (8, 8)]  # (itemsize of x, itemsize of the accumulator)


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@pytest.mark.parametrize(("itemsize", "acc"), ITEMS)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("limits", [SM80, SM90], ids=["sm_80", "sm_90"])
def test_forward_config_covers_the_row(hidden, itemsize, acc, limits):
    v = _launch.vector_width(itemsize)
    cfg = _launch.forward_config(1000, hidden, itemsize, acc, hidden % v == 0, limits, regs=64, static_smem=256)
    assert _is_pow2(cfg.group) and cfg.group <= _launch.DEFS["FWD_THREADS"]
    assert cfg.block % 32 == 0 and cfg.block % cfg.group == 0 and cfg.block <= _launch.DEFS["FWD_THREADS"]
    assert cfg.group <= 32 or cfg.block == cfg.group  # groups larger than a warp are whole blocks
    assert cfg.items * cfg.group * v >= hidden > (cfg.items - 1) * cfg.group * v  # exactly covers the row
    k = _launch.fwd_items(itemsize, acc)
    if cfg.group < _launch.DEFS["FWD_THREADS"]:
        assert cfg.items <= k  # fits the registers unless the block is already as large as allowed
    over = max(0, cfg.items - k) * cfg.group * 16
    assert cfg.over_smem in (0, over)
    assert cfg.over_smem + 256 <= limits.smem_per_block_optin
    assert 1 <= cfg.grid <= -(-1000 // cfg.rows_per_block)
    assert cfg.log2g == cfg.group.bit_length() - 1


def test_forward_config_examples():
    # small rows: one thread per row, many rows per block
    c = _launch.forward_config(10, 1, 4, 4, True, SM90, 64)
    assert (c.group, c.block, c.items) == (1, 256, 1) and c.grid == 1
    c = _launch.forward_config(10**6, 3, 2, 4, False, SM90, 64)
    assert c.group == 1 and c.items == 1 and c.grid == SM90.sm_count * 4  # persistent grid, 4 blocks of 256
    # a bf16 LLM row: 4096 = 512 vectors of 8, 2 per thread -> 256 threads
    c = _launch.forward_config(4096, 4096, 2, 4, True, SM90, 64)
    assert (c.group, c.block, c.items, c.over_smem) == (256, 256, 2, 0)
    # 65536 float32: 16384 vectors over 512 threads: 4 in registers, 28 in shared memory on sm_90 ...
    c = _launch.forward_config(1024, 65536, 4, 4, True, SM90, 64, 128)
    assert (c.group, c.items, c.over_smem) == (512, 32, 28 * 512 * 16)
    # ... which does not fit sm_80 (or when forced): re-read from L2
    assert _launch.forward_config(1024, 65536, 4, 4, True, SM80, 64, 128).over_smem == 0
    assert _launch.forward_config(1024, 65536, 4, 4, True, SM90, 64, 128, overflow="global").over_smem == 0
    with pytest.raises(ValueError, match="do not fit"):
        _launch.forward_config(1024, 65536, 4, 4, True, SM80, 64, 128, overflow="smem")
    # 262144 float32 never fits shared memory
    assert _launch.forward_config(8, 262144, 4, 4, True, SM90, 64).over_smem == 0


@pytest.mark.parametrize(("itemsize", "acc"), ITEMS)
@pytest.mark.parametrize("hidden", HIDDEN)
def test_backward_config(hidden, itemsize, acc):
    v = _launch.vector_width(itemsize)
    kind = _launch.backward_kind(hidden, itemsize, acc)
    cfg = _launch.backward_config(777, hidden, itemsize, acc, hidden % v == 0, SM90, kind, regs=64, static_smem=512)
    assert cfg.kind == kind
    rc = cfg.rows
    assert _is_pow2(rc.group) and rc.block % rc.group == 0 and (rc.group <= 32 or rc.block == rc.group)
    assert rc.items * rc.group * v >= hidden
    if kind == "fused":
        k = _launch.bwd_items(itemsize, acc)
        assert k >= 1 and rc.items <= k and rc.block <= _launch.DEFS["BWD_THREADS"]
        assert cfg.partials == rc.grid >= 1
    else:
        assert rc.block <= _launch.DEFS["STATS_THREADS"]
        assert cfg.apply_block == _launch.DEFS["APPLY_THREADS"]
        assert cfg.tiles * cfg.apply_block * v >= hidden > (cfg.tiles - 1) * cfg.apply_block * v
        assert cfg.chunks * cfg.rows_per_chunk >= 777 > (cfg.chunks - 1) * cfg.rows_per_chunk
        assert cfg.partials == cfg.chunks


def test_backward_kind_by_size():
    # 16 float accumulators... 8 columns per thread x 1024 threads
    assert _launch.backward_kind(8192, 2, 4) == "fused"
    assert _launch.backward_kind(8192, 4, 4) == "fused"
    assert _launch.backward_kind(8200, 4, 4) == "split"
    assert _launch.backward_kind(4096, 8, 8) == "fused"
    assert _launch.backward_kind(8192, 8, 8) == "split"
    assert _launch.backward_kind(65536, 2, 4) == "split"
    assert _launch.backward_kind(262144, 4, 4) == "split"
    # 2-byte x with float64 parameters: a 16-byte item is 8 doubles, over the budget
    assert _launch.bwd_items(2, 8) == 0
    assert _launch.backward_kind(16, 2, 8) == "split"
    with pytest.raises(ValueError, match="no fused backward"):
        _launch.backward_kind(16, 2, 8, force="fused")
    assert _launch.backward_kind(16, 4, 4, force="split") == "split"
    with pytest.raises(ValueError):
        _launch.backward_config(10, 8200, 4, 4, True, SM90, "fused")


def test_split_backward_grid_limits():
    cfg = _launch.backward_config(1, 1 << 24, 8, 8, True, SM90, "split")
    assert cfg.tiles == (1 << 24) // (256 * 2) and cfg.chunks == 1
    with pytest.raises(ValueError, match="column tiles"):
        _launch.backward_config(1, 1 << 26, 8, 8, True, SM90, "split")
    with pytest.raises(ValueError, match="hidden size"):
        _launch.forward_config(1, 0, 4, 4, True, SM90)


def test_zero_rows_launch_nothing():
    assert _launch.forward_config(0, 128, 4, 4, True, SM90, 32).grid == 0
    cfg = _launch.backward_config(0, 128, 4, 4, True, SM90, "split")
    assert cfg.chunks == 0 and cfg.partials == 0


@pytest.mark.parametrize(
    ("hidden", "itemsize", "addresses", "expected"),
    [
        (4096, 2, (0, 256), True),
        (4096, 4, (1024, 2048, 4096), True),
        (4097, 4, (0, 0), False),  # H not a multiple of 4
        (3, 8, (0,), False),
        (2, 8, (0, 16), True),
        (4096, 2, (0, 258), False),  # an array offset by one element
        (4096, 4, (8, 0), False),
        (8, 2, (0,), True),
    ],
)
def test_can_vectorize(hidden, itemsize, addresses, expected):
    assert _launch.can_vectorize(hidden, itemsize, addresses) is expected


def test_vector_width_and_group_size():
    assert [_launch.vector_width(s) for s in (2, 4, 8)] == [8, 4, 2]
    with pytest.raises(ValueError):
        _launch.vector_width(1)
    assert _launch.group_size(1, 4, 4, 512) == 1
    assert _launch.group_size(4096, 2, 2, 512) == 256
    assert _launch.group_size(262144, 4, 4, 512) == 512
    assert _launch.group_size(65, 4, 4, 512) == 8  # 17 vectors, 4 per thread: 5 threads, rounded up to 8
    assert _launch.items_per_thread(65, 4, 8) == 3


def test_launch_bounds_table():
    fwd = "pynorm::stats_fwd<float, float, pynorm::Centered, pynorm::Vector<true>>"
    assert _launch.launch_bound(fwd) == _launch.DEFS["FWD_THREADS"]
    assert _launch.launch_bound("stats_bwd") == _launch.DEFS["BWD_THREADS"]
    assert _launch.launch_bound("stats_bwd_stats") == _launch.DEFS["STATS_THREADS"]
    assert _launch.launch_bound("stats_bwd_apply") == _launch.DEFS["APPLY_THREADS"]
    assert _launch.launch_bound("reduce_partials") == 256
    with pytest.raises(KeyError):
        _launch.launch_bound("nope")


# ---------------------------------------------------------------------------
# dtype dispatch


@pytest.mark.parametrize(
    ("x", "w", "b", "expected"),
    [
        ("float32", None, None, ("float", "float", "float", (False, False))),
        ("bfloat16", None, None, ("__nv_bfloat16", "__nv_bfloat16", "float", (False, False))),
        ("float16", "float16", "float16", ("__half", "__half", "float", (False, False))),
        ("bfloat16", "float32", None, ("__nv_bfloat16", "float", "float", (False, False))),
        ("bfloat16", None, "bfloat16", ("__nv_bfloat16", "__nv_bfloat16", "float", (False, False))),
        ("float16", "float64", None, ("__half", "double", "double", (False, False))),
        # a parameter narrower than x is widened to the accumulation type first (param_types)
        ("float64", "bfloat16", "bfloat16", ("double", "double", "double", (True, True))),
        ("float32", "float32", "float64", ("float", "double", "double", (True, False))),
        ("bfloat16", "bfloat16", "float32", ("__nv_bfloat16", "float", "float", (True, False))),
        ("float16", "float32", "float16", ("__half", "float", "float", (False, True))),
    ],
)
def test_type_plan(x, w, b, expected):
    plan = _launch.type_plan(dtype_of(x), w and dtype_of(w), b and dtype_of(b))
    assert (plan.T, plan.W, plan.acc, plan.casts) == expected
    assert plan.acc_dtype == ("float64" if plan.acc == "double" else "float32")
    assert plan.acc_itemsize == np.dtype(plan.acc_dtype).itemsize


@pytest.mark.parametrize("bad", ["int32", "complex64", "float128" if hasattr(np, "float128") else "uint8"])
def test_type_plan_rejects_other_dtypes(bad):
    with pytest.raises(DTypeError, match="float16, bfloat16, float32 and float64"):
        _launch.type_plan(np.dtype(bad))
    with pytest.raises(DTypeError):
        _launch.type_plan(np.dtype("float32"), np.dtype(bad))


# ---------------------------------------------------------------------------
# what the kernels themselves need of their input (everything else is validated once, from the op
# spec, before dispatch: tests/test_validation.py)


def test_input_checks_of_the_kernels():
    from pynorm.backends.cupy._launch import check_input as _check_input

    assert _check_input(np.zeros((0, 8), np.float16)) == (0, 8)  # no rows is fine
    with pytest.raises(ShapeError, match="2-D"):
        _check_input(np.zeros(8, np.float32))
    with pytest.raises(ShapeError, match="range 1"):
        _check_input(np.zeros((4, 0), np.float32))
