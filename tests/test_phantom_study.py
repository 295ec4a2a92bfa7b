"""The App. C command (phantom vs exact implicit derivatives) on a few steps of DEQ-DKEF on Parkinsons."""

from __future__ import annotations

import json

from benchmarks.studies.phantom import main as phantom_main


def test_phantom_study_writes_plots_and_errors_fall_with_k(tmp_path, uci_root):
    out = tmp_path / "phantom"
    summary = phantom_main(["--root", str(uci_root), "--steps", "3", "--every", "1", "--ks", "1,2,4",
                            "--batch-size", "16", "--n-inducing", "8", "--out", str(out)])
    per_k = summary["per_k"]
    rel = [per_k[k]["rel_error"]["mean"] for k in ("1", "2", "4")]
    # Prop. 2: the phantom score error falls geometrically with K (rate ≈ the contraction rate, < 1/λ = 0.5)
    assert rel[0] > 0 and rel[1] < 0.5 * rel[0] and rel[2] < 0.5**2 * rel[1]
    for loss in ("sm", "ssm"):
        assert 0.99 < per_k["2"][f"grad_cos_{loss}"]["min"] <= 1 + 1e-12
        assert per_k["2"][f"grad_cos_{loss}"]["n"] == 3
    saved = json.loads((out / "phantom_summary.json").read_text())
    assert saved["per_k"]["2"]["rel_error"]["n"] == 3 * 8  # 3 comparisons × the 8 loss-half samples
    for png in ("fig5_score_rel_error.png", "fig6_score_cosine.png", "fig7_param_grad_cosine.png"):
        assert (out / png).stat().st_size > 1000
