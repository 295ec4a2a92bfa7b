"""Build objects from config: Hydra's ``instantiate`` with the user's own error on top."""

from __future__ import annotations

from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig


def build(conf: DictConfig, **kwargs):
    """``hydra.utils.instantiate``, but a user error inside the target (a bad value, a missing file) is
    re-raised as itself, so the message the user reads is ours rather than Hydra's wrapper."""
    try:
        return instantiate(conf, **kwargs)
    except InstantiationException as exc:
        if isinstance(exc.__cause__, (ValueError, FileNotFoundError, TypeError)):
            raise exc.__cause__ from None
        raise
