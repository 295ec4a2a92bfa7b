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
        lines = str(exc).splitlines()
        key = next((x.split(":", 1)[1].strip() for x in lines if x.startswith("full_key:")), "")
        if isinstance(exc.__cause__, TypeError) and "." in key and "missing" in str(exc.__cause__):
            # a nested class the module completes (an optimiser: its parameters) built whole
            raise ValueError(f"{key}: {exc.__cause__}; a class the module completes needs {key}._partial_=true") \
                from None
        if isinstance(exc.__cause__, (ValueError, FileNotFoundError, TypeError)):
            raise exc.__cause__ from None
        if lines and lines[0].startswith("Error locating target"):  # a _target_ path that names no class
            raise ValueError(f"{key or 'a config'}._target_: {lines[0].split(', set env var')[0]}") from None
        raise
