"""Proof that the CPU execution harness catches real kernel bugs: each test plants one bug in a copy
of pynorm's CUDA sources, runs LayerNorm / RMSNorm through the backend's real host code on the
harness, and asserts that the bug is caught -- by the harness (race, deadlock, missing lanes, a
write outside a buffer) or by the comparison with the reference -- and says how.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest

from . import requested, unavailable_reason

if not requested():
    pytest.skip("the CPU execution harness runs in `tox -e cuda_cpu` (PYNORM_CUDA_CPU=1)", allow_module_level=True)
_REASON = unavailable_reason()
if _REASON is not None:
    pytest.skip(f"the CPU execution harness cannot run here: {_REASON}", allow_module_level=True)

import cupy  # noqa: E402  (the harness's stand-in)

from pynorm.backends.cupy import _loader, stats  # noqa: E402
from pynorm.reference import layer_norm as ref_ln  # noqa: E402
from pynorm.reference import rms_norm as ref_rms  # noqa: E402
from pynorm.testing import term_scales  # noqa: E402

from . import fakecupy  # noqa: E402

# name -> (file, exact text, replacement)
PLANTED = {
    "missing barrier (block reduction)": (
        "common.cuh",
        "    __syncthreads();  // the previous reduction's readers are done with `red`\n",
        "",
    ),
    "missing barrier (partial sums of the groups)": (
        "stats.cu",
        "          }\n        }\n      }\n    }\n    __syncthreads();\n  }\n}",
        "          }\n        }\n      }\n    }\n  }\n}",
    ),
    "off-by-one loop bound": (
        "reduce.cu",
        "for (long long p = threadIdx.y; p < n; p += PYNORM_REDUCE_Y)",
        "for (long long p = threadIdx.y; p <= n; p += PYNORM_REDUCE_Y)",
    ),
    "out-of-bounds store": (
        "common.cuh",
        "    if (base + e < H) p[e] = r.v[e];",
        "    if (base + e <= H) p[e] = r.v[e];",
    ),
    "wrong coefficient": (
        "stats.cu",
        "      o.coef = div_row(gx, n);",
        "      o.coef = div_row(gx, n) * A(1.001);",
    ),
    "shuffle skipped by one lane": (
        "common.cuh",
        "    for (int i = 0; i < N; ++i) v[i] += __shfl_xor_sync(0xffffffffu, v[i], o);",
        "    for (int i = 0; i < N; ++i) {\n"
        "      if ((threadIdx.x & 31) != 5) v[i] += __shfl_xor_sync(0xffffffffu, v[i], o);\n"
        "    }",
    ),
}

# shapes that take every path the bugs above sit on: block per row (H = 1000: reductions across warps),
# sub-warp rows with a scalar tail (H = 77 is not a multiple of the vector width), many rows (several
# groups per block)
CASES = [((64, 1000), "float32"), ((33, 77), "float32"), ((300, 48), "float32")]


@pytest.fixture
def planted(tmp_path, monkeypatch):
    """Install a copy of the kernels with one bug: ``planted(name)``."""

    clean = {f: _loader.assemble(f) for f in _loader.KERNELS}
    file_of = {kern: f for f, kernels in _loader.KERNELS.items() for kern in kernels}
    original_stats = fakecupy._nvrtc_stats

    def clean_stats(code, names, options):
        """NVRTC's figures of the unmodified source: a planted copy is launched like the kernel it is a
        copy of (saves an NVRTC compilation per planted bug; launch sizing does not depend on the bug)."""
        base = names[0].split("<", 1)[0].rsplit("::", 1)[-1]
        return original_stats(clean[file_of[base]], names, options)

    def plant(name: str) -> None:
        file, old, new = PLANTED[name]
        d = tmp_path / "kernels"
        shutil.copytree(Path(str(_loader.kernel_dir())), d)
        src = (d / file).read_text()
        assert src.count(old) == 1, f"the text to replace for {name!r} must occur once in {file}"
        (d / file).write_text(src.replace(old, new))
        monkeypatch.setattr(_loader, "kernel_dir", lambda: d)
        monkeypatch.setattr(fakecupy, "_nvrtc_stats", clean_stats)
        _loader.forget()

    yield plant
    _loader.forget()


def _dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _run(op: str, shape: tuple[int, int], dt: str) -> str | None:
    """Forward and backward on the harness; how the result disagrees with the reference (None if not)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal(shape).astype(_dtype(dt))
    dy = rng.standard_normal(shape).astype(_dtype(dt))
    h = shape[1]
    names = ("weight", "bias") if op == "layer_norm" else ("weight",)
    params = {n: ((1.0 if n == "weight" else 0.0) + 0.5 * rng.standard_normal(h)).astype(_dtype(dt)) for n in names}
    dev, ref = stats.OP_IMPLS[op], (ref_ln if op == "layer_norm" else ref_rms)
    conv = {"eps": 1e-5, "correction": 1} if op == "layer_norm" else {"eps": 1e-6}
    y, ctx = dev.forward(cupy.asarray(x), *(cupy.asarray(p) for p in params.values()), **conv)
    grads = dev.backward(cupy.asarray(dy), ctx)
    y_r, ctx_r = ref.forward(x, *params.values(), **conv)
    grads_r = ref.backward(dy, ctx_r)
    sc = term_scales(op, x, params, dy, conv)
    rtol = 1e-5 if dt == "float32" else 2.0**-7
    for what, a, e, s in [("y", y, y_r, sc["y"]), ("dx", grads[0], grads_r[0], sc["dx"])] + [
        (f"d{n}", g, gr, sc[f"d{n}"]) for n, g, gr in zip(names, grads[1:], grads_r[1:], strict=True)
    ]:
        av = cupy.asnumpy(a).astype(np.float64)
        ev = np.asarray(e).astype(np.float64)
        bad = ~(np.abs(av - ev) <= 4 * rtol * s + 1e-30)
        if bad.any():
            return f"{what} differs from the reference in {int(bad.sum())} of {bad.size} elements"
    return None


def _how_caught(op: str) -> list[str]:
    found = []
    for shape, dt in CASES:
        try:
            why = _run(op, shape, dt)
        except (fakecupy.HarnessError, fakecupy.CUDADriverError) as exc:
            why = f"harness: {str(exc)[:400]}"
        if why is not None:
            found.append(f"{op} {shape} {dt}: {why}")
    return found


EXPECT = {
    "missing barrier (block reduction)": r"race|differs",
    "missing barrier (partial sums of the groups)": r"race",
    "off-by-one loop bound": r"differs|invalid memory access",
    "out-of-bounds store": r"past the end|race|differs",
    "wrong coefficient": r"dx differs",
    "shuffle skipped by one lane": r"harness: .*(lanes|warp)",
}


def test_the_unmodified_kernels_pass(planted):
    assert _how_caught("layer_norm") == [] and _how_caught("rms_norm") == []


@pytest.mark.parametrize("name", list(PLANTED))
def test_planted_bug_is_caught(planted, name, capsys):
    planted(name)
    found = _how_caught("layer_norm") + (_how_caught("rms_norm") if "coefficient" not in name else [])
    assert found, f"planted bug {name!r} went unnoticed"
    assert any(re.search(EXPECT[name], f) for f in found), found
    with capsys.disabled():
        print(f"\n  planted {name!r}: caught {len(found)} times, e.g. {found[0][:240]}")
