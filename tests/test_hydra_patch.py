"""src.config.hydra_patch: why it exists, and that it still works against the installed Hydra.

The patch turns a boolean override value back into a group option name (``deq=true``). These tests fail when
Hydra's behaviour changes either way: if its grammar stops reading ``true`` as a boolean (the patch is then
unnecessary: remove it), or if the private classes it wraps move (the patch would silently stop applying).
"""

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser

import src  # noqa: F401  installs the patch, as every entry point does

CONF = str(Path(__file__).resolve().parents[1] / "conf")


def test_hydra_still_parses_true_as_a_boolean():
    override = OverridesParser.create().parse_overrides(["deq=true"])[0]
    assert override.value() is True, "Hydra now reads deq=true as a string: src/config/hydra_patch.py can go"


def test_the_patched_hydra_internal_is_wrapped():
    from hydra._internal import defaults_list

    assert hasattr(defaults_list.Overrides.__init__, "__wrapped__")


def test_one_private_hydra_class_is_patched_in_src():
    """Issue 49: no second framework over Hydra. Only this module reaches into Hydra's private modules (the Optuna
    sweeper's report is a public Hydra callback, src.reports.optuna_sweep)."""
    import re

    root = Path(__file__).resolve().parents[1] / "src"
    private = sorted(str(p.relative_to(root)) for p in root.rglob("*.py")
                     if re.search(r"hydra\._internal|hydra_plugins\.\w+\._impl", p.read_text()))
    assert private == ["config/hydra_patch.py"], private


@pytest.mark.parametrize(("choice", "enabled"), [("true", True), ("false", False)])
def test_deq_group_choices_compose(choice, enabled):
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("train", overrides=[f"deq={choice}", "deq.solver=anderson", "logger=none"])
    assert cfg.deq.enabled is enabled and cfg.deq.solver == "anderson"


def test_a_plain_boolean_key_stays_boolean():
    with initialize_config_dir(config_dir=CONF, version_base="1.3"):
        cfg = compose("train", overrides=["test=false", "logger=none"])
    assert cfg.test is False
