"""The public functional surface is made from the op specs (:mod:`pynorm._api`): every op has its three functions
with the spec's signature and a docstring naming every argument, and the typing stub is current."""

from __future__ import annotations

import inspect
import subprocess
import sys

import numpy as np
import pytest

import pynorm
from pynorm import _api, _stub, ops


@pytest.mark.parametrize("op", sorted(ops.SPECS))
def test_every_op_has_its_three_functions_with_the_specs_signature(op: str) -> None:
    spec = ops.SPECS[op]
    fwd, call, bwd = (getattr(pynorm, n) for n in (f"{op}_forward", op, f"{op}_backward"))
    for f in (fwd, call):
        sig = inspect.signature(f)
        names = list(sig.parameters)
        positional = [i.name for i in spec.inputs if not i.keyword] + list(spec.param_names)
        assert names[: 1 + len(positional)] == ["x", *positional]
        for o in spec.options:
            p = sig.parameters[o.name]
            default = inspect.Parameter.empty if o.default is ops.REQUIRED else o.default
            assert p.kind is inspect.Parameter.KEYWORD_ONLY and p.default == default, (op, o.name)
        common = ("axis", "backend", "out") if spec.layout == "rows" else ("backend", "out")
        for n in (*common, *(i.name for i in spec.inputs if i.keyword)):
            assert sig.parameters[n].kind is inspect.Parameter.KEYWORD_ONLY
        assert ("axis" in sig.parameters) == (spec.layout == "rows")
        required = [p.name for p in spec.params if p.required] + [i.name for i in spec.inputs if i.required]
        for n in required:
            assert sig.parameters[n].default is inspect.Parameter.empty, (op, n)
    bsig = inspect.signature(bwd)
    assert list(bsig.parameters) == ["dy", "ctx", *(f"d{o}" for o in spec.outputs[1:]), "dx_out"]
    assert bsig.return_annotation == spec.grads.__name__
    assert getattr(pynorm, spec.grads.__name__) is spec.grads


@pytest.mark.parametrize("op", sorted(ops.SPECS))
def test_docstrings_name_every_argument(op: str) -> None:
    spec = ops.SPECS[op]
    doc = getattr(pynorm, f"{op}_forward").__doc__
    common = ("axis", "backend", "out") if spec.layout == "rows" else ("backend", "out")
    for n in ("x", *spec.input_names, *spec.param_names, *(o.name for o in spec.options), *common):
        assert f"\n{n} : " in doc, (op, n)
    assert "Returns\n-------" in doc
    bdoc = getattr(pynorm, f"{op}_backward").__doc__
    assert spec.grads.__name__ in bdoc


def test_the_stub_is_current() -> None:
    assert _stub.PATH.read_text() == _api.stub(), "run python -m pynorm._stub"


def test_a_generated_function_raises_as_a_written_one() -> None:
    x = np.ones((2, 4), np.float32)
    with pytest.raises(TypeError, match="unexpected keyword argument 'epsilon'"):
        pynorm.layer_norm(x, epsilon=1e-5)
    with pytest.raises(TypeError, match="missing .* required positional argument"):
        pynorm.dyt(x)
    y, _ = pynorm.layer_norm_forward(x, np.ones(4, np.float32), eps=1e-6, axis=-1)
    np.testing.assert_array_equal(y, pynorm.layer_norm(x, np.ones(4, np.float32), eps=1e-6))
    assert pynorm.layer_norm_forward.__module__ == "pynorm.functional"
    assert "pynorm generated" in pynorm.layer_norm_forward.__code__.co_filename


def test_generic_forward_is_the_public_forward() -> None:
    for name, spec in ops.SPECS.items():
        if not any(i.keyword for i in spec.inputs):
            assert spec.generic_forward() is getattr(pynorm, f"{name}_forward")


def test_mypy_sees_the_generated_functions(tmp_path: object) -> None:
    pytest.importorskip("mypy", reason="mypy is installed in the lint env")
    from pathlib import Path

    d = Path(str(tmp_path))
    (d / "use.py").write_text(
        "import numpy as np\nimport pynorm\n"
        "y = pynorm.layer_norm(np.ones((2, 4)), eps=1e-6)\n"
        "g: pynorm.LayerNormGrads = pynorm.layer_norm_backward(y, pynorm.layer_norm_forward(y)[1])\n"
        "pynorm.layer_norm(np.ones((2, 4)), epsilon=1e-6)\n"
    )
    r = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental", str(d / "use.py")], capture_output=True,
                       text=True, timeout=300)  # fmt: skip
    assert 'Unexpected keyword argument "epsilon" for "layer_norm"' in r.stdout, r.stdout + r.stderr
    assert r.stdout.count("error:") == 1, r.stdout
