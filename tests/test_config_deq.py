"""The ``deq`` setting parsed once (src.deq.config): one typed value, every family's depth rule in one table."""

import pytest
from omegaconf import OmegaConf

from src.config.family_data import family_of
from src.deq.config import DEPTH_RULES, DEQConfig, check_block, deq_setting, resolve_depth


def test_deq_setting_is_a_deq_config_or_none():
    on = deq_setting(OmegaConf.create({"enabled": True, "solver": "anderson", "injection": "softplus"}))
    assert isinstance(on, DEQConfig) and on.solver == "anderson" and on.injection == "softplus"
    assert deq_setting({"enabled": False, "solver": "anderson"}) is None
    assert deq_setting(None) is None and deq_setting(on) is on  # idempotent
    with pytest.raises(ValueError, match="deq.solver='newton' is unknown"):
        deq_setting({"enabled": True, "solver": "newton"})
    assert deq_setting({"enabled": False, "solver": "newton"}) is None  # explicit layers ignore the solver keys
    with pytest.raises(ValueError, match="deq config group"):
        deq_setting(True)
    assert deq_setting({"enabled": False, "tol": 1e-3}, enabled=True).tol == 1e-3  # a DEQ by the family's choice


@pytest.mark.parametrize(("family", "explicit", "deq"), [("dkef", 3, 1), ("nice", 5, 1), ("vae", 0, 1), ("ncsn", 1, 1)])
def test_depth_defaults_per_family(family, explicit, deq):
    assert resolve_depth(family, None, None) == explicit
    assert resolve_depth(family, None, DEQConfig()) == deq


def test_depth_rules_refuse_what_the_family_cannot_build():
    with pytest.raises(ValueError, match="depth=2 with deq=true"):
        resolve_depth("ncsn", 2, DEQConfig())
    with pytest.raises(ValueError, match="one layer inside f"):
        resolve_depth("vae", 8, DEQConfig())
    assert resolve_depth("nice", 4, DEQConfig()) == 4 and resolve_depth("vae", 0, None) == 0
    with pytest.raises(ValueError, match=">= 1"):
        resolve_depth("ncsn", 0, None)
    assert set(DEPTH_RULES) >= {"dkef", "nice", "vae", "ncsn"}


def test_family_of_a_run_config():
    assert family_of({"model": {"_target_": "src.lit.nice.NICEModule"}}) == "nice"
    assert family_of({"model": {"_target_": "src.lit.dkef.DKEFModule"}}) == "dkef"
    assert family_of({"model": {}}) is None


def test_the_deq_enable_flag_is_read_in_one_place():
    """Acceptance of issue #39: ``enabled`` of the deq group is read only by deq_setting (src/deq/config.py)."""
    import re
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "src"
    readers = []
    for path in src.rglob("*.py"):
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if re.search(r"""(get\(|\[)["']enabled["']""", line):
                readers.append(f"{path.relative_to(src)}:{i}")
    assert [r.split(":")[0] for r in readers] == ["deq/config.py"], readers


def test_the_deq_setting_is_parsed_where_the_module_is_built_and_nowhere_below():
    """Issue 49: the setting is parsed in src/deq/config.py (its home) and called once, where a LightningModule is
    built (src/lit/base.py); every network takes the typed value."""
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "src"
    callers = sorted(str(p.relative_to(src)) for p in src.rglob("*.py") if "deq_setting(" in p.read_text())
    assert callers == ["deq/config.py", "lit/base.py"], callers


def test_a_family_refuses_another_familys_block_and_one_pass_needs_a_deq():
    """Issue 49: deq_setting with the family refuses what it cannot build, in one line."""
    ncsn = deq_setting({"enabled": True, "block": "normalized_residual"}, "ncsn")
    assert ncsn.block == "normalized_residual" and deq_setting(ncsn, "ncsn") is ncsn
    check_block("ncsn", "normalized_residual")  # no error
    # the family is checked before the other keys: with the family's own norm set (model=dkef's spectral default)
    # the message is about the block, not about norm not applying to it
    with pytest.raises(ValueError, match=r"^deq.block=normalized_residual is a block of model=ncsn only: model=dkef"):
        deq_setting({"enabled": True, "block": "normalized_residual", "norm": "spectral", "norm_lambda": 2.0}, "dkef")
    for family in ("dkef", "nice", "vae", "supervised"):
        with pytest.raises(ValueError) as info:
            deq_setting({"enabled": True, "block": "normalized_residual"}, family)
        assert str(info.value) == (f"deq.block=normalized_residual is a block of model=ncsn only: model={family} "
                                   "has its own DEQ block, so drop deq.block (or set deq.block=null)")
        with pytest.raises(ValueError, match=f"model={family} has its own DEQ block"):
            deq_setting(DEQConfig(block="normalized_residual"), family)
    assert deq_setting({"enabled": True, "block": None}, "dkef").block is None
    assert deq_setting({"enabled": True, "block": "normalized_residual"}).block == "normalized_residual"  # no family
    with pytest.raises(ValueError, match=r"^deq.one_pass=true needs deq=true: .*drop deq.one_pass or use deq=true$"):
        deq_setting({"enabled": False, "one_pass": True})
    assert deq_setting({"enabled": False, "one_pass": False}) is None
    assert deq_setting({"enabled": True, "one_pass": True}, "dkef").one_pass is True
    with pytest.raises(ValueError, match=r"^loss=cp cannot run with deq.backward=implicit"):
        deq_setting({"enabled": True, "backward": "implicit"}, "dkef", loss="cp")
    assert deq_setting({"enabled": False, "backward": "implicit"}, "dkef", loss="cp") is None


def test_the_solver_config_and_yaml_share_one_set_of_defaults():
    """Issue 49: DEQConfig's field defaults are the DEQ defaults' one definition; solve() takes its defaults from
    them and conf/shared/deq_solver.yaml (the keys users see) writes out the same values."""
    import dataclasses
    import inspect
    from pathlib import Path

    from src.deq import solvers

    defaults = {f.name: f.default for f in dataclasses.fields(DEQConfig)}
    assert (defaults["tol"], defaults["stop_mode"], defaults["solver"]) == (1e-4, "rel", "picard")
    yaml = OmegaConf.to_container(OmegaConf.load(Path(__file__).resolve().parents[1] / "conf" / "shared" /
                                                 "deq_solver.yaml"))
    assert yaml == defaults
    for fn in (solvers.solve, solvers.picard, solvers.anderson, solvers.broyden):
        params = inspect.signature(fn).parameters
        for key in ("tol", "max_iter", "stop_mode", "anderson_m", "anderson_beta"):
            if key in params:
                assert params[key].default == defaults[key], (fn.__name__, key)
    assert inspect.signature(solvers.solve).parameters["method"].default == defaults["solver"]
