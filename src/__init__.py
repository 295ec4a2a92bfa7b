"""deqsm: score matching with deep equilibrium layers (Hydra + PyTorch Lightning)."""

from src.config.hydra_patch import install as _install_hydra_patch

_install_hydra_patch()
