"""``python -m pynorm demo``: residual placements on deep stacks -- gradients at initialisation and training.

For each placement (Post-LN, Pre-LN, Sandwich, DeepNorm, LayerNorm Scaling, Mix-LN, and a norm-free Pre-LN stack
whose every norm is DyT) and depth, the demo

1. measures the gradient norm of every block's parameters at initialisation (one batch, one
   forward and backward through :class:`pynorm.blocks.SequenceModel`);
2. trains the model with Adam (no warmup, no clipping) on the synthetic *sort* task (the target at
   position ``i`` is the ``i``-th smallest input token) and records the loss of every step; a run is
   *diverged* when its loss becomes NaN/inf or exceeds twice the chance level;
3. checks common claims about placement and depth against the numbers (Post-LN's gradients grow toward
   the top at initialisation and Pre-LN's stay level: Xiong et al. 2020, "On Layer Normalization in the
   Transformer Architecture"; deep Post-LN fails to train and DeepNorm fixes it: Wang et al. 2022, "DeepNet:
   Scaling Transformers to 1,000 Layers", and Liu et al. 2020, "Understanding the Difficulty of Training
   Transformers"; shallow Post-LN trains: Vaswani et al. 2017, "Attention Is All You Need"; LayerNorm Scaling
   keeps the deep blocks' gradients from shrinking: Sun et al. 2025, "The Curse of Depth in Large Language
   Models"; Mix-LN's gradients are more uniform across depth: Li, Yin & Liu 2025, "Mix-LN"; DyT trains where
   LayerNorm does: Zhu et al. 2025, "Transformers without Normalization") and says which the run shows and which
   it does not, with the criterion;
4. writes ``demo.json`` (every number), ``demo.png`` (matplotlib, if installed: gradient norm per
   layer per placement, loss curves) and prints a table.

``--quick`` runs a smaller grid (< 30 s); ``--full`` trains every placement at every trained depth (by default the
deepest trained depth, 96, trains only the placements its claims compare: Post-LN, Pre-LN, DeepNorm); ``--help``
lists the knobs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

import pynorm
from pynorm.blocks import Adam, SequenceModel, cross_entropy, sort_task, train_step

#: the demo's stacks: a Stack placement each, but "dyt" -- a Pre-LN stack whose every norm is DyT (norm-free)
PLACEMENTS = ("post", "pre", "sandwich", "deepnorm", "layer_norm_scaling", "mix", "dyt")
LABELS = {
    "post": "Post-LN", "pre": "Pre-LN", "sandwich": "Sandwich", "deepnorm": "DeepNorm",
    "layer_norm_scaling": "LN-Scaling", "mix": "Mix-LN", "dyt": "DyT (Pre)",
}  # fmt: skip
#: the placements trained at depths above :attr:`Config.all_up_to` (those the deep-training claims compare)
DEEP_TRAINED = ("post", "pre", "deepnorm")


@dataclass
class Config:
    init_depths: tuple[int, ...] = (6, 24, 96, 384)
    train_steps: dict[int, int] = field(default_factory=lambda: {6: 300, 24: 100, 96: 60})
    d_model: int = 32
    n_heads: int = 4
    d_ff: int = 64
    vocab: int = 16
    seq_len: int = 8
    batch: int = 16
    lr: float = 1e-3
    norm: str = "layer"
    seed: int = 0
    #: every placement trains at depths up to this one; deeper, only :data:`DEEP_TRAINED` (``--full``: all)
    all_up_to: int = 24

    def trains(self, placement: str, depth: int) -> bool:
        """Whether ``placement`` is trained at ``depth`` (a depth of :attr:`train_steps`)."""
        return depth in self.train_steps and (depth <= self.all_up_to or placement in DEEP_TRAINED)


QUICK = Config(init_depths=(6, 24, 96), train_steps={6: 80, 24: 40})


def pick_backend(requested: str, quick: bool) -> tuple[str, str]:
    """The backend to run on and why: ``auto`` is cupy where a GPU is usable, else numba, else numpy."""
    avail = {b.name: b.available for b in pynorm.list_backends()}
    if requested != "auto":
        if not avail.get(requested, False):
            raise SystemExit(
                f"backend {requested!r} is not available here: {pynorm._registry.unavailable_reason(requested)}"
            )
        return requested, "requested"
    if avail.get("cupy"):
        try:
            import cupy

            if cupy.cuda.runtime.getDeviceCount() > 0:
                return "cupy", "a CUDA device is available"
        except Exception:  # no device, no driver: fall through
            pass
    if avail.get("numba"):
        return "numba", "the fastest CPU backend; its first run compiles its kernels (about 25 s), cached after"
    return "numpy", "numba is not installed (pip install 'pynorm[numba]')"


def _model(cfg: Config, placement: str, depth: int, backend: str) -> SequenceModel:
    pl, norm = ("pre", "dyt") if placement == "dyt" else (placement, cfg.norm)
    return SequenceModel(
        cfg.vocab, cfg.seq_len, depth, cfg.d_model, cfg.n_heads, cfg.d_ff, placement=pl, norm=norm, rng=cfg.seed,
        backend=backend,
    )  # fmt: skip


def _to_host(a: Any) -> Any:
    return a.get() if hasattr(a, "get") else a


def run(cfg: Config, backend: str, progress: Any = None) -> dict[str, Any]:
    """Run the grid; returns every number (the JSON's content)."""
    rng = np.random.default_rng(cfg.seed + 1)
    init_tokens, init_targets = sort_task(rng, cfg.batch, cfg.seq_len, cfg.vocab)
    out: dict[str, Any] = {"init": {}, "train": {}}
    for depth in cfg.init_depths:
        for pl in PLACEMENTS:
            m = _model(cfg, pl, depth, backend)
            t0 = time.perf_counter()
            logits, ctx = m.forward(m.xp.asarray(init_tokens))
            loss, dl = cross_entropy(logits, m.xp.asarray(init_targets), m.xp)
            m.backward(dl, ctx)
            g = m.stack.layer_grad_norms()
            out["init"][f"{pl}/{depth}"] = {
                "placement": pl, "depth": depth, "loss": loss, "grad_norm": g, "seconds": time.perf_counter() - t0,
            }  # fmt: skip
            if progress is not None:
                progress(depth, f"init {LABELS[pl]} L={depth}")
    chance = math.log(cfg.vocab)
    for depth, steps in cfg.train_steps.items():
        for pl in PLACEMENTS:
            if not cfg.trains(pl, depth):
                continue
            m = _model(cfg, pl, depth, backend)
            opt = Adam(cfg.lr)
            drng = np.random.default_rng(cfg.seed + 2)  # the same batches for every placement
            losses: list[float] = []
            diverged_at = None
            t0 = time.perf_counter()
            for step in range(steps):
                tok, tgt = sort_task(drng, cfg.batch, cfg.seq_len, cfg.vocab)
                r = train_step(m, m.xp.asarray(tok), tgt, opt)
                losses.append(r.loss)
                if progress is not None:
                    progress(depth, f"train {LABELS[pl]} L={depth}")
                if not math.isfinite(r.loss) or r.loss > 2 * chance:
                    diverged_at = step
                    if progress is not None:
                        progress(depth * (steps - step - 1), f"train {LABELS[pl]} L={depth}")
                    break
            seconds = time.perf_counter() - t0
            # held-out accuracy: the share of positions whose argmax is the sorted token
            tok, tgt = sort_task(np.random.default_rng(cfg.seed + 3), 64, cfg.seq_len, cfg.vocab)
            logits, _ = m.forward(m.xp.asarray(tok), checkpoint=True)  # keeps only the blocks' inputs
            pred = np.asarray(_to_host(logits)).argmax(axis=-1)
            acc = float(np.mean(pred == tgt)) if diverged_at is None else float("nan")
            tail = losses[-min(20, len(losses)) :]
            out["train"][f"{pl}/{depth}"] = {
                "placement": pl, "depth": depth, "steps": len(losses), "losses": losses,
                "final_loss": float(np.mean(tail)), "accuracy": acc, "diverged_at": diverged_at,
                "seconds": seconds, "grad_norm_per_step": m.stack.history["grad_norm"],
                "update_norm_per_step": m.stack.history["update_norm"],
            }  # fmt: skip
    return out


def _clean(o: Any) -> Any:
    """``o`` with NaN and infinities replaced by None (strict JSON)."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, dict):
        return {k: _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    return o


def _ratio(g: list[float]) -> float:
    """Mean gradient norm of the top quarter of the blocks over that of the bottom quarter."""
    q = max(1, len(g) // 4)
    return float(np.mean(g[-q:]) / max(np.mean(g[:q]), 1e-300))


def _spread(g: list[float]) -> float:
    return float(max(g) / max(min(g), 1e-300))


#: where each claim comes from
SOURCES = {
    "post_top": "Xiong et al. 2020",
    "pre_level": "Xiong et al. 2020",
    "post_deep": "Wang et al. 2022; Liu et al. 2020",
    "deepnorm": "Wang et al. 2022",
    "post_shallow": "Vaswani et al. 2017",
    "lns": "Sun et al. 2025, arXiv 2502.05795",
    "mix": "Li, Yin & Liu 2025, arXiv 2412.13795",
    "dyt": "Zhu et al. 2025, arXiv 2503.10622",
}


def claims(cfg: Config, res: dict[str, Any]) -> list[dict[str, Any]]:
    """The claims (:data:`SOURCES`), each with the paper it comes from, the run's evidence and whether the run
    shows it."""
    out = []
    init = res["init"]
    for depth in cfg.init_depths:
        post, pre = init[f"post/{depth}"]["grad_norm"], init[f"pre/{depth}"]["grad_norm"]
        rp, rq = _ratio(post), _ratio(pre)
        out.append({
            "claim": f"Post-LN's gradients concentrate at the top at init (L={depth})",
            "source": SOURCES["post_top"],
            "evidence": f"top/bottom quarter gradient norm: Post-LN {rp:.2f}, Pre-LN {rq:.2f}",
            "shown": bool(rp > 1.5 and rp > 1.5 * rq),
        })  # fmt: skip
        out.append({
            "claim": f"Pre-LN's per-layer gradient norms are about equal (L={depth})",
            "source": SOURCES["pre_level"],
            "evidence": f"max/min over layers: Pre-LN {_spread(pre):.2f}, Post-LN {_spread(post):.2f}",
            "shown": bool(_spread(pre) < 2.0),
        })  # fmt: skip
    train = res["train"]
    deepest = max(cfg.train_steps) if cfg.train_steps else None
    if deepest is not None:
        chance = math.log(cfg.vocab)
        p, d, q = (train[f"{k}/{deepest}"] for k in ("post", "deepnorm", "pre"))

        def desc(r: dict[str, Any]) -> str:
            if r["diverged_at"] is not None:
                return f"diverged at step {r['diverged_at']}"
            return f"loss {r['final_loss']:.3f}"

        post_fails = p["diverged_at"] is not None or p["final_loss"] > 0.9 * chance
        out.append({
            "claim": f"Post-LN fails to train at depth (L={deepest}, {cfg.train_steps[deepest]} steps)",
            "source": SOURCES["post_deep"],
            "evidence": f"Post-LN {desc(p)} (chance {chance:.3f}); Pre-LN {desc(q)}",
            "shown": bool(post_fails),
        })  # fmt: skip
        dn_ok = d["diverged_at"] is None and d["final_loss"] < 0.9 * chance
        better = p["diverged_at"] is not None or d["final_loss"] < p["final_loss"] - 0.05
        out.append({
            "claim": f"DeepNorm trains the deep Post-LN stack (L={deepest})",
            "source": SOURCES["deepnorm"],
            "evidence": f"DeepNorm {desc(d)}; Post-LN {desc(p)}",
            "shown": bool(dn_ok and better),
        })  # fmt: skip
        shallow = min(cfg.train_steps)
        ps, qs = train[f"post/{shallow}"], train[f"pre/{shallow}"]
        out.append({
            "claim": f"Post-LN trains fine when shallow (L={shallow})",
            "source": SOURCES["post_shallow"],
            "evidence": f"Post-LN {desc(ps)}, Pre-LN {desc(qs)} (chance {chance:.3f})",
            "shown": bool(ps["diverged_at"] is None and ps["final_loss"] < 0.9 * chance),
        })  # fmt: skip
    return out + depth_claims(cfg, res)


def depth_claims(cfg: Config, res: dict[str, Any]) -> list[dict[str, Any]]:
    """The 2025 depth studies' claims, each with its criterion in the evidence: at the deepest init depth, LayerNorm
    Scaling's top/bottom gradient ratio above Pre-LN's, and Mix-LN's max/min spread below both Pre-LN's and
    Post-LN's; at every trained depth where the Pre-LN (LayerNorm) stack trains, the DyT stack trains too."""
    out = []
    init, deep = res["init"], max(cfg.init_depths)
    lns, pre, post, mix = (init[f"{k}/{deep}"]["grad_norm"] for k in ("layer_norm_scaling", "pre", "post", "mix"))
    rl, rp = _ratio(lns), _ratio(pre)
    out.append({
        "claim": f"LayerNorm Scaling keeps the deep blocks' gradient norms from shrinking with depth (L={deep})",
        "source": SOURCES["lns"],
        "evidence": f"top/bottom quarter at init: LN-Scaling {rl:.2f}, Pre-LN {rp:.2f} (shown if LN-Scaling's is the "
        "higher)",
        "shown": bool(rl > rp),
    })  # fmt: skip
    sm, sq, sp = _spread(mix), _spread(pre), _spread(post)
    out.append({
        "claim": f"Mix-LN's gradients are more uniform across depth than Pre-LN's and Post-LN's (L={deep})",
        "source": SOURCES["mix"],
        "evidence": f"max/min over blocks at init: Mix-LN {sm:.2f}, Pre-LN {sq:.2f}, Post-LN {sp:.3g} (shown if "
        "Mix-LN's is the smallest)",
        "shown": bool(sm < sq and sm < sp),
    })  # fmt: skip
    chance = math.log(cfg.vocab)
    pairs = [(d, res["train"][f"pre/{d}"], res["train"][f"dyt/{d}"]) for d in cfg.train_steps if cfg.trains("dyt", d)]
    pairs = [(d, q, y) for d, q, y in pairs if q["diverged_at"] is None and q["final_loss"] < 0.9 * chance]
    if pairs:

        def trains(r: dict[str, Any]) -> bool:
            return r["diverged_at"] is None and r["final_loss"] < 0.9 * chance

        ev = "; ".join(
            f"L={d}: LayerNorm {q['final_loss']:.3f}, DyT "
            + (f"diverged at step {y['diverged_at']}" if y["diverged_at"] is not None else f"{y['final_loss']:.3f}")
            for d, q, y in pairs
        )
        out.append({
            "claim": f"DyT trains where LayerNorm trains (Pre-LN stacks, L={', '.join(str(d) for d, _, _ in pairs)})",
            "source": SOURCES["dyt"],
            "evidence": f"final loss {ev} (shown if DyT ends below 90% of chance {chance:.3f} wherever LayerNorm "
            "does)",
            "shown": bool(all(trains(y) for _, _, y in pairs)),
        })  # fmt: skip
    return out


def status(t: dict[str, Any], chance: float) -> str:
    """``ok``, ``stuck near chance`` (final loss above 90% of chance level) or ``DIVERGED at step k``."""
    if t["diverged_at"] is not None:
        return f"DIVERGED at step {t['diverged_at']}"
    return "stuck near chance" if t["final_loss"] > 0.9 * chance else "ok"


def table(cfg: Config, res: dict[str, Any]) -> str:
    """The console table: one row per (depth, placement)."""
    cols = ("depth", "placement", "grad top/bot", "grad max/min", "steps", "loss start", "loss end", "acc")
    widths = (5, 10, 12, 12, 5, 10, 9, 6)
    head = "  ".join(f"{c:>{w}s}" if i != 1 else f"{c:{w}s}" for i, (c, w) in enumerate(zip(cols, widths)))
    lines = [head + "  status", "-" * (len(head) + 20)]
    chance = math.log(cfg.vocab)
    for depth in cfg.init_depths:
        for pl in PLACEMENTS:
            g = res["init"][f"{pl}/{depth}"]["grad_norm"]
            cells = [f"{depth:5d}", f"{LABELS[pl]:10s}", f"{_ratio(g):12.2f}", f"{_spread(g):12.2f}"]
            t = res["train"].get(f"{pl}/{depth}")
            if t is None:
                cells += [f"{'-':>5s}", f"{'-':>10s}", f"{'-':>9s}", f"{'-':>6s}", "gradients at init only"]
            else:
                acc = f"{t['accuracy']:6.1%}" if math.isfinite(t["accuracy"]) else f"{'-':>6s}"
                start = float(np.mean(t["losses"][:10]))
                cells += [f"{t['steps']:5d}", f"{start:10.3f}", f"{t['final_loss']:9.3f}", acc, status(t, chance)]
            lines.append("  ".join(cells))
    return "\n".join(lines)


def plot(
    cfg: Config, res: dict[str, Any], path: str, cl: list[dict[str, Any]] | None = None, backend: str = ""
) -> bool:
    """The figure: gradient norm per block at initialisation (top row, one panel per depth), training loss
    (bottom row, one panel per trained depth) and the claims with what this run says of them (last panel)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    depths = list(cfg.init_depths)
    tdepths = list(cfg.train_steps)
    ncol = max(len(depths), len(tdepths) + 1)
    fig = plt.figure(figsize=(4.2 * ncol, 9.4), layout="constrained")
    fig.suptitle(
        f"Residual placement and depth (d_model {cfg.d_model}, {cfg.norm} norm but the DyT stack, backend "
        f"{backend or '?'})",
        fontsize=13,
    )
    top, bottom = np.asarray(fig.subfigures(2, 1, height_ratios=(1.0, 1.15))).ravel()
    for j, (ax, depth) in enumerate(zip(np.atleast_1d(top.subplots(1, len(depths))), depths, strict=True)):
        for pl in PLACEMENTS:
            g = res["init"][f"{pl}/{depth}"]["grad_norm"]
            ax.plot(np.arange(1, depth + 1), g, label=LABELS[pl], **STYLES[pl])
        ax.set_yscale("log")
        ax.set_title(f"gradient norm per block at init, L={depth}", fontsize=10)
        ax.set_xlabel("block (1 = bottom)")
        if j == 0:
            ax.set_ylabel("||dL/dθ_block||")
    handles, labels = np.atleast_1d(top.axes)[0].get_legend_handles_labels()
    top.legend(handles, labels, loc="outside lower center", ncol=len(PLACEMENTS), fontsize=9, frameon=False)
    chance = math.log(cfg.vocab)
    axes = np.atleast_1d(bottom.subplots(1, len(tdepths) + 1, width_ratios=[1.0] * len(tdepths) + [2.2]))
    for j, (ax, depth) in enumerate(zip(axes[:-1], tdepths, strict=True)):
        for pl in PLACEMENTS:
            t = res["train"].get(f"{pl}/{depth}")
            if t is None:
                continue
            ls = np.asarray(t["losses"], dtype=float)
            k = 10
            sm = np.convolve(ls, np.ones(k) / k, mode="valid") if len(ls) >= k else ls
            lab = LABELS[pl] + (f" (diverged @ {t['diverged_at']})" if t["diverged_at"] is not None else "")
            ax.plot(np.arange(len(sm)) + (len(ls) - len(sm)), sm, label=lab, **STYLES[pl])
        ax.axhline(chance, color="gray", ls=":", lw=1, label="chance")
        ax.set_title(f"training loss (sort task), L={depth}", fontsize=10)
        ax.set_xlabel("Adam step")
        if j == 0:
            ax.set_ylabel("cross-entropy (10-step mean)")
        ax.legend(fontsize=7)
    _claims_panel(axes[-1], cl or [])
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


#: each stack's line in the figure (a color each; the norm-free DyT stack dashed)
STYLES: dict[str, dict[str, Any]] = {
    "post": {"color": "tab:red", "lw": 1.2},
    "pre": {"color": "tab:blue", "lw": 1.2},
    "sandwich": {"color": "tab:green", "lw": 1.2},
    "deepnorm": {"color": "tab:purple", "lw": 1.2},
    "layer_norm_scaling": {"color": "tab:orange", "lw": 1.2},
    "mix": {"color": "tab:brown", "lw": 1.2},
    "dyt": {"color": "black", "lw": 1.0, "ls": "--"},
}


def _claims_panel(ax: Any, cl: list[dict[str, Any]]) -> None:
    import textwrap

    ax.axis("off")
    ax.set_title("what this run shows", fontsize=10)
    y = 0.99
    for c in cl:
        mark, color = ("SHOWN", "tab:green") if c["shown"] else ("NOT SHOWN", "tab:red")
        ax.text(0.0, y, mark, color=color, fontsize=7, fontweight="bold", va="top", transform=ax.transAxes)
        body = textwrap.fill(f"{c['claim']} -- {c['source']}", 92)
        ax.text(0.15, y, body, fontsize=7, va="top", transform=ax.transAxes)
        y -= 0.036 * (body.count("\n") + 1) + 0.016


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.bar: Any = None
        self.done = 0
        self.total = total
        self.enabled = enabled
        self.last = 0.0
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, unit="block-step", file=sys.stderr, dynamic_ncols=True, mininterval=0.5,
                                disable=None)  # fmt: skip  # None: off when stderr is not a terminal
            except ImportError:
                self.bar = None

    def __call__(self, n: int, desc: str) -> None:
        self.done += n
        if self.bar is not None:
            self.bar.set_description(desc, refresh=False)
            self.bar.update(n)
        elif self.enabled and time.perf_counter() - self.last > 2.0:
            self.last = time.perf_counter()
            print(f"  [{100 * self.done / max(self.total, 1):5.1f}%] {desc}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def main(argv: list[str] | None = None) -> int:
    """``python -m pynorm demo [options]``; returns the exit status. The numba thread cap the demo sets for its tiny
    arrays (``--threads``) is put back as it was when it returns: a caller's later calls keep their threads."""
    from .backends.numba import _threads

    cap = _threads._cap
    try:
        return _main(argv)
    finally:
        if _threads._cap != cap:
            _threads.set_num_threads(cap)


def _main(argv: list[str] | None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pynorm demo", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a small grid: depths 6, 24, 96 at init, training at 6 and 24")
    ap.add_argument("--full", action="store_true", help="train every placement at every trained depth (slower)")
    ap.add_argument("--backend", default="auto", help="numpy, numba, cupy or auto (default)")
    ap.add_argument("--out", default="pynorm-demo", help="folder for demo.json and demo.png (default ./pynorm-demo)")
    ap.add_argument("--depths", type=lambda s: tuple(int(v) for v in s.split(",")), help="depths measured at init")
    ap.add_argument(
        "--train", type=lambda s: {int(a): int(b) for a, b in (p.split(":") for p in s.split(","))},
        help="depth:steps pairs to train, e.g. 6:300,24:100,96:60",
    )  # fmt: skip
    ap.add_argument("--lr", type=float)
    ap.add_argument("--width", type=int, help="d_model (d_ff = 2 * width, 4 heads)")
    ap.add_argument("--norm", choices=["layer", "rms", "scale", "dyt", "derf"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="numba threads (default 1: the arrays are tiny)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    cfg = Config(**{k: v for k, v in asdict(QUICK if args.quick else Config()).items()})
    if args.depths:
        cfg.init_depths = args.depths
    if args.train is not None:
        cfg.train_steps = args.train
    cfg.init_depths = tuple(sorted(set(cfg.init_depths) | set(cfg.train_steps)))
    if args.lr:
        cfg.lr = args.lr
    if args.width:
        cfg.d_model, cfg.d_ff = args.width, 2 * args.width
    if args.norm:
        cfg.norm = args.norm
    if args.full:
        cfg.all_up_to = max(cfg.train_steps, default=0)
    cfg.seed = args.seed
    backend, why = pick_backend(args.backend, args.quick)
    if backend == "numba" and not args.threads:
        # the demo's arrays are tiny (128 rows): numba's worker threads would only compete with BLAS's
        pynorm.set_num_threads(1)
        why += "; 1 thread (--threads N for more)"
    elif backend == "numba":
        pynorm.set_num_threads(args.threads)
    t_start = time.perf_counter()
    print(f"pynorm {pynorm.__version__} demo: residual placements on deep stacks (backend {backend}: {why})")
    print(
        f"model: d_model {cfg.d_model}, {cfg.n_heads} heads, d_ff {cfg.d_ff}, {cfg.norm} norm; sort task: "
        f"{cfg.seq_len} tokens of {cfg.vocab}, batch {cfg.batch}; Adam lr {cfg.lr:g}, no warmup, no clipping"
    )
    print(f"gradients at init for depths {', '.join(map(str, cfg.init_depths))}; training "
          + ", ".join(f"L={d} for {s} steps" for d, s in cfg.train_steps.items()))  # fmt: skip
    # warm-up: the backend's first call compiles (numba) or loads its kernels
    t0 = time.perf_counter()
    for pl in ("post", "pre", "dyt"):  # every kernel the runs use (LayerNorm, add + LayerNorm, DyT)
        warm = _model(cfg, pl, 1, backend)
        zeros = np.zeros((2, cfg.seq_len), dtype=np.int64)
        train_step(warm, warm.xp.asarray(zeros), zeros, Adam())
    t_warm = time.perf_counter() - t0
    print(f"backend warm-up (kernel compilation or cache load): {t_warm:.1f} s")
    total = len(PLACEMENTS) * sum(cfg.init_depths) + sum(
        d * s for d, s in cfg.train_steps.items() for pl in PLACEMENTS if cfg.trains(pl, d)
    )
    prog = _Progress(total, not args.no_progress)
    try:
        res = run(cfg, backend, prog)
    finally:
        prog.close()
    cl = claims(cfg, res)
    elapsed = time.perf_counter() - t_start
    os.makedirs(args.out, exist_ok=True)
    jpath, ppath = os.path.join(args.out, "demo.json"), os.path.join(args.out, "demo.png")
    conf: dict[str, Any] = asdict(cfg)
    conf["train_steps"] = {str(k): v for k, v in cfg.train_steps.items()}
    doc = {
        "pynorm": pynorm.__version__, "backend": backend, "backend_reason": why, "config": conf,
        "seconds": {"total": elapsed, "warmup": t_warm}, "results": res, "claims": cl,
    }  # fmt: skip
    with open(jpath, "w") as f:
        json.dump(_clean(doc), f, allow_nan=False)
    print()
    print("grad top/bot: mean gradient norm of the top quarter of the blocks / the bottom quarter, at init;")
    print("grad max/min: largest / smallest block gradient norm; loss start: mean of the first 10 steps,")
    print(f"loss end: mean of the last 20 (chance: log {cfg.vocab} = {math.log(cfg.vocab):.3f});")
    print("acc: share of the positions of 64 held-out sequences sorted right")
    print(table(cfg, res))
    print("\nCommon claims about placement and depth, as this run shows them:")
    for c in cl:
        print(f"  [{'SHOWN' if c['shown'] else 'NOT SHOWN'}] {c['claim']} ({c['source']}): {c['evidence']}")
    not_shown = [c for c in cl if not c["shown"]]
    if not_shown:
        print(f"  {len(not_shown)} claim(s) NOT shown by this run; see docs/blocks.md for how to read them")
    wrote = plot(cfg, res, ppath, cl, backend)
    print(
        f"\nwrote {jpath}"
        + (f" and {ppath}" if wrote else " (no figure: pip install matplotlib, or pip install 'pynorm[demo]')")
    )
    print(f"total {elapsed:.1f} s on backend {backend}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
