"""Every command and config key the user documentation names composes.

The README and docs/ are read for ``python -m src.train …`` commands (each composed with Hydra exactly as
written, placeholders such as ``<data dir>`` filled in) and for dotted config keys in backticks
(``model.metrics.exact_sm.test_points``), each of which must exist in at least one composition of the
config groups. A renamed or removed key in the docs fails here, not in a user's terminal.
"""

from __future__ import annotations

import re
import shlex
from functools import lru_cache
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import src  # noqa: F401  (installs src.config.hydra_patch: deq=true as a group choice, as every entry point does)
from tests.conftest import CONF_DIR, compose_train

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
GROUPS = ("model", "data", "loss", "deq", "trainer", "callbacks", "logger", "ema", "eval", "paths")
COMMAND = re.compile(r"python -m src\.train\b(.*)")
KEY = re.compile(r"`\+*((?:" + "|".join(GROUPS) + r")\.[A-Za-z_][\w.]*)[=`]")


def _joined_lines(text: str) -> list[str]:
    """The text's lines with shell continuations (a trailing backslash) joined."""
    return text.replace("\\\n", " ").splitlines()


def _overrides(command_tail: str) -> list[list[str]] | None:
    """The override lists a documented command stands for (one per value of a swept key), or None when the
    command is not one to compose (a sweep over a search space, an unparsable line)."""
    tail = re.split(r"\s#", command_tail, maxsplit=1)[0].split("`", 1)[0]
    tail = re.sub(r"<[^>]*>", "x", tail)  # <data dir>, <time>, ...
    tail = tail.replace("…", "").replace("...", "")
    try:
        tokens = shlex.split(tail)
    except ValueError:
        return None
    base, sweeps = [], []
    for tok in tokens:
        if tok.startswith(("-", "hydra")) or "=" not in tok:
            if tok not in ("-m", "--multirun") and not tok.startswith("hydra") and tok.strip():
                return None  # a flag of another tool, or a pipe: not a plain src.train command
            continue
        if "(" in tok:  # an Optuna search space: the sweeper parses it
            continue
        key, value = tok.split("=", 1)
        if "," in value and not value.startswith("["):
            sweeps.append((key, value.split(",")))
        else:
            base.append(tok)
    runs = [base + [f"{k}={vals[0]}" for k, vals in sweeps]]
    for i, (key, vals) in enumerate(sweeps):
        for v in vals[1:]:
            runs.append(base + [f"{k}={vs[0]}" for j, (k, vs) in enumerate(sweeps) if j != i] + [f"{key}={v}"])
    return runs


def documented_commands() -> list[tuple[str, list[str]]]:
    found = []
    for doc in DOCS:
        for line in _joined_lines(doc.read_text()):
            for m in COMMAND.finditer(line):
                runs = _overrides(m.group(1))
                for overrides in runs or []:
                    found.append((f"{doc.name}: python -m src.train {' '.join(overrides)}", overrides))
    return found


@pytest.mark.parametrize("label,overrides", documented_commands(), ids=lambda v: v if isinstance(v, str) else "")
def test_documented_command_composes(label, overrides):
    cfg = compose_train(overrides)
    OmegaConf.to_container(cfg.model, resolve=False)  # composed: every group option and key exists


def _flat_keys(tree: dict, prefix: str = "") -> set[str]:
    keys = set()
    for key, value in tree.items():
        full = f"{prefix}{key}"
        keys.add(full)
        if isinstance(value, dict):
            keys |= _flat_keys(value, f"{full}.")
    return keys


@lru_cache(maxsize=1)
def known_keys() -> frozenset[str]:
    """Every config key of every option of every group (each group option composed on its own, each NCSN
    ``model/net`` choice, and each experiment), the keys a documented ``group.key`` may name."""
    variants = [[]]
    for group in ("model", "data", "loss", "trainer", "callbacks", "logger", "experiment", "eval"):
        folder = CONF_DIR / group
        if folder.is_dir():
            variants += [[f"{group}={p.stem}"] for p in sorted(folder.glob("*.yaml"))]
    variants += [["deq=true"], ["deq=false"], ["ema=true"]]
    variants += [["model=ncsn", f"model/net={p.stem}"] for p in sorted((CONF_DIR / "model" / "net").glob("*.yaml"))]
    keys: set[str] = set()
    for overrides in variants:
        cfg = compose_train(overrides)
        keys |= {k for k in _flat_keys(OmegaConf.to_container(cfg, resolve=False)) if k.split(".")[0] in GROUPS}
    return frozenset(keys)


def documented_keys() -> list[tuple[str, str]]:
    keys = {(doc.name, m.group(1).rstrip(".")) for doc in DOCS for m in KEY.finditer(doc.read_text())}
    return sorted((doc, key) for doc, key in keys if not key.endswith((".md", ".py", ".yaml", ".json")))  # files


@pytest.mark.parametrize("doc,key", documented_keys())
def test_documented_key_exists(doc, key):
    keys = known_keys()
    # a key under a free-form mapping (e.g. callbacks.<name>.*, model.optimizer.<name>.*) exists when its
    # parent does and the parent is a mapping the user may extend
    assert key in keys or any(key.startswith(f"{k}.") for k in keys if k.endswith(("optimizer", "ais"))), (
        f"{doc} names config key `{key}`, which no composition of the config groups has")
