"""pynorm.blocks' API: one ``rng=`` everywhere, ``io_norm_kind``, mask dtypes, and ``docs/blocks.md``
kept true -- its signatures against ``inspect.signature``, its parameter-name tables against real modules.

The tables and signatures are read from the page (the expected values are the page's text), the
modules are built by the code under test; a mismatch either way fails.
"""

from __future__ import annotations

import inspect
import itertools
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pynorm.blocks import (
    Adam,
    Block,
    Embedding,
    FeedForward,
    Linear,
    LossScaler,
    MultiHeadAttention,
    Norm,
    SequenceModel,
    Stack,
    cross_entropy,
    deepnorm_constants,
    sort_task,
    train_step,
)
from pynorm.errors import ArgumentError, DTypeError, ShapeError

from .test_blocks import B_, D_, T_, _np, grad_check

PAGE = Path(__file__).resolve().parent.parent / "docs" / "blocks.md"
TEXT = PAGE.read_text(encoding="utf-8")


def _prose(text: str) -> str:
    """The page without its fenced code blocks (their calls are examples, not signatures)."""
    out, fence = [], None
    for line in text.splitlines():
        m = re.match(r"^\s*(`{3,})", line)
        if m and (fence is None or m.group(1).startswith(fence)):
            fence = None if fence else m.group(1)
            continue
        if fence is None:
            out.append(line)
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# rng: one name, one meaning


def _params(m: Any) -> dict[str, np.ndarray]:
    return {n: np.asarray(o.params[k]).copy() for n, o, k in m.named_parameters()}


MAKERS: dict[Any, tuple[Any, ...]] = {
    Linear: (6, 5),
    FeedForward: (6, 10),
    MultiHeadAttention: (6, 2),
    Embedding: (5, 6, 4),
    Block: (6, 2, 10),
    Stack: (2, 6, 2, 10),
    SequenceModel: (5, 4, 2, 6, 2, 10),
}


@pytest.mark.parametrize("cls", list(MAKERS), ids=lambda c: c.__name__)
def test_rng_is_one_argument_everywhere(cls):
    def make(**kw: Any) -> Any:
        return cls(*MAKERS[cls], **kw)

    assert inspect.signature(cls).parameters["rng"].default is None
    a, b = _params(make(rng=3)), _params(make(rng=3))
    gen = _params(make(rng=np.random.default_rng(3)))  # a Generator is used as is: the same stream
    ss = _params(make(rng=np.random.SeedSequence(3)))
    other, fresh1, fresh2 = _params(make(rng=4)), _params(make()), _params(make())
    weights = [n for n in a if n.endswith((".W", "E", "P")) or n == "W"]
    assert weights
    for n in weights:
        np.testing.assert_array_equal(a[n], b[n], err_msg=n)
        np.testing.assert_array_equal(a[n], gen[n], err_msg=n)
        np.testing.assert_array_equal(a[n], ss[n], err_msg=n)
    assert any(not np.array_equal(a[n], other[n]) for n in weights)
    assert any(not np.array_equal(fresh1[n], fresh2[n]) for n in weights)  # None: fresh entropy
    for bad in (-1, 1.5, True, "0", [1, 2]):
        with pytest.raises(ArgumentError, match=r"\brng\b"):
            make(rng=bad)
    with pytest.raises(TypeError, match="seed"):
        make(seed=0)


def test_keyword_options_bind_like_written_out_signatures():
    # the constructors take their options through **kw (pynorm.blocks._base.keyword_options): a call is
    # still bound to the public signature, and the options' defaults reach the constructor
    for bad in ((6, 2, 10, 1), (6,)):
        with pytest.raises(TypeError):
            Block(*bad)
    with pytest.raises(TypeError, match="hybrid_layers"):  # a stack's option, not a block's
        Block(6, 2, 10, hybrid_layers=1)
    stack = Stack(2, 6, 2, 10, rng=0)
    assert stack.placement == "pre" and stack.record and not stack.checkpoint and stack.final_norm is not None
    assert [b.norm_kind for b in stack.blocks] == ["layer", "layer"]
    hybrid = Stack(2, 6, 2, 10, hybrid_layers=1, norm="rms", n_modalities=2, rng=0)
    assert [b.norm_kind for b in hybrid.blocks] == ["modality", "rms"]
    assert hybrid.blocks[0].norms["norm1"].inner.kind == "rms"


def test_modules_built_from_one_generator_draw_consecutive_streams():
    g = np.random.default_rng(7)
    first, second = Linear(4, 4, rng=g), Linear(4, 4, rng=g)
    ref = np.random.default_rng(7)
    w1 = ref.standard_normal((4, 4)) * np.sqrt(2.0 / 8)
    w2 = ref.standard_normal((4, 4)) * np.sqrt(2.0 / 8)
    np.testing.assert_allclose(first.params["W"], w1.astype(np.float32), rtol=1e-6)
    np.testing.assert_allclose(second.params["W"], w2.astype(np.float32), rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# io_norm_kind


@pytest.mark.parametrize(
    ("norm", "extra", "expected"),
    [
        ("layer", {}, "layer"),
        ("rms", {}, "rms"),
        ("scale", {}, "scale"),
        ("dyt", {}, "dyt"),
        ("modality", {"modality_kind": "rms"}, "rms"),
        ("modality", {"modality_kind": "layer"}, "layer"),
        ("rms", {"io_norm_kind": "layer"}, "layer"),
        ("layer", {"io_norm_kind": "dyt"}, "dyt"),
    ],
)
def test_io_norm_kind_follows_the_blocks_norm(norm, extra, expected):
    blk = Block(8, 2, norm=norm, n_modalities=2, io_norms=True, **extra)
    assert [n.kind for n in (blk.attn.ln_q, blk.attn.ln_kv, blk.attn.ln_out)] == [expected] * 3
    assert blk.attn.io_norm_kind == expected
    st = Stack(2, 8, 2, norm=norm, n_modalities=2, io_norms=True, **extra)
    assert {b.attn.ln_out.kind for b in st.blocks} == {expected}


def test_io_norm_kind_in_a_hybrid_stack_follows_norm():
    st = Stack(3, 8, 2, norm="rms", hybrid_layers=2, n_modalities=2, io_norms=True)
    assert [b.norm_kind for b in st.blocks] == ["modality", "modality", "rms"]
    assert [b.attn.ln_q.kind for b in st.blocks] == ["rms"] * 3


def test_io_norm_kind_errors():
    for make in (MultiHeadAttention, Block):
        with pytest.raises(ArgumentError, match="io_norm_kind.*io_norms=True"):
            make(8, 2, io_norm_kind="rms")
        with pytest.raises(ArgumentError, match="io_norm_kind"):
            make(8, 2, io_norms=True, io_norm_kind="modality")
    with pytest.raises(ArgumentError, match="io_norm_kind"):
        Stack(2, 8, 2, io_norm_kind="layer")
    assert MultiHeadAttention(8, 2, io_norms=True).ln_q.kind == "layer"  # no block norm to follow


def test_stack_of_modality_norms(backend):
    """``Stack(norm="modality")``: every block's norms and the final norm are tables of ``modality_kind``."""
    rng = np.random.default_rng(20)
    st = Stack(1, D_, 2, 12, norm="modality", modality_kind="rms", n_modalities=3, rng=4, dtype=np.float64,
               backend=backend.name, xp=backend.xp)  # fmt: skip
    shapes = {n: tuple(o.params[k].shape) for n, o, k in st.named_parameters()}
    assert shapes["layers.0.norm1.norm.weight"] == (3, D_) and shapes["final_norm.norm.weight"] == (3, D_)
    assert not any(n.endswith("norm.bias") for n in shapes)
    ids = backend.asarray(rng.integers(0, 3, (B_, T_)))
    grad_check(backend, st, rng.standard_normal((B_, T_, D_)), lambda a: st.forward(a, None, ids), directions=2)


# ---------------------------------------------------------------------------------------------
# padding masks


@pytest.mark.parametrize("dtype", [np.int64, np.int8, np.float32])
def test_a_non_bool_padding_mask_is_a_dtype_error(dtype):
    x = np.zeros((2, 3, 8), np.float32)
    mask = np.ones((2, 3), dtype)
    for m in (MultiHeadAttention(8, 2), Block(8, 2), Stack(1, 8, 2)):
        with pytest.raises(DTypeError, match=r"padding_mask.*bool"):
            m.forward(x, mask)
    with pytest.raises(ShapeError, match="padding_mask"):  # a bool mask of the wrong shape stays a ShapeError
        MultiHeadAttention(8, 2).forward(x, np.ones((2, 4), bool))
    with pytest.raises(ShapeError, match="padding_mask"):
        MultiHeadAttention(8, 2).forward(x, np.ones((3, 3), bool))


@pytest.mark.parametrize("kind", ["layer", "rms", "scale", "dyt"])
def test_fully_masked_rows_through_ln_out(backend, kind):
    """A query with no visible key: ``y = ln_out(0) Wo^T + bo`` and no gradient reaches ``x`` or q/k/v."""
    rng = np.random.default_rng(21)
    mha = MultiHeadAttention(D_, 2, qk_norm="rms", io_norms=True, io_norm_kind=kind, causal=True, rng=6,
                             dtype=np.float64, backend=backend.name, xp=backend.xp)  # fmt: skip
    ln = mha.ln_out.inner
    for k in ln.params:  # non-trivial ln_out parameters (alpha, g: scalars)
        ln.params[k] = backend.asarray(rng.standard_normal(ln.params[k].shape) + 1.0)
    bo = rng.standard_normal(D_)
    mha.o.params["b"] = backend.asarray(bo)
    wo = _np(backend, mha.o.params["W"])
    ln0 = _np(backend, ln.params["bias"]) if kind in ("layer", "dyt") else np.zeros(D_)  # ln_out(0)
    expected_row = ln0 @ wo.T + bo
    pm = np.array([[False, False, False], [False, True, True]])  # all of sequence 0; query 0 of sequence 1
    x = rng.standard_normal((B_, T_, D_))
    y, ctx = mha.forward(backend.asarray(x), backend.asarray(pm))
    y = _np(backend, y)
    masked = np.zeros((B_, T_), bool)
    masked[0, :] = masked[1, 0] = True
    np.testing.assert_allclose(y[masked], np.broadcast_to(expected_row, (4, D_)), rtol=1e-12, atol=1e-12)
    # a gradient on the fully masked rows only: nothing reaches x, the projections or the input norms
    dy = np.where(masked[..., None], rng.standard_normal(y.shape), 0.0)
    mha.zero_grad()
    dx = _np(backend, mha.backward(backend.asarray(dy), ctx))
    np.testing.assert_array_equal(dx, 0.0)
    for n, o, k in mha.named_parameters():
        g = _np(backend, o.grads[k])
        assert np.all(np.isfinite(g)), n
        if n.startswith(("q.", "k.", "v.", "q_norm.", "k_norm.", "ln_q.", "ln_kv.")):
            np.testing.assert_array_equal(g, 0.0, err_msg=n)
    np.testing.assert_allclose(_np(backend, mha.o.grads["b"]), dy.sum(axis=(0, 1)), rtol=1e-12)
    if kind in ("layer", "dyt"):
        np.testing.assert_allclose(_np(backend, ln.grads["bias"]), (dy @ wo).sum(axis=(0, 1)), rtol=1e-12)


# ---------------------------------------------------------------------------------------------
# docs/blocks.md: signatures and their defaults

SIGNED: dict[str, Any] = {
    "Linear": Linear,
    "FeedForward": FeedForward,
    "MultiHeadAttention": MultiHeadAttention,
    "MultiHeadAttention.forward": MultiHeadAttention.forward,
    "Norm": Norm,
    "Norm.forward": Norm.forward,
    "Norm.forward_add": Norm.forward_add,
    "Embedding": Embedding,
    "Block": Block,
    "Block.forward": Block.forward,
    "Stack": Stack,
    "Stack.forward": Stack.forward,
    "Adam": Adam,
    "Adam.step": Adam.step,
    "LossScaler": LossScaler,
    "SequenceModel": SequenceModel,
    "SequenceModel.forward": SequenceModel.forward,
    "train_step": train_step,
    "cross_entropy": cross_entropy,
    "sort_task": sort_task,
    "deepnorm_constants": deepnorm_constants,
}
ITEM = re.compile(r"^(?:\*|\.\.\.|\*{1,2}[A-Za-z_]\w*|[A-Za-z_]\w*(?:=.+)?)$")


def _split_top(s: str) -> list[str]:
    parts, depth, cur, quote = [], 0, "", None
    for ch in s:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "\"'":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
            continue
        cur += ch
    if cur.strip():
        parts.append(cur.strip())
    return parts


def documented_signatures(text: str) -> list[tuple[str, list[str]]]:
    """``(name, items)`` for every code span ``Name(item, ...)`` of a known callable whose items all read
    as parameters (``a``, ``a=default``, ``*``, ``*args``, ``**kw``, ``...``); other spans are calls."""
    out = []
    for span in re.findall(r"`([^`]+)`", _prose(text)):
        span = " ".join(span.split())
        m = re.match(r"^(?:pynorm\.)?([A-Za-z_][\w.]*)\((.*)$", span)
        if not m or m.group(1) not in SIGNED:
            continue
        body, depth = m.group(2), 1
        for i, ch in enumerate(body):
            depth += {"(": 1, ")": -1}.get(ch, 0)
            if depth == 0:
                body, rest = body[:i], body[i + 1 :].strip()
                break
        else:
            continue
        items = _split_top(body)
        if (rest and not rest.startswith("->")) or not all(ITEM.match(it) for it in items):
            continue
        out.append((m.group(1), items))
    return out


def _same(doc: Any, real: Any) -> bool:
    """The documented default is the real one: the same object, or an equal value of the same type
    (an int for a float is accepted, a bool for a number is not)."""
    if doc is real:
        return True
    if isinstance(doc, bool) or isinstance(real, bool):
        return False
    if isinstance(doc, int | float) and isinstance(real, int | float):
        return doc == real
    return type(doc) is type(real) and bool(doc == real)


def _check_signature(name: str, items: list[str]) -> list[str]:
    obj = SIGNED[name]
    params = list(inspect.signature(obj).parameters.values())
    if "." in name:  # a method: drop self
        params = params[1:]
    by_name = {p.name: p for p in params}
    errors, order, keyword_only = [], [], False
    P = inspect.Parameter
    for it in items:
        if it == "...":
            continue
        if it == "*":
            keyword_only = True
            continue
        star = len(it) - len(it.lstrip("*"))
        pname, _, default = it.lstrip("*").partition("=")
        p = by_name.get(pname)
        if p is None:
            errors.append(f"{name}: no parameter {pname!r}")
            continue
        order.append(params.index(p))
        kind = {1: P.VAR_POSITIONAL, 2: P.VAR_KEYWORD}.get(star)
        if kind is not None and p.kind is not kind:
            errors.append(f"{name}: {it} but {pname} is {p.kind.description}")
        if star == 1:
            keyword_only = True
        if star == 0:
            if keyword_only != (p.kind is P.KEYWORD_ONLY):
                errors.append(f"{name}: {pname} is {p.kind.description}, documented otherwise")
            if not default and p.default is not P.empty:
                errors.append(f"{name}: {pname} documented without a default; it is {p.default!r}")
            if default:
                if p.default is P.empty:
                    errors.append(f"{name}: {pname}={default} documented; it has no default")
                elif not _same(eval(default, {"__builtins__": {}, "np": np}), p.default):  # the page's own text
                    errors.append(f"{name}: {pname}={default} documented; the default is {p.default!r}")
    if order != sorted(order):
        errors.append(f"{name}: parameters documented out of order")
    if "..." not in items:
        missing = [p.name for p in params if params.index(p) not in order]
        if missing:
            errors.append(f"{name}: {missing} not documented (and no '...')")
    return errors


def test_documented_signatures_are_the_real_ones():
    sigs = documented_signatures(TEXT)
    missing = set(SIGNED) - {n for n, _ in sigs}
    assert not missing, f"docs/blocks.md has no signature of {sorted(missing)}"
    errors = [e for n, items in sigs for e in _check_signature(n, items)]
    assert not errors, "\n".join(errors)
    for full in ("Block", "Stack"):  # every option of these two is on the page
        assert any(n == full and "..." not in items for n, items in sigs), full


def test_the_signature_check_can_fail():
    bad = """`Block(d_model, n_heads, d_ff=8, *, placement="post", ...)` `Stack(n_layers, seed=0, ...)`
    `Adam(lr, ...)` `Linear(in_features, out_features, bias=True)` `Norm(kind, d, ...)`"""
    errors = [e for n, items in documented_signatures(bad) for e in _check_signature(n, items)]
    for word in ("d_ff=8", "placement=", "'seed'", "lr documented without", "not documented", "out of order"):
        assert any(word in e for e in errors), (word, errors)


# ---------------------------------------------------------------------------------------------
# docs/blocks.md: the parameter-name tables

SIZES = {"d": 12, "d_k": 4, "f": 20, "m": 2, "vocab": 7, "seq_len": 5}
N_HEADS = 3


def _table(marker: str) -> list[list[str]]:
    lines = TEXT.split(f"<!-- parameter-table: {marker} -->\n", 1)[1].splitlines()
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    assert len(rows) > 2, marker
    return rows[2:]  # past the header and the |---| line


def _shape(expr: str, n: int | None = None) -> tuple[int, ...]:
    return tuple(eval(expr, {"__builtins__": {}}, {**SIZES, "n": n}))  # the page's own text


def _norm_table() -> dict[tuple[str, str | None], dict[str, str]]:
    """``{(kind, modality_kind or None): {key: shape expression}}`` from the page's norm table."""
    out = {}
    for kind_cell, params_cell in _table("norm"):
        spans = re.findall(r"`([^`]+)`", kind_cell)
        sub = None
        if len(spans) > 1:
            m = re.fullmatch(r'modality_kind="(\w+)"', spans[1])
            assert m, kind_cell
            sub = m.group(1)
        keys = {}
        for s in re.findall(r"`([^`]+)`", params_cell):
            m = re.fullmatch(r"(\w+) (\(.*\))", s)
            assert m, params_cell
            keys[m.group(1)] = m.group(2)
        out[(spans[0].strip('"'), sub)] = keys
    return out


CONDITIONS = {
    "always": lambda c: True,
    "`learnable_alpha=True`": lambda c: c["learnable_alpha"],
    '`qk_norm` is not None, or `placement="hybrid"`': lambda c: c["qk_norm"] is not None or c["placement"] == "hybrid",
    '`v_norm=True` or `placement="hybrid"`': lambda c: c.get("v_norm", False) or c["placement"] == "hybrid",
    "`io_norms=True`": lambda c: c["io_norms"],
    '`placement` is `"pre"`, `"post"`, `"deepnorm"` or `"layer_norm_scaling"`': lambda c: (
        c["placement"] in ("pre", "post", "deepnorm", "layer_norm_scaling")
    ),
    '`placement` is `"pre"`, `"post"`, `"deepnorm"`, `"layer_norm_scaling"` or `"hybrid"`': lambda c: (
        c["placement"] in ("pre", "post", "deepnorm", "layer_norm_scaling", "hybrid")
    ),
    '`placement` is `"sandwich"` or `"peri"`': lambda c: c["placement"] in ("sandwich", "peri"),
    '`input_norm=True`; None means `placement="peri"`': lambda c: (
        c["placement"] == "peri" if c.get("input_norm") is None else c["input_norm"]
    ),
    '`final_norm=True`; None means the top block\'s placement is `"pre"`, `"sandwich"`, `"peri"` or '
    '`"layer_norm_scaling"`': lambda c: (
        _top(c) in ("pre", "sandwich", "peri", "layer_norm_scaling") if c["final_norm"] is None else c["final_norm"]
    ),
}


def _top(c: dict[str, Any]) -> str:
    """The placement of a stack's top block (Mix-LN's: Post-LN only if every block is)."""
    if c["placement"] != "mix":
        return str(c["placement"])
    return "post" if int(np.floor(c.get("mix_alpha", 0.25) * c["n_layers"] + 1e-9)) >= c["n_layers"] else "pre"


def _kind(var: str, c: dict[str, Any]) -> tuple[str, str | None]:
    """The (kind, modality_kind) of a norm the table names by argument -- the defaults as the page states them."""
    if var == "qk_norm":  # HybridNorm's QKV-norm: RMSNorm for norm="rms", else LayerNorm, unless qk_norm says
        default = ("rms" if c["norm"] == "rms" else "layer") if c["placement"] == "hybrid" else None
        return c["qk_norm"] or default, None
    if var == "io_norm_kind":
        k = c["io_norm_kind"] or (c["modality_kind"] if c["norm"] == "modality" else c["norm"])
        return k, None
    assert var == "norm", var
    return c["norm"], c["modality_kind"] if c["norm"] == "modality" else None


def expected_names(marker: str, c: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """What table ``marker`` says the named parameters of a module built with options ``c`` are."""
    norms, out = _norm_table(), {}
    for names_cell, shape_cell, cond in _table(marker):
        assert cond in CONDITIONS, f"docs/blocks.md: unknown condition {cond!r} (add it to CONDITIONS)"
        if not CONDITIONS[cond](c):
            continue
        composite = re.fullmatch(r"`([\w.<>]+)` \+ an? (\w+)'s names", names_cell)
        if composite:
            prefix, what = composite.groups()
            if what == "Block":
                for i in range(c["n_layers"]):
                    sub = dict(c)
                    if i < c["hybrid_layers"]:
                        sub |= {"norm": "modality", "modality_kind": c["norm"]}
                    if c["placement"] == "mix":  # Mix-LN: the lowest floor(mix_alpha * n) blocks Post-LN
                        n_post = int(np.floor(c.get("mix_alpha", 0.25) * c["n_layers"] + 1e-9))
                        sub["placement"] = "post" if i < n_post else "pre"
                    out |= {prefix.replace("<i>", str(i)) + k: v for k, v in expected_names("Block", sub).items()}
            else:
                out |= {prefix + k: v for k, v in expected_names(what, c).items()}
            continue
        names = re.findall(r"`([^`]+)`", names_cell)
        norm = re.fullmatch(r"an? `(\w+)` norm over `(\w+)`", shape_cell)
        for name in names:
            if norm:
                assert name.endswith(".norm.*"), name
                width = SIZES[norm.group(2)]
                for key, shp in norms[_kind(norm.group(1), c)].items():
                    out[name[:-1] + key] = _shape(shp, width)
            else:
                out[name] = _shape(shape_cell.strip("`"))
    return out


def _actual(m: Any) -> dict[str, tuple[int, ...]]:
    return {n: tuple(o.params[k].shape) for n, o, k in m.named_parameters()}


BASE = {"norm": "layer", "modality_kind": "layer", "qk_norm": None, "io_norms": False, "io_norm_kind": None,
        "learnable_alpha": False, "final_norm": None, "hybrid_layers": 0}  # fmt: skip
NORMS = [("layer", "layer"), ("rms", "layer"), ("scale", "layer"), ("dyt", "layer"), ("derf", "layer"),
         ("modality", "layer"), ("modality", "rms")]  # fmt: skip


def _block(c: dict[str, Any]) -> Block:
    opts = {k: c[k] for k in ("placement", "norm", "modality_kind", "qk_norm", "io_norms", "io_norm_kind",
                              "learnable_alpha")}  # fmt: skip
    dn = {"n_layers": 4} if c["placement"] == "deepnorm" else {}
    return Block(SIZES["d"], N_HEADS, SIZES["f"], n_modalities=SIZES["m"], **opts, **dn)


@pytest.mark.parametrize("placement", ["pre", "post", "sandwich", "deepnorm", "layer_norm_scaling", "peri", "hybrid"])
def test_block_parameter_names_are_the_documented_ones(placement):
    io = [(False, None), (True, None), (True, "scale")]
    alphas = [False, True] if placement == "deepnorm" else [False]
    for (norm, mk), qk, (ion, iok), la in itertools.product(NORMS, [None, "layer", "rms"], io, alphas):
        c = BASE | {"placement": placement, "norm": norm, "modality_kind": mk, "qk_norm": qk, "io_norms": ion,
                    "io_norm_kind": iok, "learnable_alpha": la}  # fmt: skip
        assert _actual(_block(c)) == expected_names("Block", c), c


@pytest.mark.parametrize(
    "opts",
    [
        {"placement": "pre"},
        {"placement": "post", "norm": "rms", "final_norm": True, "qk_norm": "layer"},
        {"placement": "sandwich", "norm": "rms", "hybrid_layers": 1, "io_norms": True},
        {"placement": "deepnorm", "norm": "modality", "modality_kind": "rms", "learnable_alpha": True},
        {"placement": "pre", "norm": "dyt", "final_norm": False, "io_norms": True, "io_norm_kind": "layer"},
        {"placement": "mix", "mix_alpha": 0.5, "norm": "derf"},
        {"placement": "mix", "mix_alpha": 1.0},
        {"placement": "peri", "norm": "rms"},
        {"placement": "hybrid", "input_norm": True},
    ],
)
def test_stack_and_model_parameter_names_are_the_documented_ones(opts):
    c = BASE | {"n_layers": 2} | opts
    kw = {k: v for k, v in opts.items()} | {"n_modalities": SIZES["m"]}
    st = Stack(2, SIZES["d"], N_HEADS, SIZES["f"], **kw)
    assert _actual(st) == expected_names("Stack", c)
    model = SequenceModel(SIZES["vocab"], SIZES["seq_len"], 2, SIZES["d"], N_HEADS, SIZES["f"], **kw)
    assert _actual(model) == expected_names("SequenceModel", c)


def test_the_pages_parameter_example():
    names = _actual(Stack(2, 64, 4, norm="rms", qk_norm="rms"))
    assert {"layers.0.attn.q.W", "layers.1.norm2.norm.weight", "final_norm.norm.weight"} <= set(names)
    assert names["layers.0.attn.q_norm.norm.weight"] == (16,)
    assert not any(n.endswith("norm.bias") for n in names)
    assert "`layers.0.attn.q_norm.norm.weight` (shape `(16,)`)" in TEXT
