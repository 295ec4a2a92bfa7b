"""The model family of a run config, what data each family needs, and the one-line refusal when the data lack it.

The default data set (``data=gaussian``, conf/train.yaml) is DKEF's; ``python -m src.train model=dkef`` and
``model=nice`` train on it as they are. The image families read ``data.shape`` (and ``data.pixel_range``), which
only image data sets define: ``python -m src.train model=ncsn`` alone would otherwise stop deep inside
OmegaConf (``InterpolationKeyError: Interpolation key 'data.shape' not found``). :func:`check_family_data` stops
first with one line naming the data to add.
"""

from __future__ import annotations

from collections.abc import Mapping

from src.deq.config import DEPTH_RULES

# family -> (the data key it needs, what to add on the command line)
FAMILY_DATA: dict[str, tuple[str, str]] = {
    "ncsn": ("shape", "data=mnist_images (or cifar10, celeba; experiment=ncsn_mnist: the paper's setup)"),
    "vae": ("shape", "data=mnist_images data.binarize=true (or cifar10, celeba; experiment=vae_mnist: the paper's)"),
}


def family_of(cfg: Mapping) -> str | None:
    """The model family of a composed run config (``model._target_ = src.lit.<family>.<Class>``), or None."""
    target = str((cfg.get("model") or {}).get("_target_", ""))
    parts = target.split(".")
    family = parts[2] if len(parts) > 3 and parts[:2] == ["src", "lit"] else None
    return family if family in DEPTH_RULES else None


def check_family_data(cfg: Mapping) -> None:
    """Raise a one-line ``ValueError`` when ``cfg``'s model family needs a data key its data set lacks."""
    family = family_of(cfg)
    if family not in FAMILY_DATA:
        return
    key, hint = FAMILY_DATA[family]
    data = cfg.get("data") or {}
    if key not in data:
        name = str(data.get("_target_", "the default data")).rsplit(".", 1)[-1]
        raise ValueError(f"model={family} needs image data ({name} has no data.{key}): add {hint}")
