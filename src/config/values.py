"""Config values as plain Python: the one converter every layer uses.

:func:`plain` turns OmegaConf containers into plain dicts/lists for models and LightningModules.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def plain(cfg: Any) -> Any:
    """OmegaConf containers → plain dicts/lists (resolved), other Mappings → dict, anything else unchanged.

    Plain values pickle (DDP, checkpoints' hyper-parameters) and print cleanly.
    """
    try:
        from omegaconf import DictConfig, ListConfig, OmegaConf

        if isinstance(cfg, (DictConfig, ListConfig)):
            return OmegaConf.to_container(cfg, resolve=True)
    except ImportError:  # pragma: no cover
        pass
    if isinstance(cfg, Mapping):
        return dict(cfg)
    return cfg
