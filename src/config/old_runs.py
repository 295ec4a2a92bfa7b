"""What a run written by an older deqsm needs to load today: the one home of old-run compatibility.

``src.evaluate``, ``src.sample`` and the benchmarks load a finished run's saved ``.hydra/config.yaml``
(:mod:`src.runs.load`); what changed in the config since such a run was written is read back here, and only here:

- :func:`clear_stale_norm_of_normalized_block`: runs of ``deq.block=normalized_residual`` saved while ``deq.norm`` /
  ``deq.norm_lambda`` defaulted to frobenius / 2 store those defaults, which that block never used and now refuses;
- :func:`composed_preset`: a run config written before ``eval=auto`` composed its evaluation presets into
  ``cfg.eval`` (:mod:`src.metrics.presets` asks for the preset here when the run's config lacks it).

Config keys that moved (``model.evaluation.*`` → ``model.metrics.*``) are no longer translated: no committed run
holds them; docs/usage.md lists where each went.
"""

from __future__ import annotations

from omegaconf import DictConfig


def clear_stale_norm_of_normalized_block(cfg: DictConfig) -> None:
    """Runs of ``deq.block=normalized_residual`` saved while ``deq.norm`` / ``deq.norm_lambda`` defaulted to
    frobenius / 2 store those defaults, which that block never used and now refuses (``src.deq.config``): read
    them as unset. Any other stored value was an override the block ignored — left, so that loading says so."""
    model = cfg.get("model")
    for deq in (cfg.get("deq"), model.get("deq") if isinstance(model, DictConfig) else None):
        if (isinstance(deq, DictConfig) and deq.get("block") == "normalized_residual"
                and deq.get("norm") == "frobenius" and deq.get("norm_lambda") in (2, 2.0)):
            deq.norm = deq.norm_lambda = None


def composed_preset(name: str) -> DictConfig:
    """The evaluation preset ``name`` as Hydra composes ``eval=<name>`` from the config groups of this version (for
    a run config written before eval=auto composed its presets)."""
    from hydra import compose, initialize
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():  # inside a Hydra app: its own config search path
        return compose(config_name="train", overrides=[f"eval={name}"]).eval
    with initialize(config_path="../../conf", version_base="1.3"):
        return compose(config_name="train", overrides=[f"eval={name}"]).eval
