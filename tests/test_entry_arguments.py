"""The ``key=value`` arguments of ``python -m src.evaluate`` and ``python -m src.sample``
(src/runs/load.py ``split_arguments``): the entry point's own keys apart from the run-config overrides."""

from __future__ import annotations

import pytest

import src.evaluate
import src.sample
from src.runs.load import split_arguments


def test_own_keys_apart_from_overrides():
    own, overrides = split_arguments(["ckpt_path=a/b=c.ckpt", "data.root=/d", "n=8", "trust_checkpoint=true", "n"],
                                     ("ckpt_path", "n", "trust_checkpoint"))
    assert own == {"ckpt_path": "a/b=c.ckpt", "n": "8", "trust_checkpoint": "true"}  # split at the first '='
    assert overrides == ["data.root=/d"]  # a bare own key is neither


def test_entry_points_pass_their_keys_and_overrides(monkeypatch):
    calls = {}
    monkeypatch.setattr(src.evaluate, "evaluate", lambda ckpt, overrides, trust: calls.update(ev=(ckpt, overrides, trust)))
    monkeypatch.setattr(src.sample, "sample_from_checkpoint", lambda ckpt, **kw: calls.update(sample=(ckpt, kw)))
    src.evaluate.main(["ckpt_path=x.ckpt", "eval.name=standard", "trust_checkpoint=true"])
    assert calls["ev"] == ("x.ckpt", ["eval.name=standard"], True)
    src.sample.main(["ckpt_path=y.ckpt", "n=4", "out=s.png", "model.sampling.n_steps_each=2"])
    assert calls["sample"] == ("y.ckpt", {"n": 4, "seed": 0, "out": "s.png",
                                          "overrides": ["model.sampling.n_steps_each=2"], "trust": False})
    with pytest.raises(SystemExit, match=r"^usage: python -m src\.evaluate ckpt_path="):
        src.evaluate.main(["n=3"])
