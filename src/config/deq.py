"""The ``deq`` setting, parsed once, and every model family's depth rule in one table.

``deq=true`` / ``deq=false`` pick the config group ``conf/deq/{true,false}.yaml``: one mapping with ``enabled``
and the solver keys of :class:`src.deq.config.DEQConfig` (paper §3.2–3.4, Alg. 1). :func:`deq_setting` turns it
into the one typed value every model reads — a :class:`~src.deq.config.DEQConfig` (a DEQ block, eq. 5) or
``None`` (explicit layers) — and is the only reader of ``enabled``. It is idempotent (a ``DEQConfig`` or ``None``
passes through), so a LightningModule can keep the plain mapping as a hyper-parameter (a checkpoint stays
weights-only loadable) and hand it to its network, which parses it here.

:data:`DEPTH_RULES` holds what ``depth: null`` means and which depths are valid, per family: the explicit
default (DKEF: the reference Φ_w's 3 dense layers; NICE: the reference coupling MLP's 5; the VAE score
estimator: 0 extra layers, the SSM VAE; NCSN: 1 plain ResBlock standing for the DEQ-ResBlock), and the DEQ
default (1 layer inside f, the paper's) — fixed at 1 where the family's DEQ block has exactly one layer (VAE,
NCSN). :func:`resolve_depth` applies it; :func:`resolve_injection` resolves ``deq.injection: null``.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from src.config.values import plain

if TYPE_CHECKING:
    from src.deq.config import DEQConfig


def _deq_config_class() -> type:
    """``src.deq.config.DEQConfig``, imported when first needed: the models stay importable (and their
    factories picklable) without ``src.deq``."""
    return importlib.import_module("src.deq.config").DEQConfig


def injections() -> tuple[str, ...]:
    """The valid ``deq.injection`` values (``src.deq.config.INJECTIONS``, their one definition)."""
    return importlib.import_module("src.deq.config").INJECTIONS


# The DEQ blocks beyond the family's own (``deq.block: null``) that a family can build: a ``deq.block`` of another
# family is refused in one line (model=dkef with deq.block=normalized_residual was a TypeError deep in the block).
FAMILY_BLOCKS: dict[str, tuple[str, ...]] = {"ncsn": ("normalized_residual",)}


def deq_setting(deq: Any, family: str | None = None) -> DEQConfig | None:
    """The ``deq`` config group → ``DEQConfig`` (``enabled: true``) or ``None`` (``enabled: false``, or no group).

    The one place that reads ``deq.enabled``; the other keys are checked by ``DEQConfig`` (one-line errors), and
    with ``family`` given (``dkef``, ``nice``, …) a ``deq.block`` that family cannot build is refused first
    (:func:`check_block`). ``deq=false`` with ``deq.one_pass=true`` is refused: the one-pass control replaces a
    DEQ's fixed point, and explicit layers have none (the other solver keys stay valid with ``deq=false``, so
    that sweeps over ``deq=true,false`` keep them)."""
    if deq is None:
        return None
    if isinstance(deq, _deq_config_class()):
        return block_config(deq, family)
    cfg = plain(deq)
    if not isinstance(cfg, Mapping):
        raise ValueError(f"deq={deq!r}: give the deq config group (deq=true or deq=false, then deq.<key>=<value>)")  # noqa: TRY004
    if not bool(cfg.get("enabled", False)):
        if cfg.get("one_pass"):
            raise ValueError("deq.one_pass=true needs deq=true: the one-pass control replaces the DEQ's fixed point "
                             "by one explicit pass, and deq=false has no DEQ; drop deq.one_pass or use deq=true")
        return None
    return block_config(cfg, family)


def block_config(deq: Any, family: str | None = None) -> DEQConfig:
    """The solver keys of a ``deq`` mapping as a ``DEQConfig`` (a ``DEQConfig`` passes through, ``None`` gives the
    defaults), for code that builds a DEQ block by construction (``DEQNet``, NCSN's DEQ-ResBlock): it does not
    ask whether the DEQ is on — :func:`deq_setting` does, before. ``family``: refuse a block it cannot build
    (before the other keys are checked, whose messages assume the block is possible)."""
    config_class = _deq_config_class()
    if isinstance(deq, config_class):
        check_block(family, deq.block)
        return deq
    cfg = dict(plain(deq) or {})
    cfg.pop("enabled", None)
    check_block(family, cfg.get("block"))
    return config_class(**cfg)


def check_block(family: str | None, block: str | None) -> None:
    """Refuse ``deq.block`` when ``family`` cannot build it (:data:`FAMILY_BLOCKS`; nothing is refused when
    ``family`` or ``block`` is None), in one line naming the keys."""
    if family is None or block is None or block in FAMILY_BLOCKS.get(family, ()):
        return
    owners = [f"model={f}" for f, blocks in FAMILY_BLOCKS.items() if block in blocks]
    raise ValueError(f"deq.block={block} is a block of {', '.join(owners) or 'no model family'} only: model={family} "
                     "has its own DEQ block, so drop deq.block (or set deq.block=null)")


@dataclass(frozen=True)
class DepthRule:
    """What ``depth`` means for one family: explicit layers when ``deq=false``, layers inside f when ``deq=true``."""

    explicit_default: int  # depth: null with deq=false
    explicit_min: int = 1  # the smallest explicit depth
    deq_default: int = 1  # depth: null with deq=true (the paper's one layer inside f)
    deq_only_default: str = ""  # non-empty: the DEQ block has exactly deq_default layers; why (the refusal)
    injection: str = "linear"  # what deq.injection: null means (src/models/deq_net.py says why linear)
    meaning: str = "explicit layers when deq=false, layers inside the DEQ map f when deq=true"


DEPTH_RULES: dict[str, DepthRule] = {
    "dkef": DepthRule(explicit_default=3),
    "nice": DepthRule(explicit_default=5),
    "supervised": DepthRule(explicit_default=3),  # the DEQ-vs-feed-forward studies (src/studies)
    "vae": DepthRule(explicit_default=0, explicit_min=0,
                     deq_only_default="the VAE score estimator's DEQ block has one layer inside f",
                     meaning="extra stride-1 layers of the VAE score estimator (0: the SSM VAE; 8, 16: Aug(8), "
                             "Aug(16)) when deq=false"),
    "ncsn": DepthRule(explicit_default=1,
                      deq_only_default="the DEQ-ResBlock's map has one residual branch (depth 1)",
                      meaning="the plain ResBlocks standing in for the DEQ-ResBlock when deq=false"),
}


def _rule(family: str) -> DepthRule:
    try:
        return DEPTH_RULES[family]
    except KeyError:
        raise ValueError(f"unknown model family {family!r}; known: {', '.join(DEPTH_RULES)}") from None


def resolve_depth(family: str, depth: int | None, deq: DEQConfig | None) -> int:
    """The ``depth`` key of ``family``, validated, with ``None`` replaced by the family's default
    (:data:`DEPTH_RULES`); ``deq`` is :func:`deq_setting`'s value (``None``: explicit layers)."""
    rule = _rule(family)
    enabled = deq is not None
    if depth is None:
        return rule.deq_default if enabled else rule.explicit_default
    minimum = 1 if enabled else rule.explicit_min
    if isinstance(depth, bool) or not isinstance(depth, (int, float)) or int(depth) != depth or depth < minimum:
        default = f"{rule.deq_default} with deq=true, {rule.explicit_default} with deq=false"
        raise ValueError(f"depth={depth!r} is invalid for {family}: give an integer >= {minimum} ({rule.meaning}), "
                         f"or leave it unset for the {family} default ({default})")
    if enabled and rule.deq_only_default and int(depth) != rule.deq_default:
        raise ValueError(f"depth={depth} with deq=true: {rule.deq_only_default}; leave depth unset "
                         f"(or {rule.deq_default})")
    return int(depth)


def resolve_injection(family: str, injection: str | None) -> str:
    """``deq.injection``: ``linear`` | ``softplus``, or ``None`` for the family's default."""
    value = _rule(family).injection if injection is None else injection
    if value not in injections():
        raise ValueError(f"deq.injection={injection!r} is unknown; valid: {', '.join(injections())} "
                         "(or null for the model family's default)")
    return value


def family_of(cfg: Mapping) -> str | None:
    """The model family of a composed run config (``model._target_ = src.lit.<family>.<Class>``), or None."""
    target = str((cfg.get("model") or {}).get("_target_", ""))
    parts = target.split(".")
    family = parts[2] if len(parts) > 3 and parts[:2] == ["src", "lit"] else None
    return family if family in DEPTH_RULES else None
