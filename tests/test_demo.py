"""``python -m pynorm demo``: a tiny run end to end, the claims' logic on made-up results, the CLI dispatch."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from pynorm import __main__ as cli
from pynorm import demo


def test_tiny_demo_run(backend, tmp_path, capsys):
    from pynorm.backends.numba import _threads

    cap = _threads._cap
    rc = demo.main(["--backend", backend.name, "--depths", "2,3", "--train", "2:4", "--width", "8",
                    "--out", str(tmp_path), "--no-progress"])  # fmt: skip
    assert rc == 0
    assert _threads._cap == cap  # the demo's one-thread cap is put back: the caller keeps its threads
    out = capsys.readouterr().out
    assert "Post-LN" in out and "DeepNorm" in out and "claims" in out
    doc = json.loads((tmp_path / "demo.json").read_text())  # strict JSON (no NaN)
    assert doc["backend"] == backend.name
    res = doc["results"]
    for pl in demo.PLACEMENTS:
        assert len(res["init"][f"{pl}/3"]["grad_norm"]) == 3
        assert all(g > 0 for g in res["init"][f"{pl}/2"]["grad_norm"])
        t = res["train"][f"{pl}/2"]
        assert t["steps"] == 4 and len(t["losses"]) == 4
        assert len(t["update_norm_per_step"]) == 4 and len(t["update_norm_per_step"][-1]) == 2
        assert len(t["grad_norm_per_step"]) == 4 and all(len(g) == 2 for g in t["grad_norm_per_step"])
    assert {"claim", "evidence", "shown"} <= set(doc["claims"][0])
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return
    assert (tmp_path / "demo.png").stat().st_size > 10_000


def _fake(
    cfg: demo.Config, post_top: float, post_loss: float, dn_loss: float, post_div: int | None, lns_top: float = 1.0,
    mix_top: float = 1.0, dyt_div: int | None = None,
) -> dict:  # fmt: skip
    res: dict = {"init": {}, "train": {}}
    for d in cfg.init_depths:
        for pl in demo.PLACEMENTS:
            g = [1.0] * d
            top = {"post": post_top, "layer_norm_scaling": lns_top, "mix": mix_top}.get(pl)
            if top is not None:
                g[-max(1, d // 4) :] = [top] * max(1, d // 4)
            if pl == "pre":  # shrinking toward the top, within the "about equal" spread of 2
                g = list(np.linspace(1.5, 1.0, d))
            res["init"][f"{pl}/{d}"] = {"grad_norm": g}
    for d in cfg.train_steps:
        for pl in demo.PLACEMENTS:
            deep = d == max(cfg.train_steps)  # the made-up losses are for the deepest stack; shallow ones train
            loss = {"post": post_loss, "deepnorm": dn_loss}.get(pl, 1.0) if deep else 1.0
            div = {"post": post_div if deep else None, "dyt": dyt_div}.get(pl)
            res["train"][f"{pl}/{d}"] = {"final_loss": loss, "diverged_at": div, "losses": [3.0] * 10, "steps": 10,
                                         "accuracy": 0.5}  # fmt: skip
    return res


def test_claims_follow_the_numbers():
    cfg = demo.Config(init_depths=(4, 8), train_steps={4: 10, 8: 10}, vocab=16)
    chance = math.log(16)
    good = {c["claim"]: c["shown"] for c in demo.claims(cfg, _fake(cfg, 5.0, chance, 1.0, None))}
    assert all(good.values()), good
    bad = {c["claim"]: c["shown"] for c in demo.claims(cfg, _fake(cfg, 1.0, 1.0, 1.0, None))}
    assert not bad["Post-LN's gradients concentrate at the top at init (L=8)"]
    assert not bad["Post-LN fails to train at depth (L=8, 10 steps)"]
    assert not bad["DeepNorm trains the deep Post-LN stack (L=8)"]  # not better than Post-LN
    assert bad["Pre-LN's per-layer gradient norms are about equal (L=8)"]
    diverged = {c["claim"]: c["shown"] for c in demo.claims(cfg, _fake(cfg, 5.0, 1.0, 1.0, 3))}
    assert diverged["Post-LN fails to train at depth (L=8, 10 steps)"]
    assert demo.status({"diverged_at": 3, "final_loss": 9.0}, chance) == "DIVERGED at step 3"
    assert demo.status({"diverged_at": None, "final_loss": chance}, chance) == "stuck near chance"
    assert demo.status({"diverged_at": None, "final_loss": 1.0}, chance) == "ok"


def test_depth_study_claims_follow_the_numbers():
    """LayerNorm Scaling (top/bottom above Pre-LN's), Mix-LN (the smallest spread), DyT (trains where LayerNorm
    trains), each NOT SHOWN when its numbers say otherwise; the criterion is printed with the evidence."""
    cfg = demo.Config(init_depths=(4, 8), train_steps={4: 10, 8: 10}, vocab=16)
    good = {c["claim"]: c for c in demo.depth_claims(cfg, _fake(cfg, 5.0, 1.0, 1.0, None))}
    assert all(c["shown"] for c in good.values()) and len(good) == 3
    assert all("shown if" in c["evidence"] for c in good.values())
    bad = {c["claim"]: c["shown"] for c in demo.depth_claims(cfg, _fake(cfg, 5.0, 1.0, 1.0, None, 0.5, 8.0, 2))}
    assert bad == {
        "LayerNorm Scaling keeps the deep blocks' gradient norms from shrinking with depth (L=8)": False,
        "Mix-LN's gradients are more uniform across depth than Pre-LN's and Post-LN's (L=8)": False,
        "DyT trains where LayerNorm trains (Pre-LN stacks, L=4, 8)": False,
    }
    deep = demo.Config(init_depths=(4, 48), train_steps={4: 10, 48: 10}, vocab=16)
    assert not deep.trains("mix", 48) and deep.trains("post", 48) and deep.trains("mix", 4)


def test_cli_dispatch(monkeypatch, capsys):
    seen = []
    monkeypatch.setattr(demo, "main", lambda argv: seen.append(list(argv)) or 0)
    assert cli.main([]) == 0 and cli.main(["demo", "--quick"]) == 0 and cli.main(["--quick"]) == 0
    assert seen == [[], ["--quick"], ["--quick"]]
    assert cli.main(["backends"]) == 0
    assert "numpy" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["nonsense"])
